"""S3 versioning (issue 13) with boto3, the aws cli and rclone: every write of a versioned bucket
keeps a version readable by its id, deletes add delete markers, versions are removed only by id,
ListObjectVersions pages through all of them, suspended buckets replace the `null` version, and
lifecycle rules expire noncurrent versions and lone delete markers as of a moved clock."""

import hashlib
import os
import random
import threading
import time
import uuid

import botocore
import pytest
import requests

from conftest import aws, error_code, http_status, make_client, require_tool
from test_clients import rclone
from test_lifecycle import DAY_MS, debug_server, run_pass  # noqa: F401 (a fixture)

MIB = 1024 * 1024


def versioned_bucket(s3, status="Enabled"):
    name = f"v-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": status})
    return name


def all_versions(s3, bucket, **kwargs):
    """(key, version id, is latest, is delete marker) in listing order, through every page."""
    out = []
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket, **kwargs):
        entries = [(v["Key"], v["VersionId"], v["IsLatest"], False) for v in page.get("Versions", [])]
        entries += [(m["Key"], m["VersionId"], m["IsLatest"], True)
                    for m in page.get("DeleteMarkers", [])]
        # boto3 splits versions and markers: put them back in order, by key, the latest first,
        # then newest first (Keel's ids are 16 hex digits that grow with time).
        out += sorted(entries, key=lambda e: (e[0], not e[2], [-ord(c) for c in e[1]]))
    return out


def empty_bucket(s3, bucket):
    for key, version, _, _ in all_versions(s3, bucket):
        s3.delete_object(Bucket=bucket, Key=key, VersionId=version)
    s3.delete_bucket(Bucket=bucket)


def test_versions_are_kept_read_by_id_and_deletes_add_markers(s3):
    # Proves PUT answers a version id, GET/HEAD read any version by id, a plain DELETE adds a
    # delete marker (GET then answers 404 with x-amz-delete-marker, GET of the marker 405), and
    # deleting the marker by id brings the object back; a bucket holding versions cannot be
    # deleted until every version is removed by id.
    bucket = versioned_bucket(s3)
    assert s3.get_bucket_versioning(Bucket=bucket)["Status"] == "Enabled"
    one, two = os.urandom(1000), os.urandom(3 * MIB + 5)
    v1 = s3.put_object(Bucket=bucket, Key="doc", Body=one)["VersionId"]
    v2 = s3.put_object(Bucket=bucket, Key="doc", Body=two)["VersionId"]
    assert v1 != v2 and "null" not in (v1, v2)
    current = s3.get_object(Bucket=bucket, Key="doc")
    assert current["VersionId"] == v2 and current["Body"].read() == two
    old = s3.get_object(Bucket=bucket, Key="doc", VersionId=v1)
    assert old["VersionId"] == v1 and old["Body"].read() == one
    assert s3.head_object(Bucket=bucket, Key="doc", VersionId=v1)["ContentLength"] == 1000

    deleted = s3.delete_object(Bucket=bucket, Key="doc")
    assert deleted["DeleteMarker"] is True
    marker = deleted["VersionId"]
    with pytest.raises(botocore.exceptions.ClientError) as gone:
        s3.get_object(Bucket=bucket, Key="doc")
    assert error_code(gone) == "NoSuchKey" and http_status(gone) == 404
    headers = gone.value.response["ResponseMetadata"]["HTTPHeaders"]
    assert headers.get("x-amz-delete-marker") == "true" and headers.get("x-amz-version-id") == marker
    with pytest.raises(botocore.exceptions.ClientError) as on_marker:
        s3.get_object(Bucket=bucket, Key="doc", VersionId=marker)
    assert http_status(on_marker) == 405
    assert s3.get_object(Bucket=bucket, Key="doc", VersionId=v2)["Body"].read() == two
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)
    assert all_versions(s3, bucket) == [
        ("doc", marker, True, True), ("doc", v2, False, False), ("doc", v1, False, False)]
    with pytest.raises(botocore.exceptions.ClientError) as not_empty:
        s3.delete_bucket(Bucket=bucket)
    assert error_code(not_empty) == "BucketNotEmpty"

    undeleted = s3.delete_object(Bucket=bucket, Key="doc", VersionId=marker)
    assert undeleted["VersionId"] == marker and undeleted["DeleteMarker"] is True
    assert s3.get_object(Bucket=bucket, Key="doc")["Body"].read() == two
    # Removing the current version by id makes the previous one current.
    s3.delete_object(Bucket=bucket, Key="doc", VersionId=v2)
    assert s3.get_object(Bucket=bucket, Key="doc")["Body"].read() == one
    with pytest.raises(botocore.exceptions.ClientError) as removed:
        s3.get_object(Bucket=bucket, Key="doc", VersionId=v2)
    assert error_code(removed) == "NoSuchVersion" and http_status(removed) == 404
    empty_bucket(s3, bucket)


