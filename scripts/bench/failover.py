#!/usr/bin/env python3
"""Failover of a replicated volume (issue 11), over many kills: how long after a `kill -9` of
its primary the volume is served again through the other node, and how long a client's
writes stall when a replica is killed instead.

    python3 scripts/bench/failover.py [--kills 100] [--leader-kills 100] [--replica-kills 20]
        [--json out.json]

One loopback cluster: two storage nodes and a witness, an R=2 volume. Each primary kill runs
`keel bench durability write` (a FLUSH every 4 writes, 4 writers) through the primary, kills
it -9 after 1-3 s, then attaches through the other node, retrying every 50 ms until it serves
a read (the take-over), and runs `keel bench durability verify` there: a round with a lost
flushed write fails the benchmark. The killed node restarts, catches up and is the replica of
the next round, so the roles alternate (and so does which node leads Raft: each round records
whether the killed primary also led it). --leader-kills rounds first hand Raft leadership to
the primary (`POST /api/v1/cluster/leader`), so the survivors must elect a leader before the
volume can be handed over. Each replica kill writes and flushes 4 KiB blocks
through the primary (QD1) and reports the longest gap between two acknowledged FLUSHes around
the kill (the primary drops the replica through Raft before a FLUSH completes without it).

Targets (issue 11): take-over p50 <= 3 s, p99 <= 6 s over >= 100 kills; a replica's loss
stalls writes <= 3 s. The nodes share this machine's one disk and two cores. Data under
/var/tmp."""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from keelcluster import KEEL_BIN, Cluster, wait_until  # noqa: E402
from nbd_client import Client  # noqa: E402

WORK = Path(os.environ.get("KEEL_BENCH_DIR", "/var/tmp/keel-bench-failover"))
SIZE = 64 << 20
NAME = "failover"


def replication(node):
    code, info = node.api("GET", f"/api/v1/volumes/{NAME}")
    assert code == 200, info
    return info["replication"]


def both_in_sync(node):
    wait_until("both replicas in sync", lambda: sorted(replication(node)["in_sync"]) == [1, 2], timeout=120)


def served_after(node, since):
    """Retries attaching through `node` until a read succeeds; returns seconds since `since`."""
    deadline = since + 60
    while time.time() < deadline:
        try:
            client = Client(node.host, node.nbd_port, NAME, timeout=10)
            try:
                client.read(0, 4096)
                return time.time() - since
            finally:
                client.close()
        except Exception:  # refused until the take-over: try again
            time.sleep(0.05)
    raise AssertionError(f"{node.name} did not serve {NAME} within 60 s of the kill")


