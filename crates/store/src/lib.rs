//! keel-store: the local storage engine every other layer sits on.
//!
//! Data lives in append-only segment files on one or two data directories ("devices"; two make a
//! local mirror). Every record in a segment is an *extent*: a header, the key, and the payload,
//! each covered by CRC32C (see `docs/on-disk-format.md`). An embedded KV (redb) maps each live key
//! to its extent's location; the index may lag the log and is replayed from the log tail at open,
//! so the hot path pays one `fdatasync` per batch of writers, not two.
//!
//! Invariants this crate keeps:
//! - a write acknowledged with [`Durability::Sync`] is on stable storage on every device: its
//!   batch's `fdatasync` returned before the acknowledgement;
//! - after any crash the log holds a prefix of the write sequence (recovery stops at the first
//!   torn or corrupt record and truncates there), and the ops of one [`Store::write`] call are
//!   applied all together or not at all;
//! - a read never returns bytes whose checksum does not hold: it repairs from the mirror copy or
//!   fails with [`StoreError::Corrupt`];
//! - a failed `fdatasync` poisons the store: every later write fails until it is reopened.

mod commit;
mod compact;
pub mod disk;
mod error;
pub mod format;
pub mod fsinfo;
mod index;
mod latency;
mod scrub;
mod segment;
pub mod simdisk;

use bytes::Bytes;
use std::path::PathBuf;
use std::sync::Arc;

pub use commit::RebuildReport;
pub use compact::CompactReport;
pub use error::{StoreError, StoreResult};
pub use format::Compression;
pub use latency::{CommitBatches, SyncLatency};
pub use scrub::ScrubReport;

/// A data directory with less than this many times the store's reserve free is low on space
/// ([`Store::space_low`]): a node hands its replicated volumes to replicas with room, and
/// counts as nearly full (placement gives it no new replica).
pub const LOW_SPACE_RESERVES: u64 = 2;

/// First byte of every key: which part of Keel the key belongs to. Keys sort by keyspace first,
/// so each keyspace is one contiguous range of the index.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keyspace {
    /// Small metadata records (buckets, object manifests, volume definitions, snapshots).
    Meta = 0x01,
    /// Object chunks, addressed by the BLAKE3 hash of their content.
    Chunk = 0x02,
    /// Volume blocks, addressed by (volume id, block number, generation).
    Block = 0x03,
}

/// Key of an object chunk: keyspace byte, then the 32-byte BLAKE3 hash of the chunk.
pub fn chunk_key(hash: &[u8; 32]) -> Vec<u8> {
    let mut key = Vec::with_capacity(33);
    key.push(Keyspace::Chunk as u8);
    key.extend_from_slice(hash);
    key
}

/// Key of a volume block. Big-endian fields so that, for one block, all generations sort next to
/// each other and "the newest generation at or below G" is one reverse range lookup
/// ([`Store::floor`]).
pub fn block_key(volume_id: u64, block: u64, generation: u64) -> Vec<u8> {
    let mut key = Vec::with_capacity(25);
    key.push(Keyspace::Block as u8);
    key.extend_from_slice(&volume_id.to_be_bytes());
    key.extend_from_slice(&block.to_be_bytes());
    key.extend_from_slice(&generation.to_be_bytes());
    key
}

/// Key of a metadata record: keyspace byte, then the caller's bytes.
pub fn meta_key(suffix: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(1 + suffix.len());
    key.push(Keyspace::Meta as u8);
    key.extend_from_slice(suffix);
    key
}

/// How durable a write must be before [`Store::write`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Returned only after the batch holding the write was `fdatasync`ed on every device.
    Sync,
    /// Returned once the write is in the log's order and visible to reads (page cache); it becomes
    /// durable with the next [`Store::flush`] or synced write. A crash keeps a prefix of the log.
    Buffered,
}

/// One operation of a write batch.
#[derive(Debug, Clone)]
pub enum WriteOp {
    Put {
        key: Vec<u8>,
        /// Shared: a caller that holds the bytes already (a replica's batch) lends them
        /// without a copy.
        value: Bytes,
        compression: Compression,
        /// Store a BLAKE3 hash of the (uncompressed) value in the header and verify it on read.
        content_hash: bool,
    },
    Delete {
        key: Vec<u8>,
    },
}

impl WriteOp {
    pub fn put(key: Vec<u8>, value: impl Into<Bytes>, compression: Compression) -> WriteOp {
        WriteOp::Put {
            key,
            value: value.into(),
            compression,
            content_hash: false,
        }
    }

