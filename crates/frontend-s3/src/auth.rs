//! Who may do what: SigV4 secrets come from the access-key records (s3s verifies signatures,
//! presigned URLs and streaming chunk signatures with them), and every request must be signed by
//! a key that owns the bucket it names or was granted it.

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
        let Some(credentials) = cx.credentials() else {
            return Err(s3_error!(AccessDenied, "Anonymous access is not allowed"));
        };
        let bucket = match cx.s3_path() {
            S3Path::Root => return Ok(()),
            S3Path::Bucket { bucket } | S3Path::Object { bucket, .. } => bucket,
        };
        if cx.s3_op().name() == "CreateBucket" {
            return Ok(());
        }
        match self.objects.can_access(bucket, &credentials.access_key) {
            // The operation answers NoSuchBucket itself.
            None | Some(true) => Ok(()),
            Some(false) => Err(s3_error!(AccessDenied, "Access Denied")),
        }
    }
}
