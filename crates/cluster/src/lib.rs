//! keel-cluster: several Keel nodes as one system. One Raft group (openraft) holds the catalog —
//! nodes, volumes, snapshots, buckets, keys, replication state — with its log and vote in each
//! node's own store and the catalog as its state machine.
//!
//! What a node does here:
//! - **Forms or joins the cluster** ([`Cluster::start`]): the first node bootstraps (a fresh
//!   cluster id, node id 1); a node started with a seed address asks any member to join, gets a
//!   fresh id from the leader (ids are never reused) and enters Raft as a learner.
//! - **Proposes** catalog commands ([`keel_catalog::Metadata`]): to its own Raft if it leads,
//!   else forwarded to the leader; retried with the same proposal id across leader changes (the
//!   state machine applies an id once); answered once this node applied the entry.
//! - **Leads** ([`membership`]): keeps the voter set at the configured size (1, 3 or 5) from
//!   healthy members — a witness first, learners that caught up next — replacing voters that
//!   are down or leaving, and records every node's liveness (up / suspect / down) through Raft
//!   from the reports nodes send every heartbeat interval.
//!
//! Fault model: crash-stop nodes with durable stores; any message may be lost, delayed or
//! duplicated; partitions. Safety is openraft's (a write is acknowledged once a quorum of voters
//! stored it); liveness needs a quorum of voters up and connected. Every timeout here comes from
//! [`Timing`].

pub mod force;
mod log_store;
pub mod membership;
pub mod messages;
mod network;
pub mod rpc_transport;
mod state_machine;
pub mod transport;
mod types;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use keel_catalog::{
    Catalog, CatalogState, Command, Metadata, MetadataError, NodeAddresses, NodeId, NodeRecord,
    NodeRole, NodeSpec, NodeState, Outcome, FIRST_NODE_ID,
};
use keel_store::{meta_key, Compression, Durability, Store, WriteOp};
use openraft::errors::{ClientWriteError, RaftError};
use openraft::{ChangeMembers, Instant as _, ReadPolicy, ServerState};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

pub use log_store::LogStore;
pub use messages::NodeReport;
pub use state_machine::{StateMachine, DEDUP_WINDOW_ENTRIES};
pub use transport::{
    BoxFuture, Caller, Handler, LocalNetwork, LocalTransport, Payload, Peer, RemoteFailure,
    Transport, TransportError,
};
pub use types::{CommandResult, Raft, RaftNode, TypeConfig};

use messages::{
    JoinRequest, JoinResponse, Proposal, Proposed, CODE_BAD_REQUEST, CODE_FAILED, CODE_NOT_LEADER,
    CODE_NOT_READY, CODE_REFUSED, METHOD_HEARTBEAT, METHOD_JOIN, METHOD_PROPOSE,
    METHOD_RAFT_APPEND, METHOD_RAFT_PRE_VOTE, METHOD_RAFT_SNAPSHOT, METHOD_RAFT_TRANSFER_LEADER,
    METHOD_RAFT_VOTE, METHOD_READ_INDEX, METHOD_SILENCE, METHOD_STATUS, METHOD_TRANSFER_LEADERSHIP,
};

const IDENTITY_SUFFIX: &[u8] = b"l/identity";
const INSTANCE_SUFFIX: &[u8] = b"l/instance";

/// Timeouts and intervals, with the defaults a loopback or LAN cluster uses. Every one is a
/// trade: shorter detects failures sooner and raises false alarms on a loaded machine.
#[derive(Debug, Clone)]
pub struct Timing {
    /// Raft leader heartbeats. Default 150 ms.
    pub raft_heartbeat: Duration,
    /// A follower that hears no leader for a random time in this range starts an election.
    /// Default 600–1200 ms: measured, a new leader about 2 s after the old one is killed (the
    /// other followers must also have lost the leader's lease before they grant a vote).
    pub election_timeout_min: Duration,
    pub election_timeout_max: Duration,
    /// How often each node reports to the leader. Default 500 ms.
    pub report_interval: Duration,
    /// No report for this long: the node is `suspect`. Default 3 s.
    pub suspect_after: Duration,
    /// No report for this long: the node is `down` (and a voter on it gets replaced). Default
    /// 10 s.
    pub down_after: Duration,
    /// How long a proposal may take, across retries, before it fails. Default 10 s.
    pub propose_timeout: Duration,
    /// One call to another node. Default 2 s.
    pub call_timeout: Duration,
    /// How often the leader reconsiders the voter set. Default 1 s.
    pub membership_interval: Duration,
    /// Entries between metadata snapshots (and log purges). Default 1000.
    pub snapshot_every_entries: u64,
}

impl Default for Timing {
    fn default() -> Timing {
        Timing {
            raft_heartbeat: Duration::from_millis(150),
            election_timeout_min: Duration::from_millis(600),
            election_timeout_max: Duration::from_millis(1200),
            report_interval: Duration::from_millis(500),
            suspect_after: Duration::from_secs(3),
            down_after: Duration::from_secs(10),
            propose_timeout: Duration::from_secs(10),
            call_timeout: Duration::from_secs(2),
            membership_interval: Duration::from_secs(1),
            snapshot_every_entries: 1000,
        }
    }
}

/// How this node takes part in the cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub name: String,
    pub role: NodeRole,
    /// Advertised addresses (what other nodes and clients dial).
    pub addresses: NodeAddresses,
    pub labels: BTreeMap<String, String>,
    pub devices: Vec<keel_catalog::DeviceRecord>,
    /// Cluster address of any member, to join through (ignored once this node is a member).
    pub join: Option<String>,
    /// The cluster id from the join token: used when forming a cluster, checked when joining
    /// or restarting. None: a random one when forming, nothing checked.
    pub cluster_id: Option<[u8; 16]>,
    /// Voters the leader keeps when enough healthy members exist: 1, 3 or 5.
    pub voters: usize,
    pub timing: Timing,
    /// Every time read and sleep of the cluster goes through it (a simulation's clock in tests).
    pub clock: Arc<dyn keel_clock::Clock>,
}

/// Who this node is, stored at `l/identity` (local, never replicated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub cluster_id: [u8; 16],
    pub node_id: NodeId,
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster store: {0}")]
    Store(String),
    #[error("raft: {0}")]
    Raft(String),
    #[error("joining through {seed}: {detail}")]
    Join { seed: String, detail: String },
    #[error("invalid cluster configuration: {0}")]
    Config(String),
    #[error("{0}")]
    Metadata(#[from] MetadataError),
}

fn store_error(error: impl std::fmt::Display) -> ClusterError {
    ClusterError::Store(error.to_string())
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    rand::Rng::fill(&mut rand::thread_rng(), &mut bytes[..]);
    bytes
}

/// Reads this data directory's identity, if it is a member of a cluster.
pub fn read_identity(store: &Store) -> Result<Option<Identity>, ClusterError> {
    match store.get(&meta_key(IDENTITY_SUFFIX)).map_err(store_error)? {
        Some(bytes) => {
            Ok(Some(postcard::from_bytes(&bytes).map_err(|error| {
                store_error(format!("identity: {error}"))
            })?))
        }
        None => Ok(None),
    }
}

fn write_identity(store: &Store, identity: &Identity) -> Result<(), ClusterError> {
    let value = postcard::to_allocvec(identity).map_err(store_error)?;
    store
        .write(
            vec![WriteOp::put(
                meta_key(IDENTITY_SUFFIX),
                value,
                Compression::None,
            )],
            Durability::Sync,
        )
        .map_err(store_error)?;
    Ok(())
}

/// This data directory's instance id, made on first use.
fn instance_id(store: &Store) -> Result<[u8; 16], ClusterError> {
    if let Some(bytes) = store.get(&meta_key(INSTANCE_SUFFIX)).map_err(store_error)? {
        if let Ok(instance) = <[u8; 16]>::try_from(bytes.as_slice()) {
            return Ok(instance);
        }
    }
    let instance = random_bytes::<16>();
    store
        .write(
            vec![WriteOp::put(
                meta_key(INSTANCE_SUFFIX),
                instance.to_vec(),
                Compression::None,
            )],
            Durability::Sync,
        )
        .map_err(store_error)?;
    Ok(instance)
}

