//! The catalog's records and where they live in the store's `Meta` keyspace.
//!
//! | key (after the `Meta` keyspace byte)         | value                                   |
//! | -------------------------------------------- | --------------------------------------- |
//! | `c/cluster`                                  | [`ClusterRecord`]                       |
//! | `c/node/<node id, 16 hex>`                   | [`NodeRecord`]                          |
//! | `c/nearfull/<node id, 16 hex>`               | node id (version byte + postcard): the node is nearly full |
//! | `v/next-volume-id`                           | u64 (postcard): the next volume id      |
//! | `v/vol/<volume id, 16 hex>`                  | [`VolumeRecord`]                        |
//! | `v/snap/<volume id, 16 hex>/<gen, 16 hex>`   | [`SnapshotRecord`]                      |
//! | `s3/key/<access key id>`                     | [`KeyRecord`] (version byte + postcard) |
//! | `s3/bucket/<bucket>`                         | [`BucketRecord`] (version byte + ...)   |
//! | `s3/bucket-settings/<bucket>`                | [`BucketSettings`] (version byte + ...) |
//!
//! The `v/` and `s3/` layouts are the ones single-node Keel wrote before the cluster existed, so
//! an existing data directory becomes a one-node cluster without a migration step; volume
//! records of format 1 (before replication state existed) decode into format 2 with the volume
//! placed on the local node ([`decode_volume`]).
//!
//! Every record is written only by [`crate::CatalogState::apply`]: one command, one atomic store
//! write, the same on every node.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::view::Layer;
use crate::{CatalogError, NodeId};

/// Version of the volume and snapshot record encodings (their first field).
pub const VOLUME_RECORD_FORMAT: u8 = 2;
/// Volume records written before the cluster existed: no replication state.
pub const VOLUME_RECORD_FORMAT_SINGLE_NODE: u8 = 1;
/// Format byte in front of S3 key and bucket records (and the cluster and node records).
pub const RECORD_VERSION: u8 = 1;

pub const CLUSTER_SUFFIX: &[u8] = b"c/cluster";
pub const NODE_PREFIX: &[u8] = b"c/node/";
/// Nodes over their nearfull threshold (`CatalogState::nearfull`): one record each, none once
/// back under it.
pub const NEARFULL_PREFIX: &[u8] = b"c/nearfull/";
/// Format byte in front of the nearly full nodes at the end of a catalog snapshot.
pub const NEARFULL_FORMAT: u8 = 1;
pub const NEXT_VOLUME_ID_SUFFIX: &[u8] = b"v/next-volume-id";
pub const VOLUME_PREFIX: &[u8] = b"v/vol/";
pub const SNAPSHOT_PREFIX: &[u8] = b"v/snap/";
pub const KEY_PREFIX: &[u8] = b"s3/key/";
pub const BUCKET_PREFIX: &[u8] = b"s3/bucket/";
pub const BUCKET_SETTINGS_PREFIX: &[u8] = b"s3/bucket-settings/";

/// Every prefix the catalog owns: installing a Raft snapshot replaces exactly the records under
/// these (and nothing else of the store).
pub const CATALOG_PREFIXES: [&[u8]; 5] = [
    b"c/",
    b"v/",
    KEY_PREFIX,
    BUCKET_PREFIX,
    BUCKET_SETTINGS_PREFIX,
];

// ---- cluster and nodes ----

/// The cluster itself: its identity and the counters that make ids unique forever.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterRecord {
    /// Random, fixed at bootstrap; every node-to-node connection checks it.
    pub cluster_id: [u8; 16],
    pub created_unix_ms: i64,
    /// The next node id to hand out. Node ids are never reused: a node that starts over with an
    /// empty log under a used id could vote twice in one term (openraft's node-id rule).
    pub next_node_id: NodeId,
}

/// What a node does for the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeRole {
    /// Holds data (volumes, objects) and may vote.
    Storage,
    /// Holds only the Raft log: a tie-breaking voter for two storage nodes.
    Witness,
}

impl NodeRole {
    pub fn name(self) -> &'static str {
        match self {
            NodeRole::Storage => "storage",
            NodeRole::Witness => "witness",
        }
    }
}

