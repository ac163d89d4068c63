#!/usr/bin/env python3
"""What registering every request for `keel ops` costs (issue 14: at most 2% of throughput on
the 4 KiB paths): one binary, run with `track_ops = true` and with `track_ops = false`,
alternated on / off, off / on, ...

    python3 scripts/bench/ops_overhead.py [--binary target/release/keel] [--rounds 5]
        [--seconds 10] [--json out.json] [--s3-only]

Per round and setting, on a fresh data directory under /var/tmp (a real filesystem):
  - NBD 4 KiB random reads at queue depth 32 (fio's nbd engine; a 256 MiB volume written
    first), the path where the registration's share of each request is largest;
  - NBD 4 KiB random writes at queue depth 32, and sync QD1 (each 4 KiB write followed by a
    FLUSH);
  - S3 4 KiB PUT at concurrency 32 (crates/frontend-s3/examples/s3load, every PUT synced).
Prints the medians and the on/off ratio of medians per workload, with the per-round ratios
(their spread is the noise). Needs fio and the s3load example
(cargo build --release -p keel-s3 --examples)."""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from before_after import S3LOAD, Server, compare, s3_put  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VOLUME_BYTES = 256 << 20
WORKLOADS = {
    "nbd_randread_qd32_iops": ("read", ["--rw=randread", "--bs=4k", "--iodepth=32"]),
    "nbd_randwrite_qd32_iops": ("write", ["--rw=randwrite", "--bs=4k", "--iodepth=32"]),
    "nbd_sync_qd1_iops": ("write", ["--rw=write", "--bs=4k", "--iodepth=1", "--fsync=1"]),
}


def fio(server, profile, seconds, extra=()):
    host, port = server.nbd.rsplit(":", 1)
    out = subprocess.run(["fio", "--name=ops", "--ioengine=nbd", f"--uri=nbd://{host}:{port}/bench",
                          f"--size={VOLUME_BYTES}", "--output-format=json", *profile, *extra]
                         + ([f"--runtime={seconds}", "--time_based"] if seconds else []),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]


def group_commits(server):
    """(group commits, writes they carried) so far, from /metrics."""
    with urllib.request.urlopen(f"http://{server.admin}/metrics", timeout=30) as response:
        text = response.read().decode()
    count = re.search(r"^keel_store_commit_batch_writes_count (\S+)$", text, re.M)
    writes = re.search(r"^keel_store_commit_batch_writes_sum (\S+)$", text, re.M)
    return float(count.group(1)), float(writes.group(1))


def run(server, seconds, only_s3):
    values = {}
    if not only_s3:
        values = run_nbd(server, seconds)
    values["s3_put_4k_c32_ops"] = s3_put(server, seconds, 32)
    return values


def run_nbd(server, seconds):
    server.cli("volume", "create", "bench", "--size", str(VOLUME_BYTES))
    # Written whole first, so reads find data (not holes).
    fio(server, ["--rw=write", "--bs=1m", "--iodepth=8"], 0)
    values = {}
    for metric, (direction, profile) in WORKLOADS.items():
        before = group_commits(server)
        values[metric] = fio(server, profile, seconds)[direction]["iops"]
        after = group_commits(server)
        if direction == "write" and after[0] > before[0]:
            # How many writes each group commit carried: batching explains write throughput.
            values[metric.replace("_iops", "_writes_per_commit")] = \
                (after[1] - before[1]) / (after[0] - before[0])
    return values


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", default=str(ROOT / "target" / "release" / "keel"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--dir", default="/var/tmp/keel-bench-ops")
    parser.add_argument("--json")
    parser.add_argument("--s3-only", action="store_true", help="only the S3 PUT workload (more rounds in the time)")
    args = parser.parse_args()
    if not S3LOAD.exists():
        sys.exit(f"{S3LOAD} is missing: cargo build --release -p keel-s3 --examples")
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    results = {"on": {}, "off": {}}
    for round_index in range(args.rounds):
        order = ("on", "off") if round_index % 2 == 0 else ("off", "on")
        for label in order:
            config = work / f"{label}.toml"
            config.write_text(f"track_ops = {'true' if label == 'on' else 'false'}\n")
            data = work / label
            shutil.rmtree(data, ignore_errors=True)
            os.sync()
            server = Server(args.binary, data, ["--config", str(config)])
            try:
                values = run(server, args.seconds, args.s3_only)
            finally:
                server.stop()
            for metric, value in values.items():
                results[label].setdefault(metric, []).append(value)
            print(f"round {round_index + 1} tracking {label}: "
                  + ", ".join(f"{m} {v:.1f}" for m, v in values.items()), flush=True)
    report = {"rounds": args.rounds, "seconds": args.seconds, "metrics": compare(results, "on", "off")}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
