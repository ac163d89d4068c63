//! Send/receive between two independent stores: full and incremental streams reproduce every
//! block, and bad streams (missing base, corruption, truncation) are refused with no visible
//! change on the receiving side.
#![allow(clippy::unwrap_used)]

mod volume_support;

use std::io::Read;

use keel_namespace::volume::{VolumeError, VolumeManager, VolumeSpec};
use volume_support::*;

const SIZE: u64 = 512 * BLOCK;

fn send_bytes(manager: &VolumeManager, volume: &str, base: Option<&str>, target: &str) -> Vec<u8> {
    let mut stream = manager.send(volume, base, target).unwrap();
    let mut bytes = Vec::new();
    // Small reads exercise the stream's buffering.
    let mut chunk = [0u8; 1000];
    loop {
        let count = stream.read(&mut chunk).unwrap();
        if count == 0 {
            break;
        }
        bytes.extend_from_slice(&chunk[..count]);
    }
    bytes
}

/// A source volume with two snapshots: "s1" (sparse data) and "s2" (overwrites, trims,
/// unaligned writes, a grow).
fn source(dir: &std::path::Path) -> (VolumeManager, Vec<u8>, Vec<u8>) {
    let manager = open_manager(dir);
    manager.create(&VolumeSpec::new("src", SIZE)).unwrap();
    let handle = manager.open_volume("src").unwrap();
    let mut model = vec![0u8; SIZE as usize];
    for (index, block) in [0u64, 1, 2, 50, 51, 200, 511].into_iter().enumerate() {
        let data = pattern(100 + index as u64, BLOCK as usize);
        handle.write(block * BLOCK, &data, false).unwrap();
        model[(block * BLOCK) as usize..((block + 1) * BLOCK) as usize].copy_from_slice(&data);
    }
    handle
        .write(100 * BLOCK, &pattern(1, 30 * BLOCK as usize), false)
        .unwrap();
    model[(100 * BLOCK) as usize..(130 * BLOCK) as usize]
        .copy_from_slice(&pattern(1, 30 * BLOCK as usize));
    manager.snapshot_create("src", "s1").unwrap();
    let s1 = model.clone();
    handle
        .write(BLOCK + 7, &pattern(2, 3 * BLOCK as usize), false)
        .unwrap();
    model[(BLOCK + 7) as usize..(4 * BLOCK + 7) as usize]
        .copy_from_slice(&pattern(2, 3 * BLOCK as usize));
    handle.trim(100 * BLOCK, 10 * BLOCK).unwrap();
    model[(100 * BLOCK) as usize..(110 * BLOCK) as usize].fill(0);
    handle
        .write_zeroes(511 * BLOCK, BLOCK, false, true)
        .unwrap();
    model[(511 * BLOCK) as usize..].fill(0);
    manager.resize("src", SIZE + 8 * BLOCK, false).unwrap();
    model.resize((SIZE + 8 * BLOCK) as usize, 0);
    handle
        .write(SIZE + 2 * BLOCK, &pattern(3, BLOCK as usize), false)
        .unwrap();
    model[(SIZE + 2 * BLOCK) as usize..(SIZE + 3 * BLOCK) as usize]
        .copy_from_slice(&pattern(3, BLOCK as usize));
    manager.snapshot_create("src", "s2").unwrap();
    // Changes after s2 must not travel.
    handle.write(0, &pattern(4, BLOCK as usize), false).unwrap();
    (manager, s1, model)
}

