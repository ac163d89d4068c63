//! S3 buckets, objects, multipart uploads and access keys, as records on the store.
//!
//! An object is a [`Manifest`] (size, ETag, chunk list, headers, metadata, checksums) stored as
//! one `Meta` record under `s3/obj/<bucket>\0<key>`, so listing a prefix is one range scan.
//! Small objects keep their bytes inline in the manifest (one store write per PUT); larger ones
//! are cut into chunks of at most [`CHUNK_SIZE_BYTES`], each stored once under the BLAKE3 hash of
//! its bytes (identical chunks are stored once) through a [`ChunkStore`].
//!
//! Invariants:
//! - a manifest is written with `Durability::Sync` after all its chunks were written, in one
//!   atomic store write together with the refcount changes it causes; an acknowledged PUT is
//!   therefore durable and never points at a missing chunk;
//! - a chunk's refcount counts its occurrences in manifests and part records; a chunk is deleted
//!   when its count reaches zero and no upload in progress pinned it ([`chunks`] explains the
//!   locking); chunks orphaned by a crash or an abandoned upload are freed by
//!   [`Objects::collect_garbage`];
//! - object keys are opaque bytes (UTF-8 as S3 requires): `..` or `/` mean nothing here; a NUL
//!   byte is refused because it separates names in the key layout;
//! - every method blocks (store I/O): async callers run them in `spawn_blocking`.

pub mod chunks;
pub mod cors;
pub mod lifecycle;
pub mod list;
pub mod multipart;
pub mod records;
#[cfg(test)]
mod tests;
pub mod versions;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use keel_catalog::{BucketSettings, CatalogError, Command, CorsRule, Metadata, MetadataError};
use keel_store::{Compression, Durability, Store, StoreError, WriteOp};

pub use chunks::{ChunkStore, LocalChunkStore, PinSet, PinTable, Stripes};
pub use list::{ListEntry, ListRequest, ListResult};
pub use records::{
    BucketRecord, Checksums, ChunkRef, Content, KeyRecord, Lock, Manifest, PartRecord, Retention,
    StoredHeaders, Tags, UploadRecord, VersionId, NULL_VERSION_ID, TAGS_MAX,
};
pub use versions::{Deletion, LockChange, VersionEntry, VersionListRequest, VersionListResult};

/// Largest chunk an object is cut into. Fixed-size chunks: dedup works for identical objects and
/// identical aligned regions; content-defined chunking could come later behind the same manifest.
pub const CHUNK_SIZE_BYTES: usize = 1 << 20;
/// Objects up to this size keep their bytes inside the manifest record.
pub const INLINE_SIZE_MAX_BYTES: usize = 16 << 10;
/// Longest object key S3 allows.
pub const KEY_LENGTH_MAX_BYTES: usize = 1024;
/// Records read per store scan while listing or walking a bucket.
pub const SCAN_BATCH_RECORDS: usize = 1000;
/// Chunk hashes examined per step of garbage collection.
pub const GC_BATCH_CHUNKS: usize = 1024;

/// The object layer's one error type.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("store error while {context}: {source}")]
    Store {
        context: &'static str,
        #[source]
        source: StoreError,
    },
    #[error("corrupt {what}: {reason}")]
    CorruptRecord { what: String, reason: String },
    #[error("chunk {hash_hex} of an object is missing from the store")]
    MissingChunk { hash_hex: String },
    #[error("bucket {0} does not exist")]
    NoSuchBucket(String),
    #[error("object {key:?} does not exist in bucket {bucket}")]
    NoSuchKey { bucket: String, key: String },
    #[error("bucket {0} is not empty")]
    BucketNotEmpty(String),
    #[error("bucket {0} already exists and is owned by another key")]
    BucketAlreadyExists(String),
    #[error("bucket {0} already exists and is yours")]
    BucketAlreadyOwnedByYou(String),
    #[error("invalid bucket name {name:?}: {reason}")]
    InvalidBucketName { name: String, reason: String },
    #[error("cluster metadata is unavailable: {0}")]
    Unavailable(String),
    #[error("object key is longer than {KEY_LENGTH_MAX_BYTES} bytes")]
    KeyTooLong,
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("access key {0} does not exist")]
    NoSuchAccessKey(String),
    #[error("access key {0} already exists")]
    AccessKeyExists(String),
    #[error("multipart upload {0} does not exist")]
    NoSuchUpload(String),
    #[error("invalid part {part_number}: {reason}")]
    InvalidPart { part_number: u32, reason: String },
    #[error("parts are not in ascending order of part number")]
    InvalidPartOrder,
    #[error("part {part_number} is {size_bytes} bytes, below the 5 MiB minimum for all but the last part")]
    EntityTooSmall { part_number: u32, size_bytes: u64 },
    #[error("precondition failed: {0}")]
    PreconditionFailed(&'static str),
    #[error("invalid tag: {0}")]
    InvalidTag(String),
    #[error("invalid version id {0:?}")]
    InvalidVersionId(String),
    #[error("version {version_id} of object {key:?} does not exist")]
    NoSuchVersion { key: String, version_id: String },
    #[error("version {version_id} of object {key:?} cannot be deleted or changed: {reason}")]
    ObjectLocked {
        key: String,
        version_id: String,
        reason: String,
    },
    #[error("bucket {0} has no object lock configuration")]
    ObjectLockNotEnabled(String),
    #[error("bucket {bucket}: {detail}")]
    InvalidBucketState { bucket: String, detail: String },
    /// The version read is a delete marker: the one named (`named`), or the key's newest.
    #[error("version {version_id} of object {key:?} is a delete marker")]
    DeleteMarker {
        key: String,
        version_id: String,
        named: bool,
    },
}

