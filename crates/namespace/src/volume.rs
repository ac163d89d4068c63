//! Block volumes as users name them: create, snapshot, clone, rollback, resize, delete,
//! send/receive, and handles for I/O.
//!
//! Every metadata change is a catalog command ([`keel_catalog::Command`]) proposed through
//! [`Metadata`] — the cluster's Raft group, or a local catalog without one — and applied by the
//! catalog's state machine on every node; the volume engine (`keel_volume`) of the nodes that
//! host the volume follows the applied records and does the block work (erasing a deleted
//! volume, collecting garbage). This type only validates, checks what is local (a stream or an
//! export reading a snapshot), proposes, and reads the catalog.
//!
//! Invariants:
//! - a proposal returns once this node applied it, so a read right after sees the change;
//! - checks of local activity and the proposals that depend on them run under one mutex
//!   (`local`), and opening a snapshot takes it too: a snapshot that a stream or export on this
//!   node reads cannot be deleted;
//! - a volume is hosted on the node it was created on (one replica, until replication comes):
//!   I/O, info scans and streams of a volume hosted elsewhere answer
//!   [`VolumeError::Elsewhere`].

use std::io;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use keel_catalog::{
    Command, Metadata, MetadataError, NodeId, Outcome, VolumeEntry, VolumeSettings, VolumeStatus,
};
use keel_store::{Compression, Progress, Store};
use keel_volume::{hex, new_unique_id, unix_seconds_now, Engine};

pub use keel_volume::{
    changed_blocks_since, copy_record_key, BackgroundWork, GcReport, ReceiveReport, SendStream,
    VolumeError, VolumeHandle, VolumeIo, VolumeResult, BLOCK_SIZE_BYTES, CLONE_DEPTH_MAX,
    NAME_MAX_BYTES, SNAPSHOTS_PER_VOLUME_MAX, VOLUME_SIZE_MAX_BYTES,
};

/// What to create.
#[derive(Debug, Clone)]
pub struct VolumeSpec {
    pub name: String,
    /// A positive multiple of [`BLOCK_SIZE_BYTES`].
    pub size_bytes: u64,
    pub compression: Compression,
    /// Operations per second (reads, writes, trims); None: unlimited.
    pub iops_max: Option<u64>,
    /// Bytes read plus written per second, in MiB; None: unlimited.
    pub bandwidth_max_mib_per_second: Option<u64>,
    /// Replicas (R): this node and R - 1 other storage nodes that are up, not draining and not
    /// nearly full.
    pub replicas: u8,
}

impl VolumeSpec {
    pub fn new(name: &str, size_bytes: u64) -> VolumeSpec {
        VolumeSpec {
            name: name.to_string(),
            size_bytes,
            compression: Compression::None,
            iops_max: None,
            bandwidth_max_mib_per_second: None,
            replicas: 1,
        }
    }
}

/// A volume as `list` shows it (no scan of its blocks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeSummary {
    pub name: String,
    pub id: u64,
    /// 32 hex digits.
    pub uuid: String,
    pub size_bytes: u64,
    pub compression: Compression,
    pub iops_max: Option<u64>,
    pub bandwidth_max_mib_per_second: Option<u64>,
    /// Generation new writes go to.
    pub generation: u64,
    pub snapshots: usize,
    /// (volume, snapshot) this volume was cloned from, if it is a clone.
    pub origin: Option<(String, String)>,
    pub created_unix_seconds: u64,
    /// Nodes holding its replicas; the primary first.
    pub replicas: Vec<NodeId>,
    pub primary: NodeId,
}

