//! Property test: random sequences of writes (unaligned), trims, write-zeroes, snapshots,
//! clones, rollbacks, snapshot and volume deletions, resizes, garbage collections and reopens
//! of the whole store, checked after every step against an in-memory model of every volume and
//! every snapshot, byte for byte.
#![allow(clippy::unwrap_used)]

mod volume_support;

use keel_namespace::volume::{VolumeError, VolumeManager, VolumeSpec};
use proptest::prelude::*;
use volume_support::*;

const BLOCKS_MAX: u64 = 10;

#[derive(Debug, Clone)]
enum Step {
    Write {
        volume: usize,
        offset: u64,
        length: usize,
        seed: u64,
        fua: bool,
    },
    Trim {
        volume: usize,
        block: u64,
        count: u64,
    },
    WriteZeroes {
        volume: usize,
        offset: u64,
        length: u64,
    },
    Snapshot {
        volume: usize,
    },
    Clone {
        volume: usize,
        snapshot: usize,
    },
    Rollback {
        volume: usize,
        snapshot: usize,
    },
    DeleteSnapshot {
        volume: usize,
        snapshot: usize,
    },
    Resize {
        volume: usize,
        blocks: u64,
    },
    DeleteVolume {
        volume: usize,
    },
    CollectGarbage {
        volume: usize,
    },
    Mirror {
        volume: usize,
        base: usize,
        target: usize,
    },
    Reopen,
}

fn step() -> impl Strategy<Value = Step> {
    let volume = 0usize..8;
    prop_oneof![
        6 => (volume.clone(), 0..BLOCKS_MAX * BLOCK, 1usize..(3 * BLOCK as usize), any::<u64>(), any::<bool>())
            .prop_map(|(volume, offset, length, seed, fua)| Step::Write { volume, offset, length, seed, fua }),
        2 => (volume.clone(), 0..BLOCKS_MAX, 1..4u64).prop_map(|(volume, block, count)| Step::Trim { volume, block, count }),
        1 => (volume.clone(), 0..BLOCKS_MAX * BLOCK, 1..3 * BLOCK)
            .prop_map(|(volume, offset, length)| Step::WriteZeroes { volume, offset, length }),
        2 => volume.clone().prop_map(|volume| Step::Snapshot { volume }),
        1 => (volume.clone(), 0usize..8).prop_map(|(volume, snapshot)| Step::Clone { volume, snapshot }),
        1 => (volume.clone(), 0usize..8).prop_map(|(volume, snapshot)| Step::Rollback { volume, snapshot }),
        1 => (volume.clone(), 0usize..8).prop_map(|(volume, snapshot)| Step::DeleteSnapshot { volume, snapshot }),
        1 => (volume.clone(), 1..BLOCKS_MAX + 1).prop_map(|(volume, blocks)| Step::Resize { volume, blocks }),
        1 => volume.clone().prop_map(|volume| Step::DeleteVolume { volume }),
        1 => volume.clone().prop_map(|volume| Step::CollectGarbage { volume }),
        2 => (volume.clone(), 0usize..8, 0usize..8).prop_map(|(volume, base, target)| Step::Mirror { volume, base, target }),
        1 => Just(Step::Reopen),
    ]
}

struct ModelVolume {
    name: String,
    bytes: Vec<u8>,
    /// (name, bytes), oldest first.
    snapshots: Vec<(String, Vec<u8>)>,
    /// (volume, snapshot) it was cloned from.
    origin: Option<(String, String)>,
}

/// (snapshot name, bytes).
type NamedImage = (String, Vec<u8>);

struct Model {
    volumes: Vec<ModelVolume>,
    counter: u64,
    /// Mirror volume name → snapshots received into it (name, bytes).
    mirrored: Vec<(String, Vec<NamedImage>)>,
}

impl Model {
    fn pick(&self, index: usize) -> Option<usize> {
        (!self.volumes.is_empty()).then(|| index % self.volumes.len())
    }
}

fn check(manager: &VolumeManager, model: &Model, context: &str) {
    let names: Vec<String> = manager
        .list()
        .into_iter()
        .map(|volume| volume.name)
        .collect();
    let mut expected: Vec<String> = model
        .volumes
        .iter()
        .map(|volume| volume.name.clone())
        .collect();
    expected.sort();
    assert_eq!(names, expected, "{context}: volume list");
    for volume in &model.volumes {
        let handle = manager.open_volume(&volume.name).unwrap();
        assert_eq!(
            handle.size_bytes(),
            volume.bytes.len() as u64,
            "{context}: size of {}",
            volume.name
        );
        assert_same_blocks(
            &read_all(&handle),
            &volume.bytes,
            &format!("{context}: {}", volume.name),
        );
        for (snapshot, bytes) in &volume.snapshots {
            let handle = manager.open_snapshot(&volume.name, snapshot).unwrap();
            assert_same_blocks(
                &read_all(&handle),
                bytes,
                &format!("{context}: {}@{snapshot}", volume.name),
            );
        }
    }
}

