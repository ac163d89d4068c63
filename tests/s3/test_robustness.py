"""Malformed requests get clear S3 errors and change nothing: bad XML, oversized part lists,
bad headers, body/length mismatches. Requests are signed with botocore's SigV4 signer and sent
raw, so the malformed part reaches the server as written."""

import hashlib
import os
import http.client
import pytest
import requests
from botocore.auth import S3SigV4Auth, SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from conftest import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY


def signed(server, method, path, body=b"", headers=None):
    request = AWSRequest(method=method, url=server.endpoint + path, data=body, headers=headers or {})
    request.headers["x-amz-content-sha256"] = hashlib.sha256(body).hexdigest()
    S3SigV4Auth(Credentials(ACCESS_KEY_ID, SECRET_ACCESS_KEY), "s3", REGION).add_auth(request)
    prepared = request.prepare()
    return requests.request(method, prepared.url, headers=dict(prepared.headers), data=body, timeout=30)


def raw_signed_get(server, path):
    """A signed GET of exactly `path` (no client-side normalisation); returns (status, body)."""
    request = AWSRequest(method="GET", url=server.endpoint + path, data=b"")
    request.headers["x-amz-content-sha256"] = hashlib.sha256(b"").hexdigest()
    S3SigV4Auth(Credentials(ACCESS_KEY_ID, SECRET_ACCESS_KEY), "s3", REGION).add_auth(request)
    host = server.endpoint.split("://", 1)[1]
    connection = http.client.HTTPConnection(host, timeout=30)
    try:
        connection.putrequest("GET", path, skip_accept_encoding=True)
        for name, value in request.headers.items():
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_malformed_delete_objects_xml(server, s3, bucket):
    # Proves a DeleteObjects body that is not the expected XML answers 400 MalformedXML and
    # deletes nothing.
    s3.put_object(Bucket=bucket, Key="keep", Body=b"x")
    for body in (b"<Delete><Object><Key>keep", b"not xml at all", b"<Wrong/>"):
        md5 = __import__("base64").b64encode(hashlib.md5(body).digest()).decode()
        response = signed(server, "POST", f"/{bucket}?delete", body, {"Content-MD5": md5})
        assert response.status_code == 400, response.content
        assert b"MalformedXML" in response.content or b"InvalidRequest" in response.content
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]] == ["keep"]


def test_malformed_and_oversized_complete_xml(server, s3, bucket):
    # Proves CompleteMultipartUpload with broken XML or with more than 10 000 parts is refused
    # with a 400 and leaves the upload in place.
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key="mp")["UploadId"]
    etag = s3.upload_part(Bucket=bucket, Key="mp", UploadId=upload_id, PartNumber=1, Body=b"p")["ETag"]
    broken = b"<CompleteMultipartUpload><Part><PartNumber>1</PartNumber>"
    response = signed(server, "POST", f"/{bucket}/mp?uploadId={upload_id}", broken)
    assert response.status_code == 400 and b"MalformedXML" in response.content
    parts = b"".join(
        b"<Part><PartNumber>%d</PartNumber><ETag>%s</ETag></Part>" % (n, etag.encode())
        for n in range(1, 10003))
    oversized = b"<CompleteMultipartUpload>" + parts + b"</CompleteMultipartUpload>"
    response = signed(server, "POST", f"/{bucket}/mp?uploadId={upload_id}", oversized)
    assert response.status_code == 400, response.content
    assert s3.list_parts(Bucket=bucket, Key="mp", UploadId=upload_id)["Parts"][0]["ETag"] == etag
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)


