//! Who may do what: SigV4 secrets come from the access-key records (s3s verifies signatures,
//! presigned URLs and streaming chunk signatures with them), and every request must be signed by
//! a key that owns the bucket it names or was granted it (and, when the request names the owner
//! it expects, by a bucket that owner owns). Besides: anyone, unsigned, may list and read a
//! bucket whose canned ACL is `public-read` ([`ANONYMOUS_READS`]) and read an object whose own
//! canned ACL is ([`OBJECT_READS`]); and a bucket's policy
//! ([`crate::policy`]) may deny a request these rules allow, or allow one they refuse (to
//! another key or to anonymous callers). A policy never locks the owner out of the policy
//! itself: the owner may always read, replace and delete it.

use std::sync::Arc;

use keel_namespace::object::Objects;

use crate::policy::{self, Decision};
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
        let (bucket, key) = match cx.s3_path() {
            S3Path::Root => (None, None),
            S3Path::Bucket { bucket } => (Some(bucket), None),
            S3Path::Object { bucket, key } => (Some(bucket), Some(key)),
        };
        let operation = cx.s3_op().name();
        let principal = cx.credentials().map(|c| c.access_key.as_str());
        let decision = match bucket {
            Some(bucket) if operation != "CreateBucket" => {
                self.policy_decision(cx, bucket, key.map(|k| k.as_ref()), principal)
            }
            _ => Decision::Silent,
        };
        let Some(credentials) = cx.credentials() else {
            if decision == Decision::Deny {
                return Err(s3_error!(
                    AccessDenied,
                    "Access Denied by the bucket policy"
                ));
            }
            let public = bucket.is_some_and(|bucket| self.objects.bucket_is_public(bucket));
            if decision == Decision::Allow || (public && ANONYMOUS_READS.contains(&operation)) {
                return Ok(());
            }
            // An object whose own canned ACL is `public-read`, in a private bucket.
            if let (Some(bucket), Some(key)) = (bucket, key) {
                if OBJECT_READS.contains(&operation)
                    && self.object_is_public(cx, bucket, key.as_ref()).await
                {
                    return Ok(());
                }
            }
            return Err(s3_error!(AccessDenied, "Anonymous access is not allowed"));
        };
        let Some(bucket) = bucket else {
            return Ok(());
        };
        if operation == "CreateBucket" {
            return Ok(());
        }
        let owner = self.objects.bucket(bucket).map(|record| record.owner);
        let owns = owner.as_deref() == Some(credentials.access_key.as_str());
        if decision == Decision::Deny && !(owns && POLICY_OPERATIONS.contains(&operation)) {
            return Err(s3_error!(
                AccessDenied,
                "Access Denied by the bucket policy"
            ));
        }
        match self.objects.can_access(bucket, &credentials.access_key) {
            // The operation answers NoSuchBucket itself.
            None => return Ok(()),
            Some(true) => {}
            Some(false) if decision == Decision::Allow => {}
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

impl BucketAccess {
    /// Whether the object a request reads (the `versionId` it names, or the current version)
    /// has the canned ACL `public-read` (a store read, off the async threads).
    async fn object_is_public(&self, cx: &S3AccessContext<'_>, bucket: &str, key: &str) -> bool {
        let version = match query_param(cx, "versionId")
            .map(|id| keel_namespace::object::VersionId::parse(&id))
        {
            None => None,
            Some(Ok(id)) => Some(id),
            // A malformed id reads nothing.
            Some(Err(_)) => return false,
        };
        let objects = self.objects.clone();
        let (bucket, key) = (bucket.to_string(), key.to_string());
        tokio::task::spawn_blocking(move || objects.object_is_public(&bucket, &key, version))
            .await
            .unwrap_or(false)
    }

    /// What `bucket`'s policy says about this request (silent without a policy).
    fn policy_decision(
        &self,
        cx: &S3AccessContext<'_>,
        bucket: &str,
        key: Option<&str>,
        principal: Option<&str>,
    ) -> Decision {
        let Some(text) = self.objects.bucket_policy(bucket) else {
            return Decision::Silent;
        };
        let policy = match policy::parse(bucket, &text) {
            Ok(policy) => policy,
            Err(error) => {
                // Stored policies were parsed when put; one that no longer parses (a newer
                // Keel wrote it) must not open the bucket: deny.
                tracing::error!(bucket, %error, "a stored bucket policy does not parse");
                return Decision::Deny;
            }
        };
        let resource = match key {
            Some(key) => format!("arn:aws:s3:::{bucket}/{key}"),
            None => format!("arn:aws:s3:::{bucket}"),
        };
        let prefix = query_param(cx, "prefix");
        let action = policy::action_of(cx.s3_op().name());
        policy.decide(&policy::Request {
            principal,
            action: &action,
            resource: &resource,
            prefix: prefix.as_deref(),
            // Keel's S3 listener is plain HTTP.
            secure_transport: false,
        })
    }
}

/// The value of the request's query parameter `name`, decoded.
fn query_param(cx: &S3AccessContext<'_>, name: &str) -> Option<String> {
    let query = cx.uri().query()?;
    form_urlencoded::parse(query.as_bytes())
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.into_owned())
}

/// Operations on the policy itself, which its bucket's owner may always do.
const POLICY_OPERATIONS: [&str; 4] = [
    "GetBucketPolicy",
    "GetBucketPolicyStatus",
    "PutBucketPolicy",
    "DeleteBucketPolicy",
];

const EXPECTED_BUCKET_OWNER: &str = "x-amz-expected-bucket-owner";

/// What an unsigned request may do with a `public-read` object of a private bucket.
const OBJECT_READS: [&str; 2] = ["GetObject", "HeadObject"];

/// What an unsigned request may do in a `public-read` bucket: list it and read its objects.
const ANONYMOUS_READS: [&str; 5] = [
    "GetObject",
    "HeadObject",
    "ListObjects",
    "ListObjectsV2",
    "HeadBucket",
];
