//! Concurrency: writers on several threads, while snapshots are taken and deleted and the
//! garbage collector runs in a loop. Each block carries the sequence number of its write, so we
//! can check two things:
//! - every snapshot shows, for each block, a write that started before the snapshot returned,
//!   and nothing older than the last write acknowledged before the snapshot began;
//! - snapshots (and the volume) are never torn and never lose data to the concurrent collector.
#![allow(clippy::unwrap_used)]

mod volume_support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use keel_namespace::volume::VolumeSpec;
use volume_support::*;

const THREADS: u64 = 4;
const BLOCKS_PER_THREAD: u64 = 16;
/// Hole-marker extents placed before the written blocks, so that each collector pass spends
/// time paging through keys before it reaches them: snapshots and writes then land between
/// the collector's capture of the views and its visit of the blocks.
const BALLAST_BLOCKS: u64 = 20_000;

fn offset(block: u64) -> u64 {
    (BALLAST_BLOCKS + block) * BLOCK
}

fn read_active(handle: &dyn keel_namespace::volume::VolumeIo, blocks: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; (blocks * BLOCK) as usize];
    handle.read(offset(0), &mut bytes).unwrap();
    bytes
}
const WRITES_PER_THREAD: u64 = 400;
const SNAPSHOTS: usize = 12;

/// Bytes below this depend on the write; the rest of a block is the same for every write to
/// it, so a partial write of the head yields a whole valid image (through read-modify-write).
const HEAD_BYTES: usize = 3000;

fn image(block: u64, seq: u64) -> Vec<u8> {
    let mut data = pattern(block * 1_000_003 + seq, HEAD_BYTES);
    data[..8].copy_from_slice(&seq.to_le_bytes());
    data.extend_from_slice(&pattern(block, BLOCK as usize)[HEAD_BYTES..]);
    data
}

fn seq_in(data: &[u8], block: u64) -> u64 {
    let seq = u64::from_le_bytes(data[..8].try_into().unwrap());
    let expected = image(block, seq);
    let first_difference = data.iter().zip(&expected).position(|(a, b)| a != b);
    assert!(
        first_difference.is_none(),
        "block {block} is torn: write {seq}, first difference at byte {first_difference:?}, zero block: {}",
        data.iter().all(|&byte| byte == 0)
    );
    seq
}

// See the file comment.
#[test]
fn snapshots_and_collector_under_concurrent_writes() {
    let dir = test_dir("concurrency");
    let manager = Arc::new(open_manager(&dir));
    let blocks = THREADS * BLOCKS_PER_THREAD;
    manager
        .create(&VolumeSpec::new("busy", (BALLAST_BLOCKS + blocks) * BLOCK))
        .unwrap();
    let handle = manager.open_volume("busy").unwrap();
    // Sequence 0 everywhere first, so every block always holds some write.
    let zeroes = vec![0u8; 8 << 20];
    for chunk in 0..BALLAST_BLOCKS * BLOCK / zeroes.len() as u64 {
        handle
            .write(chunk * zeroes.len() as u64, &zeroes, false)
            .unwrap();
    }
    for block in 0..blocks {
        handle
            .write(offset(block), &image(block, 0), false)
            .unwrap();
    }
    let started: Arc<Vec<AtomicU64>> = Arc::new((0..blocks).map(|_| AtomicU64::new(0)).collect());
    let acknowledged: Arc<Vec<AtomicU64>> =
        Arc::new((0..blocks).map(|_| AtomicU64::new(0)).collect());
    let done = Arc::new(AtomicBool::new(false));

    let mut writers = Vec::new();
    for thread in 0..THREADS {
        let handle = handle.clone();
        let started = started.clone();
        let acknowledged = acknowledged.clone();
        writers.push(std::thread::spawn(move || {
            for seq in 1..=WRITES_PER_THREAD {
                let block = thread * BLOCKS_PER_THREAD + seq % BLOCKS_PER_THREAD;
                started[block as usize].store(seq, Ordering::SeqCst);
                let data = image(block, seq);
                if seq % 3 == 0 {
                    // Only the head: a read-modify-write that must keep the tail.
                    handle
                        .write(offset(block), &data[..HEAD_BYTES], seq % 2 == 0)
                        .unwrap();
                } else {
                    handle.write(offset(block), &data, false).unwrap();
                }
                acknowledged[block as usize].store(seq, Ordering::SeqCst);
            }
        }));
    }
    let collector = {
        let manager = manager.clone();
        let done = done.clone();
        std::thread::spawn(move || {
            let mut passes = 0u64;
            while !done.load(Ordering::SeqCst) && passes < 10_000 {
                manager.collect_garbage("busy", &mut |_| {}).unwrap();
                passes += 1;
            }
            passes
        })
    };

    // Snapshots with the bounds each block must fall in; every third one is deleted again.
    let mut kept: Vec<(String, Vec<u64>, Vec<u64>)> = Vec::new();
    for index in 0..SNAPSHOTS {
        let lower: Vec<u64> = acknowledged
            .iter()
            .map(|seq| seq.load(Ordering::SeqCst))
            .collect();
        let name = format!("s{index}");
        manager.snapshot_create("busy", &name).unwrap();
        let upper: Vec<u64> = started
            .iter()
            .map(|seq| seq.load(Ordering::SeqCst))
            .collect();
        if index % 3 == 2 {
            manager.snapshot_delete("busy", &name, &mut |_| {}).unwrap();
        } else {
            kept.push((name, lower, upper));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    for writer in writers {
        writer.join().unwrap();
    }
    done.store(true, Ordering::SeqCst);
    let passes = collector.join().unwrap();
    assert!(passes > 0);

    for (name, lower, upper) in &kept {
        let frozen = manager.open_snapshot("busy", name).unwrap();
        let bytes = read_active(frozen.as_ref(), blocks);
        for block in 0..blocks {
            let data = &bytes[(block * BLOCK) as usize..((block + 1) * BLOCK) as usize];
            let seq = seq_in(data, block);
            let (low, high) = (lower[block as usize], upper[block as usize]);
            assert!(
                (low..=high).contains(&seq),
                "snapshot {name} block {block}: write {seq} outside [{low}, {high}]"
            );
        }
    }
    let bytes = read_active(handle.as_ref(), blocks);
    for block in 0..blocks {
        let data = &bytes[(block * BLOCK) as usize..((block + 1) * BLOCK) as usize];
        assert_eq!(
            seq_in(data, block),
            acknowledged[block as usize].load(Ordering::SeqCst),
            "volume block {block}"
        );
    }
}
