//! Block volumes: thin-provisioned 4 KiB-block disks on the store, with instant copy-on-write
//! snapshots, clones, rollback, resize, QoS limits and send/receive streams.
//!
//! Layout (design in `docs/volumes.md`): block `b` of volume `v` written in generation `g` is one
//! store extent at `block_key(v, b, g)`; an empty value is a hole marker (reads as zeroes and hides
//! older generations). A snapshot freezes the current generation and the volume moves on to a new
//! one; what a volume, snapshot or clone sees is a [`view`]: per layer (the volume, then the
//! parents a clone falls through to) the newest generation, the generation ranges it skips
//! (rollback, unfinished receive) and the truncations a shrink left.
//!
//! Invariants:
//! - the current generation of a volume is never seen by any snapshot: writes in it never change
//!   a snapshot, so snapshots are frozen without copying anything;
//! - every generation is handed out once per volume (`generation_next` is persisted before any
//!   extent of a new generation is written), so leftovers of an interrupted operation are never
//!   seen by a later generation; they are excluded, then collected as garbage;
//! - metadata changes are single `Durability::Sync` store writes; a write acknowledged to the
//!   client before a FLUSH, a FUA write or a metadata change is durable once that returns (the
//!   store's log keeps a prefix);
//! - an extent is deleted only when no view of its volume (current or snapshot) sees it and it is
//!   not in a generation handed out after the collector captured those views.

mod handle;
mod limiter;
mod record;
mod scan;
mod stream;
mod view;

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use keel_store::{Compression, Durability, Progress, Store, StoreError, WriteOp};

pub use handle::VolumeHandle;
pub use limiter::{Clock, SystemClock};
pub use stream::{ReceiveReport, SendStream};

use limiter::RateLimiter;
use record::{
    decode, encode, hex, new_unique_id, snapshot_key, unix_seconds_now, volume_key, Origin,
    SnapshotRecord, VolumeRecord, VolumeStatus, RECORD_FORMAT,
};
use view::Layer;

/// Size of a volume block: the unit of a store extent, of copy-on-write and of NBD alignment.
pub const BLOCK_SIZE_BYTES: u64 = 4096;
/// Largest volume: keeps block numbers and byte offsets far from overflow.
pub const VOLUME_SIZE_MAX_BYTES: u64 = 1 << 50;
/// Longest volume or snapshot name.
pub const NAME_MAX_BYTES: usize = 128;
/// Deepest chain of clones: each level costs one more lookup for blocks the clone never wrote.
pub const CLONE_DEPTH_MAX: usize = 16;
/// Most snapshots per volume: the garbage collector and `info` evaluate every view per block.
pub const SNAPSHOTS_PER_VOLUME_MAX: usize = 1024;

/// Everything that can go wrong with a volume, with the volume it happened to.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {name:?} not found")]
    NotFound { name: String },

    #[error("volume {name:?} already exists")]
    AlreadyExists { name: String },

    #[error("snapshot {snapshot:?} of volume {volume:?} not found")]
    SnapshotNotFound { volume: String, snapshot: String },

    #[error("snapshot {snapshot:?} of volume {volume:?} already exists")]
    SnapshotExists { volume: String, snapshot: String },

    #[error("volume {volume:?}: {detail}")]
    Invalid { volume: String, detail: String },

    #[error("volume {volume:?}: range at byte {offset} of {length} bytes is past its end ({size_bytes} bytes)")]
    OutOfRange {
        volume: String,
        offset: u64,
        length: u64,
        size_bytes: u64,
    },

    #[error("volume {volume:?} is read-only: {reason}")]
    ReadOnly { volume: String, reason: String },

    #[error("volume {volume:?} is in use: {detail}")]
    InUse { volume: String, detail: String },

    #[error("volume {volume:?} was deleted")]
    Deleted { volume: String },

    #[error("volume {volume:?}: store error while {operation}: {source}")]
    Store {
        volume: String,
        operation: &'static str,
        #[source]
        source: StoreError,
    },

    #[error("volume metadata: {detail}")]
    Metadata { detail: String },

    #[error("volume {volume:?}: block {block} is corrupt: {detail}")]
    CorruptBlock {
        volume: String,
        block: u64,
        detail: String,
    },

    #[error("send/receive stream: {detail} (at byte {offset})")]
    Stream { detail: String, offset: u64 },

    #[error(
        "send/receive stream: its base snapshot {base_name:?} (guid {base_guid}) is not a snapshot \
         of volume {volume:?} here; send a full stream or one based on a snapshot this side has"
    )]
    BaseMissing {
        volume: String,
        base_name: String,
        base_guid: String,
    },

    #[error("send/receive stream I/O: {0}")]
    Io(#[from] io::Error),
}

pub type VolumeResult<T> = Result<T, VolumeError>;

impl VolumeError {
    fn store(volume: &str, operation: &'static str) -> impl FnOnce(StoreError) -> VolumeError {
        let volume = volume.to_string();
        move |source| VolumeError::Store {
            volume,
            operation,
            source,
        }
    }
}

