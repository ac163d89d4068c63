//! The replica side: applies a primary's stream to the local volume, in order, after checking
//! the sender is the volume's primary in this node's view of the catalog (epoch fencing).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::OwnedMutexGuard;

use keel_catalog::NodeId;
use keel_volume::VolumeIo;

use crate::wire::{
    block_hash, Batch, BatchAck, ChangedAnswer, ChangedRequest, CopyAnswer, HashAnswer,
    HashRequest, Op, SnapshotRange, SnapshotRepairWrite, UnwrittenAnswer, BLOCK_HASH_BYTES,
    CODE_BEHIND, CODE_FAILED, CODE_FENCED, CODE_NO_SPACE, CODE_OUT_OF_ORDER, UNREADABLE_BLOCK_HASH,
};
use crate::{lock, Point, Shared};

/// Why a replica refused a call: an error code of [`crate::wire`] and a message.
#[derive(Debug)]
pub struct Refusal {
    pub code: u16,
    pub message: String,
}

fn refusal(code: u16, message: String) -> Refusal {
    Refusal { code, message }
}

/// Where this node is in a primary's stream for one volume.
struct Position {
    stream: u64,
    next_index: u64,
    /// The newest epoch a batch of the stream carried: a primary starts each stream in an
    /// epoch at least that of its streams before, and a node takes a volume over in a newer
    /// one, so a batch of another stream in an older epoch is a late one of a replaced stream.
    epoch: u64,
    /// The stream's FLUSH batches applied here, oldest first, each with the common point it
    /// would make (this node's store sequence once it was applied, and the view then): a
    /// later batch names one both nodes made durable (`Batch::common_index`), and it becomes
    /// this node's common point.
    flushes: VecDeque<(u64, Point)>,
}

/// FLUSH batches a stream remembers before one is named common (bounded memory).
const FLUSHES_KEPT: usize = 1024;

/// One volume as a replica holds it.
#[derive(Default)]
struct Replica {
    position: Option<Position>,
    /// The local volume, opened in the epoch beside it: a later epoch opens it again (the
    /// replica may have been removed from this node and placed back since).
    handle: Option<(u64, Arc<dyn VolumeIo>)>,
    /// When this node last kept its common point with the primary ([`crate::Settings::point_every`]).
    point_kept: Option<Instant>,
}

/// Every volume this node holds a replica of. Each volume's mutex is held while a batch is
/// applied, so hashes, batches and a take-over never interleave. (Async: a take-over holds it
/// while Raft records it; store work under it runs through [`crate::blocking`].)
#[derive(Default)]
pub(crate) struct Replicas {
    volumes: Mutex<HashMap<u64, Arc<Slot>>>,
}

/// One volume's replica state, and the turn of the batches waiting for the ones before them
/// (a primary keeps several in flight; they may arrive, or be scheduled, out of order).
#[derive(Default)]
pub(crate) struct Slot {
    pub(crate) state: Arc<tokio::sync::Mutex<ReplicaSlot>>,
    turn: tokio::sync::Notify,
}

#[derive(Default)]
pub(crate) struct ReplicaSlot {
    replica: Replica,
}

/// How long a replica waits for its catalog to apply an epoch a primary already uses.
const CATALOG_CATCH_UP: Duration = Duration::from_secs(1);

/// How long a batch waits for the batches of its stream before it (in flight at once).
const TURN_WAIT: Duration = Duration::from_secs(2);

impl Replicas {
    pub(crate) fn slot(&self, volume_id: u64) -> Arc<Slot> {
        lock(&self.volumes).entry(volume_id).or_default().clone()
    }

    /// Forgets the stream position (this node becomes the volume's primary: any older stream
    /// is over).
    pub(crate) fn forget(slot: &mut ReplicaSlot) {
        slot.replica.position = None;
    }
}

