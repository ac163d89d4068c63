"""Replicated volumes across real `keel server` processes on loopback: two storage nodes and a
witness, an R=2 volume attached through NBD. Each test says what it proves. The nodes share
this machine's one disk, so no timing here says anything about separate machines.

KEEL_REPLICATION_ROUNDS sets how many primary kills the durability test runs (default 2; the
long mode runs more)."""

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from keelcluster import KEEL_BIN, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import failsync  # noqa: E402
from nbd_client import Client, NbdError  # noqa: E402

# The transport method of the primary's replication batches (crates/replication/src/wire.rs).
METHOD_REPLICATE = 0x0200

ROUNDS = int(os.environ.get("KEEL_REPLICATION_ROUNDS", "2"))
BLOCK = 4096
SIZE = 64 << 20
# The 1 MiB chunks of the tail test's writes, and the unit in which the primary records what a
# replica lacks (crates/replication/src/dirty.rs).
CHUNK = 1 << 20
UNIT = 64 << 10


def cluster_config(workdir, name, settings):
    """A configuration file for `keel server` whose [cluster] section holds `settings` (TOML
    lines); the arguments that load it."""
    config = workdir / f"{name}.toml"
    config.write_text(f"[cluster]\n{settings}\n")
    return ["--config", str(config)]


def two_nodes_and_witness(cluster, extra_args=()):
    """Two storage nodes started with `extra_args`, and a witness."""
    first = cluster.add(extra_args=extra_args)
    second = cluster.add(extra_args=extra_args)
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


def pair_with_one_replica(cluster, workdir, settings, name, size=SIZE):
    """Node 1 with `settings` (TOML lines of its [cluster] section), node 2 and a witness; an
    R=1 volume `name` on node 1, attached there. Returns (node 1, node 2, the client)."""
    first = cluster.add(extra_args=cluster_config(workdir, name, settings))
    second = cluster.add()
    cluster.add(witness=True)
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    code, created = first.api("POST", "/api/v1/volumes", {"name": name, "size_bytes": size}, timeout=30)
    assert code == 200, created
    return first, second, attach(first, name)


def write_random(client, size):
    """Writes `size` random bytes from offset 0 in 1 MiB requests, flushes, returns them."""
    data = os.urandom(size)
    for offset in range(0, size, 1 << 20):
        client.write(offset, data[offset:offset + (1 << 20)])
    client.flush()
    return data


def snapshot_then_raise(node, client, name, snapshot):
    """Through `client` (attached to `node`, the R=1 volume `name`'s primary): 64 blocks
    `kept`, snapshot `snapshot`, the first 32 rewritten `newer`; then R raised to 2 through
    `node`, and both replicas in sync. With snapshot repair off, the new replica's copy of the
    snapshot lacks its data."""
    for index in range(64):
        client.write(index * BLOCK, block("kept", index))
    client.flush()
    code, answer = node.api("POST", f"/api/v1/volumes/{name}/snapshots", {"name": snapshot})
    assert code == 200, answer
    for index in range(32):
        client.write(index * BLOCK, block("newer", index))
    client.flush()
    node.cli("volume", "set-replication", name, "--replicas", "2")
    wait_until("the new replica in sync", lambda: len(replication(node, name)["in_sync"]) == 2, timeout=60)


def block(tag, index):
    seed = f"{tag}:{index}:".encode()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]


def write_in_background(client, tag, indexes, flush_every):
    """Writes block(tag, index) at each index through `client` on a thread of its own, with a
    FLUSH after every `flush_every` writes; returns the started thread, the blocks a FLUSH
    covered (filled in as they are), and a list that receives the error that stopped it."""
    flushed, failure = {}, []

    def write():
        try:
            pending = {}
            for count, index in enumerate(indexes, start=1):
                pending[index] = block(tag, index)
                client.write(index * BLOCK, pending[index])
                if count % flush_every == 0:
                    client.flush()
                    flushed.update(pending)
                    pending.clear()
        except Exception as error:  # noqa: BLE001 - reported by the caller
            failure.append(error)

    writer = threading.Thread(target=write)
    writer.start()
    return writer, flushed, failure


def write_blocks(client, tag, indexes):
    """Writes block(tag, index) at each index through `client`, flushes, returns them by index."""
    written = {}
    for index in indexes:
        written[index] = block(tag, index)
        client.write(index * BLOCK, written[index])
    client.flush()
    return written


def test_r2_volume_survives_losing_a_replica_and_resyncs_what_changed(cluster):
    """An R=2 volume is placed on both storage nodes and both are in sync once attached (the
    never-written volume is skipped, not compared). With
    the replica killed (-9), writes and FLUSHes go on after the in-sync set shrinks through
    Raft; when it returns it catches up by comparing only the 256 KiB written meanwhile (the
    primary kept track of it; the whole written stretch is 64 MiB) and shipping only
    the blocks that changed (bytes shipped ≤ 1.1× the bytes written meanwhile), and rejoins.
    A client attaching through the other node meanwhile is forwarded to the primary, whose
    client is attached. Then the primary is killed and the volume attached through the other
    node holds every flushed write."""
    first, second = two_nodes_and_witness(cluster)
    create_r2(first, "r2")
    info = replication(first, "r2")
    assert info["replicas"] == [1, 2] and info["factor"] == 2, info

    client = attach(first, "r2")
    wait_until("both replicas in sync", lambda: sorted(replication(first, "r2")["in_sync"]) == [1, 2])
    # Nothing was ever written on either side: the catch-up skipped the whole volume without
    # comparing a block.
    served = replication(first, "r2")["served_here"]
    assert (served["resync_skipped_bytes"], served["resync_bytes"]) == (SIZE, 0), served
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
    # The absent replica is listed as catching up over the four units written meanwhile.
    wait_until("node 2 listed as catching up", lambda: [
        (c["node"], c["total_bytes"]) for c in replication(first, "r2")["served_here"]["catching_up"]] == [(2, 4 * UNIT)])
    # Written while the replica was away: these blocks, and nothing else, must travel.
    absent_bytes = 64 * BLOCK
    shipped_before = info["served_here"]["resync_bytes"]
    compared_before = info["served_here"]["resync_compared_bytes"]

    second.start()
    wait_until("the replica back in sync", lambda: sorted(replication(first, "r2")["in_sync"]) == [1, 2], timeout=60)
    assert "KEEL_VOLUME_DEGRADED" not in first.cli("status").stdout
    assert replication(first, "r2")["served_here"]["catching_up"] == []
    served = replication(first, "r2")["served_here"]
    shipped = served["resync_bytes"] - shipped_before
    assert 0 < shipped <= 1.1 * absent_bytes, (shipped, absent_bytes)
    # Those four units (twice if an attempt failed half-way as the node came up), not the
    # 64 MiB a comparison of every written stretch reads.
    compared = served["resync_compared_bytes"] - compared_before
    assert 4 * UNIT <= compared <= 8 * UNIT, compared
    for index in range(320, 384):
        expected[index] = block("after", index)
        client.write(index * BLOCK, expected[index])
    client.flush()

    # While the primary is alive and its client attached, the other node does not take the
    # volume over: a client attaching there is forwarded to it.
    forwarded = Client(second.host, second.nbd_port, "r2", timeout=30)
    assert forwarded.read(320 * BLOCK, BLOCK) == expected[320]
    forwarded.close()
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


def r2_in_sync_with_blocks(cluster, name):
    """Two storage nodes and a witness; an R=2 volume `name` attached through node 1, both
    replicas in sync, and the first block of each of its first 8 MiB written and flushed.
    Returns (node 1, node 2, the client, {offset: block written})."""
    first, second = two_nodes_and_witness(cluster)
    create_r2(first, name)
    client = attach(first, name)
    wait_until("both replicas in sync", lambda: sorted(replication(first, name)["in_sync"]) == [1, 2])
    expected = {chunk * CHUNK: block("before", chunk) for chunk in range(8)}
    for offset, data in expected.items():
        client.write(offset, data)
    client.flush()
    return first, second, client, expected


def write_without_the_replica(second, client, expected):
    """Node 2 (the replica) killed -9, then one block written in each of chunks 20 and 21
    (not flushed)."""
    second.kill9()
    for chunk in (20, 21):
        expected[chunk * CHUNK] = block("absent", chunk)
        client.write(chunk * CHUNK, expected[chunk * CHUNK])


def write_then_fail_over(client, first, second, name, expected, chunk):
    """One more block written and flushed through node 1 (at `chunk`), node 1 killed -9, the
    volume attached through node 2: it reads every block of `expected` as written."""
    expected[chunk * CHUNK] = block("after", chunk)
    client.write(chunk * CHUNK, expected[chunk * CHUNK])
    client.flush()
    first.kill9()
    other = attach(second, name, timeout=60)
    for offset, data in expected.items():
        assert other.read(offset, BLOCK) == data, f"the block at {offset} is not what was written"


def test_writes_a_replica_never_confirmed_are_compared_when_it_returns(cluster):
    """Writes to chunks 10 to 13 are held in the primary's transport for a second (the
    fault proxy) while the replica is killed -9, so they never reach it; a FLUSH then
    completes without it. When it returns, its catch-up compares only what it may lack —
    the four 64 KiB units of those writes, which its stream carried but it never confirmed
    durable — not the 64 MiB written stretch. The primary is then killed and the volume attached through the
    returned replica holds every block: before, in the lost tail, and after."""
    first, second = two_nodes_and_witness(cluster)
    create_r2(first, "tail")
    client = attach(first, "tail")
    wait_until("both replicas in sync", lambda: sorted(replication(first, "tail")["in_sync"]) == [1, 2])
    expected = {}
    for chunk in range(8):
        expected[chunk * CHUNK] = block("before", chunk)
    for chunk in range(10, 14):
        expected[chunk * CHUNK + BLOCK] = block("lost-tail", chunk)
    for offset in [o for o in expected if o < 8 * CHUNK]:
        client.write(offset, expected[offset])
    client.flush()
    wait_until("in sync after the first writes", lambda: sorted(replication(first, "tail")["in_sync"]) == [1, 2])
    compared_before = replication(first, "tail")["served_here"]["resync_compared_bytes"]
    first.faults([], delays=[{"node": second.node_id(), "method": METHOD_REPLICATE, "milliseconds": 1000}])
    for offset in [o for o in expected if o >= 8 * CHUNK]:
        client.write(offset, expected[offset])
    second.kill9()
    client.flush()
    assert replication(first, "tail")["in_sync"] == [1]
    first.faults([])
    second.start()
    wait_until("the replica back in sync", lambda: sorted(replication(first, "tail")["in_sync"]) == [1, 2], timeout=60)
    compared = replication(first, "tail")["served_here"]["resync_compared_bytes"] - compared_before
    assert 4 * UNIT <= compared <= 8 * UNIT, compared
    write_then_fail_over(client, first, second, "tail", expected, 20)


def test_a_primary_stopped_cleanly_remembers_what_its_replica_lacks(cluster):
    """Node 2 (the replica) is killed and two blocks are written without it; then node 1
    (the primary) is stopped cleanly and started again, and the volume attached through it
    anew. At its shutdown the primary noted in its store what node 2 lacks; the new primary
    takes that note (the volume's epoch has not moved since), so when node 2 returns its
    catch-up compares those two 64 KiB units, not the 64 MiB written stretch. Then node 1 is
    stopped cleanly once more, with node 2 in sync this time: after the restart node 2 lacks
    nothing and is compared not at all. Finally node 1 is killed and the volume attached
    through node 2 holds every block."""
    first, second, client, expected = r2_in_sync_with_blocks(cluster, "clean")
    write_without_the_replica(second, client, expected)
    client.flush()
    assert replication(first, "clean")["in_sync"] == [1]
    client.close()

    first.stop()
    first.start()
    client = attach(first, "clean", timeout=60)
    second.start()
    wait_until("node 2 back in sync", lambda: sorted(replication(first, "clean")["in_sync"]) == [1, 2], timeout=60)
    compared = replication(first, "clean")["served_here"]["resync_compared_bytes"]
    assert 2 * UNIT <= compared <= 4 * UNIT, compared
    client.close()

    first.stop()
    first.start()
    client = attach(first, "clean", timeout=60)
    wait_until("node 2 in sync after the restart", lambda: sorted(replication(first, "clean")["in_sync"]) == [1, 2], timeout=60)
    assert replication(first, "clean")["served_here"]["resync_compared_bytes"] == 0
    write_then_fail_over(client, first, second, "clean", expected, 30)


def settle_common_points(client, expected):
    """A few FLUSHes 150 ms apart with the replica in sync: each node keeps its common point
    with the other (at most every 100 ms; the replica learns its point from the next batch)."""
    for _ in range(4):
        client.write(0, expected[0])
        client.flush()
        time.sleep(0.15)


def test_a_catch_up_after_a_crash_or_a_take_over_compares_what_changed_since_the_common_point(cluster):
    """Each node keeps, per volume and peer, its store sequence at the last FLUSH both made
    durable while in sync (its common point). Part 1: node 2 (the replica) is killed -9,
    two blocks are written and one is trimmed without it, then node 1 (the primary) is killed
    -9 too, so its in-memory record of what node 2 lacks is gone. Both return; node 1
    serves again and node 2's catch-up compares what either changed since its common point
    (a handful of 64 KiB units), not the 64 MiB written stretch. Part 2: writes to four
    written blocks are held in node 1's transport and node 1 is killed -9 before they reach
    node 2, which takes the volume over (it holds every block as flushed, the trimmed one as
    zeroes) and writes one more. When node 1 returns, node 2 compares what node 1 changed
    since its point too: node 1's unflushed writes are replaced by node 2's copy. Finally
    node 2 is killed and the volume read through node 1 is node 2's."""
    first, second, client, expected = r2_in_sync_with_blocks(cluster, "common")
    settle_common_points(client, expected)

    write_without_the_replica(second, client, expected)
    client.trim(3 * CHUNK, BLOCK)
    expected[3 * CHUNK] = bytes(BLOCK)
    client.flush()
    assert replication(first, "common")["in_sync"] == [1]
    first.kill9()
    second.start()
    first.start()
    client = attach(first, "common", timeout=60)
    wait_until("node 2 back in sync", lambda: sorted(replication(first, "common")["in_sync"]) == [1, 2], timeout=60)
    compared = replication(first, "common")["served_here"]["resync_compared_bytes"]
    assert 3 * UNIT <= compared <= 12 * UNIT, compared
    settle_common_points(client, expected)

    first.faults([], delays=[{"node": second.node_id(), "method": METHOD_REPLICATE, "milliseconds": 3000}])
    for chunk in range(4, 8):
        client.write(chunk * CHUNK, block("unflushed", chunk))
    first.kill9()
    other = attach(second, "common", timeout=60)
    for offset, data in expected.items():
        assert other.read(offset, BLOCK) == data, f"node 2 does not hold the block at {offset} as flushed"
    expected[50 * CHUNK] = block("after", 50)
    other.write(50 * CHUNK, expected[50 * CHUNK])
    other.flush()
    first.start()
    wait_until("node 1 back in sync", lambda: sorted(replication(second, "common")["in_sync"]) == [1, 2], timeout=60)
    compared = replication(second, "common")["served_here"]["resync_compared_bytes"]
    assert 5 * UNIT <= compared <= 16 * UNIT, compared
    other.flush()
    second.kill9()
    last = attach(first, "common", timeout=60)
    for offset, data in expected.items():
        assert last.read(offset, BLOCK) == data, f"node 1 does not hold node 2's block at {offset}"


def catch_up_after_restarting_the_primary(first, name):
    """Node 1 (the primary) killed -9 and started again: it no longer knows what node 2 lacks,
    so it compares what either changed since its common point. Returns the client attached
    through node 1 again and the bytes compared."""
    first.kill9()
    first.start()
    client = attach(first, name, timeout=60)
    wait_until("node 2 back in sync", lambda: sorted(replication(first, name)["in_sync"]) == [1, 2], timeout=60)
    return client, replication(first, name)["served_here"]["resync_compared_bytes"]


def test_an_idle_volume_and_a_finished_catch_up_leave_a_fresh_common_point(cluster):
    """A common point is only as fresh as the last FLUSH both nodes know they made durable
    together. Part 1: 32 units are written and flushed, then the volume stays idle; the
    primary tells the replica which FLUSH is common with an empty batch once idle, so after
    node 1 is killed -9 and restarted, node 2's catch-up compares next to nothing (without
    that batch, node 2's point predates the 32 units, and they are compared). Part 2: node 2
    is killed, 32 units are written and flushed without it, node 2 returns and is caught up;
    the catch-up ends with a FLUSH, so with no client write after it, restarting node 1
    again compares next to nothing (without that FLUSH the last common point predates node
    2's absence)."""
    first, second, client, expected = r2_in_sync_with_blocks(cluster, "fresh")
    settle_common_points(client, expected)
    for chunk in range(20, 52):
        expected[chunk * CHUNK] = block("idle", chunk)
        client.write(chunk * CHUNK, expected[chunk * CHUNK])
    client.flush()
    time.sleep(2)
    client, compared = catch_up_after_restarting_the_primary(first, "fresh")
    assert compared <= 4 * UNIT, f"compared {compared} bytes after two idle seconds"

    second.kill9()
    for chunk in range(20, 52):
        expected[chunk * CHUNK] = block("absent", chunk)
        client.write(chunk * CHUNK, expected[chunk * CHUNK])
    client.flush()
    second.start()
    wait_until("node 2 caught up", lambda: sorted(replication(first, "fresh")["in_sync"]) == [1, 2], timeout=60)
    time.sleep(2)
    client, compared = catch_up_after_restarting_the_primary(first, "fresh")
    assert compared <= 4 * UNIT, f"compared {compared} bytes after a finished catch-up"
    client.flush()
    first.kill9()
    other = attach(second, "fresh", timeout=60)
    for offset, data in expected.items():
        assert other.read(offset, BLOCK) == data, f"node 2 lacks the block at {offset}"


