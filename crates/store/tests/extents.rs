//! Reading extents listed by `Store::extents` with `Store::read_extents`: runs of extents that
//! lie back to back are read with one `pread`, every value is still verified (a bad one is
//! repaired from the mirror or is an error), and extents moved or deleted since the listing are
//! looked up again. On the simulated disk, which counts reads and fails them on demand.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::value_for;
use keel_store::simdisk::{FaultOp, SimDisk};
use keel_store::{
    meta_key, Compression, Durability, Extent, Store, StoreConfig, StoreError, WriteOp,
};

fn open(disk: &SimDisk, dirs: &[&str]) -> Store {
    let mut config = StoreConfig::new(dirs.iter().map(PathBuf::from).collect());
    config.disk = Arc::new(disk.clone());
    config.segment_size_max_bytes = 1 << 20;
    config.reserve_bytes = 0;
    Store::open(config).unwrap()
}

fn key(n: u64) -> Vec<u8> {
    meta_key(format!("k{n:04}").as_bytes())
}

fn put(n: u64, version: u64, len: usize) -> WriteOp {
    WriteOp::put(key(n), value_for(n, version, len), Compression::None)
}

/// Offset in segment 1 of the `nth` record when every record is a `put(_, _, len)`.
fn record_offset(nth: u64, len: usize) -> u64 {
    64 + nth * (68 + key(0).len() + len) as u64
}

fn listed(store: &Store) -> Vec<Extent> {
    store.extents(&key(0), &key(10_000), usize::MAX).unwrap()
}

/// The values `read_extents` hands out, checking it hands each once, in order.
fn read(store: &Store, extents: &[&Extent]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
    let mut values = Vec::new();
    store.read_extents(extents, &mut |index, value| {
        assert_eq!(index, values.len(), "visited in order, each once");
        values.push(value.map(<[u8]>::to_vec));
    })?;
    assert_eq!(values.len(), extents.len());
    Ok(values)
}

fn read_all(store: &Store, extents: &[Extent]) -> Vec<Option<Vec<u8>>> {
    read(store, &extents.iter().collect::<Vec<_>>()).unwrap()
}

// Proves extents written together are read with one pread per run: 100 keys in one write, ten
// of them overwritten by a second write and one deleted, read back as four runs.
#[test]
fn extents_written_together_are_read_with_one_pread_per_run() {
    let disk = SimDisk::new(1);
    let store = open(&disk, &["/sim/a"]);
    store
        .write(
            (0..100).map(|n| put(n, 0, 1000)).collect(),
            Durability::Sync,
        )
        .unwrap();
    let mut second: Vec<WriteOp> = (10..20).map(|n| put(n, 1, 1000)).collect();
    second.push(WriteOp::Delete { key: key(5) });
    store.write(second, Durability::Sync).unwrap();
    let extents = listed(&store);
    assert_eq!(extents.len(), 99);
    let before = disk.reads("segments");
    let values = read_all(&store, &extents);
    // Keys 0-4 and 6-9 (key 5's record lies between them), 10-19 (the second write), 20-99.
    assert_eq!(disk.reads("segments") - before, 4, "one pread per run");
    for (extent, found) in extents.iter().zip(&values) {
        let n: u64 = std::str::from_utf8(&extent.key()[2..])
            .unwrap()
            .parse()
            .unwrap();
        let version = u64::from((10..20).contains(&n));
        assert_eq!(
            found.as_deref(),
            Some(&value_for(n, version, 1000)[..]),
            "key {n}"
        );
    }
    // Every other extent: none lies next to another, one pread each.
    let every_other: Vec<&Extent> = extents.iter().step_by(2).collect();
    let before = disk.reads("segments");
    let values = read(&store, &every_other).unwrap();
    assert_eq!(disk.reads("segments") - before, every_other.len() as u64);
    assert!(values.iter().all(Option::is_some));
}

