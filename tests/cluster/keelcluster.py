"""Helpers of Keel's multi-process cluster tests: several real `keel server` processes on
loopback addresses 127.0.0.1–127.0.0.9 (one address per node, ports found free at start), data
on a real filesystem under /var/tmp (never tmpfs). Processes are stopped by their own PIDs.

Several nodes share this machine's one disk: timings measured here say nothing about separate
machines. That disk is shared with everything else on the machine too, so its fill level is not
the test's to decide: nodes run with `nearfull_percent = 100` unless the test's own config sets
it (the tests of nearly full nodes do, or fill a small filesystem of their own past the
reserve). With the default 95, a CI run on a disk 95% full refused every replicated volume."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEEL_BIN = os.environ.get("KEEL_BIN", str(ROOT / "target" / "release" / "keel"))
WORK = Path(os.environ.get("KEEL_CLUSTER_TEST_DIR", "/var/tmp/keel-cluster-tests"))
START_TIMEOUT_SECONDS = 60


def free_port(host):
    """A port free on `host` now, below Linux's ephemeral range (32768+) so that outgoing
    connections of other processes do not take it before the node listens on it."""
    import random
    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host}")


def fs_type(path):
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True).stdout.strip()


class PortTaken(Exception):
    """The node could not listen: another process took a port picked for it."""


class Node:
    """One `keel server` of a test cluster: its own loopback address, ports and data dir."""

    def __init__(self, workdir, index, witness=False, extra_args=(), env=None):
        self.index = index
        self.name = f"n{index}"
        self.host = f"127.0.0.{index}"
        self.dir = workdir / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.witness = witness
        self.extra_args = list(extra_args)
        self.pick_ports()
        self.started = False
        self.proc = None
        self.banner = []
        self.env = dict(os.environ)
        self.env.setdefault("KEEL_ACCESS_KEY_ID", "GKCLUSTERTEST00001")
        self.env.setdefault("KEEL_SECRET_ACCESS_KEY", "cluster-test-secret-0123456789abcdef")
        self.env.setdefault("KEEL_LOG", "info")
        self.env.update(env or {})

    def pick_ports(self):
        self.cluster_port = free_port(self.host)
        self.admin_port = free_port(self.host)
        self.s3_port = free_port(self.host)
        self.nbd_port = free_port(self.host)

    @property
    def cluster(self):
        return f"{self.host}:{self.cluster_port}"

    @property
    def admin(self):
        return f"{self.host}:{self.admin_port}"

    @property
    def token_file(self):
        return self.dir / "cluster-token"

    def start(self, join=None, token=None, expect_failure=False):
        # A port found free can still be taken before the node binds it; on its first start
        # (nobody knows its addresses yet) the node then simply gets other ports.
        for _ in range(3):
            try:
                started = self.start_once(join, token, expect_failure)
            except PortTaken:
                if self.started:
                    raise
                self.pick_ports()
                continue
            self.started = self.started or not expect_failure
            return started
        raise RuntimeError(f"{self.name}: its ports were taken three times")

    def start_once(self, join, token, expect_failure):
        args = [KEEL_BIN, "server", "--data", str(self.dir), "--name", self.name,
                "--cluster", self.cluster, "--admin", self.admin, "--debug-faults"]
        if not self.witness:
            args += ["--s3", f"{self.host}:{self.s3_port}", "--nbd", f"{self.host}:{self.nbd_port}"]
        else:
            args += ["--witness"]
        if join is not None:
            args += ["--join", join.cluster]
            if token is None:
                args += ["--join-token-file", str(join.token_file)]
            else:
                args += ["--join-token", token]
        args += self.harness_config(self.extra_args)
        self.log_path = self.dir.parent / f"{self.name}.log"
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, env=self.env, text=True)
        deadline = time.time() + START_TIMEOUT_SECONDS
        self.banner = []
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                if b"Address already in use" in self.log_path.read_bytes()[log_start:]:
                    self.proc = None
                    raise PortTaken()
                if expect_failure:
                    self.proc = None
                    return code
                raise RuntimeError(f"{self.name} exited early ({code}); log {self.log_path}:\n{self.log()[-3000:]}")
            self.banner.append(line)
            if line.strip() == "ready":
                if expect_failure:
                    raise AssertionError(f"{self.name} started but was expected to fail")
                return self
        raise RuntimeError(f"{self.name} did not become ready; log {self.log_path}")

    def harness_config(self, extra_args):
        """`extra_args` with a config that sets `nearfull_percent = 100` unless the test's own
        `--config` sets `nearfull_percent` (see the module's docstring)."""
        args = list(extra_args)
        if "--config" not in args:
            path = self.dir.parent / f"{self.name}-harness.toml"
            path.write_text("nearfull_percent = 100\n")
            return args + ["--config", str(path)]
        at = args.index("--config") + 1
        own = Path(args[at])
        text = own.read_text()
        if re.search(r"^\s*nearfull_percent\s*=", text, re.M):
            return args
        path = self.dir.parent / f"{self.name}-harness-{own.name}"
        # Top-level keys come before any [table] in TOML: prepended, it stays top-level.
        path.write_text("nearfull_percent = 100\n" + text)
        args[at] = str(path)
        return args

    def log(self):
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def cli(self, *args, check=True, timeout=60):
        cmd = [KEEL_BIN, *args, "--admin", self.admin, "--token-dir", str(self.dir)]
        result = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr}")
        return result

    def status(self):
        return json.loads(self.cli("cluster", "status", "--json").stdout)

    def api(self, method, path, body=None, timeout=30):
        """Admin API call; returns (HTTP status, decoded JSON)."""
        import urllib.error
        import urllib.request
        token = (self.dir / "admin-token").read_text().strip()
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://{self.admin}{path}", data=data, method=method,
                                         headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")

    def faults(self, blocked_node_ids, delays=()):
        """Replaces this node's transport faults: traffic with `blocked_node_ids` dropped, and
        `delays` ({"node", "method" (optional), "milliseconds"}) on the calls it sends."""
        code, answer = self.api("POST", "/api/v1/debug/faults",
                                {"blocked_nodes": list(blocked_node_ids), "delays": list(delays)})
        assert code == 200, answer

    def node_id(self):
        return self.status()["node_id"]

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


