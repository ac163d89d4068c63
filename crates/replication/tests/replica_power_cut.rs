//! The replica's half of a FLUSH, under power cuts: a batch the primary sends with `flush`
//! is applied to the replica's real volume on a store whose disk is simulated
//! ([`keel_store::simdisk::SimDisk`]); the power is cut right after the batch is acknowledged
//! (every unsynced write lost or torn); after reopening, every write of every flushed batch
//! is there. A replica that acknowledged a flush without making it durable fails this test,
//! which a kill -9 of the replica's process (its page cache survives) never could.
//!
//! `KEEL_POWER_CUTS=N` runs N seeds (default 12); a failure names its seed.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use keel_catalog::{LocalCatalog, Metadata};
use keel_namespace::volume::{VolumeManager, VolumeSpec};
use keel_replication::replica::apply_ops;
use keel_replication::wire::Op;
use keel_store::simdisk::SimDisk;
use keel_store::{Store, StoreConfig};

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 64;

fn open(disk: &SimDisk) -> VolumeManager {
    let mut config = StoreConfig::new(vec![PathBuf::from("/sim/data")]);
    config.disk = Arc::new(disk.clone());
    config.segment_size_max_bytes = 1 << 20;
    config.reserve_bytes = 0;
    let store = Store::open(config).unwrap();
    let metadata: Arc<dyn Metadata> = Arc::new(LocalCatalog::open(store.clone()).unwrap());
    VolumeManager::open(store, metadata).unwrap()
}

fn image(seed: u64, index: u64) -> Vec<u8> {
    let mut data = vec![0u8; BLOCK as usize];
    let mut x = (seed << 20 | index).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for byte in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *byte = (x >> 24) as u8;
    }
    data
}

#[test]
fn a_flushed_batch_survives_a_power_cut_of_the_replica() {
    let seeds: u64 = std::env::var("KEEL_POWER_CUTS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(12);
    for seed in 0..seeds {
        let disk = SimDisk::new(seed);
        let volumes = open(&disk);
        volumes
            .create(&VolumeSpec::new("replica", BLOCKS * BLOCK))
            .unwrap();
        let volume = volumes.open_volume("replica").unwrap();
        // Batches of 1..8 writes; the last one of each round asks for a flush.
        let mut expected: Vec<Option<Vec<u8>>> = vec![None; BLOCKS as usize];
        let mut index = 0u64;
        for round in 0..(4 + seed % 5) {
            let mut pending = Vec::new();
            for batch in 0..3 {
                let ops: Vec<Op> = (0..(1 + (seed + round + batch) % 8))
                    .map(|_| {
                        index += 1;
                        let block = (index * 7 + seed) % BLOCKS;
                        pending.push((block, image(seed, index)));
                        Op::Write {
                            offset: block * BLOCK,
                            data: image(seed, index).into(),
                        }
                    })
                    .collect();
                apply_ops(volume.as_ref(), &ops, batch == 2).unwrap();
            }
            for (block, data) in pending {
                expected[block as usize] = Some(data);
            }
        }
        // The power goes while the replica still runs: nothing more reaches the disk.
        let after_cut = disk.power_cut();
        drop(volume);
        drop(volumes);
        let volumes = open(&after_cut);
        let volume = volumes.open_volume("replica").unwrap();
        for (block, wanted) in expected.iter().enumerate() {
            let Some(wanted) = wanted else { continue };
            let mut got = vec![0u8; BLOCK as usize];
            volume.read(block as u64 * BLOCK, &mut got).unwrap();
            assert!(
                &got == wanted,
                "seed {seed}: block {block} lost its flushed write after a power cut"
            );
        }
    }
}
