//! The S3 operations, implemented on the object layer. s3s has already parsed the request,
//! checked its signature and the caller's access to the bucket; each operation here validates
//! what Keel owns (keys, ranges, conditions, part lists), runs store work in blocking tasks, and
//! streams bodies both ways.

use std::sync::Arc;

use futures::StreamExt;
use keel_catalog::{BucketSettings, CorsRule, LifecycleRule, LockMode, Versioning};
use keel_namespace::object::list::{ListRequest, ListResult, ListStart, LIST_ENTRIES_MAX};
use keel_namespace::object::multipart::PARTS_MAX;
use keel_namespace::object::{
    now_unix_ms, validate_object_key, validate_tags, Checksums, Content, Deletion, Lock,
    LockChange, Manifest, ObjectError, Objects, PartRecord, PinSet, PutCondition, Retention,
    StoredHeaders, Tags, UploadRecord, VersionEntry, VersionId, VersionListRequest,
};
use s3s::dto::*;
use s3s::{s3_error, S3Error, S3ErrorCode, S3Request, S3Response, S3Result, S3};

use crate::error::{join_error, s3_error};
use crate::ingest::{ingest, ChecksumKind, ChecksumRequest, Ingested, PUT_SIZE_MAX_BYTES};
use crate::read::{evaluate, parse_copy_range, Conditions, ObjectBody, Precondition};
use crate::token::{decode_token, encode_token, url_encode};

/// Most keys one DeleteObjects request may name, as in S3.
pub const DELETE_OBJECTS_MAX: usize = 1000;
/// The largest `max-buckets` of a ListBuckets page (AWS's limit).
pub const LIST_BUCKETS_MAX: i32 = 10_000;
/// Largest total size of user metadata (names and values), as in S3.
pub const METADATA_SIZE_MAX_BYTES: usize = 2048;
/// Largest part, as in S3.
pub const PART_SIZE_MAX_BYTES: u64 = 5 << 30;

/// The S3 service over one object layer.
#[derive(Clone)]
pub struct KeelS3 {
    pub(crate) objects: Arc<Objects>,
}

/// Runs blocking object-layer work off the async threads, as work of the request being
/// answered (`keel ops`).
async fn blocking<T, F>(f: F) -> S3Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, ObjectError> + Send + 'static,
{
    let op = crate::unread::current_op();
    tokio::task::spawn_blocking(move || match op {
        Some(op) => op.enter(|| {
            let _phase = keel_ops::Phase::enter(keel_ops::phase::HANDLING);
            f()
        }),
        None => f(),
    })
    .await
    .map_err(join_error)?
    .map_err(s3_error)
}

fn caller<T>(req: &S3Request<T>) -> S3Result<String> {
    req.credentials
        .as_ref()
        .map(|c| c.access_key.clone())
        .ok_or_else(|| s3_error!(AccessDenied, "Signature is required"))
}

fn check_key(key: &str) -> S3Result<()> {
    validate_object_key(key).map_err(s3_error)
}

fn timestamp(unix_ms: i64) -> Timestamp {
    let nanos = i128::from(unix_ms) * 1_000_000;
    Timestamp::from(
        time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
            .unwrap_or(time::OffsetDateTime::UNIX_EPOCH),
    )
}

fn unix_ms(ts: &Timestamp) -> i64 {
    let t: time::OffsetDateTime = ts.clone().into();
    (t.unix_timestamp_nanos() / 1_000_000) as i64
}

fn unix_s(ts: &Timestamp) -> i64 {
    let t: time::OffsetDateTime = ts.clone().into();
    t.unix_timestamp()
}

fn etag(value: &str) -> ETag {
    ETag::Strong(value.to_string())
}

/// The stored-object headers GetObject and HeadObject both answer with (s3s has one output
/// type per operation): `$output` built from a manifest, the length served, the content range
/// and the checksum fields, plus any operation-specific fields.
macro_rules! stored_object_output {
    ($output:ident, $manifest:expr, $length:expr, $content_range:expr, $checksums:expr,
     $($field:ident: $value:expr,)*) => {{
        let manifest: &Manifest = $manifest;
        let headers = &manifest.headers;
        let (crc32, crc32c, crc64nvme, sha1, sha256) = $checksums;
        $output {
            $($field: $value,)*
            accept_ranges: Some("bytes".into()),
            content_length: Some($length as i64),
            content_range: $content_range,
            content_type: headers.content_type.clone(),
            content_encoding: headers.content_encoding.clone(),
            content_disposition: headers.content_disposition.clone(),
            content_language: headers.content_language.clone(),
            cache_control: headers.cache_control.clone(),
            expires: headers.expires_unix_ms.map(timestamp),
            e_tag: Some(etag(&manifest.etag)),
            last_modified: Some(timestamp(manifest.modified_unix_ms)),
            metadata: metadata_map(&manifest.metadata),
            checksum_crc32: crc32,
            checksum_crc32c: crc32c,
            checksum_crc64nvme: crc64nvme,
            checksum_sha1: sha1,
            checksum_sha256: sha256,
            parts_count: (!manifest.part_sizes_bytes.is_empty())
                .then_some(manifest.part_sizes_bytes.len() as i32),
            ..Default::default()
        }
    }};
}

/// The conditional-request headers of a GET/HEAD (or of a copy's source), as checked by
/// `check_conditions`.
fn conditions(
    if_match: Option<&ETagCondition>,
    if_none_match: Option<&ETagCondition>,
    if_modified_since: Option<&Timestamp>,
    if_unmodified_since: Option<&Timestamp>,
) -> Conditions {
    Conditions {
        if_match: if_match.map(condition_value),
        if_none_match: if_none_match.map(condition_value),
        if_modified_since_unix_s: if_modified_since.map(unix_s),
        if_unmodified_since_unix_s: if_unmodified_since.map(unix_s),
    }
}

fn condition_value(condition: &ETagCondition) -> Option<String> {
    match condition {
        ETagCondition::Any => None,
        ETagCondition::ETag(etag) => Some(etag.value().to_string()),
    }
}

fn user_metadata(metadata: Option<Metadata>) -> S3Result<Vec<(String, String)>> {
    let mut list: Vec<(String, String)> = metadata
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    list.sort();
    let size: usize = list.iter().map(|(k, v)| k.len() + v.len()).sum();
    if size > METADATA_SIZE_MAX_BYTES {
        return Err(S3Error::with_message(
            S3ErrorCode::MetadataTooLarge,
            format!("user metadata is {size} bytes; at most {METADATA_SIZE_MAX_BYTES} allowed"),
        ));
    }
    Ok(list)
}

fn metadata_map(list: &[(String, String)]) -> Option<Metadata> {
    if list.is_empty() {
        None
    } else {
        Some(list.iter().cloned().collect())
    }
}

fn checksum_request(
    algorithm: Option<&ChecksumAlgorithm>,
    sent: Checksums,
    content_md5: Option<String>,
    headers: &hyper::HeaderMap,
) -> S3Result<ChecksumRequest> {
    let mut algorithms = Vec::new();
    if let Some(algorithm) = algorithm {
        let kind = ChecksumKind::parse(algorithm.as_str()).ok_or_else(|| {
            S3Error::with_message(
                S3ErrorCode::InvalidArgument,
                format!("unknown checksum algorithm {:?}", algorithm.as_str()),
            )
        })?;
        algorithms.push(kind);
    }
    // A checksum announced as a trailer (`x-amz-trailer: x-amz-checksum-crc32`).
    if let Some(trailer) = headers.get("x-amz-trailer").and_then(|v| v.to_str().ok()) {
        for name in trailer.split(',') {
            if let Some(kind) = name.trim().strip_prefix("x-amz-checksum-") {
                if let Some(kind) = ChecksumKind::parse(kind) {
                    algorithms.push(kind);
                }
            }
        }
    }
    let sent_kinds = [
        (ChecksumKind::Crc32, &sent.crc32),
        (ChecksumKind::Crc32c, &sent.crc32c),
        (ChecksumKind::Crc64Nvme, &sent.crc64nvme),
        (ChecksumKind::Sha1, &sent.sha1),
        (ChecksumKind::Sha256, &sent.sha256),
    ];
    for (kind, value) in sent_kinds {
        if value.is_some() {
            algorithms.push(kind);
        }
    }
    algorithms.dedup();
    algorithms.sort_by_key(|k| k.header());
    algorithms.dedup();
    Ok(ChecksumRequest {
        algorithms,
        expected: sent,
        content_md5,
    })
}

fn trailing_checksums(trailing: Option<s3s::TrailingHeaders>) -> impl FnOnce() -> Checksums {
    move || {
        let Some(trailing) = trailing else {
            return Checksums::default();
        };
        trailing
            .read(|headers| {
                let get = |name: &str| {
                    headers
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string)
                };
                Checksums {
                    crc32: get("x-amz-checksum-crc32"),
                    crc32c: get("x-amz-checksum-crc32c"),
                    crc64nvme: get("x-amz-checksum-crc64nvme"),
                    sha1: get("x-amz-checksum-sha1"),
                    sha256: get("x-amz-checksum-sha256"),
                }
            })
            .unwrap_or_default()
    }
}

/// Reads a manifest and answers 304/412 per the conditions.
fn check_conditions(
    manifest: &Manifest,
    conditions: &Conditions,
    not_modified_is_failure: bool,
) -> S3Result<()> {
    match evaluate(conditions, &manifest.etag, manifest.modified_unix_ms) {
        Precondition::Proceed => Ok(()),
        Precondition::NotModified if !not_modified_is_failure => {
            // A 304 carries the validator the client compares against (RFC 7232 4.1).
            let mut error = S3Error::new(S3ErrorCode::NotModified);
            let mut headers = http::HeaderMap::new();
            if let Ok(value) = http::HeaderValue::from_str(&format!("\"{}\"", manifest.etag)) {
                headers.insert(http::header::ETAG, value);
            }
            error.set_headers(headers);
            Err(error)
        }
        _ => Err(s3_error!(
            PreconditionFailed,
            "At least one of the pre-conditions you specified did not hold"
        )),
    }
}

/// The byte range a GET/HEAD answers: (start, end exclusive, Content-Range if partial).
fn resolve_range(
    manifest: &Manifest,
    range: Option<&Range>,
    part_number: Option<i32>,
) -> S3Result<(u64, u64, Option<String>)> {
    let size = manifest.size_bytes;
    if let Some(part) = part_number {
        let sizes: Vec<u64> = if manifest.part_sizes_bytes.is_empty() {
            vec![size]
        } else {
            manifest.part_sizes_bytes.clone()
        };
        let index = usize::try_from(part)
            .ok()
            .filter(|p| (1..=sizes.len()).contains(p));
        let Some(index) = index else {
            // AWS: 400 InvalidPartNumber (a part beyond the object's, or > 1 on a single-part
            // object), not 416.
            let mut error = S3Error::with_message(
                S3ErrorCode::Custom("InvalidPartNumber".into()),
                "The requested partnumber is not satisfiable",
            );
            error.set_status_code(http::StatusCode::BAD_REQUEST);
            return Err(error);
        };
        let start: u64 = sizes[..index - 1].iter().sum();
        let end = start + sizes[index - 1];
        let content_range = (end > start).then(|| format!("bytes {start}-{}/{size}", end - 1));
        return Ok((start, end, content_range));
    }
    match range {
        None => Ok((0, size, None)),
        Some(range) => match range.check(size) {
            Ok(r) => Ok((
                r.start,
                r.end,
                Some(format!("bytes {}-{}/{size}", r.start, r.end - 1)),
            )),
            Err(_) => Err(s3_error!(
                InvalidRange,
                "The requested range is not satisfiable"
            )),
        },
    }
}

