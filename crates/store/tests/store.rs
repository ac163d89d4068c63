//! Integration tests of the store's contract: read-your-writes, ordered range queries, reopen,
//! torn tails, atomic groups, mirror self-heal and scrub, compaction, tmpfs refusal, and group
//! commit under concurrency.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::Write;
use std::sync::Arc;

use common::*;
use keel_store::{
    block_key, meta_key, Compression, Durability, Store, StoreConfig, StoreError, WriteOp,
};

fn put(key: &[u8], value: &[u8]) -> WriteOp {
    WriteOp::put(key.to_vec(), value.to_vec(), Compression::None)
}

/// Put, overwrite, delete and range queries behave like an ordered map, and survive reopen.
#[test]
fn basic_semantics_survive_reopen() {
    let dir = fresh_dir("basic");
    let store = open(std::slice::from_ref(&dir));
    store
        .write(
            vec![put(b"\x01a", b"1"), put(b"\x01b", b"2")],
            Durability::Sync,
        )
        .unwrap();
    store
        .write(vec![put(b"\x01a", b"one")], Durability::Buffered)
        .unwrap();
    store
        .write(
            vec![WriteOp::Delete {
                key: b"\x01b".to_vec(),
            }],
            Durability::Sync,
        )
        .unwrap();
    store
        .write(vec![put(b"\x01c", b"3")], Durability::Sync)
        .unwrap();
    let check = |store: &Store| {
        assert_eq!(store.get(b"\x01a").unwrap().unwrap(), b"one");
        assert_eq!(store.get(b"\x01b").unwrap(), None);
        assert_eq!(
            store.keys(b"\x01", b"\x02", 10).unwrap(),
            vec![b"\x01a".to_vec(), b"\x01c".to_vec()]
        );
        assert_eq!(
            store.scan(b"\x01b", b"\x02", 10).unwrap(),
            vec![(b"\x01c".to_vec(), b"3".to_vec())]
        );
        assert_eq!(store.stats().unwrap().live_extents, 2);
    };
    check(&store);
    drop(store);
    let store = open(&[dir]);
    check(&store);
    let ack = store
        .write(vec![put(b"\x01d", b"4")], Durability::Sync)
        .unwrap();
    assert_eq!(ack.seq, 6, "sequence numbers continue after reopen");
}

/// `floor` finds the newest generation of a block at or below a generation.
#[test]
fn floor_finds_newest_generation_at_or_below() {
    let dir = fresh_dir("floor");
    let store = open(&[dir]);
    for generation in [1u64, 3, 7] {
        store
            .write(
                vec![put(&block_key(9, 5, generation), &generation.to_le_bytes())],
                Durability::Buffered,
            )
            .unwrap();
    }
    let at = |g: u64| {
        store
            .floor(&block_key(9, 5, 0), &block_key(9, 5, g))
            .unwrap()
            .map(|(_, v)| u64::from_le_bytes(v.try_into().unwrap()))
    };
    assert_eq!(at(0), None);
    assert_eq!(at(2), Some(1));
    assert_eq!(at(6), Some(3));
    assert_eq!(at(u64::MAX), Some(7));
    assert_eq!(
        store
            .floor(&block_key(9, 4, 0), &block_key(9, 4, u64::MAX))
            .unwrap(),
        None
    );
}

/// Compressed values round-trip and the ratio is reported.
#[test]
fn compression_is_applied_and_reported() {
    let dir = fresh_dir("compression");
    let store = open(&[dir]);
    let page = b"INSERT INTO pgbench_accounts VALUES (1, 1, 0, '') ".repeat(80);
    for (i, codec) in [Compression::Zstd, Compression::Lz4]
        .into_iter()
        .enumerate()
    {
        store
            .write(
                vec![WriteOp::put(meta_key(&[i as u8]), page.clone(), codec)],
                Durability::Sync,
            )
            .unwrap();
        assert_eq!(store.get(&meta_key(&[i as u8])).unwrap().unwrap(), page);
    }
    let stats = store.stats().unwrap();
    assert!(
        stats.compression_ratio() > 5.0,
        "ratio {}",
        stats.compression_ratio()
    );
}

