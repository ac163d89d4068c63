//! keel-volume: the local volume engine — block I/O, garbage collection, space accounting and
//! send/receive streams for the volumes this node hosts, on this node's store.
//!
//! Layout (design in `docs/volumes.md`): block `b` of volume `v` written in generation `g` is one
//! store extent at `block_key(v, b, g)`; an empty value is a hole marker (reads as zeroes and hides
//! older generations). What a volume, snapshot or clone sees is a view (`keel_catalog::view`).
//! The records that define views and generations live in the catalog; this engine keeps, per
//! hosted volume, a copy that the catalog's [`Observer`] hook replaces under the volume's state
//! lock, so block I/O never waits for metadata and a metadata change (a snapshot, a resize) is
//! ordered with every write: writes hold the state lock shared across their store write.
//!
//! Invariants:
//! - the current generation of a volume is never seen by any snapshot: writes in it never change
//!   a snapshot, so snapshots are frozen without copying anything;
//! - an extent is deleted only when no view of its volume (current or snapshot) sees it, it is
//!   not in the generation a receive or a snapshot repair is filling, and it is below the `generation_next` captured
//!   with those views;
//! - a volume whose record is `Deleting`, gone, or no longer placed on this node refuses I/O;
//!   its blocks are erased by the engine's worker, which then asks the catalog to forget it.
//!
//! Nothing here knows about other nodes: replication (a layer above) decides which node writes.

mod handle;
mod limiter;
mod record;
mod scan;
mod stream;
mod volume_io;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{
    Arc, Condvar, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard,
};
use std::time::Duration;

use keel_catalog::{
    CatalogError, CatalogState, Event, NodeId, Observer, SnapshotRecord, VolumeEntry, VolumeRecord,
    VolumeStatus,
};
use keel_store::{Compression, Progress, Store, StoreError};

pub use handle::VolumeHandle;
pub use keel_catalog::{
    BLOCK_SIZE_BYTES, CLONE_DEPTH_MAX, NAME_MAX_BYTES, SNAPSHOTS_PER_VOLUME_MAX,
    VOLUME_SIZE_MAX_BYTES,
};
pub use limiter::{Clock, SystemClock};
pub use record::{copy_record_key, hex, new_unique_id, unix_seconds_now};
pub use scan::{changed_blocks_since, Usage};
pub use stream::{receive, Publish, ReceiveReport, SendStream};
pub use volume_io::VolumeIo;

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

    #[error(
        "volume {volume:?} is not served by this node; its primary is node {node} ({address})"
    )]
    Elsewhere {
        volume: String,
        node: NodeId,
        address: String,
    },

    #[error("volume {volume:?}: store error while {operation}: {source}")]
    Store {
        volume: String,
        operation: &'static str,
        #[source]
        source: StoreError,
    },

    #[error("volume metadata: {detail}")]
    Metadata { detail: String },

    /// The cluster could not be asked (no leader, no quorum, timeout).
    #[error("volume {volume:?}: {detail}")]
    Unavailable { volume: String, detail: String },

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

    /// A request this node forwarded to the node serving the volume failed there; `kind` is
    /// what the NBD client is told (ENOSPC, EINVAL, EPERM or EIO).
    #[error("volume {volume:?}, served by node {node}: {detail}")]
    Remote {
        volume: String,
        node: NodeId,
        kind: io::ErrorKind,
        detail: String,
    },
}

pub type VolumeResult<T> = Result<T, VolumeError>;

impl VolumeError {
    /// Whether the error says the volume's stored data is damaged (a checksum failure on every
    /// local copy, or a block extent of the wrong shape).
    pub fn is_corrupt(&self) -> bool {
        match self {
            VolumeError::CorruptBlock { .. } => true,
            VolumeError::Store { source, .. } => source.is_corrupt(),
            _ => false,
        }
    }

    /// Whether the error is the store refusing new data for want of space (its reserve).
    pub fn is_no_space(&self) -> bool {
        matches!(self, VolumeError::Store { source, .. } if source.is_no_space())
    }

    pub fn store(volume: &str, operation: &'static str) -> impl FnOnce(StoreError) -> VolumeError {
        let volume = volume.to_string();
        move |source| VolumeError::Store {
            volume,
            operation,
            source,
        }
    }

