//! Walks over a volume's block keys (never its data): garbage collection, space accounting,
//! deletion, and the per-range generation lists trims and send streams need.
//!
//! Keys of one volume sort by block, then generation, so one ordered key scan yields, block by
//! block, every generation stored for it; what each view shows is then computed in memory with
//! the same rule reads use ([`super::view`]). Memory is bounded by [`KEYS_PAGE_MAX`] keys plus
//! one block's generations.
//!
//! Collector safety: it captures the volume's views (current and every snapshot's own layer),
//! `generation_next` and the generations a receive or a snapshot repair is filling (all in the
//! volume's records), under the state lock; then it
//! deletes only extents below that `generation_next`, not being filled, and shown by none of
//! the captured views. Views created later are built from captured ones or from newer
//! generations, so they never need what it deletes. Deletes are `Buffered`: a crash can bring a
//! deleted extent back, but only an extent no view shows, and the log keeps them in order with
//! any later write.

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_store::{block_key, Durability, Extent, Progress, Store, WriteOp};

use keel_catalog::view::Layer;

use super::record::{copy_records, key_successor, parse_block_key, volume_blocks_end};
use super::{lock, read, GcReport, VolumeError, VolumeResult, VolumeShared, BLOCK_SIZE_BYTES};

/// Keys fetched per `Store::keys` call.
pub(crate) const KEYS_PAGE_MAX: usize = 4096;
/// Deletes per `Store::write` when collecting or erasing.
pub(crate) const DELETE_BATCH_OPS_MAX: usize = 4096;

/// Calls `changed(block)` for every block of `volume_id` with an extent (data or hole marker)
/// written after store sequence `since`, in block order (a block once per generation written).
/// What replication compares after a crash: a block deleted outright (a trim of a block only
/// the current generation held) leaves nothing to find, so replicated volumes trim with hole
/// markers. Reads keys only; memory is bounded by [`KEYS_PAGE_MAX`].
pub fn changed_blocks_since(
    store: &Store,
    volume: &str,
    volume_id: u64,
    since: u64,
    changed: &mut dyn FnMut(u64),
) -> VolumeResult<()> {
    let end = volume_blocks_end(volume_id);
    let mut cursor = block_key(volume_id, 0, 0);
    loop {
        let page = store
            .keys_with_sequences(&cursor, &end, KEYS_PAGE_MAX)
            .map_err(VolumeError::store(volume, "listing changed blocks"))?;
        for (key, sequence) in &page {
            if *sequence > since {
                if let Some((_, block, _)) = parse_block_key(key) {
                    changed(block);
                }
            }
        }
        match page.last() {
            Some((last, _)) if page.len() == KEYS_PAGE_MAX => cursor = key_successor(last),
            _ => break,
        }
    }
    Ok(())
}

/// What one volume stores for one block: its generations, ascending, and where each lies.
struct Stored {
    generations: Vec<u64>,
    extents: Vec<Extent>,
}

/// Block → what `volume_id` stores for it, for blocks in `[block_from, block_to)`.
fn collect_generations(
    store: &Store,
    volume: &str,
    volume_id: u64,
    block_from: u64,
    block_to: u64,
) -> VolumeResult<BTreeMap<u64, Stored>> {
    let mut stored: BTreeMap<u64, Stored> = BTreeMap::new();
    let end = block_key(volume_id, block_to, 0);
    let mut cursor = block_key(volume_id, block_from, 0);
    loop {
        let page = store
            .extents(&cursor, &end, KEYS_PAGE_MAX)
            .map_err(VolumeError::store(volume, "listing block keys"))?;
        let next = match page.last() {
            Some(last) if page.len() == KEYS_PAGE_MAX => Some(key_successor(last.key())),
            _ => None,
        };
        for extent in page {
            if let Some((_, block, generation)) = parse_block_key(extent.key()) {
                let entry = stored.entry(block).or_insert_with(|| Stored {
                    generations: Vec::new(),
                    extents: Vec::new(),
                });
                entry.generations.push(generation);
                entry.extents.push(extent);
            }
        }
        match next {
            Some(next) => cursor = next,
            None => break,
        }
    }
    Ok(stored)
}

