//! S3 versioning: which version of a key is current, which are kept, and how writes, deletes
//! and lookups move between them.
//!
//! A key's current version is its `s3/obj` record, as in an unversioned bucket, so reading the
//! current version costs the same with versioning on. A versioned bucket keeps the others as
//! `s3/ver` records (see [`records`]), newest first:
//! - a write in an `Enabled` bucket moves the current version to `s3/ver` and becomes current
//!   with a new id; in a `Suspended` bucket it becomes the `null` version, replacing the
//!   previous `null` version wherever it was;
//! - a delete without a version id moves the current version to `s3/ver` (or frees it, when it
//!   is the `null` version of a suspended bucket) and adds a delete marker there;
//! - a delete with a version id removes exactly that version; when it was the newest, the next
//!   newest object version (not a delete marker) becomes current again.
//!
//! Every such change, with the refcount changes it causes, is one synced store write made
//! under the key's lock: a crash leaves the key as it was before or after, never between.

use std::collections::HashMap;

use keel_catalog::{ObjectLock, Versioning};
use keel_store::{Compression, WriteOp};

use super::list::LIST_ENTRIES_MAX;
use super::records::{self, Lock, Manifest, Retention, VersionId};
use super::{
    manifest_compression, store_error, validate_object_key, ObjectError, Objects,
    SCAN_BATCH_RECORDS,
};

/// What a delete did, for the response's `x-amz-version-id` and `x-amz-delete-marker`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Deletion {
    /// The version removed or the delete marker added (`None` in a bucket that never had
    /// versioning).
    pub version_id: Option<String>,
    /// Whether a delete marker was added, or the version removed was one.
    pub delete_marker: bool,
}

/// A change to one version's object lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockChange {
    /// A new retention (`None`: none).
    Retention(Option<Retention>),
    LegalHold(bool),
}

const DAY_MS: i64 = 86_400_000;

/// When a default retention of a version written at `written_unix_ms` (on the layer's clock)
/// ends (a year is 365 days).
fn default_retention_from(
    default: &keel_catalog::DefaultRetention,
    written_unix_ms: i64,
) -> Retention {
    let days = default
        .days
        .map(i64::from)
        .or(default.years.map(|years| i64::from(years) * 365))
        .unwrap_or(0);
    Retention {
        mode: default.mode,
        until_unix_ms: written_unix_ms.saturating_add(days * DAY_MS),
    }
}

fn mode_name(mode: keel_catalog::LockMode) -> &'static str {
    match mode {
        keel_catalog::LockMode::Governance => "GOVERNANCE",
        keel_catalog::LockMode::Compliance => "COMPLIANCE",
    }
}

/// A retention given with a write or PutObjectRetention must end after `now_unix_ms`.
fn check_retention_ahead(
    retention: Option<&Retention>,
    now_unix_ms: i64,
) -> Result<(), ObjectError> {
    match retention {
        Some(retention) if retention.until_unix_ms <= now_unix_ms => Err(
            ObjectError::InvalidArgument("the retain-until date must be in the future".into()),
        ),
        _ => Ok(()),
    }
}

/// Where a version stands among its key's versions, for conditional deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct VersionPlace {
    /// The newest version (current, or the delete marker standing for "deleted").
    pub is_latest: bool,
    /// The key's only version.
    pub only: bool,
}

/// A page request of ListObjectVersions.
#[derive(Debug, Clone, Default)]
pub struct VersionListRequest {
    pub prefix: String,
    pub delimiter: Option<String>,
    /// Start after every version of this key, or (with `version_id_marker`) after that version.
    pub key_marker: Option<String>,
    pub version_id_marker: Option<String>,
    /// Clamped to [`LIST_ENTRIES_MAX`].
    pub max_entries: usize,
}