/// Receives calls before the cluster exists (a joining node must accept Raft traffic as soon
/// as the leader adds it) and hands them to the cluster once it does.
pub struct ClusterHandler {
    cluster: OnceLock<Weak<Cluster>>,
    node_id: AtomicU64,
    /// Told this node's id as soon as it has one (the transport's identity follows it).
    on_node_id: Option<Box<dyn Fn(NodeId) + Send + Sync>>,
}

impl ClusterHandler {
    pub fn new() -> Arc<ClusterHandler> {
        Arc::new(ClusterHandler {
            cluster: OnceLock::new(),
            node_id: AtomicU64::new(0),
            on_node_id: None,
        })
    }

    /// A handler that calls `on_node_id` when this node learns its id (at once after a join,
    /// before Raft starts, so the leader's first messages find the right identity).
    pub fn with_node_id_hook(on_node_id: Box<dyn Fn(NodeId) + Send + Sync>) -> Arc<ClusterHandler> {
        Arc::new(ClusterHandler {
            cluster: OnceLock::new(),
            node_id: AtomicU64::new(0),
            on_node_id: Some(on_node_id),
        })
    }

    fn set_node_id(&self, node: NodeId) {
        self.node_id.store(node, Ordering::SeqCst);
        if let Some(hook) = &self.on_node_id {
            hook(node);
        }
    }

    /// The node id calls made from this node carry (0 until it has one).
    pub fn current_node_id(&self) -> NodeId {
        self.node_id.load(Ordering::SeqCst)
    }
}

impl Handler for ClusterHandler {
    fn handle(
        &self,
        caller: Caller,
        method: u16,
        payload: Vec<u8>,
    ) -> BoxFuture<Result<Vec<u8>, RemoteFailure>> {
        let cluster = self.cluster.get().and_then(Weak::upgrade);
        Box::pin(async move {
            match cluster {
                Some(cluster) => cluster.handle_call(caller, method, payload).await,
                None => Err(RemoteFailure {
                    code: CODE_NOT_READY,
                    message: "this node is still starting".to_string(),
                }),
            }
        })
    }

    fn node_id(&self) -> NodeId {
        self.current_node_id()
    }
}

/// A node's incoming calls, routed: the cluster's methods to its [`ClusterHandler`], those
/// of the layers above it (from [`messages::METHOD_FIRST_ABOVE`] up: replication) to the
/// handler they set once they are open.
pub struct Dispatch {
    cluster: Arc<ClusterHandler>,
    above: OnceLock<Arc<dyn Handler>>,
}

impl Dispatch {
    pub fn new(cluster: Arc<ClusterHandler>) -> Arc<Dispatch> {
        Arc::new(Dispatch {
            cluster,
            above: OnceLock::new(),
        })
    }

    /// The handler of the methods above the cluster's (set once; a second call is ignored).
    pub fn set_above(&self, handler: Arc<dyn Handler>) {
        let _ = self.above.set(handler);
    }
}

impl Handler for Dispatch {
    fn handle(
        &self,
        caller: Caller,
        method: u16,
        payload: Vec<u8>,
    ) -> BoxFuture<Result<Vec<u8>, RemoteFailure>> {
        if method < messages::METHOD_FIRST_ABOVE {
            return self.cluster.handle(caller, method, payload);
        }
        match self.above.get() {
            Some(handler) => handler.handle(caller, method, payload),
            None => Box::pin(async {
                Err(RemoteFailure {
                    code: CODE_NOT_READY,
                    message: "this node is still starting".to_string(),
                })
            }),
        }
    }

    fn node_id(&self) -> NodeId {
        self.cluster.current_node_id()
    }
}

/// What the leader last heard from each node.
#[derive(Default)]
struct Liveness {
    /// Monotonic time of the last report, per node.
    last_report: HashMap<NodeId, std::time::Instant>,
    reports: HashMap<NodeId, NodeReport>,
    /// When this node last became leader (reports older than that are not trusted).
    leading_since: Option<std::time::Instant>,
    /// When each node's clock was last seen skewed from the leader's, and by how much (ms).
    skew_ms: HashMap<NodeId, i64>,
}

/// Produces this node's report (free space, poisoned store...): set by the server.
pub type Reporter = Box<dyn Fn() -> NodeReport + Send + Sync>;

/// A node's part in the cluster.
pub struct Cluster {
    identity: Identity,
    config: ClusterConfig,
    raft: Raft,
    state_machine: StateMachine,
    catalog: Arc<Catalog>,
    transport: Arc<dyn Transport>,
    runtime: tokio::runtime::Handle,
    liveness: Mutex<Liveness>,
    /// Client-facing addresses, known once the server bound its listeners (after start).
    addresses: Mutex<NodeAddresses>,
    reporter: OnceLock<Reporter>,
    /// This node's lease ([`Cluster::holds_lease`]).
    lease: Mutex<Lease>,
    /// When this node last heard from a leader (a Raft append or snapshot; its start before
    /// any): it acknowledged no leader after that. Told to the candidates it votes for.
    heard_leader_at: Mutex<std::time::Instant>,
    /// The votes granted to this node, with what their voters had last heard from a leader.
    grants: Arc<Mutex<network::Grants>>,
    stopping: watch::Sender<bool>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn raft_config(timing: &Timing) -> Result<Arc<openraft::Config>, ClusterError> {
    let millis = |duration: Duration| duration.as_millis() as u64;
    let config = openraft::Config {
        cluster_name: "keel".to_string(),
        heartbeat_interval: millis(timing.raft_heartbeat),
        election_timeout_min: millis(timing.election_timeout_min),
        election_timeout_max: millis(timing.election_timeout_max),
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(timing.snapshot_every_entries),
        max_in_snapshot_log_to_keep: timing.snapshot_every_entries / 2,
        enable_pre_vote: Some(true),
        ..Default::default()
    };
    Ok(Arc::new(config.validate().map_err(|error| {
        ClusterError::Config(format!("raft timing: {error}"))
    })?))
}

fn raft_error<E: std::fmt::Display>(error: E) -> ClusterError {
    ClusterError::Raft(error.to_string())
}

impl Cluster {
    /// Starts this node's part in the cluster on `store`: forms a new cluster, rejoins the one
    /// it is a member of, or joins through `config.join`. `handler` must already receive this
    /// node's calls (it passes them on once the cluster is up).
    pub async fn start(
        store: Store,
        config: ClusterConfig,
        transport: Arc<dyn Transport>,
        handler: &Arc<ClusterHandler>,
    ) -> Result<Arc<Cluster>, ClusterError> {
        if ![1, 3, 5].contains(&config.voters) {
            return Err(ClusterError::Config(format!(
                "voters must be 1, 3 or 5 (got {})",
                config.voters
            )));
        }
        keel_catalog::validate_name("node", &config.name)
            .map_err(|error| ClusterError::Config(error.to_string()))?;
        let existing = {
            let store = store.clone();
            log_store::blocking(move || read_identity(&store).map_err(std::io::Error::other))
                .await
                .map_err(store_error)?
        };
        let instance = {
            let store = store.clone();
            log_store::blocking(move || instance_id(&store).map_err(std::io::Error::other))
                .await
                .map_err(store_error)?
        };
        let (identity, fresh) = match (existing, &config.join) {
            (Some(identity), join) => {
                if join.is_some() {
                    tracing::info!(
                        node_id = identity.node_id,
                        "already a member of a cluster: ignoring the join address"
                    );
                }
                (identity, false)
            }
            (None, None) => (
                Identity {
                    cluster_id: config.cluster_id.unwrap_or_else(random_bytes::<16>),
                    node_id: FIRST_NODE_ID,
                },
                true,
            ),
            (None, Some(seed)) => {
                let identity =
                    Self::join(&config, transport.as_ref(), seed, instance, handler).await?;
                (identity, false)
            }
        };
        if let Some(expected) = config.cluster_id {
            if expected != identity.cluster_id {
                return Err(ClusterError::Config(format!(
                    "this node belongs to cluster {}, not to cluster {} (the join token's)",
                    hex::encode(identity.cluster_id),
                    hex::encode(expected)
                )));
            }
        }
        if existing.is_none() {
            let store = store.clone();
            log_store::blocking(move || {
                write_identity(&store, &identity).map_err(std::io::Error::other)
            })
            .await
            .map_err(store_error)?;
        }
        handler.set_node_id(identity.node_id);

        let state = {
            let store = store.clone();
            let node_id = identity.node_id;
            log_store::blocking(move || {
                CatalogState::load(&store, node_id).map_err(std::io::Error::other)
            })
            .await
            .map_err(store_error)?
        };
        let catalog = Catalog::new(state);
        let state_machine =
            StateMachine::open(store.clone(), catalog.clone()).map_err(store_error)?;
        let grants = Arc::new(Mutex::new(network::Grants::default()));
        let network = network::NetworkFactory {
            transport: transport.clone(),
            local_node: identity.node_id,
            clock: config.clock.clone(),
            grants: grants.clone(),
        };
        let raft = Raft::new(
            identity.node_id,
            raft_config(&config.timing)?,
            network,
            LogStore::new(store.clone()),
            state_machine.clone(),
        )
        .await
        .map_err(raft_error)?;

        let addresses = config.addresses.clone();
        let started = config.clock.now();
        let cluster = Arc::new(Cluster {
            identity,
            config,
            raft,
            state_machine,
            catalog,
            transport,
            runtime: tokio::runtime::Handle::current(),
            liveness: Mutex::new(Liveness::default()),
            lease: Mutex::new(Lease::default()),
            heard_leader_at: Mutex::new(started),
            grants,
            addresses: Mutex::new(addresses),
            reporter: OnceLock::new(),
            stopping: watch::channel(false).0,
            tasks: Mutex::new(Vec::new()),
        });
        let _ = handler.cluster.set(Arc::downgrade(&cluster));

        if fresh || cluster.needs_initialize().await? {
            cluster.initialize(instance).await?;
        }
        if existing.is_none() && !fresh {
            // Joined: serve only once the log reached this node's own record (so everything
            // decided before the join — keys, buckets, volumes — is visible here).
            cluster.wait_for_own_record().await?;
        }
        cluster.spawn_background();
        Ok(cluster)
    }

