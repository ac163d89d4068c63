#!/usr/bin/env python3
"""Replicated volume benchmarks (issue 11): R=1 vs R=2 vs R=3 through NBD with fio's nbd
engine, on one loopback cluster (three storage nodes; volumes attached on node 1).

    python3 scripts/bench/replication.py [--rounds 5] [--seconds 10] [--json out.json]
        [--workloads sync-qd1,randrw-qd64] [--pgbench [--pgbench-seconds 30]
        [--pgbench-scale 20]] [--catch-up-gib 4] [--forwarded]
        [--rebuild-gib 1 [--resync-busy-percent 25]] [--resync-gib 1 [--absent-mib 16]]
        [--snapshot-repair-gib 1]

Workloads (the profiles of scripts/bench/volume.py): sync QD1 (4 KiB sequential writes, each
followed by a FLUSH) and randrw QD64 (4 KiB random, 75% reads); with --pgbench, also Postgres
TPC-B (8 clients, synchronous_commit=on) on ext4 on each volume through nbdfuse + loop, the
same setup as scripts/bench/volume.py --pgbench (needs root). --catch-up-gib N times a fresh
N GiB volume's first attach per R: from the attach until every replica is in sync. --forwarded
also runs the fio workloads on the R=2 volume (replicas on nodes 1 and 2) attached through node
3, which holds no replica and forwards every request to node 1. --rebuild-gib N measures a
full rebuild: an N GiB volume written whole at R=1, then raised to R=2, so every byte is copied
to a new node; per round, in turn: the disk's sequential write bandwidth (fio, 1 MiB direct writes to
a file, 8 in flight: the reference; and, for context, 1 MiB buffered writes and one fsync at the end), the rebuild alone (its throughput as a share of that, and the
CPU seconds each node's process used per GiB copied: steadier than throughput here), and the
rebuild again under a client (randrw QD1 on the rebuilding volume, attached a second before the
rebuild starts and measured inside it)
whose p99 is compared with the same client once the volume is in sync; --resync-busy-percent
sets the nodes' `cluster.resync_busy_percent` (how much of the time a resync works while
clients are active; the server's default unless given). --resync-gib N measures a replica's
catch-up after an absence: an N GiB R=2 volume written whole; per round node 2 is killed -9,
--absent-mib M of 4 KiB random writes land meanwhile, node 2 returns, and the time until it
is back in sync and the bytes the catch-up compared and shipped are recorded; each round does
it twice, in alternating order: as is (the primary knows what node 2 lacks) and with the
primary's node killed -9 and started again while node 2 is away (its record in memory is
gone: the two nodes' common points say what to compare; before them, it compared every
written stretch). --snapshot-repair-gib N measures a snapshot's repair: an N GiB R=1 volume
written whole and snapshotted, raised to R=2; once the new replica is in sync (the current
contents copied), the time until the snapshot is complete on it too (its N GiB copied again,
the replica having none of it), as a share of the disk's sequential write bandwidth. Every
round runs every R
in turn, in an order that rotates between rounds; medians are quoted with the ratio to R=1.

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


# The client of a rebuilding volume: small random reads and writes, one at a time.
PROBE = ["--rw=randrw", "--rwmixread=75", "--bs=4k", "--iodepth=1", "--randrepeat=1"]


def disk_seq_write(gib, direct=True):
    """The reference: what this disk writes sequentially. Direct (the issue's reference): 1 MiB
    direct writes, 8 in flight, the device and not the page cache. Buffered: 1 MiB writes
    through the page cache and one fsync at the end, as a bulk writer that syncs rarely (a
    rebuilding replica) meets the disk; on this machine it is the lower of the two."""
    path = WORK / "seq.dat"
    engine = ["--ioengine=libaio", "--direct=1", "--iodepth=8"] if direct else ["--ioengine=psync"]
    result = subprocess.run(["fio", "--name=seq", f"--filename={path}", "--rw=write", "--bs=1m",
                             f"--size={gib}g", *engine, "--end_fsync=1", "--output-format=json"],
                            capture_output=True, text=True, check=True, timeout=900)
    path.unlink()
    return json.loads(result.stdout[result.stdout.index("{"):])["jobs"][0]["write"]["bw_bytes"]


# The client's first second is not measured (fio's ramp time): during a rebuild, it attaches and
# settles before the rebuild starts, as a client running when a replica is lost would have.
# Started at the same moment as the rebuild, its attach met the change of R: in about one
# round of four its p99 came out 4-9× for the whole round (2026-11-27; docs/benchmarks.md).
PROBE_RAMP_SECONDS = 1


def probe(node, volume, seconds):
    """Starts the client workload on a volume; returns the fio process (JSON on stdout). It
    measures `seconds` after PROBE_RAMP_SECONDS unmeasured."""
    return subprocess.Popen(["fio", "--name=probe", "--ioengine=nbd", f"--uri=nbd://{node.host}:{node.nbd_port}/{volume}",
                             "--time_based", f"--ramp_time={PROBE_RAMP_SECONDS}", f"--runtime={seconds}",
                             "--output-format=json"] + PROBE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def probe_result(process):
    out, err = process.communicate(timeout=900)
    if process.returncode != 0:
        raise RuntimeError(f"fio failed: {out[-2000:]}{err[-2000:]}")
    job = json.loads(out[out.index("{"):])["jobs"][0]
    p99 = {op: job[op]["clat_ns"]["percentile"].get("99.000000", 0) / 1000 for op in ("read", "write")}
    return {"iops": job["read"]["iops"] + job["write"]["iops"], "read_p99_us": p99["read"], "write_p99_us": p99["write"]}


def cpu_seconds(node):
    """User + system CPU seconds the node's process has used so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{node.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rebuild(node, name, gib, probe_seconds=0, nodes=()):
    """Writes a fresh R=1 volume whole, raises it to R=2 and waits until the new replica is in
    sync; returns (seconds, the client's results during the rebuild or None, CPU seconds each
    of `nodes` used per GiB copied). CPU per GiB is far steadier here than throughput, which
    moves with whatever else shares the two cores."""
    code, answer = node.api("POST", "/api/v1/volumes", {"name": name, "size_bytes": gib << 30, "replicas": 1})
    assert code == 200, answer
    subprocess.run(["fio", "--name=fill", "--ioengine=nbd", f"--uri=nbd://{node.host}:{node.nbd_port}/{name}",
                    f"--size={gib}g", "--rw=write", "--bs=1m", "--iodepth=8", "--end_fsync=1"],
                   capture_output=True, check=True, timeout=900)
    client = probe(node, name, probe_seconds) if probe_seconds else None
    if client:
        time.sleep(PROBE_RAMP_SECONDS)
    cpu_before = [cpu_seconds(each) for each in nodes]
    started = time.time()
    code, answer = node.api("POST", f"/api/v1/volumes/{name}/replication", {"replicas": 2})
    assert code == 200, answer

    # `keel status` names every volume with a replica out of sync (`volume info` would do,
    # but it sums the volume's blocks: polled often, it slows the rebuild it measures).
    def in_sync():
        code, status = node.api("GET", "/api/v1/status")
        return code == 200 and not any(f'volume "{name}"' in reason for reason in status["reasons"])

    wait_until(f"{name} in sync", in_sync, timeout=900, interval=0.05)
    took = time.time() - started
    cpu = [(cpu_seconds(each) - before) / gib for each, before in zip(nodes, cpu_before)]
    measured = probe_result(client) if client else None
    if measured:
        # The client must have run inside the rebuild, or its numbers say nothing about it.
        measured["inside_rebuild"] = took >= probe_seconds
    return took, measured, cpu


def settle(nodes, timeout=300):
    """Waits until every node is idle (under a tenth of a core over a second): a deleted
    volume's blocks are erased in the background, and that work, taking both cores here, would
    land in whatever is measured next. Returns the seconds waited."""
    started = time.time()
    while time.time() - started < timeout:
        before = [cpu_seconds(each) for each in nodes]
        time.sleep(1)
        if all(cpu_seconds(each) - was < 0.1 for each, was in zip(nodes, before)):
            break
    return time.time() - started


def delete_volume(node, name):
    code, answer = node.api("DELETE", f"/api/v1/volumes/{name}")
    assert code in (200, 202), answer
    wait_until(f"{name} deleted", lambda: node.api("GET", f"/api/v1/volumes/{name}")[0] == 404, timeout=300)


def run_rebuilds(first, args, results, nodes):
    for round_index in range(args.rounds):
        gib = args.rebuild_gib
        disk = disk_seq_write(gib)
        buffered = disk_seq_write(gib, direct=False)
        settled = settle(nodes)
        took, _, cpu = rebuild(first, f"rebuild{round_index}", gib, nodes=nodes)
        delete_volume(first, f"rebuild{round_index}")
        settled += settle(nodes)
        # The client runs for most of the unloaded rebuild's time, so it ends inside the loaded one.
        seconds = max(2, int(took * 0.8))
        loaded, during, _ = rebuild(first, f"loaded{round_index}", gib, probe_seconds=seconds)
        baseline = probe_result(probe(first, f"loaded{round_index}", seconds))
        delete_volume(first, f"loaded{round_index}")
        run = {"disk_seq_write_bytes_per_second": disk,
               "disk_buffered_write_bytes_per_second": buffered, "rebuild_seconds": took,
               "rebuild_bytes_per_second": (gib << 30) / took, "loaded_rebuild_seconds": loaded,
               "client_during": during, "client_in_sync": baseline,
               "cpu_seconds_per_gib": {node.name: used for node, used in zip(nodes, cpu)},
               "settle_seconds": settled}
        results.setdefault("rebuild", []).append(run)
        print(f"round {round_index + 1} rebuild {gib} GiB: {run['rebuild_bytes_per_second'] / 2**20:.0f} MiB/s "
              f"({run['rebuild_bytes_per_second'] / disk:.2f}× the disk's {disk / 2**20:.0f} MiB/s direct, "
              f"{run['rebuild_bytes_per_second'] / buffered:.2f}× its {buffered / 2**20:.0f} MiB/s buffered); under a client "
              f"{loaded:.1f} s; client p99 read {during['read_p99_us']:.0f} / write {during['write_p99_us']:.0f} µs "
              f"during, {baseline['read_p99_us']:.0f} / {baseline['write_p99_us']:.0f} µs in sync"
              f"{'' if during['inside_rebuild'] else ' (client outlived the rebuild)'}; waited {settled:.0f} s for idle nodes; CPU s per GiB alone: "
              + ", ".join(f"{node.name} {used:.2f}" for node, used in zip(nodes, cpu)), flush=True)


def summarize_rebuilds(runs):
    def median(pick):
        return statistics.median(pick(run) for run in runs)
    share = median(lambda run: run["rebuild_bytes_per_second"] / run["disk_seq_write_bytes_per_second"])
    buffered = median(lambda run: run["rebuild_bytes_per_second"] / run["disk_buffered_write_bytes_per_second"])
    read = median(lambda run: run["client_during"]["read_p99_us"] / max(run["client_in_sync"]["read_p99_us"], 1))
    write = median(lambda run: run["client_during"]["write_p99_us"] / max(run["client_in_sync"]["write_p99_us"], 1))
    cpu = {name: median(lambda run: run["cpu_seconds_per_gib"][name]) for name in runs[0]["cpu_seconds_per_gib"]}
    print(f"  {'rebuild':12}     {median(lambda run: run['rebuild_bytes_per_second']) / 2**20:8.0f} MiB/s "
          f"({share:.2f}× the disk's sequential direct write, {buffered:.2f}× its buffered write); client p99 during/in sync: read {read:.2f}×, write {write:.2f}×; "
          "CPU s per GiB: " + ", ".join(f"{name} {used:.2f}" for name, used in cpu.items()))
    return {"rebuild_share_of_disk": share, "rebuild_share_of_buffered_write": buffered, "client_read_p99_ratio": read, "client_write_p99_ratio": write,
            "cpu_seconds_per_gib": cpu, "runs": runs}


def snapshot_repair(node, name, gib):
    """Writes a fresh R=1 volume whole, snapshots it, raises it to R=2; returns (seconds until
    the new replica is in sync, seconds from then until its copy of the snapshot is complete)."""
    code, answer = node.api("POST", "/api/v1/volumes", {"name": name, "size_bytes": gib << 30, "replicas": 1})
    assert code == 200, answer
    subprocess.run(["fio", "--name=fill", "--ioengine=nbd", f"--uri=nbd://{node.host}:{node.nbd_port}/{name}",
                    f"--size={gib}g", "--rw=write", "--bs=1m", "--iodepth=8", "--end_fsync=1"],
                   capture_output=True, check=True, timeout=900)
    code, answer = node.api("POST", f"/api/v1/volumes/{name}/snapshots", {"name": "s"})
    assert code == 200, answer
    started = time.time()
    code, answer = node.api("POST", f"/api/v1/volumes/{name}/replication", {"replicas": 2})
    assert code == 200, answer

    def in_sync():
        code, status = node.api("GET", "/api/v1/status")
        return code == 200 and not any(f'volume "{name}"' in reason for reason in status["reasons"])

    def complete():
        code, snapshots = node.api("GET", f"/api/v1/volumes/{name}/snapshots")
        return code == 200 and not snapshots[0]["incomplete_on"]

    wait_until(f"{name} in sync", in_sync, timeout=900, interval=0.05)
    synced = time.time()
    wait_until(f"{name}@s complete on the new replica", complete, timeout=900, interval=0.05)
    return synced - started, time.time() - synced


def run_snapshot_repairs(first, args, results):
    for round_index in range(args.rounds):
        gib = args.snapshot_repair_gib
        disk = disk_seq_write(gib)
        catch_up_seconds, repair_seconds = snapshot_repair(first, f"repair{round_index}", gib)
        delete_volume(first, f"repair{round_index}")
        run = {"disk_seq_write_bytes_per_second": disk, "catch_up_seconds": catch_up_seconds,
               "repair_seconds": repair_seconds, "repair_bytes_per_second": (gib << 30) / repair_seconds}
        results.setdefault("snapshot-repair", []).append(run)
        print(f"round {round_index + 1} snapshot repair {gib} GiB: {run['repair_bytes_per_second'] / 2**20:.0f} MiB/s "
              f"({run['repair_bytes_per_second'] / disk:.2f}× the disk's {disk / 2**20:.0f} MiB/s); the catch-up "
              f"before it {catch_up_seconds:.1f} s", flush=True)


def kill_and_write(first, second, name, absent_mib, restart_primary):
    """Kills node 2, writes `absent_mib` MiB of 4 KiB random writes through node 1 (killed -9
    and started again first when `restart_primary`: a clean stop would note what node 2 lacks),
    brings node 2 back and waits until it is in sync; returns
    (seconds from its start to in sync, bytes compared, bytes shipped)."""
    uri = f"nbd://{first.host}:{first.nbd_port}/{name}"

    def served():
        code, info = first.api("GET", f"/api/v1/volumes/{name}")
        assert code == 200, info
        return info["replication"]

    second.kill9()
    if restart_primary:
        first.kill9()
        first.start()
    # Attaching through node 1 makes it primary again (after a restart: a new primary whose
    # record of what node 2 lacks is gone with its memory).
    wait_until(f"{name} attached through node 1", lambda: subprocess.run(
        ["nbdinfo", uri], capture_output=True).returncode == 0, timeout=60, interval=0.2)
    subprocess.run(["fio", "--name=absent", "--ioengine=nbd", f"--uri={uri}", "--rw=randwrite", "--bs=4k",
                    f"--io_size={absent_mib}m", "--iodepth=16", "--end_fsync=1", "--randrepeat=0"],
                   capture_output=True, check=True, timeout=900)
    wait_until("node 2 out of sync", lambda: served()["in_sync"] == [1], timeout=60)
    before = served()["served_here"]
    started = time.time()
    second.start()
    wait_until(f"{name} in sync", lambda: sorted(served()["in_sync"]) == [1, 2], timeout=900, interval=0.05)
    took = time.time() - started
    after = served()["served_here"]
    # After a restart the counters started over with the new primary.
    if restart_primary:
        before = {"resync_compared_bytes": 0, "resync_bytes": 0}
    return (took, after["resync_compared_bytes"] - before["resync_compared_bytes"],
            after["resync_bytes"] - before["resync_bytes"])


def run_resyncs(first, second, args, results):
    name = "absent"
    code, answer = first.api("POST", "/api/v1/volumes",
                             {"name": name, "size_bytes": args.resync_gib << 30, "replicas": 2})
    assert code == 200, answer
    subprocess.run(["fio", "--name=fill", "--ioengine=nbd", f"--uri=nbd://{first.host}:{first.nbd_port}/{name}",
                    f"--size={args.resync_gib}g", "--rw=write", "--bs=1m", "--iodepth=8", "--end_fsync=1"],
                   capture_output=True, check=True, timeout=900)
    wait_until("both replicas in sync", lambda: sorted(
        first.api("GET", f"/api/v1/volumes/{name}")[1]["replication"]["in_sync"]) == [1, 2], timeout=900)
    for round_index in range(args.rounds):
        order = [False, True] if round_index % 2 == 0 else [True, False]
        for restart_primary in order:
            took, compared, shipped = kill_and_write(first, second, name, args.absent_mib, restart_primary)
            kind = "primary killed" if restart_primary else "tracked"
            results.setdefault("resync", {}).setdefault(kind, []).append(
                {"seconds": took, "compared_bytes": compared, "shipped_bytes": shipped})
            print(f"round {round_index + 1} catch-up after {args.absent_mib} MiB of 4 KiB random writes, {kind}: "
                  f"{took:.2f} s, compared {compared / 2**20:.1f} MiB, shipped {shipped / 2**20:.1f} MiB", flush=True)


def summarize_resyncs(kinds, absent_mib, gib):
    summary = {}
    for kind, runs in kinds.items():
        seconds = statistics.median(run["seconds"] for run in runs)
        compared = statistics.median(run["compared_bytes"] for run in runs)
        shipped = statistics.median(run["shipped_bytes"] for run in runs)
        summary[kind] = {"seconds": seconds, "compared_bytes": compared, "shipped_bytes": shipped, "runs": runs}
        print(f"  {'catch-up':12} {kind:18}: {seconds:6.2f} s, compared {compared / 2**20:7.1f} MiB, shipped "
              f"{shipped / 2**20:6.1f} MiB ({shipped / (absent_mib << 20):.2f}× the {absent_mib} MiB written; "
              f"{gib} GiB volume)")
    return summary


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
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"the fio workloads to run, comma-separated (default: {','.join(WORKLOADS)})")
    parser.add_argument("--catch-up-gib", type=int, default=0)
    parser.add_argument("--rebuild-gib", type=int, default=0,
                        help="also measure full rebuilds of an N GiB volume (alone and under a client)")
    parser.add_argument("--resync-busy-percent", type=int,
                        help="cluster.resync_busy_percent on every node (default: the server's)")
    parser.add_argument("--resync-gib", type=int, default=0,
                        help="also measure a replica's catch-up after an absence, on an N GiB volume")
    parser.add_argument("--absent-mib", type=int, default=16,
                        help="MiB of 4 KiB random writes while the replica is away (--resync-gib)")
    parser.add_argument("--snapshot-repair-gib", type=int, default=0,
                        help="also measure the repair of an N GiB snapshot on a new replica")
    parser.add_argument("--forwarded", action="store_true",
                        help="also the R=2 volume through node 3, which holds no replica")
    args = parser.parse_args()
    workloads = [] if args.skip_fio else [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    cluster = Cluster(WORK)
    extra_args = []
    if args.resync_busy_percent is not None:
        config = WORK / "bench.toml"
        config.write_text(f"[cluster]\nresync_busy_percent = {args.resync_busy_percent}\n")
        extra_args = ["--config", str(config)]
    results = {r: {w: [] for w in [*WORKLOADS, "pgbench"]} for r in (1, 2, 3, "2f")}
    try:
        first = cluster.add(extra_args=extra_args)
        second = cluster.add(extra_args=extra_args)
        third = cluster.add(extra_args=extra_args)
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
        if args.rebuild_gib:
            run_rebuilds(first, args, results, [first, second, third])
        if args.resync_gib:
            run_resyncs(first, second, args, results)
        if args.snapshot_repair_gib:
            run_snapshot_repairs(first, args, results)
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
    if results.get("rebuild"):
        summary["rebuild"] = summarize_rebuilds(results["rebuild"])
    if results.get("resync"):
        summary["resync"] = summarize_resyncs(results["resync"], args.absent_mib, args.resync_gib)
    if results.get("snapshot-repair"):
        runs = results["snapshot-repair"]
        rate = statistics.median(run["repair_bytes_per_second"] for run in runs)
        share = statistics.median(run["repair_bytes_per_second"] / run["disk_seq_write_bytes_per_second"]
                                  for run in runs)
        summary["snapshot-repair"] = {"bytes_per_second": rate, "share_of_disk": share, "runs": runs}
        print(f"  {'snapshot repair':12}  {rate / 2**20:8.0f} MiB/s ({share:.2f}× the disk's sequential write)")
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