impl ObjectError {
    /// Whether the underlying cause is a full disk.
    pub fn is_no_space(&self) -> bool {
        matches!(self, ObjectError::Store { source, .. } if source.is_no_space())
    }

    /// Whether stored data failed its checksum or a record does not decode: the server must
    /// answer with an error, never with the bytes.
    pub fn is_corrupt(&self) -> bool {
        matches!(
            self,
            ObjectError::Store {
                source: StoreError::Corrupt { .. },
                ..
            } | ObjectError::CorruptRecord { .. }
                | ObjectError::MissingChunk { .. }
        )
    }
}

pub(crate) fn store_error(context: &'static str, source: StoreError) -> ObjectError {
    ObjectError::Store { context, source }
}

pub fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// S3 bucket naming rules (the DNS-compatible ones S3 enforces for new buckets).
pub fn validate_bucket_name(name: &str) -> Result<(), ObjectError> {
    keel_catalog::validate_bucket_name(name).map_err(|error| match error {
        CatalogError::InvalidBucketName { name, reason } => {
            ObjectError::InvalidBucketName { name, reason }
        }
        other => ObjectError::InvalidArgument(other.to_string()),
    })
}

/// Object keys: 1 to 1024 bytes of UTF-8, no NUL. Everything else (`..`, `/`, spaces) is just
/// bytes of a key.
pub fn validate_object_key(key: &str) -> Result<(), ObjectError> {
    if key.is_empty() {
        return Err(ObjectError::InvalidArgument("object key is empty".into()));
    }
    if key.len() > KEY_LENGTH_MAX_BYTES {
        return Err(ObjectError::KeyTooLong);
    }
    if key.as_bytes().contains(&0) {
        return Err(ObjectError::InvalidArgument(
            "object key contains a NUL byte".into(),
        ));
    }
    Ok(())
}

/// Inline objects are small: zstd's per-extent setup costs more than it saves there, so a
/// compressing bucket gets lz4 for their manifests; chunk lists do not compress.
fn manifest_compression(manifest: &Manifest, bucket: Compression) -> Compression {
    match (&manifest.content, bucket) {
        (Content::Inline(_), Compression::None) | (Content::Chunks(_), _) => Compression::None,
        (Content::Inline(_), _) => Compression::Lz4,
    }
}

/// Tag keys S3 accepts, in characters.
const TAG_KEY_MAX_CHARS: usize = 128;
/// Tag values S3 accepts, in characters.
const TAG_VALUE_MAX_CHARS: usize = 256;

/// S3's rules for an object's tags: at most [`TAGS_MAX`], keys of 1 to 128 characters and
/// values of at most 256, each key once.
pub fn validate_tags(tags: &Tags) -> Result<(), ObjectError> {
    validate_tag_set(tags, TAGS_MAX, "an object")
}

/// Most tags a bucket carries (S3's limit).
pub const BUCKET_TAGS_MAX: usize = 50;

pub fn validate_bucket_tags(tags: &Tags) -> Result<(), ObjectError> {
    validate_tag_set(tags, BUCKET_TAGS_MAX, "a bucket")
}

fn validate_tag_set(tags: &Tags, max: usize, owner: &str) -> Result<(), ObjectError> {
    if tags.len() > max {
        return Err(ObjectError::InvalidTag(format!(
            "{owner} may carry at most {max} tags ({} given)",
            tags.len()
        )));
    }
    let mut seen = HashSet::new();
    for (key, value) in tags {
        if key.is_empty() || key.chars().count() > TAG_KEY_MAX_CHARS {
            return Err(ObjectError::InvalidTag(format!(
                "tag keys are 1 to {TAG_KEY_MAX_CHARS} characters ({key:?})"
            )));
        }
        if value.chars().count() > TAG_VALUE_MAX_CHARS {
            return Err(ObjectError::InvalidTag(format!(
                "tag values are at most {TAG_VALUE_MAX_CHARS} characters (the value of {key:?})"
            )));
        }
        if !seen.insert(key.as_str()) {
            return Err(ObjectError::InvalidTag(format!(
                "tag key {key:?} is given more than once"
            )));
        }
    }
    Ok(())
}

pub fn compression_name(compression: Compression) -> &'static str {
    match compression {
        Compression::None => "none",
        Compression::Lz4 => "lz4",
        Compression::Zstd => "zstd",
    }
}

pub fn parse_compression(name: &str) -> Result<Compression, ObjectError> {
    match name {
        "none" => Ok(Compression::None),
        "lz4" => Ok(Compression::Lz4),
        "zstd" => Ok(Compression::Zstd),
        other => Err(ObjectError::InvalidArgument(format!(
            "unknown compression {other:?} (none, lz4, zstd)"
        ))),
    }
}

/// A condition on the object a PUT replaces (`If-None-Match: *`, `If-Match: etag`).
#[derive(Debug, Clone, Default)]
pub struct PutCondition {
    pub if_none_match_any: bool,
    pub if_match_etag: Option<String>,
}

