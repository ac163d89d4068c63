//! The catalog's state and the one place it changes: [`CatalogState::plan`] turns a command into
//! a list of record changes (or a deterministic refusal), which [`CatalogState::commit`] applies
//! to memory and [`Change::store_op`] turns into store writes.
//!
//! Determinism: `plan` reads only the state and the command (never the clock, randomness or the
//! local node), so every node applying the same log reaches the same records. Planning does not
//! mutate: a store write that fails leaves memory as it was.
//!
//! Invariants kept here (checked by `check_invariants` in tests):
//! - names are unique among ready and receiving volumes, and among buckets, keys and live nodes;
//! - ids (volume, node) are handed out once: counters only grow;
//! - a volume's `generation == view[0].generation_max < generation_next`, and every snapshot's
//!   generation is below `generation_next`;
//! - a clone's origin snapshot exists while the clone does.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use keel_store::{Compression, Store, WriteOp};

use crate::command::{Command, Event, NodeSpec, Outcome, VolumeSettings};
use crate::records::{
    self, BucketRecord, BucketSettings, ClusterRecord, KeyRecord, NodeRecord, NodeState,
    ObjectLock, Origin, Replication, SnapshotRecord, Versioning, VolumeRecord, VolumeStatus,
    SNAPSHOT_RECORD_FORMAT, VOLUME_RECORD_FORMAT,
};
use crate::view::{Layer, Truncation};
use crate::{
    validate_name, validate_size, CatalogError, NodeId, CLONE_DEPTH_MAX, SNAPSHOTS_PER_VOLUME_MAX,
};

/// Records fetched per store scan when loading or replacing the catalog.
const SCAN_PAGE_RECORDS: usize = 1024;

/// A volume and its snapshots (by generation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeEntry {
    pub record: VolumeRecord,
    pub snapshots: BTreeMap<u64, SnapshotRecord>,
}

impl VolumeEntry {
    pub fn snapshot_by_name(&self, name: &str) -> Option<&SnapshotRecord> {
        self.snapshots
            .values()
            .find(|snapshot| snapshot.name == name)
    }

    pub fn snapshot_by_guid(&self, guid: &[u8; 16]) -> Option<&SnapshotRecord> {
        self.snapshots
            .values()
            .find(|snapshot| snapshot.guid == *guid)
    }
}

/// Everything the catalog holds, in memory (it is small: records, not data).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogState {
    pub cluster: Option<ClusterRecord>,
    pub nodes: BTreeMap<NodeId, NodeRecord>,
    pub next_volume_id: u64,
    pub volumes: BTreeMap<u64, VolumeEntry>,
    pub keys: BTreeMap<String, KeyRecord>,
    pub buckets: BTreeMap<String, BucketRecord>,
    /// Encoded after the rest in a snapshot ([`CatalogState::encode`]), so snapshots from
    /// before bucket settings existed still decode.
    #[serde(skip)]
    pub bucket_settings: BTreeMap<String, BucketSettings>,
    /// Storage nodes whose data directories are over their nearfull threshold, as each
    /// reported itself (`NodeSetNearfull`): placement gives them no new replica. Encoded after
    /// the bucket settings in a snapshot, which older snapshots lack.
    #[serde(skip)]
    pub nearfull: BTreeSet<NodeId>,
}

/// Why a draining node's replica of a volume cannot leave yet ([`CatalogState::drain_waits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainWait {
    /// The primary of a replicated volume, with no other replica in sync on a node that is up
    /// and not draining to hand the volume to.
    NoHandOffTarget,
    /// The volume's only copy (R=1), with no storage node up, not draining and not nearly
    /// full to copy it to.
    NoCopyTarget,
    /// Every storage node that is up, not draining and not nearly full already holds a
    /// replica of the volume.
    NoMoveTarget,
}

impl DrainWait {
    /// What it waits for, and what the operator can do about it.
    pub fn describe(self) -> &'static str {
        match self {
            DrainWait::NoHandOffTarget => {
                "its primary has no other replica in sync on a node that is up and not draining \
                 to hand the volume to (yet: a catch-up under way ends it)"
            }
            DrainWait::NoCopyTarget => {
                "its only copy (R=1) has no storage node that is up, not draining and not \
                 nearly full to go to: add a node or bring one back"
            }
            DrainWait::NoMoveTarget => {
                "every storage node that is up, not draining and not nearly full holds one of \
                 its replicas: add a node, or lower the volume's R"
            }
        }
    }
}

/// One record-level change a command makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    PutCluster(ClusterRecord),
    PutNode(NodeRecord),
    PutNextVolumeId(u64),
    PutVolume(VolumeRecord),
    DeleteVolume(u64),
    PutSnapshot(SnapshotRecord),
    DeleteSnapshot { volume_id: u64, generation: u64 },
    PutKey(KeyRecord),
    DeleteKey(String),
    PutBucket(BucketRecord),
    DeleteBucket(String),
    PutBucketSettings(BucketSettings),
    DeleteBucketSettings(String),
    SetNearfull { node: NodeId, nearfull: bool },
}

impl Change {
    /// The store write that persists this change.
    pub fn store_op(&self) -> WriteOp {
        let put = |key: Vec<u8>, value: Vec<u8>| WriteOp::put(key, value, Compression::None);
        match self {
            Change::PutCluster(record) => {
                put(records::cluster_key(), records::encode_versioned(record))
            }
            Change::PutNode(record) => put(
                records::node_key(record.id),
                records::encode_versioned(record),
            ),
            Change::PutNextVolumeId(next) => {
                put(records::next_volume_id_key(), records::encode_plain(next))
            }
            Change::PutVolume(record) => put(
                records::volume_key(record.id),
                records::encode_plain(record),
            ),
            Change::DeleteVolume(id) => WriteOp::Delete {
                key: records::volume_key(*id),
            },
            Change::PutSnapshot(record) => put(
                records::snapshot_key(record.volume_id, record.generation),
                records::encode_plain(record),
            ),
            Change::DeleteSnapshot {
                volume_id,
                generation,
            } => WriteOp::Delete {
                key: records::snapshot_key(*volume_id, *generation),
            },
            Change::PutKey(record) => put(
                records::key_record_key(&record.access_key_id),
                records::encode_versioned(record),
            ),
            Change::DeleteKey(id) => WriteOp::Delete {
                key: records::key_record_key(id),
            },
            Change::PutBucket(record) => put(
                records::bucket_key(&record.name),
                records::encode_versioned(record),
            ),
            Change::DeleteBucket(name) => WriteOp::Delete {
                key: records::bucket_key(name),
            },
            Change::PutBucketSettings(settings) => put(
                records::bucket_settings_key(&settings.name),
                records::encode_bucket_settings(settings),
            ),
            Change::DeleteBucketSettings(name) => WriteOp::Delete {
                key: records::bucket_settings_key(name),
            },
            Change::SetNearfull {
                node,
                nearfull: true,
            } => put(
                records::nearfull_key(*node),
                records::encode_versioned(node),
            ),
            Change::SetNearfull {
                node,
                nearfull: false,
            } => WriteOp::Delete {
                key: records::nearfull_key(*node),
            },
        }
    }
}

/// A command's effect, before it is applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub changes: Vec<Change>,
    pub outcome: Outcome,
    pub events: Vec<Event>,
}

impl Plan {
    fn new(outcome: Outcome) -> Plan {
        Plan {
            changes: Vec::new(),
            outcome,
            events: Vec::new(),
        }
    }

    fn change(mut self, change: Change) -> Plan {
        self.changes.push(change);
        self
    }

    fn event(mut self, event: Event) -> Plan {
        self.events.push(event);
        self
    }

    pub fn store_ops(&self) -> Vec<WriteOp> {
        self.changes.iter().map(Change::store_op).collect()
    }
}

fn not_found(name: &str) -> CatalogError {
    CatalogError::VolumeNotFound {
        name: name.to_string(),
    }
}

