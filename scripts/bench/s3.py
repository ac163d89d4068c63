#!/usr/bin/env python3
"""S3 benchmark for Keel: 4 KiB PUT/GET ops/s and latency at concurrency 1 and 32, 64 MiB
PUT/GET MiB/s, the server's peak RSS, against two references measured on the same filesystem in
the same run: one writer doing 4 KiB write+fdatasync in a loop, and fio sequential bandwidth
(when fio is installed). Writes JSON and prints a table with the targets.

Load comes from `s3load` (crates/frontend-s3/examples/s3load.rs: presigned SigV4 requests signed
per request with the rusty-s3 client library, one keep-alive connection per worker, every request
timed in an HDR histogram): Python clients cannot generate 10k requests/s on a small machine.

usage: scripts/bench/s3.py [--data-root DIR] [--out FILE] [--server-cmd TEMPLATE]
                           [--load-bin PATH] [--seconds S] [--rounds N]

The server command is a template with {dir} and {port} (default: the release `keel server`).
Build first:
    cargo build --release -p keel -p keel-s3 --example s3load
"""

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ACCESS_KEY_ID = "GKKEELBENCH000000001"
SECRET = "keel-bench-secret-0123456789abcdefghijkl"
MIB = 1024 * 1024


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def filesystem_of(path):
    out = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    return out.stdout.strip()


def write_cache_modes():
    modes = {}
    for dev in sorted(os.listdir("/sys/block")):
        try:
            with open(f"/sys/block/{dev}/queue/write_cache") as f:
                modes[dev] = f.read().strip()
        except OSError:
            pass
    return modes


def fdatasync_reference(directory, seconds):
    """One writer appending 4 KiB and calling fdatasync after each write."""
    path = os.path.join(directory, "fsync-reference.tmp")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    block = os.urandom(4096)
    latencies = []
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            os.write(fd, block)
            os.fdatasync(fd)
            latencies.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    latencies.sort()
    return {
        "ops": len(latencies),
        "ops_per_s": len(latencies) / seconds,
        "latency_us": {
            "p50": latencies[len(latencies) // 2] * 1e6,
            "p99": latencies[int(len(latencies) * 0.99)] * 1e6,
        },
    }


def fio_reference(directory):
    if shutil.which("fio") is None:
        return None
    path = os.path.join(directory, "fio-reference.tmp")
    result = {}
    for rw in ("write", "read"):
        out = subprocess.run(
            ["fio", "--name=seq", f"--filename={path}", f"--rw={rw}", "--bs=1M", "--size=1G",
             "--direct=1", "--ioengine=libaio", "--iodepth=8", "--end_fsync=1",
             "--output-format=json"],
            capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            return {"error": out.stderr[-500:]}
        job = json.loads(out.stdout)["jobs"][0][rw]
        result[f"seq_{rw}_mib_per_s"] = job["bw_bytes"] / MIB
    os.unlink(path)
    return result


class Server:
    def __init__(self, template, data_dir):
        self.port = free_port()
        self.data_dir = data_dir
        command = shlex.split(template.format(dir=data_dir, port=self.port))
        if not os.path.isabs(command[0]):
            command[0] = os.path.join(REPO, command[0])
        env = dict(os.environ, KEEL_ACCESS_KEY_ID=ACCESS_KEY_ID, KEEL_SECRET_ACCESS_KEY=SECRET,
                   RUST_LOG="error")
        self.log = open(data_dir + ".log", "wb")
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=self.log)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.process.poll() is not None:
                sys.exit(f"server exited; see {data_dir}.log")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        sys.exit("server did not start")

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    def peak_rss_mib(self):
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return None

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def create_bucket(endpoint, bucket):
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY_ID,
                      aws_secret_access_key=SECRET, region_name="us-east-1",
                      config=Config(s3={"addressing_style": "path"}))
    s3.create_bucket(Bucket=bucket)