/// Liveness as the cluster agreed on it (decided by the leader's failure detector and recorded
/// through Raft, so every node sees the same state).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeState {
    Up,
    /// Missed heartbeats for longer than the suspect timeout.
    Suspect,
    /// Missed heartbeats for longer than the down timeout.
    Down,
}

impl NodeState {
    pub fn name(self) -> &'static str {
        match self {
            NodeState::Up => "up",
            NodeState::Suspect => "suspect",
            NodeState::Down => "down",
        }
    }
}

/// Where a node listens, per role. Cluster traffic (Raft, replication) and client traffic can be
/// on different networks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAddresses {
    /// Node-to-node RPC (`host:port`).
    pub cluster: String,
    /// Admin API and dashboard.
    pub admin: Option<String>,
    pub s3: Option<String>,
    pub nbd: Option<String>,
}

/// One data directory of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRecord {
    pub path: String,
    pub filesystem: String,
    pub capacity_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: NodeId,
    /// Unique among members that were not removed.
    pub name: String,
    /// Random, made once per data directory (see `NodeSpec::instance`).
    pub instance: [u8; 16],
    pub role: NodeRole,
    pub addresses: NodeAddresses,
    /// Failure-domain labels (`host`, `rack`, `zone`, ...): placement puts replicas in
    /// different domains where labels exist.
    pub labels: BTreeMap<String, String>,
    pub devices: Vec<DeviceRecord>,
    pub state: NodeState,
    pub state_since_unix_ms: i64,
    /// Asked to move its data away; never chosen for new data.
    pub draining: bool,
    /// Removed from the cluster. The record stays so the id is never handed out again.
    pub removed: bool,
    pub joined_unix_ms: i64,
}

// ---- volumes ----

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum VolumeStatus {
    Ready,
    /// Being filled by a full receive; invisible; abandoned (deleted) if the receive dies.
    Receiving,
    /// Being deleted: its hosts erase its blocks, then the record goes.
    Deleting,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    pub volume_id: u64,
    pub snapshot_generation: u64,
}

/// Where a volume's replicas are and who may write them. The replication layer (a later
/// change) keeps `epoch`, `primary` and `in_sync` current through Raft; today every volume has
/// one replica, on the node it was created on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replication {
    /// Replicas wanted (R).
    pub factor: u8,
    /// Writes fail rather than go on with fewer in-sync replicas than this.
    pub in_sync_min: u8,
    /// Nodes holding a replica, distinct.
    pub replicas: Vec<NodeId>,
    /// Bumped whenever the primary or the in-sync set changes; replicas refuse older epochs.
    pub epoch: u64,
    pub primary: NodeId,
    /// Replicas that hold every acknowledged flush; always contains the primary.
    pub in_sync: Vec<NodeId>,
}

/// Replicas a volume keeps at most (R).
pub const REPLICAS_MAX: usize = 3;

/// Replicas a volume holds at most while one of an R=3 volume's moves (`keel volume move`
/// raises R by one until the new replica is in sync, then lowers it removing the old one).
pub const REPLICAS_MOVING_MAX: usize = REPLICAS_MAX + 1;

/// The in-sync minimum a new volume with `factor` replicas gets: R=3 keeps writing with one
/// replica lost, never with two; R=2 keeps writing on one.
pub fn default_in_sync_min(factor: u8) -> u8 {
    if factor >= 3 {
        2
    } else {
        1
    }
}

impl Replication {
    pub fn single(node: NodeId) -> Replication {
        Replication {
            factor: 1,
            in_sync_min: 1,
            replicas: vec![node],
            epoch: 1,
            primary: node,
            in_sync: vec![node],
        }
    }

