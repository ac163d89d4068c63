//! The one command type that changes the catalog, and what applying one returns.
//!
//! A command carries everything that must be the same on every node — names, sizes, and the
//! random or time-based values (UUIDs, GUIDs, creation times), chosen once by the node that
//! proposes it — so applying it is deterministic: every node's state machine turns the same log
//! into the same records ([`crate::CatalogState::plan`]).
//!
//! Commands are serialized into the Raft log (postcard): add variants at the end only, and never
//! change an existing variant's fields; a new shape is a new variant.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::records::{DeviceRecord, KeyRecord, NodeAddresses, NodeRole, NodeState, VolumeStatus};
use crate::NodeId;

/// A new node as it asks to join (or as the first node bootstraps).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSpec {
    pub name: String,
    /// Random, made once per data directory: recognises a join retried after a crash, and a
    /// wiped node coming back under an old name.
    pub instance: [u8; 16],
    pub role: NodeRole,
    pub addresses: NodeAddresses,
    pub labels: BTreeMap<String, String>,
    pub devices: Vec<DeviceRecord>,
}

/// A new volume's settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeSettings {
    pub name: String,
    /// A positive multiple of [`crate::BLOCK_SIZE_BYTES`].
    pub size_bytes: u64,
    /// `keel_store::Compression::name()`.
    pub compression: String,
    pub iops_max: Option<u64>,
    pub bandwidth_max_mib_per_second: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    // ---- cluster ----
    /// Creates the cluster record and its first node (id 1). Refused once a cluster exists.
    Bootstrap {
        cluster_id: [u8; 16],
        created_unix_ms: i64,
        node: NodeSpec,
    },
    /// Adds a node under a fresh id (returned as [`Outcome::Node`]).
    NodeAdd {
        node: NodeSpec,
        joined_unix_ms: i64,
    },
    /// A member's addresses, labels or devices changed (it restarted with new settings).
    NodeUpdate {
        id: NodeId,
        addresses: NodeAddresses,
        labels: BTreeMap<String, String>,
        devices: Vec<DeviceRecord>,
    },
    /// The failure detector's verdict.
    NodeSetState {
        id: NodeId,
        state: NodeState,
        at_unix_ms: i64,
    },
    NodeSetDraining {
        id: NodeId,
        draining: bool,
    },
    /// Marks a node removed (its record stays so its id is never reused). Refused while it
    /// hosts a volume replica.
    NodeRemove {
        id: NodeId,
    },

    // ---- volumes ----
    VolumeCreate {
        settings: VolumeSettings,
        uuid: [u8; 16],
        created_unix_seconds: u64,
        /// Nodes that hold the replicas; the first is the primary.
        replicas: Vec<NodeId>,
        /// `Ready`, or `Receiving` for the target of a full send stream.
        status: VolumeStatus,
    },
    /// A writable clone of `parent@snapshot`, placed with its parent (it reads through the
    /// parent's blocks).
    VolumeClone {
        parent: String,
        snapshot: String,
        name: String,
        uuid: [u8; 16],
        created_unix_seconds: u64,
    },
    /// Marks a ready volume `Deleting`; its hosts erase its blocks and then send
    /// [`Command::VolumeForget`].
    VolumeDelete {
        name: String,
    },
    /// Removes the records of a `Deleting` volume once its blocks are gone.
    VolumeForget {
        volume_id: u64,
    },
    VolumeResize {
        name: String,
        size_bytes: u64,
        allow_shrink: bool,
    },
    VolumeSetLimits {
        name: String,
        iops_max: Option<u64>,
        bandwidth_max_mib_per_second: Option<u64>,
    },
    SnapshotCreate {
        volume: String,
        snapshot: String,
        guid: [u8; 16],
        created_unix_seconds: u64,
    },
    SnapshotDelete {
        volume: String,
        snapshot: String,
    },
    VolumeRollback {
        volume: String,
        snapshot: String,
    },
    /// Reserves a generation of `volume` for an incremental stream based on the snapshot with
    /// `base_guid` ([`Outcome::Reserved`]).
    ReceiveReserve {
        volume: String,
        base_guid: [u8; 16],
        target_name: String,
        target_guid: [u8; 16],
    },
    /// Publishes a fully received stream as snapshot `target_name` and points the volume at it.
    ReceivePublish {
        volume_id: u64,
        generation: u64,
        /// The base snapshot's generation for an incremental stream.
        base_generation: Option<u64>,
        target_name: String,
        target_guid: [u8; 16],
        size_bytes: u64,
        created_unix_seconds: u64,
    },
    /// Gives up a receive: a full stream's hidden volume becomes `Deleting`; an incremental
    /// stream's reserved generation is released (it stays excluded from every view).
    ReceiveAbandon {
        volume_id: u64,
        generation: u64,
    },

    // ---- S3 access keys and buckets ----
    KeyAdd {
        record: KeyRecord,
    },
    KeyDelete {
        access_key_id: String,
    },
    BucketCreate {
        name: String,
        owner: String,
        compression_code: u8,
        created_unix_ms: i64,
    },
    BucketDelete {
        name: String,
    },
    /// Grants (`allow`) or revokes an access key's full access to a bucket.
    BucketGrant {
        bucket: String,
        access_key_id: String,
        allow: bool,
    },
    BucketSetCompression {
        bucket: String,
        compression_code: u8,
    },

    // ---- replication (appended: the log encodes variants by position) ----
    /// Records a replicated volume's new primary and in-sync set, in epoch `epoch + 1`; refused
    /// unless the volume is still in `epoch` (a compare-and-set: two nodes racing to change
    /// the same epoch cannot both win). The primary must be in the set, the set among the
    /// replicas, and a new primary must come from the old in-sync set.
    VolumeSetReplication {
        volume_id: u64,
        epoch: u64,
        primary: NodeId,
        in_sync: Vec<NodeId>,
    },
    /// Moves a replica of a volume from node `from` (down for too long, draining or removed)
    /// to node `to`, which starts out of sync and is caught up by the primary; epoch + 1,
    /// refused unless the volume is still in `epoch`. The primary cannot be moved this way.
    VolumeMoveReplica {
        volume_id: u64,
        epoch: u64,
        from: NodeId,
        to: NodeId,
    },
    /// Changes a volume's replica set (and so R) and its in-sync minimum, in epoch `epoch + 1`;
    /// refused unless the volume is still in `epoch`. The primary keeps its replica; added
    /// nodes start out of sync and are caught up by the primary; removed ones leave the
    /// in-sync set and erase their copy.
    VolumeSetReplicas {
        volume_id: u64,
        epoch: u64,
        replicas: Vec<NodeId>,
        in_sync_min: u8,
    },

    // ---- bucket settings (appended) ----
    /// Replaces a bucket's tags (empty: none).
    BucketSetTags {
        bucket: String,
        tags: Vec<(String, String)>,
    },
    /// Replaces a bucket's CORS rules (empty: none).
    BucketSetCors {
        bucket: String,
        rules: Vec<crate::records::CorsRule>,
    },
    /// Sets a bucket's canned ACL: `public-read` (true) or `private`.
    BucketSetPublicRead {
        bucket: String,
        public_read: bool,
    },
    /// Replaces a bucket's lifecycle rules (empty: none).
    BucketSetLifecycle {
        bucket: String,
        rules: Vec<crate::records::LifecycleRule>,
    },
    /// Enables (true) or suspends a bucket's versioning; refused for a bucket with object lock.
    BucketSetVersioning {
        bucket: String,
        enabled: bool,
    },
    /// Enables object lock on a bucket whose versioning is enabled, or replaces its default
    /// retention.
    BucketSetObjectLock {
        bucket: String,
        lock: crate::records::ObjectLock,
    },
    /// Replaces a bucket's policy (`None`: removes it).
    BucketSetPolicy {
        bucket: String,
        policy: Option<String>,
    },
    /// Creates a bucket with versioning and object lock enabled, in one step.
    BucketCreateLocked {
        name: String,
        owner: String,
        compression_code: u8,
        created_unix_ms: i64,
    },

    // ---- snapshot repair (appended) ----
    /// Starts copying the snapshot at `snapshot_generation` to `node`, whose copy of it is
    /// incomplete: reserves a generation of the volume for the blocks that differ
    /// ([`Outcome::Reserved`], its `base_generation` the snapshot's), excluded from every
    /// view until [`Command::SnapshotRepairEnd`]. A repair already under way for `node` answers
    /// its generation again, so an interrupted repair resumes.
    SnapshotRepairBegin {
        volume_id: u64,
        snapshot_generation: u64,
        node: NodeId,
    },
    /// `node` holds every block of the snapshot that differed, durably, in `generation`: it
    /// joins the snapshot's view and the copy on `node` is complete.
    SnapshotRepairEnd {
        volume_id: u64,
        snapshot_generation: u64,
        node: NodeId,
        generation: u64,
    },

    // ---- drains (appended) ----
    /// Copies a volume's replica off a draining node before that copy goes: node `to` joins
    /// its replicas out of sync while R stays, in epoch `epoch + 1` (refused unless the
    /// volume is still in `epoch`, has R replicas, one of them on a draining node). The
    /// primary catches `to` up; then (R=1: after handing `to` the volume with
    /// `VolumeSetReplication`) the primary removes the draining node's copy
    /// (`VolumeSetReplicas`, which makes R what its replicas are again), so the volume never
    /// has fewer copies in sync than before the drain.
    VolumeCopyOffDraining {
        volume_id: u64,
        epoch: u64,
        to: NodeId,
    },

    // ---- space (appended) ----
    /// A storage node's own report that its data directories are over its nearfull threshold
    /// (`nearfull`), or back under it: placement gives a nearly full node no new replica, and
    /// a move, copy or new replica onto it is refused, while it is.
    NodeSetNearfull {
        id: NodeId,
        nearfull: bool,
    },
}

