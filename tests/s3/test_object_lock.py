"""S3 object lock (issue 13) through boto3: buckets created with object lock, retention in
GOVERNANCE and COMPLIANCE modes, legal holds, the bypass header, default retention (multipart
objects included), and the refusals: deletes of protected versions, shortened retentions, locks
on buckets without object lock, suspending versioning under lock."""

import datetime
import os
import time
import uuid

import botocore
import pytest

from conftest import error_code, http_status

MIB = 1024 * 1024


def locked_bucket(s3):
    name = f"lock-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name, ObjectLockEnabledForBucket=True)
    return name


def in_seconds(seconds):
    return datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)


def refused(call, **kwargs):
    with pytest.raises(botocore.exceptions.ClientError) as error:
        call(**kwargs)
    return error


def test_a_locked_bucket_keeps_versioning_and_says_so(s3):
    # Proves a bucket created with object lock has versioning enabled, reports its lock
    # configuration, refuses to suspend versioning, and that lock can be enabled later only on
    # a bucket whose versioning is enabled.
    bucket = locked_bucket(s3)
    assert s3.get_bucket_versioning(Bucket=bucket)["Status"] == "Enabled"
    config = s3.get_object_lock_configuration(Bucket=bucket)["ObjectLockConfiguration"]
    assert config == {"ObjectLockEnabled": "Enabled"}
    suspend = refused(s3.put_bucket_versioning, Bucket=bucket,
                      VersioningConfiguration={"Status": "Suspended"})
    assert error_code(suspend) == "InvalidBucketState" and http_status(suspend) == 409
    assert s3.get_bucket_versioning(Bucket=bucket)["Status"] == "Enabled"

    plain = f"plain-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=plain)
    missing = refused(s3.get_object_lock_configuration, Bucket=plain)
    assert error_code(missing) == "ObjectLockConfigurationNotFoundError" and http_status(missing) == 404
    enable = {"ObjectLockEnabled": "Enabled"}
    early = refused(s3.put_object_lock_configuration, Bucket=plain, ObjectLockConfiguration=enable)
    assert error_code(early) == "InvalidBucketState"
    # No lock on objects of a bucket without object lock.
    no_lock = refused(s3.put_object, Bucket=plain, Key="k", Body=b"x", ObjectLockMode="GOVERNANCE",
                      ObjectLockRetainUntilDate=in_seconds(60))
    assert error_code(no_lock) == "InvalidRequest" and http_status(no_lock) == 400
    s3.put_bucket_versioning(Bucket=plain, VersioningConfiguration={"Status": "Enabled"})
    s3.put_object_lock_configuration(Bucket=plain, ObjectLockConfiguration=enable)
    assert s3.get_object_lock_configuration(Bucket=plain)["ObjectLockConfiguration"] == enable


def test_governance_retention_yields_only_to_the_bypass(s3):
    # Proves a GOVERNANCE version shows its retention on HEAD, cannot be deleted by id (403,
    # in DeleteObjects too) or have its retention shortened without the bypass header, and can
    # with it; a plain DELETE adds a delete marker and keeps the version.
    bucket = locked_bucket(s3)
    until = in_seconds(3600).replace(microsecond=0)
    version = s3.put_object(Bucket=bucket, Key="k", Body=b"kept", ObjectLockMode="GOVERNANCE",
                            ObjectLockRetainUntilDate=until)["VersionId"]
    head = s3.head_object(Bucket=bucket, Key="k")
    assert head["ObjectLockMode"] == "GOVERNANCE" and head["ObjectLockRetainUntilDate"] == until
    retention = s3.get_object_retention(Bucket=bucket, Key="k", VersionId=version)["Retention"]
    assert retention == {"Mode": "GOVERNANCE", "RetainUntilDate": until}

    denied = refused(s3.delete_object, Bucket=bucket, Key="k", VersionId=version)
    assert error_code(denied) == "AccessDenied" and http_status(denied) == 403
    batch = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "k", "VersionId": version}]})
    assert [e["Code"] for e in batch["Errors"]] == ["AccessDenied"]
    shorter = refused(s3.put_object_retention, Bucket=bucket, Key="k", VersionId=version,
                      Retention={"Mode": "GOVERNANCE", "RetainUntilDate": in_seconds(60)})
    assert error_code(shorter) == "AccessDenied"

    marker = s3.delete_object(Bucket=bucket, Key="k")
    assert marker["DeleteMarker"] is True
    assert s3.get_object(Bucket=bucket, Key="k", VersionId=version)["Body"].read() == b"kept"

    s3.put_object_retention(Bucket=bucket, Key="k", VersionId=version, BypassGovernanceRetention=True,
                            Retention={"Mode": "GOVERNANCE", "RetainUntilDate": in_seconds(60)})
    s3.delete_object(Bucket=bucket, Key="k", VersionId=version, BypassGovernanceRetention=True)
    gone = refused(s3.head_object, Bucket=bucket, Key="k", VersionId=version)
    assert http_status(gone) == 404