/// Whether `sender` may write volume `volume_id` in `epoch`, by this node's (`local`) view of
/// the catalog: it must be the primary the catalog names, in an epoch not newer than the
/// catalog's (a newer one means this node has not applied it yet: [`CODE_BEHIND`]). Any other
/// sender is [`CODE_FENCED`]: an older primary, or a node after a take-over it missed.
/// Returns the volume's name.
pub fn admit(
    state: &keel_catalog::CatalogState,
    local: NodeId,
    volume_id: u64,
    epoch: u64,
    sender: NodeId,
) -> Result<String, Refusal> {
    let Some(entry) = state.volumes.get(&volume_id) else {
        return Err(refusal(
            CODE_FAILED,
            format!("volume #{volume_id} is not known here"),
        ));
    };
    let name = &entry.record.name;
    let replication = &entry.record.replication;
    if epoch > replication.epoch {
        return Err(refusal(
            CODE_BEHIND,
            format!("this node has not applied epoch {epoch} of volume {name:?} yet"),
        ));
    }
    if !replication.hosts(local) {
        return Err(refusal(
            CODE_FENCED,
            format!("this node holds no replica of volume {name:?}"),
        ));
    }
    if replication.primary != sender {
        return Err(refusal(
            CODE_FENCED,
            format!(
                "volume {name:?} is in epoch {} with node {} as primary; node {sender} (epoch \
                 {epoch}) may no longer write it",
                replication.epoch, replication.primary
            ),
        ));
    }
    Ok(name.clone())
}

/// [`admit`], waiting a moment for this node's catalog when it is behind the sender's epoch.
async fn check_sender(
    shared: &Shared,
    volume_id: u64,
    epoch: u64,
    sender: NodeId,
) -> Result<String, Refusal> {
    let clock = shared.clock();
    let deadline = clock.now() + CATALOG_CATCH_UP;
    loop {
        let verdict = admit(
            &shared.metadata.catalog().read(),
            shared.local_node,
            volume_id,
            epoch,
            sender,
        );
        match verdict {
            Err(refusal) if refusal.code == CODE_BEHIND && clock.now() < deadline => {
                clock.sleep(Duration::from_millis(5)).await;
            }
            other => return other,
        }
    }
}

/// Refuses a batch queued before a change of the volume's view (snapshot, rollback, resize,
/// received stream) that this node's catalog has applied since ([`Batch::generation`]): only a
/// stream the primary ended before the change can still deliver one (it waits for every
/// stream it keeps to apply what came before), and this node is caught up again on a new one.
fn check_generation(shared: &Shared, batch: &Batch) -> Result<(), Refusal> {
    let catalog = shared.metadata.catalog().read();
    let Some(entry) = catalog.volumes.get(&batch.volume_id) else {
        return Ok(());
    };
    let here = entry.record.generation;
    if here > batch.generation {
        return Err(refusal(
            CODE_OUT_OF_ORDER,
            format!(
                "batch {} of stream {:x} for volume #{} was queued in generation {}, before a \
                 change this node applied (generation {here}): its stream ended for it",
                batch.index, batch.stream, batch.volume_id, batch.generation
            ),
        ));
    }
    Ok(())
}

fn handle(
    shared: &Shared,
    slot: &mut ReplicaSlot,
    name: &str,
    epoch: u64,
) -> Result<Arc<dyn VolumeIo>, Refusal> {
    match &slot.replica.handle {
        Some((opened_in, volume)) if *opened_in == epoch => Ok(volume.clone()),
        _ => {
            let opened = shared
                .local
                .open_replica(name)
                .map_err(|error| refusal(CODE_FAILED, error.to_string()))?;
            slot.replica.handle = Some((epoch, opened.clone()));
            Ok(opened)
        }
    }
}

/// Applies a batch's changes to this node's copy of the volume, in order, and with `flush`
/// makes them durable before returning (what the primary's FLUSH waits for). Returns the
/// bytes written.
pub fn apply_ops(volume: &dyn VolumeIo, ops: &[Op], flush: bool) -> keel_volume::VolumeResult<u64> {
    let mut bytes = 0u64;
    for op in ops {
        match op {
            Op::Write { offset, data } => {
                bytes += data.len() as u64;
                volume.write_shared(*offset, data, false)?;
            }
            Op::Trim { offset, length } => volume.trim(*offset, *length)?,
            Op::Zeroes {
                offset,
                length,
                may_trim,
            } => volume.write_zeroes(*offset, *length, false, *may_trim)?,
        }
    }
    if flush {
        volume.flush()?;
    }
    Ok(bytes)
}

