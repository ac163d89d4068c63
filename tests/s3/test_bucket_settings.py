"""Bucket tagging and CORS through boto3, the aws cli and plain HTTP (a browser's preflight
carries no signature): set, read back, replaced, deleted, kept across a kill -9, refused when
invalid, dropped with the bucket; preflights answered by the first matching rule and refused
for other origins, methods and headers; allowed origins get the Access-Control-* headers on
real answers."""

import json
import tempfile
import uuid

import botocore
import pytest
import requests

from conftest import aws, error_code, http_status, make_client, require_tool

CORS = {
    "CORSRules": [
        {"ID": "app", "AllowedOrigins": ["https://app.example.com"], "AllowedMethods": ["GET", "PUT"],
         "AllowedHeaders": ["Content-*", "x-amz-*"], "ExposeHeaders": ["ETag"], "MaxAgeSeconds": 600},
        {"AllowedOrigins": ["https://*.cdn.example.net"], "AllowedMethods": ["GET"]},
    ]
}


def bucket_tags(s3, bucket):
    return {t["Key"]: t["Value"] for t in s3.get_bucket_tagging(Bucket=bucket)["TagSet"]}


def preflight(endpoint, path, origin, method, headers=None):
    asked = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers:
        asked["Access-Control-Request-Headers"] = headers
    return requests.options(f"{endpoint}{path}", headers=asked, timeout=30)


def test_bucket_tags_are_set_replaced_and_deleted(s3, bucket):
    # Proves PutBucketTagging, GetBucketTagging (NoSuchTagSet before and after), replacing the
    # whole set, DeleteBucketTagging, and that bucket tags are not object tags.
    with pytest.raises(botocore.exceptions.ClientError) as none:
        s3.get_bucket_tagging(Bucket=bucket)
    assert error_code(none) == "NoSuchTagSet" and http_status(none) == 404
    s3.put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": [{"Key": "team", "Value": "db"},
                                                             {"Key": "cost-center", "Value": "42"}]})
    assert bucket_tags(s3, bucket) == {"team": "db", "cost-center": "42"}
    s3.put_object(Bucket=bucket, Key="obj", Body=b"x")
    assert s3.get_object_tagging(Bucket=bucket, Key="obj")["TagSet"] == []
    s3.put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": [{"Key": "team", "Value": "web"}]})
    assert bucket_tags(s3, bucket) == {"team": "web"}
    s3.delete_bucket_tagging(Bucket=bucket)
    with pytest.raises(botocore.exceptions.ClientError) as gone:
        s3.get_bucket_tagging(Bucket=bucket)
    assert error_code(gone) == "NoSuchTagSet"


def test_invalid_bucket_tags_are_refused_and_change_nothing(s3, bucket):
    # Proves S3's limits on bucket tags (50 tags, keys of 1 to 128 characters, values of at most
    # 256, each key once) are refused with InvalidTag, leaving the tags as they were.
    s3.put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": [{"Key": "keep", "Value": "me"}]})
    fifty = [{"Key": f"k{i}", "Value": "v"} for i in range(50)]
    s3.put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": fifty})
    assert len(bucket_tags(s3, bucket)) == 50
    s3.put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": [{"Key": "keep", "Value": "me"}]})
    for bad in ([{"Key": f"k{i}", "Value": "v"} for i in range(51)],
                [{"Key": "k" * 129, "Value": "v"}],
                [{"Key": "k", "Value": "v" * 257}],
                [{"Key": "twice", "Value": "1"}, {"Key": "twice", "Value": "2"}]):
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            s3.put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": bad})
        assert error_code(refused) == "InvalidTag", bad[:2]
        assert bucket_tags(s3, bucket) == {"keep": "me"}


