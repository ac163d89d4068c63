//! Full-disk test on a small ext4 filesystem the test creates (a loop-mounted 64 MiB image):
//! writes fail with a clear "no space" error, nothing acknowledged is lost, the store stays
//! consistent across reopen, deletes still work, and once space is freed (delete + compaction)
//! writes resume. Needs root, `mkfs.ext4` (e2fsprogs) and `mount` with loop support.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use keel_store::{meta_key, Compression, Durability, Store, StoreConfig, StoreError, WriteOp};

struct LoopMount {
    mountpoint: PathBuf,
}

impl LoopMount {
    fn new(name: &str, size_mib: u64) -> LoopMount {
        let base = common::fresh_dir(name);
        let image = base.join("fs.img");
        let mountpoint = base.join("mnt");
        std::fs::create_dir_all(&mountpoint).unwrap();
        let file = std::fs::File::create(&image).unwrap();
        file.set_len(size_mib << 20).unwrap();
        drop(file);
        let mkfs = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0"])
            .arg(&image)
            .status();
        assert!(
            mkfs.as_ref().is_ok_and(|s| s.success()),
            "mkfs.ext4 failed or is missing (Debian package e2fsprogs): {mkfs:?}"
        );
        let mount = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(&mountpoint)
            .status()
            .unwrap();
        assert!(
            mount.success(),
            "mounting a loop image needs root and loop devices"
        );
        LoopMount { mountpoint }
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mountpoint).status();
    }
}

fn open(dir: &Path, reserve_bytes: u64) -> Store {
    let mut config = StoreConfig::new(vec![dir.to_path_buf()]);
    config.segment_size_max_bytes = 4 << 20;
    config.reserve_bytes = reserve_bytes;
    config.checkpoint_interval_bytes = 2 << 20;
    Store::open(config).unwrap()
}

fn key(i: u64) -> Vec<u8> {
    meta_key(&i.to_be_bytes())
}

fn fill(store: &Store, first: u64) -> (u64, StoreError) {
    let mut next = first;
    loop {
        let value = common::value_for(next, 0, 64 << 10);
        match store.write(
            vec![WriteOp::put(key(next), value, Compression::None)],
            Durability::Sync,
        ) {
            Ok(_) => next += 1,
            Err(error) => return (next, error),
        }
        assert!(next - first < 2000, "a 64 MiB filesystem never filled up");
    }
}

fn check(store: &Store, keys: impl Iterator<Item = u64>) {
    for i in keys {
        assert_eq!(
            store.get(&key(i)).unwrap().unwrap(),
            common::value_for(i, 0, 64 << 10),
            "key {i}"
        );
    }
}

#[test]
fn full_disk_is_a_clear_error_and_writes_resume_after_freeing_space() {
    let mount = LoopMount::new("full-disk", 64);
    let dir = mount.mountpoint.join("data");
    let ballast = mount.mountpoint.join("ballast");
    std::fs::write(&ballast, vec![7u8; 6 << 20]).unwrap();

    // Phase A: the reserve refuses writes that add data before the disk is really full.
    let store = open(&dir, 8 << 20);
    let (end, error) = fill(&store, 0);
    assert!(
        matches!(error, StoreError::NoSpace { .. }),
        "expected the reserve to refuse: {error}"
    );
    assert!(
        error.to_string().contains("no space left"),
        "unclear message: {error}"
    );
    assert!(end > 100, "only {end} writes fit");
    check(&store, 0..end);
    drop(store);
    let store = open(&dir, 8 << 20);
    check(&store, 0..end);

    // Deletes and compaction still work on the full disk, and free space.
    let deletes: Vec<WriteOp> = (0..end)
        .filter(|i| i % 4 != 0)
        .map(|i| WriteOp::Delete { key: key(i) })
        .collect();
    store.write(deletes, Durability::Sync).unwrap();
    let report = store.compact(0.3, &mut |_| {}).unwrap();
    assert!(
        report.bytes_reclaimed > 16 << 20,
        "compaction reclaimed only {} bytes",
        report.bytes_reclaimed
    );
    // Writes resume.
    let (resumed_end, _) = fill(&store, 100_000);
    assert!(
        resumed_end - 100_000 > 100,
        "only {} writes after compaction",
        resumed_end - 100_000
    );
    check(&store, (0..end).filter(|i| i % 4 == 0));
    check(&store, 100_000..resumed_end);
    drop(store);

    // Phase B: another program fills the disk to the last byte. The store refuses cleanly
    // (its index headroom is gone), keeps everything, and resumes without a restart once the
    // other program's file is removed.
    let store = open(&dir, 0);
    let filler = mount.mountpoint.join("filler");
    {
        use std::io::Write;
        let mut file = std::fs::File::create(&filler).unwrap();
        let chunk = vec![9u8; 64 << 10];
        while file.write_all(&chunk).is_ok() {}
        let _ = file.sync_all();
    }
    let (b_end, error) = fill(&store, 200_000);
    assert_eq!(b_end, 200_000, "a write got through on a full disk");
    assert!(error.is_no_space(), "expected no space, got {error}");
    assert!(!store.stats().unwrap().poisoned);
    check(&store, 100_000..resumed_end);
    std::fs::remove_file(&filler).unwrap();
    std::fs::remove_file(&ballast).unwrap();
    for i in 300_000..300_020u64 {
        store
            .write(
                vec![WriteOp::put(
                    key(i),
                    common::value_for(i, 0, 64 << 10),
                    Compression::None,
                )],
                Durability::Sync,
            )
            .unwrap();
    }
    drop(store);
    let store = open(&dir, 0);
    check(&store, 300_000..300_020);
    check(&store, 100_000..resumed_end);
    assert_eq!(store.get(&key(1)).unwrap(), None);
}
