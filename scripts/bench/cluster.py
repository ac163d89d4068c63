#!/usr/bin/env python3
"""Cluster benchmarks (issue 9): metadata write latency and throughput on a 1-node and a 3-node
loopback cluster, and the leader-failover time distribution over repeated kill -9.

    python3 scripts/bench/cluster.py [--rounds 3] [--ops 300] [--kills 20] [--json out.json]

Metadata writes are volume creations through the admin API (HTTP, kept alive), measured by the
client from request to answer: that is what an operator or a CSI driver sees. The 1-node and
3-node rounds alternate; medians are quoted. Failover: kill -9 the leader, then time (a) until a
survivor names a new leader and (b) until a write through a survivor is acknowledged; the killed
node restarts and catches up before the next kill.

All nodes share this machine's one disk (and its two cores): the numbers say nothing about
separate machines. Data under /var/tmp (a real filesystem)."""

import argparse
import http.client
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "cluster"))
from keelcluster import Cluster, wait_until  # noqa: E402

WORK = Path(os.environ.get("KEEL_BENCH_DIR", "/var/tmp/keel-bench-cluster"))


class Admin:
    """A kept-alive admin API connection to one node."""

    def __init__(self, node):
        host, port = node.admin.rsplit(":", 1)
        self.connection = http.client.HTTPConnection(host, int(port), timeout=30)
        self.token = (node.dir / "admin-token").read_text().strip()

    def create(self, name):
        body = json.dumps({"name": name, "size_bytes": 1 << 20})
        self.connection.request("POST", "/api/v1/volumes", body=body, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        response = self.connection.getresponse()
        response.read()
        return response.status


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summary(latencies_ns, seconds):
    ms = [value / 1e6 for value in latencies_ns]
    return {
        "ops": len(ms),
        "ops_per_second": round(len(ms) / seconds, 1),
        "min_ms": round(min(ms), 3),
        "p50_ms": round(percentile(ms, 0.50), 3),
        "p99_ms": round(percentile(ms, 0.99), 3),
        "p999_ms": round(percentile(ms, 0.999), 3),
        "max_ms": round(max(ms), 3),
    }


def metadata_round(size, ops, tag):
    work = WORK / f"metadata-{size}-{tag}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cluster = Cluster(work)
    try:
        nodes = [cluster.add() for _ in range(size)]
        wait_until("voters", lambda: len(cluster.voters()) == (3 if size >= 3 else 1))
        leader = cluster.node_by_id(cluster.leader())
        follower = next((n for n in nodes if n is not leader), leader)
        results = {}
        for role, node in (("via-leader", leader), ("via-follower", follower)):
            if size == 1 and role == "via-follower":
                continue
            admin = Admin(node)
            latencies = []
            started = time.perf_counter()
            for index in range(ops):
                begin = time.perf_counter_ns()
                status = admin.create(f"{role}-{index}")
                latencies.append(time.perf_counter_ns() - begin)
                assert status == 200, status
            results[f"sequential-{role}"] = summary(latencies, time.perf_counter() - started)
        # Throughput with 8 concurrent writers spread over the nodes.
        latencies, lock = [], threading.Lock()

        def writer(worker):
            admin = Admin(nodes[worker % len(nodes)])
            mine = []
            for index in range(ops // 8):
                begin = time.perf_counter_ns()
                status = admin.create(f"c{worker}-{index}")
                mine.append(time.perf_counter_ns() - begin)
                assert status == 200, status
            with lock:
                latencies.extend(mine)

        started = time.perf_counter()
        threads = [threading.Thread(target=writer, args=(worker,)) for worker in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        results["concurrency-8"] = summary(latencies, time.perf_counter() - started)
        return results
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


def failover(kills):
    work = WORK / "failover"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cluster = Cluster(work)
    elected, writable = [], []
    try:
        nodes = [cluster.add() for _ in range(3)]
        wait_until("three voters", lambda: len(cluster.voters()) == 3)
        for kill in range(kills):
            leader_id = wait_until("a leader", lambda: cluster.leader())
            victim = cluster.node_by_id(leader_id)
            survivor = next(n for n in nodes if n is not victim)
            admin = Admin(survivor)
            killed_at = time.perf_counter()
            victim.kill9()
            wait_until("a new leader", lambda: survivor.status()["leader"] not in (None, leader_id),
                       timeout=60, interval=0.02)
            elected.append(time.perf_counter() - killed_at)
            while True:
                try:
                    if admin.create(f"after-kill-{kill}") == 200:
                        break
                except OSError:
                    admin = Admin(survivor)
                time.sleep(0.01)
            writable.append(time.perf_counter() - killed_at)
            victim.start()
            wait_until("caught up", lambda: victim.status()["last_applied_index"] >= survivor.status()["last_applied_index"],
                       timeout=60)
            wait_until("three voters again", lambda: len(cluster.voters(via=survivor)) == 3, timeout=60)
            print(f"  kill {kill + 1}: new leader after {elected[-1]:.2f} s, writable after {writable[-1]:.2f} s", flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)

    def stats(values):
        return {"kills": len(values), "min_s": round(min(values), 3), "p50_s": round(percentile(values, 0.5), 3),
                "p99_s": round(percentile(values, 0.99), 3), "max_s": round(max(values), 3)}

    return {"new_leader": stats(elected), "first_write": stats(writable)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    report = {"note": "all nodes on one machine, one disk, two cores", "metadata": {}, "failover": None}
    rounds = {1: [], 3: []}
    for round_index in range(args.rounds):
        for size in (1, 3):
            result = metadata_round(size, args.ops, round_index)
            rounds[size].append(result)
            print(f"round {round_index + 1}, {size}-node: {json.dumps(result)}", flush=True)
    for size, results in rounds.items():
        merged = {}
        for key in results[0]:
            merged[key] = {field: statistics.median(r[key][field] for r in results) for field in results[0][key]}
        report["metadata"][f"{size}-node"] = merged
    if args.kills:
        print(f"failover over {args.kills} kills:", flush=True)
        report["failover"] = failover(args.kills)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