    pub fn key(&self) -> &[u8] {
        match self {
            WriteOp::Put { key, .. } | WriteOp::Delete { key } => key,
        }
    }
}

/// Acknowledgement of a write: the sequence number given to the last op of the batch.
/// Sequence numbers are dense and increasing across the store's life; replication ships by them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteAck {
    pub seq: u64,
}

/// The store's configuration. Every field's default is in [`StoreConfig::new`].
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// One data directory, or two for a local mirror (every extent written to both).
    pub data_dirs: Vec<PathBuf>,
    /// Allow data directories on tmpfs/ramfs, where fsync is meaningless. Tests and demos only.
    pub ephemeral: bool,
    /// A segment file is closed and a new one started past this size. Default 128 MiB.
    pub segment_size_max_bytes: u64,
    /// Largest amount of payload one group commit writes with one `pwrite` + `fdatasync`.
    /// Default 16 MiB.
    pub batch_size_max_bytes: usize,
    /// Free space kept back on each device: user writes are refused with
    /// [`StoreError::NoSpace`] below it, so deletes, compaction and the index can still make
    /// progress on a full disk (compaction copies at most half of it before freeing). Default
    /// 256 MiB.
    pub reserve_bytes: u64,
    /// The index is made durable (checkpointed) after this much new log. Bounds replay time at
    /// open and the memory redb holds for non-durable commits. Default 64 MiB.
    pub checkpoint_interval_bytes: u64,
    /// The filesystem under the store: the real one, or a simulated disk in tests
    /// ([`simdisk::SimDisk`]) that loses unsynced writes at a power cut and fails chosen syncs.
    pub disk: Arc<dyn disk::Disk>,
    /// Prepare (zero-fill) the next segment on a background thread ahead of the writer.
    /// Default on; a seeded simulation turns it off (the writer then creates each segment
    /// when it gets there): a thread finishing in real time would make what a power cut
    /// leaves depend on the machine's load, not on the seed.
    pub prepare_segments: bool,
    /// A group commit carrying at least this many bytes of bulk writes ([`Store::write_bulk`],
    /// compaction's copies) is written around the page cache (`O_DIRECT`; its first and last
    /// partial 4 KiB blocks through it): a rebuild or a received stream then neither copies
    /// every byte into pages nobody reads soon nor waits behind their writeback. 0 turns it
    /// off. Default 256 KiB.
    pub direct_write_min_bytes: usize,
    /// What decides when the free space read last is old enough to read again (a second):
    /// the system's clock, or a simulation's.
    pub clock: Arc<dyn keel_clock::Clock>,
}

impl StoreConfig {
    pub fn new(data_dirs: Vec<PathBuf>) -> StoreConfig {
        StoreConfig {
            data_dirs,
            ephemeral: false,
            segment_size_max_bytes: 128 << 20,
            batch_size_max_bytes: 16 << 20,
            reserve_bytes: 256 << 20,
            checkpoint_interval_bytes: 64 << 20,
            disk: Arc::new(disk::RealDisk),
            prepare_segments: true,
            direct_write_min_bytes: 256 << 10,
            clock: Arc::new(keel_clock::SystemClock),
        }
    }
}

/// Counters describing what the store holds. `live_*` count extents the index points to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoreStats {
    pub live_extents: u64,
    /// Bytes of values as written by callers (before compression).
    pub live_raw_bytes: u64,
    /// Bytes of values as stored (after compression).
    pub live_stored_bytes: u64,
    /// Bytes of all segment files on one device.
    pub log_bytes: u64,
    pub segments: u64,
    pub last_seq: u64,
    /// Checksum failures seen on reads since open (each device copy counted once).
    pub corrupt_reads: u64,
    /// Extents rewritten from a good mirror copy since open.
    pub repaired_extents: u64,
    pub poisoned: bool,
    /// Group-commit syncs of the log since open (each syncs every device).
    pub log_syncs: u64,
    /// How long syncs of the log (every device) took since open.
    pub sync_latency: SyncLatency,
    /// Bytes of closed segments that no live extent uses (overwritten or deleted data, and
    /// their headers): what compaction can return.
    pub dead_bytes: u64,
    /// Free space kept back from writes that add data (compaction and deletes may use it).
    pub reserve_bytes: u64,
    /// Index lookups the in-memory location cache answered since open.
    pub location_cache_hits: u64,
    /// Index lookups that went to the on-disk index since open.
    pub location_cache_misses: u64,
}