impl From<VolumeError> for io::Error {
    fn from(error: VolumeError) -> io::Error {
        let kind = match &error {
            VolumeError::OutOfRange { .. } | VolumeError::Invalid { .. } => {
                io::ErrorKind::InvalidInput
            }
            VolumeError::ReadOnly { .. } => io::ErrorKind::PermissionDenied,
            VolumeError::NotFound { .. }
            | VolumeError::SnapshotNotFound { .. }
            | VolumeError::Deleted { .. } => io::ErrorKind::NotFound,
            VolumeError::AlreadyExists { .. } | VolumeError::SnapshotExists { .. } => {
                io::ErrorKind::AlreadyExists
            }
            VolumeError::Store { source, .. } if source.is_no_space() => io::ErrorKind::StorageFull,
            VolumeError::Io(inner) => inner.kind(),
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, error)
    }
}

/// What to create.
#[derive(Debug, Clone)]
pub struct VolumeSpec {
    pub name: String,
    /// A positive multiple of [`BLOCK_SIZE_BYTES`].
    pub size_bytes: u64,
    pub compression: Compression,
    /// Operations per second (reads, writes, trims); None: unlimited.
    pub iops_max: Option<u64>,
    /// Bytes read plus written per second, in MiB; None: unlimited.
    pub bandwidth_max_mib_per_second: Option<u64>,
}

impl VolumeSpec {
    pub fn new(name: &str, size_bytes: u64) -> VolumeSpec {
        VolumeSpec {
            name: name.to_string(),
            size_bytes,
            compression: Compression::None,
            iops_max: None,
            bandwidth_max_mib_per_second: None,
        }
    }
}

/// A volume as `list` shows it (no scan of its blocks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeSummary {
    pub name: String,
    pub id: u64,
    /// 32 hex digits.
    pub uuid: String,
    pub size_bytes: u64,
    pub compression: Compression,
    pub iops_max: Option<u64>,
    pub bandwidth_max_mib_per_second: Option<u64>,
    /// Generation new writes go to.
    pub generation: u64,
    pub snapshots: usize,
    /// (volume, snapshot) this volume was cloned from, if it is a clone.
    pub origin: Option<(String, String)>,
    pub created_unix_seconds: u64,
}

/// A volume with its snapshots and space use (from one scan of its block keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    pub summary: VolumeSummary,
    pub block_size_bytes: u64,
    /// Bytes of blocks this volume itself wrote that its current contents show (parent blocks of
    /// a clone not counted). Blocks trimmed over older data count until the older data is gone.
    pub used_bytes: u64,
    /// Bytes of every extent the volume keeps for itself and its snapshots, before compression
    /// (includes garbage not yet collected).
    pub stored_bytes: u64,
    pub snapshots: Vec<SnapshotInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub name: String,
    /// 32 hex digits; kept by send/receive.
    pub guid: String,
    pub generation: u64,
    pub size_bytes: u64,
    pub created_unix_seconds: u64,
    /// Bytes of this volume's own blocks the snapshot shows.
    pub referenced_bytes: u64,
    /// Bytes shown by this snapshot and by no other snapshot nor the current contents: what
    /// deleting it frees (exact for the volume's own blocks; hole markers count as blocks).
    pub unique_bytes: u64,
}

/// What a garbage collection pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcReport {
    pub extents_scanned: u64,
    pub extents_deleted: u64,
}

/// A volume's in-memory state: its record and its snapshots by generation.
pub(crate) struct VolumeState {
    pub record: VolumeRecord,
    pub snapshots: BTreeMap<u64, SnapshotRecord>,
    pub compression: Compression,
}

impl VolumeState {
    fn snapshot_by_name(&self, name: &str) -> Option<&SnapshotRecord> {
        self.snapshots
            .values()
            .find(|snapshot| snapshot.name == name)
    }
}

/// Long operations in flight on a volume, guarded by their own mutex so the garbage collector
/// and deletions can check them without stopping I/O.
#[derive(Default)]
pub(crate) struct Activity {
    /// A receive is applying into this volume.
    pub receiving: bool,
    /// Generations being filled by a receive: the collector must not touch them.
    pub pending_generations: Vec<u64>,
    /// Snapshot generation → number of users (send streams, read-only handles, receive bases).
    pub snapshot_users: HashMap<u64, usize>,
}

/// One volume, shared by the manager and every handle on it.
pub(crate) struct VolumeShared {
    pub id: u64,
    pub name: String,
    pub state: RwLock<VolumeState>,
    /// Per-block-stripe locks: aligned writes take them shared, read-modify-write exclusive.
    pub stripes: Box<[RwLock<()>]>,
    pub limiter: RwLock<Option<Arc<RateLimiter>>>,
    pub deleted: AtomicBool,
    pub activity: Mutex<Activity>,
}