/// Garbage or a half-written record after the last whole batch is cut away at open; everything
/// before it is intact and new writes go after it.
#[test]
fn torn_tail_is_cut_at_open() {
    let dir = fresh_dir("torn-tail");
    let store = open(std::slice::from_ref(&dir));
    for i in 0..100u64 {
        store
            .write(
                vec![put(&meta_key(&i.to_be_bytes()), &value_for(i, 0, 100))],
                Durability::Sync,
            )
            .unwrap();
    }
    drop(store);
    let last = segment_files(&dir).pop().unwrap();
    let len_before = std::fs::metadata(&last).unwrap().len();
    // A torn record: a valid-looking magic followed by garbage.
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&last)
        .unwrap();
    file.write_all(
        b"KXT1\x01\x00\x01\x00garbage-garbage-garbage-garbage-garbage-garbage-garbage-garbage",
    )
    .unwrap();
    drop(file);
    let store = open(std::slice::from_ref(&dir));
    assert_eq!(std::fs::metadata(&last).unwrap().len(), len_before);
    for i in 0..100u64 {
        assert_eq!(
            store.get(&meta_key(&i.to_be_bytes())).unwrap().unwrap(),
            value_for(i, 0, 100)
        );
    }
    store
        .write(vec![put(b"\x01after", b"x")], Durability::Sync)
        .unwrap();
    drop(store);
    let store = open(&[dir]);
    assert_eq!(store.get(b"\x01after").unwrap().unwrap(), b"x");
}

/// The ops of one write call are applied all together or not at all: a crash image whose log
/// ends in the middle of a group (a torn write) shows none of the group's ops.
#[test]
fn a_torn_group_applies_none_of_its_ops() {
    let dir = fresh_dir("torn-group");
    let store = open(std::slice::from_ref(&dir));
    store
        .write(vec![put(b"\x01before", b"kept")], Durability::Sync)
        .unwrap();
    let last = segment_files(&dir).pop().unwrap();
    let start = std::fs::metadata(&last).unwrap().len();
    let group: Vec<WriteOp> = (0..10u8).map(|i| put(&[1, b'g', i], &[i; 500])).collect();
    store.write(group, Durability::Sync).unwrap();
    let image = crash_image(&dir, "torn-group-image");
    drop(store);
    // Keep the first half of the group's bytes only.
    let image_segment = segment_files(&image).pop().unwrap();
    let end = std::fs::metadata(&image_segment).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&image_segment)
        .unwrap()
        .set_len(start + (end - start) / 2)
        .unwrap();
    let store = open(&[image]);
    assert_eq!(store.get(b"\x01before").unwrap().unwrap(), b"kept");
    assert!(store.keys(b"\x01g", b"\x01h", 100).unwrap().is_empty());
    store
        .write(vec![put(b"\x01after", b"x")], Durability::Sync)
        .unwrap();
    assert_eq!(store.get(b"\x01after").unwrap().unwrap(), b"x");
}

/// Flipped bytes in one mirror copy are never returned: reads return the good copy and repair
/// the bad one; scrub finds and repairs every flipped extent; a second scrub finds nothing.
#[test]
fn mirror_self_heals_on_read_and_scrub() {
    let a = fresh_dir("mirror-a");
    let b = fresh_dir("mirror-b");
    let store = open(&[a.clone(), b.clone()]);
    let count = 200u64;
    for i in 0..count {
        store
            .write(
                vec![put(&meta_key(&i.to_be_bytes()), &value_for(i, 0, 3000))],
                Durability::Buffered,
            )
            .unwrap();
    }
    store.flush().unwrap();
    drop(store);
    // Flip one byte inside many extents on device A (past the segment header).
    let segment = segment_files(&a).pop().unwrap();
    let mut bytes = std::fs::read(&segment).unwrap();
    let mut flipped = 0;
    let mut at = 64 + 100;
    while at < bytes.len() {
        bytes[at] ^= 0x40;
        flipped += 1;
        at += 3000 * 3;
    }
    std::fs::write(&segment, &bytes).unwrap();
    let store = open(&[a.clone(), b.clone()]);
    // Reads of a few keys self-heal.
    for i in 0..5u64 {
        assert_eq!(
            store.get(&meta_key(&i.to_be_bytes())).unwrap().unwrap(),
            value_for(i, 0, 3000)
        );
    }
    let report = store.scrub(&mut |_| {}).unwrap();
    assert_eq!(report.extents_checked, count);
    assert_eq!(report.unrecoverable_extents, 0);
    let healed_on_read = store.stats().unwrap().repaired_extents - report.repaired_copies;
    assert_eq!(
        report.repaired_copies + healed_on_read,
        flipped,
        "every flipped extent repaired once"
    );
    let again = store.scrub(&mut |_| {}).unwrap();
    assert_eq!(again.repaired_copies, 0);
    for i in 0..count {
        assert_eq!(
            store.get(&meta_key(&i.to_be_bytes())).unwrap().unwrap(),
            value_for(i, 0, 3000)
        );
    }
    drop(store);
    assert_eq!(
        std::fs::read(&segment).unwrap(),
        std::fs::read(segment_files(&b).pop().unwrap()).unwrap()
    );
}

