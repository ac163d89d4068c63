//! Helpers shared by the store's integration tests: fresh data directories on a real
//! filesystem (under the crate's target dir, never tmpfs).

#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;

use keel_store::{Store, StoreConfig};

/// A fresh, empty directory under `target/test-data/store/<name>`.
pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("store")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fs = keel_store::fsinfo::filesystem_info(&dir).unwrap();
    assert!(
        !fs.is_volatile(),
        "test data must not live on {}",
        fs.filesystem
    );
    dir
}

pub fn open(dirs: &[PathBuf]) -> Store {
    Store::open(StoreConfig::new(dirs.to_vec())).unwrap()
}

pub fn open_small_segments(dirs: &[PathBuf], segment_bytes: u64) -> Store {
    let mut config = StoreConfig::new(dirs.to_vec());
    config.segment_size_max_bytes = segment_bytes;
    config.reserve_bytes = 0;
    Store::open(config).unwrap()
}

/// Segment files of a data directory, oldest first.
pub fn segment_files(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("segments"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    files.sort();
    files
}

/// A deterministic value for (key number, version).
pub fn value_for(key: u64, version: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut hasher = blake3::Hasher::new();
    hasher.update(&key.to_le_bytes());
    hasher.update(&version.to_le_bytes());
    hasher.finalize_xof().fill(&mut out);
    out
}

/// What the disk would hold if the process died now: a copy of the data directory taken while
/// the store is open (the log as written, the index as of its last durable commit).
pub fn crash_image(dir: &std::path::Path, name: &str) -> PathBuf {
    let image = fresh_dir(name);
    copy_tree(dir, &image);
    image
}

fn copy_tree(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}