/// A store on `dirs` holding keys 0-49 from one write, with a bit of key 20's extent flipped on
/// the first device.
fn fifty_keys_the_21st_flipped(seed: u64, dirs: &[&str]) -> (SimDisk, Store) {
    let disk = SimDisk::new(seed);
    let store = open(&disk, dirs);
    store
        .write((0..50).map(|n| put(n, 0, 1000)).collect(), Durability::Sync)
        .unwrap();
    let segment = PathBuf::from(dirs[0]).join("segments/0000000000000001.seg");
    disk.flip_bit(&segment, record_offset(20, 1000) + 300, 3)
        .unwrap();
    (disk, store)
}

fn assert_fifty_values(values: &[Option<Vec<u8>>]) {
    assert_eq!(values.len(), 50);
    for (n, found) in values.iter().enumerate() {
        assert_eq!(
            found.as_deref(),
            Some(&value_for(n as u64, 0, 1000)[..]),
            "key {n}"
        );
    }
}

// Proves a bad extent inside a run is verified, repaired from the mirror and read right, and
// that a first device failing its reads is read around.
#[test]
fn a_bad_extent_in_a_run_is_repaired_from_the_mirror() {
    let (disk, store) = fifty_keys_the_21st_flipped(2, &["/sim/a", "/sim/b"]);
    let extents = listed(&store);
    assert_fifty_values(&read_all(&store, &extents));
    assert_eq!(store.stats().unwrap().repaired_extents, 1);
    // Repaired: the next read is one pread again, and repairs nothing.
    let before = disk.reads("segments");
    read_all(&store, &extents);
    assert_eq!(disk.reads("segments") - before, 1);
    assert_eq!(store.stats().unwrap().repaired_extents, 1);
    // The first device fails every read: the second one answers.
    disk.inject(FaultOp::Read, "/sim/a/segments", libc::EIO, 0, u32::MAX);
    assert_fifty_values(&read_all(&store, &extents));
}

// Proves a bad extent inside a run, without a mirror, is an error naming its key, not data.
#[test]
fn a_bad_extent_in_a_run_without_a_mirror_is_an_error() {
    let (_disk, store) = fifty_keys_the_21st_flipped(3, &["/sim/a"]);
    let extents = listed(&store);
    let wanted: Vec<&Extent> = extents.iter().collect();
    match read(&store, &wanted) {
        Err(StoreError::Corrupt { key_hex, .. }) => {
            let expected: String = key(20).iter().map(|byte| format!("{byte:02x}")).collect();
            assert_eq!(key_hex, expected);
        }
        other => panic!("expected a corruption error, got {other:?}"),
    }
    // The extents around it read fine.
    let around: Vec<&Extent> = extents[..20].iter().chain(&extents[21..]).collect();
    assert!(read(&store, &around).is_ok());
}

// Proves extents listed before a compaction moved them are read at their new place, and one
// deleted since the listing reads as None.
#[test]
fn extents_moved_or_deleted_since_the_listing_are_looked_up_again() {
    let disk = SimDisk::new(4);
    let store = open(&disk, &["/sim/a"]);
    store
        .write(
            (0..100).map(|n| put(n, 0, 4000)).collect(),
            Durability::Sync,
        )
        .unwrap();
    let extents = listed(&store);
    for version in 1..4 {
        store
            .write(
                (0..100).map(|n| put(n, version, 4000)).collect(),
                Durability::Buffered,
            )
            .unwrap();
    }
    store
        .write(vec![WriteOp::Delete { key: key(7) }], Durability::Sync)
        .unwrap();
    let report = store.compact(0.5, &mut |_| {}).unwrap();
    assert!(report.segments_compacted > 0);
    assert!(
        !disk
            .list(&PathBuf::from("/sim/a/segments"))
            .contains(&"0000000000000001.seg".to_string()),
        "the listed extents' segment is gone"
    );
    let values = read_all(&store, &extents);
    for (n, found) in values.iter().enumerate() {
        let n = n as u64;
        if n == 7 {
            assert_eq!(found, &None, "deleted since the listing");
        } else {
            assert_eq!(
                found.as_deref(),
                Some(&value_for(n, 3, 4000)[..]),
                "key {n}"
            );
        }
    }
}
