"""Replicated volumes across real `keel server` processes on loopback: two storage nodes and a
witness, an R=2 volume attached through NBD. Each test says what it proves. The nodes share
this machine's one disk, so no timing here says anything about separate machines.

KEEL_REPLICATION_ROUNDS sets how many primary kills the durability test runs (default 2; the
long mode runs more)."""

import os
import random
import subprocess
import sys
import time
from pathlib import Path

from keelcluster import KEEL_BIN, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from nbd_client import Client, NbdError  # noqa: E402

ROUNDS = int(os.environ.get("KEEL_REPLICATION_ROUNDS", "2"))
BLOCK = 4096
SIZE = 64 << 20


def two_nodes_and_witness(cluster):
    first = cluster.add()
    second = cluster.add()
    cluster.add(witness=True)
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    return first, second


def create_r2(node, name):
    code, created = node.api("POST", "/api/v1/volumes",
                             {"name": name, "size_bytes": SIZE, "replicas": 2}, timeout=30)
    assert code == 200, created


def replication(node, name):
    code, info = node.api("GET", f"/api/v1/volumes/{name}")
    assert code == 200, info
    return info["replication"]


def attach(node, name, timeout=30):
    """Connects an NBD client to `node`, retrying while the node refuses (its primary has not
    been silent long enough yet)."""
    host, port = node.host, node.nbd_port
    return wait_until(f"attaching {name} through {node.name}",
                      lambda: Client(host, port, name, timeout=60), timeout=timeout, interval=0.2)


def block(tag, index):
    seed = f"{tag}:{index}:".encode()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]


def test_r2_volume_survives_losing_a_replica_and_resyncs_what_changed(cluster):
    """An R=2 volume is placed on both storage nodes and both are in sync once attached. With
    the replica killed (-9), writes and FLUSHes go on after the in-sync set shrinks through
    Raft; when it returns it catches up by shipping only the blocks that changed (bytes
    shipped ≤ 1.1× the bytes written meanwhile) and rejoins. Then the primary is killed and
    the volume attached through the other node holds every flushed write."""
    first, second = two_nodes_and_witness(cluster)
    create_r2(first, "r2")
    info = replication(first, "r2")
    assert info["replicas"] == [1, 2] and info["factor"] == 2, info

    client = attach(first, "r2")
    wait_until("both replicas in sync", lambda: sorted(replication(first, "r2")["in_sync"]) == [1, 2])
    expected = {}
    for index in range(256):
        expected[index] = block("before", index)
        client.write(index * BLOCK, expected[index])
    client.flush()

    second.kill9()
    started = time.time()
    for index in range(256, 320):
        expected[index] = block("during", index)
        client.write(index * BLOCK, expected[index])
    client.flush()
    stalled = time.time() - started
    info = replication(first, "r2")
    assert info["in_sync"] == [1], info
    status = first.cli("status").stdout
    assert "HEALTH_WARN" in status and "KEEL_VOLUME_DEGRADED" in status, status
    # Written while the replica was away: these blocks, and nothing else, must travel.
    absent_bytes = 64 * BLOCK
    shipped_before = info["served_here"]["resync_bytes"]

    second.start()
    wait_until("the replica back in sync", lambda: sorted(replication(first, "r2")["in_sync"]) == [1, 2], timeout=60)
    assert "KEEL_VOLUME_DEGRADED" not in first.cli("status").stdout
    shipped = replication(first, "r2")["served_here"]["resync_bytes"] - shipped_before
    assert 0 < shipped <= 1.1 * absent_bytes, (shipped, absent_bytes)
    for index in range(320, 384):
        expected[index] = block("after", index)
        client.write(index * BLOCK, expected[index])
    client.flush()

    # While the primary is alive, the other node refuses to take the volume over.
    try:
        Client(second.host, second.nbd_port, "r2", timeout=30)
        raise AssertionError("a replica node took the volume over from a live primary")
    except NbdError as refused:
        assert "OPT_GO refused" in str(refused), refused
    assert replication(first, "r2")["primary"] == 1

    first.kill9()
    killed = time.time()
    other = attach(second, "r2", timeout=60)
    serving = time.time() - killed
    for index, data in expected.items():
        assert other.read(index * BLOCK, BLOCK) == data, f"block {index} lost"
    print(f"replica loss stalled the flush {stalled:.2f} s; new primary served after {serving:.2f} s "
          f"(nodes share one disk)")
    info = replication(second, "r2")
    assert info["primary"] == 2 and info["in_sync"] == [2], info
    other.write(0, block("new-primary", 0))
    other.flush()