def test_bad_headers(server, s3, bucket):
    # Proves requests with invalid headers are refused with a 4xx and store nothing: a bad
    # x-amz-date, a bad Content-MD5, a bad part number, a body shorter than Content-Length.
    response = signed(server, "PUT", f"/{bucket}/h", b"data", {"Content-MD5": "not base64!"})
    assert 400 <= response.status_code < 500
    request = AWSRequest(method="PUT", url=f"{server.endpoint}/{bucket}/h2", data=b"data")
    request.headers["x-amz-content-sha256"] = hashlib.sha256(b"data").hexdigest()
    S3SigV4Auth(Credentials(ACCESS_KEY_ID, SECRET_ACCESS_KEY), "s3", REGION).add_auth(request)
    prepared = request.prepare()
    headers = dict(prepared.headers)
    headers["X-Amz-Date"] = "yesterday"
    response = requests.put(prepared.url, headers=headers, data=b"data", timeout=10)
    assert 400 <= response.status_code < 500
    response = signed(server, "PUT", f"/{bucket}/h3?partNumber=0&uploadId=abc", b"data")
    assert 400 <= response.status_code < 500
    # The body sent is not the body signed (same length, different bytes).
    request = AWSRequest(method="PUT", url=f"{server.endpoint}/{bucket}/h4", data=b"data")
    S3SigV4Auth(Credentials(ACCESS_KEY_ID, SECRET_ACCESS_KEY), "s3", REGION).add_auth(request)
    prepared = request.prepare()
    assert prepared.headers["X-Amz-Content-SHA256"] == hashlib.sha256(b"data").hexdigest()
    response = requests.put(prepared.url, headers=dict(prepared.headers), data=b"datX", timeout=10)
    assert 400 <= response.status_code < 500
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)


def test_path_tricks_in_urls(server, s3, bucket):
    # Proves dot segments and encoded slashes in the URL are part of the key, never a path
    # outside the bucket: `..` objects live in this bucket and nothing else changed.
    s3.put_object(Bucket=bucket, Key="../escape", Body=b"inside")
    s3.put_object(Bucket=bucket, Key="a/%2e%2e/b", Body=b"literal")
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == ["../escape", "a/%2e%2e/b"]
    assert s3.get_object(Bucket=bucket, Key="../escape")["Body"].read() == b"inside"
    # A request path with a dot segment is not resolved against the bucket: it names the key.
    # Sent byte for byte (http.client; requests/urllib3 would remove the dot segment), so the
    # server sees `a/../escape` and must not serve the object `escape` nor `../escape`.
    s3.put_object(Bucket=bucket, Key="escape", Body=b"outside")
    status, content = raw_signed_get(server, f"/{bucket}/a/../escape")
    assert status == 404, content
    assert b"<Code>NoSuchKey</Code>" in content, content
    assert b"inside" not in content and b"outside" not in content


def chunked_put(server, path, pieces, signed_body):
    """A header-signed PUT whose body goes out with Transfer-Encoding: chunked and no
    Content-Length (as `requests` sends a generator); the signature covers the hash of
    `signed_body`, or with None an unsigned payload."""
    credentials = Credentials(ACCESS_KEY_ID, SECRET_ACCESS_KEY)
    if signed_body is None:
        # SigV4Auth keeps the header; S3SigV4Auth would replace it with the hash of no body.
        request = AWSRequest(method="PUT", url=server.endpoint + path,
                             headers={"x-amz-content-sha256": "UNSIGNED-PAYLOAD"})
        SigV4Auth(credentials, "s3", REGION).add_auth(request)
    else:
        request = AWSRequest(method="PUT", url=server.endpoint + path, data=signed_body)
        S3SigV4Auth(credentials, "s3", REGION).add_auth(request)
    headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
    return requests.put(server.endpoint + path, headers=headers, data=iter(pieces), timeout=60)


def test_a_chunked_put_without_content_length_is_stored(server, s3, bucket):
    # Proves a PUT streamed with Transfer-Encoding: chunked and no Content-Length is accepted
    # as AWS accepts it (s3s alone answers 411), with an unsigned payload and with a signed
    # payload hash, stored byte for byte; a wrong payload hash is refused and stores nothing;
    # the spool leaves no file behind.
    pieces = [bytes([i]) * (300 * 1024 + i) for i in range(10)]  # ~3 MiB in uneven pieces
    body = b"".join(pieces)
    answer = chunked_put(server, f"/{bucket}/unsigned", pieces, None)
    assert answer.status_code == 200, answer.text
    assert s3.get_object(Bucket=bucket, Key="unsigned")["Body"].read() == body
    answer = chunked_put(server, f"/{bucket}/signed", pieces, body)
    assert answer.status_code == 200, answer.text
    head = s3.head_object(Bucket=bucket, Key="signed")
    assert head["ContentLength"] == len(body)
    wrong = chunked_put(server, f"/{bucket}/wrong", pieces, b"other bytes")
    assert wrong.status_code == 400, wrong.text
    with pytest.raises(Exception):
        s3.head_object(Bucket=bucket, Key="wrong")
    spool = os.path.join(server.data_dir, "s3-spool")
    assert os.listdir(spool) == []
