#!/usr/bin/env python3
"""Keel volumes vs `nbdkit file` on the same disk, in one run, alternating A and B.

Profiles (from ../shared/BENCHMARKS.md, through fio's nbd engine):
  sync-qd1     4 KiB sequential writes, QD1, each followed by an NBD FLUSH (--fsync=1)
  randrw-qd64  4 KiB random 75% read / 25% write, QD64
  seqread-1m   1 MiB sequential reads, QD4 (MiB/s = IOPS)
and, with --pgbench, Postgres TPC-B (pgbench) on ext4 on each export (nbdfuse + loop).
Both exports are written whole first (1 MiB writes), and nbdkit's file is preallocated: reads
read data on both, never holes.

Prints a table of medians and ratios (Keel / nbdkit) and writes JSON (--json FILE).
Needs: fio, nbdkit, libnbd-bin (nbdfuse), e2fsprogs, postgresql; root for loop and mount.

  python3 scripts/bench/volume.py --dir /var/tmp/keel-bench --rounds 3 --seconds 20 --pgbench
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEEL = os.environ.get("KEEL_BIN", str(ROOT / "target" / "release" / "keel"))

PROFILES = {
    "sync-qd1": ["--rw=write", "--bs=4k", "--iodepth=1", "--fsync=1", "--size=512M"],
    "randrw-qd64": ["--rw=randrw", "--rwmixread=75", "--bs=4k", "--iodepth=64", "--size=1G", "--randrepeat=1"],
    "seqread-1m": ["--rw=read", "--bs=1M", "--iodepth=4", "--size=4G"],
}


def fs_type(path):
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True).stdout.strip()


def write_cache(path):
    dev = os.stat(path).st_dev
    sys_dir = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    if (sys_dir / "partition").exists():
        sys_dir = sys_dir.parent
    try:
        return (sys_dir / "queue" / "write_cache").read_text().strip()
    except OSError:
        return "unknown"


class Targets:
    """A Keel server and an nbdkit file server on the same filesystem, started and stopped by PID."""

    def __init__(self, base, size):
        self.base = base
        self.procs = []
        keel_dir = base / "keel"
        self.keel = subprocess.Popen([KEEL, "server", "--data", str(keel_dir), "--s3", "127.0.0.1:0",
                                      "--nbd", "127.0.0.1:10890", "--admin", "127.0.0.1:10891",
                                      "--cluster", "127.0.0.1:0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.procs.append(self.keel)
        for line in self.keel.stdout:
            if line.strip() == "ready":
                break
        subprocess.run([KEEL, "volume", "create", "bench", "--size", size, "--admin", "127.0.0.1:10891",
                        "--token-dir", str(keel_dir)], check=True, capture_output=True)
        image = base / "nbdkit.img"
        with open(image, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, parse_size(size))
        self.nbdkit = subprocess.Popen(["nbdkit", "-f", "-p", "10892", "-i", "127.0.0.1", "file", f"file={image}"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(self.nbdkit)
        time.sleep(1)
        self.uris = {"keel": "nbd://127.0.0.1:10890/bench", "nbdkit": "nbd://127.0.0.1:10892"}
        for uri in self.uris.values():
            subprocess.run(["fio", "--name=fill", "--ioengine=nbd", f"--uri={uri}", "--rw=write", "--bs=1M",
                            "--iodepth=8", f"--size={size}"], check=True, capture_output=True, timeout=900)

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()


def parse_size(text):
    units = {"K": 10, "M": 20, "G": 30}
    return int(text[:-1]) << units[text[-1]] if text[-1] in units else int(text)


def run_fio(uri, profile, seconds, out):
    args = ["fio", "--name=bench", "--ioengine=nbd", f"--uri={uri}", *PROFILES[profile],
            f"--runtime={seconds}", "--time_based", "--output-format=json", f"--output={out}"]
    subprocess.run(args, check=True, capture_output=True, timeout=seconds + 300)
    job = json.loads(Path(out).read_text())["jobs"][0]
    iops = job["read"]["iops"] + job["write"]["iops"]
    latency = job["write"]["clat_ns"]["percentile"] if job["write"]["iops"] else job["read"]["clat_ns"]["percentile"]
    return {"iops": iops, "p50_us": latency.get("50.000000", 0) / 1000, "p99_us": latency.get("99.000000", 0) / 1000}


def run_pgbench(uri, work, seconds, scale):
    """ext4 on the export through nbdfuse + loop; Postgres initdb, pgbench -i, pgbench -T."""
    bindir = sorted(Path("/usr/lib/postgresql").glob("*/bin"))[-1]
    fuse, mnt = work / "fuse", work / "mnt"
    shutil.rmtree(work, ignore_errors=True)
    fuse.mkdir(parents=True)
    mnt.mkdir()
    nbdfuse = subprocess.Popen(["nbdfuse", str(fuse), uri])
    loop = None
    pg = None
    try:
        for _ in range(100):
            if (fuse / "nbd").exists():
                break
            time.sleep(0.1)
        loop = subprocess.run(["losetup", "-f", "--show", str(fuse / "nbd")], capture_output=True, text=True, check=True).stdout.strip()
        subprocess.run(["mkfs.ext4", "-q", "-F", loop], check=True)
        subprocess.run(["mount", loop, str(mnt)], check=True)
        pg = mnt / "pg"
        pg.mkdir()
        shutil.chown(pg, "postgres", "postgres")
        as_pg = ["runuser", "-u", "postgres", "--"]
        subprocess.run(as_pg + [str(bindir / "initdb"), "-D", str(pg / "data"), "-A", "trust", "--no-instructions"], check=True, capture_output=True)
        subprocess.run(as_pg + [str(bindir / "pg_ctl"), "-D", str(pg / "data"), "-w", "-l", str(pg / "log"), "-o",
                                f"-p 54399 -k {pg} -c listen_addresses='' -c synchronous_commit=on -c shared_buffers=256MB", "start"],
                       check=True, capture_output=True)
        conn = ["-h", str(pg), "-p", "54399"]
        subprocess.run(as_pg + ["pgbench", *conn, "-i", "-s", str(scale), "-q", "postgres"], check=True, capture_output=True)
        out = subprocess.run(as_pg + ["pgbench", *conn, "-c", "8", "-j", "2", "-T", str(seconds), "postgres"],
                             check=True, capture_output=True, text=True).stdout
        tps = float(next(l for l in out.splitlines() if l.startswith("tps")).split()[2])
        latency = float(next(l for l in out.splitlines() if l.startswith("latency average")).split()[3])
        return {"tps": tps, "latency_ms": latency}
    finally:
        if pg is not None:
            subprocess.run(["runuser", "-u", "postgres", "--", str(bindir / "pg_ctl"), "-D", str(pg / "data"), "-m", "fast", "stop"], capture_output=True)
        subprocess.run(["umount", str(mnt)], capture_output=True)
        if loop:
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        subprocess.run(["fusermount3", "-u", str(fuse)], capture_output=True)
        nbdfuse.wait(timeout=30)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp/keel-bench-volume")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--pgbench", action="store_true")
    parser.add_argument("--pgbench-scale", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    base = Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    fs = fs_type(base)
    if fs in ("tmpfs", "ramfs"):
        sys.exit(f"{base} is on {fs}: fsync is a no-op there; pick a directory on a real disk")
    targets = Targets(base, "4G")
    results = {"dir": str(base), "filesystem": fs, "write_cache": write_cache(base), "rounds": []}
    try:
        for round_number in range(args.rounds):
            order = ["keel", "nbdkit"] if round_number % 2 == 0 else ["nbdkit", "keel"]
            row = {}
            for profile in PROFILES:
                for name in order:
                    row[f"{name}/{profile}"] = run_fio(targets.uris[name], profile, args.seconds, base / "fio.json")
                    print(f"round {round_number + 1} {name:<7} {profile:<12} {row[f'{name}/{profile}']['iops']:>9.0f} IOPS", file=sys.stderr)
            if args.pgbench:
                for name in order:
                    row[f"{name}/pgbench"] = run_pgbench(targets.uris[name], base / f"pg-{name}", args.seconds, args.pgbench_scale)
                    print(f"round {round_number + 1} {name:<7} pgbench      {row[f'{name}/pgbench']['tps']:>9.0f} TPS", file=sys.stderr)
            results["rounds"].append(row)
    finally:
        targets.stop()

    def median(key, field):
        return statistics.median(r[key][field] for r in results["rounds"])

    summary = {}
    print(f"\nKeel volume vs nbdkit file on {fs} ({base}, write cache: {results['write_cache']}), "
          f"{args.rounds} alternating rounds of {args.seconds} s; medians")
    print(f"{'profile':<14} {'keel':>10} {'nbdkit':>10} {'ratio':>7}  per-round ratios")
    benches = [(p, "iops") for p in PROFILES] + ([("pgbench", "tps")] if args.pgbench else [])
    for profile, field in benches:
        keel, nbdkit = median(f"keel/{profile}", field), median(f"nbdkit/{profile}", field)
        per_round = [r[f"keel/{profile}"][field] / r[f"nbdkit/{profile}"][field] for r in results["rounds"]]
        summary[profile] = {"keel": keel, "nbdkit": nbdkit, "ratio": keel / nbdkit, "ratios": per_round, "unit": field}
        print(f"{profile:<14} {keel:>10.0f} {nbdkit:>10.0f} {keel / nbdkit:>7.2f}  {', '.join(f'{x:.2f}' for x in per_round)}")
    results["summary"] = summary
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