/// A volume with its snapshots and space use (from one scan of its block keys, on the node
/// that hosts it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    pub summary: VolumeSummary,
    pub block_size_bytes: u64,
    /// Bytes of blocks this volume itself wrote that its current contents show (parent blocks of
    /// a clone not counted). Blocks trimmed over older data count until the older data is gone.
    pub used_bytes: u64,
    /// Bytes of every extent the volume keeps for itself and its snapshots, before compression
    /// (includes garbage not yet collected).
    pub stored_bytes: u64,
    pub snapshots: Vec<SnapshotInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub name: String,
    /// 32 hex digits; kept by send/receive.
    pub guid: String,
    pub generation: u64,
    pub size_bytes: u64,
    pub created_unix_seconds: u64,
    /// Bytes of this volume's own blocks the snapshot shows (`None`: not counted, which
    /// takes a scan of the volume's block keys).
    pub referenced_bytes: Option<u64>,
    /// Bytes shown by this snapshot and by no other snapshot nor the current contents: what
    /// deleting it frees (exact for the volume's own blocks; hole markers count as blocks).
    pub unique_bytes: Option<u64>,
    /// Replicas whose copy of the snapshot lacks data (out of sync when it was taken, or
    /// placed after it): they neither serve it nor roll back onto it.
    pub incomplete_on: Vec<u64>,
}

/// The volumes of the cluster, as seen from this node.
pub struct VolumeManager {
    metadata: Arc<dyn Metadata>,
    engine: Arc<Engine>,
    /// Serializes checks of local activity with the proposals that depend on them.
    local: Mutex<()>,
}

fn lock(mutex: &Mutex<()>) -> MutexGuard<'_, ()> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn proposal_error(volume: &str, error: MetadataError) -> VolumeError {
    match error {
        MetadataError::Refused(refusal) => VolumeError::from_catalog(refusal),
        other => VolumeError::Unavailable {
            volume: volume.to_string(),
            detail: other.to_string(),
        },
    }
}

/// A snapshot as the catalog records it, its space use not counted.
fn snapshot_info(frozen: &keel_catalog::SnapshotRecord) -> SnapshotInfo {
    SnapshotInfo {
        name: frozen.name.clone(),
        guid: hex(&frozen.guid),
        generation: frozen.generation,
        size_bytes: frozen.size_bytes,
        created_unix_seconds: frozen.created_unix_seconds,
        referenced_bytes: None,
        unique_bytes: None,
        incomplete_on: frozen.incomplete_on.clone(),
    }
}

impl VolumeManager {
    /// Starts the local volume engine on `store`, subscribed to the catalog, and finishes
    /// what a crash interrupted on this node: erasing deleted volumes, abandoning receives.
    pub fn open(store: Store, metadata: Arc<dyn Metadata>) -> VolumeResult<VolumeManager> {
        VolumeManager::open_with(store, metadata, BackgroundWork::Thread)
    }

    /// [`Self::open`], its background work run as `background` says. With
    /// [`BackgroundWork::Caller`] (a seeded simulation's: [`Self::run_background_work`]), a
    /// deleted volume whose erase finished is forgotten at the next open, not at once: that
    /// is a blocking Raft proposal, which the caller's runtime thread cannot make.
    pub fn open_with(
        store: Store,
        metadata: Arc<dyn Metadata>,
        background: BackgroundWork,
    ) -> VolumeResult<VolumeManager> {
        let local_node = metadata.local_node();
        // Subscribe before reading the state, so no change falls in between; the engine starts
        // from the state, and changes applied meanwhile are refreshed twice (harmless).
        let engine = {
            let catalog = metadata.catalog().clone();
            let pending: Arc<Mutex<Option<Weak<Engine>>>> = Arc::new(Mutex::new(None));
            let forwarder = Arc::new(ForwardObserver {
                target: pending.clone(),
            });
            catalog.subscribe(forwarder);
            let engine = Engine::start(store, local_node, &catalog.read(), background)?;
            *pending
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(Arc::downgrade(&engine));
            engine.refresh_from(&catalog.read());
            engine
        };
        if background == BackgroundWork::Thread {
            let weak: Weak<dyn Metadata> = Arc::downgrade(&metadata);
            engine.on_erased(Box::new(move |volume_id| {
                let Some(metadata) = weak.upgrade() else {
                    return;
                };
                if let Err(error) = metadata.propose(Command::VolumeForget { volume_id }) {
                    tracing::warn!(volume_id, %error, "could not forget an erased volume; retried at the next start");
                }
            }));
        }
        let manager = VolumeManager {
            metadata,
            engine,
            local: Mutex::new(()),
        };
        manager.finish_interrupted()?;
        Ok(manager)
    }

