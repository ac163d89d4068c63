//! The engine: group commit, recovery, and verified reads.
//!
//! Group commit is leader/follower: a writer queues its ops; if no leader is active it becomes
//! the leader, takes everything queued (up to `batch_size_max_bytes`), encodes it into one buffer,
//! writes it with one `pwrite` per device, issues one `fdatasync` per device if any writer in the
//! batch asked for `Sync`, applies the batch to the index (in memory; see `index`), hands the
//! leadership to the next queued writer and wakes the writers of its batch. A lone writer pays no
//! thread hand-off; N concurrent writers share one sync.
//!
//! Fault model: an error from `fdatasync` poisons the engine (the kernel may have dropped the
//! dirty pages; retrying would report success for lost data). A failed `pwrite` (ENOSPC, EIO) is
//! undone by truncating the segment back to the batch's start, so bytes nobody was told are
//! durable can never be replayed; if the truncate fails too, the engine is poisoned.

use bytes::Bytes;
use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::{StoreError, StoreResult};
use crate::format::{self, Compression, ExtentHeader};
use crate::index::{Index, IndexUpdate, Location, Persist, Tail};
use crate::latency::{BatchSizes, SyncTimes};
use crate::segment::{hex, BatchBuffer, DirectWrites, Segment, Segments};
use crate::{Durability, StoreConfig, StoreStats, WriteAck, WriteOp};

const INDEX_FILE: &str = "index.redb";
/// Replay applies the log to the index in chunks of this many updates, bounding its memory.
const REPLAY_APPLY_CHUNK_UPDATES: usize = 16_384;
/// Free space always kept for the index and checkpoints, even with `reserve_bytes = 0`: an index
/// update that fails after its batch reached the log poisons the store.
const INDEX_HEADROOM_BYTES: u64 = 16 << 20;
/// The free-space check trusts its last statfs for this long, while the free space it saw minus
/// what the store appended since stays above the reserve by `SPACE_RECHECK_MARGIN_BYTES`.
const SPACE_RECHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);
const SPACE_RECHECK_MARGIN_BYTES: u64 = 256 << 20;
/// How often a read retries when compaction moved its extent between lookup and read.
const READ_RETRIES_MAX: usize = 8;
/// Most bytes one `pread` of [`Engine::read_extents`] covers.
const READ_SPAN_BYTES_MAX: u64 = 1 << 20;
/// Read buffers of [`Engine::read_extents`] kept for reuse (each up to [`READ_SPAN_BYTES_MAX`]),
/// so that a read does not zero a new one.
const READ_SPANS_KEPT: usize = 8;
/// A growing (unprepared) segment starts the preparation of its successor once this much has
/// been appended to it, and is left as soon as that is ready: a fresh store pays growing-file
/// fdatasyncs (about 1.5× slower here) for seconds, not for a whole segment. Stores that stay
/// smaller never write a prepared segment.
const GROWING_SEGMENT_PREPARE_AFTER_BYTES: u64 = 4 << 20;
/// A writer that fills segments faster than their successors can be zero-filled (a bulk load,
/// a replica's rebuild) never waits for the zeros: it cancels the preparation and appends to a
/// growing file. The preparations of the next segments are then skipped, 1, 2, 4, then up to
/// this many segments (or for [`PREPARE_SKIP_TIME_MAX`]), so zeros nobody will use do not take
/// the disk and a core from the writer. A preparation started half way through a prepared
/// segment (the schedule of a writer that is not in a hurry) that finishes in time resets the
/// count; one started early in a growing segment does not (it has a whole segment's lead).
const PREPARE_SKIPS_MAX: u64 = 8;
/// Skipping ends after this long even if the writer has not passed the skipped segments: a
/// bulk load fills them within seconds, a slow writer gets its prepared segments back.
const PREPARE_SKIP_TIME_MAX: std::time::Duration = std::time::Duration::from_secs(10);
/// A preparation the writer nearly outran counts as outrun: if the log grew by this share of a
/// segment (1/`PREPARE_NEARLY_OUTRUN_DIVISOR`) while the zeros were written, the writer appends
/// at a good part of the zero-fill's own speed. Its zeros are then mostly overwritten before
/// any fdatasync of small writes could use them, and writing them cost the writer as much again
/// in page-cache copies and disk bandwidth (a replica's 4 GiB rebuild: 1.3× faster with this
/// rule, measured in `docs/benchmarks.md`). A writer of small synced writes (tens of MB/s
/// against a zero-fill of hundreds) grows the log by a few percent of a segment meanwhile.
const PREPARE_NEARLY_OUTRUN_DIVISOR: u64 = 4;

/// The background preparation of the next segment.
struct Preparing {
    id: u64,
    /// The outcome, and the log's length ([`Engine::appended`]) when the zeros were done.
    thread: std::thread::JoinHandle<(StoreResult<bool>, u64)>,
    cancel: Arc<AtomicBool>,
    /// Started early, from a growing segment.
    early: bool,
    /// The log's length when it started.
    started_at: u64,
}

/// Which segments are not prepared, after the writer outran a preparation.
struct PrepareBackoff {
    /// Segments up to this id are not prepared...
    skip_through: u64,
    /// ...until this moment.
    skip_until: Option<std::time::Instant>,
    /// How many segments the next outrun preparation skips.
    skips: u64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A write as the leader sees it, prepared by the writer's own thread before it queues: hashed,
/// compressed, validated. The leader only lays bytes into the batch buffer, so CPU work runs in
/// parallel across writers and the critical section stays short.
pub(crate) struct Op {
    kind: u8,
    key: Vec<u8>,
    /// The payload as it goes to disk.
    stored: Bytes,
    compression: Compression,
    raw_len: usize,
    content_hash: Option<[u8; 32]>,
    /// Compaction copies keep the sequence number of the extent they copy.
    relocated_seq: Option<u64>,
}

impl Op {
    pub(crate) fn prepare(op: WriteOp) -> StoreResult<Op> {
        validate(&op)?;
        Ok(match op {
            WriteOp::Put {
                key,
                value,
                compression,
                content_hash,
            } => Op::put(key, value, compression, content_hash, None),
            WriteOp::Delete { key } => Op::delete(key, None),
        })
    }

    /// A compaction copy of a tombstone with sequence number `seq`. It changes nothing in a
    /// live index (the delete was applied long ago); it exists so that a rebuild of the index
    /// from the whole log still sees the delete after compaction removed the original, while an
    /// older put of the key may remain in an older segment.
    pub(crate) fn relocated_delete(key: Vec<u8>, seq: u64) -> Op {
        Op::delete(key, Some(seq))
    }

    fn delete(key: Vec<u8>, relocated_seq: Option<u64>) -> Op {
        Op {
            kind: format::KIND_DELETE,
            key,
            stored: Bytes::new(),
            compression: Compression::None,
            raw_len: 0,
            content_hash: None,
            relocated_seq,
        }
    }

    /// A compaction copy of `value`, applied only if `key` still maps to `seq`.
    pub(crate) fn relocation(
        key: Vec<u8>,
        value: Vec<u8>,
        compression: Compression,
        content_hash: bool,
        seq: u64,
    ) -> Op {
        Op::put(key, value.into(), compression, content_hash, Some(seq))
    }

    fn put(
        key: Vec<u8>,
        value: Bytes,
        compression: Compression,
        content_hash: bool,
        relocated_seq: Option<u64>,
    ) -> Op {
        let hash = content_hash.then(|| *blake3::hash(&value).as_bytes());
        let raw_len = value.len();
        let (compression, stored) = match compression {
            Compression::None => (Compression::None, value),
            codec => match format::compress(&value, codec) {
                (Compression::None, _) => (Compression::None, value),
                (packed, bytes) => (packed, bytes.into()),
            },
        };
        Op {
            kind: format::KIND_PUT,
            key,
            stored,
            compression,
            raw_len,
            content_hash: hash,
            relocated_seq,
        }
    }

    fn payload_len(&self) -> usize {
        self.stored.len()
    }

    fn record_len(&self) -> usize {
        format::record_len(self.key.len(), self.stored.len())
    }

