//! Volume basics through the public API on a real store: thin provisioning, aligned and
//! unaligned writes (also concurrent), trim and write-zeroes, resize, list/info/delete, reopen.
#![allow(clippy::unwrap_used)]

mod volume_support;

use std::sync::Arc;

use bytes::Bytes;
use keel_namespace::volume::{VolumeError, VolumeSpec, BLOCK_SIZE_BYTES};
use keel_store::Compression;
use volume_support::*;

// Proves a new volume reads as zeroes everywhere and stores nothing until written, and a read
// over written and unwritten blocks overwrites every byte of the buffer it is given.
#[test]
fn thin_volume_reads_zeroes_and_uses_no_space() {
    let dir = test_dir("thin");
    let manager = open_manager(&dir);
    manager.create(&VolumeSpec::new("thin", 64 << 20)).unwrap();
    let handle = manager.open_volume("thin").unwrap();
    assert_eq!(handle.size_bytes(), 64 << 20);
    assert_eq!(handle.block_size_bytes(), 4096);
    let mut buf = vec![0xAAu8; 1 << 20];
    handle.read(17 << 20, &mut buf).unwrap();
    assert!(buf.iter().all(|&byte| byte == 0));
    let info = manager.info("thin").unwrap();
    assert_eq!(info.used_bytes, 0);
    assert_eq!(info.stored_bytes, 0);
    handle
        .write(5 * BLOCK, &pattern(1, BLOCK as usize), false)
        .unwrap();
    let info = manager.info("thin").unwrap();
    assert_eq!(info.used_bytes, BLOCK);
    // A read over written and never-written blocks sets every byte of the buffer (a whole
    // copy reads into buffers it used before).
    let mut buf = vec![0xAAu8; 4 * BLOCK as usize];
    handle.read(4 * BLOCK, &mut buf).unwrap();
    let mut expected = vec![0u8; 4 * BLOCK as usize];
    expected[BLOCK as usize..2 * BLOCK as usize].copy_from_slice(&pattern(1, BLOCK as usize));
    assert!(buf == expected, "stale bytes left in the buffer");
}

// Proves writes at arbitrary offsets and lengths (inside a block, across block edges, large
// multi-block ones) read back exactly, against a byte-array model; also those whose bytes the
// caller lends (`write_shared`, a replica's path, storing whole blocks as slices of them).
#[test]
fn unaligned_writes_match_model() {
    let dir = test_dir("unaligned");
    let manager = open_manager(&dir);
    let size = 512 * BLOCK;
    let spec = VolumeSpec {
        compression: Compression::Lz4,
        ..VolumeSpec::new("u", size)
    };
    manager.create(&spec).unwrap();
    let handle = manager.open_volume("u").unwrap();
    let mut model = vec![0u8; size as usize];
    let cases: &[(u64, usize)] = &[
        (0, 1),
        (100, 50),
        (4000, 200),
        (BLOCK - 1, BLOCK as usize + 2),
        (3 * BLOCK, 5 * BLOCK as usize),
        (7 * BLOCK + 7, 20 * BLOCK as usize),
        (size - 10, 10),
        (BLOCK, 1 << 20),
        (12345, 0),
    ];
    for (index, &(offset, length)) in cases.iter().enumerate() {
        let data = pattern(index as u64 + 10, length);
        if index % 2 == 1 {
            // A slice of a larger buffer, as a replica's batch lends each write's bytes.
            let framed = Bytes::from([&[0xEE; 3][..], &data, &[0xEE; 5]].concat());
            let lent = framed.slice(3..3 + length);
            handle.write_shared(offset, &lent, index % 3 == 0).unwrap();
        } else {
            handle.write(offset, &data, index % 3 == 0).unwrap();
        }
        model[offset as usize..offset as usize + length].copy_from_slice(&data);
        assert_same_blocks(&read_all(&handle), &model, &format!("after write {index}"));
    }
    // Reads at odd offsets too.
    let mut buf = vec![0u8; 9999];
    handle.read(4097, &mut buf).unwrap();
    assert_eq!(&buf[..], &model[4097..4097 + 9999]);
    // Out of range is an error, not a partial write.
    let error = handle.write(size - 1, &[1, 2], false).unwrap_err();
    assert!(matches!(error, VolumeError::OutOfRange { .. }), "{error}");
    let error: std::io::Error = handle.read(size, &mut [0u8; 1]).unwrap_err().into();
    assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
}