/// One version (or delete marker) in a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionEntry {
    pub key: String,
    pub version_id: String,
    pub is_latest: bool,
    pub delete_marker: bool,
    pub size_bytes: u64,
    pub etag: String,
    pub modified_unix_ms: i64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VersionListResult {
    pub entries: Vec<VersionEntry>,
    pub common_prefixes: Vec<String>,
    pub truncated: bool,
    /// Where the next page starts when `truncated`: key marker and version id marker (none
    /// after a common prefix).
    pub next_key_marker: Option<String>,
    pub next_version_id_marker: Option<String>,
    /// The same place as a name (see [`Objects::list_versions_after`]).
    pub(crate) next_after: Vec<u8>,
}

/// A store record: key and value.
type Record = (Vec<u8>, Vec<u8>);

fn add_refs(deltas: &mut HashMap<[u8; 32], i64>, manifest: &Manifest, delta: i64) {
    for chunk in manifest.content.chunk_refs() {
        *deltas.entry(chunk.hash).or_insert(0) += delta;
    }
}

impl Objects {
    /// A bucket's versioning state (a bucket that does not exist is unversioned).
    pub fn versioning(&self, bucket: &str) -> Versioning {
        self.metadata()
            .catalog()
            .read()
            .bucket_settings
            .get(bucket)
            .map(|settings| settings.versioning)
            .unwrap_or_default()
    }

    /// Enables (true) or suspends a bucket's versioning (refused under object lock).
    pub fn set_bucket_versioning(&self, bucket: &str, enabled: bool) -> Result<(), ObjectError> {
        self.propose(keel_catalog::Command::BucketSetVersioning {
            bucket: bucket.to_string(),
            enabled,
        })
    }

    /// A bucket's object lock configuration (`None`: lock is not enabled).
    pub fn object_lock(&self, bucket: &str) -> Option<ObjectLock> {
        self.metadata()
            .catalog()
            .read()
            .bucket_settings
            .get(bucket)
            .and_then(|settings| settings.object_lock.clone())
    }

    /// Enables object lock on a bucket whose versioning is enabled, or replaces its default
    /// retention.
    pub fn set_object_lock_configuration(
        &self,
        bucket: &str,
        lock: ObjectLock,
    ) -> Result<(), ObjectError> {
        if let Some(default) = &lock.default_retention {
            let valid = match (default.days, default.years) {
                (Some(days), None) => (1..=36_500).contains(&days),
                (None, Some(years)) => (1..=100).contains(&years),
                _ => false,
            };
            if !valid {
                return Err(ObjectError::InvalidArgument(
                    "a default retention has Days (1 to 36500) or Years (1 to 100), not both"
                        .into(),
                ));
            }
        }
        self.propose(keel_catalog::Command::BucketSetObjectLock {
            bucket: bucket.to_string(),
            lock,
        })
    }

    /// Refuses a lock on a new version of a bucket without object lock, or a retention that
    /// has already ended.
    pub(crate) fn check_lock_request(&self, bucket: &str, lock: &Lock) -> Result<(), ObjectError> {
        if lock.is_none() {
            return Ok(());
        }
        self.check_lock_against(bucket, self.object_lock(bucket).as_ref(), lock)
    }

    /// [`Objects::check_lock_request`] with the bucket's lock configuration already read.
    fn check_lock_against(
        &self,
        bucket: &str,
        bucket_lock: Option<&ObjectLock>,
        lock: &Lock,
    ) -> Result<(), ObjectError> {
        if lock.is_none() {
            return Ok(());
        }
        if bucket_lock.is_none() {
            return Err(ObjectError::ObjectLockNotEnabled(bucket.to_string()));
        }
        check_retention_ahead(lock.retention.as_ref(), self.wall_unix_ms())
    }

    /// A sequence number for a new version of `key`: the clock in microseconds, raised above
    /// the last one given out and above the key's newest version (`current`, or else its
    /// newest kept version), so versions stay in order when the clock steps back.
    fn next_version_seq(
        &self,
        bucket: &str,
        key: &str,
        current: Option<&Manifest>,
        versioning: Versioning,
    ) -> Result<u64, ObjectError> {
        let newest = match (current, versioning) {
            (Some(current), _) => current.version_seq,
            (None, Versioning::Unversioned) => 0,
            (None, _) => self
                .newest_kept(bucket, key, None)?
                .map_or(0, |(_, manifest)| manifest.version_seq),
        };
        let now_us = u64::try_from(self.wall_unix_ms())
            .unwrap_or(0)
            .saturating_mul(1000);
        let mut last = self
            .last_version_seq
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let seq = now_us.max(*last + 1).max(newest + 1);
        *last = seq;
        Ok(seq)
    }

