"""Per-bucket S3 metrics on the admin API's /metrics: requests by bucket and method, body bytes in
and out, answers by status class, with boto3 doing the requests."""

import os
import re
import urllib.request
import uuid

import botocore
import pytest

from conftest import make_client


def samples(text, name):
    """{frozenset of (label, value): value} of every sample of metric `name`."""
    found = {}
    for labels, value in re.findall(rf'^{name}\{{([^}}]*)\}} (\S+)$', text, re.M):
        found[frozenset(re.findall(r'(\w+)="([^"]*)"', labels))] = float(value)
    return found


def test_requests_bytes_and_errors_are_counted_per_bucket(fresh_server):
    # Proves each bucket's PUTs, GETs and their body bytes are counted apart, a 404 counts as a
    # 4xx of its bucket, and ListBuckets (no bucket) counts as `_none`.
    fresh_server.start()
    s3 = make_client(fresh_server.endpoint)
    busy, idle = f"busy-{uuid.uuid4().hex[:8]}", f"idle-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=busy)
    s3.create_bucket(Bucket=idle)
    sizes = [1000, 70_000, 2 * 1024 * 1024]
    for index, size in enumerate(sizes):
        s3.put_object(Bucket=busy, Key=f"k{index}", Body=os.urandom(size))
    assert len(s3.get_object(Bucket=busy, Key="k1")["Body"].read()) == 70_000
    with pytest.raises(botocore.exceptions.ClientError):
        s3.head_object(Bucket=idle, Key="absent")
    s3.list_buckets()
    with urllib.request.urlopen(f"http://127.0.0.1:{fresh_server.admin_port}/metrics", timeout=30) as response:
        text = response.read().decode()
    requests = samples(text, "keel_s3_request_seconds_count")
    assert requests[frozenset({("bucket", busy), ("method", "PUT")})] == 4, requests  # bucket + 3 objects
    assert requests[frozenset({("bucket", busy), ("method", "GET")})] == 1, requests
    assert requests[frozenset({("bucket", "_none"), ("method", "GET")})] == 1, requests
    moved = samples(text, "keel_s3_bytes_total")
    assert moved[frozenset({("bucket", busy), ("direction", "in")})] == sum(sizes), moved
    assert moved[frozenset({("bucket", busy), ("direction", "out")})] == 70_000, moved
    answers = samples(text, "keel_s3_responses_total")
    assert answers[frozenset({("bucket", idle), ("status", "4xx")})] == 1, answers
    assert answers[frozenset({("bucket", busy), ("status", "2xx")})] == 5, answers
