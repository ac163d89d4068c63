"""Fixtures for Keel's end-to-end tests: the real `keel` binary on loopback, with data on a real
filesystem (never tmpfs), driven by real clients.

KEEL_BIN selects the binary (default: target/release/keel, built by scripts/test.sh)."""

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEEL_BIN = os.environ.get("KEEL_BIN", str(ROOT / "target" / "release" / "keel"))
WORK = Path(os.environ.get("KEEL_E2E_DIR", "/var/tmp/keel-e2e"))
START_TIMEOUT_SECONDS = 60


def require(tool, package):
    """Fail (never skip) when a client the test needs is missing."""
    if shutil.which(tool) is None:
        pytest.fail(f"{tool} is not installed (Debian package {package}); scripts/test.sh installs it")


def wait_for(what, probe, timeout=30, interval=0.05):
    """Polls `probe` until it returns something true, and returns that; fails after `timeout`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def s3_client(srv):
    """boto3 on `srv`'s S3 endpoint with the key the tests start it with."""
    import boto3
    return boto3.client(
        "s3", endpoint_url=f"http://{srv.s3}", region_name="us-east-1",
        aws_access_key_id=srv.env["KEEL_ACCESS_KEY_ID"],
        aws_secret_access_key=srv.env["KEEL_SECRET_ACCESS_KEY"])


class Traffic:
    """NBD and S3 requests from two threads while the `with` block runs, bounded in count:
    4 KiB writes to `volume` (a FLUSH after every 8th) each followed by a read of another
    block, and 4 KiB PUTs to `bucket` each read back; `pause` seconds between rounds. An
    error in either thread fails the block when it ends."""

    def __init__(self, srv, volume, bucket, pause=0.0):
        from nbd_client import Client
        import threading
        self.srv, self.volume, self.bucket, self.pause = srv, volume, bucket, pause
        self.client_class = Client
        self.stop = threading.Event()
        self.errors = []
        self.workers = [threading.Thread(target=self._nbd), threading.Thread(target=self._s3)]

    def _nbd(self):
        host, port = self.srv.nbd.rsplit(":", 1)
        try:
            client = self.client_class(host, int(port), self.volume)
        except Exception as error:  # noqa: BLE001 - reported at the end of the block
            self.errors.append(error)
            return
        try:
            for n in range(4000):
                if self.stop.is_set():
                    break
                client.write((n % 1024) * 4096, bytes([n % 251]) * 4096)
                if n % 8 == 0:
                    client.flush()
                client.read(((n * 7) % 1024) * 4096, 4096)
                time.sleep(self.pause)
        except Exception as error:  # noqa: BLE001 - reported at the end of the block
            self.errors.append(error)
        finally:
            client.close()

    def _s3(self):
        s3 = s3_client(self.srv)
        try:
            for n in range(2000):
                if self.stop.is_set():
                    break
                s3.put_object(Bucket=self.bucket, Key=f"k{n % 50}", Body=b"m" * 4096)
                s3.get_object(Bucket=self.bucket, Key=f"k{n % 50}")["Body"].read()
                time.sleep(self.pause)
        except Exception as error:  # noqa: BLE001 - reported at the end of the block
            self.errors.append(error)

    def __enter__(self):
        for worker in self.workers:
            worker.start()
        return self

    def __exit__(self, kind, value, traceback):
        self.stop.set()
        for worker in self.workers:
            worker.join(timeout=60)
        if kind is None:
            assert not self.errors, self.errors
        return False