/// The five checksum fields of an S3 response, in the order CRC32, CRC32C, CRC64NVME, SHA1,
/// SHA256.
type ChecksumFields = (
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// Whether a GET/HEAD asked for the stored checksums (`x-amz-checksum-mode: ENABLED`); AWS
/// returns them only then.
fn checksums_wanted(mode: Option<&ChecksumMode>) -> bool {
    mode.is_some_and(|mode| mode.as_str() == ChecksumMode::ENABLED)
}

fn checksum_fields(checksums: &Checksums) -> ChecksumFields {
    (
        checksums.crc32.clone(),
        checksums.crc32c.clone(),
        checksums.crc64nvme.clone(),
        checksums.sha1.clone(),
        checksums.sha256.clone(),
    )
}

/// The tags of an `x-amz-tagging` header (URL-encoded `key=value` pairs joined by `&`),
/// checked against S3's rules; none without the header.
fn tags_from_header(header: Option<&str>) -> S3Result<Tags> {
    let Some(header) = header.filter(|header| !header.is_empty()) else {
        return Ok(Tags::new());
    };
    let tags: Tags = form_urlencoded::parse(header.as_bytes())
        .map(|(key, value)| (key.into_owned(), value.into_owned()))
        .collect();
    validate_tags(&tags).map_err(s3_error)?;
    Ok(tags)
}

/// The tags of a PutObjectTagging body, checked against S3's rules.
/// What PutObject and PostObject have in common: everything [`KeelS3::store_upload`] stores.
struct Upload {
    bucket: String,
    key: String,
    body: Option<StreamingBlob>,
    content_length: Option<i64>,
    checksum_algorithm: Option<ChecksumAlgorithm>,
    checksums: Checksums,
    content_md5: Option<String>,
    metadata: Option<Metadata>,
    tagging: Option<String>,
    if_none_match: Option<IfNoneMatch>,
    if_match: Option<IfMatch>,
    headers: StoredHeaders,
    lock: S3Result<Lock>,
    public_read: S3Result<Option<bool>>,
}

/// An [`Upload`] from a `PutObjectInput` or a `PostObjectInput` (s3s gives both the same
/// fields).
macro_rules! upload_of {
    ($input:expr) => {{
        let input = $input;
        Upload {
            checksums: Checksums {
                crc32: input.checksum_crc32,
                crc32c: input.checksum_crc32c,
                crc64nvme: input.checksum_crc64nvme,
                sha1: input.checksum_sha1,
                sha256: input.checksum_sha256,
            },
            headers: StoredHeaders {
                content_type: input.content_type,
                content_encoding: input.content_encoding,
                content_disposition: input.content_disposition,
                content_language: input.content_language,
                cache_control: input.cache_control,
                expires_unix_ms: input.expires.as_ref().map(unix_ms),
            },
            bucket: input.bucket,
            key: input.key,
            body: input.body,
            content_length: input.content_length,
            checksum_algorithm: input.checksum_algorithm,
            content_md5: input.content_md5,
            metadata: input.metadata,
            tagging: input.tagging,
            if_none_match: input.if_none_match,
            if_match: input.if_match,
            lock: lock_from_headers(
                input.object_lock_mode.as_ref(),
                input.object_lock_retain_until_date.as_ref(),
                input.object_lock_legal_hold_status.as_ref(),
            ),
            public_read: object_canned_public_read(input.acl.as_ref()),
        }
    }};
}

/// S3's name of a retention mode.
fn lock_mode_name(mode: LockMode) -> &'static str {
    match mode {
        LockMode::Governance => ObjectLockMode::GOVERNANCE,
        LockMode::Compliance => ObjectLockMode::COMPLIANCE,
    }
}

fn lock_mode(name: &str) -> S3Result<LockMode> {
    match name {
        ObjectLockMode::GOVERNANCE => Ok(LockMode::Governance),
        ObjectLockMode::COMPLIANCE => Ok(LockMode::Compliance),
        other => Err(S3Error::with_message(
            S3ErrorCode::InvalidArgument,
            format!("unknown object lock mode {other:?}: GOVERNANCE or COMPLIANCE"),
        )),
    }
}

/// The object lock a write asks for (`x-amz-object-lock-mode` and `-retain-until-date`, which
/// come together, and `-legal-hold`).
fn lock_from_headers(
    mode: Option<&ObjectLockMode>,
    until: Option<&Timestamp>,
    hold: Option<&ObjectLockLegalHoldStatus>,
) -> S3Result<Lock> {
    let retention = match (mode, until) {
        (None, None) => None,
        (Some(mode), Some(until)) => Some(Retention {
            mode: lock_mode(mode.as_str())?,
            until_unix_ms: unix_ms(until),
        }),
        _ => {
            return Err(s3_error!(
                InvalidArgument,
                "x-amz-object-lock-mode and x-amz-object-lock-retain-until-date must both be given"
            ))
        }
    };
    Ok(Lock {
        retention,
        legal_hold: legal_hold_on(hold.map(ObjectLockLegalHoldStatus::as_str))?,
    })
}

fn legal_hold_on(status: Option<&str>) -> S3Result<bool> {
    match status {
        None | Some(ObjectLockLegalHoldStatus::OFF) => Ok(false),
        Some(ObjectLockLegalHoldStatus::ON) => Ok(true),
        Some(other) => Err(S3Error::with_message(
            S3ErrorCode::InvalidArgument,
            format!("unknown legal hold status {other:?}: ON or OFF"),
        )),
    }
}

/// A version's object lock as GET/HEAD answer it: mode, retain-until date, legal hold.
fn lock_fields(
    lock: &Lock,
) -> (
    Option<ObjectLockMode>,
    Option<Timestamp>,
    Option<ObjectLockLegalHoldStatus>,
) {
    (
        lock.retention
            .map(|r| ObjectLockMode::from_static(lock_mode_name(r.mode))),
        lock.retention.map(|r| timestamp(r.until_unix_ms)),
        lock.legal_hold
            .then(|| ObjectLockLegalHoldStatus::from_static(ObjectLockLegalHoldStatus::ON)),
    )
}

/// A lifecycle rule as Keel keeps it; what it cannot apply (transitions, filters on tags or
/// sizes, counts of noncurrent versions to keep) is refused, not ignored.
fn lifecycle_rule_in(rule: s3s::dto::LifecycleRule) -> S3Result<LifecycleRule> {
    let unsupported = |what: &str| {
        Err(s3_error!(
            NotImplemented,
            "lifecycle rules with {what} are not supported (Keel has one storage class)"
        ))
    };
    if rule.transitions.is_some() || rule.noncurrent_version_transitions.is_some() {
        return unsupported("transitions");
    }
    if rule
        .noncurrent_version_expiration
        .as_ref()
        .is_some_and(|noncurrent| noncurrent.newer_noncurrent_versions.is_some())
    {
        return Err(s3_error!(
            NotImplemented,
            "NewerNoncurrentVersions is not supported: expire noncurrent versions by NoncurrentDays"
        ));
    }
    let prefix = match rule.filter {
        Some(filter) => {
            if filter.and.is_some()
                || filter.tag.is_some()
                || filter.object_size_greater_than.is_some()
                || filter.object_size_less_than.is_some()
            {
                return Err(s3_error!(
                    NotImplemented,
                    "lifecycle filters on tags or sizes are not supported: filter by Prefix"
                ));
            }
            filter.prefix.unwrap_or_default()
        }
        None => rule.prefix.unwrap_or_default(),
    };
    let days = |value: Option<i32>, what: &str| -> S3Result<Option<u32>> {
        value
            .map(|days| {
                u32::try_from(days).map_err(|_| {
                    s3_error!(InvalidArgument, "{what} must be a positive number of days")
                })
            })
            .transpose()
    };
    let expiration = rule.expiration.unwrap_or_default();
    let noncurrent_days = match rule.noncurrent_version_expiration {
        Some(noncurrent) => Some(noncurrent.noncurrent_days.ok_or_else(|| {
            s3_error!(
                MalformedXML,
                "A NoncurrentVersionExpiration needs NoncurrentDays"
            )
        })?),
        None => None,
    };
    Ok(LifecycleRule {
        noncurrent_expiration_days: days(noncurrent_days, "NoncurrentDays")?,
        expired_object_delete_marker: expiration.expired_object_delete_marker == Some(true),
        id: rule.id,
        enabled: rule.status.as_str() == ExpirationStatus::ENABLED,
        prefix,
        expiration_days: days(expiration.days, "Expiration Days")?,
        expiration_date_unix_ms: expiration.date.as_ref().map(unix_ms),
        abort_incomplete_upload_days: days(
            rule.abort_incomplete_multipart_upload
                .and_then(|abort| abort.days_after_initiation),
            "DaysAfterInitiation",
        )?,
    })
}

fn lifecycle_rule_out(rule: LifecycleRule) -> s3s::dto::LifecycleRule {
    let expires = rule.expiration_days.is_some()
        || rule.expiration_date_unix_ms.is_some()
        || rule.expired_object_delete_marker;
    s3s::dto::LifecycleRule {
        abort_incomplete_multipart_upload: rule.abort_incomplete_upload_days.map(|days| {
            AbortIncompleteMultipartUpload {
                days_after_initiation: Some(days as i32),
            }
        }),
        expiration: expires.then(|| LifecycleExpiration {
            date: rule.expiration_date_unix_ms.map(timestamp),
            days: rule.expiration_days.map(|days| days as i32),
            expired_object_delete_marker: rule.expired_object_delete_marker.then_some(true),
        }),
        filter: Some(LifecycleRuleFilter {
            prefix: Some(rule.prefix),
            ..LifecycleRuleFilter::default()
        }),
        id: rule.id,
        noncurrent_version_expiration: rule.noncurrent_expiration_days.map(|days| {
            NoncurrentVersionExpiration {
                noncurrent_days: Some(days as i32),
                newer_noncurrent_versions: None,
            }
        }),
        noncurrent_version_transitions: None,
        prefix: None,
        status: ExpirationStatus::from_static(if rule.enabled {
            ExpirationStatus::ENABLED
        } else {
            ExpirationStatus::DISABLED
        }),
        transitions: None,
    }
}

/// The grantee S3 names "everyone".
const ALL_USERS: &str = "http://acs.amazonaws.com/groups/global/AllUsers";

/// A canned ACL Keel supports: `private` (false) or `public-read` (true); none given: `None`.
fn canned_public_read(acl: Option<&BucketCannedACL>) -> S3Result<Option<bool>> {
    match acl.map(BucketCannedACL::as_str) {
        None => Ok(None),
        Some(BucketCannedACL::PRIVATE) => Ok(Some(false)),
        Some(BucketCannedACL::PUBLIC_READ) => Ok(Some(true)),
        Some(other) => Err(s3_error!(
            NotImplemented,
            "the canned ACL {other:?} is not supported: use private or public-read"
        )),
    }
}

/// An object's canned ACL: `private` (false; also `bucket-owner-full-control`, which is what a
/// private object already grants its bucket's owner) or `public-read` (true); none given:
/// `None`.
fn object_canned_public_read(acl: Option<&ObjectCannedACL>) -> S3Result<Option<bool>> {
    match acl.map(ObjectCannedACL::as_str) {
        None => Ok(None),
        Some(ObjectCannedACL::PRIVATE | ObjectCannedACL::BUCKET_OWNER_FULL_CONTROL) => {
            Ok(Some(false))
        }
        Some(ObjectCannedACL::PUBLIC_READ) => Ok(Some(true)),
        Some(other) => Err(s3_error!(
            NotImplemented,
            "the canned ACL {other:?} is not supported: use private or public-read"
        )),
    }
}

