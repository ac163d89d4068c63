"""The `keel` binary as an operator meets it: defaults, tmpfs refusal, doctor, status, metrics,
the admin token, the CLI's volume lifecycle, and scrub repairing a damaged mirror."""

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
import urllib.error
from pathlib import Path

import pytest

from conftest import KEEL_BIN, KeelServer, fs_type


def shm_dir(name):
    path = Path("/dev/shm") / f"keel-e2e-{name}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    assert fs_type(path) == "tmpfs", "/dev/shm must be tmpfs for this test"
    return path


def test_server_refuses_tmpfs_unless_ephemeral():
    """`keel server` on a tmpfs data dir exits with a message naming tmpfs; with --ephemeral it
    serves (and says it is ephemeral)."""
    path = shm_dir("refuse")
    try:
        result = subprocess.run([KEEL_BIN, "server", "--data", str(path / "data"), "--s3", "127.0.0.1:0",
                                 "--nbd", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--cluster", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
        assert result.returncode != 0
        assert "tmpfs" in result.stderr and "--ephemeral" in result.stderr
        srv = KeelServer([path / "data"], ["--ephemeral"]).start()
        try:
            assert any("ephemeral" in line for line in srv.banner)
            status = json.loads(srv.cli("status", "--json").stdout)
            assert status["health"] == "HEALTH_WARN" and status["ephemeral"]
        finally:
            srv.stop()
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_doctor_reports_tmpfs_and_real_disks(workdir):
    """`keel doctor` says tmpfs is volatile and exits non-zero there (it is the Kubernetes init
    check), and reports a real filesystem with fdatasync latency, exiting 0."""
    path = shm_dir("doctor")
    try:
        volatile = subprocess.run([KEEL_BIN, "doctor", str(path), "--json", "--appends", "20"], capture_output=True, text=True)
        assert volatile.returncode != 0 and "not durable storage" in volatile.stderr, volatile.stderr
        report = json.loads(volatile.stdout)
        assert report["filesystem"] == "tmpfs" and report["volatile_filesystem"]
        assert "NOT DURABLE" in report["verdict"]
    finally:
        shutil.rmtree(path, ignore_errors=True)
    report = json.loads(subprocess.run([KEEL_BIN, "doctor", str(workdir), "--json", "--appends", "20"], capture_output=True, text=True, check=True).stdout)
    assert not report["volatile_filesystem"] and report["fdatasync_appends"] == 20
    assert report["fdatasync_us_p50"] > 0
    human = subprocess.run([KEEL_BIN, "doctor", str(workdir), "--appends", "5"], capture_output=True, text=True, check=True).stdout
    assert "fdatasync 4 KiB" in human, human
    assert "write cache" in human or "device" in human, human


def test_default_server_uses_keel_data(workdir):
    """With no arguments the server makes ./keel-data, listens on the documented ports and prints
    how to use S3."""
    env = dict(os.environ, KEEL_ACCESS_KEY_ID="GKDEFAULTKEY0000", KEEL_SECRET_ACCESS_KEY="default-secret-0123456789abcdefgh")
    proc = subprocess.Popen([KEEL_BIN, "server"], cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        banner = []
        for line in proc.stdout:
            banner.append(line)
            if line.strip() == "ready":
                break
        text = "".join(banner)
        assert "127.0.0.1:3900" in text and "127.0.0.1:10809" in text and "127.0.0.1:3903" in text, text
        assert "127.0.0.1:3902" in text and "node   " in text and "(id 1)" in text, text
        assert "aws --endpoint-url" in text
        assert (workdir / "keel-data" / "segments").is_dir()
        assert (workdir / "keel-data" / "admin-token").stat().st_mode & 0o077 == 0
        assert (workdir / "keel-data" / "cluster-token").stat().st_mode & 0o077 == 0
        assert (workdir / "keel-data" / "cluster-token").read_text().startswith("keel1-")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr.read()


def http(method, url, token=None, body=None):
    request = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body is not None else None)
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def health_config(workdir, nearfull_percent):
    config = workdir / f"nearfull-{nearfull_percent}.toml"
    config.write_text(f"nearfull_percent = {nearfull_percent}\n")
    return config


def test_status_metrics_dashboard_and_token(workdir, make_server):
    """Status and /metrics need no token and report the store; mutations without the right token
    are refused with 401 and change nothing. (The nearly-full check is off here: how full the test
    machine's disk is must not decide this test; the next test covers it.)"""
    server = make_server(extra_args=["--config", str(health_config(workdir, 100))])
    status = json.loads(server.cli("status", "--json").stdout)
    assert status["health"] == "HEALTH_OK", status["reasons"]
    assert status["store"]["poisoned"] is False
    code, metrics = http("GET", f"http://{server.admin}/metrics")
    assert code == 200 and b"keel_store_live_extents" in metrics and b"keel_health 0" in metrics
    # Counts since start are counters (issue 14), so rate() works on them; levels are gauges.
    # Without asking, the classic text format (counter families named NAME_total); asked for,
    # OpenMetrics (families named without the suffix, ending in # EOF).
    text = metrics.decode()
    openmetrics = urllib.request.urlopen(urllib.request.Request(
        f"http://{server.admin}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}),
        timeout=30).read().decode()
    for name in ("keel_store_log_syncs", "keel_store_corrupt_reads", "keel_store_repaired_extents"):
        assert f"# TYPE {name}_total counter" in text and re.search(rf"^{name}_total \d+$", text, re.M), name
        assert f"# TYPE {name} counter" in openmetrics and re.search(rf"^{name}_total \d+$", openmetrics, re.M)
    assert "# TYPE keel_store_live_extents gauge" in text
    assert openmetrics.endswith("# EOF\n") and "# EOF" not in text
    code, page = http("GET", f"http://{server.admin}/")
    assert code == 200 and b"<title>Keel</title>" in page
    code, _ = http("POST", f"http://{server.admin}/api/v1/volumes", body={"name": "x", "size_bytes": 4096})
    assert code == 401
    code, _ = http("POST", f"http://{server.admin}/api/v1/volumes", token="wrong", body={"name": "x", "size_bytes": 4096})
    assert code == 401
    assert "x" not in server.cli("volume", "list").stdout


def test_nbd_request_latency_histograms_count_every_request(server):
    """/metrics has `keel_nbd_request_seconds` histograms by command (issue 14): after 8 writes,
    a flush and 3 reads through NBD, each command's count says so and its buckets add up."""
    from nbd_client import Client
    server.cli("volume", "create", "timed", "--size", "1M")
    host, port = server.nbd.rsplit(":", 1)
    client = Client(host, int(port), "timed")
    for index in range(8):
        client.write(index * 4096, bytes([index]) * 4096)
    client.flush()
    for index in range(3):
        assert client.read(index * 4096, 4096) == bytes([index]) * 4096
    client.close()
    code, metrics = http("GET", f"http://{server.admin}/metrics")
    text = metrics.decode()
    assert code == 200 and "# TYPE keel_nbd_request_seconds histogram" in text
    counts = {op: int(count) for op, count in re.findall(r'^keel_nbd_request_seconds_count\{op="(\w+)"\} (\d+)$', text, re.M)}
    assert counts == {"read": 3, "write": 8, "flush": 1, "trim": 0, "zeroes": 0}, counts
    infinite = re.search(r'^keel_nbd_request_seconds_bucket\{le="\+Inf",op="write"\} (\d+)$', text, re.M)
    assert infinite and int(infinite.group(1)) == 8, text


def samples(text, name):
    """{frozenset of (label, value): value} of every sample of metric `name`."""
    found = {}
    for labels, value in re.findall(rf'^{name}\{{([^}}]*)\}} (\S+)$', text, re.M):
        found[frozenset(re.findall(r'(\w+)="([^"]*)"', labels))] = float(value)
    return found


def test_per_volume_metrics_say_which_volume_does_the_io(make_server, workdir):
    """`keel_volume_request_seconds{volume,op}` and `keel_volume_bytes_total{volume,direction}`
    count each volume's NBD requests and bytes apart (issue 14: which volume eats the IOPS);
    past 64 volumes, further ones count together under `volume="_other"`."""
    from nbd_client import Client
    server = make_server()
    host, port = server.nbd.rsplit(":", 1)
    for name in ("busy", "quiet"):
        server.cli("volume", "create", name, "--size", "1M")
    busy = Client(host, int(port), "busy")
    for index in range(5):
        busy.write(index * 4096, bytes([index + 1]) * 4096)
    busy.flush()
    busy.close()
    quiet = Client(host, int(port), "quiet")
    assert quiet.read(0, 8192) == bytes(8192)
    quiet.close()
    code, metrics = http("GET", f"http://{server.admin}/metrics")
    assert code == 200
    text = metrics.decode()
    counts = samples(text, "keel_volume_request_seconds_count")
    assert counts[frozenset({("volume", "busy"), ("op", "write")})] == 5, counts
    assert counts[frozenset({("volume", "busy"), ("op", "flush")})] == 1, counts
    assert counts[frozenset({("volume", "quiet"), ("op", "read")})] == 1, counts
    assert counts[frozenset({("volume", "quiet"), ("op", "write")})] == 0, counts
    moved = samples(text, "keel_volume_bytes_total")
    assert moved[frozenset({("volume", "busy"), ("direction", "write")})] == 5 * 4096, moved
    assert moved[frozenset({("volume", "quiet"), ("direction", "read")})] == 8192, moved
    assert moved[frozenset({("volume", "quiet"), ("direction", "write")})] == 0, moved

    for index in range(64):
        name = f"many-{index:02}"
        server.cli("volume", "create", name, "--size", "64K")
        client = Client(host, int(port), name)
        client.write(0, b"m" * 4096)
        client.close()
    code, metrics = http("GET", f"http://{server.admin}/metrics")
    moved = samples(metrics.decode(), "keel_volume_bytes_total")
    volumes = {dict(labels)["volume"] for labels in moved}
    assert len(volumes) == 65 and "_other" in volumes, sorted(volumes)
    # busy and quiet came first, then 62 of the others; the last two share `_other`.
    assert moved[frozenset({("volume", "_other"), ("direction", "write")})] == 2 * 4096, moved


def test_a_slow_device_warns_with_its_code_and_syncs_are_timed(make_server, workdir):
    """Every sync of the log is timed (`keel_store_fdatasync_seconds`); with `slow_sync_ms`
    below what this disk's fdatasync takes, health is HEALTH_WARN with KEEL_SLOW_DEVICE once
    enough flushes went through; with 0 the check is off; a negative value is refused."""
    from nbd_client import Client

    def config(value):
        path = workdir / f"slow-{value}.toml"
        path.write_text(f"slow_sync_ms = {value}\n")
        return ["--config", str(path)]

    def flushed_writes(server, count):
        host, port = server.nbd.rsplit(":", 1)
        client = Client(host, int(port), "v")
        for index in range(count):
            client.write(index * 4096, bytes([index % 250 + 1]) * 4096)
            client.flush()
        client.close()

    server = make_server(extra_args=config(0.001))
    server.cli("volume", "create", "v", "--size", "1M")
    flushed_writes(server, 30)
    status = json.loads(server.cli("status", "--json").stdout)
    [reason] = [r for r in status["reasons"] if r.startswith("KEEL_SLOW_DEVICE")]
    assert "above slow_sync_ms (0.001 ms)" in reason, reason
    assert status["health"] == "HEALTH_WARN", status
    code, metrics = http("GET", f"http://{server.admin}/metrics")
    text = metrics.decode()
    count = int(re.search(r"^keel_store_fdatasync_seconds_count (\d+)$", text, re.M).group(1))
    infinite = int(re.search(r'^keel_store_fdatasync_seconds_bucket\{le="\+Inf"\} (\d+)$', text, re.M).group(1))
    syncs = int(float(re.search(r"^keel_store_log_syncs_total (\S+)$", text, re.M).group(1)))
    assert count >= syncs >= 30 and infinite == count, (count, syncs, infinite)

    server.stop()
    server.extra_args = config(0)
    server.start()
    flushed_writes(server, 30)
    status = json.loads(server.cli("status", "--json").stdout)
    assert not [r for r in status["reasons"] if r.startswith("KEEL_SLOW_DEVICE")], status["reasons"]
    server.stop()
    bad = subprocess.run([KEEL_BIN, "server", "--data", str(workdir / "data"), *config(-1)],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "slow_sync_ms must be 0 (off) or a positive" in bad.stderr, bad.stderr


def test_nearly_full_data_directory_warns_with_its_code(workdir, make_server):
    """Over the configured fill level, health is HEALTH_WARN with KEEL_NEARFULL, the usage and the
    action, in `keel status` and in /metrics; a level of 0 or above 100 is refused at start."""
    used = shutil.disk_usage(workdir)
    percent = (used.total - used.free) * 100 // used.total
    assert percent >= 2, "the test needs a data filesystem that is at least 2% used"
    server = make_server(extra_args=["--config", str(health_config(workdir, 1))])
    status = json.loads(server.cli("status", "--json").stdout)
    assert status["health"] == "HEALTH_WARN", status["reasons"]
    [reason] = [r for r in status["reasons"] if r.startswith("KEEL_NEARFULL")]
    assert "over the 1% warning level" in reason and "keel store compact" in reason
    # The same check, structured: code, severity, message, action; an info check alone (one
    # data directory) would not have made it HEALTH_WARN.
    checks = {c["code"]: c for c in status["checks"]}
    assert checks["KEEL_NEARFULL"]["severity"] == "warn"
    assert "keel store compact" in checks["KEEL_NEARFULL"]["action"]
    assert checks["KEEL_NO_LOCAL_MIRROR"]["severity"] == "info"
    [device] = status["devices"]
    assert device["dir"] == str(server.data_dirs[0]) and device["total_bytes"] == used.total
    code, metrics = http("GET", f"http://{server.admin}/metrics")
    assert code == 200 and re.search(rb"^keel_health 1$", metrics, re.M)
    assert re.search(rb'^keel_health_check\{code="KEEL_NEARFULL",severity="warn"\} 1$', metrics, re.M)
    assert re.search(rb'^keel_device_size_bytes\{dir="[^"]+"\} %d$' % used.total, metrics, re.M)
    server.stop()
    relaxed = make_server(extra_args=["--config", str(health_config(workdir, 100))])
    status = json.loads(relaxed.cli("status", "--json").stdout)
    assert status["health"] == "HEALTH_OK", status["reasons"]
    # Only information left: no mirror, and (where the disk has one) the volatile write cache.
    volatile = status["devices"][0]["write_cache"] == "write back"
    expected = {"KEEL_NO_LOCAL_MIRROR"} | ({"KEEL_VOLATILE_WRITE_CACHE"} if volatile else set())
    assert {c["code"] for c in status["checks"]} == expected, status["checks"]
    assert {c["severity"] for c in status["checks"]} == {"info"}
    relaxed.stop()
    bad = subprocess.run(
        [KEEL_BIN, "server", "--data", str(workdir / "data"), "--config", str(health_config(workdir, 0))],
        capture_output=True, text=True, timeout=30,
    )
    assert bad.returncode != 0 and "nearfull_percent must be 1 to 100" in bad.stderr


def test_a_kept_alive_admin_connection_survives_a_body_the_handler_ignores(server):
    """`POST /api/v1/store/scrub` takes no body; the CLI sends `{}`. When the body arrived
    after the headers, the server answered without reading it and closed the connection, so
    the job poll the CLI had already sent on it was lost (`keel store scrub` failed in CI with
    "Peer disconnected"). Headers, a pause, then the body: the next request on the same
    connection must be answered."""
    import socket

    token = (server.data_dirs[0] / "admin-token").read_text().strip()
    host, port = server.admin.rsplit(":", 1)

    def answer(connection):
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = connection.recv(65536)
            assert chunk, f"the server closed the connection (got {data!r})"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        while len(body) < length:
            body += connection.recv(65536)
        return head.split(b"\r\n")[0], json.loads(body)

    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(f"POST /api/v1/store/scrub HTTP/1.1\r\nHost: keel\r\nAuthorization: Bearer {token}\r\n"
                           "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n".encode())
        time.sleep(0.1)
        connection.sendall(b"{}")
        status, started = answer(connection)
        assert status == b"HTTP/1.1 200 OK" and "job" in started, (status, started)
        connection.sendall(f"GET /api/v1/jobs/{started['job']} HTTP/1.1\r\nHost: keel\r\n"
                           f"Authorization: Bearer {token}\r\n\r\n".encode())
        status, job = answer(connection)
        assert status == b"HTTP/1.1 200 OK" and job["id"] == started["job"], (status, job)


def test_volume_lifecycle_through_the_cli(server):
    """create, list, info, resize, delete, with clear errors for a duplicate and a missing volume."""
    server.cli("volume", "create", "data", "--size", "1G", "--compression", "zstd", "--iops", "5000")
    listing = server.cli("volume", "list").stdout
    assert "data" in listing and "1.0 GiB" in listing and "zstd" in listing
    duplicate = server.cli("volume", "create", "data", "--size", "1G", check=False)
    assert duplicate.returncode != 0 and "already exists" in duplicate.stderr
    server.cli("volume", "resize", "data", "--size", "2G")
    info = json.loads(server.cli("volume", "info", "data").stdout)
    assert info["volume"]["size_bytes"] == 2 << 30
    server.cli("volume", "delete", "data")
    assert "data" not in server.cli("volume", "list").stdout
    missing = server.cli("volume", "info", "data", check=False)
    assert missing.returncode != 0 and "not found" in missing.stderr


def test_scrub_repairs_a_damaged_mirror(make_server, workdir):
    """With two data directories, bytes flipped in one copy of the log are found and repaired by
    `keel store scrub`, and the volume reads back intact."""
    from test_nbd import qemu_io

    a, b = workdir / "mirror-a", workdir / "mirror-b"
    srv = make_server([a, b])
    srv.cli("volume", "create", "m", "--size", "16M")
    qemu_io(srv.nbd_uri("m"), "write -P 0x6d 0 4M", "flush")
    srv.stop()
    damage_written_segment(a)
    srv.start()
    report = json.loads(srv.cli("store", "scrub").stdout)
    assert report["repaired_copies"] > 5 and report["unrecoverable_extents"] == 0, report
    qemu_io(srv.nbd_uri("m"), "read -P 0x6d 0 4M")
    again = json.loads(srv.cli("store", "scrub").stdout)
    # Every live extent verified; flips that landed in dead extents or padding are not data.
    assert again["repaired_copies"] == 0 and again["unrecoverable_extents"] == 0


def damage_written_segment(data_dir):
    """Flips bytes every 200 KB of the segment holding the most written bytes (the newest may be
    a prepared, all-zero one), only where it was written."""
    segments = sorted((data_dir / "segments").glob("*.seg"))
    segment = max(segments, key=lambda p: len(p.read_bytes().rstrip(b"\0")))
    data = bytearray(segment.read_bytes())
    written = len(bytes(data).rstrip(b"\0"))
    assert written > 3_000_000, (segment, written)
    for offset in range(10_000, written, 200_000):
        data[offset] ^= 0x5A
    segment.write_bytes(bytes(data))


def scrub_config(workdir, interval_seconds):
    config = workdir / f"scrub-{interval_seconds}.toml"
    config.write_text(f"[scrub]\ninterval_seconds = {interval_seconds}\nbusy_percent = 50\n")
    return ["--config", str(config)]


def wait_for_scheduled_scrub(srv, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = json.loads(srv.cli("status", "--json").stdout)
        if status["scrub"]["last"] is not None:
            return status
        time.sleep(0.5)
    raise AssertionError(f"no scheduled scrub ran within {timeout} s: {status['scrub']}")


def damaged_then_scrubbed_on_schedule(make_server, workdir, data_dirs):
    """A server on `data_dirs` with hourly scrubs writes 4 MiB to a volume "m" and stops; its
    first directory's log is damaged; it restarts with scrubs every 2 s, due at once since the
    schedule began at the first start. Returns the server and its status after the first
    scheduled run."""
    from test_nbd import qemu_io

    srv = make_server(data_dirs, extra_args=scrub_config(workdir, 3600))
    srv.cli("volume", "create", "m", "--size", "16M")
    qemu_io(srv.nbd_uri("m"), "write -P 0x6d 0 4M", "flush")
    assert json.loads(srv.cli("status", "--json").stdout)["scrub"]["last"] is None
    srv.stop()
    damage_written_segment(data_dirs[0])
    time.sleep(2)
    srv.extra_args = scrub_config(workdir, 2)
    srv.start()
    return srv, wait_for_scheduled_scrub(srv)


def test_a_scheduled_scrub_repairs_a_damaged_mirror_unasked(make_server, workdir):
    """Nobody runs `keel store scrub`: once `scrub.interval_seconds` has passed since the
    schedule began (recorded at the first start, so it survives the restart between), the
    server scrubs on its own and repairs a damaged mirror copy; the run is recorded, shown by
    `keel status`, kept across a restart, and the next is due an interval after it."""
    from test_nbd import qemu_io

    a, b = workdir / "mirror-a", workdir / "mirror-b"
    srv, status = damaged_then_scrubbed_on_schedule(make_server, workdir, [a, b])
    run = status["scrub"]["last"]
    assert run["repaired_copies"] > 5 and run["unrecoverable_extents"] == 0, run
    assert run["errors"] == [], run
    # The repair is on disk: a manual scrub finds nothing left to repair.
    again = json.loads(srv.cli("store", "scrub").stdout)
    assert again["repaired_copies"] == 0 and again["unrecoverable_extents"] == 0, again
    qemu_io(srv.nbd_uri("m"), "read -P 0x6d 0 4M")
    srv.stop()
    srv.extra_args = scrub_config(workdir, 3600)
    srv.start()
    kept = json.loads(srv.cli("status", "--json").stdout)["scrub"]
    # Runs came every 2 s until the stop: the last of them is kept.
    assert kept["last"]["finished_unix_ms"] >= run["finished_unix_ms"], (kept, run)
    assert kept["next_unix_ms"] == kept["last"]["finished_unix_ms"] + 3_600_000, kept
    shown = srv.cli("status").stdout
    assert "scrub every 1.0h, last" in shown and "repaired" in shown, shown


def test_a_scheduled_scrub_that_finds_data_with_no_good_copy_turns_health_red(make_server, workdir):
    """One data directory, damaged: the scheduled scrub cannot repair it, and health says so
    with its code until someone acts."""
    _, status = damaged_then_scrubbed_on_schedule(make_server, workdir, [workdir / "data"])
    assert status["scrub"]["last"]["unrecoverable_extents"] > 5, status["scrub"]
    assert status["health"] == "HEALTH_ERR", status
    assert any(reason.startswith("KEEL_SCRUB_ERRORS") for reason in status["reasons"]), status["reasons"]


def test_a_server_stops_at_once_while_a_slow_scheduled_scrub_runs(make_server, workdir):
    """A scheduled scrub working 1% of the time sleeps about 99 times each page it read: a
    SIGTERM must still stop the server cleanly at once (the scrub ends at its next page and is
    not recorded, so it is due again at the next start)."""
    from test_nbd import qemu_io

    config = workdir / "slow-scrub.toml"
    config.write_text("[scrub]\ninterval_seconds = 1\nbusy_percent = 1\n")
    srv = make_server([workdir / "data"])
    srv.cli("volume", "create", "big", "--size", "256M", "--compression", "none")
    qemu_io(srv.nbd_uri("big"), "write -P 0x42 0 192M", "flush")
    srv.stop()
    srv.extra_args = ["--config", str(config)]
    srv.start()
    token = (workdir / "data" / "admin-token").read_text().strip()

    def scrubbing():
        code, body = http("GET", f"http://{srv.admin}/api/v1/jobs", token)
        assert code == 200, body
        return [job for job in json.loads(body) if job["kind"] == "scheduled scrub" and job["state"] == "running"
                and job["done"] > 0]

    deadline = time.time() + 60
    while not scrubbing():
        assert time.time() < deadline, "no scheduled scrub started"
        time.sleep(0.2)
    # /metrics shows the running job and how far it is (issue 14: scrub progress).
    code, metrics = http("GET", f"http://{srv.admin}/metrics")
    assert re.search(rb'^keel_jobs_running\{kind="scheduled scrub"\} 1$', metrics, re.M), metrics
    ratio = re.search(rb'^keel_jobs_progress_ratio\{kind="scheduled scrub"\} (\S+)$', metrics, re.M)
    assert ratio and 0 < float(ratio.group(1)) < 1, ratio
    proc = srv.proc
    started = time.time()
    srv.stop()
    took = time.time() - started
    assert proc.returncode == 0, proc.returncode
    assert took < 10, f"stopping took {took:.1f} s"
    assert json.loads((workdir / "data" / "scrub-schedule.json").read_text())["last"] is None


def test_lost_index_is_refused_then_rebuilt_from_the_log(make_server, workdir):
    """A data directory whose index.redb is gone is refused at start with the command that fixes
    it; `keel store rebuild-index` rebuilds it from the log, after compaction moved data and
    dropped segments, and every volume byte and every deletion is as before."""
    from test_nbd import qemu_io

    data = workdir / "data"
    srv = make_server([data], extra_args=["--config", str(small_segments(workdir))])
    srv.cli("volume", "create", "keep", "--size", "16M")
    srv.cli("volume", "create", "gone", "--size", "16M")
    qemu_io(srv.nbd_uri("keep"), "write -P 0x4b 0 4M", "flush")
    qemu_io(srv.nbd_uri("gone"), "write -P 0x47 0 4M", "flush")
    # Overwrite most of "keep" so compaction has dead extents to reclaim, then delete "gone".
    qemu_io(srv.nbd_uri("keep"), "write -P 0x4c 0 3M", "flush")
    srv.cli("volume", "delete", "gone")
    compacted = json.loads(srv.cli("store", "compact", "--dead-ratio", "0.3").stdout)
    assert compacted["segments_compacted"] > 0, compacted
    srv.stop()

    (data / "index.redb").unlink()
    refused = subprocess.run(
        [KEEL_BIN, "server", "--data", str(data), "--s3", "127.0.0.1:0", "--nbd", "127.0.0.1:0",
         "--admin", "127.0.0.1:0", "--cluster", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, env=srv.env,
    )
    assert refused.returncode != 0
    assert "keel store rebuild-index" in refused.stderr, refused.stderr

    rebuilt = subprocess.run([KEEL_BIN, "store", "rebuild-index", "--data", str(data)],
                             capture_output=True, text=True, timeout=300)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "rebuilt the index" in rebuilt.stdout

    srv.start()
    listing = srv.cli("volume", "list").stdout
    assert "keep" in listing and "gone" not in listing, listing
    qemu_io(srv.nbd_uri("keep"), "read -P 0x4c 0 3M", "read -P 0x4b 3M 1M", "read -P 0 4M 4M")
    scrub = json.loads(srv.cli("store", "scrub").stdout)
    assert scrub["unrecoverable_extents"] == 0, scrub


def small_segments(workdir):
    config = workdir / "small-segments.toml"
    config.write_text("[store]\nsegment_size_max_bytes = 1048576\nreserve_bytes = 16777216\n")
    return config
