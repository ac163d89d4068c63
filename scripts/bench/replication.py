#!/usr/bin/env python3
"""Replicated volume benchmarks (issue 11): R=1 vs R=2 vs R=3 through NBD with fio's nbd
engine, on one loopback cluster (three storage nodes; volumes attached on node 1).

    python3 scripts/bench/replication.py [--rounds 5] [--seconds 10] [--json out.json]
        [--pgbench [--pgbench-seconds 30] [--pgbench-scale 20]] [--catch-up-gib 4] [--forwarded]

Workloads (the profiles of scripts/bench/volume.py): sync QD1 (4 KiB sequential writes, each
followed by a FLUSH) and randrw QD64 (4 KiB random, 75% reads); with --pgbench, also Postgres
TPC-B (8 clients, synchronous_commit=on) on ext4 on each volume through nbdfuse + loop, the
same setup as scripts/bench/volume.py --pgbench (needs root). --catch-up-gib N times a fresh
N GiB volume's first attach per R: from the attach until every replica is in sync. --forwarded
also runs the fio workloads on the R=2 volume (replicas on nodes 1 and 2) attached through node
3, which holds no replica and forwards every request to node 1. Every round runs every R in
turn, in an order that rotates between rounds; medians are quoted with the ratio to R=1.

All nodes share this machine's one disk (and its two cores): every replica's fdatasync lands on
the same device, so R=2 costs more here than on separate machines. Data under /var/tmp."""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "cluster"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from keelcluster import Cluster, wait_until  # noqa: E402
from volume import run_pgbench  # noqa: E402

WORK = Path(os.environ.get("KEEL_BENCH_DIR", "/var/tmp/keel-bench-replication"))
SIZE = 256 << 20
# Postgres needs room for its tables (scale 20 ≈ 300 MiB) and WAL; every copy of every R lives
# on this one disk, and each round formats the volumes again (garbage until compaction).
PGBENCH_SIZE = 2 << 30

# The same profiles as scripts/bench/volume.py (the single-node reference).
WORKLOADS = {
    "sync-qd1": ["--rw=write", "--bs=4k", "--iodepth=1", "--fsync=1"],
    "randrw-qd64": ["--rw=randrw", "--rwmixread=75", "--bs=4k", "--iodepth=64", "--randrepeat=1"],
}


def fio(node, volume, workload, seconds):
    args = ["fio", "--name=bench", "--ioengine=nbd", f"--uri=nbd://{node.host}:{node.nbd_port}/{volume}",
            f"--size={SIZE}", "--time_based", f"--runtime={seconds}", "--output-format=json"] + WORKLOADS[workload]
    result = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 120)
    if result.returncode != 0:
        raise RuntimeError(f"fio failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")
    job = json.loads(result.stdout[result.stdout.index("{"):])["jobs"][0]
    write = job["write"]
    sync = job.get("sync", {}).get("lat_ns", {}).get("percentile", {})
    return {
        "iops": job["read"]["iops"] + write["iops"],
        # A write and its FLUSH at QD1: what a database's commit waits for.
        "flush_p50_us": sync.get("50.000000", 0) / 1000,
        "write_p50_us": write["clat_ns"]["percentile"].get("50.000000", 0) / 1000,
        "write_p99_us": write["clat_ns"]["percentile"].get("99.000000", 0) / 1000,
    }


def catch_up(node, name, size, replicas):
    """Creates a fresh volume, attaches it (one read) and waits until every replica is in sync."""
    code, answer = node.api("POST", "/api/v1/volumes", {"name": name, "size_bytes": size, "replicas": replicas})
    assert code == 200, answer
    started = time.time()
    subprocess.run(["nbdinfo", f"nbd://{node.host}:{node.nbd_port}/{name}"], capture_output=True, check=True)

    def in_sync():
        code, info = node.api("GET", f"/api/v1/volumes/{name}")
        return code == 200 and len(info["replication"]["in_sync"]) == replicas

    wait_until(f"{name} in sync", in_sync, timeout=300, interval=0.02)
    return time.time() - started