/// The generations stored for blocks `[block_from, block_to)` by several volumes (the layers
/// of one or two views), where each lies, and the blocks any of them holds, ascending.
pub(crate) struct RangeGenerations {
    /// Sorted, without duplicates; `maps[i]` belongs to `volume_ids[i]`.
    volume_ids: Vec<u64>,
    maps: Vec<BTreeMap<u64, Stored>>,
    blocks: Vec<u64>,
}

impl RangeGenerations {
    pub(crate) fn collect(
        store: &Store,
        volume: &str,
        volume_ids: impl IntoIterator<Item = u64>,
        block_from: u64,
        block_to: u64,
    ) -> VolumeResult<RangeGenerations> {
        let mut volume_ids: Vec<u64> = volume_ids.into_iter().collect();
        volume_ids.sort_unstable();
        volume_ids.dedup();
        let maps = volume_ids
            .iter()
            .map(|&volume_id| collect_generations(store, volume, volume_id, block_from, block_to))
            .collect::<VolumeResult<Vec<_>>>()?;
        let mut blocks: Vec<u64> = maps.iter().flat_map(|map| map.keys().copied()).collect();
        blocks.sort_unstable();
        blocks.dedup();
        Ok(RangeGenerations {
            volume_ids,
            maps,
            blocks,
        })
    }

    /// Blocks with at least one extent in the range, ascending.
    pub(crate) fn blocks(&self) -> &[u64] {
        &self.blocks
    }

    fn stored(&self, volume_id: u64, block: u64) -> Option<&Stored> {
        self.volume_ids
            .binary_search(&volume_id)
            .ok()
            .and_then(|index| self.maps[index].get(&block))
    }

    /// Ascending generations `volume_id` stores for `block` (empty if none).
    pub(crate) fn of(&self, volume_id: u64, block: u64) -> &[u64] {
        self.stored(volume_id, block)
            .map(|stored| stored.generations.as_slice())
            .unwrap_or(&[])
    }

    /// Where `volume_id`'s extent of `block` at `generation` lies, if it was listed: read it
    /// with [`Store::read_extents`].
    pub(crate) fn extent(&self, volume_id: u64, block: u64, generation: u64) -> Option<&Extent> {
        let stored = self.stored(volume_id, block)?;
        let index = stored.generations.iter().position(|g| *g == generation)?;
        stored.extents.get(index)
    }
}

/// Calls `visit(block, generations, keys)` for every block of `volume_id` that has extents, in
/// block order.
fn for_each_block(
    store: &Store,
    volume: &str,
    volume_id: u64,
    visit: &mut dyn FnMut(u64, &[u64]) -> VolumeResult<()>,
) -> VolumeResult<()> {
    let end = volume_blocks_end(volume_id);
    let mut cursor = block_key(volume_id, 0, 0);
    let mut current: Option<(u64, Vec<u64>)> = None;
    loop {
        let page = store
            .keys(&cursor, &end, KEYS_PAGE_MAX)
            .map_err(VolumeError::store(volume, "listing block keys"))?;
        for key in &page {
            let Some((_, block, generation)) = parse_block_key(key) else {
                continue;
            };
            match current.as_mut() {
                Some((current_block, generations)) if *current_block == block => {
                    generations.push(generation)
                }
                _ => {
                    if let Some((done_block, generations)) = current.take() {
                        visit(done_block, &generations)?;
                    }
                    current = Some((block, vec![generation]));
                }
            }
        }
        match page.last() {
            Some(last) if page.len() == KEYS_PAGE_MAX => cursor = key_successor(last),
            _ => break,
        }
    }
    if let Some((block, generations)) = current {
        visit(block, &generations)?;
    }
    Ok(())
}