// Proves a full stream of s1 then an incremental s1→s2 reproduce both snapshots block for
// block on another store, that the incremental stream carries only the changed blocks, and
// that a further incremental from the received side's point of view chains by GUID.
#[test]
fn full_and_incremental_reproduce_every_block() {
    let (source_manager, s1, s2) = source(&test_dir("stream-src"));
    let target_dir = test_dir("stream-dst");
    let target = open_manager(&target_dir);

    let full = send_bytes(&source_manager, "src", None, "s1");
    let report = target.receive(&mut full.as_slice(), "dst").unwrap();
    assert!(!report.incremental);
    assert_eq!(report.blocks, 7 + 30);
    assert_eq!(report.stream_bytes, full.len() as u64);
    assert_same_blocks(
        &read_all(&target.open_volume("dst").unwrap()),
        &s1,
        "full receive",
    );
    assert_same_blocks(
        &read_all(&target.open_snapshot("dst", "s1").unwrap()),
        &s1,
        "received s1",
    );

    let incremental = send_bytes(&source_manager, "src", Some("s1"), "s2");
    assert!(
        incremental.len() < full.len() / 2,
        "incremental stream is {} bytes",
        incremental.len()
    );
    let report = target.receive(&mut incremental.as_slice(), "dst").unwrap();
    assert!(report.incremental);
    // Blocks 1..=4 (unaligned write), block SIZE+2; trims: 100..110 and 511.
    assert_eq!(report.blocks, 5);
    assert_eq!(report.trimmed_blocks, 11);
    assert_same_blocks(
        &read_all(&target.open_volume("dst").unwrap()),
        &s2,
        "incremental receive",
    );
    assert_same_blocks(
        &read_all(&target.open_snapshot("dst", "s2").unwrap()),
        &s2,
        "received s2",
    );
    assert_same_blocks(
        &read_all(&target.open_snapshot("dst", "s1").unwrap()),
        &s1,
        "s1 still there",
    );
    // The GUIDs match on both sides.
    let source_info = source_manager.info("src").unwrap();
    let target_info = target.info("dst").unwrap();
    let guids = |info: &keel_namespace::volume::VolumeInfo| -> Vec<(String, String)> {
        info.snapshots
            .iter()
            .map(|snapshot| (snapshot.name.clone(), snapshot.guid.clone()))
            .collect()
    };
    assert_eq!(guids(&source_info), guids(&target_info));

    // Received data survives a reopen of the receiving store.
    drop(target);
    let target = open_manager(&target_dir);
    assert_same_blocks(
        &read_all(&target.open_volume("dst").unwrap()),
        &s2,
        "after reopen",
    );

    // A stream can also be sent back from the receiving side (full, of what it received).
    let back = send_bytes(&target, "dst", Some("s1"), "s2");
    let third = open_manager(&test_dir("stream-third"));
    third
        .receive(
            &mut send_bytes(&target, "dst", None, "s1").as_slice(),
            "copy",
        )
        .unwrap();
    third.receive(&mut back.as_slice(), "copy").unwrap();
    assert_same_blocks(
        &read_all(&third.open_volume("copy").unwrap()),
        &s2,
        "relayed copy",
    );
}

// Proves an incremental stream is refused when the receiver lacks its base (volume missing, or
// volume without that snapshot), and that nothing changes on the receiver.
#[test]
fn receive_refuses_missing_base() {
    let (source_manager, _, _) = source(&test_dir("base-src"));
    let target = open_manager(&test_dir("base-dst"));
    let incremental = send_bytes(&source_manager, "src", Some("s1"), "s2");
    let error = target
        .receive(&mut incremental.as_slice(), "dst")
        .unwrap_err();
    assert!(matches!(error, VolumeError::BaseMissing { .. }), "{error}");
    assert!(target.list().is_empty());

    // A volume of the same name whose s1 is a different snapshot (other GUID).
    target.create(&VolumeSpec::new("dst", SIZE)).unwrap();
    target.snapshot_create("dst", "s1").unwrap();
    let error = target
        .receive(&mut incremental.as_slice(), "dst")
        .unwrap_err();
    assert!(matches!(error, VolumeError::BaseMissing { .. }), "{error}");
    let info = target.info("dst").unwrap();
    assert_eq!(info.snapshots.len(), 1);
    assert_eq!(info.stored_bytes, 0);
    // A full stream into an existing name is refused too.
    let full = send_bytes(&source_manager, "src", None, "s1");
    assert!(matches!(
        target.receive(&mut full.as_slice(), "dst"),
        Err(VolumeError::AlreadyExists { .. })
    ));
}

