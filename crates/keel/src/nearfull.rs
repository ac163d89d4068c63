//! This node's "nearly full" mark in the catalog (`NodeSetNearfull`): set once a data
//! directory's filesystem is over `nearfull_percent` used or has less than twice the store's
//! reserve free, cleared once every one is back a point under the percentage and a hundredth
//! of its size above twice the reserve. Placement gives a nearly full node no new replica,
//! and Raft refuses a move, copy or new replica onto it, so a rebuild or a drain does not
//! fill a disk that is already nearly full (`docs/volumes.md`, "Placement").

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use keel_catalog::{Command, Metadata};
use keel_clock::Clock;

/// How often the data directories are looked at.
pub const CHECK_EVERY: Duration = Duration::from_secs(5);

/// One data directory's filesystem as `df` sees it: bytes in use, the bytes its percentage
/// is of ([`keel_store::fsinfo::FilesystemInfo::used_of`]), and bytes free to Keel.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    pub used: u64,
    pub counted: u64,
    pub available: u64,
}

impl Usage {
    pub fn of(info: &keel_store::fsinfo::FilesystemInfo) -> Usage {
        let (used, counted) = info.used_of();
        Usage {
            used,
            counted,
            available: info.available_bytes,
        }
    }

    /// Whether the store is about to refuse writes here: it refuses one that would leave less
    /// than `reserve` free, and a group commit writes up to [`FULL_MARGIN_BYTES`] at once.
    /// An unknown size (nothing counted) is never full.
    pub fn full(&self, reserve: u64) -> bool {
        self.counted > 0 && self.available < reserve.saturating_add(FULL_MARGIN_BYTES)
    }

    /// Whether so little is free that a whole copy could fill it: under twice the store's
    /// reserve (or, `marked` already, under that plus a hundredth of the filesystem, so a
    /// node at the edge does not flap), whatever the percentage.
    fn low(&self, reserve: u64, marked: bool) -> bool {
        let limit = reserve.saturating_mul(keel_store::LOW_SPACE_RESERVES);
        let limit = if marked {
            limit.saturating_add(self.counted / 100)
        } else {
            limit
        };
        self.available < limit
    }

    pub fn percent_used(&self) -> u128 {
        u128::from(self.used) * 100 / u128::from(self.counted.max(1))
    }
}

/// How far above its reserve a store counts as full: the most one group commit writes.
pub const FULL_MARGIN_BYTES: u64 = 16 << 20;

/// Whether data directories with this usage make the node nearly full: one is over `percent`
/// used, or, the node being marked already (`marked`), one is still over `percent - 1` (a
/// point of hysteresis, so a node at the edge does not flap); 100 or more turns this test
/// off. Or one has less free than twice the store's `reserve` ([`Usage::low`]): the store
/// refuses writes at its reserve, which on a small filesystem (or with a large reserve)
/// comes before any percentage.
pub fn nearly_full(usage: &[Usage], percent: u8, reserve: u64, marked: bool) -> bool {
    usage.iter().any(|dir| {
        dir.counted > 0 && (over_percent(dir, percent, marked) || dir.low(reserve, marked))
    })
}

/// Whether one directory is over `percent` used (`marked`: over a point under it).
pub fn over_percent(dir: &Usage, percent: u8, marked: bool) -> bool {
    if percent >= 100 {
        return false;
    }
    let limit = u128::from(if marked {
        percent.saturating_sub(1)
    } else {
        percent
    });
    u128::from(dir.used) * 100 > u128::from(dir.counted) * limit
}

