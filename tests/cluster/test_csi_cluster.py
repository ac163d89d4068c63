"""The CSI controller on a three-node cluster (keel processes on loopback sharing one disk): a
volume is created on the node the CO asks for by topology (where the pod's node plugin will
attach it), and the volume operations that must run on the volume's primary (snapshot, clone,
expand) reach it although the driver talks to another node. The nodes share one admin token
(`keel server --admin-token-file`), as the Kubernetes manifests set them up. And the node
plugins of two nodes holding replicas, as a pod moves from one to the other."""

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from keelcluster import KEEL_BIN, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import csi_stubs  # noqa: E402

MIB = 1 << 20
NODE_KEY = "topology.csi.keel.io/node"


def api(node, token, path):
    request = urllib.request.Request(f"http://{node.admin}{path}", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_controller_places_volumes_by_topology_and_routes_to_the_primary(cluster, workdir):
    token = secrets.token_hex(24)
    token_file = workdir / "shared-admin-token"
    token_file.write_text(token + "\n")
    nodes = [cluster.add(extra_args=["--admin-token-file", str(token_file)]) for _ in range(3)]
    for node in nodes:
        # The shared token is the node's token: no per-node token file was created.
        assert not (node.dir / "admin-token").exists()
        # The test helpers (keel CLI) read the token from the data directory.
        (node.dir / "admin-token").write_text(token)
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    first, second = nodes[0], nodes[1]
    second_id = second.node_id()

    pb, rpc = csi_stubs.generate(workdir / "stubs")
    socket_path = workdir / "csi.sock"
    env = dict(os.environ, KEEL_ADMIN_TOKEN=token)
    with open(workdir / "csi.log", "ab") as log:
        driver = subprocess.Popen([KEEL_BIN, "csi", "--mode", "controller", "--endpoint", f"unix://{socket_path}",
                                   "--admin", first.admin], stdout=log, stderr=log, env=env)
    try:
        wait_until("the CSI socket", socket_path.exists, timeout=30)
        channel = csi_stubs.connect(socket_path)
        controller, identity = rpc.ControllerStub(channel), rpc.IdentityStub(channel)
        services = {c.service.type for c in identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest()).capabilities}
        assert pb.PluginCapability.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS in services
        mount = pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
            access_mode=pb.VolumeCapability.AccessMode(mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))
        on_second = pb.TopologyRequirement(preferred=[pb.Topology(segments={NODE_KEY: second.name})],
                                           requisite=[pb.Topology(segments={NODE_KEY: second.name})])

        # Created through node 1, placed on node 2 as the CO asked.
        volume = controller.CreateVolume(pb.CreateVolumeRequest(
            name="pvc-a", capacity_range=pb.CapacityRange(required_bytes=64 * MIB), volume_capabilities=[mount],
            accessibility_requirements=on_second)).volume
        assert [dict(t.segments) for t in volume.accessible_topology] == [{NODE_KEY: second.name}]
        replication = api(second, token, "/api/v1/volumes/pvc-a")["replication"]
        assert (replication["primary"], replication["replicas"]) == (second_id, [second_id])

        # Snapshot, clone and expand run on the primary (node 1 would answer 421).
        snapshot = controller.CreateSnapshot(pb.CreateSnapshotRequest(name="snap-a", source_volume_id="pvc-a")).snapshot
        clone = controller.CreateVolume(pb.CreateVolumeRequest(
            name="pvc-a-restore", volume_capabilities=[mount], capacity_range=pb.CapacityRange(required_bytes=128 * MIB),
            volume_content_source=pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snapshot.snapshot_id)))).volume
        assert clone.capacity_bytes == 128 * MIB
        assert [dict(t.segments) for t in clone.accessible_topology] == [{NODE_KEY: second.name}]
        # A clone lives with its parent: asked for on node 1 only, it is refused so the scheduler
        # picks another node, rather than created where the pod could not attach it.
        with pytest.raises(grpc.RpcError) as refused:
            controller.CreateVolume(pb.CreateVolumeRequest(
                name="pvc-a-elsewhere", volume_capabilities=[mount],
                accessibility_requirements=pb.TopologyRequirement(requisite=[pb.Topology(segments={NODE_KEY: first.name})]),
                volume_content_source=pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snapshot.snapshot_id))))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        grown = controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
            volume_id="pvc-a", capacity_range=pb.CapacityRange(required_bytes=256 * MIB)))
        assert grown.capacity_bytes == 256 * MIB
        assert api(second, token, "/api/v1/volumes/pvc-a")["volume"]["size_bytes"] == 256 * MIB

        # A topology with no Keel node in it is refused, not placed anywhere.
        with pytest.raises(grpc.RpcError) as refused:
            controller.CreateVolume(pb.CreateVolumeRequest(
                name="pvc-nowhere", volume_capabilities=[mount],
                accessibility_requirements=pb.TopologyRequirement(requisite=[pb.Topology(segments={NODE_KEY: "not-a-keel-node"})])))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "pvc-nowhere" not in [v["name"] for v in api(first, token, "/api/v1/volumes")]

        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id="pvc-a-restore"))
        controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snapshot.snapshot_id))
        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id="pvc-a"))
        deadline = time.time() + 30
        while api(first, token, "/api/v1/volumes") and time.time() < deadline:
            time.sleep(0.1)
        assert api(first, token, "/api/v1/volumes") == []
    finally:
        driver.terminate()
        driver.wait(timeout=30)