/// Waits until this node's catalog applied Raft index `index` (what the primary had applied
/// when it changed the volume's metadata between two writes).
async fn wait_for_catalog(shared: &Shared, index: u64) -> Result<(), Refusal> {
    let clock = shared.clock();
    let deadline = clock.now() + CATALOG_CATCH_UP;
    while shared.cluster.applied_index() < index {
        if clock.now() >= deadline {
            return Err(refusal(
                CODE_BEHIND,
                format!("this node has not applied metadata index {index} yet"),
            ));
        }
        clock.sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}

/// Applies one batch of a primary's stream (its store I/O through
/// [`crate::blocking_in_place`]). A batch that comes before the one it follows waits its turn
/// (the primary keeps several in flight); one whose predecessor never comes, or that follows
/// nothing this node holds, is refused.
pub(crate) async fn apply(
    shared: &Arc<Shared>,
    sender: NodeId,
    batch: Batch,
) -> Result<BatchAck, Refusal> {
    wait_for_catalog(shared, batch.catalog_index).await?;
    let slot = shared.replicas.slot(batch.volume_id);
    let held = wait_for_turn(shared, &slot, &batch).await?;
    // After the wait: a take-over may have happened while this batch waited.
    let checked = check_sender(shared, batch.volume_id, batch.epoch, sender)
        .await
        .and_then(|name| check_generation(shared, &batch).map(|()| name));
    let applied = match checked {
        Ok(name) => {
            let shared = shared.clone();
            crate::blocking_in_place(move || apply_held(&shared, held, sender, &name, &batch))
                .await
                .unwrap_or_else(|error| Err(refusal(CODE_FAILED, error)))
        }
        Err(refused) => {
            drop(held);
            Err(refused)
        }
    };
    slot.turn.notify_waiters();
    applied
}

/// The blocking part of [`apply`]: the batch applied to the local volume under its slot,
/// which is dropped on return.
fn apply_held(
    shared: &Shared,
    mut state: OwnedMutexGuard<ReplicaSlot>,
    sender: NodeId,
    name: &str,
    batch: &Batch,
) -> Result<BatchAck, Refusal> {
    // A failure below leaves the position unset: the primary must resync this replica.
    let previous = state.replica.position.take();
    let applied = apply_batch(shared, &mut state, name, batch);
    if applied.is_ok() {
        let (mut flushes, epoch) = previous
            .filter(|position| position.stream == batch.stream)
            .map(|position| (position.flushes, position.epoch.max(batch.epoch)))
            .unwrap_or((VecDeque::new(), batch.epoch));
        if batch.flush {
            // Every change of this batch and the ones before is committed, none after it.
            // The view is the one the primary queued the FLUSH under: a rollback waits for
            // this FLUSH to be durable here, or drops this stream first.
            if let Some(excluded) = shared.excluded(batch.volume_id) {
                let store_sequence = shared.local.committed_sequence();
                flushes.push_back((
                    batch.index,
                    Point {
                        store_sequence,
                        excluded,
                    },
                ));
                if flushes.len() > FLUSHES_KEPT {
                    flushes.pop_front();
                }
            }
        }
        let now = shared.clock_now();
        let due = state
            .replica
            .point_kept
            .is_none_or(|kept| now.saturating_duration_since(kept) >= shared.point_every);
        if let (Some(common), true) = (batch.common_index, due) {
            let mut point = None;
            while flushes.front().is_some_and(|(index, _)| *index <= common) {
                point = flushes.pop_front().map(|(_, point)| point);
            }
            // Named common perhaps long after it was durable here (a late batch of a stream
            // a rollback dropped): kept with the view of its FLUSH, not today's.
            if let Some(point) = point {
                state.replica.point_kept = Some(now);
                for peer in std::iter::once(sender).chain(batch.common_with.iter().copied()) {
                    if peer != shared.local_node {
                        shared.keep_point(name, batch.volume_id, peer, &point);
                    }
                }
            }
        }
        state.replica.position = Some(Position {
            stream: batch.stream,
            next_index: batch.index + 1,
            epoch,
            flushes,
        });
    }
    applied
}

fn apply_batch(
    shared: &Shared,
    state: &mut ReplicaSlot,
    name: &str,
    batch: &Batch,
) -> Result<BatchAck, Refusal> {
    let volume = handle(shared, state, name, batch.epoch)?;
    let bytes = apply_ops(volume.as_ref(), &batch.ops, batch.flush).map_err(|error| {
        let code = if error.is_no_space() {
            CODE_NO_SPACE
        } else {
            CODE_FAILED
        };
        refusal(code, error.to_string())
    })?;
    shared.counters.received(bytes);
    Ok(BatchAck {
        durable: batch.flush,
        client_requests: shared.activity.requests_started(),
    })
}

/// Waits until `batch` continues what this node holds: the first of a stream, or the next of
/// the stream it holds. A batch further on in that stream, or of another stream (its first
/// batch may still be on its way), waits for the ones before it, at most [`TURN_WAIT`]; any
/// other (an earlier index: a repeat) is refused, as is one still waiting then. Returns the
/// volume's slot, held.
async fn wait_for_turn(
    shared: &Shared,
    slot: &Slot,
    batch: &Batch,
) -> Result<OwnedMutexGuard<ReplicaSlot>, Refusal> {
    let clock = shared.clock();
    let deadline = clock.now() + TURN_WAIT;
    loop {
        let turn = slot.turn.notified();
        tokio::pin!(turn);
        turn.as_mut().enable();
        let mut state = slot.state.clone().lock_owned().await;
        let waits = match &state.replica.position {
            // A late batch of a stream older than this node's (a replaced primary's, or one
            // its node sent before it restarted): never applied over what the newer stream
            // wrote, and the newer stream goes on.
            Some(position) if position.stream != batch.stream && batch.epoch < position.epoch => {
                let held = (position.stream, position.epoch);
                drop(state);
                return Err(refusal(
                    CODE_OUT_OF_ORDER,
                    format!(
                        "batch {} of stream {:x} (epoch {}) for volume #{} is older than stream \
                         {:x} (epoch {}) this node applies",
                        batch.index, batch.stream, batch.epoch, batch.volume_id, held.0, held.1
                    ),
                ));
            }
            Some(position) if position.stream == batch.stream => {
                if position.next_index == batch.index {
                    return Ok(state);
                }
                position.next_index < batch.index
            }
            _ if batch.index == 0 => return Ok(state),
            _ => true,
        };
        let now = clock.now();
        if !waits || now >= deadline {
            state.replica.position = None;
            drop(state);
            slot.turn.notify_waiters();
            return Err(refusal(
                CODE_OUT_OF_ORDER,
                format!(
                    "batch {} of stream {:x} for volume #{} does not continue what this node \
                     holds (it restarted or missed a batch); it needs a resync",
                    batch.index, batch.stream, batch.volume_id
                ),
            ));
        }
        drop(state);
        tokio::select! {
            _ = turn => {}
            _ = clock.sleep(deadline - now) => {}
        }
    }
}

/// The volume a range request is about (`name`, its sender checked), once the range is whole
/// blocks of at most `max` bytes (`unit` names that limit in the refusal). Called holding the
/// volume's slot, which the caller keeps while it reads.
fn range_volume(
    shared: &Shared,
    slot: &mut ReplicaSlot,
    name: &str,
    request: &HashRequest,
    (max, unit): (u64, &str),
) -> Result<Arc<dyn VolumeIo>, Refusal> {
    let volume = handle(shared, slot, name, request.epoch)?;
    let block = u64::from(volume.block_size_bytes());
    if !request.offset.is_multiple_of(block)
        || !request.length.is_multiple_of(block)
        || request.length > max
    {
        return Err(refusal(
            crate::wire::CODE_BAD_REQUEST,
            format!(
                "range {}+{} is not whole blocks of at most a {unit}",
                request.offset, request.length
            ),
        ));
    }
    Ok(volume)
}

/// What this node's copy changed since its common point with the primary asking (a catch-up
/// after a crash or a take-over compares only that, and what the primary changed since its
/// own point).
pub(crate) async fn changed(
    shared: &Arc<Shared>,
    sender: NodeId,
    request: ChangedRequest,
) -> Result<ChangedAnswer, Refusal> {
    wait_for_catalog(shared, request.catalog_index).await?;
    let name = check_sender(shared, request.volume_id, request.epoch, sender).await?;
    let shared = shared.clone();
    // (About what this node holds durably, as a range's answers are: [`with_range`].)
    let listed = crate::blocking(move || {
        shared.local.open_local(&name)?.flush()?;
        shared.changed_since_point(&name, request.volume_id, sender)
    })
    .await
    .map_err(|error| refusal(CODE_FAILED, error))?;
    let chunks = listed
        .map_err(|error| refusal(CODE_FAILED, error.to_string()))?
        .map(|chunks| postcard::to_allocvec(&chunks))
        .transpose()
        .map_err(|error| refusal(CODE_FAILED, error.to_string()))?;
    Ok(ChangedAnswer { chunks })
}

/// A probe: at most this many bytes.
const PROBE: (u64, &str) = (crate::RESYNC_PROBE_BYTES, "probe");
/// A chunk: at most this many bytes.
const CHUNK: (u64, &str) = (crate::RESYNC_CHUNK_BYTES, "chunk");

/// Whether a range (at most a probe) was never written here.
pub(crate) async fn unwritten(
    shared: &Arc<Shared>,
    sender: NodeId,
    request: HashRequest,
) -> Result<UnwrittenAnswer, Refusal> {
    with_range(shared, sender, request, PROBE, move |volume, request| {
        let unwritten = volume
            .range_unwritten(request.offset, request.length)
            .map_err(|error| refusal(CODE_FAILED, error.to_string()))?;
        Ok(UnwrittenAnswer { unwritten })
    })
    .await
}

/// This node's copy of a range (at most a chunk), for a primary whose own copy of it failed its
/// checksum. The primary asks only once every write it ordered before has been applied here.
pub(crate) async fn read_copy(
    shared: &Arc<Shared>,
    sender: NodeId,
    request: HashRequest,
) -> Result<CopyAnswer, Refusal> {
    with_range(shared, sender, request, CHUNK, |volume, request| {
        let mut data = vec![0u8; request.length as usize];
        volume
            .read(request.offset, &mut data)
            .map_err(|error| refusal(CODE_FAILED, error.to_string()))?;
        Ok(CopyAnswer { data })
    })
    .await
}

/// Runs `work` on the local volume for a request about a range of it (at most `limit`),
/// holding the volume's replica slot (no batch is applied meanwhile), through
/// [`crate::blocking`].
async fn with_range<T: Send + 'static>(
    shared: &Arc<Shared>,
    sender: NodeId,
    request: HashRequest,
    limit: (u64, &'static str),
    work: impl FnOnce(&dyn VolumeIo, &HashRequest) -> Result<T, Refusal> + Send + 'static,
) -> Result<T, Refusal> {
    wait_for_catalog(shared, request.catalog_index).await?;
    let slot = shared.replicas.slot(request.volume_id);
    let mut held = slot.state.clone().lock_owned().await;
    let name = check_sender(shared, request.volume_id, request.epoch, sender).await?;
    let shared = shared.clone();
    crate::blocking(move || {
        let volume = range_volume(&shared, &mut held, &name, &request, limit)?;
        // Answered about what this node holds durably: a catch-up trusts the answer until it
        // ends, and a power cut here would take back writes applied but not flushed yet, which
        // the catch-up, having compared them equal, would never ship again.
        volume
            .flush()
            .map_err(|error| refusal(CODE_FAILED, error.to_string()))?;
        work(volume.as_ref(), &request)
    })
    .await
    .unwrap_or_else(|error| Err(refusal(CODE_FAILED, error)))
}

/// Hashes of this node's blocks of a range (at most a chunk); none when the range was never
/// written here.
pub(crate) async fn hashes(
    shared: &Arc<Shared>,
    sender: NodeId,
    request: HashRequest,
) -> Result<HashAnswer, Refusal> {
    with_range(shared, sender, request, CHUNK, |volume, request| {
        let hashes = hash_range(volume, request.offset, request.length)
            .map_err(|error| refusal(CODE_FAILED, error.to_string()))?;
        Ok(HashAnswer { hashes })
    })
    .await
}

/// Hashes of the blocks of a range of `volume` (a copy of the volume, or of a snapshot);
/// none when the range was never written here.
pub(crate) fn hash_range(
    volume: &dyn VolumeIo,
    offset: u64,
    length: u64,
) -> keel_volume::VolumeResult<Vec<u8>> {
    let block = u64::from(volume.block_size_bytes());
    if volume.range_unwritten(offset, length)? {
        return Ok(Vec::new());
    }
    let mut data = vec![0u8; length as usize];
    let mut hashes = Vec::with_capacity(data.len() / block as usize * BLOCK_HASH_BYTES);
    match volume.read(offset, &mut data) {
        Ok(()) => {
            for chunk in data.chunks(block as usize) {
                hashes.extend_from_slice(&block_hash(chunk));
            }
        }
        // A damaged copy here: block by block, a block that fails its checksum answers a hash
        // no content has, so the good copy is shipped and the write replaces it.
        Err(error) if error.is_corrupt() => {
            for (index, chunk) in data.chunks_mut(block as usize).enumerate() {
                let at = offset + index as u64 * block;
                match volume.read(at, chunk) {
                    Ok(()) => hashes.extend_from_slice(&block_hash(chunk)),
                    Err(error) if error.is_corrupt() => {
                        tracing::warn!(
                            volume = volume.name(),
                            offset = at,
                            %error,
                            "a block of this copy is damaged: a good copy replaces it"
                        );
                        hashes.extend_from_slice(&UNREADABLE_BLOCK_HASH);
                    }
                    Err(error) => return Err(error),
                }
            }
        }
        Err(error) => return Err(error),
    }
    Ok(hashes)
}

/// Checks a range request about a snapshot of the volume's primary: once the catalog here
/// applied what the primary had (the repair's start), for whole blocks of at most a chunk.
async fn check_snapshot_range(
    shared: &Shared,
    sender: NodeId,
    request: &SnapshotRange,
) -> Result<(), Refusal> {
    wait_for_catalog(shared, request.catalog_index).await?;
    check_sender(shared, request.volume_id, request.epoch, sender).await?;
    check_chunk(request.offset, request.length)
}

/// This node's copy of the snapshot a range request is about (blocking).
fn snapshot_copy(shared: &Shared, request: &SnapshotRange) -> Result<Arc<dyn VolumeIo>, Refusal> {
    shared
        .local
        .open_snapshot_copy(
            request.volume_id,
            request.snapshot_generation,
            request.repair,
        )
        .map_err(|error| refusal(CODE_FAILED, error.to_string()))
}

fn check_chunk(offset: u64, length: u64) -> Result<(), Refusal> {
    let block = keel_volume::BLOCK_SIZE_BYTES;
    if !offset.is_multiple_of(block)
        || !length.is_multiple_of(block)
        || length > crate::RESYNC_CHUNK_BYTES
    {
        return Err(refusal(
            crate::wire::CODE_BAD_REQUEST,
            format!("range {offset}+{length} is not whole blocks of at most a chunk"),
        ));
    }
    Ok(())
}

/// Runs blocking `work` for a request, through [`crate::blocking`].
async fn in_blocking<T: Send + 'static>(
    shared: &Arc<Shared>,
    work: impl FnOnce(&Shared) -> Result<T, Refusal> + Send + 'static,
) -> Result<T, Refusal> {
    let shared = shared.clone();
    crate::blocking(move || work(&shared))
        .await
        .unwrap_or_else(|error| Err(refusal(CODE_FAILED, error)))
}