    /// Runs the engine's background work queued so far, here and now (opened with
    /// [`BackgroundWork::Caller`]).
    pub fn run_background_work(&self) {
        self.engine.run_background_work();
    }

    /// Receives that died with the process are abandoned; deletions whose erase finished but
    /// whose record stayed are forgotten.
    fn finish_interrupted(&self) -> VolumeResult<()> {
        let local_node = self.metadata.local_node();
        let interrupted: Vec<(u64, u64, String)> = self
            .metadata
            .catalog()
            .read()
            .volumes
            .values()
            .filter(|entry| entry.record.replication.hosts(local_node))
            .filter_map(|entry| {
                let record = &entry.record;
                match (record.status, record.receiving_generation) {
                    (VolumeStatus::Receiving, _) => Some((record.id, 1, record.name.clone())),
                    (VolumeStatus::Ready, Some(generation)) => {
                        Some((record.id, generation, record.name.clone()))
                    }
                    _ => None,
                }
            })
            .collect();
        for (volume_id, generation, name) in interrupted {
            tracing::info!(volume = %name, "abandoning a receive that was interrupted");
            self.propose(
                &name,
                Command::ReceiveAbandon {
                    volume_id,
                    generation,
                },
            )?;
        }
        Ok(())
    }

    pub fn metadata(&self) -> &Arc<dyn Metadata> {
        &self.metadata
    }

    pub fn store(&self) -> &Store {
        self.engine.store()
    }

    fn propose(&self, volume: &str, command: Command) -> VolumeResult<Outcome> {
        self.metadata
            .propose(command)
            .map_err(|error| proposal_error(volume, error))
    }

    /// A ready volume's catalog entry.
    fn entry(&self, name: &str) -> VolumeResult<VolumeEntry> {
        self.metadata
            .catalog()
            .read()
            .volume(name)
            .cloned()
            .ok_or_else(|| VolumeError::NotFound {
                name: name.to_string(),
            })
    }

    /// The engine's copy of a volume hosted here, or where it is hosted.
    fn hosted(&self, entry: &VolumeEntry) -> VolumeResult<Arc<keel_volume::VolumeShared>> {
        if let Some(shared) = self.engine.get(entry.record.id) {
            return Ok(shared);
        }
        let primary = entry.record.replication.primary;
        let address = self
            .metadata
            .catalog()
            .read()
            .nodes
            .get(&primary)
            .map(|node| {
                node.addresses
                    .nbd
                    .clone()
                    .unwrap_or_else(|| node.addresses.cluster.clone())
            })
            .unwrap_or_else(|| "unknown".to_string());
        Err(VolumeError::Elsewhere {
            volume: entry.record.name.clone(),
            node: primary,
            address,
        })
    }

    fn summary_of(&self, entry: &VolumeEntry) -> VolumeSummary {
        let record = &entry.record;
        let origin = self.metadata.catalog().read().origin_names(&record.origin);
        VolumeSummary {
            name: record.name.clone(),
            id: record.id,
            uuid: hex(&record.uuid),
            size_bytes: record.size_bytes,
            compression: Compression::from_name(&record.compression).unwrap_or_default(),
            iops_max: record.iops_max,
            bandwidth_max_mib_per_second: record.bandwidth_max_mib_per_second,
            generation: record.generation,
            snapshots: entry.snapshots.len(),
            origin,
            created_unix_seconds: record.created_unix_seconds,
            replicas: record.replication.replicas.clone(),
            primary: record.replication.primary,
        }
    }

