//! Volume metadata records as stored under `meta_key(b"v/...")`, and the block key helpers.
//!
//! Records (postcard, each starting with a format byte so they can evolve):
//! - `v/next-volume-id` → u64: the next volume id to hand out (ids are never reused, so a
//!   deleted volume's leftover extents can never show through a new volume);
//! - `v/vol/<id, 16 hex>` → [`VolumeRecord`];
//! - `v/snap/<volume id, 16 hex>/<generation, 16 hex>` → [`SnapshotRecord`].
//!
//! Every change to these records is one `Store::write` with `Durability::Sync`, so a metadata
//! change is atomic and, the log being ordered, also makes every block write before it durable.

use serde::{Deserialize, Serialize};

use super::view::Layer;
use super::VolumeError;

/// Version of the record encoding; bumped on incompatible change.
pub(crate) const RECORD_FORMAT: u8 = 1;

pub(crate) const NEXT_VOLUME_ID_SUFFIX: &[u8] = b"v/next-volume-id";
pub(crate) const VOLUME_PREFIX: &[u8] = b"v/vol/";
pub(crate) const SNAPSHOT_PREFIX: &[u8] = b"v/snap/";
/// Every volume record lives under this prefix (used to scan them all at open).
pub(crate) const ALL_PREFIX: &[u8] = b"v/";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum VolumeStatus {
    Ready,
    /// Being filled by a full receive; invisible, deleted at open if the receive never finished.
    Receiving,
    /// Being deleted; the deletion is finished at open if it was interrupted.
    Deleting,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Origin {
    pub volume_id: u64,
    pub snapshot_generation: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct VolumeRecord {
    pub format: u8,
    pub id: u64,
    pub uuid: [u8; 16],
    pub name: String,
    pub size_bytes: u64,
    /// `keel_store::Compression::name()`.
    pub compression: String,
    pub iops_max: Option<u64>,
    pub bandwidth_max_mib_per_second: Option<u64>,
    /// Generation new writes go to. Always `view[0].generation_max`.
    pub generation: u64,
    /// Next generation to hand out; every generation is handed out once.
    pub generation_next: u64,
    pub view: Vec<Layer>,
    pub origin: Option<Origin>,
    pub status: VolumeStatus,
    pub created_unix_seconds: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SnapshotRecord {
    pub format: u8,
    pub volume_id: u64,
    pub name: String,
    /// Identity that survives send/receive: an incremental stream names its base by this.
    pub guid: [u8; 16],
    pub generation: u64,
    pub size_bytes: u64,
    pub view: Vec<Layer>,
    pub created_unix_seconds: u64,
}

pub(crate) fn volume_key(volume_id: u64) -> Vec<u8> {
    let mut suffix = VOLUME_PREFIX.to_vec();
    suffix.extend_from_slice(format!("{volume_id:016x}").as_bytes());
    keel_store::meta_key(&suffix)
}

pub(crate) fn snapshot_key(volume_id: u64, generation: u64) -> Vec<u8> {
    let mut suffix = SNAPSHOT_PREFIX.to_vec();
    suffix.extend_from_slice(format!("{volume_id:016x}/{generation:016x}").as_bytes());
    keel_store::meta_key(&suffix)
}

pub(crate) fn encode<T: Serialize>(record: &T) -> Result<Vec<u8>, VolumeError> {
    postcard::to_allocvec(record).map_err(|error| VolumeError::Metadata {
        detail: format!("encoding: {error}"),
    })
}

pub(crate) fn decode<'a, T: Deserialize<'a>>(
    key: &[u8],
    bytes: &'a [u8],
) -> Result<T, VolumeError> {
    postcard::from_bytes(bytes).map_err(|error| VolumeError::Metadata {
        detail: format!(
            "decoding record {}: {error}",
            String::from_utf8_lossy(key.get(1..).unwrap_or_default())
        ),
    })
}

/// Length of `keel_store::block_key`: keyspace byte, volume id, block, generation.
pub(crate) const BLOCK_KEY_BYTES: usize = 25;

/// (volume id, block, generation) of a block key.
pub(crate) fn parse_block_key(key: &[u8]) -> Option<(u64, u64, u64)> {
    if key.len() != BLOCK_KEY_BYTES {
        return None;
    }
    let field = |at: usize| -> Option<u64> {
        Some(u64::from_be_bytes(key.get(at..at + 8)?.try_into().ok()?))
    };
    Some((field(1)?, field(9)?, field(17)?))
}

/// The smallest key greater than `key` (for paging through `Store::keys`).
pub(crate) fn key_successor(key: &[u8]) -> Vec<u8> {
    let mut next = Vec::with_capacity(key.len() + 1);
    next.extend_from_slice(key);
    next.push(0);
    next
}

/// First key past every block of `volume_id`.
pub(crate) fn volume_blocks_end(volume_id: u64) -> Vec<u8> {
    match volume_id.checked_add(1) {
        Some(next) => keel_store::block_key(next, 0, 0),
        None => vec![keel_store::Keyspace::Block as u8 + 1],
    }
}

pub(crate) fn unix_seconds_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs())
        .unwrap_or(0)
}

/// 16 bytes unique for practical purposes: BLAKE3 of the wall clock, a process-wide counter,
/// the process id and a caller-given context. Used for volume UUIDs and snapshot GUIDs.
pub(crate) fn new_unique_id(context: &[u8]) -> [u8; 16] {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_nanos())
        .unwrap_or(0);
    let mut hasher = blake3::Hasher::new();
    hasher.update(&nanos.to_le_bytes());
    hasher.update(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    hasher.update(&std::process::id().to_le_bytes());
    hasher.update(context);
    let hash = hasher.finalize();
    let mut id = [0u8; 16];
    id.copy_from_slice(&hash.as_bytes()[..16]);
    id
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves block keys parse back to their fields and the volume end bound sorts after them.
    #[test]
    fn block_key_round_trip() {
        let key = keel_store::block_key(7, 9, 11);
        assert_eq!(parse_block_key(&key), Some((7, 9, 11)));
        assert!(key < volume_blocks_end(7));
        assert!(keel_store::block_key(7, u64::MAX, u64::MAX) < volume_blocks_end(7));
        assert!(volume_blocks_end(u64::MAX) > keel_store::block_key(u64::MAX, u64::MAX, 1));
        assert!(key_successor(&key) > key);
    }
}
