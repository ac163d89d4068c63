"""Block volumes over NBD with real clients: qemu-io, qemu-img, fio (nbd engine), nbdcopy,
nbdfuse + loop + ext4 + Postgres, and the flush contract across kill -9 of the server."""

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import time
import urllib.request

import pytest

import failsync
from conftest import require, wait_for
from nbd_client import Client, NbdError


def qemu_io(uri, *commands, check=True):
    require("qemu-io", "qemu-utils")
    # Snapshot exports (VOLUME@SNAPSHOT) are read-only: open them so.
    args = ["qemu-io", "-f", "raw"] + (["-r"] if "@" in uri.rsplit("/", 1)[1] else []) + [uri]
    for c in commands:
        args += ["-c", c]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    # qemu-io prints pattern mismatches but may still exit 0: look at the output too.
    failed = result.returncode != 0 or "Pattern verification failed" in result.stdout or "failed" in result.stderr.lower()
    if check and failed:
        raise AssertionError(f"qemu-io {commands} failed: {result.stdout}\n{result.stderr}")
    return result, failed


def export_sha256(uri, workdir, name):
    """Copies a whole export with nbdcopy and hashes it."""
    require("nbdcopy", "libnbd-bin")
    out = workdir / f"{name}.img"
    subprocess.run(["nbdcopy", uri, str(out)], check=True, timeout=300)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    out.unlink()
    return digest


def test_qemu_reads_and_writes_a_volume(server):
    """qemu-img sees the volume's size; qemu-io writes patterns and reads them back over nbd://,
    including unaligned I/O and a region never written (reads as zeroes: thin provisioning)."""
    server.cli("volume", "create", "vm", "--size", "64M")
    require("qemu-img", "qemu-utils")
    info = subprocess.run(["qemu-img", "info", "--output=json", server.nbd_uri("vm")], capture_output=True, text=True, check=True)
    assert '"virtual-size": 67108864' in info.stdout
    qemu_io(server.nbd_uri("vm"), "write -P 0xab 0 1M", "write -P 0xcd 1048577 5000", "aio_flush")
    qemu_io(server.nbd_uri("vm"), "read -P 0xab 0 1M", "read -P 0xcd 1048577 5000", "read -P 0 8M 1M")
    _, failed = qemu_io(server.nbd_uri("vm"), "read -P 0xee 0 4096", check=False)
    assert failed, "a wrong pattern must not verify"


def test_fio_random_writes_verify(server, workdir):
    """fio's nbd engine writes random 4 KiB blocks at queue depth 16 with crc32c verification
    headers, then a second verify-only pass reads them all back."""
    require("fio", "fio")
    server.cli("volume", "create", "fio", "--size", "64M", "--compression", "lz4")
    host, port = server.nbd.rsplit(":", 1)
    common = ["fio", "--name=verify", "--ioengine=nbd", f"--uri=nbd://{host}:{port}/fio", "--rw=randwrite", "--bs=4k",
              "--size=32M", "--iodepth=16", "--verify=crc32c", "--verify_fatal=1", "--randseed=42", "--output-format=terse"]
    # fio keeps its verify state files in the working directory: keep them in the test's.
    subprocess.run(common + ["--do_verify=1"], check=True, capture_output=True, timeout=300, cwd=workdir)
    subprocess.run(common + ["--verify_only"], check=True, capture_output=True, timeout=300, cwd=workdir)


