//! This node's "nearly full" mark in the catalog (`NodeSetNearfull`): set once a data
//! directory's filesystem is over `nearfull_percent` used, cleared once every one is back a
//! point under it. Placement gives a nearly full node no new replica, and Raft refuses a move,
//! copy or new replica onto it, so a rebuild or a drain does not fill a disk that is already
//! nearly full (`docs/volumes.md`, "Placement").

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use keel_catalog::{Command, Metadata};
use keel_clock::Clock;

/// How often the data directories are looked at.
pub const CHECK_EVERY: Duration = Duration::from_secs(5);

/// Whether data directories with these `(used, counted)` bytes
/// ([`keel_store::fsinfo::FilesystemInfo::used_of`]: `df`'s figures) make the node nearly
/// full: one is over `percent` used, or, the node being marked already (`marked`), one is still over
/// `percent - 1` (a point of hysteresis, so a node at the edge does not flap). 100 or more
/// never marks a node.
pub fn nearly_full(usage: &[(u64, u64)], percent: u8, marked: bool) -> bool {
    if percent >= 100 {
        return false;
    }
    let limit = u128::from(if marked {
        percent.saturating_sub(1)
    } else {
        percent
    });
    usage
        .iter()
        .any(|&(used, counted)| counted > 0 && u128::from(used) * 100 > u128::from(counted) * limit)
}

/// Checks the data directories every [`CHECK_EVERY`] and proposes the mark when it should
/// change, until `stop`. A refused or failed proposal is tried again at the next check.
pub async fn watch(
    cluster: Arc<keel_cluster::Cluster>,
    dirs: Vec<PathBuf>,
    percent: u8,
    clock: Arc<dyn Clock>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let node = cluster.local_node();
    loop {
        let usage: Vec<(u64, u64)> = dirs
            .iter()
            .filter_map(|dir| keel_store::fsinfo::filesystem_info(dir).ok())
            .map(|info| info.used_of())
            .collect();
        let marked = cluster.catalog().read().nearfull.contains(&node);
        let full = nearly_full(&usage, percent, marked);
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
                    "a data directory is over nearfull_percent used: this node takes no new \
                     replica until it is back under"
                ),
                Ok(_) => tracing::info!(
                    percent,
                    "the data directories are back under nearfull_percent: this node takes new \
                     replicas again"
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
    use super::nearly_full;

    // Proves the mark is set over the threshold, kept until a point under it, never set at
    // 100 (the check off), and that one full directory of several is enough.
    #[test]
    fn a_node_is_nearly_full_over_the_threshold_until_a_point_under_it() {
        let used = |percent: u64| (percent, 100);
        assert!(!nearly_full(&[used(95)], 95, false));
        assert!(nearly_full(&[used(96)], 95, false));
        assert!(nearly_full(&[used(95)], 95, true), "kept at the threshold");
        assert!(
            !nearly_full(&[used(94)], 95, true),
            "cleared a point under it"
        );
        assert!(!nearly_full(&[used(100)], 100, false));
        assert!(nearly_full(&[used(10), used(99)], 95, false));
        assert!(
            !nearly_full(&[(0, 0)], 95, false),
            "an unknown size marks nothing"
        );
    }
}