/// The volume's own layer of its current view and of each snapshot (by generation).
fn own_layers(shared: &VolumeShared) -> (Layer, Vec<(u64, Layer)>, u64, Vec<u64>, u64) {
    let state = read(&shared.state);
    let current = state.record.view[0].clone();
    assert_eq!(
        current.volume_id, shared.id,
        "a volume's first layer is its own"
    );
    let snapshots = state
        .snapshots
        .values()
        .map(|snapshot| {
            assert_eq!(
                snapshot.view[0].volume_id, shared.id,
                "a snapshot's first layer is its volume's"
            );
            (snapshot.generation, snapshot.view[0].clone())
        })
        .collect();
    // The receive's generation is reserved in the same record change that raises
    // generation_next, so both are captured together.
    // So are the generations of snapshot repairs under way.
    let pending: Vec<u64> = state
        .record
        .receiving_generation
        .into_iter()
        .chain(
            state
                .snapshots
                .values()
                .flat_map(|snapshot| snapshot.repairs.iter().map(|repair| repair.generation)),
        )
        .collect();
    let size_blocks = state.record.size_bytes / BLOCK_SIZE_BYTES;
    (
        current,
        snapshots,
        state.record.generation_next,
        pending,
        size_blocks,
    )
}

/// Deletes the volume's extents no view shows. See the module comment for why it is safe.
pub(crate) fn collect_garbage(
    store: &Store,
    shared: &Arc<VolumeShared>,
    progress: &mut dyn FnMut(Progress),
) -> VolumeResult<GcReport> {
    let _one_at_a_time = lock(&shared.collecting);
    let (current, snapshots, generation_limit, pending, size_blocks) = own_layers(shared);
    let mut layers: Vec<Layer> = vec![current];
    layers.extend(snapshots.into_iter().map(|(_, layer)| layer));
    let mut report = GcReport::default();
    let mut deletes: Vec<WriteOp> = Vec::new();
    let mut visit = |block: u64, generations: &[u64]| -> VolumeResult<()> {
        report.extents_scanned += generations.len() as u64;
        let shown: Vec<u64> = layers
            .iter()
            .filter_map(|layer| layer.visible(block, generations))
            .collect();
        for &generation in generations {
            if generation >= generation_limit
                || pending.contains(&generation)
                || shown.contains(&generation)
            {
                continue;
            }
            deletes.push(WriteOp::Delete {
                key: block_key(shared.id, block, generation),
            });
            report.extents_deleted += 1;
        }
        if deletes.len() >= DELETE_BATCH_OPS_MAX {
            store
                .write(std::mem::take(&mut deletes), Durability::Buffered)
                .map_err(VolumeError::store(&shared.name, "collecting garbage"))?;
            progress(Progress {
                done: block,
                total: size_blocks.max(block + 1),
            });
        }
        Ok(())
    };
    for_each_block(store, &shared.name, shared.id, &mut visit)?;
    if !deletes.is_empty() {
        store
            .write(deletes, Durability::Buffered)
            .map_err(VolumeError::store(&shared.name, "collecting garbage"))?;
    }
    progress(Progress {
        done: size_blocks,
        total: size_blocks,
    });
    Ok(report)
}

/// Space use of a volume, in blocks.
#[derive(Debug, Default)]
pub struct Usage {
    /// Own extents the current contents show.
    pub current_blocks: u64,
    /// Every own extent stored.
    pub extents: u64,
    pub snapshot_referenced_blocks: BTreeMap<u64, u64>,
    pub snapshot_unique_blocks: BTreeMap<u64, u64>,
}