/// Hashes of this node's copy of a range of a snapshot.
pub(crate) async fn snapshot_hashes(
    shared: &Arc<Shared>,
    sender: NodeId,
    request: SnapshotRange,
) -> Result<HashAnswer, Refusal> {
    check_snapshot_range(shared, sender, &request).await?;
    in_blocking(shared, move |shared| {
        let copy = snapshot_copy(shared, &request)?;
        let hashes = hash_range(copy.as_ref(), request.offset, request.length)
            .map_err(|error| refusal(CODE_FAILED, error.to_string()))?;
        Ok(HashAnswer { hashes })
    })
    .await
}

/// This node's copy of a range of a snapshot it holds whole.
pub(crate) async fn snapshot_read(
    shared: &Arc<Shared>,
    sender: NodeId,
    request: SnapshotRange,
) -> Result<CopyAnswer, Refusal> {
    check_snapshot_range(shared, sender, &request).await?;
    in_blocking(shared, move |shared| {
        let copy = snapshot_copy(shared, &request)?;
        let mut data = vec![0u8; request.length as usize];
        copy.read(request.offset, &mut data)
            .map_err(|error| refusal(CODE_FAILED, error.to_string()))?;
        Ok(CopyAnswer { data })
    })
    .await
}

/// Writes blocks of a snapshot into the repair of this node's copy, durably.
pub(crate) async fn snapshot_repair(
    shared: &Arc<Shared>,
    sender: NodeId,
    request: SnapshotRepairWrite,
) -> Result<(), Refusal> {
    wait_for_catalog(shared, request.catalog_index).await?;
    check_sender(shared, request.volume_id, request.epoch, sender).await?;
    let mut bytes = 0u64;
    for run in &request.runs {
        check_chunk(run.offset, run.data.len() as u64)?;
        bytes += run.data.len() as u64;
    }
    // Whole blocks of one chunk at most.
    check_chunk(0, bytes)?;
    in_blocking(shared, move |shared| {
        let runs: Vec<(u64, &[u8])> = request
            .runs
            .iter()
            .map(|run| (run.offset, run.data.as_slice()))
            .collect();
        shared
            .local
            .write_snapshot_repair(
                request.volume_id,
                request.snapshot_generation,
                request.repair,
                &runs,
            )
            .map_err(|error| refusal(CODE_FAILED, error.to_string()))?;
        shared.counters.received(bytes);
        Ok(())
    })
    .await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use keel_catalog::{Command, LocalCatalog, Metadata, NodeAddresses, NodeRole, NodeSpec};

    // Proves the fencing rule: only the catalog's primary writes, an older epoch's primary is
    // fenced after a take-over, a newer epoch waits for the catalog, and a node without a
    // replica refuses.
    #[test]
    fn only_the_catalogs_primary_may_write() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../target/test-data/replication-admit");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store =
            keel_store::Store::open(keel_store::StoreConfig::new(vec![dir.clone()])).unwrap();
        let catalog = LocalCatalog::open(store).unwrap();
        for (name, address) in [("two", "127.0.0.2:1"), ("three", "127.0.0.3:1")] {
            catalog
                .propose(Command::NodeAdd {
                    node: NodeSpec {
                        name: name.to_string(),
                        instance: [7; 16],
                        role: NodeRole::Storage,
                        addresses: NodeAddresses {
                            cluster: address.to_string(),
                            ..NodeAddresses::default()
                        },
                        labels: Default::default(),
                        devices: Vec::new(),
                    },
                    joined_unix_ms: 1,
                })
                .unwrap();
        }
        catalog
            .propose(crate::tests::volume_create("r2", vec![1, 2]))
            .unwrap();
        let id = catalog.catalog().read().volume("r2").unwrap().record.id;
        let code = |local, epoch, sender| {
            admit(&catalog.catalog().read(), local, id, epoch, sender)
                .err()
                .map(|refusal| refusal.code)
        };
        assert_eq!(code(2, 1, 1), None, "the primary writes its replica");
        assert_eq!(
            code(2, 1, 2),
            Some(CODE_FENCED),
            "a replica is not a primary"
        );
        assert_eq!(code(2, 2, 1), Some(CODE_BEHIND), "a newer epoch waits");
        assert_eq!(code(3, 1, 1), Some(CODE_FENCED), "node 3 holds no replica");
        assert_eq!(
            code(3, 2, 1),
            Some(CODE_BEHIND),
            "a replica moved to node 3 in an epoch it has not applied yet"
        );
        // Node 2 takes over (epoch 2): node 1's stream is fenced, even in node 2's epoch.
        catalog
            .propose(Command::VolumeSetReplication {
                volume_id: id,
                epoch: 1,
                primary: 2,
                in_sync: vec![2],
            })
            .unwrap();
        assert_eq!(code(1, 1, 1), Some(CODE_FENCED));
        assert_eq!(code(1, 2, 1), Some(CODE_FENCED));
        assert_eq!(code(1, 2, 2), None);
    }
}
