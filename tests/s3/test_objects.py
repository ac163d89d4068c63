"""Object operations through boto3: put/get/head/delete, headers and metadata, ETags, ranges,
conditional requests, copies, checksums, key edge cases, listings."""

import base64
import datetime
import hashlib
import os
import zlib

import botocore
import pytest

from conftest import error_code, http_status, make_client


def test_put_get_head_delete_with_headers(s3, bucket):
    # Proves a PUT stores bytes, Content-Type, user metadata and the other stored headers, and
    # GET/HEAD return them with ETag = MD5; DELETE removes the object.
    body = b"hello keel"
    expires = datetime.datetime(2030, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    put = s3.put_object(
        Bucket=bucket, Key="doc.txt", Body=body, ContentType="text/plain",
        ContentEncoding="identity", ContentDisposition='attachment; filename="d.txt"',
        CacheControl="max-age=60", Expires=expires, ContentLanguage="en",
        Metadata={"Color": "blue", "n": "1"},
    )
    md5 = hashlib.md5(body).hexdigest()
    assert put["ETag"] == f'"{md5}"'
    got = s3.get_object(Bucket=bucket, Key="doc.txt")
    assert got["Body"].read() == body
    for response in (got, s3.head_object(Bucket=bucket, Key="doc.txt")):
        assert response["ETag"] == f'"{md5}"'
        assert response["ContentType"] == "text/plain"
        assert response["ContentEncoding"] == "identity"
        assert response["ContentDisposition"] == 'attachment; filename="d.txt"'
        assert response["CacheControl"] == "max-age=60"
        assert response["ContentLanguage"] == "en"
        assert response["Expires"] == expires
        assert response["Metadata"] == {"color": "blue", "n": "1"}
        assert response["ContentLength"] == len(body)
    s3.delete_object(Bucket=bucket, Key="doc.txt")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket=bucket, Key="doc.txt")
    assert error_code(e) == "NoSuchKey"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_object(Bucket=bucket, Key="doc.txt")
    assert http_status(e) == 404
    # Deleting a missing key succeeds, as in S3.
    s3.delete_object(Bucket=bucket, Key="doc.txt")


def test_large_object_round_trip_and_overwrite(s3, bucket):
    # Proves a multi-chunk object (not a multiple of the chunk size) reads back byte for byte,
    # and an overwrite replaces it entirely.
    data = os.urandom(5 * 1024 * 1024 + 333)
    s3.put_object(Bucket=bucket, Key="big", Body=data)
    assert s3.get_object(Bucket=bucket, Key="big")["Body"].read() == data
    assert s3.head_object(Bucket=bucket, Key="big")["ETag"] == f'"{hashlib.md5(data).hexdigest()}"'
    s3.put_object(Bucket=bucket, Key="big", Body=b"small now")
    assert s3.get_object(Bucket=bucket, Key="big")["Body"].read() == b"small now"


def test_get_streams_whole_object_while_it_is_overwritten_and_deleted(s3, bucket):
    # Proves a GET pins the chunks it streams (issue 10, defect 6): an overwrite and a delete
    # during a long read free the old chunks only after the read, so the body is the whole
    # original object rather than a 200 cut short. 48 MiB is far beyond what the server reads
    # ahead and the sockets buffer while the client is paused.
    data = os.urandom(48 * 1024 * 1024)
    s3.put_object(Bucket=bucket, Key="long-read", Body=data)
    body = s3.get_object(Bucket=bucket, Key="long-read")["Body"]
    first = body.read(1024 * 1024)
    s3.put_object(Bucket=bucket, Key="long-read", Body=os.urandom(3 * 1024 * 1024))
    s3.delete_object(Bucket=bucket, Key="long-read")
    rest = body.read()
    got = first + rest
    assert len(got) == len(data)
    assert hashlib.md5(got).hexdigest() == hashlib.md5(data).hexdigest()


def test_empty_object(s3, bucket):
    # Proves a zero-byte object round-trips with the MD5 of nothing.
    s3.put_object(Bucket=bucket, Key="empty", Body=b"")
    got = s3.get_object(Bucket=bucket, Key="empty")
    assert got["Body"].read() == b""
    assert got["ETag"] == '"d41d8cd98f00b204e9800998ecf8427e"'


