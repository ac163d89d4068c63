//! Block keys and small helpers shared by the engine's modules.
//!
//! The volume and snapshot records themselves live in the catalog (`keel_catalog::records`).

use keel_store::Store;
use serde::Serialize;

use super::VolumeError;

pub(crate) fn encode<T: Serialize>(record: &T) -> Result<Vec<u8>, VolumeError> {
    postcard::to_allocvec(record).map_err(|error| VolumeError::Metadata {
        detail: format!("encoding: {error}"),
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

/// Key of a record another layer keeps about this node's copy of volume `volume_id` under
/// `name` (replication's common points and shutdown note): such records describe the copy's
/// blocks, so erasing the copy deletes them before its first block.
pub fn copy_record_key(volume_id: u64, name: &[u8]) -> Vec<u8> {
    let mut key = copy_records_prefix(volume_id);
    key.extend_from_slice(name);
    key
}

fn copy_records_prefix(volume_id: u64) -> Vec<u8> {
    let mut suffix = b"copy/".to_vec();
    suffix.extend_from_slice(&volume_id.to_be_bytes());
    keel_store::meta_key(&suffix)
}

/// The key range of every [`copy_record_key`] of `volume_id`.
pub(crate) fn copy_records(volume_id: u64) -> (Vec<u8>, Vec<u8>) {
    let start = copy_records_prefix(volume_id);
    let end = match volume_id.checked_add(1) {
        Some(next) => copy_records_prefix(next),
        None => keel_store::meta_key(b"copy0"),
    };
    (start, end)
}

/// First key past every block of `volume_id`.
pub(crate) fn volume_blocks_end(volume_id: u64) -> Vec<u8> {
    match volume_id.checked_add(1) {
        Some(next) => keel_store::block_key(next, 0, 0),
        None => vec![keel_store::Keyspace::Block as u8 + 1],
    }
}

pub fn unix_seconds_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs())
        .unwrap_or(0)
}

/// 16 bytes unique for practical purposes: BLAKE3 of the wall clock, a process-wide counter,
/// the process id and a caller-given context. Used for volume UUIDs and snapshot GUIDs.
pub fn new_unique_id(context: &[u8]) -> [u8; 16] {
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

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Distinct volume ids that have at least one block extent in the store (one lookup per id).
pub(crate) fn volume_ids_with_blocks(store: &Store) -> Result<Vec<u64>, VolumeError> {
    let end = vec![keel_store::Keyspace::Block as u8 + 1];
    let mut cursor = keel_store::block_key(0, 0, 0);
    let mut ids = Vec::new();
    loop {
        let page = store
            .keys(&cursor, &end, 1)
            .map_err(VolumeError::store("*", "listing volumes with blocks"))?;
        let Some(key) = page.first() else {
            return Ok(ids);
        };
        let Some((volume_id, _, _)) = parse_block_key(key) else {
            // Not a block key of this layout: step over it.
            cursor = key_successor(key);
            continue;
        };
        ids.push(volume_id);
        match volume_id.checked_add(1) {
            Some(next) => cursor = keel_store::block_key(next, 0, 0),
            None => return Ok(ids),
        }
    }
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
