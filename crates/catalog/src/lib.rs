//! keel-catalog: Keel's cluster-wide metadata — nodes, volumes and their snapshots and
//! replication state, S3 buckets and access keys — as records, the one [`Command`] type that
//! changes them, and the deterministic state machine that applies it ([`CatalogState::plan`]).
//!
//! Who applies commands: the cluster's Raft state machine (`keel-cluster`), on every node in log
//! order; or, where there is no cluster (tests, offline tools), a [`LocalCatalog`] that applies
//! each command at once. Either way the change goes through [`Catalog::apply`]: one store write
//! holding the command's record changes (plus the caller's own bookkeeping, such as Raft's
//! applied log id), then the in-memory state, then the [`Observer`]s, in apply order.
//!
//! Layering: this crate sits right above the store and knows nothing of Raft, the network or
//! block I/O. The volume engine reads its records (views, generations); the namespace turns
//! user requests into commands through [`Metadata::propose`].

mod command;
pub mod records;
mod state;
pub mod view;

use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard};

use keel_store::{Durability, Store, StoreError, WriteOp};
use serde::{Deserialize, Serialize};

pub use command::{Command, Event, NodeSpec, Outcome, VolumeSettings};
pub use records::{
    default_in_sync_min, BucketRecord, BucketSettings, ClusterRecord, CorsRule, DefaultRetention,
    DeviceRecord, KeyRecord, LifecycleRule, LockMode, NodeAddresses, NodeRecord, NodeRole,
    NodeState, ObjectLock, Origin, Replication, SnapshotRecord, SnapshotRepair, Versioning,
    VolumeRecord, VolumeStatus, REPLICAS_MAX, REPLICAS_MOVING_MAX, SNAPSHOT_RECORD_FORMAT,
};
pub use state::{CatalogState, Change, DrainWait, Plan, VolumeEntry};

/// A node's id in the cluster (and in Raft). Handed out once, never reused.
pub type NodeId = u64;

/// The id the bootstrapping node takes.
pub const FIRST_NODE_ID: NodeId = 1;
/// Size of a volume block: the unit of a store extent, of copy-on-write and of NBD alignment.
pub const BLOCK_SIZE_BYTES: u64 = 4096;
/// Largest volume: keeps block numbers and byte offsets far from overflow.
pub const VOLUME_SIZE_MAX_BYTES: u64 = 1 << 50;
/// Longest volume, snapshot or node name.
pub const NAME_MAX_BYTES: usize = 128;
/// Deepest chain of clones: each level costs one more lookup for blocks the clone never wrote.
pub const CLONE_DEPTH_MAX: usize = 16;
/// Most snapshots per volume: the garbage collector and `info` evaluate every view per block.
pub const SNAPSHOTS_PER_VOLUME_MAX: usize = 1024;

/// Why a command was refused, or why the catalog could not be read. Refusals are deterministic
/// (every node refuses the same command the same way) and travel back to the proposer, so they
/// are plain data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum CatalogError {
    #[error("volume {name:?} not found")]
    VolumeNotFound { name: String },
    #[error("volume {name:?} already exists")]
    VolumeExists { name: String },
    #[error("snapshot {snapshot:?} of volume {volume:?} not found")]
    SnapshotNotFound { volume: String, snapshot: String },
    #[error("snapshot {snapshot:?} of volume {volume:?} already exists")]
    SnapshotExists { volume: String, snapshot: String },
    #[error("volume {volume:?} is in use: {detail}")]
    VolumeInUse { volume: String, detail: String },
    #[error(
        "send/receive stream: its base snapshot (guid {base_guid}) is not a snapshot of volume \
         {volume:?} here; send a full stream or one based on a snapshot this side has"
    )]
    BaseMissing { volume: String, base_guid: String },
    #[error("{subject}: {detail}")]
    Invalid { subject: String, detail: String },
    #[error("node {node} is not a member of the cluster")]
    NodeNotFound { node: NodeId },
    #[error("a node named {name:?} is already a member")]
    NodeExists { name: String },
    #[error("node {node:?} is in use: {detail}")]
    NodeInUse { node: String, detail: String },
    #[error("bucket {name} does not exist")]
    NoSuchBucket { name: String },
    #[error("bucket {name} already exists and is owned by another key")]
    BucketAlreadyExists { name: String },
    #[error("bucket {name} already exists and is yours")]
    BucketAlreadyOwnedByYou { name: String },
    #[error("invalid bucket name {name:?}: {reason}")]
    InvalidBucketName { name: String, reason: String },
    #[error("access key {access_key_id} does not exist")]
    NoSuchAccessKey { access_key_id: String },
    #[error("access key {access_key_id} already exists")]
    AccessKeyExists { access_key_id: String },
    #[error("catalog record {record} is corrupt: {detail}")]
    Corrupt { record: String, detail: String },
    #[error("store error while {operation}: {detail}")]
    Store { operation: String, detail: String },
    #[error("bucket {name}: {detail}")]
    InvalidBucketState { name: String, detail: String },
}