@pytest.mark.parametrize("range_header,start,end", [
    ("bytes=0-0", 0, 1),
    ("bytes=10-19", 10, 20),
    ("bytes=1048570-1048590", 1048570, 1048591),
    ("bytes=2000000-", 2000000, None),
    ("bytes=-100", -100, None),
    ("bytes=5-99999999", 5, None),
])
def test_range_get(s3, bucket, range_header, start, end):
    # Proves range GETs return exactly the requested bytes (also across chunk boundaries) with
    # 206 and a Content-Range.
    data = bytes(range(256)) * 9000
    s3.put_object(Bucket=bucket, Key="r", Body=data)
    got = s3.get_object(Bucket=bucket, Key="r", Range=range_header)
    expected = data[start:end] if end is not None else data[start:]
    assert got["Body"].read() == expected
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert got["ContentRange"].endswith(f"/{len(data)}")


def test_range_not_satisfiable(s3, bucket):
    # Proves a range starting past the end answers InvalidRange (416).
    s3.put_object(Bucket=bucket, Key="r", Body=b"0123456789")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket=bucket, Key="r", Range="bytes=10-20")
    assert error_code(e) == "InvalidRange"
    assert http_status(e) == 416


def test_conditional_requests(s3, bucket):
    # Proves If-Match / If-None-Match / If-Modified-Since / If-Unmodified-Since answer 412/304
    # or the object, for both GET and HEAD.
    put = s3.put_object(Bucket=bucket, Key="c", Body=b"conditional")
    etag = put["ETag"]
    modified = s3.head_object(Bucket=bucket, Key="c")["LastModified"]
    past = modified - datetime.timedelta(hours=1)
    future = modified + datetime.timedelta(hours=1)
    assert s3.get_object(Bucket=bucket, Key="c", IfMatch=etag)["Body"].read() == b"conditional"
    assert s3.get_object(Bucket=bucket, Key="c", IfNoneMatch='"other"')["Body"].read()
    assert s3.get_object(Bucket=bucket, Key="c", IfModifiedSince=past)["Body"].read()
    assert s3.get_object(Bucket=bucket, Key="c", IfUnmodifiedSince=future)["Body"].read()
    for method in (s3.get_object, s3.head_object):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            method(Bucket=bucket, Key="c", IfMatch='"0123"')
        assert http_status(e) == 412
        with pytest.raises(botocore.exceptions.ClientError) as e:
            method(Bucket=bucket, Key="c", IfUnmodifiedSince=past)
        assert http_status(e) == 412
        with pytest.raises(botocore.exceptions.ClientError) as e:
            method(Bucket=bucket, Key="c", IfNoneMatch=etag)
        assert http_status(e) == 304
        # A 304 carries the ETag the client compares against (issue 13).
        assert e.value.response["ResponseMetadata"]["HTTPHeaders"].get("etag") == etag
        with pytest.raises(botocore.exceptions.ClientError) as e:
            method(Bucket=bucket, Key="c", IfModifiedSince=future)
        assert http_status(e) == 304


def test_put_if_none_match(s3, bucket):
    # Proves PUT with If-None-Match: * refuses to overwrite (412) and leaves the object alone.
    s3.put_object(Bucket=bucket, Key="once", Body=b"first", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket=bucket, Key="once", Body=b"second", IfNoneMatch="*")
    assert http_status(e) == 412
    assert s3.get_object(Bucket=bucket, Key="once")["Body"].read() == b"first"


def test_delete_objects(s3, bucket):
    # Proves DeleteObjects removes the named keys (missing keys count as deleted) and keeps the rest.
    for i in range(5):
        s3.put_object(Bucket=bucket, Key=f"d/{i}", Body=b"x")
    result = s3.delete_objects(
        Bucket=bucket,
        Delete={"Objects": [{"Key": "d/0"}, {"Key": "d/1"}, {"Key": "missing"}]},
    )
    assert sorted(d["Key"] for d in result["Deleted"]) == ["d/0", "d/1", "missing"]
    quiet = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "d/2"}], "Quiet": True})
    assert not quiet.get("Deleted")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys == ["d/3", "d/4"]


