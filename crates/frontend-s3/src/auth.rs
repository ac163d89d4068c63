//! Who may do what: SigV4 secrets come from the access-key records (s3s verifies signatures,
//! presigned URLs and streaming chunk signatures with them), and every request must be signed by
//! a key that owns the bucket it names or was granted it (and, when the request names the owner
//! it expects, by a bucket that owner owns). The one exception: anyone, unsigned, may list and
//! read a bucket whose canned ACL is `public-read` ([`ANONYMOUS_READS`]).

use std::sync::Arc;

use keel_namespace::object::Objects;
use s3s::access::{S3Access, S3AccessContext};
use s3s::auth::{S3Auth, SecretKey};
use s3s::path::S3Path;
use s3s::{s3_error, S3Result};

pub struct KeyAuth {
    pub objects: Arc<Objects>,
}

#[async_trait::async_trait]
impl S3Auth for KeyAuth {
    async fn get_secret_key(&self, access_key: &str) -> S3Result<SecretKey> {
        match self.objects.key(access_key) {
            Some(record) => Ok(SecretKey::from(record.secret_access_key)),
            None => Err(s3_error!(
                InvalidAccessKeyId,
                "The AWS Access Key Id you provided does not exist in our records."
            )),
        }
    }
}

pub struct BucketAccess {
    pub objects: Arc<Objects>,
}

#[async_trait::async_trait]
impl S3Access for BucketAccess {
    async fn check(&self, cx: &mut S3AccessContext<'_>) -> S3Result<()> {
        let bucket = match cx.s3_path() {
            S3Path::Root => None,
            S3Path::Bucket { bucket } | S3Path::Object { bucket, .. } => Some(bucket),
        };
        let Some(credentials) = cx.credentials() else {
            let public = bucket.is_some_and(|bucket| self.objects.bucket_is_public(bucket));
            if public && ANONYMOUS_READS.contains(&cx.s3_op().name()) {
                return Ok(());
            }
            return Err(s3_error!(AccessDenied, "Anonymous access is not allowed"));
        };
        let Some(bucket) = bucket else {
            return Ok(());
        };
        if cx.s3_op().name() == "CreateBucket" {
            return Ok(());
        }
        match self.objects.can_access(bucket, &credentials.access_key) {
            // The operation answers NoSuchBucket itself.
            None => return Ok(()),
            Some(true) => {}
            Some(false) => return Err(s3_error!(AccessDenied, "Access Denied")),
        }
        // `x-amz-expected-bucket-owner`: the client's guard against writing to a bucket that
        // changed hands. A bucket's owner id is the access key that created it (ListBuckets and
        // ListObjects with fetch-owner show it).
        if let Some(expected) = cx.headers().get(EXPECTED_BUCKET_OWNER) {
            let owner = self.objects.bucket(bucket).map(|record| record.owner);
            if owner.as_deref().map(str::as_bytes) != Some(expected.as_bytes()) {
                return Err(s3_error!(
                    AccessDenied,
                    "The bucket is not owned by the expected bucket owner"
                ));
            }
        }
        Ok(())
    }
}

const EXPECTED_BUCKET_OWNER: &str = "x-amz-expected-bucket-owner";

/// What an unsigned request may do in a `public-read` bucket: list it and read its objects.
const ANONYMOUS_READS: [&str; 5] = [
    "GetObject",
    "HeadObject",
    "ListObjects",
    "ListObjectsV2",
    "HeadBucket",
];
