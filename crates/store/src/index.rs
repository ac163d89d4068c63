//! The index: redb tables mapping each live key to its extent's location, per-segment live-space
//! counters, and the log position the index reflects ("tail").
//!
//! Why redb: a copy-on-write B-tree with checksummed commit slots, pure Rust, one file, ordered
//! keys with range scans (listing, "newest generation at or below G"), and a non-durable commit
//! mode. The hot path commits with `Durability::None` (no fsync: the log already made the batch
//! durable); every `checkpoint_interval_bytes` of log one commit is made durable. After a crash
//! redb reverts to its last durable commit and the store replays the log from the tail that
//! commit recorded, so the index may lag the log but never runs ahead of it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};

use crate::disk::{Disk, IndexBackend, OpenMode};
use crate::error::{StoreError, StoreResult};

const EXTENTS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("extents");
const SEGMENT_STATS: TableDefinition<u64, &[u8]> = TableDefinition::new("segment_stats");
const STATE: TableDefinition<&str, &[u8]> = TableDefinition::new("state");
const TAIL: &str = "tail";

/// Memory redb may use for its page cache.
const INDEX_CACHE_SIZE_MAX_BYTES: usize = 256 << 20;

const LOCATION_LEN: usize = 36;

/// Where an extent lives: the same segment and offset on every device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Location {
    pub segment: u64,
    pub offset: u64,
    pub record_len: u32,
    pub raw_len: u32,
    pub stored_len: u32,
    pub seq: u64,
}

impl Location {
    fn encode(&self) -> [u8; LOCATION_LEN] {
        let mut out = [0u8; LOCATION_LEN];
        out[0..8].copy_from_slice(&self.segment.to_le_bytes());
        out[8..16].copy_from_slice(&self.offset.to_le_bytes());
        out[16..20].copy_from_slice(&self.record_len.to_le_bytes());
        out[20..24].copy_from_slice(&self.raw_len.to_le_bytes());
        out[24..28].copy_from_slice(&self.stored_len.to_le_bytes());
        out[28..36].copy_from_slice(&self.seq.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> StoreResult<Location> {
        if bytes.len() != LOCATION_LEN {
            return Err(StoreError::Index(format!(
                "location record of {} bytes, expected {LOCATION_LEN}",
                bytes.len()
            )));
        }
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let u32_at = |at: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&bytes[at..at + 4]);
            u32::from_le_bytes(b)
        };
        Ok(Location {
            segment: u64_at(0),
            offset: u64_at(8),
            record_len: u32_at(16),
            raw_len: u32_at(20),
            stored_len: u32_at(24),
            seq: u64_at(28),
        })
    }
}

/// The log position the index reflects: every extent before it has been applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tail {
    pub segment: u64,
    pub offset: u64,
    pub next_seq: u64,
}