def test_copy_object(s3, bucket):
    # Proves CopyObject copies bytes and metadata (COPY), replaces metadata (REPLACE), honours
    # copy-source conditions, and refuses a copy onto itself without REPLACE.
    data = os.urandom(3 * 1024 * 1024)
    s3.put_object(Bucket=bucket, Key="src", Body=data, ContentType="a/b", Metadata={"k": "v"})
    s3.copy_object(Bucket=bucket, Key="dst", CopySource={"Bucket": bucket, "Key": "src"})
    got = s3.get_object(Bucket=bucket, Key="dst")
    assert got["Body"].read() == data
    assert got["Metadata"] == {"k": "v"} and got["ContentType"] == "a/b"
    s3.copy_object(
        Bucket=bucket, Key="dst2", CopySource={"Bucket": bucket, "Key": "src"},
        MetadataDirective="REPLACE", Metadata={"new": "1"}, ContentType="c/d",
    )
    head = s3.head_object(Bucket=bucket, Key="dst2")
    assert head["Metadata"] == {"new": "1"} and head["ContentType"] == "c/d"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.copy_object(Bucket=bucket, Key="src", CopySource={"Bucket": bucket, "Key": "src"})
    assert http_status(e) == 400
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.copy_object(
            Bucket=bucket, Key="dst3", CopySource={"Bucket": bucket, "Key": "src"},
            CopySourceIfMatch='"nope"',
        )
    assert http_status(e) == 412
    # Deleting the source leaves the copy intact (shared chunks are reference counted).
    s3.delete_object(Bucket=bucket, Key="src")
    assert s3.get_object(Bucket=bucket, Key="dst")["Body"].read() == data
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.copy_object(Bucket=bucket, Key="x", CopySource={"Bucket": bucket, "Key": "src"})
    assert error_code(e) == "NoSuchKey"


def b64(digest):
    return base64.b64encode(digest).decode()


@pytest.mark.parametrize("algorithm", ["CRC32", "CRC32C", "SHA256", "SHA1"])
def test_checksums_stored_and_returned(server, s3, bucket, algorithm):
    # Proves the checksum a client sends is verified, stored and returned (HEAD and GET with
    # ChecksumMode=ENABLED).
    data = os.urandom(2 * 1024 * 1024 + 17)
    put = s3.put_object(Bucket=bucket, Key="ck", Body=data, ChecksumAlgorithm=algorithm)
    field = "Checksum" + algorithm
    assert put[field]
    head = s3.head_object(Bucket=bucket, Key="ck", ChecksumMode="ENABLED")
    assert head[field] == put[field]
    if algorithm == "CRC32":
        assert head[field] == b64(zlib.crc32(data).to_bytes(4, "big"))
    if algorithm == "SHA256":
        assert head[field] == b64(hashlib.sha256(data).digest())
    got = s3.get_object(Bucket=bucket, Key="ck", ChecksumMode="ENABLED")
    assert got["Body"].read() == data
    assert got[field] == put[field]
    # Without x-amz-checksum-mode: ENABLED, AWS sends no checksum headers (issue 13). A client
    # that does not add the mode on its own shows it.
    plain = make_client(server.endpoint, response_checksum_validation="when_required")
    assert field not in plain.head_object(Bucket=bucket, Key="ck")
    unasked = plain.get_object(Bucket=bucket, Key="ck")
    assert field not in unasked
    assert unasked["Body"].read() == data


def test_wrong_checksum_refused(s3, bucket):
    # Proves a body that does not match its declared SHA256 / Content-MD5 is refused (BadDigest)
    # and no object is created.
    wrong = b64(hashlib.sha256(b"something else").digest())
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket=bucket, Key="bad", Body=b"payload", ChecksumSHA256=wrong)
    assert error_code(e) in ("BadDigest", "XAmzContentChecksumMismatch", "InvalidRequest")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket=bucket, Key="bad", Body=b"payload",
                      ContentMD5=b64(hashlib.md5(b"other").digest()))
    assert error_code(e) in ("BadDigest", "InvalidDigest")
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)


@pytest.mark.parametrize("key", ["..", "../x", "a/../b", "./.", "a//b", "/lead", "sp ace", "é🙂", "%2F", "?q=1&x", "a" * 1024])
def test_keys_are_opaque(s3, bucket, key):
    # Proves path-like keys are plain keys: stored, listed and read back under exactly that name.
    s3.put_object(Bucket=bucket, Key=key, Body=key.encode())
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == key.encode()
    listed = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert listed == [key]


def test_bad_keys_refused(s3, bucket):
    # Proves an over-long key (KeyTooLongError) and a key with NUL are refused and create nothing.
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket=bucket, Key="k" * 1025, Body=b"x")
    assert error_code(e) == "KeyTooLongError"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket=bucket, Key="a\x00b", Body=b"x")
    assert http_status(e) == 400
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)


def populate(s3, bucket, keys):
    for key in keys:
        s3.put_object(Bucket=bucket, Key=key, Body=b"x")


KEYS = ["a/1", "a/2", "a/b/3", "b", "b/1", "c", "d/e/f", "d/e/g", "z"]