/// Checks the data directories every [`CHECK_EVERY`] and proposes the mark when it should
/// change, until `stop`. A refused or failed proposal is tried again at the next check.
pub async fn watch(
    cluster: Arc<keel_cluster::Cluster>,
    dirs: Vec<PathBuf>,
    percent: u8,
    reserve: u64,
    clock: Arc<dyn Clock>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let node = cluster.local_node();
    loop {
        let usage: Vec<Usage> = dirs
            .iter()
            .filter_map(|dir| keel_store::fsinfo::filesystem_info(dir).ok())
            .map(|info| Usage::of(&info))
            .collect();
        let marked = cluster.catalog().read().nearfull.contains(&node);
        let full = nearly_full(&usage, percent, reserve, marked);
        if full != marked {
            match cluster
                .propose_async(Command::NodeSetNearfull {
                    id: node,
                    nearfull: full,
                })
                .await
            {
                Ok(_) if full => tracing::warn!(
                    percent,
                    reserve,
                    "a data directory is over nearfull_percent used, or has less than twice the \
                     store's reserve free: this node takes no new replica until it is back under"
                ),
                Ok(_) => tracing::info!(
                    percent,
                    reserve,
                    "the data directories are back under nearfull_percent, with room above the \
                     store's reserve: this node takes new replicas again"
                ),
                Err(error) => tracing::info!(%error, "could not record this node's free space yet"),
            }
        }
        tokio::select! {
            _ = clock.sleep(CHECK_EVERY) => {}
            _ = stop.wait_for(|stop| *stop) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{nearly_full, Usage};

    const GIB: u64 = 1 << 30;

    /// `percent` used of 100 GiB, the rest free.
    fn used(percent: u64) -> Usage {
        Usage {
            used: percent * GIB,
            counted: 100 * GIB,
            available: (100 - percent) * GIB,
        }
    }

    // Proves the mark is set over the threshold, kept until a point under it, never set at
    // 100 (the check off), and that one full directory of several is enough.
    #[test]
    fn a_node_is_nearly_full_over_the_threshold_until_a_point_under_it() {
        let reserve = 256 << 20;
        assert!(!nearly_full(&[used(95)], 95, reserve, false));
        assert!(nearly_full(&[used(96)], 95, reserve, false));
        assert!(
            nearly_full(&[used(95)], 95, reserve, true),
            "kept at the threshold"
        );
        assert!(
            !nearly_full(&[used(94)], 95, reserve, true),
            "cleared a point under it"
        );
        assert!(
            !nearly_full(&[used(99)], 100, reserve, false),
            "100: the percentage off (1 GiB free is over twice the reserve)"
        );
        assert!(nearly_full(&[used(10), used(99)], 95, reserve, false));
        let unknown = Usage {
            used: 0,
            counted: 0,
            available: 0,
        };
        assert!(
            !nearly_full(&[unknown], 95, reserve, false),
            "an unknown size marks nothing"
        );
    }

    // Proves a directory under its percentage is nearly full with less than twice the
    // store's reserve free (a small filesystem, or a large reserve), whatever the percentage
    // setting (100 included), stays so until a hundredth of its size above that, and that
    // "full" is the reserve plus one group commit.
    #[test]
    fn a_node_is_nearly_full_close_to_the_stores_reserve() {
        let mib = 1u64 << 20;
        let small = |available_mib: u64| Usage {
            used: (200 - available_mib) * mib,
            counted: 200 * mib,
            available: available_mib * mib,
        };
        let reserve = 16 * mib;
        assert!(
            !nearly_full(&[small(40)], 95, reserve, false),
            "80% used, 40 MiB free"
        );
        assert!(
            nearly_full(&[small(31)], 95, reserve, false),
            "under twice the reserve"
        );
        assert!(
            nearly_full(&[small(31)], 100, reserve, false),
            "the percentage off"
        );
        assert!(
            nearly_full(&[small(33)], 95, reserve, true),
            "kept within a hundredth of the size above twice the reserve"
        );
        assert!(
            !nearly_full(&[small(35)], 95, reserve, true),
            "cleared beyond it"
        );
        assert!(
            small(31).full(reserve),
            "within one group commit of the reserve"
        );
        assert!(!small(33).full(reserve));
    }
}