/// Number of block-lock stripes per volume.
pub(crate) const LOCK_STRIPES: usize = 1024;

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // State behind these locks is only replaced after its store write succeeded, so a panic
    // while holding one cannot leave it half-changed.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(crate) fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(crate) fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl VolumeShared {
    fn new(record: VolumeRecord, snapshots: BTreeMap<u64, SnapshotRecord>) -> VolumeShared {
        // An unknown codec name (a newer format) only affects new writes: every extent records
        // its own codec, so falling back to none keeps the volume readable.
        let compression = Compression::from_name(&record.compression).unwrap_or_default();
        let limiter = make_limiter(record.iops_max, record.bandwidth_max_mib_per_second);
        VolumeShared {
            id: record.id,
            name: record.name.clone(),
            state: RwLock::new(VolumeState {
                record,
                snapshots,
                compression,
            }),
            stripes: (0..LOCK_STRIPES).map(|_| RwLock::new(())).collect(),
            limiter: RwLock::new(limiter),
            deleted: AtomicBool::new(false),
            activity: Mutex::new(Activity::default()),
        }
    }

    /// Marks a snapshot as in use until the guard drops (it cannot be deleted meanwhile).
    pub(crate) fn use_snapshot(self: &Arc<Self>, generation: u64) -> SnapshotUse {
        *lock(&self.activity)
            .snapshot_users
            .entry(generation)
            .or_insert(0) += 1;
        SnapshotUse {
            volume: self.clone(),
            generation,
        }
    }
}

/// Keeps a snapshot from being deleted while a stream or a read-only handle reads it.
pub(crate) struct SnapshotUse {
    volume: Arc<VolumeShared>,
    generation: u64,
}

impl Drop for SnapshotUse {
    fn drop(&mut self) {
        let mut activity = lock(&self.volume.activity);
        if let Some(count) = activity.snapshot_users.get_mut(&self.generation) {
            *count -= 1;
            if *count == 0 {
                activity.snapshot_users.remove(&self.generation);
            }
        }
    }
}

fn make_limiter(
    iops_max: Option<u64>,
    bandwidth_max_mib_per_second: Option<u64>,
) -> Option<Arc<RateLimiter>> {
    if iops_max.is_none() && bandwidth_max_mib_per_second.is_none() {
        return None;
    }
    Some(Arc::new(RateLimiter::new(
        iops_max,
        bandwidth_max_mib_per_second.map(|mib| mib.saturating_mul(1 << 20)),
        Box::new(SystemClock),
    )))
}

struct Catalog {
    /// Every volume that has a record, including ones being received (their names are taken).
    by_name: BTreeMap<String, Arc<VolumeShared>>,
    next_volume_id: u64,
}

/// The volumes of one store: create, snapshot, clone, send, receive, and handles for I/O.
/// Thread-safe; metadata changes are serialized by one mutex, block I/O only takes per-volume
/// read locks.
pub struct VolumeManager {
    store: Store,
    catalog: Mutex<Catalog>,
}

fn validate_name(kind: &str, name: &str) -> VolumeResult<()> {
    let valid = !name.is_empty()
        && name.len() <= NAME_MAX_BYTES
        && name
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.'))
        && !name.starts_with('.');
    if valid {
        Ok(())
    } else {
        Err(VolumeError::Invalid {
            volume: name.to_string(),
            detail: format!(
                "{kind} names are 1 to {NAME_MAX_BYTES} characters of A-Z a-z 0-9 - _ . and do not start with a dot"
            ),
        })
    }
}

fn validate_size(name: &str, size_bytes: u64) -> VolumeResult<()> {
    if size_bytes == 0
        || !size_bytes.is_multiple_of(BLOCK_SIZE_BYTES)
        || size_bytes > VOLUME_SIZE_MAX_BYTES
    {
        return Err(VolumeError::Invalid {
            volume: name.to_string(),
            detail: format!(
                "size {size_bytes} must be a positive multiple of {BLOCK_SIZE_BYTES} bytes, at most {VOLUME_SIZE_MAX_BYTES}"
            ),
        });
    }
    Ok(())
}