    /// A catalog refusal, in volume terms.
    pub fn from_catalog(error: CatalogError) -> VolumeError {
        match error {
            CatalogError::VolumeNotFound { name } => VolumeError::NotFound { name },
            CatalogError::VolumeExists { name } => VolumeError::AlreadyExists { name },
            CatalogError::SnapshotNotFound { volume, snapshot } => {
                VolumeError::SnapshotNotFound { volume, snapshot }
            }
            CatalogError::SnapshotExists { volume, snapshot } => {
                VolumeError::SnapshotExists { volume, snapshot }
            }
            CatalogError::VolumeInUse { volume, detail } => VolumeError::InUse { volume, detail },
            CatalogError::BaseMissing { volume, base_guid } => VolumeError::BaseMissing {
                volume,
                base_name: String::new(),
                base_guid,
            },
            CatalogError::Invalid { subject, detail } => VolumeError::Invalid {
                volume: subject,
                detail,
            },
            other => VolumeError::Metadata {
                detail: other.to_string(),
            },
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
            full if full.is_no_space() => io::ErrorKind::StorageFull,
            VolumeError::Io(inner) => inner.kind(),
            VolumeError::Remote { kind, .. } => *kind,
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, error)
    }
}

/// What a garbage collection pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcReport {
    pub extents_scanned: u64,
    pub extents_deleted: u64,
}

/// A hosted volume's copy of its catalog records.
pub struct VolumeState {
    pub record: VolumeRecord,
    pub snapshots: BTreeMap<u64, SnapshotRecord>,
    pub compression: Compression,
}

impl VolumeState {
    pub fn snapshot_by_name(&self, name: &str) -> Option<&SnapshotRecord> {
        self.snapshots
            .values()
            .find(|snapshot| snapshot.name == name)
    }
}

/// Refuses a snapshot whose copy on `node` lacks data ([`SnapshotRecord::incomplete_on`]),
/// naming the replicas that hold it whole.
pub fn check_snapshot_complete(
    record: &VolumeRecord,
    snapshot: &SnapshotRecord,
    node: NodeId,
) -> VolumeResult<()> {
    if snapshot.complete_on(node) {
        return Ok(());
    }
    let whole: Vec<String> = record
        .replication
        .replicas
        .iter()
        .filter(|replica| snapshot.complete_on(**replica))
        .map(|replica| format!("node {replica}"))
        .collect();
    Err(VolumeError::Unavailable {
        volume: record.name.clone(),
        detail: format!(
            "snapshot {:?} is incomplete on this node (node {node}): its replica here was out \
             of sync when the snapshot was taken, or placed after it, and catching up copies \
             the current contents only; {}",
            snapshot.name,
            if whole.is_empty() {
                "no replica holds it whole any more".to_string()
            } else {
                format!("it is whole on {}", whole.join(", "))
            }
        ),
    })
}

/// The snapshot at `generation` of a hosted volume.
fn snapshot_at<'a>(
    shared: &VolumeShared,
    state: &'a VolumeState,
    generation: u64,
) -> VolumeResult<&'a SnapshotRecord> {
    state
        .snapshots
        .get(&generation)
        .ok_or_else(|| VolumeError::SnapshotNotFound {
            volume: shared.name.clone(),
            snapshot: format!("(generation {generation})"),
        })
}

/// Refuses a repair of `node`'s copy of a snapshot into `repair` that the catalog (as this
/// node applied it) does not record.
fn check_repair(
    shared: &VolumeShared,
    snapshot: &SnapshotRecord,
    node: NodeId,
    repair: u64,
) -> VolumeResult<()> {
    if snapshot.repair_of(node) == Some(repair) {
        return Ok(());
    }
    Err(VolumeError::Unavailable {
        volume: shared.name.clone(),
        detail: format!(
            "no repair of snapshot {:?} on node {node} into generation {repair} is under way \
             here (yet)",
            snapshot.name
        ),
    })
}

/// Local activity on a volume that the catalog does not know about.
#[derive(Default)]
pub(crate) struct Activity {
    /// Snapshot generation → number of users (send streams, read-only handles, receive bases).
    pub snapshot_users: HashMap<u64, usize>,
}