    pub fn hosts(&self, node: NodeId) -> bool {
        self.replicas.contains(&node)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub format: u8,
    pub id: u64,
    pub uuid: [u8; 16],
    pub name: String,
    pub size_bytes: u64,
    /// `keel_store::Compression::name()`.
    pub compression: String,
    pub iops_max: Option<u64>,
    pub bandwidth_max_mib_per_second: Option<u64>,
    /// Generation new writes go to. Always `view[0].generation_max`.
    pub generation: u64,
    /// Next generation to hand out; every generation is handed out once.
    pub generation_next: u64,
    pub view: Vec<Layer>,
    pub origin: Option<Origin>,
    pub status: VolumeStatus,
    pub created_unix_seconds: u64,
    /// A generation an incremental receive is filling: excluded from every view, and the
    /// garbage collector leaves it alone, until the receive is published or abandoned.
    pub receiving_generation: Option<u64>,
    pub replication: Replication,
}

/// Snapshot records since they list the copies being repaired ([`SnapshotRepair`]). Format 3
/// ends at `incomplete_on` (no repairs); formats 1 and 2 end at `created_unix_seconds` and read
/// as complete everywhere.
pub const SNAPSHOT_RECORD_FORMAT: u8 = 4;
/// The first snapshot record format that names the nodes whose copy is incomplete.
const SNAPSHOT_RECORD_FORMAT_INCOMPLETE: u8 = 3;

/// A snapshot's data being copied to a node whose copy lacks it: the blocks that differ land
/// in `generation`, reserved for it (every other view excludes it; the garbage collector
/// leaves it alone), which joins the snapshot's view once the copy is complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRepair {
    pub node: NodeId,
    pub generation: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub format: u8,
    pub volume_id: u64,
    pub name: String,
    /// Identity that survives send/receive: an incremental stream names its base by this.
    pub guid: [u8; 16],
    pub generation: u64,
    pub size_bytes: u64,
    pub view: Vec<Layer>,
    pub created_unix_seconds: u64,
    /// Replicas whose copy of the snapshot lacks data: out of the in-sync set (catching up,
    /// or down) when it was taken, or placed on their node after it. A resync compares and
    /// copies the volume's current contents only, so on these nodes the snapshot's older
    /// generations may not hold what the primary's did: they neither serve it nor roll back
    /// onto it, until their copy is repaired.
    pub incomplete_on: Vec<NodeId>,
    /// Copies of this snapshot being repaired, one per node of `incomplete_on` at most.
    pub repairs: Vec<SnapshotRepair>,
}

impl SnapshotRecord {
    /// Whether `node`'s copy of the snapshot holds all of its data.
    pub fn complete_on(&self, node: NodeId) -> bool {
        !self.incomplete_on.contains(&node)
    }

    /// The generation reserved for repairing `node`'s copy, if a repair is under way.
    pub fn repair_of(&self, node: NodeId) -> Option<u64> {
        self.repairs
            .iter()
            .find(|repair| repair.node == node)
            .map(|repair| repair.generation)
    }

    /// The view `node`'s copy is compared and repaired through: the snapshot's view, and the
    /// generation reserved for `node`'s repair (no other node holds extents in it).
    pub fn repair_view(&self, generation: u64) -> Vec<Layer> {
        let mut view = self.view.clone();
        view[0].include(generation);
        view
    }
}

/// Postcard encodes a struct as its fields in order, so this is the derived encoding of the
/// fields, then `incomplete_on` and `repairs` (always written, in format
/// [`SNAPSHOT_RECORD_FORMAT`]).
impl Serialize for SnapshotRecord {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let mut tuple = serializer.serialize_tuple(10)?;
        tuple.serialize_element(&SNAPSHOT_RECORD_FORMAT)?;
        tuple.serialize_element(&self.volume_id)?;
        tuple.serialize_element(&self.name)?;
        tuple.serialize_element(&self.guid)?;
        tuple.serialize_element(&self.generation)?;
        tuple.serialize_element(&self.size_bytes)?;
        tuple.serialize_element(&self.view)?;
        tuple.serialize_element(&self.created_unix_seconds)?;
        tuple.serialize_element(&self.incomplete_on)?;
        tuple.serialize_element(&self.repairs)?;
        tuple.end()
    }
}

impl<'de> Deserialize<'de> for SnapshotRecord {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = SnapshotRecord;

            fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
                formatter.write_str("a snapshot record")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<SnapshotRecord, A::Error> {
                fn field<'de, A: serde::de::SeqAccess<'de>, T: Deserialize<'de>>(
                    seq: &mut A,
                    index: usize,
                ) -> Result<T, A::Error> {
                    seq.next_element()?
                        .ok_or_else(|| serde::de::Error::invalid_length(index, &"10 fields"))
                }
                let format: u8 = field(&mut seq, 0)?;
                let volume_id = field(&mut seq, 1)?;
                let name = field(&mut seq, 2)?;
                let guid = field(&mut seq, 3)?;
                let generation = field(&mut seq, 4)?;
                let size_bytes = field(&mut seq, 5)?;
                let view = field(&mut seq, 6)?;
                let created_unix_seconds = field(&mut seq, 7)?;
                let incomplete_on = if format >= SNAPSHOT_RECORD_FORMAT_INCOMPLETE {
                    field(&mut seq, 8)?
                } else {
                    Vec::new()
                };
                let repairs = if format >= SNAPSHOT_RECORD_FORMAT {
                    field(&mut seq, 9)?
                } else {
                    Vec::new()
                };
                Ok(SnapshotRecord {
                    format: SNAPSHOT_RECORD_FORMAT,
                    volume_id,
                    name,
                    guid,
                    generation,
                    size_bytes,
                    view,
                    created_unix_seconds,
                    incomplete_on,
                    repairs,
                })
            }
        }
        deserializer.deserialize_tuple(10, Fields)
    }
}

/// A volume record as single-node Keel wrote it (format 1).
#[derive(Deserialize)]
struct VolumeRecordSingleNode {
    format: u8,
    id: u64,
    uuid: [u8; 16],
    name: String,
    size_bytes: u64,
    compression: String,
    iops_max: Option<u64>,
    bandwidth_max_mib_per_second: Option<u64>,
    generation: u64,
    generation_next: u64,
    view: Vec<Layer>,
    origin: Option<Origin>,
    status: VolumeStatus,
    created_unix_seconds: u64,
}

/// Decodes a volume record of either format; a format-1 record is placed on `local_node` (the
/// only node a single-node data directory ever had).
pub fn decode_volume(
    key: &[u8],
    bytes: &[u8],
    local_node: NodeId,
) -> Result<VolumeRecord, CatalogError> {
    match bytes.first() {
        Some(&VOLUME_RECORD_FORMAT_SINGLE_NODE) => {
            let old: VolumeRecordSingleNode = decode_postcard(key, bytes)?;
            debug_assert_eq!(old.format, VOLUME_RECORD_FORMAT_SINGLE_NODE);
            Ok(VolumeRecord {
                format: VOLUME_RECORD_FORMAT,
                id: old.id,
                uuid: old.uuid,
                name: old.name,
                size_bytes: old.size_bytes,
                compression: old.compression,
                iops_max: old.iops_max,
                bandwidth_max_mib_per_second: old.bandwidth_max_mib_per_second,
                generation: old.generation,
                generation_next: old.generation_next,
                view: old.view,
                origin: old.origin,
                status: old.status,
                created_unix_seconds: old.created_unix_seconds,
                receiving_generation: None,
                replication: Replication::single(local_node),
            })
        }
        _ => decode_postcard(key, bytes),
    }
}

// ---- S3 keys and buckets ----

/// An access key. The secret is stored in clear: SigV4 needs it to recompute signatures.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    pub access_key_id: String,
    pub name: String,
    pub secret_access_key: String,
    pub created_unix_ms: i64,
}

/// A bucket: its owner (the key that created it), the keys it was granted to, and how its chunks
/// are compressed (a `keel_store::Compression` code).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketRecord {
    pub name: String,
    pub owner: String,
    pub grants: Vec<String>,
    pub created_unix_ms: i64,
    pub compression_code: u8,
}

/// A bucket's optional settings, apart from its [`BucketRecord`] (whose encoding predates
/// them): its tags, its CORS rules, whether anyone may read it and its lifecycle rules. No
/// record: none of them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketSettings {
    pub name: String,
    /// Key and value, sorted by key (S3's bucket tagging).
    pub tags: Vec<(String, String)>,
    /// In the order given: the first rule that matches a request applies.
    pub cors: Vec<CorsRule>,
    /// The canned ACL `public-read`: anyone, unsigned, may list the bucket and read its
    /// objects (never write). Otherwise `private`.
    pub public_read: bool,
    /// Applied by the object layer's lifecycle worker.
    pub lifecycle: Vec<LifecycleRule>,
    /// S3 versioning: once enabled, a bucket keeps every version until it is deleted by id.
    pub versioning: Versioning,
    /// S3 object lock, once enabled (never disabled; versioning stays enabled).
    pub object_lock: Option<ObjectLock>,
    /// The bucket policy, as the JSON document given (checked by the S3 frontend before it is
    /// stored).
    pub policy: Option<String>,
}