impl Tail {
    fn encode(&self) -> [u8; 24] {
        let mut out = [0u8; 24];
        out[0..8].copy_from_slice(&self.segment.to_le_bytes());
        out[8..16].copy_from_slice(&self.offset.to_le_bytes());
        out[16..24].copy_from_slice(&self.next_seq.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> StoreResult<Tail> {
        if bytes.len() != 24 {
            return Err(StoreError::Index("tail record has the wrong length".into()));
        }
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        Ok(Tail {
            segment: u64_at(0),
            offset: u64_at(8),
            next_seq: u64_at(16),
        })
    }
}

/// Live-space counters of one segment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SegmentStats {
    pub live_record_bytes: u64,
    pub live_extents: u64,
    pub live_raw_bytes: u64,
    pub live_stored_bytes: u64,
}

impl SegmentStats {
    fn encode(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        for (i, v) in [
            self.live_record_bytes,
            self.live_extents,
            self.live_raw_bytes,
            self.live_stored_bytes,
        ]
        .iter()
        .enumerate()
        {
            out[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8]) -> SegmentStats {
        let at = |i: usize| {
            let mut b = [0u8; 8];
            if let Some(slice) = bytes.get(i * 8..i * 8 + 8) {
                b.copy_from_slice(slice);
            }
            u64::from_le_bytes(b)
        };
        SegmentStats {
            live_record_bytes: at(0),
            live_extents: at(1),
            live_raw_bytes: at(2),
            live_stored_bytes: at(3),
        }
    }

    /// Adds `added` and takes away `removed` (clamped at zero).
    fn apply(&mut self, added: &SegmentStats, removed: &SegmentStats) {
        self.live_record_bytes = (self.live_record_bytes + added.live_record_bytes)
            .saturating_sub(removed.live_record_bytes);
        self.live_extents =
            (self.live_extents + added.live_extents).saturating_sub(removed.live_extents);
        self.live_raw_bytes =
            (self.live_raw_bytes + added.live_raw_bytes).saturating_sub(removed.live_raw_bytes);
        self.live_stored_bytes = (self.live_stored_bytes + added.live_stored_bytes)
            .saturating_sub(removed.live_stored_bytes);
    }

    fn add(&mut self, loc: &Location, sign: i64) {
        let apply = |v: &mut u64, d: u64| {
            *v = if sign > 0 {
                v.saturating_add(d)
            } else {
                v.saturating_sub(d)
            }
        };
        apply(&mut self.live_record_bytes, loc.record_len as u64);
        apply(&mut self.live_extents, 1);
        apply(&mut self.live_raw_bytes, loc.raw_len as u64);
        apply(&mut self.live_stored_bytes, loc.stored_len as u64);
    }
}

/// When applied updates must reach redb.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Persist {
    /// When enough are pending (in the background).
    Later,
    /// Now, durably, on a background thread: a periodic checkpoint, which only bounds replay.
    DurableInBackground,
    /// Now, durably, before `apply` returns.
    Durable,
}

/// One change to apply, in log order.
pub(crate) enum IndexUpdate {
    Put {
        key: Vec<u8>,
        location: Location,
        /// A compaction copy: applied only if the key still maps to `location.seq`.
        relocated: bool,
        /// Bytes this node does not read back soon ([`crate::Store::write_bulk`], compaction):
        /// the location cache is updated if it holds the key, and otherwise left alone, so a
        /// rebuild's blocks neither push out the keys clients read nor cost a cache insert
        /// each.
        bulk: bool,
    },
    Delete {
        key: Vec<u8>,
    },
    /// A record that changes no entry (a carried tombstone).
    Nothing,
}

/// Index entries applied but not yet written to redb: a key's newest location, or `None` when
/// it was deleted, plus the per-segment counter changes and the tail they bring.
#[derive(Default)]
struct Pending {
    extents: BTreeMap<Vec<u8>, Option<Location>>,
    /// Per segment: what was added and what was removed.
    stats: BTreeMap<u64, (SegmentStats, SegmentStats)>,
    /// Segments whose counters are to be deleted.
    dropped: Vec<u64>,
    tail: Option<Tail>,
    /// Numbers the writes to redb: redb records the last one it holds, so a reader can tell
    /// whether its redb snapshot already includes a set that is being written.
    write_number: u64,
}

/// What is applied but not yet in redb: the entries still gathering, and the set being written
/// (on the background writer or by a checkpoint). `active` takes precedence over `writing`,
/// and both over redb.
#[derive(Default)]
struct Overlay {
    active: Pending,
    writing: Option<Arc<Pending>>,
}

impl Overlay {
    /// The newest pending entry for `key`, if any layer has one.
    fn entry(&self, key: &[u8]) -> Option<Option<Location>> {
        self.active
            .extents
            .get(key)
            .or_else(|| self.writing.as_ref().and_then(|w| w.extents.get(key)))
            .copied()
    }