def test_a_pod_moving_to_another_replica_node_gets_the_volume_handed_over(cluster, workdir):
    """Kubelet's flow on two nodes holding replicas of an R=2 volume (nodes 1 and 2, and a
    witness; one `keel csi --mode node` per node, staging through nbdfuse + a loop device +
    ext4): the pod runs on node 1 (the primary), writes a file and fsyncs it, and is deleted
    (unpublish, unstage); the pod then starts on node 2, whose plugin stages the volume while
    node 1 is up, as a rolling update or `kubectl drain` does. Node 2 gets the volume handed
    over (its primary now), finds the file, writes another, and with node 2 killed node 1
    takes the volume back (once node 2's lease ran out: kubelet retries staging until then)
    and serves both."""
    for tool, package in (("nbdfuse", "libnbd-bin"), ("losetup", "util-linux"), ("mkfs.ext4", "e2fsprogs")):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            pytest.fail(f"{tool} is not installed (Debian package {package}); scripts/test.sh installs it")
    first = cluster.add()
    second = cluster.add()
    cluster.add(witness=True)
    wait_until("three voters", lambda: cluster.voters() == {1, 2, 3})
    code, created = first.api("POST", "/api/v1/volumes", {"name": "pvc-moving", "size_bytes": 64 * MIB, "replicas": 2},
                              timeout=30)
    assert code == 200, created
    wait_until("both replicas in sync", lambda: sorted(first.api("GET", "/api/v1/volumes/pvc-moving")[1]
                                                       ["replication"]["in_sync"]) == [1, 2], timeout=30)

    pb, rpc = csi_stubs.generate(workdir / "stubs")
    mount = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
        access_mode=pb.VolumeCapability.AccessMode(mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))
    plugins = []

    def plugin(node):
        """Starts node `node`'s plugin; returns its Node stub."""
        # A unix socket's path has at most 107 bytes: not under this test's long workdir.
        socket_path = Path(tempfile.mkdtemp(prefix=f"keel-csi-{node.name}-")) / "csi.sock"
        log = open(workdir / f"csi-{node.name}.log", "ab")
        plugins.append(subprocess.Popen(
            [KEEL_BIN, "csi", "--mode", "node", "--endpoint", f"unix://{socket_path}", "--node-id", node.name,
             "--nbd", f"{node.host}:{node.nbd_port}", "--state-dir", str(workdir / f"csi-state-{node.name}"),
             "--attach", "nbdfuse", "--admin", node.admin, "--token-dir", str(node.dir)], stdout=log, stderr=log))
        wait_until(f"{node.name}'s CSI socket", socket_path.exists, timeout=30)
        return rpc.NodeStub(csi_stubs.connect(socket_path))

    def pod(node_stub, name):
        """Stages and publishes the volume for a pod `name`; returns (stage, target)."""
        stage, target = workdir / f"stage-{name}", workdir / "pods" / name / "data"
        node_stub.NodeStageVolume(pb.NodeStageVolumeRequest(
            volume_id="pvc-moving", staging_target_path=str(stage), volume_capability=mount))
        node_stub.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id="pvc-moving", staging_target_path=str(stage), target_path=str(target), volume_capability=mount))
        return stage, target

    def gone(node_stub, stage, target):
        node_stub.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id="pvc-moving", target_path=str(target)))
        node_stub.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id="pvc-moving", staging_target_path=str(stage)))

    def write(path, data):
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def primary(node):
        code, info = node.api("GET", "/api/v1/volumes/pvc-moving")
        assert code == 200, info
        return info["replication"]["primary"]

    try:
        on_first, on_second = plugin(first), plugin(second)
        stage, target = pod(on_first, "a")
        before = os.urandom(3 * MIB)
        write(target / "before", before)
        gone(on_first, stage, target)
        assert primary(first) == 1

        stage, target = pod(on_second, "b")
        assert primary(second) == 2
        assert "handed the volume to the node a client attached to" in first.log()
        assert (target / "before").read_bytes() == before
        after = os.urandom(3 * MIB)
        write(target / "after", after)
        gone(on_second, stage, target)
        wait_until("node 1 caught up", lambda: sorted(second.api("GET", "/api/v1/volumes/pvc-moving")[1]
                                                      ["replication"]["in_sync"]) == [1, 2], timeout=60)

        second.kill9()

        refusals = []

        def staged():
            # Refused until node 2's lease has run out (kubelet retries the same way), with
            # the Keel server's reason rather than only nbdfuse's "no export named".
            try:
                return pod(on_first, "c")
            except grpc.RpcError as refused:
                assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
                refusals.append(refused.details())
                return None
        stage, target = wait_until("the pod staged on node 1", staged, timeout=60)
        assert refusals, "staged at once on node 1 with node 2's lease still running"
        print("NodeStage refused:", refusals[0])
        for details in refusals:
            assert 'the Keel server refused: export "pvc-moving" cannot be opened: ' in details, details
        assert primary(first) == 1
        assert (target / "before").read_bytes() == before
        assert (target / "after").read_bytes() == after
        gone(on_first, stage, target)
    finally:
        for process in plugins:
            process.terminate()
            process.wait(timeout=30)
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            point = line.split(" ")[4]
            if point.startswith(str(workdir)):
                subprocess.run(["umount", "-l", point], capture_output=True)