    fn adds_data(&self) -> bool {
        self.kind == format::KIND_PUT && self.relocated_seq.is_none()
    }
}

enum SlotState {
    Waiting,
    Lead,
    Done(StoreResult<WriteAck>),
}

struct Slot {
    state: Mutex<SlotState>,
    ready: Condvar,
}

impl Slot {
    fn set(&self, state: SlotState) {
        *lock(&self.state) = state;
        self.ready.notify_one();
    }
}

struct Pending {
    ops: Vec<Op>,
    durability: Durability,
    /// Compaction and checkpoints may write into the space reserve.
    may_use_reserve: bool,
    /// Bytes this node does not read back soon: a replica's copy of a volume, a received
    /// stream, compaction's copies. A batch carrying `StoreConfig::direct_write_min_bytes` of
    /// them is written around the page cache, where they would only push out pages that are
    /// read.
    bulk: bool,
    /// Make the index durable after this batch, dropping these segments' counters.
    checkpoint: Option<Vec<u64>>,
    slot: Arc<Slot>,
}

#[derive(Default)]
struct Queue {
    pending: VecDeque<Pending>,
    leader_active: bool,
}

struct Writer {
    segment: Arc<Segment>,
    /// Append position in `segment`.
    offset: u64,
    next_seq: u64,
    /// Every byte appended so far has been fdatasynced.
    synced: bool,
    /// The segment grows with each append (it was not prepared), so every fdatasync also
    /// writes file-size and block-allocation metadata: the writer moves to a prepared segment as
    /// soon as one is ready, instead of when this one is full. Cleared if that preparation
    /// fails; the segment is then used up as usual.
    growing: bool,
    since_checkpoint_bytes: u64,
    /// When free space was last read, the least free space of any device then, and the bytes
    /// appended since.
    space_checked_at: Option<std::time::Instant>,
    space_available_bytes: u64,
    appended_since_space_check_bytes: u64,
    /// For batches carrying `StoreConfig::direct_write_min_bytes` of bulk writes.
    direct: DirectWrites,
    /// Where each batch is encoded.
    buffer: BatchBuffer,
}

pub(crate) struct Engine {
    config: StoreConfig,
    pub(crate) segments: Segments,
    pub(crate) index: Index,
    queue: Mutex<Queue>,
    writer: Mutex<Writer>,
    /// `Writer::next_seq` as of the last committed batch, readable without waiting for the
    /// writer (which holds its lock across fdatasync): every write not committed yet gets a
    /// sequence number at least this.
    next_seq: AtomicU64,
    poisoned: AtomicBool,
    poison_reason: Mutex<Option<(String, String)>>,
    pub(crate) corrupt_reads: AtomicU64,
    /// Buffers [`Engine::read_extents`] reads runs into, kept for the next read.
    read_spans: Mutex<Vec<Vec<u8>>>,
    pub(crate) repaired_extents: AtomicU64,
    /// Log fdatasync calls (one per device) since open.
    syncs: AtomicU64,
    /// How long each sync of the log (every device) took.
    sync_times: SyncTimes,
    /// Writes each group commit carried.
    batch_sizes: BatchSizes,
    /// How long each device's fdatasync of the log took, by device.
    device_sync_times: Vec<SyncTimes>,
    /// The background preparation of the next segment, if one was started.
    preparing: Mutex<Option<Preparing>>,
    prepare_backoff: Mutex<PrepareBackoff>,
    /// Bytes appended to the log since open: how far the writer got while a preparation ran.
    appended: Arc<AtomicU64>,
    /// Serializes scrub and compaction with each other.
    pub(crate) maintenance: Mutex<()>,
}

impl Engine {
    pub fn open(config: StoreConfig) -> StoreResult<Engine> {
        let segments = Segments::open(config.disk.clone(), &config.data_dirs, config.ephemeral)?;
        segments.remove_preparations()?;
        let index_dir = segments.devices[0].dir.clone();
        let index_path = index_dir.join(INDEX_FILE);
        let copy_path = segments.devices.get(1).map(|d| d.dir.join(INDEX_FILE));
        let disk = segments.disk.clone();
        let exists = |path: &std::path::Path| -> StoreResult<bool> {
            Ok(disk
                .file_len(path)
                .map_err(|e| StoreError::io(path, e))?
                .is_some())
        };
        let mut index_exists = exists(&index_path)?;
        if !index_exists && !segments.ids().is_empty() {
            match &copy_path {
                // The mirror keeps a copy: restore the index from it.
                Some(copy) if exists(copy)? => {
                    tracing::warn!(path = %index_path.display(), "the index is missing; restoring it from its copy on the mirror");
                    copy_file(disk.as_ref(), copy, &index_path)?;
                    crate::segment::sync_dir(disk.as_ref(), &index_dir)?;
                    index_exists = true;
                }
                // Replaying from the first segment would skip compaction copies and resurrect
                // keys whose tombstones compaction removed: refuse rather than lose data.
                _ => return Err(StoreError::IndexMissing { path: index_path }),
            }
        }
        let (index, tail) = Index::open(disk.as_ref(), &index_path, copy_path.as_deref())?;
        if !index_exists {
            // The new index's directory entry (and its copy's) must be durable before any
            // segment is: a log without its index is refused at open.
            for device in &segments.devices {
                crate::segment::sync_dir(disk.as_ref(), &device.dir)?;
            }
        }
        let writer = recover(&segments, &index, tail, config.segment_size_max_bytes)?;
        let next_seq = AtomicU64::new(writer.next_seq);
        let device_sync_times = segments
            .devices
            .iter()
            .map(|_| SyncTimes::default())
            .collect();
        Ok(Engine {
            config,
            segments,
            index,
            queue: Mutex::new(Queue::default()),
            writer: Mutex::new(writer),
            next_seq,
            poisoned: AtomicBool::new(false),
            poison_reason: Mutex::new(None),
            corrupt_reads: AtomicU64::new(0),
            read_spans: Mutex::new(Vec::new()),
            repaired_extents: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            sync_times: SyncTimes::default(),
            batch_sizes: BatchSizes::default(),
            device_sync_times,
            preparing: Mutex::new(None),
            prepare_backoff: Mutex::new(PrepareBackoff {
                skip_through: 0,
                skip_until: None,
                skips: 1,
            }),
            appended: Arc::new(AtomicU64::new(0)),
            maintenance: Mutex::new(()),
        })
    }

    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// Free space writes that add data never use: the configured reserve, at least the
    /// index's headroom.
    pub fn reserve_bytes(&self) -> u64 {
        self.config.reserve_bytes.max(INDEX_HEADROOM_BYTES)
    }

    /// The least free space of any data directory, read now.
    pub fn available_bytes(&self) -> StoreResult<u64> {
        let mut least = u64::MAX;
        for device in &self.segments.devices {
            let available = (self.segments.disk.available_bytes(&device.dir))
                .map_err(|e| StoreError::io(&device.dir, e))?;
            least = least.min(available);
        }
        Ok(least)
    }

    pub fn write(&self, ops: Vec<WriteOp>, durability: Durability) -> StoreResult<WriteAck> {
        self.write_ops(ops, durability, false, false)
    }

    /// [`Engine::write`] of bytes this node does not read back soon (see [`Pending::bulk`]).
    pub fn write_bulk(&self, ops: Vec<WriteOp>, durability: Durability) -> StoreResult<WriteAck> {
        self.write_ops(ops, durability, false, true)
    }

    /// [`Engine::write`] for metadata that may use the space reserve.
    pub fn write_metadata(
        &self,
        ops: Vec<WriteOp>,
        durability: Durability,
    ) -> StoreResult<WriteAck> {
        self.write_ops(ops, durability, true, false)
    }

    fn write_ops(
        &self,
        ops: Vec<WriteOp>,
        durability: Durability,
        may_use_reserve: bool,
        bulk: bool,
    ) -> StoreResult<WriteAck> {
        let prepared = ops
            .into_iter()
            .map(Op::prepare)
            .collect::<StoreResult<Vec<Op>>>()?;
        self.submit(prepared, durability, may_use_reserve, bulk, None)
    }

    pub fn flush(&self) -> StoreResult<()> {
        self.submit(Vec::new(), Durability::Sync, true, false, None)
            .map(|_| ())
    }

    /// Writes compaction copies; each is applied only if its key still maps to its seq. Bulk:
    /// nothing asks for a copy because it was copied.
    pub(crate) fn relocate(&self, ops: Vec<Op>) -> StoreResult<()> {
        self.submit(ops, Durability::Buffered, true, true, None)
            .map(|_| ())
    }

    /// Syncs the log and commits the index durably, forgetting `dropped` segments' counters.
    pub(crate) fn checkpoint(&self, dropped: Vec<u64>) -> StoreResult<()> {
        self.submit(Vec::new(), Durability::Sync, true, false, Some(dropped))
            .map(|_| ())
    }

    pub(crate) fn active_segment(&self) -> u64 {
        lock(&self.writer).segment.id
    }

