//! The store on a simulated disk ([`keel_store::simdisk::SimDisk`]) that keeps durable and
//! volatile bytes apart: power cuts that lose or tear every unsynced write, failed syncs with
//! Linux's semantics (the lost pages stay cached and the next sync succeeds), flipped bits, and a
//! full disk. Each test here failed before the fix it names.
//!
//! `KEEL_POWER_CUTS=N` runs N seeded power cuts instead of the short CI slice; every failure
//! prints the seed that reproduces it.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_store::simdisk::{FaultOp, SimDisk};
use keel_store::{meta_key, Compression, Durability, Store, StoreConfig, StoreError, WriteOp};

fn config(disk: &SimDisk, dirs: &[&str]) -> StoreConfig {
    let mut config = StoreConfig::new(dirs.iter().map(PathBuf::from).collect());
    config.disk = Arc::new(disk.clone());
    config.segment_size_max_bytes = 1 << 20;
    config.reserve_bytes = 0;
    config
}

fn open(disk: &SimDisk, dirs: &[&str]) -> Store {
    Store::open(config(disk, dirs)).unwrap()
}

fn key(n: u64) -> Vec<u8> {
    meta_key(format!("k{n:04}").as_bytes())
}

fn value(n: u64, version: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version.wrapping_add(1);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn put(n: u64, version: u64, len: usize) -> WriteOp {
    WriteOp::put(key(n), value(n, version, len), Compression::None)
}

fn segment_path(dir: &str, id: u64) -> PathBuf {
    Path::new(dir)
        .join("segments")
        .join(format!("{id:016x}.seg"))
}

/// Offset in segment 1 of the `nth` record when every record is a `put(_, _, len)` of a
/// `key(_)`: segment header, then records of header + key + payload.
fn record_offset(nth: u64, len: usize) -> u64 {
    let record = 68 + key(0).len() as u64 + len as u64;
    64 + nth * record
}

/// Issue 10, defect 3: after a failed writeback the lost pages stay cached and clean. A reopen
/// that replays through the cache indexes bytes the disk does not have; the next acknowledged
/// write then lands after a hole and is lost (or the log refuses to open) at the next power cut.
#[test]
fn reopen_after_a_failed_sync_replays_what_the_device_holds() {
    let disk = SimDisk::new(7);
    let store = open(&disk, &["/sim/a"]);
    store.write(vec![put(1, 0, 512)], Durability::Sync).unwrap();
    disk.inject(FaultOp::Sync, "segments", libc::EIO, 0, 1);
    let failed = store.write(vec![put(2, 0, 512)], Durability::Sync);
    assert!(
        failed.is_err(),
        "a failed fdatasync is reported: {failed:?}"
    );
    let refused = store.write(vec![put(3, 0, 512)], Durability::Sync);
    assert!(
        matches!(refused, Err(StoreError::Poisoned { .. })),
        "the store is poisoned after a failed sync: {refused:?}"
    );
    // The process restarts; the machine does not: the page cache still holds key 2.
    let restarted = disk.process_restart();
    drop(store);
    let store = open(&restarted, &["/sim/a"]);
    assert_eq!(store.get(&key(1)).unwrap(), Some(value(1, 0, 512)));
    let seen_after_reopen = store.get(&key(2)).unwrap();
    store.write(vec![put(4, 0, 512)], Durability::Sync).unwrap();
    drop(store);

    let after_cut = restarted.power_cut();
    let store = Store::open(config(&after_cut, &["/sim/a"]))
        .expect("the log written after the reopen is whole");
    assert_eq!(store.get(&key(1)).unwrap(), Some(value(1, 0, 512)));
    assert_eq!(
        store.get(&key(4)).unwrap(),
        Some(value(4, 0, 512)),
        "a write acknowledged after the reopen survives the power cut"
    );
    assert_eq!(
        store.get(&key(2)).unwrap(),
        seen_after_reopen,
        "a key seen after the reopen does not vanish at the next power cut"
    );
}

/// Issue 10, defect 2: a mirror repair syncs the same file the group commit syncs. Swallowing
/// its failed sync lets the next log sync report success for writes that never reached the disk.
#[test]
fn a_failed_sync_during_mirror_repair_poisons_the_store() {
    let disk = SimDisk::new(11);
    let dirs = ["/sim/a", "/sim/b"];
    let store = open(&disk, &dirs);
    store.write(vec![put(1, 0, 512)], Durability::Sync).unwrap();
    // Damage device a's copy of key 1's payload, so a read repairs it from device b.
    let payload = record_offset(0, 512) + 68 + key(1).len() as u64 + 10;
    disk.flip_bit(&segment_path("/sim/a", 1), payload, 3)
        .unwrap();
    // An acknowledged, not yet synced write shares the file with the repair.
    store
        .write(vec![put(2, 0, 512)], Durability::Buffered)
        .unwrap();
    disk.inject(FaultOp::Sync, "/sim/a/segments", libc::EIO, 0, 1);
    assert_eq!(
        store.get(&key(1)).unwrap(),
        Some(value(1, 0, 512)),
        "the read is served from the good copy"
    );
    assert_eq!(disk.fired().len(), 1, "the repair's sync failed");
    let flushed = store.flush();
    assert!(
        matches!(flushed, Err(StoreError::Poisoned { .. })),
        "a flush after the lost writeback must not report success: {flushed:?}"
    );
    assert!(store.stats().unwrap().poisoned);
}

/// Issue 10, defect 5: a bad record followed by records written after a sync is media
/// corruption, not a torn tail. Cutting there would drop acknowledged writes.
#[test]
fn corruption_in_the_middle_of_the_log_refuses_to_open_and_cuts_nothing() {
    let disk = SimDisk::new(13);
    let store = open(&disk, &["/sim/a"]);
    for n in 0..40 {
        store.write(vec![put(n, 0, 256)], Durability::Sync).unwrap();
    }
    // A crash: the index was never checkpointed past the start, so the log is replayed.
    let crashed = disk.process_restart();
    drop(store);
    let path = segment_path("/sim/a", 1);
    let len_before = crashed.len_of(&path).unwrap();
    crashed
        .flip_bit(&path, record_offset(10, 256) + 100, 0)
        .unwrap();
    let opened = Store::open(config(&crashed, &["/sim/a"]));
    assert!(
        matches!(opened, Err(StoreError::LogCorrupt { segment: 1, .. })),
        "mid-log corruption must refuse to open: {:?}",
        opened.as_ref().err()
    );
    assert_eq!(
        crashed.len_of(&path),
        Some(len_before),
        "nothing after the damage was cut"
    );
    let message = opened.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(message.contains("acknowledged"), "{message}");
}

/// A torn tail — the last, unsynced batch half on disk — is still cut and the store opens.
#[test]
fn a_torn_unsynced_tail_is_cut_and_the_store_opens() {
    let disk = SimDisk::new(17);
    let store = open(&disk, &["/sim/a"]);
    for n in 0..10 {
        store.write(vec![put(n, 0, 256)], Durability::Sync).unwrap();
    }
    for n in 10..20 {
        store
            .write(vec![put(n, 0, 4096)], Durability::Buffered)
            .unwrap();
    }
    let mut torn_seen = false;
    for _ in 0..20 {
        let cut = disk.power_cut();
        let store = Store::open(config(&cut, &["/sim/a"])).unwrap();
        for n in 0..10 {
            assert_eq!(store.get(&key(n)).unwrap(), Some(value(n, 0, 256)));
        }
        torn_seen |= store.get(&key(19)).unwrap().is_none();
    }
    assert!(torn_seen, "some cut lost the unsynced tail");
    drop(store);
}

/// Issue 10, defect 4: on a full disk a batch that frees more than it adds (a delete that
/// rewrites a reference count on its way) is admitted from the reserve.
#[test]
fn a_full_disk_still_admits_batches_that_free_space() {
    let disk = SimDisk::new(19);
    disk.set_capacity(Some(40 << 20));
    let mut config = config(&disk, &["/sim/a"]);
    config.reserve_bytes = 4 << 20;
    let store = Store::open(config).unwrap();
    let counter = meta_key(b"refcount");
    store
        .write(
            vec![WriteOp::put(counter.clone(), vec![2; 8], Compression::None)],
            Durability::Sync,
        )
        .unwrap();
    let mut written = 0;
    let full = loop {
        match store.write(vec![put(written, 0, 64 << 10)], Durability::Sync) {
            Ok(_) => written += 1,
            Err(error) => break error,
        }
        assert!(written < 1000, "the disk never filled");
    };
    assert!(full.is_no_space(), "{full}");
    // Drop one reference and delete a large value in one batch: it frees far more than it adds.
    store
        .write(
            vec![
                WriteOp::put(counter.clone(), vec![1; 8], Compression::None),
                WriteOp::Delete { key: key(0) },
            ],
            Durability::Sync,
        )
        .expect("a batch that frees space is admitted on a full disk");
    assert_eq!(store.get(&counter).unwrap(), Some(vec![1; 8]));
    let refused = store.write(vec![put(5000, 0, 64 << 10)], Durability::Sync);
    assert!(
        refused.as_ref().is_err_and(StoreError::is_no_space),
        "new data is still refused: {refused:?}"
    );
}

/// Issue 10, defect 1: a log without its index is refused, not replayed from the first segment
/// (which would skip compaction copies and bring deleted keys back).
#[test]
fn a_missing_index_is_refused_with_a_clear_error() {
    let disk = SimDisk::new(23);
    let store = open(&disk, &["/sim/a"]);
    store.write(vec![put(1, 0, 256)], Durability::Sync).unwrap();
    drop(store);
    use keel_store::disk::Disk;
    disk.remove_file(Path::new("/sim/a/index.redb")).unwrap();
    let opened = Store::open(config(&disk, &["/sim/a"]));
    assert!(
        matches!(opened, Err(StoreError::IndexMissing { .. })),
        "{:?}",
        opened.as_ref().err()
    );
}

/// What one seeded run did: the op log, and the index of the last op acknowledged as durable.
struct Workload {
    /// (key, Some(version) for a put / None for a delete), in acknowledgement order.
    ops: Vec<(u64, Option<u64>)>,
    durable_through: usize,
}

fn model_at(ops: &[(u64, Option<u64>)]) -> BTreeMap<u64, u64> {
    let mut state = BTreeMap::new();
    for (key, version) in ops {
        match version {
            Some(v) => {
                state.insert(*key, *v);
            }
            None => {
                state.remove(key);
            }
        }
    }
    state
}

const KEYS: u64 = 24;

fn value_len(key: u64, version: u64) -> usize {
    64 + ((key * 131 + version * 977) % 6000) as usize
}

/// With `bulk`, every write is a [`Store::write_bulk`].
fn run_workload(store: &Store, seed: u64, steps: usize, bulk: bool) -> Workload {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut ops = Vec::new();
    let mut durable_through = 0;
    for step in 0..steps {
        let roll = next() % 100;
        let key = next() % KEYS;
        let durability = if next() % 3 == 0 {
            Durability::Sync
        } else {
            Durability::Buffered
        };
        let op = if roll < 15 {
            (key, None)
        } else {
            (key, Some(step as u64))
        };
        let write = match op.1 {
            None => WriteOp::Delete {
                key: self::key(key),
            },
            Some(v) => WriteOp::put(
                self::key(key),
                value(key, v, value_len(key, v)),
                Compression::None,
            ),
        };
        if bulk {
            store.write_bulk(vec![write], durability).unwrap();
        } else {
            store.write(vec![write], durability).unwrap();
        }
        ops.push(op);
        if durability == Durability::Sync {
            durable_through = ops.len();
        }
        if roll >= 97 {
            store.compact(0.3, &mut |_| {}).unwrap();
        } else if roll == 96 {
            store.flush().unwrap();
            durable_through = ops.len();
        }
    }
    Workload {
        ops,
        durable_through,
    }
}

/// Every power cut leaves the store at a prefix of the acknowledged writes that includes
/// everything acknowledged as durable, with every checksum holding.
#[test]
fn seeded_power_cuts_keep_every_durable_write() {
    let cuts: u64 = std::env::var("KEEL_POWER_CUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150);
    let mut checked = 0u64;
    let mut direct_bytes = 0;
    for seed in 1..=cuts {
        let disk = SimDisk::new(seed);
        // Every other seed writes each batch's whole blocks around the page cache, so one
        // batch is up to three writes a power cut keeps, tears or loses each on its own.
        let bulk = seed % 2 == 0;
        let direct_write_min_bytes = if bulk { 1 } else { 0 };
        let seed_config = |disk: &SimDisk| StoreConfig {
            direct_write_min_bytes,
            ..config(disk, &["/sim/a"])
        };
        let store = Store::open(seed_config(&disk)).unwrap();
        let steps = 20 + (seed as usize * 7919) % 180;
        let workload = run_workload(&store, seed, steps, bulk);
        direct_bytes += disk.direct_bytes();
        let cut = disk.power_cut();
        drop(store);
        let store = Store::open(seed_config(&cut))
            .unwrap_or_else(|e| panic!("seed {seed}: reopen after a power cut failed: {e}"));
        let report = store.scrub(&mut |_| {}).unwrap();
        assert_eq!(report.unrecoverable_extents, 0, "seed {seed}: {report:?}");
        let mut found = BTreeMap::new();
        for key in 0..KEYS {
            if let Some(bytes) = store.get(&self::key(key)).unwrap() {
                let version = (0..=steps as u64)
                    .find(|v| bytes == value(key, *v, value_len(key, *v)))
                    .unwrap_or_else(|| panic!("seed {seed}: key {key} holds bytes never written"));
                found.insert(key, version);
            }
        }
        let prefix = (workload.durable_through..=workload.ops.len())
            .find(|p| model_at(&workload.ops[..*p]) == found);
        assert!(
            prefix.is_some(),
            "seed {seed}: the store after the cut is no prefix of the writes at or after the \
             last durable one ({} of {}): {found:?}",
            workload.durable_through,
            workload.ops.len()
        );
        store
            .write(vec![put(0, 9_999, 128)], Durability::Sync)
            .unwrap_or_else(|e| panic!("seed {seed}: write after reopen failed: {e}"));
        checked += 1;
    }
    println!("power cuts checked: {checked}, {direct_bytes} bytes written direct");
    assert!(direct_bytes > 0, "no seed wrote around the page cache");
}

/// A batch carrying `direct_write_min_bytes` of bulk writes or more has its whole blocks
/// written around the page cache (and no byte twice: the partial blocks at its ends go through
/// the cache); a smaller one, or one of ordinary writes, does not. What was synced survives a
/// power cut either way.
#[test]
fn a_large_bulk_batch_goes_around_the_page_cache_and_survives_a_power_cut() {
    let disk = SimDisk::new(41);
    let store = open(&disk, &["/sim/a", "/sim/b"]);
    let big = 1 << 20;
    store
        .write_bulk(vec![put(1, 1, 100)], Durability::Buffered)
        .unwrap();
    store
        .write(vec![put(4, 1, big)], Durability::Buffered)
        .unwrap();
    assert_eq!(
        disk.direct_bytes(),
        0,
        "a small bulk or a large plain batch went direct"
    );
    store
        .write_bulk(vec![put(2, 1, big), put(3, 1, 5000)], Durability::Sync)
        .unwrap();
    // Two devices (a mirror): each gets the batch's whole blocks, all but at most the two
    // partial ones.
    let direct = disk.direct_bytes();
    assert!(
        direct >= 2 * (big as u64 + 5000 - 8192) && direct <= 2 * (big as u64 + 5300),
        "{direct} bytes written direct"
    );
    let cut = disk.power_cut();
    drop(store);
    let store = Store::open(config(&cut, &["/sim/a", "/sim/b"])).unwrap();
    for (n, len) in [(1, 100), (2, big), (3, 5000), (4, big)] {
        assert_eq!(
            store.get(&key(n)).unwrap().unwrap(),
            value(n, 1, len),
            "key {n}"
        );
    }
    let report = store.scrub(&mut |_| {}).unwrap();
    assert_eq!(report.unrecoverable_extents, 0, "{report:?}");
    assert_eq!(
        report.repaired_copies, 0,
        "the mirror's copies differ: {report:?}"
    );
}

/// On a filesystem that refuses `O_DIRECT`, a large batch is written through the cache, and
/// the store keeps working.
#[test]
fn a_filesystem_without_direct_io_gets_ordinary_writes() {
    let disk = SimDisk::new(43);
    disk.refuse_direct();
    let store = open(&disk, &["/sim/a"]);
    for version in 0..3 {
        store
            .write_bulk(vec![put(5, version, 1 << 20)], Durability::Sync)
            .unwrap();
    }
    assert_eq!(disk.direct_bytes(), 0);
    let cut = disk.power_cut();
    drop(store);
    let store = Store::open(config(&cut, &["/sim/a"])).unwrap();
    assert_eq!(store.get(&key(5)).unwrap().unwrap(), value(5, 2, 1 << 20));
}

/// Issue 10, defect 8: preparing the next segment zero-fills it to full size; on a nearly full
/// disk that must not eat the reserve that deletes and compaction need.
#[test]
fn segment_preparation_never_eats_the_reserve() {
    let disk = SimDisk::new(29);
    disk.set_capacity(Some(40 << 20));
    let mut config = config(&disk, &["/sim/a"]);
    config.segment_size_max_bytes = 8 << 20;
    config.reserve_bytes = 16 << 20;
    let store = Store::open(config).unwrap();
    let mut n = 0;
    loop {
        match store.write(vec![put(n, 0, 256 << 10)], Durability::Sync) {
            Ok(_) => n += 1,
            Err(error) => {
                assert!(error.is_no_space(), "{error}");
                break;
            }
        }
        assert!(n < 1000, "the disk never filled");
    }
    // Let a background preparation, if one started, finish.
    std::thread::sleep(std::time::Duration::from_millis(300));
    use keel_store::disk::Disk;
    let available = disk.available_bytes(Path::new("/sim/a")).unwrap();
    assert!(
        available >= 16 << 20,
        "free space {available} fell below the 16 MiB reserve"
    );
}

/// A writer never waits for the zeros of its next segment: with each 1 MiB write of the
/// preparation taking 2 s (a device slow for that file: 18 s per 8 MiB segment), the writer
/// reaches the segment being prepared, cancels the preparation (waiting for one write at most)
/// and appends to a growing file instead, and goes on through four segments in well under
/// the time one preparation takes (before, each roll joined the preparation: every write
/// stalled until its zeros were done, 16 s or more per segment). After an outrun preparation
/// the next ones are skipped (1, then 2 segments here): of the five segments' successors, two
/// are prepared. Everything written reads back after a restart, and no prepared file is left
/// behind.
#[test]
fn a_writer_that_outruns_the_preparation_of_its_next_segment_does_not_wait_for_it() {
    let disk = SimDisk::new(37);
    disk.slow_writes(Some(".seg.prepared"), std::time::Duration::from_secs(2));
    let mut config = config(&disk, &["/sim/a"]);
    config.segment_size_max_bytes = 8 << 20;
    let store = Arc::new(Store::open(config.clone()).unwrap());
    let (done, finished) = std::sync::mpsc::channel();
    let writer = {
        let store = store.clone();
        std::thread::spawn(move || {
            for n in 0..512 {
                store
                    .write(vec![put(n, 0, 64 << 10)], Durability::Buffered)
                    .unwrap();
            }
            store.flush().unwrap();
            let _ = done.send(());
        })
    };
    let outran = finished.recv_timeout(std::time::Duration::from_secs(40));
    assert!(
        outran.is_ok(),
        "the writer waited for the preparations of its next segments"
    );
    writer.join().unwrap();
    disk.slow_writes(None, std::time::Duration::ZERO);
    let prepared: Vec<_> = disk
        .created()
        .into_iter()
        .filter(|path| path.to_string_lossy().ends_with(".seg.prepared"))
        .collect();
    assert_eq!(prepared.len(), 2, "{prepared:?}");
    let segments = disk.list(Path::new("/sim/a/segments"));
    assert!(
        segments
            .iter()
            .filter(|name| name.ends_with(".seg"))
            .count()
            >= 5,
        "{segments:?}"
    );
    drop(store);
    // A preparation still running at close is cancelled too, and removes its file.
    let segments = disk.list(Path::new("/sim/a/segments"));
    assert!(
        !segments.iter().any(|name| name.ends_with(".prepared")),
        "{segments:?}"
    );
    config.disk = Arc::new(disk.process_restart());
    let store = Store::open(config).unwrap();
    for n in 0..512 {
        assert_eq!(
            store.get(&key(n)).unwrap(),
            Some(value(n, 0, 64 << 10)),
            "key {n}"
        );
    }
}

/// A writer that appends a quarter of a segment while the zeros of its next segment are written
/// (a bulk load, a replica's rebuild) nearly outran them: the prepared segment is used, but the
/// next preparations are skipped as after an outrun one, because zeros written at the
/// writer's own pace cost it as much again in copies and disk bandwidth. Here each write of
/// the preparation takes 200 ms (1.8 s for an 8 MiB segment) while the writer appends 2.5 MiB
/// at once: segment 2 is prepared and used, segment 3 is not prepared (before, it was: only an
/// outrun preparation counted). Everything written reads back after a restart.
#[test]
fn a_writer_that_nearly_outruns_a_preparation_skips_the_next_ones() {
    use keel_store::disk::Disk;
    const SEGMENT: u64 = 8 << 20;
    const VALUE: usize = 256 << 10;
    let disk = SimDisk::new(41);
    disk.slow_writes(Some(".seg.prepared"), std::time::Duration::from_millis(200));
    let mut config = config(&disk, &["/sim/a"]);
    config.segment_size_max_bytes = SEGMENT;
    let store = Store::open(config.clone()).unwrap();
    let mut lens = Vec::new();
    let mut write = |len: usize| {
        store
            .write(vec![put(lens.len() as u64, 0, len)], Durability::Buffered)
            .unwrap();
        lens.push(len);
    };
    // Past 4 MiB: the preparation of segment 2 starts. Then 2.5 MiB more at once.
    for _ in 0..27 {
        write(VALUE);
    }
    let prepared = Path::new("/sim/a/segments/0000000000000002.seg.prepared");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while disk.file_len(prepared).unwrap() != Some(SEGMENT) {
        assert!(
            std::time::Instant::now() < deadline,
            "segment 2 was never prepared"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // The writer moves to the prepared segment once the preparation has returned.
    let second = segment_path("/sim/a", 2);
    while disk.file_len(&second).unwrap().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "the writer never moved to segment 2"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
        write(4096);
    }
    assert_eq!(
        disk.file_len(&second).unwrap(),
        Some(SEGMENT),
        "segment 2 is the prepared one"
    );
    // Through segment 2 and into 3: past its half, segment 3 would be prepared.
    for _ in 0..32 {
        write(VALUE);
    }
    assert!(disk.file_len(&segment_path("/sim/a", 3)).unwrap().is_some());
    let preparations: Vec<_> = disk
        .created()
        .into_iter()
        .filter(|path| path.to_string_lossy().ends_with(".seg.prepared"))
        .collect();
    assert_eq!(preparations, vec![prepared.to_path_buf()]);
    drop(store);
    disk.slow_writes(None, std::time::Duration::ZERO);
    config.disk = Arc::new(disk.process_restart());
    let store = Store::open(config).unwrap();
    for (n, len) in lens.into_iter().enumerate() {
        let n = n as u64;
        assert_eq!(
            store.get(&key(n)).unwrap(),
            Some(value(n, 0, len)),
            "key {n}"
        );
    }
}

/// Issue 10, defect 8: a mirror segment created on one device but not the other must be undone,
/// or every later roll (and the next open) trips over the half pair.
#[test]
fn a_half_created_mirror_segment_is_undone() {
    let disk = SimDisk::new(31);
    let dirs = ["/sim/a", "/sim/b"];
    let store = open(&disk, &dirs);
    // The next two file creations on device b fail: the background preparation of segment 2
    // (the log then falls back to creating the segment at the roll), and that creation, which
    // leaves segment 2 made on device a only.
    disk.inject(FaultOp::Create, "/sim/b/segments/", libc::EIO, 0, 2);
    let mut acknowledged = Vec::new();
    let mut failures = 0;
    for n in 0..200 {
        match store.write(vec![put(n, 0, 16 << 10)], Durability::Sync) {
            Ok(_) => acknowledged.push(n),
            Err(_) => failures += 1,
        }
    }
    let fired = disk.fired();
    assert_eq!(fired.len(), 2, "both faults fired: {fired:?}");
    assert!(fired[1].1.to_string_lossy().ends_with(".seg"), "{fired:?}");
    assert!(
        failures <= 1,
        "only the write that hit the fault may fail: {failures}"
    );
    drop(store);
    let store = Store::open(config(&disk, &dirs)).expect("the next open finds whole pairs");
    for n in acknowledged {
        assert_eq!(store.get(&key(n)).unwrap(), Some(value(n, 0, 16 << 10)));
    }
}

/// Issue 10, defect 1: the index rebuilt from the whole log holds exactly what the store held —
/// compaction copies applied where no newer version exists, and keys deleted before compaction
/// removed their tombstone's segment stay deleted although an older segment still holds a put.
#[test]
fn rebuild_index_from_the_whole_log_after_compaction() {
    let disk = SimDisk::new(37);
    let dirs = ["/sim/a"];
    let store = open(&disk, &dirs);
    let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let mut write = |store: &Store, op: WriteOp| {
        match &op {
            WriteOp::Put { key, value, .. } => {
                model.insert(key.clone(), value.to_vec());
            }
            WriteOp::Delete { key } => {
                model.remove(key);
            }
        }
        store.write(vec![op], Durability::Sync).unwrap();
    };
    // Segment 1: keys 0..60, which stay live (so segment 1 is never compacted) except key 0.
    for n in 0..60 {
        write(&store, put(n, 0, 16 << 10));
    }
    // Later segments: temporary keys, overwritten at once (mostly dead), key 0's delete among
    // them, and an overwrite of key 1 (its first version in segment 1 becomes dead).
    for round in 0..3 {
        for n in 100..160 {
            write(&store, put(n, round, 16 << 10));
        }
        if round == 0 {
            write(&store, WriteOp::Delete { key: key(0) });
            write(&store, put(1, 1, 100));
        }
    }
    let report = store.compact(0.5, &mut |_| {}).unwrap();
    assert!(report.segments_compacted > 0, "{report:?}");
    assert!(
        report.tombstones_carried > 0,
        "key 0's tombstone was carried: {report:?}"
    );
    // Compaction copies (relocated extents) must be applied by the rebuild too.
    assert!(report.extents_moved > 0, "{report:?}");
    drop(store);

    use keel_store::disk::Disk;
    disk.remove_file(Path::new("/sim/a/index.redb")).unwrap();
    let refused = Store::open(config(&disk, &dirs));
    assert!(matches!(refused, Err(StoreError::IndexMissing { .. })));
    let rebuilt = Store::rebuild_index(&config(&disk, &dirs), &mut |_| {}).unwrap();
    assert_eq!(rebuilt.live_keys, model.len() as u64, "{rebuilt:?}");
    let store = open(&disk, &dirs);
    assert_eq!(store.get(&key(0)).unwrap(), None, "a deleted key came back");
    for (key, value) in &model {
        assert_eq!(store.get(key).unwrap().as_ref(), Some(value));
    }
    let all = store.keys(&[0], &[0xff], 10_000).unwrap();
    assert_eq!(all.len(), model.len(), "no extra keys");
    store
        .write(vec![put(999, 0, 64)], Durability::Sync)
        .unwrap();
}

/// Issue 10, defect 1: with a mirror, the index has a copy on the second device; a lost index
/// is restored from it at open (after a clean close and after a crash), with nothing lost.
#[test]
fn a_lost_index_is_restored_from_its_copy_on_the_mirror() {
    use keel_store::disk::Disk;
    let disk = SimDisk::new(41);
    let dirs = ["/sim/a", "/sim/b"];
    let store = open(&disk, &dirs);
    // Two versions of each key over several segments, then compaction: the copy must follow
    // relocations and deleted segments, not just the first writes.
    for n in 0..50 {
        store
            .write(vec![put(n, 0, 32 << 10)], Durability::Sync)
            .unwrap();
    }
    // Overwrite most of the first segment, so compaction moves the rest of it.
    for n in 0..15 {
        store
            .write(vec![put(n, 1, 32 << 10)], Durability::Sync)
            .unwrap();
    }
    store
        .write(vec![WriteOp::Delete { key: key(7) }], Durability::Sync)
        .unwrap();
    let compacted = store.compact(0.3, &mut |_| {}).unwrap();
    assert!(
        compacted.segments_compacted > 0 && compacted.extents_moved > 0,
        "{compacted:?}"
    );
    drop(store);
    assert!(
        disk.len_of(Path::new("/sim/b/index.redb")).is_some(),
        "the copy exists"
    );
    disk.remove_file(Path::new("/sim/a/index.redb")).unwrap();
    let store = Store::open(config(&disk, &dirs)).expect("restored from the copy");
    for n in (0..50).filter(|n| *n != 7) {
        assert_eq!(
            store.get(&key(n)).unwrap(),
            Some(value(n, u64::from(n < 15), 32 << 10))
        );
    }
    assert_eq!(store.get(&key(7)).unwrap(), None);
    // A crash (no clean close), then the index is lost: the copy and the log still hold all.
    for n in 50..80 {
        store
            .write(vec![put(n, 0, 2048)], Durability::Sync)
            .unwrap();
    }
    let crashed = disk.process_restart();
    drop(store);
    crashed.remove_file(Path::new("/sim/a/index.redb")).unwrap();
    let store = Store::open(config(&crashed, &dirs)).expect("restored after a crash");
    for n in (0..50).filter(|n| *n != 7) {
        assert_eq!(
            store.get(&key(n)).unwrap(),
            Some(value(n, u64::from(n < 15), 32 << 10)),
            "key {n}"
        );
    }
    for n in 50..80 {
        assert_eq!(
            store.get(&key(n)).unwrap(),
            Some(value(n, 0, 2048)),
            "key {n}"
        );
    }
    assert_eq!(store.get(&key(7)).unwrap(), None);
}

/// A segment filled mostly around the page cache prepares no successor: zero-filling it
/// through the cache would copy every byte the bulk writer then writes again. The same
/// writes made as ordinary ones start preparations.
#[test]
fn a_segment_filled_around_the_page_cache_prepares_no_successor() {
    for bulk in [true, false] {
        let disk = SimDisk::new(47);
        let mut config = config(&disk, &["/sim/a"]);
        config.segment_size_max_bytes = 4 << 20;
        let store = Store::open(config).unwrap();
        // 12 MiB: three segments' worth, so the log rolls (joining any preparation) twice.
        for n in 0..40 {
            let ops = vec![put(n, 1, 300 << 10)];
            if bulk {
                store.write_bulk(ops, Durability::Buffered).unwrap();
            } else {
                store.write(ops, Durability::Buffered).unwrap();
            }
        }
        store.flush().unwrap();
        let prepared = disk
            .created()
            .iter()
            .filter(|path| path.to_string_lossy().ends_with(".prepared"))
            .count();
        if bulk {
            assert_eq!(prepared, 0, "bulk writes prepared {prepared} segments");
            assert!(disk.direct_bytes() > 10 << 20, "{}", disk.direct_bytes());
        } else {
            assert!(prepared > 0, "ordinary writes prepared no segment");
        }
        for n in 0..40 {
            assert_eq!(store.get(&key(n)).unwrap().unwrap(), value(n, 1, 300 << 10));
        }
    }
}

/// Small synced writes after a bulk load (a client's writes on a node that just received a
/// replica or a stream) do not stay in the growing file the bulk writer left, where every
/// fdatasync also writes the file's allocation: the first starts preparing the next segment,
/// and the log moves into it as soon as it is ready.
#[test]
fn small_synced_writes_after_a_bulk_load_move_into_a_prepared_segment() {
    const SEGMENT: u64 = 4 << 20;
    let disk = SimDisk::new(53);
    let mut config = config(&disk, &["/sim/a"]);
    config.segment_size_max_bytes = SEGMENT;
    let store = Store::open(config).unwrap();
    // 48 batches of 300 KiB, 13 to a segment: the fourth, growing, holds nine (2.6 MiB, past
    // half of it) and has room for 1.4 MiB more.
    for n in 0..48 {
        store
            .write_bulk(vec![put(n, 1, 300 << 10)], Durability::Buffered)
            .unwrap();
    }
    let segments = Path::new("/sim/a/segments");
    let prepared = |disk: &SimDisk| {
        disk.created()
            .iter()
            .filter(|path| path.to_string_lossy().ends_with(".prepared"))
            .count()
    };
    assert_eq!(prepared(&disk), 0);
    let newest = |disk: &SimDisk| {
        let name = disk
            .list(segments)
            .into_iter()
            .filter(|name| name.ends_with(".seg"))
            .max()
            .unwrap();
        disk.len_of(&segments.join(&name)).unwrap()
    };
    assert!(newest(&disk) < SEGMENT);
    // At most 1 MiB of 4 KiB writes, which would not fill the growing segment: the log must
    // move into a prepared (full-length) file before that. A pause between writes gives the
    // background zero-fill time even on a loaded machine (2.5 s in all).
    let mut moved = None;
    for n in 1000..1250 {
        store
            .write(vec![put(n, 1, 4096)], Durability::Sync)
            .unwrap();
        if newest(&disk) == SEGMENT {
            moved = Some(n);
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let moved = moved.expect("small synced writes stayed in the growing segment");
    assert!(prepared(&disk) > 0);
    for n in 0..48 {
        assert_eq!(store.get(&key(n)).unwrap().unwrap(), value(n, 1, 300 << 10));
    }
    for n in 1000..=moved {
        assert_eq!(store.get(&key(n)).unwrap().unwrap(), value(n, 1, 4096));
    }
}