def load(args, server, bucket, op, size, concurrency, keys, seconds, ops_max=None, prefix="p"):
    command = [args.load_bin, "--endpoint", server.endpoint, "--access-key", ACCESS_KEY_ID,
               "--secret", SECRET, "--bucket", bucket, "--op", op, "--size", str(size),
               "--concurrency", str(concurrency), "--keys", str(keys),
               "--duration-s", str(seconds), "--prefix", prefix]
    if ops_max:
        command += ["--ops-max", str(ops_max)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120)
    if out.returncode != 0:
        sys.exit(f"s3load failed: {out.stderr}")
    result = json.loads(out.stdout)
    if result["errors"]:
        print(f"warning: {result['errors']} failed requests in {op} {size} c={concurrency}")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=os.path.join(REPO, "target", "bench-s3"))
    parser.add_argument("--out", default=os.path.join(REPO, "target", "bench-s3.json"))
    parser.add_argument("--server-cmd", default=os.environ.get(
        "KEEL_S3_SERVER_CMD",
        "target/release/keel server --data {dir} --s3 127.0.0.1:{port} --nbd 127.0.0.1:0 --admin 127.0.0.1:0 --cluster 127.0.0.1:0"))
    parser.add_argument("--load-bin", default=os.path.join(REPO, "target/release/examples/s3load"))
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not os.path.exists(args.load_bin):
        sys.exit(f"{args.load_bin} missing: cargo build --release -p keel-s3 --example s3load")
    os.makedirs(args.data_root, exist_ok=True)
    fs = filesystem_of(args.data_root)
    if fs in ("tmpfs", "ramfs"):
        sys.exit(f"{args.data_root} is on {fs}: fsync is meaningless there")
    data_dir = os.path.join(args.data_root, f"run-{uuid.uuid4().hex[:8]}")
    os.makedirs(data_dir)

    report = {"filesystem": fs, "write_cache": write_cache_modes(), "data_dir": data_dir,
              "server_cmd": args.server_cmd, "nproc": os.cpu_count(), "rounds": args.rounds}
    print(f"data on {fs}; write cache {report['write_cache']}")
    report["fio_reference"] = fio_reference(args.data_root)
    print(f"reference: fio {report['fio_reference']}")

    server = Server(args.server_cmd, data_dir)
    try:
        bucket = "bench"
        create_bucket(server.endpoint, bucket)
        runs = {}
        rounds = []
        # The disk is shared and noisy: the fdatasync reference and the small PUTs alternate in
        # rounds, and each round's ratio is computed from numbers measured side by side.
        for index in range(args.rounds):
            reference = fdatasync_reference(args.data_root, args.seconds)
            put_c1 = load(args, server, bucket, "put", 4096, 1, 100000, args.seconds, prefix=f"small{index}")
            put_c32 = load(args, server, bucket, "put", 4096, 32, 100000, args.seconds, prefix=f"many{index}")
            rounds.append({
                "fdatasync_4k_reference": reference, "put_4k_c1": put_c1, "put_4k_c32": put_c32,
                "put_c32_over_fsync": put_c32["ops_per_s"] / reference["ops_per_s"],
                "put_c1_p50_limit_us": 2 * (reference["latency_us"]["p50"] + 1000),
            })
            print(f"round {index}: fdatasync {reference['ops_per_s']:.0f}/s p50 "
                  f"{reference['latency_us']['p50']:.0f} us | PUT c=1 {put_c1['ops_per_s']:.0f}/s p50 "
                  f"{put_c1['latency_us']['p50']} us | PUT c=32 {put_c32['ops_per_s']:.0f}/s "
                  f"({rounds[-1]['put_c32_over_fsync']:.1f}x)")
        report["rounds_4k_put"] = rounds
        median = sorted(rounds, key=lambda r: r["put_c32_over_fsync"])[len(rounds) // 2]
        runs["put_4k_c1"] = median["put_4k_c1"]
        runs["put_4k_c32"] = median["put_4k_c32"]
        keys = rounds[0]["put_4k_c1"]["ops"]
        runs["get_4k_c1"] = load(args, server, bucket, "get", 4096, 1, keys, args.seconds, prefix="small0")
        runs["get_4k_c32"] = load(args, server, bucket, "get", 4096, 32, keys, args.seconds, prefix="small0")
        # Large objects: sequential bandwidth of one client.
        runs["put_64m_c1"] = load(args, server, bucket, "put", 64 * MIB, 1, 8, max(args.seconds, 10), ops_max=8, prefix="large")
        runs["get_64m_c1"] = load(args, server, bucket, "get", 64 * MIB, 1, 8, max(args.seconds, 10), ops_max=8, prefix="large")
        report["runs"] = runs
        report["server_peak_rss_mib"] = server.peak_rss_mib()
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    fio = report["fio_reference"] or {}
    targets = {
        "put_4k_c32_vs_fsync_writer, median of rounds (>= 10x)": median["put_c32_over_fsync"],
        "put_4k_c1_p50_us vs its round's 2*(fsync p50 + 1 ms)": (runs["put_4k_c1"]["latency_us"]["p50"],
                                                                    median["put_c1_p50_limit_us"]),
        "get_4k_c1_p50_us (< 1000)": runs["get_4k_c1"]["latency_us"]["p50"],
    }
    if "seq_write_mib_per_s" in fio:
        targets["put_64m_vs_disk_write (>= 0.5)"] = runs["put_64m_c1"]["mib_per_s"] / fio["seq_write_mib_per_s"]
        targets["get_64m_vs_disk_read (>= 0.8; GET is served from the page cache)"] = (
            runs["get_64m_c1"]["mib_per_s"] / fio["seq_read_mib_per_s"])
    report["targets"] = targets
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\n{'run':<12} {'ops/s':>9} {'MiB/s':>8} {'p50 us':>8} {'p99 us':>8} {'p99.9 us':>9} {'ops':>7}")
    for name, run in runs.items():
        lat = run["latency_us"]
        print(f"{name:<12} {run['ops_per_s']:>9.0f} {run['mib_per_s']:>8.1f} {lat['p50']:>8} "
              f"{lat['p99']:>8} {lat['p999']:>9} {run['ops']:>7}")
    print(f"server peak RSS: {report['server_peak_rss_mib']:.1f} MiB")
    for name, value in targets.items():
        print(f"target {name}: {value}")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