impl Command {
    /// A short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Command::Bootstrap { .. } => "bootstrap",
            Command::NodeAdd { .. } => "node-add",
            Command::NodeUpdate { .. } => "node-update",
            Command::NodeSetState { .. } => "node-set-state",
            Command::NodeSetDraining { .. } => "node-set-draining",
            Command::NodeRemove { .. } => "node-remove",
            Command::VolumeCreate { .. } => "volume-create",
            Command::VolumeSetReplication { .. } => "volume-set-replication",
            Command::VolumeMoveReplica { .. } => "volume-move-replica",
            Command::VolumeSetReplicas { .. } => "volume-set-replicas",
            Command::VolumeCopyOffDraining { .. } => "volume-copy-off-draining",
            Command::NodeSetNearfull { .. } => "node-set-nearfull",
            Command::VolumeClone { .. } => "volume-clone",
            Command::VolumeDelete { .. } => "volume-delete",
            Command::VolumeForget { .. } => "volume-forget",
            Command::VolumeResize { .. } => "volume-resize",
            Command::VolumeSetLimits { .. } => "volume-set-limits",
            Command::SnapshotCreate { .. } => "snapshot-create",
            Command::SnapshotDelete { .. } => "snapshot-delete",
            Command::VolumeRollback { .. } => "volume-rollback",
            Command::ReceiveReserve { .. } => "receive-reserve",
            Command::ReceivePublish { .. } => "receive-publish",
            Command::ReceiveAbandon { .. } => "receive-abandon",
            Command::KeyAdd { .. } => "key-add",
            Command::KeyDelete { .. } => "key-delete",
            Command::BucketCreate { .. } => "bucket-create",
            Command::BucketDelete { .. } => "bucket-delete",
            Command::BucketGrant { .. } => "bucket-grant",
            Command::BucketSetCompression { .. } => "bucket-set-compression",
            Command::BucketSetTags { .. } => "bucket-set-tags",
            Command::BucketSetCors { .. } => "bucket-set-cors",
            Command::BucketSetPublicRead { .. } => "bucket-set-public-read",
            Command::BucketSetLifecycle { .. } => "bucket-set-lifecycle",
            Command::BucketSetVersioning { .. } => "bucket-set-versioning",
            Command::BucketSetObjectLock { .. } => "bucket-set-object-lock",
            Command::BucketCreateLocked { .. } => "bucket-create-locked",
            Command::BucketSetPolicy { .. } => "bucket-set-policy",
            Command::SnapshotRepairBegin { .. } => "snapshot-repair-begin",
            Command::SnapshotRepairEnd { .. } => "snapshot-repair-end",
        }
    }
}

