"""Fixtures for Keel's S3 end-to-end tests: a real server process on 127.0.0.1 and real clients.

The server is the `keel` binary (KEEL_BIN, default target/release/keel, as scripts/test.sh
builds it); KEEL_S3_SERVER_CMD may replace the whole command, a template with {dir} (data
directory), {port} and {admin_port}.

The server is given the key in KEEL_ACCESS_KEY_ID / KEEL_SECRET_ACCESS_KEY. Data lives under
/var/tmp/keel-s3-tests/ (a real filesystem: durability tests mean nothing on tmpfs).
Tests that need a second access key create it with `keel key create` through the admin API.
"""

import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import time
import uuid

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DATA_ROOT = os.environ.get("KEEL_S3_TEST_DATA", "/var/tmp/keel-s3-tests")
KEEL_BIN = os.environ.get("KEEL_BIN", os.path.join(REPO, "target", "release", "keel"))
DEFAULT_CMD = (
    KEEL_BIN + " server --data {dir} --s3 127.0.0.1:{port} "
    "--nbd 127.0.0.1:0 --admin 127.0.0.1:{admin_port} --cluster 127.0.0.1:0"
)
ACCESS_KEY_ID = "GKKEELTEST0000000001"
SECRET_ACCESS_KEY = "keel-test-secret-0123456789abcdefghijklm"
REGION = "us-east-1"
# How long a server may take to start accepting connections.
START_TIMEOUT_S = 30
# How many times a start may meet a port taken by another process before the test fails.
BIND_ATTEMPTS = 5


def free_port():
    """A port free now, below Linux's ephemeral range (32768+) so that the outgoing connections
    of clients and other servers do not take it before the server listens on it."""
    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port on 127.0.0.1")


def require_tool(name, package):
    if shutil.which(name) is None:
        pytest.fail(f"{name} is required: install the Debian package {package}")