    /// Where a new volume's `count` replicas go: this node first (the client attaches here),
    /// then other storage nodes that are up and not draining, spread over failure domains
    /// ([`keel_catalog::CatalogState::choose_replica_nodes`]).
    fn place(&self, volume: &str, count: u8) -> VolumeResult<Vec<NodeId>> {
        let local = self.metadata.local_node();
        let wanted = usize::from(count.max(1));
        if wanted > keel_catalog::REPLICAS_MAX {
            return Err(VolumeError::Invalid {
                volume: volume.to_string(),
                detail: format!(
                    "{count} replicas: Keel keeps 1 to {}",
                    keel_catalog::REPLICAS_MAX
                ),
            });
        }
        let mut replicas = vec![local];
        replicas.extend(
            self.metadata
                .catalog()
                .read()
                .choose_replica_nodes(&[local], wanted - 1),
        );
        if replicas.len() < wanted {
            return Err(VolumeError::Invalid {
                volume: volume.to_string(),
                detail: format!(
                    "{wanted} replicas need {wanted} storage nodes that are up, not draining and \
                     (but this one) not nearly full; the cluster has {}",
                    replicas.len()
                ),
            });
        }
        Ok(replicas)
    }

    /// Creates an empty (all-zero, thin) volume, hosted on this node.
    pub fn create(&self, spec: &VolumeSpec) -> VolumeResult<VolumeSummary> {
        let settings = VolumeSettings {
            name: spec.name.clone(),
            size_bytes: spec.size_bytes,
            compression: spec.compression.name().to_string(),
            iops_max: spec.iops_max,
            bandwidth_max_mib_per_second: spec.bandwidth_max_mib_per_second,
        };
        self.propose(
            &spec.name,
            Command::VolumeCreate {
                settings,
                uuid: new_unique_id(spec.name.as_bytes()),
                created_unix_seconds: unix_seconds_now(),
                replicas: self.place(&spec.name, spec.replicas)?,
                status: VolumeStatus::Ready,
            },
        )?;
        Ok(self.summary_of(&self.entry(&spec.name)?))
    }

    /// Every ready volume of the cluster, by name.
    /// Per volume hosted here: how long its requests were held back by its QoS limits.
    pub fn throttled(&self) -> Vec<(String, std::time::Duration)> {
        self.engine.throttled()
    }

    pub fn list(&self) -> Vec<VolumeSummary> {
        let mut entries: Vec<VolumeEntry> = self
            .metadata
            .catalog()
            .read()
            .ready_volumes()
            .cloned()
            .collect();
        entries.sort_by(|a, b| a.record.name.cmp(&b.record.name));
        entries.iter().map(|entry| self.summary_of(entry)).collect()
    }

    /// The volume, its snapshots and its space use. Scans the volume's block keys (not their
    /// data) on this node, which must host it.
    pub fn info(&self, name: &str) -> VolumeResult<VolumeInfo> {
        let entry = self.entry(name)?;
        self.hosted(&entry)?;
        let usage = self.engine.usage(entry.record.id)?.unwrap_or_default();
        let block = |count: Option<&u64>| count.copied().unwrap_or(0) * BLOCK_SIZE_BYTES;
        let snapshots = entry
            .snapshots
            .values()
            .map(|snapshot| SnapshotInfo {
                referenced_bytes: Some(block(
                    usage.snapshot_referenced_blocks.get(&snapshot.generation),
                )),
                unique_bytes: Some(block(
                    usage.snapshot_unique_blocks.get(&snapshot.generation),
                )),
                ..snapshot_info(snapshot)
            })
            .collect();
        Ok(VolumeInfo {
            summary: self.summary_of(&entry),
            block_size_bytes: BLOCK_SIZE_BYTES,
            used_bytes: usage.current_blocks * BLOCK_SIZE_BYTES,
            stored_bytes: usage.extents * BLOCK_SIZE_BYTES,
            snapshots,
        })
    }

