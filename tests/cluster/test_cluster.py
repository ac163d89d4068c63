"""Multi-process cluster tests: real `keel server` processes on 127.0.0.1–127.0.0.9 forming,
growing, losing and healing a cluster. Each test says what it proves. Nodes share one disk here.

KEEL_CLUSTER_KILLS sets how many leader kills the kill test runs (default 4; the long mode and
the failover benchmark run 20 or more)."""

import os
import socket
import statistics
import threading
import time

import pytest

from keelcluster import KEEL_BIN, Node, PortTaken, wait_until

KILLS = int(os.environ.get("KEEL_CLUSTER_KILLS", "4"))


def create_volume(node, name):
    return node.api("POST", "/api/v1/volumes", {"name": name, "size_bytes": 1 << 20}, timeout=30)


def volume_names(node):
    code, volumes = node.api("GET", "/api/v1/volumes")
    assert code == 200, volumes
    return [v["name"] for v in volumes]


def test_clusters_of_one_three_and_five_form(cluster):
    """1 node: 1 voter. 2 nodes: still 1 voter (2 would tolerate no more failures). 3: 3 voters.
    With --voters 5, 5 nodes: 5 voters; every node reports the same leader and membership."""
    first = cluster.add(extra_args=["--voters", "5"])
    assert "ready" in "".join(first.banner)
    assert cluster.voters() == {1}
    cluster.add()
    time.sleep(1.0)
    assert cluster.voters() == {1}, "two nodes keep one voter"
    cluster.add()
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    cluster.add()
    cluster.add()
    wait_until("five voters", lambda: cluster.voters() == {1, 2, 3, 4, 5})
    leaders = {node.status()["leader"] for node in cluster.nodes}
    assert len(leaders) == 1 and None not in leaders
    listing = first.cli("node", "list").stdout
    for node in cluster.nodes:
        assert node.name in listing
    assert first.status()["health"] == [], first.status()["health"]


def test_proposals_on_any_node_are_seen_everywhere(cluster):
    """A volume created through a follower's admin API is committed by the leader and listed
    by every node; its replica lives on the node that created it."""
    nodes = [cluster.add() for _ in range(3)]
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    follower = next(n for n in nodes if n.node_id() != cluster.leader())
    code, created = create_volume(follower, "through-follower")
    assert code == 200, created
    for node in nodes:
        wait_until(f"{node.name} lists it", lambda node=node: "through-follower" in volume_names(node))
    elsewhere = next(n for n in nodes if n is not follower)
    code, info = elsewhere.api("GET", "/api/v1/volumes/through-follower")
    assert code == 421, (code, info)
    assert f"node {follower.node_id()}" in info["error"], info
    code, duplicate = create_volume(nodes[0], "through-follower")
    assert code == 409 and "already exists" in duplicate["error"], duplicate


def test_two_storage_nodes_and_a_witness(cluster):
    """Two storage nodes and a witness: three voters, the witness serves no S3 or NBD; losing
    the witness or one storage node leaves metadata writable; the health says what is down."""
    a = cluster.add()
    b = cluster.add()
    w = cluster.add(witness=True)
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    assert not any(line.strip().startswith("s3 ") for line in w.banner), w.banner
    assert "witness" in "".join(w.banner)
    w.kill9()
    code, answer = create_volume(a, "without-witness")
    assert code == 200, answer
    wait_until("witness recorded down", lambda: any(
        n["record"]["name"] == w.name and n["record"]["state"] == "Down" for n in a.status()["nodes"]), timeout=40)
    assert any(check["code"] == "KEEL_NODE_DOWN" for check in a.status()["health"])
    w.start()
    wait_until("witness catches up", lambda: w.status()["last_applied_index"] >= a.status()["last_applied_index"])
    b.kill9()
    code, answer = create_volume(a, "without-b")
    assert code == 200, answer