impl StoreStats {
    /// raw / stored, 1.0 when nothing is stored.
    pub fn compression_ratio(&self) -> f64 {
        if self.live_stored_bytes == 0 {
            1.0
        } else {
            self.live_raw_bytes as f64 / self.live_stored_bytes as f64
        }
    }
}

/// Progress of a long operation (scrub, compaction), reported to a callback.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub done: u64,
    pub total: u64,
}

/// The store. Cheap to clone; all clones share one engine. Methods block (disk I/O): async
/// callers use `spawn_blocking`.
#[derive(Clone)]
pub struct Store {
    engine: Arc<commit::Engine>,
}

/// A live key and where its value lies, as [`Store::extents`] listed it (or [`Store::extent`]
/// found it).
#[derive(Debug, Clone)]
pub struct Extent {
    key: Vec<u8>,
    location: index::Location,
}

impl Extent {
    pub fn key(&self) -> &[u8] {
        &self.key
    }
}

impl Store {
    /// Opens (or creates) the store, replaying the log tail into the index.
    pub fn open(config: StoreConfig) -> StoreResult<Store> {
        let engine = commit::Engine::open(config)?;
        Ok(Store {
            engine: Arc::new(engine),
        })
    }

    /// Appends `ops` as one atomic group, in order, and returns once they are as durable as
    /// `durability` says. Concurrent callers share one `pwrite` and one `fdatasync`.
    pub fn write(&self, ops: Vec<WriteOp>, durability: Durability) -> StoreResult<WriteAck> {
        self.engine.write(ops, durability)
    }

    /// [`Store::write`] of bytes this node does not read back soon: a replica's copy of a
    /// volume, a received stream. Once a group commit carries
    /// [`StoreConfig::direct_write_min_bytes`] of them, it goes to the disk around the page
    /// cache, so they neither push out pages that are read nor cost a copy into the cache.
    /// Durability is [`Store::write`]'s.
    pub fn write_bulk(&self, ops: Vec<WriteOp>, durability: Durability) -> StoreResult<WriteAck> {
        self.engine.write_bulk(ops, durability)
    }

    /// [`Store::write`] that may use the space reserve: for the cluster's metadata (the Raft
    /// log and vote, the state machine, catalog records), which is small and bounded, and
    /// without which nothing — not even a delete that would free space — can happen on a full
    /// disk.
    pub fn write_metadata(
        &self,
        ops: Vec<WriteOp>,
        durability: Durability,
    ) -> StoreResult<WriteAck> {
        self.engine.write_metadata(ops, durability)
    }

    /// Makes every write that returned before this call durable.
    pub fn flush(&self) -> StoreResult<()> {
        self.engine.flush()
    }

    /// The value stored under `key`, verified against its checksums.
    pub fn get(&self, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        self.engine.get(key)
    }

    /// Whether `key` is live, without reading its extent.
    pub fn contains(&self, key: &[u8]) -> StoreResult<bool> {
        self.engine.contains(key)
    }

    /// The greatest live key in `[low, high]` (inclusive) and its value.
    pub fn floor(&self, low: &[u8], high: &[u8]) -> StoreResult<Option<(Vec<u8>, Vec<u8>)>> {
        self.engine.floor(low, high)
    }

    /// Live keys in `[start, end)` in order, at most `limit` of them.
    pub fn keys(&self, start: &[u8], end: &[u8], limit: usize) -> StoreResult<Vec<Vec<u8>>> {
        self.engine.keys(start, end, limit)
    }

