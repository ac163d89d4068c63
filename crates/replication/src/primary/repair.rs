//! Snapshot repair: copies a snapshot's data to a replica whose copy of it is incomplete (the
//! replica was out of the in-sync set when the snapshot was taken, was placed after it, or
//! did not receive the stream that made it). A catch-up copies the volume's current contents
//! only; this copies each such snapshot, so that losing the nodes that held it whole loses
//! no snapshot.
//!
//! The primary drives it, one snapshot copy at a time ([`Primary::spawn_snapshot_repair`]),
//! for a target replica that is in sync and up, from a node that holds the snapshot whole
//! (this one when it does, else an in-sync replica that does):
//! 1. Raft reserves a generation of the volume for the repair (`SnapshotRepairBegin`): no
//!    view shows it, and the garbage collector keeps it. A repair already under way answers
//!    its generation again, so an interrupted one resumes where it stopped.
//! 2. Chunk by chunk, the target's hashes of its copy as the repair sees it (the snapshot's
//!    view plus the reserved generation) are compared with the source's; the blocks that
//!    differ are read from the source and written, durably, into the reserved generation on
//!    the target. Zeroes are written as hole markers: they hide the stale blocks below.
//! 3. Raft ends the repair (`SnapshotRepairEnd`): the reserved generation joins the
//!    snapshot's view, and the target's copy is complete.
//!
//! No other node holds extents in the reserved generation, so adding it to the snapshot's view
//! changes nothing there; the volume and every other view exclude it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use keel_catalog::{Command, NodeId, Outcome};

use super::Primary;
use crate::replica::hash_range;
use crate::wire::{
    self, CopyAnswer, HashAnswer, RepairRun, SnapshotRange, SnapshotRepairWrite, BLOCK_HASH_BYTES,
    METHOD_SNAPSHOT_HASHES, METHOD_SNAPSHOT_READ, METHOD_SNAPSHOT_REPAIR,
};
use crate::{RepairDue, RESYNC_CHUNK_BYTES};

/// How long one call of a repair to another node may take (a chunk's read or durable write
/// on a busy shared disk).
const REPAIR_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A snapshot copy being repaired, as `volume info` shows it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SnapshotRepairProgress {
    pub snapshot: String,
    pub node: NodeId,
    /// The node its data comes from.
    pub source: NodeId,
    pub compared_bytes: u64,
    pub total_bytes: u64,
    pub shipped_bytes: u64,
}

impl Primary {
    /// Starts repairing one incomplete snapshot copy, if one is due and none is under way
    /// here; it retries at the next call after a failure (the engine calls this every few
    /// seconds).
    pub(crate) fn spawn_snapshot_repair(self: &Arc<Self>) {
        if !self.shared.snapshot_repair || self.is_closed() {
            return;
        }
        let due = {
            let catalog = self.shared.metadata.catalog().read();
            catalog.volumes.get(&self.volume_id).and_then(|entry| {
                crate::snapshot_repair_due(&catalog, entry, self.shared.local_node)
            })
        };
        let Some(due) = due else {
            return;
        };
        if self.repairing.swap(true, Ordering::SeqCst) {
            return;
        }
        let this = self.clone();
        self.shared.runtime.spawn(async move {
            match this.repair_snapshot(due).await {
                Ok(shipped_bytes) => {
                    this.repair_failures.store(0, Ordering::Relaxed);
                    tracing::info!(
                        volume = %this.name,
                        snapshot_generation = due.generation,
                        node = due.target,
                        shipped_bytes,
                        "snapshot copy repaired: it is complete on the node"
                    );
                }
                Err(error) => {
                    // Said once, then every 30th time: a node that keeps failing is retried
                    // every few seconds.
                    let failures = this.repair_failures.fetch_add(1, Ordering::Relaxed);
                    if failures.is_multiple_of(30) {
                        tracing::info!(
                            volume = %this.name,
                            snapshot_generation = due.generation,
                            node = due.target,
                            %error,
                            failures,
                            "repairing a snapshot copy failed; it is retried"
                        );
                    }
                }
            }
            this.state().snapshot_repair = None;
            this.repairing.store(false, Ordering::SeqCst);
        });
    }