    /// Pending entries with keys in `range`, ascending, `active` winning over `writing`.
    fn entries<R>(&self, range: R) -> Vec<(&Vec<u8>, Option<Location>)>
    where
        R: std::ops::RangeBounds<Vec<u8>> + Clone,
    {
        let mut merged: BTreeMap<&Vec<u8>, Option<Location>> = BTreeMap::new();
        if let Some(writing) = &self.writing {
            merged.extend(writing.extents.range(range.clone()).map(|(k, v)| (k, *v)));
        }
        merged.extend(self.active.extents.range(range).map(|(k, v)| (k, *v)));
        merged.into_iter().collect()
    }
}

pub(crate) struct Index {
    shared: Arc<Shared>,
}

struct Shared {
    db: Database,
    /// The same index on the mirror device, written with every set after `db`.
    copy: Option<Database>,
    /// Applied updates gather in `overlay.active`; once there are [`PENDING_ENTRIES_MAX`] of
    /// them they become `overlay.writing` and a background thread writes them to redb in one
    /// transaction, while new updates gather again. A durable checkpoint writes everything in
    /// the committing thread. (A redb write transaction per group commit copied a leaf and its
    /// branches per key and cost more CPU than the rest of a 4 KiB write together; writing them
    /// in the committing thread stalled every writer for tens of milliseconds.) Only the
    /// committing thread (the group commit leader, or recovery) applies; readers look here
    /// first, then in redb.
    overlay: RwLock<Overlay>,
    pending_entries_max: usize,
    /// Recently used locations, so hot point lookups (a volume's blocks) skip the overlay and
    /// redb's tree walk. `apply` writes every key's new location here (or removes a deleted
    /// key) under the overlay's write lock, and lookups fill it from redb under the read lock
    /// only for keys that are not pending, so a cached location is always the key's newest.
    locations: quick_cache::sync::Cache<Vec<u8>, Location>,
    /// The background write in progress, if any (at most one at a time).
    writer: Mutex<WriterSlot>,
    /// Why a background write failed; the next `apply` reports it (and the store is poisoned).
    write_failure: Mutex<Option<String>>,
    /// Numbers the sets of pending entries.
    next_write_number: AtomicU64,
}

/// The thread writing a set of pending entries to redb, if one is.
type WriterSlot = Option<std::thread::JoinHandle<()>>;

/// Locations kept in the lookup cache: about 64 MiB, the metadata of 2 GiB of 4 KiB blocks.
const LOCATION_CACHE_ENTRIES: usize = 512 * 1024;

/// Pending index entries written to redb together (a few MiB of memory at most; twice that
/// while one set is being written).
const PENDING_ENTRIES_MAX: usize = 16_384;

/// In `STATE`: the number of the last set of pending entries written to redb.
const WRITTEN: &str = "written";

fn read_lock(lock: &RwLock<Overlay>) -> RwLockReadGuard<'_, Overlay> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write_lock(lock: &RwLock<Overlay>) -> RwLockWriteGuard<'_, Overlay> {
    lock.write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Index {
    /// Opens the index at `path`, and its copy at `copy` (on the mirror device) when there is
    /// one. A copy that is missing or does not match the index (a crash between their writes,
    /// a replaced device) is rewritten from the index first.
    pub fn open(
        disk: &dyn Disk,
        path: &Path,
        copy: Option<&Path>,
    ) -> StoreResult<(Index, Option<Tail>)> {
        Index::open_with(disk, path, copy, PENDING_ENTRIES_MAX)
    }

    fn open_with(
        disk: &dyn Disk,
        path: &Path,
        copy: Option<&Path>,
        pending_entries_max: usize,
    ) -> StoreResult<(Index, Option<Tail>)> {
        let db = open_db(disk, path)?;
        let (tail, written) = read_state(&db)?;
        let copy = match copy {
            Some(copy_path) => {
                let copy = open_db(disk, copy_path)?;
                if read_state(&copy)? != (tail, written) {
                    tracing::info!(path = %copy_path.display(), "rewriting the index copy on the mirror");
                    mirror_all(&db, &copy)?;
                }
                Some(copy)
            }
            None => None,
        };
        let index = Index {
            shared: Arc::new(Shared {
                db,
                copy,
                overlay: RwLock::new(Overlay::default()),
                pending_entries_max,
                locations: quick_cache::sync::Cache::new(LOCATION_CACHE_ENTRIES),
                writer: Mutex::new(None),
                write_failure: Mutex::new(None),
                next_write_number: AtomicU64::new(written + 1),
            }),
        };
        Ok((index, tail))
    }

    /// Applies updates in order and records `tail`, then writes what is pending to redb as
    /// `persist` says (a full set of pending entries is always handed to a background write).
    /// Called by one thread at a time (the committer).
    pub fn apply(
        &self,
        updates: &[IndexUpdate],
        tail: Tail,
        persist: Persist,
        dropped_segments: &[u64],
    ) -> StoreResult<()> {
        if let Some(reason) = lock(&self.shared.write_failure).clone() {
            return Err(StoreError::Index(format!(
                "writing index entries to redb failed earlier: {reason}"
            )));
        }
        let shared = &*self.shared;
        let full = {
            let mut overlay = write_lock(&shared.overlay);
            // Opened at the first key neither the cache nor the overlay knows (a new key: a
            // fresh volume's blocks all are), then kept for the rest of the batch.
            let mut redb_extents = None;
            for update in updates {
                let key = match update {
                    IndexUpdate::Put { key, .. } | IndexUpdate::Delete { key } => key,
                    IndexUpdate::Nothing => continue,
                };
                let cached = shared.locations.get(key.as_slice());
                let current = match cached {
                    Some(location) => Some(location),
                    None => match overlay.entry(key) {
                        Some(entry) => entry,
                        None => {
                            let table = match &redb_extents {
                                Some(table) => table,
                                None => redb_extents
                                    .insert(shared.db.begin_read()?.open_table(EXTENTS)?),
                            };
                            table
                                .get(key.as_slice())?
                                .map(|v| Location::decode(v.value()))
                                .transpose()?
                        }
                    },
                };
                let active = &mut overlay.active;
                let new = match update {
                    IndexUpdate::Put {
                        location,
                        relocated,
                        ..
                    } => {
                        // A compaction copy lands only if the key still maps to what was copied.
                        if *relocated && current.map(|c| c.seq) != Some(location.seq) {
                            continue;
                        }
                        active
                            .stats
                            .entry(location.segment)
                            .or_default()
                            .0
                            .add(location, 1);
                        Some(*location)
                    }
                    IndexUpdate::Delete { .. } => {
                        if current.is_none() {
                            continue;
                        }
                        None
                    }
                    IndexUpdate::Nothing => continue,
                };
                if let Some(old) = current {
                    active.stats.entry(old.segment).or_default().1.add(&old, 1);
                }
                // Once the entry is written to redb, the cache agrees with it. A key it does not
                // hold needs nothing: a lookup finds the new location in the overlay, then in
                // redb.
                let bulk = matches!(update, IndexUpdate::Put { bulk: true, .. });
                match new {
                    Some(location) if cached.is_some() || !bulk => {
                        shared.locations.insert(key.clone(), location)
                    }
                    Some(_) => {}
                    None => {
                        shared.locations.remove(key.as_slice());
                    }
                }
                active.extents.insert(key.clone(), new);
            }
            for segment in dropped_segments {
                overlay.active.stats.remove(segment);
                overlay.active.dropped.push(*segment);
            }
            overlay.active.tail = Some(tail);
            overlay.active.extents.len() >= shared.pending_entries_max
        };
        match persist {
            Persist::Durable => self.write_all_durably(),
            Persist::DurableInBackground => self.start_background_write(true),
            Persist::Later if full => self.start_background_write(false),
            Persist::Later => Ok(()),
        }
    }

    /// Moves the active entries to `writing` (after the previous write finished) and returns
    /// them, holding the writer slot.
    fn take_active(&self) -> StoreResult<(MutexGuard<'_, WriterSlot>, Arc<Pending>)> {
        let shared = &*self.shared;
        let mut writer = lock(&shared.writer);
        if let Some(previous) = writer.take() {
            // Bounded memory: one set being written, one gathering.
            let _ = previous.join();
        }
        if let Some(reason) = lock(&shared.write_failure).clone() {
            return Err(StoreError::Index(format!(
                "writing index entries to redb failed earlier: {reason}"
            )));
        }
        let mut overlay = write_lock(&shared.overlay);
        let mut set = std::mem::take(&mut overlay.active);
        set.write_number = shared.next_write_number.fetch_add(1, Ordering::SeqCst);
        let set = Arc::new(set);
        overlay.writing = Some(Arc::clone(&set));
        drop(overlay);
        Ok((writer, set))
    }

    fn start_background_write(&self, durable: bool) -> StoreResult<()> {
        let (mut writer, set) = self.take_active()?;
        let shared = Arc::clone(&self.shared);
        let background = Arc::clone(&set);
        let spawned = std::thread::Builder::new()
            .name("keel-index-write".into())
            .spawn(move || {
                // A failure is recorded for the next apply.
                let _ = shared.write_set(&background, durable);
            });
        match spawned {
            Ok(thread) => {
                *writer = Some(thread);
                Ok(())
            }
            Err(error) => {
                // Write the set here instead.
                tracing::warn!(%error, "could not start the index writer thread");
                self.shared
                    .write_set(&set, false)
                    .map_err(StoreError::Index)
            }
        }
    }

    /// Writes every pending entry to redb and commits durably.
    fn write_all_durably(&self) -> StoreResult<()> {
        let (_writer, set) = self.take_active()?;
        self.shared.write_set(&set, true).map_err(StoreError::Index)
    }

    /// Lookups the location cache answered, and those it did not, since open.
    pub fn cache_lookups(&self) -> (u64, u64) {
        (self.shared.locations.hits(), self.shared.locations.misses())
    }

    pub fn get(&self, key: &[u8]) -> StoreResult<Option<Location>> {
        let shared = &*self.shared;
        // A cached location is the key's newest: `apply` overwrites or removes it before the
        // write is acknowledged. No lock needed for that.
        if let Some(location) = shared.locations.get(key) {
            return Ok(Some(location));
        }
        // Held from here on: `apply` cannot change the key between the redb read and the cache
        // fill below.
        let overlay = read_lock(&shared.overlay);
        if let Some(entry) = overlay.entry(key) {
            return Ok(entry);
        }
        let txn = shared.db.begin_read()?;
        let table = txn.open_table(EXTENTS)?;
        let location = table
            .get(key)?
            .map(|v| Location::decode(v.value()))
            .transpose()?;
        if let Some(location) = location {
            shared.locations.insert(key.to_vec(), location);
        }
        drop(overlay);
        Ok(location)
    }

    pub fn floor(&self, low: &[u8], high: &[u8]) -> StoreResult<Option<(Vec<u8>, Location)>> {
        if low > high {
            return Ok(None);
        }
        if low == high {
            // A point lookup: redb's get walks the tree once, a range cursor twice.
            return Ok(self.get(low)?.map(|location| (low.to_vec(), location)));
        }
        let overlay = read_lock(&self.shared.overlay);
        let pending = overlay.entries(low.to_vec()..=high.to_vec());
        let mut pending = pending.into_iter().rev().peekable();
        let txn = self.shared.db.begin_read()?;
        let table = txn.open_table(EXTENTS)?;
        let mut stored = table.range(low..=high)?.rev();
        let mut next_stored = stored.next().transpose()?;
        loop {
            let stored_key = next_stored.as_ref().map(|(key, _)| key.value());
            match (pending.peek(), stored_key) {
                (None, None) => return Ok(None),
                // The pending key is the greater (or the same key, which it overrides).
                (Some((key, entry)), stored_key)
                    if stored_key.is_none_or(|s| key.as_slice() >= s) =>
                {
                    if stored_key == Some(key.as_slice()) {
                        next_stored = stored.next().transpose()?;
                    }
                    if let Some(location) = entry {
                        return Ok(Some(((*key).clone(), *location)));
                    }
                    pending.next();
                }
                _ => {
                    return match next_stored {
                        Some((key, value)) => Ok(Some((
                            key.value().to_vec(),
                            Location::decode(value.value())?,
                        ))),
                        None => Ok(None),
                    }
                }
            }
        }
    }

    pub fn range(
        &self,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> StoreResult<Vec<(Vec<u8>, Location)>> {
        if start >= end {
            return Ok(Vec::new());
        }
        let overlay = read_lock(&self.shared.overlay);
        let pending = overlay.entries(start.to_vec()..end.to_vec());
        let mut pending = pending.into_iter().peekable();
        let txn = self.shared.db.begin_read()?;
        let table = txn.open_table(EXTENTS)?;
        let mut stored = table.range(start..end)?;
        let mut next_stored = stored.next().transpose()?;
        let mut out = Vec::new();
        while out.len() < limit {
            let stored_key = next_stored.as_ref().map(|(key, _)| key.value());
            match (pending.peek(), stored_key) {
                (None, None) => break,
                // The pending key is the smaller (or the same key, which it overrides).
                (Some((key, entry)), stored_key)
                    if stored_key.is_none_or(|s| key.as_slice() <= s) =>
                {
                    if stored_key == Some(key.as_slice()) {
                        next_stored = stored.next().transpose()?;
                    }
                    if let Some(location) = entry {
                        out.push(((*key).clone(), *location));
                    }
                    pending.next();
                }
                _ => {
                    if let Some((key, value)) = next_stored {
                        out.push((key.value().to_vec(), Location::decode(value.value())?));
                    }
                    next_stored = stored.next().transpose()?;
                }
            }
        }
        Ok(out)
    }

    pub fn segment_stats(&self) -> StoreResult<BTreeMap<u64, SegmentStats>> {
        let overlay = read_lock(&self.shared.overlay);
        let txn = self.shared.db.begin_read()?;
        let written = written_number(&txn.open_table(STATE)?)?;
        let table = txn.open_table(SEGMENT_STATS)?;
        let mut out = BTreeMap::new();
        for entry in table.iter()? {
            let (segment, value) = entry?;
            out.insert(segment.value(), SegmentStats::decode(value.value()));
        }
        // The set being written counts only if this redb snapshot does not hold it yet.
        let writing = overlay
            .writing
            .as_deref()
            .filter(|set| set.write_number > written);
        for set in writing.into_iter().chain([&overlay.active]) {
            for segment in &set.dropped {
                out.remove(segment);
            }
            for (segment, (added, removed)) in &set.stats {
                out.entry(*segment).or_default().apply(added, removed);
            }
        }
        Ok(out)
    }
}

impl Shared {
    /// Writes one set of pending entries to redb in one transaction, then forgets it. Readers
    /// keep seeing the set in the overlay until redb holds it.
    fn write_set(&self, set: &Pending, durable: bool) -> Result<(), String> {
        let written = write_to_redb(&self.db, set, durable)
            .and_then(|()| match &self.copy {
                Some(copy) => write_to_redb(copy, set, durable),
                None => Ok(()),
            })
            .map_err(|e| e.to_string());
        match &written {
            Ok(()) => write_lock(&self.overlay).writing = None,
            // The set stays in the overlay, so reads stay right; the next apply fails.
            Err(reason) => {
                tracing::error!(%reason, "writing index entries to redb failed");
                *lock(&self.write_failure) = Some(reason.clone());
            }
        }
        written
    }
}

fn write_to_redb(db: &Database, set: &Pending, durable: bool) -> StoreResult<()> {
    {
        let mut txn = db.begin_write()?;
        txn.set_durability(if durable {
            Durability::Immediate
        } else {
            Durability::None
        })?;
        {
            let mut extents = txn.open_table(EXTENTS)?;
            for (key, entry) in &set.extents {
                match entry {
                    Some(location) => {
                        extents.insert(key.as_slice(), location.encode().as_slice())?;
                    }
                    None => {
                        extents.remove(key.as_slice())?;
                    }
                }
            }
            let mut stats = txn.open_table(SEGMENT_STATS)?;
            for (segment, (added, removed)) in &set.stats {
                let mut current = stats
                    .get(*segment)?
                    .map(|v| SegmentStats::decode(v.value()))
                    .unwrap_or_default();
                current.apply(added, removed);
                stats.insert(*segment, current.encode().as_slice())?;
            }
            for segment in &set.dropped {
                stats.remove(*segment)?;
            }
            let mut state = txn.open_table(STATE)?;
            if let Some(tail) = set.tail {
                state.insert(TAIL, tail.encode().as_slice())?;
            }
            state.insert(WRITTEN, set.write_number.to_le_bytes().as_slice())?;
        }
        txn.commit()?;
    }
    Ok(())
}

/// Opens (or creates) an index database with its tables.
fn open_db(disk: &dyn Disk, path: &Path) -> StoreResult<Database> {
    let file = disk
        .open(path, OpenMode::Create)
        .map_err(|e| StoreError::io(path, e))?;
    let db = redb::Builder::new()
        .set_cache_size(INDEX_CACHE_SIZE_MAX_BYTES)
        .create_with_backend(IndexBackend(file))?;
    let txn = db.begin_write()?;
    {
        txn.open_table(EXTENTS)?;
        txn.open_table(SEGMENT_STATS)?;
        txn.open_table(STATE)?;
    }
    txn.commit()?;
    Ok(db)
}

/// The tail and write number an index database holds.
fn read_state(db: &Database) -> StoreResult<(Option<Tail>, u64)> {
    let txn = db.begin_read()?;
    let table = txn.open_table(STATE)?;
    let tail = table
        .get(TAIL)?
        .map(|v| Tail::decode(v.value()))
        .transpose()?;
    Ok((tail, written_number(&table)?))
}

/// Makes `to` hold exactly what `from` holds, durably, in one transaction.
fn mirror_all(from: &Database, to: &Database) -> StoreResult<()> {
    let read = from.begin_read()?;
    let mut txn = to.begin_write()?;
    txn.set_durability(Durability::Immediate)?;
    {
        txn.delete_table(EXTENTS)?;
        txn.delete_table(SEGMENT_STATS)?;
        txn.delete_table(STATE)?;
        let mut extents = txn.open_table(EXTENTS)?;
        for entry in read.open_table(EXTENTS)?.iter()? {
            let (key, value) = entry?;
            extents.insert(key.value(), value.value())?;
        }
        let mut stats = txn.open_table(SEGMENT_STATS)?;
        for entry in read.open_table(SEGMENT_STATS)?.iter()? {
            let (key, value) = entry?;
            stats.insert(key.value(), value.value())?;
        }
        let mut state = txn.open_table(STATE)?;
        for entry in read.open_table(STATE)?.iter()? {
            let (key, value) = entry?;
            state.insert(key.value(), value.value())?;
        }
    }
    txn.commit()?;
    Ok(())
}

fn written_number<T: ReadableTable<&'static str, &'static [u8]>>(table: &T) -> StoreResult<u64> {
    Ok(table
        .get(WRITTEN)?
        .and_then(|v| v.value().try_into().ok().map(u64::from_le_bytes))
        .unwrap_or(0))
}

impl Drop for Index {
    /// A background write still holds the database; let it finish before the file closes.
    fn drop(&mut self) {
        if let Some(thread) = lock(&self.shared.writer).take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn location_round_trips() {
        let loc = Location {
            segment: 3,
            offset: 4096,
            record_len: 4168,
            raw_len: 4096,
            stored_len: 100,
            seq: 77,
        };
        assert_eq!(Location::decode(&loc.encode()).unwrap(), loc);
    }

    fn location(segment: u64, seq: u64) -> Location {
        Location {
            segment,
            offset: seq * 100,
            record_len: 100,
            raw_len: 30,
            stored_len: 30,
            seq,
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        // Proves the pending entries and redb read as one ordered map: random puts and deletes,
        // applied in random chunks, some durable, with pending entries written to redb every
        // few updates, give the same get, floor, range and per-segment counters as a model.
        #[test]
        fn pending_entries_and_redb_read_as_one_map(
            ops in proptest::collection::vec((0u8..24, proptest::bool::ANY, 1u64..4), 1..200),
            chunk in 1usize..12,
            durable_every in 1usize..6,
            pending_max in 1usize..10,
        ) {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/unit-test-data/index-pending");
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(format!("{}.redb", std::process::id()));
            let _ = std::fs::remove_file(&path);
            let (index, _) = Index::open_with(&crate::disk::RealDisk, &path, None, pending_max).unwrap();
            let mut model: BTreeMap<Vec<u8>, Location> = BTreeMap::new();
            let mut seq = 0u64;
            for (round, ops) in ops.chunks(chunk).enumerate() {
                let mut updates = Vec::new();
                for &(key, put, segment) in ops {
                    let key = vec![key];
                    seq += 1;
                    if put {
                        let location = location(segment, seq);
                        model.insert(key.clone(), location);
                        updates.push(IndexUpdate::Put {
                            key,
                            location,
                            relocated: false,
                            bulk: false,
                        });
                    } else {
                        model.remove(&key);
                        updates.push(IndexUpdate::Delete { key });
                    }
                }
                let tail = Tail { segment: 1, offset: seq, next_seq: seq + 1 };
                let persist = match round % durable_every {
                    0 => Persist::Durable,
                    1 => Persist::DurableInBackground,
                    _ => Persist::Later,
                };
                index.apply(&updates, tail, persist, &[]).unwrap();
                for key in 0u8..24 {
                    proptest::prop_assert_eq!(index.get(&[key]).unwrap(), model.get(&vec![key]).copied());
                    for high in key..24 {
                        let expected = model
                            .range(vec![key]..=vec![high])
                            .next_back()
                            .map(|(k, v)| (k.clone(), *v));
                        proptest::prop_assert_eq!(index.floor(&[key], &[high]).unwrap(), expected);
                    }
                }
                let expected: Vec<_> = model
                    .range(vec![3]..vec![20])
                    .take(7)
                    .map(|(k, v)| (k.clone(), *v))
                    .collect();
                proptest::prop_assert_eq!(index.range(&[3], &[20], 7).unwrap(), expected);
                let mut counters: BTreeMap<u64, SegmentStats> = BTreeMap::new();
                for location in model.values() {
                    counters.entry(location.segment).or_default().add(location, 1);
                }
                let stats: BTreeMap<u64, SegmentStats> = index
                    .segment_stats()
                    .unwrap()
                    .into_iter()
                    .filter(|(_, stats)| stats.live_extents > 0)
                    .collect();
                proptest::prop_assert_eq!(stats, counters);
            }
            drop(index);
            std::fs::remove_file(&path).unwrap();
        }
    }
}