    fn submit(
        &self,
        ops: Vec<Op>,
        durability: Durability,
        may_use_reserve: bool,
        bulk: bool,
        checkpoint: Option<Vec<u64>>,
    ) -> StoreResult<WriteAck> {
        // Until a leader has written this request, or this thread leads.
        let _wait = keel_ops::Phase::enter(keel_ops::phase::COMMIT_WAIT);
        let slot = Arc::new(Slot {
            state: Mutex::new(SlotState::Waiting),
            ready: Condvar::new(),
        });
        let lead = {
            let mut queue = lock(&self.queue);
            queue.pending.push_back(Pending {
                ops,
                durability,
                may_use_reserve,
                bulk,
                checkpoint,
                slot: slot.clone(),
            });
            !std::mem::replace(&mut queue.leader_active, true)
        };
        if !lead {
            let mut state = lock(&slot.state);
            loop {
                match std::mem::replace(&mut *state, SlotState::Waiting) {
                    SlotState::Waiting => {
                        state = slot
                            .ready
                            .wait(state)
                            .unwrap_or_else(|poisoned| poisoned.into_inner());
                    }
                    SlotState::Lead => break,
                    SlotState::Done(result) => return result,
                }
            }
        }
        // Leader: our entry is at the front of the queue (a leader is only ever handed the
        // front entry, and a writer that found no leader had an empty queue before its push).
        let batch = {
            let mut queue = lock(&self.queue);
            let mut batch = Vec::new();
            let mut bytes = 0usize;
            while let Some(front) = queue.pending.front() {
                let size: usize = front.ops.iter().map(Op::payload_len).sum();
                if !batch.is_empty() && bytes + size > self.config.batch_size_max_bytes {
                    break;
                }
                bytes += size;
                if let Some(pending) = queue.pending.pop_front() {
                    batch.push(pending);
                }
            }
            batch
        };
        let results = self.commit_batch(&batch);
        {
            let mut queue = lock(&self.queue);
            match queue.pending.front() {
                Some(next) => next.slot.set(SlotState::Lead),
                None => queue.leader_active = false,
            }
        }
        let mut own = None;
        for (pending, result) in batch.into_iter().zip(results) {
            if Arc::ptr_eq(&pending.slot, &slot) {
                own = Some(result);
            } else {
                pending.slot.set(SlotState::Done(result));
            }
        }
        own.unwrap_or_else(|| Err(StoreError::Invalid("leader lost its own write".into())))
    }

    /// Syncs `segment` on every device, timing it.
    fn timed_sync(&self, segment: &Segment) -> StoreResult<()> {
        let _sync = keel_ops::Phase::enter(keel_ops::phase::FDATASYNC);
        let started = std::time::Instant::now();
        let synced = segment.sync_timed(&self.device_sync_times);
        self.sync_times.observe(started.elapsed());
        synced
    }

    fn poison(&self, operation: &str, error: &StoreError) {
        tracing::error!(%error, operation, "store poisoned: refusing writes until reopened");
        self.poisoned.store(true, Ordering::SeqCst);
        let mut reason = lock(&self.poison_reason);
        if reason.is_none() {
            *reason = Some((operation.to_string(), error.to_string()));
        }
    }

    fn poisoned_error(&self) -> StoreError {
        let reason = lock(&self.poison_reason).clone();
        let (operation, reason) = reason.unwrap_or_else(|| ("sync".into(), "unknown".into()));
        StoreError::Poisoned { operation, reason }
    }

    /// Refuses `needed` more bytes below the reserve. Reads free space with statfs only when the
    /// last reading is old or close to the limit.
    fn space_check_cached(&self, writer: &mut Writer, needed: u64) -> StoreResult<()> {
        let reserve_bytes = self.reserve_bytes();
        if let Some(at) = writer.space_checked_at {
            let estimate = writer
                .space_available_bytes
                .saturating_sub(writer.appended_since_space_check_bytes);
            if self.config.clock.now().saturating_duration_since(at) < SPACE_RECHECK_INTERVAL
                && estimate > needed + reserve_bytes + SPACE_RECHECK_MARGIN_BYTES
            {
                return Ok(());
            }
        }
        let result = self.space_check(needed);
        writer.space_checked_at = Some(self.config.clock.now());
        writer.appended_since_space_check_bytes = 0;
        writer.space_available_bytes = match &result {
            Ok(()) => self
                .segments
                .devices
                .iter()
                .filter_map(|d| self.segments.disk.available_bytes(&d.dir).ok())
                .min()
                .unwrap_or(0),
            Err(_) => 0,
        };
        result
    }

    /// Whether the extents `ops` replace or delete take at least the log bytes their new
    /// extents take. Only asked on a full disk, so the index lookups cost nothing otherwise.
    fn frees_at_least_what_it_adds(&self, ops: &[Op]) -> bool {
        let mut adds = 0u64;
        let mut frees = 0u64;
        let mut seen = std::collections::HashSet::new();
        for op in ops {
            if op.kind == format::KIND_PUT {
                adds += op.record_len() as u64;
            }
            // A key written twice in one batch frees its old extent once.
            if !seen.insert(op.key.as_slice()) {
                continue;
            }
            match self.index.get(&op.key) {
                Ok(Some(location)) => frees += u64::from(location.record_len),
                Ok(None) => {}
                Err(_) => return false,
            }
        }
        frees >= adds
    }

    fn space_check(&self, needed: u64) -> StoreResult<()> {
        let reserve_bytes = self.reserve_bytes();
        for device in &self.segments.devices {
            let available = self
                .segments
                .disk
                .available_bytes(&device.dir)
                .map_err(|e| StoreError::io(&device.dir, e))?;
            if available < needed.saturating_add(reserve_bytes) {
                return Err(StoreError::NoSpace {
                    path: device.dir.clone(),
                    available_bytes: available,
                    reserve_bytes,
                });
            }
        }
        Ok(())
    }