    /// Changes the volume's size. Growing shows zeroes past the old end. Shrinking needs
    /// `allow_shrink`; blocks past the new end are gone from the volume (snapshots keep theirs)
    /// and read as zeroes if it grows again.
    pub fn resize(&self, name: &str, size_bytes: u64, allow_shrink: bool) -> VolumeResult<()> {
        let entry = self.entry(name)?;
        let command = Command::VolumeResize {
            name: name.to_string(),
            size_bytes,
            allow_shrink,
        };
        if entry.record.size_bytes > size_bytes && self.engine.get(entry.record.id).is_some() {
            self.engine.collect_after(
                entry.record.id,
                || self.propose(name, command),
                &mut |_| {},
            )?;
        } else {
            self.propose(name, command)?;
        }
        Ok(())
    }

    /// Changes the QoS limits of a volume (None: unlimited); open handles follow at once.
    pub fn set_limits(
        &self,
        name: &str,
        iops_max: Option<u64>,
        bandwidth_max_mib_per_second: Option<u64>,
    ) -> VolumeResult<()> {
        self.propose(
            name,
            Command::VolumeSetLimits {
                name: name.to_string(),
                iops_max,
                bandwidth_max_mib_per_second,
            },
        )?;
        Ok(())
    }

    /// Deletes a volume, its snapshots and all its blocks. On the node hosting it, returns once
    /// the blocks are erased (in bounded batches; `progress` reports the block position reached
    /// out of the volume's size in blocks); elsewhere, once the deletion is recorded (the host
    /// erases in the background). Refused while clones of its snapshots exist, a stream is
    /// received into it, or a stream or export on this node reads one of its snapshots.
    pub fn delete(&self, name: &str, progress: &mut dyn FnMut(Progress)) -> VolumeResult<()> {
        let entry = self.entry(name)?;
        let volume_id = entry.record.id;
        let propose = || {
            // The in-use check and the proposal under one lock.
            let _local = lock(&self.local);
            if let Some(shared) = self.engine.get(volume_id) {
                if shared.snapshot_in_use(None) {
                    return Err(VolumeError::InUse {
                        volume: name.to_string(),
                        detail: "a send, receive or snapshot export is using it".to_string(),
                    });
                }
            }
            self.propose(
                name,
                Command::VolumeDelete {
                    name: name.to_string(),
                },
            )
            .map(|_| ())
        };
        if self.engine.get(volume_id).is_some() {
            self.engine.erase_after(volume_id, propose, progress)
        } else {
            propose()
        }
    }

    /// Freezes the volume's current contents as a snapshot, instantly (nothing is copied).
    pub fn snapshot_create(&self, volume: &str, snapshot: &str) -> VolumeResult<SnapshotInfo> {
        let outcome = self.propose(
            volume,
            Command::SnapshotCreate {
                volume: volume.to_string(),
                snapshot: snapshot.to_string(),
                guid: new_unique_id(snapshot.as_bytes()),
                created_unix_seconds: unix_seconds_now(),
            },
        )?;
        let Outcome::Snapshot { generation, .. } = outcome else {
            return Err(VolumeError::Metadata {
                detail: format!("creating a snapshot answered {outcome:?}"),
            });
        };
        // Every write acknowledged before the snapshot is in it; make them durable before
        // saying the snapshot exists (the catalog applies records without a sync of its own).
        self.engine.store().flush().map_err(VolumeError::store(
            volume,
            "flushing before a snapshot returns",
        ))?;
        let entry = self.entry(volume)?;
        let frozen =
            entry
                .snapshots
                .get(&generation)
                .ok_or_else(|| VolumeError::SnapshotNotFound {
                    volume: volume.to_string(),
                    snapshot: snapshot.to_string(),
                })?;
        Ok(snapshot_info(frozen))
    }

