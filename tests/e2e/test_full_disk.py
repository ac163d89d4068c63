"""A full disk, end to end: `keel server` on a small loop-mounted ext4 that the test creates and
fills through S3. On the full disk, new data is refused with a clear error, while everything that
frees space still works — a volume delete (a catalog change through Raft), S3 deletes of objects
whose chunks a copy shares — and after compaction writes resume with nothing acknowledged lost.
Needs root, mkfs.ext4 (e2fsprogs) and loop mounts."""

import hashlib
import os
import subprocess

import boto3
import botocore
import pytest
from botocore.config import Config

from conftest import require

MIB = 1024 * 1024


@pytest.fixture
def small_disk(workdir):
    require("mkfs.ext4", "e2fsprogs")
    image = workdir / "fs.img"
    mnt = workdir / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(160 * MIB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_refuses_new_data_and_still_frees_space(make_server, workdir, small_disk):
    config = workdir / "keel.toml"
    config.write_text("[store]\nsegment_size_max_bytes = 8388608\nreserve_bytes = 16777216\n")
    srv = make_server([small_disk / "data"], extra_args=["--config", str(config)])
    s3 = boto3.client(
        "s3", endpoint_url=f"http://{srv.s3}", region_name="us-east-1",
        aws_access_key_id=srv.env["KEEL_ACCESS_KEY_ID"],
        aws_secret_access_key=srv.env["KEEL_SECRET_ACCESS_KEY"],
        config=Config(retries={"max_attempts": 1}),
    )
    s3.create_bucket(Bucket="fill")
    base = os.urandom(4 * MIB)
    s3.put_object(Bucket="fill", Key="base", Body=base)
    s3.copy_object(Bucket="fill", Key="copy", CopySource={"Bucket": "fill", "Key": "base"})
    srv.cli("volume", "create", "vol", "--size", "64M")

    # Fill with ever smaller objects until even a 512-byte one is refused: the disk is at the
    # reserve, where any write that adds data fails.
    stored = {}
    n = 0
    for size in (4 * MIB, 256 * 1024, 16 * 1024, 512):
        refused = None
        for _ in range(400):
            body = os.urandom(size)
            try:
                s3.put_object(Bucket="fill", Key=f"obj-{n}", Body=body)
                stored[f"obj-{n}"] = hashlib.md5(body).hexdigest()
                n += 1
            except botocore.exceptions.ClientError as e:
                refused = e
                break
        assert refused is not None, f"the 160 MiB disk never filled with {size}-byte objects"
        assert refused.response["ResponseMetadata"]["HTTPStatusCode"] == 507, refused.response
        assert refused.response["Error"]["Code"] == "InsufficientStorage"
    # Health says so, naming the directory: the store refuses writes at its reserve.
    status = srv.cli("status", check=False).stdout
    assert "KEEL_FULL" in status and f"{small_disk / 'data'} has" in status, status
    assert "writes that add data are refused" in status, status

    # A volume write is refused too (ENOSPC through NBD), and the volume can still be deleted.
    require("qemu-io", "qemu-utils")
    _, failed = qemu_io(srv.nbd_uri("vol"), "write -P 0xaa 0 32M", check=False)
    assert failed, "a 32 MiB volume write on a full disk must fail"
    srv.cli("volume", "delete", "vol")
    assert "vol" not in srv.cli("volume", "list").stdout

    # Deleting an object whose chunks a copy shares rewrites their reference counts: allowed.
    s3.delete_object(Bucket="fill", Key="copy")
    assert s3.get_object(Bucket="fill", Key="base")["Body"].read() == base
    s3.delete_object(Bucket="fill", Key="base")
    for key in list(stored)[: len(stored) // 2]:
        s3.delete_object(Bucket="fill", Key=key)
        del stored[key]

    srv.cli("store", "compact")
    assert "KEEL_FULL" not in srv.cli("status", check=False).stdout
    s3.put_object(Bucket="fill", Key="after", Body=b"space is back")
    assert s3.get_object(Bucket="fill", Key="after")["Body"].read() == b"space is back"
    for key, md5 in stored.items():
        got = s3.get_object(Bucket="fill", Key=key)["Body"].read()
        assert hashlib.md5(got).hexdigest() == md5, key


def qemu_io(uri, *commands, check=True):
    args = ["qemu-io", "-f", "raw", uri]
    for c in commands:
        args += ["-c", c]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    failed = result.returncode != 0 or "failed" in result.stderr.lower() or "error" in result.stdout.lower()
    if check and failed:
        raise AssertionError(f"qemu-io {commands} failed: {result.stdout}\n{result.stderr}")
    return result, failed