    /// Writes one batch; returns one result per pending write, in order.
    fn commit_batch(&self, batch: &[Pending]) -> Vec<StoreResult<WriteAck>> {
        let fail_all = |make: &dyn Fn() -> StoreError| batch.iter().map(|_| Err(make())).collect();
        if self.poisoned.load(Ordering::SeqCst) {
            return fail_all(&|| self.poisoned_error());
        }
        let mut writer = lock(&self.writer);
        self.batch_sizes.observe(batch.len());

        // Admission: writes that add data are refused below the reserve; deletes, compaction
        // and checkpoints go through so that space can be freed.
        let mut admitted: Vec<Option<StoreError>> = Vec::with_capacity(batch.len());
        let mut space_verdict: Option<Result<(), (std::path::PathBuf, u64, u64)>> = None;
        for pending in batch {
            let adds_data = pending.ops.iter().any(Op::adds_data);
            if !adds_data || pending.may_use_reserve {
                admitted.push(None);
                continue;
            }
            let verdict = space_verdict.get_or_insert_with(|| {
                let needed: usize = batch
                    .iter()
                    .flat_map(|p| &p.ops)
                    .map(|op| op.payload_len() + 128)
                    .sum();
                match self.space_check_cached(&mut writer, needed as u64) {
                    Ok(()) => Ok(()),
                    Err(StoreError::NoSpace {
                        path,
                        available_bytes,
                        reserve_bytes,
                    }) => Err((path, available_bytes, reserve_bytes)),
                    Err(other) => {
                        tracing::warn!(%other, "free-space check failed; writing anyway");
                        Ok(())
                    }
                }
            });
            if verdict.is_err() && self.frees_at_least_what_it_adds(&pending.ops) {
                // Space must always be reclaimable: a batch that frees more than it adds (a
                // delete that rewrites a record or a reference count on its way) may use the
                // reserve.
                admitted.push(None);
                continue;
            }
            admitted.push(
                verdict
                    .clone()
                    .err()
                    .map(
                        |(path, available_bytes, reserve_bytes)| StoreError::NoSpace {
                            path,
                            available_bytes,
                            reserve_bytes,
                        },
                    ),
            );
        }

        // Size the batch, then roll to a new segment first if it would not fit.
        let mut total_len = 0u64;
        let mut bulk_len = 0u64;
        for (pending, refused) in batch.iter().zip(&admitted) {
            if refused.is_none() {
                let len = pending
                    .ops
                    .iter()
                    .map(|op| op.record_len() as u64)
                    .sum::<u64>();
                total_len += len;
                if pending.bulk {
                    bulk_len += len;
                }
            }
        }
        let full = writer.offset + total_len > self.config.segment_size_max_bytes;
        let successor_ready = writer.growing
            && match self.preparation_outcome(writer.segment.id + 1) {
                Some(true) => true,
                // It failed: stay in this segment until it is full (and stop asking).
                Some(false) => {
                    writer.growing = false;
                    false
                }
                None => false,
            };
        if (full || successor_ready) && writer.offset > format::SEGMENT_HEADER_LEN as u64 {
            if let Err(error) = self.roll(&mut writer) {
                return fail_all(&|| clone_error(&error));
            }
        }

        // Encode.
        let base = writer.offset;
        // Given back once the batch is written, unless a value larger than a batch grew it
        // (lost on a failure too: the next batch grows a new one).
        let mut reused = std::mem::take(&mut writer.buffer);
        let buffer = reused.for_append(base, total_len as usize);
        let mut encoded = 0usize;
        let mut updates = Vec::new();
        let mut acks = Vec::with_capacity(batch.len());
        let mut seq = writer.next_seq;
        let mut need_sync = false;
        let mut checkpoint: Option<Vec<u64>> = None;
        // The batch's first extent says whether the log before it was durable (see
        // `format::FLAG_AFTER_SYNC`).
        let mut after_sync = if writer.synced {
            format::FLAG_AFTER_SYNC
        } else {
            0
        };
        for (pending, refused) in batch.iter().zip(&admitted) {
            if refused.is_some() {
                acks.push(0);
                continue;
            }
            need_sync |= pending.durability == Durability::Sync;
            if let Some(dropped) = &pending.checkpoint {
                checkpoint.get_or_insert_with(Vec::new).extend(dropped);
            }
            let last = pending.ops.len().saturating_sub(1);
            for (i, op) in pending.ops.iter().enumerate() {
                let group_end = if i == last { format::FLAG_GROUP_END } else { 0 };
                let offset = base + encoded as u64;
                let record = &mut buffer[encoded..encoded + op.record_len()];
                encoded += record.len();
                let (op_seq, flags) = match op.relocated_seq {
                    Some(old_seq) => (old_seq, group_end | format::FLAG_RELOCATED),
                    None => (seq, group_end),
                };
                let flags = flags | std::mem::take(&mut after_sync);
                format::encode_extent(
                    record,
                    op.kind,
                    op.compression,
                    flags,
                    op_seq,
                    &op.key,
                    &op.stored,
                    op.raw_len,
                    op.content_hash.as_ref(),
                );
                if op.kind == format::KIND_DELETE && op.relocated_seq.is_some() {
                    // A carried tombstone: nothing to change in the live index.
                } else if op.kind == format::KIND_DELETE {
                    updates.push(IndexUpdate::Delete {
                        key: op.key.clone(),
                    });
                } else {
                    updates.push(IndexUpdate::Put {
                        key: op.key.clone(),
                        location: Location {
                            segment: writer.segment.id,
                            offset,
                            record_len: (base + encoded as u64 - offset) as u32,
                            raw_len: op.raw_len as u32,
                            stored_len: op.stored.len() as u32,
                            seq: op_seq,
                        },
                        relocated: op.relocated_seq.is_some(),
                        bulk: pending.bulk,
                    });
                }
                if op.relocated_seq.is_none() {
                    seq += 1;
                }
            }
            acks.push(seq.saturating_sub(1));
        }
        assert_eq!(
            encoded as u64, total_len,
            "batch size computed before encoding"
        );

        // Write.
        let pwrite = keel_ops::Phase::enter(keel_ops::phase::PWRITE);
        let min = self.config.direct_write_min_bytes as u64;
        // (`bulk_len` is part of the buffer: a direct batch is never empty.)
        let went_direct = min > 0 && bulk_len >= min;
        if !buffer.is_empty() {
            let writer = &mut *writer;
            let direct = went_direct.then_some(&writer.direct);
            if let Err(error) = writer.segment.append(buffer, base, direct) {
                if let Err(undo) = writer.segment.truncate(base) {
                    self.poison("truncate after failed write", &undo);
                }
                let error = if error.is_no_space() {
                    self.space_check(buffer.len() as u64).err().unwrap_or(error)
                } else {
                    error
                };
                return fail_all(&|| clone_error(&error));
            }
            writer.synced = false;
        }
        let appended = buffer.len() as u64;
        if reused.capacity_bytes() <= self.config.batch_size_max_bytes + crate::disk::DIRECT_ALIGN {
            writer.buffer = reused;
        }
        writer.since_checkpoint_bytes += appended;
        writer.appended_since_space_check_bytes += appended;
        let checkpoint_due = writer.since_checkpoint_bytes >= self.config.checkpoint_interval_bytes;
        need_sync |= checkpoint_due || checkpoint.is_some();

        drop(pwrite);

        // Sync.
        if need_sync && !writer.synced {
            self.syncs.fetch_add(1, Ordering::Relaxed);
            if let Err(error) = self.timed_sync(&writer.segment) {
                self.poison("fdatasync", &error);
                return fail_all(&|| self.poisoned_error());
            }
            writer.synced = true;
        }
        writer.offset = base + appended;
        writer.next_seq = seq;
        self.appended.fetch_add(appended, Ordering::Relaxed);
        self.next_seq.store(seq, Ordering::SeqCst);
        // Only a batch of ordinary writes starts a preparation. A bulk writer (a rebuild, a
        // receive) gains nothing from it: zeros written through the cache ahead of it cost a
        // copy of every byte, and it syncs too rarely to gain from overwriting allocated
        // blocks. Small synced writes that follow it in the growing file it leaves do: they
        // start one at once, and move into it as soon as it is ready.
        if appended > 0
            && !went_direct
            && (writer.offset > self.config.segment_size_max_bytes / 2
                || (writer.growing && writer.offset >= GROWING_SEGMENT_PREPARE_AFTER_BYTES))
        {
            self.prepare_next_segment(writer.segment.id + 1, writer.growing);
        }

        // Index.
        // An explicit checkpoint (compaction about to delete segments, close) waits for the
        // index to be durable; the periodic one, which only bounds replay, is written in the
        // background.
        let durable = need_sync && (checkpoint_due || checkpoint.is_some());
        let persist = match (durable, checkpoint.is_some()) {
            (false, _) => Persist::Later,
            (true, false) => Persist::DurableInBackground,
            (true, true) => Persist::Durable,
        };
        let tail = Tail {
            segment: writer.segment.id,
            offset: writer.offset,
            next_seq: writer.next_seq,
        };
        if !updates.is_empty() || durable {
            let _apply = keel_ops::Phase::enter(keel_ops::phase::APPLYING);
            let dropped = checkpoint.unwrap_or_default();
            if let Err(error) = self.index.apply(&updates, tail, persist, &dropped) {
                // The log holds the batch durably; reopening replays it into the index.
                self.poison("index update", &error);
                return fail_all(&|| self.poisoned_error());
            }
            if durable {
                writer.since_checkpoint_bytes = 0;
            }
        }

        admitted
            .into_iter()
            .zip(acks)
            .map(|(refused, seq)| match refused {
                Some(error) => Err(error),
                None => Ok(WriteAck { seq }),
            })
            .collect()
    }

    /// Closes the active segment (synced) and starts the next one.
    fn roll(&self, writer: &mut Writer) -> StoreResult<()> {
        if !writer.synced {
            if let Err(error) = self.timed_sync(&writer.segment) {
                self.poison("fdatasync", &error);
                return Err(self.poisoned_error());
            }
            writer.synced = true;
        }
        let id = writer.segment.id + 1;
        let preparing = lock(&self.preparing).take();
        let prepared = match preparing {
            Some(preparing) if preparing.id == id => {
                // Never wait for the zeros (see PREPARE_SKIPS_MAX).
                if !preparing.thread.is_finished() {
                    preparing.cancel.store(true, Ordering::SeqCst);
                }
                let (outcome, outrun) = match preparing.thread.join() {
                    Ok((outcome, done_at)) => {
                        let grown = done_at.saturating_sub(preparing.started_at);
                        let nearly = grown
                            >= self.config.segment_size_max_bytes / PREPARE_NEARLY_OUTRUN_DIVISOR;
                        let cancelled = matches!(outcome, Ok(false));
                        (Ok(outcome), cancelled || nearly)
                    }
                    Err(panic) => (Err(panic), false),
                };
                self.note_preparation(id, outrun, preparing.early);
                match outcome {
                    Ok(Ok(true)) => self
                        .segments
                        .activate_prepared(id, self.config.segment_size_max_bytes)?,
                    Ok(Ok(false)) => None,
                    Ok(Err(error)) => {
                        tracing::warn!(%error, segment = id, "could not prepare segment; appending to a new file");
                        None
                    }
                    Err(_) => None,
                }
            }
            _ => None,
        };
        let (next, growing) = match prepared {
            Some(segment) => (segment, false),
            None => (self.segments.create(id)?, true),
        };
        writer.segment = next;
        writer.growing = growing;
        writer.offset = format::SEGMENT_HEADER_LEN as u64;
        Ok(())
    }