/// What an applied command produced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    Done,
    /// The id a node got.
    Node(NodeId),
    /// The id a volume got.
    Volume(u64),
    /// A snapshot's generation.
    Snapshot {
        volume_id: u64,
        generation: u64,
    },
    /// Where an incremental receive (or a snapshot repair) writes, and the snapshot it builds
    /// on (repairs).
    Reserved {
        volume_id: u64,
        generation: u64,
        base_generation: u64,
    },
}

/// What changed, for the layers that keep local state in step with the catalog (the volume
/// engine, the object layer). Delivered in apply order, after the change is durable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A volume's record or snapshots changed (created, resized, snapshotted, ...).
    VolumeChanged {
        volume_id: u64,
    },
    /// A volume became `Deleting`: its hosts erase its blocks.
    VolumeDeleting {
        volume_id: u64,
    },
    /// A volume's records are gone.
    VolumeForgotten {
        volume_id: u64,
    },
    /// Extents of a volume may have become garbage (snapshot deleted, rollback, shrink,
    /// abandoned receive): its hosts collect.
    VolumeGarbage {
        volume_id: u64,
    },
    NodeChanged {
        node: NodeId,
    },
    BucketChanged {
        name: String,
    },
    KeysChanged,
    /// A Raft snapshot replaced the whole catalog.
    Restored,
}

impl std::fmt::Display for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.kind())
    }
}