class Server:
    """One server process over one data directory; can be killed and restarted on it."""

    def __init__(self, data_dir, command_template=None, extra_args=()):
        self.data_dir = data_dir
        self.port = free_port()
        self.admin_port = free_port()
        self.command_template = command_template or os.environ.get("KEEL_S3_SERVER_CMD", DEFAULT_CMD)
        self.extra_args = list(extra_args)
        self.process = None
        self.log_path = os.path.join(data_dir + ".log")

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    def start(self):
        """Starts the server. Ports come from free_port(), so another process may take one between
        the probe and the server's bind: a first start then moves to fresh ports, a restart (whose
        clients know the old ports) waits for its ports to be free again."""
        first_start = self.process is None
        for attempt in range(BIND_ATTEMPTS):
            log_offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
            if self._start_once():
                return self
            with open(self.log_path, "rb") as log:
                log.seek(log_offset)
                refused_bind = b"cannot listen for" in log.read()
            if not refused_bind or attempt + 1 == BIND_ATTEMPTS:
                break
            if first_start:
                self.port, self.admin_port = free_port(), free_port()
            else:
                time.sleep(1)
        pytest.fail(f"server exited with {self.process.returncode}; log: {self.log_path}")

    def _start_once(self):
        """True once the server listens; False when it exited (the log says why)."""
        os.makedirs(self.data_dir, exist_ok=True)
        command = shlex.split(self.command_template.format(dir=self.data_dir, port=self.port, admin_port=self.admin_port))
        command += self.extra_args
        binary = command[0]
        if not os.path.isabs(binary):
            command[0] = os.path.join(REPO, binary)
        if not os.path.exists(command[0]):
            pytest.fail(
                f"server binary {command[0]} does not exist: build it (cargo build -p keel, or "
                f"or set KEEL_BIN / KEEL_S3_SERVER_CMD)"
            )
        env = dict(os.environ)
        env["KEEL_ACCESS_KEY_ID"] = ACCESS_KEY_ID
        env["KEEL_SECRET_ACCESS_KEY"] = SECRET_ACCESS_KEY
        env.setdefault("RUST_LOG", "warn")
        log_offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log)
        log.close()
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self.process.poll() is not None:
                return False
            if self._listening(log_offset):
                return True
            time.sleep(0.05)
        pytest.fail(f"server did not listen on {self.port} within {START_TIMEOUT_S} s")

    def _listening(self, log_offset):
        """Keel says "ready" once every listener is bound (a port another process holds would
        accept a connection even though this server failed); another command is probed."""
        if self.command_template == DEFAULT_CMD:
            with open(self.log_path, "rb") as log:
                log.seek(log_offset)
                return b"\nready\n" in b"\n" + log.read()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def peak_rss_bytes(self):
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM in /proc status")

    def kill9(self):
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def cleanup(self):
        """Removes the data directory and the log (kept when the server crashed)."""
        shutil.rmtree(self.data_dir, ignore_errors=True)
        if self.process is None or self.process.returncode in (0, -signal.SIGTERM, -signal.SIGKILL):
            try:
                os.unlink(self.log_path)
            except OSError:
                pass

    def stop(self):
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def new_data_dir(name):
    path = os.path.join(DATA_ROOT, f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture
def client_dir():
    """A directory for a client's files beside the servers' data (never tmpfs), removed after
    the test (left behind, each run of the suite kept about 66 MiB of them)."""
    path = os.path.join(DATA_ROOT, f"client-{uuid.uuid4().hex[:8]}")
    os.makedirs(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def server():
    srv = Server(new_data_dir("session")).start()
    yield srv
    srv.stop()
    srv.cleanup()


@pytest.fixture
def fresh_server():
    """A server of its own (for kill -9 and memory tests); the test may restart it."""
    srv = Server(new_data_dir("fresh"))
    yield srv
    srv.stop()
    srv.cleanup()


@pytest.fixture(scope="session")
def two_key_server():
    """A server with a second access key, created the way an operator does: `keel key create`."""
    srv = Server(new_data_dir("twokeys")).start()
    created = subprocess.run(
        [KEEL_BIN, "key", "create", "other", "--admin", f"127.0.0.1:{srv.admin_port}", "--token-dir", srv.data_dir],
        capture_output=True, text=True, check=True,
    ).stdout
    values = dict(line.split("=", 1) for line in created.split())
    srv.other_key_id = values["AWS_ACCESS_KEY_ID"]
    srv.other_secret = values["AWS_SECRET_ACCESS_KEY"]
    yield srv
    srv.stop()
    srv.cleanup()


def make_client(endpoint, key_id=ACCESS_KEY_ID, secret=SECRET_ACCESS_KEY, **config):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        region_name=REGION,
        config=Config(
            s3={"addressing_style": "path"},
            retries={"max_attempts": 1, "mode": "standard"},
            **config,
        ),
    )


@pytest.fixture(scope="session")
def s3(server):
    return make_client(server.endpoint)


@pytest.fixture
def bucket(s3):
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    yield name
    # Empty and delete; tolerate tests that deleted it.
    try:
        paginator = s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=name, Delete={"Objects": keys})
        for upload in s3.list_multipart_uploads(Bucket=name).get("Uploads", []):
            s3.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
        s3.delete_bucket(Bucket=name)
    except Exception:
        pass


def aws(server, *args, config_dir, timeout=120):
    """Runs the aws cli against `server` with the test key, path-style addressing and a config
    of its own in `config_dir` (nothing from the user's ~/.aws)."""
    config = os.path.join(config_dir, "aws-config")
    with open(config, "w") as f:
        f.write(f"[default]\nregion = {REGION}\ns3 =\n    addressing_style = path\n")
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET_ACCESS_KEY,
               AWS_CONFIG_FILE=config, AWS_SHARED_CREDENTIALS_FILE=os.path.join(config_dir, "none"))
    return subprocess.run(["aws", "--endpoint-url", server.endpoint, *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def error_code(excinfo):
    return excinfo.value.response["Error"]["Code"]


def http_status(excinfo):
    return excinfo.value.response["ResponseMetadata"]["HTTPStatusCode"]
