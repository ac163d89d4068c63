"""Bucket lifecycle rules (issue 13) through boto3: stored and read back,
refused when Keel cannot apply them, and applied by a pass run through the admin API as of a
moved clock (`as_of_unix_ms`, accepted only from a server started with --debug-faults): objects
under an expiring prefix go once they are old enough and only then, others stay, disabled rules
do nothing, incomplete uploads past their age are aborted."""

import os
import time
import uuid

import botocore
import pytest
import requests

from conftest import Server, error_code, http_status, make_client, new_data_dir

DAY_MS = 86_400_000

RULES = [
    {"ID": "logs", "Status": "Enabled", "Filter": {"Prefix": "logs/"}, "Expiration": {"Days": 30}},
    {"ID": "uploads", "Status": "Enabled", "Filter": {"Prefix": "tmp/"},
     "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 7}},
    {"ID": "off", "Status": "Disabled", "Filter": {"Prefix": "keep/"}, "Expiration": {"Days": 1}},
]


@pytest.fixture
def debug_server():
    srv = Server(new_data_dir("lifecycle"), extra_args=["--debug-faults"]).start()
    yield srv
    srv.stop()
    srv.cleanup()


def run_pass(server, as_of_unix_ms=None):
    token = open(os.path.join(server.data_dir, "admin-token")).read().strip()
    body = {} if as_of_unix_ms is None else {"as_of_unix_ms": as_of_unix_ms}
    return requests.post(f"http://127.0.0.1:{server.admin_port}/api/v1/s3/lifecycle", json=body,
                         headers={"Authorization": f"Bearer {token}"}, timeout=60)


def keys(s3, bucket):
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []))


def test_lifecycle_rules_expire_objects_and_abort_uploads_when_due(debug_server):
    s3 = make_client(debug_server.endpoint)
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    with pytest.raises(botocore.exceptions.ClientError) as none:
        s3.get_bucket_lifecycle_configuration(Bucket=bucket)
    assert error_code(none) == "NoSuchLifecycleConfiguration" and http_status(none) == 404
    s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": RULES})
    stored = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    assert [(r["ID"], r["Status"], r["Filter"]["Prefix"]) for r in stored] == \
        [("logs", "Enabled", "logs/"), ("uploads", "Enabled", "tmp/"), ("off", "Disabled", "keep/")]
    assert stored[0]["Expiration"] == {"Days": 30}
    assert stored[1]["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 7}

    for key in ("logs/2026/a.log", "logs/b.log", "other/c.txt", "keep/d.txt"):
        s3.put_object(Bucket=bucket, Key=key, Body=key.encode())
    stale = s3.create_multipart_upload(Bucket=bucket, Key="tmp/big.bin")["UploadId"]
    elsewhere = s3.create_multipart_upload(Bucket=bucket, Key="other/big.bin")["UploadId"]
    now = int(time.time() * 1000)

    early = run_pass(debug_server, now + 6 * DAY_MS)
    assert early.status_code == 200 and early.json()["objects_expired"] == 0, early.text
    assert early.json()["uploads_aborted"] == 0
    assert keys(s3, bucket) == ["keep/d.txt", "logs/2026/a.log", "logs/b.log", "other/c.txt"]

    week = run_pass(debug_server, now + 8 * DAY_MS).json()
    assert week == {"as_of_unix_ms": now + 8 * DAY_MS, "objects_expired": 0, "uploads_aborted": 1,
                    "versions_expired": 0, "delete_markers_removed": 0}
    uploads = [u["UploadId"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
    assert uploads == [elsewhere] and stale not in uploads

    month = run_pass(debug_server, now + 31 * DAY_MS).json()
    assert month["objects_expired"] == 2, month
    assert keys(s3, bucket) == ["keep/d.txt", "other/c.txt"]
    # Written again: an object's age counts from its last write.
    rewritten = int(time.time() * 1000)
    s3.put_object(Bucket=bucket, Key="logs/b.log", Body=b"new")
    assert run_pass(debug_server, rewritten + 29 * DAY_MS).json()["objects_expired"] == 0
    assert keys(s3, bucket) == ["keep/d.txt", "logs/b.log", "other/c.txt"]
    assert run_pass(debug_server, rewritten + 31 * DAY_MS).json()["objects_expired"] == 1
    # A pass as of now (what the hourly worker does) expires nothing young.
    s3.put_object(Bucket=bucket, Key="logs/young.log", Body=b"young")
    assert run_pass(debug_server).json()["objects_expired"] == 0
    assert "logs/young.log" in keys(s3, bucket)

    # /metrics counts what the passes did (3 objects, 1 upload) and when the last one ran.
    metrics = requests.get(f"http://127.0.0.1:{debug_server.admin_port}/metrics", timeout=30).text
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines()
                  if line.startswith("keel_s3_lifecycle_"))
    assert float(values["keel_s3_lifecycle_objects_expired_total"]) == 3, values
    assert float(values["keel_s3_lifecycle_uploads_aborted_total"]) == 1, values
    assert float(values["keel_s3_lifecycle_passes_failed_total"]) == 0, values
    assert abs(float(values["keel_s3_lifecycle_last_pass_timestamp_seconds"]) - time.time()) < 60, values

    s3.abort_multipart_upload(Bucket=bucket, Key="other/big.bin", UploadId=elsewhere)
    s3.delete_bucket_lifecycle(Bucket=bucket)
    with pytest.raises(botocore.exceptions.ClientError) as gone:
        s3.get_bucket_lifecycle_configuration(Bucket=bucket)
    assert error_code(gone) == "NoSuchLifecycleConfiguration"
    assert run_pass(debug_server, now + 400 * DAY_MS).json()["objects_expired"] == 0


def test_rules_keel_cannot_apply_are_refused(s3, bucket, server):
    # Proves rules keeping a count of versions, transitions or tag filters answer NotImplemented, invalid
    # ones 400, nothing is stored either way, and a server without --debug-faults refuses a
    # pass as of another time.
    for rule, status in (
        ({"ID": "v", "Status": "Enabled", "Filter": {"Prefix": ""},
          "NoncurrentVersionExpiration": {"NoncurrentDays": 3, "NewerNoncurrentVersions": 2}}, 501),
        ({"ID": "m", "Status": "Enabled", "Filter": {"Prefix": ""},
          "Expiration": {"Days": 3, "ExpiredObjectDeleteMarker": True}}, 400),
        ({"ID": "t", "Status": "Enabled", "Filter": {"Prefix": ""},
          "Transitions": [{"Days": 3, "StorageClass": "GLACIER"}]}, 501),
        ({"ID": "tag", "Status": "Enabled", "Filter": {"Tag": {"Key": "k", "Value": "v"}},
          "Expiration": {"Days": 3}}, 501),
        ({"ID": "zero", "Status": "Enabled", "Filter": {"Prefix": ""}, "Expiration": {"Days": 0}}, 400),
        ({"ID": "none", "Status": "Enabled", "Filter": {"Prefix": ""}}, 400),
    ):
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [rule]})
        assert http_status(refused) == status, rule["ID"]
    with pytest.raises(botocore.exceptions.ClientError) as none:
        s3.get_bucket_lifecycle_configuration(Bucket=bucket)
    assert error_code(none) == "NoSuchLifecycleConfiguration"
    refused = run_pass(server, int(time.time() * 1000) + 365 * DAY_MS)
    assert refused.status_code == 400 and "--debug-faults" in refused.text