    /// Live keys in `[start, end)` in order with the sequence number of the write that set
    /// each (compaction keeps it), at most `limit` of them: what changed since a sequence
    /// number is answerable without reading values.
    pub fn keys_with_sequences(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> StoreResult<Vec<(Vec<u8>, u64)>> {
        self.engine.keys_with_sequences(start, end, limit)
    }

    /// The sequence number of the last committed write: every write committed later gets a
    /// greater one. Does not wait for a group commit in progress.
    pub fn committed_sequence(&self) -> u64 {
        self.engine.committed_sequence()
    }

    /// Live keys in `[start, end)` in order with where their values lie, at most `limit` of
    /// them: a caller that needs only some of the values reads those with
    /// [`Store::read_extents`].
    pub fn extents(&self, start: &[u8], end: &[u8], limit: usize) -> StoreResult<Vec<Extent>> {
        Ok(self
            .engine
            .extents(start, end, limit)?
            .into_iter()
            .map(|(key, location)| Extent { key, location })
            .collect())
    }

    /// Where the value of `key` lies, if it is live: a point lookup the location cache usually
    /// answers. Read it with [`Store::read_extents`].
    pub fn extent(&self, key: Vec<u8>) -> StoreResult<Option<Extent>> {
        Ok(self
            .engine
            .extent(&key)?
            .map(|location| Extent { key, location }))
    }

    /// Hands the value of each of `extents` (listed by [`Store::extents`]) to `visit` with its
    /// index, in order, verified against its checksums like [`Store::get`]; `None` where the key
    /// was deleted since it was listed. Extents written one after another are read together:
    /// one `pread` per run, not one per extent, and an uncompressed value is not copied.
    pub fn read_extents(
        &self,
        extents: &[&Extent],
        visit: &mut dyn FnMut(usize, Option<&[u8]>),
    ) -> StoreResult<()> {
        let located: Vec<(&[u8], index::Location)> = extents
            .iter()
            .map(|extent| (extent.key.as_slice(), extent.location))
            .collect();
        self.engine.read_extents(&located, visit)
    }

    /// Live keys and values in `[start, end)` in order, at most `limit` of them.
    pub fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> StoreResult<Vec<(Vec<u8>, Vec<u8>)>> {
        self.engine.scan(start, end, limit)
    }

    pub fn stats(&self) -> StoreResult<StoreStats> {
        self.engine.stats()
    }

    /// Whether a failed sync stopped the store's writes until it is reopened (the kernel may
    /// have dropped data the sync covered); reads still work. A cheap part of [`Store::stats`].
    pub fn poisoned(&self) -> bool {
        self.engine.poisoned()
    }

    /// How long syncs of the log took since open (a cheap part of [`Store::stats`]).
    pub fn sync_latency(&self) -> SyncLatency {
        self.engine.sync_latency()
    }

    /// How long each device's fdatasyncs of the log took since open, by data directory.
    pub fn device_sync_latency(&self) -> Vec<(std::path::PathBuf, SyncLatency)> {
        self.engine.device_sync_latency()
    }

    /// How many writes each group commit carried since open.
    pub fn commit_batches(&self) -> CommitBatches {
        self.engine.commit_batches()
    }

    /// Verifies every live extent on every device, repairing bad copies from good ones.
    /// Safe to interrupt: it only rewrites an extent in place with bytes that verified.
    pub fn scrub(&self, progress: &mut dyn FnMut(Progress)) -> StoreResult<ScrubReport> {
        scrub::scrub(&self.engine, progress, &|| false)
    }

    /// [`Store::scrub`], stopping early (the report says `interrupted`) once `stop` answers
    /// true; it is asked after each page of extents.
    pub fn scrub_until(
        &self,
        progress: &mut dyn FnMut(Progress),
        stop: &dyn Fn() -> bool,
    ) -> StoreResult<ScrubReport> {
        scrub::scrub(&self.engine, progress, stop)
    }

    /// Rewrites the live extents of segments whose dead share is at least `dead_ratio_min`
    /// (0.0–1.0), then deletes those segments. Safe to interrupt at any point.
    pub fn compact(
        &self,
        dead_ratio_min: f64,
        progress: &mut dyn FnMut(Progress),
    ) -> StoreResult<CompactReport> {
        compact::compact(&self.engine, dead_ratio_min, progress)
    }

    pub fn config(&self) -> &StoreConfig {
        self.engine.config()
    }

    /// Free space (per data directory) that writes adding data never use: such a write is
    /// refused when it would leave less ([`StoreError::NoSpace`]).
    pub fn reserve_bytes(&self) -> u64 {
        self.engine.reserve_bytes()
    }

    /// Whether a data directory has less than [`LOW_SPACE_RESERVES`] times the reserve free
    /// (read now): writes adding data are about to be refused there.
    pub fn space_low(&self) -> StoreResult<bool> {
        let low = self.reserve_bytes().saturating_mul(LOW_SPACE_RESERVES);
        Ok(self.engine.available_bytes()? < low)
    }

    /// Builds a new index for the (closed) store from its whole log, when `index.redb` is lost
    /// or damaged; the old file, if any, is kept as `index.redb.replaced`. Reads every segment.
    pub fn rebuild_index(
        config: &StoreConfig,
        progress: &mut dyn FnMut(Progress),
    ) -> StoreResult<RebuildReport> {
        commit::rebuild_index(config, progress)
    }
}
