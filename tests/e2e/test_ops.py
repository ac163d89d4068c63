"""`keel ops`: the NBD and S3 requests in flight and the recent slowest, with the phase each is
in and the time each spent in each phase, through the real CLI against a running server."""

import hashlib
import json
import re
import socket
import struct
import time
import urllib.request

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from conftest import s3_client, wait_for
from nbd_client import Client

CMD_WRITE = 1
REQUEST_MAGIC = 0x25609513


def ops_json(srv):
    return json.loads(srv.cli("ops", "--json").stdout)



def phases(op):
    return {p["phase"]: p["ms"] for p in op["phases"]}


def test_a_stalled_nbd_write_is_shown_in_flight_then_among_the_slowest(server):
    # Proves an NBD write whose payload has not all arrived is listed in flight with its
    # volume, range, client and phase ("receiving"), in the table and the JSON; once answered
    # it leaves the in-flight list and is among the slowest with the time it spent receiving.
    server.cli("volume", "create", "opsvol", "--size", "16M")
    host, port = server.nbd.rsplit(":", 1)
    client = Client(host, int(port), "opsvol")
    try:
        own = "%s:%d" % client.sock.getsockname()
        payload = bytes(range(256)) * 32
        header = struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_WRITE, 77, 8192, len(payload))
        client.sock.sendall(header + payload[:1000])

        def stalled():
            return [op for op in ops_json(server)["in_flight"] if op["operation"] == "write"]

        [op] = wait_for("the stalled write in flight", stalled)
        assert op["frontend"] == "nbd"
        assert op["target"] == "opsvol offset 8192 length 8192"
        assert op["client"] == own
        assert op["phase"] == "receiving"
        table = server.cli("ops").stdout
        row = next(line for line in table.splitlines() if "opsvol offset 8192" in line)
        assert "write" in row and own in row and "*receiving" in row, table

        time.sleep(1.2)
        client.sock.sendall(payload[1000:])
        magic, error, cookie = struct.unpack(">IIQ", client._recv(16))
        assert (error, cookie) == (0, 77)
        assert client.read(8192, len(payload)) == payload
    finally:
        client.close()

    def finished():
        report = ops_json(server)
        return None if any(o["operation"] == "write" for o in report["in_flight"]) else report

    report = wait_for("the write to finish", finished)
    [done] = [o for o in report["slowest"] if o["id"] == op["id"]]
    assert "phase" not in done
    assert done["duration_ms"] >= 1200
    spent = phases(done)
    assert spent["receiving"] >= 1100
    assert {"writing", "replying"} <= spent.keys()
    # Over the 1 s threshold: kept in its own list too, and counted in the --slow heading.
    assert [o["id"] for o in report["over_threshold"]] == [done["id"]]
    slow = server.cli("ops", "--slow").stdout
    assert "1 over 1000 ms kept" in slow, slow
    assert "opsvol offset 8192 length 8192" in slow, slow


