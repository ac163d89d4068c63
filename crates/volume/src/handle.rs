//! Block I/O on a volume: the operations an NBD export needs, as plain blocking calls.
//!
//! Cost model: an aligned 4 KiB write is one store op and no read; a write of N aligned blocks
//! is one `Store::write` of N ops (one group commit) up to [`WRITE_BATCH_OPS_MAX`]; a read lists
//! the keys of the blocks it covers (one index range per layer, for each step of up to
//! [`READ_BATCH_BLOCKS_MAX`] blocks) and reads the extents its view shows with one `pread` per
//! run of extents that lie back to back in the log (one per write that wrote them, typically).
//! A read within one block, and a partial write's read-modify-write, read the block with one
//! floor lookup (plus one per excluded generation it lands on, or per clone layer for blocks the
//! clone never wrote); the location cache answers it without redb when the view has a single
//! generation to look at.
//!
//! Concurrency: writes hold the volume state's read lock across their store write, so a
//! snapshot (which takes it exclusively) sees every write either entirely before or entirely
//! after it. A write that covers part of a block reads, patches and rewrites it while holding
//! that block's stripe lock exclusively; full-block writes take their stripes shared, so a
//! read-modify-write never loses a concurrent write to the same block.
//!
//! Durability: plain writes are `Durability::Buffered` (ordered and held, like a disk's volatile
//! cache); FUA writes are `Durability::Sync` (which, the log being ordered, also makes every
//! earlier write durable); `flush` syncs the whole store, covering every connection.

use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLockReadGuard, RwLockWriteGuard};

use bytes::Bytes;
use keel_store::{block_key, Durability, Extent, Store, WriteOp};

use keel_catalog::view::{self, Layer, LayerAnswer};

use super::record::{key_successor, parse_block_key};
use super::scan::KEYS_PAGE_MAX;
use super::{
    read, SnapshotUse, VolumeError, VolumeResult, VolumeShared, VolumeState, BLOCK_SIZE_BYTES,
    LOCK_STRIPES,
};

/// Most ops in one `Store::write`: 8192 blocks = 32 MiB, the largest NBD request Keel accepts.
pub(crate) const WRITE_BATCH_OPS_MAX: usize = 8192;
/// Most blocks one step of a read lists and reads (1 MiB): what it holds beyond the caller's
/// buffer.
pub(crate) const READ_BATCH_BLOCKS_MAX: u64 = 256;
/// Most blocks a read finds with point lookups rather than a listing (see [`read_blocks`]).
const POINT_LOOKUPS_MAX: usize = 8;
/// Blocks a trim or write-zeroes examines per step (one key scan per layer per step).
pub(crate) const ZERO_CHUNK_BLOCKS: u64 = 16_384;

const BLOCK_SIZE: usize = BLOCK_SIZE_BYTES as usize;

/// A snapshot's view, for read-only handles.
pub(crate) struct FrozenView {
    pub view: Vec<Layer>,
    pub size_bytes: u64,
    pub _user: SnapshotUse,
}

/// I/O on one volume (or, read-only, on one snapshot). Cheap to share across threads.
pub struct VolumeHandle {
    store: Store,
    shared: Arc<VolumeShared>,
    frozen: Option<FrozenView>,
    /// A replica's handle: this node serves no reads of what it writes, so its writes are the
    /// store's bulk writes (`Store::write_bulk`), kept out of the page cache.
    bulk: bool,
}

/// Stripe guards held for the duration of one request.
struct StripeLocks<'a> {
    _shared: Vec<RwLockReadGuard<'a, ()>>,
    _exclusive: Vec<RwLockWriteGuard<'a, ()>>,
}