def test_leader_kill_under_a_stream_of_changes(cluster, workdir):
    """kill -9 of the leader while changes stream in through the other nodes: a new leader
    within seconds, every acknowledged change present afterwards on every node, no change
    applied twice, and the killed node catches up when it returns."""
    nodes = [cluster.add() for _ in range(3)]
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    acknowledged, failed = [], []
    stop = threading.Event()
    counter = [0]

    def stream():
        while not stop.is_set():
            counter[0] += 1
            name = f"v{counter[0]}"
            targets = [n for n in nodes if n.proc is not None]
            target = targets[counter[0] % len(targets)]
            try:
                code, answer = create_volume(target, name)
            except OSError:
                code, answer = 0, None
            (acknowledged if code == 200 else failed).append((time.time(), name))

    writer = threading.Thread(target=stream)
    writer.start()
    failovers = []
    try:
        for _ in range(KILLS):
            time.sleep(1.0)
            leader_id = wait_until("a leader", lambda: cluster.leader())
            victim = cluster.node_by_id(leader_id)
            killed_at = time.time()
            victim.kill9()
            survivor = next(n for n in nodes if n.proc is not None)
            wait_until("a new leader", lambda: survivor.status()["leader"] not in (None, leader_id), timeout=30)
            wait_until("a change acknowledged after the kill",
                       lambda: any(at > killed_at for at, _ in acknowledged), timeout=30)
            failovers.append(min(at for at, _ in acknowledged if at > killed_at) - killed_at)
            victim.start()
    finally:
        stop.set()
        writer.join()
    names = set(name for _, name in acknowledged)
    for node in nodes:
        wait_until(f"{node.name} has every acknowledged change",
                   lambda node=node: names <= set(volume_names(node)), timeout=60)
    listed = volume_names(nodes[0])
    assert len(listed) == len(set(listed)), "a change applied twice"
    attempted = names | set(name for _, name in failed)
    assert set(listed) <= attempted, "a change nobody asked for"
    assert all(set(volume_names(n)) == set(listed) for n in nodes), "one history"
    print(f"failover to the next acknowledged change (s): {sorted(round(f, 2) for f in failovers)}, "
          f"median {statistics.median(failovers):.2f}; {len(acknowledged)} acknowledged, {len(failed)} failed")
    assert max(failovers) < 20, failovers


def test_a_minority_refuses_writes_and_heals(cluster):
    """The transport's fault proxy isolates the leader: it refuses writes with a clear error,
    the majority elects a leader and accepts writes, and after healing all nodes hold one
    history."""
    nodes = [cluster.add() for _ in range(3)]
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    leader_id = cluster.leader()
    minority = cluster.node_by_id(leader_id)
    majority = [n for n in nodes if n is not minority]
    others = [n.node_id() for n in majority]
    minority.faults(others)
    for node in majority:
        node.faults([leader_id])
    code, answer = create_volume(minority, "on-the-minority")
    assert code == 503, (code, answer)
    assert "quorum" in answer["error"] or "did not answer" in answer["error"], answer
    wait_until("the majority elects", lambda: majority[0].status()["leader"] not in (None, leader_id), timeout=30)
    code, answer = create_volume(majority[0], "on-the-majority")
    assert code == 200, answer
    for node in nodes:
        node.faults([])
    wait_until("one history", lambda: all(
        set(volume_names(n)) == set(volume_names(nodes[0])) and "on-the-majority" in volume_names(n) for n in nodes),
        timeout=40)


def test_a_restarted_node_catches_up_by_snapshot(cluster, workdir):
    """A node away while the log moves far past a snapshot gets the snapshot when it returns."""
    config = workdir / "keel.toml"
    config.write_text("[cluster]\nsnapshot_every_entries = 20\n")
    args = ["--config", str(config)]
    nodes = [cluster.add(extra_args=args) for _ in range(3)]
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    away = nodes[2]
    left_at = away.status()["last_applied_index"]
    away.stop()
    for i in range(80):
        code, answer = create_volume(nodes[0], f"s{i}")
        assert code == 200, answer
    wait_until("the others purged the entries it missed",
               lambda: all((n.status()["last_purged_index"] or 0) > left_at for n in nodes[:2]))
    away.start()
    wait_until("caught up", lambda: len(volume_names(away)) == 80, timeout=60)
    assert "installed a metadata snapshot" in away.log()


def test_wrong_token_and_garbage_are_refused(cluster, workdir):
    """A node with the wrong cluster secret cannot join: it exits with a clear error at the
    first refusal (a refusal at the handshake is not retried) and the member logs it; garbage
    sent to the cluster port closes that connection only."""
    a = cluster.add()
    wrong = "keel1-" + a.token_file.read_text().split("-")[1] + "-" + "ab" * 32
    intruder = Node(workdir, 2)
    cluster.nodes.append(intruder)
    code = intruder.start(join=a, token=wrong, expect_failure=True)
    assert code != 0
    log = intruder.log().lower()
    assert "join" in log and "refused this node" in log and "secret" in log, log[-2000:]
    assert "retrying" not in log, log[-2000:]
    wait_until("the member logged the refusal", lambda: "refus" in a.log().lower() or "authentic" in a.log().lower())
    with socket.create_connection((a.host, a.cluster_port), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + os.urandom(4096))
        raw.settimeout(5)
        try:
            raw.recv(1024)
        except OSError:
            pass
    code, answer = create_volume(a, "still-serving")
    assert code == 200, answer