/// A tagging body's pairs, as given (validated by the caller for what it tags).
fn tag_pairs(tagging: Tagging) -> Tags {
    tagging
        .tag_set
        .into_iter()
        .map(|tag| (tag.key.unwrap_or_default(), tag.value.unwrap_or_default()))
        .collect()
}

/// Tags as a tagging answer lists them.
fn tag_set(tags: Tags) -> TagSet {
    tags.into_iter()
        .map(|(key, value)| Tag {
            key: Some(key),
            value: Some(value),
        })
        .collect()
}

fn tags_from_body(tagging: Tagging) -> S3Result<Tags> {
    let tags = tag_pairs(tagging);
    validate_tags(&tags).map_err(s3_error)?;
    Ok(tags)
}

/// How DeleteObjects reports one deletion: the version named (`version_id`) was removed, or a
/// delete marker was added (`delete_marker_version_id`).
fn deleted_object(key: String, named: Option<String>, deletion: Deletion) -> DeletedObject {
    let added_marker = named.is_none() && deletion.delete_marker;
    DeletedObject {
        key: Some(key),
        delete_marker: deletion.delete_marker.then_some(true),
        delete_marker_version_id: if added_marker {
            deletion.version_id.clone()
        } else {
            None
        },
        version_id: named,
    }
}

/// A request's `versionId`, if it names one.
fn version_of(version_id: Option<&str>) -> S3Result<Option<VersionId>> {
    version_id
        .map(|id| VersionId::parse(id).map_err(s3_error))
        .transpose()
}

/// A copy source: bucket, key and the version named, if any.
fn copy_source_parts(source: &CopySource) -> S3Result<(String, String, Option<VersionId>)> {
    match source {
        CopySource::Bucket {
            bucket,
            key,
            version_id,
        } => Ok((
            bucket.to_string(),
            key.to_string(),
            version_of(version_id.as_deref())?,
        )),
        _ => Err(s3_error!(
            NotImplemented,
            "Only bucket copy sources are supported"
        )),
    }
}

fn list_start_from_marker(
    marker: Option<&str>,
    prefix: &str,
    delimiter: Option<&str>,
) -> Option<ListStart> {
    let marker = marker.filter(|m| !m.is_empty())?;
    if let Some(delimiter) = delimiter.filter(|d| !d.is_empty()) {
        if marker.starts_with(prefix) && marker.ends_with(delimiter) {
            return Some(ListStart::AfterPrefix(marker.to_string()));
        }
    }
    Some(ListStart::AfterKey(marker.to_string()))
}

fn max_keys(value: Option<i32>) -> S3Result<usize> {
    match value {
        None => Ok(LIST_ENTRIES_MAX),
        Some(n) if n < 0 => Err(s3_error!(InvalidArgument, "max-keys must not be negative")),
        Some(n) => Ok((n as usize).min(LIST_ENTRIES_MAX)),
    }
}

impl KeelS3 {
    async fn list(&self, bucket: &str, request: ListRequest) -> S3Result<ListResult> {
        let objects = self.objects.clone();
        let bucket = bucket.to_string();
        blocking(move || objects.list_objects(&bucket, &request)).await
    }

    /// The manifest (of the version named, or the current one) with its chunks pinned for as
    /// long as the returned set lives (a read).
    async fn pinned_manifest(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionId>,
    ) -> S3Result<(Manifest, PinSet)> {
        let objects = self.objects.clone();
        let (bucket, key) = (bucket.to_string(), key.to_string());
        blocking(move || objects.get_manifest_pinned(&bucket, &key, version)).await
    }

    async fn manifest(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionId>,
    ) -> S3Result<Manifest> {
        let objects = self.objects.clone();
        let (bucket, key) = (bucket.to_string(), key.to_string());
        blocking(move || objects.get_manifest(&bucket, &key, version)).await
    }

    async fn set_tags(
        &self,
        bucket: String,
        key: String,
        version_id: Option<String>,
        tags: Tags,
    ) -> S3Result<Option<String>> {
        check_key(&key)?;
        let version = version_of(version_id.as_deref())?;
        let objects = self.objects.clone();
        blocking(move || objects.set_object_tags(&bucket, &key, version, tags)).await?;
        Ok(version_id)
    }

    /// The version id a response about `manifest` carries: none in a bucket that never had
    /// versioning (S3 sends no `x-amz-version-id` there).
    fn version_header(&self, bucket: &str, manifest: &Manifest) -> Option<String> {
        (self.objects.versioning(bucket) != Versioning::Unversioned).then(|| manifest.version_id())
    }

    /// A bucket's ACL as S3 shows it, or an object's (`object_public`: the object's own canned
    /// ACL is `public-read`): the owner (the access key that created the bucket) with
    /// FULL_CONTROL, and everyone with READ when the bucket or the object is public.
    fn acl_of(&self, bucket: &str, object_public: bool) -> S3Result<(Owner, Vec<Grant>)> {
        let record = self
            .objects
            .bucket(bucket)
            .ok_or_else(|| s3_error!(NoSuchBucket, "The specified bucket does not exist"))?;
        let owner = Owner {
            display_name: Some(record.owner.clone()),
            id: Some(record.owner.clone()),
        };
        let mut grants = vec![Grant {
            grantee: Some(Grantee {
                display_name: Some(record.owner.clone()),
                email_address: None,
                id: Some(record.owner),
                type_: Type::from_static(Type::CANONICAL_USER),
                uri: None,
            }),
            permission: Some(Permission::from_static(Permission::FULL_CONTROL)),
        }];
        if object_public || self.objects.bucket_is_public(bucket) {
            grants.push(Grant {
                grantee: Some(Grantee {
                    display_name: None,
                    email_address: None,
                    id: None,
                    type_: Type::from_static(Type::GROUP),
                    uri: Some(ALL_USERS.to_string()),
                }),
                permission: Some(Permission::from_static(Permission::READ)),
            });
        }
        Ok((owner, grants))
    }

    /// Reads the body of a whole object (PUT, POST) or of a part into chunks of `bucket` (an
    /// absent body is empty), verifying its checksums and that it is as long as its
    /// `Content-Length` said.
    async fn ingest_body(
        &self,
        bucket: &str,
        body: Option<StreamingBlob>,
        content_length: Option<i64>,
        request: &ChecksumRequest,
        whole_object: bool,
        trailing_headers: Option<s3s::TrailingHeaders>,
    ) -> S3Result<Ingested> {
        let compression = self.objects.bucket_compression(bucket).map_err(s3_error)?;
        let size_max_bytes = if whole_object {
            PUT_SIZE_MAX_BYTES
        } else {
            PART_SIZE_MAX_BYTES
        };
        let body = body.unwrap_or_else(|| {
            StreamingBlob::wrap(futures::stream::empty::<Result<bytes::Bytes, std::io::Error>>())
        });
        let ingested = ingest(
            self.objects.clone(),
            compression,
            body,
            request,
            whole_object,
            size_max_bytes,
            trailing_checksums(trailing_headers),
        )
        .await?;
        if let Some(expected) = content_length {
            if expected >= 0 && expected as u64 != ingested.size_bytes {
                return Err(s3_error!(
                    IncompleteBody,
                    "The body is shorter or longer than Content-Length"
                ));
            }
        }
        Ok(ingested)
    }

    /// Stores one object from a PutObject or a PostObject: its body streamed in (checksums and
    /// `Content-MD5` verified), then its manifest committed under the request's conditions.
    async fn store_upload(
        &self,
        upload: Upload,
        headers: &http::HeaderMap,
        trailing_headers: Option<s3s::TrailingHeaders>,
    ) -> S3Result<(Manifest, Option<String>)> {
        check_key(&upload.key)?;
        let request = checksum_request(
            upload.checksum_algorithm.as_ref(),
            upload.checksums,
            upload.content_md5,
            headers,
        )?;
        let metadata = user_metadata(upload.metadata)?;
        let tags = tags_from_header(upload.tagging.as_deref())?;
        let lock = upload.lock?;
        let public_read = upload.public_read?.unwrap_or(false);
        let condition = PutCondition {
            if_none_match_any: upload
                .if_none_match
                .as_ref()
                .is_some_and(ETagCondition::is_any),
            if_match_etag: upload
                .if_match
                .as_ref()
                .map(|c| condition_value(c).unwrap_or_else(|| "*".into())),
        };
        let ingested = self
            .ingest_body(
                &upload.bucket,
                upload.body,
                upload.content_length,
                &request,
                true,
                trailing_headers,
            )
            .await?;
        let manifest = Manifest {
            size_bytes: ingested.size_bytes,
            etag: ingested.md5_hex.clone(),
            modified_unix_ms: now_unix_ms(),
            content: ingested.content,
            part_sizes_bytes: Vec::new(),
            headers: upload.headers,
            metadata,
            checksums: ingested.checksums.clone(),
            tags,
            version_seq: 0,
            versioned: false,
            delete_marker: false,
            lock,
            public_read,
        };
        let pins = ingested.pins;
        let objects = self.objects.clone();
        let (bucket, key) = (upload.bucket, upload.key);
        blocking(move || {
            let result = objects.put_object(&bucket, &key, manifest, &condition);
            drop(pins);
            result
        })
        .await
    }

    /// A bucket's optional settings (all empty when it has none); NoSuchBucket unless it exists.
    fn settings_of(&self, bucket: &str) -> S3Result<BucketSettings> {
        self.require_bucket(bucket)?;
        Ok(self.objects.bucket_settings(bucket).unwrap_or_default())
    }

    /// A bucket's policy document: NoSuchBucket, or NoSuchBucketPolicy when it has none.
    fn policy_of(&self, bucket: &str) -> S3Result<String> {
        self.require_bucket(bucket)?;
        self.objects
            .bucket_policy(bucket)
            .ok_or_else(|| s3_error!(NoSuchBucketPolicy, "The bucket policy does not exist"))
    }

    /// NoSuchBucket unless `bucket` exists (access was checked by the auth layer).
    fn require_bucket(&self, bucket: &str) -> S3Result<()> {
        if self.objects.bucket(bucket).is_none() {
            return Err(s3_error!(
                NoSuchBucket,
                "The specified bucket does not exist"
            ));
        }
        Ok(())
    }