// Proves concurrent unaligned writes to disjoint byte ranges of the same blocks never lose each
// other's bytes (read-modify-write is serialized per block): 8 threads each own every 8th
// 512-byte sector of 16 blocks.
#[test]
fn concurrent_unaligned_writes_keep_every_sector() {
    let dir = test_dir("concurrent");
    let manager = open_manager(&dir);
    manager.create(&VolumeSpec::new("c", 16 * BLOCK)).unwrap();
    let handle = manager.open_volume("c").unwrap();
    let threads = 8u64;
    let sectors = 16 * BLOCK / 512;
    let mut joins = Vec::new();
    for thread in 0..threads {
        let handle = Arc::clone(&handle);
        joins.push(std::thread::spawn(move || {
            for round in 0..3u64 {
                for sector in (thread..sectors).step_by(threads as usize) {
                    let data = vec![(thread * 16 + round) as u8 + 1; 512];
                    handle.write(sector * 512, &data, false).unwrap();
                }
            }
        }));
    }
    for join in joins {
        join.join().unwrap();
    }
    let bytes = read_all(&handle);
    for sector in 0..sectors {
        let thread = sector % threads;
        let expected = (thread * 16 + 2) as u8 + 1;
        let chunk = &bytes[(sector * 512) as usize..((sector + 1) * 512) as usize];
        assert!(
            chunk.iter().all(|&byte| byte == expected),
            "sector {sector} lost its last write"
        );
    }
}

// Proves trim and write-zeroes make ranges read as zeroes (partial blocks included for
// write-zeroes, excluded for trim) and that trimming freshly written blocks frees their space.
#[test]
fn trim_and_write_zeroes() {
    let dir = test_dir("trim");
    let manager = open_manager(&dir);
    let size = 64 * BLOCK;
    manager.create(&VolumeSpec::new("t", size)).unwrap();
    let handle = manager.open_volume("t").unwrap();
    let data = pattern(3, size as usize);
    handle.write(0, &data, false).unwrap();
    let mut model = data.clone();
    assert_eq!(manager.info("t").unwrap().used_bytes, size);

    handle.trim(10 * BLOCK + 100, 10 * BLOCK).unwrap();
    // Only the whole blocks 11..20 are discarded.
    model[(11 * BLOCK) as usize..(20 * BLOCK) as usize].fill(0);
    assert_same_blocks(&read_all(&handle), &model, "after trim");
    assert_eq!(manager.info("t").unwrap().used_bytes, size - 9 * BLOCK);

    handle
        .write_zeroes(30 * BLOCK + 5, 3 * BLOCK, true, false)
        .unwrap();
    model[(30 * BLOCK + 5) as usize..(33 * BLOCK + 5) as usize].fill(0);
    assert_same_blocks(&read_all(&handle), &model, "after write_zeroes");
    handle
        .write_zeroes(40 * BLOCK + 5, 10, false, true)
        .unwrap();
    model[(40 * BLOCK + 5) as usize..(40 * BLOCK + 15) as usize].fill(0);
    assert_same_blocks(&read_all(&handle), &model, "after small write_zeroes");

    // Trim over a snapshot's data must hide it in the volume but not in the snapshot.
    manager.snapshot_create("t", "s").unwrap();
    handle.trim(0, size).unwrap();
    assert!(read_all(&handle).iter().all(|&byte| byte == 0));
    let snapshot = manager.open_snapshot("t", "s").unwrap();
    assert_same_blocks(&read_all(&snapshot), &model, "snapshot after trim");
    assert!(snapshot.read_only());
    assert!(snapshot.write(0, &[1], false).is_err());
}

