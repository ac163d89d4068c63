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

use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};

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

/// One change to apply, in log order.
pub(crate) enum IndexUpdate {
    Put {
        key: Vec<u8>,
        location: Location,
        /// A compaction copy: applied only if the key still maps to `location.seq`.
        relocated: bool,
    },
    Delete {
        key: Vec<u8>,
    },
}

pub(crate) struct Index {
    db: Database,
}

impl Index {
    pub fn open(path: &Path) -> StoreResult<(Index, Option<Tail>)> {
        let db = redb::Builder::new()
            .set_cache_size(INDEX_CACHE_SIZE_MAX_BYTES)
            .create(path)?;
        let txn = db.begin_write()?;
        {
            txn.open_table(EXTENTS)?;
            txn.open_table(SEGMENT_STATS)?;
            txn.open_table(STATE)?;
        }
        txn.commit()?;
        let index = Index { db };
        let tail = index.tail()?;
        Ok((index, tail))
    }

    fn tail(&self) -> StoreResult<Option<Tail>> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(STATE)?;
        let value = table.get(TAIL)?;
        value.map(|v| Tail::decode(v.value())).transpose()
    }

    /// Applies updates in order, records `tail`, and commits — durably when `durable`.
    pub fn apply(
        &self,
        updates: &[IndexUpdate],
        tail: Tail,
        durable: bool,
        dropped_segments: &[u64],
    ) -> StoreResult<()> {
        let mut txn = self.db.begin_write()?;
        txn.set_durability(if durable {
            Durability::Immediate
        } else {
            Durability::None
        })?;
        {
            let mut extents = txn.open_table(EXTENTS)?;
            let mut deltas: BTreeMap<u64, (SegmentStats, SegmentStats)> = BTreeMap::new();
            for update in updates {
                match update {
                    IndexUpdate::Put {
                        key,
                        location,
                        relocated,
                    } => {
                        if *relocated {
                            let current = extents
                                .get(key.as_slice())?
                                .map(|v| Location::decode(v.value()))
                                .transpose()?;
                            if current.map(|c| c.seq) != Some(location.seq) {
                                continue;
                            }
                        }
                        let old = extents.insert(key.as_slice(), location.encode().as_slice())?;
                        if let Some(old) = old {
                            let old = Location::decode(old.value())?;
                            deltas.entry(old.segment).or_default().1.add(&old, 1);
                        }
                        deltas
                            .entry(location.segment)
                            .or_default()
                            .0
                            .add(location, 1);
                    }
                    IndexUpdate::Delete { key } => {
                        if let Some(old) = extents.remove(key.as_slice())? {
                            let old = Location::decode(old.value())?;
                            deltas.entry(old.segment).or_default().1.add(&old, 1);
                        }
                    }
                }
            }
            let mut stats = txn.open_table(SEGMENT_STATS)?;
            for (segment, (added, removed)) in deltas {
                let mut current = stats
                    .get(segment)?
                    .map(|v| SegmentStats::decode(v.value()))
                    .unwrap_or_default();
                current.live_record_bytes = (current.live_record_bytes + added.live_record_bytes)
                    .saturating_sub(removed.live_record_bytes);
                current.live_extents = (current.live_extents + added.live_extents)
                    .saturating_sub(removed.live_extents);
                current.live_raw_bytes = (current.live_raw_bytes + added.live_raw_bytes)
                    .saturating_sub(removed.live_raw_bytes);
                current.live_stored_bytes = (current.live_stored_bytes + added.live_stored_bytes)
                    .saturating_sub(removed.live_stored_bytes);
                stats.insert(segment, current.encode().as_slice())?;
            }
            for segment in dropped_segments {
                stats.remove(*segment)?;
            }
            let mut state = txn.open_table(STATE)?;
            state.insert(TAIL, tail.encode().as_slice())?;
        }
        txn.commit()?;
        Ok(())
    }

    pub fn get(&self, key: &[u8]) -> StoreResult<Option<Location>> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(EXTENTS)?;
        let value = table.get(key)?;
        value.map(|v| Location::decode(v.value())).transpose()
    }

    pub fn floor(&self, low: &[u8], high: &[u8]) -> StoreResult<Option<(Vec<u8>, Location)>> {
        if low > high {
            return Ok(None);
        }
        let txn = self.db.begin_read()?;
        let table = txn.open_table(EXTENTS)?;
        let mut range = table.range(low..=high)?;
        match range.next_back() {
            Some(entry) => {
                let (key, value) = entry?;
                Ok(Some((
                    key.value().to_vec(),
                    Location::decode(value.value())?,
                )))
            }
            None => Ok(None),
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
        let txn = self.db.begin_read()?;
        let table = txn.open_table(EXTENTS)?;
        let mut out = Vec::new();
        for entry in table.range(start..end)? {
            if out.len() >= limit {
                break;
            }
            let (key, value) = entry?;
            out.push((key.value().to_vec(), Location::decode(value.value())?));
        }
        Ok(out)
    }

    pub fn segment_stats(&self) -> StoreResult<BTreeMap<u64, SegmentStats>> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(SEGMENT_STATS)?;
        let mut out = BTreeMap::new();
        for entry in table.iter()? {
            let (segment, value) = entry?;
            out.insert(segment.value(), SegmentStats::decode(value.value()));
        }
        Ok(out)
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
}
