"""Authentication and authorization: wrong signatures, unknown keys, anonymous requests, expired
presigned URLs are refused and change nothing; keys see only their own (or granted) buckets."""

import time
import uuid

import botocore
import pytest
import requests

from conftest import (ACCESS_KEY_ID, SECRET_ACCESS_KEY,
                      error_code, http_status, make_client)


def assert_unchanged(s3, bucket):
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)


def test_wrong_secret_refused(server, s3, bucket):
    # Proves a request signed with the wrong secret answers SignatureDoesNotMatch (403) and
    # stores nothing.
    bad = make_client(server.endpoint, secret="not-the-right-secret-at-all-000000")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        bad.put_object(Bucket=bucket, Key="k", Body=b"v")
    assert error_code(e) == "SignatureDoesNotMatch"
    assert http_status(e) == 403
    assert_unchanged(s3, bucket)


def test_unknown_key_refused(server, s3, bucket):
    # Proves an access key the server does not know answers InvalidAccessKeyId (403).
    bad = make_client(server.endpoint, key_id="GKNOSUCHKEY000000000")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        bad.put_object(Bucket=bucket, Key="k", Body=b"v")
    assert error_code(e) == "InvalidAccessKeyId"
    assert http_status(e) == 403
    assert_unchanged(s3, bucket)


def test_anonymous_refused(server, s3, bucket):
    # Proves unsigned requests are refused with 403 AccessDenied: read, write and list.
    s3.put_object(Bucket=bucket, Key="secret", Body=b"data")
    for method, path, data in (
        ("GET", f"/{bucket}/secret", None),
        ("PUT", f"/{bucket}/anon", b"x"),
        ("GET", f"/{bucket}", None),
        ("GET", "/", None),
        ("DELETE", f"/{bucket}/secret", None),
    ):
        response = requests.request(method, server.endpoint + path, data=data, timeout=10)
        assert response.status_code == 403, (method, path, response.status_code)
        assert b"AccessDenied" in response.content
        assert b"data" != response.content
    # A browser-form POST upload (unsupported; s3s would read the form before any check).
    form = requests.post(f"{server.endpoint}/{bucket}", data={"key": "form"},
                         files={"file": ("f.bin", b"x" * (300 * 1024))}, timeout=10)
    assert form.status_code >= 400
    small_form = requests.post(f"{server.endpoint}/{bucket}", data={"key": "form2"},
                               files={"file": ("f.bin", b"x")}, timeout=10)
    assert small_form.status_code >= 400
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys == ["secret"]


def test_presigned_urls(server, s3, bucket):
    # Proves a presigned GET works within its lifetime, is refused once expired, and a
    # presigned URL with a tampered signature is refused.
    s3.put_object(Bucket=bucket, Key="p", Body=b"presigned")
    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "p"}, ExpiresIn=60)
    assert requests.get(url, timeout=10).content == b"presigned"
    put_url = s3.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": "q"}, ExpiresIn=60)
    assert requests.put(put_url, data=b"via url", timeout=10).status_code == 200
    assert s3.get_object(Bucket=bucket, Key="q")["Body"].read() == b"via url"
    expired = s3.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": "late"}, ExpiresIn=1)
    time.sleep(2.5)
    response = requests.put(expired, data=b"too late", timeout=10)
    assert response.status_code == 403
    tampered = url[:-4] + ("0000" if not url.endswith("0000") else "1111")
    assert requests.get(tampered, timeout=10).status_code == 403
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys == ["p", "q"]


def test_bucket_permissions_per_key(two_key_server):
    # Proves each key sees only buckets it owns: the other key cannot list, read, write or
    # delete them (AccessDenied) and does not see them in ListBuckets; it cannot take the name.
    owner = make_client(two_key_server.endpoint)
    other = make_client(two_key_server.endpoint, key_id=two_key_server.other_key_id, secret=two_key_server.other_secret)
    bucket = f"own-{uuid.uuid4().hex[:8]}"
    owner.create_bucket(Bucket=bucket)
    owner.put_object(Bucket=bucket, Key="mine", Body=b"private")
    assert bucket not in [b["Name"] for b in other.list_buckets()["Buckets"]]
    for call in (
        lambda: other.get_object(Bucket=bucket, Key="mine"),
        lambda: other.put_object(Bucket=bucket, Key="theirs", Body=b"x"),
        lambda: other.list_objects_v2(Bucket=bucket),
        lambda: other.delete_object(Bucket=bucket, Key="mine"),
        lambda: other.delete_bucket(Bucket=bucket),
        lambda: other.copy_object(Bucket=bucket, Key="c", CopySource={"Bucket": bucket, "Key": "mine"}),
    ):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            call()
        assert http_status(e) == 403
    with pytest.raises(botocore.exceptions.ClientError) as e:
        other.create_bucket(Bucket=bucket)
    assert error_code(e) == "BucketAlreadyExists"
    # The other key's own bucket cannot be used as a copy source into ours either way.
    theirs = f"theirs-{uuid.uuid4().hex[:8]}"
    other.create_bucket(Bucket=theirs)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        other.copy_object(Bucket=theirs, Key="stolen", CopySource={"Bucket": bucket, "Key": "mine"})
    assert http_status(e) == 403
    assert [o["Key"] for o in owner.list_objects_v2(Bucket=bucket)["Contents"]] == ["mine"]
    assert "Contents" not in other.list_objects_v2(Bucket=theirs)