    /// Repairs the target's copy of one snapshot (see the module comment); returns the bytes
    /// shipped.
    async fn repair_snapshot(self: &Arc<Self>, due: RepairDue) -> Result<u64, String> {
        let (snapshot_name, size) = {
            let catalog = self.shared.metadata.catalog().read();
            let snapshot = catalog
                .volumes
                .get(&self.volume_id)
                .and_then(|entry| entry.snapshots.get(&due.generation))
                .ok_or("the snapshot is gone")?;
            (snapshot.name.clone(), snapshot.size_bytes)
        };
        let begun = self
            .shared
            .cluster
            .propose_async(Command::SnapshotRepairBegin {
                volume_id: self.volume_id,
                snapshot_generation: due.generation,
                node: due.target,
            })
            .await
            .map_err(|error| error.to_string())?;
        let Outcome::Reserved {
            generation: repair, ..
        } = begun
        else {
            return Err(format!("Raft answered the repair's start with {begun:?}"));
        };
        // The nodes wait until they applied the start before they answer.
        let catalog_index = self.shared.cluster.applied_index();
        let range = |offset: u64, length: u64, repair: Option<u64>| SnapshotRange {
            volume_id: self.volume_id,
            epoch: self.state().epoch,
            snapshot_generation: due.generation,
            repair,
            catalog_index,
            offset,
            length,
        };
        self.state().snapshot_repair = Some(SnapshotRepairProgress {
            snapshot: snapshot_name,
            node: due.target,
            source: due.source,
            compared_bytes: 0,
            total_bytes: size,
            shipped_bytes: 0,
        });
        let block = u64::from(self.local.block_size_bytes());
        let clock = self.shared.clock();
        let started = clock.now();
        let busy_percent = u32::from(self.shared.resync_busy_percent.clamp(1, 100));
        let mut requests_seen = self.local_requests();
        let mut shipped = 0u64;
        let mut offset = 0u64;
        while offset < size {
            if self.is_closed() {
                return Err("this node stopped serving the volume".to_string());
            }
            let chunk_started = clock.now();
            let length = RESYNC_CHUNK_BYTES.min(size - offset);
            let blocks = (length / block) as usize;
            let theirs = self
                .snapshot_hashes(due.target, range(offset, length, Some(repair)))
                .await?;
            let ours = self
                .snapshot_hashes(due.source, range(offset, length, None))
                .await?;
            let runs = differing_runs(&ours, &theirs, blocks, block as usize)?;
            if !runs.is_empty() {
                let data = self
                    .snapshot_read(due.source, range(offset, length, None))
                    .await?;
                if data.len() as u64 != length {
                    return Err(format!(
                        "node {} sent {} bytes of a {length}-byte chunk",
                        due.source,
                        data.len()
                    ));
                }
                let runs: Vec<RepairRun> = runs
                    .into_iter()
                    .map(|(first, end)| {
                        let (start, stop) = (first * block as usize, end * block as usize);
                        RepairRun {
                            offset: offset + start as u64,
                            data: data[start..stop].to_vec(),
                        }
                    })
                    .collect();
                shipped += runs.iter().map(|run| run.data.len() as u64).sum::<u64>();
                let write = SnapshotRepairWrite {
                    volume_id: self.volume_id,
                    epoch: self.state().epoch,
                    snapshot_generation: due.generation,
                    repair,
                    catalog_index,
                    runs,
                };
                self.snapshot_write(due.target, write).await?;
            }
            offset += length;
            if let Some(progress) = self.state().snapshot_repair.as_mut() {
                progress.compared_bytes = offset;
                progress.shipped_bytes = shipped;
            }
            // Paced as a catch-up is: the configured rate, and a share of the time while
            // clients are active on either node.
            let worked = clock.now().saturating_duration_since(chunk_started);
            if let Some(rate) = self.shared.resync_bytes_per_second {
                let due_at = Duration::from_secs_f64(shipped as f64 / rate.max(1) as f64);
                let elapsed = clock.now().saturating_duration_since(started);
                if due_at > elapsed {
                    clock.sleep(due_at - elapsed).await;
                }
            }
            let requests = self.local_requests();
            if (requests != requests_seen || self.replica_node_busy(due.target))
                && busy_percent < 100
            {
                clock
                    .sleep(worked * (100 - busy_percent) / busy_percent)
                    .await;
                requests_seen = self.local_requests();
            }
        }
        // Every write above was durable on the target when it answered.
        self.shared
            .cluster
            .propose_async(Command::SnapshotRepairEnd {
                volume_id: self.volume_id,
                snapshot_generation: due.generation,
                node: due.target,
                generation: repair,
            })
            .await
            .map_err(|error| error.to_string())?;
        Ok(shipped)
    }

