//! Power cuts under volumes and objects: the real volume manager and object layer on a store
//! whose disk is simulated ([`keel_store::simdisk::SimDisk`]). Each seed runs a random mix of
//! buffered and FUA volume writes, flushes, object puts and deletes (and store compaction), cuts
//! the power at its end — every unsynced write lost or torn — and checks after reopening:
//! - the volume shows a prefix of its write sequence that includes every write acknowledged
//!   before a returned FLUSH or FUA write, with no torn block;
//! - every object whose PUT or DELETE was acknowledged is there with its bytes, or gone;
//! - in the seeds whose bucket has versioning enabled (every other seed), every acknowledged
//!   version and delete marker is listed, newest first, each version with its bytes, and
//!   versions deleted by id are gone.
//!
//! `KEEL_POWER_CUTS=N` runs N seeds (default 12); a failure names its seed.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use keel_catalog::{KeyRecord, LocalCatalog, Metadata};
use keel_namespace::object::{
    Checksums, Content, Manifest, Objects, PutCondition, StoredHeaders, VersionId,
    VersionListRequest, CHUNK_SIZE_BYTES,
};
use keel_namespace::volume::{VolumeManager, VolumeSpec};
use keel_store::simdisk::SimDisk;
use keel_store::{Compression, Store, StoreConfig};

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 64;

fn store_on(disk: &SimDisk) -> Store {
    let mut config = StoreConfig::new(vec![PathBuf::from("/sim/data")]);
    config.disk = Arc::new(disk.clone());
    config.segment_size_max_bytes = 1 << 20;
    config.reserve_bytes = 0;
    Store::open(config).unwrap()
}

fn open(disk: &SimDisk) -> (Store, VolumeManager, Arc<Objects>) {
    let store = store_on(disk);
    let metadata: Arc<dyn Metadata> = Arc::new(LocalCatalog::open(store.clone()).unwrap());
    let volumes = VolumeManager::open(store.clone(), metadata.clone()).unwrap();
    let objects = Objects::open(store.clone(), metadata).unwrap();
    (store, volumes, objects)
}

fn bytes_for(seed: u64, length: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..length)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Write `seq` goes to block `seq % BLOCKS` and carries `seq` in its first 8 bytes.
fn block_image(seq: u64) -> Vec<u8> {
    let mut data = bytes_for(seq + 1, BLOCK as usize);
    data[..8].copy_from_slice(&seq.to_le_bytes());
    data
}

/// Returns the version id the write got (`None` in an unversioned bucket).
fn put_object(objects: &Objects, key: &str, data: &[u8]) -> Option<String> {
    let mut pins = objects.pin_set();
    let chunks = data
        .chunks(CHUNK_SIZE_BYTES)
        .map(|c| {
            objects
                .write_chunk(Compression::Lz4, c.to_vec(), &mut pins)
                .unwrap()
        })
        .collect();
    let manifest = Manifest {
        size_bytes: data.len() as u64,
        etag: hex::encode(&blake3::hash(data).as_bytes()[..16]),
        modified_unix_ms: 0,
        content: Content::Chunks(chunks),
        part_sizes_bytes: Vec::new(),
        headers: StoredHeaders::default(),
        metadata: Vec::new(),
        checksums: Checksums::default(),
        tags: Vec::new(),
        version_seq: 0,
        versioned: false,
        delete_marker: false,
        lock: Default::default(),
        public_read: false,
    };
    objects
        .put_object("bkt", key, manifest, &PutCondition::default())
        .unwrap()
        .1
}

fn read_object(objects: &Objects, key: &str) -> Option<Vec<u8>> {
    read_version(objects, key, None)
}

fn read_version(objects: &Objects, key: &str, version: Option<&str>) -> Option<Vec<u8>> {
    let version = version.map(|id| VersionId::parse(id).unwrap());
    let manifest = objects.get_manifest("bkt", key, version).ok()?;
    Some(
        manifest
            .content
            .chunk_refs()
            .iter()
            .flat_map(|c| objects.read_chunk(c).unwrap())
            .collect(),
    )
}

#[test]
fn power_cuts_under_volumes_and_objects() {
    let seeds: u64 = std::env::var("KEEL_POWER_CUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    for seed in 1..=seeds {
        run_seed(seed);
    }
    println!("seeds checked: {seeds}");
}

