//! Crash consistency at the process level: a child process writes to a volume (buffered writes,
//! FUA writes, flushes, snapshots) and is killed with SIGKILL at a random moment; the parent
//! reopens the store and checks the durability contract of `docs/volumes.md`:
//! - every write acknowledged before a returned FLUSH or FUA write is there;
//! - the volume holds a prefix of the write sequence (no later write without every earlier one);
//! - every snapshot that exists shows exactly the writes before it.
//!
//! Write `seq` goes to block `seq % BLOCKS` and carries `seq` in its first 8 bytes, so the
//! expected image after any prefix is computable. Three kill/reopen rounds continue the sequence.
#![allow(clippy::unwrap_used)]

mod volume_support;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use keel_namespace::volume::{VolumeIo, VolumeSpec};
use volume_support::*;

const BLOCKS: u64 = 256;
const WRITES_MAX: u64 = 400_000;
const CHILD_TIME_MAX: Duration = Duration::from_secs(30);
const SNAPSHOTS_MAX: u64 = 20;
const ROUNDS: usize = 3;

fn block_image(seq: u64) -> Vec<u8> {
    let mut data = pattern(seq + 1, BLOCK as usize);
    data[..8].copy_from_slice(&seq.to_le_bytes());
    data
}

/// The seq each block shows after writes `0..=last` (None: never written).
fn expected_after(last: Option<u64>, block: u64) -> Option<u64> {
    let last = last?;
    (last >= block).then(|| last - (last - block) % BLOCKS)
}

fn seq_of(data: &[u8], block: u64) -> Option<u64> {
    if data.iter().all(|&byte| byte == 0) {
        return None;
    }
    let seq = u64::from_le_bytes(data[..8].try_into().unwrap());
    assert_eq!(
        seq % BLOCKS,
        block,
        "block {block} holds write {seq} of another block"
    );
    assert!(
        data == block_image(seq).as_slice(),
        "block {block}: write {seq} is torn"
    );
    Some(seq)
}

fn image_seqs(handle: &dyn VolumeIo) -> Vec<Option<u64>> {
    let bytes = read_all(handle);
    bytes
        .chunks(BLOCK as usize)
        .enumerate()
        .map(|(block, data)| seq_of(data, block as u64))
        .collect()
}

// Child half of `crash_keeps_flushed_prefix` (run only by it, in a separate process).
#[test]
#[ignore = "child process of crash_keeps_flushed_prefix"]
fn crash_child_writer() {
    let dir = std::env::var("KEEL_VOLUME_CRASH_DIR").expect("run by crash_keeps_flushed_prefix");
    let acks = std::env::var("KEEL_VOLUME_CRASH_ACKS").unwrap();
    let start: u64 = std::env::var("KEEL_VOLUME_CRASH_START")
        .unwrap()
        .parse()
        .unwrap();
    let manager = open_manager(Path::new(&dir));
    if manager.list().is_empty() {
        manager
            .create(&VolumeSpec::new("crash", BLOCKS * BLOCK))
            .unwrap();
    }
    let handle = manager.open_volume("crash").unwrap();
    let mut ack_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&acks)
        .unwrap();
    let mut acknowledge = |seq: u64| {
        writeln!(ack_file, "{seq}").unwrap();
        ack_file.sync_data().unwrap();
    };
    let mut snapshots = manager.info("crash").unwrap().snapshots.len() as u64;
    let began = Instant::now();
    for seq in start..start + WRITES_MAX {
        if began.elapsed() > CHILD_TIME_MAX {
            break;
        }
        let fua = seq % 37 == 0;
        handle
            .write((seq % BLOCKS) * BLOCK, &block_image(seq), fua)
            .unwrap();
        if fua {
            acknowledge(seq);
        }
        if seq % 16 == 15 {
            handle.flush().unwrap();
            acknowledge(seq);
        }
        if seq % 250 == 0 && snapshots < SNAPSHOTS_MAX {
            manager
                .snapshot_create("crash", &format!("at-{seq}"))
                .unwrap();
            snapshots += 1;
        }
    }
    // Wait to be killed (bounded).
    std::thread::sleep(CHILD_TIME_MAX);
}

// See the file comment.
#[test]
fn crash_keeps_flushed_prefix() {
    let dir = test_dir("crash");
    let acks = dir.join("acks");
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let mut next_seq = 0u64;
    let mut acknowledged_max: Option<u64> = None;
    for round in 0..ROUNDS {
        let _ = std::fs::remove_file(&acks);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "crash_child_writer",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("KEEL_VOLUME_CRASH_DIR", &data)
            .env("KEEL_VOLUME_CRASH_ACKS", &acks)
            .env("KEEL_VOLUME_CRASH_START", next_seq.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        // Let it acknowledge a few flushes, then kill it at a moment that varies per run.
        let began = Instant::now();
        loop {
            let lines = std::fs::read_to_string(&acks)
                .map(|text| text.lines().count())
                .unwrap_or(0);
            if lines >= 100 || began.elapsed() > Duration::from_secs(10) {
                break;
            }
            assert!(
                child.try_wait().unwrap().is_none(),
                "round {round}: child exited early"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let jitter = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
            % 40;
        std::thread::sleep(Duration::from_millis(jitter as u64));
        child.kill().unwrap();
        child.wait().unwrap();
        let round_acknowledged = std::fs::read_to_string(&acks)
            .unwrap()
            .lines()
            .filter_map(|line| line.parse::<u64>().ok())
            .max();
        assert!(
            round_acknowledged.is_some(),
            "round {round}: nothing acknowledged"
        );
        acknowledged_max = acknowledged_max.max(round_acknowledged);

        let manager = open_manager(&data);
        let handle = manager.open_volume("crash").unwrap();
        let seqs = image_seqs(handle.as_ref());
        let last = seqs.iter().flatten().copied().max();
        assert!(
            last >= acknowledged_max,
            "round {round}: newest write present is {last:?}, but {acknowledged_max:?} was flushed"
        );
        for (block, seq) in seqs.iter().enumerate() {
            assert_eq!(
                *seq,
                expected_after(last, block as u64),
                "round {round}: block {block} breaks the prefix ending at write {last:?}"
            );
        }
        let info = manager.info("crash").unwrap();
        for snapshot in &info.snapshots {
            let taken_after: u64 = snapshot.name.trim_start_matches("at-").parse().unwrap();
            let frozen = manager.open_snapshot("crash", &snapshot.name).unwrap();
            for (block, seq) in image_seqs(frozen.as_ref()).iter().enumerate() {
                assert_eq!(
                    *seq,
                    expected_after(Some(taken_after), block as u64),
                    "round {round}: snapshot {} block {block}",
                    snapshot.name
                );
            }
        }
        eprintln!(
            "round {round}: writes up to {last:?} survived, {acknowledged_max:?} acknowledged, {} snapshots",
            info.snapshots.len()
        );
        next_seq = last.map_or(0, |last| last + 1);
    }
}