pub(crate) fn usage(store: &Store, shared: &Arc<VolumeShared>) -> VolumeResult<Usage> {
    let (current, snapshots, _, _, _) = own_layers(shared);
    let mut usage = Usage::default();
    let mut visit = |block: u64, generations: &[u64]| -> VolumeResult<()> {
        usage.extents += generations.len() as u64;
        let current_shown = current.visible(block, generations);
        if current_shown.is_some() {
            usage.current_blocks += 1;
        }
        let shown: Vec<(u64, Option<u64>)> = snapshots
            .iter()
            .map(|(snapshot_generation, layer)| {
                (*snapshot_generation, layer.visible(block, generations))
            })
            .collect();
        for (index, (snapshot_generation, extent)) in shown.iter().enumerate() {
            let Some(extent) = extent else { continue };
            *usage
                .snapshot_referenced_blocks
                .entry(*snapshot_generation)
                .or_insert(0) += 1;
            let shared_elsewhere = current_shown == Some(*extent)
                || shown.iter().enumerate().any(|(other, (_, other_extent))| {
                    other != index && *other_extent == Some(*extent)
                });
            if !shared_elsewhere {
                *usage
                    .snapshot_unique_blocks
                    .entry(*snapshot_generation)
                    .or_insert(0) += 1;
            }
        }
        Ok(())
    };
    for_each_block(store, &shared.name, shared.id, &mut visit)?;
    Ok(usage)
}

/// Deletes every extent of volume `volume_id` (named `volume` in errors), in batches, reporting
/// the block position reached out of `size_blocks`.
pub(crate) fn delete_all_blocks(
    store: &Store,
    volume_id: u64,
    volume: &str,
    size_blocks: u64,
    progress: &mut dyn FnMut(Progress),
) -> VolumeResult<()> {
    delete_all_blocks_while(store, volume_id, volume, size_blocks, progress, || Some(()))
}

/// Deletes `keys` in one buffered write (the log keeps it in order with every later write).
fn delete_keys(
    store: &Store,
    keys: Vec<Vec<u8>>,
    volume: &str,
    operation: &'static str,
) -> VolumeResult<()> {
    let deletes = keys
        .into_iter()
        .map(|key| WriteOp::Delete { key })
        .collect();
    store
        .write(deletes, Durability::Buffered)
        .map(|_| ())
        .map_err(VolumeError::store(volume, operation))
}

/// [`delete_all_blocks`], each batch under the guard `hold` returns; stops (without error)
/// once it returns `None`.
pub(crate) fn delete_all_blocks_while<G>(
    store: &Store,
    volume_id: u64,
    volume: &str,
    size_blocks: u64,
    progress: &mut dyn FnMut(Progress),
    hold: impl Fn() -> Option<G>,
) -> VolumeResult<()> {
    {
        let Some(_held) = hold() else {
            return Ok(());
        };
        // The records about the copy go first: the log keeps them in order with the deletes
        // of its blocks, so no crash leaves a record describing blocks that are gone.
        let (start, end) = copy_records(volume_id);
        let records = store
            .keys(&start, &end, DELETE_BATCH_OPS_MAX)
            .map_err(VolumeError::store(volume, "listing the copy's records"))?;
        if !records.is_empty() {
            delete_keys(store, records, volume, "deleting the copy's records")?;
        }
    }
    let end = volume_blocks_end(volume_id);
    let start = block_key(volume_id, 0, 0);
    loop {
        let Some(_held) = hold() else {
            return Ok(());
        };
        // Always restart from the beginning: the previous page is deleted, so this pages on.
        let page = store
            .keys(&start, &end, DELETE_BATCH_OPS_MAX)
            .map_err(VolumeError::store(volume, "listing blocks to delete"))?;
        let Some(last) = page.last() else { break };
        let position = parse_block_key(last)
            .map(|(_, block, _)| block)
            .unwrap_or(0);
        let full = page.len() == DELETE_BATCH_OPS_MAX;
        delete_keys(store, page, volume, "deleting blocks")?;
        progress(Progress {
            done: position.min(size_blocks),
            total: size_blocks,
        });
        if !full {
            break;
        }
    }
    progress(Progress {
        done: size_blocks,
        total: size_blocks,
    });
    Ok(())
}