    async fn wait_for_own_record(&self) -> Result<(), ClusterError> {
        let deadline = tokio::time::Instant::now() + self.config.timing.propose_timeout * 3;
        let mut applied = self.state_machine.applied_index();
        loop {
            if self
                .catalog
                .read()
                .nodes
                .contains_key(&self.identity.node_id)
            {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, applied.changed())
                .await
                .is_err()
            {
                return Err(ClusterError::Join {
                    seed: self.config.join.clone().unwrap_or_default(),
                    detail: "joined, but the leader's log did not reach this node in time"
                        .to_string(),
                });
            }
        }
    }

    /// A first node whose Raft log is still empty (it crashed between writing its identity and
    /// initializing Raft) or whose catalog lacks the cluster record.
    async fn needs_initialize(&self) -> Result<bool, ClusterError> {
        if self.identity.node_id != FIRST_NODE_ID {
            return Ok(false);
        }
        let initialized = self.raft.is_initialized().await.map_err(raft_error)?;
        Ok(!initialized || self.catalog.read().cluster.is_none())
    }

    async fn initialize(&self, instance: [u8; 16]) -> Result<(), ClusterError> {
        if !self.raft.is_initialized().await.map_err(raft_error)? {
            let mut members = BTreeMap::new();
            members.insert(self.identity.node_id, self.raft_node());
            self.raft.initialize(members).await.map_err(raft_error)?;
        }
        if self.catalog.read().cluster.is_none() {
            let node = self.node_spec(instance);
            self.propose_async(Command::Bootstrap {
                cluster_id: self.identity.cluster_id,
                created_unix_ms: self.config.clock.wall_unix_ms(),
                node,
            })
            .await?;
            tracing::info!(
                cluster_id = %hex::encode(self.identity.cluster_id),
                "formed a new cluster"
            );
        }
        Ok(())
    }

    fn node_spec(&self, instance: [u8; 16]) -> NodeSpec {
        NodeSpec {
            name: self.config.name.clone(),
            instance,
            role: self.config.role,
            addresses: self.addresses(),
            labels: self.config.labels.clone(),
            devices: self.config.devices.clone(),
        }
    }

    /// This node's advertised addresses.
    pub fn addresses(&self) -> NodeAddresses {
        lock(&self.addresses).clone()
    }

    /// Records the client-facing addresses the server actually bound (S3, NBD, admin); the
    /// node's catalog record follows within a report interval.
    pub fn set_client_addresses(
        &self,
        admin: Option<String>,
        s3: Option<String>,
        nbd: Option<String>,
    ) {
        let mut addresses = lock(&self.addresses);
        addresses.admin = admin;
        addresses.s3 = s3;
        addresses.nbd = nbd;
    }

    fn raft_node(&self) -> RaftNode {
        RaftNode {
            name: self.config.name.clone(),
            address: self.config.addresses.cluster.clone(),
        }
    }