    /// The volume's snapshots, oldest first. With `usage`, their space use too: one scan of
    /// the volume's block keys on this node, which must host it (as `info`). Without it, only
    /// what the catalog holds, which any node answers at once whatever the volume's size.
    pub fn snapshot_list(&self, volume: &str, usage: bool) -> VolumeResult<Vec<SnapshotInfo>> {
        if usage {
            return Ok(self.info(volume)?.snapshots);
        }
        Ok(self
            .entry(volume)?
            .snapshots
            .values()
            .map(snapshot_info)
            .collect())
    }

    /// Deletes a snapshot and frees the blocks no other snapshot nor the current contents need.
    /// Refused while a clone was made from it or a stream or export is reading it.
    pub fn snapshot_delete(
        &self,
        volume: &str,
        snapshot: &str,
        progress: &mut dyn FnMut(Progress),
    ) -> VolumeResult<GcReport> {
        let volume_id = self.entry(volume)?.record.id;
        let command = Command::SnapshotDelete {
            volume: volume.to_string(),
            snapshot: snapshot.to_string(),
        };
        let ((), report) = self.engine.collect_after(
            volume_id,
            || {
                // The in-use check and the proposal under one lock: no stream or export on this
                // node can start reading the snapshot in between.
                let _local = lock(&self.local);
                let entry = self.entry(volume)?;
                let generation = entry
                    .snapshot_by_name(snapshot)
                    .ok_or_else(|| VolumeError::SnapshotNotFound {
                        volume: volume.to_string(),
                        snapshot: snapshot.to_string(),
                    })?
                    .generation;
                if let Some(shared) = self.engine.get(entry.record.id) {
                    if shared.snapshot_in_use(Some(generation)) {
                        return Err(VolumeError::InUse {
                            volume: volume.to_string(),
                            detail: format!(
                                "snapshot {snapshot:?} is being sent, received onto or exported"
                            ),
                        });
                    }
                }
                self.propose(volume, command).map(|_| ())
            },
            progress,
        )?;
        Ok(report)
    }

    /// Makes the volume's contents (and size) those of the snapshot again. Later snapshots
    /// stay; the discarded current contents are freed.
    pub fn rollback(&self, volume: &str, snapshot: &str) -> VolumeResult<()> {
        let entry = self.entry(volume)?;
        let command = Command::VolumeRollback {
            volume: volume.to_string(),
            snapshot: snapshot.to_string(),
        };
        if self.engine.get(entry.record.id).is_some() {
            self.engine.collect_after(
                entry.record.id,
                || self.propose(volume, command),
                &mut |_| {},
            )?;
        } else {
            self.propose(volume, command)?;
        }
        Ok(())
    }

    /// Creates volume `name`, a writable copy of `volume@snapshot` that shares its blocks until
    /// either side overwrites them. Inherits compression, limits and placement.
    pub fn clone_volume(
        &self,
        volume: &str,
        snapshot: &str,
        name: &str,
    ) -> VolumeResult<VolumeSummary> {
        self.propose(
            name,
            Command::VolumeClone {
                parent: volume.to_string(),
                snapshot: snapshot.to_string(),
                name: name.to_string(),
                uuid: new_unique_id(name.as_bytes()),
                created_unix_seconds: unix_seconds_now(),
            },
        )?;
        Ok(self.summary_of(&self.entry(name)?))
    }

    /// A handle for block I/O on the volume's current contents (shared by any number of
    /// threads and connections).
    pub fn open_volume(&self, name: &str) -> VolumeResult<Arc<dyn VolumeIo>> {
        self.open_current(name, false)
    }

    /// [`VolumeManager::open_volume`] for this node's copy as a replica: its writes are kept
    /// out of the page cache (this node serves no reads of it while it is a replica).
    pub fn open_replica(&self, name: &str) -> VolumeResult<Arc<dyn VolumeIo>> {
        self.open_current(name, true)
    }

