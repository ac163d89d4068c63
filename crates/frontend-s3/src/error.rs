//! The S3 frontend's error type, and how object-layer errors become S3 error responses.
//!
//! Mapping rules worth knowing: a checksum failure in the store or an undecodable record is a
//! 500 `InternalError` whose message says the data is corrupt (never the bytes); a full disk is
//! a 507 with code `InsufficientStorage` (clients treat it as a non-retryable server error and
//! show the message, unlike 503 `SlowDown`, which they would retry in a loop).

use keel_namespace::object::ObjectError;
use s3s::{S3Error, S3ErrorCode};

/// Errors of the frontend's own API (key and bucket administration, serving).
#[derive(Debug, thiserror::Error)]
pub enum FrontendError {
    #[error(transparent)]
    Object(#[from] ObjectError),
    #[error("invalid access key id {0:?}: use 3 to 128 characters A-Z, a-z, 0-9")]
    InvalidAccessKeyId(String),
    #[error("invalid secret access key: use 8 to 128 printable ASCII characters")]
    InvalidSecret,
}

/// HTTP status for a full disk.
const INSUFFICIENT_STORAGE: u16 = 507;

pub(crate) fn s3_error(error: ObjectError) -> S3Error {
    use ObjectError as E;
    let message = error.to_string();
    match &error {
        E::NoSuchBucket(_) => S3Error::with_message(S3ErrorCode::NoSuchBucket, message),
        E::NoSuchKey { .. } => S3Error::with_message(S3ErrorCode::NoSuchKey, message),
        E::BucketNotEmpty(_) => S3Error::with_message(S3ErrorCode::BucketNotEmpty, message),
        E::BucketAlreadyExists(_) => {
            S3Error::with_message(S3ErrorCode::BucketAlreadyExists, message)
        }
        E::BucketAlreadyOwnedByYou(_) => {
            S3Error::with_message(S3ErrorCode::BucketAlreadyOwnedByYou, message)
        }
        E::InvalidBucketName { .. } => {
            S3Error::with_message(S3ErrorCode::InvalidBucketName, message)
        }
        E::KeyTooLong => S3Error::with_message(S3ErrorCode::KeyTooLongError, message),
        E::InvalidArgument(_) => S3Error::with_message(S3ErrorCode::InvalidArgument, message),
        E::NoSuchUpload(_) => S3Error::with_message(S3ErrorCode::NoSuchUpload, message),
        E::InvalidPart { .. } => S3Error::with_message(S3ErrorCode::InvalidPart, message),
        E::InvalidPartOrder => S3Error::with_message(S3ErrorCode::InvalidPartOrder, message),
        E::EntityTooSmall { .. } => S3Error::with_message(S3ErrorCode::EntityTooSmall, message),
        E::PreconditionFailed(_) => S3Error::with_message(S3ErrorCode::PreconditionFailed, message),
        E::InvalidTag(_) => S3Error::with_message(S3ErrorCode::InvalidTag, message),
        E::NoSuchAccessKey(_) => S3Error::with_message(S3ErrorCode::InvalidAccessKeyId, message),
        E::AccessKeyExists(_) => S3Error::with_message(S3ErrorCode::InvalidArgument, message),
        E::Unavailable(_) => S3Error::with_message(S3ErrorCode::ServiceUnavailable, message),
        E::InvalidVersionId(_) => {
            S3Error::with_message(S3ErrorCode::InvalidArgument, "Invalid version id specified")
        }
        E::NoSuchVersion { .. } => S3Error::with_message(S3ErrorCode::NoSuchVersion, message),
        // AWS answers a delete of a protected version with 403 AccessDenied.
        E::ObjectLocked { .. } => S3Error::with_message(S3ErrorCode::AccessDenied, message),
        E::ObjectLockNotEnabled(_) => S3Error::with_message(S3ErrorCode::InvalidRequest, message),
        E::InvalidBucketState { .. } => {
            S3Error::with_message(S3ErrorCode::InvalidBucketState, message)
        }
        E::DeleteMarker {
            version_id, named, ..
        } => {
            // A named marker cannot be read (405); a key whose newest version is a marker is
            // missing (404). Both say which marker, as S3 does.
            let code = if *named {
                S3ErrorCode::MethodNotAllowed
            } else {
                S3ErrorCode::NoSuchKey
            };
            let mut e = S3Error::with_message(code, message.clone());
            let mut headers = http::HeaderMap::new();
            headers.insert(
                "x-amz-delete-marker",
                http::HeaderValue::from_static("true"),
            );
            if let Ok(value) = http::HeaderValue::from_str(version_id) {
                headers.insert("x-amz-version-id", value);
            }
            e.set_headers(headers);
            e
        }
        _ if error.is_no_space() => {
            let mut e =
                S3Error::with_message(S3ErrorCode::Custom("InsufficientStorage".into()), message);
            if let Ok(status) = hyper::StatusCode::from_u16(INSUFFICIENT_STORAGE) {
                e.set_status_code(status);
            }
            e
        }
        _ if error.is_corrupt() => {
            tracing::error!(%error, "corrupt data refused");
            S3Error::with_message(
                S3ErrorCode::InternalError,
                format!("stored data failed verification and was not returned: {message}"),
            )
        }
        _ => {
            tracing::error!(%error, "internal error");
            S3Error::with_message(S3ErrorCode::InternalError, message)
        }
    }
}

impl From<FrontendError> for S3Error {
    fn from(error: FrontendError) -> S3Error {
        match error {
            FrontendError::Object(error) => s3_error(error),
            other => S3Error::with_message(S3ErrorCode::InternalError, other.to_string()),
        }
    }
}

/// A `spawn_blocking` task that panicked or was cancelled.
pub(crate) fn join_error(error: tokio::task::JoinError) -> S3Error {
    S3Error::with_message(
        S3ErrorCode::InternalError,
        format!("internal task failed: {error}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_store::StoreError;

    // Proves the documented mapping of store failures: a full disk is 507 InsufficientStorage,
    // corruption is 500 InternalError saying the data was not returned.
    #[test]
    fn store_failures_map_to_documented_errors() {
        let full = s3_error(ObjectError::Store {
            context: "test",
            source: StoreError::NoSpace {
                path: "/data".into(),
                available_bytes: 0,
                reserve_bytes: 64 << 20,
            },
        });
        assert_eq!(full.code().as_str(), "InsufficientStorage");
        assert_eq!(full.status_code().map(|s| s.as_u16()), Some(507));
        let corrupt = s3_error(ObjectError::Store {
            context: "test",
            source: StoreError::Corrupt {
                key_hex: "02ab".into(),
                segment: 1,
                offset: 2,
                detail: "crc mismatch".into(),
            },
        });
        assert_eq!(corrupt.code(), &S3ErrorCode::InternalError);
        assert!(corrupt
            .message()
            .is_some_and(|m| m.contains("failed verification") && m.contains("crc mismatch")));
        let missing = s3_error(ObjectError::NoSuchKey {
            bucket: "b".into(),
            key: "k".into(),
        });
        assert_eq!(missing.code(), &S3ErrorCode::NoSuchKey);
    }
}
