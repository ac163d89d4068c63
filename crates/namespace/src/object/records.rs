//! The S3 metadata records and where they live in the store's `Meta` keyspace.
//!
//! Access keys (`s3/key/...`) and buckets (`s3/bucket/...`) are catalog records
//! (`keel_catalog::records`). The records of this node's objects:
//!
//! Layout (every key is `meta_key(b"s3/...")`; `\0` separates names because neither bucket names
//! nor object keys may contain a NUL byte, so the separators are unambiguous and a prefix of a
//! bucket's object keys is one contiguous range of the index):
//!
//! | key                                              | value            |
//! | ------------------------------------------------ | ---------------- |
//! | `s3/obj/<bucket>\0<object key>`                  | [`Manifest`]     |
//! | `s3/ver/<bucket>\0<object key>\0<!seq u64 BE>`   | [`Manifest`]     |
//! | `s3/ref/<32-byte chunk hash>`                    | u64 LE refcount  |
//! | `s3/upload/<bucket>\0<object key>\0<upload id>`  | [`UploadRecord`] |
//! | `s3/part/<bucket>\0<upload id>\0<part u32 BE>`   | [`PartRecord`]   |
//!
//! `s3/obj` holds each key's current version; `s3/ver` the versions a versioned bucket keeps
//! besides (noncurrent ones, and delete markers), newest first within a key because the key
//! ends with the bitwise complement of the version's sequence number. A key with no current
//! version in `s3/obj` is absent or deleted: its newest `s3/ver` record, if any, is a delete
//! marker (a write never leaves an object version newer than the current one behind).
//!
//! Every value starts with a format version byte followed by postcard: [`RECORD_VERSION`],
//! for manifests and upload records [`VERSIONED_RECORD_VERSION`] (manifests of versions 1 and
//! 2 decode as unversioned objects, without tags in version 1; upload records of versions 1
//! and 2 without tags or lock). Decoding never panics on arbitrary bytes: it returns
//! [`ObjectError::CorruptRecord`].

use keel_store::meta_key;
use serde::{Deserialize, Serialize};

use super::ObjectError;

/// Format version written as the first byte of a part record.
pub const RECORD_VERSION: u8 = 1;
/// Format version of manifests and upload records when they gained object tags.
pub const TAGGED_RECORD_VERSION: u8 = 2;
/// Format version of manifests, which carry their version and object lock since, and of
/// upload records, which carry object lock since.
pub const VERSIONED_RECORD_VERSION: u8 = 3;

/// An object's tags (`x-amz-tagging`, PutObjectTagging), in the order given; at most
/// [`TAGS_MAX`], keys unique.
pub type Tags = Vec<(String, String)>;
/// Tags an object may carry (S3's limit).
pub const TAGS_MAX: usize = 10;

/// One chunk of an object: the BLAKE3 hash of its bytes (its address in the store) and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    pub hash: [u8; 32],
    pub length_bytes: u32,
}

/// Where an object's bytes are: inline in the manifest (small objects: one store write per PUT)
/// or as a list of content-addressed chunks, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Content {
    Inline(#[serde(with = "raw_bytes")] Vec<u8>),
    Chunks(Vec<ChunkRef>),
}

/// Inline bytes as one byte string instead of a sequence of `u8` values. In postcard both are a
/// varint length and the raw bytes (the format is unchanged); this only skips a serializer call
/// per byte.
mod raw_bytes {
    use serde::de::{Error, SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(bytes)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        struct BytesVisitor;
        impl<'de> Visitor<'de> for BytesVisitor {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::new();
                while let Some(byte) = seq.next_element()? {
                    out.push(byte);
                }
                Ok(out)
            }
        }
        deserializer.deserialize_byte_buf(BytesVisitor)
    }
}

impl Content {
    /// Each chunk occurrence (a chunk used twice counts twice: refcounts count occurrences).
    pub fn chunk_refs(&self) -> &[ChunkRef] {
        match self {
            Content::Inline(_) => &[],
            Content::Chunks(chunks) => chunks,
        }
    }
}

/// HTTP headers S3 stores with an object and returns on GET/HEAD.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredHeaders {
    pub content_type: Option<String>,
    pub content_encoding: Option<String>,
    pub content_disposition: Option<String>,
    pub content_language: Option<String>,
    pub cache_control: Option<String>,
    /// `Expires`, as milliseconds since the Unix epoch.
    pub expires_unix_ms: Option<i64>,
}