/// Without a mirror, a corrupt extent is a clear error naming the key, never data; scrub lists it.
#[test]
fn corruption_without_mirror_is_an_error() {
    let dir = fresh_dir("corrupt-single");
    let store = open(std::slice::from_ref(&dir));
    store
        .write(vec![put(b"\x01victim", &[7u8; 4096])], Durability::Sync)
        .unwrap();
    store
        .write(vec![put(b"\x01bystander", &[8u8; 4096])], Durability::Sync)
        .unwrap();
    drop(store);
    let segment = segment_files(&dir).pop().unwrap();
    let mut bytes = std::fs::read(&segment).unwrap();
    bytes[64 + 68 + 7 + 2000] ^= 1;
    std::fs::write(&segment, &bytes).unwrap();
    let store = open(&[dir]);
    match store.get(b"\x01victim") {
        Err(StoreError::Corrupt { key_hex, .. }) => assert_eq!(key_hex, "0176696374696d"),
        other => panic!("expected a corruption error, got {other:?}"),
    }
    assert_eq!(
        store.get(b"\x01bystander").unwrap().unwrap(),
        vec![8u8; 4096]
    );
    let report = store.scrub(&mut |_| {}).unwrap();
    assert_eq!(report.unrecoverable_extents, 1);
    assert_eq!(
        report.unrecoverable_keys,
        vec!["0176696374696d".to_string()]
    );
}

/// Compaction reclaims overwritten space, keeps every live value (also after reopen) and can be
/// run while the data keeps changing.
#[test]
fn compaction_reclaims_space_and_keeps_data() {
    let dir = fresh_dir("compaction");
    let store = open_small_segments(std::slice::from_ref(&dir), 1 << 20);
    let keys = 64u64;
    for version in 0..20u64 {
        let ops = (0..keys)
            .map(|k| put(&meta_key(&k.to_be_bytes()), &value_for(k, version, 4000)))
            .collect();
        store.write(ops, Durability::Buffered).unwrap();
    }
    store
        .write(
            vec![WriteOp::Delete {
                key: meta_key(&0u64.to_be_bytes()),
            }],
            Durability::Sync,
        )
        .unwrap();
    let before = store.stats().unwrap();
    let mut seen_progress = false;
    let report = store.compact(0.5, &mut |_| seen_progress = true).unwrap();
    assert!(report.segments_compacted > 0 && seen_progress);
    let after = store.stats().unwrap();
    assert!(
        after.log_bytes < before.log_bytes / 2,
        "log {} -> {}",
        before.log_bytes,
        after.log_bytes
    );
    assert_eq!(after.live_extents, keys - 1);
    let check = |store: &Store| {
        assert_eq!(store.get(&meta_key(&0u64.to_be_bytes())).unwrap(), None);
        for k in 1..keys {
            assert_eq!(
                store.get(&meta_key(&k.to_be_bytes())).unwrap().unwrap(),
                value_for(k, 19, 4000)
            );
        }
    };
    check(&store);
    // Writes after compaction, then reopen: relocated copies never undo newer writes.
    store
        .write(
            vec![put(&meta_key(&5u64.to_be_bytes()), b"newest")],
            Durability::Sync,
        )
        .unwrap();
    drop(store);
    let store = open_small_segments(&[dir], 1 << 20);
    assert_eq!(
        store.get(&meta_key(&5u64.to_be_bytes())).unwrap().unwrap(),
        b"newest"
    );
    assert_eq!(
        store.get(&meta_key(&6u64.to_be_bytes())).unwrap().unwrap(),
        value_for(6, 19, 4000)
    );
}