fn run_seed(seed: u64) {
    let disk = SimDisk::new(seed);
    let (store, volumes, objects) = open(&disk);
    volumes
        .create(&VolumeSpec::new("v", BLOCKS * BLOCK))
        .unwrap();
    objects
        .add_key(KeyRecord {
            access_key_id: "K".into(),
            name: "k".into(),
            secret_access_key: "secretsecret".into(),
            created_unix_ms: 0,
        })
        .unwrap();
    objects.create_bucket("bkt", "K", Compression::Lz4).unwrap();
    let versioned = seed.is_multiple_of(2);
    if versioned {
        objects.set_bucket_versioning("bkt", true).unwrap();
    }
    let volume = volumes.open_volume("v").unwrap();

    let mut x = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut written = 0u64; // volume writes acknowledged: seqs 0..written
    let mut durable = 0u64; // seqs 0..durable are durable (a FLUSH or FUA write returned)
    let mut objects_model: BTreeMap<String, Option<Vec<u8>>> = BTreeMap::new();
    // Versioned seeds: each key's versions, oldest first (id, bytes; a delete marker has none).
    type Versions = Vec<(String, Option<Vec<u8>>)>;
    let mut versions_model: BTreeMap<String, Versions> = BTreeMap::new();
    let steps = 30 + next() % 120;
    for _ in 0..steps {
        match next() % 100 {
            0..=59 => {
                let seq = written;
                let fua = next() % 8 == 0;
                volume
                    .write((seq % BLOCKS) * BLOCK, &block_image(seq), fua)
                    .unwrap();
                written += 1;
                if fua {
                    durable = written;
                }
            }
            60..=69 => {
                volume.flush().unwrap();
                durable = written;
            }
            70..=89 => {
                let key = format!("o{}", next() % 6);
                let data = bytes_for(
                    next(),
                    1 + (next() % (3 * CHUNK_SIZE_BYTES as u64)) as usize,
                );
                let version = put_object(&objects, &key, &data);
                if versioned {
                    let id = version.unwrap();
                    versions_model
                        .entry(key.clone())
                        .or_default()
                        .push((id, Some(data.clone())));
                }
                objects_model.insert(key, Some(data));
            }
            90..=96 => {
                let key = format!("o{}", next() % 6);
                let kept = versions_model.entry(key.clone()).or_default();
                if versioned && !kept.is_empty() && next() % 2 == 0 {
                    // Removes one version for good (the newest ones promote the next).
                    let (id, _) = kept.remove((next() % kept.len() as u64) as usize);
                    objects
                        .delete_object("bkt", &key, Some(VersionId::parse(&id).unwrap()), false)
                        .unwrap();
                } else {
                    let deletion = objects.delete_object("bkt", &key, None, false).unwrap();
                    if versioned {
                        kept.push((deletion.version_id.unwrap(), None));
                    }
                }
                if versioned {
                    let current = kept.last().and_then(|(_, data)| data.clone());
                    objects_model.insert(key, current);
                } else {
                    objects_model.insert(key, None);
                }
            }
            _ => {
                store.compact(0.3, &mut |_| {}).unwrap();
            }
        }
    }
    let cut = disk.power_cut();
    drop((volume, volumes, objects, store));

    let (store, volumes, objects) = open(&cut);
    let scrub = store.scrub(&mut |_| {}).unwrap();
    assert_eq!(scrub.unrecoverable_extents, 0, "seed {seed}: {scrub:?}");
    // S3 PUT and DELETE are acknowledged only when durable: each is exactly as acknowledged.
    for (key, expected) in &objects_model {
        assert_eq!(
            read_object(&objects, key).as_ref(),
            expected.as_ref(),
            "seed {seed}: object {key}"
        );
    }
    if versioned {
        let page = objects
            .list_versions(
                "bkt",
                &VersionListRequest {
                    max_entries: 1000,
                    ..Default::default()
                },
            )
            .unwrap();
        let listed: Vec<(String, String, bool)> = page
            .entries
            .iter()
            .map(|e| (e.key.clone(), e.version_id.clone(), e.delete_marker))
            .collect();
        let expected: Vec<(String, String, bool)> = versions_model
            .iter()
            .flat_map(|(key, versions)| {
                versions
                    .iter()
                    .rev()
                    .map(|(id, data)| (key.clone(), id.clone(), data.is_none()))
            })
            .collect();
        assert_eq!(listed, expected, "seed {seed}: versions");
        for (key, versions) in &versions_model {
            for (id, data) in versions.iter().filter(|(_, data)| data.is_some()) {
                assert_eq!(
                    read_version(&objects, key, Some(id)).as_ref(),
                    data.as_ref(),
                    "seed {seed}: version {id} of {key}"
                );
            }
        }
    }
    let volume = volumes.open_volume("v").unwrap();
    let mut image = vec![0u8; (BLOCKS * BLOCK) as usize];
    volume.read(0, &mut image).unwrap();
    let seqs: Vec<Option<u64>> = image
        .chunks(BLOCK as usize)
        .enumerate()
        .map(|(block, data)| {
            if data.iter().all(|&b| b == 0) {
                return None;
            }
            let seq = u64::from_le_bytes(data[..8].try_into().unwrap());
            assert_eq!(
                seq % BLOCKS,
                block as u64,
                "seed {seed}: block {block} misplaced"
            );
            assert!(
                data == block_image(seq).as_slice(),
                "seed {seed}: block {block} torn"
            );
            Some(seq)
        })
        .collect();
    // The image is the one after writes 0..n for some n in durable..=written.
    let expected_after = |n: u64, block: u64| -> Option<u64> {
        if n == 0 || n - 1 < block {
            return None;
        }
        let last = n - 1;
        Some(last - (last - block) % BLOCKS)
    };
    let prefix = (durable..=written)
        .find(|n| (0..BLOCKS).all(|block| seqs[block as usize] == expected_after(*n, block)));
    assert!(
        prefix.is_some(),
        "seed {seed}: the volume is no prefix of its writes at or after the last durable one \
         ({durable} of {written}): {seqs:?}"
    );
    volume.write(0, &block_image(BLOCKS), true).unwrap();
}