/// Checksums the client sent (and the server verified) at upload, base64 as S3 spells them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checksums {
    pub crc32: Option<String>,
    pub crc32c: Option<String>,
    pub crc64nvme: Option<String>,
    pub sha1: Option<String>,
    pub sha256: Option<String>,
}

/// An object: its size, ETag, content, headers, user metadata and checksums.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub size_bytes: u64,
    /// Hex MD5 of the bytes, or for multipart `hex(MD5(part MD5s))-N`; without quotes.
    pub etag: String,
    pub modified_unix_ms: i64,
    pub content: Content,
    /// Sizes of the parts of a multipart object, in order; empty for a single PUT.
    pub part_sizes_bytes: Vec<u64>,
    pub headers: StoredHeaders,
    /// User metadata (`x-amz-meta-*`), names lower-case, sorted.
    pub metadata: Vec<(String, String)>,
    pub checksums: Checksums,
    pub tags: Tags,
    /// Orders a key's versions: unique per key, larger for newer versions (microseconds since
    /// the epoch when written, raised past the key's newest version when the clock is behind).
    pub version_seq: u64,
    /// Whether the version has its own id; otherwise it is the `null` version (written while
    /// the bucket was unversioned or had versioning suspended).
    pub versioned: bool,
    /// A delete marker: no bytes, stands for "deleted" as the newest version of a key.
    pub delete_marker: bool,
    /// Object lock on this version.
    pub lock: Lock,
    /// The version's canned ACL is `public-read`: anyone, unsigned, may read it.
    pub public_read: bool,
}

/// S3 object lock on one version: a retention period and a legal hold; while either holds,
/// the version cannot be deleted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lock {
    pub retention: Option<Retention>,
    pub legal_hold: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retention {
    pub mode: keel_catalog::LockMode,
    /// Until when (ms since the epoch).
    pub until_unix_ms: i64,
}

impl Lock {
    pub fn is_none(&self) -> bool {
        self.retention.is_none() && !self.legal_hold
    }

    /// Why the version cannot be deleted as of `now_unix_ms`, if it cannot: a legal hold, a
    /// compliance retention, or a governance retention not bypassed.
    pub fn refuses_delete(&self, now_unix_ms: i64, bypass_governance: bool) -> Option<String> {
        if self.legal_hold {
            return Some("it is under a legal hold".into());
        }
        match self.retention {
            Some(retention) if retention.until_unix_ms > now_unix_ms => match retention.mode {
                keel_catalog::LockMode::Compliance => {
                    Some("it is under COMPLIANCE retention".into())
                }
                keel_catalog::LockMode::Governance if !bypass_governance => Some(
                    "it is under GOVERNANCE retention (x-amz-bypass-governance-retention \
                     lifts it)"
                        .into(),
                ),
                keel_catalog::LockMode::Governance => None,
            },
            _ => None,
        }
    }
}

/// The version id S3 clients see for a `null` version.
pub const NULL_VERSION_ID: &str = "null";

/// A version as a client names it: `null` or the id of a version with its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionId {
    Null,
    Seq(u64),
}

impl VersionId {
    /// Parses a client's `versionId`: `null` or 16 hex digits.
    pub fn parse(text: &str) -> Result<VersionId, ObjectError> {
        if text == NULL_VERSION_ID {
            return Ok(VersionId::Null);
        }
        if text.len() == 16 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
            if let Ok(seq) = u64::from_str_radix(text, 16) {
                return Ok(VersionId::Seq(seq));
            }
        }
        Err(ObjectError::InvalidVersionId(text.to_string()))
    }
}

impl std::fmt::Display for VersionId {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            VersionId::Null => f.write_str(NULL_VERSION_ID),
            VersionId::Seq(seq) => write!(f, "{seq:016x}"),
        }
    }
}

/// The version of a manifest written before versions existed: the `null` version, ordered
/// by its modification time.
fn unversioned_seq(modified_unix_ms: i64) -> u64 {
    u64::try_from(modified_unix_ms)
        .unwrap_or(0)
        .saturating_mul(1000)
}

/// A manifest as version 2 wrote it: no version.
#[derive(Deserialize)]
struct ManifestV2 {
    size_bytes: u64,
    etag: String,
    modified_unix_ms: i64,
    content: Content,
    part_sizes_bytes: Vec<u64>,
    headers: StoredHeaders,
    metadata: Vec<(String, String)>,
    checksums: Checksums,
    tags: Tags,
}