/// One hosted volume, shared by the engine and every handle on it.
pub struct VolumeShared {
    pub id: u64,
    pub name: String,
    pub(crate) state: RwLock<VolumeState>,
    /// Per-block-stripe locks: aligned writes take them shared, read-modify-write exclusive.
    pub(crate) stripes: Box<[RwLock<()>]>,
    pub(crate) limiter: RwLock<Option<Arc<limiter::RateLimiter>>>,
    /// Nanoseconds requests spent held back by the limits since the volume was opened here.
    pub(crate) throttled_nanos: AtomicU64,
    pub(crate) deleted: AtomicBool,
    pub(crate) activity: Mutex<Activity>,
    /// One garbage collection at a time per volume.
    pub(crate) collecting: Mutex<()>,
}

/// Number of block-lock stripes per volume.
pub(crate) const LOCK_STRIPES: usize = 1024;

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // State behind these locks is only replaced whole, so a panic while holding one cannot
    // leave it half-changed.
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

fn make_limiter(
    iops_max: Option<u64>,
    bandwidth_max_mib_per_second: Option<u64>,
) -> Option<Arc<limiter::RateLimiter>> {
    if iops_max.is_none() && bandwidth_max_mib_per_second.is_none() {
        return None;
    }
    Some(Arc::new(limiter::RateLimiter::new(
        iops_max,
        bandwidth_max_mib_per_second.map(|mib| mib.saturating_mul(1 << 20)),
        Box::new(SystemClock),
    )))
}

impl VolumeShared {
    fn new(entry: &VolumeEntry) -> VolumeShared {
        let record = entry.record.clone();
        // An unknown codec name (a newer format) only affects new writes: every extent records
        // its own codec, so falling back to none keeps the volume readable.
        let compression = Compression::from_name(&record.compression).unwrap_or_default();
        let limiter = make_limiter(record.iops_max, record.bandwidth_max_mib_per_second);
        VolumeShared {
            id: record.id,
            name: record.name.clone(),
            deleted: AtomicBool::new(record.status == VolumeStatus::Deleting),
            state: RwLock::new(VolumeState {
                record,
                snapshots: entry.snapshots.clone(),
                compression,
            }),
            stripes: (0..LOCK_STRIPES).map(|_| RwLock::new(())).collect(),
            limiter: RwLock::new(limiter),
            throttled_nanos: AtomicU64::new(0),
            activity: Mutex::new(Activity::default()),
            collecting: Mutex::new(()),
        }
    }

    /// Replaces the records (under the state lock: in-flight writes finish first).
    fn update(&self, entry: &VolumeEntry) {
        let mut state = write(&self.state);
        let limits_changed = state.record.iops_max != entry.record.iops_max
            || state.record.bandwidth_max_mib_per_second
                != entry.record.bandwidth_max_mib_per_second;
        state.compression = Compression::from_name(&entry.record.compression).unwrap_or_default();
        state.record = entry.record.clone();
        state.snapshots = entry.snapshots.clone();
        if entry.record.status == VolumeStatus::Deleting {
            self.deleted.store(true, Ordering::SeqCst);
        }
        if limits_changed {
            *write(&self.limiter) = make_limiter(
                entry.record.iops_max,
                entry.record.bandwidth_max_mib_per_second,
            );
        }
    }

    /// The records as of now.
    pub fn state(&self) -> RwLockReadGuard<'_, VolumeState> {
        read(&self.state)
    }

    /// Marks a snapshot as in use until the guard drops (the namespace refuses to delete it
    /// meanwhile).
    pub fn use_snapshot(self: &Arc<Self>, generation: u64) -> SnapshotUse {
        *lock(&self.activity)
            .snapshot_users
            .entry(generation)
            .or_insert(0) += 1;
        SnapshotUse {
            volume: self.clone(),
            generation,
        }
    }

    /// Whether a stream or an export reads the snapshot at `generation` (any, if None).
    pub fn snapshot_in_use(&self, generation: Option<u64>) -> bool {
        let activity = lock(&self.activity);
        match generation {
            Some(generation) => activity.snapshot_users.contains_key(&generation),
            None => !activity.snapshot_users.is_empty(),
        }
    }
}