def test_list_v2_prefix_delimiter(s3, bucket):
    # Proves ListObjectsV2 prefix filtering and delimiter roll-up into CommonPrefixes.
    populate(s3, bucket, KEYS)
    result = s3.list_objects_v2(Bucket=bucket, Delimiter="/")
    assert [o["Key"] for o in result["Contents"]] == ["b", "c", "z"]
    assert [p["Prefix"] for p in result["CommonPrefixes"]] == ["a/", "b/", "d/"]
    result = s3.list_objects_v2(Bucket=bucket, Prefix="a/", Delimiter="/")
    assert [o["Key"] for o in result["Contents"]] == ["a/1", "a/2"]
    assert [p["Prefix"] for p in result["CommonPrefixes"]] == ["a/b/"]
    result = s3.list_objects_v2(Bucket=bucket, Prefix="d/")
    assert [o["Key"] for o in result["Contents"]] == ["d/e/f", "d/e/g"]
    assert result["KeyCount"] == 2
    result = s3.list_objects_v2(Bucket=bucket, StartAfter="c")
    assert [o["Key"] for o in result["Contents"]] == ["d/e/f", "d/e/g", "z"]


def test_listings_echo_a_delimiter_only_when_one_was_sent(s3, bucket):
    # Proves ListObjects (v1 and v2) answers carry a <Delimiter> element only when the request
    # had one, as AWS does (issue 13: an empty element was echoed).
    populate(s3, bucket, ["a/1", "b"])
    bodies = []

    def keep(http_response, **_):
        bodies.append(http_response.content)

    s3.meta.events.register("after-call.s3.ListObjects", keep)
    s3.meta.events.register("after-call.s3.ListObjectsV2", keep)
    try:
        s3.list_objects(Bucket=bucket)
        s3.list_objects_v2(Bucket=bucket)
        s3.list_objects(Bucket=bucket, Delimiter="/")
        s3.list_objects_v2(Bucket=bucket, Delimiter="/")
    finally:
        s3.meta.events.unregister("after-call.s3.ListObjects", keep)
        s3.meta.events.unregister("after-call.s3.ListObjectsV2", keep)
    assert len(bodies) == 4
    for body in bodies[:2]:
        assert b"<Delimiter" not in body, body
    for body in bodies[2:]:
        assert b"<Delimiter>/</Delimiter>" in body, body


@pytest.mark.parametrize("delimiter", [None, "/"])
def test_list_v2_pagination(s3, bucket, delimiter):
    # Proves paging with max-keys and continuation tokens returns every entry exactly once.
    populate(s3, bucket, KEYS)
    seen = []
    token = None
    for _ in range(20):
        kwargs = {"Bucket": bucket, "MaxKeys": 2}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        if token:
            kwargs["ContinuationToken"] = token
        page = s3.list_objects_v2(**kwargs)
        entries = [o["Key"] for o in page.get("Contents", [])] + [p["Prefix"] for p in page.get("CommonPrefixes", [])]
        assert len(entries) <= 2
        seen += entries
        if not page["IsTruncated"]:
            break
        token = page["NextContinuationToken"]
    expected = sorted(KEYS) if not delimiter else sorted(["b", "c", "z", "a/", "b/", "d/"])
    assert sorted(seen) == expected and len(seen) == len(expected)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.list_objects_v2(Bucket=bucket, ContinuationToken="not-a-token!")
    assert error_code(e) == "InvalidArgument"


def test_list_v1_markers(s3, bucket):
    # Proves ListObjects (V1) pages with Marker/NextMarker, and the paginator sees every key.
    populate(s3, bucket, KEYS)
    page = s3.list_objects(Bucket=bucket, MaxKeys=3)
    assert [o["Key"] for o in page["Contents"]] == ["a/1", "a/2", "a/b/3"]
    assert page["IsTruncated"]
    page = s3.list_objects(Bucket=bucket, Marker="a/b/3", MaxKeys=3)
    assert [o["Key"] for o in page["Contents"]] == ["b", "b/1", "c"]
    keys = []
    for page in s3.get_paginator("list_objects").paginate(Bucket=bucket, PaginationConfig={"PageSize": 2}):
        keys += [o["Key"] for o in page.get("Contents", [])]
    assert keys == sorted(KEYS)
    prefixes = []
    for page in s3.get_paginator("list_objects").paginate(Bucket=bucket, Delimiter="/", PaginationConfig={"PageSize": 1}):
        prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
    assert prefixes == ["a/", "b/", "d/"]


def test_list_object_versions_unversioned(s3, bucket):
    # Proves ListObjectVersions answers for an unversioned bucket with version id "null".
    populate(s3, bucket, ["v1", "v2"])
    versions = s3.list_object_versions(Bucket=bucket)["Versions"]
    assert [(v["Key"], v["VersionId"], v["IsLatest"]) for v in versions] == [
        ("v1", "null", True), ("v2", "null", True)]