// Proves corrupted streams (a flipped bit in a block, in a length, in the trailer's hash) and
// truncated streams (cut at many points) are refused with a stream error, and leave no volume,
// snapshot or stored block behind.
#[test]
fn receive_refuses_corrupt_and_truncated_streams() {
    let (source_manager, s1, s2) = source(&test_dir("corrupt-src"));
    let full = send_bytes(&source_manager, "src", None, "s1");
    let incremental = send_bytes(&source_manager, "src", Some("s1"), "s2");
    let target = open_manager(&test_dir("corrupt-dst"));
    let store = target.store().clone();
    let block_extents = || {
        store
            .keys(
                &keel_store::block_key(0, 0, 0),
                &[keel_store::Keyspace::Block as u8 + 1],
                100_000,
            )
            .unwrap()
            .len()
    };

    let length = full.len();
    let flips = [9usize, 30, 200, length / 2, length - 40, length - 3];
    for position in flips {
        let mut bad = full.clone();
        bad[position] ^= 0x10;
        let error = target.receive(&mut bad.as_slice(), "dst").unwrap_err();
        assert!(
            matches!(error, VolumeError::Stream { .. }),
            "flip at {position}: {error}"
        );
        assert!(target.list().is_empty(), "flip at {position} left a volume");
        assert_eq!(block_extents(), 0, "flip at {position} left blocks");
    }
    for cut in [0usize, 5, 8, 20, 100, length / 3, length - 50, length - 1] {
        let error = target.receive(&mut &full[..cut], "dst").unwrap_err();
        assert!(
            matches!(error, VolumeError::Stream { .. }),
            "cut at {cut}: {error}"
        );
        assert!(target.list().is_empty(), "cut at {cut} left a volume");
        assert_eq!(block_extents(), 0, "cut at {cut} left blocks");
    }
    let mut longer = full.clone();
    longer.push(0);
    assert!(target.receive(&mut longer.as_slice(), "dst").is_err());
    assert!(target.list().is_empty());

    // Incremental: a corrupt stream leaves the received base exactly as it was.
    target.receive(&mut full.as_slice(), "dst").unwrap();
    let stored_before = target.info("dst").unwrap().stored_bytes;
    let mut bad = incremental.clone();
    let middle = bad.len() / 2;
    bad[middle] ^= 1;
    assert!(target.receive(&mut bad.as_slice(), "dst").is_err());
    assert!(target
        .receive(&mut &incremental[..incremental.len() - 10], "dst")
        .is_err());
    let info = target.info("dst").unwrap();
    assert_eq!(info.snapshots.len(), 1);
    assert_eq!(
        info.stored_bytes, stored_before,
        "a failed receive left blocks"
    );
    assert_same_blocks(
        &read_all(&target.open_volume("dst").unwrap()),
        &s1,
        "after failed incremental",
    );
    target.receive(&mut incremental.as_slice(), "dst").unwrap();
    assert_same_blocks(
        &read_all(&target.open_volume("dst").unwrap()),
        &s2,
        "after good incremental",
    );
}

/// Delivers `bytes`, pausing once after `pause_at` bytes until told to go on.
struct PausingReader {
    bytes: Vec<u8>,
    position: usize,
    pause_at: usize,
    paused: Option<std::sync::mpsc::Sender<()>>,
    resume: std::sync::mpsc::Receiver<()>,
}

impl Read for PausingReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.position >= self.pause_at {
            if let Some(paused) = self.paused.take() {
                paused.send(()).unwrap();
                self.resume
                    .recv_timeout(std::time::Duration::from_secs(30))
                    .unwrap();
            }
        }
        let limit = if self.position < self.pause_at {
            self.pause_at
        } else {
            self.bytes.len()
        };
        let count = out.len().min(limit - self.position);
        out[..count].copy_from_slice(&self.bytes[self.position..self.position + count]);
        self.position += count;
        Ok(count)
    }
}

