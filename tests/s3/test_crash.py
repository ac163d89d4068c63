"""Durability: objects whose PUT was acknowledged survive kill -9 of the server, byte for byte."""

import hashlib
import os
import random
import threading
import time
import uuid

import botocore

from conftest import make_client

MIB = 1024 * 1024
# How long writers keep writing before the server is killed under them.
WRITE_WINDOW_S = 3.0
WRITERS = 6


def test_acknowledged_puts_survive_kill9(fresh_server):
    # Proves every acknowledged PUT (inline, multi-chunk, multipart) is present and identical
    # after kill -9 and restart, including PUTs acknowledged just before the kill while other
    # PUTs were still in flight.
    fresh_server.start()
    s3 = make_client(fresh_server.endpoint)
    bucket = f"crash-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    expected = {}
    for key, size in (("inline", 100), ("chunked", 3 * MIB + 11), ("empty", 0)):
        data = os.urandom(size)
        s3.put_object(Bucket=bucket, Key=key, Body=data)
        expected[key] = hashlib.md5(data).hexdigest()
    upload = s3.create_multipart_upload(Bucket=bucket, Key="multipart")["UploadId"]
    parts = [os.urandom(5 * MIB), os.urandom(77)]
    etags = [s3.upload_part(Bucket=bucket, Key="multipart", UploadId=upload, PartNumber=i + 1,
                            Body=p)["ETag"] for i, p in enumerate(parts)]
    s3.complete_multipart_upload(Bucket=bucket, Key="multipart", UploadId=upload, MultipartUpload={
        "Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]})
    expected["multipart"] = hashlib.md5(b"".join(parts)).hexdigest()

    acknowledged = {}
    lock = threading.Lock()
    stop = time.time() + WRITE_WINDOW_S

    def writer(index):
        client = make_client(fresh_server.endpoint)
        rng = random.Random(index)
        n = 0
        while time.time() < stop:
            key = f"w{index}/{n}"
            data = os.urandom(rng.choice([10, 4096, 70000, 1200000]))
            try:
                client.put_object(Bucket=bucket, Key=key, Body=data)
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                return
            with lock:
                acknowledged[key] = hashlib.md5(data).hexdigest()
            n += 1

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(WRITERS)]
    for t in threads:
        t.start()
    time.sleep(WRITE_WINDOW_S - 0.5)
    with lock:
        expected.update(acknowledged)
    fresh_server.kill9()
    for t in threads:
        t.join(timeout=60)
    with lock:
        expected.update(acknowledged)
    assert len(expected) > 20, "the writers acknowledged too few PUTs to prove anything"

    fresh_server.start()
    s3 = make_client(fresh_server.endpoint)
    for key, md5 in expected.items():
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        assert hashlib.md5(body).hexdigest() == md5, key
