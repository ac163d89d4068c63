"""Browser-form POST uploads (issue 13) with a policy signed by boto3's generate_presigned_post,
sent the way a browser sends the form (requests, multipart/form-data, no Authorization header):
stored like a PUT; success_action_status and success_action_redirect answered as S3 does; an
expired policy, a tampered signature, a field outside the policy's conditions, a file outside
its content-length-range or over Keel's limit refused with nothing stored; ${filename} in a
key replaced by the uploaded file's name."""

import base64
import concurrent.futures
import datetime
import json
import uuid

import requests

from conftest import make_client

MIB = 1024 * 1024
POST_FILE_SIZE_MAX_BYTES = 32 * MIB  # crates/frontend-s3/src/lib.rs


def post(server, form, body, filename="upload.bin"):
    return requests.post(f"{server.endpoint}/{form['bucket']}", data=form["fields"],
                         files={"file": (filename, body)}, timeout=300)


def presigned(s3, bucket, key, fields=None, conditions=None, expires=300):
    form = s3.generate_presigned_post(bucket, key, Fields=fields, Conditions=conditions, ExpiresIn=expires)
    form["bucket"] = bucket
    return form


def test_a_signed_form_upload_is_stored_like_a_put(server, s3, bucket):
    # Proves the happy path: the file is stored under the form's key with its Content-Type,
    # the default answer is 204, success_action_status 201 answers XML naming the object, and
    # success_action_redirect answers 303 to the URL with bucket, key and ETag.
    form = presigned(s3, bucket, "avatars/me.png", fields={"Content-Type": "image/png"},
                     conditions=[{"Content-Type": "image/png"}, ["content-length-range", 1, 1 * MIB]])
    answer = post(server, form, b"\x89PNG fake image")
    assert answer.status_code == 204, answer.text
    got = s3.get_object(Bucket=bucket, Key="avatars/me.png")
    assert got["Body"].read() == b"\x89PNG fake image" and got["ContentType"] == "image/png"

    form = presigned(s3, bucket, "docs/report.txt", fields={"success_action_status": "201"},
                     conditions=[["starts-with", "$key", "docs/"], {"success_action_status": "201"}])
    answer = post(server, form, b"report body", filename="report.txt")
    assert answer.status_code == 201, answer.text
    assert "<Key>docs/report.txt</Key>" in answer.text and f"<Bucket>{bucket}</Bucket>" in answer.text
    assert s3.get_object(Bucket=bucket, Key="docs/report.txt")["Body"].read() == b"report body"

    redirect = "https://app.example.com/done"
    form = presigned(s3, bucket, "r.txt", fields={"success_action_redirect": redirect},
                     conditions=[{"success_action_redirect": redirect}])
    answer = requests.post(f"{server.endpoint}/{bucket}", data=form["fields"], files={"file": ("r.txt", b"r")},
                           allow_redirects=False, timeout=60)
    assert answer.status_code == 303, answer.text
    assert answer.headers["Location"].startswith(redirect + "?") and "key=r.txt" in answer.headers["Location"]


def test_forms_outside_their_policy_are_refused_and_store_nothing(server, s3, bucket):
    # Proves the refusals: an expired policy, a signature that does not match the policy, a key
    # outside the policy's starts-with, a file above the content-length-range, and a file above
    # Keel's in-memory limit; none of them stores anything.
    expired = presigned(s3, bucket, "expired.txt", expires=-60)
    answer = post(server, expired, b"late")
    assert answer.status_code == 403 and "expired" in answer.text.lower(), answer.text

    tampered = presigned(s3, bucket, "tampered.txt")
    policy = json.loads(base64.b64decode(tampered["fields"]["policy"]))
    policy["expiration"] = (datetime.datetime.now(datetime.timezone.utc)
                            + datetime.timedelta(days=365)).strftime("%Y-%m-%dT%H:%M:%SZ")
    tampered["fields"]["policy"] = base64.b64encode(json.dumps(policy).encode()).decode()
    answer = post(server, tampered, b"forged")
    assert answer.status_code == 403, answer.text

    outside = presigned(s3, bucket, "docs/ok.txt", conditions=[["starts-with", "$key", "docs/"]])
    outside["fields"]["key"] = "elsewhere.txt"
    answer = post(server, outside, b"moved")
    # As AWS answers: 403 AccessDenied, "Invalid according to Policy".
    assert answer.status_code == 403 and "<Code>AccessDenied</Code>" in answer.text, answer.text
    assert "Invalid according to Policy" in answer.text and "starts-with" in answer.text, answer.text

    small = presigned(s3, bucket, "small.bin", conditions=[["content-length-range", 1, 1024]])
    answer = post(server, small, b"x" * 2048)
    assert answer.status_code == 400 and "EntityTooLarge" in answer.text, answer.text

    huge = presigned(s3, bucket, "huge.bin")
    answer = post(server, huge, b"\0" * (POST_FILE_SIZE_MAX_BYTES + 1))
    assert answer.status_code == 400 and "EntityTooLarge" in answer.text, answer.text

    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys == [], keys


def test_filename_in_a_form_key_is_the_uploaded_file_name(server, s3, bucket):
    # Proves S3's ${filename}: the key gets the name of the file the form uploads (a form
    # whose file part has no name is refused and stores nothing).
    form = presigned(s3, bucket, "uploads/${filename}",
                     conditions=[["starts-with", "$key", "uploads/"]])
    answer = post(server, form, b"named bytes", filename="holiday photo.jpg")
    assert answer.status_code == 204, answer.text
    got = s3.get_object(Bucket=bucket, Key="uploads/holiday photo.jpg")
    assert got["Body"].read() == b"named bytes"
    nameless = requests.post(f"{server.endpoint}/{bucket}", data=form["fields"],
                             files={"file": (None, b"x")}, timeout=60)
    assert nameless.status_code == 400 and "filename" in nameless.text, nameless.text
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys == ["uploads/holiday photo.jpg"], keys


def test_concurrent_form_uploads_keep_memory_bounded(fresh_server):
    # Proves the bound on memory: s3s holds each form's file in memory, so Keel reads at most 4
    # at once (POST_UPLOADS_MAX); 16 uploads of 30 MiB sent together all land (those that
    # waited arrive in large pieces, which s3s's form parser refuses unless cut), with the
    # server's peak RSS under 240 MiB (measured 155-178 MiB; 283 MiB with 16 at once).
    fresh_server.start()
    s3 = make_client(fresh_server.endpoint)
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    body = bytes(range(256)) * (30 * MIB // 256)
    forms = [presigned(s3, bucket, f"f{i}.bin") for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda form: post(fresh_server, form, body), forms))
    assert [a.status_code for a in answers] == [204] * 16, [a.text for a in answers if a.status_code != 204][:1]
    assert all(s3.head_object(Bucket=bucket, Key=f"f{i}.bin")["ContentLength"] == len(body) for i in range(16))
    peak = fresh_server.peak_rss_bytes()
    print(f"server peak RSS {peak / MIB:.1f} MiB")
    assert peak < 240 * MIB, f"server peak RSS {peak / MIB:.1f} MiB"
