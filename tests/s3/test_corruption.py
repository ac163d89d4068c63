"""Corrupt data on disk is never served: a GET of an object whose stored chunk fails its checksum
answers 500 InternalError with a clear message, not the bytes."""

import os
import uuid

import botocore
import pytest

from conftest import make_client

MIB = 1024 * 1024


def segment_files(data_dir):
    for root, _, files in os.walk(data_dir):
        for name in files:
            path = os.path.join(root, name)
            if os.path.getsize(path) >= MIB:
                yield path


def test_corrupt_chunk_is_an_error_not_data(fresh_server):
    # Proves a flipped byte inside a stored chunk makes GET answer 500 InternalError saying the
    # data failed verification, and the corrupted bytes are not returned. Random data is stored
    # uncompressed, so the object's bytes can be found in the segment file and damaged there.
    fresh_server.start()
    s3 = make_client(fresh_server.endpoint)
    bucket = f"corrupt-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    data = os.urandom(2 * MIB)
    s3.put_object(Bucket=bucket, Key="victim", Body=data)
    s3.put_object(Bucket=bucket, Key="healthy", Body=b"fine")
    fresh_server.stop()

    marker = data[100:164]
    damaged = False
    for path in segment_files(fresh_server.data_dir):
        with open(path, "r+b") as f:
            content = f.read()
            at = content.find(marker)
            if at >= 0:
                f.seek(at + 10)
                f.write(bytes([content[at + 10] ^ 0xFF]))
                f.flush()
                os.fsync(f.fileno())
                damaged = True
                break
    assert damaged, "the object's bytes were not found in any segment file"

    fresh_server.start()
    s3 = make_client(fresh_server.endpoint)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket=bucket, Key="victim")["Body"].read()
    assert e.value.response["Error"]["Code"] == "InternalError"
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert "verification" in e.value.response["Error"]["Message"]
    assert s3.get_object(Bucket=bucket, Key="healthy")["Body"].read() == b"fine"