def test_after_a_take_over_the_third_replica_is_caught_up_by_its_common_point(cluster):
    """Three storage nodes and an R=3 volume attached through node 1, every replica in sync,
    blocks written and flushed. Node 1 is killed -9 and node 2 takes the volume over, alone in
    sync. Node 3 made the same FLUSHes durable as node 2 while both were in sync, and each
    batch told it so: each keeps a common point with the other. Node 2's catch-up of node 3
    therefore compares a few 64 KiB units, not the 64 MiB written stretch. Node 1 returns,
    node 2 is killed, and the volume read through node 3 holds every block."""
    nodes = [cluster.add() for _ in range(3)]
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    first, second, third = nodes
    code, created = first.api("POST", "/api/v1/volumes",
                              {"name": "three", "size_bytes": SIZE, "replicas": 3}, timeout=30)
    assert code == 200, created
    client = attach(first, "three")
    wait_until("all three in sync", lambda: sorted(replication(first, "three")["in_sync"]) == [1, 2, 3], timeout=60)
    expected = {chunk * CHUNK: block("before", chunk) for chunk in range(8)}
    for offset, data in expected.items():
        client.write(offset, data)
    client.flush()
    settle_common_points(client, expected)

    first.kill9()
    other = attach(second, "three", timeout=60)
    wait_until("node 3 in sync with node 2", lambda: 3 in replication(second, "three")["in_sync"], timeout=60)
    compared = replication(second, "three")["served_here"]["resync_compared_bytes"]
    assert compared <= 4 * UNIT, compared
    expected[30 * CHUNK] = block("after", 30)
    other.write(30 * CHUNK, expected[30 * CHUNK])
    other.flush()
    first.start()
    wait_until("node 1 in sync again", lambda: sorted(replication(second, "three")["in_sync"]) == [1, 2, 3], timeout=60)
    second.kill9()
    last = attach(third, "three", timeout=60)
    for offset, data in expected.items():
        assert last.read(offset, BLOCK) == data, f"node 3 does not hold the block at {offset}"


def test_no_flushed_write_is_lost_when_the_primary_is_killed(cluster, workdir):
    """`keel bench durability write` (a FLUSH every 4 writes) runs through the primary; the
    primary is killed -9; the volume is attached through the other node, which takes over
    after the primary's lease, and `keel bench durability verify` finds every write that was
    acknowledged as flushed. The killed node then returns, catches up and is the replica of
    the next round. In the first round the primary is also the Raft leader, so the survivors
    must elect a leader before that leader can hand the volume over."""
    nodes = list(two_nodes_and_witness(cluster))
    witness = cluster.nodes[2]
    # The first node bootstrapped the cluster and usually still leads; if the witness took over,
    # restarting it moves the leadership back to a storage node.
    while cluster.leader() == witness.node_id():
        witness.stop()
        wait_until("a storage node leading", lambda: cluster.leader(via=nodes[0]) in (1, 2), timeout=30)
        witness.start()
    primary = [node.node_id() for node in nodes].index(cluster.leader())
    create_r2(nodes[primary], "dur")
    client = attach(nodes[primary], "dur")
    client.close()
    failovers = []
    leader_killed = []
    for round_index in range(ROUNDS):
        node = nodes[primary]
        other = nodes[1 - primary]
        wait_until("both replicas in sync", lambda: sorted(replication(node, "dur")["in_sync"]) == [1, 2], timeout=60)
        killed_id = node.node_id()
        assert replication(node, "dur")["primary"] == killed_id
        led = cluster.leader(via=other) == killed_id
        assert led or round_index > 0, "the first round must kill the Raft leader"
        leader_killed.append(led)
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
        assert replication(other, "dur")["primary"] == other.node_id()
        if led:
            assert cluster.leader(via=other) != killed_id
        verify = subprocess.run(
            [KEEL_BIN, "bench", "durability", "verify", "--target", f"nbd://{other.host}:{other.nbd_port}/dur",
             "--log", str(log)], capture_output=True, text=True, timeout=300)
        assert verify.returncode == 0, f"write:\n{output}\nverify:\n{verify.stdout}{verify.stderr}"
        assert "PASS: every acknowledged write survived" in verify.stdout, verify.stdout
        node.start()
        primary = 1 - primary
    print(f"failover (kill to serving through the other node): {['%.2f' % t for t in failovers]} s, "
          f"the primary also led Raft: {leader_killed} (nodes share one disk)")


def test_a_partitioned_primary_is_fenced(cluster):
    """The primary is cut off from the other nodes (the transport's fault injection). Its
    FLUSH fails (the replica does not answer, and it cannot reach Raft to drop it); the other
    node takes over once the primary's lease ran out; after the partition heals, the old
    primary still refuses to acknowledge anything for the volume to its client, and a client
    attaching through node 1 then is forwarded to node 2, where its writes land."""
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
    wait_until("node 1 knowing node 2 took over", lambda: replication(first, "fence")["primary"] == 2, timeout=30)
    try:
        client.write(3 * BLOCK, block("stale", 3))
        client.flush()
        raise AssertionError("the old primary acknowledged a FLUSH after another node took over")
    except (NbdError, OSError):
        pass
    assert other.read(3 * BLOCK, BLOCK) != block("stale", 3)
    # A client attaching through node 1 now is forwarded to node 2: its writes land there.
    # (Refused until node 1 has heard from node 2 again since the heal: it retries, as
    # kubelet's staging does.)
    def forwarded():
        try:
            return Client(first.host, first.nbd_port, "fence", timeout=30)
        except NbdError as refused:
            assert "not in sync; attach through the primary, node 2" in str(refused), refused
            return None
    through_first = wait_until("node 1 forwarding a client to node 2", forwarded, timeout=10)
    through_first.write(4 * BLOCK, block("forwarded", 4))
    through_first.flush()
    assert other.read(4 * BLOCK, BLOCK) == block("forwarded", 4)
    assert replication(second, "fence")["primary"] == 2


class Mount:
    """nbdfuse → loop device → ext4 → mount of one NBD export; torn down in reverse order
    (also after the server behind it died)."""

    def __init__(self, workdir, name):
        self.fuse_dir = workdir / f"fuse-{name}"
        self.mnt = workdir / f"mnt-{name}"
        self.fuse = None
        self.loop = None

    def attach(self, uri, mkfs):
        for tool, package in (("nbdfuse", "libnbd-bin"), ("mkfs.ext4", "e2fsprogs"), ("losetup", "mount")):
            if shutil.which(tool) is None:
                raise AssertionError(f"{tool} is not installed (Debian package {package})")
        self.fuse_dir.mkdir(exist_ok=True)
        self.mnt.mkdir(exist_ok=True)
        self.fuse = subprocess.Popen(["nbdfuse", str(self.fuse_dir), uri], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=open(self.fuse_dir.parent / "nbdfuse.log", "ab"))
        wait_until("nbdfuse exposing the export", lambda: (self.fuse_dir / "nbd").exists(), timeout=30)
        self.loop = subprocess.run(["losetup", "-f", "--show", str(self.fuse_dir / "nbd")],
                                   capture_output=True, text=True, check=True).stdout.strip()
        if mkfs:
            subprocess.run(["mkfs.ext4", "-q", "-F", self.loop], check=True)
        subprocess.run(["mount", self.loop, str(self.mnt)], check=True)
        return self.mnt

    def detach(self):
        subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True, timeout=60)
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], capture_output=True, timeout=60)
        if self.fuse:
            self.fuse.terminate()
            try:
                self.fuse.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.fuse.kill()
                self.fuse.wait(timeout=30)
        subprocess.run(["umount", "-l", str(self.fuse_dir)], capture_output=True, timeout=60)
        self.fuse = self.loop = None


def postgres_bindir():
    versions = sorted(p for p in os.listdir("/usr/lib/postgresql") if p.isdigit()) if os.path.isdir("/usr/lib/postgresql") else []
    if not versions:
        raise AssertionError("PostgreSQL is not installed (Debian package postgresql)")
    return f"/usr/lib/postgresql/{versions[-1]}/bin"


def as_postgres(args, check=True, **kwargs):
    return subprocess.run(["runuser", "-u", "postgres", "--", *args], check=check, capture_output=True, text=True, **kwargs)