/// Reads one block through a view: Some(data) or None for zeroes.
pub(crate) fn read_block(
    store: &Store,
    volume: &str,
    view: &[Layer],
    block: u64,
) -> VolumeResult<Option<Vec<u8>>> {
    for layer in view {
        let hidden = layer.hidden_upto(block);
        let low = block_key(layer.volume_id, block, hidden + 1);
        let mut high_generation = layer.generation_max;
        while high_generation > hidden {
            let found = store
                .floor(&low, &block_key(layer.volume_id, block, high_generation))
                .map_err(VolumeError::store(volume, "reading a block"))?;
            let Some((key, value)) = found else { break };
            let generation = match parse_block_key(&key) {
                Some((volume_id, found_block, generation))
                    if volume_id == layer.volume_id && found_block == block =>
                {
                    generation
                }
                _ => {
                    return Err(VolumeError::CorruptBlock {
                        volume: volume.to_string(),
                        block,
                        detail: "floor lookup returned a key outside the block's range".to_string(),
                    })
                }
            };
            if let Some((excluded_low, _)) = layer.excluded_range(generation) {
                high_generation = excluded_low - 1;
                continue;
            }
            return match value.len() {
                0 => Ok(None),
                BLOCK_SIZE => Ok(Some(value)),
                length => Err(VolumeError::CorruptBlock {
                    volume: volume.to_string(),
                    block,
                    detail: format!(
                        "extent of generation {generation} holds {length} bytes, not {BLOCK_SIZE}"
                    ),
                }),
            };
        }
        if hidden > 0 {
            return Ok(None);
        }
    }
    Ok(None)
}

/// Reads blocks `[first, first + count)` through a view: calls `visit(index, data)` once for
/// each block, `first + index`, in no particular order, with None for zeroes. The same rule as
/// [`read_block`], found with one key range listing per layer (only over the blocks the layers
/// above left unresolved), and the chosen extents read together.
pub(crate) fn read_blocks(
    store: &Store,
    volume: &str,
    view: &[Layer],
    (first, count): (u64, usize),
    visit: &mut dyn FnMut(usize, Option<&[u8]>),
) -> VolumeResult<()> {
    // Per block: the extent its layer shows, once some layer resolved it.
    let mut chosen: Vec<Option<Extent>> = vec![None; count];
    let mut resolved = vec![false; count];
    let mut generations: Vec<u64> = Vec::new();
    // One block's extents in one layer, ascending by generation.
    let mut extents: Vec<(u64, Extent)> = Vec::new();
    for layer in view {
        let Some(low) = resolved.iter().position(|done| !done) else {
            break;
        };
        let high = resolved.iter().rposition(|done| !done).map_or(low, |at| at) + 1;
        // A few blocks of a layer that can show only its newest generation for them (a volume
        // never snapshotted, typically): a point lookup per block, which the location cache
        // usually answers. More blocks are listed: one redb range beats many lookups that miss.
        let single = high - low <= POINT_LOOKUPS_MAX
            && layer.excluded_range(layer.generation_max).is_none()
            && (low..high)
                .all(|index| layer.hidden_upto(first + index as u64) + 1 == layer.generation_max);
        if single {
            for index in low..high {
                if resolved[index] {
                    continue;
                }
                let block = first + index as u64;
                let found = store
                    .extent(block_key(layer.volume_id, block, layer.generation_max))
                    .map_err(VolumeError::store(volume, "looking up a block"))?;
                let generations: &[u64] = match found {
                    Some(_) => &[layer.generation_max],
                    None => &[],
                };
                match layer.answer(block, generations) {
                    LayerAnswer::Shows(_) => chosen[index] = found,
                    LayerAnswer::Hidden => {}
                    LayerAnswer::Below => continue,
                }
                resolved[index] = true;
            }
            continue;
        }
        let listed = list_extents(
            store,
            volume,
            layer.volume_id,
            first + low as u64,
            first + high as u64,
        )?;
        let mut listed = listed.into_iter().peekable();
        for index in low..high {
            let block = first + index as u64;
            extents.clear();
            while let Some((found_block, generation, extent)) =
                listed.next_if(|(found_block, _, _)| *found_block <= block)
            {
                if found_block == block {
                    extents.push((generation, extent));
                }
            }
            if resolved[index] {
                continue;
            }
            generations.clear();
            generations.extend(extents.iter().map(|(generation, _)| *generation));
            match layer.answer(block, &generations) {
                LayerAnswer::Shows(generation) => {
                    chosen[index] = extents
                        .iter()
                        .position(|(found, _)| *found == generation)
                        .map(|at| extents.swap_remove(at).1);
                }
                LayerAnswer::Hidden => {}
                LayerAnswer::Below => continue,
            }
            resolved[index] = true;
        }
    }
    // Which block each extent read belongs to.
    let mut wanted: Vec<&Extent> = Vec::with_capacity(count);
    let mut wanted_blocks: Vec<usize> = Vec::with_capacity(count);
    for (index, extent) in chosen.iter().enumerate() {
        match extent {
            Some(extent) => {
                wanted.push(extent);
                wanted_blocks.push(index);
            }
            None => visit(index, None),
        }
    }
    let mut deleted = Vec::new();
    let mut wrong_size: Option<(usize, usize)> = None;
    store
        .read_extents(&wanted, &mut |at, value| {
            let index = wanted_blocks[at];
            match value.map(<[u8]>::len) {
                None => deleted.push(index),
                Some(0) => visit(index, None),
                Some(BLOCK_SIZE) => visit(index, value),
                Some(length) => {
                    wrong_size.get_or_insert((at, length));
                }
            }
        })
        .map_err(VolumeError::store(volume, "reading blocks"))?;
    if let Some((at, length)) = wrong_size {
        let generation = parse_block_key(wanted[at].key()).map_or(0, |(_, _, found)| found);
        return Err(VolumeError::CorruptBlock {
            volume: volume.to_string(),
            block: first + wanted_blocks[at] as u64,
            detail: format!(
                "extent of generation {generation} holds {length} bytes, not {BLOCK_SIZE}"
            ),
        });
    }
    // Deleted since it was listed (a trim, or a collection of a view no longer shown): what
    // the view shows now.
    for index in deleted {
        let value = read_block(store, volume, view, first + index as u64)?;
        visit(index, value.as_deref());
    }
    Ok(())
}