def test_cors_rules_are_stored_replaced_and_deleted(s3, bucket):
    # Proves PutBucketCors and GetBucketCors round-trip every field, NoSuchCORSConfiguration
    # before and after DeleteBucketCors, and invalid rules refused without changing the stored
    # ones.
    with pytest.raises(botocore.exceptions.ClientError) as none:
        s3.get_bucket_cors(Bucket=bucket)
    assert error_code(none) == "NoSuchCORSConfiguration" and http_status(none) == 404
    s3.put_bucket_cors(Bucket=bucket, CORSConfiguration=CORS)
    assert s3.get_bucket_cors(Bucket=bucket)["CORSRules"] == CORS["CORSRules"]
    for bad in ({"AllowedOrigins": ["*"], "AllowedMethods": ["PATCH"]},
                {"AllowedOrigins": ["https://*.*.example.com"], "AllowedMethods": ["GET"]}):
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            s3.put_bucket_cors(Bucket=bucket, CORSConfiguration={"CORSRules": [bad]})
        assert http_status(refused) == 400, bad
    assert s3.get_bucket_cors(Bucket=bucket)["CORSRules"] == CORS["CORSRules"]
    s3.delete_bucket_cors(Bucket=bucket)
    with pytest.raises(botocore.exceptions.ClientError) as gone:
        s3.get_bucket_cors(Bucket=bucket)
    assert error_code(gone) == "NoSuchCORSConfiguration"


def test_preflights_follow_the_buckets_rules(server, s3, bucket):
    # Proves a preflight (unsigned OPTIONS) is refused (403) while the bucket has no rules and
    # for an origin, method or header no rule allows; answered 200 with what the first matching
    # rule allows otherwise; and a request without Origin is a 400.
    path = f"/{bucket}/photo.jpg"
    denied = preflight(server.endpoint, path, "https://app.example.com", "GET")
    assert denied.status_code == 403 and "CORS is not enabled" in denied.text
    s3.put_bucket_cors(Bucket=bucket, CORSConfiguration=CORS)

    ok = preflight(server.endpoint, path, "https://app.example.com", "PUT", "content-type, X-Amz-Date")
    assert ok.status_code == 200, ok.text
    assert ok.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
    assert ok.headers["Access-Control-Allow-Methods"] == "GET, PUT"
    assert ok.headers["Access-Control-Allow-Headers"] == "content-type, X-Amz-Date"
    assert ok.headers["Access-Control-Expose-Headers"] == "ETag"
    assert ok.headers["Access-Control-Max-Age"] == "600"
    assert "Origin" in ok.headers["Vary"]

    cdn = preflight(server.endpoint, path, "https://eu.cdn.example.net", "GET")
    assert cdn.status_code == 200 and cdn.headers["Access-Control-Allow-Origin"] == "https://eu.cdn.example.net"

    for origin, method, headers in (("https://evil.example.org", "GET", None),
                                    ("https://eu.cdn.example.net", "PUT", None),
                                    ("https://app.example.com", "DELETE", None),
                                    ("https://app.example.com", "PUT", "authorization")):
        refused = preflight(server.endpoint, path, origin, method, headers)
        assert refused.status_code == 403, (origin, method, headers)
        assert "Access-Control-Allow-Origin" not in refused.headers
    bad = requests.options(f"{server.endpoint}{path}", timeout=30)
    assert bad.status_code == 400


def test_allowed_origins_get_cors_headers_on_real_answers(s3, bucket):
    # Proves a signed request carrying an allowed Origin gets Access-Control-Allow-Origin on its
    # answer, and one from another origin (or another method) does not, while it is served the
    # same either way.
    s3.put_bucket_cors(Bucket=bucket, CORSConfiguration=CORS)
    s3.put_object(Bucket=bucket, Key="page.html", Body=b"<p>hi</p>")

    def get_with_origin(origin):
        def add_origin(request, **_):
            request.headers["Origin"] = origin
        s3.meta.events.register_first("before-sign.s3.GetObject", add_origin)
        try:
            return s3.get_object(Bucket=bucket, Key="page.html")
        finally:
            s3.meta.events.unregister("before-sign.s3.GetObject", add_origin)

    allowed = get_with_origin("https://app.example.com")
    headers = allowed["ResponseMetadata"]["HTTPHeaders"]
    assert allowed["Body"].read() == b"<p>hi</p>"
    assert headers["access-control-allow-origin"] == "https://app.example.com"
    assert headers["access-control-expose-headers"] == "ETag"
    other = get_with_origin("https://evil.example.org")
    assert other["Body"].read() == b"<p>hi</p>"
    assert "access-control-allow-origin" not in other["ResponseMetadata"]["HTTPHeaders"]