def test_postgres_on_r2_survives_losing_the_replica_then_the_primary(cluster, workdir):
    """Postgres on ext4 on an R=2 volume (nbdfuse + loop through the primary). pgbench runs
    while the replica's node is killed -9: pgbench finishes without an error. Then a client
    commits numbered rows one by one while the primary's node is killed -9; the volume is
    attached through the other node, Postgres recovers there, every row whose COMMIT returned
    is present, and pg_amcheck finds no corruption."""
    bindir = postgres_bindir()
    first, second = two_nodes_and_witness(cluster)
    code, created = first.api("POST", "/api/v1/volumes", {"name": "pg", "size_bytes": 2 << 30, "replicas": 2})
    assert code == 200, created
    mounts = [Mount(workdir, "first")]
    postgres = {"pid": None, "pgdata": None}
    port = "54331"
    try:
        mnt = mounts[-1].attach(f"nbd://{first.host}:{first.nbd_port}/pg", mkfs=True)
        wait_until("both replicas in sync", lambda: sorted(replication(first, "pg")["in_sync"]) == [1, 2], timeout=60)
        pgdata = mnt / "pgdata"
        postgres["pgdata"] = pgdata
        pgdata.mkdir()
        shutil.chown(pgdata, "postgres", "postgres")
        # A short socket directory (a socket path has at most 107 bytes); no data goes there.
        run = Path(tempfile.mkdtemp(prefix="keel-pg-"))
        shutil.chown(run, "postgres", "postgres")
        conn = ["-h", str(run), "-p", port]

        def start_postgres():
            as_postgres([f"{bindir}/pg_ctl", "-D", str(pgdata), "-w", "-l", str(pgdata / "pg.log"), "-o",
                         f"-p {port} -k {run} -c listen_addresses='' -c synchronous_commit=on -c fsync=on",
                         "start"], timeout=180)
            postgres["pid"] = int((pgdata / "postmaster.pid").read_text().split()[0])

        as_postgres([f"{bindir}/initdb", "-D", str(pgdata), "--no-instructions", "-A", "trust"], timeout=300)
        start_postgres()
        as_postgres(["pgbench", *conn, "-i", "-s", "5", "postgres"], timeout=600)
        bench = subprocess.Popen(["runuser", "-u", "postgres", "--", "pgbench", *conn, "-c", "4", "-j", "2",
                                  "-T", "15", "postgres"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(5)
        second.kill9()
        output, _ = bench.communicate(timeout=300)
        assert bench.returncode == 0, output
        print("pgbench on R=2 with the replica killed mid-run:",
              [line for line in output.splitlines() if line.startswith("tps")], "(nodes share one disk)")
        assert replication(first, "pg")["in_sync"] == [1]
        second.start()
        wait_until("the replica back in sync", lambda: sorted(replication(first, "pg")["in_sync"]) == [1, 2], timeout=120)

        as_postgres(["psql", *conn, "-d", "postgres", "-c", "CREATE TABLE committed (n integer PRIMARY KEY)"])
        committed = []
        writer = subprocess.Popen(
            ["runuser", "-u", "postgres", "--", "psql", *conn, "-d", "postgres", "-X", "-q", "-v", "ON_ERROR_STOP=1"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # Each INSERT commits on its own; psql echoes the number only after the COMMIT returned.
        killed = False
        for n in range(1, 100000):
            try:
                writer.stdin.write(f"INSERT INTO committed VALUES ({n});\n\\echo {n}\n")
                writer.stdin.flush()
                line = writer.stdout.readline().strip()
            except (BrokenPipeError, OSError):
                break
            if line != str(n):
                break
            committed.append(n)
            if n == 300:
                first.kill9()
                killed = True
        assert killed and len(committed) >= 300, committed[-5:]
        writer.kill()
        writer.wait()
        os.kill(postgres["pid"], 9)
        postgres["pid"] = None
        subprocess.run(["pkill", "-9", "-f", f"postgres -D {pgdata}"], capture_output=True)
        mounts[-1].detach()

        attach(second, "pg", timeout=60).close()
        mounts.append(Mount(workdir, "second"))
        mnt = mounts[-1].attach(f"nbd://{second.host}:{second.nbd_port}/pg", mkfs=False)
        pgdata = mnt / "pgdata"
        postgres["pgdata"] = pgdata
        (pgdata / "postmaster.pid").unlink(missing_ok=True)
        start_postgres()
        rows = as_postgres(["psql", *conn, "-d", "postgres", "-At", "-c", "SELECT n FROM committed"]).stdout.split()
        present = {int(row) for row in rows}
        lost = [n for n in committed if n not in present]
        assert not lost, f"{len(lost)} committed rows lost, first {lost[:10]}"
        as_postgres(["psql", *conn, "-d", "postgres", "-c", "CREATE EXTENSION IF NOT EXISTS amcheck"])
        as_postgres([f"{bindir}/pg_amcheck", *conn, "-d", "postgres", "--heapallindexed"], timeout=300)
        print(f"{len(committed)} committed rows, all present after the primary's node was killed "
              f"(nodes share one disk)")
    finally:
        if postgres["pid"] is not None:
            as_postgres([f"{bindir}/pg_ctl", "-D", str(postgres["pgdata"]), "-w", "-m", "immediate", "stop"],
                        check=False, timeout=120)
        for mount in reversed(mounts):
            mount.detach()


def test_a_replica_on_a_node_that_stays_down_is_rebuilt_elsewhere(cluster, workdir):
    """Three storage nodes, an R=2 volume on nodes 1 and 2. Node 2 is killed and stays down
    past `replica_move_after_ms`: its replica moves to node 3 through Raft and node 3 is
    caught up and put in sync. Node 2 returns; draining node 3 copies the replica back to node
    2 at once (node 3's copy stays in sync until node 2's is, then goes), and copies two R=1 volumes nobody attached off it, one to each other node (the
    less provisioned first), which then holds its one replica with every block. The primary is
    killed, and the volume attached through node 2 holds every flushed write."""
    config = workdir / "fast-moves.toml"
    config.write_text("[cluster]\nsuspect_after_ms = 1000\ndown_after_ms = 2000\nreplica_move_after_ms = 1000\n")
    nodes = [cluster.add(extra_args=["--config", str(config)]) for _ in range(3)]
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    first, second, third = nodes
    create_r2(first, "moving")
    client = attach(first, "moving")
    wait_until("both replicas in sync", lambda: sorted(replication(first, "moving")["in_sync"]) == [1, 2])
    expected = {}
    for index in range(128):
        expected[index] = block("moving", index)
        client.write(index * BLOCK, expected[index])
    client.flush()

    second.kill9()
    wait_until("the replica moved to node 3 and in sync",
               lambda: (replication(first, "moving")["replicas"] == [1, 3]
                        and sorted(replication(first, "moving")["in_sync"]) == [1, 3]), timeout=90)
    for index in range(128, 160):
        expected[index] = block("after-move", index)
        client.write(index * BLOCK, expected[index])
    client.flush()

    second.start()
    wait_until("node 2 back up", lambda: all(n["record"]["state"] == "Up" for n in first.status()["nodes"]), timeout=60)
    # Draining node 3 copies its replica at once, here back to node 2, and copies the only
    # replica of each R=1 volume created there (nobody attached them) to another node.
    solo_blocks = {}
    for name in ("solo", "solo2"):
        code, created = third.api("POST", "/api/v1/volumes", {"name": name, "size_bytes": SIZE}, timeout=30)
        assert code == 200, created
        solo = attach(third, name)
        solo_blocks[name] = write_blocks(solo, name, range(0, SIZE // BLOCK, 97))
        solo.close()
    code, info = first.api("GET", "/api/v1/nodes/n3")
    assert code == 200 and info["replicas"] == [
        {"volume": "moving", "primary": False, "in_sync": True},
        {"volume": "solo", "primary": True, "in_sync": True},
        {"volume": "solo2", "primary": True, "in_sync": True}], info
    # What the R=2 volume's replication goes through during the drain, sampled: node 3's copy
    # must stay in sync until node 2's new one is, and only then go.
    seen = []
    sampling = threading.Event()

    def sample():
        while not sampling.is_set():
            info = replication(first, "moving")
            state = (info["replicas"], sorted(info["in_sync"]))
            if not seen or seen[-1] != state:
                seen.append(state)
            time.sleep(0.05)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    drained = first.cli("node", "drain", "n3").stdout
    assert ("n3 draining: 3 volume replica(s) to move off" in drained
            and "2 of them the volume's only copy (R=1): each is copied to another storage node" in drained
            and "primary:" not in drained), drained
    try:
        wait_until("the replica moved off the draining node",
                   lambda: (replication(first, "moving")["replicas"] == [1, 2]
                            and sorted(replication(first, "moving")["in_sync"]) == [1, 2]), timeout=90)
    finally:
        sampling.set()
        sampler.join(timeout=10)
    if seen[-1] != ([1, 2], [1, 2]):
        seen.append(([1, 2], [1, 2]))
    assert seen[0] == ([1, 3], [1, 3]) and seen[-1] == ([1, 2], [1, 2]), seen
    # (The copy may be in sync by the first sample that shows it: a 2 s check removes node 3's.)
    assert seen[1][0] == [1, 3, 2] and 3 in seen[1][1], f"node 3's copy went before node 2's was made: {seen}"
    assert all(len(in_sync) >= 2 for _, in_sync in seen), f"fewer than 2 copies in sync: {seen}"

    def copied_off():
        """Where the R=1 volumes are, once each is on one node other than node 3."""
        placed = {}
        for name in ("solo", "solo2"):
            # The primary answers (another node redirects).
            answers = [node.api("GET", f"/api/v1/volumes/{name}") for node in nodes]
            info = next((info["replication"] for code, info in answers if code == 200), None)
            if info is None or len(info["replicas"]) != 1 or info["primary"] == 3:
                return None
            placed[name] = info
        return placed
    placed = wait_until("each R=1 volume's copy alone on another node", copied_off, timeout=90)
    # Nodes 1 and 2 hold "moving" alike: the first copy goes to the lower id of the two, or to
    # node 2 if "moving" was not back there yet; the second to the other node either way.
    assert sorted(info["primary"] for info in placed.values()) == [1, 2], placed
    for info in placed.values():
        assert (info["factor"], info["replicas"], info["in_sync"]) == (1, [info["primary"]], [info["primary"]]), placed
    wait_until("node 3 drained",
               lambda: "KEEL_NODE_DRAINING: node n3 is drained: it holds no volume replica" in first.cli("status").stdout,
               timeout=60)
    # What placement weighed, as operators see it: "moving" and one R=1 volume on each node.
    code, listed = third.api("GET", "/api/v1/nodes")
    assert code == 200, listed
    assert {node["record"]["id"]: node["provisioned_bytes"] for node in listed} == {
        1: 2 * SIZE, 2: 2 * SIZE, 3: 0}, listed
    listing = third.cli("node", "list").stdout.splitlines()
    assert "PROVISIONED" in listing[0] and "OF CAPACITY" in listing[0], listing
    for name, shown in (("n1", "128.0 MiB"), ("n2", "128.0 MiB"), ("n3", "0 B")):
        assert any(line.split()[1] == name and shown in line for line in listing[1:]), listing
    for name, blocks in solo_blocks.items():
        solo = attach(nodes[placed[name]["primary"] - 1], name)
        for index, data in blocks.items():
            assert solo.read(index * BLOCK, BLOCK) == data, f"{name} block {index} lost in the copy"
        solo.close()
    first.kill9()
    other = attach(second, "moving", timeout=60)
    for index, data in expected.items():
        assert other.read(index * BLOCK, BLOCK) == data, f"block {index} lost"
    assert replication(second, "moving")["primary"] == 2


def test_a_nearly_full_node_takes_no_new_replica(cluster, workdir):
    """Three storage nodes; node 2 runs with `nearfull_percent = 1`, which this disk is fuller
    than: it records itself nearly full through Raft. The other nodes' `keel status` warns
    (KEEL_NODE_NEARFULL; node 2's own says KEEL_NEARFULL) and `keel node list` says so. An R=2 volume created on node 1 gets
    its second replica on node 3, not on node 2 (the lower id, which placement picks
    otherwise); raising it to R=3 is refused, naming nearly full nodes. Node 2 restarted with
    the check off clears the mark, and R=3 then places the third replica there."""
    total, used, _ = shutil.disk_usage(workdir)
    assert used * 100 > total, f"the test needs a disk more than 1% used: {used} of {total} bytes"
    config = workdir / "nearfull.toml"
    config.write_text("nearfull_percent = 1\n")
    first = cluster.add()
    second = cluster.add(extra_args=["--config", str(config)])
    third = cluster.add()
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})

    def marked(node):
        code, listed = node.api("GET", "/api/v1/nodes")
        assert code == 200, listed
        return {entry["record"]["id"] for entry in listed if entry["nearfull"]}
    wait_until("node 2 recorded nearly full", lambda: marked(first) == {2}, timeout=30)
    status = third.cli("status").stdout
    assert "KEEL_NODE_NEARFULL" in status and "node n2 is nearly full" in status, status
    own = second.cli("status").stdout
    assert "KEEL_NEARFULL" in own and "KEEL_NODE_NEARFULL" not in own, own
    listing = first.cli("node", "list").stdout.splitlines()
    assert [line.split()[1] for line in listing if "nearly full: no new replicas" in line] == ["n2"], listing

    create_r2(first, "spared")
    assert replication(first, "spared")["replicas"] == [1, 3]
    code, answer = first.api("POST", "/api/v1/volumes/spared/replication", {"replicas": 3}, timeout=30)
    assert code != 200 and "not nearly full" in answer["error"], (code, answer)
    assert replication(first, "spared")["replicas"] == [1, 3]

    config.write_text("nearfull_percent = 100\n")
    second.kill9()
    second.start()
    wait_until("node 2's mark cleared", lambda: marked(first) == set(), timeout=30)
    assert "KEEL_NODE_NEARFULL" not in third.cli("status").stdout
    code, answer = first.api("POST", "/api/v1/volumes/spared/replication", {"replicas": 3}, timeout=30)
    assert code == 200, answer
    assert replication(first, "spared")["replicas"] == [1, 3, 2]


@pytest.fixture
def small_second_disk(cluster, workdir):
    """Node 2's data directory as a 192 MiB ext4 of its own (loop-mounted); unmounted after
    the cluster stops."""
    if shutil.which("mkfs.ext4") is None:
        pytest.fail("mkfs.ext4 is not installed (Debian package e2fsprogs); scripts/test.sh installs it")
    image, mount = workdir / "n2.img", workdir / "n2"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(192 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    yield mount
    cluster.stop()
    subprocess.run(["umount", str(mount)], check=False)


def fill_second_node(cluster, workdir, settings=""):
    """Two storage nodes (16 MiB store reserve, 8 MiB segments, `settings` for [cluster]) and a
    witness; node 2 (on `small_second_disk`) holds 96 MiB of an R=1 volume `ballast`, then
    96 MiB written through node 1 to the R=2 volume `fills`, flushed every 8 MiB, fill it.
    Returns (node 1, node 2, the config file, the data written to `fills`)."""
    config = workdir / "small.toml"
    config.write_text("[store]\nsegment_size_max_bytes = 8388608\nreserve_bytes = 16777216\n"
                      f"[cluster]\n{settings}\n")
    first, second = two_nodes_and_witness(cluster, extra_args=["--config", str(config)])
    for node, name, replicas in ((second, "ballast", 1), (first, "fills", 2)):
        code, created = node.api("POST", "/api/v1/volumes",
                                 {"name": name, "size_bytes": 96 << 20, "replicas": replicas}, timeout=30)
        assert code == 200, created
    write_random(attach(second, "ballast"), 96 << 20)
    client = attach(first, "fills")
    data = write_flushing(client, 96 << 20)
    client.close()
    return first, second, config, data


def write_flushing(client, size):
    """Writes `size` random bytes from offset 0 in 1 MiB requests at full speed, a FLUSH every
    8 MiB and one at the end; returns them."""
    data = os.urandom(size)
    for offset in range(0, size, 1 << 20):
        client.write(offset, data[offset:offset + (1 << 20)])
        if offset % (8 << 20) == 0:
            client.flush()
    client.flush()
    return data


def assert_serves(node, name, data):
    """Attaches `name` through `node` and reads `data` back, 1 MiB at a time."""
    client = attach(node, name, timeout=60)
    for offset in range(0, len(data), 1 << 20):
        assert client.read(offset, 1 << 20) == data[offset:offset + (1 << 20)], f"MiB {offset >> 20} differs"
    client.close()


def test_a_replica_whose_disk_fills_stays_out_of_sync_says_why_and_catches_up_once_there_is_room(
        cluster, workdir, small_second_disk):
    """Node 2's data directory is a 192 MiB ext4 of its own (loop-mounted), node 1's the big
    disk; the store keeps 16 MiB in reserve on both. Node 2 holds 96 MiB of an R=1 volume,
    and 96 MiB written through node 1 to an R=2 volume then fill it: its store refuses the
    replica's writes (no space), while the client's writes and FLUSHes all succeed (the
    minimum in sync is 1). Then:
    - node 2's own health is KEEL_FULL, and node 1's names node 2 nearly full
      (KEEL_NODE_NEARFULL) and says why its replica is behind: KEEL_VOLUME_DEGRADED carries
      the replica's own "no space left" answer, as does `volume info`'s catch-up entry;
      node 2, which does not serve the volume, asks node 1 and says the same in its own
      health and `volume info` (`primary_status`);
    - the catch-up keeps trying, further and further apart (at most 3 more tries in 10 s,
      where a try a second would make about 10);
    - once the R=1 volume is deleted and node 2's store compacted (what KEEL_FULL tells the
      user to do), node 2's mark clears, the replica catches up and joins the in-sync set,
      and with node 1 killed it serves every byte."""
    first, second, _, data = fill_second_node(cluster, workdir)
    assert "KEEL_FULL" in second.cli("status", check=False).stdout
    def behind():
        status = first.cli("status", check=False).stdout
        if "node n2 is nearly full" not in status:
            return None
        degraded = [line for line in status.splitlines() if "KEEL_VOLUME_DEGRADED" in line]
        if not degraded or "no space left on" not in degraded[0]:
            return None
        return degraded[0]
    line = wait_until("node 1's health naming node 2 full", behind, timeout=30)
    assert "behind: node 2 (n2; nearly full; " in line and "its catch-up failed" in line, line
    assert "free space on the nearly full node" in line, line

    def catch_up():
        entries = replication(first, "fills")["served_here"]["catching_up"]
        assert [entry["node"] for entry in entries] == [2], entries
        return entries[0]
    entry = catch_up()
    assert entry["failures"] >= 1 and "no space left on" in entry["last_failure"], entry
    # Node 2 asks the primary for its view.
    on_second = [line for line in second.cli("status", check=False).stdout.splitlines()
                 if "KEEL_VOLUME_DEGRADED" in line]
    assert on_second and "behind: node 2 (n2; nearly full; " in on_second[0], on_second
    assert "its catch-up failed" in on_second[0] and "no space left on" in on_second[0], on_second
    seen_from_second = replication(second, "fills")
    assert seen_from_second["served_here"] is None, seen_from_second
    assert seen_from_second["primary_status_error"] is None, seen_from_second
    entries = seen_from_second["primary_status"]["catching_up"]
    assert [e["node"] for e in entries] == [2] and "no space left on" in entries[0]["last_failure"], entries
    before = entry["failures"]
    time.sleep(10)
    after = catch_up()["failures"]
    assert after - before <= 3, f"{after - before} catch-up tries in 10 s on a full replica"
    assert sorted(replication(first, "fills")["in_sync"]) == [1]

    second.cli("volume", "delete", "ballast")
    second.cli("store", "compact")
    wait_until("the replica caught up once there is room",
               lambda: sorted(replication(first, "fills")["in_sync"]) == [1, 2], timeout=120)
    assert "KEEL_FULL" not in second.cli("status", check=False).stdout
    wait_until("node 2's mark cleared",
               lambda: "KEEL_NODE_NEARFULL" not in first.cli("status", check=False).stdout, timeout=30)

    first.kill9()
    assert_serves(second, "fills", data)


def test_a_replica_refusing_its_catch_ups_that_long_moves_to_a_node_with_room(cluster, workdir, small_second_disk):
    """As above, node 2's small disk fills with an R=1 volume of its own and the replica of an
    R=2 volume written through node 1, and node 2 refuses the replica's catch-ups. Node 4, a
    storage node with room, joins; once node 2 has refused for `replica_move_after_ms` (4 s
    here), the primary moves the replica to node 4 (node 2 is up, so only its refusals make
    it move), which catches up and joins the in-sync set, and serves every byte with node 1
    killed. Node 2's copy is erased."""
    first, second, config, data = fill_second_node(cluster, workdir, "replica_move_after_ms = 4000")
    wait_until("node 2 refusing the replica's catch-ups", lambda: any(
        "no space left on" in (entry["last_failure"] or "")
        for entry in replication(first, "fills")["served_here"]["catching_up"]), timeout=30)
    assert replication(first, "fills")["replicas"] == [1, 2]

    fourth = cluster.add(extra_args=["--config", str(config)])
    wait_until("the replica moved to node 4 and in sync", lambda: (
        (lambda info: info["replicas"] == [1, 4] and sorted(info["in_sync"]) == [1, 4])(
            replication(first, "fills"))), timeout=90)
    assert "replica moved off a node that refused its catch-ups that long" in first.log()
    # What node 2 holds comes back to its own volume's 96 MiB once its copy is erased.
    def live_on_second():
        code, status = second.api("GET", "/api/v1/status")
        assert code == 200, status
        return status["store"]["live_raw_bytes"]
    wait_until("node 2's copy erased", lambda: live_on_second() <= (96 << 20) + (1 << 20), timeout=60)

    first.kill9()
    assert_serves(fourth, "fills", data)


def pair_with_a_failing_disk(cluster, workdir, failing, name):
    """Nodes 1 and 2 and a witness, node `failing` (1 or 2) with tests/failsync.c loaded; an
    R=2 volume `name` attached through node 1, 256 blocks written and flushed, both replicas
    in sync. Returns (node 1, node 2, the trigger file that fails node `failing`'s next
    segment sync, the client, the blocks written by index)."""
    fault, trigger = failsync.library(workdir)
    first = cluster.add(env=fault if failing == 1 else None)
    second = cluster.add(env=fault if failing == 2 else None)
    cluster.add(witness=True)
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    create_r2(first, name)
    client = attach(first, name)
    expected = write_blocks(client, "before", range(256))
    wait_until("both replicas in sync", lambda: sorted(replication(first, name)["in_sync"]) == [1, 2],
               timeout=60)
    return first, second, trigger, client, expected


def exits_on_its_own(node):
    """Waits for `node`'s process to exit by itself after its store failed a sync: with an
    error, its log saying why."""
    wait_until(f"{node.name} exiting on its own", lambda: node.proc.poll() is not None, timeout=60)
    assert node.proc.returncode != 0, node.log()[-2000:]
    log = node.log()
    assert "store poisoned: refusing writes until reopened" in log, log[-2000:]
    assert "this node's store failed a sync and refuses writes: shutting down for a restart" in log, log[-2000:]
    node.proc = None


def serves_blocks(node, name, blocks, where):
    """Attaches through `node` (taking the volume over if need be) and reads back every
    block of `blocks` (by index)."""
    client = attach(node, name, timeout=60)
    for index, data in blocks.items():
        assert client.read(index * BLOCK, BLOCK) == data, f"block {index} {where}"
    client.close()


def test_a_replica_whose_disk_fails_a_sync_leaves_the_in_sync_set_and_returns_after_a_restart(cluster, workdir):
    """Node 2's disk fails one sync of its store (EIO, injected into its process with
    LD_PRELOAD) while a client writes and FLUSHes an R=2 volume through node 1:
    - node 2's store refuses writes from then on (the kernel may have dropped what the sync
      covered), and the process exits with an error for its supervisor to restart it;
    - node 1 takes node 2 out of the in-sync set, and not one of the client's requests fails;
    - node 2, restarted, replays its log, is caught up and rejoins the set;
    - with node 1 killed, node 2 serves every block the client flushed."""
    first, second, trigger, client, expected = pair_with_a_failing_disk(cluster, workdir, 2, "syncs")
    writer, flushed, failure = write_in_background(client, "during", range(256, 4096), flush_every=8)
    try:
        time.sleep(0.5)
        trigger.touch()
        wait_until("node 2's disk failing a sync", lambda: not trigger.exists(), timeout=30)
        wait_until("node 2 out of the in-sync set", lambda: replication(first, "syncs")["in_sync"] == [1],
                   timeout=30)
    finally:
        writer.join(timeout=120)
    assert not writer.is_alive()
    assert not failure, f"a client request failed: {failure}"
    exits_on_its_own(second)
    expected.update(flushed)
    expected.update(write_blocks(client, "after", range(4096, 4352)))
    assert replication(first, "syncs")["in_sync"] == [1]

    second.start()
    assert "KEEL_STORE_POISONED" not in second.cli("status", check=False).stdout
    wait_until("node 2 caught up and back in the set",
               lambda: sorted(replication(first, "syncs")["in_sync"]) == [1, 2], timeout=90)
    client.close()

    first.kill9()
    serves_blocks(second, "syncs", expected, "on node 2")


def test_a_primary_whose_disk_fails_a_sync_stops_and_its_replica_takes_the_volume_over(cluster, workdir):
    """Node 1, the primary of an R=2 volume, has its disk fail one sync (EIO, injected with
    LD_PRELOAD) while a client attached there writes and FLUSHes:
    - the request that met the failure fails (EIO): nothing is acknowledged that node 1's
      store may have dropped;
    - node 1's process exits with an error, as after a crash (left running, it stayed the
      primary, failing every write, also those forwarded from node 2);
    - attached through node 2, the volume is taken over there and holds every block the
      client flushed;
    - node 1, restarted, is caught up and rejoins the set; with node 2 killed it takes the
      volume back over and serves every block too."""
    first, second, trigger, client, expected = pair_with_a_failing_disk(cluster, workdir, 1, "stops")
    writer, flushed, failure = write_in_background(client, "during", range(256, 4096), flush_every=8)
    time.sleep(0.5)
    trigger.touch()
    writer.join(timeout=120)
    assert not writer.is_alive()
    assert not trigger.exists(), "node 1's disk never failed a sync"
    assert len(failure) == 1 and isinstance(failure[0], NbdError) and "errno 5" in str(failure[0]), failure
    expected.update(flushed)
    exits_on_its_own(first)
    client.close()

    client = attach(second, "stops", timeout=60)
    assert (lambda info: (info["primary"], info["in_sync"]))(replication(second, "stops")) == (2, [2])
    for index, data in expected.items():
        assert client.read(index * BLOCK, BLOCK) == data, f"block {index} on node 2"
    expected.update(write_blocks(client, "after", range(4096, 4352)))
    client.close()

    first.start()
    wait_until("node 1 caught up and back in the set",
               lambda: sorted(replication(second, "stops")["in_sync"]) == [1, 2], timeout=90)
    second.kill9()
    serves_blocks(first, "stops", expected, "on node 1")


def test_a_primary_whose_disk_runs_low_hands_the_volume_to_a_replica_with_room(cluster, workdir, small_second_disk):
    """Node 2, on its small disk with 32 MiB of store reserve, holds 96 MiB of an R=1 volume and
    is the primary of an R=2 volume attached there, through which 96 MiB more are written at
    full speed, flushed every 8 MiB: more than the room left. Once its store has less than
    twice its reserve free, node 2 hands the volume to node 1, its replica in sync, which has
    room, and its client goes on through node 1 (forwarded) without noticing: every write and
    FLUSH succeeds, where without the hand-off the store refuses them (no space). Node 2's own
    replica then refuses the stream and falls out of sync; a client attaching to node 2 later
    is forwarded too; both read back every byte, as does one through node 1 with node 2
    killed."""
    config = workdir / "low.toml"
    config.write_text("[store]\nsegment_size_max_bytes = 8388608\nreserve_bytes = 33554432\n")
    first, second = two_nodes_and_witness(cluster, extra_args=["--config", str(config)])
    for name in ("ballast", "fills"):
        code, created = second.api("POST", "/api/v1/volumes", {
            "name": name, "size_bytes": 96 << 20, "replicas": 1 if name == "ballast" else 2}, timeout=30)
        assert code == 200, created
    write_random(attach(second, "ballast"), 96 << 20)
    assert replication(second, "fills")["primary"] == 2

    client = attach(second, "fills")
    data = write_flushing(client, 96 << 20)
    info = replication(first, "fills")
    assert info["primary"] == 1, info
    assert "this node's store is nearly out of space: handed the volume to another replica" in second.log()
    wait_until("node 2's replica out of sync", lambda: replication(first, "fills")["in_sync"] == [1], timeout=30)
    for offset in range(0, len(data), 1 << 20):
        assert client.read(offset, 1 << 20) == data[offset:offset + (1 << 20)], f"MiB {offset >> 20} differs"
    client.close()
    assert_serves(second, "fills", data)

    second.kill9()
    assert_serves(first, "fills", data)


def test_a_client_attaching_to_a_replica_gets_the_volume_handed_over_unless_it_is_in_use(cluster, workdir):
    """An R=2 volume on nodes 1 and 2, its primary node 1 (as when a pod moves to another node
    holding a replica, both nodes up):
    - while a client is attached to node 1, one attaching to node 2 is forwarded to node 1
      (node 1 keeps the volume); both read what the other wrote;
    - with both gone, a client attaching to node 2 gets the volume handed over: node 2 serves
      it as primary (node 1 quiesces it and Raft names node 2) with node 1 still in sync,
      reading every byte and writing on;
    - node 2 restarted (serving nothing), a client attaching to node 1 gets the volume back
      the same way, from a node that does not serve it (Raft names node 1 at once), and
      reads every byte, the last write through node 2 included."""
    first, second = two_nodes_and_witness(cluster)
    create_r2(first, "moving")
    assert replication(first, "moving")["primary"] == 1
    on_first = attach(first, "moving")
    data = bytearray(write_random(on_first, 4 << 20))

    on_second = attach(second, "moving")
    assert "node 1 keeps the volume: a client is attached to it there" in second.log()
    assert replication(first, "moving")["primary"] == 1
    later = os.urandom(1 << 20)
    on_second.write(4 << 20, later)
    on_second.flush()
    data += later
    assert on_first.read(4 << 20, 1 << 20) == later
    assert on_second.read(0, 4 << 20) == bytes(data[:4 << 20])
    on_first.close()
    on_second.close()

    epoch = replication(second, "moving")["epoch"]
    moved = attach(second, "moving")
    info = replication(second, "moving")
    # The hand-off's epoch, then node 2's own with the same in-sync set (no catch-up).
    assert info["primary"] == 2 and info["served_here"] is not None, info
    assert (info["epoch"], sorted(info["in_sync"])) == (epoch + 2, [1, 2]), info
    assert "handed the volume to the node a client attached to" in first.log()
    assert moved.read(0, len(data)) == bytes(data)
    last = os.urandom(1 << 20)
    moved.write(5 << 20, last)
    moved.flush()
    data += last
    moved.close()

    second.kill9()
    second.start()
    wait_until("node 2 back", lambda: second.api("GET", "/api/v1/status")[0] == 200, timeout=30)
    back = attach(first, "moving")
    assert replication(first, "moving")["primary"] == 1
    assert second.log().count("handed the volume to the node a client attached to") == 1
    assert back.read(0, len(data)) == bytes(data)
    back.close()


def test_a_drain_hands_primaries_off_and_forwards_the_clients_attached_there(cluster, workdir):
    """Three storage nodes; node 1 the primary of an R=2 volume attached there through NBD, of
    an R=3 volume nobody attached, and the only replica of an R=1 volume attached there too.
    Draining node 1 hands each primary to another replica in sync; the R=2 volume's replica on
    node 1 then moves to node 3; the R=1 volume is copied to the less provisioned of nodes 2 and 3
    (which depends on whether that move was recorded first), handed to it, and its copy on
    node 1 removed, R staying 1. The clients attached to node 1 notice nothing: they go on
    writing and flushing through the new primaries (forwarded) and read back every block; nor
    does a client attached to the node without a replica, whose session on node 1 held a write
    not yet flushed. The R=3 volume's replica has nowhere to go and stays; a client attaching
    to node 1 is forwarded to the new primary rather than take the volume back; the drain's
    answer and `keel status` name it as unable to move. Lowering that volume's R removes the
    draining node's replica, and node 1 is drained. Meanwhile each node's health lists its
    clients that are forwarded, with the node their requests go to, until they detach."""
    config = cluster_config(workdir, "handing", "replica_move_after_ms = 1000")
    nodes = [cluster.add(extra_args=config) for _ in range(3)]
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    first, second, _ = nodes

    def replication(_node, name):
        """The volume's replication as its primary answers it (another node redirects)."""
        for node in nodes:
            code, info = node.api("GET", f"/api/v1/volumes/{name}")
            if code == 200:
                return info["replication"]
        raise AssertionError(f"no node answers for {name}: {info}")

    create_r2(first, "attached")
    code, created = first.api("POST", "/api/v1/volumes", {"name": "wide", "size_bytes": SIZE, "replicas": 3},
                              timeout=30)
    assert code == 200, created
    for name, count in (("attached", 2), ("wide", 3)):
        wait_until(f"{name}'s replicas in sync", lambda: len(replication(first, name)["in_sync"]) == count, timeout=60)
    placed = replication(first, "attached")
    assert placed["primary"] == 1 and 1 in placed["replicas"], placed
    other = next(node for node in placed["replicas"] if node != 1)
    client = attach(first, "attached")
    expected = write_blocks(client, "before-drain", range(64))
    # A client on the node without a replica: forwarded to node 1, with a write acknowledged
    # and not flushed when the volume changes hands.
    free = next(node for node in (2, 3) if node not in placed["replicas"])
    remote = attach(nodes[free - 1], "attached")
    far = SIZE // BLOCK - 2
    expected[far] = block("forwarded", far)
    remote.write(far * BLOCK, expected[far])
    wide = attach(first, "wide")
    wide.write(0, block("wide", 0))
    wide.flush()
    wide.close()
    code, created = first.api("POST", "/api/v1/volumes", {"name": "solo", "size_bytes": SIZE}, timeout=30)
    assert code == 200, created
    solo = attach(first, "solo")
    solo_expected = write_blocks(solo, "solo-before-drain", range(0, SIZE // BLOCK, 61))
    # Serving a volume starts its replicas out of sync until their catch-up compared what they
    # lack (tens of ms): a drain meanwhile rightly answers that a catch-up is under way.
    for name, count in (("attached", 2), ("wide", 3)):
        wait_until(f"{name}'s replicas in sync", lambda: len(replication(first, name)["in_sync"]) == count, timeout=60)

    drained = first.cli("node", "drain", "n1").stdout
    assert ("n1 draining: 3 volume replica(s) to move off" in drained
            and "2 of them primary: each is handed to another replica in sync first" in drained
            and "1 of them the volume's only copy (R=1): each is copied to another storage node" in drained
            and "1 of them cannot move as things are" in drained
            and ("volume wide: every storage node that is up, not draining and not nearly full holds one "
                 "of its replicas: add a node, or lower the volume's R") in drained), drained

    def handed():
        attached, wide, solo = (replication(first, name) for name in ("attached", "wide", "solo"))
        return (attached["primary"] == other and sorted(attached["replicas"]) == [2, 3]
                and sorted(attached["in_sync"]) == [2, 3] and wide["primary"] == 2
                and sorted(wide["in_sync"]) == [1, 2, 3]
                and solo["factor"] == 1 and solo["primary"] in (2, 3) and solo["replicas"] == [solo["primary"]])

    # The clients write while the volumes change hands, back to back: not one request fails.
    index = 64
    deadline = time.monotonic() + 120
    slowest = 0.0
    while not handed():
        assert time.monotonic() < deadline, [replication(first, name) for name in ("attached", "wide", "solo")]
        expected[index] = block("during-drain", index)
        solo_expected[index] = block("solo-during-drain", index)
        started = time.monotonic()
        client.write(index * BLOCK, expected[index])
        client.flush()
        solo.write(index * BLOCK, solo_expected[index])
        solo.flush()
        slowest = max(slowest, time.monotonic() - started)
        index += 1
    assert index > 64, "the drain finished before the client wrote through it"
    print(f"{index - 64} writes + FLUSHes to each of two volumes through the drain, the slowest pair "
          f"{slowest * 1000:.0f} ms (the hand-offs' pauses; nodes share one disk)")
    # Health on each node names the clients attached there that are forwarded, and where to.
    solo_primary = replication(first, "solo")["primary"]
    status = first.cli("status").stdout
    line = next((line for line in status.splitlines() if "KEEL_VOLUME_FORWARDED" in line), "")
    assert f'"attached" to node n{other}' in line and f'"solo" to node n{solo_primary}' in line, status
    assert '"attached" to node n1' in nodes[free - 1].cli("status").stdout
    for offset, data in expected.items():
        assert client.read(offset * BLOCK, BLOCK) == data, f"block {offset} read through the drained node"
    for offset, data in solo_expected.items():
        assert solo.read(offset * BLOCK, BLOCK) == data, f"solo block {offset} read through the drained node"
    solo.close()
    expected[index] = block("after-drain", index)
    client.write(index * BLOCK, expected[index])
    client.flush()
    client.close()
    # The forwarded client's session on node 1 goes on through the new primary.
    expected[far + 1] = block("forwarded", far + 1)
    remote.write((far + 1) * BLOCK, expected[far + 1])
    remote.flush()
    assert remote.read(far * BLOCK, 2 * BLOCK) == expected[far] + expected[far + 1]
    remote.close()
    for node in (first, nodes[free - 1]):
        wait_until("no client forwarded any more", lambda: "KEEL_VOLUME_FORWARDED" not in node.cli("status").stdout,
                   timeout=30)

    code, info = first.api("GET", "/api/v1/nodes/n1")
    assert code == 200 and info["replicas"] == [{"volume": "wide", "primary": False, "in_sync": True}], info
    forwarded = attach(first, "wide")
    assert forwarded.read(0, BLOCK) == block("wide", 0)
    forwarded.write(BLOCK, block("wide", 1))
    forwarded.flush()
    forwarded.close()
    assert replication(first, "wide")["primary"] == 2
    status = first.cli("status").stdout
    assert ("node n1 is draining: 1 volume replica(s) left" in status
            and "1 of them cannot move as things are: volume wide: every storage node" in status), status
    second.cli("volume", "set-replication", "wide", "--replicas", "2")
    assert sorted(replication(first, "wide")["replicas"]) == [2, 3]
    wait_until("node 1 drained",
               lambda: "KEEL_NODE_DRAINING: node n1 is drained: it holds no volume replica" in first.cli("status").stdout)

    fresh = attach(nodes[other - 1], "attached")
    for offset, data in expected.items():
        assert fresh.read(offset * BLOCK, BLOCK) == data, f"block {offset} on the new primary"
    fresh.close()
    wide = attach(second, "wide")
    assert wide.read(0, 2 * BLOCK) == block("wide", 0) + block("wide", 1)
    wide.close()
    solo = attach(nodes[replication(first, "solo")["primary"] - 1], "solo")
    for offset, data in solo_expected.items():
        assert solo.read(offset * BLOCK, BLOCK) == data, f"solo block {offset} on its new node"
    solo.close()


def test_clients_a_hand_off_forwarded_come_back_when_the_volume_is_handed_back(cluster):
    """Two storage nodes and a witness; an R=2 volume attached on node 1, its client writing
    and flushing throughout. Handing the volume to node 2 leaves the client forwarded there
    (node 1's health lists it); handing it back to node 1 brings the client back to node 1's
    own primary within the background loop's few seconds (the finding clears), without one
    failed request. Twice: a client brought back is handed off and brought back again. Then
    every flushed block reads back, through node 1 and, node 1 killed, through node 2."""
    first, second = two_nodes_and_witness(cluster)
    create_r2(first, "back")
    client = attach(first, "back")
    wait_until("both replicas in sync", lambda: sorted(replication(first, "back")["in_sync"]) == [1, 2])
    stop, flushed, failure = threading.Event(), {}, []

    def write():
        index = 0
        try:
            while not stop.is_set():
                pending = {}
                for _ in range(8):
                    slot = index % (SIZE // BLOCK)
                    pending[slot] = block("back", index)
                    client.write(slot * BLOCK, pending[slot])
                    index += 1
                client.flush()
                flushed.update(pending)
        except Exception as error:  # noqa: BLE001 - asserted below
            failure.append(error)

    def forwarded(node):
        return "KEEL_VOLUME_FORWARDED" in node.cli("status").stdout

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(2):
            code, answer = first.api("POST", "/api/v1/volumes/back/hand-off", {"to": "2"}, timeout=30)
            assert code == 200, answer
            assert forwarded(first), first.cli("status").stdout
            wait_until("node 2 serving with node 1 in sync", lambda: (
                replication(second, "back")["primary"] == 2
                and sorted(replication(second, "back")["in_sync"]) == [1, 2]), timeout=30)
            code, answer = second.api("POST", "/api/v1/volumes/back/hand-off", {"to": "1"}, timeout=30)
            assert code == 200, answer
            wait_until("node 1's client back on node 1's primary", lambda: not forwarded(first), timeout=15)
            assert not failure, failure
    finally:
        stop.set()
        writer.join(timeout=60)
    assert not writer.is_alive() and not failure, failure
    assert replication(first, "back")["primary"] == 1
    assert len(flushed) > 64, len(flushed)
    for slot, data in flushed.items():
        assert client.read(slot * BLOCK, BLOCK) == data, f"block {slot}"
    client.close()
    first.kill9()
    other = attach(second, "back", timeout=60)
    for slot, data in flushed.items():
        assert other.read(slot * BLOCK, BLOCK) == data, f"block {slot} on node 2"
    other.close()


def test_an_undone_drain_removes_the_copy_it_began(cluster, workdir):
    """An R=1 volume on node 1 holding 16 MiB, attached there; catch-ups limited to 2 MiB/s.
    Draining node 1 copies the volume to node 2 (R stays 1, two replicas, the copy out of
    sync); undoing the drain before the copy is in sync removes the copy again: the volume is
    back on node 1 alone, and the client, which wrote throughout, reads back every byte."""
    first, second, client = pair_with_one_replica(cluster, workdir, "resync_mib_per_second = 2", "undone")
    data = bytearray(write_random(client, 16 << 20))
    first.cli("node", "drain", "n1")
    copying = wait_until("the copy on node 2, out of sync", lambda: (
        replication(first, "undone")["replicas"] == [1, 2] and replication(first, "undone")), timeout=30)
    assert (copying["factor"], copying["primary"], copying["in_sync"]) == (1, 1, [1]), copying
    for index in range(16):
        data[index * BLOCK:(index + 1) * BLOCK] = block("while-copying", index)
        client.write(index * BLOCK, block("while-copying", index))
    client.flush()
    first.cli("node", "drain", "n1", "--undo")
    back = wait_until("the copy removed", lambda: (
        replication(first, "undone")["replicas"] == [1] and replication(first, "undone")), timeout=30)
    assert (back["factor"], back["primary"], back["in_sync"]) == (1, 1, [1]), back
    code, info = second.api("GET", "/api/v1/nodes/n2")
    assert code == 200 and info["replicas"] == [], info
    client.write(BLOCK * 16, block("after-undo", 16))
    client.flush()
    data[16 * BLOCK:17 * BLOCK] = block("after-undo", 16)
    assert client.read(0, len(data)) == bytes(data)
    client.close()


def test_snapshots_of_an_r2_volume_cut_the_same_writes_on_both_replicas(cluster):
    """Writes, a snapshot through the primary, and more writes to the same blocks at once
    after it, five times: every snapshot read through the other node (its own copy) shows
    exactly the writes before it, as on the primary."""
    first, second = two_nodes_and_witness(cluster)
    create_r2(first, "snaps")
    client = attach(first, "snaps")
    wait_until("both replicas in sync", lambda: sorted(replication(first, "snaps")["in_sync"]) == [1, 2])
    for round_index in range(5):
        for index in range(64):
            client.write(index * BLOCK, block(f"before-{round_index}", index))
        code, answer = first.api("POST", "/api/v1/volumes/snaps/snapshots", {"name": f"s{round_index}"})
        assert code == 200, answer
        for index in range(64):
            client.write(index * BLOCK, block(f"after-{round_index}", index))
    client.flush()
    # Through the replica's node: a snapshot is not the primary's to serve.
    for node in (second, first):
        for round_index in range(5):
            snapshot = Client(node.host, node.nbd_port, f"snaps@s{round_index}")
            for index in range(64):
                got = snapshot.read(index * BLOCK, BLOCK)
                assert got == block(f"before-{round_index}", index), \
                    f"{node.name}: snapshot s{round_index} block {index} is not the write before it"
            snapshot.close()
    code, answer = second.api("POST", "/api/v1/volumes/snaps/snapshots", {"name": "elsewhere"})
    assert code == 421, (code, answer)


def test_batches_in_flight_together_are_applied_in_order(cluster):
    """The primary keeps several batches of a replica's stream in flight; node 1's transport
    delays each by a random time (up to 40 ms), so they reach node 2 out of order. Six times:
    sixteen 512 KiB writes to the same range, each its own batch, a FLUSH and a snapshot, read
    through node 2 (its own copy): it holds the burst's last write, as node 1 does, because
    node 2 applies batches in stream order, waiting for the earlier ones. It never refuses the
    later ones either: the in-sync set and its epoch never change."""
    first, second = two_nodes_and_witness(cluster)
    create_r2(first, "order")
    client = attach(first, "order")
    wait_until("both replicas in sync", lambda: sorted(replication(first, "order")["in_sync"]) == [1, 2])
    epoch = replication(first, "order")["epoch"]
    first.faults([], delays=[{"node": second.node_id(), "method": METHOD_REPLICATE, "milliseconds": 40,
                              "jitter": True}])
    length = 512 << 10
    for burst in range(6):
        for index in range(16):
            client.write(0, (f"{burst}/{index:02} ".encode() * (length // 6 + 1))[:length])
        client.flush()
        code, answer = first.api("POST", "/api/v1/volumes/order/snapshots", {"name": f"s{burst}"})
        assert code == 200, answer
        snapshot = Client(second.host, second.nbd_port, f"order@s{burst}")
        got = snapshot.read(0, length)
        snapshot.close()
        assert got.startswith(f"{burst}/15 ".encode()), f"burst {burst}: node 2 holds {got[:6]!r} last"
    info = replication(first, "order")
    assert (info["epoch"], sorted(info["in_sync"])) == (epoch, [1, 2]), \
        f"node 2 refused a batch and was resynced: {info}"


# The transport method of Raft's log appends (crates/cluster/src/messages.rs).
METHOD_RAFT_APPEND = 1


def test_a_snapshot_made_through_one_node_opens_at_once_through_another(cluster):
    """The Raft leader's log appends to a data node that does not lead are delayed by 60 ms,
    so that node learns of each new snapshot late. Three times: a snapshot through the
    volume's primary, then at once an NBD client opens it through the lagging node, which
    asks the leader how far the log is committed and waits until it applied that far before
    answering (before that, it answered that the export does not exist)."""
    first, second = two_nodes_and_witness(cluster)
    leader = cluster.node_by_id(cluster.leader())
    lagging = second if leader is not second else first
    primary = first if lagging is second else second
    create_r2(primary, "fresh")
    client = attach(primary, "fresh")
    wait_until("both replicas in sync", lambda: sorted(replication(primary, "fresh")["in_sync"]) == [1, 2])
    leader.faults([], delays=[{"node": lagging.node_id(), "method": METHOD_RAFT_APPEND, "milliseconds": 60}])
    for round_index in range(3):
        client.write(0, block(f"round-{round_index}", 0))
        client.flush()
        code, answer = primary.api("POST", "/api/v1/volumes/fresh/snapshots", {"name": f"s{round_index}"})
        assert code == 200, answer
        snapshot = Client(lagging.host, lagging.nbd_port, f"fresh@s{round_index}")
        assert snapshot.read(0, BLOCK) == block(f"round-{round_index}", 0)
        snapshot.close()
    leader.faults([])


def test_a_snapshot_incomplete_on_a_replica_is_never_served_or_rolled_back_there(cluster, workdir):
    """An R=1 volume is written and snapshotted, then raised to R=2: node 2 receives the
    current contents only, so its copy of the snapshot lacks the data (the snapshot says so).
    Half of the volume's blocks are overwritten and the volume rolled back onto the snapshot
    through node 1: node 2 leaves the in-sync set for the rollback and is caught up again
    after it, in full (the blocks not overwritten changed on neither node since their common
    point, yet node 2's rolled-back view no longer shows them: the rollback voids the point). Node 1 is killed; node 2
    takes over and serves the rolled-back contents. The snapshot exported through node 2
    shows node 1's copy (node 2's own lacks it) while node 1 lives, and is refused, naming
    node 1, once node 1 is gone. (Rolled back in place, node 2 read zeroes: its copy of the
    snapshot never had the data.) Snapshot repair is off here: it would make node 2's copy
    complete."""
    first, second, client = pair_with_one_replica(cluster, workdir, "snapshot_repair = false", "undo")
    original = {index: block("original", index) for index in range(128)}
    for index, data in original.items():
        client.write(index * BLOCK, data)
    client.flush()
    code, answer = first.api("POST", "/api/v1/volumes/undo/snapshots", {"name": "before"})
    assert code == 200, answer
    first.cli("volume", "set-replication", "undo", "--replicas", "2")
    wait_until("node 2 in sync", lambda: sorted(replication(first, "undo")["in_sync"]) == [1, 2], timeout=60)
    code, snapshots = first.api("GET", "/api/v1/volumes/undo/snapshots")
    assert code == 200, snapshots
    assert [s["incomplete_on"] for s in snapshots] == [[2]], snapshots
    for index in range(64):
        client.write(index * BLOCK, block("overwritten", index))
    client.flush()
    client.close()
    code, answer = first.api("POST", "/api/v1/volumes/undo/snapshots/before/rollback")
    assert code == 200, answer
    wait_until("node 2 caught up after the rollback",
               lambda: sorted(replication(first, "undo")["in_sync"]) == [1, 2], timeout=60)
    through_second = Client(second.host, second.nbd_port, "undo@before", timeout=30)
    for index, data in original.items():
        assert through_second.read(index * BLOCK, BLOCK) == data, f"snapshot block {index} through node 2"
    through_second.close()
    first.kill9()
    other = attach(second, "undo", timeout=60)
    for index, data in original.items():
        assert other.read(index * BLOCK, BLOCK) == data, f"block {index} is not the rolled-back data on node 2"
    other.close()
    try:
        Client(second.host, second.nbd_port, "undo@before", timeout=30)
        raise AssertionError("node 2 exported a snapshot its copy does not hold whole")
    except NbdError as refused:
        assert "holding the snapshot whole" in str(refused) and "node 1" in str(refused), refused


def test_a_snapshot_taken_while_a_replica_was_down_is_copied_to_it(cluster):
    """Node 2, the replica of an R=2 volume whose 64 blocks are written, is killed -9. Half
    the blocks are rewritten and a quarter trimmed, the volume is snapshotted (`gone`, which
    says it is incomplete on node 2) and written again. Node 2 comes back, is caught up with the
    current contents and rejoins the in-sync set; then node 1 copies the snapshot's data to it
    and the snapshot becomes complete there. Node 1 is killed -9: node 2 exports the snapshot
    with exactly its data (the trimmed blocks read as zeroes, not as node 2's older copy),
    rolls the volume back onto it, and serves the rolled-back contents."""
    first, second = two_nodes_and_witness(cluster)
    create_r2(first, "away")
    client = attach(first, "away")
    wait_until("both replicas in sync", lambda: sorted(replication(first, "away")["in_sync"]) == [1, 2])
    for index in range(64):
        client.write(index * BLOCK, block("one", index))
    client.flush()
    second.kill9()
    for index in range(32):
        client.write(index * BLOCK, block("two", index))
    client.trim(32 * BLOCK, 16 * BLOCK)
    client.flush()
    assert sorted(replication(first, "away")["in_sync"]) == [1], "a FLUSH completed with node 2 counted"
    code, answer = first.api("POST", "/api/v1/volumes/away/snapshots", {"name": "gone"})
    assert code == 200, answer
    code, snapshots = first.api("GET", "/api/v1/volumes/away/snapshots")
    assert code == 200 and [s["incomplete_on"] for s in snapshots] == [[2]], snapshots
    for index in range(16):
        client.write(index * BLOCK, block("three", index))
    client.flush()
    second.start()
    wait_until("node 2 back in sync", lambda: sorted(replication(first, "away")["in_sync"]) == [1, 2], timeout=60)
    wait_until("the snapshot complete on node 2", lambda: first.api(
        "GET", "/api/v1/volumes/away/snapshots")[1][0]["incomplete_on"] == [], timeout=60)
    client.close()
    first.kill9()

    snapshot = ["two"] * 32 + [None] * 16 + ["one"] * 16
    exported = wait_until("node 2 exporting the snapshot",
                          lambda: Client(second.host, second.nbd_port, "away@gone", timeout=30),
                          timeout=60, interval=0.2)
    for index, tag in enumerate(snapshot):
        expected = bytes(BLOCK) if tag is None else block(tag, index)
        assert exported.read(index * BLOCK, BLOCK) == expected, f"snapshot block {index} on node 2"
    exported.close()
    current = attach(second, "away", timeout=60)
    assert current.read(0, BLOCK) == block("three", 0), "node 2 lost a flushed write"
    current.close()
    code, answer = second.api("POST", "/api/v1/volumes/away/snapshots/gone/rollback")
    assert code == 200, answer
    rolled_back = attach(second, "away", timeout=60)
    for index, tag in enumerate(snapshot):
        expected = bytes(BLOCK) if tag is None else block(tag, index)
        assert rolled_back.read(index * BLOCK, BLOCK) == expected, f"rolled-back block {index} on node 2"


def test_a_new_primary_lacking_a_snapshot_copies_it_from_the_old_one(cluster, workdir):
    """An R=1 volume on node 1 (snapshot repair off there) is written and snapshotted, then
    raised to R=2: node 2's copy of the snapshot lacks its data. Node 1 is killed -9 and node 2
    takes the volume over; node 1 comes back and is caught up by node 2. Node 2, the primary,
    then copies the snapshot's data from node 1 into its own copy (the snapshot becomes
    complete there), so once node 1 is killed again node 2 still exports the snapshot, from its
    own copy, with exactly its data."""
    first, second, client = pair_with_one_replica(cluster, workdir, "snapshot_repair = false", "heal")
    snapshot_then_raise(first, client, "heal", "old")
    assert sorted(replication(first, "heal")["in_sync"]) == [1, 2]
    client.close()
    first.kill9()
    other = attach(second, "heal", timeout=60)
    code, snapshots = second.api("GET", "/api/v1/volumes/heal/snapshots")
    assert code == 200 and [s["incomplete_on"] for s in snapshots] == [[2]], snapshots
    first.start()
    wait_until("node 1 caught up by node 2", lambda: sorted(replication(second, "heal")["in_sync"]) == [1, 2],
               timeout=60)
    wait_until("the snapshot complete on node 2", lambda: second.api(
        "GET", "/api/v1/volumes/heal/snapshots")[1][0]["incomplete_on"] == [], timeout=60)
    other.close()
    first.kill9()
    exported = Client(second.host, second.nbd_port, "heal@old", timeout=30)
    for index in range(64):
        assert exported.read(index * BLOCK, BLOCK) == block("kept", index), f"snapshot block {index} on node 2"


def keel_binary(node, *args, stdin=None):
    """`keel ARGS` against `node`, with binary standard input and output."""
    cmd = [KEEL_BIN, *args, "--admin", node.admin, "--token-dir", str(node.dir)]
    return subprocess.run(cmd, input=stdin, capture_output=True, env=node.env, timeout=120)


@pytest.mark.parametrize("repair", [False, True], ids=["repair-off", "repair-on"])
def test_a_stream_received_into_a_replicated_volume_reaches_its_replicas(cluster, workdir, repair):
    """A full stream received on node 1 makes volume `dst`, raised to R=2; an incremental stream
    (32 of its 64 blocks rewritten) is refused through node 2 with the primary's address, then
    received through node 1, the primary. Its blocks were written on node 1 only: node 2 is
    taken out of the in-sync set while the volume switches to them, caught up, and back in
    sync; the received snapshot says it is incomplete on node 2. Node 1 is then killed and the
    volume, attached through node 2, holds the stream's contents. With snapshot repair off, a
    stream based on a snapshot node 2 never had the data of is refused there. With it on, node
    1 copies both snapshots' data to node 2 first (they become complete there): node 2 then
    exports both with their data and receives that stream."""
    first, second = two_nodes_and_witness(
        cluster, cluster_config(workdir, "nodes", f"snapshot_repair = {'true' if repair else 'false'}"))
    code, created = first.api("POST", "/api/v1/volumes", {"name": "src", "size_bytes": SIZE}, timeout=30)
    assert code == 200, created
    client = attach(first, "src")
    for index in range(64):
        client.write(index * BLOCK, block("one", index))
    client.flush()
    first.cli("snapshot", "create", "src@one")
    for index in range(32):
        client.write(index * BLOCK, block("two", index))
    client.flush()
    first.cli("snapshot", "create", "src@two")
    client.write(0, block("three", 0))
    client.flush()
    first.cli("snapshot", "create", "src@three")
    client.close()
    full = keel_binary(first, "snapshot", "send", "src@one")
    incremental = keel_binary(first, "snapshot", "send", "src@one", "src@two")
    assert full.returncode == 0 and incremental.returncode == 0, (full.stderr, incremental.stderr)
    onto_one = keel_binary(first, "snapshot", "send", "src@one", "src@three")
    assert onto_one.returncode == 0, onto_one.stderr

    received = keel_binary(first, "snapshot", "receive", "dst", stdin=full.stdout)
    assert received.returncode == 0, received.stderr
    first.cli("volume", "set-replication", "dst", "--replicas", "2")
    wait_until("dst in sync on both nodes", lambda: sorted(replication(first, "dst")["in_sync"]) == [1, 2],
               timeout=60)
    epoch = replication(first, "dst")["epoch"]

    refused = keel_binary(second, "snapshot", "receive", "dst", stdin=incremental.stdout)
    assert refused.returncode != 0 and b"its primary is node 1" in refused.stderr, refused.stderr
    received = keel_binary(first, "snapshot", "receive", "dst", stdin=incremental.stdout)
    assert received.returncode == 0, received.stderr
    info = replication(first, "dst")
    assert info["epoch"] > epoch, f"node 2 was never taken out of the in-sync set: {info}"
    wait_until("node 2 caught up with the stream", lambda: sorted(replication(first, "dst")["in_sync"]) == [1, 2],
               timeout=60)
    code, snapshots = first.api("GET", "/api/v1/volumes/dst/snapshots")
    assert code == 200, snapshots
    two = [snapshot for snapshot in snapshots if snapshot["name"] == "two"]
    assert two and two[0]["incomplete_on"] in ([2], []), snapshots
    if repair:
        wait_until("both snapshots complete on node 2", lambda: all(
            not snapshot["incomplete_on"] for snapshot in first.api("GET", "/api/v1/volumes/dst/snapshots")[1]),
            timeout=60)
    else:
        assert two[0]["incomplete_on"] == [2], snapshots

    first.kill9()
    other = attach(second, "dst", timeout=60)
    for index in range(64):
        expected = block("two" if index < 32 else "one", index)
        assert other.read(index * BLOCK, BLOCK) == expected, f"block {index} is not the stream's on node 2"
    other.close()
    if not repair:
        # Node 2, now primary, never had snapshot `one`'s data (it joined after): a stream
        # based on it is refused there rather than received onto holes.
        refused = keel_binary(second, "snapshot", "receive", "dst", stdin=onto_one.stdout)
        assert refused.returncode != 0 and b"incomplete on this node" in refused.stderr, refused.stderr
        return
    # Node 2's own copies of `one` and `two` now hold their data.
    for name, tags in (("one", ["one"] * 64), ("two", ["two"] * 32 + ["one"] * 32)):
        exported = Client(second.host, second.nbd_port, f"dst@{name}", timeout=30)
        for index, tag in enumerate(tags):
            assert exported.read(index * BLOCK, BLOCK) == block(tag, index), f"dst@{name} block {index} on node 2"
        exported.close()
    received = keel_binary(second, "snapshot", "receive", "dst", stdin=onto_one.stdout)
    assert received.returncode == 0, received.stderr
    after = attach(second, "dst", timeout=60)
    for index in range(64):
        expected = block("three" if index == 0 else "two" if index < 32 else "one", index)
        assert after.read(index * BLOCK, BLOCK) == expected, f"block {index} is not src@three's on node 2"


def test_limits_resize_and_clones_work_on_a_replicated_volume(cluster):
    """An R=2 volume limited to 100 operations per second: 300 writes through the primary take
    at least 1.5 s. Grown online to twice its size: a write past the old end, flushed, is on
    node 2's copy. A clone of its snapshot is placed on both nodes. Node 1 is then killed:
    through node 2 the volume holds every flushed write, the new end's included, and the clone
    reads the snapshot's data from node 2's own copy."""
    first, second = two_nodes_and_witness(cluster)
    code, created = first.api("POST", "/api/v1/volumes",
                              {"name": "lim", "size_bytes": SIZE, "replicas": 2, "iops_max": 100}, timeout=30)
    assert code == 200, created
    client = attach(first, "lim")
    wait_until("both replicas in sync", lambda: sorted(replication(first, "lim")["in_sync"]) == [1, 2])
    started = time.monotonic()
    for index in range(300):
        client.write(index * BLOCK, block("limited", index))
    client.flush()
    took = time.monotonic() - started
    assert took >= 1.5, f"300 writes at 100 IOPS took {took:.2f} s: the limit is not applied"
    client.close()

    code, answer = first.api("POST", "/api/v1/volumes/lim/resize", {"size_bytes": 2 * SIZE})
    assert code == 200, answer
    grown = attach(first, "lim")
    grown.write(SIZE, block("past-the-old-end", 0))
    grown.flush()
    assert sorted(replication(first, "lim")["in_sync"]) == [1, 2], "node 2 fell out writing past the old end"
    code, answer = first.api("POST", "/api/v1/volumes/lim/snapshots", {"name": "c"})
    assert code == 200, answer
    code, clone = first.api("POST", "/api/v1/volumes/lim/snapshots/c/clone", {"name": "copy"})
    assert code == 200, clone
    assert sorted(replication(first, "copy")["replicas"]) == [1, 2], replication(first, "copy")
    grown.close()

    first.kill9()
    after = attach(second, "lim", timeout=60)
    assert after.read(SIZE, BLOCK) == block("past-the-old-end", 0)
    for index in (0, 150, 299):
        assert after.read(index * BLOCK, BLOCK) == block("limited", index), f"block {index} lost"
    copy = attach(second, "copy", timeout=60)
    for index in (0, 150, 299):
        assert copy.read(index * BLOCK, BLOCK) == block("limited", index), f"clone block {index}"
    assert copy.read(SIZE, BLOCK) == block("past-the-old-end", 0)


def test_a_rollback_during_a_catch_up_restarts_it(cluster, workdir):
    """As above, but the rollback comes while node 2 is still catching up (paced to 16 MiB/s):
    the chunks it already compared hold the current data, which the rollback hides on node 2
    (its copy of the snapshot lacks the data). The catch-up starts over after the rollback, so
    node 2, once in sync and taking over, serves the rolled-back contents. (Continued instead,
    it joined with the chunks compared before the rollback reading as zeroes.)"""
    size = 64 << 20
    first, second, client = pair_with_one_replica(cluster, workdir, "resync_mib_per_second = 16", "midway", size)
    original = write_random(client, size)
    code, answer = first.api("POST", "/api/v1/volumes/midway/snapshots", {"name": "before"})
    assert code == 200, answer
    for offset in range(0, size, 1 << 20):
        client.write(offset, b"\xee" * (1 << 20))
    client.flush()
    client.close()
    first.cli("volume", "set-replication", "midway", "--replicas", "2")
    wait_until("node 2 half caught up",
               lambda: second.api("GET", "/api/v1/volumes/midway")[1]["replication"]["received_bytes"] >= size // 2,
               timeout=60, interval=0.05)
    assert sorted(replication(first, "midway")["in_sync"]) == [1], "caught up before the rollback"
    code, answer = first.api("POST", "/api/v1/volumes/midway/snapshots/before/rollback")
    assert code == 200, answer
    wait_until("node 2 in sync after the rollback",
               lambda: sorted(replication(first, "midway")["in_sync"]) == [1, 2], timeout=60)
    first.kill9()
    other = attach(second, "midway", timeout=60)
    for offset in range(0, size, 1 << 20):
        assert other.read(offset, 1 << 20) == original[offset:offset + (1 << 20)], \
            f"the MiB at {offset >> 20} is not the rolled-back data on node 2"


def test_replicas_change_online_and_a_removed_replica_erases_its_copy(cluster):
    """Three storage nodes. An R=1 volume attached through node 1 is raised to R=3 while a
    client writes and flushes through the same NBD connection: the attached connection
    switches to replicated writes, the new replicas (nodes 2 and 3) catch up and join the
    in-sync set. The minimum is raised, then R lowered to 2: node 3 (the highest id) leaves
    and erases its copy; placed back, it is caught up whole, and removed again. Another node
    refuses the change with the primary's address. Then the primary is killed and the volume,
    attached through node 2, holds every flushed write, including those written while R
    changed."""
    nodes = [cluster.add() for _ in range(3)]
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    first, second, third = nodes
    code, created = first.api("POST", "/api/v1/volumes", {"name": "grow", "size_bytes": SIZE}, timeout=30)
    assert code == 200, created
    assert replication(first, "grow")["replicas"] == [1]
    # Each node has its own admin token here: `keel volume move` through node 3 cannot make
    # the change through node 1, the primary, and says so.
    moved = third.cli("volume", "move", "grow", "--from", "n1", "--to", "n3", check=False)
    assert moved.returncode != 0 and "refuses this admin token" in moved.stderr, moved.stderr
    client = attach(first, "grow")
    expected = write_blocks(client, "single", range(256))

    # A writer on the attached connection while R goes from 1 to 3.
    writer, flushed, failure = write_in_background(client, "changing", range(256, 1024), 16)
    time.sleep(0.2)
    out = first.cli("volume", "set-replication", "grow", "--replicas", "3").stdout
    assert "3 replica(s)" in out, out
    writer.join(timeout=120)
    assert not writer.is_alive() and not failure, failure
    expected.update(flushed)
    assert len(flushed) == 768, len(flushed)
    info = replication(first, "grow")
    assert info["factor"] == 3 and sorted(info["replicas"]) == [1, 2, 3], info
    assert info["in_sync_min"] == 1, "the minimum stays unless asked"
    wait_until("all three replicas in sync",
               lambda: sorted(replication(first, "grow")["in_sync"]) == [1, 2, 3], timeout=90)
    # FLUSHes with all three in sync: node 3 and node 1 keep their common point.
    settle_common_points(client, expected)

    # Refusals: too many replicas; a minimum above R; the change through a non-primary.
    assert first.cli("volume", "set-replication", "grow", "--replicas", "4", check=False).returncode != 0
    code, answer = first.api("POST", "/api/v1/volumes/grow/replication", {"in_sync_min": 4})
    assert code == 400 and "minimum" in str(answer), (code, answer)
    code, answer = second.api("POST", "/api/v1/volumes/grow/replication", {"replicas": 2})
    assert code == 421, (code, answer)

    first.cli("volume", "set-replication", "grow", "--min-in-sync", "3")
    assert replication(first, "grow")["in_sync_min"] == 3
    def stored(node):
        code, report = node.api("GET", "/api/v1/status")
        assert code == 200, report
        return report["store"]["live_raw_bytes"]

    third_bytes = stored(third)
    assert third_bytes >= 1024 * BLOCK, third_bytes
    first.cli("volume", "set-replication", "grow", "--replicas", "2")
    info = replication(first, "grow")
    assert info["replicas"] == [1, 2] and info["in_sync_min"] == 2, info
    assert sorted(info["in_sync"]) == [1, 2], info
    wait_until("node 3 erased its copy",
               lambda: stored(third) < 64 * BLOCK, timeout=60)
    for index in range(1024, 1088):
        expected[index] = block("r2", index)
        client.write(index * BLOCK, expected[index])
    client.flush()

    # Placed back on node 3, the replica is a new one: erasing its copy deleted its common
    # point with node 1 first, so its catch-up compares everything (not only what changed
    # since that point) and it holds every block again.
    compared = replication(first, "grow")["served_here"]["resync_compared_bytes"]
    first.cli("volume", "set-replication", "grow", "--replicas", "3")
    wait_until("node 3 in sync again",
               lambda: sorted(replication(first, "grow")["in_sync"]) == [1, 2, 3], timeout=90)
    compared = replication(first, "grow")["served_here"]["resync_compared_bytes"] - compared
    assert compared >= 1088 * BLOCK, compared
    assert stored(third) >= 1088 * BLOCK, stored(third)
    first.cli("volume", "set-replication", "grow", "--replicas", "2")
    wait_until("node 3 erased its copy again",
               lambda: stored(third) < 64 * BLOCK, timeout=60)

    first.kill9()
    other = attach(second, "grow", timeout=60)
    for index, data in expected.items():
        assert other.read(index * BLOCK, BLOCK) == data, f"block {index} lost"
    assert replication(second, "grow")["primary"] == 2
    # One replica in sync, the minimum is 2: writes are refused until it is lowered.
    try:
        other.write(0, block("refused", 0))
        other.flush()
        raise AssertionError("a write was accepted below the in-sync minimum")
    except NbdError as refused:
        assert "failed with errno" in str(refused), refused
    other.close()
    status = second.cli("status", check=False).stdout
    assert "KEEL_VOLUME_BELOW_MIN_IN_SYNC" in status, status
    assert "set-replication grow --min-in-sync 1" in status, status
    second.cli("volume", "set-replication", "grow", "--min-in-sync", "1")
    other = attach(second, "grow")
    other.write(0, block("accepted", 0))
    other.flush()
    assert other.read(0, BLOCK) == block("accepted", 0)


def test_a_replica_moves_to_a_named_node_online(cluster, workdir):
    """Four storage nodes sharing one admin token (--admin-token-file); an R=2 volume on
    nodes 1 and 2, attached on node 1. `keel volume move mv --from n2 --to n4`, run through
    node 3 (which holds no replica: the CLI finds the primary) while a client writes and
    flushes through node 1: node 4 gets a replica (placement alone would pick node 3), caught
    up while the client writes, then node 2's leaves and erases its copy. Then the primary's
    own replica moves, `--from n1 --to n2`, while the client writes through node 1: node 2 is
    handed the volume once in sync, node 1's replica leaves, and the client goes on forwarded
    without an error; node 4 stays in sync throughout. `keel volume hand-off mv --to n4` then
    makes node 4 the primary, which serves with node 2 in sync from its first epoch; with
    node 4 killed, node 2 serves every flushed write. Refused, each
    saying why: a hand-off to a node holding no replica, a move to a node holding one, from a
    node holding none; set-replication naming a node while R stays, and R=4 but as a move's
    step. In between, an R=3 volume's replica moves, `--from n3 --to n2` (R 4 meanwhile),
    keeping three replicas in sync throughout."""
    token = workdir / "shared-admin-token"
    token.write_text(os.urandom(16).hex())
    nodes = []
    for _ in range(4):
        node = cluster.add(extra_args=("--admin-token-file", str(token)))
        # (Where this harness's API calls and CLI look for the token.)
        shutil.copy(token, node.dir / "admin-token")
        nodes.append(node)
    first, second, third, fourth = nodes
    wait_until("four members", lambda: len(first.status()["nodes"]) == 4)
    code, created = first.api("POST", "/api/v1/volumes", {"name": "mv", "size_bytes": SIZE, "replicas": 2}, timeout=30)
    assert code == 200, created
    assert replication(first, "mv")["replicas"] == [1, 2]
    client = attach(first, "mv")
    expected = write_blocks(client, "before", range(2048))
    wait_until("both replicas in sync", lambda: sorted(replication(first, "mv")["in_sync"]) == [1, 2])

    def refused(*args):
        result = third.cli(*args, check=False)
        assert result.returncode != 0, result
        return result.stderr

    assert "node 3 holds no replica of it" in refused("volume", "hand-off", "mv", "--to", "n3")
    assert "holds a replica of volume mv already" in refused("volume", "move", "mv", "--from", "n2", "--to", "n1")
    assert "holds no replica" in refused("volume", "move", "mv", "--from", "n3", "--to", "n4")
    assert "only as R is raised" in first.cli("volume", "set-replication", "mv", "--replicas", "2",
                                              "--add-to", "n4", check=False).stderr
    assert "only as R is lowered" in first.cli("volume", "set-replication", "mv", "--replicas", "2",
                                               "--remove-from", "n2", check=False).stderr
    assert replication(first, "mv")["replicas"] == [1, 2]

    writer, flushed, failure = write_in_background(client, "moving", range(2048, 4096), 64)
    moved = third.cli("volume", "move", "mv", "--from", "n2", "--to", "n4", timeout=120)
    writer.join(timeout=120)
    assert not writer.is_alive() and not failure, failure
    expected.update(flushed)
    assert "moved from node n2 to node n4" in moved.stdout, moved.stdout
    info = replication(first, "mv")
    assert info["factor"] == 2 and info["replicas"] == [1, 4] and sorted(info["in_sync"]) == [1, 4], info
    wait_until("node 2 erased its copy", lambda: all(
        replica["volume"] != "mv" for replica in second.api("GET", "/api/v1/nodes/n2")[1]["replicas"]), timeout=60)

    # An R=3 volume's replica moves the same way, R 3 -> 4 -> 3: the replicas that stay keep
    # three in sync throughout (lowering R first would leave two while the new one catches up).
    first.cli("volume", "set-replication", "mv", "--replicas", "3", "--add-to", "n3")
    assert replication(first, "mv")["replicas"] == [1, 4, 3]
    wait_until("three in sync", lambda: sorted(replication(first, "mv")["in_sync"]) == [1, 3, 4], timeout=60)
    assert "4 replicas: Keel keeps 1 to 3 (4 only while a replica moves" in first.cli(
        "volume", "set-replication", "mv", "--replicas", "4", check=False).stderr
    seen, watching = [], threading.Event()

    def watch():
        while not watching.is_set():
            info = replication(first, "mv")
            seen.append((info["factor"], sorted(info["replicas"]), sorted(info["in_sync"])))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    writer, flushed, failure = write_in_background(client, "moving R=3", range(2048, 4096), 64)
    moved = third.cli("volume", "move", "mv", "--from", "n3", "--to", "n2", timeout=120)
    writer.join(timeout=120)
    watching.set()
    watcher.join(timeout=30)
    assert not writer.is_alive() and not failure, failure
    expected.update(flushed)
    assert "(R 3 -> 4 until it is in sync)" in moved.stdout and "moved from node n3 to node n2" in moved.stdout, moved.stdout
    info = replication(first, "mv")
    assert (info["factor"], info["in_sync_min"], info["replicas"], sorted(info["in_sync"])) == (3, 1, [1, 4, 2], [1, 2, 4]), info
    assert seen and all(len(in_sync) >= 3 for _, _, in_sync in seen), seen
    assert all(factor == len(replicas) for factor, replicas, _ in seen), seen
    wait_until("node 3 erased its copy", lambda: all(
        replica["volume"] != "mv" for replica in third.api("GET", "/api/v1/nodes/n3")[1]["replicas"]), timeout=60)
    first.cli("volume", "set-replication", "mv", "--replicas", "2", "--remove-from", "n2")
    assert replication(first, "mv")["replicas"] == [1, 4]
    wait_until("node 4 in sync", lambda: sorted(replication(first, "mv")["in_sync"]) == [1, 4], timeout=60)
    wait_until("node 2 erased its copy", lambda: all(
        replica["volume"] != "mv" for replica in second.api("GET", "/api/v1/nodes/n2")[1]["replicas"]), timeout=60)

    # The primary's own replica: the new one takes the volume over once in sync, and the client
    # attached on node 1 goes on, forwarded, without an error.
    writer, flushed, failure = write_in_background(client, "primary moving", range(4096, 6144), 64)
    moved = third.cli("volume", "move", "mv", "--from", "n1", "--to", "n2", timeout=120)
    writer.join(timeout=120)
    assert not writer.is_alive() and not failure, failure
    expected.update(flushed)
    assert "node n2 is its primary now" in moved.stdout and "moved from node n1 to node n2" in moved.stdout, moved.stdout
    info = replication(second, "mv")
    # Handed off, node 2 kept node 4 in sync: it held every write node 2 held, durable.
    assert info["primary"] == 2 and sorted(info["replicas"]) == [2, 4] and sorted(info["in_sync"]) == [2, 4], info
    expected.update(write_blocks(client, "forwarded", range(6144, 6400)))
    client.close()
    wait_until("node 1 erased its copy", lambda: all(
        replica["volume"] != "mv" for replica in first.api("GET", "/api/v1/nodes/n1")[1]["replicas"]), timeout=60)

    # A hand-off alone, run through node 1 (no replica now): node 4 becomes the primary.
    epoch = replication(second, "mv")["epoch"]
    handed = first.cli("volume", "hand-off", "mv", "--to", "n4")
    assert "node n4 is its primary now" in handed.stdout, handed.stdout
    # (Node 2 proposed it; node 4's catalog applies it a moment later.)
    wait_until("node 4 names itself the primary", lambda: replication(fourth, "mv")["primary"] == 4, timeout=10)
    # A client attached there makes node 4 serve the epoch after the hand-off's, with node 2
    # still in sync: it never serves alone in sync (which a catch-up, then one more epoch
    # adding node 2 back, would end).
    client = attach(fourth, "mv")
    expected.update(write_blocks(client, "on node 4", range(6400, 6528)))
    info = replication(fourth, "mv")
    assert (info["epoch"], info["primary"], sorted(info["in_sync"])) == (epoch + 2, 4, [2, 4]), info
    client.close()

    fourth.kill9()
    other = attach(second, "mv", timeout=60)
    for index, data in expected.items():
        assert other.read(index * BLOCK, BLOCK) == data, f"block {index} lost"
    other.close()


def test_a_resync_ships_no_faster_than_its_configured_rate(cluster, workdir):
    """With `resync_mib_per_second = 2`, raising an R=1 volume holding 16 MiB to R=2 ships the
    16 MiB to the new replica in no less than 7.5 s (unthrottled it takes well under a second
    here); `volume info` shows the progress meanwhile, and the replica then holds the data.
    With `rebuilds_max = 1`, a second volume on node 1 raised right after waits its turn,
    shown in `volume info`, and copies only once the first replica is in sync."""
    first, second, client = pair_with_one_replica(
        cluster, workdir, "resync_mib_per_second = 2\nrebuilds_max = 1", "paced")
    data = os.urandom(16 << 20)
    for offset in range(0, len(data), 1 << 20):
        client.write(offset, data[offset:offset + (1 << 20)])
    client.flush()
    code, created = first.api("POST", "/api/v1/volumes", {"name": "next", "size_bytes": SIZE}, timeout=30)
    assert code == 200, created
    next_client = attach(first, "next")
    next_data = write_random(next_client, 2 << 20)
    next_client.close()

    started = time.time()
    first.cli("volume", "set-replication", "paced", "--replicas", "2")
    progress = wait_until("progress shown", lambda: [
        c for c in replication(first, "paced")["served_here"]["catching_up"] if c["compared_bytes"] > 0])
    assert progress[0]["node"] == 2 and progress[0]["total_bytes"] == SIZE, progress
    first.cli("volume", "set-replication", "next", "--replicas", "2")
    waiting = wait_until("the second copy waiting for its turn", lambda: [
        c for c in replication(first, "next")["served_here"]["catching_up"] if c["waiting_for_turn"]])
    assert waiting[0]["compared_bytes"] == 0, waiting
    status = first.cli("status").stdout
    assert "KEEL_REBUILDS_WAITING" in status and '"next" to node 2' in status, status
    # The primary's health names how far each catch-up got, or that it waits its turn.
    degraded = {line.split('"')[1]: line for line in status.splitlines() if "KEEL_VOLUME_DEGRADED" in line}
    assert "behind: node 2 (n2; catching up: " in degraded["paced"] and "of 64.0 MiB compared (" in degraded["paced"], degraded
    assert "behind: node 2 (n2; waiting for a turn to copy the whole volume)" in degraded["next"], degraded
    assert sorted(replication(first, "paced")["in_sync"]) == [1], "the first copy ended before the check"
    wait_until("the new replica in sync",
               lambda: sorted(replication(first, "paced")["in_sync"]) == [1, 2], timeout=60)
    took = time.time() - started
    shipped = replication(first, "paced")["served_here"]["resync_bytes"]
    assert shipped >= len(data), shipped
    assert took >= (len(data) - (1 << 20)) / (2 << 20), f"16 MiB shipped in {took:.2f} s at a 2 MiB/s limit"
    print(f"16 MiB resynced at a 2 MiB/s limit in {took:.2f} s")
    wait_until("the second volume's replica in sync",
               lambda: sorted(replication(first, "next")["in_sync"]) == [1, 2], timeout=60)
    client.close()
    first.kill9()
    other = attach(second, "paced", timeout=60)
    assert other.read(0, len(data)) == data
    other.close()
    other = attach(second, "next", timeout=60)
    assert other.read(0, len(next_data)) == next_data


def cached_share(node):
    """The share of `node`'s segment files in the page cache (fincore, util-linux)."""
    files = sorted(str(path) for path in (node.dir / "segments").glob("*.seg"))
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *files],
                         capture_output=True, text=True, check=True).stdout
    cached = total = 0
    for line in out.splitlines():
        resident, size = (int(field) for field in line.split())
        cached += resident
        total += size
    return cached / max(total, 1)


def test_a_replica_writes_its_copy_around_the_page_cache(cluster, workdir):
    """A replica serves no reads of its copy, so it writes it around the page cache (O_DIRECT):
    48 MiB written to an R=1 volume through node 1 stay in node 1's cache (a client reads back
    what it wrote), but the copy node 2 receives when R is raised to 2 leaves little of node
    2's segments cached. Small segments (8 MiB) keep zero-filled segments prepared ahead of
    the writer from counting. The copy then serves every byte once node 1 is gone."""
    config = workdir / "small-segments.toml"
    config.write_text("[store]\nsegment_size_max_bytes = 8388608\n")
    first = cluster.add(extra_args=["--config", str(config)])
    second = cluster.add(extra_args=["--config", str(config)])
    cluster.add(witness=True)
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    code, created = first.api("POST", "/api/v1/volumes", {"name": "around", "size_bytes": 64 << 20}, timeout=30)
    assert code == 200, created
    client = attach(first, "around")
    data = write_random(client, 48 << 20)
    client.close()
    primary = cached_share(first)
    assert primary > 0.8, f"only {primary:.2f} of the primary's segments are cached"
    first.cli("volume", "set-replication", "around", "--replicas", "2")
    wait_until("the new replica in sync",
               lambda: sorted(replication(first, "around")["in_sync"]) == [1, 2], timeout=120)
    replica = cached_share(second)
    print(f"cached: primary {primary:.2f}, replica {replica:.2f}")
    assert replica < 0.4, f"{replica:.2f} of the replica's segments are cached after the copy"
    first.kill9()
    other = attach(second, "around", timeout=60)
    for offset in range(0, len(data), 1 << 20):
        assert other.read(offset, 1 << 20) == data[offset:offset + (1 << 20)], f"MiB {offset >> 20} differs"
    other.close()


@pytest.mark.parametrize("clients_of", ["the volume", "another volume on its node",
                                        "another volume on the new replica's node"])
def test_a_resync_yields_to_clients_on_either_node(cluster, workdir, clients_of):
    """A server refuses `resync_busy_percent = 0` (a resync that never works). With
    `resync_busy_percent = 1`, raising a written 128 MiB volume from R=1 to R=2 while a client
    reads — from that volume, from another volume on the same node (the same disks), or from
    a volume on the node the new replica goes to — keeps the catch-up to 1% of the time: 5 s
    later the new replica is still catching up (unpaced, the whole copy takes a second or two
    here). Once the client stops, the catch-up goes at full speed and the replica holds the
    data."""
    bad = workdir / "never-resync.toml"
    bad.write_text("[cluster]\nresync_busy_percent = 0\n")
    refused = subprocess.run([KEEL_BIN, "server", "--data", str(workdir / "refused"), "--config", str(bad)],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "resync_busy_percent must be 1 to 100" in refused.stderr, refused.stderr
    size = 128 << 20
    first, second, client = pair_with_one_replica(cluster, workdir, "resync_busy_percent = 1", "busy", size)
    data = write_random(client, size)
    if clients_of == "the volume":
        read_through, read_name, read_data = first, "busy", data
    else:
        read_through = first if clients_of == "another volume on its node" else second
        read_name = "neighbour"
        code, created = read_through.api("POST", "/api/v1/volumes", {"name": read_name, "size_bytes": SIZE})
        assert code == 200, created
        assert replication(read_through, read_name)["replicas"] == [read_through.node_id()]
        writer = attach(read_through, read_name)
        read_data = write_random(writer, SIZE)
        writer.close()

    stop = threading.Event()
    reads = []

    def read_until_stopped():
        reader = attach(read_through, read_name)
        while not stop.is_set():
            offset = random.randrange(len(read_data) // BLOCK) * BLOCK
            assert reader.read(offset, BLOCK) == read_data[offset:offset + BLOCK]
            reads.append(offset)
        reader.close()

    thread = threading.Thread(target=read_until_stopped)
    thread.start()
    try:
        wait_until("the reader running", lambda: len(reads) > 10)
        first.cli("volume", "set-replication", "busy", "--replicas", "2")
        time.sleep(5)
        info = replication(first, "busy")
        catching_up = info["served_here"]["catching_up"]
        assert info["in_sync"] == [1] and catching_up and catching_up[0]["compared_bytes"] < size, info
        print(f"after 5 s under a reader of {clients_of}: {catching_up[0]['compared_bytes'] >> 20} of 128 MiB "
              f"compared")
    finally:
        stop.set()
        thread.join(timeout=60)
    assert len(reads) > 100, len(reads)
    client.close()
    wait_until("the new replica in sync once the client is idle",
               lambda: sorted(replication(first, "busy")["in_sync"]) == [1, 2], timeout=60)
    first.kill9()
    other = attach(second, "busy", timeout=60)
    for offset in range(0, size, 1 << 20):
        assert other.read(offset, 1 << 20) == data[offset:offset + (1 << 20)], f"MiB {offset >> 20} differs"


def test_writes_racing_a_catch_up_are_never_undone_on_the_new_replica(cluster, workdir):
    """A catch-up reads each 1 MiB chunk without holding up client writes, and queues it only
    if no write overlapped it meanwhile (else it reads it again). A client rewrites random
    blocks of a written 64 MiB volume as fast as it can while R goes from 1 to 2 (the resync
    never yields here, to race as much as possible); once in sync and flushed, the primary is
    killed and every block read through the new replica is the last one written: no stale
    chunk copy landed after a newer write."""
    first, second, client = pair_with_one_replica(cluster, workdir, "resync_busy_percent = 100", "race")
    blocks = SIZE // BLOCK
    expected = {index: block("initial", index) for index in range(blocks)}
    for start in range(0, blocks, 256):
        client.write(start * BLOCK, b"".join(expected[index] for index in range(start, start + 256)))
    client.flush()

    stop = threading.Event()
    failure = []

    def rewrite_until_stopped():
        try:
            writer = attach(first, "race")
            version = 0
            while not stop.is_set():
                version += 1
                index = random.randrange(blocks)
                data = block(f"v{version}", index)
                writer.write(index * BLOCK, data)
                expected[index] = data
            writer.flush()
            writer.close()
        except Exception as error:  # noqa: BLE001 - reported below
            failure.append(error)

    thread = threading.Thread(target=rewrite_until_stopped)
    thread.start()
    try:
        first.cli("volume", "set-replication", "race", "--replicas", "2")
        wait_until("the new replica in sync under the writer",
                   lambda: sorted(replication(first, "race")["in_sync"]) == [1, 2], timeout=120)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not failure, failure
    client.close()
    first.kill9()
    other = attach(second, "race", timeout=60)
    stale = [index for index in range(blocks) if other.read(index * BLOCK, BLOCK) != expected[index]]
    assert not stale, f"{len(stale)} blocks on the new replica are not the last write, e.g. {stale[:5]}"


def test_an_unattached_volume_gets_its_replicas_back_without_a_client(cluster, workdir):
    """Three storage nodes, no client attached to the volume at any of the steps that need a
    primary. An R=1 volume written and let go is raised to R=2: its node serves it in the
    background and catches the new replica up. Then that node is killed and stays down past
    `replica_move_after_ms`: the surviving in-sync replica takes the volume over in the
    background and rebuilds the lost replica on the third node. Finally the new primary is
    killed too (a witness keeps the Raft majority), and the third node serves every written
    block."""
    config = workdir / "fast-moves.toml"
    config.write_text("[cluster]\nsuspect_after_ms = 1000\ndown_after_ms = 2000\nreplica_move_after_ms = 1000\n")
    nodes = [cluster.add(extra_args=["--config", str(config)]) for _ in range(3)]
    # A witness keeps a Raft majority once two storage nodes are down.
    cluster.add(witness=True, extra_args=["--config", str(config)])
    wait_until("three voters", lambda: len(cluster.voters()) == 3)
    code, created = nodes[0].api("POST", "/api/v1/volumes", {"name": "idle", "size_bytes": SIZE}, timeout=30)
    assert code == 200, created
    [home] = replication(nodes[0], "idle")["replicas"]
    primary = nodes[home - 1]
    client = attach(primary, "idle")
    data = os.urandom(8 << 20)
    for offset in range(0, len(data), 1 << 20):
        client.write(offset, data[offset:offset + (1 << 20)])
    client.flush()
    client.close()

    primary.cli("volume", "set-replication", "idle", "--replicas", "2")
    wait_until("the new replica in sync with no client attached",
               lambda: len(replication(primary, "idle")["in_sync"]) == 2, timeout=60)
    [survivor_id] = [node for node in replication(primary, "idle")["replicas"] if node != home]
    survivor = nodes[survivor_id - 1]
    [third] = [node for node in nodes if node not in (primary, survivor)]

    primary.kill9()

    def rebuilt():
        info = replication(survivor, "idle")
        return (info["primary"] == survivor_id and home not in info["replicas"]
                and sorted(info["in_sync"]) == sorted(info["replicas"]) and len(info["replicas"]) == 2)

    wait_until("the survivor took over and rebuilt the lost replica", rebuilt, timeout=90)
    wait_until("the dead node replaced as a voter", lambda: home not in cluster.voters(via=survivor), timeout=60)
    survivor.kill9()
    other = attach(third, "idle", timeout=60)
    assert other.read(0, len(data)) == data


def test_a_replica_alone_holding_a_snapshot_whole_stays_on_its_down_node(cluster, workdir):
    """Three storage nodes and a witness, snapshot repair off. An R=1 volume is written and
    snapshotted, then raised to R=2: the new replica's copy of the snapshot lacks its data, so
    the first node alone holds it whole. That node is killed and stays down past
    `replica_move_after_ms`. The survivor takes the volume over in the background, but does
    not move the replica off the dead node: that would lose the snapshot. It says why in its
    log and keeps saying it with its move checks (every 2 s). Once the snapshot is deleted, the
    replica moves to the third node, which is caught up and put in sync, and the volume holds
    every flushed write."""
    args = cluster_config(workdir, "held", "suspect_after_ms = 1000\ndown_after_ms = 2000\n"
                          "replica_move_after_ms = 1000\nsnapshot_repair = false")
    nodes = [cluster.add(extra_args=args) for _ in range(3)]
    cluster.add(witness=True, extra_args=args)
    wait_until("three voters", lambda: len(cluster.voters()) == 3)
    code, created = nodes[0].api("POST", "/api/v1/volumes", {"name": "held", "size_bytes": SIZE}, timeout=30)
    assert code == 200, created
    [home] = replication(nodes[0], "held")["replicas"]
    primary = nodes[home - 1]
    client = attach(primary, "held")
    snapshot_then_raise(primary, client, "held", "only")
    client.close()
    [survivor_id] = [node for node in replication(primary, "held")["replicas"] if node != home]
    survivor = nodes[survivor_id - 1]
    [third] = [node for node in nodes if node not in (primary, survivor)]
    code, snapshots = primary.api("GET", "/api/v1/volumes/held/snapshots")
    assert code == 200 and [s["incomplete_on"] for s in snapshots] == [[survivor_id]], snapshots

    primary.kill9()
    held = "it alone holds these snapshots whole"
    # (Or moving it, which the assertion below refuses.)
    wait_until("the survivor serving the volume and holding the move back",
               lambda: (replication(survivor, "held")["primary"] == survivor_id
                        and (held in survivor.log() or home not in replication(survivor, "held")["replicas"])),
               timeout=90)
    # Several move checks later, the dead node still holds its replica, and the snapshot is
    # still whole there.
    time.sleep(6)
    info = replication(survivor, "held")
    assert sorted(info["replicas"]) == sorted([home, survivor_id]), f"the only whole copy was moved: {info}"
    code, snapshots = survivor.api("GET", "/api/v1/volumes/held/snapshots")
    assert code == 200 and [s["incomplete_on"] for s in snapshots] == [[survivor_id]], snapshots
    status = survivor.cli("status").stdout
    assert "KEEL_VOLUME_DEGRADED" in status, status
    # Health and the node's info say what the move waits for.
    assert (f"KEEL_REPLICA_MOVE_HELD: volume \"held\"'s replica stays on node {home}" in status
            and 'snapshot(s) "only" whole' in status), status
    code, info = survivor.api("GET", f"/api/v1/nodes/{home}")
    assert code == 200 and info["replicas"] == [
        {"volume": "held", "primary": False, "in_sync": False, "held_for": ["only"]}], info

    code, answer = survivor.api("DELETE", "/api/v1/volumes/held/snapshots/only")
    assert code == 200, answer

    def moved():
        info = replication(survivor, "held")
        return (sorted(info["replicas"]) == sorted([survivor_id, third.node_id()])
                and sorted(info["in_sync"]) == sorted(info["replicas"]))

    wait_until("the replica moved to the third node and in sync", moved, timeout=90)
    status = survivor.cli("status").stdout
    assert "KEEL_REPLICA_MOVE_HELD" not in status, status
    current = attach(survivor, "held", timeout=60)
    for index in range(64):
        expected = block("newer" if index < 32 else "kept", index)
        assert current.read(index * BLOCK, BLOCK) == expected, f"block {index} lost"
    current.close()


def test_a_volume_below_its_in_sync_minimum_still_attaches_forwarded(cluster):
    """A forwarding session opens with a FLUSH, so that what its client reads is durable. An
    R=2 volume with an in-sync minimum of 2 whose replica died refuses FLUSHes, yet a client
    attaching through node 3 (no replica) still gets a session and reads every flushed write;
    its writes fail saying why."""
    nodes = [cluster.add() for _ in range(3)]
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    first, second, third = nodes
    create_r2(first, "low")
    first.cli("volume", "set-replication", "low", "--min-in-sync", "2")
    client = attach(first, "low")
    expected = write_blocks(client, "low", range(64))
    wait_until("both replicas in sync", lambda: sorted(replication(first, "low")["in_sync"]) == [1, 2], timeout=60)
    second.kill9()

    def flush_refused():
        try:
            client.write(0, expected[0])
            client.flush()
            return False
        except Exception:  # the FLUSH that finds too few replicas in sync fails
            return True

    wait_until("a FLUSH refused with node 2 gone", flush_refused, timeout=60)
    assert replication(first, "low")["in_sync"] == [1]
    client.close()

    forwarded = attach(third, "low", timeout=20)
    for index, data in expected.items():
        assert forwarded.read(index * BLOCK, BLOCK) == data, f"block {index} through node 3"
    with pytest.raises(NbdError):
        forwarded.write(0, block("refused", 0))
        forwarded.flush()
    forwarded.close()


def test_a_node_without_a_replica_serves_the_volume_by_forwarding(cluster):
    """Three storage nodes; an R=2 volume on nodes 1 and 2 and an R=1 volume on node 1, both
    attached through node 3, which holds neither: every request is forwarded to the primary,
    and what node 3's client wrote and flushed is what node 1 serves. The primary is killed
    while the forwarding client has nothing unflushed: its next requests go to node 2, which
    took over, without the client noticing. Then the new primary is killed while the client
    has an acknowledged write not yet flushed: its session fails (it cannot vouch for that
    write), and so does a second connection of the same volume with nothing of its own
    unflushed (a FLUSH through it would cover the first's write); a new attach through node 3
    finds every flushed write.
    A snapshot of the R=2 volume is exported through node 3 too (read-only), and shows what
    the volume held when it was taken; its session moves to node 2, a replica holding the
    snapshot whole, as soon as node 1 dies (before node 2 takes the volume over)."""
    nodes = [cluster.add() for _ in range(3)]
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    first, second, third = nodes
    create_r2(first, "fwd")
    code, created = first.api("POST", "/api/v1/volumes", {"name": "one", "size_bytes": SIZE}, timeout=30)
    assert code == 200, created

    client = attach(third, "fwd")
    assert replication(first, "fwd")["primary"] == 1
    expected = {}
    for index in range(128):
        expected[index] = block("forwarded", index)
        client.write(index * BLOCK, expected[index], fua=index % 32 == 0)
    client.flush()
    for index in (0, 77, 127):
        assert client.read(index * BLOCK, BLOCK) == expected[index]
    direct = attach(first, "fwd")
    for index, data in expected.items():
        assert direct.read(index * BLOCK, BLOCK) == data, f"block {index} not on the primary"
    direct.close()
    wait_until("both replicas in sync", lambda: sorted(replication(first, "fwd")["in_sync"]) == [1, 2], timeout=60)
    code, answer = first.api("POST", "/api/v1/volumes/fwd/snapshots", {"name": "frozen"})
    assert code == 200, answer
    frozen = dict(expected)
    for index in range(8):
        client.write(index * BLOCK, block("after the snapshot", index))
    client.flush()
    snapshot = Client(third.host, third.nbd_port, "fwd@frozen", timeout=30)
    for index, data in frozen.items():
        assert snapshot.read(index * BLOCK, BLOCK) == data, f"block {index} of the snapshot through node 3"
    with pytest.raises(NbdError, match="errno 1"):  # EPERM: a snapshot is read-only
        snapshot.write(0, block("into the snapshot", 0))
    for index in range(8):
        expected[index] = block("after the snapshot", index)

    single = attach(third, "one")
    single.write(0, block("single", 0))
    single.flush()
    single.close()
    local = attach(first, "one")
    assert local.read(0, BLOCK) == block("single", 0)
    local.close()

    first.kill9()
    # Before any take-over: node 2 serves the snapshot while still a mere replica.
    for index in (0, 7, 8, 127):
        assert snapshot.read(index * BLOCK, BLOCK) == frozen[index], f"snapshot block {index} after node 1 died"
    snapshot.close()
    assert replication(second, "fwd")["primary"] == 1
    for index, data in expected.items():
        assert client.read(index * BLOCK, BLOCK) == data, f"block {index} lost when the primary died"
    assert replication(second, "fwd")["primary"] == 2
    for index in range(128, 160):
        expected[index] = block("moved", index)
        client.write(index * BLOCK, expected[index])
    client.flush()

    first.start()
    wait_until("node 1 back in sync", lambda: sorted(replication(second, "fwd")["in_sync"]) == [1, 2], timeout=60)
    # A second connection with nothing of its own unflushed: a FLUSH through it would claim
    # the first connection's write durable (multi-conn), so it must not move either.
    second_connection = attach(third, "fwd")
    assert second_connection.read(0, BLOCK) == expected[0]
    client.write(200 * BLOCK, block("unflushed", 200))
    second.kill9()
    for connection in (second_connection, client):
        try:
            connection.read(0, BLOCK)
            raise AssertionError("a session with an unflushed write moved to another node silently")
        except NbdError as failed:
            assert "failed with errno" in str(failed), failed
        connection.close()
    again = attach(third, "fwd", timeout=60)
    for index, data in expected.items():
        assert again.read(index * BLOCK, BLOCK) == data, f"flushed block {index} lost"
    assert replication(first, "fwd")["primary"] == 1
    again.close()


def uncompressed_r2_written(first, name, tag):
    """An uncompressed R=2 volume `name` (its blocks findable in the segment files) on nodes 1
    and 2, attached through node 1, both replicas in sync, its first 64 blocks written and
    flushed. Returns the client and {block index: data}."""
    code, created = first.api("POST", "/api/v1/volumes", {"name": name, "size_bytes": SIZE, "replicas": 2,
                                                         "compression": "none"}, timeout=30)
    assert code == 200, created
    client = attach(first, name)
    wait_until("both replicas in sync", lambda: sorted(replication(first, name)["in_sync"]) == [1, 2])
    expected = {index: block(tag, index) for index in range(64)}
    for index, data in expected.items():
        client.write(index * BLOCK, data)
    client.flush()
    return client, expected


def damage_in_place(node, content):
    """Flips a byte of the one stored copy of `content` in a running node's segment files (in
    place: the server appends to its newest segment)."""
    damaged = 0
    for segment in node.dir.rglob("*.seg"):
        at = segment.read_bytes().find(content)
        if at >= 0:
            with open(segment, "r+b") as file:
                file.seek(at + 100)
                byte = file.read(1)
                file.seek(at + 100)
                file.write(bytes([byte[0] ^ 0xFF]))
            damaged += 1
    assert damaged == 1, f"the block was found in {damaged} segment files of {node.name}"


def test_a_damaged_block_on_a_replica_is_replaced_by_the_primarys_copy(cluster):
    """An uncompressed R=2 volume is written through node 1 and both replicas are in sync. With
    node 2 stopped, one byte of a block in its segment files is flipped (its checksum now
    fails there) and more blocks are written through node 1, three of them next to the damaged
    one (in its 64 KiB unit). When node 2 returns, its catch-up compares what it lacks, that
    unit among them: the damaged block answers as unreadable rather than failing the
    catch-up, the primary ships its copy, and node 2 rejoins. Then a block of node 1's copy, the
    primary's, is damaged while it runs: reading it gives the data written, read from node 2
    and written back (counted in `volume info`), and a second read needs no repair. Then a
    block of each copy is damaged and nobody reads it: `keel volume scrub` on the primary finds
    and repairs both (node 2 refuses it with the primary's address), and a second scrub finds
    nothing. Node 1 is then killed: the volume attached through node 2 reads every block as
    written."""
    first, second = two_nodes_and_witness(cluster)
    client, expected = uncompressed_r2_written(first, "rot", "rot")

    second.stop()
    damaged = 0
    for segment in second.dir.rglob("*.seg"):
        content = bytearray(segment.read_bytes())
        at = content.find(expected[17])
        if at >= 0:
            content[at + 100] ^= 0xFF
            segment.write_bytes(bytes(content))
            damaged += 1
    assert damaged == 1, f"block 17 found in {damaged} segment files of node 2"
    for index in [18, 19, 20, *range(64, 80)]:
        expected[index] = block("rot-absent", index)
        client.write(index * BLOCK, expected[index])
    client.flush()

    second.start()
    wait_until("the damaged replica back in sync",
               lambda: sorted(replication(first, "rot")["in_sync"]) == [1, 2], timeout=60)

    damage_in_place(first, expected[33])
    assert client.read(33 * BLOCK, BLOCK) == expected[33]
    assert replication(first, "rot")["served_here"]["repaired_blocks"] == 1
    assert client.read(32 * BLOCK, 3 * BLOCK) == expected[32] + expected[33] + expected[34]
    assert replication(first, "rot")["served_here"]["repaired_blocks"] == 1

    # Damage nobody reads: a block of each copy, found by `keel volume scrub` on the primary.
    damage_in_place(second, expected[40])
    damage_in_place(first, expected[50])
    refused = second.cli("volume", "scrub", "rot", check=False)
    assert refused.returncode != 0 and "primary is node 1" in refused.stderr, refused.stderr
    report = json.loads(first.cli("volume", "scrub", "rot").stdout)
    assert (report["local_blocks_repaired"], report["replica_blocks_repaired"], report["replicas"]) == (1, 1, 2), report
    assert report["compared_bytes"] + report["skipped_bytes"] == SIZE, report
    report = json.loads(first.cli("volume", "scrub", "rot").stdout)
    assert (report["local_blocks_repaired"], report["replica_blocks_repaired"]) == (0, 0), report
    client.close()
    first.kill9()
    other = attach(second, "rot", timeout=60)
    for index, data in expected.items():
        assert other.read(index * BLOCK, BLOCK) == data, f"block {index} wrong on node 2"


def test_a_scheduled_scrub_repairs_both_copies_of_a_replicated_volume_unasked(cluster, workdir):
    """Node 1 scrubs every 3 s (`scrub.interval_seconds`). A block of each copy of an R=2 volume
    is damaged and nobody reads it or asks for a scrub: the next scheduled run on node 1, the
    primary, heals its own block from node 2 and ships its copy over node 2's. Node 1 is then
    killed, and the volume attached through node 2 reads every block as written."""
    config = workdir / "scrub-often.toml"
    config.write_text("[scrub]\ninterval_seconds = 3\nbusy_percent = 100\n")
    first = cluster.add(extra_args=["--config", str(config)])
    second = cluster.add()
    cluster.add(witness=True)
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    client, expected = uncompressed_r2_written(first, "rot", "scheduled")
    client.close()

    damage_in_place(second, expected[40])
    damage_in_place(first, expected[50])
    damaged_at_ms = time.time() * 1000

    def a_run_since_the_damage():
        code, status = first.api("GET", "/api/v1/status")
        assert code == 200, status
        last = status["scrub"]["last"]
        return last if last and last["started_unix_ms"] > damaged_at_ms else None

    run = wait_until("a scheduled scrub after the damage", a_run_since_the_damage, timeout=60)
    assert run["volumes_compared"] == 1 and run["errors"] == [], run
    assert replication(first, "rot")["served_here"]["repaired_blocks"] == 1
    first.kill9()
    other = attach(second, "rot", timeout=60)
    for index, data in expected.items():
        assert other.read(index * BLOCK, BLOCK) == data, f"block {index} wrong on node 2"


def test_a_caught_up_replica_has_every_copied_byte_when_it_joins(cluster, workdir):
    """A 64 MiB volume written at R=1 is raised to R=2 with no client: the catch-up copies it
    all, and the copy has no history position (no write was ordered since the primary started
    serving). Node 1's transport delays each replication batch to node 2 by 150 ms, so the
    last batches are still on their way long after everything is queued. The catch-up must
    join the in-sync set only once the flush behind its last copied data is confirmed: the
    moment node 2 shows in sync, node 1 is killed -9, and node 2, taking the volume over,
    serves every byte. (A catch-up that waited by history position joined at once and lost
    the batches in flight.)"""
    size = 64 << 20
    first, second, client = pair_with_one_replica(cluster, workdir, "resync_busy_percent = 100", "join", size)
    data = write_random(client, size)
    client.close()
    first.faults([], delays=[{"node": second.node_id(), "method": METHOD_REPLICATE, "milliseconds": 150}])
    first.cli("volume", "set-replication", "join", "--replicas", "2")
    deadline = time.time() + 120
    while sorted(replication(first, "join")["in_sync"]) != [1, 2]:
        assert time.time() < deadline, "the new replica never caught up"
        time.sleep(0.005)
    first.kill9()
    other = attach(second, "join", timeout=60)
    for offset in range(0, size, 1 << 20):
        assert other.read(offset, 1 << 20) == data[offset:offset + (1 << 20)], \
            f"node 2 joined the in-sync set without the MiB at {offset >> 20}"


def test_keel_ops_shows_each_replicas_confirmation_of_a_flush(cluster, workdir):
    """`keel ops` on the primary shows, for a FLUSH of a replicated volume, how long it waited
    for each replica (issue 14: "replicated per replica"). Node 1 delays its replication
    batches to node 2 by 300 ms, so node 2's confirmation comes at least that late: the flush
    spends that time in the "replicating" phase and records "replica on node 2" after it."""
    first, second, client = pair_with_one_replica(cluster, workdir, "resync_busy_percent = 100", "opsr2")
    first.cli("volume", "set-replication", "opsr2", "--replicas", "2")
    wait_until("node 2 in sync", lambda: sorted(replication(first, "opsr2")["in_sync"]) == [1, 2], timeout=120)
    first.faults([], delays=[{"node": second.node_id(), "method": METHOD_REPLICATE, "milliseconds": 300}])
    client.write(0, block("ops", 0))
    client.flush()
    client.close()
    first.faults([])
    code, report = first.api("GET", "/api/v1/ops")
    assert code == 200, report
    flushes = [op for op in report["slowest"] if op["operation"] == "flush" and op["target"] == "opsr2"]
    assert flushes, report["slowest"]
    slowest = max(flushes, key=lambda op: op["duration_ms"])
    waits = {wait["what"]: wait["ms"] for wait in slowest.get("waited_for", [])}
    assert waits.get(f"replica on node {second.node_id()}", 0) >= 290, slowest
    spent = {phase["phase"]: phase["ms"] for phase in slowest["phases"]}
    assert spent.get("replicating", 0) >= 250, slowest
    table = first.cli("ops", "--slow").stdout
    assert f"replica on node {second.node_id()}" in table, table
