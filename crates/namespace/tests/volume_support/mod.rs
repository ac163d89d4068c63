//! Shared helpers of the volume tests: a fresh data directory on a real filesystem (never
//! tmpfs), opening the store and the manager on it, and byte patterns.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use keel_namespace::volume::{VolumeIo, VolumeManager};
use keel_store::{Store, StoreConfig};

pub const BLOCK: u64 = 4096;

/// A new empty directory under `target/test-data/volume/`, unique per call within a test
/// binary (test names are unique across the volume tests). The same path is emptied and reused
/// by the next run, so repeated runs do not pile up data.
pub fn test_dir(name: &str) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/test-data/volume")
        .join(format!(
            "{name}-{}",
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn open_store(dir: &Path) -> Store {
    Store::open(StoreConfig::new(vec![dir.to_path_buf()])).unwrap()
}

pub fn open_manager(dir: &Path) -> VolumeManager {
    let store = open_store(dir);
    let metadata: std::sync::Arc<dyn keel_catalog::Metadata> =
        std::sync::Arc::new(keel_catalog::LocalCatalog::open(store.clone()).unwrap());
    VolumeManager::open(store, metadata).unwrap()
}

/// Deterministic bytes that differ per (seed, position).
pub fn pattern(seed: u64, length: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..length)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

pub fn read_all(handle: &dyn VolumeIo) -> Vec<u8> {
    let mut bytes = vec![0u8; handle.size_bytes() as usize];
    handle.read(0, &mut bytes).unwrap();
    bytes
}

/// Compares two images block by block and names the first differing block.
pub fn assert_same_blocks(left: &[u8], right: &[u8], what: &str) {
    assert_eq!(left.len(), right.len(), "{what}: sizes differ");
    for (index, (a, b)) in left
        .chunks(BLOCK as usize)
        .zip(right.chunks(BLOCK as usize))
        .enumerate()
    {
        assert!(a == b, "{what}: block {index} differs");
    }
}
