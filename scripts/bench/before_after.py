#!/usr/bin/env python3
"""Two `keel` binaries on the same data paths, alternated A B A B: did a change slow the
one-node data path down?

    python3 scripts/bench/before_after.py --before /path/to/old/keel --after target/release/keel \
        [--rounds 5] [--seconds 10] [--json out.json]

Per round and binary, on a fresh data directory under /var/tmp (a real filesystem):
  - NBD sync QD1: fio's nbd engine, 4 KiB sequential writes each followed by a FLUSH;
  - S3 4 KiB PUT at concurrency 1 and 32 (crates/frontend-s3/examples/s3load, every PUT synced).
Rounds alternate the order (A B, B A, ...) and start each run after a global sync, so neither
binary always inherits the other's writeback. Prints medians of each and the after/before
ratios; "unchanged within noise" means the ratio's spread across rounds covers 1.0. Needs fio and a built s3load example
(cargo build --release -p keel-s3 --examples)."""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
S3LOAD = ROOT / "target" / "release" / "examples" / "s3load"
ACCESS_KEY_ID = "GKKEELBENCH000000001"
SECRET = "keel-bench-secret-0123456789abcdefghij"


class Server:
    def __init__(self, binary, data, extra_args=()):
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True)
        env = dict(os.environ, KEEL_ACCESS_KEY_ID=ACCESS_KEY_ID, KEEL_SECRET_ACCESS_KEY=SECRET, KEEL_LOG="error")
        args = [binary, "server", "--data", str(data), "--s3", "127.0.0.1:0", "--nbd", "127.0.0.1:0",
                "--admin", "127.0.0.1:0"]
        help_text = subprocess.run([binary, "server", "--help"], capture_output=True, text=True).stdout
        if "--cluster" in help_text:
            args += ["--cluster", "127.0.0.1:0"]
        args += list(extra_args)
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.data = data
        deadline = time.time() + 60
        while time.time() < deadline:
            line = self.process.stdout.readline()
            if not line:
                sys.exit(f"{binary} exited early")
            if m := re.match(r"\s+s3\s+http://(\S+)", line):
                self.s3 = m.group(1)
            if m := re.match(r"\s+nbd\s+nbd://(\S+)/VOLUME", line):
                self.nbd = m.group(1)
            if m := re.match(r"\s+admin\s+http://(\S+)", line):
                self.admin = m.group(1)
            if line.strip() == "ready":
                break
        self.binary = binary

    def cli(self, *args):
        subprocess.run([self.binary, *args, "--admin", self.admin, "--token-dir", str(self.data)],
                       check=True, capture_output=True)

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)


def nbd_sync_qd1(server, seconds):
    server.cli("volume", "create", "bench", "--size", "1G")
    host, port = server.nbd.rsplit(":", 1)
    out = subprocess.run(["fio", "--name=sync-qd1", "--ioengine=nbd", f"--uri=nbd://{host}:{port}/bench",
                          "--rw=write", "--bs=4k", "--iodepth=1", "--fsync=1", "--size=512M",
                          f"--runtime={seconds}", "--time_based", "--output-format=json"],
                         capture_output=True, text=True, check=True)
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]["write"]
    return job["iops"]


def s3_put(server, seconds, concurrency):
    import boto3
    from botocore.config import Config
    s3 = boto3.client("s3", endpoint_url=f"http://{server.s3}", aws_access_key_id=ACCESS_KEY_ID,
                      aws_secret_access_key=SECRET, region_name="us-east-1",
                      config=Config(s3={"addressing_style": "path"}))
    bucket = f"bench{concurrency}"
    s3.create_bucket(Bucket=bucket)
    out = subprocess.run([str(S3LOAD), "--endpoint", f"http://{server.s3}", "--access-key", ACCESS_KEY_ID,
                          "--secret", SECRET, "--bucket", bucket, "--op", "put", "--size", "4096",
                          "--concurrency", str(concurrency), "--keys", "10000", "--duration-s", str(seconds),
                          "--prefix", "p"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    return result["ops_per_s"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--dir", default="/var/tmp/keel-bench-before-after")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not S3LOAD.exists():
        sys.exit(f"{S3LOAD} is missing: cargo build --release -p keel-s3 --examples")
    metrics = ("nbd_sync_qd1_iops", "s3_put_4k_c1_ops", "s3_put_4k_c32_ops")
    results = {"before": {m: [] for m in metrics}, "after": {m: [] for m in metrics}}
    for round_index in range(args.rounds):
        # A B, then B A: whichever runs second inherits the first's writeback, so the order
        # alternates; and every run starts after a global sync.
        order = ("before", "after") if round_index % 2 == 0 else ("after", "before")
        for label in order:
            shutil.rmtree(Path(args.dir) / label, ignore_errors=True)
            os.sync()
            binary = getattr(args, label)
            server = Server(binary, Path(args.dir) / label)
            try:
                values = (nbd_sync_qd1(server, args.seconds), s3_put(server, args.seconds, 1),
                          s3_put(server, args.seconds, 32))
            finally:
                server.stop()
            for metric, value in zip(metrics, values):
                results[label][metric].append(value)
            print(f"round {round_index + 1} {label}: " + ", ".join(f"{m} {v:.0f}" for m, v in zip(metrics, values)),
                  flush=True)
    report = {"rounds": args.rounds, "seconds": args.seconds,
              "metrics": compare(results, "after", "before")}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    shutil.rmtree(args.dir, ignore_errors=True)


def compare(results, b, a):
    """Per metric of `results[label][metric] = [value per round]`: the medians of `b` and `a`,
    the ratio of the medians (b/a) and the per-round ratios (their spread is the noise)."""
    report = {}
    for metric in results[a]:
        median_a = statistics.median(results[a][metric])
        median_b = statistics.median(results[b][metric])
        ratios = [y / x for x, y in zip(results[a][metric], results[b][metric])]
        report[metric] = {f"{b}_median": round(median_b, 1), f"{a}_median": round(median_a, 1),
                          "ratio_of_medians": round(median_b / median_a, 3),
                          "per_round_ratios": [round(r, 3) for r in ratios]}
    return report


if __name__ == "__main__":
    main()