/// How a locked version is protected until its retention ends (S3's retention modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LockMode {
    /// Callers may shorten the retention or delete the version with
    /// `x-amz-bypass-governance-retention: true`.
    Governance,
    /// Nobody may shorten the retention or delete the version before it ends.
    Compliance,
}

/// A bucket's object lock configuration: the retention new versions get when a write names
/// none (days or years after the write).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectLock {
    pub default_retention: Option<DefaultRetention>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DefaultRetention {
    pub mode: LockMode,
    /// Exactly one of `days` and `years` is set.
    pub days: Option<u32>,
    pub years: Option<u32>,
}

/// A bucket's versioning state. A bucket never returns to `Unversioned` once versioning was
/// set (S3's rule): it is `Enabled` or `Suspended`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Versioning {
    #[default]
    Unversioned,
    /// Every write makes a new version with its own id; deletes add delete markers.
    Enabled,
    /// Writes replace the `null` version; versions made while enabled are kept.
    Suspended,
}

impl BucketSettings {
    pub fn is_empty(&self) -> bool {
        self.tags.is_empty()
            && self.cors.is_empty()
            && !self.public_read
            && self.lifecycle.is_empty()
            && self.versioning == Versioning::Unversioned
            && self.object_lock.is_none()
            && self.policy.is_none()
    }
}

/// Format of bucket settings records (the byte before their postcard) and of the settings map
/// in catalog snapshots. Format 1 had no versioning and no lifecycle rules for versions; it
/// still decodes. (Format 2 also holds object lock and the bucket policy.)
pub const BUCKET_SETTINGS_FORMAT: u8 = 2;
const BUCKET_SETTINGS_FORMAT_V1: u8 = 1;

/// Bucket settings as format 1 wrote them.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct BucketSettingsV1 {
    name: String,
    tags: Vec<(String, String)>,
    cors: Vec<CorsRule>,
    public_read: bool,
    lifecycle: Vec<LifecycleRuleV1>,
}

/// A lifecycle rule as format 1 wrote it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct LifecycleRuleV1 {
    id: Option<String>,
    enabled: bool,
    prefix: String,
    expiration_days: Option<u32>,
    expiration_date_unix_ms: Option<i64>,
    abort_incomplete_upload_days: Option<u32>,
}

impl From<BucketSettingsV1> for BucketSettings {
    fn from(v1: BucketSettingsV1) -> BucketSettings {
        BucketSettings {
            name: v1.name,
            tags: v1.tags,
            cors: v1.cors,
            public_read: v1.public_read,
            lifecycle: v1
                .lifecycle
                .into_iter()
                .map(|rule| LifecycleRule {
                    id: rule.id,
                    enabled: rule.enabled,
                    prefix: rule.prefix,
                    expiration_days: rule.expiration_days,
                    expiration_date_unix_ms: rule.expiration_date_unix_ms,
                    abort_incomplete_upload_days: rule.abort_incomplete_upload_days,
                    ..LifecycleRule::default()
                })
                .collect(),
            versioning: Versioning::Unversioned,
            object_lock: None,
            policy: None,
        }
    }
}

pub fn encode_bucket_settings(settings: &BucketSettings) -> Vec<u8> {
    let mut out = vec![BUCKET_SETTINGS_FORMAT];
    out.extend_from_slice(&encode_plain(settings));
    out
}

/// Decodes a bucket settings record of either format.
pub fn decode_bucket_settings(key: &[u8], bytes: &[u8]) -> Result<BucketSettings, CatalogError> {
    match bytes.split_first() {
        Some((&BUCKET_SETTINGS_FORMAT_V1, body)) => {
            Ok(decode_postcard::<BucketSettingsV1>(key, body)?.into())
        }
        Some((&BUCKET_SETTINGS_FORMAT, body)) => decode_postcard(key, body),
        _ => decode_versioned(key, bytes),
    }
}

