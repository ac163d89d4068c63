"""The Kubernetes CSI driver (`keel csi`) against a real `keel server`: the csi-sanity conformance
suite, and the calls kubelet and the sidecars make, through gRPC, with real staging on this
machine (nbdfuse + a loop device + ext4, as root)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import KEEL_BIN, ROOT, require

sys.path.insert(0, str(ROOT / "tests"))
import csi_stubs  # noqa: E402
GIB = 1 << 30
MIB = 1 << 20
# csi-sanity specs that must pass: every spec for what the driver advertises. A capability that
# silently disappeared would turn its specs into skips and lower this count.
SANITY_PASSED_MIN = 71


@pytest.fixture(scope="module")
def csi_pb(tmp_path_factory):
    return csi_stubs.generate(tmp_path_factory.mktemp("csi-stubs"))


class Driver:
    """One `keel csi --mode both` process started by a test, stopped by its PID only."""

    def __init__(self, server, workdir):
        self.server = server
        self.workdir = workdir
        self.socket = workdir / "csi.sock"
        self.state = workdir / "csi-state"
        self.proc = None

    def start(self):
        if self.socket.exists():
            self.socket.unlink()
        # No --node-id: it defaults to the host name, which is also the server's node name, and
        # the controller places volumes by that name (topology.csi.keel.io/node).
        args = [KEEL_BIN, "csi", "--endpoint", f"unix://{self.socket}", "--mode", "both",
                "--nbd", self.server.nbd, "--state-dir", str(self.state),
                "--attach", "nbdfuse", "--admin", self.server.admin, "--token-dir", str(self.server.data_dirs[0])]
        self.log = open(self.workdir / "csi.log", "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log)
        deadline = time.time() + 30
        while not self.socket.exists():
            assert self.proc.poll() is None, f"keel csi exited: {(self.workdir / 'csi.log').read_text()}"
            assert time.time() < deadline, "keel csi did not open its socket"
            time.sleep(0.05)
        return self

    def kill9(self):
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture
def driver(server, workdir):
    require("nbdfuse", "libnbd-bin")
    require("losetup", "util-linux")
    require("mkfs.ext4", "e2fsprogs")
    d = Driver(server, workdir).start()
    yield d
    d.stop()
    # Whatever a failed test left staged: unmount and detach so the next test starts clean.
    for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
        point = line.split(" ")[4]
        if point.startswith(str(workdir)):
            subprocess.run(["umount", "-l", point], capture_output=True)
    subprocess.run(["losetup", "-D"], capture_output=True)


@pytest.mark.parametrize("access_type", ["mount", "block"])
def test_csi_sanity_passes(driver, workdir, access_type):
    """csi-sanity v5.6.0 (installed by scripts/install-deps.sh) against `keel csi --mode both` and a
    real server, node specs included (real staging through nbdfuse + loop, with ext4 for mount
    volumes and the bare device for block volumes)."""
    require("csi-sanity", "csi-sanity (go install, scripts/install-deps.sh)")
    result = subprocess.run(
        ["csi-sanity", "--csi.endpoint", str(driver.socket),
         "--csi.stagingdir", str(workdir / "sanity-stage"), "--csi.mountdir", str(workdir / "sanity-mount"),
         "--csi.testvolumesize", str(64 * MIB), "--csi.testvolumeexpandsize", str(128 * MIB),
         "--csi.testvolumeaccesstype", access_type,
         "-ginkgo.v", "-ginkgo.no-color", "-ginkgo.timeout", "10m"],
        capture_output=True, text=True, timeout=900)
    (workdir / "csi-sanity.out").write_text(result.stdout + result.stderr)
    skipped = sorted(set(re.findall(r"\[SKIPPED\] (.*not supported)", result.stdout)))
    print("csi-sanity skipped (capabilities the driver does not advertise):\n  " + "\n  ".join(skipped))
    summary = re.search(r"(\d+) Passed \| (\d+) Failed", result.stdout)
    assert result.returncode == 0 and summary, f"csi-sanity failed:\n{result.stdout[-6000:]}"
    passed, failed = int(summary.group(1)), int(summary.group(2))
    assert failed == 0
    assert passed >= SANITY_PASSED_MIN, f"only {passed} specs passed; more are skipped than before: {skipped}"


def usage_of(node, pb, volume_id, path):
    stats = node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path=str(path)))
    return {u.unit: u for u in stats.usage}


def test_kubelet_flow_snapshot_clone_expand_and_plugin_restart(driver, server, workdir, csi_pb):
    """The calls a StorageClass, kubelet and the sidecars make: create with parameters, stage,
    publish, write, snapshot, clone from the snapshot, stage the clone and compare, expand, kill -9
    the plugin while volumes are published and find them intact, then tear everything down; and
    the refusals a CO relies on."""
    import grpc

    pb, rpc = csi_pb
    def connect():
        channel = csi_stubs.connect(driver.socket)
        return rpc.ControllerStub(channel), rpc.NodeStub(channel)

    controller, node = connect()
    mount = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
        access_mode=pb.VolumeCapability.AccessMode(mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))

    def code_of(call):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        return refused.value.code()

    # A StorageClass with compression and an IOPS limit; the volume gets them.
    created = controller.CreateVolume(pb.CreateVolumeRequest(
        name="pvc-data", capacity_range=pb.CapacityRange(required_bytes=256 * MIB),
        volume_capabilities=[mount], parameters={"compression": "zstd", "iopsMax": "5000",
                                                 "csi.storage.k8s.io/pvc/name": "data"}))
    vid = created.volume.volume_id
    assert created.volume.capacity_bytes == 256 * MIB
    info = json.loads(server.cli("volume", "info", vid).stdout)["volume"]
    assert (info["compression"], info["iops_max"]) == ("zstd", 5000), info
    # Idempotent by name; a different size under the same name is refused.
    again = controller.CreateVolume(pb.CreateVolumeRequest(
        name="pvc-data", capacity_range=pb.CapacityRange(required_bytes=256 * MIB), volume_capabilities=[mount]))
    assert again.volume.volume_id == vid
    assert code_of(lambda: controller.CreateVolume(pb.CreateVolumeRequest(
        name="pvc-data", capacity_range=pb.CapacityRange(required_bytes=512 * MIB),
        volume_capabilities=[mount]))) == grpc.StatusCode.ALREADY_EXISTS
    assert code_of(lambda: controller.CreateVolume(pb.CreateVolumeRequest(
        name="pvc-typo", volume_capabilities=[mount], parameters={"iopsmax": "5"}))) == grpc.StatusCode.INVALID_ARGUMENT

    stage, target = workdir / "stage-data", workdir / "pods" / "a" / "data"
    node.NodeStageVolume(pb.NodeStageVolumeRequest(volume_id=vid, staging_target_path=str(stage), volume_capability=mount))
    node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=vid, staging_target_path=str(stage), target_path=str(target), volume_capability=mount))
    payload = os.urandom(3 * MIB)
    (target / "payload.bin").write_bytes(payload)
    subprocess.run(["sync", "-f", str(target / "payload.bin")], check=True)
    usage = usage_of(node, pb, vid, target)
    assert usage[pb.VolumeUsage.BYTES].used >= 3 * MIB
    assert usage[pb.VolumeUsage.INODES].total > 0

    # Snapshot, then a clone from it, staged next to the original.
    snap = controller.CreateSnapshot(pb.CreateSnapshotRequest(name="snap-1", source_volume_id=vid)).snapshot
    assert snap.ready_to_use and snap.source_volume_id == vid
    (target / "after-snapshot.txt").write_text("not in the snapshot")
    clone = controller.CreateVolume(pb.CreateVolumeRequest(
        name="pvc-restore", capacity_range=pb.CapacityRange(required_bytes=256 * MIB), volume_capabilities=[mount],
        volume_content_source=pb.VolumeContentSource(snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snap.snapshot_id)))).volume
    cid = clone.volume_id
    # A volume with a snapshot is not deleted behind the CO's back.
    assert code_of(lambda: controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))) == grpc.StatusCode.FAILED_PRECONDITION

    # Expand the clone before it is staged (offline expansion): the filesystem grows at staging.
    grown = controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=cid, capacity_range=pb.CapacityRange(required_bytes=512 * MIB), volume_capability=mount))
    assert grown.capacity_bytes == 512 * MIB and grown.node_expansion_required
    cstage, ctarget = workdir / "stage-restore", workdir / "pods" / "b" / "restore"
    node.NodeStageVolume(pb.NodeStageVolumeRequest(volume_id=cid, staging_target_path=str(cstage), volume_capability=mount))
    node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=cid, staging_target_path=str(cstage), target_path=str(ctarget), volume_capability=mount))
    expanded = node.NodeExpandVolume(pb.NodeExpandVolumeRequest(
        volume_id=cid, volume_path=str(ctarget), capacity_range=pb.CapacityRange(required_bytes=512 * MIB)))
    assert expanded.capacity_bytes == 512 * MIB
    assert usage_of(node, pb, cid, ctarget)[pb.VolumeUsage.BYTES].total > 400 * MIB
    assert (ctarget / "payload.bin").read_bytes() == payload
    assert not (ctarget / "after-snapshot.txt").exists()

    # kill -9 the plugin while both volumes are published: kubelet restarts it, stages again.
    driver.kill9()
    driver.start()
    controller, node = connect()
    node.NodeStageVolume(pb.NodeStageVolumeRequest(volume_id=vid, staging_target_path=str(stage), volume_capability=mount))
    node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=vid, staging_target_path=str(stage), target_path=str(target), volume_capability=mount))
    assert (target / "payload.bin").read_bytes() == payload
    (target / "after-restart.txt").write_text("written after the plugin restarted")
    subprocess.run(["sync", "-f", str(target / "after-restart.txt")], check=True)

    # Tear down in kubelet's order; every step is idempotent.
    for volume_id, stage_path, target_path in ((cid, cstage, ctarget), (vid, stage, target)):
        for _ in range(2):
            node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target_path)))
            node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=str(stage_path)))
        assert not target_path.exists()
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(workdir / "csi-state") not in mounts and str(stage) not in mounts
    assert list((driver.state / "volumes").iterdir()) == []

    # What the plugin wrote after its restart reached the volume: stage it again and read.
    node.NodeStageVolume(pb.NodeStageVolumeRequest(volume_id=vid, staging_target_path=str(stage), volume_capability=mount))
    assert (stage / "after-restart.txt").read_text() == "written after the plugin restarted"
    node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=vid, staging_target_path=str(stage)))

    # The clone reads through the snapshot: it goes first, then the snapshot, then the volume.
    assert code_of(lambda: controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))) == grpc.StatusCode.FAILED_PRECONDITION
    controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=cid))
    controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
    controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))
    controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))
    assert [e.volume.volume_id for e in controller.ListVolumes(pb.ListVolumesRequest()).entries] == []


def test_block_volume_survives_a_node_reboot(driver, server, workdir, csi_pb):
    """A raw block volume (volumeMode: Block): the published target is the device. Then what a
    reboot leaves (the plugin killed, every mount, loop device and nbdfuse gone, the staging
    records still on disk): staging again attaches anew and the data written before is there."""
    pb, rpc = csi_pb
    block = pb.VolumeCapability(
        block=pb.VolumeCapability.BlockVolume(),
        access_mode=pb.VolumeCapability.AccessMode(mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))

    def connect():
        channel = csi_stubs.connect(driver.socket)
        return rpc.ControllerStub(channel), rpc.NodeStub(channel)

    controller, node = connect()
    vid = controller.CreateVolume(pb.CreateVolumeRequest(
        name="pvc-raw", capacity_range=pb.CapacityRange(required_bytes=64 * MIB), volume_capabilities=[block])).volume.volume_id
    stage, target = workdir / "stage-raw", workdir / "pods" / "c" / "raw-device"

    def attach():
        node.NodeStageVolume(pb.NodeStageVolumeRequest(volume_id=vid, staging_target_path=str(stage), volume_capability=block))
        node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=vid, staging_target_path=str(stage), target_path=str(target), volume_capability=block))

    attach()
    payload = os.urandom(4 * MIB)
    fd = os.open(target, os.O_RDWR)
    try:
        os.pwrite(fd, payload, 8 * MIB)
        os.fsync(fd)
    finally:
        os.close(fd)
    stats = usage_of(node, pb, vid, target)
    assert stats[pb.VolumeUsage.BYTES].total == 64 * MIB
    record = json.loads((driver.state / "volumes" / f"{vid}.json").read_text())
    assert record["block"] and record["method"] == "nbdfuse"

    # The reboot: nothing of the attachment survives but the record.
    driver.kill9()
    subprocess.run(["umount", str(target)], check=True)
    subprocess.run(["losetup", "-d", record["device"]], check=True)
    subprocess.run(["fusermount3", "-u", record["fuse_dir"]], check=True)
    deadline = time.time() + 10
    while Path(f"/proc/{record['fuse_pid']}").exists() and time.time() < deadline:
        time.sleep(0.05)
    driver.start()
    controller, node = connect()
    attach()
    fd = os.open(target, os.O_RDONLY)
    try:
        assert os.pread(fd, len(payload), 8 * MIB) == payload
    finally:
        os.close(fd)
    node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=vid, target_path=str(target)))
    node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=vid, staging_target_path=str(stage)))
    assert not target.exists()
    assert list((driver.state / "volumes").iterdir()) == []
    assert list((driver.state / "fuse").iterdir()) == []
    controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vid))
