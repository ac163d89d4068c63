//! Properties of the catalog's state machine, over random command sequences:
//! - the records in the store are exactly the state in memory (reloading gives the same state),
//!   and a snapshot (encode/decode, then `replace_ops` on another store) reproduces it;
//! - two appliers of the same commands reach the same state (determinism) and refuse the same
//!   commands;
//! - the invariants the state module states hold after every command.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use keel_catalog::{
    Catalog, CatalogState, Command, DeviceRecord, KeyRecord, LocalCatalog, Metadata, NodeAddresses,
    NodeRole, NodeSpec, Outcome, VolumeSettings, VolumeStatus,
};
use keel_store::{Durability, Store, StoreConfig};
use proptest::prelude::*;

fn store_dir(name: &str) -> PathBuf {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/test-data/catalog")
        .join(format!("{name}-{}", RUN.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn open(dir: &std::path::Path) -> Store {
    Store::open(StoreConfig::new(vec![dir.to_path_buf()])).unwrap()
}

const VOLUMES: [&str; 3] = ["a", "b", "c"];
const SNAPSHOTS: [&str; 2] = ["s1", "s2"];
const BUCKETS: [&str; 2] = ["bucket-one", "bucket-two"];
const KEYS: [&str; 2] = ["KEYONE", "KEYTWO"];

fn command() -> impl Strategy<Value = Command> {
    let volume = prop::sample::select(&VOLUMES[..]).prop_map(str::to_string);
    let snapshot = prop::sample::select(&SNAPSHOTS[..]).prop_map(str::to_string);
    let bucket = prop::sample::select(&BUCKETS[..]).prop_map(str::to_string);
    let key = prop::sample::select(&KEYS[..]).prop_map(str::to_string);
    prop_oneof![
        (volume.clone(), 1u64..64, 1u64..3, any::<bool>()).prop_map(|(name, blocks, node, two)| {
            Command::VolumeCreate {
                settings: VolumeSettings {
                    name,
                    size_bytes: blocks * 4096,
                    compression: "lz4".to_string(),
                    iops_max: None,
                    bandwidth_max_mib_per_second: None,
                },
                uuid: [1; 16],
                created_unix_seconds: 5,
                replicas: if two {
                    vec![node, 3 - node]
                } else {
                    vec![node]
                },
                status: VolumeStatus::Ready,
            }
        }),
        (
            0u64..6,
            1u64..4,
            1u64..3,
            prop::collection::vec(1u64..3, 0..3)
        )
            .prop_map(|(volume_id, epoch, primary, in_sync)| {
                Command::VolumeSetReplication {
                    volume_id,
                    epoch,
                    primary,
                    in_sync,
                }
            }),
        volume
            .clone()
            .prop_map(|name| Command::VolumeDelete { name }),
        (
            0u64..6,
            1u64..4,
            prop::collection::vec(1u64..4, 0..4),
            0u8..4
        )
            .prop_map(|(volume_id, epoch, replicas, in_sync_min)| {
                Command::VolumeSetReplicas {
                    volume_id,
                    epoch,
                    replicas,
                    in_sync_min,
                }
            }),
        (0u64..6, 1u64..4, 1u64..4, 1u64..4).prop_map(|(volume_id, epoch, from, to)| {
            Command::VolumeMoveReplica {
                volume_id,
                epoch,
                from,
                to,
            }
        }),
        (1u64..4, any::<bool>())
            .prop_map(|(id, draining)| Command::NodeSetDraining { id, draining }),
        (1u64..4, any::<bool>())
            .prop_map(|(id, nearfull)| Command::NodeSetNearfull { id, nearfull }),
        (0u64..6, 1u64..4, 1u64..4).prop_map(|(volume_id, epoch, to)| {
            Command::VolumeCopyOffDraining {
                volume_id,
                epoch,
                to,
            }
        }),
        (volume.clone(), snapshot.clone()).prop_map(|(volume, snapshot)| {
            Command::SnapshotCreate {
                volume,
                snapshot,
                guid: [2; 16],
                created_unix_seconds: 6,
            }
        }),
        (volume.clone(), snapshot.clone())
            .prop_map(|(volume, snapshot)| Command::SnapshotDelete { volume, snapshot }),
        (0u64..6, 1u64..8, 1u64..4).prop_map(|(volume_id, snapshot_generation, node)| {
            Command::SnapshotRepairBegin {
                volume_id,
                snapshot_generation,
                node,
            }
        }),
        (0u64..6, 1u64..8, 1u64..4, 1u64..12).prop_map(
            |(volume_id, snapshot_generation, node, generation)| Command::SnapshotRepairEnd {
                volume_id,
                snapshot_generation,
                node,
                generation,
            }
        ),
        (volume.clone(), snapshot.clone())
            .prop_map(|(volume, snapshot)| Command::VolumeRollback { volume, snapshot }),
        (volume.clone(), snapshot.clone(), volume.clone()).prop_map(|(parent, snapshot, name)| {
            Command::VolumeClone {
                parent,
                snapshot,
                name,
                uuid: [3; 16],
                created_unix_seconds: 7,
            }
        }),
        (volume.clone(), 1u64..64, any::<bool>()).prop_map(|(name, blocks, allow_shrink)| {
            Command::VolumeResize {
                name,
                size_bytes: blocks * 4096,
                allow_shrink,
            }
        }),
        (0u64..6).prop_map(|volume_id| Command::VolumeForget { volume_id }),
        key.clone().prop_map(|id| Command::KeyAdd {
            record: KeyRecord {
                access_key_id: id,
                name: "k".to_string(),
                secret_access_key: "secretsecret".to_string(),
                created_unix_ms: 1,
            },
        }),
        key.clone()
            .prop_map(|access_key_id| Command::KeyDelete { access_key_id }),
        (bucket.clone(), key.clone()).prop_map(|(name, owner)| Command::BucketCreate {
            name,
            owner,
            compression_code: 0,
            created_unix_ms: 2,
        }),
        bucket
            .clone()
            .prop_map(|name| Command::BucketDelete { name }),
        (bucket.clone(), key, any::<bool>()).prop_map(|(bucket, access_key_id, allow)| {
            Command::BucketGrant {
                bucket,
                access_key_id,
                allow,
            }
        }),
        (bucket.clone(), 0usize..3).prop_map(|(bucket, count)| Command::BucketSetTags {
            bucket,
            tags: (0..count)
                .map(|i| (format!("k{i}"), format!("v{i}")))
                .collect(),
        }),
        (bucket.clone(), any::<bool>()).prop_map(|(bucket, public_read)| {
            Command::BucketSetPublicRead {
                bucket,
                public_read,
            }
        }),
        (bucket.clone(), 0u32..3).prop_map(|(bucket, days)| Command::BucketSetLifecycle {
            bucket,
            rules: (0..days)
                .map(|day| keel_catalog::LifecycleRule {
                    enabled: true,
                    prefix: format!("logs/{day}"),
                    expiration_days: Some(day + 1),
                    ..Default::default()
                })
                .collect(),
        }),
        (bucket.clone(), any::<bool>())
            .prop_map(|(bucket, enabled)| { Command::BucketSetVersioning { bucket, enabled } }),
        (bucket.clone(), any::<bool>()).prop_map(|(bucket, default)| {
            Command::BucketSetObjectLock {
                bucket,
                lock: keel_catalog::ObjectLock {
                    default_retention: default.then_some(keel_catalog::DefaultRetention {
                        mode: keel_catalog::LockMode::Governance,
                        days: Some(1),
                        years: None,
                    }),
                },
            }
        }),
        bucket.clone().prop_map(|name| Command::BucketCreateLocked {
            name,
            owner: "KEYONE".to_string(),
            compression_code: 0,
            created_unix_ms: 2,
        }),
        (bucket, 0usize..2).prop_map(|(bucket, count)| Command::BucketSetCors {
            bucket,
            rules: (0..count)
                .map(|i| keel_catalog::CorsRule {
                    id: Some(format!("rule{i}")),
                    allowed_origins: vec!["https://*.example.com".to_string()],
                    allowed_methods: vec!["GET".to_string()],
                    max_age_seconds: Some(60),
                    ..Default::default()
                })
                .collect(),
        }),
        (1u64..4).prop_map(|id| Command::NodeRemove { id }),
    ]
}

fn second_node() -> Command {
    Command::NodeAdd {
        node: NodeSpec {
            name: "second".to_string(),
            instance: [5; 16],
            role: NodeRole::Storage,
            addresses: NodeAddresses {
                cluster: "127.0.0.2:3902".to_string(),
                ..NodeAddresses::default()
            },
            labels: Default::default(),
            devices: Vec::new(),
        },
        joined_unix_ms: 3,
    }
}

fn check_invariants(state: &CatalogState) {
    for (name, settings) in &state.bucket_settings {
        assert!(
            state.buckets.contains_key(name),
            "settings of a missing bucket {name}"
        );
        // Object lock holds versions: versioning cannot be suspended under it.
        if settings.object_lock.is_some() {
            assert_eq!(
                settings.versioning,
                keel_catalog::Versioning::Enabled,
                "{name}"
            );
        }
    }
    let mut names = BTreeSet::new();
    for entry in state.volumes.values() {
        let record = &entry.record;
        if record.status != VolumeStatus::Deleting {
            assert!(
                names.insert(record.name.clone()),
                "duplicate name {}",
                record.name
            );
        }
        assert!(record.id < state.next_volume_id);
        let replication = &record.replication;
        assert!(replication.in_sync.contains(&replication.primary));
        assert!(replication
            .in_sync
            .iter()
            .all(|node| replication.replicas.contains(node)));
        assert!(replication.epoch >= 1);
        assert!(replication.replicas.contains(&replication.primary));
        // R is what the replicas are, but while a volume with one replica is copied off a
        // draining node: then there are two.
        assert!(
            usize::from(replication.factor) == replication.replicas.len()
                || (replication.factor == 1 && replication.replicas.len() == 2),
            "{replication:?}"
        );
        assert!(
            replication.in_sync_min >= 1
                && usize::from(replication.in_sync_min) <= replication.replicas.len()
        );
        assert_eq!(record.generation, record.view[0].generation_max);
        assert!(record.generation < record.generation_next);
        for snapshot in entry.snapshots.values() {
            assert!(snapshot.generation < record.generation_next);
            // A repair under way writes a generation no view shows.
            for repair in &snapshot.repairs {
                assert!(repair.generation < record.generation_next);
                assert!(
                    replication.replicas.contains(&repair.node),
                    "a repair of node {}'s copy, which holds no replica",
                    repair.node
                );
                assert!(!snapshot.complete_on(repair.node));
                let views = std::iter::once(&record.view)
                    .chain(entry.snapshots.values().map(|snapshot| &snapshot.view));
                for view in views {
                    assert!(
                        view[0].visible(0, &[repair.generation]).is_none(),
                        "repair generation {} is shown by {view:?}",
                        repair.generation
                    );
                }
            }
        }
        if let Some(origin) = &record.origin {
            if record.status == VolumeStatus::Ready {
                let parent = state
                    .volumes
                    .get(&origin.volume_id)
                    .expect("clone's parent");
                assert!(
                    parent.snapshots.contains_key(&origin.snapshot_generation),
                    "clone's origin snapshot"
                );
            }
        }
    }
    for bucket in state.buckets.values() {
        assert!(!bucket.name.is_empty());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn store_memory_and_snapshots_agree(commands in prop::collection::vec(command(), 1..40)) {
        let dir = store_dir("agree");
        let store = open(&dir);
        let catalog = LocalCatalog::open(store.clone()).unwrap();
        // A LocalCatalog bootstraps in memory only; make the cluster record durable too so a
        // reload sees the same state.
        let other_dir = store_dir("agree-other");
        let other_store = open(&other_dir);
        let other = LocalCatalog::open(other_store.clone()).unwrap();
        for catalog in [&catalog, &other] {
            catalog.propose(second_node()).unwrap();
        }
        let mut refusals = Vec::new();
        for command in &commands {
            let first = catalog.propose(command.clone());
            let second = other.propose(command.clone());
            prop_assert_eq!(first.is_ok(), second.is_ok(), "{:?}", command);
            if let Err(refusal) = first {
                refusals.push(refusal.to_string());
            }
            check_invariants(&catalog.catalog().read());
        }
        let memory = catalog.catalog().read().clone();
        prop_assert_eq!(&memory, &*other.catalog().read());

        // The store holds exactly what memory holds (minus the in-memory bootstrap).
        let reloaded = CatalogState::load(&store, 1).unwrap();
        let mut expected = memory.clone();
        expected.cluster = reloaded.cluster.clone();
        expected.nodes.retain(|id, _| reloaded.nodes.contains_key(id));
        prop_assert_eq!(&reloaded, &expected);

        // A snapshot written over another store's catalog reproduces the state there.
        let target_dir = store_dir("agree-target");
        let target = open(&target_dir);
        target.write(second_node_ops(), Durability::Sync).unwrap();
        let decoded = CatalogState::decode(&memory.encode()).unwrap();
        prop_assert_eq!(&decoded, &memory);
        let restored = Catalog::new(CatalogState::default());
        restored.restore(&target, decoded, Vec::new()).unwrap();
        prop_assert_eq!(&CatalogState::load(&target, 1).unwrap(), &memory);
        let _ = refusals;
    }
}

fn third_node() -> Command {
    let Command::NodeAdd { mut node, .. } = second_node() else {
        unreachable!()
    };
    node.name = "third".to_string();
    node.instance = [6; 16];
    node.addresses.cluster = "127.0.0.3:3902".to_string();
    Command::NodeAdd {
        node,
        joined_unix_ms: 4,
    }
}

/// Creates volume "r2" on nodes 1 and 2; returns its id.
fn create_r2(catalog: &LocalCatalog) -> u64 {
    create_r2_on(catalog, vec![1, 2])
}

/// Creates volume "r2" (whatever its R) on `replicas`, the first its primary; returns its id.
fn create_r2_on(catalog: &LocalCatalog, replicas: Vec<u64>) -> u64 {
    create_volume(catalog, "r2", 1 << 20, 1, replicas)
}

/// Creates a ready volume `name` of `size_bytes` (UUID bytes all `uuid`) on `replicas`, the
/// first its primary; returns its id.
fn create_volume(
    catalog: &LocalCatalog,
    name: &str,
    size_bytes: u64,
    uuid: u8,
    replicas: Vec<u64>,
) -> u64 {
    catalog
        .propose(Command::VolumeCreate {
            settings: VolumeSettings {
                name: name.to_string(),
                size_bytes,
                compression: "none".to_string(),
                iops_max: None,
                bandwidth_max_mib_per_second: None,
            },
            uuid: [uuid; 16],
            created_unix_seconds: 5,
            replicas,
            status: VolumeStatus::Ready,
        })
        .unwrap();
    catalog.catalog().read().volume(name).unwrap().record.id
}

fn replication_of(catalog: &LocalCatalog) -> keel_catalog::Replication {
    catalog
        .catalog()
        .read()
        .volume("r2")
        .unwrap()
        .record
        .replication
        .clone()
}

// Proves a replication change is a compare-and-set on the epoch, and that a node that is not
// in sync can never be named primary.
#[test]
fn replication_changes_compare_the_epoch() {
    let dir = store_dir("replication");
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    catalog.propose(second_node()).unwrap();
    let id = create_r2(&catalog);
    let set = |epoch, primary, in_sync: Vec<u64>| Command::VolumeSetReplication {
        volume_id: id,
        epoch,
        primary,
        in_sync,
    };
    // Node 1 drops node 2 from the in-sync set: epoch 1 → 2.
    catalog.propose(set(1, 1, vec![1])).unwrap();
    // Node 2 tries to take over against the epoch it last saw: refused (moved on).
    let stale = catalog.propose(set(1, 2, vec![2])).unwrap_err();
    assert!(stale.to_string().contains("epoch 2"), "{stale}");
    // Against the current epoch it is still refused: it is not in sync.
    let behind = catalog.propose(set(2, 2, vec![2])).unwrap_err();
    assert!(behind.to_string().contains("not in sync"), "{behind}");
    // The primary must be in the set.
    assert!(catalog.propose(set(2, 1, vec![2])).is_err());
    // Node 2 caught up: back in the set, epoch 3; then it may become primary.
    catalog.propose(set(2, 1, vec![1, 2])).unwrap();
    catalog.propose(set(3, 2, vec![2])).unwrap();
    let replication = replication_of(&catalog);
    assert_eq!((replication.epoch, replication.primary), (4, 2));
    assert_eq!(replication.in_sync, vec![2]);
    assert_eq!(replication.in_sync_min, 1);
    // Moving a replica: never the primary, never onto a node holding one, only in the epoch.
    let moving = |epoch, from, to| Command::VolumeMoveReplica {
        volume_id: id,
        epoch,
        from,
        to,
    };
    assert!(catalog.propose(moving(4, 2, 1)).is_err(), "the primary");
    assert!(catalog.propose(moving(3, 1, 3)).is_err(), "an old epoch");
    assert!(catalog.propose(moving(4, 1, 2)).is_err(), "onto a replica");
    assert!(catalog.propose(moving(4, 1, 9)).is_err(), "onto a stranger");
    catalog.propose(third_node()).unwrap();
    catalog.propose(moving(4, 1, 3)).unwrap();
    let replication = replication_of(&catalog);
    assert_eq!(replication.replicas, vec![3, 2]);
    assert_eq!(
        replication.in_sync,
        vec![2],
        "the new replica starts out of sync"
    );
    assert_eq!(replication.epoch, 5);

    // Changing R: the primary (node 2) keeps its replica, nodes are distinct, the minimum
    // fits, and only in the current epoch.
    let resize = |epoch, replicas: Vec<u64>, in_sync_min| Command::VolumeSetReplicas {
        volume_id: id,
        epoch,
        replicas,
        in_sync_min,
    };
    let refused = catalog.propose(resize(5, vec![3, 1], 1)).unwrap_err();
    assert!(
        refused.to_string().contains("keeps its replica"),
        "{refused}"
    );
    assert!(catalog.propose(resize(5, vec![2, 2], 1)).is_err(), "twice");
    assert!(
        catalog.propose(resize(5, vec![2, 9], 1)).is_err(),
        "a stranger"
    );
    assert!(
        catalog.propose(resize(5, vec![2, 3], 3)).is_err(),
        "minimum above R"
    );
    assert!(
        catalog.propose(resize(5, vec![2, 3], 0)).is_err(),
        "minimum zero"
    );
    assert!(
        catalog.propose(resize(4, vec![2, 3, 1], 1)).is_err(),
        "an old epoch"
    );
    catalog.propose(resize(5, vec![2, 3, 1], 2)).unwrap();
    let replication = replication_of(&catalog);
    assert_eq!(replication.replicas, vec![2, 3, 1]);
    assert_eq!((replication.factor, replication.in_sync_min), (3, 2));
    assert_eq!(
        replication.in_sync,
        vec![2],
        "added replicas start out of sync"
    );
    assert_eq!(replication.epoch, 6);
    // Down to R=1: the removed replicas leave the in-sync set.
    catalog.propose(set(6, 2, vec![2, 3])).unwrap();
    catalog.propose(resize(7, vec![2], 1)).unwrap();
    let replication = replication_of(&catalog);
    assert_eq!(
        (
            replication.replicas,
            replication.in_sync,
            replication.factor
        ),
        (vec![2], vec![2], 1)
    );
}

// Proves a volume's one replica is copied off a draining node with R kept at 1: only from a
// draining node, onto a storage node that takes replicas, in the volume's epoch; and that
// removing the draining node's copy afterwards leaves R=1 on the new node.
#[test]
fn a_single_copy_is_copied_off_a_draining_node() {
    let dir = store_dir("copy-off");
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    catalog.propose(second_node()).unwrap();
    catalog.propose(third_node()).unwrap();
    let id = create_r2_on(&catalog, vec![1]);
    catalog
        .propose(Command::SnapshotCreate {
            volume: "r2".to_string(),
            snapshot: "before".to_string(),
            guid: [2; 16],
            created_unix_seconds: 6,
        })
        .unwrap();
    let copy = |epoch, to| Command::VolumeCopyOffDraining {
        volume_id: id,
        epoch,
        to,
    };
    let refused = catalog.propose(copy(1, 2)).unwrap_err();
    assert!(
        refused.to_string().contains("is on a draining node"),
        "{refused}"
    );
    let draining = |id, draining| Command::NodeSetDraining { id, draining };
    catalog.propose(draining(1, true)).unwrap();
    catalog.propose(draining(3, true)).unwrap();
    assert!(catalog.propose(copy(1, 3)).is_err(), "onto a draining node");
    assert!(catalog.propose(copy(1, 1)).is_err(), "onto itself");
    assert!(catalog.propose(copy(1, 9)).is_err(), "onto a stranger");
    assert!(catalog.propose(copy(0, 2)).is_err(), "an old epoch");
    catalog.propose(copy(1, 2)).unwrap();
    let replication = replication_of(&catalog);
    assert_eq!(
        (
            replication.factor,
            replication.replicas.clone(),
            replication.in_sync.clone(),
            replication.epoch
        ),
        (1, vec![1, 2], vec![1], 2),
        "R stays 1; the copy starts out of sync"
    );
    let entry = catalog.catalog().read().volume("r2").unwrap().clone();
    let snapshot = entry.snapshots.values().next().unwrap();
    assert_eq!(
        snapshot.incomplete_on,
        vec![2],
        "the snapshot is not on the copy yet"
    );
    let again = catalog.propose(copy(2, 3)).unwrap_err();
    assert!(again.to_string().contains("under way already"), "{again}");
    // The copy caught up, took the volume over, and removed the draining node's replica.
    let set = |epoch, primary| Command::VolumeSetReplication {
        volume_id: id,
        epoch,
        primary,
        in_sync: vec![1, 2],
    };
    catalog.propose(set(2, 1)).unwrap();
    catalog.propose(set(3, 2)).unwrap();
    catalog
        .propose(Command::VolumeSetReplicas {
            volume_id: id,
            epoch: 4,
            replicas: vec![2],
            in_sync_min: 1,
        })
        .unwrap();
    let replication = replication_of(&catalog);
    assert_eq!(
        (
            replication.factor,
            replication.replicas,
            replication.primary
        ),
        (1, vec![2], 2)
    );
}

// Proves a replica of an R=2 volume is copied off a draining node before it goes: the copy
// joins as a third replica out of sync while R stays 2 and the draining node's copy stays in
// sync; only one copy at a time, never onto a node that holds a replica; and removing the
// draining node's copy afterwards leaves R=2.
#[test]
fn a_replica_is_copied_off_a_draining_node_before_it_goes() {
    let dir = store_dir("copy-off-r2");
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    catalog.propose(second_node()).unwrap();
    catalog.propose(third_node()).unwrap();
    let id = create_volume(&catalog, "r2", 1 << 20, 1, vec![1, 2]);
    let copy = |epoch, to| Command::VolumeCopyOffDraining {
        volume_id: id,
        epoch,
        to,
    };
    catalog
        .propose(Command::VolumeSetReplication {
            volume_id: id,
            epoch: 1,
            primary: 1,
            in_sync: vec![1, 2],
        })
        .unwrap();
    let refused = catalog.propose(copy(2, 3)).unwrap_err();
    assert!(
        refused.to_string().contains("is on a draining node"),
        "{refused}"
    );
    catalog
        .propose(Command::NodeSetDraining {
            id: 2,
            draining: true,
        })
        .unwrap();
    let onto = catalog.propose(copy(2, 1)).unwrap_err();
    assert!(onto.to_string().contains("already holds"), "{onto}");
    catalog.propose(copy(2, 3)).unwrap();
    let replication = replication_of(&catalog);
    assert_eq!(
        (
            replication.factor,
            replication.replicas.clone(),
            replication.in_sync.clone(),
            replication.epoch
        ),
        (2, vec![1, 2, 3], vec![1, 2], 3),
        "R stays 2; the draining node's copy stays in sync, the new one starts out of it"
    );
    let again = catalog.propose(copy(3, 3)).unwrap_err();
    assert!(again.to_string().contains("under way already"), "{again}");
    catalog
        .propose(Command::VolumeSetReplicas {
            volume_id: id,
            epoch: 3,
            replicas: vec![1, 3],
            in_sync_min: 1,
        })
        .unwrap();
    let replication = replication_of(&catalog);
    assert_eq!((replication.factor, replication.replicas), (2, vec![1, 3]));
}

// Proves a snapshot records the replicas whose copy of it is incomplete (out of sync when it
// was taken, or placed after it), that no in-sync replica is rolled back onto it, and that a
// clone of it starts in sync only on the nodes whose copy is complete.
#[test]
fn snapshots_know_where_their_data_is_incomplete() {
    let dir = store_dir("incomplete");
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    catalog.propose(second_node()).unwrap();
    catalog.propose(third_node()).unwrap();
    let id = create_r2(&catalog);
    let snapshot = |name: &str| Command::SnapshotCreate {
        volume: "r2".to_string(),
        snapshot: name.to_string(),
        guid: [name.len() as u8; 16],
        created_unix_seconds: 6,
    };
    let incomplete_on = |name: &str| {
        catalog
            .catalog()
            .read()
            .volume("r2")
            .unwrap()
            .snapshot_by_name(name)
            .unwrap()
            .incomplete_on
            .clone()
    };
    catalog.propose(snapshot("both")).unwrap();
    assert_eq!(incomplete_on("both"), Vec::<u64>::new());
    // Node 2 leaves the in-sync set; a snapshot taken now lacks data there.
    catalog
        .propose(Command::VolumeSetReplication {
            volume_id: id,
            epoch: 1,
            primary: 1,
            in_sync: vec![1],
        })
        .unwrap();
    catalog.propose(snapshot("alone")).unwrap();
    assert_eq!(incomplete_on("alone"), vec![2]);
    // A clone of it starts in sync on node 1 only.
    catalog
        .propose(Command::VolumeClone {
            parent: "r2".to_string(),
            snapshot: "alone".to_string(),
            name: "copy".to_string(),
            uuid: [9; 16],
            created_unix_seconds: 7,
        })
        .unwrap();
    let clone = catalog
        .catalog()
        .read()
        .volume("copy")
        .unwrap()
        .record
        .replication
        .clone();
    assert_eq!(
        (clone.replicas, clone.in_sync, clone.primary),
        (vec![1, 2], vec![1], 1)
    );
    // Node 2 is back in sync (the current contents): rolling it back onto "alone" is refused.
    catalog
        .propose(Command::VolumeSetReplication {
            volume_id: id,
            epoch: 2,
            primary: 1,
            in_sync: vec![1, 2],
        })
        .unwrap();
    let rollback = |name: &str| Command::VolumeRollback {
        volume: "r2".to_string(),
        snapshot: name.to_string(),
    };
    let refused = catalog.propose(rollback("alone")).unwrap_err();
    assert!(
        refused.to_string().contains("incomplete on node 2"),
        "{refused}"
    );
    catalog.propose(rollback("both")).unwrap();
    // A third replica: every existing snapshot is incomplete on it.
    catalog
        .propose(Command::VolumeSetReplicas {
            volume_id: id,
            epoch: 3,
            replicas: vec![1, 2, 3],
            in_sync_min: 1,
        })
        .unwrap();
    assert_eq!(incomplete_on("both"), vec![3]);
    assert_eq!(incomplete_on("alone"), vec![2, 3]);
    // Out of sync on node 2 alone, rolling back onto "both" is fine again.
    catalog
        .propose(Command::VolumeSetReplication {
            volume_id: id,
            epoch: 4,
            primary: 1,
            in_sync: vec![1, 2],
        })
        .unwrap();
    catalog.propose(rollback("both")).unwrap();
    // Reloading from the store keeps it all.
    drop(catalog);
    let reopened = LocalCatalog::open(open(&dir)).unwrap();
    let state = reopened.catalog().read();
    let record = state.volume("r2").unwrap();
    assert_eq!(
        record.snapshot_by_name("alone").unwrap().incomplete_on,
        vec![2, 3]
    );
}

// Proves a snapshot repair writes into a generation that no view shows (the volume's, later
// snapshots', the snapshot's own) until it ends; that it resumes in the same generation; and
// that once ended the snapshot's view, a rollback onto it, a clone of it and a stream received
// on top of it all show the repaired generation, and nothing the snapshot did not show.
#[test]
fn a_snapshot_repair_is_shown_only_once_it_ends() {
    let dir = store_dir("repair");
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    catalog.propose(second_node()).unwrap();
    catalog.propose(third_node()).unwrap();
    let id = create_r2(&catalog);
    let snapshot = |name: &str, guid: u8| Command::SnapshotCreate {
        volume: "r2".to_string(),
        snapshot: name.to_string(),
        guid: [guid; 16],
        created_unix_seconds: 6,
    };
    catalog
        .propose(Command::VolumeSetReplication {
            volume_id: id,
            epoch: 1,
            primary: 1,
            in_sync: vec![1],
        })
        .unwrap();
    catalog.propose(snapshot("alone", 1)).unwrap();
    let entry = || catalog.catalog().read().volume("r2").unwrap().clone();
    let frozen = entry().snapshot_by_name("alone").unwrap().clone();
    let shows = |view: &[keel_catalog::view::Layer], generation: u64| {
        view[0].visible(0, &[generation]).is_some()
    };
    let begin = |node| Command::SnapshotRepairBegin {
        volume_id: id,
        snapshot_generation: frozen.generation,
        node,
    };
    for (node, why) in [(1, "complete"), (3, "holds no replica")] {
        let refused = catalog.propose(begin(node)).unwrap_err();
        assert!(refused.to_string().contains(why), "{refused}");
    }
    let reserved = catalog.propose(begin(2)).unwrap();
    let Outcome::Reserved { generation, .. } = reserved else {
        panic!("{reserved:?}")
    };
    let live_generation = entry().record.generation;
    assert!(generation > live_generation, "a fresh generation");
    assert!(!shows(&entry().record.view, generation));
    assert!(!shows(
        &entry().snapshot_by_name("alone").unwrap().view,
        generation
    ));
    assert_eq!(catalog.propose(begin(2)).unwrap(), reserved, "resumed");
    // A snapshot taken meanwhile, and the volume after it, still skip the repair's generation.
    catalog.propose(snapshot("later", 2)).unwrap();
    assert!(entry().record.generation > generation);
    assert!(!shows(&entry().record.view, generation));
    assert!(!shows(
        &entry().snapshot_by_name("later").unwrap().view,
        generation
    ));

    let end = |generation| Command::SnapshotRepairEnd {
        volume_id: id,
        snapshot_generation: frozen.generation,
        node: 2,
        generation,
    };
    assert!(
        catalog.propose(end(generation + 1)).is_err(),
        "not its generation"
    );
    catalog.propose(end(generation)).unwrap();
    assert!(catalog.propose(end(generation)).is_err(), "ended already");
    let repaired = entry().snapshot_by_name("alone").unwrap().clone();
    assert!(repaired.complete_on(2) && repaired.repairs.is_empty());
    assert!(shows(&repaired.view, generation) && shows(&repaired.view, frozen.generation));
    assert!(
        !shows(&repaired.view, live_generation),
        "written after the snapshot"
    );
    assert!(!shows(&entry().record.view, generation));

    // A clone of it, a stream received on top of it and a rollback onto it show the repair.
    catalog
        .propose(Command::VolumeClone {
            parent: "r2".to_string(),
            snapshot: "alone".to_string(),
            name: "copy".to_string(),
            uuid: [9; 16],
            created_unix_seconds: 7,
        })
        .unwrap();
    let clone = catalog
        .catalog()
        .read()
        .volume("copy")
        .unwrap()
        .record
        .clone();
    assert!(clone.view[1].visible(0, &[generation]).is_some());
    let Outcome::Reserved {
        generation: receiving,
        ..
    } = catalog
        .propose(Command::ReceiveReserve {
            volume: "r2".to_string(),
            base_guid: [1; 16],
            target_name: "received".to_string(),
            target_guid: [3; 16],
        })
        .unwrap()
    else {
        panic!("no reservation")
    };
    catalog
        .propose(Command::ReceivePublish {
            volume_id: id,
            generation: receiving,
            base_generation: Some(frozen.generation),
            target_name: "received".to_string(),
            target_guid: [3; 16],
            size_bytes: 1 << 20,
            created_unix_seconds: 8,
        })
        .unwrap();
    let received = entry().snapshot_by_name("received").unwrap().clone();
    assert!(shows(&received.view, generation) && shows(&received.view, receiving));
    assert!(!shows(&received.view, live_generation));
    catalog
        .propose(Command::VolumeRollback {
            volume: "r2".to_string(),
            snapshot: "alone".to_string(),
        })
        .unwrap();
    let record = entry().record;
    assert!(shows(&record.view, generation) && shows(&record.view, frozen.generation));
    assert!(!shows(&record.view, live_generation) && !shows(&record.view, receiving));
}

// Proves a change of the replicas ends the repairs of the copies it erases: node 2's copy of a
// snapshot is being repaired when R is lowered off node 2 and raised back onto it (the node
// erased its copy in between, and the repair's writes with it); the old repair can no longer
// end (it would name node 2's new, empty copy complete) and a new one starts in a new
// generation. A move off the node being repaired ends its repair too.
#[test]
fn a_change_of_replicas_ends_the_repairs_of_the_copies_it_erases() {
    let dir = store_dir("repair_replicas");
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    catalog.propose(second_node()).unwrap();
    catalog.propose(third_node()).unwrap();
    let id = create_r2(&catalog);
    let epoch = || replication_of(&catalog).epoch;
    catalog
        .propose(Command::VolumeSetReplication {
            volume_id: id,
            epoch: epoch(),
            primary: 1,
            in_sync: vec![1],
        })
        .unwrap();
    catalog
        .propose(Command::SnapshotCreate {
            volume: "r2".to_string(),
            snapshot: "s".to_string(),
            guid: [1; 16],
            created_unix_seconds: 6,
        })
        .unwrap();
    let snapshot = || {
        catalog
            .catalog()
            .read()
            .volume("r2")
            .unwrap()
            .snapshot_by_name("s")
            .unwrap()
            .clone()
    };
    let generation_of_s = snapshot().generation;
    let begin = |node| Command::SnapshotRepairBegin {
        volume_id: id,
        snapshot_generation: generation_of_s,
        node,
    };
    let reserved = |outcome: Outcome| match outcome {
        Outcome::Reserved { generation, .. } => generation,
        other => panic!("{other:?}"),
    };
    let end = |node, generation| Command::SnapshotRepairEnd {
        volume_id: id,
        snapshot_generation: generation_of_s,
        node,
        generation,
    };
    let set_replicas = |replicas: Vec<u64>| Command::VolumeSetReplicas {
        volume_id: id,
        epoch: epoch(),
        replicas,
        in_sync_min: 1,
    };

    let first = reserved(catalog.propose(begin(2)).unwrap());
    catalog.propose(set_replicas(vec![1])).unwrap();
    assert!(snapshot().repairs.is_empty(), "{:?}", snapshot().repairs);
    catalog.propose(set_replicas(vec![1, 2])).unwrap();
    assert!(!snapshot().complete_on(2));
    let refused = catalog.propose(end(2, first)).unwrap_err();
    assert!(refused.to_string().contains("no repair"), "{refused}");
    assert!(
        !snapshot().complete_on(2),
        "the erased copy was named complete"
    );
    let second = reserved(catalog.propose(begin(2)).unwrap());
    assert_ne!(second, first, "a new repair, from the start");

    // Node 2 moved to node 3: the repair of its copy ends there too.
    catalog
        .propose(Command::VolumeMoveReplica {
            volume_id: id,
            epoch: epoch(),
            from: 2,
            to: 3,
        })
        .unwrap();
    assert!(snapshot().repairs.is_empty(), "{:?}", snapshot().repairs);
    assert!(catalog.propose(end(2, second)).is_err());
    assert!(!snapshot().complete_on(3));
}

// Proves new replicas go to the nodes that share the fewest failure-domain labels with the
// replicas already placed, and never to a node that is down, draining or a witness.
#[test]
fn placement_spreads_replicas_over_failure_domains() {
    let dir = store_dir("placement");
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    let zone = |id: u64, zone: &str| {
        let Command::NodeAdd { mut node, .. } = second_node() else {
            unreachable!()
        };
        node.name = format!("n{id}");
        node.instance = [id as u8; 16];
        node.addresses.cluster = format!("127.0.0.{id}:3902");
        node.labels.insert("zone".to_string(), zone.to_string());
        Command::NodeAdd {
            node,
            joined_unix_ms: 4,
        }
    };
    // Node 1 (unlabelled) exists; 2 and 3 in zone a, 4 in zone b.
    catalog.propose(zone(2, "a")).unwrap();
    catalog.propose(zone(3, "a")).unwrap();
    catalog.propose(zone(4, "b")).unwrap();
    let state = catalog.catalog().read().clone();
    assert_eq!(state.choose_replica_nodes(&[2], 1), vec![1]);
    assert_eq!(state.choose_replica_nodes(&[2, 1], 1), vec![4]);
    assert_eq!(state.choose_replica_nodes(&[3], 2), vec![1, 4]);
    assert_eq!(state.choose_replica_nodes(&[2, 3], 5), vec![1, 4]);
    catalog
        .propose(Command::NodeSetDraining {
            id: 4,
            draining: true,
        })
        .unwrap();
    catalog
        .propose(Command::NodeSetState {
            id: 1,
            state: keel_catalog::NodeState::Down,
            at_unix_ms: 9,
        })
        .unwrap();
    let state = catalog.catalog().read().clone();
    assert_eq!(state.choose_replica_nodes(&[2], 2), vec![3]);
}

// Proves placement weighs how much of each node's capacity its volumes already take: volumes
// placed one after the other (a drain's copies, new volumes) spread over the nodes in
// proportion to their capacity, where they once all went to the lowest id.
#[test]
fn placement_fills_nodes_in_proportion_to_their_capacity() {
    const GIB: u64 = 1 << 30;
    let dir = store_dir("placement-capacity");
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    for (id, capacity_gib) in [(2u64, 100u64), (3, 100), (4, 300)] {
        let Command::NodeAdd { mut node, .. } = second_node() else {
            unreachable!()
        };
        node.name = format!("n{id}");
        node.instance = [id as u8; 16];
        node.addresses.cluster = format!("127.0.0.{id}:3902");
        node.devices = vec![DeviceRecord {
            path: "/var/lib/keel".to_string(),
            filesystem: "ext4".to_string(),
            capacity_bytes: capacity_gib * GIB,
        }];
        catalog
            .propose(Command::NodeAdd {
                node,
                joined_unix_ms: 4,
            })
            .unwrap();
    }
    // 25 volumes of 10 GiB, each where placement puts a volume that leaves node 1.
    let mut placed = BTreeMap::<u64, usize>::new();
    for index in 0..25u8 {
        let to = catalog.catalog().read().choose_replica_nodes(&[1], 1);
        assert_eq!(to.len(), 1, "{to:?}");
        create_volume(&catalog, &format!("v{index}"), 10 * GIB, index, to.clone());
        *placed.entry(to[0]).or_default() += 1;
    }
    assert_eq!(placed, BTreeMap::from([(2, 5), (3, 5), (4, 15)]));
    let state = catalog.catalog().read().clone();
    assert_eq!(
        state.provisioned_bytes(),
        BTreeMap::from([(2, 50 * GIB), (3, 50 * GIB), (4, 150 * GIB)])
    );
    // Failure domains still come first: node 4 shares a zone with the replica on node 2, so
    // the second replica goes to node 3 although node 4 is as full.
    let label = |id: u64| {
        let mut record = state.nodes[&id].clone();
        record.labels.insert("zone".to_string(), "a".to_string());
        record
    };
    let mut zoned = state.clone();
    zoned.nodes.insert(2, label(2));
    zoned.nodes.insert(4, label(4));
    if let Some(first) = zoned.nodes.get_mut(&1) {
        first.draining = true;
    }
    assert_eq!(zoned.choose_replica_nodes(&[2], 1), vec![3]);
    assert_eq!(zoned.choose_replica_nodes(&[4], 2), vec![3, 2]);
    // Without the zones and the drain: node 1 holds nothing, then node 3 (the lower id of
    // two at half their capacity).
    assert_eq!(state.choose_replica_nodes(&[2], 2), vec![1, 3]);
}

// Proves a drain names what it waits for (in volume order): a replica with nowhere to move, a
// primary with no replica in sync to hand off to, an only copy with no node to copy to; and
// nothing for a volume that can leave.
#[test]
fn a_drain_names_the_volumes_that_cannot_leave() {
    use keel_catalog::DrainWait::{NoCopyTarget, NoHandOffTarget, NoMoveTarget};
    let dir = store_dir("drain-waits");
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    catalog.propose(second_node()).unwrap();
    catalog.propose(third_node()).unwrap();
    for (uuid, (name, replicas)) in [
        ("wide", vec![2, 1, 3]),
        ("pair", vec![1, 2]),
        ("solo", vec![1]),
        ("elsewhere", vec![2, 3]),
    ]
    .into_iter()
    .enumerate()
    {
        create_volume(&catalog, name, 1 << 20, uuid as u8, replicas);
    }
    catalog
        .propose(Command::NodeSetDraining {
            id: 1,
            draining: true,
        })
        .unwrap();
    let waits = |catalog: &LocalCatalog| catalog.catalog().read().drain_waits(1);
    // "pair" moves to node 3 after a hand-off to node 2, "solo" is copied: only "wide" waits.
    assert_eq!(
        waits(&catalog),
        vec![("wide".to_string(), vec![NoMoveTarget])]
    );
    let set_state = |id, state| {
        catalog
            .propose(Command::NodeSetState {
                id,
                state,
                at_unix_ms: 9,
            })
            .unwrap();
    };
    // Node 2 down: "pair" has nobody in sync to take its primary; "wide", also nowhere to go.
    set_state(2, keel_catalog::NodeState::Down);
    assert_eq!(
        waits(&catalog),
        vec![
            ("wide".to_string(), vec![NoMoveTarget]),
            ("pair".to_string(), vec![NoHandOffTarget]),
        ]
    );
    // Node 3 down too: "solo" has nowhere to go either, and "pair" neither.
    set_state(3, keel_catalog::NodeState::Down);
    assert_eq!(
        waits(&catalog),
        vec![
            ("wide".to_string(), vec![NoMoveTarget]),
            ("pair".to_string(), vec![NoHandOffTarget, NoMoveTarget]),
            ("solo".to_string(), vec![NoCopyTarget]),
        ]
    );
    // Back up, and "wide" down to R=2 through its primary: nothing waits.
    set_state(2, keel_catalog::NodeState::Up);
    set_state(3, keel_catalog::NodeState::Up);
    let wide = catalog
        .catalog()
        .read()
        .volume("wide")
        .unwrap()
        .record
        .clone();
    catalog
        .propose(Command::VolumeSetReplicas {
            volume_id: wide.id,
            epoch: wide.replication.epoch,
            in_sync_min: 1,
            replicas: vec![2, 3],
        })
        .unwrap();
    assert_eq!(waits(&catalog), Vec::new());
}

// Proves a node recorded as nearly full takes no new replica (placement skips it, Raft refuses
// one onto it), that the mark survives a restart (its store record) and a snapshot, that a
// snapshot from before the mark existed decodes without it, and that clearing it lets the node
// take replicas again; and that a node removed leaves no mark.
#[test]
fn a_nearly_full_node_takes_no_new_replica() {
    let dir = store_dir("nearfull");
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    catalog.propose(second_node()).unwrap();
    catalog.propose(third_node()).unwrap();
    let id = create_r2_on(&catalog, vec![1]);
    let mark = |nearfull| Command::NodeSetNearfull { id: 2, nearfull };
    assert!(catalog
        .propose(Command::NodeSetNearfull {
            id: 9,
            nearfull: true
        })
        .is_err());
    catalog.propose(mark(true)).unwrap();
    let state = catalog.catalog().read().clone();
    assert_eq!(state.nearfull, BTreeSet::from([2]));
    assert_eq!(state.choose_replica_nodes(&[1], 2), vec![3]);
    let onto_2 = Command::VolumeSetReplicas {
        volume_id: id,
        epoch: 1,
        replicas: vec![1, 2],
        in_sync_min: 1,
    };
    let refused = catalog.propose(onto_2.clone()).unwrap_err().to_string();
    assert!(refused.contains("nearly full"), "{refused}");

    // A snapshot keeps the mark; one written before it existed ends before it and decodes.
    let encoded = state.encode();
    assert_eq!(CatalogState::decode(&encoded).unwrap(), state);
    let tail = 1 + postcard::to_allocvec(&state.nearfull).unwrap().len();
    let older = CatalogState::decode(&encoded[..encoded.len() - tail]).unwrap();
    assert!(older.nearfull.is_empty());
    assert_eq!(older.nodes, state.nodes);

    // The store record keeps it across a restart.
    drop(catalog);
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    assert_eq!(catalog.catalog().read().nearfull, BTreeSet::from([2]));
    catalog.propose(mark(false)).unwrap();
    assert!(catalog.catalog().read().nearfull.is_empty());
    assert_eq!(
        catalog.catalog().read().choose_replica_nodes(&[1], 1),
        vec![2]
    );
    catalog.propose(onto_2).unwrap();
    // A node removed leaves no mark behind.
    catalog
        .propose(Command::NodeSetNearfull {
            id: 3,
            nearfull: true,
        })
        .unwrap();
    catalog.propose(Command::NodeRemove { id: 3 }).unwrap();
    assert!(catalog.catalog().read().nearfull.is_empty());
    drop(catalog);
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    assert!(catalog.catalog().read().nearfull.is_empty());
}

// Proves a primary is handed to a replica in sync on a node not nearly full first: the
// lowest such, else the lowest of the rest.
#[test]
fn a_hand_off_goes_to_a_replica_with_room_first() {
    let dir = store_dir("hand-off-room");
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    catalog.propose(second_node()).unwrap();
    catalog.propose(third_node()).unwrap();
    for id in [2, 3] {
        catalog
            .propose(Command::NodeSetState {
                id,
                state: keel_catalog::NodeState::Up,
                at_unix_ms: 9,
            })
            .unwrap();
    }
    create_volume(&catalog, "wide", 1 << 20, 1, vec![1, 2, 3]);
    let target = || {
        let state = catalog.catalog().read();
        let replication = &state.volume("wide").unwrap().record.replication;
        assert_eq!(replication.in_sync, vec![1, 2, 3]);
        state.hand_off_target(replication, 1)
    };
    let mark = |id, nearfull| {
        catalog
            .propose(Command::NodeSetNearfull { id, nearfull })
            .unwrap();
    };
    assert_eq!(target(), Some(2));
    mark(2, true);
    assert_eq!(target(), Some(3));
    mark(3, true);
    assert_eq!(target(), Some(2));
    mark(2, false);
    assert_eq!(target(), Some(2));
}

/// Some unrelated catalog records the restore must remove.
fn second_node_ops() -> Vec<keel_store::WriteOp> {
    let mut stray = CatalogState {
        next_volume_id: 99,
        ..CatalogState::default()
    };
    stray.buckets.insert(
        "stray-bucket".to_string(),
        keel_catalog::BucketRecord {
            name: "stray-bucket".to_string(),
            owner: "nobody".to_string(),
            grants: Vec::new(),
            created_unix_ms: 0,
            compression_code: 0,
        },
    );
    let store_dir = store_dir("stray");
    let store = open(&store_dir);
    stray.replace_ops(&store).unwrap()
}

// Proves a snapshot written before bucket settings existed (no settings after the state) still
// decodes, and that settings survive an encode/decode round trip.
#[test]
fn snapshots_with_and_without_bucket_settings_decode() {
    let mut state = CatalogState::default();
    state.bucket_settings.insert(
        "photos".to_string(),
        keel_catalog::BucketSettings {
            name: "photos".to_string(),
            tags: vec![("team".to_string(), "web".to_string())],
            cors: Vec::new(),
            public_read: true,
            lifecycle: vec![keel_catalog::LifecycleRule {
                enabled: true,
                noncurrent_expiration_days: Some(3),
                ..Default::default()
            }],
            versioning: keel_catalog::Versioning::Enabled,
            object_lock: Some(keel_catalog::ObjectLock {
                default_retention: Some(keel_catalog::DefaultRetention {
                    mode: keel_catalog::LockMode::Compliance,
                    days: None,
                    years: Some(2),
                }),
            }),
            policy: Some(r#"{"Statement": []}"#.to_string()),
        },
    );
    let decoded = CatalogState::decode(&state.encode()).unwrap();
    assert_eq!(decoded, state);
    assert_eq!(decoded.bucket_settings, state.bucket_settings);
    let mut old = vec![1u8];
    old.extend_from_slice(&postcard::to_allocvec(&state).unwrap());
    let decoded = CatalogState::decode(&old).unwrap();
    assert!(decoded.bucket_settings.is_empty());
}

/// A lifecycle rule as the first format wrote it: id, enabled, prefix, expiration days,
/// expiration date, abort days.
type RuleFormat1 = (
    Option<String>,
    bool,
    String,
    Option<u32>,
    Option<i64>,
    Option<u32>,
);

/// Bucket settings as the first format wrote them, in records and in snapshots.
#[derive(serde::Serialize)]
struct SettingsFormat1 {
    name: String,
    tags: Vec<(String, String)>,
    cors: Vec<keel_catalog::CorsRule>,
    public_read: bool,
    lifecycle: Vec<RuleFormat1>,
}

// Proves a snapshot that wrote its bucket settings in the first format (before versioning)
// decodes them, lifecycle rules included, as unversioned.
#[test]
fn snapshots_with_first_format_bucket_settings_decode() {
    let state = CatalogState::default();
    let mut old = vec![1u8];
    old.extend_from_slice(&postcard::to_allocvec(&state).unwrap());
    let mut settings = std::collections::BTreeMap::new();
    settings.insert(
        "logs".to_string(),
        SettingsFormat1 {
            name: "logs".to_string(),
            tags: vec![("team".to_string(), "ops".to_string())],
            cors: Vec::new(),
            public_read: false,
            lifecycle: vec![(Some("old".into()), true, "tmp/".into(), Some(7), None, None)],
        },
    );
    old.extend_from_slice(&postcard::to_allocvec(&settings).unwrap());
    let decoded = CatalogState::decode(&old).unwrap();
    let logs = &decoded.bucket_settings["logs"];
    assert_eq!(logs.tags, vec![("team".to_string(), "ops".to_string())]);
    assert_eq!(logs.versioning, keel_catalog::Versioning::Unversioned);
    assert_eq!(logs.lifecycle.len(), 1);
    assert_eq!(logs.lifecycle[0].prefix, "tmp/");
    assert_eq!(logs.lifecycle[0].expiration_days, Some(7));
    assert_eq!(logs.lifecycle[0].noncurrent_expiration_days, None);
}

// Proves object lock's rules: a bucket created locked has versioning enabled and lock on,
// suspending its versioning is refused, lock cannot be enabled on a bucket whose versioning is
// not enabled, and can be once it is.
#[test]
fn object_lock_needs_and_keeps_versioning() {
    let dir = store_dir("object-lock");
    let catalog = LocalCatalog::open(open(&dir)).unwrap();
    catalog
        .propose(Command::KeyAdd {
            record: KeyRecord {
                access_key_id: "KEYONE".to_string(),
                name: "k".to_string(),
                secret_access_key: "secretsecret".to_string(),
                created_unix_ms: 1,
            },
        })
        .unwrap();
    let create = |name: &str, locked: bool| {
        let (name, owner) = (name.to_string(), "KEYONE".to_string());
        catalog.propose(if locked {
            Command::BucketCreateLocked {
                name,
                owner,
                compression_code: 0,
                created_unix_ms: 2,
            }
        } else {
            Command::BucketCreate {
                name,
                owner,
                compression_code: 0,
                created_unix_ms: 2,
            }
        })
    };
    create("locked", true).unwrap();
    let settings = catalog.catalog().read().bucket_settings["locked"].clone();
    assert_eq!(settings.versioning, keel_catalog::Versioning::Enabled);
    assert_eq!(
        settings.object_lock,
        Some(keel_catalog::ObjectLock::default())
    );
    let refused = catalog.propose(Command::BucketSetVersioning {
        bucket: "locked".to_string(),
        enabled: false,
    });
    assert!(
        matches!(
            refused,
            Err(keel_catalog::MetadataError::Refused(
                keel_catalog::CatalogError::InvalidBucketState { .. }
            ))
        ),
        "{refused:?}"
    );
    assert!(matches!(
        create("locked", true),
        Err(keel_catalog::MetadataError::Refused(
            keel_catalog::CatalogError::BucketAlreadyOwnedByYou { .. }
        ))
    ));

    create("plain", false).unwrap();
    let lock = || Command::BucketSetObjectLock {
        bucket: "plain".to_string(),
        lock: keel_catalog::ObjectLock::default(),
    };
    assert!(catalog.propose(lock()).is_err());
    catalog
        .propose(Command::BucketSetVersioning {
            bucket: "plain".to_string(),
            enabled: true,
        })
        .unwrap();
    catalog.propose(lock()).unwrap();
    assert!(catalog.catalog().read().bucket_settings["plain"]
        .object_lock
        .is_some());
}