def test_copies_tags_multipart_and_batch_deletes_name_versions(s3):
    # Proves CopyObject copies the version named (CopySourceVersionId) into a new version,
    # tagging applies to the version named only, CompleteMultipartUpload answers a version id,
    # and DeleteObjects removes versions by id and adds markers for keys named without one.
    bucket = versioned_bucket(s3)
    v1 = s3.put_object(Bucket=bucket, Key="src", Body=b"first")["VersionId"]
    s3.put_object(Bucket=bucket, Key="src", Body=b"second")
    copied = s3.copy_object(Bucket=bucket, Key="dst",
                            CopySource={"Bucket": bucket, "Key": "src", "VersionId": v1})
    assert copied["CopySourceVersionId"] == v1 and copied["VersionId"]
    assert s3.get_object(Bucket=bucket, Key="dst")["Body"].read() == b"first"

    s3.put_object_tagging(Bucket=bucket, Key="src", VersionId=v1,
                          Tagging={"TagSet": [{"Key": "era", "Value": "old"}]})
    assert s3.get_object_tagging(Bucket=bucket, Key="src", VersionId=v1)["TagSet"] == [
        {"Key": "era", "Value": "old"}]
    assert s3.get_object_tagging(Bucket=bucket, Key="src")["TagSet"] == []

    upload = s3.create_multipart_upload(Bucket=bucket, Key="big")["UploadId"]
    part = os.urandom(5 * MIB)
    etag = s3.upload_part(Bucket=bucket, Key="big", UploadId=upload, PartNumber=1, Body=part)["ETag"]
    done = s3.complete_multipart_upload(Bucket=bucket, Key="big", UploadId=upload, MultipartUpload={
        "Parts": [{"PartNumber": 1, "ETag": etag}]})
    assert done["VersionId"] and done["VersionId"] != "null"
    assert s3.head_object(Bucket=bucket, Key="big")["VersionId"] == done["VersionId"]

    answer = s3.delete_objects(Bucket=bucket, Delete={"Objects": [
        {"Key": "src", "VersionId": v1}, {"Key": "dst"}]})
    deleted = {(d["Key"], d.get("VersionId"), d.get("DeleteMarker")) for d in answer["Deleted"]}
    assert ("src", v1, None) in deleted and ("dst", None, True) in deleted
    marker = next(d["DeleteMarkerVersionId"] for d in answer["Deleted"] if d["Key"] == "dst")
    listed = all_versions(s3, bucket)
    assert ("dst", marker, True, True) in listed
    assert not any(key == "src" and version == v1 for key, version, _, _ in listed)
    empty_bucket(s3, bucket)