// Proves growing shows zeroes past the old end, shrinking needs explicit consent, and data
// past a shrink does not come back when the volume grows again.
#[test]
fn resize_grow_and_shrink() {
    let dir = test_dir("resize");
    let manager = open_manager(&dir);
    manager.create(&VolumeSpec::new("r", 8 * BLOCK)).unwrap();
    let handle = manager.open_volume("r").unwrap();
    let data = pattern(4, 8 * BLOCK as usize);
    handle.write(0, &data, false).unwrap();
    manager.resize("r", 16 * BLOCK, false).unwrap();
    assert_eq!(handle.size_bytes(), 16 * BLOCK);
    let bytes = read_all(&handle);
    assert_same_blocks(&bytes[..8 * BLOCK as usize], &data, "grown head");
    assert!(bytes[8 * BLOCK as usize..].iter().all(|&byte| byte == 0));
    handle
        .write(12 * BLOCK, &pattern(5, BLOCK as usize), false)
        .unwrap();

    assert!(manager.resize("r", 4 * BLOCK, false).is_err());
    assert!(manager.resize("r", 4 * BLOCK + 1, true).is_err());
    manager.resize("r", 4 * BLOCK, true).unwrap();
    assert_eq!(handle.size_bytes(), 4 * BLOCK);
    assert!(handle.read(4 * BLOCK, &mut [0u8; 1]).is_err());
    assert!(handle.write(4 * BLOCK, &[1u8], false).is_err());
    manager.resize("r", 16 * BLOCK, false).unwrap();
    let bytes = read_all(&handle);
    assert_same_blocks(
        &bytes[..4 * BLOCK as usize],
        &data[..4 * BLOCK as usize],
        "kept head",
    );
    assert!(
        bytes[4 * BLOCK as usize..].iter().all(|&byte| byte == 0),
        "shrunk data came back"
    );
    // The shrink deleted the cut blocks' extents.
    assert_eq!(manager.info("r").unwrap().stored_bytes, 4 * BLOCK);
    // Writes past the old cut work again.
    handle
        .write(10 * BLOCK, &pattern(6, BLOCK as usize), false)
        .unwrap();
    let mut buf = vec![0u8; BLOCK as usize];
    handle.read(10 * BLOCK, &mut buf).unwrap();
    assert_eq!(buf, pattern(6, BLOCK as usize));
}

// Proves definitions, data, limits and snapshots survive closing and reopening the store, and
// that delete removes every block and the name.
#[test]
fn reopen_list_info_delete() {
    let dir = test_dir("reopen");
    {
        let manager = open_manager(&dir);
        let spec = VolumeSpec {
            compression: Compression::Zstd,
            iops_max: Some(100_000),
            bandwidth_max_mib_per_second: Some(1000),
            ..VolumeSpec::new("a", 32 * BLOCK)
        };
        manager.create(&spec).unwrap();
        manager.create(&VolumeSpec::new("b", 8 * BLOCK)).unwrap();
        assert!(matches!(
            manager.create(&VolumeSpec::new("a", 8 * BLOCK)),
            Err(VolumeError::AlreadyExists { .. })
        ));
        assert!(manager
            .create(&VolumeSpec::new("bad/name", 8 * BLOCK))
            .is_err());
        let handle = manager.open_volume("a").unwrap();
        handle
            .write(0, &pattern(7, 32 * BLOCK as usize), false)
            .unwrap();
        handle.flush().unwrap();
        manager.snapshot_create("a", "s1").unwrap();
        handle.write(0, &pattern(8, BLOCK as usize), true).unwrap();
    }
    let manager = open_manager(&dir);
    let list = manager.list();
    assert_eq!(
        list.iter()
            .map(|volume| volume.name.as_str())
            .collect::<Vec<_>>(),
        vec!["a", "b"]
    );
    let a = &list[0];
    assert_eq!(a.compression, Compression::Zstd);
    assert_eq!(a.iops_max, Some(100_000));
    assert_eq!(a.bandwidth_max_mib_per_second, Some(1000));
    assert_eq!(a.snapshots, 1);
    let handle = manager.open_volume("a").unwrap();
    let mut expected = pattern(7, 32 * BLOCK as usize);
    expected[..BLOCK as usize].copy_from_slice(&pattern(8, BLOCK as usize));
    assert_same_blocks(&read_all(&handle), &expected, "after reopen");
    let info = manager.info("a").unwrap();
    assert_eq!(info.used_bytes, 32 * BLOCK);
    assert_eq!(info.stored_bytes, 33 * BLOCK);
    assert_eq!(info.snapshots.len(), 1);
    assert_eq!(info.snapshots[0].referenced_bytes, Some(32 * BLOCK));
    assert_eq!(info.snapshots[0].unique_bytes, Some(BLOCK));
    assert_eq!(info.block_size_bytes, BLOCK_SIZE_BYTES);

    let mut progress_calls = 0;
    manager.delete("a", &mut |_| progress_calls += 1).unwrap();
    assert!(progress_calls >= 1);
    assert!(matches!(
        manager.open_volume("a"),
        Err(VolumeError::NotFound { .. })
    ));
    assert!(
        handle.read(0, &mut [0u8; 1]).is_err(),
        "a handle on a deleted volume must fail"
    );
    let store = manager.store();
    let blocks = store
        .keys(
            &keel_store::block_key(0, 0, 0),
            &[keel_store::Keyspace::Block as u8 + 1],
            10,
        )
        .unwrap();
    assert!(
        blocks.is_empty(),
        "deleted volume left {} extents",
        blocks.len()
    );
    drop(handle);
    drop(manager);
    let manager = open_manager(&dir);
    assert_eq!(manager.list().len(), 1);
    // The name is free again, and the new volume is empty.
    manager.create(&VolumeSpec::new("a", 8 * BLOCK)).unwrap();
    let handle = manager.open_volume("a").unwrap();
    assert!(read_all(&handle).iter().all(|&byte| byte == 0));
}

