#!/usr/bin/env python3
"""What S3 versioning costs Keel: 4 KiB PUT and GET ops/s at concurrency 1 and 32 into a bucket
with versioning enabled against one without, in alternating rounds on one server, and how fast
ListObjectVersions pages through 100,000 versions. Prints a table and writes JSON.

PUTs overwrite a small set of keys (so a versioned PUT keeps the version it replaces, the
expensive case) and every PUT is durable. Load comes from `s3load`, as in scripts/bench/s3.py.
The listing is timed with plain HTTP GETs of presigned URLs so the client's XML parsing does
not count: entries are counted in the raw answer.

usage: scripts/bench/s3_versioning.py [--data-root DIR] [--out FILE] [--seconds S]
                                      [--rounds N] [--versions N]
Build first:
    cargo build --release -p keel -p keel-s3 --example s3load
"""

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time
import urllib.request
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from s3 import (ACCESS_KEY_ID, REPO, SECRET, Server, filesystem_of, load,  # noqa: E402
                write_cache_modes)

# Keys the PUT rounds overwrite: each PUT after the first few replaces a version.
KEYS = 256
# The ratio the issue asks for: versioning costs at most 10%.
TARGET = 0.90


def client(endpoint):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY_ID,
                        aws_secret_access_key=SECRET, region_name="us-east-1",
                        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}))


def list_all_versions(s3, bucket):
    """Pages of 1000 through every version; returns (entries, seconds, pages)."""
    entries, pages = 0, 0
    params = {"Bucket": bucket, "MaxKeys": 1000}
    started = time.perf_counter()
    while True:
        url = s3.generate_presigned_url("list_object_versions", Params=params, ExpiresIn=600)
        with urllib.request.urlopen(url, timeout=120) as answer:
            body = answer.read()
        pages += 1
        entries += body.count(b"<Version>") + body.count(b"<DeleteMarker>")
        if b"<IsTruncated>true</IsTruncated>" not in body:
            break
        key = re.search(rb"<NextKeyMarker>(.*?)</NextKeyMarker>", body).group(1).decode()
        version = re.search(rb"<NextVersionIdMarker>(.*?)</NextVersionIdMarker>", body)
        params = {"Bucket": bucket, "MaxKeys": 1000, "KeyMarker": key}
        if version:
            params["VersionIdMarker"] = version.group(1).decode()
    return entries, time.perf_counter() - started, pages


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=os.path.join(REPO, "target", "bench-s3"))
    parser.add_argument("--out", default=os.path.join(REPO, "target", "bench-s3-versioning.json"))
    parser.add_argument("--server-cmd", default=os.environ.get(
        "KEEL_S3_SERVER_CMD",
        "target/release/keel server --data {dir} --s3 127.0.0.1:{port} --nbd 127.0.0.1:0 --admin 127.0.0.1:0 --cluster 127.0.0.1:0"))
    parser.add_argument("--load-bin", default=os.path.join(REPO, "target/release/examples/s3load"))
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--versions", type=int, default=100_000)
    args = parser.parse_args()
    if not os.path.exists(args.load_bin):
        sys.exit(f"{args.load_bin} missing: cargo build --release -p keel-s3 --example s3load")
    os.makedirs(args.data_root, exist_ok=True)
    fs = filesystem_of(args.data_root)
    if fs in ("tmpfs", "ramfs"):
        sys.exit(f"{args.data_root} is on {fs}: fsync is meaningless there")
    data_dir = os.path.join(args.data_root, f"versioning-{uuid.uuid4().hex[:8]}")
    os.makedirs(data_dir)
    report = {"filesystem": fs, "write_cache": write_cache_modes(), "rounds": args.rounds,
              "seconds": args.seconds, "keys": KEYS}
    server = Server(args.server_cmd, data_dir)
    try:
        s3 = client(server.endpoint)
        s3.create_bucket(Bucket="plain")
        s3.create_bucket(Bucket="versioned")
        s3.put_bucket_versioning(Bucket="versioned",
                                 VersioningConfiguration={"Status": "Enabled"})
        measures = [("put", 1), ("put", 32), ("get", 1), ("get", 32)]
        samples = {f"{op}_c{c}": {"plain": [], "versioned": []} for op, c in measures}
        for index in range(args.rounds):
            line = []
            for op, concurrency in measures:
                name = f"{op}_c{concurrency}"
                # Alternate which bucket goes first, so drift in the disk favours neither.
                order = ["plain", "versioned"] if index % 2 == 0 else ["versioned", "plain"]
                for bucket in order:
                    run = load(args, server, bucket, op, 4096, concurrency, KEYS, args.seconds,
                               prefix="k")
                    samples[name][bucket].append(run["ops_per_s"])
                ratio = samples[name]["versioned"][-1] / samples[name]["plain"][-1]
                line.append(f"{name} {ratio:.2f}")
            print(f"round {index}: versioned/plain " + ", ".join(line), flush=True)
        table = {}
        for name, by_bucket in samples.items():
            ratios = [v / p for v, p in zip(by_bucket["versioned"], by_bucket["plain"])]
            table[name] = {
                "plain_ops_per_s": statistics.median(by_bucket["plain"]),
                "versioned_ops_per_s": statistics.median(by_bucket["versioned"]),
                "ratio_median": statistics.median(ratios),
                "ratios": ratios,
            }
        report["put_get_4k"] = table

        # 100,000 versions of 1000 keys (100 each) in a fresh bucket, then one full listing.
        s3.create_bucket(Bucket="many")
        s3.put_bucket_versioning(Bucket="many", VersioningConfiguration={"Status": "Enabled"})
        fill = load(args, server, "many", "put", 64, 32, 1000, 600, ops_max=args.versions,
                    prefix="v")
        entries, seconds, pages = list_all_versions(s3, "many")
        report["list_versions"] = {"versions_written": fill["ops"], "entries_listed": entries,
                                   "pages": pages, "seconds": seconds,
                                   "entries_per_s": entries / seconds}
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\ndata on {fs}; medians of {args.rounds} alternating rounds of {args.seconds} s, "
          f"4 KiB objects over {KEYS} keys")
    print(f"{'measure':<12} {'plain/s':>10} {'versioned/s':>12} {'ratio':>6}  target")
    for name, row in table.items():
        print(f"{name:<12} {row['plain_ops_per_s']:>10.0f} {row['versioned_ops_per_s']:>12.0f} "
              f"{row['ratio_median']:>6.2f}  >= {TARGET}")
    listing = report["list_versions"]
    print(f"ListObjectVersions: {listing['entries_listed']} entries in {listing['seconds']:.2f} s "
          f"= {listing['entries_per_s']:.0f}/s (target >= 10000/s)")
    print(f"JSON: {args.out}")
    if listing["entries_listed"] != listing["versions_written"]:
        sys.exit(f"listed {listing['entries_listed']} of {listing['versions_written']} versions")


if __name__ == "__main__":
    main()