def test_suspended_versioning_replaces_the_null_version(s3):
    # Proves an object written before versioning is the `null` version and is kept when
    # versioning is enabled; once suspended, writes replace the `null` version and keep the
    # others, and a delete leaves a `null` delete marker.
    bucket = f"v-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="k", Body=b"before")
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    kept = s3.put_object(Bucket=bucket, Key="k", Body=b"enabled")["VersionId"]
    assert s3.get_object(Bucket=bucket, Key="k", VersionId="null")["Body"].read() == b"before"
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Suspended"})
    assert s3.get_bucket_versioning(Bucket=bucket)["Status"] == "Suspended"
    assert s3.put_object(Bucket=bucket, Key="k", Body=b"suspended")["VersionId"] == "null"
    assert s3.get_object(Bucket=bucket, Key="k", VersionId="null")["Body"].read() == b"suspended"
    assert all_versions(s3, bucket) == [("k", "null", True, False), ("k", kept, False, False)]
    deleted = s3.delete_object(Bucket=bucket, Key="k")
    assert deleted["DeleteMarker"] is True and deleted["VersionId"] == "null"
    assert all_versions(s3, bucket) == [("k", "null", True, True), ("k", kept, False, False)]
    assert s3.get_object(Bucket=bucket, Key="k", VersionId=kept)["Body"].read() == b"enabled"
    empty_bucket(s3, bucket)


def test_bad_version_requests_are_refused(s3):
    # Proves malformed version ids, unknown versions, invalid versioning configurations, MFA
    # delete and a version-id-marker without a key-marker get clear errors and change nothing.
    bucket = versioned_bucket(s3)
    s3.put_object(Bucket=bucket, Key="k", Body=b"x")
    for bad in ("../../etc", "0123", "zzzzzzzzzzzzzzzz"):
        with pytest.raises(botocore.exceptions.ClientError) as malformed:
            s3.get_object(Bucket=bucket, Key="k", VersionId=bad)
        assert error_code(malformed) == "InvalidArgument" and http_status(malformed) == 400, bad
    with pytest.raises(botocore.exceptions.ClientError) as unknown:
        s3.head_object(Bucket=bucket, Key="k", VersionId="00000000000000aa")
    assert http_status(unknown) == 404
    with pytest.raises(botocore.exceptions.ClientError) as mfa:
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={
            "Status": "Enabled", "MFADelete": "Enabled"})
    assert http_status(mfa) == 501
    with pytest.raises(botocore.exceptions.ClientError) as marker:
        s3.list_object_versions(Bucket=bucket, VersionIdMarker="null")
    assert error_code(marker) == "InvalidArgument"
    assert s3.get_bucket_versioning(Bucket=bucket)["Status"] == "Enabled"
    assert len(all_versions(s3, bucket)) == 1
    empty_bucket(s3, bucket)


def test_version_listing_pages_through_every_version(s3):
    # Proves ListObjectVersions pages (100 per page) through 260 versions and delete markers of
    # 30 keys exactly once each, in key order and newest first, with only the newest latest,
    # and that a delimiter rolls keys up into common prefixes.
    bucket = versioned_bucket(s3)
    expected = []
    for k in range(30):
        key = f"dir{k % 3}/key{k:02d}"
        ids = [s3.put_object(Bucket=bucket, Key=key, Body=b"v%d" % i)["VersionId"]
               for i in range(8)]
        markers = []
        if k % 5 == 0:
            markers = [s3.delete_object(Bucket=bucket, Key=key)["VersionId"]]
        newest_first = list(reversed(ids + markers))
        expected += [(key, vid, n == 0, vid in markers) for n, vid in enumerate(newest_first)]
    expected.sort(key=lambda e: e[0])
    assert len(expected) == 246
    listed = all_versions(s3, bucket, PaginationConfig={"PageSize": 100})
    assert listed == expected
    rolled = s3.list_object_versions(Bucket=bucket, Delimiter="/")
    assert [p["Prefix"] for p in rolled["CommonPrefixes"]] == ["dir0/", "dir1/", "dir2/"]
    assert "Versions" not in rolled