def wait_until(what, check, timeout=30, interval=0.1):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as error:  # a node restarting answers errors for a moment
            last = error
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last})")


class Cluster:
    def __init__(self, workdir):
        self.workdir = workdir
        self.nodes = []

    def add(self, witness=False, join_through=None, extra_args=(), env=None):
        node = Node(self.workdir, len(self.nodes) + 1, witness=witness, extra_args=extra_args, env=env)
        self.nodes.append(node)
        if join_through is None and len(self.nodes) > 1:
            join_through = self.nodes[0]
        node.start(join=join_through)
        return node

    def running(self):
        return [n for n in self.nodes if n.proc is not None]

    def voters(self, via=None):
        """The voters every running node (or `via` alone) agrees on, once no voter change is
        under way on any of them; None meanwhile. During Raft's joint configuration the status
        lists the old and the new voters together, and the new ones alone cannot elect a leader:
        a test that kills or cuts nodes must wait for the change to end."""
        views = []
        for node in [via] if via else self.running():
            status = node.status()
            if status["membership_changing"]:
                return None
            views.append({n["record"]["id"] for n in status["nodes"] if n["raft_role"] == "Voter"})
        return views[0] if all(view == views[0] for view in views) else None

    def leader(self, via=None):
        via = via or self.running()[0]
        return via.status()["leader"]

    def node_by_id(self, node_id):
        for node in self.nodes:
            if node.proc is not None and node.node_id() == node_id:
                return node
        return None

    def stop(self):
        for node in self.nodes:
            node.stop()