    /// Hashes of `node`'s copy of a range of the snapshot (this node's: read here).
    async fn snapshot_hashes(&self, node: NodeId, range: SnapshotRange) -> Result<Vec<u8>, String> {
        if node != self.shared.local_node {
            let answer: HashAnswer = self
                .ask(node, METHOD_SNAPSHOT_HASHES, &range, REPAIR_CALL_TIMEOUT)
                .await?;
            return Ok(answer.hashes);
        }
        let local = self.shared.local.clone();
        crate::blocking(move || {
            let copy = local
                .open_snapshot_copy(range.volume_id, range.snapshot_generation, range.repair)
                .map_err(|error| error.to_string())?;
            hash_range(copy.as_ref(), range.offset, range.length).map_err(|error| error.to_string())
        })
        .await?
    }

    /// `node`'s copy of a range of the snapshot, which it holds whole.
    async fn snapshot_read(&self, node: NodeId, range: SnapshotRange) -> Result<Vec<u8>, String> {
        if node != self.shared.local_node {
            let answer: CopyAnswer = self
                .ask(node, METHOD_SNAPSHOT_READ, &range, REPAIR_CALL_TIMEOUT)
                .await?;
            return Ok(answer.data);
        }
        let local = self.shared.local.clone();
        crate::blocking(move || {
            let copy = local
                .open_snapshot_copy(range.volume_id, range.snapshot_generation, None)
                .map_err(|error| error.to_string())?;
            let mut data = vec![0u8; range.length as usize];
            copy.read(range.offset, &mut data)
                .map_err(|error| error.to_string())?;
            Ok(data)
        })
        .await?
    }

    /// Writes blocks into the repair of `node`'s copy, durably.
    async fn snapshot_write(&self, node: NodeId, write: SnapshotRepairWrite) -> Result<(), String> {
        if node != self.shared.local_node {
            return self
                .ask::<()>(node, METHOD_SNAPSHOT_REPAIR, &write, REPAIR_CALL_TIMEOUT)
                .await;
        }
        let local = self.shared.local.clone();
        crate::blocking(move || {
            let runs: Vec<(u64, &[u8])> = write
                .runs
                .iter()
                .map(|run| (run.offset, run.data.as_slice()))
                .collect();
            local
                .write_snapshot_repair(
                    write.volume_id,
                    write.snapshot_generation,
                    write.repair,
                    &runs,
                )
                .map_err(|error| error.to_string())
        })
        .await?
    }
}

/// The runs of blocks, as (first, end) block indexes, whose hashes differ between the source
/// (`ours`) and the target (`theirs`); an empty list of hashes is a range never written
/// (zeroes).
fn differing_runs(
    ours: &[u8],
    theirs: &[u8],
    blocks: usize,
    block_bytes: usize,
) -> Result<Vec<(usize, usize)>, String> {
    let zero = wire::zero_block_hash(block_bytes);
    let hash_of = |hashes: &[u8], index: usize| -> [u8; BLOCK_HASH_BYTES] {
        if hashes.is_empty() {
            return zero;
        }
        let mut hash = [0u8; BLOCK_HASH_BYTES];
        hash.copy_from_slice(&hashes[index * BLOCK_HASH_BYTES..(index + 1) * BLOCK_HASH_BYTES]);
        hash
    };
    for hashes in [ours, theirs] {
        if !hashes.is_empty() && hashes.len() != blocks * BLOCK_HASH_BYTES {
            return Err(format!(
                "{} bytes of hashes for {blocks} blocks",
                hashes.len()
            ));
        }
    }
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for index in 0..blocks {
        if hash_of(ours, index) == hash_of(theirs, index) {
            continue;
        }
        match runs.last_mut() {
            Some((_, end)) if *end == index => *end = index + 1,
            _ => runs.push((index, index + 1)),
        }
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves only the blocks whose hashes differ travel, in runs, and that a range never
    // written on one side compares as zeroes.
    #[test]
    fn only_differing_blocks_are_shipped() {
        let zero = wire::zero_block_hash(4096);
        let other = wire::block_hash(&[1u8; 4096]);
        let hashes = |blocks: &[[u8; BLOCK_HASH_BYTES]]| blocks.concat();
        let ours = hashes(&[zero, other, other, zero, other]);
        let theirs = hashes(&[zero, zero, other, other, zero]);
        assert_eq!(
            differing_runs(&ours, &theirs, 5, 4096).ok(),
            Some(vec![(1, 2), (3, 5)])
        );
        assert_eq!(
            differing_runs(&ours, &[], 5, 4096).ok(),
            Some(vec![(1, 3), (4, 5)])
        );
        assert_eq!(differing_runs(&[], &[], 5, 4096).ok(), Some(vec![]));
        assert!(differing_runs(&ours[..16], &theirs, 5, 4096).is_err());
    }
}