/// One lifecycle rule of a bucket (S3's `LifecycleRule`): what it applies to and what it does
/// when.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LifecycleRule {
    pub id: Option<String>,
    /// Disabled rules are kept and shown, not applied.
    pub enabled: bool,
    /// Keys starting with this ("": every key).
    pub prefix: String,
    /// Objects expire this many days after they were last written.
    pub expiration_days: Option<u32>,
    /// Or at this moment (ms since the epoch).
    pub expiration_date_unix_ms: Option<i64>,
    /// Multipart uploads are aborted this many days after they began.
    pub abort_incomplete_upload_days: Option<u32>,
    /// Versions are deleted this many days after a newer version replaced them.
    pub noncurrent_expiration_days: Option<u32>,
    /// A delete marker with no older versions behind it is removed.
    pub expired_object_delete_marker: bool,
}

/// One CORS rule of a bucket (S3's `CORSRule`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CorsRule {
    pub id: Option<String>,
    /// Origins, each may hold one `*` wildcard.
    pub allowed_origins: Vec<String>,
    /// `GET`, `PUT`, `POST`, `DELETE`, `HEAD`.
    pub allowed_methods: Vec<String>,
    /// Request headers a preflight may ask for; each may hold one `*` wildcard.
    pub allowed_headers: Vec<String>,
    pub expose_headers: Vec<String>,
    pub max_age_seconds: Option<i32>,
}

// ---- keys ----

fn hex16(value: u64) -> String {
    format!("{value:016x}")
}

fn meta(suffix: &[u8], tail: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(1 + suffix.len() + tail.len());
    key.push(keel_store::Keyspace::Meta as u8);
    key.extend_from_slice(suffix);
    key.extend_from_slice(tail);
    key
}

pub fn cluster_key() -> Vec<u8> {
    meta(CLUSTER_SUFFIX, b"")
}

pub fn node_key(node: NodeId) -> Vec<u8> {
    meta(NODE_PREFIX, hex16(node).as_bytes())
}

pub fn nearfull_key(node: NodeId) -> Vec<u8> {
    meta(NEARFULL_PREFIX, hex16(node).as_bytes())
}

pub fn next_volume_id_key() -> Vec<u8> {
    meta(NEXT_VOLUME_ID_SUFFIX, b"")
}

pub fn volume_key(volume_id: u64) -> Vec<u8> {
    meta(VOLUME_PREFIX, hex16(volume_id).as_bytes())
}

pub fn snapshot_key(volume_id: u64, generation: u64) -> Vec<u8> {
    meta(
        SNAPSHOT_PREFIX,
        format!("{}/{}", hex16(volume_id), hex16(generation)).as_bytes(),
    )
}

pub fn key_record_key(access_key_id: &str) -> Vec<u8> {
    meta(KEY_PREFIX, access_key_id.as_bytes())
}

pub fn bucket_key(bucket: &str) -> Vec<u8> {
    meta(BUCKET_PREFIX, bucket.as_bytes())
}

pub fn bucket_settings_key(bucket: &str) -> Vec<u8> {
    meta(BUCKET_SETTINGS_PREFIX, bucket.as_bytes())
}

/// `meta_key(prefix)` and the first key past every key starting with it.
pub fn prefix_range(prefix: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let start = meta(prefix, b"");
    let mut end = start.clone();
    // Every prefix here ends in a printable byte, so incrementing the last byte is exact.
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    (start, end)
}

// ---- encodings ----

fn decode_postcard<T: for<'de> Deserialize<'de>>(
    key: &[u8],
    bytes: &[u8],
) -> Result<T, CatalogError> {
    postcard::from_bytes(bytes).map_err(|error| CatalogError::Corrupt {
        record: String::from_utf8_lossy(key.get(1..).unwrap_or_default()).into_owned(),
        detail: error.to_string(),
    })
}

/// Plain postcard: volume, snapshot and counter records (their format byte is a field).
pub fn encode_plain<T: Serialize>(record: &T) -> Vec<u8> {
    // postcard only fails on writer errors or serde shapes our plain records do not use.
    postcard::to_allocvec(record)
        .unwrap_or_else(|error| panic!("postcard cannot encode a plain catalog record: {error}"))
}