def test_aws_cli_and_rclone_see_versions(server, s3, tmp_path):
    # Proves the aws cli enables versioning, overwrites and reads an old version by id, and
    # that rclone syncs into a versioned bucket with every overwritten and deleted file kept
    # as an old version (`--s3-versions` lists them).
    require_tool("rclone", "rclone")
    bucket = f"v-{uuid.uuid4().hex[:12]}"
    config_dir = str(tmp_path)
    assert aws(server, "s3", "mb", f"s3://{bucket}", config_dir=config_dir).returncode == 0
    result = aws(server, "s3api", "put-bucket-versioning", "--bucket", bucket,
                 "--versioning-configuration", "Status=Enabled", config_dir=config_dir)
    assert result.returncode == 0, result.stderr
    src = tmp_path / "file.txt"
    for text in ("one", "two"):
        src.write_text(text)
        assert aws(server, "s3", "cp", str(src), f"s3://{bucket}/file.txt",
                   config_dir=config_dir).returncode == 0
    listing = aws(server, "s3api", "list-object-versions", "--bucket", bucket,
                  "--query", "Versions[?IsLatest==`false`].VersionId", "--output", "text",
                  config_dir=config_dir)
    assert listing.returncode == 0, listing.stderr
    old_id = listing.stdout.strip()
    assert len(old_id) == 16, listing.stdout
    out = tmp_path / "old.txt"
    got = aws(server, "s3api", "get-object", "--bucket", bucket, "--key", "file.txt",
              "--version-id", old_id, str(out), config_dir=config_dir)
    assert got.returncode == 0, got.stderr
    assert out.read_text() == "one"

    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (tree / name).write_text(f"{name} v1")
    assert rclone(server, "sync", str(tree), f"keel:{bucket}/tree").returncode == 0
    (tree / "a.txt").write_text("a.txt v2")
    (tree / "c.txt").unlink()
    result = rclone(server, "sync", str(tree), f"keel:{bucket}/tree")
    assert result.returncode == 0, result.stderr
    current = sorted(rclone(server, "lsf", f"keel:{bucket}/tree").stdout.split())
    assert current == ["a.txt", "b.txt"]
    with_versions = rclone(server, "lsf", "--s3-versions", f"keel:{bucket}/tree")
    assert with_versions.returncode == 0, with_versions.stderr
    names = sorted(with_versions.stdout.split())
    # Current files plus a.txt's and c.txt's old versions (rclone suffixes them -v<time>).
    assert len(names) == 4 and sum(n.startswith("a-v") for n in names) == 1, names
    assert sum(n.startswith("c-v") for n in names) == 1, names
    # Restoring with versions brings every old version back with its bytes.
    restored = tmp_path / "restored"
    result = rclone(server, "copy", "--s3-versions", f"keel:{bucket}/tree", str(restored))
    assert result.returncode == 0, result.stderr
    contents = {p.name.split("-v")[0]: p.read_text() for p in restored.iterdir() if "-v" in p.name}
    assert contents == {"a": "a.txt v1", "c": "c.txt v1"}, contents
    assert (restored / "a.txt").read_text() == "a.txt v2"
    empty_bucket(s3, bucket)


def test_lifecycle_expires_noncurrent_versions_and_lone_markers(debug_server):
    # Proves NoncurrentVersionExpiration and ExpiredObjectDeleteMarker are stored, read back
    # and applied by a pass as of a moved clock: a noncurrent version goes once it has been
    # noncurrent long enough, the current one stays, and a delete marker with nothing behind
    # it is removed; /metrics counts both.
    s3 = make_client(debug_server.endpoint)
    bucket = versioned_bucket(s3)
    rules = [{"ID": "old", "Status": "Enabled", "Filter": {"Prefix": ""},
              "NoncurrentVersionExpiration": {"NoncurrentDays": 3},
              "Expiration": {"ExpiredObjectDeleteMarker": True}}]
    s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": rules})
    stored = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"][0]
    assert stored["NoncurrentVersionExpiration"] == {"NoncurrentDays": 3}
    assert stored["Expiration"] == {"ExpiredObjectDeleteMarker": True}
    old = s3.put_object(Bucket=bucket, Key="k", Body=b"old")["VersionId"]
    new = s3.put_object(Bucket=bucket, Key="k", Body=b"new")["VersionId"]
    s3.put_object(Bucket=bucket, Key="gone", Body=b"x")
    s3.delete_object(Bucket=bucket, Key="gone")
    now = int(time.time() * 1000)
    early = run_pass(debug_server, now + 2 * DAY_MS).json()
    assert early["versions_expired"] == 0 and early["delete_markers_removed"] == 0, early
    due = run_pass(debug_server, now + 4 * DAY_MS).json()
    # k's old version and gone's only version went; gone's marker is removed by the next pass.
    assert due["versions_expired"] == 2, due
    after = run_pass(debug_server, now + 4 * DAY_MS).json()
    assert after["delete_markers_removed"] == 1, after
    assert all_versions(s3, bucket) == [("k", new, True, False)]
    with pytest.raises(botocore.exceptions.ClientError):
        s3.get_object(Bucket=bucket, Key="k", VersionId=old)
    # `keel bucket info` (the admin API) counts the versions kept besides the current ones.
    token = open(os.path.join(debug_server.data_dir, "admin-token")).read().strip()
    info = requests.get(f"http://127.0.0.1:{debug_server.admin_port}/api/v1/buckets/{bucket}",
                        headers={"Authorization": f"Bearer {token}"}, timeout=30).json()
    assert (info["versioning"], info["objects"], info["kept_versions"]) == ("enabled", 1, 0), info
    assert info["object_lock"] is False and info["policy"] is False, info
    metrics = requests.get(
        f"http://127.0.0.1:{debug_server.admin_port}/metrics", timeout=30).text
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines()
                  if line.startswith("keel_s3_lifecycle_"))
    assert float(values["keel_s3_lifecycle_versions_expired_total"]) == 2, values
    assert float(values["keel_s3_lifecycle_delete_markers_removed_total"]) == 1, values


