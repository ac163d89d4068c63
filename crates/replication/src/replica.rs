//! The replica side: applies a primary's stream to the local volume, in order, after checking
//! the sender is the volume's primary in this node's view of the catalog (epoch fencing).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_catalog::NodeId;
use keel_volume::VolumeIo;

use crate::wire::{
    block_hash, Batch, BatchAck, HashAnswer, HashRequest, Op, BLOCK_HASH_BYTES, CODE_BEHIND,
    CODE_FAILED, CODE_FENCED, CODE_OUT_OF_ORDER,
};
use crate::{lock, Shared};

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
}

/// One volume as a replica holds it.
#[derive(Default)]
struct Replica {
    position: Option<Position>,
    handle: Option<Arc<dyn VolumeIo>>,
}

/// Every volume this node holds a replica of. Each volume's mutex is held while a batch is
/// applied, so hashes, batches and a take-over never interleave.
#[derive(Default)]
pub(crate) struct Replicas {
    volumes: Mutex<HashMap<u64, Arc<Mutex<ReplicaSlot>>>>,
}

#[derive(Default)]
pub(crate) struct ReplicaSlot {
    replica: Replica,
}

/// How long a replica waits for its catalog to apply an epoch a primary already uses.
const CATALOG_CATCH_UP: Duration = Duration::from_secs(1);

impl Replicas {
    pub(crate) fn slot(&self, volume_id: u64) -> Arc<Mutex<ReplicaSlot>> {
        lock(&self.volumes).entry(volume_id).or_default().clone()
    }

    /// Forgets the stream position (this node becomes the volume's primary: any older stream
    /// is over).
    pub(crate) fn forget(slot: &mut ReplicaSlot) {
        slot.replica.position = None;
    }
}

/// Checks that `sender` may write the volume in `epoch`: it is the primary this node's catalog
/// names, and the epoch is not newer than the catalog's (then the catalog is behind: wait).
fn check_sender(
    shared: &Shared,
    volume_id: u64,
    epoch: u64,
    sender: NodeId,
) -> Result<String, Refusal> {
    let deadline = shared.clock_now() + CATALOG_CATCH_UP;
    loop {
        let (name, current, primary, hosts) = {
            let state = shared.metadata.catalog().read();
            let Some(entry) = state.volumes.get(&volume_id) else {
                return Err(refusal(
                    CODE_FAILED,
                    format!("volume #{volume_id} is not known here"),
                ));
            };
            let replication = &entry.record.replication;
            (
                entry.record.name.clone(),
                replication.epoch,
                replication.primary,
                replication.hosts(shared.local_node),
            )
        };
        if !hosts {
            return Err(refusal(
                CODE_FENCED,
                format!("this node holds no replica of volume {name:?}"),
            ));
        }
        if epoch > current {
            if shared.clock_now() >= deadline {
                return Err(refusal(
                    CODE_BEHIND,
                    format!("this node has not applied epoch {epoch} of volume {name:?} yet"),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        if primary != sender {
            return Err(refusal(
                CODE_FENCED,
                format!(
                    "volume {name:?} is in epoch {current} with node {primary} as primary; node \
                     {sender} (epoch {epoch}) may no longer write it"
                ),
            ));
        }
        return Ok(name);
    }
}

fn handle<'a>(
    shared: &Shared,
    slot: &'a mut ReplicaSlot,
    name: &str,
) -> Result<&'a Arc<dyn VolumeIo>, Refusal> {
    if slot.replica.handle.is_none() {
        let opened = shared
            .local
            .open_local(name)
            .map_err(|error| refusal(CODE_FAILED, error.to_string()))?;
        slot.replica.handle = Some(opened);
    }
    slot.replica
        .handle
        .as_ref()
        .ok_or_else(|| refusal(CODE_FAILED, "no handle".to_string()))
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
                volume.write(*offset, data, false)?;
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

/// Applies one batch of a primary's stream (blocking: store I/O).
pub(crate) fn apply(shared: &Shared, sender: NodeId, batch: Batch) -> Result<BatchAck, Refusal> {
    let slot = shared.replicas.slot(batch.volume_id);
    let mut slot = lock(&slot);
    let name = check_sender(shared, batch.volume_id, batch.epoch, sender)?;
    let continues = match &slot.replica.position {
        _ if batch.index == 0 => true,
        Some(position) => position.stream == batch.stream && position.next_index == batch.index,
        None => false,
    };
    if !continues {
        slot.replica.position = None;
        return Err(refusal(
            CODE_OUT_OF_ORDER,
            format!(
                "batch {} of stream {:x} for volume {name:?} does not continue what this node \
                 holds (it restarted or missed a batch); it needs a resync",
                batch.index, batch.stream
            ),
        ));
    }
    // A failure below leaves the position unset: the primary must resync this replica.
    slot.replica.position = None;
    let volume = handle(shared, &mut slot, &name)?.clone();
    let bytes = apply_ops(volume.as_ref(), &batch.ops, batch.flush)
        .map_err(|error| refusal(CODE_FAILED, error.to_string()))?;
    shared.counters.received(bytes);
    slot.replica.position = Some(Position {
        stream: batch.stream,
        next_index: batch.index + 1,
    });
    Ok(BatchAck {
        durable: batch.flush,
    })
}

/// Hashes of this node's blocks of a range (blocking: reads the local volume).
pub(crate) fn hashes(
    shared: &Shared,
    sender: NodeId,
    request: HashRequest,
) -> Result<HashAnswer, Refusal> {
    let slot = shared.replicas.slot(request.volume_id);
    let mut slot = lock(&slot);
    let name = check_sender(shared, request.volume_id, request.epoch, sender)?;
    let volume = handle(shared, &mut slot, &name)?.clone();
    let block = u64::from(volume.block_size_bytes());
    if !request.offset.is_multiple_of(block)
        || !request.length.is_multiple_of(block)
        || request.length > crate::RESYNC_CHUNK_BYTES
    {
        return Err(refusal(
            crate::wire::CODE_BAD_REQUEST,
            format!(
                "range {}+{} is not whole blocks of at most a chunk",
                request.offset, request.length
            ),
        ));
    }
    let mut data = vec![0u8; request.length as usize];
    volume
        .read(request.offset, &mut data)
        .map_err(|error| refusal(CODE_FAILED, error.to_string()))?;
    let mut hashes = Vec::with_capacity(data.len() / block as usize * BLOCK_HASH_BYTES);
    for chunk in data.chunks(block as usize) {
        hashes.extend_from_slice(&block_hash(chunk));
    }
    Ok(HashAnswer { hashes })
}