/// What a bucket holds, for `keel bucket info`.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketInfo {
    pub name: String,
    pub owner: String,
    pub grants: Vec<String>,
    pub compression: &'static str,
    pub created_unix_ms: i64,
    pub objects: u64,
    /// Sum of object sizes as clients see them.
    pub logical_bytes: u64,
    /// Bytes after deduplication of chunks within the bucket (inline bytes counted once each).
    pub unique_bytes: u64,
    /// Estimate of bytes on disk: `unique_bytes` divided by the store-wide compression ratio
    /// (the store does not report compressed sizes per key).
    pub stored_bytes_estimate: u64,
    /// `logical_bytes / stored_bytes_estimate`; 1.0 for an empty bucket.
    pub compression_ratio: f64,
    pub uploads_in_progress: u64,
    /// `unversioned`, `enabled` or `suspended`.
    pub versioning: &'static str,
    /// Versions kept besides the current ones: noncurrent versions and delete markers (not in
    /// the byte counts above).
    pub kept_versions: u64,
    pub object_lock: bool,
    pub has_policy: bool,
}

/// What a garbage collection pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub chunks_examined: u64,
    pub chunks_deleted: u64,
}

/// Local state of a bucket this node writes into (the bucket's record is in the catalog).
pub(crate) struct BucketEntry {
    /// Object writes hold it shared; deleting the bucket holds it exclusively, so no object is
    /// committed (on this node) into a bucket being deleted.
    gate: RwLock<()>,
}

/// A bucket held open for an object write: the bucket cannot be deleted until it is dropped.
pub(crate) struct BucketGuard<'a> {
    _gate: RwLockReadGuard<'a, ()>,
    pub(crate) compression: Compression,
}

/// The object layer over one store. Cheap to share (`Arc`); all methods take `&self`.
///
/// Buckets and access keys are catalog records (cluster-wide, changed through
/// [`Metadata::propose`]); manifests, chunks and uploads are records of this node's store.
pub struct Objects {
    store: Store,
    metadata: Arc<dyn Metadata>,
    chunks: Arc<dyn ChunkStore>,
    gates: RwLock<HashMap<String, Arc<BucketEntry>>>,
    key_stripes: Stripes,
    chunk_stripes: Stripes,
    pins: Arc<PinTable>,
    /// Serializes bucket administration done from this node (rare).
    admin: Mutex<()>,
    /// The last version sequence number given out (see [`Manifest::version_seq`]).
    last_version_seq: Mutex<u64>,
    /// The wall clock version order and object lock decisions read (a test moves it).
    clock: Arc<dyn keel_clock::Clock>,
}

fn refusal(error: MetadataError) -> ObjectError {
    match error {
        MetadataError::Refused(refusal) => match refusal {
            CatalogError::NoSuchBucket { name } => ObjectError::NoSuchBucket(name),
            CatalogError::BucketAlreadyExists { name } => ObjectError::BucketAlreadyExists(name),
            CatalogError::BucketAlreadyOwnedByYou { name } => {
                ObjectError::BucketAlreadyOwnedByYou(name)
            }
            CatalogError::InvalidBucketName { name, reason } => {
                ObjectError::InvalidBucketName { name, reason }
            }
            CatalogError::NoSuchAccessKey { access_key_id } => {
                ObjectError::NoSuchAccessKey(access_key_id)
            }
            CatalogError::AccessKeyExists { access_key_id } => {
                ObjectError::AccessKeyExists(access_key_id)
            }
            CatalogError::InvalidBucketState { name, detail } => ObjectError::InvalidBucketState {
                bucket: name,
                detail,
            },
            other => ObjectError::InvalidArgument(other.to_string()),
        },
        other => ObjectError::Unavailable(other.to_string()),
    }
}

impl Objects {
    /// Opens the object layer on `store`, chunks stored locally.
    pub fn open(store: Store, metadata: Arc<dyn Metadata>) -> Result<Arc<Objects>, ObjectError> {
        let chunks = Arc::new(LocalChunkStore::new(store.clone()));
        Objects::open_with_chunks(store, metadata, chunks)
    }

    /// Opens the object layer with chunks placed by `chunks` (the cluster's placement).
    pub fn open_with_chunks(
        store: Store,
        metadata: Arc<dyn Metadata>,
        chunks: Arc<dyn ChunkStore>,
    ) -> Result<Arc<Objects>, ObjectError> {
        Objects::open_with_clock(store, metadata, chunks, Arc::new(keel_clock::SystemClock))
    }

    /// Opens the object layer on `clock` (version order, retention decisions).
    pub fn open_with_clock(
        store: Store,
        metadata: Arc<dyn Metadata>,
        chunks: Arc<dyn ChunkStore>,
        clock: Arc<dyn keel_clock::Clock>,
    ) -> Result<Arc<Objects>, ObjectError> {
        let objects = Arc::new(Objects {
            store,
            metadata,
            chunks,
            gates: RwLock::new(HashMap::new()),
            key_stripes: Stripes::new(),
            chunk_stripes: Stripes::new(),
            pins: Arc::new(PinTable::default()),
            admin: Mutex::new(()),
            last_version_seq: Mutex::new(0),
            clock,
        });
        let owner = Arc::downgrade(&objects);
        objects.pins.set_reaper(Box::new(move |hashes| {
            if let Some(objects) = owner.upgrade() {
                objects.free_unreferenced(hashes);
            }
        }));
        Ok(objects)
    }