    /// The caller may read the copy source's bucket, and it is owned by the owner the request
    /// expects (`x-amz-source-expected-bucket-owner`), if it names one.
    fn check_source_access(
        &self,
        caller: &str,
        bucket: &str,
        expected_owner: Option<&str>,
    ) -> S3Result<()> {
        match self.objects.can_access(bucket, caller) {
            None => return Err(s3_error!(NoSuchBucket, "The source bucket does not exist")),
            Some(false) => return Err(s3_error!(AccessDenied, "Access Denied to the copy source")),
            Some(true) => {}
        }
        if let Some(expected) = expected_owner {
            let owner = self.objects.bucket(bucket).map(|record| record.owner);
            if owner.as_deref() != Some(expected) {
                return Err(s3_error!(
                    AccessDenied,
                    "The copy source bucket is not owned by the expected bucket owner"
                ));
            }
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl S3 for KeelS3 {
    /// A browser-form upload: s3s has checked the policy's signature, expiry and conditions
    /// and read the file (up to [`crate::POST_FILE_SIZE_MAX_BYTES`]); it is stored as a PUT
    /// would be, and s3s answers as `success_action_status` / `success_action_redirect` ask.
    async fn post_object(
        &self,
        req: S3Request<PostObjectInput>,
    ) -> S3Result<S3Response<PostObjectOutput>> {
        let S3Request {
            mut input,
            headers,
            extensions,
            ..
        } = req;
        if input.key.contains("${filename}") {
            // The file's name as the form gave it (see `unread::FormFileName`).
            let file_name = extensions
                .get::<crate::unread::FormFileName>()
                .and_then(|found| found.get())
                .filter(|name| !name.is_empty())
                .ok_or_else(|| {
                    s3_error!(
                        InvalidArgument,
                        "the form's key uses ${{filename}} but its file part has no file name"
                    )
                })?;
            input.key = input.key.replace("${filename}", file_name);
        }
        let (manifest, version_id) = self.store_upload(upload_of!(input), &headers, None).await?;
        let (crc32, crc32c, crc64nvme, sha1, sha256) = checksum_fields(&manifest.checksums);
        Ok(S3Response::new(PostObjectOutput {
            version_id,
            e_tag: Some(etag(&manifest.etag)),
            checksum_crc32: crc32,
            checksum_crc32c: crc32c,
            checksum_crc64nvme: crc64nvme,
            checksum_sha1: sha1,
            checksum_sha256: sha256,
            size: Some(manifest.size_bytes as i64),
            ..Default::default()
        }))
    }

    async fn list_buckets(
        &self,
        req: S3Request<ListBucketsInput>,
    ) -> S3Result<S3Response<ListBucketsOutput>> {
        let caller = caller(&req)?;
        let name = self.objects.key(&caller).map(|k| k.name);
        let input = req.input;
        let max_buckets = match input.max_buckets {
            None => usize::MAX,
            Some(max) if (1..=LIST_BUCKETS_MAX).contains(&max) => max as usize,
            Some(max) => {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    format!("max-buckets {max} is not between 1 and {LIST_BUCKETS_MAX}"),
                ))
            }
        };
        // The continuation token is the name of the last bucket of the previous page.
        let after = input.continuation_token.as_deref();
        let mut buckets: Vec<_> = self
            .objects
            .list_buckets_for(&caller)
            .into_iter()
            .filter(|b| {
                input
                    .prefix
                    .as_deref()
                    .is_none_or(|prefix| b.name.starts_with(prefix))
                    && after.is_none_or(|after| b.name.as_str() > after)
            })
            .collect();
        buckets.sort_by(|a, b| a.name.cmp(&b.name));
        let continuation_token =
            (buckets.len() > max_buckets).then(|| buckets[max_buckets - 1].name.clone());
        buckets.truncate(max_buckets);
        let buckets = buckets
            .into_iter()
            .map(|b| Bucket {
                name: Some(b.name),
                creation_date: Some(timestamp(b.created_unix_ms)),
                bucket_region: None,
            })
            .collect();
        Ok(S3Response::new(ListBucketsOutput {
            buckets: Some(buckets),
            owner: Some(Owner {
                display_name: name,
                id: Some(caller),
            }),
            continuation_token,
            prefix: input.prefix,
        }))
    }

    async fn create_bucket(
        &self,
        req: S3Request<CreateBucketInput>,
    ) -> S3Result<S3Response<CreateBucketOutput>> {
        let caller = caller(&req)?;
        let public_read = canned_public_read(req.input.acl.as_ref())?;
        let locked = req.input.object_lock_enabled_for_bucket == Some(true);
        let bucket = req.input.bucket.clone();
        let objects = self.objects.clone();
        let name = bucket.clone();
        blocking(move || {
            if locked {
                objects.create_locked_bucket(&name, &caller, crate::DEFAULT_BUCKET_COMPRESSION)?;
            } else {
                objects.create_bucket(&name, &caller, crate::DEFAULT_BUCKET_COMPRESSION)?;
            }
            // A second change: a crash between the two leaves the bucket private, never the
            // other way round.
            if public_read == Some(true) {
                objects.set_bucket_public_read(&name, true)?;
            }
            Ok(())
        })
        .await?;
        Ok(S3Response::new(CreateBucketOutput {
            location: Some(format!("/{bucket}")),
        }))
    }

    async fn delete_bucket(
        &self,
        req: S3Request<DeleteBucketInput>,
    ) -> S3Result<S3Response<DeleteBucketOutput>> {
        let objects = self.objects.clone();
        let bucket = req.input.bucket.clone();
        blocking(move || objects.delete_bucket(&bucket)).await?;
        Ok(S3Response::new(DeleteBucketOutput {}))
    }

    async fn head_bucket(
        &self,
        req: S3Request<HeadBucketInput>,
    ) -> S3Result<S3Response<HeadBucketOutput>> {
        self.require_bucket(&req.input.bucket)?;
        Ok(S3Response::new(HeadBucketOutput::default()))
    }

    async fn get_bucket_location(
        &self,
        req: S3Request<GetBucketLocationInput>,
    ) -> S3Result<S3Response<GetBucketLocationOutput>> {
        self.require_bucket(&req.input.bucket)?;
        Ok(S3Response::new(GetBucketLocationOutput::default()))
    }

    async fn get_bucket_acl(
        &self,
        req: S3Request<GetBucketAclInput>,
    ) -> S3Result<S3Response<GetBucketAclOutput>> {
        let bucket = req.input.bucket;
        let (owner, grants) = self.acl_of(&bucket, false)?;
        Ok(S3Response::new(GetBucketAclOutput {
            grants: Some(grants),
            owner: Some(owner),
        }))
    }

    async fn put_bucket_acl(
        &self,
        req: S3Request<PutBucketAclInput>,
    ) -> S3Result<S3Response<PutBucketAclOutput>> {
        let input = req.input;
        self.require_bucket(&input.bucket)?;
        let Some(public_read) = canned_public_read(input.acl.as_ref())? else {
            return Err(s3_error!(
                NotImplemented,
                "Keel sets a bucket's ACL only through x-amz-acl: private or public-read"
            ));
        };
        let objects = self.objects.clone();
        blocking(move || objects.set_bucket_public_read(&input.bucket, public_read)).await?;
        Ok(S3Response::new(PutBucketAclOutput::default()))
    }

    async fn put_object_acl(
        &self,
        req: S3Request<PutObjectAclInput>,
    ) -> S3Result<S3Response<PutObjectAclOutput>> {
        let input = req.input;
        check_key(&input.key)?;
        let version = version_of(input.version_id.as_deref())?;
        let Some(public_read) = object_canned_public_read(input.acl.as_ref())? else {
            return Err(s3_error!(
                NotImplemented,
                "Keel sets an object's ACL only through x-amz-acl: private or public-read"
            ));
        };
        let objects = self.objects.clone();
        let (bucket, key) = (input.bucket, input.key);
        blocking(move || objects.set_object_public_read(&bucket, &key, version, public_read))
            .await?;
        Ok(S3Response::new(PutObjectAclOutput::default()))
    }

    async fn get_object_acl(
        &self,
        req: S3Request<GetObjectAclInput>,
    ) -> S3Result<S3Response<GetObjectAclOutput>> {
        let input = req.input;
        let version = version_of(input.version_id.as_deref())?;
        let manifest = self.manifest(&input.bucket, &input.key, version).await?;
        let (owner, grants) = self.acl_of(&input.bucket, manifest.public_read)?;
        Ok(S3Response::new(GetObjectAclOutput {
            grants: Some(grants),
            owner: Some(owner),
            ..GetObjectAclOutput::default()
        }))
    }

    async fn get_bucket_lifecycle_configuration(
        &self,
        req: S3Request<GetBucketLifecycleConfigurationInput>,
    ) -> S3Result<S3Response<GetBucketLifecycleConfigurationOutput>> {
        let rules = self.settings_of(&req.input.bucket)?.lifecycle;
        if rules.is_empty() {
            return Err(s3_error!(
                NoSuchLifecycleConfiguration,
                "The lifecycle configuration does not exist"
            ));
        }
        Ok(S3Response::new(GetBucketLifecycleConfigurationOutput {
            rules: Some(rules.into_iter().map(lifecycle_rule_out).collect()),
            transition_default_minimum_object_size: None,
        }))
    }

    async fn put_bucket_lifecycle_configuration(
        &self,
        req: S3Request<PutBucketLifecycleConfigurationInput>,
    ) -> S3Result<S3Response<PutBucketLifecycleConfigurationOutput>> {
        let input = req.input;
        self.require_bucket(&input.bucket)?;
        let rules = input
            .lifecycle_configuration
            .map(|configuration| configuration.rules)
            .unwrap_or_default()
            .into_iter()
            .map(lifecycle_rule_in)
            .collect::<S3Result<Vec<_>>>()?;
        if rules.is_empty() {
            return Err(s3_error!(
                MalformedXML,
                "a lifecycle configuration needs a Rule"
            ));
        }
        let objects = self.objects.clone();
        blocking(move || objects.set_bucket_lifecycle(&input.bucket, rules)).await?;
        Ok(S3Response::new(
            PutBucketLifecycleConfigurationOutput::default(),
        ))
    }

    async fn delete_bucket_lifecycle(
        &self,
        req: S3Request<DeleteBucketLifecycleInput>,
    ) -> S3Result<S3Response<DeleteBucketLifecycleOutput>> {
        let bucket = req.input.bucket;
        self.require_bucket(&bucket)?;
        let objects = self.objects.clone();
        blocking(move || objects.set_bucket_lifecycle(&bucket, Vec::new())).await?;
        Ok(S3Response::new(DeleteBucketLifecycleOutput::default()))
    }

    async fn get_bucket_tagging(
        &self,
        req: S3Request<GetBucketTaggingInput>,
    ) -> S3Result<S3Response<GetBucketTaggingOutput>> {
        let tags = self.settings_of(&req.input.bucket)?.tags;
        if tags.is_empty() {
            return Err(s3_error!(NoSuchTagSet, "The TagSet does not exist"));
        }
        Ok(S3Response::new(GetBucketTaggingOutput {
            tag_set: tag_set(tags),
        }))
    }

    async fn put_bucket_tagging(
        &self,
        req: S3Request<PutBucketTaggingInput>,
    ) -> S3Result<S3Response<PutBucketTaggingOutput>> {
        let input = req.input;
        self.require_bucket(&input.bucket)?;
        let tags = tag_pairs(input.tagging);
        let objects = self.objects.clone();
        blocking(move || objects.set_bucket_tags(&input.bucket, tags)).await?;
        Ok(S3Response::new(PutBucketTaggingOutput::default()))
    }

    async fn delete_bucket_tagging(
        &self,
        req: S3Request<DeleteBucketTaggingInput>,
    ) -> S3Result<S3Response<DeleteBucketTaggingOutput>> {
        let bucket = req.input.bucket;
        self.require_bucket(&bucket)?;
        let objects = self.objects.clone();
        blocking(move || objects.set_bucket_tags(&bucket, Tags::new())).await?;
        Ok(S3Response::new(DeleteBucketTaggingOutput::default()))
    }

    async fn get_bucket_cors(
        &self,
        req: S3Request<GetBucketCorsInput>,
    ) -> S3Result<S3Response<GetBucketCorsOutput>> {
        let rules = self.settings_of(&req.input.bucket)?.cors;
        if rules.is_empty() {
            return Err(s3_error!(
                NoSuchCORSConfiguration,
                "The CORS configuration does not exist"
            ));
        }
        let optional = |list: Vec<String>| (!list.is_empty()).then_some(list);
        Ok(S3Response::new(GetBucketCorsOutput {
            cors_rules: Some(
                rules
                    .into_iter()
                    .map(|rule| CORSRule {
                        allowed_headers: optional(rule.allowed_headers),
                        allowed_methods: rule.allowed_methods,
                        allowed_origins: rule.allowed_origins,
                        expose_headers: optional(rule.expose_headers),
                        id: rule.id,
                        max_age_seconds: rule.max_age_seconds,
                    })
                    .collect(),
            ),
        }))
    }

    async fn put_bucket_cors(
        &self,
        req: S3Request<PutBucketCorsInput>,
    ) -> S3Result<S3Response<PutBucketCorsOutput>> {
        let input = req.input;
        self.require_bucket(&input.bucket)?;
        let rules: Vec<CorsRule> = input
            .cors_configuration
            .cors_rules
            .into_iter()
            .map(|rule| CorsRule {
                id: rule.id,
                allowed_origins: rule.allowed_origins,
                allowed_methods: rule.allowed_methods,
                allowed_headers: rule.allowed_headers.unwrap_or_default(),
                expose_headers: rule.expose_headers.unwrap_or_default(),
                max_age_seconds: rule.max_age_seconds,
            })
            .collect();
        if rules.is_empty() {
            return Err(s3_error!(
                MalformedXML,
                "a CORS configuration needs a CORSRule"
            ));
        }
        let objects = self.objects.clone();
        blocking(move || objects.set_bucket_cors(&input.bucket, rules)).await?;
        Ok(S3Response::new(PutBucketCorsOutput::default()))
    }

    async fn delete_bucket_cors(
        &self,
        req: S3Request<DeleteBucketCorsInput>,
    ) -> S3Result<S3Response<DeleteBucketCorsOutput>> {
        let bucket = req.input.bucket;
        self.require_bucket(&bucket)?;
        let objects = self.objects.clone();
        blocking(move || objects.set_bucket_cors(&bucket, Vec::new())).await?;
        Ok(S3Response::new(DeleteBucketCorsOutput::default()))
    }

    async fn get_bucket_versioning(
        &self,
        req: S3Request<GetBucketVersioningInput>,
    ) -> S3Result<S3Response<GetBucketVersioningOutput>> {
        self.require_bucket(&req.input.bucket)?;
        let status = match self.objects.versioning(&req.input.bucket) {
            Versioning::Unversioned => None,
            Versioning::Enabled => Some(BucketVersioningStatus::ENABLED),
            Versioning::Suspended => Some(BucketVersioningStatus::SUSPENDED),
        };
        Ok(S3Response::new(GetBucketVersioningOutput {
            status: status.map(BucketVersioningStatus::from_static),
            mfa_delete: None,
        }))
    }

    async fn get_bucket_policy(
        &self,
        req: S3Request<GetBucketPolicyInput>,
    ) -> S3Result<S3Response<GetBucketPolicyOutput>> {
        let policy = self.policy_of(&req.input.bucket)?;
        Ok(S3Response::new(GetBucketPolicyOutput {
            policy: Some(policy),
        }))
    }

    async fn get_bucket_policy_status(
        &self,
        req: S3Request<GetBucketPolicyStatusInput>,
    ) -> S3Result<S3Response<GetBucketPolicyStatusOutput>> {
        let bucket = req.input.bucket;
        let text = self.policy_of(&bucket)?;
        let policy = crate::policy::parse(&bucket, &text).map_err(|reason| {
            S3Error::with_message(
                S3ErrorCode::InternalError,
                format!("the stored bucket policy does not parse: {reason}"),
            )
        })?;
        Ok(S3Response::new(GetBucketPolicyStatusOutput {
            policy_status: Some(PolicyStatus {
                is_public: Some(policy.is_public()),
            }),
        }))
    }

    async fn put_bucket_policy(
        &self,
        req: S3Request<PutBucketPolicyInput>,
    ) -> S3Result<S3Response<PutBucketPolicyOutput>> {
        let input = req.input;
        self.require_bucket(&input.bucket)?;
        crate::policy::parse(&input.bucket, &input.policy).map_err(|reason| {
            S3Error::with_message(
                S3ErrorCode::MalformedPolicy,
                format!("The bucket policy is not accepted: {reason}"),
            )
        })?;
        let objects = self.objects.clone();
        blocking(move || objects.set_bucket_policy(&input.bucket, Some(input.policy))).await?;
        Ok(S3Response::new(PutBucketPolicyOutput::default()))
    }

    async fn delete_bucket_policy(
        &self,
        req: S3Request<DeleteBucketPolicyInput>,
    ) -> S3Result<S3Response<DeleteBucketPolicyOutput>> {
        let bucket = req.input.bucket;
        self.require_bucket(&bucket)?;
        let objects = self.objects.clone();
        blocking(move || objects.set_bucket_policy(&bucket, None)).await?;
        Ok(S3Response::new(DeleteBucketPolicyOutput::default()))
    }

    async fn get_object_lock_configuration(
        &self,
        req: S3Request<GetObjectLockConfigurationInput>,
    ) -> S3Result<S3Response<GetObjectLockConfigurationOutput>> {
        self.require_bucket(&req.input.bucket)?;
        let lock = self
            .objects
            .object_lock(&req.input.bucket)
            .ok_or_else(|| {
                S3Error::with_message(
                    S3ErrorCode::Custom("ObjectLockConfigurationNotFoundError".into()),
                    "Object Lock configuration does not exist for this bucket",
                )
            })
            .map_err(|mut e| {
                e.set_status_code(http::StatusCode::NOT_FOUND);
                e
            })?;
        let rule = lock.default_retention.map(|default| ObjectLockRule {
            default_retention: Some(DefaultRetention {
                mode: Some(ObjectLockRetentionMode::from_static(lock_mode_name(
                    default.mode,
                ))),
                days: default.days.map(|days| days as i32),
                years: default.years.map(|years| years as i32),
            }),
        });
        Ok(S3Response::new(GetObjectLockConfigurationOutput {
            object_lock_configuration: Some(ObjectLockConfiguration {
                object_lock_enabled: Some(ObjectLockEnabled::from_static(
                    ObjectLockEnabled::ENABLED,
                )),
                rule,
            }),
        }))
    }

    async fn put_object_lock_configuration(
        &self,
        req: S3Request<PutObjectLockConfigurationInput>,
    ) -> S3Result<S3Response<PutObjectLockConfigurationOutput>> {
        let input = req.input;
        self.require_bucket(&input.bucket)?;
        let configuration = input.object_lock_configuration.unwrap_or_default();
        if configuration
            .object_lock_enabled
            .as_ref()
            .map(|e| e.as_str())
            != Some(ObjectLockEnabled::ENABLED)
        {
            return Err(s3_error!(
                MalformedXML,
                "ObjectLockEnabled must be Enabled (object lock cannot be disabled)"
            ));
        }
        let default_retention = match configuration.rule.and_then(|rule| rule.default_retention) {
            None => None,
            Some(default) => {
                let mode = default
                    .mode
                    .ok_or_else(|| s3_error!(MalformedXML, "A DefaultRetention needs a Mode"))?;
                let count = |value: Option<i32>| {
                    value
                        .map(|v| {
                            u32::try_from(v).map_err(|_| {
                                s3_error!(InvalidArgument, "Days and Years must be positive")
                            })
                        })
                        .transpose()
                };
                Some(keel_catalog::DefaultRetention {
                    mode: lock_mode(mode.as_str())?,
                    days: count(default.days)?,
                    years: count(default.years)?,
                })
            }
        };
        let objects = self.objects.clone();
        blocking(move || {
            objects.set_object_lock_configuration(
                &input.bucket,
                keel_catalog::ObjectLock { default_retention },
            )
        })
        .await?;
        Ok(S3Response::new(PutObjectLockConfigurationOutput::default()))
    }

    async fn get_object_retention(
        &self,
        req: S3Request<GetObjectRetentionInput>,
    ) -> S3Result<S3Response<GetObjectRetentionOutput>> {
        let input = req.input;
        let version = version_of(input.version_id.as_deref())?;
        let manifest = self.manifest(&input.bucket, &input.key, version).await?;
        let retention = manifest.lock.retention.ok_or_else(|| {
            let mut e = S3Error::with_message(
                S3ErrorCode::Custom("NoSuchObjectLockConfiguration".into()),
                "The specified object does not have a retention configuration",
            );
            e.set_status_code(http::StatusCode::NOT_FOUND);
            e
        })?;
        Ok(S3Response::new(GetObjectRetentionOutput {
            retention: Some(ObjectLockRetention {
                mode: Some(ObjectLockRetentionMode::from_static(lock_mode_name(
                    retention.mode,
                ))),
                retain_until_date: Some(timestamp(retention.until_unix_ms)),
            }),
        }))
    }

    async fn put_object_retention(
        &self,
        req: S3Request<PutObjectRetentionInput>,
    ) -> S3Result<S3Response<PutObjectRetentionOutput>> {
        let input = req.input;
        check_key(&input.key)?;
        let version = version_of(input.version_id.as_deref())?;
        let retention = match input.retention {
            Some(ObjectLockRetention {
                mode: Some(mode),
                retain_until_date: Some(until),
            }) => Some(Retention {
                mode: lock_mode(mode.as_str())?,
                until_unix_ms: unix_ms(&until),
            }),
            Some(ObjectLockRetention {
                mode: None,
                retain_until_date: None,
            })
            | None => None,
            Some(_) => {
                return Err(s3_error!(
                    MalformedXML,
                    "A Retention has both a Mode and a RetainUntilDate, or neither"
                ))
            }
        };
        let bypass = input.bypass_governance_retention == Some(true);
        let objects = self.objects.clone();
        let (bucket, key) = (input.bucket, input.key);
        blocking(move || {
            objects.set_object_lock(
                &bucket,
                &key,
                version,
                LockChange::Retention(retention),
                bypass,
            )
        })
        .await?;
        Ok(S3Response::new(PutObjectRetentionOutput::default()))
    }

    async fn get_object_legal_hold(
        &self,
        req: S3Request<GetObjectLegalHoldInput>,
    ) -> S3Result<S3Response<GetObjectLegalHoldOutput>> {
        let input = req.input;
        let version = version_of(input.version_id.as_deref())?;
        if self.objects.object_lock(&input.bucket).is_none() {
            return Err(s3_error(ObjectError::ObjectLockNotEnabled(input.bucket)));
        }
        let manifest = self.manifest(&input.bucket, &input.key, version).await?;
        let status = if manifest.lock.legal_hold {
            ObjectLockLegalHoldStatus::ON
        } else {
            ObjectLockLegalHoldStatus::OFF
        };
        Ok(S3Response::new(GetObjectLegalHoldOutput {
            legal_hold: Some(ObjectLockLegalHold {
                status: Some(ObjectLockLegalHoldStatus::from_static(status)),
            }),
        }))
    }

    async fn put_object_legal_hold(
        &self,
        req: S3Request<PutObjectLegalHoldInput>,
    ) -> S3Result<S3Response<PutObjectLegalHoldOutput>> {
        let input = req.input;
        check_key(&input.key)?;
        let version = version_of(input.version_id.as_deref())?;
        let on = legal_hold_on(
            input
                .legal_hold
                .as_ref()
                .and_then(|hold| hold.status.as_ref())
                .map(ObjectLockLegalHoldStatus::as_str),
        )?;
        let objects = self.objects.clone();
        let (bucket, key) = (input.bucket, input.key);
        blocking(move || {
            objects.set_object_lock(&bucket, &key, version, LockChange::LegalHold(on), false)
        })
        .await?;
        Ok(S3Response::new(PutObjectLegalHoldOutput::default()))
    }

    async fn put_bucket_versioning(
        &self,
        req: S3Request<PutBucketVersioningInput>,
    ) -> S3Result<S3Response<PutBucketVersioningOutput>> {
        let input = req.input;
        self.require_bucket(&input.bucket)?;
        let configuration = input.versioning_configuration;
        if configuration
            .mfa_delete
            .as_ref()
            .is_some_and(|m| m.as_str() == MFADelete::ENABLED)
        {
            return Err(s3_error!(
                NotImplemented,
                "MFA delete is not supported: Keel has no MFA devices"
            ));
        }
        let enabled = match configuration.status.as_ref().map(|s| s.as_str()) {
            Some(BucketVersioningStatus::ENABLED) => true,
            Some(BucketVersioningStatus::SUSPENDED) => false,
            _ => {
                return Err(s3_error!(
                    MalformedXML,
                    "The versioning Status must be Enabled or Suspended"
                ))
            }
        };
        let objects = self.objects.clone();
        blocking(move || objects.set_bucket_versioning(&input.bucket, enabled)).await?;
        Ok(S3Response::new(PutBucketVersioningOutput::default()))
    }

    async fn put_object(
        &self,
        req: S3Request<PutObjectInput>,
    ) -> S3Result<S3Response<PutObjectOutput>> {
        let S3Request {
            input,
            headers,
            trailing_headers,
            ..
        } = req;
        let (manifest, version_id) = self
            .store_upload(upload_of!(input), &headers, trailing_headers)
            .await?;
        let (crc32, crc32c, crc64nvme, sha1, sha256) = checksum_fields(&manifest.checksums);
        Ok(S3Response::new(PutObjectOutput {
            version_id,
            e_tag: Some(etag(&manifest.etag)),
            checksum_crc32: crc32,
            checksum_crc32c: crc32c,
            checksum_crc64nvme: crc64nvme,
            checksum_sha1: sha1,
            checksum_sha256: sha256,
            size: Some(manifest.size_bytes as i64),
            ..Default::default()
        }))
    }

    async fn get_object(
        &self,
        req: S3Request<GetObjectInput>,
    ) -> S3Result<S3Response<GetObjectOutput>> {
        let input = req.input;
        let version = version_of(input.version_id.as_deref())?;
        let (manifest, pins) = self
            .pinned_manifest(&input.bucket, &input.key, version)
            .await?;
        let conditions = conditions(
            input.if_match.as_ref(),
            input.if_none_match.as_ref(),
            input.if_modified_since.as_ref(),
            input.if_unmodified_since.as_ref(),
        );
        check_conditions(&manifest, &conditions, false)?;
        let (start, end, content_range) =
            resolve_range(&manifest, input.range.as_ref(), input.part_number)?;
        let mut body = ObjectBody::new(self.objects.clone(), &manifest, pins, start, end);
        // Read the first piece before answering, so a corrupt or missing first chunk is a clean
        // 500 rather than a truncated 200.
        let first = match body.next().await {
            Some(Ok(bytes)) => Some(bytes),
            Some(Err(error)) => {
                return Err(S3Error::with_message(
                    S3ErrorCode::InternalError,
                    format!("stored data failed verification and was not returned: {error}"),
                ))
            }
            None => None,
        };
        let stream = futures::stream::iter(first.map(Ok)).chain(body);
        // Checksums describe the whole object: not sent with a range, and only when asked for.
        let checksums = if content_range.is_none() && checksums_wanted(input.checksum_mode.as_ref())
        {
            checksum_fields(&manifest.checksums)
        } else {
            Default::default()
        };
        let (lock_mode, lock_until, legal_hold) = lock_fields(&manifest.lock);
        Ok(S3Response::new(stored_object_output!(
            GetObjectOutput,
            &manifest,
            end - start,
            content_range,
            checksums,
            body: Some(StreamingBlob::wrap(stream)),
            tag_count: (!manifest.tags.is_empty()).then_some(manifest.tags.len() as i32),
            version_id: self.version_header(&input.bucket, &manifest),
            object_lock_mode: lock_mode,
            object_lock_retain_until_date: lock_until,
            object_lock_legal_hold_status: legal_hold,
        )))
    }

    async fn head_object(
        &self,
        req: S3Request<HeadObjectInput>,
    ) -> S3Result<S3Response<HeadObjectOutput>> {
        let input = req.input;
        let version = version_of(input.version_id.as_deref())?;
        let manifest = self.manifest(&input.bucket, &input.key, version).await?;
        let conditions = conditions(
            input.if_match.as_ref(),
            input.if_none_match.as_ref(),
            input.if_modified_since.as_ref(),
            input.if_unmodified_since.as_ref(),
        );
        check_conditions(&manifest, &conditions, false)?;
        let (start, end, content_range) =
            resolve_range(&manifest, input.range.as_ref(), input.part_number)?;
        let checksums = if checksums_wanted(input.checksum_mode.as_ref()) {
            checksum_fields(&manifest.checksums)
        } else {
            Default::default()
        };
        let (lock_mode, lock_until, legal_hold) = lock_fields(&manifest.lock);
        Ok(S3Response::new(stored_object_output!(
            HeadObjectOutput,
            &manifest,
            end - start,
            content_range,
            checksums,
            version_id: self.version_header(&input.bucket, &manifest),
            object_lock_mode: lock_mode,
            object_lock_retain_until_date: lock_until,
            object_lock_legal_hold_status: legal_hold,
        )))
    }

    async fn get_object_tagging(
        &self,
        req: S3Request<GetObjectTaggingInput>,
    ) -> S3Result<S3Response<GetObjectTaggingOutput>> {
        let input = req.input;
        let version = version_of(input.version_id.as_deref())?;
        let manifest = self.manifest(&input.bucket, &input.key, version).await?;
        Ok(S3Response::new(GetObjectTaggingOutput {
            version_id: self.version_header(&input.bucket, &manifest),
            tag_set: tag_set(manifest.tags),
        }))
    }

    async fn put_object_tagging(
        &self,
        req: S3Request<PutObjectTaggingInput>,
    ) -> S3Result<S3Response<PutObjectTaggingOutput>> {
        let input = req.input;
        let tags = tags_from_body(input.tagging)?;
        let version_id = self
            .set_tags(input.bucket, input.key, input.version_id, tags)
            .await?;
        Ok(S3Response::new(PutObjectTaggingOutput { version_id }))
    }

    async fn delete_object_tagging(
        &self,
        req: S3Request<DeleteObjectTaggingInput>,
    ) -> S3Result<S3Response<DeleteObjectTaggingOutput>> {
        let input = req.input;
        let version_id = self
            .set_tags(input.bucket, input.key, input.version_id, Tags::new())
            .await?;
        Ok(S3Response::new(DeleteObjectTaggingOutput { version_id }))
    }

    async fn delete_object(
        &self,
        req: S3Request<DeleteObjectInput>,
    ) -> S3Result<S3Response<DeleteObjectOutput>> {
        check_key(&req.input.key)?;
        let version = version_of(req.input.version_id.as_deref())?;
        let bypass = req.input.bypass_governance_retention == Some(true);
        let objects = self.objects.clone();
        let (bucket, key) = (req.input.bucket, req.input.key);
        let deletion =
            blocking(move || objects.delete_object(&bucket, &key, version, bypass)).await?;
        Ok(S3Response::new(DeleteObjectOutput {
            delete_marker: deletion.delete_marker.then_some(true),
            version_id: deletion.version_id,
            ..Default::default()
        }))
    }

    async fn delete_objects(
        &self,
        req: S3Request<DeleteObjectsInput>,
    ) -> S3Result<S3Response<DeleteObjectsOutput>> {
        let input = req.input;
        if input.delete.objects.len() > DELETE_OBJECTS_MAX {
            return Err(s3_error!(
                MalformedXML,
                "A DeleteObjects request may name at most 1000 keys"
            ));
        }
        self.require_bucket(&input.bucket)?;
        let quiet = input.delete.quiet.unwrap_or(false);
        let bypass = input.bypass_governance_retention == Some(true);
        let named: Vec<(String, Option<String>)> = input
            .delete
            .objects
            .into_iter()
            .map(|o| (o.key, o.version_id))
            .collect();
        let objects = self.objects.clone();
        let bucket = input.bucket.clone();
        let results = blocking(move || {
            Ok(named
                .into_iter()
                .map(|(key, version_id)| {
                    let result = validate_object_key(&key)
                        .and(version_id.as_deref().map(VersionId::parse).transpose())
                        .and_then(|version| objects.delete_object(&bucket, &key, version, bypass));
                    (key, version_id, result)
                })
                .collect::<Vec<_>>())
        })
        .await?;
        let mut deleted = Vec::new();
        let mut errors = Vec::new();
        for (key, version_id, result) in results {
            match result {
                Ok(deletion) => {
                    if !quiet {
                        deleted.push(deleted_object(key, version_id, deletion));
                    }
                }
                Err(error) => {
                    let e = s3_error(error);
                    errors.push(Error {
                        code: Some(e.code().as_str().to_string()),
                        key: Some(key),
                        message: e.message().map(str::to_string),
                        version_id,
                    });
                }
            }
        }
        Ok(S3Response::new(DeleteObjectsOutput {
            deleted: Some(deleted),
            errors: (!errors.is_empty()).then_some(errors),
            ..Default::default()
        }))
    }

    async fn copy_object(
        &self,
        req: S3Request<CopyObjectInput>,
    ) -> S3Result<S3Response<CopyObjectOutput>> {
        let caller = caller(&req)?;
        let input = req.input;
        check_key(&input.key)?;
        let (source_bucket, source_key, source_version) = copy_source_parts(&input.copy_source)?;
        self.check_source_access(
            &caller,
            &source_bucket,
            input.expected_source_bucket_owner.as_deref(),
        )?;
        let replace = input
            .metadata_directive
            .as_ref()
            .is_some_and(|d| d.as_str() == MetadataDirective::REPLACE);
        if source_bucket == input.bucket
            && source_key == input.key
            && source_version.is_none()
            && !replace
        {
            return Err(s3_error!(
                InvalidRequest,
                "This copy request is illegal because it is trying to copy an object to itself without changing the object's metadata"
            ));
        }
        let source = self
            .manifest(&source_bucket, &source_key, source_version)
            .await?;
        let copy_source_version_id = source_version.map(|_| source.version_id());
        let conditions = conditions(
            input.copy_source_if_match.as_ref(),
            input.copy_source_if_none_match.as_ref(),
            input.copy_source_if_modified_since.as_ref(),
            input.copy_source_if_unmodified_since.as_ref(),
        );
        check_conditions(&source, &conditions, true)?;
        let mut manifest = source.clone();
        manifest.modified_unix_ms = now_unix_ms();
        // A copy is a new version: it gets the ACL and lock the request asks for, not the
        // source's.
        manifest.public_read = object_canned_public_read(input.acl.as_ref())?.unwrap_or(false);
        manifest.lock = lock_from_headers(
            input.object_lock_mode.as_ref(),
            input.object_lock_retain_until_date.as_ref(),
            input.object_lock_legal_hold_status.as_ref(),
        )?;
        if input
            .tagging_directive
            .as_ref()
            .is_some_and(|d| d.as_str() == TaggingDirective::REPLACE)
        {
            manifest.tags = tags_from_header(input.tagging.as_deref())?;
        }
        if replace {
            manifest.metadata = user_metadata(input.metadata)?;
            manifest.headers = StoredHeaders {
                content_type: input.content_type,
                content_encoding: input.content_encoding,
                content_disposition: input.content_disposition,
                content_language: input.content_language,
                cache_control: input.cache_control,
                expires_unix_ms: input.expires.as_ref().map(unix_ms),
            };
        }
        let objects = self.objects.clone();
        let (bucket, key) = (input.bucket, input.key);
        let (manifest, version_id) = blocking(move || {
            let mut pins = objects.pin_set();
            objects.pin_manifest(&manifest, &mut pins)?;
            objects.put_object(&bucket, &key, manifest, &PutCondition::default())
        })
        .await?;
        Ok(S3Response::new(CopyObjectOutput {
            version_id,
            copy_source_version_id,
            copy_object_result: Some(CopyObjectResult {
                e_tag: Some(etag(&manifest.etag)),
                last_modified: Some(timestamp(manifest.modified_unix_ms)),
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn list_objects_v2(
        &self,
        req: S3Request<ListObjectsV2Input>,
    ) -> S3Result<S3Response<ListObjectsV2Output>> {
        let input = req.input;
        let prefix = input.prefix.clone().unwrap_or_default();
        let start = match &input.continuation_token {
            Some(token) => Some(decode_token(token).ok_or_else(|| {
                s3_error!(
                    InvalidArgument,
                    "The continuation token provided is incorrect"
                )
            })?),
            None => input
                .start_after
                .clone()
                .filter(|s| !s.is_empty())
                .map(ListStart::AfterKey),
        };
        let max_entries = max_keys(input.max_keys)?;
        let result = self
            .list(
                &input.bucket,
                ListRequest {
                    prefix: prefix.clone(),
                    delimiter: input.delimiter.clone(),
                    start,
                    max_entries,
                },
            )
            .await?;
        let url = input
            .encoding_type
            .as_ref()
            .is_some_and(|e| e.as_str() == EncodingType::URL);
        let encode = |s: &str| if url { url_encode(s) } else { s.to_string() };
        let owner = input.fetch_owner.unwrap_or(false).then(|| Owner {
            id: self.objects.bucket(&input.bucket).map(|b| b.owner),
            display_name: None,
        });
        let key_count = (result.entries.len() + result.common_prefixes.len()) as i32;
        let contents: Vec<Object> = result
            .entries
            .iter()
            .map(|e| Object {
                key: Some(encode(&e.key)),
                size: Some(e.size_bytes as i64),
                e_tag: Some(etag(&e.etag)),
                last_modified: Some(timestamp(e.modified_unix_ms)),
                storage_class: Some(ObjectStorageClass::from_static(
                    ObjectStorageClass::STANDARD,
                )),
                owner: owner.clone(),
                ..Default::default()
            })
            .collect();
        let common_prefixes: Vec<CommonPrefix> = result
            .common_prefixes
            .iter()
            .map(|p| CommonPrefix {
                prefix: Some(encode(p)),
            })
            .collect();
        Ok(S3Response::new(ListObjectsV2Output {
            name: Some(input.bucket),
            prefix: Some(encode(&prefix)),
            delimiter: input.delimiter.as_deref().map(encode),
            max_keys: Some(max_entries as i32),
            key_count: Some(key_count),
            is_truncated: Some(result.truncated),
            continuation_token: input.continuation_token,
            next_continuation_token: result.next.as_ref().map(encode_token),
            start_after: input.start_after.as_deref().map(encode),
            contents: Some(contents),
            common_prefixes: (!common_prefixes.is_empty()).then_some(common_prefixes),
            encoding_type: input.encoding_type,
            ..Default::default()
        }))
    }

    async fn list_objects(
        &self,
        req: S3Request<ListObjectsInput>,
    ) -> S3Result<S3Response<ListObjectsOutput>> {
        let input = req.input;
        let prefix = input.prefix.clone().unwrap_or_default();
        let start =
            list_start_from_marker(input.marker.as_deref(), &prefix, input.delimiter.as_deref());
        let max_entries = max_keys(input.max_keys)?;
        let result = self
            .list(
                &input.bucket,
                ListRequest {
                    prefix: prefix.clone(),
                    delimiter: input.delimiter.clone(),
                    start,
                    max_entries,
                },
            )
            .await?;
        let url = input
            .encoding_type
            .as_ref()
            .is_some_and(|e| e.as_str() == EncodingType::URL);
        let encode = |s: &str| if url { url_encode(s) } else { s.to_string() };
        let next_marker = result.next.as_ref().map(|n| match n {
            ListStart::AfterKey(k) | ListStart::AfterPrefix(k) => encode(k),
        });
        let contents: Vec<Object> = result
            .entries
            .iter()
            .map(|e| Object {
                key: Some(encode(&e.key)),
                size: Some(e.size_bytes as i64),
                e_tag: Some(etag(&e.etag)),
                last_modified: Some(timestamp(e.modified_unix_ms)),
                storage_class: Some(ObjectStorageClass::from_static(
                    ObjectStorageClass::STANDARD,
                )),
                ..Default::default()
            })
            .collect();
        let common_prefixes: Vec<CommonPrefix> = result
            .common_prefixes
            .iter()
            .map(|p| CommonPrefix {
                prefix: Some(encode(p)),
            })
            .collect();
        Ok(S3Response::new(ListObjectsOutput {
            name: Some(input.bucket),
            prefix: Some(encode(&prefix)),
            marker: Some(input.marker.as_deref().map(encode).unwrap_or_default()),
            max_keys: Some(max_entries as i32),
            is_truncated: Some(result.truncated),
            contents: Some(contents),
            common_prefixes: (!common_prefixes.is_empty()).then_some(common_prefixes),
            delimiter: input.delimiter.as_deref().map(encode),
            next_marker,
            encoding_type: input.encoding_type,
            ..Default::default()
        }))
    }

    async fn list_object_versions(
        &self,
        req: S3Request<ListObjectVersionsInput>,
    ) -> S3Result<S3Response<ListObjectVersionsOutput>> {
        let input = req.input;
        let prefix = input.prefix.clone().unwrap_or_default();
        let max_entries = max_keys(input.max_keys)?;
        if input.version_id_marker.is_some() && input.key_marker.as_deref().unwrap_or("").is_empty()
        {
            return Err(s3_error!(
                InvalidArgument,
                "A version-id marker cannot be specified without a key marker"
            ));
        }
        let request = VersionListRequest {
            prefix: prefix.clone(),
            delimiter: input.delimiter.clone(),
            key_marker: input.key_marker.clone(),
            version_id_marker: input.version_id_marker.clone(),
            max_entries,
        };
        let objects = self.objects.clone();
        let bucket = input.bucket.clone();
        let result = blocking(move || objects.list_versions(&bucket, &request)).await?;
        let url = input
            .encoding_type
            .as_ref()
            .is_some_and(|e| e.as_str() == EncodingType::URL);
        let encode = |s: &str| if url { url_encode(s) } else { s.to_string() };
        let (markers, versions): (Vec<&VersionEntry>, Vec<&VersionEntry>) =
            result.entries.iter().partition(|e| e.delete_marker);
        let versions: Vec<ObjectVersion> = versions
            .into_iter()
            .map(|e| ObjectVersion {
                key: Some(encode(&e.key)),
                version_id: Some(e.version_id.clone()),
                is_latest: Some(e.is_latest),
                size: Some(e.size_bytes as i64),
                e_tag: Some(etag(&e.etag)),
                last_modified: Some(timestamp(e.modified_unix_ms)),
                storage_class: Some(ObjectVersionStorageClass::from_static(
                    ObjectVersionStorageClass::STANDARD,
                )),
                ..Default::default()
            })
            .collect();
        let delete_markers: Vec<DeleteMarkerEntry> = markers
            .into_iter()
            .map(|e| DeleteMarkerEntry {
                key: Some(encode(&e.key)),
                version_id: Some(e.version_id.clone()),
                is_latest: Some(e.is_latest),
                last_modified: Some(timestamp(e.modified_unix_ms)),
                owner: None,
            })
            .collect();
        let common_prefixes: Vec<CommonPrefix> = result
            .common_prefixes
            .iter()
            .map(|p| CommonPrefix {
                prefix: Some(encode(p)),
            })
            .collect();
        Ok(S3Response::new(ListObjectVersionsOutput {
            name: Some(input.bucket),
            prefix: Some(encode(&prefix)),
            key_marker: Some(input.key_marker.as_deref().map(encode).unwrap_or_default()),
            version_id_marker: input.version_id_marker,
            max_keys: Some(max_entries as i32),
            is_truncated: Some(result.truncated),
            next_key_marker: result.next_key_marker.as_deref().map(encode),
            next_version_id_marker: result.next_version_id_marker,
            versions: (!versions.is_empty()).then_some(versions),
            delete_markers: (!delete_markers.is_empty()).then_some(delete_markers),
            common_prefixes: (!common_prefixes.is_empty()).then_some(common_prefixes),
            delimiter: input.delimiter.as_deref().map(encode),
            encoding_type: input.encoding_type,
            ..Default::default()
        }))
    }

    async fn create_multipart_upload(
        &self,
        req: S3Request<CreateMultipartUploadInput>,
    ) -> S3Result<S3Response<CreateMultipartUploadOutput>> {
        let input = req.input;
        check_key(&input.key)?;
        let upload_id = crate::keys::random_hex(16);
        let record = UploadRecord {
            key: input.key.clone(),
            upload_id: upload_id.clone(),
            initiated_unix_ms: now_unix_ms(),
            headers: StoredHeaders {
                content_type: input.content_type,
                content_encoding: input.content_encoding,
                content_disposition: input.content_disposition,
                content_language: input.content_language,
                cache_control: input.cache_control,
                expires_unix_ms: input.expires.as_ref().map(unix_ms),
            },
            metadata: user_metadata(input.metadata)?,
            checksum_algorithm: input
                .checksum_algorithm
                .as_ref()
                .map(|a| a.as_str().to_string()),
            tags: tags_from_header(input.tagging.as_deref())?,
            lock: lock_from_headers(
                input.object_lock_mode.as_ref(),
                input.object_lock_retain_until_date.as_ref(),
                input.object_lock_legal_hold_status.as_ref(),
            )?,
            public_read: object_canned_public_read(input.acl.as_ref())?.unwrap_or(false),
        };
        let objects = self.objects.clone();
        let bucket = input.bucket.clone();
        blocking(move || objects.create_upload(&bucket, &record)).await?;
        Ok(S3Response::new(CreateMultipartUploadOutput {
            bucket: Some(input.bucket),
            key: Some(input.key),
            upload_id: Some(upload_id),
            checksum_algorithm: input.checksum_algorithm,
            ..Default::default()
        }))
    }

    async fn upload_part(
        &self,
        req: S3Request<UploadPartInput>,
    ) -> S3Result<S3Response<UploadPartOutput>> {
        let S3Request {
            input,
            headers,
            trailing_headers,
            ..
        } = req;
        let part_number = part_number(input.part_number)?;
        {
            let objects = self.objects.clone();
            let (bucket, key, upload_id) = (
                input.bucket.clone(),
                input.key.clone(),
                input.upload_id.clone(),
            );
            blocking(move || objects.get_upload(&bucket, &key, &upload_id)).await?;
        }
        let request = checksum_request(
            input.checksum_algorithm.as_ref(),
            Checksums {
                crc32: input.checksum_crc32.clone(),
                crc32c: input.checksum_crc32c.clone(),
                crc64nvme: input.checksum_crc64nvme.clone(),
                sha1: input.checksum_sha1.clone(),
                sha256: input.checksum_sha256.clone(),
            },
            input.content_md5.clone(),
            &headers,
        )?;
        let ingested = self
            .ingest_body(
                &input.bucket,
                input.body,
                input.content_length,
                &request,
                false,
                trailing_headers,
            )
            .await?;
        let part = PartRecord {
            part_number,
            size_bytes: ingested.size_bytes,
            etag: ingested.md5_hex.clone(),
            modified_unix_ms: now_unix_ms(),
            chunks: match &ingested.content {
                Content::Chunks(chunks) => chunks.clone(),
                Content::Inline(_) => Vec::new(),
            },
            checksums: ingested.checksums.clone(),
        };
        let pins = ingested.pins;
        let objects = self.objects.clone();
        let (bucket, key, upload_id) = (input.bucket, input.key, input.upload_id);
        let committed = part.clone();
        blocking(move || {
            let result = objects.commit_part(&bucket, &key, &upload_id, &committed);
            drop(pins);
            result
        })
        .await?;
        let (crc32, crc32c, crc64nvme, sha1, sha256) = checksum_fields(&part.checksums);
        Ok(S3Response::new(UploadPartOutput {
            e_tag: Some(etag(&part.etag)),
            checksum_crc32: crc32,
            checksum_crc32c: crc32c,
            checksum_crc64nvme: crc64nvme,
            checksum_sha1: sha1,
            checksum_sha256: sha256,
            ..Default::default()
        }))
    }

    async fn upload_part_copy(
        &self,
        req: S3Request<UploadPartCopyInput>,
    ) -> S3Result<S3Response<UploadPartCopyOutput>> {
        let caller = caller(&req)?;
        let input = req.input;
        let part_number = part_number(input.part_number)?;
        let (source_bucket, source_key, source_version) = copy_source_parts(&input.copy_source)?;
        self.check_source_access(
            &caller,
            &source_bucket,
            input.expected_source_bucket_owner.as_deref(),
        )?;
        {
            let objects = self.objects.clone();
            let (bucket, key, upload_id) = (
                input.bucket.clone(),
                input.key.clone(),
                input.upload_id.clone(),
            );
            blocking(move || objects.get_upload(&bucket, &key, &upload_id)).await?;
        }
        // The source's chunks stay pinned while they are read and re-cut into the part's chunks.
        let (source, source_pins) = self
            .pinned_manifest(&source_bucket, &source_key, source_version)
            .await?;
        let copy_source_version_id = source_version.map(|_| source.version_id());
        let conditions = conditions(
            input.copy_source_if_match.as_ref(),
            input.copy_source_if_none_match.as_ref(),
            input.copy_source_if_modified_since.as_ref(),
            input.copy_source_if_unmodified_since.as_ref(),
        );
        check_conditions(&source, &conditions, true)?;
        let (start, end) = match &input.copy_source_range {
            None => (0, source.size_bytes),
            Some(range) => match parse_copy_range(range) {
                Some((first, last)) if last < source.size_bytes => (first, last + 1),
                _ => {
                    return Err(s3_error!(
                        InvalidRange,
                        "The x-amz-copy-source-range is not satisfiable"
                    ))
                }
            },
        };
        let compression = self
            .objects
            .bucket_compression(&input.bucket)
            .map_err(s3_error)?;
        let body = ObjectBody::new(self.objects.clone(), &source, source_pins, start, end);
        let ingested = ingest(
            self.objects.clone(),
            compression,
            body,
            &ChecksumRequest::default(),
            false,
            PART_SIZE_MAX_BYTES,
            Checksums::default,
        )
        .await?;
        let part = PartRecord {
            part_number,
            size_bytes: ingested.size_bytes,
            etag: ingested.md5_hex.clone(),
            modified_unix_ms: now_unix_ms(),
            chunks: match &ingested.content {
                Content::Chunks(chunks) => chunks.clone(),
                Content::Inline(_) => Vec::new(),
            },
            checksums: Checksums::default(),
        };
        let pins = ingested.pins;
        let objects = self.objects.clone();
        let (bucket, key, upload_id) = (input.bucket, input.key, input.upload_id);
        let committed = part.clone();
        blocking(move || {
            let result = objects.commit_part(&bucket, &key, &upload_id, &committed);
            drop(pins);
            result
        })
        .await?;
        Ok(S3Response::new(UploadPartCopyOutput {
            copy_source_version_id,
            copy_part_result: Some(CopyPartResult {
                e_tag: Some(etag(&part.etag)),
                last_modified: Some(timestamp(part.modified_unix_ms)),
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn complete_multipart_upload(
        &self,
        req: S3Request<CompleteMultipartUploadInput>,
    ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
        let input = req.input;
        let listed = input
            .multipart_upload
            .and_then(|m| m.parts)
            .unwrap_or_default();
        if listed.is_empty() {
            return Err(s3_error!(
                MalformedXML,
                "The XML you provided did not list any part"
            ));
        }
        if listed.len() > PARTS_MAX as usize {
            return Err(S3Error::with_message(
                S3ErrorCode::MalformedXML,
                format!("The XML you provided lists more than {PARTS_MAX} parts"),
            ));
        }
        let mut parts = Vec::with_capacity(listed.len());
        for part in listed {
            let (Some(number), Some(tag)) = (part.part_number, part.e_tag) else {
                return Err(s3_error!(
                    MalformedXML,
                    "Every part needs a PartNumber and an ETag"
                ));
            };
            let number = u32::try_from(number)
                .map_err(|_| s3_error!(InvalidPart, "Part numbers are between 1 and 10000"))?;
            parts.push((number, tag.value().to_string()));
        }
        let condition = PutCondition {
            if_none_match_any: input
                .if_none_match
                .as_ref()
                .is_some_and(ETagCondition::is_any),
            if_match_etag: input
                .if_match
                .as_ref()
                .map(|c| condition_value(c).unwrap_or_else(|| "*".into())),
        };
        let objects = self.objects.clone();
        let (bucket, key, upload_id) = (input.bucket.clone(), input.key.clone(), input.upload_id);
        let (manifest, version_id) = blocking(move || {
            objects.complete_upload(&bucket, &key, &upload_id, &parts, &condition)
        })
        .await?;
        Ok(S3Response::new(CompleteMultipartUploadOutput {
            version_id,
            bucket: Some(input.bucket.clone()),
            key: Some(input.key.clone()),
            location: Some(format!("/{}/{}", input.bucket, input.key)),
            e_tag: Some(etag(&manifest.etag)),
            ..Default::default()
        }))
    }

    async fn abort_multipart_upload(
        &self,
        req: S3Request<AbortMultipartUploadInput>,
    ) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
        let objects = self.objects.clone();
        let input = req.input;
        blocking(move || objects.abort_upload(&input.bucket, &input.key, &input.upload_id)).await?;
        Ok(S3Response::new(AbortMultipartUploadOutput::default()))
    }

    async fn list_parts(
        &self,
        req: S3Request<ListPartsInput>,
    ) -> S3Result<S3Response<ListPartsOutput>> {
        let input = req.input;
        let after: u32 = match input.part_number_marker {
            None => 0,
            Some(marker) => u32::try_from(marker).map_err(|_| {
                s3_error!(InvalidArgument, "part-number-marker must not be negative")
            })?,
        };
        let max_parts = match input.max_parts {
            None => LIST_ENTRIES_MAX,
            Some(n) if n < 0 => {
                return Err(s3_error!(InvalidArgument, "max-parts must not be negative"))
            }
            Some(n) => (n as usize).min(LIST_ENTRIES_MAX),
        };
        let objects = self.objects.clone();
        let (bucket, key, upload_id) = (
            input.bucket.clone(),
            input.key.clone(),
            input.upload_id.clone(),
        );
        let (parts, truncated) =
            blocking(move || objects.list_parts(&bucket, &key, &upload_id, after, max_parts))
                .await?;
        let next = parts.last().map(|p| p.part_number as i32);
        let caller = req.credentials.as_ref().map(|c| c.access_key.clone());
        Ok(S3Response::new(ListPartsOutput {
            bucket: Some(input.bucket),
            key: Some(input.key),
            upload_id: Some(input.upload_id),
            part_number_marker: input.part_number_marker,
            next_part_number_marker: if truncated { next } else { None },
            max_parts: Some(max_parts as i32),
            is_truncated: Some(truncated),
            owner: Some(Owner {
                id: caller.clone(),
                display_name: None,
            }),
            initiator: Some(Initiator {
                id: caller,
                display_name: None,
            }),
            storage_class: Some(StorageClass::from_static(StorageClass::STANDARD)),
            parts: Some(
                parts
                    .into_iter()
                    .map(|p| Part {
                        part_number: Some(p.part_number as i32),
                        e_tag: Some(etag(&p.etag)),
                        size: Some(p.size_bytes as i64),
                        last_modified: Some(timestamp(p.modified_unix_ms)),
                        checksum_crc32: p.checksums.crc32,
                        checksum_crc32c: p.checksums.crc32c,
                        checksum_crc64nvme: p.checksums.crc64nvme,
                        checksum_sha1: p.checksums.sha1,
                        checksum_sha256: p.checksums.sha256,
                    })
                    .collect(),
            ),
            ..Default::default()
        }))
    }

    async fn list_multipart_uploads(
        &self,
        req: S3Request<ListMultipartUploadsInput>,
    ) -> S3Result<S3Response<ListMultipartUploadsOutput>> {
        let input = req.input;
        let prefix = input.prefix.clone().unwrap_or_default();
        let after = input
            .key_marker
            .clone()
            .filter(|k| !k.is_empty())
            .map(|key| {
                (
                    key,
                    input.upload_id_marker.clone().unwrap_or_else(|| "~".into()),
                )
            });
        let max_uploads = match input.max_uploads {
            None => LIST_ENTRIES_MAX,
            Some(n) if n < 0 => {
                return Err(s3_error!(
                    InvalidArgument,
                    "max-uploads must not be negative"
                ))
            }
            Some(n) => (n as usize).min(LIST_ENTRIES_MAX),
        };
        let objects = self.objects.clone();
        let bucket = input.bucket.clone();
        let (uploads, truncated) =
            blocking(move || objects.list_uploads_page(&bucket, &prefix, after, max_uploads))
                .await?;
        let caller = req.credentials.as_ref().map(|c| c.access_key.clone());
        let last = uploads.last().map(|u| (u.key.clone(), u.upload_id.clone()));
        Ok(S3Response::new(ListMultipartUploadsOutput {
            bucket: Some(input.bucket),
            prefix: input.prefix,
            key_marker: input.key_marker,
            upload_id_marker: input.upload_id_marker,
            max_uploads: Some(max_uploads as i32),
            is_truncated: Some(truncated),
            next_key_marker: last.as_ref().filter(|_| truncated).map(|l| l.0.clone()),
            next_upload_id_marker: last.as_ref().filter(|_| truncated).map(|l| l.1.clone()),
            uploads: Some(
                uploads
                    .into_iter()
                    .map(|u| MultipartUpload {
                        key: Some(u.key),
                        upload_id: Some(u.upload_id),
                        initiated: Some(timestamp(u.initiated_unix_ms)),
                        storage_class: Some(StorageClass::from_static(StorageClass::STANDARD)),
                        owner: Some(Owner {
                            id: caller.clone(),
                            display_name: None,
                        }),
                        initiator: Some(Initiator {
                            id: caller.clone(),
                            display_name: None,
                        }),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }))
    }
}

fn part_number(value: i32) -> S3Result<u32> {
    u32::try_from(value)
        .ok()
        .filter(|n| (1..=PARTS_MAX).contains(n))
        .ok_or_else(|| {
            s3_error!(
                InvalidArgument,
                "Part number must be an integer between 1 and 10000, inclusive"
            )
        })
}
