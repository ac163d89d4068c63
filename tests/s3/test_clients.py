"""The AWS CLI and rclone against Keel: the everyday commands work end to end."""

import filecmp
import hashlib
import os
import subprocess
import uuid

import pytest

from conftest import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY, aws, require_tool

MIB = 1024 * 1024
# A client command that takes longer than this is a failure, not a hang.
COMMAND_TIMEOUT_S = 120


def test_aws_cli(server, client_dir):
    # Proves `aws s3` mb/cp (single and multipart)/ls/sync/rm/rb and `aws s3api` work, and
    # downloaded files equal the uploaded ones.
    require_tool("aws", "awscli")
    tmp = client_dir
    bucket = f"cli-{uuid.uuid4().hex[:8]}"
    small = os.path.join(tmp, "small.txt")
    large = os.path.join(tmp, "large.bin")
    with open(small, "w") as f:
        f.write("hello from the aws cli\n")
    with open(large, "wb") as f:
        f.write(os.urandom(20 * MIB + 3))  # above the CLI's 8 MiB multipart threshold
    assert aws(server, "s3", "mb", f"s3://{bucket}", config_dir=tmp).returncode == 0
    for path in (small, large):
        result = aws(server, "s3", "cp", path, f"s3://{bucket}/dir/", config_dir=tmp)
        assert result.returncode == 0, result.stderr
    listing = aws(server, "s3", "ls", f"s3://{bucket}/dir/", config_dir=tmp)
    assert "small.txt" in listing.stdout and "large.bin" in listing.stdout
    down = os.path.join(tmp, "down")
    os.makedirs(down)
    result = aws(server, "s3", "cp", f"s3://{bucket}/dir/", down, "--recursive", config_dir=tmp)
    assert result.returncode == 0, result.stderr
    assert filecmp.cmp(small, os.path.join(down, "small.txt"), shallow=False)
    assert filecmp.cmp(large, os.path.join(down, "large.bin"), shallow=False)
    head = aws(server, "s3api", "head-object", "--bucket", bucket, "--key", "dir/small.txt", config_dir=tmp)
    assert head.returncode == 0 and hashlib.md5(open(small, "rb").read()).hexdigest() in head.stdout
    result = aws(server, "s3", "sync", down, f"s3://{bucket}/synced/", config_dir=tmp)
    assert result.returncode == 0, result.stderr
    assert aws(server, "s3", "rm", f"s3://{bucket}", "--recursive", config_dir=tmp).returncode == 0
    result = aws(server, "s3", "rb", f"s3://{bucket}", config_dir=tmp)
    assert result.returncode == 0, result.stderr
    missing = aws(server, "s3", "ls", f"s3://{bucket}", config_dir=tmp)
    assert missing.returncode != 0 and "NoSuchBucket" in missing.stderr


def rclone(server, *args):
    env = dict(
        os.environ,
        RCLONE_CONFIG_KEEL_TYPE="s3",
        RCLONE_CONFIG_KEEL_PROVIDER="Other",
        RCLONE_CONFIG_KEEL_ACCESS_KEY_ID=ACCESS_KEY_ID,
        RCLONE_CONFIG_KEEL_SECRET_ACCESS_KEY=SECRET_ACCESS_KEY,
        RCLONE_CONFIG_KEEL_ENDPOINT=server.endpoint,
        RCLONE_CONFIG_KEEL_REGION=REGION,
        RCLONE_CONFIG_KEEL_FORCE_PATH_STYLE="true",
    )
    # rclone's AWS SDK refuses a custom CA bundle on a plain-HTTP transport; we use plain HTTP.
    env.pop("AWS_CA_BUNDLE", None)
    return subprocess.run(["rclone", "--config", "/dev/null", *args], env=env,
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


def test_rclone(server, client_dir):
    # Proves rclone mkdir/copy (with multipart)/check/lsf/delete/rmdir work and `rclone check`
    # finds the remote identical to the local tree.
    require_tool("rclone", "rclone")
    tmp = client_dir
    tree = os.path.join(tmp, "tree")
    os.makedirs(os.path.join(tree, "sub", "deeper"))
    files = {"a.txt": b"alpha", "sub/b.bin": os.urandom(MIB + 7),
             "sub/deeper/c.bin": os.urandom(12 * MIB + 1), "sp ace.txt": b"space"}
    for name, data in files.items():
        with open(os.path.join(tree, name), "wb") as f:
            f.write(data)
    bucket = f"rc-{uuid.uuid4().hex[:8]}"
    result = rclone(server, "mkdir", f"keel:{bucket}")
    assert result.returncode == 0, result.stderr
    result = rclone(server, "copy", tree, f"keel:{bucket}/tree", "--s3-upload-cutoff", "5M",
                    "--s3-chunk-size", "5M")
    assert result.returncode == 0, result.stderr
    result = rclone(server, "check", tree, f"keel:{bucket}/tree")
    assert result.returncode == 0, result.stderr
    listed = rclone(server, "lsf", "-R", f"keel:{bucket}/tree").stdout.split()
    assert "a.txt" in listed and "sub/deeper/c.bin" in listed
    down = os.path.join(tmp, "down")
    result = rclone(server, "copy", f"keel:{bucket}/tree", down)
    assert result.returncode == 0, result.stderr
    for name, data in files.items():
        with open(os.path.join(down, name), "rb") as f:
            assert f.read() == data
    assert rclone(server, "delete", f"keel:{bucket}").returncode == 0
    result = rclone(server, "rmdir", f"keel:{bucket}")
    assert result.returncode == 0, result.stderr