fn run(steps: Vec<Step>) {
    let dir = test_dir("model");
    let mut manager = Some(open_manager(&dir));
    let mut model = Model {
        volumes: Vec::new(),
        counter: 0,
        mirrored: Vec::new(),
    };
    let mirror_dir = test_dir("model-mirror");
    let mut mirror = Some(open_manager(&mirror_dir));
    for root in 0..2 {
        let name = format!("v{root}");
        manager
            .as_ref()
            .unwrap()
            .create(&VolumeSpec::new(&name, 4 * BLOCK))
            .unwrap();
        model.volumes.push(ModelVolume {
            name,
            bytes: vec![0u8; 4 * BLOCK as usize],
            snapshots: Vec::new(),
            origin: None,
        });
    }
    for (index, step) in steps.into_iter().enumerate() {
        let context = format!("step {index} {step:?}");
        let volumes = manager.as_ref().unwrap();
        match step {
            Step::Write {
                volume,
                offset,
                length,
                seed,
                fua,
            } => {
                let Some(volume) = model.pick(volume) else {
                    continue;
                };
                let entry = &mut model.volumes[volume];
                let size = entry.bytes.len() as u64;
                if offset >= size {
                    continue;
                }
                let length = length.min((size - offset) as usize);
                let data = pattern(seed, length);
                volumes
                    .open_volume(&entry.name)
                    .unwrap()
                    .write(offset, &data, fua)
                    .unwrap();
                entry.bytes[offset as usize..offset as usize + length].copy_from_slice(&data);
            }
            Step::Trim {
                volume,
                block,
                count,
            } => {
                let Some(volume) = model.pick(volume) else {
                    continue;
                };
                let entry = &mut model.volumes[volume];
                let size_blocks = entry.bytes.len() as u64 / BLOCK;
                if block >= size_blocks {
                    continue;
                }
                let count = count.min(size_blocks - block);
                volumes
                    .open_volume(&entry.name)
                    .unwrap()
                    .trim(block * BLOCK, count * BLOCK)
                    .unwrap();
                entry.bytes[(block * BLOCK) as usize..((block + count) * BLOCK) as usize].fill(0);
            }
            Step::WriteZeroes {
                volume,
                offset,
                length,
            } => {
                let Some(volume) = model.pick(volume) else {
                    continue;
                };
                let entry = &mut model.volumes[volume];
                let size = entry.bytes.len() as u64;
                if offset >= size {
                    continue;
                }
                let length = length.min(size - offset);
                volumes
                    .open_volume(&entry.name)
                    .unwrap()
                    .write_zeroes(offset, length, false, true)
                    .unwrap();
                entry.bytes[offset as usize..(offset + length) as usize].fill(0);
            }
            Step::Snapshot { volume } => {
                let Some(volume) = model.pick(volume) else {
                    continue;
                };
                model.counter += 1;
                let name = format!("s{}", model.counter);
                let entry = &mut model.volumes[volume];
                volumes.snapshot_create(&entry.name, &name).unwrap();
                entry.snapshots.push((name, entry.bytes.clone()));
            }
            Step::Clone { volume, snapshot } => {
                let Some(volume) = model.pick(volume) else {
                    continue;
                };
                let entry = &model.volumes[volume];
                if entry.snapshots.is_empty() || model.volumes.len() >= 6 {
                    continue;
                }
                let (snapshot_name, bytes) =
                    entry.snapshots[snapshot % entry.snapshots.len()].clone();
                model.counter += 1;
                let name = format!("c{}", model.counter);
                volumes
                    .clone_volume(&entry.name, &snapshot_name, &name)
                    .unwrap();
                let origin = Some((entry.name.clone(), snapshot_name));
                model.volumes.push(ModelVolume {
                    name,
                    bytes,
                    snapshots: Vec::new(),
                    origin,
                });
            }
            Step::Rollback { volume, snapshot } => {
                let Some(volume) = model.pick(volume) else {
                    continue;
                };
                let entry = &mut model.volumes[volume];
                if entry.snapshots.is_empty() {
                    continue;
                }
                let (name, bytes) = entry.snapshots[snapshot % entry.snapshots.len()].clone();
                volumes.rollback(&entry.name, &name).unwrap();
                entry.bytes = bytes;
            }
            Step::DeleteSnapshot { volume, snapshot } => {
                let Some(volume) = model.pick(volume) else {
                    continue;
                };
                let entry = &model.volumes[volume];
                if entry.snapshots.is_empty() {
                    continue;
                }
                let position = snapshot % entry.snapshots.len();
                let name = entry.snapshots[position].0.clone();
                let volume_name = entry.name.clone();
                let has_clone = model
                    .volumes
                    .iter()
                    .any(|other| other.origin == Some((volume_name.clone(), name.clone())));
                let result = volumes.snapshot_delete(&volume_name, &name, &mut |_| {});
                if has_clone {
                    assert!(
                        matches!(result, Err(VolumeError::InUse { .. })),
                        "{context}: {result:?}"
                    );
                } else {
                    result.unwrap();
                    model.volumes[volume].snapshots.remove(position);
                }
            }
            Step::Resize { volume, blocks } => {
                let Some(volume) = model.pick(volume) else {
                    continue;
                };
                let entry = &mut model.volumes[volume];
                volumes.resize(&entry.name, blocks * BLOCK, true).unwrap();
                entry.bytes.resize((blocks * BLOCK) as usize, 0);
            }
            Step::DeleteVolume { volume } => {
                let Some(volume) = model.pick(volume) else {
                    continue;
                };
                let name = model.volumes[volume].name.clone();
                let has_clone = model.volumes.iter().any(|other| {
                    other
                        .origin
                        .as_ref()
                        .is_some_and(|(parent, _)| *parent == name)
                });
                let result = volumes.delete(&name, &mut |_| {});
                if has_clone {
                    assert!(
                        matches!(result, Err(VolumeError::InUse { .. })),
                        "{context}: {result:?}"
                    );
                } else {
                    result.unwrap();
                    model.volumes.remove(volume);
                }
            }
            Step::CollectGarbage { volume } => {
                let Some(volume) = model.pick(volume) else {
                    continue;
                };
                volumes
                    .collect_garbage(&model.volumes[volume].name, &mut |_| {})
                    .unwrap();
            }
            Step::Mirror {
                volume,
                base,
                target,
            } => {
                // Sends a snapshot to the mirror store: full the first time, then incremental
                // from a snapshot the mirror already has (any of them, older or newer).
                let Some(volume) = model.pick(volume) else {
                    continue;
                };
                let entry = &model.volumes[volume];
                if entry.snapshots.is_empty() {
                    continue;
                }
                let (target_name, target_bytes) =
                    entry.snapshots[target % entry.snapshots.len()].clone();
                let mirror_name = format!("m-{}", entry.name);
                let mirrors = mirror.as_ref().unwrap();
                let position = model
                    .mirrored
                    .iter()
                    .position(|(name, _)| *name == mirror_name);
                let base_name = match position {
                    None => None,
                    Some(position) => {
                        let received = &model.mirrored[position].1;
                        if received.iter().any(|(name, _)| *name == target_name) {
                            continue;
                        }
                        // The base must still exist at the source.
                        let candidates: Vec<&String> = received
                            .iter()
                            .map(|(name, _)| name)
                            .filter(|name| {
                                entry.snapshots.iter().any(|(source, _)| source == *name)
                            })
                            .collect();
                        if candidates.is_empty() {
                            continue;
                        }
                        Some(candidates[base % candidates.len()].clone())
                    }
                };
                let mut stream = volumes
                    .send(&entry.name, base_name.as_deref(), &target_name)
                    .unwrap();
                let report = mirrors.receive(&mut stream, &mirror_name).unwrap();
                assert_eq!(report.incremental, base_name.is_some(), "{context}");
                match position {
                    None => model.mirrored.push((
                        mirror_name.clone(),
                        vec![(target_name.clone(), target_bytes.clone())],
                    )),
                    Some(position) => model.mirrored[position]
                        .1
                        .push((target_name.clone(), target_bytes.clone())),
                }
                let handle = mirrors.open_volume(&mirror_name).unwrap();
                assert_same_blocks(
                    &read_all(&handle),
                    &target_bytes,
                    &format!("{context}: mirror {mirror_name}"),
                );
                for (name, bytes) in &model
                    .mirrored
                    .iter()
                    .find(|(name, _)| *name == mirror_name)
                    .unwrap()
                    .1
                {
                    let frozen = mirrors.open_snapshot(&mirror_name, name).unwrap();
                    assert_same_blocks(
                        &read_all(&frozen),
                        bytes,
                        &format!("{context}: mirror {mirror_name}@{name}"),
                    );
                }
            }
            Step::Reopen => {
                drop(manager.take());
                manager = Some(open_manager(&dir));
                drop(mirror.take());
                mirror = Some(open_manager(&mirror_dir));
            }
        }
        check(manager.as_ref().unwrap(), &model, &context);
    }
    // A final garbage collection must not change anything anyone can see.
    let volumes = manager.as_ref().unwrap();
    for volume in &model.volumes {
        volumes.collect_garbage(&volume.name, &mut |_| {}).unwrap();
    }
    check(volumes, &model, "after final collection");
    drop(manager);
    let manager = open_manager(&dir);
    check(&manager, &model, "after final reopen");
    drop(manager);
    drop(mirror);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&mirror_dir);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, max_shrink_iters: 200, ..ProptestConfig::default() })]

    // See the file comment: the volume layer must behave exactly like the byte-array model.
    #[test]
    fn volumes_match_model(steps in proptest::collection::vec(step(), 1..60)) {
        run(steps);
    }
}