    /// Whether the preparation of segment `id` finished with full-size files (`Some(true)`),
    /// finished without them (`Some(false)`), or has not finished or started (`None`).
    fn preparation_outcome(&self, id: u64) -> Option<bool> {
        let finished = lock(&self.preparing)
            .as_ref()
            .is_some_and(|preparing| preparing.id == id && preparing.thread.is_finished());
        finished.then(|| {
            self.segments
                .preparation_complete(id, self.config.segment_size_max_bytes)
        })
    }

    /// Starts zero-filling segment `id` on a background thread, once, unless the writer
    /// outran the preparations before it (see PREPARE_SKIPS_MAX) or preparing is off
    /// ([`StoreConfig::prepare_segments`]).
    fn prepare_next_segment(&self, id: u64, early: bool) {
        if !self.config.prepare_segments {
            return;
        }
        {
            let backoff = lock(&self.prepare_backoff);
            if id <= backoff.skip_through
                && backoff
                    .skip_until
                    .is_some_and(|until| std::time::Instant::now() < until)
            {
                return;
            }
        }
        let mut preparing = lock(&self.preparing);
        if preparing
            .as_ref()
            .is_some_and(|preparing| preparing.id == id)
        {
            return;
        }
        let reserve_bytes = self.reserve_bytes();
        let cancel = Arc::new(AtomicBool::new(false));
        let preparation = self.segments.preparation(
            id,
            self.config.segment_size_max_bytes,
            reserve_bytes,
            cancel.clone(),
        );
        let appended = self.appended.clone();
        let started_at = appended.load(Ordering::Relaxed);
        match std::thread::Builder::new()
            .name("keel-segment-prep".into())
            .spawn(move || {
                let outcome = preparation.run();
                (outcome, appended.load(Ordering::Relaxed))
            }) {
            Ok(thread) => {
                *preparing = Some(Preparing {
                    id,
                    thread,
                    cancel,
                    early,
                    started_at,
                })
            }
            Err(error) => tracing::warn!(%error, "could not start segment preparation"),
        }
    }

    /// Counts the preparation of segment `id` the writer just reached: `outrun` when the
    /// writer got there first or nearly did (see [`PREPARE_NEARLY_OUTRUN_DIVISOR`]), `early`
    /// when it started from a growing segment.
    fn note_preparation(&self, id: u64, outrun: bool, early: bool) {
        let mut backoff = lock(&self.prepare_backoff);
        if outrun {
            backoff.skip_through = id + backoff.skips;
            backoff.skip_until = Some(std::time::Instant::now() + PREPARE_SKIP_TIME_MAX);
            backoff.skips = (backoff.skips * 2).min(PREPARE_SKIPS_MAX);
        } else if !early {
            backoff.skips = 1;
        }
    }

    pub fn get(&self, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        for _ in 0..READ_RETRIES_MAX {
            let Some(location) = self.index.get(key)? else {
                return Ok(None);
            };
            if let Some(value) = self.read_extent(key, &location)? {
                return Ok(Some(value));
            }
        }
        Err(StoreError::Invalid(format!(
            "key {} kept moving during read",
            hex(key)
        )))
    }

    pub fn contains(&self, key: &[u8]) -> StoreResult<bool> {
        Ok(self.index.get(key)?.is_some())
    }

    pub fn floor(&self, low: &[u8], high: &[u8]) -> StoreResult<Option<(Vec<u8>, Vec<u8>)>> {
        for _ in 0..READ_RETRIES_MAX {
            let Some((key, location)) = self.index.floor(low, high)? else {
                return Ok(None);
            };
            if let Some(value) = self.read_extent(&key, &location)? {
                return Ok(Some((key, value)));
            }
        }
        Err(StoreError::Invalid(
            "floor lookup kept moving during read".into(),
        ))
    }

    pub fn keys(&self, start: &[u8], end: &[u8], limit: usize) -> StoreResult<Vec<Vec<u8>>> {
        Ok(self
            .index
            .range(start, end, limit)?
            .into_iter()
            .map(|(key, _)| key)
            .collect())
    }

    pub fn keys_with_sequences(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> StoreResult<Vec<(Vec<u8>, u64)>> {
        Ok(self
            .index
            .range(start, end, limit)?
            .into_iter()
            .map(|(key, location)| (key, location.seq))
            .collect())
    }

    /// Every write not committed yet gets a sequence number above this.
    pub fn committed_sequence(&self) -> u64 {
        self.next_seq.load(Ordering::SeqCst).saturating_sub(1)
    }

    pub fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> StoreResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut out = Vec::new();
        for (key, location) in self.index.range(start, end, limit)? {
            let value = match self.read_extent(&key, &location)? {
                Some(value) => Some(value),
                // Moved by compaction since the range read: look it up again.
                None => self.get(&key)?,
            };
            if let Some(value) = value {
                out.push((key, value));
            }
        }
        Ok(out)
    }

    /// Where `key`'s value lies, if it is live.
    pub fn extent(&self, key: &[u8]) -> StoreResult<Option<Location>> {
        self.index.get(key)
    }

    /// Live keys in `[start, end)` with their extents' locations, at most `limit` of them.
    pub fn extents(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> StoreResult<Vec<(Vec<u8>, Location)>> {
        self.index.range(start, end, limit)
    }

    /// Reads and verifies the values of extents listed by [`Engine::extents`] and hands each to
    /// `visit` with its index, in order. Runs of extents that lie back to back in one segment
    /// are read with one `pread` of the first device into a reused buffer, and an uncompressed
    /// value is handed out of it without a copy. An extent that fails verification there is
    /// read again alone, through [`Engine::read_extent`] (every device, repair, or
    /// [`StoreError::Corrupt`]). An extent whose segment is gone (compaction moved it) is looked
    /// up again; `None` where its key was deleted since the listing.
    pub fn read_extents(
        &self,
        extents: &[(&[u8], Location)],
        visit: &mut dyn FnMut(usize, Option<&[u8]>),
    ) -> StoreResult<()> {
        let mut span = lock(&self.read_spans).pop().unwrap_or_default();
        let result = self.read_extent_runs(extents, &mut span, visit);
        // (A run of one extent larger than a span makes a larger buffer: not kept.)
        let mut spans = lock(&self.read_spans);
        if spans.len() < READ_SPANS_KEPT && span.len() as u64 <= READ_SPAN_BYTES_MAX {
            spans.push(span);
        }
        result
    }

    fn read_extent_runs(
        &self,
        extents: &[(&[u8], Location)],
        span: &mut Vec<u8>,
        visit: &mut dyn FnMut(usize, Option<&[u8]>),
    ) -> StoreResult<()> {
        let mut first = 0;
        while first < extents.len() {
            let (_, head) = extents[first];
            let mut end = first + 1;
            let mut span_end = head.offset + u64::from(head.record_len);
            while let Some((_, next)) = extents.get(end) {
                let next_end = next.offset + u64::from(next.record_len);
                if next.segment != head.segment
                    || next.offset != span_end
                    || next_end - head.offset > READ_SPAN_BYTES_MAX
                {
                    break;
                }
                span_end = next_end;
                end += 1;
            }
            let want = (span_end - head.offset) as usize;
            if span.len() < want {
                span.resize(want, 0);
            }
            // Nothing read (the segment is gone, or the first device failed): every extent of
            // the run is read alone below.
            let read = self
                .segments
                .get(head.segment)
                .and_then(|segment| segment.read_into(0, head.offset, &mut span[..want]).ok())
                .unwrap_or(0);
            for (index, &(key, location)) in extents.iter().enumerate().take(end).skip(first) {
                let at = (location.offset - head.offset) as usize;
                let checked = span[..read]
                    .get(at..at + location.record_len as usize)
                    .and_then(|record| check_record_ref(record, key, &location).ok());
                match checked {
                    Some(value) => visit(index, Some(&value)),
                    None => {
                        let value = match self.read_extent(key, &location)? {
                            Some(value) => Some(value),
                            None => self.get(key)?,
                        };
                        visit(index, value.as_deref());
                    }
                }
            }
            first = end;
        }
        Ok(())
    }

    /// Reads and verifies one extent, trying every device and repairing bad copies from a good
    /// one. `Ok(None)` means the segment is gone (compaction moved the extent): look up again.
    pub(crate) fn read_extent(
        &self,
        key: &[u8],
        location: &Location,
    ) -> StoreResult<Option<Vec<u8>>> {
        Ok(self
            .read_verified(key, location, false)?
            .map(|(_, value)| value))
    }

    /// Like [`Engine::read_extent`], but with `all_devices` every copy is read and checked even
    /// when the first one is good (scrub). Returns how many copies were repaired.
    pub(crate) fn read_verified(
        &self,
        key: &[u8],
        location: &Location,
        all_devices: bool,
    ) -> StoreResult<Option<(usize, Vec<u8>)>> {
        let Some(segment) = self.segments.get(location.segment) else {
            return Ok(None);
        };
        let mut good: Option<(Vec<u8>, Vec<u8>)> = None;
        let mut bad_devices = Vec::new();
        let mut last_problem = String::new();
        for device in 0..segment.files.len() {
            if good.is_some() && !all_devices {
                break;
            }
            let checked = segment
                .read_at(device, location.offset, location.record_len as usize)
                .map_err(|e| e.to_string())
                .and_then(|record| {
                    check_record(&record, key, location).map(|value| (record, value))
                });
            match checked {
                Ok(found) => {
                    if good.is_none() {
                        good = Some(found);
                    }
                }
                Err(problem) => {
                    self.corrupt_reads.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        key = %hex(key),
                        segment = location.segment,
                        offset = location.offset,
                        device,
                        %problem,
                        "extent failed verification"
                    );
                    bad_devices.push(device);
                    last_problem = problem;
                }
            }
        }
        let Some((record, value)) = good else {
            return Err(StoreError::Corrupt {
                key_hex: hex(key),
                segment: location.segment,
                offset: location.offset,
                detail: last_problem,
            });
        };
        let mut repaired = 0;
        for device in bad_devices {
            match segment.repair_at(device, &record, location.offset) {
                Ok(()) => {
                    repaired += 1;
                    self.repaired_extents.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(key = %hex(key), device, "repaired extent from mirror copy");
                }
                // The repair syncs the same file the group commit syncs, and Linux reports a
                // writeback error once per file: swallowing it here would let the next log sync
                // return success for writes that never reached the disk.
                Err(error) => self.poison("mirror repair fdatasync", &error),
            }
        }
        Ok(Some((repaired, value)))
    }