impl From<ManifestV2> for Manifest {
    fn from(v2: ManifestV2) -> Manifest {
        Manifest {
            size_bytes: v2.size_bytes,
            etag: v2.etag,
            modified_unix_ms: v2.modified_unix_ms,
            content: v2.content,
            part_sizes_bytes: v2.part_sizes_bytes,
            headers: v2.headers,
            metadata: v2.metadata,
            checksums: v2.checksums,
            tags: v2.tags,
            version_seq: unversioned_seq(v2.modified_unix_ms),
            versioned: false,
            delete_marker: false,
            lock: Lock::default(),
            public_read: false,
        }
    }
}

/// A manifest as version 1 wrote it: no tags.
#[derive(Deserialize)]
struct ManifestV1 {
    size_bytes: u64,
    etag: String,
    modified_unix_ms: i64,
    content: Content,
    part_sizes_bytes: Vec<u64>,
    headers: StoredHeaders,
    metadata: Vec<(String, String)>,
    checksums: Checksums,
}

impl From<ManifestV1> for Manifest {
    fn from(v1: ManifestV1) -> Manifest {
        ManifestV2 {
            size_bytes: v1.size_bytes,
            etag: v1.etag,
            modified_unix_ms: v1.modified_unix_ms,
            content: v1.content,
            part_sizes_bytes: v1.part_sizes_bytes,
            headers: v1.headers,
            metadata: v1.metadata,
            checksums: v1.checksums,
            tags: Tags::new(),
        }
        .into()
    }
}

impl Manifest {
    /// A delete marker written at `modified_unix_ms` as version `version_seq`.
    pub fn delete_marker(version_seq: u64, versioned: bool, modified_unix_ms: i64) -> Manifest {
        Manifest {
            size_bytes: 0,
            etag: String::new(),
            modified_unix_ms,
            content: Content::Inline(Vec::new()),
            part_sizes_bytes: Vec::new(),
            headers: StoredHeaders::default(),
            metadata: Vec::new(),
            checksums: Checksums::default(),
            tags: Tags::new(),
            version_seq,
            versioned,
            delete_marker: true,
            lock: Lock::default(),
            public_read: false,
        }
    }

    /// The id clients see: `null` or 16 hex digits of the sequence number.
    pub fn version_id(&self) -> String {
        let id = if self.versioned {
            VersionId::Seq(self.version_seq)
        } else {
            VersionId::Null
        };
        id.to_string()
    }

    /// Whether `id` names this version.
    pub fn is_version(&self, id: VersionId) -> bool {
        match id {
            VersionId::Null => !self.versioned,
            VersionId::Seq(seq) => self.versioned && self.version_seq == seq,
        }
    }

    /// Checks the manifest's internal consistency: chunk lengths add up to the size.
    pub fn check(&self) -> Result<(), ObjectError> {
        let total: u64 = match &self.content {
            Content::Inline(data) => data.len() as u64,
            Content::Chunks(chunks) => chunks.iter().map(|c| u64::from(c.length_bytes)).sum(),
        };
        if total != self.size_bytes {
            return Err(ObjectError::CorruptRecord {
                what: "object manifest".into(),
                reason: format!(
                    "content holds {total} bytes but the manifest says {}",
                    self.size_bytes
                ),
            });
        }
        Ok(())
    }
}

pub use keel_catalog::{BucketRecord, KeyRecord};

/// An in-progress multipart upload: what the completed object will carry besides its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadRecord {
    pub key: String,
    pub upload_id: String,
    pub initiated_unix_ms: i64,
    pub headers: StoredHeaders,
    pub metadata: Vec<(String, String)>,
    /// The checksum algorithm the client announced (`CRC32`, `CRC32C`, `SHA256`, ...), if any.
    pub checksum_algorithm: Option<String>,
    /// The tags the completed object gets (`x-amz-tagging` at creation).
    pub tags: Tags,
    /// The object lock the completed object gets.
    pub lock: Lock,
    /// The canned ACL `public-read` for the completed object.
    pub public_read: bool,
}

/// An upload record as version 2 wrote it: no object lock.
#[derive(Deserialize)]
struct UploadRecordV2 {
    key: String,
    upload_id: String,
    initiated_unix_ms: i64,
    headers: StoredHeaders,
    metadata: Vec<(String, String)>,
    checksum_algorithm: Option<String>,
    tags: Tags,
}

impl From<UploadRecordV2> for UploadRecord {
    fn from(v2: UploadRecordV2) -> UploadRecord {
        UploadRecord {
            key: v2.key,
            upload_id: v2.upload_id,
            initiated_unix_ms: v2.initiated_unix_ms,
            headers: v2.headers,
            metadata: v2.metadata,
            checksum_algorithm: v2.checksum_algorithm,
            tags: v2.tags,
            lock: Lock::default(),
            public_read: false,
        }
    }
}

