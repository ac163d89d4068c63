//! Scrub: read every live extent on every device, verify header CRC, payload CRC and content
//! hash, and rewrite bad copies from a good one. It walks the index in key order a page at a
//! time (no long read transactions) and only ever overwrites a copy with bytes that verified, so
//! it is safe to interrupt at any point and to run beside writers.

use std::sync::atomic::Ordering;

use crate::commit::Engine;
use crate::error::{StoreError, StoreResult};
use crate::segment::hex;
use crate::Progress;

/// Extents fetched from the index per page.
const SCRUB_PAGE_EXTENTS: usize = 1024;
/// Keys of unrecoverable extents listed in the report (the count is always exact).
const UNRECOVERABLE_LISTED_MAX: usize = 100;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScrubReport {
    pub extents_checked: u64,
    pub bytes_checked: u64,
    /// Device copies that failed verification and were rewritten from a good copy.
    pub repaired_copies: u64,
    /// Extents with no good copy on any device.
    pub unrecoverable_extents: u64,
    /// Hex keys of (some of) the unrecoverable extents.
    pub unrecoverable_keys: Vec<String>,
    /// Stopped before the end (`Store::scrub_until`).
    pub interrupted: bool,
}

pub(crate) fn scrub(
    engine: &Engine,
    progress: &mut dyn FnMut(Progress),
    stop: &dyn Fn() -> bool,
) -> StoreResult<ScrubReport> {
    let _maintenance = engine
        .maintenance
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let total = engine.stats()?.live_extents;
    let mut report = ScrubReport::default();
    let end = vec![0xFFu8; crate::format::KEY_LEN_MAX_BYTES + 1];
    let mut cursor: Vec<u8> = Vec::new();
    let before = engine.repaired_extents.load(Ordering::Relaxed);
    loop {
        let page = engine.index.range(&cursor, &end, SCRUB_PAGE_EXTENTS)?;
        let Some((last_key, _)) = page.last() else {
            break;
        };
        cursor = last_key.clone();
        cursor.push(0);
        for (key, location) in page {
            report.extents_checked += 1;
            report.bytes_checked += location.record_len as u64;
            match engine.read_verified(&key, &location, true) {
                Ok(_) => {}
                Err(StoreError::Corrupt { .. }) => {
                    report.unrecoverable_extents += 1;
                    if report.unrecoverable_keys.len() < UNRECOVERABLE_LISTED_MAX {
                        report.unrecoverable_keys.push(hex(&key));
                    }
                }
                Err(other) => return Err(other),
            }
        }
        progress(Progress {
            done: report.extents_checked,
            total: total.max(report.extents_checked),
        });
        if stop() {
            report.interrupted = true;
            break;
        }
    }
    report.repaired_copies = engine.repaired_extents.load(Ordering::Relaxed) - before;
    Ok(report)
}