def kill_primary(nodes, primary, round_index, leader_id, make_leader):
    node, other = nodes[primary], nodes[1 - primary]
    both_in_sync(node)
    if make_leader:
        code, answer = node.api("POST", "/api/v1/cluster/leader", {"node": str(node.node_id())})
        assert code == 200, answer
    killed_led = leader_id() == node.node_id()
    assert killed_led or not make_leader
    log = WORK / f"durability-{round_index}.log"
    writer = subprocess.Popen(
        [KEEL_BIN, "bench", "durability", "write", "--target", f"nbd://{node.host}:{node.nbd_port}/{NAME}",
         "--log", str(log), "--size", "16MiB", "--writers", "4", "--writes-per-flush", "4",
         "--runtime-seconds", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0 + random.random() * 2.0)
    node.kill9()
    killed = time.time()
    took = served_after(other, killed)
    output, _ = writer.communicate(timeout=120)
    verify = subprocess.run(
        [KEEL_BIN, "bench", "durability", "verify", "--target", f"nbd://{other.host}:{other.nbd_port}/{NAME}",
         "--log", str(log)], capture_output=True, text=True, timeout=300)
    if verify.returncode != 0 or "PASS: every acknowledged write survived" not in verify.stdout:
        raise AssertionError(f"round {round_index}: a flushed write was lost\nwrite:\n{output}\n"
                             f"verify:\n{verify.stdout}{verify.stderr}")
    log.unlink()
    node.start()
    return took, killed_led


def kill_replica(nodes, primary):
    """Writes and flushes through the primary at QD1 while the replica is killed; returns the
    longest gap between acknowledged FLUSHes from 1 s before the kill on."""
    node, replica = nodes[primary], nodes[1 - primary]
    both_in_sync(node)
    client = Client(node.host, node.nbd_port, NAME, timeout=60)
    acknowledged = []
    stop = threading.Event()
    failure = []

    def write():
        block = os.urandom(4096)
        offset = 0
        try:
            while not stop.is_set():
                client.write(offset, block)
                client.flush()
                acknowledged.append(time.time())
                offset = (offset + 4096) % SIZE
        except Exception as error:  # reported below: a replica's loss must not fail writes
            failure.append(error)

    thread = threading.Thread(target=write)
    thread.start()
    time.sleep(1.5)
    replica.kill9()
    killed = time.time()
    time.sleep(6.0)
    stop.set()
    thread.join(timeout=60)
    client.close()
    if failure:
        raise AssertionError(f"writes failed after the replica was killed: {failure[0]}")
    around = [t for t in acknowledged if t >= killed - 1.0]
    if len(around) < 2 or around[-1] < killed:
        raise AssertionError("no FLUSH was acknowledged after the replica was killed")
    stall = max(b - a for a, b in zip(around, around[1:]))
    replica.start()
    return stall


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def summarize(values):
    return {"count": len(values), "p50_s": statistics.median(values), "p99_s": percentile(values, 0.99),
            "max_s": max(values), "runs_s": values}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=100, help="primary kills")
    parser.add_argument("--leader-kills", type=int, default=0,
                        help="primary kills where the primary also leads Raft")
    parser.add_argument("--replica-kills", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    cluster = Cluster(WORK)
    takeovers, leader_takeovers, stalls = [], [], []
    try:
        nodes = [cluster.add(), cluster.add()]
        cluster.add(witness=True)
        wait_until("three voters", lambda: cluster.voters() == {1, 2, 3}, timeout=60)
        code, created = nodes[0].api("POST", "/api/v1/volumes",
                                     {"name": NAME, "size_bytes": SIZE, "replicas": 2}, timeout=30)
        assert code == 200, created
        Client(nodes[0].host, nodes[0].nbd_port, NAME).close()
        primary = 0
        for round_index in range(args.replica_kills):
            stall = kill_replica(nodes, primary)
            stalls.append(stall)
            print(f"replica kill {round_index + 1}/{args.replica_kills}: longest FLUSH gap {stall:.2f} s",
                  flush=True)
        for round_index in range(args.kills + args.leader_kills):
            alive = nodes[1 - primary]
            make_leader = round_index >= args.kills
            took, led = kill_primary(nodes, primary, round_index, lambda: cluster.leader(via=alive), make_leader)
            (leader_takeovers if led else takeovers).append(took)
            print(f"primary kill {round_index + 1}/{args.kills + args.leader_kills}: served through the other node "
                  f"{took:.2f} s after the kill{' (it also led Raft)' if led else ''}", flush=True)
            primary = 1 - primary
    finally:
        cluster.stop()

    summary = {"nodes": "2 storage + witness on one machine, one shared disk"}
    print("\n(all nodes share one disk and two cores)")
    everything = takeovers + leader_takeovers
    for label, values in (("take-over, every kill", everything), ("take-over, primary led Raft", leader_takeovers),
                          ("take-over, primary did not lead", takeovers), ("replica kill: FLUSH stall", stalls)):
        if values:
            summary[label] = summarize(values)
            print(f"  {label:32} n={len(values):4}  p50 {summary[label]['p50_s']:.2f} s  "
                  f"p99 {summary[label]['p99_s']:.2f} s  max {summary[label]['max_s']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