// Proves the garbage collector leaves alone the blocks an incremental receive has already
// written but not yet committed: a collection (and a snapshot deletion) run while the receive
// is paused near the end of its stream, and the receive then completes with every block right.
#[test]
fn collector_spares_blocks_of_a_receive_in_progress() {
    let source_manager = open_manager(&test_dir("pause-src"));
    source_manager
        .create(&VolumeSpec::new("src", SIZE))
        .unwrap();
    let handle = source_manager.open_volume("src").unwrap();
    handle.write(0, &pattern(1, SIZE as usize), false).unwrap();
    source_manager.snapshot_create("src", "a").unwrap();
    let b = pattern(2, SIZE as usize);
    handle.write(0, &b, false).unwrap();
    source_manager.snapshot_create("src", "b").unwrap();
    let full = send_bytes(&source_manager, "src", None, "a");
    let incremental = send_bytes(&source_manager, "src", Some("a"), "b");

    let target = std::sync::Arc::new(open_manager(&test_dir("pause-dst")));
    target.receive(&mut full.as_slice(), "dst").unwrap();
    target.snapshot_create("dst", "local").unwrap();
    let (paused_sender, paused) = std::sync::mpsc::channel();
    let (resume, resume_receiver) = std::sync::mpsc::channel();
    let reader = PausingReader {
        pause_at: incremental.len() * 9 / 10,
        bytes: incremental,
        position: 0,
        paused: Some(paused_sender),
        resume: resume_receiver,
    };
    let receiver = {
        let target = target.clone();
        std::thread::spawn(move || {
            let mut reader = reader;
            target.receive(&mut reader, "dst")
        })
    };
    paused
        .recv_timeout(std::time::Duration::from_secs(30))
        .unwrap();
    // 90% of 512 blocks were read, so at least one batch of 256 is handed to the store's
    // writer (its own thread): collect until the collector sees it, deleting nothing.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let report = target.collect_garbage("dst", &mut |_| {}).unwrap();
        assert_eq!(report.extents_deleted, 0, "{report:?}");
        if report.extents_scanned > 512 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the receive's first batch never landed: {report:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    target.snapshot_delete("dst", "local", &mut |_| {}).unwrap();
    resume.send(()).unwrap();
    receiver.join().unwrap().unwrap();
    assert_same_blocks(
        &read_all(&target.open_volume("dst").unwrap()),
        &b,
        "after the paused receive",
    );
}

// Proves the stream's checksum is what docs/volumes.md says, whatever pieces the sender and
// the receiver hash it in: the BLAKE3 of every byte before the trailer record. A stream of
// 600 written blocks (three chunks of the sender, over 2 MiB: several batches of the
// receiver's hashing) is walked record by record; the hash is the trailer's last 32 bytes
// (postcard writes the array as is, last). Another store receives it. Streams kept as
// backups must stay receivable by later builds.
/// A full stream of a snapshot of 600 written blocks (of 700), and the volume it was sent from.
fn stream_of_600_blocks(dir: &str) -> (Vec<u8>, Vec<u8>) {
    let manager = open_manager(&test_dir(dir));
    manager
        .create(&VolumeSpec::new("big", 700 * BLOCK))
        .unwrap();
    let handle = manager.open_volume("big").unwrap();
    handle
        .write(50 * BLOCK, &pattern(7, 600 * BLOCK as usize), false)
        .unwrap();
    manager.snapshot_create("big", "s").unwrap();
    (send_bytes(&manager, "big", None, "s"), read_all(&handle))
}

/// A volume manager on a store on a simulated disk seeded with `seed`, and the disk.
fn on_simulated_disk(seed: u64) -> (keel_store::simdisk::SimDisk, VolumeManager) {
    let disk = keel_store::simdisk::SimDisk::new(seed);
    let mut config = keel_store::StoreConfig::new(vec![std::path::PathBuf::from("/sim/data")]);
    config.disk = std::sync::Arc::new(disk.clone());
    config.reserve_bytes = 0;
    let store = keel_store::Store::open(config).unwrap();
    let metadata: std::sync::Arc<dyn keel_catalog::Metadata> =
        std::sync::Arc::new(keel_catalog::LocalCatalog::open(store.clone()).unwrap());
    (disk, VolumeManager::open(store, metadata).unwrap())
}