def fs_type(path):
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def workdir(request):
    """A fresh directory for one test on a real filesystem, removed if the test passed."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)
    path = WORK / name
    if path.exists():
        subprocess.run(["umount", "-l", str(path / "mnt")], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    assert fs_type(path) not in ("tmpfs", "ramfs"), f"{path} is on {fs_type(path)}: data tests need a real filesystem"
    yield path
    # Removed once the test passed (its servers are stopped by then, its mounts gone), unless
    # KEEL_KEEP_TEST_DATA=1; a failed test's stays for its logs.
    reports = [getattr(request.node, f"rep_{when}", None) for when in ("setup", "call")]
    mounted = any(line.split()[1].startswith(str(path) + "/") for line in open("/proc/mounts"))
    keep = os.environ.get("KEEL_KEEP_TEST_DATA") == "1"
    if all(report is not None and report.passed for report in reports) and not mounted and not keep:
        shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test, for `workdir` to see whether it passed."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


class KeelServer:
    """One `keel server` process started by a test, stopped by its PID only."""

    def __init__(self, data_dirs, extra_args=(), env=None):
        self.data_dirs = [Path(d) for d in data_dirs]
        self.extra_args = list(extra_args)
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("KEEL_ACCESS_KEY_ID", "GKE2ETESTKEY0000")
        self.env.setdefault("KEEL_SECRET_ACCESS_KEY", "e2e-secret-key-0123456789abcdefghij")
        self.proc = None
        self.banner = []
        self.s3 = self.nbd = self.admin = None
        self.s3_port = self.nbd_port = self.admin_port = self.cluster_port = 0

    def start(self):
        args = [KEEL_BIN, "server"]
        for d in self.data_dirs:
            args += ["--data", str(d)]
        args += [
            "--s3", f"127.0.0.1:{self.s3_port}",
            "--nbd", f"127.0.0.1:{self.nbd_port}",
            "--admin", f"127.0.0.1:{self.admin_port}",
            "--cluster", f"127.0.0.1:{self.cluster_port}",
        ]
        args += self.extra_args
        self.log = open(self.data_dirs[0].parent / f"server-{self.data_dirs[0].name}.log", "ab")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, env=self.env, text=True)
        deadline = time.time() + START_TIMEOUT_SECONDS
        self.banner = []
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"keel server exited early ({self.proc.wait()}): {''.join(self.banner)}")
            self.banner.append(line)
            if m := re.match(r"\s+s3\s+http://(\S+)", line):
                self.s3 = m.group(1)
            if m := re.match(r"\s+nbd\s+nbd://(\S+)/VOLUME", line):
                self.nbd = m.group(1)
            if m := re.match(r"\s+admin\s+http://(\S+)", line):
                self.admin = m.group(1)
            if m := re.match(r"\s+cluster\s+(\S+)", line):
                self.cluster = m.group(1)
            if line.strip() == "ready":
                # Restarts reuse the ports so clients' URLs stay valid.
                self.s3_port = int(self.s3.rsplit(":", 1)[1])
                self.nbd_port = int(self.nbd.rsplit(":", 1)[1])
                self.admin_port = int(self.admin.rsplit(":", 1)[1])
                self.cluster_port = int(self.cluster.rsplit(":", 1)[1])
                return self
        raise RuntimeError("keel server did not become ready")

    def nbd_uri(self, export):
        return f"nbd://{self.nbd}/{export}"

    def api(self, method, path, timeout=30):
        """Admin API call without a body; returns (HTTP status, decoded JSON)."""
        token = (self.data_dirs[0] / "admin-token").read_text().strip()
        request = urllib.request.Request(f"http://{self.admin}{path}", method=method,
                                         headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")

    def cli(self, *args, check=True, input=None, stdout=None):
        cmd = [KEEL_BIN, *args, "--admin", self.admin, "--token-dir", str(self.data_dirs[0])]
        result = subprocess.run(cmd, capture_output=stdout is None, stdout=stdout, input=input, text=stdout is None and not isinstance(input, bytes), env=self.env)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr}")
        return result

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill9(self):
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@pytest.fixture
def server(workdir):
    srv = KeelServer([workdir / "data"]).start()
    yield srv
    srv.stop()


@pytest.fixture
def make_server(workdir):
    started = []

    def make(data_dirs=None, extra_args=(), env=None):
        srv = KeelServer(data_dirs or [workdir / "data"], extra_args, env).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()