    /// Makes `manifest` (an object) the current version of `key`, whose current version is
    /// `current`: gives it its version and adds to `ops` and `deltas` the writes that retire
    /// `current` as the bucket's versioning says. The caller holds the key's lock and commits.
    /// Returns the version id to report.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn install(
        &self,
        bucket: &str,
        key: &str,
        current: Option<&Manifest>,
        manifest: &mut Manifest,
        compression: Compression,
        ops: &mut Vec<WriteOp>,
        deltas: &mut HashMap<[u8; 32], i64>,
    ) -> Result<Option<String>, ObjectError> {
        let versioning = self.versioning(bucket);
        let bucket_lock = self.object_lock(bucket);
        self.check_lock_against(bucket, bucket_lock.as_ref(), &manifest.lock)?;
        manifest.version_seq = self.next_version_seq(bucket, key, current, versioning)?;
        manifest.versioned = versioning == Versioning::Enabled;
        manifest.delete_marker = false;
        if manifest.lock.retention.is_none() {
            manifest.lock.retention = bucket_lock
                .and_then(|lock| lock.default_retention)
                .map(|default| default_retention_from(&default, self.wall_unix_ms()));
        }
        add_refs(deltas, manifest, 1);
        self.retire(bucket, key, current, versioning, compression, ops, deltas)?;
        ops.push(WriteOp::put(
            records::object_key(bucket, key),
            records::encode_manifest(manifest),
            manifest_compression(manifest, compression),
        ));
        Ok((versioning != Versioning::Unversioned).then(|| manifest.version_id()))
    }

    /// The writes that retire `current` before a newer version (or a delete marker) takes its
    /// place: unversioned, it is dropped; enabled, it is kept; suspended, it is kept unless it
    /// is the `null` version, and a kept `null` version is dropped (the new one replaces it).
    /// The `s3/obj` record itself is overwritten or deleted by the caller.
    #[allow(clippy::too_many_arguments)]
    fn retire(
        &self,
        bucket: &str,
        key: &str,
        current: Option<&Manifest>,
        versioning: Versioning,
        compression: Compression,
        ops: &mut Vec<WriteOp>,
        deltas: &mut HashMap<[u8; 32], i64>,
    ) -> Result<(), ObjectError> {
        let keep = |ops: &mut Vec<WriteOp>, old: &Manifest| {
            ops.push(WriteOp::put(
                records::version_key(bucket, key, old.version_seq),
                records::encode_manifest(old),
                manifest_compression(old, compression),
            ))
        };
        match (versioning, current) {
            (Versioning::Unversioned, Some(old)) => add_refs(deltas, old, -1),
            (Versioning::Unversioned, None) => {}
            (Versioning::Enabled, Some(old)) => keep(ops, old),
            (Versioning::Enabled, None) => {}
            (Versioning::Suspended, current) => {
                match current {
                    Some(old) if old.versioned => keep(ops, old),
                    Some(old) => add_refs(deltas, old, -1),
                    None => {}
                }
                if let Some((stored_at, null)) = self.kept_version(bucket, key, VersionId::Null)? {
                    add_refs(deltas, &null, -1);
                    ops.push(WriteOp::Delete { key: stored_at });
                }
            }
        }
        Ok(())
    }

    /// Reads up to `limit` kept versions of `key`, newest first, starting at `from` (a
    /// version record key; `None`: the newest).
    fn kept_versions(
        &self,
        bucket: &str,
        key: &str,
        from: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Record>, ObjectError> {
        let prefix = records::key_versions_prefix(bucket, key);
        let end = records::prefix_end(&prefix).unwrap_or_default();
        let start = from.map_or_else(|| prefix.clone(), <[u8]>::to_vec);
        self.store
            .scan(&start, &end, limit)
            .map_err(|e| store_error("reading the versions of an object", e))
    }

    /// The newest kept version of `key` other than the one stored at `except`.
    fn newest_kept(
        &self,
        bucket: &str,
        key: &str,
        except: Option<&[u8]>,
    ) -> Result<Option<(Vec<u8>, Manifest)>, ObjectError> {
        for (stored_at, value) in self.kept_versions(bucket, key, None, 2)? {
            if Some(stored_at.as_slice()) != except {
                return Ok(Some((stored_at, records::decode_manifest(&value)?)));
            }
        }
        Ok(None)
    }

    /// The kept version of `key` that `id` names, with where it is stored.
    fn kept_version(
        &self,
        bucket: &str,
        key: &str,
        id: VersionId,
    ) -> Result<Option<(Vec<u8>, Manifest)>, ObjectError> {
        match id {
            VersionId::Seq(seq) => {
                let stored_at = records::version_key(bucket, key, seq);
                match self
                    .store
                    .get(&stored_at)
                    .map_err(|e| store_error("reading an object version", e))?
                {
                    Some(value) => {
                        let manifest = records::decode_manifest(&value)?;
                        Ok(manifest.is_version(id).then_some((stored_at, manifest)))
                    }
                    None => Ok(None),
                }
            }
            // At most one `null` version exists; it may be anywhere among the kept ones.
            VersionId::Null => {
                let mut from: Option<Vec<u8>> = None;
                loop {
                    let batch =
                        self.kept_versions(bucket, key, from.as_deref(), SCAN_BATCH_RECORDS)?;
                    let Some((last, _)) = batch.last() else {
                        return Ok(None);
                    };
                    from = Some(records::successor(last));
                    for (stored_at, value) in batch {
                        let manifest = records::decode_manifest(&value)?;
                        if !manifest.versioned {
                            return Ok(Some((stored_at, manifest)));
                        }
                    }
                }
            }
        }
    }

    /// The version of `key` that `version` names (`None`: the current one) and where it is
    /// stored. A missing current version is NoSuchKey (DeleteMarker when a delete marker is
    /// the newest version), a missing named one NoSuchVersion and a named delete marker
    /// DeleteMarker (S3 reads no marker).
    pub(crate) fn locate(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionId>,
    ) -> Result<(Vec<u8>, Manifest), ObjectError> {
        let record_key = records::object_key(bucket, key);
        let current = self.read_manifest_at(&record_key)?;
        let found = match (version, current) {
            (None, Some(current)) => Some((record_key, current)),
            (None, None) => {
                // Deleted in a versioned bucket: say so (S3 answers with the marker's id).
                let marker = match self.versioning(bucket) {
                    Versioning::Unversioned => None,
                    _ => self.newest_kept(bucket, key, None)?,
                };
                return Err(match marker {
                    Some((_, marker)) if marker.delete_marker => ObjectError::DeleteMarker {
                        key: key.to_string(),
                        version_id: marker.version_id(),
                        named: false,
                    },
                    _ => ObjectError::NoSuchKey {
                        bucket: bucket.to_string(),
                        key: key.to_string(),
                    },
                });
            }
            (Some(id), Some(current)) if current.is_version(id) => Some((record_key, current)),
            (Some(id), _) => self.kept_version(bucket, key, id)?,
        };
        match found {
            Some((_, manifest)) if manifest.delete_marker => Err(ObjectError::DeleteMarker {
                key: key.to_string(),
                version_id: manifest.version_id(),
                named: true,
            }),
            Some(found) => Ok(found),
            None => Err(ObjectError::NoSuchVersion {
                key: key.to_string(),
                version_id: version.unwrap_or(VersionId::Null).to_string(),
            }),
        }
    }

    /// Deletes `key`: without a version, its current version (a versioned bucket keeps it and
    /// adds a delete marker); with one, exactly that version, for good, unless object lock
    /// protects it (`bypass_governance` lifts a GOVERNANCE retention).
    pub fn delete_object(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionId>,
        bypass_governance: bool,
    ) -> Result<Deletion, ObjectError> {
        validate_object_key(key)?;
        match version {
            None => Ok(self
                .delete_current_if(bucket, key, |_| true)?
                .unwrap_or_default()),
            Some(id) => self.delete_version(bucket, key, id, bypass_governance),
        }
    }

    /// Changes the object lock of version `version` of `key` (the current one when `None`):
    /// its retention or its legal hold. A retention may always be extended; shortening or
    /// removing it, or turning COMPLIANCE into GOVERNANCE, is refused while it runs (for
    /// GOVERNANCE, unless `bypass_governance`).
    pub fn set_object_lock(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionId>,
        change: LockChange,
        bypass_governance: bool,
    ) -> Result<(), ObjectError> {
        if self.object_lock(bucket).is_none() {
            return match self.bucket(bucket) {
                Some(_) => Err(ObjectError::ObjectLockNotEnabled(bucket.to_string())),
                None => Err(ObjectError::NoSuchBucket(bucket.to_string())),
            };
        }
        self.rewrite_version(bucket, key, version, |manifest| {
            match change {
                LockChange::LegalHold(on) => manifest.lock.legal_hold = on,
                LockChange::Retention(retention) => {
                    let now = self.wall_unix_ms();
                    check_retention_ahead(retention.as_ref(), now)?;
                    if let Some(old) = manifest
                        .lock
                        .retention
                        .filter(|old| old.until_unix_ms > now)
                    {
                        let weaker = match retention {
                            None => true,
                            Some(new) => {
                                new.until_unix_ms < old.until_unix_ms
                                    || (old.mode == keel_catalog::LockMode::Compliance
                                        && new.mode == keel_catalog::LockMode::Governance)
                            }
                        };
                        let allowed =
                            old.mode == keel_catalog::LockMode::Governance && bypass_governance;
                        if weaker && !allowed {
                            return Err(ObjectError::ObjectLocked {
                                key: key.to_string(),
                                version_id: manifest.version_id(),
                                reason: format!(
                                    "its {} retention until {} ms cannot be shortened or removed",
                                    mode_name(old.mode),
                                    old.until_unix_ms
                                ),
                            });
                        }
                    }
                    manifest.lock.retention = retention;
                }
            }
            Ok(())
        })
    }

    /// Deletes the current version of `key` (as [`Objects::delete_object`] without a version)
    /// if it passes `still`, checked under the key's lock so a write after the caller looked is
    /// never deleted in its place; returns whether it deleted.
    pub fn delete_object_if(
        &self,
        bucket: &str,
        key: &str,
        still: impl FnOnce(&Manifest) -> bool,
    ) -> Result<bool, ObjectError> {
        Ok(self
            .delete_current_if(bucket, key, |current| current.is_some_and(still))?
            .is_some())
    }

    /// `None` when `still` refused (given the current version, if any).
    fn delete_current_if(
        &self,
        bucket: &str,
        key: &str,
        still: impl FnOnce(Option<&Manifest>) -> bool,
    ) -> Result<Option<Deletion>, ObjectError> {
        let (entry, _) = self.open_bucket(bucket)?;
        let guard = self.gate(&entry, bucket)?;
        let record_key = records::object_key(bucket, key);
        let _locks = self.lock_keys(&[&record_key]);
        let current = self.read_manifest_at(&record_key)?;
        if !still(current.as_ref()) {
            return Ok(None);
        }
        let versioning = self.versioning(bucket);
        if versioning == Versioning::Unversioned && current.is_none() {
            return Ok(Some(Deletion::default()));
        }
        let mut ops = Vec::new();
        let mut deltas = HashMap::new();
        let seq = self.next_version_seq(bucket, key, current.as_ref(), versioning)?;
        self.retire(
            bucket,
            key,
            current.as_ref(),
            versioning,
            guard.compression,
            &mut ops,
            &mut deltas,
        )?;
        if current.is_some() {
            ops.push(WriteOp::Delete { key: record_key });
        }
        if versioning == Versioning::Unversioned {
            self.commit(ops, deltas)?;
            return Ok(Some(Deletion::default()));
        }
        let marker =
            Manifest::delete_marker(seq, versioning == Versioning::Enabled, self.wall_unix_ms());
        ops.push(WriteOp::put(
            records::version_key(bucket, key, seq),
            records::encode_manifest(&marker),
            Compression::None,
        ));
        self.commit(ops, deltas)?;
        Ok(Some(Deletion {
            version_id: Some(marker.version_id()),
            delete_marker: true,
        }))
    }

    /// Removes version `id` of `key` for good (deleting a version that does not exist does
    /// nothing, as S3's DELETE is idempotent). When it was the newest, the next newest version
    /// becomes current if it is an object.
    fn delete_version(
        &self,
        bucket: &str,
        key: &str,
        id: VersionId,
        bypass_governance: bool,
    ) -> Result<Deletion, ObjectError> {
        let deletion = self.delete_version_if(bucket, key, id, bypass_governance, |_| true)?;
        Ok(deletion.unwrap_or(Deletion {
            version_id: Some(id.to_string()),
            delete_marker: false,
        }))
    }

    /// [`Objects::delete_version`] if the version exists and passes `still`, checked under the
    /// key's lock; `None` otherwise. A version object lock protects is `ObjectLocked`.
    pub(crate) fn delete_version_if(
        &self,
        bucket: &str,
        key: &str,
        id: VersionId,
        bypass_governance: bool,
        still: impl FnOnce(&VersionPlace) -> bool,
    ) -> Result<Option<Deletion>, ObjectError> {
        let (entry, _) = self.open_bucket(bucket)?;
        let guard = self.gate(&entry, bucket)?;
        let record_key = records::object_key(bucket, key);
        let _locks = self.lock_keys(&[&record_key]);
        let current = self.read_manifest_at(&record_key)?;
        let found = match &current {
            Some(current) if current.is_version(id) => Some((record_key.clone(), current.clone())),
            _ => self.kept_version(bucket, key, id)?,
        };
        let Some((stored_at, removed)) = found else {
            return Ok(None);
        };
        let current_goes = stored_at == record_key;
        // The newest other version: it becomes current (if it is an object) when the removed
        // version is current or the newest of a key without a current version.
        let next = if current_goes || current.is_none() {
            let except = (!current_goes).then_some(stored_at.as_slice());
            self.newest_kept(bucket, key, except)?
        } else {
            None
        };
        let is_latest = current_goes
            || (current.is_none()
                && next
                    .as_ref()
                    .is_none_or(|(_, other)| other.version_seq < removed.version_seq));
        let place = VersionPlace {
            is_latest,
            only: current.is_none() && next.is_none(),
        };
        if !still(&place) {
            return Ok(None);
        }
        if let Some(reason) = removed
            .lock
            .refuses_delete(self.wall_unix_ms(), bypass_governance)
        {
            return Err(ObjectError::ObjectLocked {
                key: key.to_string(),
                version_id: removed.version_id(),
                reason,
            });
        }
        let mut ops = vec![WriteOp::Delete {
            key: stored_at.clone(),
        }];
        let mut deltas = HashMap::new();
        add_refs(&mut deltas, &removed, -1);
        if let Some((kept_at, newest)) = next.filter(|_| is_latest) {
            if !newest.delete_marker {
                ops.push(WriteOp::Delete { key: kept_at });
                ops.push(WriteOp::put(
                    record_key,
                    records::encode_manifest(&newest),
                    manifest_compression(&newest, guard.compression),
                ));
            }
        }
        self.commit(ops, deltas)?;
        Ok(Some(Deletion {
            version_id: Some(removed.version_id()),
            delete_marker: removed.delete_marker,
        }))
    }

    /// One page of the versions of `bucket`'s keys (ListObjectVersions): keys in order, each
    /// key's versions newest first, delete markers included.
    pub fn list_versions(
        &self,
        bucket: &str,
        request: &VersionListRequest,
    ) -> Result<VersionListResult, ObjectError> {
        if self.bucket(bucket).is_none() {
            return Err(ObjectError::NoSuchBucket(bucket.to_string()));
        }
        let after = self.list_start(bucket, request)?;
        self.list_versions_after(bucket, request, &after)
    }

    /// [`Objects::list_versions`] from right after `after`, a name as the previous page's
    /// `next_after` gave it (its markers are ignored): unlike a version id marker, a name
    /// still says where to go on when that version was deleted since.
    pub(crate) fn list_versions_after(
        &self,
        bucket: &str,
        request: &VersionListRequest,
        after: &[u8],
    ) -> Result<VersionListResult, ObjectError> {
        let max_entries = request.max_entries.min(LIST_ENTRIES_MAX);
        let delimiter = request.delimiter.as_deref().filter(|d| !d.is_empty());
        // Names: an object key for a current version, the key plus the version suffix for a
        // kept one; both streams are read from `after` on and merged in name order, which puts
        // a key's current version before its kept ones.
        let (after_key, inside_key) = resume_point(after);
        let mut current = Stream::new(records::objects_prefix(bucket), &request.prefix, after);
        let mut kept = Stream::new(records::versions_prefix(bucket), &request.prefix, after);
        let mut result = VersionListResult::default();
        // A listing that resumes inside a key has passed that key's latest version.
        let mut last_key: Option<String> = inside_key
            .then(|| after_key.and_then(|key| std::str::from_utf8(key).ok()))
            .flatten()
            .map(str::to_string);
        let mut count = 0usize;
        loop {
            let from_current = match (current.peek(self)?, kept.peek(self)?) {
                (None, None) => break,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some(a), Some(b)) => a.0 < b.0,
            };
            let stream = if from_current {
                &mut current
            } else {
                &mut kept
            };
            let Some((name, value)) = stream.take() else {
                break;
            };
            let key_bytes = if from_current {
                name.as_slice()
            } else {
                records::split_version_name(&name)
                    .map(|(key, _)| key)
                    .ok_or_else(|| ObjectError::CorruptRecord {
                        what: "object version key in the index".into(),
                        reason: "no version suffix".into(),
                    })?
            };
            let key = std::str::from_utf8(key_bytes).map_err(|_| ObjectError::CorruptRecord {
                what: "object key in the index".into(),
                reason: "not UTF-8".into(),
            })?;
            let rest = key.get(request.prefix.len()..).unwrap_or_default();
            if let Some(position) = delimiter.and_then(|d| rest.find(d).map(|p| p + d.len())) {
                let common = key[..request.prefix.len() + position].to_string();
                // Listed on an earlier page (the listing resumes after it or inside it).
                let listed = after_key.is_some_and(|after| common.as_bytes() <= after);
                if count == max_entries && !listed {
                    result.truncated = true;
                    break;
                }
                match records::prefix_end(common.as_bytes()) {
                    Some(end) => {
                        current.skip_to(&end);
                        kept.skip_to(&end);
                    }
                    None => {
                        current.finish();
                        kept.finish();
                    }
                }
                if listed {
                    continue;
                }
                result.next_after = after_every_version(&common);
                result.next_key_marker = Some(common.clone());
                result.next_version_id_marker = None;
                result.common_prefixes.push(common);
                count += 1;
                continue;
            }
            if count == max_entries {
                result.truncated = true;
                break;
            }
            let manifest = records::decode_manifest(&value)?;
            let version_id = manifest.version_id();
            let is_latest = from_current || last_key.as_deref() != Some(key);
            result.next_version_id_marker = Some(version_id.clone());
            result.entries.push(VersionEntry {
                key: key.to_string(),
                version_id,
                is_latest,
                delete_marker: manifest.delete_marker,
                size_bytes: manifest.size_bytes,
                etag: manifest.etag,
                modified_unix_ms: manifest.modified_unix_ms,
            });
            result.next_key_marker = Some(key.to_string());
            last_key = Some(key.to_string());
            result.next_after = name;
            count += 1;
        }
        if !result.truncated {
            result.next_key_marker = None;
            result.next_version_id_marker = None;
            result.next_after = Vec::new();
        }
        Ok(result)
    }

    /// The name a listing starts after (empty: from the first).
    fn list_start(
        &self,
        bucket: &str,
        request: &VersionListRequest,
    ) -> Result<Vec<u8>, ObjectError> {
        let Some(key) = request.key_marker.as_deref().filter(|k| !k.is_empty()) else {
            return Ok(Vec::new());
        };
        let Some(marker) = request.version_id_marker.as_deref() else {
            return Ok(after_every_version(key));
        };
        let id = VersionId::parse(marker)?;
        let current = self.read_manifest_at(&records::object_key(bucket, key))?;
        if current.is_some_and(|current| current.is_version(id)) {
            return Ok(key.as_bytes().to_vec());
        }
        let seq = match id {
            VersionId::Seq(seq) => seq,
            VersionId::Null => match self.kept_version(bucket, key, id)? {
                Some((_, manifest)) => manifest.version_seq,
                None => {
                    return Err(ObjectError::InvalidArgument(
                        "the version-id-marker names no version of the key-marker".into(),
                    ))
                }
            },
        };
        let mut after = key.as_bytes().to_vec();
        after.push(0);
        after.extend_from_slice(&(!seq).to_be_bytes());
        Ok(after)
    }
}