    fn open_current(&self, name: &str, replica: bool) -> VolumeResult<Arc<dyn VolumeIo>> {
        let entry = self.entry(name)?;
        self.hosted(&entry)?;
        let id = entry.record.id;
        let handle = if replica {
            self.engine.open_replica(id)
        } else {
            self.engine.open(id)
        };
        let handle = handle.ok_or_else(|| VolumeError::NotFound {
            name: name.to_string(),
        })?;
        Ok(handle)
    }

    /// A read-only handle on a snapshot; the snapshot cannot be deleted while it is open.
    pub fn open_snapshot(&self, volume: &str, snapshot: &str) -> VolumeResult<Arc<dyn VolumeIo>> {
        let _local = lock(&self.local);
        let entry = self.entry(volume)?;
        self.hosted(&entry)?;
        let handle = self
            .engine
            .open_snapshot(entry.record.id, snapshot)?
            .ok_or_else(|| VolumeError::NotFound {
                name: volume.to_string(),
            })?;
        Ok(handle)
    }

    /// A read-only handle on this node's copy of the snapshot at `generation` of volume
    /// `volume_id` (see [`Engine::open_snapshot_copy`]).
    pub fn open_snapshot_copy(
        &self,
        volume_id: u64,
        generation: u64,
        repair: Option<u64>,
    ) -> VolumeResult<Arc<dyn VolumeIo>> {
        let handle = self
            .engine
            .open_snapshot_copy(volume_id, generation, repair)?
            .ok_or_else(|| VolumeError::NotFound {
                name: format!("(id {volume_id})"),
            })?;
        Ok(handle)
    }

    /// Writes blocks of a snapshot's repair into this node's copy, durably (see
    /// [`Engine::write_snapshot_repair`]).
    pub fn write_snapshot_repair(
        &self,
        volume_id: u64,
        generation: u64,
        repair: u64,
        runs: &[(u64, &[u8])],
    ) -> VolumeResult<()> {
        self.engine
            .write_snapshot_repair(volume_id, generation, repair, runs)
    }

    /// Keeps `value` as the record `name` about this node's copy of volume `volume_id` (the
    /// store erases such records with the copy), replacing the one before. With `sync` it is
    /// durable on return; otherwise the store's next sync makes it durable, in order with
    /// every write before it.
    pub fn keep_copy_record(
        &self,
        volume_id: u64,
        name: &[u8],
        value: Vec<u8>,
        sync: bool,
    ) -> VolumeResult<()> {
        let op =
            keel_store::WriteOp::put(copy_record_key(volume_id, name), value, Compression::None);
        let durability = if sync {
            keel_store::Durability::Sync
        } else {
            keel_store::Durability::Buffered
        };
        self.store()
            .write(vec![op], durability)
            .map(|_| ())
            .map_err(VolumeError::store("copy record", "keep"))
    }

    /// The record `name` about this node's copy of volume `volume_id`.
    pub fn copy_record(&self, volume_id: u64, name: &[u8]) -> VolumeResult<Option<Vec<u8>>> {
        self.store()
            .get(&copy_record_key(volume_id, name))
            .map_err(VolumeError::store("copy record", "read"))
    }

    /// Deletes the record `name` about this node's copy of volume `volume_id`, durably.
    pub fn forget_copy_record(&self, volume_id: u64, name: &[u8]) -> VolumeResult<()> {
        let key = copy_record_key(volume_id, name);
        self.store()
            .write(
                vec![keel_store::WriteOp::Delete { key }],
                keel_store::Durability::Sync,
            )
            .map(|_| ())
            .map_err(VolumeError::store("copy record", "delete"))
    }

    /// Calls `changed(offset, length)` for each block of this node's copy of volume
    /// `volume_id` (named `name`) written, or trimmed, after store sequence `since`.
    pub fn changed_since(
        &self,
        name: &str,
        volume_id: u64,
        since: u64,
        changed: &mut dyn FnMut(u64, u64),
    ) -> VolumeResult<()> {
        changed_blocks_since(self.store(), name, volume_id, since, &mut |index| {
            changed(index * BLOCK_SIZE_BYTES, BLOCK_SIZE_BYTES)
        })
    }

