"""Object tagging through boto3 and the aws cli: tags set at PUT, multipart creation and copy,
replaced and deleted through the tagging API, counted on GET, kept across a restart; S3's limits
refused with InvalidTag and nothing changed."""

import os
import tempfile
import uuid

import botocore
import pytest

from conftest import aws, error_code, http_status, make_client, require_tool

MIB = 1024 * 1024


def tag_set(s3, bucket, key):
    return {t["Key"]: t["Value"] for t in s3.get_object_tagging(Bucket=bucket, Key=key)["TagSet"]}


def test_tags_set_at_put_replaced_counted_and_deleted(s3, bucket):
    # Proves x-amz-tagging on PUT (URL-encoded pairs), GetObjectTagging, the tag count on GET,
    # PutObjectTagging replacing the whole set without touching the object, and
    # DeleteObjectTagging.
    s3.put_object(Bucket=bucket, Key="doc", Body=b"tagged body", Tagging="project=keel&owner=a%20b%26c")
    assert tag_set(s3, bucket, "doc") == {"project": "keel", "owner": "a b&c"}
    got = s3.get_object(Bucket=bucket, Key="doc")
    assert got["TagCount"] == 2 and got["Body"].read() == b"tagged body"
    before = s3.head_object(Bucket=bucket, Key="doc")

    s3.put_object_tagging(Bucket=bucket, Key="doc",
                          Tagging={"TagSet": [{"Key": "stage", "Value": "done"}]})
    assert tag_set(s3, bucket, "doc") == {"stage": "done"}
    after = s3.head_object(Bucket=bucket, Key="doc")
    assert (after["ETag"], after["LastModified"]) == (before["ETag"], before["LastModified"])
    assert s3.get_object(Bucket=bucket, Key="doc")["Body"].read() == b"tagged body"

    s3.delete_object_tagging(Bucket=bucket, Key="doc")
    assert tag_set(s3, bucket, "doc") == {}
    assert "TagCount" not in s3.get_object(Bucket=bucket, Key="doc")
    # An overwrite without tags has none.
    s3.put_object_tagging(Bucket=bucket, Key="doc", Tagging={"TagSet": [{"Key": "k", "Value": "v"}]})
    s3.put_object(Bucket=bucket, Key="doc", Body=b"new")
    assert tag_set(s3, bucket, "doc") == {}


def test_tags_of_multipart_uploads_and_copies(s3, bucket):
    # Proves tags given at CreateMultipartUpload land on the completed object, and a copy keeps
    # the source's tags (directive COPY, the default) or takes the request's (REPLACE).
    upload = s3.create_multipart_upload(Bucket=bucket, Key="mp", Tagging="kind=multipart")
    part = s3.upload_part(Bucket=bucket, Key="mp", UploadId=upload["UploadId"], PartNumber=1, Body=os.urandom(MIB))
    s3.complete_multipart_upload(Bucket=bucket, Key="mp", UploadId=upload["UploadId"],
                                 MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    assert tag_set(s3, bucket, "mp") == {"kind": "multipart"}

    s3.copy_object(Bucket=bucket, Key="kept", CopySource={"Bucket": bucket, "Key": "mp"})
    assert tag_set(s3, bucket, "kept") == {"kind": "multipart"}
    s3.copy_object(Bucket=bucket, Key="replaced", CopySource={"Bucket": bucket, "Key": "mp"},
                   TaggingDirective="REPLACE", Tagging="kind=copy&n=2")
    assert tag_set(s3, bucket, "replaced") == {"kind": "copy", "n": "2"}


def test_tags_beyond_s3s_limits_are_refused_and_change_nothing(s3, bucket):
    # Proves S3's rules: at most 10 tags, keys of 1 to 128 characters, values of at most 256, a
    # key once (an empty key only through the header: boto3 refuses it itself); each is refused with 400 InvalidTag, by PutObjectTagging (the old tags stay)
    # and by PUT (no object is written); tagging a missing object is NoSuchKey.
    s3.put_object(Bucket=bucket, Key="limits", Body=b"x", Tagging="keep=me")
    eleven = [{"Key": f"k{i}", "Value": "v"} for i in range(11)]
    long_key = [{"Key": "k" * 129, "Value": "v"}]
    long_value = [{"Key": "k", "Value": "v" * 257}]
    twice = [{"Key": "k", "Value": "1"}, {"Key": "k", "Value": "2"}]
    for tags in (eleven, long_key, long_value, twice):
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            s3.put_object_tagging(Bucket=bucket, Key="limits", Tagging={"TagSet": tags})
        assert (http_status(refused), error_code(refused)) == (400, "InvalidTag"), tags
    assert tag_set(s3, bucket, "limits") == {"keep": "me"}
    ten = "&".join(f"k{i}=v" for i in range(10))
    s3.put_object(Bucket=bucket, Key="ten", Body=b"x", Tagging=ten)
    assert len(tag_set(s3, bucket, "ten")) == 10
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        s3.put_object(Bucket=bucket, Key="eleven", Body=b"x", Tagging=ten + "&k10=v")
    assert error_code(refused) == "InvalidTag"
    with pytest.raises(botocore.exceptions.ClientError) as missing:
        s3.head_object(Bucket=bucket, Key="eleven")
    assert http_status(missing) == 404
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        s3.put_object(Bucket=bucket, Key="eleven", Body=b"x", Tagging="=no-key")
    assert error_code(refused) == "InvalidTag"
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        s3.create_multipart_upload(Bucket=bucket, Key="mp", Tagging="a=1&a=2")
    assert error_code(refused) == "InvalidTag"
    with pytest.raises(botocore.exceptions.ClientError) as missing:
        s3.put_object_tagging(Bucket=bucket, Key="absent", Tagging={"TagSet": [{"Key": "k", "Value": "v"}]})
    assert error_code(missing) == "NoSuchKey"


def test_tags_survive_a_restart_and_the_aws_cli_reads_them(fresh_server):
    # Proves tags are stored with the object (durable across a kill -9 once acknowledged) and
    # that the aws cli's s3api tagging commands work against Keel.
    require_tool("aws", "awscli")
    fresh_server.start()
    s3 = make_client(fresh_server.endpoint)
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="small", Body=b"inline", Tagging="size=small")
    s3.put_object(Bucket=bucket, Key="large", Body=os.urandom(3 * MIB))
    s3.put_object_tagging(Bucket=bucket, Key="large", Tagging={"TagSet": [{"Key": "size", "Value": "large"}]})
    fresh_server.kill9()
    fresh_server.start()
    s3 = make_client(fresh_server.endpoint)
    assert tag_set(s3, bucket, "small") == {"size": "small"}
    assert tag_set(s3, bucket, "large") == {"size": "large"}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        put = aws(fresh_server, "s3api", "put-object-tagging", "--bucket", bucket, "--key", "small",
                  "--tagging", "TagSet=[{Key=cli,Value=yes}]", config_dir=tmp)
        assert put.returncode == 0, put.stderr
        got = aws(fresh_server, "s3api", "get-object-tagging", "--bucket", bucket, "--key", "small",
                  "--output", "text", config_dir=tmp)
        assert got.returncode == 0, got.stderr
        assert "cli" in got.stdout and "yes" in got.stdout and "size" not in got.stdout, got.stdout