def test_snapshot_space_use_is_counted_on_request(server):
    """`keel snapshot list` shows what each snapshot references and what deleting it would free
    (a scan of the volume's block keys); the API answers without that scan when asked
    `?usage=false`, as the CSI driver asks, listing the same snapshots with no counts."""
    server.cli("volume", "create", "space", "--size", "16M", "--compression", "none")
    qemu_io(server.nbd_uri("space"), "write -P 0x11 0 2M", "flush")
    server.cli("snapshot", "create", "space@s1")
    qemu_io(server.nbd_uri("space"), "write -P 0x22 0 512K", "flush")
    counted = json.loads(server.cli("snapshot", "list", "space", "--json").stdout)
    assert [(s["name"], s["referenced_bytes"], s["unique_bytes"]) for s in counted] == [("s1", 2 << 20, 512 << 10)], counted
    token = (server.data_dirs[0] / "admin-token").read_text().strip()
    request = urllib.request.Request(f"http://{server.admin}/api/v1/volumes/space/snapshots?usage=false",
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        listed = json.loads(response.read())
    assert [s["name"] for s in listed] == ["s1"] and listed[0]["guid"] == counted[0]["guid"], listed
    assert "referenced_bytes" not in listed[0] and "unique_bytes" not in listed[0], listed


def test_snapshot_clone_rollback(server):
    """A snapshot stays frozen while its volume changes; a clone is independent of its parent both
    ways; rollback restores the snapshot's bytes. Snapshots are readable as VOLUME@SNAPSHOT."""
    server.cli("volume", "create", "db", "--size", "16M")
    qemu_io(server.nbd_uri("db"), "write -P 0x11 0 2M", "flush")
    server.cli("snapshot", "create", "db@s1")
    qemu_io(server.nbd_uri("db"), "write -P 0x22 0 1M", "flush")
    qemu_io(server.nbd_uri("db@s1"), "read -P 0x11 0 2M")
    qemu_io(server.nbd_uri("db"), "read -P 0x22 0 1M", "read -P 0x11 1M 1M")
    host, port = server.nbd.rsplit(":", 1)
    snapshot = Client(host, int(port), "db@s1")
    with pytest.raises(NbdError, match="errno 1"):  # EPERM
        snapshot.write(0, b"\x99" * 4096)
    snapshot.close()

    server.cli("snapshot", "clone", "db@s1", "db-clone")
    qemu_io(server.nbd_uri("db-clone"), "read -P 0x11 0 2M", "write -P 0x33 1M 4096", "flush")
    qemu_io(server.nbd_uri("db"), "read -P 0x11 1M 4096")
    qemu_io(server.nbd_uri("db@s1"), "read -P 0x11 1M 4096")
    qemu_io(server.nbd_uri("db"), "write -P 0x44 8M 4096", "flush")
    qemu_io(server.nbd_uri("db-clone"), "read -P 0 8M 4096")

    server.cli("snapshot", "rollback", "db@s1")
    qemu_io(server.nbd_uri("db"), "read -P 0x11 0 2M", "read -P 0 8M 4096")
    listing = server.cli("snapshot", "list", "db").stdout
    assert "db@s1" in listing
    # A clone depends on the snapshot: deleting it is refused (docs/volumes.md), and the snapshot
    # and the clone stay whole.
    refused = server.cli("snapshot", "delete", "db@s1", check=False)
    assert refused.returncode != 0, refused.stdout
    assert "clone" in (refused.stderr + refused.stdout).lower(), refused.stderr
    assert "db@s1" in server.cli("snapshot", "list", "db").stdout
    qemu_io(server.nbd_uri("db-clone"), "read -P 0x11 0 1M", "read -P 0x33 1M 4096")


def test_send_receive_full_and_incremental(make_server, workdir):
    """A full stream then an incremental stream, received by another server, give byte-identical
    snapshots; a stream whose base is missing and a corrupted stream are refused."""
    a = make_server([workdir / "a"])
    b = make_server([workdir / "b"])
    a.cli("volume", "create", "src", "--size", "32M", "--compression", "zstd")
    qemu_io(a.nbd_uri("src"), "write -P 0x51 0 4M", "write -P 0x52 20M 1M", "flush")
    a.cli("snapshot", "create", "src@one")
    qemu_io(a.nbd_uri("src"), "write -P 0x53 2M 3M", "write -z 20M 512K", "flush")
    a.cli("snapshot", "create", "src@two")

    full = workdir / "full.stream"
    incremental = workdir / "incremental.stream"
    with open(full, "wb") as out:
        a.cli("snapshot", "send", "src@one", stdout=out)
    with open(incremental, "wb") as out:
        a.cli("snapshot", "send", "src@one", "src@two", stdout=out)
    assert full.stat().st_size > 0 and incremental.stat().st_size < full.stat().st_size

    # Incremental before its base: refused, nothing created.
    refused = b.cli("snapshot", "receive", "dst", input=incremental.read_bytes(), check=False)
    assert refused.returncode != 0 and b"base" in refused.stderr.lower()
    # A corrupted full stream: refused.
    corrupt = bytearray(full.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0xFF
    refused = b.cli("snapshot", "receive", "dst", input=bytes(corrupt), check=False)
    assert refused.returncode != 0
    assert "dst" not in b.cli("volume", "list").stdout

    b.cli("snapshot", "receive", "dst", input=full.read_bytes())
    b.cli("snapshot", "receive", "dst", input=incremental.read_bytes())
    assert export_sha256(a.nbd_uri("src@one"), workdir, "a1") == export_sha256(b.nbd_uri("dst@one"), workdir, "b1")
    assert export_sha256(a.nbd_uri("src@two"), workdir, "a2") == export_sha256(b.nbd_uri("dst@two"), workdir, "b2")


CRASH_ROUNDS = 8
BLOCK = 4096


def test_flushed_writes_survive_kill_9(make_server, workdir):
    """Writes with periodic FLUSH (and some FUA writes) against the server, kill -9 at a random
    moment, restart, verify every block whose write was covered by a FLUSH (or FUA) reply holds
    that data or a later write of the same block — over several rounds on a real filesystem."""
    srv = make_server([workdir / "data"])
    srv.cli("volume", "create", "crash", "--size", "8M")
    host, port = srv.nbd.rsplit(":", 1)
    blocks = (8 << 20) // BLOCK
    durable = {}  # block -> set of versions a flush covered (the latest must be there, or newer)
    rng = random.Random(7)
    version = 0

    def payload(block, v):
        return hashlib.sha256(f"{block}:{v}".encode()).digest() * (BLOCK // 32)

    for round_number in range(CRASH_ROUNDS):
        client = Client(host, int(port), "crash")
        pending = {}
        deadline = time.time() + rng.uniform(0.3, 1.5)
        kill_at_op = None
        ops = 0
        while True:
            version += 1
            block = rng.randrange(blocks)
            fua = rng.random() < 0.1
            try:
                client.write(block * BLOCK, payload(block, version), fua=fua)
                pending[block] = version
                if fua:
                    durable[block] = version
                    del pending[block]
                ops += 1
                if ops % 16 == 0:
                    client.flush()
                    durable.update(pending)
                    pending.clear()
                if time.time() > deadline and kill_at_op is None:
                    kill_at_op = ops + rng.randrange(8)
                if kill_at_op is not None and ops >= kill_at_op:
                    srv.kill9()
                    break
            except Exception:
                break
        try:
            client.close()
        except Exception:
            pass
        srv.start()
        check = Client(host, int(port), "crash")
        for block, v in durable.items():
            data = check.read(block * BLOCK, BLOCK)
            # The block holds the flushed version or a later write of it (later writes may have
            # reached the log before the kill).
            ok = data == payload(block, v) or any(data == payload(block, later) for later in range(v + 1, version + 1))
            assert ok, f"round {round_number}: block {block} lost flushed version {v}"
        check.close()
    assert len(durable) > 100, "the test flushed too little to mean anything"


@pytest.fixture
def nbd_mount(workdir):
    """nbdfuse → loop device → ext4 → mount, torn down in reverse order."""
    state = {}

    def mount(uri, size_check=True):
        require("nbdfuse", "libnbd-bin")
        require("mkfs.ext4", "e2fsprogs")
        fuse_dir = workdir / "fuse"
        fuse_dir.mkdir()
        state["fuse"] = subprocess.Popen(["nbdfuse", str(fuse_dir), uri])
        for _ in range(100):
            if (fuse_dir / "nbd").exists():
                break
            time.sleep(0.1)
        assert (fuse_dir / "nbd").exists(), "nbdfuse did not expose the export"
        loop = subprocess.run(["losetup", "-f", "--show", str(fuse_dir / "nbd")], capture_output=True, text=True, check=True).stdout.strip()
        state["loop"] = loop
        subprocess.run(["mkfs.ext4", "-q", "-F", loop], check=True)
        mnt = workdir / "mnt"
        mnt.mkdir()
        subprocess.run(["mount", loop, str(mnt)], check=True)
        state["mnt"] = mnt
        return mnt

    yield mount
    if "mnt" in state:
        subprocess.run(["umount", str(state["mnt"])], capture_output=True)
    if "loop" in state:
        subprocess.run(["losetup", "-d", state["loop"]], capture_output=True)
    if "fuse" in state:
        subprocess.run(["fusermount3", "-u", str(workdir / "fuse")], capture_output=True)
        state["fuse"].terminate()
        state["fuse"].wait(timeout=30)


def run_as_postgres(args, **kwargs):
    return subprocess.run(["runuser", "-u", "postgres", "--", *args], check=True, capture_output=True, text=True, **kwargs)


def test_postgres_on_a_volume(server, nbd_mount):
    """Postgres on ext4 on a Keel volume (nbdfuse + loop): initdb, pgbench -i -s 10, pgbench -T 20,
    then pg_amcheck finds no corruption."""
    bindir = next(iter(sorted(p for p in os.listdir("/usr/lib/postgresql") if p.isdigit())), None)
    if bindir is None:
        pytest.fail("PostgreSQL is not installed (Debian package postgresql)")
    bindir = f"/usr/lib/postgresql/{bindir}/bin"
    server.cli("volume", "create", "pg", "--size", "2G")
    mnt = nbd_mount(server.nbd_uri("pg"))
    pgdata = mnt / "pgdata"
    pgdata.mkdir()
    shutil.chown(pgdata, "postgres", "postgres")
    socket_dir = mnt / "run"
    socket_dir.mkdir()
    shutil.chown(socket_dir, "postgres", "postgres")
    run_as_postgres([f"{bindir}/initdb", "-D", str(pgdata), "--no-instructions", "-A", "trust"])
    port = "54329"
    run_as_postgres([f"{bindir}/pg_ctl", "-D", str(pgdata), "-w", "-l", str(socket_dir / "pg.log"),
                     "-o", f"-p {port} -k {socket_dir} -c listen_addresses='' -c synchronous_commit=on -c fsync=on", "start"], timeout=120)
    try:
        conn = ["-h", str(socket_dir), "-p", port]
        run_as_postgres(["pgbench", *conn, "-i", "-s", "10", "postgres"], timeout=600)
        result = run_as_postgres(["pgbench", *conn, "-c", "4", "-j", "2", "-T", "20", "postgres"], timeout=300)
        tps = [line for line in result.stdout.splitlines() if line.startswith("tps")]
        assert tps, result.stdout
        print("pgbench on a Keel volume:", tps[0])
        run_as_postgres(["psql", *conn, "-d", "postgres", "-c", "CREATE EXTENSION IF NOT EXISTS amcheck"])
        run_as_postgres([f"{bindir}/pg_amcheck", *conn, "-d", "postgres", "--heapallindexed"], timeout=300)
    finally:
        run_as_postgres([f"{bindir}/pg_ctl", "-D", str(pgdata), "-w", "-m", "fast", "stop"], timeout=120)


def test_a_refused_export_is_explained_in_the_server_log_and_the_admin_api(server):
    """libnbd clients (nbdinfo here, nbdfuse under the CSI node plugin) report any refused
    export as "no export named", keeping the server's reason to their debug output: the
    server logs the reason where an operator looks, and lists it in the admin API (which the
    CSI node plugin asks), after the id it reported last."""
    require("nbdinfo", "libnbd-bin")
    code, before = server.api("GET", "/api/v1/nbd/refusals?export=missing-volume")
    assert code == 200 and before["refusals"] == [], before
    result = subprocess.run(["nbdinfo", f"nbd://{server.nbd}/missing-volume"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "missing-volume" in result.stderr, result
    log = (server.data_dirs[0].parent / f"server-{server.data_dirs[0].name}.log").read_text()
    log = re.sub(r"\x1b\[[0-9;]*m", "", log)
    refused = [line for line in log.splitlines() if "refused to open an NBD export" in line]
    assert refused and 'export "missing-volume" does not exist' in refused[-1], refused
    code, listed = server.api("GET", f"/api/v1/nbd/refusals?export=missing-volume&after={before['last']}")
    assert code == 200, listed
    # (nbdinfo may ask more than once.)
    reasons = {r["reason"] for r in listed["refusals"]}
    assert reasons == {'export "missing-volume" does not exist'}, listed
    assert listed["last"] == listed["refusals"][-1]["id"] > before["last"], listed
    code, later = server.api("GET", f"/api/v1/nbd/refusals?export=missing-volume&after={listed['last']}")
    assert code == 200 and later["refusals"] == [], later


def test_a_failed_sync_stops_the_server_and_a_restart_keeps_every_flushed_write(make_server, workdir):
    """The disk fails one sync of the store (EIO, injected into the server with LD_PRELOAD,
    tests/failsync.c) while a client writes and FLUSHes a volume: the FLUSH that met it fails
    (the kernel may have dropped what the sync covered: nothing of it is acknowledged), and the
    server stops by itself with an error, for its supervisor to restart it, rather than stay up
    refusing every write. Restarted, it serves every block flushed before."""
    fault, trigger = failsync.library(workdir)
    server = make_server(env=fault)
    server.cli("volume", "create", "db", "--size", "16M")
    host, port = server.nbd.rsplit(":", 1)
    client = Client(host, int(port), "db")
    flushed = {}
    for index in range(64):
        data = os.urandom(4096)
        client.write(index * 4096, data)
        client.flush()
        flushed[index] = data
    trigger.touch()
    with pytest.raises(NbdError, match="errno 5"):  # EIO
        client.write(64 * 4096, os.urandom(4096))
        client.flush()
    assert not trigger.exists()
    wait_for("the server stopping itself", lambda: server.proc.poll() is not None)
    assert server.proc.returncode != 0
    log = (workdir / "server-data.log").read_text(errors="replace")
    assert "this node's store failed a sync and refuses writes: shutting down for a restart" in log
    server.proc = None

    server.start()
    assert "KEEL_STORE_POISONED" not in server.cli("status").stdout
    client = Client(host, int(port), "db")
    for index, data in flushed.items():
        assert client.read(index * 4096, 4096) == data, f"block {index}"
    client.write(0, b"\x01" * 4096)
    client.flush()
    client.close()