    pub fn stats(&self) -> StoreResult<StoreStats> {
        let mut stats = StoreStats::default();
        let segment_stats = self.index.segment_stats()?;
        for per_segment in segment_stats.values() {
            stats.live_extents += per_segment.live_extents;
            stats.live_raw_bytes += per_segment.live_raw_bytes;
            stats.live_stored_bytes += per_segment.live_stored_bytes;
        }
        let active = self.active_segment();
        for id in self.segments.ids() {
            if let Some(segment) = self.segments.get(id) {
                let len = segment.len(0)?;
                stats.log_bytes += len;
                stats.segments += 1;
                // The active segment grows (and may be preallocated): only closed ones count.
                if id < active {
                    let live = segment_stats.get(&id).map_or(0, |s| s.live_record_bytes);
                    stats.dead_bytes += len
                        .saturating_sub(format::SEGMENT_HEADER_LEN as u64)
                        .saturating_sub(live);
                }
            }
        }
        stats.reserve_bytes = self.reserve_bytes();
        stats.last_seq = lock(&self.writer).next_seq.saturating_sub(1);
        stats.corrupt_reads = self.corrupt_reads.load(Ordering::Relaxed);
        stats.repaired_extents = self.repaired_extents.load(Ordering::Relaxed);
        stats.poisoned = self.poisoned();
        stats.log_syncs = self.syncs.load(Ordering::Relaxed);
        stats.sync_latency = self.sync_latency();
        (stats.location_cache_hits, stats.location_cache_misses) = self.index.cache_lookups();
        Ok(stats)
    }

    /// Whether a failed sync poisoned the engine: it refuses writes until reopened.
    pub fn poisoned(&self) -> bool {
        self.poisoned.load(Ordering::SeqCst)
    }

    pub fn sync_latency(&self) -> crate::SyncLatency {
        self.sync_times.snapshot()
    }

    pub fn commit_batches(&self) -> crate::CommitBatches {
        self.batch_sizes.snapshot()
    }

    pub fn device_sync_latency(&self) -> Vec<(std::path::PathBuf, crate::SyncLatency)> {
        self.segments
            .devices
            .iter()
            .zip(&self.device_sync_times)
            .map(|(device, times)| (device.dir.clone(), times.snapshot()))
            .collect()
    }
}

impl Drop for Engine {
    /// A clean close syncs the log and writes the whole index durably, so the next open has
    /// nothing to replay. (redb also makes its non-durable commits durable when it closes; the
    /// log they point at is durable first either way.)
    fn drop(&mut self) {
        if !self.poisoned.load(Ordering::SeqCst) {
            if let Err(error) = self.checkpoint(Vec::new()) {
                tracing::error!(%error, "could not checkpoint the index at close");
            }
        }
        if let Some(preparing) = lock(&self.preparing).take() {
            preparing.cancel.store(true, Ordering::SeqCst);
            let _ = preparing.thread.join();
        }
    }
}

fn clone_error(error: &StoreError) -> StoreError {
    match error {
        StoreError::NoSpace {
            path,
            available_bytes,
            reserve_bytes,
        } => StoreError::NoSpace {
            path: path.clone(),
            available_bytes: *available_bytes,
            reserve_bytes: *reserve_bytes,
        },
        StoreError::Io { path, source } => StoreError::Io {
            path: path.clone(),
            source: std::io::Error::new(source.kind(), source.to_string()),
        },
        other => StoreError::Invalid(other.to_string()),
    }
}

fn validate(op: &WriteOp) -> StoreResult<()> {
    let key = op.key();
    if key.is_empty() || key.len() > format::KEY_LEN_MAX_BYTES {
        return Err(StoreError::Invalid(format!(
            "key length {} outside 1..={}",
            key.len(),
            format::KEY_LEN_MAX_BYTES
        )));
    }
    if let WriteOp::Put { value, .. } = op {
        if value.len() > format::VALUE_LEN_MAX_BYTES {
            return Err(StoreError::Invalid(format!(
                "value of {} bytes exceeds {}",
                value.len(),
                format::VALUE_LEN_MAX_BYTES
            )));
        }
    }
    Ok(())
}

/// Verifies a record read at an index location: checksums, key, kind and sequence number.
fn check_record(record: &[u8], key: &[u8], location: &Location) -> Result<Vec<u8>, String> {
    check_record_ref(record, key, location).map(Cow::into_owned)
}

/// [`check_record`] without a copy of an uncompressed value.
fn check_record_ref<'a>(
    record: &'a [u8],
    key: &[u8],
    location: &Location,
) -> Result<Cow<'a, [u8]>, String> {
    let format::ExtentRef {
        header,
        key: record_key,
        value,
    } = format::decode_extent_ref(record)?;
    if record_key != key {
        return Err("extent holds another key".into());
    }
    if header.kind != format::KIND_PUT || header.seq != location.seq {
        return Err(format!(
            "extent kind {} seq {} does not match index seq {}",
            header.kind, header.seq, location.seq
        ));
    }
    Ok(value)
}

