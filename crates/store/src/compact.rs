//! Compaction: reclaim the space of dead extents (overwritten or deleted) by copying the live
//! extents of mostly-dead segments to the log's end and deleting those segments.
//!
//! Safe to interrupt: a copy carries its original sequence number and is applied (at write time
//! and at replay) only if the key still maps to that sequence number, so a copy can never undo a
//! newer write; a segment is unlinked only after a durable index checkpoint shows it holds no live
//! extent. Copies may use the space reserve, so compaction works on a full disk.

use std::collections::BTreeSet;

use crate::commit::{Engine, Op};
use crate::error::StoreResult;
use crate::format;
use crate::Progress;

/// Payload bytes per relocation batch (one group commit).
const RELOCATE_BATCH_MAX_BYTES: usize = 8 << 20;
const INDEX_PAGE_EXTENTS: usize = 4096;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactReport {
    pub segments_compacted: u64,
    pub extents_moved: u64,
    pub bytes_reclaimed: u64,
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
    let mut victims = BTreeSet::new();
    for id in engine.segments.ids().into_iter().filter(|id| *id < active) {
        let Some(segment) = engine.segments.get(id) else {
            continue;
        };
        let len = segment.len(0)?;
        let data = len.saturating_sub(format::SEGMENT_HEADER_LEN as u64);
        let live = stats.get(&id).map(|s| s.live_record_bytes).unwrap_or(0);
        let dead_ratio = if data == 0 {
            1.0
        } else {
            1.0 - live as f64 / data as f64
        };
        if dead_ratio >= dead_ratio_min {
            victims.insert(id);
        }
    }
    let mut report = CompactReport::default();
    if victims.is_empty() {
        return Ok(report);
    }

    // Find the live extents of the victims by walking the index (robust even when a dead
    // region of a segment no longer parses).
    let end = vec![0xFFu8; format::KEY_LEN_MAX_BYTES + 1];
    let mut cursor: Vec<u8> = Vec::new();
    let mut batch: Vec<Op> = Vec::new();
    let mut batch_bytes = 0usize;
    let total_live: u64 = victims
        .iter()
        .filter_map(|id| stats.get(id))
        .map(|s| s.live_extents)
        .sum();
    loop {
        let page = engine.index.range(&cursor, &end, INDEX_PAGE_EXTENTS)?;
        let Some((last_key, _)) = page.last() else {
            break;
        };
        cursor = last_key.clone();
        cursor.push(0);
        for (key, location) in page {
            if !victims.contains(&location.segment) {
                continue;
            }
            let Some(value) = engine.read_extent(&key, &location)? else {
                continue;
            };
            let segment = engine.segments.get(location.segment);
            let header = match segment {
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
            batch.push(Op::Relocate {
                key,
                value,
                compression,
                content_hash,
                seq: location.seq,
            });
            report.extents_moved += 1;
            if batch_bytes >= RELOCATE_BATCH_MAX_BYTES {
                engine.relocate(std::mem::take(&mut batch))?;
                batch_bytes = 0;
                progress(Progress {
                    done: report.extents_moved,
                    total: total_live.max(report.extents_moved),
                });
            }
        }
    }
    if !batch.is_empty() {
        engine.relocate(batch)?;
    }
    progress(Progress {
        done: report.extents_moved,
        total: total_live.max(report.extents_moved),
    });

    // Only segments with no live extent left may go.
    let after = engine.index.segment_stats()?;
    let empty: Vec<u64> = victims
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
    Ok(report)
}