def test_bucket_settings_survive_a_kill_and_go_with_the_bucket(fresh_server):
    # Proves tags and CORS rules are durable once acknowledged (kill -9, restart), that the aws
    # cli reads and writes them, and that deleting the bucket drops them (a new bucket of the
    # same name starts without).
    require_tool("aws", "awscli")
    fresh_server.start()
    s3 = make_client(fresh_server.endpoint)
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": [{"Key": "team", "Value": "db"}]})
    s3.put_bucket_cors(Bucket=bucket, CORSConfiguration=CORS)
    fresh_server.kill9()
    fresh_server.start()
    s3 = make_client(fresh_server.endpoint)
    assert bucket_tags(s3, bucket) == {"team": "db"}
    assert s3.get_bucket_cors(Bucket=bucket)["CORSRules"] == CORS["CORSRules"]
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        def s3api(*args):
            done = aws(fresh_server, "s3api", *args, "--bucket", bucket, config_dir=tmp)
            assert done.returncode == 0, done.stderr
            return done.stdout

        s3api("put-bucket-tagging", "--tagging", "TagSet=[{Key=cli,Value=yes}]")
        assert json.loads(s3api("get-bucket-tagging"))["TagSet"] == [{"Key": "cli", "Value": "yes"}]
        rules = json.loads(s3api("get-bucket-cors"))["CORSRules"]
        assert [rule["AllowedOrigins"] for rule in rules] == [["https://app.example.com"],
                                                              ["https://*.cdn.example.net"]]
    s3.delete_bucket(Bucket=bucket)
    s3.create_bucket(Bucket=bucket)
    with pytest.raises(botocore.exceptions.ClientError) as tags:
        s3.get_bucket_tagging(Bucket=bucket)
    assert error_code(tags) == "NoSuchTagSet"
    with pytest.raises(botocore.exceptions.ClientError) as cors:
        s3.get_bucket_cors(Bucket=bucket)
    assert error_code(cors) == "NoSuchCORSConfiguration"


def test_a_public_read_bucket_serves_anonymous_reads_and_nothing_else(server, s3, bucket):
    # Proves the canned ACLs: unsigned requests are refused on a private bucket; after
    # PutBucketAcl public-read, an unsigned boto3 client lists the bucket and reads (GET, HEAD)
    # its objects, but cannot write, delete, read the ACL or list buckets; GetBucketAcl and
    # GetObjectAcl show the AllUsers READ grant; back to private, anonymous reads are refused
    # again; CreateBucket with public-read starts public; other canned ACLs are NotImplemented.
    from botocore import UNSIGNED

    anonymous = make_client(server.endpoint, signature_version=UNSIGNED)
    s3.put_object(Bucket=bucket, Key="site/index.html", Body=b"<h1>public</h1>")

    def refused(call, **kwargs):
        with pytest.raises(botocore.exceptions.ClientError) as denied:
            call(**kwargs)
        assert http_status(denied) == 403, call
        return denied

    refused(anonymous.get_object, Bucket=bucket, Key="site/index.html")
    refused(anonymous.list_objects_v2, Bucket=bucket)
    assert [g["Permission"] for g in s3.get_bucket_acl(Bucket=bucket)["Grants"]] == ["FULL_CONTROL"]

    s3.put_bucket_acl(Bucket=bucket, ACL="public-read")
    assert anonymous.get_object(Bucket=bucket, Key="site/index.html")["Body"].read() == b"<h1>public</h1>"
    assert anonymous.head_object(Bucket=bucket, Key="site/index.html")["ContentLength"] == 15
    listed = anonymous.list_objects_v2(Bucket=bucket, Prefix="site/")
    assert [o["Key"] for o in listed["Contents"]] == ["site/index.html"]
    assert anonymous.list_objects(Bucket=bucket)["Contents"][0]["Key"] == "site/index.html"
    plain = requests.get(f"{server.endpoint}/{bucket}/site/index.html", timeout=30)
    assert plain.status_code == 200 and plain.content == b"<h1>public</h1>"
    refused(anonymous.put_object, Bucket=bucket, Key="site/evil.html", Body=b"x")
    refused(anonymous.delete_object, Bucket=bucket, Key="site/index.html")
    refused(anonymous.get_bucket_acl, Bucket=bucket)
    refused(anonymous.put_bucket_acl, Bucket=bucket, ACL="private")
    refused(anonymous.list_buckets)
    assert s3.head_object(Bucket=bucket, Key="site/index.html")["ContentLength"] == 15
    grants = s3.get_bucket_acl(Bucket=bucket)["Grants"]
    assert {(g["Grantee"]["Type"], g["Permission"]) for g in grants} == {("CanonicalUser", "FULL_CONTROL"),
                                                                        ("Group", "READ")}
    assert any(g["Grantee"].get("URI") == "http://acs.amazonaws.com/groups/global/AllUsers" for g in grants)
    assert len(s3.get_object_acl(Bucket=bucket, Key="site/index.html")["Grants"]) == 2

    s3.put_bucket_acl(Bucket=bucket, ACL="private")
    refused(anonymous.get_object, Bucket=bucket, Key="site/index.html")
    with pytest.raises(botocore.exceptions.ClientError) as unsupported:
        s3.put_bucket_acl(Bucket=bucket, ACL="public-read-write")
    assert http_status(unsupported) == 501

    public = f"t-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=public, ACL="public-read")
    s3.put_object(Bucket=public, Key="a", Body=b"open")
    assert anonymous.get_object(Bucket=public, Key="a")["Body"].read() == b"open"
    s3.delete_object(Bucket=public, Key="a")
    s3.delete_bucket(Bucket=public)