def test_compliance_retention_and_legal_hold_block_every_delete(s3):
    # Proves a COMPLIANCE version cannot be deleted or its retention shortened, even with the
    # bypass, until the retention ends; extending it works; a legal hold blocks deletes until
    # it is lifted.
    bucket = locked_bucket(s3)
    version = s3.put_object(Bucket=bucket, Key="k", Body=b"audit", ObjectLockMode="COMPLIANCE",
                            ObjectLockRetainUntilDate=in_seconds(2))["VersionId"]
    for kwargs in ({}, {"BypassGovernanceRetention": True}):
        denied = refused(s3.delete_object, Bucket=bucket, Key="k", VersionId=version, **kwargs)
        assert error_code(denied) == "AccessDenied"
    weaker = refused(s3.put_object_retention, Bucket=bucket, Key="k", VersionId=version,
                     BypassGovernanceRetention=True,
                     Retention={"Mode": "GOVERNANCE", "RetainUntilDate": in_seconds(3600)})
    assert error_code(weaker) == "AccessDenied"
    s3.put_object_retention(Bucket=bucket, Key="k", VersionId=version,
                            Retention={"Mode": "COMPLIANCE", "RetainUntilDate": in_seconds(3)})
    s3.put_object_legal_hold(Bucket=bucket, Key="k", VersionId=version, LegalHold={"Status": "ON"})
    assert s3.get_object_legal_hold(Bucket=bucket, Key="k", VersionId=version)["LegalHold"] == {
        "Status": "ON"}
    assert s3.head_object(Bucket=bucket, Key="k")["ObjectLockLegalHoldStatus"] == "ON"
    time.sleep(3.5)
    # The retention has ended; the legal hold still holds.
    held = refused(s3.delete_object, Bucket=bucket, Key="k", VersionId=version)
    assert error_code(held) == "AccessDenied"
    s3.put_object_legal_hold(Bucket=bucket, Key="k", VersionId=version, LegalHold={"Status": "OFF"})
    s3.delete_object(Bucket=bucket, Key="k", VersionId=version)
    assert "Versions" not in s3.list_object_versions(Bucket=bucket)
    past = refused(s3.put_object, Bucket=bucket, Key="late", Body=b"x", ObjectLockMode="COMPLIANCE",
                   ObjectLockRetainUntilDate=in_seconds(-60))
    assert http_status(past) == 400


def test_default_retention_applies_to_new_versions_and_multipart(s3):
    # Proves a bucket's default retention is stored and read back, applies to a PUT, a copy and
    # a multipart object written without lock headers, and that a multipart upload created
    # with lock headers gets those instead.
    bucket = locked_bucket(s3)
    config = {"ObjectLockEnabled": "Enabled",
              "Rule": {"DefaultRetention": {"Mode": "GOVERNANCE", "Days": 1}}}
    s3.put_object_lock_configuration(Bucket=bucket, ObjectLockConfiguration=config)
    assert s3.get_object_lock_configuration(Bucket=bucket)["ObjectLockConfiguration"] == config
    before = datetime.datetime.now(datetime.timezone.utc)
    s3.put_object(Bucket=bucket, Key="plain", Body=b"x")
    head = s3.head_object(Bucket=bucket, Key="plain")
    assert head["ObjectLockMode"] == "GOVERNANCE"
    day = head["ObjectLockRetainUntilDate"] - before
    assert datetime.timedelta(hours=23, minutes=59) < day < datetime.timedelta(hours=24, minutes=1)
    s3.copy_object(Bucket=bucket, Key="copy", CopySource={"Bucket": bucket, "Key": "plain"})
    assert s3.head_object(Bucket=bucket, Key="copy")["ObjectLockMode"] == "GOVERNANCE"

    part = os.urandom(5 * MIB)
    for key, headers, mode in (("mp-default", {}, "GOVERNANCE"),
                               ("mp-own", {"ObjectLockMode": "COMPLIANCE",
                                           "ObjectLockRetainUntilDate": in_seconds(2)}, "COMPLIANCE")):
        upload = s3.create_multipart_upload(Bucket=bucket, Key=key, **headers)["UploadId"]
        etag = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=part)["ETag"]
        s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={
            "Parts": [{"PartNumber": 1, "ETag": etag}]})
        assert s3.head_object(Bucket=bucket, Key=key)["ObjectLockMode"] == mode, key
    version = s3.head_object(Bucket=bucket, Key="mp-default")["VersionId"]
    denied = refused(s3.delete_object, Bucket=bucket, Key="mp-default", VersionId=version)
    assert error_code(denied) == "AccessDenied"
    bad = refused(s3.put_object_lock_configuration, Bucket=bucket, ObjectLockConfiguration={
        "ObjectLockEnabled": "Enabled",
        "Rule": {"DefaultRetention": {"Mode": "GOVERNANCE", "Days": 1, "Years": 1}}})
    assert http_status(bad) == 400