def test_acknowledged_versions_and_markers_survive_kill9(fresh_server):
    # Proves every version and delete marker acknowledged before kill -9 (while overwrites and
    # deletes of the same keys were in flight) is listed after restart, each version with its
    # bytes, and no version or marker appears that was never acknowledged or in flight.
    fresh_server.start()
    s3 = make_client(fresh_server.endpoint)
    bucket = versioned_bucket(s3)
    acknowledged = {}  # version id -> (key, md5 or None for a marker)
    attempted = set()  # keys written or deleted, acknowledged or not
    lock = threading.Lock()
    stop = time.time() + 3.0

    def writer(index):
        client = make_client(fresh_server.endpoint)
        rng = random.Random(index)
        while time.time() < stop:
            key = f"k{rng.randrange(8)}"
            with lock:
                attempted.add(key)
            try:
                if rng.random() < 0.25:
                    version = client.delete_object(Bucket=bucket, Key=key)["VersionId"]
                    entry = (key, None)
                else:
                    data = os.urandom(rng.choice([100, 5000, 70000, 1100000]))
                    version = client.put_object(Bucket=bucket, Key=key, Body=data)["VersionId"]
                    entry = (key, hashlib.md5(data).hexdigest())
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                return
            with lock:
                acknowledged[version] = entry

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(2.5)
    fresh_server.kill9()
    for t in threads:
        t.join(timeout=60)
    assert len(acknowledged) > 20, "too few acknowledged writes to prove anything"

    fresh_server.start()
    s3 = make_client(fresh_server.endpoint)
    listed = {version: (key, marker) for key, version, _, marker in all_versions(s3, bucket)}
    for version, (key, md5) in acknowledged.items():
        assert version in listed, f"acknowledged version {version} of {key} is gone"
        assert listed[version] == (key, md5 is None)
        if md5 is not None:
            body = s3.get_object(Bucket=bucket, Key=key, VersionId=version)["Body"].read()
            assert hashlib.md5(body).hexdigest() == md5, (key, version)
    # At most one unacknowledged write per writer was in flight at the kill.
    unknown = set(listed) - set(acknowledged)
    assert len(unknown) <= len(threads), unknown
    assert all(listed[v][0] in attempted for v in unknown)
    # Each key's newest listed version is what a plain GET answers.
    for key in {k for k, _ in listed.values()}:
        newest = next(e for e in all_versions(s3, bucket, Prefix=key) if e[0] == key)
        if newest[3]:
            with pytest.raises(botocore.exceptions.ClientError) as deleted:
                s3.get_object(Bucket=bucket, Key=key)
            assert error_code(deleted) == "NoSuchKey"
        else:
            assert s3.get_object(Bucket=bucket, Key=key)["VersionId"] == newest[1]