/// Why a proposal did not produce an outcome.
#[derive(Debug, Clone, thiserror::Error)]
pub enum MetadataError {
    /// Applied, and refused by the state machine: nothing changed.
    #[error("{0}")]
    Refused(#[from] CatalogError),
    /// Not applied: no leader or no quorum could be reached (the command was never accepted).
    #[error("cluster metadata is unavailable: {detail}")]
    Unavailable { detail: String },
    /// Sent, but no answer came in time: it may or may not have been applied.
    #[error("cluster metadata did not answer in time (the change may or may not have been made): {detail}")]
    Timeout { detail: String },
    /// This node's store failed while applying; the node stops serving metadata.
    #[error("this node's store failed while applying cluster metadata: {detail}")]
    Failed { detail: String },
}

/// Names of volumes, snapshots and nodes: 1 to [`NAME_MAX_BYTES`] characters of `A-Z a-z 0-9 - _
/// .`, not starting with a dot.
pub fn validate_name(kind: &str, name: &str) -> Result<(), CatalogError> {
    let valid = !name.is_empty()
        && name.len() <= NAME_MAX_BYTES
        && name
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.'))
        && !name.starts_with('.');
    if valid {
        Ok(())
    } else {
        Err(CatalogError::Invalid {
            subject: name.to_string(),
            detail: format!(
                "{kind} names are 1 to {NAME_MAX_BYTES} characters of A-Z a-z 0-9 - _ . and do not start with a dot"
            ),
        })
    }
}

/// A volume size: a positive multiple of [`BLOCK_SIZE_BYTES`], at most
/// [`VOLUME_SIZE_MAX_BYTES`].
pub fn validate_size(name: &str, size_bytes: u64) -> Result<(), CatalogError> {
    if size_bytes == 0
        || !size_bytes.is_multiple_of(BLOCK_SIZE_BYTES)
        || size_bytes > VOLUME_SIZE_MAX_BYTES
    {
        return Err(CatalogError::Invalid {
            subject: name.to_string(),
            detail: format!(
                "size {size_bytes} must be a positive multiple of {BLOCK_SIZE_BYTES} bytes, at most {VOLUME_SIZE_MAX_BYTES}"
            ),
        });
    }
    Ok(())
}

/// S3 bucket naming rules (the DNS-compatible ones S3 enforces for new buckets).
pub fn validate_bucket_name(name: &str) -> Result<(), CatalogError> {
    let invalid = |reason: &str| {
        Err(CatalogError::InvalidBucketName {
            name: name.chars().take(80).collect(),
            reason: reason.to_string(),
        })
    };
    if !(3..=63).contains(&name.len()) {
        return invalid("must be 3 to 63 characters long");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
    {
        return invalid("only lower-case letters, digits, '.' and '-' are allowed");
    }
    let first = name.as_bytes()[0];
    let last = name.as_bytes()[name.len() - 1];
    if !(first.is_ascii_alphanumeric() && last.is_ascii_alphanumeric()) {
        return invalid("must start and end with a letter or digit");
    }
    if name.contains("..") || name.contains(".-") || name.contains("-.") {
        return invalid("must not contain '..', '.-' or '-.'");
    }
    if name.parse::<std::net::Ipv4Addr>().is_ok() {
        return invalid("must not look like an IP address");
    }
    if name.starts_with("xn--") || name.ends_with("-s3alias") || name.ends_with("--ol-s3") {
        return invalid("reserved prefix or suffix");
    }
    Ok(())
}

/// Keeps local state in step with the catalog. Called after every applied command that changed
/// something, in apply order, with the new state. It runs on the applying thread (the Raft state
/// machine): it must be quick and must never wait for another proposal (that would wait for
/// this very apply to finish); long work (erasing a volume's blocks) goes to a worker.
pub trait Observer: Send + Sync {
    fn applied(&self, state: &CatalogState, events: &[Event]);
}

/// The catalog in memory, shared by the state machine that applies commands and everyone who
/// reads it.
pub struct Catalog {
    state: RwLock<CatalogState>,
    observers: RwLock<Vec<Arc<dyn Observer>>>,
    /// One applier at a time, so observers see changes in order.
    applying: Mutex<()>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Catalog {
    pub fn new(state: CatalogState) -> Arc<Catalog> {
        Arc::new(Catalog {
            state: RwLock::new(state),
            observers: RwLock::new(Vec::new()),
            applying: Mutex::new(()),
        })
    }

    /// The current state. Hold the guard briefly: appliers wait for it.
    pub fn read(&self) -> RwLockReadGuard<'_, CatalogState> {
        self.state
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn subscribe(&self, observer: Arc<dyn Observer>) {
        self.observers
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(observer);
    }

    fn notify(&self, events: &[Event]) {
        if events.is_empty() {
            return;
        }
        let observers = self
            .observers
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        let state = self.read();
        for observer in observers {
            observer.applied(&state, events);
        }
    }

    /// Applies `command`: its record changes and the caller's bookkeeping (`extra`, given the
    /// outcome) in one store write with `durability`, then memory, then observers. A refusal
    /// still writes `extra`. A store failure leaves memory unchanged and is returned as the outer
    /// error.
    pub fn apply(
        &self,
        store: &Store,
        command: &Command,
        extra: &dyn Fn(&Result<Outcome, CatalogError>) -> Vec<WriteOp>,
        durability: Durability,
    ) -> Result<Result<Outcome, CatalogError>, StoreError> {
        let _applying = lock(&self.applying);
        let plan = self.read().plan(command);
        let outcome = plan
            .as_ref()
            .map(|plan| plan.outcome.clone())
            .map_err(Clone::clone);
        let mut ops = match &plan {
            Ok(plan) => plan.store_ops(),
            Err(_) => Vec::new(),
        };
        ops.extend(extra(&outcome));
        if !ops.is_empty() {
            store.write_metadata(ops, durability)?;
        }
        if let Ok(plan) = plan {
            self.state
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .commit(&plan.changes);
            self.notify(&plan.events);
        }
        Ok(outcome)
    }

    /// Replaces the whole catalog with `state` (a Raft snapshot being installed): every catalog
    /// record in the store is rewritten in one atomic write together with `extra`.
    pub fn restore(
        &self,
        store: &Store,
        state: CatalogState,
        extra: Vec<WriteOp>,
    ) -> Result<(), CatalogError> {
        let _applying = lock(&self.applying);
        let mut ops = state.replace_ops(store)?;
        ops.extend(extra);
        store
            .write_metadata(ops, Durability::Sync)
            .map_err(|source| CatalogError::Store {
                operation: "installing a catalog snapshot".to_string(),
                detail: source.to_string(),
            })?;
        *self
            .state
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = state;
        self.notify(&[Event::Restored]);
        Ok(())
    }
}

/// How the layers above change the catalog: propose a command, get its outcome once this node
/// applied it (so a read right after sees the change).
pub trait Metadata: Send + Sync {
    /// Blocks until the command is applied here or fails. Never call it from an [`Observer`].
    fn propose(&self, command: Command) -> Result<Outcome, MetadataError>;
    /// Blocks until this node applied every command committed anywhere before the call (a
    /// read barrier): the catalog then shows what another node changed just before.
    fn catch_up(&self) -> Result<(), MetadataError>;
    fn catalog(&self) -> &Arc<Catalog>;
    /// This node's id.
    fn local_node(&self) -> NodeId;
}

/// A catalog without a cluster: commands apply at once to the local store (tests, offline
/// tools). Bootstraps a one-node cluster with node [`FIRST_NODE_ID`] on first open.
pub struct LocalCatalog {
    store: Store,
    catalog: Arc<Catalog>,
}

impl LocalCatalog {
    /// Opens the catalog of `store`. A store that was never part of a cluster gets a one-node
    /// cluster in memory only (node [`FIRST_NODE_ID`], the id `keel server` takes when it later
    /// bootstraps that directory), so records written here place volumes on that node.
    pub fn open(store: Store) -> Result<LocalCatalog, MetadataError> {
        let mut state = CatalogState::load(&store, FIRST_NODE_ID)?;
        if state.cluster.is_none() {
            let node = NodeSpec {
                name: "local".to_string(),
                instance: [0; 16],
                role: NodeRole::Storage,
                addresses: NodeAddresses {
                    cluster: "local".to_string(),
                    ..NodeAddresses::default()
                },
                labels: Default::default(),
                devices: Vec::new(),
            };
            let plan = state.plan(&Command::Bootstrap {
                cluster_id: [0; 16],
                created_unix_ms: 0,
                node,
            })?;
            state.commit(&plan.changes);
        }
        Ok(LocalCatalog {
            store,
            catalog: Catalog::new(state),
        })
    }

    /// Members of the cluster this store belongs to (1 for a store never part of a cluster).
    pub fn members(&self) -> usize {
        self.catalog.read().members().count()
    }
}

impl Metadata for LocalCatalog {
    fn propose(&self, command: Command) -> Result<Outcome, MetadataError> {
        match self
            .catalog
            .apply(&self.store, &command, &|_| Vec::new(), Durability::Sync)
        {
            Ok(outcome) => Ok(outcome?),
            Err(error) => Err(MetadataError::Failed {
                detail: error.to_string(),
            }),
        }
    }

    /// Commands apply here at once: nothing to wait for.
    fn catch_up(&self) -> Result<(), MetadataError> {
        Ok(())
    }

    fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    fn local_node(&self) -> NodeId {
        FIRST_NODE_ID
    }
}