def test_flushes_show_the_store_phases_and_s3_puts_their_key(server):
    # Proves phases marked below the frontends reach the request: durable NBD writes show the
    # store's group commit (its wait, or the pwrite and fdatasync it led), and an S3 PUT shows
    # its bucket and key, the client, and the time its body took to arrive.
    server.cli("volume", "create", "syncvol", "--size", "16M")
    host, port = server.nbd.rsplit(":", 1)
    client = Client(host, int(port), "syncvol")
    try:
        for i in range(20):
            client.write(i * 4096, bytes([i]) * 4096, fua=True)
    finally:
        client.close()
    slowest = ops_json(server)["slowest"]
    writes = [op for op in slowest if op["target"].startswith("syncvol ")]
    assert len(writes) == 20
    store_phases = set().union(*(phases(op).keys() for op in writes))
    assert "fdatasync" in store_phases and "pwrite" in store_phases, store_phases
    assert all(op["operation"] == "write" for op in writes)

    s3 = s3_client(server)
    s3.create_bucket(Bucket="opsbucket")
    # A PUT whose body arrives in two parts, 1.2 s apart, sent raw so the pause is ours.
    body = b"k" * 100_000
    request = AWSRequest(method="PUT", url=f"http://{server.s3}/opsbucket/dir/slow-object",
                         data=body, headers={"Content-Length": str(len(body))})
    request.headers["x-amz-content-sha256"] = hashlib.sha256(body).hexdigest()
    S3SigV4Auth(Credentials(server.env["KEEL_ACCESS_KEY_ID"], server.env["KEEL_SECRET_ACCESS_KEY"]),
                "s3", "us-east-1").add_auth(request)
    host, port = server.s3.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    try:
        own = "%s:%d" % sock.getsockname()
        head = "PUT /opsbucket/dir/slow-object HTTP/1.1\r\nHost: %s\r\n" % server.s3
        head += "".join(f"{k}: {v}\r\n" for k, v in request.headers.items() if k.lower() != "host")
        sock.sendall(head.encode() + b"\r\n" + body[:5000])

        def stalled():
            return [op for op in ops_json(server)["in_flight"] if op["frontend"] == "s3"]

        [op] = wait_for("the stalled PUT in flight", stalled)
        assert op["operation"] == "PUT"
        assert op["target"] == "opsbucket/dir/slow-object"
        assert op["client"] == own
        time.sleep(1.2)
        sock.sendall(body[5000:])
        status = sock.recv(4096).split(b"\r\n", 1)[0]
        assert b" 200 " in status, status
    finally:
        sock.close()
    assert s3.get_object(Bucket="opsbucket", Key="dir/slow-object")["Body"].read() == body
    report = ops_json(server)
    [done] = [o for o in report["over_threshold"] if o["id"] == op["id"]]
    spent = phases(done)
    assert spent["receiving"] >= 1100, spent
    assert "handling" in spent and "replying" in spent, spent


def test_tracking_can_be_turned_off(make_server, workdir):
    # Proves `track_ops = false` registers nothing and says so.
    config = workdir / "keel.toml"
    config.write_text("track_ops = false\n")
    srv = make_server(extra_args=["--config", str(config)])
    srv.cli("volume", "create", "quiet", "--size", "4M")
    host, port = srv.nbd.rsplit(":", 1)
    client = Client(host, int(port), "quiet")
    try:
        client.write(0, b"q" * 4096, fua=True)
    finally:
        client.close()
    report = ops_json(srv)
    assert report["tracking"] is False
    assert report["slowest"] == [] and report["in_flight"] == []
    assert "request tracking is off" in srv.cli("ops", "--slow").stdout


def test_qos_throttling_shows_as_a_phase_and_in_metrics(server):
    # Proves time a volume's IOPS limit holds requests back is visible: as the "throttled"
    # phase of those requests in `keel ops`, and summed in keel_volume_throttled_seconds_total.
    server.cli("volume", "create", "slowvol", "--size", "4M", "--iops", "20")
    server.cli("volume", "create", "fastvol", "--size", "4M")
    host, port = server.nbd.rsplit(":", 1)
    for name in ("slowvol", "fastvol"):
        client = Client(host, int(port), name)
        try:
            for i in range(30):
                client.write(i * 4096, b"t" * 4096)
        finally:
            client.close()
    slowest = ops_json(server)["slowest"]
    throttled = [phases(op).get("throttled", 0) for op in slowest if op["target"].startswith("slowvol ")]
    assert sum(throttled) > 1000, throttled  # 30 writes at 20 per second: about 1.5 s held back
    assert not [op for op in slowest if op["target"].startswith("fastvol ") and "throttled" in phases(op)]
    with urllib.request.urlopen(f"http://{server.admin}/metrics", timeout=30) as response:
        text = response.read().decode()
    held = re.search(r'^keel_volume_throttled_seconds_total\{volume="slowvol"\} (\S+)$', text, re.M)
    assert held and float(held.group(1)) > 1.0, text
    assert 'keel_volume_throttled_seconds_total{volume="fastvol"}' not in text
