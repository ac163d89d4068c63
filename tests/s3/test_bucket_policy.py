"""Bucket policies (issue 13) through boto3 with three access keys and anonymous clients: a
policy opens reads of a prefix to everyone, grants another key read-only access (by key id or
user ARN, with an `s3:prefix` condition on listings), denies what the owner could otherwise do,
and `aws:SecureTransport` denies plain HTTP; a key the policy does not name stays refused,
malformed or unsupported policies are refused with MalformedPolicy, and the owner can always
remove a policy that locks everyone out."""

import json
import subprocess
import uuid

import botocore
import pytest
from botocore import UNSIGNED

from conftest import KEEL_BIN, error_code, http_status, make_client


def create_key(server, name):
    created = subprocess.run(
        [KEEL_BIN, "key", "create", name, "--admin", f"127.0.0.1:{server.admin_port}",
         "--token-dir", server.data_dir], capture_output=True, text=True, check=True).stdout
    values = dict(line.split("=", 1) for line in created.split())
    return make_client(server.endpoint, values["AWS_ACCESS_KEY_ID"], values["AWS_SECRET_ACCESS_KEY"])


def denied(call, **kwargs):
    with pytest.raises(botocore.exceptions.ClientError) as error:
        call(**kwargs)
    assert error_code(error) == "AccessDenied" and http_status(error) == 403, error.value
    return error


def put_policy(s3, bucket, *statements):
    document = json.dumps({"Version": "2012-10-17", "Statement": list(statements)})
    s3.put_bucket_policy(Bucket=bucket, Policy=document)
    return document


@pytest.fixture
def owned(two_key_server):
    owner = make_client(two_key_server.endpoint)
    bucket = f"pol-{uuid.uuid4().hex[:12]}"
    owner.create_bucket(Bucket=bucket)
    for key in ("public/a.txt", "private/b.txt", "logs/2026/c.log"):
        owner.put_object(Bucket=bucket, Key=key, Body=key.encode())
    return owner, bucket


def test_a_policy_opens_a_prefix_to_anonymous_reads_only(two_key_server, owned):
    # Proves an Allow for Principal "*" on bucket/public/* lets unsigned clients read those
    # objects and nothing else (other prefixes, writes, listings stay refused), the policy reads
    # back as given, and deleting it closes the bucket again.
    owner, bucket = owned
    anonymous = make_client(two_key_server.endpoint, signature_version=UNSIGNED)
    denied(anonymous.get_object, Bucket=bucket, Key="public/a.txt")
    document = put_policy(owner, bucket, {
        "Sid": "PublicRead", "Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
        "Resource": f"arn:aws:s3:::{bucket}/public/*"})
    assert owner.get_bucket_policy(Bucket=bucket)["Policy"] == document
    assert owner.get_bucket_policy_status(Bucket=bucket)["PolicyStatus"] == {"IsPublic": True}
    assert anonymous.get_object(Bucket=bucket, Key="public/a.txt")["Body"].read() == b"public/a.txt"
    denied(anonymous.get_object, Bucket=bucket, Key="private/b.txt")
    denied(anonymous.put_object, Bucket=bucket, Key="public/new.txt", Body=b"x")
    denied(anonymous.list_objects_v2, Bucket=bucket)
    owner.delete_bucket_policy(Bucket=bucket)
    with pytest.raises(botocore.exceptions.ClientError) as none:
        owner.get_bucket_policy(Bucket=bucket)
    assert error_code(none) == "NoSuchBucketPolicy"
    denied(anonymous.get_object, Bucket=bucket, Key="public/a.txt")