    /// Deletes those of `hashes` that no record references and nobody pins: the chunks of a
    /// failed upload (a body error, a size cutoff, a checksum mismatch, a failed condition) are
    /// freed when it gives up, so failing uploads cannot fill the disk. A failure leaves the
    /// chunk to garbage collection.
    fn free_unreferenced(&self, hashes: &[[u8; 32]]) {
        for hash in hashes {
            let _stripe = self.chunk_stripes.lock(vec![Stripes::index_of_chunk(hash)]);
            if self.pins.is_pinned(hash) {
                continue;
            }
            let unreferenced = self
                .store
                .contains(&records::refcount_key(hash))
                .map(|referenced| !referenced);
            let result = match unreferenced {
                Ok(true) => match self.chunks.has_chunk(hash) {
                    Ok(true) => self.chunks.delete_chunk(hash),
                    Ok(false) => Ok(()),
                    Err(error) => Err(error),
                },
                Ok(false) => Ok(()),
                Err(error) => Err(store_error("reading a chunk refcount", error)),
            };
            if let Err(error) = result {
                tracing::warn!(chunk = %hex::encode(hash), %error, "freeing an unreferenced chunk failed");
            }
        }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Now on this layer's wall clock, in ms since the epoch.
    pub fn wall_unix_ms(&self) -> i64 {
        self.clock.wall_unix_ms()
    }

    pub fn metadata(&self) -> &Arc<dyn Metadata> {
        &self.metadata
    }

    fn admin_lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.admin
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn propose(&self, command: Command) -> Result<(), ObjectError> {
        self.metadata.propose(command).map(|_| ()).map_err(refusal)
    }

    // ---- access keys ----

    /// Stores a new access key (the caller generated its id and secret).
    pub fn add_key(&self, record: KeyRecord) -> Result<(), ObjectError> {
        self.propose(Command::KeyAdd { record })
    }

    pub fn key(&self, access_key_id: &str) -> Option<KeyRecord> {
        self.metadata
            .catalog()
            .read()
            .keys
            .get(access_key_id)
            .cloned()
    }

    /// All access keys, sorted by id.
    pub fn list_keys(&self) -> Vec<KeyRecord> {
        self.metadata
            .catalog()
            .read()
            .keys
            .values()
            .cloned()
            .collect()
    }

    /// Deletes an access key. Buckets it owns keep existing (grant them to another key).
    pub fn delete_key(&self, access_key_id: &str) -> Result<(), ObjectError> {
        self.propose(Command::KeyDelete {
            access_key_id: access_key_id.to_string(),
        })
    }

    // ---- buckets ----

    fn entry(&self, bucket: &str) -> Result<Arc<BucketEntry>, ObjectError> {
        if !self.metadata.catalog().read().buckets.contains_key(bucket) {
            return Err(ObjectError::NoSuchBucket(bucket.to_string()));
        }
        if let Some(entry) = self
            .gates
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(bucket)
        {
            return Ok(entry.clone());
        }
        Ok(self
            .gates
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entry(bucket.to_string())
            .or_insert_with(|| {
                Arc::new(BucketEntry {
                    gate: RwLock::new(()),
                })
            })
            .clone())
    }

    /// Creates `name` owned by `owner` (an access key id).
    pub fn create_bucket(
        &self,
        name: &str,
        owner: &str,
        compression: Compression,
    ) -> Result<(), ObjectError> {
        self.create(name, owner, compression, false)
    }

    /// Creates `name` with versioning and object lock enabled (S3's
    /// `x-amz-bucket-object-lock-enabled`), in one metadata change.
    pub fn create_locked_bucket(
        &self,
        name: &str,
        owner: &str,
        compression: Compression,
    ) -> Result<(), ObjectError> {
        self.create(name, owner, compression, true)
    }

    fn create(
        &self,
        name: &str,
        owner: &str,
        compression: Compression,
        locked: bool,
    ) -> Result<(), ObjectError> {
        validate_bucket_name(name)?;
        let _admin = self.admin_lock();
        let (name, owner) = (name.to_string(), owner.to_string());
        let (compression_code, created_unix_ms) = (compression.code(), now_unix_ms());
        self.propose(if locked {
            Command::BucketCreateLocked {
                name,
                owner,
                compression_code,
                created_unix_ms,
            }
        } else {
            Command::BucketCreate {
                name,
                owner,
                compression_code,
                created_unix_ms,
            }
        })
    }

    /// Deletes an empty bucket (no objects, no kept versions or delete markers); multipart
    /// uploads still in progress in it are aborted. (Objects are stored on the node that
    /// received them: the emptiness check covers this node's.)
    pub fn delete_bucket(&self, name: &str) -> Result<(), ObjectError> {
        let _admin = self.admin_lock();
        let entry = self.entry(name)?;
        let _gate = entry
            .gate
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for prefix in [
            records::objects_prefix(name),
            records::versions_prefix(name),
        ] {
            let end = records::prefix_end(&prefix).unwrap_or_default();
            let any = self
                .store
                .keys(&prefix, &end, 1)
                .map_err(|e| store_error("checking that a bucket is empty", e))?;
            if !any.is_empty() {
                return Err(ObjectError::BucketNotEmpty(name.to_string()));
            }
        }
        for upload in self.all_uploads(name)? {
            self.abort_upload_locked(name, &upload.key, &upload.upload_id)?;
        }
        self.propose(Command::BucketDelete {
            name: name.to_string(),
        })?;
        self.gates
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(name);
        Ok(())
    }

    pub fn bucket(&self, name: &str) -> Option<BucketRecord> {
        self.metadata.catalog().read().buckets.get(name).cloned()
    }

    /// All buckets, sorted by name.
    pub fn list_buckets(&self) -> Vec<BucketRecord> {
        self.metadata
            .catalog()
            .read()
            .buckets
            .values()
            .cloned()
            .collect()
    }

    /// Buckets `access_key_id` owns or was granted, sorted by name.
    pub fn list_buckets_for(&self, access_key_id: &str) -> Vec<BucketRecord> {
        self.list_buckets()
            .into_iter()
            .filter(|b| b.owner == access_key_id || b.grants.iter().any(|g| g == access_key_id))
            .collect()
    }

    /// `None` when the bucket does not exist; otherwise whether the key may use it.
    pub fn can_access(&self, bucket: &str, access_key_id: &str) -> Option<bool> {
        self.metadata
            .catalog()
            .read()
            .can_access(bucket, access_key_id)
    }

    /// Grants `access_key_id` full access to `bucket`.
    pub fn allow(&self, bucket: &str, access_key_id: &str) -> Result<(), ObjectError> {
        self.change_grants(bucket, access_key_id, true)
    }

    /// Removes a grant (the owner keeps access).
    pub fn deny(&self, bucket: &str, access_key_id: &str) -> Result<(), ObjectError> {
        self.change_grants(bucket, access_key_id, false)
    }

    fn change_grants(&self, bucket: &str, key: &str, grant: bool) -> Result<(), ObjectError> {
        self.propose(Command::BucketGrant {
            bucket: bucket.to_string(),
            access_key_id: key.to_string(),
            allow: grant,
        })
    }

    /// Changes how new chunks of `bucket` are compressed (existing chunks stay as they are).
    pub fn set_bucket_compression(
        &self,
        bucket: &str,
        compression: Compression,
    ) -> Result<(), ObjectError> {
        self.propose(Command::BucketSetCompression {
            bucket: bucket.to_string(),
            compression_code: compression.code(),
        })
    }

    /// A bucket's tags and CORS rules (none set: `None`).
    pub fn bucket_settings(&self, name: &str) -> Option<BucketSettings> {
        self.metadata
            .catalog()
            .read()
            .bucket_settings
            .get(name)
            .cloned()
    }

    /// Replaces a bucket's tags (empty: removes them).
    pub fn set_bucket_tags(&self, bucket: &str, tags: Tags) -> Result<(), ObjectError> {
        validate_bucket_tags(&tags)?;
        self.propose(Command::BucketSetTags {
            bucket: bucket.to_string(),
            tags,
        })
    }

    /// Sets a bucket's canned ACL: `public-read` (anyone may list and read it) or `private`.
    pub fn set_bucket_public_read(
        &self,
        bucket: &str,
        public_read: bool,
    ) -> Result<(), ObjectError> {
        self.propose(Command::BucketSetPublicRead {
            bucket: bucket.to_string(),
            public_read,
        })
    }

    /// Replaces a bucket's policy document (`None`: removes it). The caller has checked it.
    pub fn set_bucket_policy(
        &self,
        bucket: &str,
        policy: Option<String>,
    ) -> Result<(), ObjectError> {
        self.propose(Command::BucketSetPolicy {
            bucket: bucket.to_string(),
            policy,
        })
    }

    /// A bucket's policy document, if it has one.
    pub fn bucket_policy(&self, bucket: &str) -> Option<String> {
        self.metadata
            .catalog()
            .read()
            .bucket_settings
            .get(bucket)
            .and_then(|settings| settings.policy.clone())
    }

    /// Whether anyone, unsigned, may read `bucket` (its canned ACL is `public-read`).
    pub fn bucket_is_public(&self, bucket: &str) -> bool {
        self.metadata
            .catalog()
            .read()
            .bucket_settings
            .get(bucket)
            .is_some_and(|settings| settings.public_read)
    }

    /// Replaces a bucket's lifecycle rules (empty: removes them).
    pub fn set_bucket_lifecycle(
        &self,
        bucket: &str,
        rules: Vec<keel_catalog::LifecycleRule>,
    ) -> Result<(), ObjectError> {
        lifecycle::validate_lifecycle(&rules)?;
        self.propose(Command::BucketSetLifecycle {
            bucket: bucket.to_string(),
            rules,
        })
    }

    /// Replaces a bucket's CORS rules (empty: removes them).
    pub fn set_bucket_cors(&self, bucket: &str, rules: Vec<CorsRule>) -> Result<(), ObjectError> {
        cors::validate_cors(&rules)?;
        self.propose(Command::BucketSetCors {
            bucket: bucket.to_string(),
            rules,
        })
    }

    /// Counts a bucket's objects and bytes (walks its manifests: O(objects)).
    pub fn bucket_info(&self, name: &str) -> Result<BucketInfo, ObjectError> {
        let record = self
            .bucket(name)
            .ok_or_else(|| ObjectError::NoSuchBucket(name.to_string()))?;
        let mut objects = 0u64;
        let mut logical_bytes = 0u64;
        let mut unique_bytes = 0u64;
        let mut seen: HashSet<[u8; 32]> = HashSet::new();
        let prefix = records::objects_prefix(name);
        let end = records::prefix_end(&prefix).unwrap_or_default();
        let mut cursor = prefix.clone();
        loop {
            let batch = self
                .store
                .scan(&cursor, &end, SCAN_BATCH_RECORDS)
                .map_err(|e| store_error("walking a bucket", e))?;
            let Some((last, _)) = batch.last() else { break };
            cursor = records::successor(last);
            for (_, value) in &batch {
                let manifest = records::decode_manifest(value)?;
                objects += 1;
                logical_bytes += manifest.size_bytes;
                match &manifest.content {
                    Content::Inline(data) => unique_bytes += data.len() as u64,
                    Content::Chunks(chunks) => {
                        for chunk in chunks {
                            if seen.insert(chunk.hash) {
                                unique_bytes += u64::from(chunk.length_bytes);
                            }
                        }
                    }
                }
            }
        }
        let ratio = self
            .store
            .stats()
            .map_err(|e| store_error("reading store statistics", e))?
            .compression_ratio()
            .max(1.0);
        let stored_bytes_estimate = (unique_bytes as f64 / ratio).round() as u64;
        let uploads_in_progress = self.all_uploads(name)?.len() as u64;
        let kept_versions = {
            let prefix = records::versions_prefix(name);
            let end = records::prefix_end(&prefix).unwrap_or_default();
            let mut count = 0u64;
            let mut cursor = prefix;
            loop {
                let batch = self
                    .store
                    .keys(&cursor, &end, SCAN_BATCH_RECORDS)
                    .map_err(|e| store_error("counting a bucket's versions", e))?;
                let Some(last) = batch.last() else { break };
                cursor = records::successor(last);
                count += batch.len() as u64;
            }
            count
        };
        let settings = self.bucket_settings(name).unwrap_or_default();
        Ok(BucketInfo {
            name: record.name,
            owner: record.owner,
            grants: record.grants,
            compression: compression_name(
                Compression::from_code(record.compression_code).unwrap_or_default(),
            ),
            created_unix_ms: record.created_unix_ms,
            objects,
            logical_bytes,
            unique_bytes,
            stored_bytes_estimate,
            compression_ratio: if stored_bytes_estimate == 0 {
                1.0
            } else {
                logical_bytes as f64 / stored_bytes_estimate as f64
            },
            uploads_in_progress,
            versioning: match settings.versioning {
                keel_catalog::Versioning::Unversioned => "unversioned",
                keel_catalog::Versioning::Enabled => "enabled",
                keel_catalog::Versioning::Suspended => "suspended",
            },
            kept_versions,
            object_lock: settings.object_lock.is_some(),
            has_policy: settings.policy.is_some(),
        })
    }

    /// Holds `bucket` open for an object write.
    pub(crate) fn open_bucket(
        &self,
        bucket: &str,
    ) -> Result<(Arc<BucketEntry>, Compression), ObjectError> {
        let entry = self.entry(bucket)?;
        let compression = self.compression_of(bucket)?;
        Ok((entry, compression))
    }

    fn gate<'a>(
        &self,
        entry: &'a BucketEntry,
        bucket: &str,
    ) -> Result<BucketGuard<'a>, ObjectError> {
        let gate = entry
            .gate
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Checked under the gate: a deletion from this node holds it exclusively until the
        // bucket's record is gone.
        let compression = self.compression_of(bucket)?;
        Ok(BucketGuard {
            _gate: gate,
            compression,
        })
    }

    fn compression_of(&self, bucket: &str) -> Result<Compression, ObjectError> {
        let catalog = self.metadata.catalog().read();
        let record = catalog
            .buckets
            .get(bucket)
            .ok_or_else(|| ObjectError::NoSuchBucket(bucket.to_string()))?;
        Ok(Compression::from_code(record.compression_code).unwrap_or_default())
    }

    /// The compression new chunks of `bucket` get.
    pub fn bucket_compression(&self, bucket: &str) -> Result<Compression, ObjectError> {
        Ok(self.open_bucket(bucket)?.1)
    }

    // ---- chunks ----

    /// A new, empty pin set for an upload.
    pub fn pin_set(&self) -> PinSet {
        PinSet::new(self.pins.clone())
    }

    /// Stores one chunk of an upload (skipped when an identical chunk is already stored) and
    /// pins it until `pins` is dropped.
    pub fn write_chunk(
        &self,
        compression: Compression,
        data: Vec<u8>,
        pins: &mut PinSet,
    ) -> Result<ChunkRef, ObjectError> {
        assert!(
            data.len() <= CHUNK_SIZE_BYTES,
            "chunk larger than the chunk size"
        );
        let hash = *blake3::hash(&data).as_bytes();
        let chunk = ChunkRef {
            hash,
            length_bytes: data.len() as u32,
        };
        let exists = {
            let _stripe = self
                .chunk_stripes
                .lock(vec![Stripes::index_of_chunk(&hash)]);
            self.pins.pin(&hash);
            pins.push(hash);
            self.chunks.has_chunk(&hash)?
        };
        if !exists {
            self.chunks.put_chunk(&hash, data, compression)?;
        }
        Ok(chunk)
    }

    /// Pins the chunks of an existing manifest (for copies) and checks they are still stored.
    pub fn pin_manifest(&self, manifest: &Manifest, pins: &mut PinSet) -> Result<(), ObjectError> {
        for chunk in manifest.content.chunk_refs() {
            let _stripe = self
                .chunk_stripes
                .lock(vec![Stripes::index_of_chunk(&chunk.hash)]);
            self.pins.pin(&chunk.hash);
            pins.push(chunk.hash);
            if !self.chunks.has_chunk(&chunk.hash)? {
                return Err(ObjectError::MissingChunk {
                    hash_hex: hex::encode(chunk.hash),
                });
            }
        }
        Ok(())
    }

    /// Reads one chunk of an object and checks its length against the manifest.
    pub fn read_chunk(&self, chunk: &ChunkRef) -> Result<Vec<u8>, ObjectError> {
        let data =
            self.chunks
                .get_chunk(&chunk.hash)?
                .ok_or_else(|| ObjectError::MissingChunk {
                    hash_hex: hex::encode(chunk.hash),
                })?;
        if data.len() != chunk.length_bytes as usize {
            return Err(ObjectError::CorruptRecord {
                what: format!("chunk {}", hex::encode(chunk.hash)),
                reason: format!(
                    "{} bytes stored, {} expected",
                    data.len(),
                    chunk.length_bytes
                ),
            });
        }
        Ok(data)
    }

    /// Applies refcount `deltas` and writes `ops` with them in one synced store write, then
    /// deletes chunks nobody references any more. The caller holds the key stripes of the
    /// records in `ops`.
    fn commit(
        &self,
        mut ops: Vec<WriteOp>,
        deltas: HashMap<[u8; 32], i64>,
    ) -> Result<(), ObjectError> {
        let changed: Vec<([u8; 32], i64)> = deltas
            .into_iter()
            .filter(|(_, delta)| *delta != 0)
            .collect();
        let _stripes = self.chunk_stripes.lock(
            changed
                .iter()
                .map(|(hash, _)| Stripes::index_of_chunk(hash))
                .collect(),
        );
        let mut freed = Vec::new();
        for (hash, delta) in &changed {
            let key = records::refcount_key(hash);
            let current = match self
                .store
                .get(&key)
                .map_err(|e| store_error("reading a chunk refcount", e))?
            {
                Some(bytes) => records::decode_refcount(&bytes)?,
                None => 0,
            };
            let mut next = current as i64 + delta;
            if next < 0 {
                tracing::error!(
                    chunk = %hex::encode(hash),
                    current,
                    delta,
                    "chunk refcount would go negative; clamping to zero"
                );
                next = 0;
            }
            if next == 0 {
                ops.push(WriteOp::Delete { key });
                freed.push(*hash);
            } else {
                ops.push(WriteOp::put(
                    key,
                    records::encode_refcount(next as u64),
                    Compression::None,
                ));
            }
        }
        self.store
            .write(ops, Durability::Sync)
            .map_err(|e| store_error("committing object metadata", e))?;
        for hash in freed {
            if !self.pins.is_pinned(&hash) {
                // A failure here leaves an orphan chunk for garbage collection, not a wrong answer.
                if let Err(error) = self.chunks.delete_chunk(&hash) {
                    tracing::warn!(chunk = %hex::encode(hash), %error, "freeing a chunk failed");
                }
            }
        }
        Ok(())
    }

    fn lock_keys(&self, keys: &[&[u8]]) -> Vec<std::sync::MutexGuard<'_, ()>> {
        self.key_stripes
            .lock(keys.iter().map(|k| Stripes::index_of_bytes(k)).collect())
    }

    fn read_manifest_at(&self, key: &[u8]) -> Result<Option<Manifest>, ObjectError> {
        match self
            .store
            .get(key)
            .map_err(|e| store_error("reading an object manifest", e))?
        {
            Some(bytes) => Ok(Some(records::decode_manifest(&bytes)?)),
            None => Ok(None),
        }
    }

    // ---- objects ----

    /// Makes `manifest` the object `key` of `bucket`, durably: it replaces the current version,
    /// or in a versioned bucket becomes the newest version (see [`versions`]). Returns the
    /// manifest as stored (with its version) and the version id to report (`None` in a bucket
    /// that never had versioning). The chunks it names must have been written with
    /// [`Objects::write_chunk`] (or pinned with [`Objects::pin_manifest`]) by the caller, whose
    /// `PinSet` is still alive.
    pub fn put_object(
        &self,
        bucket: &str,
        key: &str,
        mut manifest: Manifest,
        condition: &PutCondition,
    ) -> Result<(Manifest, Option<String>), ObjectError> {
        validate_object_key(key)?;
        validate_tags(&manifest.tags)?;
        manifest.check()?;
        let (entry, _) = self.open_bucket(bucket)?;
        let guard = self.gate(&entry, bucket)?;
        let record_key = records::object_key(bucket, key);
        let _locks = self.lock_keys(&[&record_key]);
        let old = self.read_manifest_at(&record_key)?;
        check_put_condition(old.as_ref(), condition)?;
        let mut ops = Vec::with_capacity(1);
        let mut deltas: HashMap<[u8; 32], i64> = HashMap::new();
        let version = self.install(
            bucket,
            key,
            old.as_ref(),
            &mut manifest,
            guard.compression,
            &mut ops,
            &mut deltas,
        )?;
        self.commit(ops, deltas)?;
        Ok((manifest, version))
    }

    /// Replaces the tags of object `key` (its current version, or the version named),
    /// durably; nothing else about it changes (not its modification time, as in S3).
    pub fn set_object_tags(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionId>,
        tags: Tags,
    ) -> Result<(), ObjectError> {
        validate_tags(&tags)?;
        self.rewrite_version(bucket, key, version, |manifest| {
            manifest.tags = tags;
            Ok(())
        })
    }

    /// Sets the canned ACL of object `key` (its current version, or the version named):
    /// `public-read` (true) or `private`.
    pub fn set_object_public_read(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionId>,
        public_read: bool,
    ) -> Result<(), ObjectError> {
        self.rewrite_version(bucket, key, version, |manifest| {
            manifest.public_read = public_read;
            Ok(())
        })
    }

    /// Whether anyone, unsigned, may read `key` (the version named, or the current one):
    /// its canned ACL is `public-read`. A missing object is not public.
    pub fn object_is_public(&self, bucket: &str, key: &str, version: Option<VersionId>) -> bool {
        self.locate(bucket, key, version)
            .is_ok_and(|(_, manifest)| manifest.public_read)
    }

    /// Changes one version's record in place under the key's lock (its tags, ACL or lock; never
    /// its bytes), durably.
    pub(crate) fn rewrite_version(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionId>,
        change: impl FnOnce(&mut Manifest) -> Result<(), ObjectError>,
    ) -> Result<(), ObjectError> {
        validate_object_key(key)?;
        let (entry, _) = self.open_bucket(bucket)?;
        let guard = self.gate(&entry, bucket)?;
        let record_key = records::object_key(bucket, key);
        let _locks = self.lock_keys(&[&record_key]);
        let (stored_at, mut manifest) = self.locate(bucket, key, version)?;
        change(&mut manifest)?;
        let ops = vec![WriteOp::put(
            stored_at,
            records::encode_manifest(&manifest),
            manifest_compression(&manifest, guard.compression),
        )];
        self.commit(ops, HashMap::new())
    }

    /// The manifest of `key` in `bucket`: its current version, or the version named.
    pub fn get_manifest(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionId>,
    ) -> Result<Manifest, ObjectError> {
        if self.entry(bucket).is_err() {
            return Err(ObjectError::NoSuchBucket(bucket.to_string()));
        }
        Ok(self.locate(bucket, key, version)?.1)
    }

    /// The manifest of `key` in `bucket` (as [`Objects::get_manifest`] finds it) with its chunks
    /// pinned until the returned set is dropped: a reader streaming the object keeps its bytes
    /// even if the object is overwritten or deleted meanwhile. Read and pinned under the key's
    /// lock, so no overwrite can free a chunk between the two.
    pub fn get_manifest_pinned(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionId>,
    ) -> Result<(Manifest, PinSet), ObjectError> {
        if self.entry(bucket).is_err() {
            return Err(ObjectError::NoSuchBucket(bucket.to_string()));
        }
        let record_key = records::object_key(bucket, key);
        let _locks = self.lock_keys(&[&record_key]);
        let (_, manifest) = self.locate(bucket, key, version)?;
        let mut pins = self.pin_set();
        self.pin_manifest(&manifest, &mut pins)?;
        Ok((manifest, pins))
    }

    /// Frees chunks that no manifest or part references and no upload has pinned (left behind by
    /// a crash between a chunk write and its manifest, or by an abandoned upload).
    pub fn collect_garbage(&self) -> Result<GcReport, ObjectError> {
        let mut report = GcReport::default();
        let mut after: Option<[u8; 32]> = None;
        loop {
            let batch = self.chunks.list_chunks(after.as_ref(), GC_BATCH_CHUNKS)?;
            let Some(last) = batch.last() else { break };
            after = Some(*last);
            for hash in &batch {
                report.chunks_examined += 1;
                let _stripe = self.chunk_stripes.lock(vec![Stripes::index_of_chunk(hash)]);
                if self.pins.is_pinned(hash) {
                    continue;
                }
                let referenced = self
                    .store
                    .contains(&records::refcount_key(hash))
                    .map_err(|e| store_error("reading a chunk refcount", e))?;
                if !referenced {
                    self.chunks.delete_chunk(hash)?;
                    report.chunks_deleted += 1;
                }
            }
        }
        Ok(report)
    }
}

fn check_put_condition(
    old: Option<&Manifest>,
    condition: &PutCondition,
) -> Result<(), ObjectError> {
    if condition.if_none_match_any && old.is_some() {
        return Err(ObjectError::PreconditionFailed(
            "If-None-Match: * and the object exists",
        ));
    }
    if let Some(expected) = &condition.if_match_etag {
        match old {
            Some(old) if &old.etag == expected || expected == "*" => {}
            _ => return Err(ObjectError::PreconditionFailed("If-Match does not match")),
        }
    }
    Ok(())
}
