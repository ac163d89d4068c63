"""Bucket operations through boto3: create, list, head, location, versioning, delete, errors."""

import uuid

import botocore
import pytest

from conftest import error_code, http_status


def test_create_list_head_location_delete(s3):
    # Proves the bucket lifecycle: a created bucket is listed, answers HEAD, location and
    # versioning (unversioned), and is gone after delete.
    name = f"life-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=name)
    assert name in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    s3.head_bucket(Bucket=name)
    assert s3.get_bucket_location(Bucket=name).get("LocationConstraint") in (None, "")
    assert "Status" not in s3.get_bucket_versioning(Bucket=name)
    s3.delete_bucket(Bucket=name)
    assert name not in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_bucket(Bucket=name)
    assert http_status(e) == 404


def test_create_twice_is_already_owned(s3, bucket):
    # Proves re-creating your own bucket answers BucketAlreadyOwnedByYou (409).
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.create_bucket(Bucket=bucket)
    assert error_code(e) == "BucketAlreadyOwnedByYou"
    assert http_status(e) == 409


def test_delete_non_empty_bucket_refused(s3, bucket):
    # Proves a bucket holding an object cannot be deleted, and still holds the object after.
    s3.put_object(Bucket=bucket, Key="k", Body=b"v")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.delete_bucket(Bucket=bucket)
    assert error_code(e) == "BucketNotEmpty"
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"


def test_missing_bucket_errors(s3):
    # Proves operations on a bucket that does not exist answer NoSuchBucket.
    for call in (
        lambda: s3.delete_bucket(Bucket="no-such-bucket-x"),
        lambda: s3.list_objects_v2(Bucket="no-such-bucket-x"),
        lambda: s3.put_object(Bucket="no-such-bucket-x", Key="k", Body=b"v"),
        lambda: s3.get_object(Bucket="no-such-bucket-x", Key="k"),
    ):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            call()
        assert error_code(e) == "NoSuchBucket"


@pytest.mark.parametrize("name", ["ab", "Upper-Case", "under_score", "a..b", "192.168.0.1"])
def test_invalid_bucket_names_refused(s3, name):
    # Proves invalid bucket names are refused with InvalidBucketName and create nothing.
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.create_bucket(Bucket=name)
    assert error_code(e) in ("InvalidBucketName", "InvalidRequest")
    assert name not in [b["Name"] for b in s3.list_buckets()["Buckets"]]


def test_list_buckets_pages_with_max_buckets_and_continuation_token(s3):
    # Proves ListBuckets pagination (issue 13): max-buckets pages, the continuation token resumes
    # after the last bucket of a page, the prefix filters and is echoed, the last page has no token.
    prefix = f"pg-{uuid.uuid4().hex[:8]}-"
    names = [f"{prefix}{i}" for i in range(5)]
    for name in names:
        s3.create_bucket(Bucket=name)
    try:
        seen, token, pages = [], None, 0
        while True:
            kwargs = {"Prefix": prefix, "MaxBuckets": 2}
            if token:
                kwargs["ContinuationToken"] = token
            page = s3.list_buckets(**kwargs)
            pages += 1
            assert page["Prefix"] == prefix
            assert len(page["Buckets"]) <= 2
            seen += [b["Name"] for b in page["Buckets"]]
            token = page.get("ContinuationToken")
            if not token:
                break
        assert (seen, pages) == (names, 3)
        assert [b["Name"] for b in s3.list_buckets(Prefix=prefix)["Buckets"]] == names
    finally:
        for name in names:
            s3.delete_bucket(Bucket=name)


def test_expected_bucket_owner_is_checked(s3):
    # Proves ExpectedBucketOwner (issue 13): the owner id ListBuckets reports passes on bucket and
    # object requests; any other id is refused with 403 AccessDenied and changes nothing.
    name = f"owner-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=name)
    try:
        owner = s3.list_buckets()["Owner"]["ID"]
        s3.head_bucket(Bucket=name, ExpectedBucketOwner=owner)
        s3.put_object(Bucket=name, Key="k", Body=b"v1", ExpectedBucketOwner=owner)
        assert s3.get_object(Bucket=name, Key="k", ExpectedBucketOwner=owner)["Body"].read() == b"v1"
        with pytest.raises(botocore.exceptions.ClientError) as e:
            s3.put_object(Bucket=name, Key="k", Body=b"v2", ExpectedBucketOwner="111122223333")
        assert error_code(e) == "AccessDenied" and http_status(e) == 403
        with pytest.raises(botocore.exceptions.ClientError) as e:
            s3.list_objects_v2(Bucket=name, ExpectedBucketOwner=owner + "x")
        assert error_code(e) == "AccessDenied"
        assert s3.get_object(Bucket=name, Key="k")["Body"].read() == b"v1"
        # The copy source's owner (ExpectedSourceBucketOwner), on CopyObject and UploadPartCopy.
        source = {"Bucket": name, "Key": "k"}
        s3.copy_object(Bucket=name, Key="copy", CopySource=source, ExpectedSourceBucketOwner=owner)
        with pytest.raises(botocore.exceptions.ClientError) as e:
            s3.copy_object(Bucket=name, Key="stolen", CopySource=source, ExpectedSourceBucketOwner="111122223333")
        assert error_code(e) == "AccessDenied" and http_status(e) == 403
        upload = s3.create_multipart_upload(Bucket=name, Key="parts")["UploadId"]
        try:
            with pytest.raises(botocore.exceptions.ClientError) as e:
                s3.upload_part_copy(Bucket=name, Key="parts", UploadId=upload, PartNumber=1, CopySource=source,
                                    ExpectedSourceBucketOwner="111122223333")
            assert error_code(e) == "AccessDenied"
        finally:
            s3.abort_multipart_upload(Bucket=name, Key="parts", UploadId=upload)
        assert "stolen" not in [o["Key"] for o in s3.list_objects_v2(Bucket=name)["Contents"]]
    finally:
        for key in ("k", "copy"):
            s3.delete_object(Bucket=name, Key=key)
        s3.delete_bucket(Bucket=name)