/// `(block, generation, extent)` of every extent of `volume_id` for blocks `[from, to)`, in key
/// order.
fn list_extents(
    store: &Store,
    volume: &str,
    volume_id: u64,
    from: u64,
    to: u64,
) -> VolumeResult<Vec<(u64, u64, Extent)>> {
    let end = block_key(volume_id, to, 0);
    let mut cursor = block_key(volume_id, from, 0);
    let mut out = Vec::new();
    loop {
        let page = store
            .extents(&cursor, &end, KEYS_PAGE_MAX)
            .map_err(VolumeError::store(volume, "listing block extents"))?;
        let full = page.len() == KEYS_PAGE_MAX;
        if let Some(last) = page.last() {
            cursor = key_successor(last.key());
        }
        for extent in page {
            match parse_block_key(extent.key()) {
                Some((found_volume, block, generation)) if found_volume == volume_id => {
                    out.push((block, generation, extent))
                }
                _ => {
                    return Err(VolumeError::CorruptBlock {
                        volume: volume.to_string(),
                        block: from,
                        detail: "key listing returned a key outside the volume's range".to_string(),
                    })
                }
            }
        }
        if !full {
            return Ok(out);
        }
    }
}

fn is_zero(data: &[u8]) -> bool {
    data.iter().all(|&byte| byte == 0)
}

impl VolumeHandle {
    pub(crate) fn new(
        store: Store,
        shared: Arc<VolumeShared>,
        frozen: Option<FrozenView>,
        bulk: bool,
    ) -> VolumeHandle {
        VolumeHandle {
            store,
            shared,
            frozen,
            bulk,
        }
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    pub fn size_bytes(&self) -> u64 {
        match &self.frozen {
            Some(frozen) => frozen.size_bytes,
            None => read(&self.shared.state).record.size_bytes,
        }
    }

    pub fn block_size_bytes(&self) -> u32 {
        BLOCK_SIZE_BYTES as u32
    }

    /// True for snapshot handles.
    pub fn read_only(&self) -> bool {
        self.frozen.is_some()
    }

    fn throttle(&self, bytes: u64) {
        let limiter = read(&self.shared.limiter).clone();
        if let Some(limiter) = limiter {
            let waited = limiter.acquire(bytes);
            if !waited.is_zero() {
                let nanos = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
                self.shared
                    .throttled_nanos
                    .fetch_add(nanos, Ordering::Relaxed);
            }
        }
    }

    fn state(&self) -> VolumeResult<RwLockReadGuard<'_, VolumeState>> {
        let state = read(&self.shared.state);
        if self.shared.deleted.load(Ordering::SeqCst) {
            return Err(VolumeError::Deleted {
                volume: self.shared.name.clone(),
            });
        }
        Ok(state)
    }

    /// `offset + length`, or an out-of-range error if that overflows (before the size is known).
    fn range_end(&self, offset: u64, length: u64) -> VolumeResult<u64> {
        offset
            .checked_add(length)
            .ok_or_else(|| VolumeError::OutOfRange {
                volume: self.shared.name.clone(),
                offset,
                length,
                size_bytes: 0,
            })
    }