def test_a_node_whose_port_is_taken_stops_before_it_joins(cluster, workdir):
    """A joining node whose S3 port is in use stops with a clear error before it becomes a
    member: the cluster never lists it, so started again on free ports it joins under the
    addresses it serves. (It used to join first, under a cluster address its next start on
    other ports no longer served, and stay unreachable.)"""
    a = cluster.add()
    node = Node(workdir, 2)
    cluster.nodes.append(node)
    with socket.socket() as taken:
        taken.bind((node.host, 0))
        taken.listen()
        node.s3_port = taken.getsockname()[1]
        with pytest.raises(PortTaken):
            node.start_once(join=a, token=None, expect_failure=False)
    assert f"cannot listen for s3 on {node.host}:{node.s3_port}" in node.log(), node.log()[-2000:]
    assert [n["record"]["name"] for n in a.status()["nodes"]] == ["n1"]
    node.pick_ports()
    node.start(join=a)
    # Node 2 learns the membership from the leader, which reaches it at its cluster address.
    wait_until("node 2 reached by the leader",
               lambda: sorted(n["record"]["name"] for n in node.status()["nodes"]) == ["n1", "n2"])
    code, answer = create_volume(node, "after-the-taken-port")
    assert code == 200, answer


def test_drain_and_remove(cluster):
    """Draining a voter moves its seat to another node; removing a node takes it out for good,
    and a node holding a volume replica cannot be removed."""
    nodes = [cluster.add() for _ in range(4)]
    voters = wait_until("three voters", lambda: len(cluster.voters() or ()) == 3 and cluster.voters())
    learner = next(n for n in nodes if n.node_id() not in voters)
    seat = next(n for n in nodes if n.node_id() in voters and n.node_id() != cluster.leader())
    nodes[0].cli("node", "drain", seat.name)
    wait_until("the drained node lost its seat", lambda: seat.node_id() not in cluster.voters(via=nodes[0])
               and learner.node_id() in cluster.voters(via=nodes[0]))
    code, answer = create_volume(learner, "on-learner")
    assert code == 200, answer
    refused = nodes[0].cli("node", "remove", learner.name, check=False)
    assert refused.returncode != 0 and "replica" in refused.stderr, refused.stderr
    removed_id = seat.node_id()
    seat.stop()
    nodes[0].cli("node", "remove", seat.name)
    wait_until("removed", lambda: seat.name not in nodes[0].cli("node", "list").stdout)
    status = nodes[0].status()
    assert all(n["record"]["id"] != removed_id or n["record"]["removed"] for n in status["nodes"])


def test_leadership_moves_to_the_voter_asked(cluster):
    """`keel cluster transfer-leader` hands Raft leadership to the voter named (asked of a
    follower, which asks the leader), and back by id; a learner or an unknown node is refused
    and the leader stays."""
    nodes = [cluster.add() for _ in range(4)]
    voters = wait_until("three voters", lambda: len(cluster.voters() or ()) == 3 and cluster.voters())
    learner = next(n for n in nodes if n.node_id() not in voters)
    leader = cluster.leader()
    followers = [n for n in nodes if n.node_id() in voters and n.node_id() != leader]
    asked, target = followers
    done = asked.cli("cluster", "transfer-leader", target.name)
    assert f"node {target.node_id()} ({target.name}) leads" in done.stdout, done.stdout
    wait_until("every node sees the new leader",
               lambda: all(cluster.leader(via=n) == target.node_id() for n in nodes))
    back = target.cli("cluster", "transfer-leader", str(leader))
    assert f"node {leader} " in back.stdout, back.stdout
    wait_until("the old leader leads again", lambda: cluster.leader(via=asked) == leader)
    refused = asked.cli("cluster", "transfer-leader", learner.name, check=False)
    assert refused.returncode != 0 and "only a metadata voter can lead" in refused.stderr, refused.stderr
    unknown = asked.cli("cluster", "transfer-leader", "no-such-node", check=False)
    assert unknown.returncode != 0 and "not found" in unknown.stderr, unknown.stderr
    assert cluster.leader(via=asked) == leader


def test_force_primary_after_losing_both_other_voters(cluster):
    """Two storage nodes and a witness, both others lost: the survivor refuses metadata writes;
    force-primary (refused without confirmation) makes it the only voter and writes resume."""
    import subprocess
    a = cluster.add()
    b = cluster.add()
    w = cluster.add(witness=True)
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    code, _ = create_volume(a, "before")
    assert code == 200
    b.kill9()
    w.kill9()
    code, answer = create_volume(a, "blocked")
    assert code == 503, (code, answer)
    wait_until("no quorum reported", lambda: any(check["code"] == "KEEL_NO_QUORUM" for check in a.status()["health"]))
    a.stop()
    refused = subprocess.run([KEEL_BIN, "cluster", "force-primary", "--data", str(a.dir)], capture_output=True, text=True)
    assert refused.returncode != 0 and "LOST" in refused.stderr, refused.stderr
    forced = subprocess.run([KEEL_BIN, "cluster", "force-primary", "--data", str(a.dir),
                             "--yes-i-accept-losing-metadata"], capture_output=True, text=True)
    assert forced.returncode == 0, forced.stderr
    assert "WARNING" in forced.stderr
    a.start()
    code, answer = create_volume(a, "after")
    assert code == 200, answer
    assert {"before", "after"} <= set(volume_names(a))
    assert cluster.voters(via=a) == {a.node_id()}