/// An upload record as version 1 wrote it: no tags.
#[derive(Deserialize)]
struct UploadRecordV1 {
    key: String,
    upload_id: String,
    initiated_unix_ms: i64,
    headers: StoredHeaders,
    metadata: Vec<(String, String)>,
    checksum_algorithm: Option<String>,
}

impl From<UploadRecordV1> for UploadRecord {
    fn from(v1: UploadRecordV1) -> UploadRecord {
        UploadRecordV2 {
            key: v1.key,
            upload_id: v1.upload_id,
            initiated_unix_ms: v1.initiated_unix_ms,
            headers: v1.headers,
            metadata: v1.metadata,
            checksum_algorithm: v1.checksum_algorithm,
            tags: Tags::new(),
        }
        .into()
    }
}

/// One uploaded part of a multipart upload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartRecord {
    pub part_number: u32,
    pub size_bytes: u64,
    /// Hex MD5 of the part's bytes.
    pub etag: String,
    pub modified_unix_ms: i64,
    pub chunks: Vec<ChunkRef>,
    pub checksums: Checksums,
}

/// Records written at [`RECORD_VERSION`] (manifests and upload records have their own
/// functions, at [`TAGGED_RECORD_VERSION`]).
pub trait PlainRecord: Serialize + for<'de> Deserialize<'de> {}

impl PlainRecord for PartRecord {}

/// Serializes a record: version byte, then postcard.
pub fn encode<T: PlainRecord>(record: &T) -> Vec<u8> {
    encode_as(RECORD_VERSION, record)
}

pub fn encode_manifest(manifest: &Manifest) -> Vec<u8> {
    encode_as(VERSIONED_RECORD_VERSION, manifest)
}

pub fn encode_upload(upload: &UploadRecord) -> Vec<u8> {
    encode_as(VERSIONED_RECORD_VERSION, upload)
}

fn encode_as<T: Serialize>(version: u8, record: &T) -> Vec<u8> {
    let mut out = vec![version];
    // postcard only fails on writer errors or unsupported serde shapes; our records are plain
    // structs written to a Vec, so a failure is a programming error.
    let body = postcard::to_allocvec(record).expect("postcard encodes plain records into a Vec");
    out.extend_from_slice(&body);
    out
}

/// Parses a record written by [`encode`]; `what` names it in the error.
pub fn decode<T: PlainRecord>(bytes: &[u8], what: &str) -> Result<T, ObjectError> {
    match split_version(bytes, what)? {
        (RECORD_VERSION, body) => decode_body(body, what),
        (version, _) => Err(unknown_version(what, version)),
    }
}

/// Decodes a manifest (any version) and checks it.
pub fn decode_manifest(bytes: &[u8]) -> Result<Manifest, ObjectError> {
    const WHAT: &str = "object manifest";
    let manifest: Manifest = match split_version(bytes, WHAT)? {
        (RECORD_VERSION, body) => decode_body::<ManifestV1>(body, WHAT)?.into(),
        (TAGGED_RECORD_VERSION, body) => decode_body::<ManifestV2>(body, WHAT)?.into(),
        (VERSIONED_RECORD_VERSION, body) => decode_body(body, WHAT)?,
        (version, _) => return Err(unknown_version(WHAT, version)),
    };
    manifest.check()?;
    Ok(manifest)
}

/// Decodes an upload record (either version).
pub fn decode_upload(bytes: &[u8]) -> Result<UploadRecord, ObjectError> {
    const WHAT: &str = "multipart upload record";
    match split_version(bytes, WHAT)? {
        (RECORD_VERSION, body) => Ok(decode_body::<UploadRecordV1>(body, WHAT)?.into()),
        (TAGGED_RECORD_VERSION, body) => Ok(decode_body::<UploadRecordV2>(body, WHAT)?.into()),
        (VERSIONED_RECORD_VERSION, body) => decode_body(body, WHAT),
        (version, _) => Err(unknown_version(WHAT, version)),
    }
}

fn split_version<'a>(bytes: &'a [u8], what: &str) -> Result<(u8, &'a [u8]), ObjectError> {
    bytes
        .split_first()
        .map(|(version, body)| (*version, body))
        .ok_or_else(|| ObjectError::CorruptRecord {
            what: what.to_string(),
            reason: "empty record".into(),
        })
}