/// Each key keeps the sequence number of the write that set it, through compaction and reopen,
/// and `committed_sequence` bounds every earlier write: "what changed since" needs no values.
#[test]
fn sequences_say_what_changed_since_through_compaction_and_reopen() {
    let dir = fresh_dir("sequences");
    let store = open_small_segments(std::slice::from_ref(&dir), 1 << 20);
    let key = |k: u64| meta_key(&k.to_be_bytes());
    let changed_since = |store: &Store, since: u64| -> Vec<Vec<u8>> {
        store
            .keys_with_sequences(&meta_key(b""), &meta_key(&[0xff; 9]), 1000)
            .unwrap()
            .into_iter()
            .filter(|(_, sequence)| *sequence > since)
            .map(|(key, _)| key)
            .collect()
    };
    for version in 0..8u64 {
        let ops = (0..64u64)
            .map(|k| put(&key(k), &value_for(k, version, 4000)))
            .collect();
        store.write(ops, Durability::Buffered).unwrap();
    }
    let since = store.committed_sequence();
    assert!(changed_since(&store, since).is_empty());
    store
        .write(
            vec![put(&key(7), b"later"), put(&key(9), b"later")],
            Durability::Sync,
        )
        .unwrap();
    assert!(store.committed_sequence() >= since + 2);
    assert_eq!(changed_since(&store, since), vec![key(7), key(9)]);
    let report = store.compact(0.5, &mut |_| {}).unwrap();
    assert!(report.segments_compacted > 0);
    assert_eq!(changed_since(&store, since), vec![key(7), key(9)]);
    drop(store);
    let store = open_small_segments(&[dir], 1 << 20);
    assert_eq!(changed_since(&store, since), vec![key(7), key(9)]);
    assert!(store.committed_sequence() >= since + 2);
    assert_eq!(changed_since(&store, 0).len(), 64);
}