    /// Deletes the volume's extents that no view needs any more (rollback leftovers, data
    /// of deleted snapshots, interrupted receives). Runs while I/O continues.
    pub fn collect_garbage(
        &self,
        volume: &str,
        progress: &mut dyn FnMut(Progress),
    ) -> VolumeResult<GcReport> {
        let entry = self.entry(volume)?;
        self.hosted(&entry)?;
        self.engine.collect_now(entry.record.id, progress)
    }

    /// [`VolumeManager::send`] written to `output`; returns the bytes written.
    pub fn send_to(
        &self,
        volume: &str,
        base: Option<&str>,
        target: &str,
        output: &mut dyn io::Write,
    ) -> VolumeResult<u64> {
        let mut stream = self.send(volume, base, target)?;
        Ok(io::copy(&mut stream, output)?)
    }

    /// A stream of the blocks of `volume@target` (full), or of the blocks that differ between
    /// `volume@base` and `volume@target` (incremental). Reads lazily: memory stays bounded.
    pub fn send(&self, volume: &str, base: Option<&str>, target: &str) -> VolumeResult<SendStream> {
        let _local = lock(&self.local);
        let entry = self.entry(volume)?;
        let shared = self.hosted(&entry)?;
        let find = |name: &str| {
            entry
                .snapshot_by_name(name)
                .cloned()
                .ok_or_else(|| VolumeError::SnapshotNotFound {
                    volume: volume.to_string(),
                    snapshot: name.to_string(),
                })
        };
        let target_snapshot = find(target)?;
        let base_snapshot = base.map(find).transpose()?;
        let local = self.metadata.local_node();
        for snapshot in base_snapshot.iter().chain([&target_snapshot]) {
            keel_volume::check_snapshot_complete(&entry.record, snapshot, local)?;
        }
        let compression = Compression::from_name(&entry.record.compression).unwrap_or_default();
        SendStream::new(
            self.engine.store().clone(),
            shared,
            entry.record.uuid,
            compression,
            base_snapshot,
            target_snapshot,
        )
    }

    /// Applies a stream made by [`VolumeManager::send`] on this node. A full stream creates
    /// volume `volume` (which must not exist); an incremental one needs `volume` to have the
    /// stream's base snapshot, and replaces its current contents by the stream's target
    /// snapshot (like `zfs receive -F`). Nothing is visible until the whole stream verified; a
    /// bad, truncated or mismatched stream leaves the volume as it was.
    pub fn receive(&self, input: &mut dyn io::Read, volume: &str) -> VolumeResult<ReceiveReport> {
        self.receive_published_by(input, volume, &|publish| publish())
    }

    /// [`VolumeManager::receive`], its last step run by `publish` ([`keel_volume::Publish`]).
    pub fn receive_published_by(
        &self,
        input: &mut dyn io::Read,
        volume: &str,
        publish: keel_volume::Publish<'_>,
    ) -> VolumeResult<ReceiveReport> {
        keel_volume::receive(&self.engine, self.metadata.as_ref(), input, volume, publish)
    }

    /// Stops the engine's background worker (after the job it is running).
    pub fn shutdown(&self) {
        self.engine.shutdown();
    }
}

impl Drop for VolumeManager {
    fn drop(&mut self) {
        self.engine.shutdown();
    }
}

/// Subscribed to the catalog before the engine exists, so changes applied while the engine
/// starts are not lost; forwards to the engine once it is set.
struct ForwardObserver {
    target: Arc<Mutex<Option<Weak<Engine>>>>,
}

impl keel_catalog::Observer for ForwardObserver {
    fn applied(&self, state: &keel_catalog::CatalogState, events: &[keel_catalog::Event]) {
        let engine = self
            .target
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .as_ref()
            .and_then(Weak::upgrade);
        if let Some(engine) = engine {
            keel_catalog::Observer::applied(engine.as_ref(), state, events);
        }
    }
}