fn decode_body<T: for<'de> Deserialize<'de>>(body: &[u8], what: &str) -> Result<T, ObjectError> {
    postcard::from_bytes(body).map_err(|error| ObjectError::CorruptRecord {
        what: what.to_string(),
        reason: error.to_string(),
    })
}

fn unknown_version(what: &str, version: u8) -> ObjectError {
    ObjectError::CorruptRecord {
        what: what.to_string(),
        reason: format!("unknown record version {version}"),
    }
}

pub fn encode_refcount(count: u64) -> Vec<u8> {
    count.to_le_bytes().to_vec()
}

pub fn decode_refcount(bytes: &[u8]) -> Result<u64, ObjectError> {
    let array: [u8; 8] = bytes.try_into().map_err(|_| ObjectError::CorruptRecord {
        what: "chunk refcount".into(),
        reason: format!("{} bytes instead of 8", bytes.len()),
    })?;
    Ok(u64::from_le_bytes(array))
}

// ---- key layout ----

/// Prefix of all object manifests of `bucket`: `s3/obj/<bucket>\0`.
pub fn objects_prefix(bucket: &str) -> Vec<u8> {
    let mut key = meta_key(b"s3/obj/");
    key.extend_from_slice(bucket.as_bytes());
    key.push(0);
    key
}

pub fn object_key(bucket: &str, key: &str) -> Vec<u8> {
    let mut out = objects_prefix(bucket);
    out.extend_from_slice(key.as_bytes());
    out
}

/// Prefix of every kept version of every key of `bucket`: `s3/ver/<bucket>\0`.
pub fn versions_prefix(bucket: &str) -> Vec<u8> {
    let mut key = meta_key(b"s3/ver/");
    key.extend_from_slice(bucket.as_bytes());
    key.push(0);
    key
}

/// Prefix of the kept versions of `key`: `s3/ver/<bucket>\0<key>\0`.
pub fn key_versions_prefix(bucket: &str, key: &str) -> Vec<u8> {
    let mut out = versions_prefix(bucket);
    out.extend_from_slice(key.as_bytes());
    out.push(0);
    out
}

/// Bytes a version record's name adds after its object key: `\0` and the complemented seq.
pub const VERSION_SUFFIX_BYTES: usize = 9;

/// Where version `version_seq` of `key` is kept; newer versions sort first.
pub fn version_key(bucket: &str, key: &str, version_seq: u64) -> Vec<u8> {
    let mut out = key_versions_prefix(bucket, key);
    out.extend_from_slice(&(!version_seq).to_be_bytes());
    out
}

/// Splits the name of a version record (its key after [`versions_prefix`]) into the object
/// key and the version's sequence number.
pub fn split_version_name(name: &[u8]) -> Option<(&[u8], u64)> {
    let split = name.len().checked_sub(VERSION_SUFFIX_BYTES)?;
    let (key, suffix) = name.split_at(split);
    let (nul, seq) = suffix.split_first()?;
    let seq: [u8; 8] = seq.try_into().ok()?;
    (*nul == 0).then_some((key, !u64::from_be_bytes(seq)))
}

pub fn refcount_key(hash: &[u8; 32]) -> Vec<u8> {
    let mut key = meta_key(b"s3/ref/");
    key.extend_from_slice(hash);
    key
}

pub fn uploads_prefix(bucket: &str) -> Vec<u8> {
    let mut key = meta_key(b"s3/upload/");
    key.extend_from_slice(bucket.as_bytes());
    key.push(0);
    key
}

pub fn upload_key(bucket: &str, key: &str, upload_id: &str) -> Vec<u8> {
    let mut out = uploads_prefix(bucket);
    out.extend_from_slice(key.as_bytes());
    out.push(0);
    out.extend_from_slice(upload_id.as_bytes());
    out
}

pub fn parts_prefix(bucket: &str, upload_id: &str) -> Vec<u8> {
    let mut key = meta_key(b"s3/part/");
    key.extend_from_slice(bucket.as_bytes());
    key.push(0);
    key.extend_from_slice(upload_id.as_bytes());
    key.push(0);
    key
}

pub fn part_key(bucket: &str, upload_id: &str, part_number: u32) -> Vec<u8> {
    let mut key = parts_prefix(bucket, upload_id);
    key.extend_from_slice(&part_number.to_be_bytes());
    key
}

/// The smallest key greater than every key that starts with `prefix`, or `None` when no such
/// key exists (the prefix is all `0xff`).
pub fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

/// The smallest key strictly greater than `key`.
pub fn successor(key: &[u8]) -> Vec<u8> {
    let mut out = key.to_vec();
    out.push(0);
    out
}