/// Replays the log after the index's tail and returns the writer positioned at the log's end.
fn recover(
    segments: &Segments,
    index: &Index,
    tail: Option<Tail>,
    segment_size_max_bytes: u64,
) -> StoreResult<Writer> {
    let ids = segments.ids();
    let Some(&first_id) = ids.first() else {
        let segment = segments.create(1)?;
        let tail = Tail {
            segment: 1,
            offset: format::SEGMENT_HEADER_LEN as u64,
            next_seq: 1,
        };
        index.apply(&[], tail, Persist::Durable, &[])?;
        return Ok(Writer {
            segment,
            offset: tail.offset,
            next_seq: 1,
            synced: true,
            growing: true,
            since_checkpoint_bytes: 0,
            space_checked_at: None,
            direct: DirectWrites::new(),
            buffer: BatchBuffer::default(),
            space_available_bytes: 0,
            appended_since_space_check_bytes: 0,
        });
    };
    let tail = tail.unwrap_or(Tail {
        segment: first_id,
        offset: format::SEGMENT_HEADER_LEN as u64,
        next_seq: 1,
    });
    if segments.get(tail.segment).is_none() {
        return Err(StoreError::Mismatch(format!(
            "the index was checkpointed at segment {} which is missing from the data directory",
            tail.segment
        )));
    }
    // Replay must see what the devices hold. After a failed writeback (a poisoned store that was
    // reopened without a reboot) Linux keeps the lost pages cached and clean: reading through the
    // cache would replay, index and acknowledge bytes the disk does not have.
    for id in ids.iter().copied().filter(|id| *id >= tail.segment) {
        if let Some(segment) = segments.get(id) {
            segment.drop_cache()?;
        }
    }
    let mut next_seq = tail.next_seq;
    let mut updates: Vec<IndexUpdate> = Vec::new();
    let mut group: Vec<IndexUpdate> = Vec::new();
    let mut end = (tail.segment, tail.offset);
    let mut replayed_extents = 0u64;
    'segments: for id in ids.iter().copied().filter(|id| *id >= tail.segment) {
        let Some(segment) = segments.get(id) else {
            continue;
        };
        let file_len = segment.len(0)?;
        let mut offset = if id == tail.segment {
            tail.offset
        } else {
            format::SEGMENT_HEADER_LEN as u64
        };
        end = (id, offset);
        while offset < file_len {
            let Some((header, key)) = read_replay_record(&segment, offset, file_len)? else {
                // A rolled segment that was prepared ends in zeros: the log goes on in the next
                // segment. Anything else is the end of the log.
                if Some(&id) != ids.last()
                    && group.is_empty()
                    && tail_is_zero(&segment, offset, file_len)?
                {
                    break;
                }
                break 'segments;
            };
            let record_len = header.record_len() as u64;
            let location = Location {
                segment: id,
                offset,
                record_len: record_len as u32,
                raw_len: header.raw_len as u32,
                stored_len: header.stored_len as u32,
                seq: header.seq,
            };
            let relocated = header.flags & format::FLAG_RELOCATED != 0;
            group.push(if header.kind == format::KIND_DELETE && relocated {
                // A carried tombstone changes nothing in a replayed index either (see
                // `Op::relocated_delete`); it still counts toward its group.
                IndexUpdate::Nothing
            } else if header.kind == format::KIND_DELETE {
                IndexUpdate::Delete { key }
            } else {
                IndexUpdate::Put {
                    key,
                    location,
                    relocated: header.flags & format::FLAG_RELOCATED != 0,
                    bulk: false,
                }
            });
            if header.flags & format::FLAG_RELOCATED == 0 {
                next_seq = next_seq.max(header.seq + 1);
            }
            offset += record_len;
            if header.flags & format::FLAG_GROUP_END != 0 {
                replayed_extents += group.len() as u64;
                updates.append(&mut group);
                end = (id, offset);
                if updates.len() >= REPLAY_APPLY_CHUNK_UPDATES {
                    let partial = Tail {
                        segment: end.0,
                        offset: end.1,
                        next_seq,
                    };
                    index.apply(&updates, partial, Persist::Later, &[])?;
                    updates.clear();
                }
            }
        }
        if !group.is_empty() {
            // A group never spans segments: the writer rolls before a batch, not inside it.
            break;
        }
    }
    // Cut the log at the end of the last whole group: everything after it was never
    // acknowledged (a torn batch), and leaving it could let a later append look valid. Unless
    // what follows proves the log went on after a sync: then this is media corruption in the
    // middle of the log, and cutting would drop acknowledged writes.
    let (end_segment, end_offset) = end;
    // A prepared segment's unwritten tail is zeros and stays (appends overwrite it). Read once:
    // on a clean open it is the only part of the end segment after the log.
    let end_tail_zero = match segments.get(end_segment) {
        Some(segment) => {
            let len = segment.len(0)?;
            len <= end_offset || tail_is_zero(&segment, end_offset, len)?
        }
        None => true,
    };
    check_end_is_torn_tail(segments, &ids, end_segment, end_offset, end_tail_zero)?;
    let mut dropped_bytes = 0u64;
    for id in ids.iter().copied().filter(|id| *id >= end_segment) {
        let Some(segment) = segments.get(id) else {
            continue;
        };
        if id == end_segment {
            let len = segment.len(0)?;
            if !end_tail_zero {
                dropped_bytes += len - end_offset;
                segment.truncate(end_offset)?;
            }
        } else {
            dropped_bytes += segment.len(0)?;
            segments.remove(id)?;
        }
    }
    if dropped_bytes > 0 {
        tracing::warn!(
            segment = end_segment,
            offset = end_offset,
            dropped_bytes,
            "log ended in an incomplete batch; cut it at the last whole group"
        );
    }
    let segment = segments
        .get(end_segment)
        .ok_or_else(|| StoreError::Mismatch("log end segment vanished".into()))?;
    // What was replayed may sit only in the page cache: make it durable before the index
    // checkpoint that points at it.
    for id in ids
        .iter()
        .copied()
        .filter(|id| *id >= tail.segment && *id <= end_segment)
    {
        if let Some(replayed) = segments.get(id) {
            replayed.sync()?;
        }
    }
    let tail = Tail {
        segment: end_segment,
        offset: end_offset,
        next_seq,
    };
    index.apply(&updates, tail, Persist::Durable, &[])?;
    if replayed_extents > 0 {
        tracing::info!(replayed_extents, "replayed log tail into the index");
    }
    // A prepared segment is created at its full size; a shorter one grows with each append.
    let growing = segment.len(0)? < segment_size_max_bytes;
    Ok(Writer {
        segment,
        offset: end_offset,
        next_seq,
        synced: true,
        growing,
        since_checkpoint_bytes: 0,
        space_checked_at: None,
        direct: DirectWrites::new(),
        buffer: BatchBuffer::default(),
        space_available_bytes: 0,
        appended_since_space_check_bytes: 0,
    })
}

/// Copies a file durably (the index from its copy on the mirror), 1 MiB at a time.
fn copy_file(
    disk: &dyn crate::disk::Disk,
    from: &std::path::Path,
    to: &std::path::Path,
) -> StoreResult<()> {
    use crate::disk::OpenMode;
    let source = disk
        .open(from, OpenMode::Existing)
        .map_err(|e| StoreError::io(from, e))?;
    let target = disk
        .open(to, OpenMode::Truncate)
        .map_err(|e| StoreError::io(to, e))?;
    let len = source.len().map_err(|e| StoreError::io(from, e))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    while offset < len {
        let read = crate::disk::read_up_to(source.as_ref(), &mut buf, offset)
            .map_err(|e| StoreError::io(from, e))?;
        if read == 0 {
            break;
        }
        target
            .write_all_at(&buf[..read], offset)
            .map_err(|e| StoreError::io(to, e))?;
        offset += read as u64;
    }
    target.sync_data().map_err(|e| StoreError::io(to, e))
}

/// Refuses to cut the log at `(end_segment, end_offset)` when anything after it was written
/// after a sync that covered the cut point: a valid extent flagged [`format::FLAG_AFTER_SYNC`]
/// later in the same segment, or any valid extent in a later segment (a segment is synced before
/// the next one is started). Unflagged extents after the cut may be sectors of a torn, unsynced
/// batch that reached the disk out of order, and are dropped with it.
fn check_end_is_torn_tail(
    segments: &Segments,
    ids: &[u64],
    end_segment: u64,
    end_offset: u64,
    end_tail_zero: bool,
) -> StoreResult<()> {
    let bad = |detail: String| StoreError::LogCorrupt {
        segment: end_segment,
        offset: end_offset,
        detail,
    };
    // Zeros after the end hold no extent: only later segments remain to look at.
    let first = if end_tail_zero {
        end_segment + 1
    } else {
        end_segment
    };
    for id in ids.iter().copied().filter(|id| *id >= first) {
        let Some(segment) = segments.get(id) else {
            continue;
        };
        let (from, need_flag) = if id == end_segment {
            (end_offset + 1, true)
        } else {
            (format::SEGMENT_HEADER_LEN as u64, false)
        };
        if let Some((offset, seq)) = find_valid_extent(&segment, from, need_flag)? {
            return Err(bad(format!(
                "a valid extent (seq {seq}) written after a sync follows at segment {id} \
                 offset {offset}"
            )));
        }
    }
    Ok(())
}

/// The first offset at or after `from` (on any device) where a whole extent verifies, with its
/// seq; only extents flagged [`format::FLAG_AFTER_SYNC`] when `need_flag`.
fn find_valid_extent(
    segment: &Segment,
    from: u64,
    need_flag: bool,
) -> StoreResult<Option<(u64, u64)>> {
    const CHUNK_BYTES: u64 = 1 << 20;
    let overlap = format::EXTENT_MAGIC.len() as u64;
    for device in 0..segment.files.len() {
        let len = segment.len(device)?;
        let mut start = from;
        while start < len {
            let chunk = segment.read_at(device, start, (len - start).min(CHUNK_BYTES) as usize)?;
            let mut at = 0;
            while let Some(found) = chunk[at..]
                .windows(format::EXTENT_MAGIC.len())
                .position(|w| w == format::EXTENT_MAGIC)
            {
                let offset = start + (at + found) as u64;
                at += found + 1;
                let header = segment.read_at(device, offset, format::EXTENT_HEADER_LEN)?;
                let Ok(header) = format::decode_header(&header) else {
                    continue;
                };
                if need_flag && header.flags & format::FLAG_AFTER_SYNC == 0 {
                    continue;
                }
                let record_len = header.record_len() as u64;
                if offset + record_len > len {
                    continue;
                }
                let record = segment.read_at(device, offset, record_len as usize)?;
                if format::decode_extent(&record).is_ok() {
                    return Ok(Some((offset, header.seq)));
                }
            }
            if start + (chunk.len() as u64) >= len {
                break;
            }
            start += (chunk.len() as u64).saturating_sub(overlap).max(1);
        }
    }
    Ok(None)
}