/// The name right after every version of `key` (the version name of sequence number 0, which
/// no version has): a listing resuming there goes on with the next key.
fn after_every_version(key: &str) -> Vec<u8> {
    let mut after = key.as_bytes().to_vec();
    after.push(0);
    after.extend_from_slice(&[0xff; 8]);
    after
}

/// The key a listing resuming after `after` is at, and whether it resumes inside that key
/// (after its current version or one of its kept ones, not after all of them).
fn resume_point(after: &[u8]) -> (Option<&[u8]>, bool) {
    if after.is_empty() {
        return (None, false);
    }
    match records::split_version_name(after) {
        Some((key, seq)) => (Some(key), seq != 0),
        None => (Some(after), true),
    }
}

/// One of the two record ranges a version listing merges, read a batch at a time; names are
/// the record keys without the range's base.
struct Stream {
    base: Vec<u8>,
    /// The next store key to read from.
    cursor: Vec<u8>,
    end: Vec<u8>,
    buffer: std::collections::VecDeque<Record>,
    exhausted: bool,
}

impl Stream {
    /// Names under `prefix`, after `after` (exclusive; empty: from the first).
    fn new(base: Vec<u8>, prefix: &str, after: &[u8]) -> Stream {
        let mut start = base.clone();
        start.extend_from_slice(prefix.as_bytes());
        let end = records::prefix_end(&start)
            .or_else(|| records::prefix_end(&base))
            .unwrap_or_default();
        let mut cursor = start;
        if !after.is_empty() {
            let mut resume = base.clone();
            resume.extend_from_slice(after);
            cursor = cursor.max(records::successor(&resume));
        }
        Stream {
            base,
            cursor,
            end,
            buffer: Default::default(),
            exhausted: false,
        }
    }