    fn check_range(&self, offset: u64, length: u64, size_bytes: u64) -> VolumeResult<u64> {
        match offset.checked_add(length) {
            Some(end) if end <= size_bytes => Ok(end),
            _ => Err(VolumeError::OutOfRange {
                volume: self.shared.name.clone(),
                offset,
                length,
                size_bytes,
            }),
        }
    }

    fn check_writable(&self) -> VolumeResult<()> {
        if self.frozen.is_some() {
            return Err(VolumeError::ReadOnly {
                volume: self.shared.name.clone(),
                reason: "this handle exports a snapshot".to_string(),
            });
        }
        Ok(())
    }

    /// Locks the stripes of blocks `first..=last`; `exclusive` blocks (partially written ones)
    /// exclusively. Stripes are taken in index order, so requests cannot deadlock.
    fn lock_stripes(&self, first: u64, last: u64, exclusive: &[u64]) -> StripeLocks<'_> {
        let stripe_of = |block: u64| (block % LOCK_STRIPES as u64) as usize;
        let mut order: Vec<(usize, bool)> = if last - first + 1 >= LOCK_STRIPES as u64 {
            (0..LOCK_STRIPES).map(|stripe| (stripe, false)).collect()
        } else {
            (first..=last)
                .map(|block| (stripe_of(block), false))
                .collect()
        };
        for &block in exclusive {
            order.push((stripe_of(block), true));
        }
        // Exclusive sorts after shared for the same stripe; keep the last (strongest) mode.
        order.sort_unstable();
        let mut locks = StripeLocks {
            _shared: Vec::new(),
            _exclusive: Vec::new(),
        };
        let mut index = 0;
        while index < order.len() {
            let (stripe, mut is_exclusive) = order[index];
            while index + 1 < order.len() && order[index + 1].0 == stripe {
                index += 1;
                is_exclusive |= order[index].1;
            }
            let lock = &self.shared.stripes[stripe];
            if is_exclusive {
                locks._exclusive.push(super::write(lock));
            } else {
                locks._shared.push(read(lock));
            }
            index += 1;
        }
        locks
    }

    /// Whether no extent was ever stored for a block of `[offset, offset + length)`, in this
    /// volume or a volume its view reads through: the range then reads as zeroes. One key scan
    /// per layer says so, where reading would look every block up (resync comparisons of
    /// sparse volumes). A block written then trimmed keeps an (empty) extent: not unwritten.
    pub fn range_unwritten(&self, offset: u64, length: u64) -> VolumeResult<bool> {
        let state = self.state()?;
        let view = match &self.frozen {
            Some(frozen) => &frozen.view,
            None => &state.record.view,
        };
        let first = offset / BLOCK_SIZE_BYTES;
        let end = self.range_end(offset, length)?.div_ceil(BLOCK_SIZE_BYTES);
        for layer in view {
            let keys = self
                .store
                .keys(
                    &block_key(layer.volume_id, first, 0),
                    &block_key(layer.volume_id, end, 0),
                    1,
                )
                .map_err(VolumeError::store(&self.shared.name, "listing block keys"))?;
            if !keys.is_empty() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Reads `buf.len()` bytes at `offset`; never-written blocks read as zeroes.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> VolumeResult<()> {
        if buf.is_empty() {
            return Ok(());
        }
        self.throttle(buf.len() as u64);
        let state = self.state()?;
        let (view, size_bytes) = match &self.frozen {
            Some(frozen) => (&frozen.view, frozen.size_bytes),
            None => (&state.record.view, state.record.size_bytes),
        };
        let end = self.check_range(offset, buf.len() as u64, size_bytes)?;
        let last = (end - 1) / BLOCK_SIZE_BYTES;
        let mut first = offset / BLOCK_SIZE_BYTES;
        if first == last {
            // One block: a point lookup the location cache usually answers beats a listing.
            let within = (offset - first * BLOCK_SIZE_BYTES) as usize;
            match read_block(&self.store, &self.shared.name, view, first)? {
                Some(data) => buf.copy_from_slice(&data[within..within + buf.len()]),
                None => buf.fill(0),
            }
            return Ok(());
        }
        while first <= last {
            let count = (last - first + 1).min(READ_BATCH_BLOCKS_MAX);
            let step = (first, count as usize);
            read_blocks(
                &self.store,
                &self.shared.name,
                view,
                step,
                &mut |index, data| {
                    // The part of block `first + index` inside the read.
                    let block_start = (first + index as u64) * BLOCK_SIZE_BYTES;
                    let from = block_start.max(offset);
                    let to = (block_start + BLOCK_SIZE_BYTES).min(end);
                    let target = &mut buf[(from - offset) as usize..(to - offset) as usize];
                    match data {
                        Some(data) => target.copy_from_slice(
                            &data[(from - block_start) as usize..(to - block_start) as usize],
                        ),
                        None => target.fill(0),
                    }
                },
            )?;
            first += count;
        }
        Ok(())
    }

    /// Writes `data` at `offset` (copied once: the store holds its whole blocks as slices of
    /// the copy). With `fua`, returns only once this write and every write acknowledged before
    /// it are durable.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> VolumeResult<()> {
        self.write_shared(offset, &Bytes::copy_from_slice(data), fua)
    }

    /// [`VolumeHandle::write`] of bytes the caller shares (a replica's batch): whole blocks are
    /// stored as slices of them, without a copy.
    pub fn write_shared(&self, offset: u64, data: &Bytes, fua: bool) -> VolumeResult<()> {
        self.check_writable()?;
        if data.is_empty() {
            return if fua { self.flush() } else { Ok(()) };
        }
        self.throttle(data.len() as u64);
        let length = data.len() as u64;
        let end = self.range_end(offset, length)?;
        let first = offset / BLOCK_SIZE_BYTES;
        let last = (end - 1) / BLOCK_SIZE_BYTES;
        let partial: Vec<u64> = [first, last]
            .into_iter()
            .filter(|&block| {
                let block_start = block * BLOCK_SIZE_BYTES;
                offset > block_start || end < block_start + BLOCK_SIZE_BYTES
            })
            .collect();
        let _stripes = self.lock_stripes(first, last, &partial);
        let state = self.state()?;
        self.check_range(offset, length, state.record.size_bytes)?;
        let generation = state.record.generation;
        let compression = state.compression;
        let mut ops = Vec::with_capacity(((last - first + 1) as usize).min(WRITE_BATCH_OPS_MAX));
        for block in first..=last {
            let block_start = block * BLOCK_SIZE_BYTES;
            let value = if partial.contains(&block) {
                let mut merged =
                    read_block(&self.store, &self.shared.name, &state.record.view, block)?
                        .unwrap_or_else(|| vec![0u8; BLOCK_SIZE]);
                let from = offset.max(block_start);
                let to = end.min(block_start + BLOCK_SIZE_BYTES);
                merged[(from - block_start) as usize..(to - block_start) as usize]
                    .copy_from_slice(&data[(from - offset) as usize..(to - offset) as usize]);
                Bytes::from(merged)
            } else {
                let at = (block_start - offset) as usize;
                data.slice(at..at + BLOCK_SIZE)
            };
            // All-zero blocks are stored as hole markers: thin, and compression-free.
            let value = if is_zero(&value) { Bytes::new() } else { value };
            ops.push(WriteOp::put(
                block_key(self.shared.id, block, generation),
                value,
                compression,
            ));
            if ops.len() == WRITE_BATCH_OPS_MAX && block != last {
                self.submit(std::mem::take(&mut ops), Durability::Buffered)?;
            }
        }
        self.submit(
            ops,
            if fua {
                Durability::Sync
            } else {
                Durability::Buffered
            },
        )
    }

    fn submit(&self, ops: Vec<WriteOp>, durability: Durability) -> VolumeResult<()> {
        if ops.is_empty() {
            return if durability == Durability::Sync {
                self.flush()
            } else {
                Ok(())
            };
        }
        let written = if self.bulk {
            self.store.write_bulk(ops, durability)
        } else {
            self.store.write(ops, durability)
        };
        written
            .map(|_| ())
            .map_err(VolumeError::store(&self.shared.name, "writing blocks"))
    }

    /// Returns once every write acknowledged before this call (on any handle of any volume of
    /// this store) is durable.
    pub fn flush(&self) -> VolumeResult<()> {
        self.store
            .flush()
            .map_err(VolumeError::store(&self.shared.name, "flushing"))
    }

    /// Discards `length` bytes at `offset`: whole blocks in the range read as zeroes afterwards
    /// and stop using space; partial blocks at the edges are left as they are (TRIM is a hint).
    pub fn trim(&self, offset: u64, length: u64) -> VolumeResult<()> {
        self.check_writable()?;
        if length == 0 {
            return Ok(());
        }
        self.throttle(0);
        let end = self.range_end(offset, length)?;
        let first_full = offset.div_ceil(BLOCK_SIZE_BYTES);
        let end_full = end / BLOCK_SIZE_BYTES;
        let state = self.state()?;
        self.check_range(offset, length, state.record.size_bytes)?;
        drop(state);
        if first_full < end_full {
            self.zero_blocks(first_full, end_full, false)?;
        }
        Ok(())
    }

    /// Writes zeroes over `length` bytes at `offset`. Whole blocks become hole markers (or
    /// disappear) whatever `may_trim` says: a hole reads as zeroes and a log-structured store
    /// has nothing to preallocate. With `fua`, durable before returning.
    pub fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    ) -> VolumeResult<()> {
        // `may_trim == false` (NO_HOLE) cannot reserve space in a log-structured store: every
        // later write allocates anyway. Holes and zero-filled blocks read the same.
        let _ = may_trim;
        self.check_writable()?;
        if length == 0 {
            return if fua { self.flush() } else { Ok(()) };
        }
        let end = self.range_end(offset, length)?;
        {
            let state = self.state()?;
            self.check_range(offset, length, state.record.size_bytes)?;
        }
        let first_full = offset.div_ceil(BLOCK_SIZE_BYTES);
        let end_full = end / BLOCK_SIZE_BYTES;
        if first_full >= end_full {
            // Inside one or two blocks without covering any whole one: a plain write.
            let zeroes = vec![0u8; length as usize];
            return self.write(offset, &zeroes, fua);
        }
        if offset < first_full * BLOCK_SIZE_BYTES {
            let head = first_full * BLOCK_SIZE_BYTES - offset;
            self.write(offset, &vec![0u8; head as usize], false)?;
        }
        if end > end_full * BLOCK_SIZE_BYTES {
            let tail = end - end_full * BLOCK_SIZE_BYTES;
            self.write(
                end_full * BLOCK_SIZE_BYTES,
                &vec![0u8; tail as usize],
                false,
            )?;
        }
        self.throttle(0);
        self.zero_blocks(first_full, end_full, fua)
    }

    /// Makes blocks `[first, end)` read as zeroes. Cost follows the extents that exist in the
    /// range, not its length: blocks nothing was ever written to are skipped, blocks written
    /// only in the current generation are deleted outright, others get a hole marker. A
    /// replicated volume's blocks always get a hole marker: a deletion leaves no key with a
    /// sequence number, and replication finds what changed after a crash by those
    /// ([`crate::changed_blocks_since`]).
    fn zero_blocks(&self, first: u64, end: u64, fua: bool) -> VolumeResult<()> {
        let _stripes = self.lock_stripes(first, end - 1, &[]);
        let state = self.state()?;
        let view = &state.record.view;
        let generation = state.record.generation;
        let compression = state.compression;
        let replicated =
            state.record.replication.factor > 1 || state.record.replication.replicas.len() > 1;
        let mut view_before_current = view.clone();
        view_before_current[0].generation_max = generation - 1;
        let mut chunk_start = first;
        let mut ops = Vec::new();
        while chunk_start < end {
            let chunk_end = end.min(chunk_start + ZERO_CHUNK_BLOCKS);
            let stored = super::scan::RangeGenerations::collect(
                &self.store,
                &self.shared.name,
                view.iter().map(|layer| layer.volume_id),
                chunk_start,
                chunk_end,
            )?;
            for &block in stored.blocks() {
                let generations_of = |volume_id: u64| stored.of(volume_id, block);
                let Some(shown) = view::resolve(view, block, generations_of) else {
                    continue;
                };
                let key = block_key(self.shared.id, block, generation);
                // Shown from the current generation and nothing older under it? Then deleting
                // the extent leaves zeroes and frees its space; otherwise a hole marker hides
                // what lies below.
                let op = if !replicated
                    && shown == (self.shared.id, generation)
                    && view::resolve(&view_before_current, block, generations_of).is_none()
                {
                    WriteOp::Delete { key }
                } else {
                    WriteOp::put(key, Vec::new(), compression)
                };
                ops.push(op);
                if ops.len() == WRITE_BATCH_OPS_MAX {
                    self.submit(std::mem::take(&mut ops), Durability::Buffered)?;
                }
            }
            chunk_start = chunk_end;
        }
        self.submit(
            ops,
            if fua {
                Durability::Sync
            } else {
                Durability::Buffered
            },
        )
    }
}