def test_a_policy_grants_another_key_read_only_and_no_one_else(two_key_server, owned):
    # Proves a policy naming one key (by id and by user ARN) lets it read and list under a
    # prefix, while its writes, listings of other prefixes, and every request of a key the
    # policy does not name are refused.
    owner, bucket = owned
    other = make_client(two_key_server.endpoint, two_key_server.other_key_id,
                        two_key_server.other_secret)
    stranger = create_key(two_key_server, f"stranger-{uuid.uuid4().hex[:6]}")
    denied(other.get_object, Bucket=bucket, Key="logs/2026/c.log")
    put_policy(owner, bucket, {
        "Effect": "Allow", "Principal": {"AWS": [two_key_server.other_key_id]},
        "Action": ["s3:GetObject"], "Resource": f"arn:aws:s3:::{bucket}/*"}, {
        "Effect": "Allow",
        "Principal": {"AWS": f"arn:aws:iam::000000000000:user/{two_key_server.other_key_id}"},
        "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}",
        "Condition": {"StringLike": {"s3:prefix": "logs/*"}}})
    assert other.get_object(Bucket=bucket, Key="private/b.txt")["Body"].read() == b"private/b.txt"
    assert owner.get_bucket_policy_status(Bucket=bucket)["PolicyStatus"] == {"IsPublic": False}
    listed = other.list_objects_v2(Bucket=bucket, Prefix="logs/")
    assert [o["Key"] for o in listed["Contents"]] == ["logs/2026/c.log"]
    denied(other.list_objects_v2, Bucket=bucket, Prefix="private/")
    denied(other.put_object, Bucket=bucket, Key="logs/new.log", Body=b"x")
    denied(other.delete_object, Bucket=bucket, Key="private/b.txt")
    denied(other.put_bucket_policy, Bucket=bucket, Policy=json.dumps({"Statement": {
        "Effect": "Allow", "Principal": "*", "Action": "s3:*", "Resource": f"arn:aws:s3:::{bucket}/*"}}))
    denied(stranger.get_object, Bucket=bucket, Key="private/b.txt")
    denied(stranger.list_objects_v2, Bucket=bucket, Prefix="logs/")


def test_a_deny_binds_the_owner_but_never_locks_it_out_of_the_policy(owned):
    # Proves an explicit Deny refuses the owner's deletes, a Deny on aws:SecureTransport false
    # refuses every plain-HTTP request, and the owner can still read and delete the policy.
    owner, bucket = owned
    put_policy(owner, bucket, {
        "Effect": "Deny", "Principal": "*", "Action": "s3:DeleteObject",
        "Resource": f"arn:aws:s3:::{bucket}/*"})
    denied(owner.delete_object, Bucket=bucket, Key="private/b.txt")
    assert owner.get_object(Bucket=bucket, Key="private/b.txt")["Body"].read() == b"private/b.txt"
    put_policy(owner, bucket, {
        "Sid": "TLSOnly", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
        "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
        "Condition": {"Bool": {"aws:SecureTransport": "false"}}})
    denied(owner.get_object, Bucket=bucket, Key="public/a.txt")
    denied(owner.list_objects_v2, Bucket=bucket)
    assert "TLSOnly" in owner.get_bucket_policy(Bucket=bucket)["Policy"]
    owner.delete_bucket_policy(Bucket=bucket)
    assert owner.get_object(Bucket=bucket, Key="public/a.txt")["Body"].read() == b"public/a.txt"


def test_malformed_and_unsupported_policies_are_refused(owned):
    # Proves invalid JSON, unknown effects, NotPrincipal, non-S3 actions, resources of another
    # bucket and unsupported conditions answer 400 MalformedPolicy and store nothing.
    owner, bucket = owned
    statement = {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
                 "Resource": f"arn:aws:s3:::{bucket}/*"}
    for bad in ("{not json", json.dumps({"Statement": [dict(statement, Effect="Perhaps")]}),
                json.dumps({"Statement": [{k: v for k, v in statement.items() if k != "Principal"}
                                          | {"NotPrincipal": "*"}]}),
                json.dumps({"Statement": [dict(statement, Action="ec2:RunInstances")]}),
                json.dumps({"Statement": [dict(statement, Resource="arn:aws:s3:::elsewhere/*")]}),
                json.dumps({"Statement": [dict(statement, Condition={
                    "IpAddress": {"aws:SourceIp": "10.0.0.0/8"}})]})):
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            owner.put_bucket_policy(Bucket=bucket, Policy=bad)
        assert error_code(refused) == "MalformedPolicy" and http_status(refused) == 400, bad
    with pytest.raises(botocore.exceptions.ClientError) as none:
        owner.get_bucket_policy(Bucket=bucket)
    assert error_code(none) == "NoSuchBucketPolicy"