    fn peek(&mut self, objects: &Objects) -> Result<Option<&Record>, ObjectError> {
        if self.buffer.is_empty() && !self.exhausted {
            let batch = if self.cursor < self.end {
                objects
                    .store()
                    .scan(&self.cursor, &self.end, SCAN_BATCH_RECORDS)
                    .map_err(|e| store_error("listing object versions", e))?
            } else {
                Vec::new()
            };
            match batch.last() {
                Some((last, _)) => self.cursor = records::successor(last),
                None => self.exhausted = true,
            }
            let base_len = self.base.len();
            self.buffer.extend(
                batch
                    .into_iter()
                    .map(|(key, value)| (key.get(base_len..).unwrap_or_default().to_vec(), value)),
            );
        }
        Ok(self.buffer.front())
    }

    fn take(&mut self) -> Option<Record> {
        self.buffer.pop_front()
    }

    /// Skips every name before `name`.
    fn skip_to(&mut self, name: &[u8]) {
        while self
            .buffer
            .front()
            .is_some_and(|(next, _)| next.as_slice() < name)
        {
            self.buffer.pop_front();
        }
        if self.buffer.is_empty() {
            let mut key = self.base.clone();
            key.extend_from_slice(name);
            self.cursor = self.cursor.clone().max(key);
        }
    }

    fn finish(&mut self) {
        self.buffer.clear();
        self.exhausted = true;
    }
}