impl VolumeManager {
    /// Loads every volume definition from the store, and finishes deletions and discards
    /// receives that a crash interrupted.
    pub fn open(store: Store) -> VolumeResult<VolumeManager> {
        let mut next_volume_id = 1u64;
        let mut records: Vec<VolumeRecord> = Vec::new();
        let mut snapshots: HashMap<u64, BTreeMap<u64, SnapshotRecord>> = HashMap::new();
        let start = keel_store::meta_key(record::ALL_PREFIX);
        let mut end = keel_store::meta_key(record::ALL_PREFIX);
        // "v0" is the first key past every "v/..." key.
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        let mut cursor = start;
        loop {
            let page = store
                .scan(&cursor, &end, scan::KEYS_PAGE_MAX)
                .map_err(VolumeError::store("*", "loading volume metadata"))?;
            for (key, value) in &page {
                let suffix = key.get(1..).unwrap_or_default();
                if suffix == record::NEXT_VOLUME_ID_SUFFIX {
                    let stored: u64 = decode(key, value)?;
                    next_volume_id = next_volume_id.max(stored);
                } else if suffix.starts_with(record::VOLUME_PREFIX) {
                    let volume: VolumeRecord = decode(key, value)?;
                    next_volume_id = next_volume_id.max(volume.id + 1);
                    records.push(volume);
                } else if suffix.starts_with(record::SNAPSHOT_PREFIX) {
                    let snapshot: SnapshotRecord = decode(key, value)?;
                    snapshots
                        .entry(snapshot.volume_id)
                        .or_default()
                        .insert(snapshot.generation, snapshot);
                }
            }
            match page.last() {
                Some((key, _)) if page.len() == scan::KEYS_PAGE_MAX => {
                    cursor = record::key_successor(key)
                }
                _ => break,
            }
        }
        let manager = VolumeManager {
            store,
            catalog: Mutex::new(Catalog {
                by_name: BTreeMap::new(),
                next_volume_id,
            }),
        };
        let mut unfinished = Vec::new();
        {
            let mut catalog = lock(&manager.catalog);
            for volume in records {
                let volume_snapshots = snapshots.remove(&volume.id).unwrap_or_default();
                let status = volume.status;
                let shared = Arc::new(VolumeShared::new(volume, volume_snapshots));
                if status == VolumeStatus::Ready {
                    catalog.by_name.insert(shared.name.clone(), shared);
                } else {
                    unfinished.push(shared);
                }
            }
        }
        for shared in unfinished {
            tracing::info!(volume = %shared.name, "finishing an interrupted volume deletion or receive");
            manager.erase(&shared, &mut |_| {})?;
        }
        Ok(manager)
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    fn get(&self, name: &str) -> VolumeResult<Arc<VolumeShared>> {
        let catalog = lock(&self.catalog);
        Self::get_ready(&catalog, name)
    }

    fn get_ready(catalog: &Catalog, name: &str) -> VolumeResult<Arc<VolumeShared>> {
        match catalog.by_name.get(name) {
            Some(shared) if read(&shared.state).record.status == VolumeStatus::Ready => {
                Ok(shared.clone())
            }
            _ => Err(VolumeError::NotFound {
                name: name.to_string(),
            }),
        }
    }

    fn commit(&self, volume: &str, operation: &'static str, ops: Vec<WriteOp>) -> VolumeResult<()> {
        self.store
            .write(ops, Durability::Sync)
            .map(|_| ())
            .map_err(VolumeError::store(volume, operation))
    }

    fn volume_put(record: &VolumeRecord) -> VolumeResult<WriteOp> {
        Ok(WriteOp::put(
            volume_key(record.id),
            encode(record)?,
            Compression::None,
        ))
    }

    fn snapshot_put(snapshot: &SnapshotRecord) -> VolumeResult<WriteOp> {
        Ok(WriteOp::put(
            snapshot_key(snapshot.volume_id, snapshot.generation),
            encode(snapshot)?,
            Compression::None,
        ))
    }

    /// Allocates a volume id; the caller persists `v/next-volume-id` in the same batch.
    /// (An id skipped because its commit failed is simply never used.)
    fn allocate_volume_id(catalog: &mut Catalog) -> VolumeResult<(u64, WriteOp)> {
        let id = catalog.next_volume_id;
        catalog.next_volume_id += 1;
        let value = encode(&catalog.next_volume_id)?;
        Ok((
            id,
            WriteOp::put(
                keel_store::meta_key(record::NEXT_VOLUME_ID_SUFFIX),
                value,
                Compression::None,
            ),
        ))
    }

    fn new_record(
        id: u64,
        spec: &VolumeSpec,
        view: Vec<Layer>,
        origin: Option<Origin>,
        status: VolumeStatus,
    ) -> VolumeRecord {
        VolumeRecord {
            format: RECORD_FORMAT,
            id,
            uuid: new_unique_id(spec.name.as_bytes()),
            name: spec.name.clone(),
            size_bytes: spec.size_bytes,
            compression: spec.compression.name().to_string(),
            iops_max: spec.iops_max,
            bandwidth_max_mib_per_second: spec.bandwidth_max_mib_per_second,
            generation: 1,
            generation_next: 2,
            view,
            origin,
            status,
            created_unix_seconds: unix_seconds_now(),
        }
    }

    /// Creates an empty (all-zero, thin) volume.
    pub fn create(&self, spec: &VolumeSpec) -> VolumeResult<VolumeSummary> {
        validate_name("volume", &spec.name)?;
        validate_size(&spec.name, spec.size_bytes)?;
        let mut catalog = lock(&self.catalog);
        if catalog.by_name.contains_key(&spec.name) {
            return Err(VolumeError::AlreadyExists {
                name: spec.name.clone(),
            });
        }
        let (id, id_op) = Self::allocate_volume_id(&mut catalog)?;
        let record = Self::new_record(id, spec, vec![Layer::new(id, 1)], None, VolumeStatus::Ready);
        self.commit(
            &spec.name,
            "creating the volume",
            vec![id_op, Self::volume_put(&record)?],
        )?;
        let shared = Arc::new(VolumeShared::new(record, BTreeMap::new()));
        catalog.by_name.insert(spec.name.clone(), shared.clone());
        let summary = self.summary_of(&catalog, &read(&shared.state));
        Ok(summary)
    }

    fn origin_names(catalog: &Catalog, origin: &Option<Origin>) -> Option<(String, String)> {
        let origin = origin.as_ref()?;
        let parent = catalog
            .by_name
            .values()
            .find(|volume| volume.id == origin.volume_id)?;
        let state = read(&parent.state);
        let snapshot = state.snapshots.get(&origin.snapshot_generation)?;
        Some((parent.name.clone(), snapshot.name.clone()))
    }

    fn summary_of(&self, catalog: &Catalog, state: &VolumeState) -> VolumeSummary {
        let record = &state.record;
        VolumeSummary {
            name: record.name.clone(),
            id: record.id,
            uuid: hex(&record.uuid),
            size_bytes: record.size_bytes,
            compression: state.compression,
            iops_max: record.iops_max,
            bandwidth_max_mib_per_second: record.bandwidth_max_mib_per_second,
            generation: record.generation,
            snapshots: state.snapshots.len(),
            origin: Self::origin_names(catalog, &record.origin),
            created_unix_seconds: record.created_unix_seconds,
        }
    }

    /// Every ready volume, by name.
    pub fn list(&self) -> Vec<VolumeSummary> {
        let catalog = lock(&self.catalog);
        catalog
            .by_name
            .values()
            .filter_map(|shared| {
                let state = read(&shared.state);
                (state.record.status == VolumeStatus::Ready)
                    .then(|| self.summary_of(&catalog, &state))
            })
            .collect()
    }

    /// The volume, its snapshots and its space use. Scans the volume's block keys (not their
    /// data): cost grows with the number of extents the volume holds.
    pub fn info(&self, name: &str) -> VolumeResult<VolumeInfo> {
        let (shared, summary) = {
            let catalog = lock(&self.catalog);
            let shared = Self::get_ready(&catalog, name)?;
            let summary = self.summary_of(&catalog, &read(&shared.state));
            (shared, summary)
        };
        let usage = scan::usage(&self.store, &shared)?;
        let state = read(&shared.state);
        let snapshots = state
            .snapshots
            .values()
            .map(|snapshot| SnapshotInfo {
                name: snapshot.name.clone(),
                guid: hex(&snapshot.guid),
                generation: snapshot.generation,
                size_bytes: snapshot.size_bytes,
                created_unix_seconds: snapshot.created_unix_seconds,
                referenced_bytes: usage
                    .snapshot_referenced_blocks
                    .get(&snapshot.generation)
                    .copied()
                    .unwrap_or(0)
                    * BLOCK_SIZE_BYTES,
                unique_bytes: usage
                    .snapshot_unique_blocks
                    .get(&snapshot.generation)
                    .copied()
                    .unwrap_or(0)
                    * BLOCK_SIZE_BYTES,
            })
            .collect();
        Ok(VolumeInfo {
            summary,
            block_size_bytes: BLOCK_SIZE_BYTES,
            used_bytes: usage.current_blocks * BLOCK_SIZE_BYTES,
            stored_bytes: usage.extents * BLOCK_SIZE_BYTES,
            snapshots,
        })
    }

    /// Changes the volume's size. Growing shows zeroes past the old end. Shrinking needs
    /// `allow_shrink`; blocks past the new end are gone from the volume (snapshots keep theirs)
    /// and read as zeroes if it grows again.
    pub fn resize(&self, name: &str, size_bytes: u64, allow_shrink: bool) -> VolumeResult<()> {
        validate_size(name, size_bytes)?;
        let shrunk = {
            let catalog = lock(&self.catalog);
            let shared = Self::get_ready(&catalog, name)?;
            let mut state = write(&shared.state);
            let mut record = state.record.clone();
            let shrinking = size_bytes < record.size_bytes;
            if shrinking && !allow_shrink {
                return Err(VolumeError::Invalid {
                    volume: name.to_string(),
                    detail: format!(
                        "shrinking from {} to {size_bytes} bytes discards data; ask for it explicitly",
                        record.size_bytes
                    ),
                });
            }
            if shrinking {
                // Hide every block past the new end as of now, then move on to a fresh
                // generation so writes after a later grow are seen again.
                let current = record.generation;
                let next = record.generation_next;
                let top = &mut record.view[0];
                top.truncations.push(view::Truncation {
                    block_from: size_bytes / BLOCK_SIZE_BYTES,
                    generation_upto: current,
                });
                top.generation_max = next;
                record.generation = next;
                record.generation_next = next + 1;
            }
            record.size_bytes = size_bytes;
            self.commit(name, "resizing", vec![Self::volume_put(&record)?])?;
            state.record = record;
            shrinking.then(|| shared.clone())
        };
        if let Some(shared) = shrunk {
            scan::collect_garbage(&self.store, &shared, &mut |_| {})?;
        }
        Ok(())
    }

    /// Changes the QoS limits of a volume (None: unlimited); open handles follow at once.
    pub fn set_limits(
        &self,
        name: &str,
        iops_max: Option<u64>,
        bandwidth_max_mib_per_second: Option<u64>,
    ) -> VolumeResult<()> {
        let catalog = lock(&self.catalog);
        let shared = Self::get_ready(&catalog, name)?;
        let mut state = write(&shared.state);
        let mut record = state.record.clone();
        record.iops_max = iops_max;
        record.bandwidth_max_mib_per_second = bandwidth_max_mib_per_second;
        self.commit(name, "setting limits", vec![Self::volume_put(&record)?])?;
        state.record = record;
        *write(&shared.limiter) = make_limiter(iops_max, bandwidth_max_mib_per_second);
        Ok(())
    }

    /// Volumes (other than `shared`) whose views read through `shared`'s extents.
    fn dependents(
        catalog: &Catalog,
        shared: &VolumeShared,
        snapshot_generation: Option<u64>,
    ) -> Vec<String> {
        catalog
            .by_name
            .values()
            .filter(|other| other.id != shared.id)
            .filter(|other| {
                let state = read(&other.state);
                match (&state.record.origin, snapshot_generation) {
                    (Some(origin), Some(generation)) => {
                        origin.volume_id == shared.id && origin.snapshot_generation == generation
                    }
                    (Some(origin), None) => origin.volume_id == shared.id,
                    (None, _) => false,
                }
            })
            .map(|other| other.name.clone())
            .collect()
    }

    /// Deletes a volume, its snapshots and all its blocks (in bounded batches; `progress`
    /// reports the block position reached out of the volume's size in blocks). Refused while
    /// clones of its snapshots exist or a stream is being received into it.
    pub fn delete(&self, name: &str, progress: &mut dyn FnMut(Progress)) -> VolumeResult<()> {
        let shared = {
            let mut catalog = lock(&self.catalog);
            let shared = Self::get_ready(&catalog, name)?;
            let clones = Self::dependents(&catalog, &shared, None);
            if !clones.is_empty() {
                return Err(VolumeError::InUse {
                    volume: name.to_string(),
                    detail: format!(
                        "clones {clones:?} read through its snapshots; delete them first"
                    ),
                });
            }
            {
                let activity = lock(&shared.activity);
                if activity.receiving || !activity.snapshot_users.is_empty() {
                    return Err(VolumeError::InUse {
                        volume: name.to_string(),
                        detail: "a send, receive or snapshot export is using it".to_string(),
                    });
                }
            }
            let mut state = write(&shared.state);
            let mut record = state.record.clone();
            record.status = VolumeStatus::Deleting;
            self.commit(
                name,
                "marking the volume deleted",
                vec![Self::volume_put(&record)?],
            )?;
            state.record = record;
            shared.deleted.store(true, Ordering::SeqCst);
            catalog.by_name.remove(name);
            shared.clone()
        };
        self.erase(&shared, progress)
    }

    /// Removes every extent and record of a volume that is no longer in the catalog.
    fn erase(&self, shared: &VolumeShared, progress: &mut dyn FnMut(Progress)) -> VolumeResult<()> {
        shared.deleted.store(true, Ordering::SeqCst);
        let size_blocks = read(&shared.state).record.size_bytes / BLOCK_SIZE_BYTES;
        scan::delete_all_blocks(&self.store, shared, size_blocks, progress)?;
        let state = read(&shared.state);
        let mut ops: Vec<WriteOp> = state
            .snapshots
            .keys()
            .map(|&generation| WriteOp::Delete {
                key: snapshot_key(shared.id, generation),
            })
            .collect();
        ops.push(WriteOp::Delete {
            key: volume_key(shared.id),
        });
        self.commit(&shared.name, "removing the volume's records", ops)
    }

    /// Freezes the volume's current contents as a snapshot, instantly (nothing is copied).
    pub fn snapshot_create(&self, volume: &str, snapshot: &str) -> VolumeResult<SnapshotInfo> {
        validate_name("snapshot", snapshot)?;
        let catalog = lock(&self.catalog);
        let shared = Self::get_ready(&catalog, volume)?;
        let mut state = write(&shared.state);
        if state.snapshot_by_name(snapshot).is_some() {
            return Err(VolumeError::SnapshotExists {
                volume: volume.to_string(),
                snapshot: snapshot.to_string(),
            });
        }
        if state.snapshots.len() >= SNAPSHOTS_PER_VOLUME_MAX {
            return Err(VolumeError::Invalid {
                volume: volume.to_string(),
                detail: format!("it already has {SNAPSHOTS_PER_VOLUME_MAX} snapshots"),
            });
        }
        let mut record = state.record.clone();
        let frozen = SnapshotRecord {
            format: RECORD_FORMAT,
            volume_id: record.id,
            name: snapshot.to_string(),
            guid: new_unique_id(snapshot.as_bytes()),
            generation: record.generation,
            size_bytes: record.size_bytes,
            view: record.view.clone(),
            created_unix_seconds: unix_seconds_now(),
        };
        let next = record.generation_next;
        record.generation = next;
        record.generation_next = next + 1;
        record.view[0].generation_max = next;
        self.commit(
            volume,
            "creating a snapshot",
            vec![Self::snapshot_put(&frozen)?, Self::volume_put(&record)?],
        )?;
        let info = snapshot_info(&frozen);
        state.record = record;
        state.snapshots.insert(frozen.generation, frozen);
        Ok(info)
    }

    /// The volume's snapshots, oldest first, with their space use (one scan, as `info`).
    pub fn snapshot_list(&self, volume: &str) -> VolumeResult<Vec<SnapshotInfo>> {
        Ok(self.info(volume)?.snapshots)
    }

    /// Deletes a snapshot and frees the blocks no other snapshot nor the current contents need.
    /// Refused while a clone was made from it or a stream or export is reading it.
    pub fn snapshot_delete(
        &self,
        volume: &str,
        snapshot: &str,
        progress: &mut dyn FnMut(Progress),
    ) -> VolumeResult<GcReport> {
        let shared = {
            let catalog = lock(&self.catalog);
            let shared = Self::get_ready(&catalog, volume)?;
            let mut state = write(&shared.state);
            let generation = state
                .snapshot_by_name(snapshot)
                .ok_or_else(|| VolumeError::SnapshotNotFound {
                    volume: volume.to_string(),
                    snapshot: snapshot.to_string(),
                })?
                .generation;
            let clones = Self::dependents(&catalog, &shared, Some(generation));
            if !clones.is_empty() {
                return Err(VolumeError::InUse {
                    volume: volume.to_string(),
                    detail: format!("clones {clones:?} were made from snapshot {snapshot:?}"),
                });
            }
            if lock(&shared.activity)
                .snapshot_users
                .contains_key(&generation)
            {
                return Err(VolumeError::InUse {
                    volume: volume.to_string(),
                    detail: format!(
                        "snapshot {snapshot:?} is being sent, received onto or exported"
                    ),
                });
            }
            self.commit(
                volume,
                "deleting a snapshot",
                vec![WriteOp::Delete {
                    key: snapshot_key(shared.id, generation),
                }],
            )?;
            state.snapshots.remove(&generation);
            shared.clone()
        };
        scan::collect_garbage(&self.store, &shared, progress)
    }

    /// Makes the volume's contents (and size) those of the snapshot again. Later snapshots
    /// stay; the discarded current contents are freed.
    pub fn rollback(&self, volume: &str, snapshot: &str) -> VolumeResult<()> {
        let shared = {
            let catalog = lock(&self.catalog);
            let shared = Self::get_ready(&catalog, volume)?;
            if lock(&shared.activity).receiving {
                return Err(VolumeError::InUse {
                    volume: volume.to_string(),
                    detail: "a stream is being received into it".to_string(),
                });
            }
            let mut state = write(&shared.state);
            let target = state
                .snapshot_by_name(snapshot)
                .ok_or_else(|| VolumeError::SnapshotNotFound {
                    volume: volume.to_string(),
                    snapshot: snapshot.to_string(),
                })?
                .clone();
            let mut record = state.record.clone();
            rebase_onto(
                &mut record,
                &target.view,
                target.generation,
                target.size_bytes,
            );
            self.commit(volume, "rolling back", vec![Self::volume_put(&record)?])?;
            state.record = record;
            shared.clone()
        };
        scan::collect_garbage(&self.store, &shared, &mut |_| {})?;
        Ok(())
    }

    /// Creates volume `name`, a writable copy of `volume@snapshot` that shares its blocks until
    /// either side overwrites them. Inherits compression and limits.
    pub fn clone_volume(
        &self,
        volume: &str,
        snapshot: &str,
        name: &str,
    ) -> VolumeResult<VolumeSummary> {
        validate_name("volume", name)?;
        let mut catalog = lock(&self.catalog);
        if catalog.by_name.contains_key(name) {
            return Err(VolumeError::AlreadyExists {
                name: name.to_string(),
            });
        }
        let parent = Self::get_ready(&catalog, volume)?;
        let (spec, parent_view, origin) = {
            let state = read(&parent.state);
            let source =
                state
                    .snapshot_by_name(snapshot)
                    .ok_or_else(|| VolumeError::SnapshotNotFound {
                        volume: volume.to_string(),
                        snapshot: snapshot.to_string(),
                    })?;
            if source.view.len() >= CLONE_DEPTH_MAX {
                return Err(VolumeError::Invalid {
                    volume: name.to_string(),
                    detail: format!("clone chains are limited to {CLONE_DEPTH_MAX} levels"),
                });
            }
            let spec = VolumeSpec {
                name: name.to_string(),
                size_bytes: source.size_bytes,
                compression: state.compression,
                iops_max: state.record.iops_max,
                bandwidth_max_mib_per_second: state.record.bandwidth_max_mib_per_second,
            };
            let origin = Origin {
                volume_id: parent.id,
                snapshot_generation: source.generation,
            };
            (spec, source.view.clone(), origin)
        };
        let (id, id_op) = Self::allocate_volume_id(&mut catalog)?;
        let mut view = vec![Layer::new(id, 1)];
        view.extend(parent_view);
        let record = Self::new_record(id, &spec, view, Some(origin), VolumeStatus::Ready);
        self.commit(
            name,
            "creating a clone",
            vec![id_op, Self::volume_put(&record)?],
        )?;
        let shared = Arc::new(VolumeShared::new(record, BTreeMap::new()));
        catalog.by_name.insert(name.to_string(), shared.clone());
        let summary = self.summary_of(&catalog, &read(&shared.state));
        Ok(summary)
    }

    /// A handle for block I/O on the volume's current contents (shared by any number of
    /// threads and connections).
    pub fn open_volume(&self, name: &str) -> VolumeResult<Arc<VolumeHandle>> {
        let shared = self.get(name)?;
        Ok(Arc::new(VolumeHandle::new(
            self.store.clone(),
            shared,
            None,
        )))
    }

    /// A read-only handle on a snapshot; the snapshot cannot be deleted while it is open.
    pub fn open_snapshot(&self, volume: &str, snapshot: &str) -> VolumeResult<Arc<VolumeHandle>> {
        let shared = self.get(volume)?;
        let frozen = {
            let state = read(&shared.state);
            state
                .snapshot_by_name(snapshot)
                .ok_or_else(|| VolumeError::SnapshotNotFound {
                    volume: volume.to_string(),
                    snapshot: snapshot.to_string(),
                })?
                .clone()
        };
        let user = shared.use_snapshot(frozen.generation);
        Ok(Arc::new(VolumeHandle::new(
            self.store.clone(),
            shared,
            Some(handle::FrozenView {
                view: frozen.view,
                size_bytes: frozen.size_bytes,
                _user: user,
            }),
        )))
    }

    /// Deletes the volume's extents that no view needs any more (rollback leftovers, data
    /// of deleted snapshots, interrupted receives). Runs while I/O continues.
    pub fn collect_garbage(
        &self,
        volume: &str,
        progress: &mut dyn FnMut(Progress),
    ) -> VolumeResult<GcReport> {
        let shared = self.get(volume)?;
        scan::collect_garbage(&self.store, &shared, progress)
    }

    /// [`VolumeManager::send`] written to `output`; returns the bytes written.
    pub fn send_to(
        &self,
        volume: &str,
        base: Option<&str>,
        target: &str,
        output: &mut dyn io::Write,
    ) -> VolumeResult<u64> {
        let mut stream = self.send(volume, base, target)?;
        Ok(io::copy(&mut stream, output)?)
    }

    /// A stream of the blocks of `volume@target` (full), or of the blocks that differ between
    /// `volume@base` and `volume@target` (incremental). Reads lazily: memory stays bounded.
    pub fn send(&self, volume: &str, base: Option<&str>, target: &str) -> VolumeResult<SendStream> {
        let shared = self.get(volume)?;
        let state = read(&shared.state);
        let find = |name: &str| {
            state
                .snapshot_by_name(name)
                .cloned()
                .ok_or_else(|| VolumeError::SnapshotNotFound {
                    volume: volume.to_string(),
                    snapshot: name.to_string(),
                })
        };
        let target_snapshot = find(target)?;
        let base_snapshot = base.map(find).transpose()?;
        let uuid = state.record.uuid;
        let compression = state.compression;
        drop(state);
        stream::SendStream::new(
            self.store.clone(),
            shared,
            uuid,
            compression,
            base_snapshot,
            target_snapshot,
        )
    }

    /// Applies a stream made by [`VolumeManager::send`]. A full stream creates volume
    /// `volume` (which must not exist); an incremental one needs `volume` to have the stream's
    /// base snapshot, and replaces its current contents by the stream's target snapshot (like
    /// `zfs receive -F`). Nothing is visible until the whole stream verified; a bad, truncated
    /// or mismatched stream leaves the volume as it was.
    pub fn receive(&self, input: &mut dyn io::Read, volume: &str) -> VolumeResult<ReceiveReport> {
        stream::receive(self, input, volume)
    }
}

/// Points `record`'s current view at a frozen view (rollback, receive): a fresh generation on
/// top of it, skipping every own generation written after it.
pub(crate) fn rebase_onto(
    record: &mut VolumeRecord,
    frozen_view: &[Layer],
    frozen_generation: u64,
    size_bytes: u64,
) {
    let next = record.generation_next;
    let mut view = frozen_view.to_vec();
    view[0].generation_max = next;
    view[0].exclude(frozen_generation + 1, next - 1);
    record.view = view;
    record.generation = next;
    record.generation_next = next + 1;
    record.size_bytes = size_bytes;
}

fn snapshot_info(snapshot: &SnapshotRecord) -> SnapshotInfo {
    SnapshotInfo {
        name: snapshot.name.clone(),
        guid: hex(&snapshot.guid),
        generation: snapshot.generation,
        size_bytes: snapshot.size_bytes,
        created_unix_seconds: snapshot.created_unix_seconds,
        referenced_bytes: 0,
        unique_bytes: 0,
    }
}