/// Keeps a snapshot from being deleted while a stream or a read-only handle reads it.
pub struct SnapshotUse {
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

/// Background work of the engine.
#[derive(Default)]
struct Work {
    /// Hosted volumes to erase (their record is `Deleting`).
    erase: BTreeSet<u64>,
    /// Volume ids with blocks here that this node does not host: no record at all (found at
    /// start or after a snapshot install), or a replica the catalog moved or removed.
    erase_orphans: BTreeSet<u64>,
    /// Hosted volumes whose garbage to collect.
    collect: BTreeSet<u64>,
    /// The erase running now and how far it got.
    running_erase: Option<(u64, Progress)>,
    /// The collection the worker runs now, and the last one it finished (with its report), so a
    /// caller that asked for the same collection gets its result instead of a second pass.
    running_collect: Option<u64>,
    finished_collect: Option<(u64, GcReport)>,
    /// Volumes whose next collection the caller runs itself right after its proposal applies
    /// (see [`Engine::collect_after`]): the catalog event does not queue one.
    collect_by_caller: BTreeSet<u64>,
    /// Volumes the caller erases itself right after its deletion applies ([`Engine::erase_after`]).
    erase_by_caller: BTreeSet<u64>,
    stopping: bool,
}

/// Called with a volume id once its blocks are erased (the namespace then forgets the record).
pub type ErasedCallback = Box<dyn Fn(u64) + Send + Sync>;

/// The volumes this node hosts, kept in step with the catalog.
pub struct Engine {
    store: Store,
    local_node: NodeId,
    volumes: RwLock<HashMap<u64, Arc<VolumeShared>>>,
    work: Mutex<Work>,
    work_changed: Condvar,
    on_erased: OnceLock<ErasedCallback>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Who runs an engine's background work: erasing deleted volumes and copies this node no
/// longer hosts, collecting garbage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackgroundWork {
    /// A worker thread of the engine's own, as soon as the work is queued.
    Thread,
    /// Whoever calls [`Engine::run_background_work`]: a seeded simulation, where a thread
    /// finishing in real time would make what each node's store holds depend on the machine's
    /// load, not on the seed.
    Caller,
}

impl Engine {
    /// Builds the engine from the catalog's current state and starts its worker (with
    /// [`BackgroundWork::Thread`]). Subscribe it to the catalog before reading `state`, so no
    /// change falls between the two.
    pub fn start(
        store: Store,
        local_node: NodeId,
        state: &CatalogState,
        background: BackgroundWork,
    ) -> VolumeResult<Arc<Engine>> {
        let engine = Arc::new(Engine {
            store,
            local_node,
            volumes: RwLock::new(HashMap::new()),
            work: Mutex::new(Work::default()),
            work_changed: Condvar::new(),
            on_erased: OnceLock::new(),
            worker: Mutex::new(None),
        });
        engine.refresh_all(state);
        engine.find_orphans(state)?;
        if background == BackgroundWork::Caller {
            return Ok(engine);
        }
        let weak = Arc::downgrade(&engine);
        let worker = std::thread::Builder::new()
            .name("keel-volume-worker".into())
            .spawn(move || worker_loop(weak))
            .map_err(VolumeError::Io)?;
        *lock(&engine.worker) = Some(worker);
        Ok(engine)
    }

    /// Runs the background work queued so far, here and now ([`BackgroundWork::Caller`]).
    pub fn run_background_work(&self) {
        while let Some(job) = next_job(self, false) {
            run_job(self, job);
        }
    }

