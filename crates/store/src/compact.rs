//! Compaction: reclaim the space of dead extents (overwritten or deleted) by copying the live
//! extents of mostly-dead segments to the log's end and deleting those segments.
//!
//! Safe to interrupt: a copy carries its original sequence number and is applied (at write time
//! and at replay) only if the key still maps to that sequence number, so a copy can never undo a
//! newer write; a segment is unlinked only after a durable index checkpoint shows it holds no live
//! extent. Copies may use the space reserve, so compaction works on a full disk: segments are
//! compacted in groups whose live bytes fit in half the reserve, most-dead first, each group
//! freed before the next is copied.

use std::collections::BTreeSet;

use crate::commit::{scan_segment, Engine, Op};
use crate::error::StoreResult;
use crate::format;
use crate::Progress;

/// Payload bytes per relocation batch (one group commit).
const RELOCATE_BATCH_MAX_BYTES: usize = 8 << 20;
const INDEX_PAGE_EXTENTS: usize = 4096;
/// Smallest live-byte budget of one compaction group, whatever the reserve.
const GROUP_LIVE_MIN_BYTES: u64 = 4 << 20;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactReport {
    pub segments_compacted: u64,
    pub extents_moved: u64,
    pub bytes_reclaimed: u64,
    /// Tombstones copied forward (see `compact_group`).
    pub tombstones_carried: u64,
}

pub(crate) fn compact(
    engine: &Engine,
    dead_ratio_min: f64,
    progress: &mut dyn FnMut(Progress),
) -> StoreResult<CompactReport> {
    let _maintenance = engine
        .maintenance
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let active = engine.active_segment();
    let stats = engine.index.segment_stats()?;
    // (dead ratio, segment, live bytes)
    let mut victims = Vec::new();
    for id in engine.segments.ids().into_iter().filter(|id| *id < active) {
        let Some(segment) = engine.segments.get(id) else {
            continue;
        };
        let data = segment
            .len(0)?
            .saturating_sub(format::SEGMENT_HEADER_LEN as u64);
        let live = stats.get(&id).map(|s| s.live_record_bytes).unwrap_or(0);
        let dead_ratio = if data == 0 {
            1.0
        } else {
            1.0 - live as f64 / data as f64
        };
        if dead_ratio >= dead_ratio_min {
            victims.push((dead_ratio, id, live));
        }
    }
    // Most dead first: they free the most space for the least copying.
    victims.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut report = CompactReport::default();
    let total = victims.len() as u64;
    // Copies of one group must fit in half the reserve, so compaction works on a full disk.
    let group_budget_bytes = (engine.config().reserve_bytes / 2).max(GROUP_LIVE_MIN_BYTES);
    let mut remaining = victims.as_slice();
    while !remaining.is_empty() {
        let mut group = BTreeSet::new();
        let mut live_bytes = 0u64;
        for (_, id, live) in remaining {
            if !group.is_empty() && live_bytes + live > group_budget_bytes {
                break;
            }
            group.insert(*id);
            live_bytes += live;
        }
        remaining = &remaining[group.len()..];
        compact_group(engine, &group, &mut report)?;
        progress(Progress {
            done: report.segments_compacted,
            total,
        });
    }
    Ok(report)
}

/// Copies the live extents of `group` to the log's end, checkpoints, and deletes the segments.
fn compact_group(
    engine: &Engine,
    group: &BTreeSet<u64>,
    report: &mut CompactReport,
) -> StoreResult<()> {
    // Find the live extents by walking the index (robust even when a dead region of a segment
    // no longer parses).
    let end = vec![0xFFu8; format::KEY_LEN_MAX_BYTES + 1];
    let mut cursor: Vec<u8> = Vec::new();
    let mut batch: Vec<Op> = Vec::new();
    let mut batch_bytes = 0usize;
    loop {
        let page = engine.index.range(&cursor, &end, INDEX_PAGE_EXTENTS)?;
        let Some((last_key, _)) = page.last() else {
            break;
        };
        cursor = last_key.clone();
        cursor.push(0);
        for (key, location) in page {
            if !group.contains(&location.segment) {
                continue;
            }
            let Some(value) = engine.read_extent(&key, &location)? else {
                continue;
            };
            let header = match engine.segments.get(location.segment) {
                Some(segment) => {
                    let bytes = segment.read_at(0, location.offset, format::EXTENT_HEADER_LEN)?;
                    format::decode_header(&bytes).ok()
                }
                None => None,
            };
            let (compression, content_hash) = header
                .map(|h| (h.compression, h.flags & format::FLAG_CONTENT_HASH != 0))
                .unwrap_or_default();
            batch_bytes += value.len();
            batch.push(Op::relocation(
                key,
                value,
                compression,
                content_hash,
                location.seq,
            ));
            report.extents_moved += 1;
            if batch_bytes >= RELOCATE_BATCH_MAX_BYTES {
                engine.relocate(std::mem::take(&mut batch))?;
                batch_bytes = 0;
            }
        }
    }
    // Tombstones are carried forward while an older segment might still hold a put they hide,
    // so that rebuilding the index from the whole log (`Store::rebuild_index`) never brings a
    // deleted key back. A key put again since needs no tombstone.
    let oldest = engine.segments.ids().first().copied().unwrap_or(0);
    for id in group.iter().copied().filter(|id| *id > oldest) {
        let Some(segment) = engine.segments.get(id) else {
            continue;
        };
        scan_segment(&segment, false, &mut |_, header, key| {
            if header.kind != format::KIND_DELETE {
                return Ok(());
            }
            if engine
                .index
                .get(&key)?
                .is_some_and(|location| location.seq > header.seq)
            {
                return Ok(());
            }
            batch_bytes += key.len() + format::EXTENT_HEADER_LEN;
            batch.push(Op::relocated_delete(key, header.seq));
            report.tombstones_carried += 1;
            Ok(())
        })?;
        if batch_bytes >= RELOCATE_BATCH_MAX_BYTES {
            engine.relocate(std::mem::take(&mut batch))?;
            batch_bytes = 0;
        }
    }
    if !batch.is_empty() {
        engine.relocate(batch)?;
    }
    // Only segments with no live extent left may go.
    let after = engine.index.segment_stats()?;
    let empty: Vec<u64> = group
        .iter()
        .copied()
        .filter(|id| after.get(id).map(|s| s.live_extents == 0).unwrap_or(true))
        .collect();
    engine.checkpoint(empty.clone())?;
    for id in &empty {
        if let Some(segment) = engine.segments.get(*id) {
            report.bytes_reclaimed += segment.len(0)?;
        }
        engine.segments.remove(*id)?;
        report.segments_compacted += 1;
    }
    Ok(())
}