def test_a_public_read_object_is_readable_in_a_private_bucket(server, s3, bucket):
    # Proves per-object canned ACLs: an object put (or completed, as multipart) with
    # x-amz-acl public-read is readable unsigned in a private bucket while its neighbours and
    # the listing are not; PutObjectAcl turns it private and public again; GetObjectAcl shows
    # the AllUsers READ grant; a copy does not inherit the ACL; unsupported canned ACLs are
    # NotImplemented.
    from botocore import UNSIGNED

    anonymous = make_client(server.endpoint, signature_version=UNSIGNED)
    s3.put_object(Bucket=bucket, Key="open.txt", Body=b"open", ACL="public-read")
    s3.put_object(Bucket=bucket, Key="closed.txt", Body=b"closed")

    def refused(call, **kwargs):
        with pytest.raises(botocore.exceptions.ClientError) as denied:
            call(**kwargs)
        assert http_status(denied) == 403, call

    assert anonymous.get_object(Bucket=bucket, Key="open.txt")["Body"].read() == b"open"
    assert anonymous.head_object(Bucket=bucket, Key="open.txt")["ContentLength"] == 4
    refused(anonymous.get_object, Bucket=bucket, Key="closed.txt")
    refused(anonymous.list_objects_v2, Bucket=bucket)
    refused(anonymous.put_object, Bucket=bucket, Key="open.txt", Body=b"overwritten")
    assert len(s3.get_object_acl(Bucket=bucket, Key="open.txt")["Grants"]) == 2
    assert len(s3.get_object_acl(Bucket=bucket, Key="closed.txt")["Grants"]) == 1

    s3.put_object_acl(Bucket=bucket, Key="open.txt", ACL="private")
    refused(anonymous.get_object, Bucket=bucket, Key="open.txt")
    s3.put_object_acl(Bucket=bucket, Key="closed.txt", ACL="public-read")
    assert anonymous.get_object(Bucket=bucket, Key="closed.txt")["Body"].read() == b"closed"
    s3.copy_object(Bucket=bucket, Key="copy.txt", CopySource={"Bucket": bucket, "Key": "closed.txt"})
    refused(anonymous.get_object, Bucket=bucket, Key="copy.txt")

    upload = s3.create_multipart_upload(Bucket=bucket, Key="big.bin", ACL="public-read")["UploadId"]
    etag = s3.upload_part(Bucket=bucket, Key="big.bin", UploadId=upload, PartNumber=1,
                          Body=b"p" * 100)["ETag"]
    s3.complete_multipart_upload(Bucket=bucket, Key="big.bin", UploadId=upload, MultipartUpload={
        "Parts": [{"PartNumber": 1, "ETag": etag}]})
    assert anonymous.get_object(Bucket=bucket, Key="big.bin")["Body"].read() == b"p" * 100
    with pytest.raises(botocore.exceptions.ClientError) as unsupported:
        s3.put_object(Bucket=bucket, Key="x", Body=b"x", ACL="authenticated-read")
    assert http_status(unsupported) == 501
    for key in ("open.txt", "closed.txt", "copy.txt", "big.bin"):
        s3.delete_object(Bucket=bucket, Key=key)