fn snapshot_not_found(volume: &str, snapshot: &str) -> CatalogError {
    CatalogError::SnapshotNotFound {
        volume: volume.to_string(),
        snapshot: snapshot.to_string(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Points `record`'s current view at a frozen view (rollback, receive): a fresh generation on
/// top of it, skipping every own generation written after it.
fn rebase_onto(record: &mut VolumeRecord, frozen_view: &[Layer], size_bytes: u64) {
    let next = record.generation_next;
    let mut view = frozen_view.to_vec();
    // Everything the frozen view did not show stays hidden (a repaired snapshot's view shows
    // a generation above its own).
    view[0].include(next);
    record.view = view;
    record.generation = next;
    record.generation_next = next + 1;
    record.size_bytes = size_bytes;
}

impl CatalogState {
    /// Reads every catalog record from the store. `local_node` places volume records written by
    /// single-node Keel (before replication state existed).
    pub fn load(store: &Store, local_node: NodeId) -> Result<CatalogState, CatalogError> {
        let mut state = CatalogState {
            next_volume_id: 1,
            ..CatalogState::default()
        };
        let mut snapshots: Vec<SnapshotRecord> = Vec::new();
        for prefix in records::CATALOG_PREFIXES {
            for (key, value) in scan_prefix(store, prefix)? {
                let suffix = key.get(1..).unwrap_or_default();
                if suffix == records::CLUSTER_SUFFIX {
                    state.cluster = Some(records::decode_versioned(&key, &value)?);
                } else if suffix.starts_with(records::NEARFULL_PREFIX) {
                    state
                        .nearfull
                        .insert(records::decode_versioned(&key, &value)?);
                } else if suffix.starts_with(records::NODE_PREFIX) {
                    let node: NodeRecord = records::decode_versioned(&key, &value)?;
                    state.nodes.insert(node.id, node);
                } else if suffix == records::NEXT_VOLUME_ID_SUFFIX {
                    let next: u64 = records::decode_plain(&key, &value)?;
                    state.next_volume_id = state.next_volume_id.max(next);
                } else if suffix.starts_with(records::VOLUME_PREFIX) {
                    let record = records::decode_volume(&key, &value, local_node)?;
                    state.next_volume_id = state.next_volume_id.max(record.id + 1);
                    state.volumes.insert(
                        record.id,
                        VolumeEntry {
                            record,
                            snapshots: BTreeMap::new(),
                        },
                    );
                } else if suffix.starts_with(records::SNAPSHOT_PREFIX) {
                    snapshots.push(records::decode_plain(&key, &value)?);
                } else if suffix.starts_with(records::KEY_PREFIX) {
                    let record: KeyRecord = records::decode_versioned(&key, &value)?;
                    state.keys.insert(record.access_key_id.clone(), record);
                } else if suffix.starts_with(records::BUCKET_PREFIX) {
                    let record: BucketRecord = records::decode_versioned(&key, &value)?;
                    state.buckets.insert(record.name.clone(), record);
                } else if suffix.starts_with(records::BUCKET_SETTINGS_PREFIX) {
                    let settings = records::decode_bucket_settings(&key, &value)?;
                    state
                        .bucket_settings
                        .insert(settings.name.clone(), settings);
                } else {
                    tracing::warn!(
                        record = %String::from_utf8_lossy(suffix),
                        "ignoring an unknown record in the catalog's key range"
                    );
                }
            }
        }
        for snapshot in snapshots {
            match state.volumes.get_mut(&snapshot.volume_id) {
                Some(entry) => {
                    entry.snapshots.insert(snapshot.generation, snapshot);
                }
                None => tracing::warn!(
                    volume_id = snapshot.volume_id,
                    snapshot = %snapshot.name,
                    "ignoring a snapshot record whose volume record is gone"
                ),
            }
        }
        Ok(state)
    }

    /// Store ops that make the store's catalog records exactly this state's: deletes of every
    /// record now under the catalog's prefixes, then puts of every record of `self`.
    pub fn replace_ops(&self, store: &Store) -> Result<Vec<WriteOp>, CatalogError> {
        let mut ops = Vec::new();
        for prefix in records::CATALOG_PREFIXES {
            for (key, _) in scan_prefix(store, prefix)? {
                ops.push(WriteOp::Delete { key });
            }
        }
        let mut changes = Vec::new();
        if let Some(cluster) = &self.cluster {
            changes.push(Change::PutCluster(cluster.clone()));
        }
        changes.extend(self.nodes.values().cloned().map(Change::PutNode));
        changes.push(Change::PutNextVolumeId(self.next_volume_id));
        for entry in self.volumes.values() {
            changes.push(Change::PutVolume(entry.record.clone()));
            changes.extend(entry.snapshots.values().cloned().map(Change::PutSnapshot));
        }
        changes.extend(self.keys.values().cloned().map(Change::PutKey));
        changes.extend(self.buckets.values().cloned().map(Change::PutBucket));
        changes.extend(
            self.bucket_settings
                .values()
                .cloned()
                .map(Change::PutBucketSettings),
        );
        changes.extend(self.nearfull.iter().map(|node| Change::SetNearfull {
            node: *node,
            nearfull: true,
        }));
        ops.extend(changes.iter().map(Change::store_op));
        Ok(ops)
    }

    /// A snapshot's encoding: the state (versioned), then the bucket settings, which
    /// snapshots written before they existed lack. Settings came in format 1 as a plain
    /// postcard map; now that map is written empty and followed by the format byte and the
    /// map in [`records::BUCKET_SETTINGS_FORMAT`].
    pub fn encode(&self) -> Vec<u8> {
        let mut out = records::encode_versioned(self);
        let legacy: BTreeMap<String, records::BucketSettingsV1> = BTreeMap::new();
        out.extend_from_slice(&records::encode_plain(&legacy));
        out.push(records::BUCKET_SETTINGS_FORMAT);
        out.extend_from_slice(&records::encode_plain(&self.bucket_settings));
        out.push(records::NEARFULL_FORMAT);
        out.extend_from_slice(&records::encode_plain(&self.nearfull));
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<CatalogState, CatalogError> {
        let corrupt = |detail: String| CatalogError::Corrupt {
            record: "snapshot".to_string(),
            detail,
        };
        let body = match bytes.split_first() {
            Some((&records::RECORD_VERSION, body)) => body,
            Some((version, _)) => return Err(corrupt(format!("unknown record version {version}"))),
            None => return Err(corrupt("empty record".to_string())),
        };
        let (mut state, rest): (CatalogState, &[u8]) =
            postcard::take_from_bytes(body).map_err(|error| corrupt(error.to_string()))?;
        if rest.is_empty() {
            return Ok(state);
        }
        let (legacy, rest): (BTreeMap<String, records::BucketSettingsV1>, &[u8]) =
            postcard::take_from_bytes(rest).map_err(|error| corrupt(error.to_string()))?;
        let rest = match rest.split_first() {
            None => {
                state.bucket_settings = legacy
                    .into_iter()
                    .map(|(name, settings)| (name, settings.into()))
                    .collect();
                return Ok(state);
            }
            Some((&records::BUCKET_SETTINGS_FORMAT, body)) => {
                let (settings, rest) =
                    postcard::take_from_bytes(body).map_err(|error| corrupt(error.to_string()))?;
                state.bucket_settings = settings;
                rest
            }
            Some((format, _)) => {
                return Err(corrupt(format!("unknown bucket settings format {format}")))
            }
        };
        // Snapshots from before nearly full nodes were recorded end here.
        match rest.split_first() {
            None => {}
            Some((&records::NEARFULL_FORMAT, body)) => {
                state.nearfull =
                    postcard::from_bytes(body).map_err(|error| corrupt(error.to_string()))?;
            }
            Some((format, _)) => {
                return Err(corrupt(format!(
                    "unknown nearly full nodes format {format}"
                )))
            }
        }
        Ok(state)
    }

    // ---- lookups ----

    /// A ready volume by name.
    pub fn volume(&self, name: &str) -> Option<&VolumeEntry> {
        self.volumes
            .values()
            .find(|entry| entry.record.name == name && entry.record.status == VolumeStatus::Ready)
    }

    /// Whether a ready or receiving volume holds `name` (a deleting one frees its name).
    fn volume_name_taken(&self, name: &str) -> bool {
        self.volumes
            .values()
            .any(|entry| entry.record.name == name && entry.record.status != VolumeStatus::Deleting)
    }

    /// Whether `node` is a member the cluster records as `Up` (not suspect, down or unknown).
    pub fn node_is_up(&self, node: NodeId) -> bool {
        (self.nodes.get(&node)).is_some_and(|record| record.state == NodeState::Up)
    }

    pub fn ready_volumes(&self) -> impl Iterator<Item = &VolumeEntry> {
        self.volumes
            .values()
            .filter(|entry| entry.record.status == VolumeStatus::Ready)
    }

    /// Names of ready volumes (other than `volume_id`) that read through `volume_id`'s extents:
    /// clones of any of its snapshots, or of the one at `snapshot_generation`.
    pub fn dependents(&self, volume_id: u64, snapshot_generation: Option<u64>) -> Vec<String> {
        self.volumes
            .values()
            .filter(|entry| entry.record.id != volume_id)
            .filter(|entry| match (&entry.record.origin, snapshot_generation) {
                (Some(origin), Some(generation)) => {
                    origin.volume_id == volume_id && origin.snapshot_generation == generation
                }
                (Some(origin), None) => origin.volume_id == volume_id,
                (None, _) => false,
            })
            .map(|entry| entry.record.name.clone())
            .collect()
    }

    /// (volume name, snapshot name) a clone was made from.
    pub fn origin_names(&self, origin: &Option<Origin>) -> Option<(String, String)> {
        let origin = origin.as_ref()?;
        let parent = self.volumes.get(&origin.volume_id)?;
        let snapshot = parent.snapshots.get(&origin.snapshot_generation)?;
        Some((parent.record.name.clone(), snapshot.name.clone()))
    }

    /// The live member made from the data directory with this instance id.
    pub fn node_by_instance(&self, instance: &[u8; 16]) -> Option<&NodeRecord> {
        self.nodes
            .values()
            .find(|node| node.instance == *instance && !node.removed)
    }

    pub fn node_by_name(&self, name: &str) -> Option<&NodeRecord> {
        self.nodes
            .values()
            .find(|node| node.name == name && !node.removed)
    }

    /// Members that were not removed.
    pub fn members(&self) -> impl Iterator<Item = &NodeRecord> {
        self.nodes.values().filter(|node| !node.removed)
    }

    /// Whether the key may use the bucket: `None` when the bucket does not exist.
    pub fn can_access(&self, bucket: &str, access_key_id: &str) -> Option<bool> {
        let record = self.buckets.get(bucket)?;
        Some(record.owner == access_key_id || record.grants.iter().any(|g| g == access_key_id))
    }

    // ---- applying ----

    /// The changes `command` makes, or why it is refused. Pure: reads `self` and `command` only.
    pub fn plan(&self, command: &Command) -> Result<Plan, CatalogError> {
        match command {
            Command::Bootstrap {
                cluster_id,
                created_unix_ms,
                node,
            } => self.plan_bootstrap(*cluster_id, *created_unix_ms, node),
            Command::NodeAdd {
                node,
                joined_unix_ms,
            } => self.plan_node_add(node, *joined_unix_ms),
            Command::NodeUpdate {
                id,
                addresses,
                labels,
                devices,
            } => {
                let mut record = self.live_node(*id)?.clone();
                record.addresses = addresses.clone();
                record.labels = labels.clone();
                record.devices = devices.clone();
                Ok(Plan::new(Outcome::Done)
                    .change(Change::PutNode(record))
                    .event(Event::NodeChanged { node: *id }))
            }
            Command::NodeSetState {
                id,
                state,
                at_unix_ms,
            } => {
                let mut record = self.live_node(*id)?.clone();
                if record.state == *state {
                    return Ok(Plan::new(Outcome::Done));
                }
                record.state = *state;
                record.state_since_unix_ms = *at_unix_ms;
                Ok(Plan::new(Outcome::Done)
                    .change(Change::PutNode(record))
                    .event(Event::NodeChanged { node: *id }))
            }
            Command::NodeSetNearfull { id, nearfull } => {
                self.live_node(*id)?;
                Ok(Plan::new(Outcome::Done)
                    .change(Change::SetNearfull {
                        node: *id,
                        nearfull: *nearfull,
                    })
                    .event(Event::NodeChanged { node: *id }))
            }
            Command::NodeSetDraining { id, draining } => {
                let mut record = self.live_node(*id)?.clone();
                record.draining = *draining;
                Ok(Plan::new(Outcome::Done)
                    .change(Change::PutNode(record))
                    .event(Event::NodeChanged { node: *id }))
            }
            Command::NodeRemove { id } => {
                let mut record = self.live_node(*id)?.clone();
                let hosted: Vec<String> = self
                    .volumes
                    .values()
                    .filter(|entry| entry.record.replication.hosts(*id))
                    .map(|entry| entry.record.name.clone())
                    .collect();
                if !hosted.is_empty() {
                    return Err(CatalogError::NodeInUse {
                        node: record.name,
                        detail: format!(
                            "it holds replicas of volumes {hosted:?}; delete or move them first"
                        ),
                    });
                }
                record.removed = true;
                let mut plan = Plan::new(Outcome::Done).change(Change::PutNode(record));
                if self.nearfull.contains(id) {
                    plan = plan.change(Change::SetNearfull {
                        node: *id,
                        nearfull: false,
                    });
                }
                Ok(plan.event(Event::NodeChanged { node: *id }))
            }
            Command::VolumeCreate {
                settings,
                uuid,
                created_unix_seconds,
                replicas,
                status,
            } => self.plan_volume_create(settings, *uuid, *created_unix_seconds, replicas, *status),
            Command::VolumeClone {
                parent,
                snapshot,
                name,
                uuid,
                created_unix_seconds,
            } => self.plan_clone(parent, snapshot, name, *uuid, *created_unix_seconds),
            Command::VolumeDelete { name } => {
                let entry = self.volume(name).ok_or_else(|| not_found(name))?;
                let clones = self.dependents(entry.record.id, None);
                if !clones.is_empty() {
                    return Err(CatalogError::VolumeInUse {
                        volume: name.clone(),
                        detail: format!(
                            "clones {clones:?} read through its snapshots; delete them first"
                        ),
                    });
                }
                if entry.record.receiving_generation.is_some() {
                    return Err(CatalogError::VolumeInUse {
                        volume: name.clone(),
                        detail: "a stream is being received into it".to_string(),
                    });
                }
                let mut record = entry.record.clone();
                record.status = VolumeStatus::Deleting;
                Ok(Plan::new(Outcome::Volume(record.id))
                    .event(Event::VolumeDeleting {
                        volume_id: record.id,
                    })
                    .change(Change::PutVolume(record)))
            }
            Command::VolumeForget { volume_id } => {
                let entry = self
                    .volumes
                    .get(volume_id)
                    .ok_or_else(|| CatalogError::Invalid {
                        subject: format!("volume id {volume_id}"),
                        detail: "no such volume".to_string(),
                    })?;
                if entry.record.status != VolumeStatus::Deleting {
                    return Err(CatalogError::Invalid {
                        subject: entry.record.name.clone(),
                        detail: "only a volume being deleted can be forgotten".to_string(),
                    });
                }
                let mut plan = Plan::new(Outcome::Done);
                for &generation in entry.snapshots.keys() {
                    plan = plan.change(Change::DeleteSnapshot {
                        volume_id: *volume_id,
                        generation,
                    });
                }
                Ok(plan
                    .change(Change::DeleteVolume(*volume_id))
                    .event(Event::VolumeForgotten {
                        volume_id: *volume_id,
                    }))
            }
            Command::VolumeResize {
                name,
                size_bytes,
                allow_shrink,
            } => self.plan_resize(name, *size_bytes, *allow_shrink),
            Command::VolumeSetLimits {
                name,
                iops_max,
                bandwidth_max_mib_per_second,
            } => {
                let entry = self.volume(name).ok_or_else(|| not_found(name))?;
                let mut record = entry.record.clone();
                record.iops_max = *iops_max;
                record.bandwidth_max_mib_per_second = *bandwidth_max_mib_per_second;
                Ok(Plan::new(Outcome::Done)
                    .event(Event::VolumeChanged {
                        volume_id: record.id,
                    })
                    .change(Change::PutVolume(record)))
            }
            Command::VolumeSetReplication {
                volume_id,
                epoch,
                primary,
                in_sync,
            } => self.plan_set_replication(*volume_id, *epoch, *primary, in_sync),
            Command::VolumeMoveReplica {
                volume_id,
                epoch,
                from,
                to,
            } => self.plan_move_replica(*volume_id, *epoch, *from, *to),
            Command::VolumeSetReplicas {
                volume_id,
                epoch,
                replicas,
                in_sync_min,
            } => self.plan_set_replicas(*volume_id, *epoch, replicas, *in_sync_min),
            Command::SnapshotCreate {
                volume,
                snapshot,
                guid,
                created_unix_seconds,
            } => self.plan_snapshot_create(volume, snapshot, *guid, *created_unix_seconds),
            Command::SnapshotDelete { volume, snapshot } => {
                let entry = self.volume(volume).ok_or_else(|| not_found(volume))?;
                let frozen = entry
                    .snapshot_by_name(snapshot)
                    .ok_or_else(|| snapshot_not_found(volume, snapshot))?;
                let clones = self.dependents(entry.record.id, Some(frozen.generation));
                if !clones.is_empty() {
                    return Err(CatalogError::VolumeInUse {
                        volume: volume.clone(),
                        detail: format!("clones {clones:?} were made from snapshot {snapshot:?}"),
                    });
                }
                let volume_id = entry.record.id;
                Ok(Plan::new(Outcome::Done)
                    .change(Change::DeleteSnapshot {
                        volume_id,
                        generation: frozen.generation,
                    })
                    .event(Event::VolumeChanged { volume_id })
                    .event(Event::VolumeGarbage { volume_id }))
            }
            Command::VolumeRollback { volume, snapshot } => {
                let entry = self.volume(volume).ok_or_else(|| not_found(volume))?;
                if entry.record.receiving_generation.is_some() {
                    return Err(CatalogError::VolumeInUse {
                        volume: volume.clone(),
                        detail: "a stream is being received into it".to_string(),
                    });
                }
                let target = entry
                    .snapshot_by_name(snapshot)
                    .ok_or_else(|| snapshot_not_found(volume, snapshot))?;
                if let Some(node) = entry
                    .record
                    .replication
                    .in_sync
                    .iter()
                    .find(|node| !target.complete_on(**node))
                {
                    return Err(CatalogError::Invalid {
                        subject: format!("volume {volume:?}"),
                        detail: format!(
                            "snapshot {snapshot:?} is incomplete on node {node}, which is in \
                             sync: take it out of the in-sync set first, or its copy would \
                             roll back onto data it never had"
                        ),
                    });
                }
                let mut record = entry.record.clone();
                rebase_onto(&mut record, &target.view, target.size_bytes);
                let volume_id = record.id;
                Ok(Plan::new(Outcome::Done)
                    .change(Change::PutVolume(record))
                    .event(Event::VolumeChanged { volume_id })
                    .event(Event::VolumeGarbage { volume_id }))
            }
            Command::ReceiveReserve {
                volume,
                base_guid,
                target_name,
                target_guid,
            } => self.plan_receive_reserve(volume, base_guid, target_name, target_guid),
            Command::ReceivePublish {
                volume_id,
                generation,
                base_generation,
                target_name,
                target_guid,
                size_bytes,
                created_unix_seconds,
            } => self.plan_receive_publish(
                *volume_id,
                *generation,
                *base_generation,
                target_name,
                *target_guid,
                *size_bytes,
                *created_unix_seconds,
            ),
            Command::VolumeCopyOffDraining {
                volume_id,
                epoch,
                to,
            } => self.plan_copy_off_draining(*volume_id, *epoch, *to),
            Command::SnapshotRepairBegin {
                volume_id,
                snapshot_generation,
                node,
            } => self.plan_repair_begin(*volume_id, *snapshot_generation, *node),
            Command::SnapshotRepairEnd {
                volume_id,
                snapshot_generation,
                node,
                generation,
            } => self.plan_repair_end(*volume_id, *snapshot_generation, *node, *generation),
            Command::ReceiveAbandon {
                volume_id,
                generation,
            } => {
                let entry = self
                    .volumes
                    .get(volume_id)
                    .ok_or_else(|| CatalogError::Invalid {
                        subject: format!("volume id {volume_id}"),
                        detail: "no such volume".to_string(),
                    })?;
                let mut record = entry.record.clone();
                if record.status == VolumeStatus::Receiving {
                    record.status = VolumeStatus::Deleting;
                    return Ok(Plan::new(Outcome::Done)
                        .change(Change::PutVolume(record))
                        .event(Event::VolumeDeleting {
                            volume_id: *volume_id,
                        }));
                }
                if record.receiving_generation != Some(*generation) {
                    // Already published or abandoned: nothing left to release.
                    return Ok(Plan::new(Outcome::Done));
                }
                record.receiving_generation = None;
                Ok(Plan::new(Outcome::Done)
                    .change(Change::PutVolume(record))
                    .event(Event::VolumeChanged {
                        volume_id: *volume_id,
                    })
                    .event(Event::VolumeGarbage {
                        volume_id: *volume_id,
                    }))
            }
            Command::KeyAdd { record } => {
                if self.keys.contains_key(&record.access_key_id) {
                    return Err(CatalogError::AccessKeyExists {
                        access_key_id: record.access_key_id.clone(),
                    });
                }
                Ok(Plan::new(Outcome::Done)
                    .change(Change::PutKey(record.clone()))
                    .event(Event::KeysChanged))
            }
            Command::KeyDelete { access_key_id } => {
                if !self.keys.contains_key(access_key_id) {
                    return Err(CatalogError::NoSuchAccessKey {
                        access_key_id: access_key_id.clone(),
                    });
                }
                Ok(Plan::new(Outcome::Done)
                    .change(Change::DeleteKey(access_key_id.clone()))
                    .event(Event::KeysChanged))
            }
            Command::BucketCreate {
                name,
                owner,
                compression_code,
                created_unix_ms,
            } => self.create_bucket(name, owner, *compression_code, *created_unix_ms),
            Command::BucketCreateLocked {
                name,
                owner,
                compression_code,
                created_unix_ms,
            } => {
                let settings = BucketSettings {
                    name: name.clone(),
                    versioning: Versioning::Enabled,
                    object_lock: Some(ObjectLock::default()),
                    ..BucketSettings::default()
                };
                Ok(self
                    .create_bucket(name, owner, *compression_code, *created_unix_ms)?
                    .change(Change::PutBucketSettings(settings)))
            }
            Command::BucketSetPolicy { bucket, policy } => {
                let mut settings = self.settings_of(bucket)?;
                settings.policy = policy.clone();
                Ok(self.put_settings(settings))
            }
            Command::BucketSetObjectLock { bucket, lock } => {
                let mut settings = self.settings_of(bucket)?;
                if settings.versioning != Versioning::Enabled {
                    return Err(CatalogError::InvalidBucketState {
                        name: bucket.clone(),
                        detail: "object lock needs versioning enabled".into(),
                    });
                }
                settings.object_lock = Some(lock.clone());
                Ok(self.put_settings(settings))
            }
            Command::BucketDelete { name } => {
                if !self.buckets.contains_key(name) {
                    return Err(CatalogError::NoSuchBucket { name: name.clone() });
                }
                let mut plan = Plan::new(Outcome::Done).change(Change::DeleteBucket(name.clone()));
                if self.bucket_settings.contains_key(name) {
                    plan = plan.change(Change::DeleteBucketSettings(name.clone()));
                }
                Ok(plan.event(Event::BucketChanged { name: name.clone() }))
            }
            Command::BucketSetTags { bucket, tags } => {
                let mut settings = self.settings_of(bucket)?;
                settings.tags = tags.clone();
                settings.tags.sort();
                Ok(self.put_settings(settings))
            }
            Command::BucketSetCors { bucket, rules } => {
                let mut settings = self.settings_of(bucket)?;
                settings.cors = rules.clone();
                Ok(self.put_settings(settings))
            }
            Command::BucketSetPublicRead {
                bucket,
                public_read,
            } => {
                let mut settings = self.settings_of(bucket)?;
                settings.public_read = *public_read;
                Ok(self.put_settings(settings))
            }
            Command::BucketSetLifecycle { bucket, rules } => {
                let mut settings = self.settings_of(bucket)?;
                settings.lifecycle = rules.clone();
                Ok(self.put_settings(settings))
            }
            Command::BucketSetVersioning { bucket, enabled } => {
                let mut settings = self.settings_of(bucket)?;
                if !enabled && settings.object_lock.is_some() {
                    return Err(CatalogError::InvalidBucketState {
                        name: bucket.clone(),
                        detail: "versioning cannot be suspended on a bucket with object lock"
                            .into(),
                    });
                }
                settings.versioning = if *enabled {
                    Versioning::Enabled
                } else {
                    Versioning::Suspended
                };
                Ok(self.put_settings(settings))
            }
            Command::BucketGrant {
                bucket,
                access_key_id,
                allow,
            } => {
                if !self.keys.contains_key(access_key_id) {
                    return Err(CatalogError::NoSuchAccessKey {
                        access_key_id: access_key_id.clone(),
                    });
                }
                let mut record = self
                    .buckets
                    .get(bucket)
                    .ok_or_else(|| CatalogError::NoSuchBucket {
                        name: bucket.clone(),
                    })?
                    .clone();
                record.grants.retain(|grant| grant != access_key_id);
                if *allow {
                    record.grants.push(access_key_id.clone());
                    record.grants.sort();
                }
                Ok(Plan::new(Outcome::Done)
                    .change(Change::PutBucket(record))
                    .event(Event::BucketChanged {
                        name: bucket.clone(),
                    }))
            }
            Command::BucketSetCompression {
                bucket,
                compression_code,
            } => {
                Compression::from_code(*compression_code).ok_or_else(|| CatalogError::Invalid {
                    subject: bucket.clone(),
                    detail: format!("unknown compression code {compression_code}"),
                })?;
                let mut record = self
                    .buckets
                    .get(bucket)
                    .ok_or_else(|| CatalogError::NoSuchBucket {
                        name: bucket.clone(),
                    })?
                    .clone();
                record.compression_code = *compression_code;
                Ok(Plan::new(Outcome::Done)
                    .change(Change::PutBucket(record))
                    .event(Event::BucketChanged {
                        name: bucket.clone(),
                    }))
            }
        }
    }

    /// Applies planned changes to memory (after they are in the store).
    pub fn commit(&mut self, changes: &[Change]) {
        for change in changes {
            match change {
                Change::PutCluster(record) => self.cluster = Some(record.clone()),
                Change::PutNode(record) => {
                    self.nodes.insert(record.id, record.clone());
                }
                Change::PutNextVolumeId(next) => self.next_volume_id = *next,
                Change::PutVolume(record) => {
                    self.volumes
                        .entry(record.id)
                        .and_modify(|entry| entry.record = record.clone())
                        .or_insert_with(|| VolumeEntry {
                            record: record.clone(),
                            snapshots: BTreeMap::new(),
                        });
                }
                Change::DeleteVolume(id) => {
                    self.volumes.remove(id);
                }
                Change::PutSnapshot(record) => {
                    if let Some(entry) = self.volumes.get_mut(&record.volume_id) {
                        entry.snapshots.insert(record.generation, record.clone());
                    }
                }
                Change::DeleteSnapshot {
                    volume_id,
                    generation,
                } => {
                    if let Some(entry) = self.volumes.get_mut(volume_id) {
                        entry.snapshots.remove(generation);
                    }
                }
                Change::PutKey(record) => {
                    self.keys
                        .insert(record.access_key_id.clone(), record.clone());
                }
                Change::DeleteKey(id) => {
                    self.keys.remove(id);
                }
                Change::PutBucket(record) => {
                    self.buckets.insert(record.name.clone(), record.clone());
                }
                Change::DeleteBucket(name) => {
                    self.buckets.remove(name);
                }
                Change::PutBucketSettings(settings) => {
                    self.bucket_settings
                        .insert(settings.name.clone(), settings.clone());
                }
                Change::DeleteBucketSettings(name) => {
                    self.bucket_settings.remove(name);
                }
                Change::SetNearfull { node, nearfull } => {
                    if *nearfull {
                        self.nearfull.insert(*node);
                    } else {
                        self.nearfull.remove(node);
                    }
                }
            }
        }
    }

    /// The plan of a new bucket (refused when the name is taken or invalid, the owner unknown).
    fn create_bucket(
        &self,
        name: &str,
        owner: &str,
        compression_code: u8,
        created_unix_ms: i64,
    ) -> Result<Plan, CatalogError> {
        crate::validate_bucket_name(name)?;
        if let Some(existing) = self.buckets.get(name) {
            return Err(if existing.owner == owner {
                CatalogError::BucketAlreadyOwnedByYou {
                    name: name.to_string(),
                }
            } else {
                CatalogError::BucketAlreadyExists {
                    name: name.to_string(),
                }
            });
        }
        if !self.keys.contains_key(owner) {
            return Err(CatalogError::NoSuchAccessKey {
                access_key_id: owner.to_string(),
            });
        }
        Compression::from_code(compression_code).ok_or_else(|| CatalogError::Invalid {
            subject: name.to_string(),
            detail: format!("unknown compression code {compression_code}"),
        })?;
        Ok(Plan::new(Outcome::Done)
            .change(Change::PutBucket(BucketRecord {
                name: name.to_string(),
                owner: owner.to_string(),
                grants: Vec::new(),
                created_unix_ms,
                compression_code,
            }))
            .event(Event::BucketChanged {
                name: name.to_string(),
            }))
    }

    /// A bucket's settings as they are (default when it has none yet).
    fn settings_of(&self, bucket: &str) -> Result<BucketSettings, CatalogError> {
        if !self.buckets.contains_key(bucket) {
            return Err(CatalogError::NoSuchBucket {
                name: bucket.to_string(),
            });
        }
        Ok(self
            .bucket_settings
            .get(bucket)
            .cloned()
            .unwrap_or_else(|| BucketSettings {
                name: bucket.to_string(),
                ..BucketSettings::default()
            }))
    }

    /// Records `settings` (or drops the record when nothing is set).
    fn put_settings(&self, settings: BucketSettings) -> Plan {
        let name = settings.name.clone();
        let change = if settings.is_empty() {
            Change::DeleteBucketSettings(name.clone())
        } else {
            Change::PutBucketSettings(settings)
        };
        Plan::new(Outcome::Done)
            .change(change)
            .event(Event::BucketChanged { name })
    }

    fn live_node(&self, id: NodeId) -> Result<&NodeRecord, CatalogError> {
        self.nodes
            .get(&id)
            .filter(|node| !node.removed)
            .ok_or(CatalogError::NodeNotFound { node: id })
    }

    fn validate_node(&self, node: &NodeSpec) -> Result<(), CatalogError> {
        validate_name("node", &node.name)?;
        if self.node_by_name(&node.name).is_some() {
            return Err(CatalogError::NodeExists {
                name: node.name.clone(),
            });
        }
        if node.addresses.cluster.is_empty() {
            return Err(CatalogError::Invalid {
                subject: node.name.clone(),
                detail: "a node needs a cluster address".to_string(),
            });
        }
        Ok(())
    }

    fn new_node(id: NodeId, node: &NodeSpec, at_unix_ms: i64) -> NodeRecord {
        NodeRecord {
            id,
            name: node.name.clone(),
            instance: node.instance,
            role: node.role,
            addresses: node.addresses.clone(),
            labels: node.labels.clone(),
            devices: node.devices.clone(),
            state: NodeState::Up,
            state_since_unix_ms: at_unix_ms,
            draining: false,
            removed: false,
            joined_unix_ms: at_unix_ms,
        }
    }

    fn plan_bootstrap(
        &self,
        cluster_id: [u8; 16],
        created_unix_ms: i64,
        node: &NodeSpec,
    ) -> Result<Plan, CatalogError> {
        if let Some(cluster) = &self.cluster {
            return Err(CatalogError::Invalid {
                subject: "cluster".to_string(),
                detail: format!(
                    "this catalog already belongs to cluster {}",
                    hex(&cluster.cluster_id)
                ),
            });
        }
        self.validate_node(node)?;
        let first = crate::FIRST_NODE_ID;
        Ok(Plan::new(Outcome::Node(first))
            .change(Change::PutCluster(ClusterRecord {
                cluster_id,
                created_unix_ms,
                next_node_id: first + 1,
            }))
            .change(Change::PutNode(Self::new_node(
                first,
                node,
                created_unix_ms,
            )))
            .event(Event::NodeChanged { node: first }))
    }

    fn plan_node_add(&self, node: &NodeSpec, joined_unix_ms: i64) -> Result<Plan, CatalogError> {
        let mut cluster = self.cluster.clone().ok_or_else(|| CatalogError::Invalid {
            subject: node.name.clone(),
            detail: "the cluster is not bootstrapped".to_string(),
        })?;
        self.validate_node(node)?;
        let id = cluster.next_node_id;
        cluster.next_node_id += 1;
        Ok(Plan::new(Outcome::Node(id))
            .change(Change::PutCluster(cluster))
            .change(Change::PutNode(Self::new_node(id, node, joined_unix_ms)))
            .event(Event::NodeChanged { node: id }))
    }

    /// A fresh volume record at generation 1 showing only its own (empty) layer, ready, with
    /// `replication`; callers adjust the view, origin or status.
    fn new_volume_record(
        id: u64,
        settings: &VolumeSettings,
        uuid: [u8; 16],
        created_unix_seconds: u64,
        replication: Replication,
    ) -> VolumeRecord {
        VolumeRecord {
            format: VOLUME_RECORD_FORMAT,
            id,
            uuid,
            name: settings.name.clone(),
            size_bytes: settings.size_bytes,
            compression: settings.compression.clone(),
            iops_max: settings.iops_max,
            bandwidth_max_mib_per_second: settings.bandwidth_max_mib_per_second,
            generation: 1,
            generation_next: 2,
            view: vec![Layer::new(id, 1)],
            origin: None,
            status: VolumeStatus::Ready,
            created_unix_seconds,
            receiving_generation: None,
            replication,
        }
    }

    fn plan_volume_create(
        &self,
        settings: &VolumeSettings,
        uuid: [u8; 16],
        created_unix_seconds: u64,
        replicas: &[NodeId],
        status: VolumeStatus,
    ) -> Result<Plan, CatalogError> {
        validate_name("volume", &settings.name)?;
        validate_size(&settings.name, settings.size_bytes)?;
        if Compression::from_name(&settings.compression).is_none() {
            return Err(CatalogError::Invalid {
                subject: settings.name.clone(),
                detail: format!("unknown compression {:?}", settings.compression),
            });
        }
        if status == VolumeStatus::Deleting {
            return Err(CatalogError::Invalid {
                subject: settings.name.clone(),
                detail: "a volume cannot be created in the deleting state".to_string(),
            });
        }
        if self.volume_name_taken(&settings.name) {
            return Err(CatalogError::VolumeExists {
                name: settings.name.clone(),
            });
        }
        let replication = self.check_placement(&settings.name, replicas)?;
        let id = self.next_volume_id;
        let mut record =
            Self::new_volume_record(id, settings, uuid, created_unix_seconds, replication);
        record.status = status;
        Ok(Plan::new(Outcome::Volume(id))
            .change(Change::PutNextVolumeId(id + 1))
            .change(Change::PutVolume(record))
            .event(Event::VolumeChanged { volume_id: id }))
    }

    /// A copy of the volume's record, if its replication is still in `epoch`: every change
    /// of replication is a compare-and-set on the epoch.
    fn volume_in_epoch(&self, volume_id: u64, epoch: u64) -> Result<VolumeRecord, CatalogError> {
        let record = self
            .volumes
            .get(&volume_id)
            .ok_or_else(|| not_found(&format!("#{volume_id}")))?
            .record
            .clone();
        if record.replication.epoch != epoch {
            return Err(CatalogError::Invalid {
                subject: format!("volume {:?}", record.name),
                detail: format!(
                    "its replication moved to epoch {} (this change was made against epoch \
                     {epoch})",
                    record.replication.epoch
                ),
            });
        }
        Ok(record)
    }

    fn plan_set_replication(
        &self,
        volume_id: u64,
        epoch: u64,
        primary: NodeId,
        in_sync: &[NodeId],
    ) -> Result<Plan, CatalogError> {
        let mut record = self.volume_in_epoch(volume_id, epoch)?;
        let invalid = |detail: String| CatalogError::Invalid {
            subject: format!("volume {:?}", record.name),
            detail,
        };
        let current = &record.replication;
        if !in_sync.contains(&primary) {
            return Err(invalid(format!(
                "the primary (node {primary}) must be in the in-sync set"
            )));
        }
        if let Some(stranger) = in_sync.iter().find(|node| !current.replicas.contains(node)) {
            return Err(invalid(format!("node {stranger} holds no replica")));
        }
        if primary != current.primary && !current.in_sync.contains(&primary) {
            return Err(invalid(format!(
                "node {primary} is not in sync and cannot become primary"
            )));
        }
        let mut members: Vec<NodeId> = Vec::with_capacity(in_sync.len());
        for node in in_sync {
            if !members.contains(node) {
                members.push(*node);
            }
        }
        record.replication.epoch = epoch + 1;
        record.replication.primary = primary;
        record.replication.in_sync = members;
        Ok(Plan::new(Outcome::Done)
            .event(Event::VolumeChanged { volume_id })
            .change(Change::PutVolume(record)))
    }

    fn plan_move_replica(
        &self,
        volume_id: u64,
        epoch: u64,
        from: NodeId,
        to: NodeId,
    ) -> Result<Plan, CatalogError> {
        let mut record = self.volume_in_epoch(volume_id, epoch)?;
        let invalid = |detail: String| CatalogError::Invalid {
            subject: format!("volume {:?}", record.name),
            detail,
        };
        let replication = &record.replication;
        if from == replication.primary {
            return Err(invalid(format!(
                "node {from} is the primary; attach through another replica to move it"
            )));
        }
        let Some(slot) = replication.replicas.iter().position(|node| *node == from) else {
            return Err(invalid(format!("node {from} holds no replica")));
        };
        if replication.replicas.contains(&to) {
            return Err(invalid(format!("node {to} already holds a replica")));
        }
        self.check_new_replica(&record.name, to)?;
        record.replication.replicas[slot] = to;
        record.replication.in_sync.retain(|node| *node != from);
        record.replication.epoch = epoch + 1;
        Ok(self.plan_replicas_changed(record, &[to], &[from]))
    }

    fn plan_copy_off_draining(
        &self,
        volume_id: u64,
        epoch: u64,
        to: NodeId,
    ) -> Result<Plan, CatalogError> {
        let mut record = self.volume_in_epoch(volume_id, epoch)?;
        let invalid = |detail: String| CatalogError::Invalid {
            subject: format!("volume {:?}", record.name),
            detail,
        };
        let replication = &record.replication;
        if replication.replicas.len() != usize::from(replication.factor) {
            return Err(invalid(format!(
                "R is {} with replicas on nodes {:?}: a copy off a draining node is under way \
                 already",
                replication.factor, replication.replicas
            )));
        }
        let draining = |node: &NodeId| {
            (self.nodes.get(node)).is_some_and(|record| record.draining && !record.removed)
        };
        if !replication.replicas.iter().any(draining) {
            return Err(invalid(format!(
                "none of its replicas (nodes {:?}) is on a draining node",
                replication.replicas
            )));
        }
        if replication.replicas.contains(&to) {
            return Err(invalid(format!("node {to} already holds a replica")));
        }
        self.check_new_replica(&record.name, to)?;
        record.replication.replicas.push(to);
        record.replication.epoch = epoch + 1;
        Ok(self.plan_replicas_changed(record, &[to], &[]))
    }

    /// The plan of a change of a volume's replicas, `record` as it becomes: the record, and
    /// what the change does to its snapshots ([`Self::snapshots_after_replicas_change`]).
    fn plan_replicas_changed(
        &self,
        record: VolumeRecord,
        added: &[NodeId],
        removed: &[NodeId],
    ) -> Plan {
        let volume_id = record.id;
        self.snapshots_after_replicas_change(
            Plan::new(Outcome::Done).event(Event::VolumeChanged { volume_id }),
            volume_id,
            added,
            removed,
        )
        .change(Change::PutVolume(record))
    }

    /// Adds to `plan` what a change of the volume's replicas does to its snapshots: every
    /// snapshot is incomplete on the `added` nodes, new replicas (they receive the volume's
    /// current contents only, and a node that left and comes back has erased its copy), and no
    /// repair of a copy on an added or `removed` node goes on: the copy it wrote into is
    /// erased, so ending it would name a copy complete that lacks what it wrote before.
    fn snapshots_after_replicas_change(
        &self,
        mut plan: Plan,
        volume_id: u64,
        added: &[NodeId],
        removed: &[NodeId],
    ) -> Plan {
        let Some(entry) = self.volumes.get(&volume_id) else {
            return plan;
        };
        for snapshot in entry.snapshots.values() {
            let missing: Vec<NodeId> = added
                .iter()
                .copied()
                .filter(|node| snapshot.complete_on(*node))
                .collect();
            let ended = |node: NodeId| added.contains(&node) || removed.contains(&node);
            if missing.is_empty() && !snapshot.repairs.iter().any(|repair| ended(repair.node)) {
                continue;
            }
            let mut snapshot = snapshot.clone();
            snapshot.incomplete_on.extend(missing);
            snapshot.repairs.retain(|repair| !ended(repair.node));
            plan = plan.change(Change::PutSnapshot(snapshot));
        }
        plan
    }

    fn plan_set_replicas(
        &self,
        volume_id: u64,
        epoch: u64,
        replicas: &[NodeId],
        in_sync_min: u8,
    ) -> Result<Plan, CatalogError> {
        let mut record = self.volume_in_epoch(volume_id, epoch)?;
        let invalid = |detail: String| CatalogError::Invalid {
            subject: format!("volume {:?}", record.name),
            detail,
        };
        if record.status != VolumeStatus::Ready {
            return Err(invalid(
                "it is not ready (being received or deleted)".to_string(),
            ));
        }
        let current = &record.replication;
        // (One more than R's most while an R=3 volume's replica moves.)
        if replicas.is_empty() || replicas.len() > records::REPLICAS_MOVING_MAX {
            return Err(invalid(format!(
                "{} replicas: Keel keeps 1 to {} ({} while a replica moves)",
                replicas.len(),
                records::REPLICAS_MAX,
                records::REPLICAS_MOVING_MAX
            )));
        }
        if !replicas.contains(&current.primary) {
            return Err(invalid(format!(
                "the primary (node {}) keeps its replica; attach through another replica first",
                current.primary
            )));
        }
        for (index, &node) in replicas.iter().enumerate() {
            if replicas[..index].contains(&node) {
                return Err(invalid(format!("node {node} is named twice as a replica")));
            }
            if !current.replicas.contains(&node) {
                self.check_new_replica(&record.name, node)?;
            }
        }
        if in_sync_min == 0 || usize::from(in_sync_min) > replicas.len() {
            return Err(invalid(format!(
                "an in-sync minimum of {in_sync_min} with {} replicas: it must be 1 to {}",
                replicas.len(),
                replicas.len()
            )));
        }
        let in_sync = current
            .in_sync
            .iter()
            .copied()
            .filter(|node| replicas.contains(node))
            .collect();
        let added: Vec<NodeId> = replicas
            .iter()
            .copied()
            .filter(|node| !current.replicas.contains(node))
            .collect();
        let removed: Vec<NodeId> = current
            .replicas
            .iter()
            .copied()
            .filter(|node| !replicas.contains(node))
            .collect();
        record.replication = Replication {
            factor: replicas.len() as u8,
            in_sync_min,
            replicas: replicas.to_vec(),
            epoch: epoch + 1,
            primary: current.primary,
            in_sync,
        };
        Ok(self.plan_replicas_changed(record, &added, &removed))
    }

    /// A node may take a new replica of `volume`: a live storage node, not draining, not
    /// nearly full.
    fn check_new_replica(&self, volume: &str, node: NodeId) -> Result<(), CatalogError> {
        let target = self.live_node(node)?;
        if target.role != crate::records::NodeRole::Storage
            || target.draining
            || self.nearfull.contains(&node)
        {
            return Err(CatalogError::Invalid {
                subject: format!("volume {volume:?}"),
                detail: format!(
                    "node {} cannot take a replica (a witness, draining, or nearly full)",
                    target.name
                ),
            });
        }
        Ok(())
    }

    /// Up to `count` storage nodes to take new replicas of a volume whose replicas are on
    /// `holding`: up, not draining, removed or nearly full, holding none. Each pick shares the
    /// fewest failure-domain labels (same key, same value: `zone`, `rack`, `host`, ...) with
    /// the replicas already placed; among those, it is the node least provisioned
    /// ([`Self::provisioned_fraction`]), then the lowest id. So the volumes a drain copies or
    /// moves, proposed one after the other, spread over the nodes in proportion to their
    /// capacity instead of all landing on one.
    pub fn choose_replica_nodes(&self, holding: &[NodeId], count: usize) -> Vec<NodeId> {
        let mut candidates: Vec<&NodeRecord> = self.replica_candidates(holding).collect();
        if candidates.is_empty() {
            return Vec::new();
        }
        let provisioned = self.provisioned_bytes();
        let mut placed: Vec<&NodeRecord> = holding
            .iter()
            .filter_map(|node| self.nodes.get(node))
            .collect();
        let mut chosen = Vec::new();
        while chosen.len() < count {
            let shared_labels = |candidate: &NodeRecord| -> usize {
                placed
                    .iter()
                    .map(|other| {
                        candidate
                            .labels
                            .iter()
                            .filter(|(key, value)| other.labels.get(*key) == Some(*value))
                            .count()
                    })
                    .sum()
            };
            let Some(best) = candidates
                .iter()
                .enumerate()
                .min_by_key(|(_, node)| {
                    let provisioned = provisioned.get(&node.id).copied().unwrap_or(0);
                    (
                        shared_labels(node),
                        Self::provisioned_fraction(node, provisioned),
                        node.id,
                    )
                })
                .map(|(index, _)| index)
            else {
                break;
            };
            let node = candidates.remove(best);
            chosen.push(node.id);
            placed.push(node);
        }
        chosen
    }

    /// Why `node` cannot take a new replica of a volume whose replicas are on `holding`, if
    /// it cannot: the rules of [`Self::choose_replica_nodes`], for a node the user names.
    pub fn replica_target_refusal(&self, holding: &[NodeId], node: NodeId) -> Option<String> {
        let Some(record) = self.nodes.get(&node).filter(|record| !record.removed) else {
            return Some(format!("node {node} is not a member"));
        };
        let name = &record.name;
        if record.role != crate::records::NodeRole::Storage {
            Some(format!("node {name} is a witness: it holds no data"))
        } else if holding.contains(&node) {
            Some(format!("node {name} holds a replica already"))
        } else if record.state != NodeState::Up {
            Some(format!("node {name} is not up"))
        } else if record.draining {
            Some(format!("node {name} is draining"))
        } else if self.nearfull.contains(&node) {
            Some(format!("node {name} is nearly full"))
        } else {
            None
        }
    }

    /// The nodes [`Self::choose_replica_nodes`] picks from, in no order: storage nodes up,
    /// not draining, removed or nearly full, holding none of `holding`.
    fn replica_candidates<'a>(
        &'a self,
        holding: &'a [NodeId],
    ) -> impl Iterator<Item = &'a NodeRecord> + 'a {
        self.nodes.values().filter(move |node| {
            !node.removed
                && !node.draining
                && !self.nearfull.contains(&node.id)
                && node.role == crate::records::NodeRole::Storage
                && node.state == NodeState::Up
                && !holding.contains(&node.id)
        })
    }

    /// The replica a node that is draining (or low on space) hands a volume's primary to:
    /// the lowest in the in-sync set other than `from` whose node is up and neither draining
    /// nor removed, one not nearly full first (`None`: the primary stays until one is).
    pub fn hand_off_target(&self, replication: &Replication, from: NodeId) -> Option<NodeId> {
        (replication.in_sync.iter().copied())
            .filter(|node| *node != from)
            .filter(|node| {
                self.nodes.get(node).is_some_and(|record| {
                    record.state == NodeState::Up && !record.draining && !record.removed
                })
            })
            .min_by_key(|node| (self.nearfull.contains(node), *node))
    }

    /// The ready volumes whose replica on `node` (draining) cannot leave it as things are,
    /// each with why: what the drain waits for, before any copying ([`DrainWait`]). A volume
    /// whose copy or catch-up is under way, or whose R was lowered below its replica count,
    /// is not listed: it is on its way.
    pub fn drain_waits(&self, node: NodeId) -> Vec<(String, Vec<DrainWait>)> {
        self.ready_volumes()
            .filter_map(|entry| {
                let replication = &entry.record.replication;
                if !replication.hosts(node)
                    || replication.replicas.len() > usize::from(replication.factor)
                {
                    return None;
                }
                let mut waits = Vec::new();
                if replication.replicas.len() == 1 {
                    if self.replica_candidates(&[node]).next().is_none() {
                        waits.push(DrainWait::NoCopyTarget);
                    }
                } else {
                    if replication.primary == node
                        && self.hand_off_target(replication, node).is_none()
                    {
                        waits.push(DrainWait::NoHandOffTarget);
                    }
                    let staying: Vec<NodeId> = (replication.replicas.iter().copied())
                        .filter(|replica| *replica != node)
                        .collect();
                    if self.replica_candidates(&staying).next().is_none() {
                        waits.push(DrainWait::NoMoveTarget);
                    }
                }
                (!waits.is_empty()).then(|| (entry.record.name.clone(), waits))
            })
            .collect()
    }

    /// The logical size of every volume (any status: one being deleted still holds its
    /// blocks) with a replica on each node, summed per node.
    pub fn provisioned_bytes(&self) -> BTreeMap<NodeId, u64> {
        let mut provisioned = BTreeMap::new();
        for entry in self.volumes.values() {
            for node in &entry.record.replication.replicas {
                let bytes: &mut u64 = provisioned.entry(*node).or_default();
                *bytes = bytes.saturating_add(entry.record.size_bytes);
            }
        }
        provisioned
    }

    /// `provisioned` bytes as a fraction of the node's capacity (its data directories' sizes
    /// when it joined), in millionths; volumes are thin, so it may exceed a million. A node
    /// that recorded no capacity counts as one of 1 GiB.
    fn provisioned_fraction(node: &NodeRecord, provisioned: u64) -> u64 {
        const UNKNOWN_CAPACITY: u64 = 1 << 30;
        let capacity: u64 = node
            .devices
            .iter()
            .map(|device| device.capacity_bytes)
            .fold(0, u64::saturating_add);
        let capacity = if capacity == 0 {
            UNKNOWN_CAPACITY
        } else {
            capacity
        };
        let fraction = u128::from(provisioned) * 1_000_000 / u128::from(capacity);
        u64::try_from(fraction).unwrap_or(u64::MAX)
    }

    /// Replicas must be distinct live storage nodes; the first is the primary.
    fn check_placement(
        &self,
        volume: &str,
        replicas: &[NodeId],
    ) -> Result<Replication, CatalogError> {
        let invalid = |detail: String| CatalogError::Invalid {
            subject: volume.to_string(),
            detail,
        };
        let Some(&primary) = replicas.first() else {
            return Err(invalid("a volume needs at least one replica".to_string()));
        };
        for (index, &node) in replicas.iter().enumerate() {
            if replicas[..index].contains(&node) {
                return Err(invalid(format!("node {node} is named twice as a replica")));
            }
            let record = self.live_node(node)?;
            if record.role != crate::records::NodeRole::Storage {
                return Err(invalid(format!(
                    "node {} is a {} and holds no data",
                    record.name,
                    record.role.name()
                )));
            }
        }
        let factor = u8::try_from(replicas.len())
            .map_err(|_| invalid(format!("{} replicas is too many", replicas.len())))?;
        Ok(Replication {
            factor,
            in_sync_min: records::default_in_sync_min(factor),
            replicas: replicas.to_vec(),
            epoch: 1,
            primary,
            in_sync: replicas.to_vec(),
        })
    }

    fn plan_clone(
        &self,
        parent: &str,
        snapshot: &str,
        name: &str,
        uuid: [u8; 16],
        created_unix_seconds: u64,
    ) -> Result<Plan, CatalogError> {
        validate_name("volume", name)?;
        if self.volume_name_taken(name) {
            return Err(CatalogError::VolumeExists {
                name: name.to_string(),
            });
        }
        let parent_entry = self.volume(parent).ok_or_else(|| not_found(parent))?;
        let source = parent_entry
            .snapshot_by_name(snapshot)
            .ok_or_else(|| snapshot_not_found(parent, snapshot))?;
        if source.view.len() >= CLONE_DEPTH_MAX {
            return Err(CatalogError::Invalid {
                subject: name.to_string(),
                detail: format!("clone chains are limited to {CLONE_DEPTH_MAX} levels"),
            });
        }
        let settings = VolumeSettings {
            name: name.to_string(),
            size_bytes: source.size_bytes,
            compression: parent_entry.record.compression.clone(),
            iops_max: parent_entry.record.iops_max,
            bandwidth_max_mib_per_second: parent_entry.record.bandwidth_max_mib_per_second,
        };
        let id = self.next_volume_id;
        let mut view = vec![Layer::new(id, 1)];
        view.extend(source.view.iter().cloned());
        // Each replica of the clone reads the parent's snapshot on its own node: only those
        // whose copy of it is complete start in sync (the others are caught up by the
        // clone's primary, which must be one of the former).
        let mut replication = parent_entry.record.replication.clone();
        replication.epoch = 1;
        replication.in_sync.retain(|node| source.complete_on(*node));
        if !replication.in_sync.contains(&replication.primary) {
            match replication.in_sync.first() {
                Some(&node) => replication.primary = node,
                None => {
                    return Err(CatalogError::Invalid {
                        subject: name.to_string(),
                        detail: format!(
                            "snapshot {snapshot:?} of volume {parent:?} is incomplete on every \
                             in-sync replica"
                        ),
                    })
                }
            }
        }
        let mut record =
            Self::new_volume_record(id, &settings, uuid, created_unix_seconds, replication);
        record.view = view;
        record.origin = Some(Origin {
            volume_id: parent_entry.record.id,
            snapshot_generation: source.generation,
        });
        Ok(Plan::new(Outcome::Volume(id))
            .change(Change::PutNextVolumeId(id + 1))
            .change(Change::PutVolume(record))
            .event(Event::VolumeChanged { volume_id: id }))
    }

    fn plan_resize(
        &self,
        name: &str,
        size_bytes: u64,
        allow_shrink: bool,
    ) -> Result<Plan, CatalogError> {
        validate_size(name, size_bytes)?;
        let entry = self.volume(name).ok_or_else(|| not_found(name))?;
        let mut record = entry.record.clone();
        let shrinking = size_bytes < record.size_bytes;
        if shrinking && !allow_shrink {
            return Err(CatalogError::Invalid {
                subject: name.to_string(),
                detail: format!(
                    "shrinking from {} to {size_bytes} bytes discards data; ask for it explicitly",
                    record.size_bytes
                ),
            });
        }
        if shrinking {
            // Hide every block past the new end as of now, then move on to a fresh generation
            // so writes after a later grow are seen again.
            let current = record.generation;
            let next = record.generation_next;
            let top = &mut record.view[0];
            top.truncations.push(Truncation {
                block_from: size_bytes / crate::BLOCK_SIZE_BYTES,
                generation_upto: current,
            });
            top.generation_max = next;
            record.generation = next;
            record.generation_next = next + 1;
        }
        record.size_bytes = size_bytes;
        let volume_id = record.id;
        let mut plan = Plan::new(Outcome::Done)
            .change(Change::PutVolume(record))
            .event(Event::VolumeChanged { volume_id });
        if shrinking {
            plan = plan.event(Event::VolumeGarbage { volume_id });
        }
        Ok(plan)
    }

    fn plan_snapshot_create(
        &self,
        volume: &str,
        snapshot: &str,
        guid: [u8; 16],
        created_unix_seconds: u64,
    ) -> Result<Plan, CatalogError> {
        validate_name("snapshot", snapshot)?;
        let entry = self.volume(volume).ok_or_else(|| not_found(volume))?;
        if entry.snapshot_by_name(snapshot).is_some() {
            return Err(CatalogError::SnapshotExists {
                volume: volume.to_string(),
                snapshot: snapshot.to_string(),
            });
        }
        if entry.snapshots.len() >= SNAPSHOTS_PER_VOLUME_MAX {
            return Err(CatalogError::Invalid {
                subject: volume.to_string(),
                detail: format!("it already has {SNAPSHOTS_PER_VOLUME_MAX} snapshots"),
            });
        }
        let mut record = entry.record.clone();
        let replication = &record.replication;
        let frozen = SnapshotRecord {
            format: SNAPSHOT_RECORD_FORMAT,
            volume_id: record.id,
            name: snapshot.to_string(),
            guid,
            generation: record.generation,
            size_bytes: record.size_bytes,
            view: record.view.clone(),
            created_unix_seconds,
            incomplete_on: replication
                .replicas
                .iter()
                .copied()
                .filter(|node| !replication.in_sync.contains(node))
                .collect(),
            repairs: Vec::new(),
        };
        let next = record.generation_next;
        record.generation = next;
        record.generation_next = next + 1;
        record.view[0].generation_max = next;
        let volume_id = record.id;
        Ok(Plan::new(Outcome::Snapshot {
            volume_id,
            generation: frozen.generation,
        })
        .change(Change::PutSnapshot(frozen))
        .change(Change::PutVolume(record))
        .event(Event::VolumeChanged { volume_id }))
    }

    /// The snapshot at `generation` of volume `volume_id`, with its volume's record.
    fn snapshot_at(
        &self,
        volume_id: u64,
        generation: u64,
    ) -> Result<(&VolumeRecord, &SnapshotRecord), CatalogError> {
        let entry = self
            .volumes
            .get(&volume_id)
            .ok_or_else(|| CatalogError::Invalid {
                subject: format!("volume id {volume_id}"),
                detail: "no such volume".to_string(),
            })?;
        let snapshot =
            entry
                .snapshots
                .get(&generation)
                .ok_or_else(|| CatalogError::SnapshotNotFound {
                    volume: entry.record.name.clone(),
                    snapshot: format!("(generation {generation})"),
                })?;
        Ok((&entry.record, snapshot))
    }

    fn plan_repair_begin(
        &self,
        volume_id: u64,
        snapshot_generation: u64,
        node: NodeId,
    ) -> Result<Plan, CatalogError> {
        let (record, snapshot) = self.snapshot_at(volume_id, snapshot_generation)?;
        let reserved = |generation| Outcome::Reserved {
            volume_id,
            generation,
            base_generation: snapshot_generation,
        };
        if let Some(generation) = snapshot.repair_of(node) {
            return Ok(Plan::new(reserved(generation)));
        }
        let invalid = |detail: String| CatalogError::Invalid {
            subject: format!("snapshot {:?} of volume {:?}", snapshot.name, record.name),
            detail,
        };
        if !record.replication.hosts(node) {
            return Err(invalid(format!("node {node} holds no replica")));
        }
        if snapshot.complete_on(node) {
            return Err(invalid(format!("node {node}'s copy is complete")));
        }
        if record.status != VolumeStatus::Ready {
            return Err(invalid("the volume is not ready".to_string()));
        }
        let mut record = record.clone();
        let generation = record.generation_next;
        record.generation_next += 1;
        record.view[0].exclude(generation, generation);
        let mut snapshot = snapshot.clone();
        snapshot
            .repairs
            .push(records::SnapshotRepair { node, generation });
        Ok(Plan::new(reserved(generation))
            .change(Change::PutSnapshot(snapshot))
            .change(Change::PutVolume(record))
            .event(Event::VolumeChanged { volume_id }))
    }

    fn plan_repair_end(
        &self,
        volume_id: u64,
        snapshot_generation: u64,
        node: NodeId,
        generation: u64,
    ) -> Result<Plan, CatalogError> {
        let (record, snapshot) = self.snapshot_at(volume_id, snapshot_generation)?;
        if snapshot.repair_of(node) != Some(generation) {
            return Err(CatalogError::Invalid {
                subject: format!("snapshot {:?} of volume {:?}", snapshot.name, record.name),
                detail: format!("no repair of node {node}'s copy into generation {generation}"),
            });
        }
        let mut snapshot = snapshot.clone();
        snapshot.view = snapshot.repair_view(generation);
        snapshot.repairs.retain(|repair| repair.node != node);
        snapshot
            .incomplete_on
            .retain(|incomplete| *incomplete != node);
        Ok(Plan::new(Outcome::Done)
            .change(Change::PutSnapshot(snapshot))
            .event(Event::VolumeChanged { volume_id }))
    }

    fn plan_receive_reserve(
        &self,
        volume: &str,
        base_guid: &[u8; 16],
        target_name: &str,
        target_guid: &[u8; 16],
    ) -> Result<Plan, CatalogError> {
        validate_name("snapshot", target_name)?;
        let base_missing = || CatalogError::BaseMissing {
            volume: volume.to_string(),
            base_guid: hex(base_guid),
        };
        let entry = self.volume(volume).ok_or_else(base_missing)?;
        let base = entry.snapshot_by_guid(base_guid).ok_or_else(base_missing)?;
        if let Some(existing) = entry
            .snapshots
            .values()
            .find(|snapshot| snapshot.name == target_name || snapshot.guid == *target_guid)
        {
            return Err(CatalogError::SnapshotExists {
                volume: volume.to_string(),
                snapshot: existing.name.clone(),
            });
        }
        if entry.record.receiving_generation.is_some() {
            return Err(CatalogError::VolumeInUse {
                volume: volume.to_string(),
                detail: "another stream is being received into it".to_string(),
            });
        }
        let mut record = entry.record.clone();
        let generation = record.generation_next;
        record.generation_next += 1;
        record.view[0].exclude(generation, generation);
        record.receiving_generation = Some(generation);
        let volume_id = record.id;
        Ok(Plan::new(Outcome::Reserved {
            volume_id,
            generation,
            base_generation: base.generation,
        })
        .change(Change::PutVolume(record))
        .event(Event::VolumeChanged { volume_id }))
    }

    #[allow(clippy::too_many_arguments)]
    fn plan_receive_publish(
        &self,
        volume_id: u64,
        generation: u64,
        base_generation: Option<u64>,
        target_name: &str,
        target_guid: [u8; 16],
        size_bytes: u64,
        created_unix_seconds: u64,
    ) -> Result<Plan, CatalogError> {
        let entry = self
            .volumes
            .get(&volume_id)
            .ok_or_else(|| CatalogError::Invalid {
                subject: format!("volume id {volume_id}"),
                detail: "the volume being received into is gone".to_string(),
            })?;
        let name = entry.record.name.clone();
        validate_size(&name, size_bytes)?;
        let expected_status = if base_generation.is_some() {
            entry.record.status == VolumeStatus::Ready
                && entry.record.receiving_generation == Some(generation)
        } else {
            entry.record.status == VolumeStatus::Receiving && generation == 1
        };
        if !expected_status {
            return Err(CatalogError::Invalid {
                subject: name,
                detail: "the receive was abandoned before it could be published".to_string(),
            });
        }
        if entry
            .snapshots
            .values()
            .any(|snapshot| snapshot.name == target_name || snapshot.guid == target_guid)
        {
            return Err(CatalogError::SnapshotExists {
                volume: name,
                snapshot: target_name.to_string(),
            });
        }
        let size_blocks = size_bytes / crate::BLOCK_SIZE_BYTES;
        let mut frozen_view =
            match base_generation {
                None => vec![Layer::new(volume_id, generation)],
                Some(base_generation) => {
                    let base = entry.snapshots.get(&base_generation).ok_or_else(|| {
                        CatalogError::Invalid {
                            subject: name.clone(),
                            detail: "the receive's base snapshot was deleted".to_string(),
                        }
                    })?;
                    let mut view = base.view.clone();
                    view[0].include(generation);
                    if size_blocks < base.size_bytes / crate::BLOCK_SIZE_BYTES {
                        view[0].truncations.push(Truncation {
                            block_from: size_blocks,
                            generation_upto: generation - 1,
                        });
                    }
                    view
                }
            };
        frozen_view[0].volume_id = volume_id;
        let snapshot = SnapshotRecord {
            format: SNAPSHOT_RECORD_FORMAT,
            volume_id,
            name: target_name.to_string(),
            guid: target_guid,
            generation,
            size_bytes,
            view: frozen_view,
            created_unix_seconds,
            // The stream's blocks are on the node that received them, the primary (the
            // replication layer receives into a replicated volume only there): the other
            // replicas are caught up with the current contents only.
            incomplete_on: entry
                .record
                .replication
                .replicas
                .iter()
                .copied()
                .filter(|node| *node != entry.record.replication.primary)
                .collect(),
            repairs: Vec::new(),
        };
        let mut record = entry.record.clone();
        rebase_onto(&mut record, &snapshot.view, snapshot.size_bytes);
        record.status = VolumeStatus::Ready;
        record.receiving_generation = None;
        Ok(Plan::new(Outcome::Snapshot {
            volume_id,
            generation,
        })
        .change(Change::PutSnapshot(snapshot))
        .change(Change::PutVolume(record))
        .event(Event::VolumeChanged { volume_id }))
    }
}

/// A store key and its value.
type KeyValue = (Vec<u8>, Vec<u8>);

/// Every (key, value) under `meta_key(prefix)`.
fn scan_prefix(store: &Store, prefix: &[u8]) -> Result<Vec<KeyValue>, CatalogError> {
    let (mut cursor, end) = records::prefix_range(prefix);
    let mut out = Vec::new();
    loop {
        let page = store
            .scan(&cursor, &end, SCAN_PAGE_RECORDS)
            .map_err(|source| CatalogError::Store {
                operation: "reading catalog records".to_string(),
                detail: source.to_string(),
            })?;
        let full = page.len() == SCAN_PAGE_RECORDS;
        if let Some((last, _)) = page.last() {
            cursor = last.clone();
            cursor.push(0);
        }
        out.extend(page);
        if !full {
            return Ok(out);
        }
    }
}