pub fn decode_plain<T: for<'de> Deserialize<'de>>(
    key: &[u8],
    bytes: &[u8],
) -> Result<T, CatalogError> {
    decode_postcard(key, bytes)
}

/// Version byte, then postcard: key, bucket, cluster and node records.
pub fn encode_versioned<T: Serialize>(record: &T) -> Vec<u8> {
    let mut out = vec![RECORD_VERSION];
    out.extend_from_slice(&encode_plain(record));
    out
}

pub fn decode_versioned<T: for<'de> Deserialize<'de>>(
    key: &[u8],
    bytes: &[u8],
) -> Result<T, CatalogError> {
    match bytes.split_first() {
        Some((&RECORD_VERSION, body)) => decode_postcard(key, body),
        Some((version, _)) => Err(CatalogError::Corrupt {
            record: String::from_utf8_lossy(key.get(1..).unwrap_or_default()).into_owned(),
            detail: format!("unknown record version {version}"),
        }),
        None => Err(CatalogError::Corrupt {
            record: String::from_utf8_lossy(key.get(1..).unwrap_or_default()).into_owned(),
            detail: "empty record".to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct WrittenBySingleNode {
        format: u8,
        id: u64,
        uuid: [u8; 16],
        name: String,
        size_bytes: u64,
        compression: String,
        iops_max: Option<u64>,
        bandwidth_max_mib_per_second: Option<u64>,
        generation: u64,
        generation_next: u64,
        view: Vec<Layer>,
        origin: Option<Origin>,
        status: VolumeStatus,
        created_unix_seconds: u64,
    }

    // Proves a volume record written by single-node Keel (format 1) still decodes, placed on
    // the local node, and that format-2 records round-trip.
    #[test]
    fn single_node_volume_records_decode() {
        let old = WrittenBySingleNode {
            format: 1,
            id: 7,
            uuid: [3; 16],
            name: "pg".into(),
            size_bytes: 1 << 30,
            compression: "lz4".into(),
            iops_max: Some(100),
            bandwidth_max_mib_per_second: None,
            generation: 4,
            generation_next: 5,
            view: vec![Layer::new(7, 4)],
            origin: None,
            status: VolumeStatus::Ready,
            created_unix_seconds: 12,
        };
        let key = volume_key(7);
        let record = decode_volume(&key, &encode_plain(&old), 1).expect("decodes");
        assert_eq!(record.format, VOLUME_RECORD_FORMAT);
        assert_eq!(record.name, "pg");
        assert_eq!(record.generation, 4);
        assert_eq!(record.iops_max, Some(100));
        assert_eq!(record.replication, Replication::single(1));
        let again = decode_volume(&key, &encode_plain(&record), 9).expect("decodes");
        assert_eq!(again, record);
        assert!(decode_volume(&key, &[2, 1], 1).is_err());
    }

    /// A snapshot record as formats 1 and 2 wrote it: no `incomplete_on`.
    #[derive(Serialize)]
    struct SnapshotBeforeFormat3 {
        format: u8,
        volume_id: u64,
        name: String,
        guid: [u8; 16],
        generation: u64,
        size_bytes: u64,
        view: Vec<Layer>,
        created_unix_seconds: u64,
    }

    /// A snapshot record as format 3 wrote it: `incomplete_on`, no repairs.
    #[derive(Serialize)]
    struct SnapshotFormat3 {
        old: SnapshotBeforeFormat3,
        incomplete_on: Vec<NodeId>,
    }

    // Proves records written before `incomplete_on` still decode (complete everywhere),
    // alone and inside a larger encoding (a Raft snapshot of the catalog holds them in maps:
    // the next field must still line up), and that the new format round-trips.
    #[test]
    fn snapshot_records_of_every_format_decode() {
        let old = SnapshotBeforeFormat3 {
            format: VOLUME_RECORD_FORMAT,
            volume_id: 7,
            name: "s".to_string(),
            guid: [3; 16],
            generation: 4,
            size_bytes: 1 << 20,
            view: vec![Layer::new(7, 4)],
            created_unix_seconds: 99,
        };
        let expected = SnapshotRecord {
            format: SNAPSHOT_RECORD_FORMAT,
            volume_id: 7,
            name: "s".to_string(),
            guid: [3; 16],
            generation: 4,
            size_bytes: 1 << 20,
            view: vec![Layer::new(7, 4)],
            created_unix_seconds: 99,
            incomplete_on: Vec::new(),
            repairs: Vec::new(),
        };
        let decoded: SnapshotRecord =
            decode_plain(b"k", &postcard::to_allocvec(&old).expect("encodes")).expect("decodes");
        assert_eq!(decoded, expected);
        let nested: (SnapshotRecord, u64) =
            postcard::from_bytes(&postcard::to_allocvec(&(&old, 12345u64)).expect("encodes"))
                .expect("decodes");
        assert_eq!(nested, (expected.clone(), 12345));

        // Format 3: `incomplete_on`, no repairs.
        let third = SnapshotFormat3 {
            old: SnapshotBeforeFormat3 { format: 3, ..old },
            incomplete_on: vec![2],
        };
        let nested: (SnapshotRecord, u64) =
            postcard::from_bytes(&postcard::to_allocvec(&(&third, 77u64)).expect("encodes"))
                .expect("decodes");
        assert_eq!(
            nested,
            (
                SnapshotRecord {
                    incomplete_on: vec![2],
                    ..expected.clone()
                },
                77
            )
        );

        let new = SnapshotRecord {
            incomplete_on: vec![2, 3],
            repairs: vec![SnapshotRepair {
                node: 3,
                generation: 9,
            }],
            ..expected
        };
        let round: (SnapshotRecord, u64) =
            postcard::from_bytes(&postcard::to_allocvec(&(&new, 6u64)).expect("encodes"))
                .expect("decodes");
        assert_eq!(round, (new.clone(), 6));
        assert!(new.complete_on(1) && !new.complete_on(2));
        assert_eq!((new.repair_of(3), new.repair_of(2)), (Some(9), None));
        assert!(decode_plain::<SnapshotRecord>(b"k", &encode_plain(&new)[..20]).is_err());
    }

    // Proves the catalog's prefixes are disjoint from the object layer's local records (whose
    // keys start `s3/obj/`, `s3/ver/`, `s3/ref/`, `s3/upload/`, `s3/part/`).
    #[test]
    fn catalog_prefixes_exclude_local_object_records() {
        for local in [
            &b"s3/obj/x"[..],
            b"s3/ver/x",
            b"s3/ref/x",
            b"s3/upload/x",
            b"s3/part/x",
        ] {
            assert!(CATALOG_PREFIXES
                .iter()
                .all(|prefix| !local.starts_with(prefix)));
        }
        let (start, end) = prefix_range(b"v/vol/");
        assert!(start < volume_key(0) && volume_key(u64::MAX) < end);
        let snapshot = snapshot_key(u64::MAX, 1);
        assert!(snapshot < start || snapshot >= end);
    }

    // Proves a bucket settings record of the first format decodes (unversioned, its lifecycle
    // rules kept) and the current format round-trips versioning.
    #[test]
    fn bucket_settings_records_of_both_formats_decode() {
        let key = bucket_settings_key("logs");
        let v1 = BucketSettingsV1 {
            name: "logs".into(),
            public_read: true,
            lifecycle: vec![LifecycleRuleV1 {
                enabled: true,
                expiration_days: Some(9),
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut bytes = vec![BUCKET_SETTINGS_FORMAT_V1];
        bytes.extend_from_slice(&encode_plain(&v1));
        let decoded = decode_bucket_settings(&key, &bytes).expect("decodes");
        assert!(decoded.public_read);
        assert_eq!(decoded.versioning, Versioning::Unversioned);
        assert_eq!(decoded.lifecycle[0].expiration_days, Some(9));
        let current = BucketSettings {
            versioning: Versioning::Suspended,
            ..decoded
        };
        let bytes = encode_bucket_settings(&current);
        assert_eq!(
            decode_bucket_settings(&key, &bytes).expect("decodes"),
            current
        );
    }
}
