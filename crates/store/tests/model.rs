//! Property test: random sequences of put / delete / read / flush / compaction / crash-and-reopen
//! checked against an in-memory model (a BTreeMap) of what must be there.
//!
//! A "crash" takes a crash image of the data directory while the store is open (the log as the
//! kernel holds it, the index as of its last durable commit) and continues on the image, so
//! recovery's replay is exercised at every crash point. Every acknowledged write is in the page
//! cache at that moment, so the model must match exactly.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::*;
use keel_store::{meta_key, Compression, Durability, Store, StoreConfig, WriteOp};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Action {
    Put {
        key: u8,
        len: u16,
        codec: u8,
        sync: bool,
    },
    PutGroup {
        keys: Vec<u8>,
        len: u16,
    },
    Delete {
        key: u8,
    },
    Read {
        key: u8,
    },
    Flush,
    Compact,
    Crash,
    Reopen,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        8 => (any::<u8>(), 0u16..6000, 0u8..3, any::<bool>())
            .prop_map(|(key, len, codec, sync)| Action::Put { key, len, codec, sync }),
        2 => (proptest::collection::vec(any::<u8>(), 1..6), 1u16..3000)
            .prop_map(|(keys, len)| Action::PutGroup { keys, len }),
        3 => any::<u8>().prop_map(|key| Action::Delete { key }),
        4 => any::<u8>().prop_map(|key| Action::Read { key }),
        1 => Just(Action::Flush),
        1 => Just(Action::Compact),
        1 => Just(Action::Crash),
        1 => Just(Action::Reopen),
    ]
}

fn key_of(k: u8) -> Vec<u8> {
    meta_key(&[b'm', k])
}

fn open_config(dir: &std::path::Path) -> Store {
    let mut config = StoreConfig::new(vec![dir.to_path_buf()]);
    config.segment_size_max_bytes = 256 << 10;
    config.checkpoint_interval_bytes = 128 << 10;
    config.reserve_bytes = 0;
    Store::open(config).unwrap()
}

fn check_all(store: &Store, model: &BTreeMap<u8, Vec<u8>>) {
    let keys = store.keys(&key_of(0), &meta_key(b"n"), 1000).unwrap();
    let expected: Vec<Vec<u8>> = model.keys().map(|k| key_of(*k)).collect();
    assert_eq!(keys, expected);
    for (k, v) in model {
        assert_eq!(&store.get(&key_of(*k)).unwrap().unwrap(), v, "key {k}");
    }
}

fn run(actions: Vec<Action>, case: usize) {
    let mut dir = fresh_dir(&format!("model-{case}"));
    let mut store = open_config(&dir);
    let mut model: BTreeMap<u8, Vec<u8>> = BTreeMap::new();
    let mut version = 0u64;
    let mut crashes = 0;
    for action in actions {
        version += 1;
        match action {
            Action::Put {
                key,
                len,
                codec,
                sync,
            } => {
                let value = value_for(key as u64, version, len as usize);
                let codec =
                    [Compression::None, Compression::Lz4, Compression::Zstd][codec as usize];
                let durability = if sync {
                    Durability::Sync
                } else {
                    Durability::Buffered
                };
                store
                    .write(
                        vec![WriteOp::put(key_of(key), value.clone(), codec)],
                        durability,
                    )
                    .unwrap();
                model.insert(key, value);
            }
            Action::PutGroup { keys, len } => {
                let ops = keys
                    .iter()
                    .map(|k| {
                        WriteOp::put(
                            key_of(*k),
                            value_for(*k as u64, version, len as usize),
                            Compression::Zstd,
                        )
                    })
                    .collect();
                store.write(ops, Durability::Sync).unwrap();
                for k in keys {
                    model.insert(k, value_for(k as u64, version, len as usize));
                }
            }
            Action::Delete { key } => {
                store
                    .write(
                        vec![WriteOp::Delete { key: key_of(key) }],
                        Durability::Buffered,
                    )
                    .unwrap();
                model.remove(&key);
            }
            Action::Read { key } => {
                assert_eq!(store.get(&key_of(key)).unwrap(), model.get(&key).cloned());
            }
            Action::Flush => store.flush().unwrap(),
            Action::Compact => {
                store.compact(0.3, &mut |_| {}).unwrap();
            }
            Action::Crash => {
                crashes += 1;
                let image = crash_image(&dir, &format!("model-{case}-crash-{crashes}"));
                drop(store);
                dir = image;
                store = open_config(&dir);
                check_all(&store, &model);
            }
            Action::Reopen => {
                drop(store);
                store = open_config(&dir);
                check_all(&store, &model);
            }
        }
    }
    check_all(&store, &model);
    let stats = store.stats().unwrap();
    assert_eq!(stats.live_extents, model.len() as u64);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model(actions in proptest::collection::vec(action(), 1..160)) {
        static CASE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let case = CASE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        run(actions, case);
    }
}