/// Called with each record's offset, header and key.
pub(crate) type RecordVisitor<'a> = dyn FnMut(u64, &ExtentHeader, Vec<u8>) -> StoreResult<()> + 'a;

/// Every whole extent of `segment` in log order (verified, repaired from the mirror where a
/// copy is bad), handed to `visit` with its offset. A segment that is not the log's last must
/// verify to its end (or to zeros); `last` lets a torn tail end the scan.
pub(crate) fn scan_segment(
    segment: &Segment,
    last: bool,
    visit: &mut RecordVisitor<'_>,
) -> StoreResult<()> {
    let file_len = segment.len(0)?;
    let mut offset = format::SEGMENT_HEADER_LEN as u64;
    while offset < file_len {
        let Some((header, key)) = read_replay_record(segment, offset, file_len)? else {
            if last || tail_is_zero(segment, offset, file_len)? {
                return Ok(());
            }
            return Err(StoreError::LogCorrupt {
                segment: segment.id,
                offset,
                detail: "a record of a closed segment does not verify on any device".into(),
            });
        };
        let record_len = header.record_len() as u64;
        visit(offset, &header, key)?;
        offset += record_len;
    }
    Ok(())
}

/// What [`rebuild_index`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RebuildReport {
    pub segments: u64,
    pub extents_read: u64,
    pub live_keys: u64,
    /// Deletes (original or carried by compaction) that hid an older put.
    pub tombstones: u64,
}

/// Builds a new index from the whole log (the store must not be open). Each key ends at its
/// newest record by sequence number — a put, or a delete that hides every older put even when
/// compaction moved one of them to a later segment. An existing index file is kept as
/// `index.redb.replaced`.
pub(crate) fn rebuild_index(
    config: &StoreConfig,
    progress: &mut dyn FnMut(crate::Progress),
) -> StoreResult<RebuildReport> {
    let segments = Segments::open(config.disk.clone(), &config.data_dirs, config.ephemeral)?;
    segments.remove_preparations()?;
    let disk = segments.disk.clone();
    let dir = segments.devices[0].dir.clone();
    let path = dir.join(INDEX_FILE);
    if disk
        .file_len(&path)
        .map_err(|e| StoreError::io(&path, e))?
        .is_some()
    {
        let aside = dir.join(format!("{INDEX_FILE}.replaced"));
        disk.rename(&path, &aside)
            .map_err(|e| StoreError::io(&aside, e))?;
    }
    // The copy on the mirror is stale from now on: set it aside too (the next open writes a
    // new one from the rebuilt index).
    let copy_path = segments.devices.get(1).map(|d| d.dir.join(INDEX_FILE));
    if let Some(copy) = &copy_path {
        if disk
            .file_len(copy)
            .map_err(|e| StoreError::io(copy, e))?
            .is_some()
        {
            let aside = copy.with_file_name(format!("{INDEX_FILE}.replaced"));
            disk.rename(copy, &aside)
                .map_err(|e| StoreError::io(&aside, e))?;
        }
    }
    let (index, _) = Index::open(disk.as_ref(), &path, None)?;
    for device in &segments.devices {
        crate::segment::sync_dir(disk.as_ref(), &device.dir)?;
    }
    let ids = segments.ids();
    let mut report = RebuildReport::default();
    let mut tombstones: std::collections::HashMap<Vec<u8>, u64> = std::collections::HashMap::new();
    let mut next_seq = 1u64;
    let mut end = (
        ids.first().copied().unwrap_or(1),
        format::SEGMENT_HEADER_LEN as u64,
    );
    for (position, id) in ids.iter().copied().enumerate() {
        let Some(segment) = segments.get(id) else {
            continue;
        };
        let last = position + 1 == ids.len();
        let mut group: Vec<(u64, ExtentHeader, Vec<u8>)> = Vec::new();
        scan_segment(&segment, last, &mut |offset, header, key| {
            report.extents_read += 1;
            let group_end = header.flags & format::FLAG_GROUP_END != 0;
            group.push((offset, header.clone(), key));
            if !group_end {
                return Ok(());
            }
            for (offset, header, key) in group.drain(..) {
                let relocated = header.flags & format::FLAG_RELOCATED != 0;
                if !relocated {
                    next_seq = next_seq.max(header.seq + 1);
                }
                let current = index.get(&key)?.map(|location| location.seq);
                let newest = current.max(tombstones.get(&key).copied());
                if newest.is_some_and(|newest| newest >= header.seq) {
                    continue;
                }
                let record_len = header.record_len() as u64;
                let tail = Tail {
                    segment: id,
                    offset: offset + record_len,
                    next_seq,
                };
                let update = if header.kind == format::KIND_DELETE {
                    tombstones.insert(key.clone(), header.seq);
                    IndexUpdate::Delete { key }
                } else {
                    tombstones.remove(&key);
                    IndexUpdate::Put {
                        key,
                        location: Location {
                            segment: id,
                            offset,
                            record_len: record_len as u32,
                            raw_len: header.raw_len as u32,
                            stored_len: header.stored_len as u32,
                            seq: header.seq,
                        },
                        relocated: false,
                        bulk: false,
                    }
                };
                index.apply(&[update], tail, Persist::Later, &[])?;
            }
            end = (id, offset + header.record_len() as u64);
            Ok(())
        })?;
        if !group.is_empty() {
            // A torn group at the log's end: never acknowledged; the next open cuts it.
            break;
        }
        report.segments += 1;
        progress(crate::Progress {
            done: report.segments,
            total: ids.len() as u64,
        });
    }
    let tail = Tail {
        segment: end.0,
        offset: end.1,
        next_seq,
    };
    index.apply(&[], tail, Persist::Durable, &[])?;
    report.live_keys = index
        .segment_stats()?
        .values()
        .map(|stats| stats.live_extents)
        .sum();
    report.tombstones = tombstones.len() as u64;
    Ok(report)
}

/// Whether every device holds only zero bytes in `[from, to)`.
fn tail_is_zero(segment: &Segment, from: u64, to: u64) -> StoreResult<bool> {
    const CHUNK_BYTES: u64 = 1 << 20;
    for device in 0..segment.files.len() {
        let mut offset = from;
        while offset < to {
            let len = (to - offset).min(CHUNK_BYTES) as usize;
            let bytes = segment.read_at(device, offset, len)?;
            if bytes.iter().any(|b| *b != 0) {
                return Ok(false);
            }
            offset += len as u64;
        }
    }
    Ok(true)
}

/// Reads one record during replay, falling back to (and repairing from) the mirror copy.
/// `None` marks the end of the log: nothing valid at this offset on any device.
fn read_replay_record(
    segment: &Segment,
    offset: u64,
    file_len: u64,
) -> StoreResult<Option<(ExtentHeader, Vec<u8>)>> {
    let mut good: Option<(ExtentHeader, Vec<u8>, Vec<u8>)> = None;
    let mut bad = Vec::new();
    for device in 0..segment.files.len() {
        let header_bytes = segment.read_at(device, offset, format::EXTENT_HEADER_LEN)?;
        let Ok(header) = format::decode_header(&header_bytes) else {
            bad.push(device);
            continue;
        };
        let record_len = header.record_len() as u64;
        if offset + record_len > file_len.max(segment.len(device)?) {
            bad.push(device);
            continue;
        }
        let record = segment.read_at(device, offset, record_len as usize)?;
        match format::decode_extent(&record) {
            Ok((header, key, _)) => {
                good = Some((header, key, record));
                break;
            }
            Err(_) => bad.push(device),
        }
    }
    let Some((header, key, record)) = good else {
        return Ok(None);
    };
    for device in bad {
        segment.repair_at(device, &record, offset)?;
        tracing::info!(
            offset,
            device,
            "repaired log record from mirror copy during replay"
        );
    }
    Ok(Some((header, key)))
}