def label(replicas):
    return "2 forwarded" if replicas == "2f" else str(replicas)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--pgbench", action="store_true")
    parser.add_argument("--pgbench-seconds", type=int, default=30)
    parser.add_argument("--pgbench-scale", type=int, default=20)
    parser.add_argument("--skip-fio", action="store_true", help="no fio workloads")
    parser.add_argument("--catch-up-gib", type=int, default=0)
    parser.add_argument("--forwarded", action="store_true",
                        help="also the R=2 volume through node 3, which holds no replica")
    args = parser.parse_args()
    workloads = [] if args.skip_fio else list(WORKLOADS)

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    cluster = Cluster(WORK)
    results = {r: {w: [] for w in [*WORKLOADS, "pgbench"]} for r in (1, 2, 3, "2f")}
    try:
        first = cluster.add()
        cluster.add()
        third = cluster.add()
        wait_until("three voters", lambda: cluster.voters() == {1, 2, 3}, timeout=60)
        for replicas in (1, 2, 3):
            code, answer = first.api("POST", "/api/v1/volumes",
                                     {"name": f"r{replicas}", "size_bytes": SIZE, "replicas": replicas})
            assert code == 200, answer
            # Fill the volume so reads hit data and every R starts from the same state.
            subprocess.run(["fio", "--name=fill", "--ioengine=nbd", f"--uri=nbd://{first.host}:{first.nbd_port}/r{replicas}",
                            f"--size={SIZE}", "--rw=write", "--bs=1m", "--iodepth=8", "--end_fsync=1"],
                           capture_output=True, check=True, timeout=900)
            if args.pgbench:
                code, answer = first.api("POST", "/api/v1/volumes",
                                         {"name": f"pg{replicas}", "size_bytes": PGBENCH_SIZE, "replicas": replicas})
                assert code == 200, answer
        if args.catch_up_gib:
            for round_index in range(args.rounds):
                for replicas in (2, 3):
                    took = catch_up(first, f"fresh{round_index}r{replicas}", args.catch_up_gib << 30, replicas)
                    results[replicas].setdefault("catch-up", []).append(took)
                    print(f"round {round_index + 1} fresh {args.catch_up_gib} GiB R={replicas}: every replica "
                          f"in sync {took:.2f} s after the first attach", flush=True)
        order = [1, 2, 3]
        for round_index in range(args.rounds):
            if args.pgbench:
                for replicas in order:
                    uri = f"nbd://{first.host}:{first.nbd_port}/pg{replicas}"
                    measured = run_pgbench(uri, WORK / f"pg-r{replicas}", args.pgbench_seconds, args.pgbench_scale)
                    measured["iops"] = measured["tps"]
                    results[replicas]["pgbench"].append(measured)
                    print(f"round {round_index + 1} pgbench R={replicas}: {measured['tps']:.0f} TPS "
                          f"latency {measured['latency_ms']:.2f} ms", flush=True)
            for workload in workloads:
                runs = [(replicas, first, f"r{replicas}") for replicas in order]
                if args.forwarded:
                    runs.insert(round_index % (len(runs) + 1), ("2f", third, "r2"))
                for replicas, node, volume in runs:
                    measured = fio(node, volume, workload, args.seconds)
                    results[replicas][workload].append(measured)
                    print(f"round {round_index + 1} {workload} R={label(replicas)}: {measured['iops']:.0f} IOPS "
                          f"write p50 {measured['write_p50_us']:.0f} µs p99 {measured['write_p99_us']:.0f} µs",
                          flush=True)
            order = order[1:] + order[:1]
    finally:
        cluster.stop()

    summary = {}
    print("\nmedians (all nodes share one disk):")
    for replicas in (2, 3):
        runs = results[replicas].get("catch-up", [])
        if runs:
            summary[f"catch-up R={replicas}"] = {"seconds": statistics.median(runs), "runs": runs}
            print(f"  {'catch-up':12} R={replicas}: {statistics.median(runs):8.2f} s to in sync "
                  f"(fresh {args.catch_up_gib} GiB)")
    if args.pgbench:
        base = statistics.median(m["tps"] for m in results[1]["pgbench"])
        for replicas in (1, 2, 3):
            runs = results[replicas]["pgbench"]
            tps = statistics.median(m["tps"] for m in runs)
            latency = statistics.median(m["latency_ms"] for m in runs)
            summary[f"pgbench R={replicas}"] = {"tps": tps, "ratio_to_r1": tps / base, "latency_ms": latency, "runs": runs}
            print(f"  {'pgbench':12} R={replicas}: {tps:8.0f} TPS   ({tps / base:.2f}× R=1)  latency {latency:.2f} ms")
    for workload in workloads:
        base = statistics.median(m["iops"] for m in results[1][workload])
        for replicas in (1, 2, 3, "2f") if args.forwarded else (1, 2, 3):
            runs = results[replicas][workload]
            iops = statistics.median(m["iops"] for m in runs)
            p50 = statistics.median(m["write_p50_us"] for m in runs)
            flush = statistics.median(m.get("flush_p50_us", 0) for m in runs)
            summary[f"{workload} R={label(replicas)}"] = {"iops": iops, "ratio_to_r1": iops / base,
                                                           "write_p50_us": p50, "flush_p50_us": flush, "runs": runs}
            print(f"  {workload:12} R={label(replicas)}: {iops:8.0f} IOPS  ({iops / base:.2f}× R=1)  write p50 {p50:.0f} µs"
                  f"  flush p50 {flush:.0f} µs")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