// Proves the types the NBD server and the async admin API share across threads are Send and
// Sync (a compile-time check: this test fails to build otherwise).
#[test]
fn shared_types_are_thread_safe() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<keel_namespace::volume::VolumeManager>();
    send_sync::<keel_namespace::volume::VolumeHandle>();
    send::<keel_namespace::volume::SendStream>();
    send_sync::<VolumeError>();
}

// Proves `range_unwritten` (what resyncs of sparse volumes skip by): true only where no block
// holds an extent, in the volume or in a parent a clone reads through.
#[test]
fn unwritten_ranges_are_told_apart_from_written_ones() {
    let dir = test_dir("unwritten");
    let manager = open_manager(&dir);
    let chunk = 256 * BLOCK;
    manager
        .create(&VolumeSpec::new("sparse", 8 * chunk))
        .unwrap();
    let handle = manager.open_volume("sparse").unwrap();
    for index in 0..8 {
        assert!(handle.range_unwritten(index * chunk, chunk).unwrap());
    }
    handle
        .write(chunk + 7 * BLOCK, &pattern(3, 100), false)
        .unwrap();
    handle
        .write(4 * chunk, &pattern(4, BLOCK as usize), false)
        .unwrap();
    // Written then trimmed or zeroed, and trimmed or zeroed without ever being written: they
    // read as zeroes, whatever extents (none, or empty ones) say so.
    handle
        .write(3 * chunk, &pattern(5, BLOCK as usize), false)
        .unwrap();
    handle.trim(3 * chunk, 4 * BLOCK).unwrap();
    handle
        .write(5 * chunk, &pattern(6, BLOCK as usize), false)
        .unwrap();
    handle.write_zeroes(5 * chunk, BLOCK, false, false).unwrap();
    handle.trim(6 * chunk, chunk).unwrap();
    let unwritten: Vec<bool> = (0..8)
        .map(|index| handle.range_unwritten(index * chunk, chunk).unwrap())
        .collect();
    assert_eq!(
        (
            unwritten[0],
            unwritten[1],
            unwritten[2],
            unwritten[4],
            unwritten[7]
        ),
        (true, false, true, false, true)
    );
    // The invariant a resync relies on: an unwritten range reads as zeroes.
    for (index, &none) in unwritten.iter().enumerate() {
        let mut data = vec![0xAAu8; chunk as usize];
        handle.read(index as u64 * chunk, &mut data).unwrap();
        if none {
            assert!(data.iter().all(|&byte| byte == 0), "chunk {index}");
        }
    }
    // The last block of a range and the first of the next are told apart.
    assert!(handle.range_unwritten(chunk, 7 * BLOCK).unwrap());
    assert!(!handle.range_unwritten(chunk, 8 * BLOCK).unwrap());

    // A clone reads through its parent: the parent's written blocks are not unwritten there.
    manager.snapshot_create("sparse", "s").unwrap();
    manager.clone_volume("sparse", "s", "child").unwrap();
    let child = manager.open_volume("child").unwrap();
    assert!(!child.range_unwritten(chunk, chunk).unwrap());
    assert!(child.range_unwritten(2 * chunk, chunk).unwrap());
}