def test_no_flushed_write_is_lost_when_the_primary_is_killed(cluster, workdir):
    """`keel bench durability write` (a FLUSH every 4 writes) runs through the primary; the
    primary is killed -9; the volume is attached through the other node, which takes over
    after the primary's lease, and `keel bench durability verify` finds every write that was
    acknowledged as flushed. The killed node then returns, catches up and is the replica of
    the next round."""
    nodes = list(two_nodes_and_witness(cluster))
    create_r2(nodes[0], "dur")
    primary = 0
    client = attach(nodes[primary], "dur")
    client.close()
    failovers = []
    for round_index in range(ROUNDS):
        node = nodes[primary]
        other = nodes[1 - primary]
        wait_until("both replicas in sync", lambda: sorted(replication(node, "dur")["in_sync"]) == [1, 2], timeout=60)
        log = workdir / f"durability-{round_index}.log"
        writer = subprocess.Popen(
            [KEEL_BIN, "bench", "durability", "write", "--target", f"nbd://{node.host}:{node.nbd_port}/dur",
             "--log", str(log), "--size", "16MiB", "--writers", "4", "--writes-per-flush", "4",
             "--runtime-seconds", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(2.0 + random.random() * 2.0)
        node.kill9()
        killed = time.time()
        output, _ = writer.communicate(timeout=120)
        attach(other, "dur", timeout=60).close()
        failovers.append(time.time() - killed)
        verify = subprocess.run(
            [KEEL_BIN, "bench", "durability", "verify", "--target", f"nbd://{other.host}:{other.nbd_port}/dur",
             "--log", str(log)], capture_output=True, text=True, timeout=300)
        assert verify.returncode == 0, f"write:\n{output}\nverify:\n{verify.stdout}{verify.stderr}"
        assert "PASS: every acknowledged write survived" in verify.stdout, verify.stdout
        node.start()
        primary = 1 - primary
    print(f"failover (kill to serving through the other node): {['%.2f' % t for t in failovers]} s "
          f"(nodes share one disk)")


def test_a_partitioned_primary_is_fenced(cluster):
    """The primary is cut off from the other nodes (the transport's fault injection). Its
    FLUSH fails (the replica does not answer, and it cannot reach Raft to drop it); the other
    node takes over once the primary's lease ran out; after the partition heals, the old
    primary still refuses to acknowledge anything for the volume."""
    first, second = two_nodes_and_witness(cluster)
    create_r2(first, "fence")
    client = attach(first, "fence")
    wait_until("both replicas in sync", lambda: sorted(replication(first, "fence")["in_sync"]) == [1, 2])
    client.write(0, block("one", 0))
    client.flush()

    first.faults([2, 3])
    client.write(BLOCK, block("cut-off", 1))
    try:
        client.flush()
        raise AssertionError("a cut-off primary acknowledged a FLUSH")
    except NbdError:
        pass
    other = attach(second, "fence", timeout=60)
    assert other.read(0, BLOCK) == block("one", 0)
    other.write(2 * BLOCK, block("new", 2))
    other.flush()

    first.faults([])
    time.sleep(1.0)
    stale = None
    try:
        stale = Client(first.host, first.nbd_port, "fence", timeout=30)
        stale.write(3 * BLOCK, block("stale", 3))
        stale.flush()
        raise AssertionError("the old primary acknowledged a FLUSH after another node took over")
    except NbdError:
        pass
    assert other.read(3 * BLOCK, BLOCK) != block("stale", 3)
    assert replication(second, "fence")["primary"] == 2