    /// Where erased volumes are reported (set once, by the namespace).
    pub fn on_erased(&self, callback: ErasedCallback) {
        let _ = self.on_erased.set(callback);
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn local_node(&self) -> NodeId {
        self.local_node
    }

    /// A hosted volume by id (any status).
    pub fn get(&self, volume_id: u64) -> Option<Arc<VolumeShared>> {
        read(&self.volumes).get(&volume_id).cloned()
    }

    /// Per hosted volume (by name): how long its requests were held back by its QoS limits
    /// since it was opened here.
    pub fn throttled(&self) -> Vec<(String, Duration)> {
        let mut volumes: Vec<(String, Duration)> = read(&self.volumes)
            .values()
            .map(|shared| {
                let nanos = shared.throttled_nanos.load(Ordering::Relaxed);
                (shared.name.clone(), Duration::from_nanos(nanos))
            })
            .collect();
        volumes.sort();
        volumes
    }

    /// Ids of the volumes hosted here.
    pub fn hosted(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = read(&self.volumes).keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// A handle for block I/O on a hosted volume's current contents.
    pub fn open(&self, volume_id: u64) -> Option<Arc<VolumeHandle>> {
        self.open_current(volume_id, false)
    }

    /// [`Engine::open`] for a replica of the volume: this node serves no reads of it while it
    /// is one, so what it writes is kept out of the page cache (`Store::write_bulk`).
    pub fn open_replica(&self, volume_id: u64) -> Option<Arc<VolumeHandle>> {
        self.open_current(volume_id, true)
    }

    fn open_current(&self, volume_id: u64, bulk: bool) -> Option<Arc<VolumeHandle>> {
        let shared = self.get(volume_id)?;
        Some(Arc::new(VolumeHandle::new(
            self.store.clone(),
            shared,
            None,
            bulk,
        )))
    }

    /// A read-only handle on a hosted volume's snapshot; the snapshot counts as in use while it
    /// is open.
    pub fn open_snapshot(
        &self,
        volume_id: u64,
        snapshot: &str,
    ) -> VolumeResult<Option<Arc<VolumeHandle>>> {
        let Some(shared) = self.get(volume_id) else {
            return Ok(None);
        };
        let frozen = {
            let state = read(&shared.state);
            let frozen =
                state
                    .snapshot_by_name(snapshot)
                    .ok_or_else(|| VolumeError::SnapshotNotFound {
                        volume: shared.name.clone(),
                        snapshot: snapshot.to_string(),
                    })?;
            check_snapshot_complete(&state.record, frozen, self.local_node)?;
            frozen.clone()
        };
        let user = shared.use_snapshot(frozen.generation);
        Ok(Some(Arc::new(VolumeHandle::new(
            self.store.clone(),
            shared,
            Some(handle::FrozenView {
                view: frozen.view,
                size_bytes: frozen.size_bytes,
                _user: user,
            }),
            false,
        ))))
    }

    /// A read-only handle on this node's copy of the snapshot at `generation` of a hosted
    /// volume. With `repair`, through the snapshot's view and the generation reserved for
    /// repairing this copy ([`SnapshotRecord::repair_view`]): what the repair compares, whole
    /// or not. Without, refused unless the copy here is complete.
    pub fn open_snapshot_copy(
        &self,
        volume_id: u64,
        generation: u64,
        repair: Option<u64>,
    ) -> VolumeResult<Option<Arc<VolumeHandle>>> {
        let Some(shared) = self.get(volume_id) else {
            return Ok(None);
        };
        let (view, size_bytes) = {
            let state = read(&shared.state);
            let frozen = snapshot_at(&shared, &state, generation)?;
            match repair {
                Some(repair) => {
                    check_repair(&shared, frozen, self.local_node, repair)?;
                    (frozen.repair_view(repair), frozen.size_bytes)
                }
                None => {
                    check_snapshot_complete(&state.record, frozen, self.local_node)?;
                    (frozen.view.clone(), frozen.size_bytes)
                }
            }
        };
        let user = shared.use_snapshot(generation);
        Ok(Some(Arc::new(VolumeHandle::new(
            self.store.clone(),
            shared,
            Some(handle::FrozenView {
                view,
                size_bytes,
                _user: user,
            }),
            false,
        ))))
    }

    /// Writes `runs`, each whole blocks at an offset, into the generation `repair` reserved
    /// for repairing this node's copy of the snapshot at `generation`: one store write,
    /// durable on return. An all-zero block is written as a hole marker: it hides what older
    /// generations of the copy hold.
    pub fn write_snapshot_repair(
        &self,
        volume_id: u64,
        generation: u64,
        repair: u64,
        runs: &[(u64, &[u8])],
    ) -> VolumeResult<()> {
        let shared = self.get(volume_id).ok_or_else(|| VolumeError::NotFound {
            name: format!("(id {volume_id})"),
        })?;
        // Held across the write: the repair cannot end, nor the snapshot go, in between.
        let state = read(&shared.state);
        let frozen = snapshot_at(&shared, &state, generation)?;
        check_repair(&shared, frozen, self.local_node, repair)?;
        let block = BLOCK_SIZE_BYTES;
        let mut ops: Vec<keel_store::WriteOp> = Vec::new();
        for &(offset, data) in runs {
            let length = data.len() as u64;
            if !offset.is_multiple_of(block)
                || !length.is_multiple_of(block)
                || offset
                    .checked_add(length)
                    .is_none_or(|end| end > frozen.size_bytes)
            {
                return Err(VolumeError::Invalid {
                    volume: shared.name.clone(),
                    detail: format!(
                        "a repair of {length} bytes at {offset} is not whole blocks within the \
                         snapshot's {} bytes",
                        frozen.size_bytes
                    ),
                });
            }
            for (index, content) in data.chunks(block as usize).enumerate() {
                let value = if content.iter().all(|byte| *byte == 0) {
                    Vec::new()
                } else {
                    content.to_vec()
                };
                ops.push(keel_store::WriteOp::put(
                    keel_store::block_key(volume_id, offset / block + index as u64, repair),
                    value,
                    state.compression,
                ));
            }
        }
        if ops.is_empty() {
            return Ok(());
        }
        // Bulk: a repair fills a replica's copy, which this node does not read soon.
        self.store
            .write_bulk(ops, keel_store::Durability::Sync)
            .map(drop)
            .map_err(VolumeError::store(&shared.name, "repairing a snapshot"))
    }

    /// Space use of a hosted volume (scans its block keys).
    pub fn usage(&self, volume_id: u64) -> VolumeResult<Option<Usage>> {
        match self.get(volume_id) {
            Some(shared) => Ok(Some(scan::usage(&self.store, &shared)?)),
            None => Ok(None),
        }
    }

    /// Runs `change` (a proposal that makes garbage of `volume_id`, e.g. a snapshot deletion),
    /// then collects that garbage here and now, instead of in the background.
    pub fn collect_after<T>(
        &self,
        volume_id: u64,
        change: impl FnOnce() -> VolumeResult<T>,
        progress: &mut dyn FnMut(Progress),
    ) -> VolumeResult<(T, GcReport)> {
        lock(&self.work).collect_by_caller.insert(volume_id);
        let changed = change();
        lock(&self.work).collect_by_caller.remove(&volume_id);
        let value = changed?;
        let report = self.collect_now(volume_id, progress)?;
        Ok((value, report))
    }

    /// Collects a hosted volume's garbage now: takes over a queued collection of it, or waits
    /// for the one the worker is running and answers its report.
    pub fn collect_now(
        &self,
        volume_id: u64,
        progress: &mut dyn FnMut(Progress),
    ) -> VolumeResult<GcReport> {
        let mut work = lock(&self.work);
        work.collect.remove(&volume_id);
        if work.running_collect == Some(volume_id) {
            while work.running_collect == Some(volume_id) {
                work = self
                    .work_changed
                    .wait(work)
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
            }
            if let Some((finished, report)) = work.finished_collect {
                if finished == volume_id {
                    return Ok(report);
                }
            }
        }
        drop(work);
        self.collect(volume_id, progress)
    }

    fn collect(
        &self,
        volume_id: u64,
        progress: &mut dyn FnMut(Progress),
    ) -> VolumeResult<GcReport> {
        match self.get(volume_id) {
            Some(shared) => scan::collect_garbage(&self.store, &shared, progress),
            None => Ok(GcReport::default()),
        }
    }

    /// Runs `change` (the proposal that marks `volume_id` deleted), then erases the volume's
    /// blocks here and now with progress, instead of in the background.
    pub fn erase_after<T>(
        &self,
        volume_id: u64,
        change: impl FnOnce() -> VolumeResult<T>,
        progress: &mut dyn FnMut(Progress),
    ) -> VolumeResult<T> {
        lock(&self.work).erase_by_caller.insert(volume_id);
        let changed = change();
        let mut work = lock(&self.work);
        work.erase_by_caller.remove(&volume_id);
        let value = match changed {
            Ok(value) => value,
            Err(error) => {
                // The deletion may have applied after all (a timeout): leave it to the worker.
                if self
                    .get(volume_id)
                    .is_some_and(|shared| shared.deleted.load(Ordering::SeqCst))
                {
                    work.erase.insert(volume_id);
                    self.work_changed.notify_all();
                }
                return Err(error);
            }
        };
        work.erase.insert(volume_id);
        drop(work);
        self.erase_now(volume_id, progress)?;
        Ok(value)
    }

    /// Erases a volume whose record is `Deleting` now, reporting progress; if the worker is
    /// already erasing it, waits for it (forwarding its progress). Returns once its blocks are
    /// gone and the erased callback ran.
    pub fn erase_now(
        &self,
        volume_id: u64,
        progress: &mut dyn FnMut(Progress),
    ) -> VolumeResult<()> {
        let mut work = lock(&self.work);
        loop {
            if work.erase.remove(&volume_id) {
                work.running_erase = Some((volume_id, Progress { done: 0, total: 0 }));
                drop(work);
                let result = self.erase(volume_id, progress);
                let mut work = lock(&self.work);
                work.running_erase = None;
                self.work_changed.notify_all();
                drop(work);
                return result;
            }
            match work.running_erase {
                Some((running, reached)) if running == volume_id => {
                    progress(reached);
                    work = self
                        .work_changed
                        .wait_timeout(work, std::time::Duration::from_millis(100))
                        .map(|(guard, _)| guard)
                        .unwrap_or_else(|poisoned| poisoned.into_inner().0);
                }
                _ => return Ok(()),
            }
        }
    }

    fn erase(&self, volume_id: u64, progress: &mut dyn FnMut(Progress)) -> VolumeResult<()> {
        let Some(shared) = self.get(volume_id) else {
            return Ok(());
        };
        shared.deleted.store(true, Ordering::SeqCst);
        let size_blocks = read(&shared.state).record.size_bytes / BLOCK_SIZE_BYTES;
        scan::delete_all_blocks(
            &self.store,
            volume_id,
            &shared.name,
            size_blocks,
            &mut |reached| {
                if let Some((_, recorded)) = lock(&self.work).running_erase.as_mut() {
                    *recorded = reached;
                }
                progress(reached);
            },
        )?;
        if let Some(callback) = self.on_erased.get() {
            callback(volume_id);
        }
        Ok(())
    }

    fn enqueue(&self, change: impl FnOnce(&mut Work)) {
        let mut work = lock(&self.work);
        change(&mut work);
        self.work_changed.notify_all();
    }

    /// Brings the copy of one volume in line with the catalog.
    fn refresh(&self, state: &CatalogState, volume_id: u64) {
        let hosted_entry = state
            .volumes
            .get(&volume_id)
            .filter(|entry| entry.record.replication.hosts(self.local_node));
        let mut volumes = write(&self.volumes);
        match hosted_entry {
            Some(entry) => {
                match volumes.get(&volume_id) {
                    Some(shared) => shared.update(entry),
                    None => {
                        volumes.insert(volume_id, Arc::new(VolumeShared::new(entry)));
                    }
                }
                if entry.record.status == VolumeStatus::Deleting {
                    drop(volumes);
                    self.enqueue(|work| {
                        if !work.erase_by_caller.contains(&volume_id) {
                            work.erase.insert(volume_id);
                        }
                    });
                }
            }
            None => {
                if let Some(shared) = volumes.remove(&volume_id) {
                    shared.deleted.store(true, Ordering::SeqCst);
                    drop(volumes);
                    if self.erasable_here(state, volume_id) {
                        tracing::info!(volume = %shared.name, "this node no longer holds a replica; erasing its copy");
                        self.enqueue(|work| {
                            work.erase_orphans.insert(volume_id);
                        });
                    }
                }
            }
        }
    }

    /// Whether this node's blocks of `volume_id` are garbage: the catalog has no such volume,
    /// or has its replicas on other nodes and no volume hosted here reads through its blocks
    /// (a clone made while the replica was here).
    fn erasable_here(&self, state: &CatalogState, volume_id: u64) -> bool {
        let Some(entry) = state.volumes.get(&volume_id) else {
            return true;
        };
        let reads_through = |view: &[keel_catalog::view::Layer]| {
            view.iter().any(|layer| layer.volume_id == volume_id)
        };
        !entry.record.replication.hosts(self.local_node)
            && !state.volumes.values().any(|other| {
                other.record.replication.hosts(self.local_node)
                    && (reads_through(&other.record.view)
                        || other
                            .snapshots
                            .values()
                            .any(|snapshot| reads_through(&snapshot.view)))
            })
    }

    /// Brings every hosted volume in line with the catalog.
    pub fn refresh_from(&self, state: &CatalogState) {
        self.refresh_all(state)
    }

    fn refresh_all(&self, state: &CatalogState) {
        let mut ids: BTreeSet<u64> = read(&self.volumes).keys().copied().collect();
        ids.extend(state.volumes.keys().copied());
        for id in ids {
            self.refresh(state, id);
        }
    }

    /// Queues for erasure every volume id that has blocks here but no record at all (a crash
    /// between a volume's last erase batch and its record's removal, or a Raft snapshot that
    /// arrived after the volume was deleted elsewhere).
    fn find_orphans(&self, state: &CatalogState) -> VolumeResult<()> {
        let orphans = record::volume_ids_with_blocks(&self.store)?
            .into_iter()
            .filter(|id| self.erasable_here(state, *id))
            .collect::<Vec<u64>>();
        if !orphans.is_empty() {
            tracing::info!(
                ?orphans,
                "erasing blocks of volumes the catalog no longer has"
            );
            self.enqueue(|work| work.erase_orphans.extend(orphans));
        }
        Ok(())
    }

    /// Stops the worker (after the job it is running).
    pub fn shutdown(&self) {
        self.enqueue(|work| work.stopping = true);
        if let Some(worker) = lock(&self.worker).take() {
            let _ = worker.join();
        }
    }
}

impl Observer for Engine {
    fn applied(&self, state: &CatalogState, events: &[Event]) {
        for event in events {
            match event {
                Event::VolumeChanged { volume_id } | Event::VolumeDeleting { volume_id } => {
                    self.refresh(state, *volume_id)
                }
                Event::VolumeForgotten { volume_id } => self.refresh(state, *volume_id),
                Event::VolumeGarbage { volume_id } => {
                    if self.get(*volume_id).is_some() {
                        self.enqueue(|work| {
                            if !work.collect_by_caller.contains(volume_id) {
                                work.collect.insert(*volume_id);
                            }
                        });
                    }
                }
                Event::Restored => {
                    self.refresh_all(state);
                    if let Err(error) = self.find_orphans(state) {
                        tracing::warn!(%error, "could not look for orphaned volume blocks");
                    }
                }
                Event::NodeChanged { .. } | Event::BucketChanged { .. } | Event::KeysChanged => {}
            }
        }
    }
}

enum Job {
    Erase(u64),
    EraseOrphan(u64),
    Collect(u64),
}

/// The next job queued; with `wait`, waits for one (`None` once the engine stops).
fn next_job(engine: &Engine, wait: bool) -> Option<Job> {
    let mut work = lock(&engine.work);
    loop {
        if work.stopping {
            return None;
        }
        if let Some(id) = work.erase.pop_first() {
            work.running_erase = Some((id, Progress { done: 0, total: 0 }));
            return Some(Job::Erase(id));
        }
        if let Some(id) = work.erase_orphans.pop_first() {
            return Some(Job::EraseOrphan(id));
        }
        if let Some(id) = work.collect.pop_first() {
            work.running_collect = Some(id);
            return Some(Job::Collect(id));
        }
        if !wait {
            return None;
        }
        work = engine
            .work_changed
            .wait(work)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
    }
}

fn worker_loop(engine: std::sync::Weak<Engine>) {
    loop {
        let Some(strong) = engine.upgrade() else {
            return;
        };
        let Some(job) = next_job(&strong, true) else {
            return;
        };
        run_job(&strong, job);
    }
}

fn run_job(strong: &Engine, job: Job) {
    let result = match job {
        Job::Erase(id) => {
            let result = strong.erase(id, &mut |_| {});
            lock(&strong.work).running_erase = None;
            strong.work_changed.notify_all();
            result
        }
        // Batch by batch, and only while the volume is not hosted here: a replica placed
        // back on this node meanwhile keeps what it is sent from then on.
        Job::EraseOrphan(id) => scan::delete_all_blocks_while(
            &strong.store,
            id,
            &format!("#{id}"),
            0,
            &mut |_| {},
            || {
                let volumes = read(&strong.volumes);
                (!volumes.contains_key(&id)).then_some(volumes)
            },
        ),
        Job::Collect(id) => {
            let result = strong.collect(id, &mut |_| {});
            let mut work = lock(&strong.work);
            work.running_collect = None;
            work.finished_collect = result.as_ref().ok().map(|report| (id, *report));
            strong.work_changed.notify_all();
            result.map(|_| ())
        }
    };
    if let Err(error) = result {
        tracing::warn!(%error, "volume background work failed; it is retried at the next start");
    }
}