    /// Asks the cluster behind `seed` for an id (retrying until the propose timeout).
    async fn join(
        config: &ClusterConfig,
        transport: &dyn Transport,
        seed: &str,
        instance: [u8; 16],
        _handler: &Arc<ClusterHandler>,
    ) -> Result<Identity, ClusterError> {
        let request = JoinRequest {
            node: NodeSpec {
                name: config.name.clone(),
                instance,
                role: config.role,
                addresses: config.addresses.clone(),
                labels: config.labels.clone(),
                devices: config.devices.clone(),
            },
            instance,
        };
        let payload = postcard::to_allocvec(&request).map_err(|error| ClusterError::Join {
            seed: seed.to_string(),
            detail: error.to_string(),
        })?;
        let deadline = tokio::time::Instant::now() + config.timing.propose_timeout * 3;
        let mut pause = Duration::from_millis(100);
        loop {
            let answer = transport
                .call(
                    Peer::AnyAt {
                        address: seed.to_string(),
                    },
                    METHOD_JOIN,
                    payload.clone().into(),
                    config.timing.propose_timeout,
                )
                .await;
            let failure = match answer {
                Ok(bytes) => {
                    let response: JoinResponse =
                        postcard::from_bytes(&bytes).map_err(|error| ClusterError::Join {
                            seed: seed.to_string(),
                            detail: format!("undecodable answer: {error}"),
                        })?;
                    tracing::info!(
                        node_id = response.node_id,
                        cluster_id = %hex::encode(response.cluster_id),
                        "joined the cluster"
                    );
                    return Ok(Identity {
                        cluster_id: response.cluster_id,
                        node_id: response.node_id,
                    });
                }
                Err(TransportError::Remote { code, message, .. }) if code == CODE_REFUSED => {
                    return Err(ClusterError::Join {
                        seed: seed.to_string(),
                        detail: message,
                    })
                }
                // The seed refused this node at the handshake: a retry would be refused too.
                Err(error @ TransportError::Refused { .. }) => {
                    return Err(ClusterError::Join {
                        seed: seed.to_string(),
                        detail: error.to_string(),
                    })
                }
                Err(error) => error,
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(ClusterError::Join {
                    seed: seed.to_string(),
                    detail: failure.to_string(),
                });
            }
            tracing::info!(%failure, "join attempt failed; retrying");
            config.clock.sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    pub fn identity(&self) -> Identity {
        self.identity
    }

    pub fn node_id(&self) -> NodeId {
        self.identity.node_id
    }

    pub fn raft(&self) -> &Raft {
        &self.raft
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// Where this node's report comes from (set once by the server).
    pub fn set_reporter(&self, reporter: Reporter) {
        let _ = self.reporter.set(reporter);
    }

    /// Raft's latest metrics (leader, term, membership, replication progress).
    pub fn metrics(&self) -> openraft::RaftMetrics<TypeConfig> {
        use openraft::async_runtime::watch::WatchReceiver;
        self.raft.metrics().borrow_watched().clone()
    }

    /// The current leader, if this node knows one.
    pub fn leader(&self) -> Option<NodeId> {
        self.metrics().current_leader
    }

    pub fn is_leader(&self) -> bool {
        self.metrics().state == ServerState::Leader
    }

    fn node_address(&self, node: NodeId) -> Option<String> {
        let metrics = self.metrics();
        let in_membership = metrics
            .membership_config
            .nodes()
            .find(|(id, _)| **id == node)
            .map(|(_, raft_node)| raft_node.address.clone());
        in_membership.or_else(|| {
            self.catalog
                .read()
                .nodes
                .get(&node)
                .map(|record| record.addresses.cluster.clone())
        })
    }

    async fn call_node(
        &self,
        node: NodeId,
        method: u16,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, TransportError> {
        let Some(address) = self.node_address(node) else {
            return Err(TransportError::Unreachable {
                peer: format!("node {node}"),
                detail: "its address is unknown here".to_string(),
            });
        };
        self.transport
            .call(
                Peer::Node { id: node, address },
                method,
                payload.into(),
                timeout,
            )
            .await
    }

    /// Waits until this node applied at least `index` (bounded by `timeout`).
    async fn wait_applied(&self, index: u64, timeout: Duration) -> bool {
        let mut applied = self.state_machine.applied_index();
        tokio::time::timeout(timeout, applied.wait_for(|&at| at >= index))
            .await
            .is_ok_and(|waited| waited.is_ok())
    }

    /// Whether this node leads and a quorum acknowledged it recently (a leader cut off from
    /// its quorum must not keep accepting writes that can never commit).
    fn leads_with_quorum(&self) -> Option<bool> {
        let metrics = self.metrics();
        if metrics.state != ServerState::Leader {
            return None;
        }
        if metrics.membership_config.voter_ids().count() <= 1 {
            return Some(true);
        }
        let fresh_within = self.config.timing.election_timeout_max * 2;
        Some(
            metrics
                .last_quorum_acked
                .as_ref()
                .is_some_and(|acked| acked.elapsed() <= fresh_within),
        )
    }

    /// As leader: when a quorum last acknowledged this node's leadership (the time openraft
    /// recorded for it; now for a single voter). A leader's lease runs from there, so a leader
    /// cut off from its quorum loses its lease no later than any other node would.
    fn quorum_acked_at(&self) -> Option<std::time::Instant> {
        let metrics = self.metrics();
        if metrics.state != ServerState::Leader {
            return None;
        }
        let now = self.config.clock.now();
        if metrics.membership_config.voter_ids().count() <= 1 {
            return Some(now);
        }
        let acked = metrics.last_quorum_acked.as_ref()?;
        now.checked_sub(acked.elapsed())
    }

    /// Proposes a command; returns its outcome once this node applied it.
    pub async fn propose_async(&self, command: Command) -> Result<Outcome, MetadataError> {
        let proposal = Proposal {
            id: random_bytes::<16>(),
            command,
        };
        let kind = proposal.command.kind();
        let timing = &self.config.timing;
        let timing_clock = self.config.clock.clone();
        let deadline = tokio::time::Instant::now() + timing.propose_timeout;
        let mut pause = Duration::from_millis(20);
        let mut maybe_sent = false;
        let mut last_problem = String::from("no leader is known");
        loop {
            if self.metrics().state == ServerState::Shutdown {
                let detail = format!("{kind}: this node's Raft has stopped (shutting down)");
                // An earlier attempt may have reached the leader.
                return Err(if maybe_sent {
                    MetadataError::Timeout { detail }
                } else {
                    MetadataError::Unavailable { detail }
                });
            }
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            if remaining.is_zero() {
                let detail = format!("{kind}: {last_problem}");
                return Err(if maybe_sent {
                    MetadataError::Timeout { detail }
                } else {
                    MetadataError::Unavailable { detail }
                });
            }
            match self.leads_with_quorum() {
                Some(false) => {
                    last_problem =
                        "this node leads but has lost contact with a quorum of voters".to_string();
                }
                Some(true) => {
                    maybe_sent = true;
                    match tokio::time::timeout(remaining, self.raft.client_write(proposal.clone()))
                        .await
                    {
                        Ok(Ok(response)) => return Ok(response.data.0?),
                        Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))))
                        | Ok(Err(RaftError::APIError(ClientWriteError::LogEntryDiscarded(_)))) => {
                            last_problem = "leadership changed".to_string();
                        }
                        // This node's Raft stopped (its store failed applying, say) with the
                        // entry in flight: a quorum may have committed it all the same, and
                        // the other nodes apply it. The caller must settle which.
                        Ok(Err(RaftError::Fatal(fatal))) => {
                            return Err(MetadataError::Timeout {
                                detail: format!(
                                    "{kind}: this node's Raft stopped with the proposal in \
                                     flight: {fatal}"
                                ),
                            })
                        }
                        Ok(Err(other)) => {
                            return Err(MetadataError::Failed {
                                detail: other.to_string(),
                            })
                        }
                        Err(_) => last_problem = "the entry did not commit in time".to_string(),
                    }
                }
                None => match self.leader() {
                    None => last_problem = "no leader is known (no quorum of voters?)".to_string(),
                    Some(leader) => {
                        let payload = postcard::to_allocvec(&proposal).map_err(|error| {
                            MetadataError::Failed {
                                detail: error.to_string(),
                            }
                        })?;
                        let call_timeout = remaining.min(timing.propose_timeout);
                        match self
                            .call_node(leader, METHOD_PROPOSE, payload, call_timeout)
                            .await
                        {
                            Ok(bytes) => {
                                let proposed: Proposed =
                                    postcard::from_bytes(&bytes).map_err(|error| {
                                        MetadataError::Failed {
                                            detail: format!("undecodable answer: {error}"),
                                        }
                                    })?;
                                let remaining =
                                    deadline.saturating_duration_since(tokio::time::Instant::now());
                                // Made, but answered as made only once this node's
                                // catalog shows it: a caller acts on its own catalog next (a
                                // snapshot's writes after it go to the volume's new
                                // generation only once this node applied it).
                                if !self.wait_applied(proposed.index, remaining).await {
                                    return Err(MetadataError::Timeout {
                                        detail: format!(
                                            "{kind}: made at index {}, not yet applied on this \
                                             node",
                                            proposed.index
                                        ),
                                    });
                                }
                                return Ok(proposed.result.0?);
                            }
                            Err(error) => {
                                maybe_sent |= !error.never_sent();
                                if let TransportError::Remote {
                                    code: CODE_FAILED,
                                    message,
                                    ..
                                } = &error
                                {
                                    return Err(MetadataError::Failed {
                                        detail: message.clone(),
                                    });
                                }
                                last_problem = format!("leader {leader}: {error}");
                            }
                        }
                    }
                },
            }
            timing_clock.sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// The leader's side of a forwarded proposal.
    async fn serve_proposal(&self, proposal: Proposal) -> Result<Proposed, RemoteFailure> {
        if self.leads_with_quorum() != Some(true) {
            return Err(RemoteFailure {
                code: CODE_NOT_LEADER,
                message: "not the leader (or cut off from the quorum)".to_string(),
            });
        }
        match tokio::time::timeout(
            self.config.timing.propose_timeout,
            self.raft.client_write(proposal),
        )
        .await
        {
            Ok(Ok(response)) => Ok(Proposed {
                result: response.data,
                index: response.log_id.index(),
            }),
            Ok(Err(RaftError::APIError(error))) => Err(RemoteFailure {
                code: CODE_NOT_LEADER,
                message: error.to_string(),
            }),
            // The leader's Raft stopped with the entry in flight (its store failed applying,
            // say): a quorum may have committed it. Answered as "not the leader", so that the
            // proposer retries the same proposal with the next leader, whose dedup table
            // answers the first outcome if it was made (found by the simulation, seed 200969
            // of `--fours` with failed syncs: a replica's return to the in-sync set, taken as
            // failed by its primary, was made, and FLUSHes went on without it).
            Ok(Err(RaftError::Fatal(fatal))) => Err(RemoteFailure {
                code: CODE_NOT_LEADER,
                message: format!("the leader's Raft stopped with the proposal in flight: {fatal}"),
            }),
            Err(_) => Err(RemoteFailure {
                code: CODE_NOT_LEADER,
                message: "the entry did not commit in time".to_string(),
            }),
        }
    }

    /// The leader's side of a join.
    async fn serve_join(&self, request: JoinRequest) -> Result<JoinResponse, RemoteFailure> {
        if !self.is_leader() {
            let Some(leader) = self.leader() else {
                return Err(RemoteFailure {
                    code: CODE_NOT_LEADER,
                    message: "no leader is known yet".to_string(),
                });
            };
            let payload = postcard::to_allocvec(&request).map_err(|error| RemoteFailure {
                code: CODE_FAILED,
                message: error.to_string(),
            })?;
            return match self
                .call_node(
                    leader,
                    METHOD_JOIN,
                    payload,
                    self.config.timing.propose_timeout,
                )
                .await
            {
                Ok(bytes) => postcard::from_bytes(&bytes).map_err(|error| RemoteFailure {
                    code: CODE_FAILED,
                    message: error.to_string(),
                }),
                Err(TransportError::Remote { code, message, .. }) => {
                    Err(RemoteFailure { code, message })
                }
                Err(error) => Err(RemoteFailure {
                    code: CODE_NOT_LEADER,
                    message: error.to_string(),
                }),
            };
        }
        let existing = self
            .catalog
            .read()
            .node_by_instance(&request.instance)
            .map(|node| node.id);
        let node_id = match existing {
            Some(id) => id,
            None => match self
                .propose_async(Command::NodeAdd {
                    node: request.node.clone(),
                    joined_unix_ms: self.config.clock.wall_unix_ms(),
                })
                .await
            {
                Ok(Outcome::Node(id)) => id,
                Ok(other) => {
                    return Err(RemoteFailure {
                        code: CODE_FAILED,
                        message: format!("adding a node answered {other:?}"),
                    })
                }
                Err(MetadataError::Refused(refusal)) => {
                    return Err(RemoteFailure {
                        code: CODE_REFUSED,
                        message: refusal.to_string(),
                    })
                }
                Err(error) => {
                    return Err(RemoteFailure {
                        code: CODE_NOT_LEADER,
                        message: error.to_string(),
                    })
                }
            },
        };
        let raft_node = RaftNode {
            name: request.node.name.clone(),
            address: request.node.addresses.cluster.clone(),
        };
        if let Err(error) = self.raft.add_learner(node_id, raft_node, false).await {
            return Err(RemoteFailure {
                code: CODE_NOT_LEADER,
                message: format!("adding node {node_id} as a learner: {error}"),
            });
        }
        tracing::info!(node_id, name = %request.node.name, "a node joined as a learner");
        Ok(JoinResponse {
            node_id,
            cluster_id: self.identity.cluster_id,
        })
    }

    /// Answers one incoming call.
    pub async fn handle_call(
        &self,
        caller: Caller,
        method: u16,
        payload: Vec<u8>,
    ) -> Result<Vec<u8>, RemoteFailure> {
        let bad_request = |error: String| RemoteFailure {
            code: CODE_BAD_REQUEST,
            message: error,
        };
        if caller == Caller::Unassigned && method != METHOD_JOIN {
            return Err(RemoteFailure {
                code: CODE_REFUSED,
                message: "a node without an id may only ask to join".to_string(),
            });
        }
        fn encode_answer<T: Serialize>(answer: &T) -> Result<Vec<u8>, RemoteFailure> {
            postcard::to_allocvec(answer).map_err(|error| RemoteFailure {
                code: CODE_FAILED,
                message: error.to_string(),
            })
        }
        fn decode_request<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, String> {
            postcard::from_bytes(bytes).map_err(|error| format!("undecodable request: {error}"))
        }
        match method {
            METHOD_RAFT_APPEND => {
                let request = decode_request(&payload).map_err(bad_request)?;
                self.heard_from_a_leader();
                encode_answer(&self.raft.append_entries(request).await)
            }
            METHOD_RAFT_VOTE => {
                let request = decode_request(&payload).map_err(bad_request)?;
                let vote = self.raft.vote(request).await;
                // Read after voting: every append Raft handled before this vote was noted
                // before Raft saw it, and once the vote is granted, an older leader's appends
                // are refused (a higher term).
                let heard = *lock(&self.heard_leader_at);
                let ago = self.config.clock.now().saturating_duration_since(heard);
                let answer: Result<network::VoteAnswer, RaftError<TypeConfig>> =
                    vote.map(|response| (response, ago.as_millis() as u64));
                encode_answer(&answer)
            }
            METHOD_RAFT_PRE_VOTE => {
                let request = decode_request(&payload).map_err(bad_request)?;
                encode_answer(&self.raft.pre_vote(request).await)
            }
            METHOD_RAFT_SNAPSHOT => {
                let (vote, meta, data): (types::Vote, types::SnapshotMeta, Vec<u8>) =
                    decode_request(&payload).map_err(bad_request)?;
                self.heard_from_a_leader();
                let snapshot = types::Snapshot {
                    meta,
                    snapshot: data,
                };
                let answer: Result<_, RaftError<TypeConfig>> = self
                    .raft
                    .install_full_snapshot(vote, snapshot)
                    .await
                    .map_err(RaftError::Fatal);
                encode_answer(&answer)
            }
            METHOD_RAFT_TRANSFER_LEADER => {
                let request = decode_request(&payload).map_err(bad_request)?;
                encode_answer(&self.raft.handle_transfer_leader(request).await)
            }
            METHOD_JOIN => {
                let request: JoinRequest = decode_request(&payload).map_err(bad_request)?;
                encode_answer(&self.serve_join(request).await?)
            }
            METHOD_PROPOSE => {
                let proposal: Proposal = decode_request(&payload).map_err(bad_request)?;
                encode_answer(&self.serve_proposal(proposal).await?)
            }
            METHOD_HEARTBEAT => {
                let report: NodeReport = decode_request(&payload).map_err(bad_request)?;
                if let Caller::Member(node) = caller {
                    if node != report.node_id {
                        return Err(bad_request(format!(
                            "node {node} sent a report for node {}",
                            report.node_id
                        )));
                    }
                }
                self.record_report(report);
                // The reporter's lease runs from this leader's last quorum acknowledgement at
                // the latest: a leader cut off from its quorum renews nobody's lease.
                // The index it had committed too: the reporter's lease waits until it applied
                // that far ([`Cluster::holds_lease`]); no lease before this leader's own term
                // committed an entry ([`Cluster::lease_committed`]).
                let now = self.config.clock.now();
                let answer: Option<(u64, u64)> = (self.quorum_acked_at())
                    .zip(self.lease_committed())
                    .map(|(acked, committed)| {
                        let acked_ms_ago = now.saturating_duration_since(acked).as_millis() as u64;
                        (acked_ms_ago, committed)
                    });
                encode_answer(&answer)
            }
            METHOD_STATUS => encode_answer(&self.liveness_view()),
            METHOD_TRANSFER_LEADERSHIP => {
                let to: NodeId = decode_request(&payload).map_err(bad_request)?;
                if !self.is_leader() {
                    return Err(RemoteFailure {
                        code: CODE_NOT_LEADER,
                        message: "not the leader".to_string(),
                    });
                }
                self.raft
                    .trigger()
                    .transfer_leader(to)
                    .await
                    .map_err(|error| RemoteFailure {
                        code: CODE_FAILED,
                        message: error.to_string(),
                    })?;
                encode_answer(&())
            }
            METHOD_READ_INDEX => {
                if !self.is_leader() {
                    return Err(RemoteFailure {
                        code: CODE_NOT_LEADER,
                        message: "not the leader".to_string(),
                    });
                }
                let index = self.read_index().await.map_err(|error| RemoteFailure {
                    code: CODE_FAILED,
                    message: error.to_string(),
                })?;
                encode_answer(&index)
            }
            METHOD_SILENCE => {
                let node: NodeId = decode_request(&payload).map_err(bad_request)?;
                match self.local_silence(node) {
                    Some(silence) => encode_answer(&(silence.as_millis() as u64)),
                    None => Err(RemoteFailure {
                        code: CODE_NOT_LEADER,
                        message: "not the leader (or leading for too short a time)".to_string(),
                    }),
                }
            }
            other => Err(bad_request(format!("unknown method {other}"))),
        }
    }

    /// Whether this node heard from the leader (or, as leader, from a quorum) within `lease`:
    /// a node that holds a lease may serve as a volume's primary; the leader gives a primary's
    /// volume to another node only after it has been silent for longer ([`Cluster::silent_for`]).
    /// A lease also needs this node to have applied what the leader had committed when it
    /// gave it: a node back from a partition is given a lease at once, and until its catalog
    /// caught up it would still believe what it believed before (a primary taken over
    /// meanwhile would serve a read from its old copy: simulation seed 94381).
    pub fn holds_lease(&self, lease: Duration) -> bool {
        let now = self.config.clock.now();
        let applied = self.applied_index();
        let mut held = lock(&self.lease);
        if let Some((from, committed)) = held.given {
            if applied >= committed {
                held.from = held.from.max(Some(from));
                held.given = None;
            }
        }
        held.from
            .is_some_and(|from| now.saturating_duration_since(from) < lease)
    }

    /// The leader gave this node a lease running `from` then, when it had committed the log
    /// through `committed`.
    fn lease_given(&self, from: std::time::Instant, committed: u64) {
        let mut held = lock(&self.lease);
        if held.given.is_none_or(|(given, _)| given <= from) {
            held.given = Some((from, committed));
        }
    }

    /// As leader: the index through which the cluster committed the log, once it committed an
    /// entry of this leader's own term (the blank one it appends when elected), and so every
    /// entry an earlier leader committed. `None` before: openraft's cluster-committed index
    /// starts afresh with each term, and a lease given meanwhile would not wait for a node back
    /// from a partition to apply what earlier leaders committed (a primary taken over while it
    /// was cut off served reads from its old copy: simulation seed 80775).
    fn lease_committed(&self) -> Option<u64> {
        let metrics = self.metrics();
        let committed = metrics.cluster_committed?;
        (committed.leader_id.term == metrics.current_term).then_some(committed.index())
    }

    /// As leader with a quorum: how long no report came from `node`, at most how long since an
    /// earlier leader can last have renewed its lease ([`Cluster::earlier_leaders_quiet_since`]).
    fn local_silence(&self, node: NodeId) -> Option<Duration> {
        if self.leads_with_quorum() != Some(true) {
            return None;
        }
        let since = self.earlier_leaders_quiet_since()?;
        let now = self.config.clock.now();
        let liveness = lock(&self.liveness);
        let last = liveness
            .last_report
            .get(&node)
            .map_or(since, |at| (*at).max(since));
        Some(now.saturating_duration_since(last))
    }

    /// As leader: an instant after which no earlier leader renewed any lease. Every lease an
    /// earlier leader gave runs from a moment a quorum of voters acknowledged it (its own; a
    /// follower's is capped by the leader's acknowledgement it came with, see the report
    /// loop); that quorum shares a voter with the one that elected this node, and that voter
    /// told with its vote when it last heard a leader ([`network::Grants`]). So the latest of
    /// those instants, and of this node's own, bounds them all: a primary that was the old
    /// leader is taken over a lease after its death, not a lease after the election. Without
    /// grants (a single voter), from when this node started leading.
    fn earlier_leaders_quiet_since(&self) -> Option<std::time::Instant> {
        let vote = self.metrics().vote;
        let own = *lock(&self.heard_leader_at);
        let voters = lock(&self.grants).heard_leader_by_voters_of(&vote);
        match voters {
            Some(voters) => Some(own.max(voters)),
            None => lock(&self.liveness).leading_since,
        }
    }

    /// This node handles a Raft message only a leader sends.
    fn heard_from_a_leader(&self) {
        *lock(&self.heard_leader_at) = self.config.clock.now();
    }

    /// A read barrier: waits (bounded by the call timeout) until this node applied every
    /// command the cluster committed before the call, asking the leader how far that is. A
    /// read of the catalog afterwards sees what another node changed just before.
    pub async fn catch_up(&self) -> Result<(), MetadataError> {
        let unavailable = |detail: String| MetadataError::Unavailable { detail };
        let leader = self
            .leader()
            .ok_or_else(|| unavailable("no leader".to_string()))?;
        let timeout = self.config.timing.call_timeout;
        let index = if leader == self.identity.node_id {
            self.read_index().await?
        } else {
            let answer = self
                .call_node(leader, METHOD_READ_INDEX, Vec::new(), timeout)
                .await
                .map_err(|error| unavailable(error.to_string()))?;
            postcard::from_bytes(&answer).map_err(|error| unavailable(error.to_string()))?
        };
        if self.wait_applied(index, timeout).await {
            Ok(())
        } else {
            Err(MetadataError::Timeout {
                detail: format!("this node did not apply up to index {index} in {timeout:?}"),
            })
        }
    }

    /// As leader: an index covering every command committed before the call, once a quorum
    /// confirmed this node still leads.
    async fn read_index(&self) -> Result<u64, MetadataError> {
        self.raft
            .ensure_linearizable(ReadPolicy::ReadIndex)
            .await
            .map(|read| read.index())
            .map_err(|error| MetadataError::Unavailable {
                detail: error.to_string(),
            })
    }

    /// How long the leader has heard nothing from `node` (asked of the leader).
    pub async fn silent_for(&self, node: NodeId) -> Result<Duration, MetadataError> {
        if let Some(silence) = self.local_silence(node) {
            return Ok(silence);
        }
        let unavailable = |detail: String| MetadataError::Unavailable { detail };
        let leader = self
            .leader()
            .ok_or_else(|| unavailable("no leader".to_string()))?;
        if leader == self.identity.node_id {
            return Err(unavailable("this leader has no quorum yet".to_string()));
        }
        let payload =
            postcard::to_allocvec(&node).map_err(|error| unavailable(error.to_string()))?;
        let answer = self
            .call_node(
                leader,
                METHOD_SILENCE,
                payload,
                self.config.timing.call_timeout,
            )
            .await
            .map_err(|error| unavailable(error.to_string()))?;
        let millis: u64 =
            postcard::from_bytes(&answer).map_err(|error| unavailable(error.to_string()))?;
        Ok(Duration::from_millis(millis))
    }

    fn record_report(&self, report: NodeReport) {
        let now = self.config.clock.now();
        let mut liveness = lock(&self.liveness);
        let skew = report.sent_unix_ms - self.config.clock.wall_unix_ms();
        liveness.skew_ms.insert(report.node_id, skew);
        liveness.last_report.insert(report.node_id, now);
        liveness.reports.insert(report.node_id, report);
    }

    /// What this node (as leader) knows of each node's reports.
    fn liveness_view(&self) -> Vec<NodeLiveness> {
        let now = self.config.clock.now();
        let liveness = lock(&self.liveness);
        liveness
            .reports
            .iter()
            .map(|(node, report)| NodeLiveness {
                node: *node,
                last_report_ms_ago: liveness
                    .last_report
                    .get(node)
                    .map(|at| now.saturating_duration_since(*at).as_millis() as u64),
                clock_skew_ms: liveness.skew_ms.get(node).copied().unwrap_or(0),
                report: report.clone(),
            })
            .collect()
    }

    /// Whether this node's record says what its configuration says (addresses, labels,
    /// devices); a restart with new settings is recorded by [`Command::NodeUpdate`].
    fn record_is_current(&self) -> bool {
        let state = self.catalog.read();
        state
            .nodes
            .get(&self.identity.node_id)
            .is_none_or(|record| {
                record.addresses == self.addresses()
                    && record.labels == self.config.labels
                    && record.devices == self.config.devices
            })
    }

    fn spawn_background(self: &Arc<Self>) {
        let mut tasks = lock(&self.tasks);
        tasks.push(tokio::spawn(report_loop(Arc::downgrade(self))));
        tasks.push(tokio::spawn(leader_loop(Arc::downgrade(self))));
    }

    fn own_report(&self) -> NodeReport {
        let mut report = match self.reporter.get() {
            Some(reporter) => reporter(),
            None => NodeReport::default(),
        };
        report.node_id = self.identity.node_id;
        report.sent_unix_ms = self.config.clock.wall_unix_ms();
        report.version = env!("CARGO_PKG_VERSION").to_string();
        report
    }

    /// The cluster as this node sees it (liveness from the leader when it can be asked).
    pub async fn status(&self) -> ClusterStatus {
        let metrics = self.metrics();
        let leader = metrics.current_leader;
        let liveness: Option<Vec<NodeLiveness>> = if metrics.state == ServerState::Leader {
            Some(self.liveness_view())
        } else if let Some(leader) = leader {
            match self
                .call_node(
                    leader,
                    METHOD_STATUS,
                    Vec::new(),
                    self.config.timing.call_timeout,
                )
                .await
            {
                Ok(bytes) => postcard::from_bytes(&bytes).ok(),
                Err(_) => None,
            }
        } else {
            None
        };
        let membership = metrics.membership_config.membership().clone();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let learners: BTreeSet<NodeId> = membership.learner_ids().collect();
        let state = self.catalog.read();
        let provisioned = state.provisioned_bytes();
        let by_node: HashMap<NodeId, NodeLiveness> = liveness
            .iter()
            .flatten()
            .map(|entry| (entry.node, entry.clone()))
            .collect();
        let nodes: Vec<NodeStatus> = state
            .nodes
            .values()
            .map(|record| NodeStatus {
                raft_role: if voters.contains(&record.id) {
                    RaftRole::Voter
                } else if learners.contains(&record.id) {
                    RaftRole::Learner
                } else {
                    RaftRole::None
                },
                leader: leader == Some(record.id),
                provisioned_bytes: provisioned.get(&record.id).copied().unwrap_or(0),
                nearfull: state.nearfull.contains(&record.id),
                liveness: by_node.get(&record.id).cloned(),
                record: record.clone(),
            })
            .collect();
        // A leader cut off from its quorum is no leader for health purposes: it cannot commit.
        let effective_leader = if self.leads_with_quorum() == Some(false) {
            None
        } else {
            leader
        };
        let health = membership::health(
            &self.config,
            effective_leader,
            &nodes,
            liveness.is_some(),
            voters.len(),
        );
        ClusterStatus {
            cluster_id: hex::encode(self.identity.cluster_id),
            node_id: self.identity.node_id,
            leader,
            term: metrics.current_term,
            last_applied_index: metrics.last_applied.map(|id| id.index()),
            last_purged_index: metrics.purged.map(|id| id.index()),
            membership_changing: membership.get_joint_config().len() > 1,
            nodes,
            health,
        }
    }

    /// Marks a node as leaving (its voter seat goes to another node) or back.
    pub async fn drain(&self, node: NodeId, draining: bool) -> Result<(), MetadataError> {
        self.propose_async(Command::NodeSetDraining { id: node, draining })
            .await
            .map(|_| ())
    }

    /// Hands Raft leadership to the voter `to` (before maintenance on the leader's machine, or
    /// to place it): the leader starts an election on `to`, which the other voters join at
    /// once. Returns once this node sees `to` lead; asked of a follower, it asks the leader.
    pub async fn transfer_leadership(&self, to: NodeId) -> Result<(), MetadataError> {
        let metrics = self.metrics();
        if !metrics.membership_config.voter_ids().any(|id| id == to) {
            return Err(MetadataError::Refused(
                keel_catalog::CatalogError::Invalid {
                    subject: format!("node {to}"),
                    detail: "only a metadata voter can lead (see `keel node list`)".to_string(),
                },
            ));
        }
        let unavailable = |detail: String| MetadataError::Unavailable { detail };
        match metrics.current_leader {
            Some(leader) if leader == to => return Ok(()),
            Some(leader) if leader == self.identity.node_id => self
                .raft
                .trigger()
                .transfer_leader(to)
                .await
                .map_err(|error| unavailable(error.to_string()))?,
            Some(leader) => {
                let payload =
                    postcard::to_allocvec(&to).map_err(|error| unavailable(error.to_string()))?;
                self.call_node(
                    leader,
                    METHOD_TRANSFER_LEADERSHIP,
                    payload,
                    self.config.timing.call_timeout,
                )
                .await
                .map_err(|error| unavailable(error.to_string()))?;
            }
            None => return Err(unavailable("no leader".to_string())),
        }
        let clock = self.config.clock.clone();
        let deadline = clock.now() + self.config.timing.propose_timeout;
        while self.leader() != Some(to) {
            if clock.now() >= deadline {
                return Err(MetadataError::Timeout {
                    detail: format!("node {to} did not take the leadership over"),
                });
            }
            clock.sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Removes a node from the cluster for good (its id is never reused).
    pub async fn remove(&self, node: NodeId) -> Result<(), MetadataError> {
        if node == self.identity.node_id {
            return Err(MetadataError::Refused(
                keel_catalog::CatalogError::Invalid {
                    subject: self.config.name.clone(),
                    detail: "a node cannot remove itself; ask another member".to_string(),
                },
            ));
        }
        self.propose_async(Command::NodeRemove { id: node })
            .await
            .map(|_| ())
    }

    /// Stops this node's Raft and background tasks.
    pub async fn shutdown(&self) {
        self.stopping.send_replace(true);
        let tasks: Vec<_> = lock(&self.tasks).drain(..).collect();
        for task in tasks {
            task.abort();
        }
        if let Err(error) = self.raft.shutdown().await {
            tracing::warn!(%error, "raft did not shut down cleanly");
        }
    }

    /// Whether [`Cluster::shutdown`] was called: layers above stop their own work with it.
    pub fn is_stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    /// Whether this node's Raft stopped: shut down, or on a fatal error (its store failed
    /// applying an entry). Nothing proposed here is made or learnt any more.
    pub fn raft_stopped(&self) -> bool {
        use openraft::async_runtime::watch::WatchReceiver;
        self.raft.metrics().borrow_watched().state == ServerState::Shutdown
    }

    /// Waits until this node's Raft stopped ([`Cluster::raft_stopped`]).
    pub async fn raft_stopped_wait(&self) {
        use openraft::async_runtime::watch::WatchReceiver;
        let mut metrics = self.raft.metrics();
        loop {
            if metrics.borrow_watched().state == ServerState::Shutdown {
                return;
            }
            if metrics.changed().await.is_err() {
                return;
            }
        }
    }

    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    /// Index of the last entry this node applied.
    pub fn applied_index(&self) -> u64 {
        *self.state_machine.applied_index().borrow()
    }
}

/// A node's lease: the leader's acknowledgement of its reports, counted only once the node
/// applied what the leader had committed then.
#[derive(Debug, Default)]
struct Lease {
    /// The lease this node holds runs from here.
    from: Option<std::time::Instant>,
    /// The latest lease given, and the index the leader had committed then: it replaces
    /// `from` once this node applied that far. Until then an earlier lease still counts
    /// (no take-over happens while it runs: the leader waits it out).
    given: Option<(std::time::Instant, u64)>,
}

/// A node's liveness as the leader sees it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeLiveness {
    pub node: NodeId,
    pub last_report_ms_ago: Option<u64>,
    pub clock_skew_ms: i64,
    pub report: NodeReport,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RaftRole {
    Voter,
    Learner,
    None,
}

impl RaftRole {
    pub fn name(self) -> &'static str {
        match self {
            RaftRole::Voter => "voter",
            RaftRole::Learner => "learner",
            RaftRole::None => "none",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeStatus {
    pub record: NodeRecord,
    pub raft_role: RaftRole,
    pub leader: bool,
    /// The logical sizes of the volumes with a replica on the node, summed: what placement
    /// weighs against the node's capacity ([`keel_catalog::CatalogState::provisioned_bytes`]).
    pub provisioned_bytes: u64,
    /// Recorded as nearly full (its own report, `NodeSetNearfull`): no new replica goes there.
    pub nearfull: bool,
    pub liveness: Option<NodeLiveness>,
}

/// One health finding: a stable code, a severity, what is wrong and what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthCheck {
    pub code: String,
    /// `warn` or `error`.
    pub severity: String,
    pub message: String,
    pub action: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterStatus {
    pub cluster_id: String,
    pub node_id: NodeId,
    pub leader: Option<NodeId>,
    pub term: u64,
    pub last_applied_index: Option<u64>,
    /// Raft entries up to this index are gone from this node's log (in its last snapshot).
    pub last_purged_index: Option<u64>,
    /// A change of the voters is under way on this node (Raft's joint configuration: the old
    /// and the new voters each need a majority until it ends). `raft_role` lists both sets.
    pub membership_changing: bool,
    pub nodes: Vec<NodeStatus>,
    pub health: Vec<HealthCheck>,
}

impl Metadata for Cluster {
    fn propose(&self, command: Command) -> Result<Outcome, MetadataError> {
        let future = self.propose_async(command);
        match tokio::runtime::Handle::try_current() {
            // Called from inside the runtime (a worker thread): let it block here.
            Ok(_) => tokio::task::block_in_place(|| self.runtime.block_on(future)),
            Err(_) => self.runtime.block_on(future),
        }
    }

    fn catch_up(&self) -> Result<(), MetadataError> {
        let future = Cluster::catch_up(self);
        match tokio::runtime::Handle::try_current() {
            Ok(_) => tokio::task::block_in_place(|| self.runtime.block_on(future)),
            Err(_) => self.runtime.block_on(future),
        }
    }

    fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    fn local_node(&self) -> NodeId {
        self.identity.node_id
    }
}

/// Every node: report to the leader each interval.
async fn report_loop(cluster: Weak<Cluster>) {
    loop {
        let Some(strong) = cluster.upgrade() else {
            return;
        };
        let interval = strong.config.timing.report_interval;
        let strong_clock = strong.config.clock.clone();
        if !strong.record_is_current() && strong.leader().is_some() {
            let command = Command::NodeUpdate {
                id: strong.identity.node_id,
                addresses: strong.addresses(),
                labels: strong.config.labels.clone(),
                devices: strong.config.devices.clone(),
            };
            match strong.propose_async(command).await {
                Ok(_) => tracing::info!("recorded this node's new addresses, labels or devices"),
                Err(error) => tracing::info!(%error, "could not record this node's settings yet"),
            }
        }
        let report = strong.own_report();
        let sent = strong_clock.now();
        if strong.is_leader() {
            // Noted here too (every report interval), not only at the leader loop's next tick:
            // a take-over waits out the primary's silence counted from here.
            lock(&strong.liveness).leading_since.get_or_insert(sent);
            strong.record_report(report);
            if let Some((acked, committed)) =
                (strong.quorum_acked_at()).zip(strong.lease_committed())
            {
                strong.lease_given(acked, committed);
            }
        } else if let Some(leader) = strong.leader() {
            match postcard::to_allocvec(&report) {
                Ok(payload) => {
                    match strong
                        .call_node(leader, METHOD_HEARTBEAT, payload, interval * 2)
                        .await
                    {
                        Ok(answer) => match postcard::from_bytes::<Option<(u64, u64)>>(&answer) {
                            Ok(Some((acked_ms_ago, committed))) => {
                                let acked = strong_clock
                                    .now()
                                    .checked_sub(Duration::from_millis(acked_ms_ago));
                                if let Some(acked) = acked {
                                    strong.lease_given(sent.min(acked), committed);
                                }
                            }
                            Ok(None) => {
                                tracing::debug!("the leader has no quorum, or its term committed nothing yet: no lease")
                            }
                            Err(error) => tracing::warn!(%error, "bad answer to a report"),
                        },
                        Err(error) => tracing::debug!(%error, "could not report to the leader"),
                    }
                }
                Err(error) => tracing::warn!(%error, "could not encode this node's report"),
            }
        }
        let mut stopping = strong.stopping.subscribe();
        drop(strong);
        tokio::select! {
            biased;
            _ = strong_clock.sleep(interval) => {}
            _ = stopping.wait_for(|stop| *stop) => return,
        }
    }
}

/// The leader: liveness verdicts and the voter set, each interval.
async fn leader_loop(cluster: Weak<Cluster>) {
    loop {
        let Some(strong) = cluster.upgrade() else {
            return;
        };
        let interval = strong.config.timing.membership_interval;
        let strong_clock = strong.config.clock.clone();
        if strong.is_leader() {
            strong.judge_liveness().await;
            if let Err(error) = strong.reconcile_voters().await {
                tracing::info!(%error, "could not adjust the voter set yet");
            }
        } else {
            lock(&strong.liveness).leading_since = None;
        }
        let mut stopping = strong.stopping.subscribe();
        drop(strong);
        tokio::select! {
            biased;
            _ = strong_clock.sleep(interval) => {}
            _ = stopping.wait_for(|stop| *stop) => return,
        }
    }
}

impl Cluster {
    /// Records through Raft which nodes are up, suspect or down.
    async fn judge_liveness(&self) {
        let now = self.config.clock.now();
        let verdicts: Vec<(NodeId, NodeState)> = {
            let mut liveness = lock(&self.liveness);
            let since = *liveness.leading_since.get_or_insert(now);
            let state = self.catalog.read();
            state
                .members()
                .filter(|node| node.id != self.identity.node_id)
                .map(|node| {
                    // Silence is counted from when this node started leading at the latest: a
                    // new leader has not heard anyone yet.
                    let heard = liveness
                        .last_report
                        .get(&node.id)
                        .copied()
                        .map(|at| at.max(since))
                        .unwrap_or(since);
                    let silent = now.saturating_duration_since(heard);
                    let verdict = membership::verdict(&self.config.timing, silent);
                    (node.id, verdict)
                })
                .filter(|(id, verdict)| {
                    state
                        .nodes
                        .get(id)
                        .is_some_and(|node| node.state != *verdict)
                })
                .collect()
        };
        let mut changes = verdicts;
        let own_state = self
            .catalog
            .read()
            .nodes
            .get(&self.identity.node_id)
            .map(|node| node.state);
        if own_state.is_some_and(|state| state != NodeState::Up) {
            changes.push((self.identity.node_id, NodeState::Up));
        }
        for (node, state) in changes {
            tracing::info!(node, state = state.name(), "node liveness changed");
            if let Err(error) = self
                .propose_async(Command::NodeSetState {
                    id: node,
                    state,
                    at_unix_ms: self.config.clock.wall_unix_ms(),
                })
                .await
            {
                tracing::info!(%error, "could not record a liveness change");
                return;
            }
        }
    }

    /// Adds missing learners and moves the voter set toward the target.
    async fn reconcile_voters(&self) -> Result<(), ClusterError> {
        let metrics = self.metrics();
        if metrics
            .membership_config
            .membership()
            .get_joint_config()
            .len()
            > 1
        {
            // A joint configuration is in flight; openraft finishes it.
            return Ok(());
        }
        let membership = metrics.membership_config.membership().clone();
        let in_raft: BTreeSet<NodeId> = membership.nodes().map(|(id, _)| *id).collect();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let members: Vec<NodeRecord> = self.catalog.read().members().cloned().collect();
        let removed: Vec<NodeId> = self
            .catalog
            .read()
            .nodes
            .values()
            .filter(|node| node.removed && in_raft.contains(&node.id))
            .map(|node| node.id)
            .collect();
        // Members the log does not reach yet (an add_learner lost with a leader change).
        for member in &members {
            if !in_raft.contains(&member.id) {
                let node = RaftNode {
                    name: member.name.clone(),
                    address: member.addresses.cluster.clone(),
                };
                self.raft
                    .add_learner(member.id, node, false)
                    .await
                    .map_err(raft_error)?;
            }
        }
        // Members whose cluster address changed since Raft learnt it (a restart elsewhere).
        let moved: BTreeMap<NodeId, RaftNode> = members
            .iter()
            .filter(|member| {
                membership
                    .nodes()
                    .any(|(id, node)| *id == member.id && node.address != member.addresses.cluster)
            })
            .map(|member| {
                (
                    member.id,
                    RaftNode {
                        name: member.name.clone(),
                        address: member.addresses.cluster.clone(),
                    },
                )
            })
            .collect();
        if !moved.is_empty() {
            tracing::info!(nodes = ?moved.keys().collect::<Vec<_>>(), "updating node addresses in raft");
            self.raft
                .change_membership(ChangeMembers::SetNodes(moved), true)
                .await
                .map_err(raft_error)?;
            return Ok(());
        }
        let last_index = metrics.last_log_index.unwrap_or(0);
        let caught_up: BTreeSet<NodeId> = match &metrics.replication {
            Some(replication) => replication
                .iter()
                .filter(|(_, matched)| {
                    matched.as_ref().is_some_and(|id| {
                        id.index() + membership::CAUGHT_UP_LAG_ENTRIES >= last_index
                    })
                })
                .map(|(id, _)| *id)
                .collect(),
            None => BTreeSet::new(),
        };
        let desired = membership::desired_voters(
            self.config.voters,
            self.identity.node_id,
            &voters,
            &members,
            &caught_up,
        );
        if desired != voters && !desired.is_empty() {
            tracing::info!(?voters, ?desired, "changing the voter set");
            self.raft
                .change_membership(ChangeMembers::ReplaceAllVoters(desired), true)
                .await
                .map_err(raft_error)?;
        }
        if !removed.is_empty() {
            let removed: BTreeSet<NodeId> = removed.into_iter().collect();
            if removed
                .iter()
                .all(|node| !self.raft_voters().contains(node))
            {
                tracing::info!(?removed, "removing nodes from the raft group");
                self.raft
                    .change_membership(ChangeMembers::RemoveNodes(removed), false)
                    .await
                    .map_err(raft_error)?;
            }
        }
        Ok(())
    }

    fn raft_voters(&self) -> BTreeSet<NodeId> {
        self.metrics().membership_config.voter_ids().collect()
    }
}