/// A data directory on tmpfs is refused unless the store is opened as ephemeral.
#[test]
fn tmpfs_is_refused_unless_ephemeral() {
    let dir = std::path::PathBuf::from("/dev/shm")
        .join(format!("keel-store-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    assert_eq!(
        keel_store::fsinfo::filesystem_info(&dir)
            .unwrap()
            .filesystem,
        "tmpfs",
        "/dev/shm must be tmpfs for this test"
    );
    let refused = Store::open(StoreConfig::new(vec![dir.clone()]));
    assert!(
        matches!(refused, Err(StoreError::VolatileFilesystem { .. })),
        "{:?}",
        refused.err()
    );
    let mut config = StoreConfig::new(vec![dir.clone()]);
    config.ephemeral = true;
    let store = Store::open(config).unwrap();
    store
        .write(vec![put(b"\x01k", b"v")], Durability::Sync)
        .unwrap();
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A second process (here: a second open) cannot open a data directory in use.
#[test]
fn a_data_directory_is_locked() {
    let dir = fresh_dir("locked");
    let _store = open(std::slice::from_ref(&dir));
    assert!(matches!(
        Store::open(StoreConfig::new(vec![dir])),
        Err(StoreError::Locked { .. })
    ));
}

/// 64 concurrent synced writers: every acknowledged write is readable, and they shared syncs
/// (far fewer batches than writes is shown by the sequence numbers being dense).
#[test]
fn concurrent_writers_all_land() {
    let dir = fresh_dir("concurrent");
    let store = Arc::new(open(std::slice::from_ref(&dir)));
    let threads: Vec<_> = (0..64u64)
        .map(|t| {
            let store = store.clone();
            std::thread::spawn(move || {
                for i in 0..20u64 {
                    let k = t * 1000 + i;
                    store
                        .write(
                            vec![put(&meta_key(&k.to_be_bytes()), &value_for(k, 0, 4096))],
                            Durability::Sync,
                        )
                        .unwrap();
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    assert_eq!(store.stats().unwrap().last_seq, 64 * 20);
    drop(store);
    let store = open(&[dir]);
    for t in 0..64u64 {
        for i in 0..20u64 {
            let k = t * 1000 + i;
            assert_eq!(
                store.get(&meta_key(&k.to_be_bytes())).unwrap().unwrap(),
                value_for(k, 0, 4096)
            );
        }
    }
}

/// Keys and values past their bounds are refused with a clear error and change nothing.
#[test]
fn oversized_input_is_refused() {
    let dir = fresh_dir("oversized");
    let store = open(&[dir]);
    let long_key = vec![1u8; keel_store::format::KEY_LEN_MAX_BYTES + 1];
    assert!(matches!(
        store.write(vec![put(&long_key, b"v")], Durability::Sync),
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        store.write(vec![put(b"", b"v")], Durability::Sync),
        Err(StoreError::Invalid(_))
    ));
    assert_eq!(store.stats().unwrap().last_seq, 0);
}

/// Waits until the segment after `segment` is prepared to its full size.
fn wait_until_prepared(segment: &std::path::Path, segment_bytes: u64) {
    let stem = segment.file_stem().and_then(|s| s.to_str()).unwrap();
    let id = u64::from_str_radix(stem, 16).unwrap();
    let prepared = segment.with_file_name(format!("{:016x}.seg.prepared", id + 1));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::fs::metadata(&prepared).map(|m| m.len()).ok() != Some(segment_bytes) {
        assert!(
            std::time::Instant::now() < deadline,
            "{} was not prepared within 30 s",
            prepared.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Segments are prepared ahead (zero-filled to full size) once the active one is half full; a
/// rolled prepared segment ends in zeros, and replay must go on into the next segment rather
/// than take the zeros for the end of the log.
#[test]
fn replay_crosses_prepared_segments() {
    let dir = fresh_dir("prepared-segments");
    let segment_bytes = 1u64 << 20;
    let store = open_small_segments(std::slice::from_ref(&dir), segment_bytes);
    let mut waited = false;
    for i in 0..80u64 {
        store
            .write(
                vec![put(&meta_key(&i.to_be_bytes()), &value_for(i, 0, 40_000))],
                Durability::Sync,
            )
            .unwrap();
        // Past half of the first (growing) segment the store zero-fills its successor in the
        // background. A writer never waits for the zeros: on a busy machine it can reach the
        // end before the preparing thread even starts, and then no segment is prepared. Wait
        // until the successor is written whole (past its last cancellation point).
        if let [first] = segment_files(&dir).as_slice() {
            if !waited && std::fs::metadata(first).unwrap().len() > segment_bytes / 2 {
                waited = true;
                wait_until_prepared(first, segment_bytes);
            }
        }
    }
    assert!(waited, "the first segment never passed half its size");
    let files = segment_files(&dir);
    assert!(
        files.len() >= 3,
        "expected several segments, got {}",
        files.len()
    );
    let full_size = files[..files.len() - 1]
        .iter()
        .filter(|f| std::fs::metadata(f).unwrap().len() == 1 << 20)
        .count();
    assert!(
        full_size >= 1,
        "no rolled segment was a prepared (full-size) one"
    );
    let image = crash_image(&dir, "prepared-segments-image");
    drop(store);
    let store = open_small_segments(&[image], 1 << 20);
    for i in 0..80u64 {
        assert_eq!(
            store.get(&meta_key(&i.to_be_bytes())).unwrap().unwrap(),
            value_for(i, 0, 40_000),
            "key {i}"
        );
    }
}

/// A fresh store's first segment grows with each append (every fdatasync also writes metadata);
/// once 4 MiB went into it, the next segment is prepared and the writer moves there as soon as
/// it is ready, long before the first is full. Data on both sides of the move survives reopen.
#[test]
fn a_growing_segment_is_left_once_a_prepared_one_is_ready() {
    const SEGMENT_BYTES: u64 = 32 << 20;
    let dir = fresh_dir("growing-segment");
    let store = open_small_segments(std::slice::from_ref(&dir), SEGMENT_BYTES);
    let mut written = 0u64;
    for i in 0..5u64 {
        store
            .write(
                vec![put(&meta_key(&i.to_be_bytes()), &value_for(i, 0, 1 << 20))],
                Durability::Buffered,
            )
            .unwrap();
        written += 1;
    }
    // Bounded wait for the preparation, writing meanwhile so the writer can move.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while segment_files(&dir).len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the writer never left the growing segment"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
        store
            .write(
                vec![put(
                    &meta_key(&written.to_be_bytes()),
                    &value_for(written, 0, 4096),
                )],
                Durability::Sync,
            )
            .unwrap();
        written += 1;
    }
    let files = segment_files(&dir);
    let first = std::fs::metadata(&files[0]).unwrap().len();
    let second = std::fs::metadata(&files[1]).unwrap().len();
    assert!(first < SEGMENT_BYTES / 2, "first segment is {first} bytes");
    assert_eq!(second, SEGMENT_BYTES, "the second segment was prepared");
    drop(store);
    let store = open_small_segments(&[dir], SEGMENT_BYTES);
    for i in 0..written {
        let length = if i < 5 { 1 << 20 } else { 4096 };
        assert_eq!(
            store.get(&meta_key(&i.to_be_bytes())).unwrap().unwrap(),
            value_for(i, 0, length),
            "key {i}"
        );
    }
}

/// The share of `path`'s pages in the page cache (mincore on a mapping of it).
fn cached_share(path: &std::path::Path) -> f64 {
    use std::os::unix::io::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    let len = file.metadata().unwrap().len() as usize;
    let page = 4096;
    let pages = len.div_ceil(page);
    let mut resident = vec![0u8; pages];
    // SAFETY: a read-only shared mapping of a file this test opened, of its current length,
    // only passed to mincore (never read through) and unmapped before the function returns.
    let cached = unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        );
        assert_ne!(map, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        let rc = libc::mincore(map, len, resident.as_mut_ptr());
        let error = std::io::Error::last_os_error();
        libc::munmap(map, len);
        assert_eq!(rc, 0, "mincore: {error}");
        resident.iter().filter(|page| *page & 1 == 1).count()
    };
    cached as f64 / pages as f64
}

/// A large bulk batch goes to the disk around the page cache (`O_DIRECT`): once it is written,
/// its segment holds almost no cached page. With `direct_write_min_bytes` 0, for a batch below
/// it, or for an ordinary write, every page written stays cached. All read back the same
/// bytes, also after a reopen.
#[test]
fn a_large_bulk_batch_is_written_around_the_page_cache() {
    let value = value_for(7, 1, 8 << 20);
    for (min, bulk, expect_direct) in [
        (256 << 10, true, true),
        (0, true, false),
        (16 << 20, true, false),
        (256 << 10, false, false),
    ] {
        let dir = fresh_dir(&format!("direct-{min}-{bulk}"));
        let mut config = StoreConfig::new(vec![dir.clone()]);
        config.direct_write_min_bytes = min;
        config.reserve_bytes = 0;
        let store = Store::open(config.clone()).unwrap();
        let ops = vec![put(&meta_key(b"big"), &value)];
        if bulk {
            store.write_bulk(ops, Durability::Sync).unwrap();
        } else {
            store.write(ops, Durability::Sync).unwrap();
        }
        let segment = &segment_files(&dir)[0];
        let share = cached_share(segment);
        if expect_direct {
            assert!(
                share < 0.05,
                "{share:.3} of the segment is cached ({min}, {bulk})"
            );
        } else {
            assert!(
                share > 0.9,
                "{share:.3} of the segment is cached ({min}, {bulk})"
            );
        }
        assert_eq!(store.get(&meta_key(b"big")).unwrap().unwrap(), value);
        drop(store);
        let store = Store::open(config).unwrap();
        assert_eq!(store.get(&meta_key(b"big")).unwrap().unwrap(), value);
        assert_eq!(store.scrub(&mut |_| {}).unwrap().unrecoverable_extents, 0);
    }
}

/// A bulk write leaves a key the location cache does not hold out of it (a rebuild's blocks
/// would push out the keys clients read), and updates one it holds: the cache never answers
/// with an old location.
#[test]
fn bulk_writes_cache_no_new_location_and_update_a_cached_one() {
    let dir = fresh_dir("bulk-cache");
    let store = open(std::slice::from_ref(&dir));
    // (hits, misses) of one lookup.
    let lookup = |key: &[u8]| {
        let before = store.stats().unwrap();
        let value = store.get(key).unwrap();
        let after = store.stats().unwrap();
        let counted = (
            after.location_cache_hits - before.location_cache_hits,
            after.location_cache_misses - before.location_cache_misses,
        );
        (value, counted)
    };
    let hot = block_key(1, 0, 1);
    let copied = block_key(1, 1, 1);
    store
        .write(vec![put(&hot, b"old")], Durability::Sync)
        .unwrap();
    assert_eq!(lookup(&hot), (Some(b"old".to_vec()), (1, 0)));

    store
        .write_bulk(vec![put(&copied, b"copy")], Durability::Sync)
        .unwrap();
    assert_eq!(lookup(&copied), (Some(b"copy".to_vec()), (0, 1)));

    store
        .write_bulk(vec![put(&hot, b"new")], Durability::Sync)
        .unwrap();
    assert_eq!(lookup(&hot), (Some(b"new".to_vec()), (1, 0)));
    drop(store);
    let store = open(std::slice::from_ref(&dir));
    assert_eq!(store.get(&hot).unwrap(), Some(b"new".to_vec()));
    assert_eq!(store.get(&copied).unwrap(), Some(b"copy".to_vec()));
}