#[test]
fn a_stream_s_checksum_is_the_blake3_of_every_byte_before_its_trailer() {
    let (bytes, sent) = stream_of_600_blocks("stream-checksum-src");
    let mut offset = 8;
    let mut records = 0;
    let (trailer_at, payload) = loop {
        let tag = bytes[offset];
        let length = u32::from_le_bytes(bytes[offset + 1..offset + 5].try_into().unwrap()) as usize;
        let payload = &bytes[offset + 5..offset + 5 + length];
        if tag == 4 {
            break (offset, payload);
        }
        records += 1;
        offset += 5 + length + 4;
    };
    // The header, then a record per block.
    assert_eq!(records, 1 + 600);
    assert_eq!(trailer_at + 5 + payload.len() + 4, bytes.len());
    assert_eq!(
        blake3::hash(&bytes[..trailer_at]).as_bytes(),
        &payload[payload.len() - 32..],
        "the trailer's hash is not the BLAKE3 of the bytes before it"
    );
    let target = open_manager(&test_dir("stream-checksum-dst"));
    let report = target.receive(&mut bytes.as_slice(), "copy").unwrap();
    assert_eq!(report.blocks, 600);
    assert_same_blocks(
        &read_all(&target.open_volume("copy").unwrap()),
        &sent,
        "received copy",
    );
}

// Proves a receive whose store writes fail ends with the store's error, neither hanging nor
// leaving a volume behind: a full stream of 600 blocks (three batches, which the receive's
// writer thread writes while the next are read) goes to a store on a simulated disk where a
// write fails with ENOSPC once the volume is made. The receive answers the store's error,
// `dst` is not there and its name is freed; the same stream is then received whole.
#[test]
fn a_receive_whose_writes_fail_answers_the_store_error_and_leaves_nothing() {
    use keel_store::simdisk::FaultOp;
    let (bytes, sent) = stream_of_600_blocks("stream-enospc-src");

    let (disk, target) = on_simulated_disk(11);
    const ENOSPC: i32 = 28;
    disk.inject(FaultOp::Write, "/sim/data", ENOSPC, 2, 1);
    let error = target.receive(&mut bytes.as_slice(), "dst").unwrap_err();
    let message = error.to_string();
    assert!(message.contains("received blocks"), "{message}");
    disk.clear_faults();
    assert!(
        target.open_volume("dst").is_err(),
        "a failed receive left dst behind"
    );
    // The half-received volume is erased in the background; its name is free once it is.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let report = loop {
        match target.receive(&mut bytes.as_slice(), "dst") {
            Err(VolumeError::AlreadyExists { .. }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            received => break received.unwrap(),
        }
    };
    assert_eq!(report.blocks, 600);
    assert_same_blocks(
        &read_all(&target.open_volume("dst").unwrap()),
        &sent,
        "received after the fault",
    );
}

/// A received stream is written around the page cache (nothing reads a volume while it
/// arrives): on a simulated disk, its blocks go out as direct writes, and read back whole.
#[test]
fn a_received_stream_is_written_around_the_page_cache() {
    let (bytes, sent) = stream_of_600_blocks("stream-direct-src");

    let (disk, target) = on_simulated_disk(12);
    let before = disk.direct_bytes();
    let report = target.receive(&mut bytes.as_slice(), "dst").unwrap();
    assert_eq!(report.blocks, 600);
    let direct = disk.direct_bytes() - before;
    assert!(
        direct >= 300 * BLOCK,
        "only {direct} bytes of 600 blocks were written direct"
    );
    assert_same_blocks(
        &read_all(&target.open_volume("dst").unwrap()),
        &sent,
        "received around the cache",
    );
}
