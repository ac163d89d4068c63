//! keel-replication: synchronous replication of volumes across nodes.
//!
//! The contract (`docs/volumes.md`, replication): a FLUSH is acknowledged only when every write
//! acknowledged before it is durable on every member of the volume's in-sync replica set (ISR),
//! which Raft records per volume as `{epoch, primary, in_sync}`; a member that stops answering
//! is removed from the ISR through Raft (epoch + 1) before a FLUSH completes without it;
//! replicas refuse writes from a node that is not the primary of their current epoch, so a
//! primary that lost its place cannot get a FLUSH acknowledged.
//!
//! - [`protocol`]: the protocol's core as a pure state machine, checked exhaustively with
//!   stateright in `tests/model.rs` against crashes, lost and reordered messages. It is the
//!   specification: the engine follows its rules without running it.
//! - [`Replication`]: the engine. A client attaching to a replicated volume on a node that
//!   holds a replica makes that node the volume's primary ([`Replication::open`]); the
//!   primary ([`primary`]) streams the volume's own writes (offset, data) to the replicas
//!   over the cluster's transport; the replica side ([`replica`]) applies them in order to
//!   its local volume. Nothing below this crate knows about other nodes.

mod attached;
mod buffers;
mod dirty;
mod forward;
pub mod primary;
pub mod protocol;
pub mod replica;
mod turns;
pub mod wire;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use keel_catalog::{Command, Metadata, MetadataError, NodeId, VolumeRecord};
use keel_cluster::{BoxFuture, Caller, Handler, RemoteFailure};
use keel_volume::{VolumeError, VolumeIo, VolumeResult};

use crate::attached::Attached;
pub use crate::dirty::Point;
use crate::dirty::{Chunks, ShutdownNote};
pub use crate::forward::Forwarded;
use crate::forward::{Served, Sessions};
use crate::primary::{Failure, Primary, PrimaryStatus};
use crate::replica::Replicas;
use crate::wire::{
    ForwardClose, ForwardOpen, ForwardRequest, CODE_BAD_REQUEST, CODE_NOT_FOUND, CODE_REFUSED,
    CODE_SESSION_GONE, METHOD_CHANGED, METHOD_COPY_TURN, METHOD_FORWARD_CLOSE, METHOD_FORWARD_IO,
    METHOD_FORWARD_OPEN, METHOD_HANDED_OFF, METHOD_HAND_OVER, METHOD_HASHES, METHOD_PRIMARY_STATUS,
    METHOD_READ_COPY, METHOD_REPLICATE, METHOD_SNAPSHOT_HASHES, METHOD_SNAPSHOT_READ,
    METHOD_SNAPSHOT_REPAIR, METHOD_UNWRITTEN,
};

/// A primary serves only while it heard from the Raft leader within this.
pub const LEASE: Duration = Duration::from_secs(2);
/// Another node takes a volume over only after the leader heard nothing from its primary for
/// this long: the lease plus a margin for clock-rate drift and a report in flight.
pub const TAKE_OVER_SILENCE: Duration = Duration::from_millis(2500);
/// How often a node keeps its common point with another for a volume, at most, unless
/// [`Settings::point_every`] says otherwise (each is a small store write; an older point only
/// widens a later catch-up).
pub const POINT_EVERY: Duration = Duration::from_millis(100);
/// The unit a resync compares and ships.
pub const RESYNC_CHUNK_BYTES: u64 = 1 << 20;
/// The stretch a catch-up first asks about as a whole: skipped when neither side ever wrote
/// it (a fresh or sparse volume), else compared chunk by chunk.
pub const RESYNC_PROBE_BYTES: u64 = 64 << 20;
/// How long attaching waits for enough replicas to be in sync to accept writes; after it the
/// client is attached anyway (reads work, writes fail with the reason until enough replicas
/// caught up). Well under an NBD client's handshake timeout.
const ATTACH_WAIT_FOR_IN_SYNC: Duration = Duration::from_secs(10);
/// How often an attach tries again when R crossed between one replica and more while it
/// waited for the attach lock (each change of R takes a Raft round trip: more in a row means
/// someone keeps changing it).
const ATTACH_TRIES: usize = 3;
/// How long a node where a client attaches waits for the primary to hand it the volume
/// ([`wire::METHOD_HAND_OVER`]: a quiesce of a volume no client uses and a Raft round), and
/// then for its own catalog to name it the primary.
const HAND_OVER_WAIT: Duration = Duration::from_secs(5);

/// How long a node waits for a volume's primary to say how it serves the volume
/// ([`Replication::primary_status_anywhere`]): `keel status` waits for it.
const STATUS_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// Runs blocking work (store I/O) off the async runtime's workers, from engine tasks. (Client
/// I/O runs its store work inline on the client's own thread.)
#[cfg(not(feature = "simulation"))]
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| format!("a blocking task failed: {error}"))
}

/// In the simulation store work runs inline: a blocking-pool thread finishing in real time
/// would make the order of events depend on the machine, not on the seed.
#[cfg(feature = "simulation")]
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    Ok(work())
}

/// Runs blocking work a caller waits for at once (a replica applying a batch the primary's
/// FLUSH waits for) on the calling task's own thread, the runtime moving its other tasks to
/// another thread meanwhile: no hand-over to a pool thread and back on the path a FLUSH
/// waits on (two thread wake-ups, tens of µs each on a busy machine). A current-thread
/// runtime (tests) cannot give its thread away: there the work goes to the pool. A panic in
/// `work` is an error, as [`blocking`]'s is.
#[cfg(not(feature = "simulation"))]
pub(crate) async fn blocking_in_place<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    match tokio::runtime::Handle::current().runtime_flavor() {
        tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(|| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))
                .map_err(|_| "a blocking task panicked".to_string())
        }),
        _ => blocking(work).await,
    }
}

/// In the simulation, as all store work there: inline ([`blocking`]).
#[cfg(feature = "simulation")]
pub(crate) async fn blocking_in_place<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    blocking(work).await
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Opens this node's own copy of a volume (the local volume engine).
pub trait LocalVolumes: Send + Sync + 'static {
    fn open_local(&self, name: &str) -> VolumeResult<Arc<dyn VolumeIo>>;
    /// [`LocalVolumes::open_local`] for applying a primary's writes to this node's copy: this
    /// node serves no reads of it while it is a replica, so its writes stay out of the page
    /// cache.
    fn open_replica(&self, name: &str) -> VolumeResult<Arc<dyn VolumeIo>>;
    /// A read-only handle on this node's copy of `volume@snapshot` (refused when the copy does
    /// not hold the snapshot whole).
    fn open_local_snapshot(&self, volume: &str, snapshot: &str) -> VolumeResult<Arc<dyn VolumeIo>>;
    /// A read-only handle on this node's copy of the snapshot at `generation` of volume
    /// `volume_id`: with `repair`, through the generation reserved for repairing this copy
    /// (whole or not); without, refused unless the copy holds the snapshot whole.
    fn open_snapshot_copy(
        &self,
        volume_id: u64,
        generation: u64,
        repair: Option<u64>,
    ) -> VolumeResult<Arc<dyn VolumeIo>>;
    /// Writes `runs` (whole blocks at an offset each) into the generation `repair` reserved
    /// for repairing this node's copy of the snapshot at `generation`; durable on return.
    fn write_snapshot_repair(
        &self,
        volume_id: u64,
        generation: u64,
        repair: u64,
        runs: &[(u64, &[u8])],
    ) -> VolumeResult<()>;
    /// Keeps `value` as the record `name` about this node's copy of volume `volume_id` (the
    /// store erases such records with the copy), replacing the one before. With `sync` it is
    /// durable on return; otherwise the store's next sync makes it durable, in order with
    /// every write before it.
    fn keep_record(
        &self,
        volume_id: u64,
        name: &[u8],
        value: Vec<u8>,
        sync: bool,
    ) -> VolumeResult<()>;
    /// The record `name` about this node's copy of volume `volume_id`.
    fn record(&self, volume_id: u64, name: &[u8]) -> VolumeResult<Option<Vec<u8>>>;
    /// Deletes the record `name` about this node's copy of volume `volume_id`, durably.
    fn forget_record(&self, volume_id: u64, name: &[u8]) -> VolumeResult<()>;
    /// The store sequence of this node's last committed write: every write committed later
    /// gets a greater one.
    fn committed_sequence(&self) -> u64;
    /// Whether this node's store is about to refuse writes for want of space
    /// (`keel_store::Store::space_low`). Free space that cannot be read is not low here: the
    /// store's own writes report that error.
    fn space_low(&self) -> bool;
    /// Calls `changed(offset, length)` for each block of volume `volume_id` (named `name`)
    /// written, or trimmed, after store sequence `since`.
    fn changed_since(
        &self,
        name: &str,
        volume_id: u64,
        since: u64,
        changed: &mut dyn FnMut(u64, u64),
    ) -> VolumeResult<()>;
}

/// The record about a copy that says what its replicas lacked when this node stopped cleanly.
const NOTE_RECORD: &[u8] = b"replication/lacking";

/// The record about a copy that holds its common point with `peer` ([`Point`]).
fn point_record(peer: NodeId) -> Vec<u8> {
    let mut name = b"replication/common/".to_vec();
    name.extend_from_slice(&peer.to_be_bytes());
    name
}

/// Bytes this node sent and received as replication traffic (tests and `volume info`).
#[derive(Default)]
pub struct Counters {
    received_bytes: AtomicU64,
    handed_off: AtomicU64,
    copied_off: AtomicU64,
}

impl Counters {
    pub(crate) fn received(&self, bytes: u64) {
        self.received_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn received_bytes(&self) -> u64 {
        self.received_bytes.load(Ordering::Relaxed)
    }

    /// Volumes this node handed to another replica because it was draining.
    pub fn handed_off(&self) -> u64 {
        self.handed_off.load(Ordering::Relaxed)
    }

    /// Replicas on a draining node this node began copying to another node before they go
    /// (`VolumeCopyOffDraining` recorded): the one replica of an R=1 volume on this node, or,
    /// as a volume's primary, a replica on another node.
    pub fn copied_off(&self) -> u64 {
        self.copied_off.load(Ordering::Relaxed)
    }
}

/// Where a change of R puts or takes a replica when the user names the node
/// (`keel volume set-replication --add-to/--remove-from`, which `keel volume move` uses);
/// otherwise [`Replication::set_replicas`] chooses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Placement {
    /// Raising R: the first replica added goes to this node.
    pub add_to: Option<NodeId>,
    /// Lowering R: this replica leaves first (never the primary's).
    pub remove_from: Option<NodeId>,
}

/// How the engine behaves (from the server's configuration).
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// How long a replica's node may stay down before the replica is rebuilt on another node
    /// (draining and removed nodes: at once).
    pub move_after: Duration,
    /// Most bytes per second a resync ships to one replica; `None`: unlimited.
    pub resync_bytes_per_second: Option<u64>,
    /// The share of the time (1 to 100 %) a resync works while clients are active on the
    /// primary's node or the replica's (any volume or bucket); 100: it never yields.
    pub resync_busy_percent: u8,
    /// Whether primaries copy snapshots' data to the in-sync replicas whose copy lacks it
    /// (paced as a resync); off, such copies stay incomplete and are served by the others.
    pub snapshot_repair: bool,
    /// Most whole-volume catch-ups (a replica added, moved or copied off a draining node, or
    /// one with no common point) this node sends at once, and, separately, most it receives
    /// at once (`crate::turns`); the others wait their turn. At least 1.
    pub rebuilds_max: usize,
    /// How often a node keeps its common point with another for a volume, at most
    /// ([`POINT_EVERY`]).
    pub point_every: Duration,
}

/// What the primary side and the replica side share.
pub(crate) struct Shared {
    pub metadata: Arc<dyn Metadata>,
    pub cluster: Arc<keel_cluster::Cluster>,
    pub transport: Arc<dyn keel_cluster::Transport>,
    pub local: Arc<dyn LocalVolumes>,
    pub local_node: NodeId,
    pub runtime: tokio::runtime::Handle,
    pub replicas: Replicas,
    pub counters: Counters,
    pub resync_bytes_per_second: Option<u64>,
    pub resync_busy_percent: u8,
    pub snapshot_repair: bool,
    /// Turns for whole-volume catch-ups sent from this node ([`Settings::rebuilds_max`]).
    pub rebuilds: Arc<tokio::sync::Semaphore>,
    /// Turns for those this node receives (the same limit).
    pub receiving: turns::ReceiveTurns,
    pub point_every: Duration,
    /// Counts this node's client requests (every frontend): a resync yields while they come.
    pub activity: keel_ops::Ops,
    /// Per volume, what the clients forwarding through this node left unflushed.
    pub forwarding: Mutex<HashMap<String, Weak<forward::Unflushed>>>,
    /// Every forwarding handle opened here, while it lives ([`Replication::forwarded_clients`]).
    pub(crate) forwarded: Mutex<Vec<Weak<Forwarded>>>,
    /// Streams begun here (the simulation derives their ids from it).
    pub streams_begun: AtomicU64,
    /// What whole copies from this node read their chunks into.
    pub chunk_buffers: Arc<buffers::ChunkBuffers>,
    /// Clients' writes look at free space now and then ([`Shared::wrote`]).
    pub space: SpaceWatch,
    /// Per volume, the epoch a primary's hand-off to this node made ([`wire::HandedOff`]):
    /// every replica in sync then held the same writes, durable, so this node serves that
    /// epoch's successor keeping them in sync. Only in memory: a node that restarts catches
    /// them up as after any take-over.
    pub handed_here: Mutex<HashMap<u64, u64>>,
}

/// Clients reaching an export through this node forwarded to another node ([`Forwarded`]):
/// slower than attaching through the node serving it (one more round trip per request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardedClients {
    /// The volume, or `volume@snapshot`.
    pub export: String,
    /// The node their requests go to now.
    pub node: NodeId,
    /// Handles forwarding so: one per attach here (an NBD client's connections share one),
    /// and one per volume whose clients a hand-off left forwarded.
    pub handles: usize,
}

/// How clients' writes notice the store running out of space between the move loop's looks.
pub(crate) struct SpaceWatch {
    /// When the clock started, for `looked_ms`.
    since: Instant,
    /// When a write last read free space, in ms after `since`.
    looked_ms: AtomicU64,
    /// Wakes the move loop to hand the primaries off ([`Replication::hand_off_primaries`]).
    low: tokio::sync::Notify,
}

/// How often clients' writes read free space (a statfs), at most.
const SPACE_LOOK_EVERY: Duration = Duration::from_millis(100);

impl Shared {
    pub(crate) fn clock(&self) -> Arc<dyn keel_clock::Clock> {
        self.cluster.config().clock.clone()
    }

    pub(crate) fn clock_now(&self) -> Instant {
        self.cluster.config().clock.now()
    }

    /// After a client's write here: at most every [`SPACE_LOOK_EVERY`], reads whether the
    /// store is low on space and if so wakes the move loop, which hands the primaries off
    /// before the store refuses writes (a writer fast enough to use the space left within
    /// the move loop's own period would otherwise get there first).
    pub(crate) fn wrote(&self) {
        let now = self.clock_now().saturating_duration_since(self.space.since);
        let now = u64::try_from(now.as_millis()).unwrap_or(u64::MAX);
        let looked = self.space.looked_ms.load(Ordering::Relaxed);
        if now.saturating_sub(looked) < SPACE_LOOK_EVERY.as_millis() as u64
            || (self.space.looked_ms)
                .compare_exchange(looked, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        if self.local.space_low() {
            self.space.low.notify_one();
        }
    }

    pub(crate) fn holds_lease(&self) -> bool {
        self.cluster.holds_lease(LEASE)
    }

    /// Runs blocking work (a store write nobody waits for) in the background; inline in the
    /// simulation, where a thread would finish at a time the seed does not decide.
    pub(crate) fn detached(&self, work: impl FnOnce() + Send + 'static) {
        if cfg!(feature = "simulation") {
            work();
        } else {
            drop(self.runtime.spawn_blocking(work));
        }
    }

    /// A new replication stream's id: unique among the streams any primary of any volume ever
    /// sent a replica (a replica takes a batch as continuing its stream by id and index).
    /// Random; in the simulation derived from the node, the epoch and a count instead (a
    /// node that restarts takes its volumes over in a later epoch).
    pub(crate) fn new_stream_id(&self, volume_id: u64, epoch: u64) -> u64 {
        let count = self.streams_begun.fetch_add(1, Ordering::Relaxed);
        if !cfg!(feature = "simulation") {
            return rand::random::<u64>();
        }
        let mut hasher = blake3::Hasher::new();
        for part in [self.local_node, volume_id, epoch, count] {
            hasher.update(&part.to_le_bytes());
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
        u64::from_le_bytes(id)
    }

    /// The answer for a volume another node serves: its node and client address.
    fn elsewhere(&self, volume: &str, node: NodeId) -> VolumeError {
        VolumeError::Elsewhere {
            volume: volume.to_string(),
            node,
            address: self
                .node_address(node, true)
                .unwrap_or_else(|| "unknown".to_string()),
        }
    }

    /// Refuses (with the primary's address) a change of a replicated volume that another
    /// node serves as primary; one with a single replica is its own node's to change.
    fn refuse_if_served_elsewhere(&self, volume: &str, record: &VolumeRecord) -> VolumeResult<()> {
        let replication = &record.replication;
        if replication.replicas.len() > 1 && replication.primary != self.local_node {
            return Err(self.elsewhere(volume, replication.primary));
        }
        Ok(())
    }

    /// The generations volume `volume_id`'s view excludes now (rollbacks), if it exists: what
    /// a common point taken now is stamped with ([`Point`]).
    pub(crate) fn excluded(&self, volume_id: u64) -> Option<Vec<(u64, u64)>> {
        let catalog = self.metadata.catalog().read();
        let entry = catalog.volumes.get(&volume_id)?;
        Some(
            entry
                .record
                .view
                .first()
                .map(|layer| layer.excluded.clone())
                .unwrap_or_default(),
        )
    }

    /// Keeps this node's common point with `peer` for a volume ([`Point`], stamped with the
    /// view of the FLUSH it was taken at); a failure only leaves the older point, which
    /// widens a later catch-up.
    pub(crate) fn keep_point(&self, name: &str, volume_id: u64, peer: NodeId, point: &Point) {
        // A volume deleted meanwhile: its copy's records are erased with it, not kept again.
        if !self
            .metadata
            .catalog()
            .read()
            .volumes
            .contains_key(&volume_id)
        {
            return;
        }
        let kept = postcard::to_allocvec(point)
            .map_err(|error| error.to_string())
            .and_then(|bytes| {
                self.local
                    .keep_record(volume_id, &point_record(peer), bytes, false)
                    .map_err(|error| error.to_string())
            });
        if let Err(error) = kept {
            tracing::warn!(volume = %name, peer, %error, "keeping a replication point failed");
        }
    }

    /// This node's common point with `peer` for a volume, if it keeps one that decodes.
    fn point(&self, name: &str, volume_id: u64, peer: NodeId) -> VolumeResult<Option<Point>> {
        let Some(bytes) = self.local.record(volume_id, &point_record(peer))? else {
            return Ok(None);
        };
        match postcard::from_bytes(&bytes) {
            Ok(point) => Ok(Some(point)),
            Err(error) => {
                tracing::warn!(volume = %name, peer, %error, "a replication point does not decode; ignoring it");
                Ok(None)
            }
        }
    }

    /// What this node's copy of a volume changed since its common point with `peer`, if it
    /// holds one that still holds (`None`: a catch-up must compare everything).
    pub(crate) fn changed_since_point(
        &self,
        name: &str,
        volume_id: u64,
        peer: NodeId,
    ) -> VolumeResult<Option<Chunks>> {
        let Some(point) = self.point(name, volume_id, peer)? else {
            return Ok(None);
        };
        let Some(since) = self
            .excluded(volume_id)
            .and_then(|excluded| point.holds(&excluded))
        else {
            return Ok(None);
        };
        let mut chunks = Chunks::default();
        self.local
            .changed_since(name, volume_id, since, &mut |offset, length| {
                chunks.mark(offset, length)
            })?;
        Ok(Some(chunks))
    }

    /// A volume's catalog record, by name.
    fn volume_record(&self, name: &str) -> VolumeResult<VolumeRecord> {
        self.metadata
            .catalog()
            .read()
            .volume(name)
            .map(|entry| entry.record.clone())
            .ok_or_else(|| VolumeError::NotFound {
                name: name.to_string(),
            })
    }

    fn node_address(&self, node: NodeId, client: bool) -> Option<String> {
        let state = self.metadata.catalog().read();
        let record = state.nodes.get(&node)?;
        Some(if client {
            record
                .addresses
                .nbd
                .clone()
                .unwrap_or_else(|| record.addresses.cluster.clone())
        } else {
            record.addresses.cluster.clone()
        })
    }

    pub(crate) async fn call(
        &self,
        node: NodeId,
        method: u16,
        payload: impl Into<keel_cluster::Payload>,
        timeout: Duration,
    ) -> Result<Vec<u8>, Failure> {
        let payload = payload.into();
        let Some(address) = self.node_address(node, false) else {
            return Err(Failure {
                code: None,
                message: format!("node {node} has no known address"),
            });
        };
        self.transport
            .call(
                keel_cluster::Peer::Node { id: node, address },
                method,
                payload,
                timeout,
            )
            .await
            .map_err(|error| match error {
                keel_cluster::TransportError::Remote { code, message, .. } => Failure {
                    code: Some(code),
                    message,
                },
                other => Failure {
                    code: None,
                    message: other.to_string(),
                },
            })
    }
}

/// A handle of clients attached here that a hand-off switched to forwarding
/// ([`Replication::returning`]).
struct Returning {
    volume_id: u64,
    name: String,
    attached: Weak<Attached>,
}

/// This node's replication engine: the primaries it serves and the replicas it holds.
pub struct Replication {
    shared: Arc<Shared>,
    primaries: Mutex<BTreeMap<u64, Arc<Primary>>>,
    /// Volumes with one replica that clients attached here (raising R switches them over to
    /// a primary).
    singles: Mutex<HashMap<u64, Weak<Attached>>>,
    /// Replicated volumes whose clients attached here reach the primary served here (a
    /// drain's hand-off switches them to forwarding, [`Replication::hand_off_primaries`]).
    clients: Mutex<HashMap<u64, Weak<Attached>>>,
    /// Handles of clients attached here that a hand-off left forwarded, while they live:
    /// brought back once the volume is handed back ([`Replication::bring_clients_back`]).
    returning: Mutex<Vec<Returning>>,
    /// Serializes attaches and replica-set changes (one take-over of a volume at a time). An
    /// attach reads the volume's record again once it holds this: the replicas may have
    /// changed while it waited.
    attaching: tokio::sync::Mutex<()>,
    /// Volumes served here for clients attached to nodes without a replica.
    sessions: Sessions,
    /// This engine, for the RPC handler's blocking tasks.
    this: Weak<Replication>,
    /// How long a replica's node may stay down before its replica moves
    /// ([`Settings::move_after`]).
    move_after: Duration,
    /// [`Settings::rebuilds_max`].
    rebuilds_max: usize,
}

fn unavailable(volume: &str, detail: String) -> VolumeError {
    VolumeError::Unavailable {
        volume: volume.to_string(),
        detail,
    }
}

/// A replication change Raft did not make, as the admin API reports it: refused (a bad
/// request, or another node changed the volume meanwhile), or metadata unreachable.
pub(crate) fn change_error(volume: &str, error: MetadataError) -> VolumeError {
    match error {
        MetadataError::Refused(refusal) => VolumeError::Invalid {
            volume: volume.to_string(),
            detail: refusal.to_string(),
        },
        other => unavailable(volume, other.to_string()),
    }
}

impl Replication {
    /// Starts the engine. `activity` is the server's request tracker: resyncs yield to the
    /// clients it counts, of any volume or bucket on the node's disks.
    pub fn new(
        cluster: Arc<keel_cluster::Cluster>,
        transport: Arc<dyn keel_cluster::Transport>,
        local: Arc<dyn LocalVolumes>,
        runtime: tokio::runtime::Handle,
        settings: Settings,
        activity: keel_ops::Ops,
    ) -> Arc<Replication> {
        let metadata: Arc<dyn Metadata> = cluster.clone();
        let local_node = metadata.local_node();
        let started = cluster.config().clock.now();
        let replication = Arc::new_cyclic(|this| Replication {
            shared: Arc::new(Shared {
                metadata,
                cluster,
                transport,
                local,
                local_node,
                runtime,
                replicas: Replicas::default(),
                counters: Counters::default(),
                resync_bytes_per_second: settings.resync_bytes_per_second,
                resync_busy_percent: settings.resync_busy_percent,
                snapshot_repair: settings.snapshot_repair,
                rebuilds: Arc::new(tokio::sync::Semaphore::new(settings.rebuilds_max.max(1))),
                receiving: turns::ReceiveTurns::new(settings.rebuilds_max),
                point_every: settings.point_every,
                activity,
                forwarding: Mutex::new(HashMap::new()),
                forwarded: Mutex::new(Vec::new()),
                streams_begun: AtomicU64::new(0),
                handed_here: Mutex::new(HashMap::new()),
                chunk_buffers: Arc::default(),
                space: SpaceWatch {
                    since: started,
                    looked_ms: AtomicU64::new(0),
                    low: tokio::sync::Notify::new(),
                },
            }),
            primaries: Mutex::new(BTreeMap::new()),
            singles: Mutex::new(HashMap::new()),
            clients: Mutex::new(HashMap::new()),
            returning: Mutex::new(Vec::new()),
            attaching: tokio::sync::Mutex::new(()),
            sessions: Sessions::default(),
            this: this.clone(),
            move_after: settings.move_after,
            rebuilds_max: settings.rebuilds_max.max(1),
        });
        replication
            .shared
            .runtime
            .spawn(move_loop(Arc::downgrade(&replication), settings.move_after));
        replication
    }

    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// This node is shutting down (its clients are gone): each primary served here flushes
    /// to its replicas and stops, and what it knew each replica lacks is kept in the store,
    /// so that the next primary of the volume here catches them up with only that (see
    /// [`Replication::shutdown_note`]). Blocking.
    pub fn shutdown(&self) {
        let primaries: Vec<(u64, Arc<Primary>)> = lock(&self.primaries)
            .iter()
            .map(|(id, primary)| (*id, primary.clone()))
            .collect();
        // One wait for all: a replica that does not answer costs it once, not per volume.
        let deadline = self.shared.clock_now() + SHUTDOWN_FLUSH_WAIT;
        for (volume_id, primary) in primaries {
            let Some(note) = primary.stop_for_shutdown(deadline) else {
                continue;
            };
            let kept = postcard::to_allocvec(&note)
                .map_err(|error| error.to_string())
                .and_then(|bytes| {
                    self.shared
                        .local
                        .keep_record(volume_id, NOTE_RECORD, bytes, true)
                        .map_err(|error| error.to_string())
                });
            if let Err(error) = kept {
                tracing::warn!(volume_id, %error, "could not keep what the replicas lack; they will be compared whole");
            }
        }
    }

    /// What the replicas of `volume` lacked when this node last stopped cleanly while serving
    /// it, if its epoch is still the one it had then (`epoch`: the epoch this node just
    /// replaced by attaching): nobody else was its primary, and its replicas did not change.
    /// Otherwise (or if unreadable) nothing: every replica is compared whole. A note serves
    /// one start: it is deleted as it is read.
    fn shutdown_note(&self, volume: &str, volume_id: u64, epoch: u64) -> BTreeMap<NodeId, Chunks> {
        let local = &self.shared.local;
        let taken = local.record(volume_id, NOTE_RECORD).and_then(|note| {
            if note.is_some() {
                local.forget_record(volume_id, NOTE_RECORD)?;
            }
            Ok(note)
        });
        let note = match taken {
            Ok(Some(bytes)) => postcard::from_bytes::<ShutdownNote>(&bytes),
            Ok(None) => return BTreeMap::new(),
            Err(error) => {
                tracing::warn!(volume, %error, "could not read what the replicas lacked at the last shutdown");
                return BTreeMap::new();
            }
        };
        match note.map(|note| (note.epoch, note.lacking_in(epoch))) {
            Ok((_, Some(lacking))) => {
                tracing::info!(
                    volume,
                    epoch,
                    "the replicas are caught up with what they lacked at the last shutdown"
                );
                lacking
            }
            Ok((then, None)) => {
                tracing::info!(
                    volume,
                    then,
                    now = epoch,
                    "the volume changed since the last shutdown: its replicas are compared whole"
                );
                BTreeMap::new()
            }
            Err(error) => {
                tracing::warn!(volume, %error, "unreadable note of what the replicas lacked");
                BTreeMap::new()
            }
        }
    }

    /// Runs `change` (a snapshot, rollback or resize of `volume`) at one point of the volume's
    /// write stream on every replica ([`Primary::quiesce_async`]) when this node serves it as
    /// primary. A replicated volume whose primary is another node is refused with its address;
    /// a volume with one replica, or not attached anywhere yet, runs `change` as it is, with
    /// attaches held back until it is made: a primary starting meanwhile would order writes
    /// that the replicas then meet on either side of the change. Blocking.
    pub fn quiesce<T>(
        &self,
        volume: &str,
        change: impl FnOnce() -> VolumeResult<T>,
    ) -> VolumeResult<T> {
        self.shared
            .runtime
            .block_on(self.quiesce_async(volume, async { change() }))
    }

    /// [`Self::quiesce`] for a `change` that is a future.
    async fn quiesce_async<T>(
        &self,
        volume: &str,
        change: impl std::future::Future<Output = VolumeResult<T>>,
    ) -> VolumeResult<T> {
        let attaching = self.attaching.lock().await;
        match self.quiescing(volume)? {
            Some(primary) => {
                drop(attaching);
                primary.quiesce_async(change).await
            }
            None => change.await,
        }
    }

    /// The primary a change of `volume` runs through ([`Self::quiesce`]): the one this node
    /// serves, `None` for a volume nobody serves (or that does not exist), refused when
    /// another node is its primary.
    fn quiescing(&self, volume: &str) -> VolumeResult<Option<Arc<Primary>>> {
        let Some(record) = self
            .shared
            .metadata
            .catalog()
            .read()
            .volume(volume)
            .map(|entry| entry.record.clone())
        else {
            return Ok(None);
        };
        let served = self.served(record.id);
        if served.is_none() {
            self.shared.refuse_if_served_elsewhere(volume, &record)?;
        }
        Ok(served)
    }

    /// Rolls `volume` back onto `snapshot` through [`Replication::quiesce`] (`rollback` does
    /// it on this node's copy and in the catalog). Replicas whose copy of the snapshot is
    /// incomplete ([`keel_catalog::SnapshotRecord::incomplete_on`]) would roll back onto data
    /// they never had: the primary first takes them out of the in-sync set, and catches them
    /// up from the start once the rollback is done. Refused on a primary whose own copy is
    /// incomplete. Blocking.
    pub fn rollback<T>(
        &self,
        volume: &str,
        snapshot: &str,
        rollback: impl FnOnce() -> VolumeResult<T>,
    ) -> VolumeResult<T> {
        self.shared
            .runtime
            .block_on(self.rollback_async(volume, snapshot, async { rollback() }))
    }

    /// [`Self::rollback`] for a `rollback` that is a future.
    pub async fn rollback_async<T>(
        &self,
        volume: &str,
        snapshot: &str,
        rollback: impl std::future::Future<Output = VolumeResult<T>>,
    ) -> VolumeResult<T> {
        let local = self.shared.local_node;
        let lacking = |entry: &keel_catalog::VolumeEntry| lacking_snapshot(entry, snapshot, local);
        let attaching = self.attaching.lock().await;
        // Served here: the primary decides which replicas lack the snapshot with no change of
        // the replica set in flight, and holds such changes back until the rollback is made.
        if let Some(primary) = self.quiescing(volume)? {
            drop(attaching);
            return primary.quiesce_dropping_async(lacking, rollback).await;
        }
        // Nobody serves it: decided under the attach lock, which a change of R holds too.
        let planned = {
            let catalog = self.shared.metadata.catalog().read();
            match catalog.volume(volume) {
                Some(entry) => Some((entry.record.clone(), lacking(entry)?)),
                None => None,
            }
        };
        match planned {
            Some((record, incomplete)) if !incomplete.is_empty() => {
                drop(attaching);
                self.primary_served_here(volume, &record)
                    .await?
                    .quiesce_dropping_async(lacking, rollback)
                    .await
            }
            // No replica to drop: made with attaches held back, as [`Self::quiesce`] does.
            _ => rollback.await,
        }
    }

    /// Refuses to receive a stream into `volume` here when it is replicated and another node
    /// is its primary (answered with its address): only the primary's copy may take the
    /// stream. A volume that does not exist yet (a full stream creates it here) passes.
    pub fn check_receive_here(&self, volume: &str) -> VolumeResult<()> {
        match self.shared.volume_record(volume) {
            Ok(record) => self.shared.refuse_if_served_elsewhere(volume, &record),
            Err(_) => Ok(()),
        }
    }

    /// Runs the last step of a stream received into `volume` on this node (a
    /// [`keel_volume::Publish`]). A replicated volume's stream is in this node's copy only:
    /// this node must be its primary (served from now on if nothing attached it); the other
    /// replicas are taken out of the in-sync set first, and caught up from the start once
    /// the volume shows the stream, as for a rollback onto a snapshot they lack. Blocking.
    pub fn publish_received(
        &self,
        volume: &str,
        publish: &mut dyn FnMut() -> VolumeResult<()>,
    ) -> VolumeResult<()> {
        // (A volume a full stream creates is not ready before it is published: one replica.)
        let record = match self.shared.volume_record(volume) {
            Ok(record) if record.replication.replicas.len() > 1 => record,
            _ => return publish(),
        };
        let local = self.shared.local_node;
        let others = |entry: &keel_catalog::VolumeEntry| {
            Ok((entry.record.replication.replicas.iter())
                .copied()
                .filter(|node| *node != local)
                .collect())
        };
        self.shared
            .runtime
            .block_on(self.primary_served_here(volume, &record))?
            .quiesce_dropping(others, publish)
    }

    /// The replicated volumes this node is named primary of: those a scheduled scrub compares.
    pub fn primary_here(&self) -> Vec<String> {
        let local = self.shared.local_node;
        self.shared
            .metadata
            .catalog()
            .read()
            .ready_volumes()
            .filter(|entry| {
                entry.record.replication.replicas.len() > 1
                    && entry.record.replication.primary == local
            })
            .map(|entry| entry.record.name.clone())
            .collect()
    }

    /// The primary to scrub a replicated volume through ([`Primary::scrub`]): served here
    /// already, or named primary here and served from now on (as if a client attached).
    /// Another node is refused with the primary's address; a volume with one replica has
    /// nothing to compare (`keel store scrub` checks each node's own copies). Blocking.
    pub fn scrub_target(&self, name: &str) -> VolumeResult<Arc<Primary>> {
        let record = self.shared.volume_record(name)?;
        if record.replication.replicas.len() <= 1 {
            return Err(VolumeError::Invalid {
                volume: name.to_string(),
                detail: "it has one replica: there is nothing to compare it with (keel store \
                         scrub checks this node's copies)"
                    .to_string(),
            });
        }
        self.shared
            .runtime
            .block_on(self.primary_served_here(name, &record))
    }

    /// The primary of a replicated volume named primary here: served already, or served from
    /// now on (as if a client attached). Another node is refused with the primary's address.
    async fn primary_served_here(
        &self,
        name: &str,
        record: &VolumeRecord,
    ) -> VolumeResult<Arc<Primary>> {
        if record.replication.primary != self.shared.local_node {
            return Err(self.shared.elsewhere(name, record.replication.primary));
        }
        let served = self.served(record.id);
        match served {
            Some(primary) => Ok(primary),
            None => {
                drop(self.open_hosted(name).await?);
                lock(&self.primaries)
                    .get(&record.id)
                    .cloned()
                    .ok_or_else(|| unavailable(name, "it is not served here".to_string()))
            }
        }
    }

    /// The state of a replicated volume this node serves as primary.
    pub fn primary_status(&self, volume_id: u64) -> Option<PrimaryStatus> {
        self.served(volume_id).map(|primary| primary.status())
    }

    /// [`Self::primary_status`] from the volume's primary, wherever it runs: this node's
    /// own when it serves the volume, else asked of the primary's node
    /// ([`wire::METHOD_PRIMARY_STATUS`], at most [`STATUS_CALL_TIMEOUT`]). `Ok(None)`: no node
    /// serves it now; `Err`: why the primary could not be asked.
    pub async fn primary_status_anywhere(
        &self,
        volume_id: u64,
    ) -> Result<Option<PrimaryStatus>, String> {
        if let Some(status) = self.primary_status(volume_id) {
            return Ok(Some(status));
        }
        let primary = {
            let catalog = self.shared.metadata.catalog().read();
            let entry = (catalog.volumes.get(&volume_id))
                .ok_or_else(|| format!("no volume with id {volume_id}"))?;
            let primary = entry.record.replication.primary;
            if primary == self.shared.local_node {
                return Ok(None);
            }
            if !catalog.node_is_up(primary) {
                return Err(format!("node {primary} is not up"));
            }
            primary
        };
        let request = postcard::to_allocvec(&wire::PrimaryStatusRequest { volume_id })
            .map_err(|error| error.to_string())?;
        let answer = (self.shared)
            .call(primary, METHOD_PRIMARY_STATUS, request, STATUS_CALL_TIMEOUT)
            .await
            .map_err(|failure| format!("node {primary}: {}", failure.message))?;
        let answer: wire::PrimaryStatusAnswer = postcard::from_bytes(&answer)
            .map_err(|error| format!("node {primary}'s answer: {error}"))?;
        Ok(answer.status)
    }

    /// This node's common point with `peer` for `volume` ([`Point`]), as its store keeps it.
    pub fn common_point(&self, volume: &str, peer: NodeId) -> VolumeResult<Option<Point>> {
        let record = self.shared.volume_record(volume)?;
        self.shared.point(volume, record.id, peer)
    }

    /// A handle for block I/O on a volume, for a client attaching here (blocking: it may ask
    /// Raft to make this node the volume's primary, and it waits for the replicas to catch
    /// up). A volume with one replica is the local volume itself. On a node that holds no
    /// replica, every request is forwarded to the node serving the volume ([`forward`]).
    ///
    /// This node becomes the primary if it holds a replica in the in-sync set and either is
    /// the primary already, or the leader has not heard from the primary for longer than its
    /// lease ([`TAKE_OVER_SILENCE`]). Taking over bumps the epoch with this node alone in
    /// sync (fencing every older stream); the other replicas catch up and rejoin.
    ///
    /// On a node handing its volumes off (draining, or low on space: [`Leaving`]), a
    /// replicated volume whose primary is another node that is up is forwarded there like on
    /// a node without a replica: a client attached here must not take the volume back.
    /// Elsewhere, when another node serves the volume and is alive, this node asks it for the
    /// volume first ([`Self::ask_for_volume`]: a pod moved here, say), and forwards the
    /// client there if it keeps it.
    pub fn open(&self, name: &str) -> VolumeResult<Arc<dyn VolumeIo>> {
        if !self.hosted_here(name)? || self.forwarded_while_leaving(name)? {
            return Ok(Forwarded::open(self.shared.clone(), name)?);
        }
        if let Some(why) = self.shared.runtime.block_on(self.ask_for_volume(name))? {
            tracing::info!(
                volume = name,
                "forwarding a client attached here to the volume's primary: {why}"
            );
            return Ok(Forwarded::open(self.shared.clone(), name)?);
        }
        self.shared.runtime.block_on(self.open_hosted(name))
    }

    /// For a client attaching here to a replicated volume whose primary is another node that
    /// is up: forwards it there while this node's replica is not in sync; else, while the
    /// primary is alive (heard from within [`TAKE_OVER_SILENCE`]), asks that node to hand the
    /// volume over ([`wire::METHOD_HAND_OVER`], answered by [`Self::hand_over`]), so that the client
    /// reads locally. `None` once Raft names this node the primary and its catalog applied
    /// it, or when no other live node serves the volume or the primary cannot be asked (the
    /// attach goes on: this node serves it, takes it over or is refused as before); else why
    /// the client is forwarded to the primary instead: this node's replica is not in sync, or
    /// the primary kept the volume (a client uses it there).
    ///
    /// The simulation's clients call it before [`Self::open_primary`] now and then.
    pub async fn ask_for_volume(&self, name: &str) -> VolumeResult<Option<String>> {
        let local = self.shared.local_node;
        let record = self.shared.volume_record(name)?;
        let replication = &record.replication;
        let primary = replication.primary;
        let primary_up = self.shared.metadata.catalog().read().node_is_up(primary);
        if replication.replicas.len() <= 1 || primary == local || !primary_up {
            return Ok(None);
        }
        // A replica out of sync never takes the volume over, however long this node has not
        // heard from the primary (right after a partition healed, its view is stale): the
        // client goes to the primary (a forward to a primary that is gone fails, as the
        // take-over's refusal would).
        if !replication.in_sync.contains(&local) {
            return Ok(Some(format!(
                "this node's replica is not in sync (node {primary} serves the volume)"
            )));
        }
        let silence = (self.shared.cluster.silent_for(primary).await)
            .map_err(|error| unavailable(name, error.to_string()))?;
        if silence >= TAKE_OVER_SILENCE {
            return Ok(None);
        }
        let request = wire::HandOverRequest {
            volume_id: record.id,
        };
        let request = postcard::to_allocvec(&request)
            .map_err(|error| unavailable(name, error.to_string()))?;
        let answer = match (self.shared)
            .call(primary, METHOD_HAND_OVER, request, HAND_OVER_WAIT)
            .await
        {
            Ok(bytes) => postcard::from_bytes::<wire::HandOverAnswer>(&bytes)
                .map_err(|error| error.to_string()),
            Err(failure) => Err(failure.message),
        };
        match answer {
            Ok(wire::HandOverAnswer { kept: None }) => {}
            Ok(wire::HandOverAnswer { kept: Some(why) }) => {
                return Ok(Some(format!("node {primary} keeps the volume: {why}")))
            }
            Err(why) => {
                // Cut off, say: the attach goes on as before it asked (a take-over once the
                // primary has been silent long enough, else refused with its address).
                tracing::info!(
                    volume = name,
                    node = primary,
                    "could not ask the volume's primary to hand it over: {why}"
                );
                return Ok(None);
            }
        }
        let clock = self.shared.clock();
        let deadline = clock.now() + HAND_OVER_WAIT;
        while self.shared.volume_record(name)?.replication.primary != local {
            if clock.now() >= deadline {
                return Ok(Some(format!(
                    "node {primary} handed the volume over, but this node's catalog has not \
                     shown it within {} s",
                    HAND_OVER_WAIT.as_secs()
                )));
            }
            clock.sleep(Duration::from_millis(20)).await;
        }
        tracing::info!(
            volume = name,
            node = primary,
            "the volume's primary handed it over to this node, where a client attached"
        );
        Ok(None)
    }

    /// Answers a node holding a replica in sync that asks for the volume for a client attached
    /// there ([`Self::ask_for_volume`]): hands the volume to it ([`Primary::hand_off`]) when
    /// this node is its primary and no client uses it here (attached here, or forwarded from
    /// a node without a replica); when nothing serves it here, Raft just names `to` the
    /// primary with the same in-sync set (a compare-and-set on the epoch: a primary starting
    /// here meanwhile makes it fail). `Err`: why the volume stays.
    async fn hand_over(&self, to: NodeId, volume_id: u64) -> Result<(), String> {
        let local = self.shared.local_node;
        let _attaching = self.attaching.lock().await;
        let (name, replication) = {
            let catalog = self.shared.metadata.catalog().read();
            let entry = (catalog.volumes.get(&volume_id)).ok_or("no such volume")?;
            (entry.record.name.clone(), entry.record.replication.clone())
        };
        if replication.primary != local {
            return Err(format!("node {} is its primary", replication.primary));
        }
        if !replication.in_sync.contains(&to) || to == local {
            return Err(format!("node {to}'s replica is not in sync"));
        }
        let served = lock(&self.primaries)
            .get(&volume_id)
            .filter(|primary| !primary.is_closed())
            .cloned();
        let handed = match served {
            Some(primary) => {
                if self.attached_to(&primary).is_some() {
                    return Err("a client is attached to it there".to_string());
                }
                if self.sessions.serve_volume(&self.shared, volume_id) {
                    return Err(
                        "a client attached to another node uses it through this one".to_string()
                    );
                }
                let why = format!("node {to} asked for the volume for a client attached there");
                primary.hand_off(to, &why).await
            }
            None => self
                .shared
                .cluster
                .propose_async(Command::VolumeSetReplication {
                    volume_id,
                    epoch: replication.epoch,
                    primary: to,
                    in_sync: replication.in_sync.clone(),
                })
                .await
                .map(|_| ())
                .map_err(|error| change_error(&name, error)),
        };
        handed.map_err(|error| error.to_string())?;
        self.shared
            .counters
            .handed_off
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            volume = name,
            node = to,
            "handed the volume to the node a client attached to"
        );
        Ok(())
    }

    /// A read-only handle on `volume@snapshot`: this node's copy when it holds the snapshot
    /// whole, else a forwarding session on a node that does (this node holds no replica, or
    /// its replica was out of sync when the snapshot was taken).
    pub fn open_snapshot(&self, volume: &str, snapshot: &str) -> VolumeResult<Arc<dyn VolumeIo>> {
        let local_node = self.shared.local_node;
        let whole_here = {
            let catalog = self.shared.metadata.catalog().read();
            let entry = catalog
                .volume(volume)
                .ok_or_else(|| VolumeError::NotFound {
                    name: volume.to_string(),
                })?;
            let frozen = snapshot_of(entry, snapshot)?;
            entry.record.replication.hosts(local_node) && frozen.complete_on(local_node)
        };
        if whole_here {
            return self.shared.local.open_local_snapshot(volume, snapshot);
        }
        Ok(Forwarded::open(
            self.shared.clone(),
            &format!("{volume}@{snapshot}"),
        )?)
    }

    /// Whether this node is handing its volumes off ([`Leaving`]) and `name` is a replicated
    /// volume served by another node that is up ([`Self::open`]).
    fn forwarded_while_leaving(&self, name: &str) -> VolumeResult<bool> {
        if self.leaving().is_none() {
            return Ok(false);
        }
        let record = self.shared.volume_record(name)?;
        let replication = &record.replication;
        let catalog = self.shared.metadata.catalog().read();
        Ok(replication.replicas.len() > 1
            && replication.primary != self.shared.local_node
            && catalog.node_is_up(replication.primary))
    }

    fn hosted_here(&self, name: &str) -> VolumeResult<bool> {
        let record = self.shared.volume_record(name)?;
        Ok(record.replication.hosts(self.shared.local_node))
    }

    /// [`Replication::open`] on a node that holds a replica (another node is refused with the
    /// primary's address).
    async fn open_hosted(&self, name: &str) -> VolumeResult<Arc<dyn VolumeIo>> {
        // Each way in reads the record again under the attach lock, and answers `None` when R
        // crossed between one replica and more while it waited: then the other way is taken.
        for _ in 0..ATTACH_TRIES {
            let record = self.shared.volume_record(name)?;
            if record.replication.hosts(self.shared.local_node)
                && record.replication.replicas.len() <= 1
            {
                if let Some(single) = self.open_single(name).await? {
                    return Ok(single);
                }
            } else if let Some(primary) = self.open_replicated(name, false).await? {
                return Ok(self.client_handle(name, primary));
            }
        }
        Err(unavailable(
            name,
            "its number of replicas kept changing while this client attached; attach again"
                .to_string(),
        ))
    }

    /// The handle clients attached here reach `primary` through: one per volume, shared, so
    /// that a hand-off switches them all at once.
    fn client_handle(&self, name: &str, primary: Arc<Primary>) -> Arc<dyn VolumeIo> {
        let mut clients = lock(&self.clients);
        clients.retain(|_, attached| attached.strong_count() > 0);
        let volume_id = primary.volume_id();
        if let Some(attached) = clients.get(&volume_id).and_then(Weak::upgrade) {
            if attached.serves(&primary) {
                return attached;
            }
        }
        let attached = Arc::new(Attached::new(name, primary));
        clients.insert(volume_id, Arc::downgrade(&attached));
        attached
    }

    /// The handle through which clients attached here reach `primary`, if any is still held.
    fn attached_to(&self, primary: &Arc<Primary>) -> Option<Arc<Attached>> {
        let volume_id = primary.volume_id();
        [&self.clients, &self.singles]
            .into_iter()
            .filter_map(|map| lock(map).get(&volume_id).and_then(Weak::upgrade))
            .find(|attached| attached.serves(primary))
    }

    /// [`Replication::open`] for an async client of a volume on a node that holds a replica
    /// (the simulation's): the primary, served here from now on; one this node holds no
    /// replica of is refused. A volume with one replica is served by a primary too, as one
    /// whose R was lowered to 1 while attached is (a server's clients get its local copy
    /// instead, switched over when R is raised, which takes blocking work). Store I/O runs
    /// inline: a server's clients use [`Replication::open`].
    pub async fn open_primary(&self, name: &str) -> VolumeResult<Arc<Primary>> {
        self.open_replicated(name, true)
            .await?
            .ok_or_else(|| VolumeError::Invalid {
                volume: name.to_string(),
                detail: "it has one replica: its local copy serves it".to_string(),
            })
    }

    /// A forwarding session on the node serving `name`, for an async client attached here
    /// (the simulation's, on a node without a replica or whose replica is out of sync; a
    /// server's clients get one from [`Replication::open`]).
    pub async fn open_forwarded(&self, name: &str) -> VolumeResult<Arc<Forwarded>> {
        Forwarded::open_async(self.shared.clone(), name).await
    }

    /// [`Self::open_primary`]; `None` for a volume with one replica unless `single` (serve
    /// that too).
    async fn open_replicated(
        &self,
        name: &str,
        single: bool,
    ) -> VolumeResult<Option<Arc<Primary>>> {
        let local_node = self.shared.local_node;
        // The record read under the attach lock: a change of R holds it while Raft records
        // the change, so what follows acts on the replicas and epoch as they are.
        let _attaching = self.attaching.lock().await;
        let record = self.shared.volume_record(name)?;
        let replication = record.replication.clone();
        if !replication.hosts(local_node) {
            return Err(self.shared.elsewhere(name, replication.primary));
        }
        if replication.replicas.len() <= 1 && !single {
            return Ok(None);
        }
        let primary_address = || {
            self.shared
                .node_address(replication.primary, true)
                .unwrap_or_else(|| "unknown".to_string())
        };
        if let Some(primary) = lock(&self.primaries).get(&record.id) {
            if replication.primary != local_node {
                primary.close(format!(
                    "node {} took the volume over in epoch {}",
                    replication.primary, replication.epoch
                ));
            } else if primary.stale_for(replication.epoch) {
                primary.close(format!(
                    "the volume changed hands meanwhile: epoch {} names this node again",
                    replication.epoch
                ));
            } else if !primary.is_closed() {
                return Ok(Some(primary.clone()));
            }
        }
        let local = self.shared.local.open_local(name)?;
        if replication.primary != local_node {
            if !replication.in_sync.contains(&local_node) {
                return Err(unavailable(
                    name,
                    format!(
                        "this node's replica is not in sync; attach through the primary, node \
                         {} at {}",
                        replication.primary,
                        primary_address()
                    ),
                ));
            }
            let silence = self
                .shared
                .cluster
                .silent_for(replication.primary)
                .await
                .map_err(|error| unavailable(name, error.to_string()))?;
            if silence < TAKE_OVER_SILENCE {
                return Err(unavailable(
                    name,
                    format!(
                        "its primary, node {} at {}, was heard from {} ms ago: attach there (a \
                         node takes a volume over only after its primary has been silent for {} ms)",
                        replication.primary,
                        primary_address(),
                        silence.as_millis(),
                        TAKE_OVER_SILENCE.as_millis()
                    ),
                ));
            }
        }
        if !self.shared.holds_lease() {
            return Err(unavailable(
                name,
                "this node is not in touch with the cluster's leader".to_string(),
            ));
        }
        // Under the replica slot: no batch of an older stream is being applied while this
        // node takes over, and none is accepted after (the catalog names this node).
        let slot = self.shared.replicas.slot(record.id);
        let mut slot = slot.state.lock().await;
        Replicas::forget(&mut slot);
        // Handed off (the epoch its primary's hand-off made, which nobody served since): the
        // replicas in sync then stay in sync. Otherwise they may hold writes this copy lacks
        // or lack some it holds (not yet flushed when the primary stopped): this node serves
        // alone in sync and catches them up.
        let handed = lock(&self.shared.handed_here).remove(&record.id);
        let in_sync = if replication.primary == local_node && handed == Some(replication.epoch) {
            replication.in_sync.clone()
        } else {
            vec![local_node]
        };
        self.shared
            .cluster
            .propose_async(Command::VolumeSetReplication {
                volume_id: record.id,
                epoch: replication.epoch,
                primary: local_node,
                in_sync: in_sync.clone(),
            })
            .await
            .map_err(|error| match error {
                MetadataError::Refused(refusal) => unavailable(
                    name,
                    format!("another node changed its replication meanwhile: {refusal}"),
                ),
                other => unavailable(name, other.to_string()),
            })?;
        drop(slot);
        tracing::info!(
            volume = name,
            epoch = replication.epoch + 1,
            "serving as the volume's primary"
        );
        let known = self.shutdown_note(name, record.id, replication.epoch);
        let mut taken = replication.clone();
        taken.epoch += 1;
        taken.primary = local_node;
        taken.in_sync = in_sync;
        let primary = Primary::start(
            self.shared.clone(),
            record.id,
            name.to_string(),
            local,
            &taken,
            known,
        );
        lock(&self.primaries).insert(record.id, primary.clone());
        // Writes need `in_sync_min` replicas: give the others a moment to catch up.
        let clock = self.shared.clock();
        let deadline = clock.now() + ATTACH_WAIT_FOR_IN_SYNC;
        while primary.status().in_sync.len() < usize::from(replication.in_sync_min)
            && clock.now() < deadline
            && !primary.is_closed()
        {
            clock.sleep(Duration::from_millis(20)).await;
        }
        Ok(Some(primary))
    }

    /// A volume with one replica: the primary already serving it here (its R was lowered to
    /// 1), or its local copy behind a switch that raising R turns into a primary. `None` if
    /// the volume has more than one replica by the time the attach lock is held: raising R
    /// holds that lock while Raft records the new replicas, so a record read before it may
    /// be stale, and the local copy alone would take writes the new replicas never get.
    async fn open_single(&self, name: &str) -> VolumeResult<Option<Arc<dyn VolumeIo>>> {
        let _attaching = self.attaching.lock().await;
        let record = self.shared.volume_record(name)?;
        if record.replication.replicas.len() > 1 {
            return Ok(None);
        }
        if let Some(primary) = self.served(record.id) {
            return Ok(Some(primary));
        }
        let mut singles = lock(&self.singles);
        if let Some(attached) = singles.get(&record.id).and_then(Weak::upgrade) {
            return Ok(Some(attached));
        }
        let attached = Arc::new(Attached::new(name, self.shared.local.open_local(name)?));
        singles.retain(|_, attached| attached.strong_count() > 0);
        singles.insert(record.id, Arc::downgrade(&attached));
        Ok(Some(attached))
    }

    /// Changes a volume's replication factor R (1 to 3) and its in-sync minimum, online.
    /// Only the volume's primary does it (another node is refused with its address). Added
    /// replicas go to up storage nodes spread over failure domains and are caught up by the
    /// primary in the background; lowering R removes replicas that are out of sync first,
    /// then those on nodes draining or removed, never the primary's, and never the only
    /// replica holding a snapshot whole (refused when it would have to); `placement` names
    /// the node a replica goes to or leaves first instead. Without a new
    /// minimum the current one stays (lowered to R if it would exceed it). A volume with one
    /// replica attached here switches to replicated writes once the I/O in flight has
    /// finished.
    pub fn set_replicas(
        &self,
        name: &str,
        factor: Option<u8>,
        in_sync_min: Option<u8>,
        placement: Placement,
    ) -> VolumeResult<()> {
        let _attaching = self.attaching.blocking_lock();
        let (record, replicas, in_sync_min) =
            self.replicas_wanted(name, factor, in_sync_min, placement)?;
        let current = &record.replication;
        let attached = lock(&self.singles).get(&record.id).and_then(Weak::upgrade);
        match attached {
            // Only from one replica: then this node is alone in sync. A closed primary of a
            // replicated volume is never restarted here behind its clients' backs (the
            // catalog may count replicas in sync that the new one has not caught up); its
            // clients attach again, which takes the volume over properly.
            Some(attached)
                if self.served(record.id).is_none()
                    && current.replicas.len() == 1
                    && replicas.len() > 1 =>
            {
                let command = Command::VolumeSetReplicas {
                    volume_id: record.id,
                    epoch: current.epoch,
                    replicas,
                    in_sync_min,
                };
                self.widen_attached_single(&attached, name, record.id, command)
            }
            _ => self.shared.runtime.block_on(self.change_replicas(
                name,
                &record,
                replicas,
                in_sync_min,
            )),
        }
    }

    /// Gives a volume with one replica, attached here behind `attached`, more replicas
    /// through `command` (Raft), and switches its clients over to a primary serving it here
    /// once the I/O in flight has finished: their writes from then on reach the new replicas
    /// too. Blocking; the caller holds the attach lock.
    fn widen_attached_single(
        &self,
        attached: &Attached,
        name: &str,
        volume_id: u64,
        command: Command,
    ) -> VolumeResult<()> {
        attached.switch(|_| -> VolumeResult<Arc<dyn VolumeIo>> {
            self.shared
                .metadata
                .propose(command)
                .map_err(|error| change_error(name, error))?;
            let taken = self
                .shared
                .metadata
                .catalog()
                .read()
                .volumes
                .get(&volume_id)
                .map(|entry| entry.record.replication.clone())
                .ok_or_else(|| VolumeError::NotFound {
                    name: name.to_string(),
                })?;
            let local = self.shared.local.open_local(name)?;
            let primary = Primary::start(
                self.shared.clone(),
                volume_id,
                name.to_string(),
                local,
                &taken,
                BTreeMap::new(),
            );
            lock(&self.primaries).insert(volume_id, primary.clone());
            tracing::info!(
                volume = name,
                epoch = taken.epoch,
                "serving as the volume's primary"
            );
            Ok(primary)
        })?;
        Ok(())
    }

    /// [`Self::set_replicas`] for an async caller (the simulation's). A volume with one
    /// replica that a client has attached here is refused: switching that client over takes
    /// blocking work ([`Self::set_replicas`] does it).
    pub async fn set_replicas_async(
        &self,
        name: &str,
        factor: Option<u8>,
        in_sync_min: Option<u8>,
        placement: Placement,
    ) -> VolumeResult<()> {
        let _attaching = self.attaching.lock().await;
        let (record, replicas, in_sync_min) =
            self.replicas_wanted(name, factor, in_sync_min, placement)?;
        let attached_single = lock(&self.singles)
            .get(&record.id)
            .is_some_and(|attached| attached.strong_count() > 0);
        if attached_single && self.served(record.id).is_none() && replicas.len() > 1 {
            return Err(VolumeError::Invalid {
                volume: name.to_string(),
                detail: "a client has it attached here with one replica: change R through the \
                         blocking call"
                    .to_string(),
            });
        }
        self.change_replicas(name, &record, replicas, in_sync_min)
            .await
    }

    /// The replicas and in-sync minimum a change of R makes of `name`'s (the caller holds the
    /// attach lock): refused unless this node is its primary and enough storage nodes are
    /// up for it.
    fn replicas_wanted(
        &self,
        name: &str,
        factor: Option<u8>,
        in_sync_min: Option<u8>,
        placement: Placement,
    ) -> VolumeResult<(VolumeRecord, Vec<NodeId>, u8)> {
        let local_node = self.shared.local_node;
        let (record, replicas) = {
            let catalog = self.shared.metadata.catalog().read();
            let entry = catalog.volume(name).ok_or_else(|| VolumeError::NotFound {
                name: name.to_string(),
            })?;
            let record = entry.record.clone();
            let current = &record.replication;
            if current.primary != local_node {
                drop(catalog);
                return Err(self.shared.elsewhere(name, current.primary));
            }
            let wanted = usize::from(factor.unwrap_or(current.factor));
            // One more than R's most only as a move's first step (`keel volume move`: a
            // replica added on a named node while every other stays in sync), and kept until
            // the move lowers R again.
            let moving = wanted == keel_catalog::REPLICAS_MOVING_MAX
                && match placement.add_to {
                    Some(_) => usize::from(current.factor) + 1 == wanted,
                    None => usize::from(current.factor) == wanted,
                };
            if wanted == 0 || (wanted > keel_catalog::REPLICAS_MAX && !moving) {
                return Err(VolumeError::Invalid {
                    volume: name.to_string(),
                    detail: format!(
                        "{wanted} replicas: Keel keeps 1 to {} ({} only while a replica moves: \
                         keel volume move)",
                        keel_catalog::REPLICAS_MAX,
                        keel_catalog::REPLICAS_MOVING_MAX
                    ),
                });
            }
            let invalid = |detail: String| VolumeError::Invalid {
                volume: name.to_string(),
                detail,
            };
            let only_whole = |leaving: NodeId, lost: &[String]| {
                invalid(format!(
                    "lowering R to {wanted} would remove node {leaving}, the only replica \
                     holding snapshot(s) {} whole: wait until snapshot repair has copied them \
                     to another replica (keel volume info shows it), or delete them first",
                    quoted(lost)
                ))
            };
            let mut replicas = current.replicas.clone();
            if let Some(node) = placement.add_to {
                if wanted <= replicas.len() {
                    return Err(invalid(format!(
                        "a replica goes to a named node (node {node}) only as R is raised"
                    )));
                }
                if let Some(why) = catalog.replica_target_refusal(&replicas, node) {
                    return Err(invalid(format!("no replica can be added there: {why}")));
                }
                replicas.push(node);
            }
            if wanted > replicas.len() {
                let missing = wanted - replicas.len();
                let added = catalog.choose_replica_nodes(&replicas, missing);
                if added.len() < missing {
                    return Err(VolumeError::Invalid {
                        volume: name.to_string(),
                        detail: format!(
                            "{wanted} replicas need {missing} more storage node(s) that are up, \
                             not draining, not nearly full and hold none; the cluster has {}",
                            added.len()
                        ),
                    });
                }
                replicas.extend(added);
            }
            if let Some(node) = placement.remove_from {
                if wanted >= replicas.len() {
                    return Err(invalid(format!(
                        "a named replica (node {node}) leaves only as R is lowered"
                    )));
                }
                if !replicas.contains(&node) {
                    return Err(invalid(format!("node {node} holds no replica of it")));
                }
                if node == current.primary {
                    return Err(invalid(format!(
                        "node {node} is its primary, whose replica stays: attach the volume \
                         through another replica's node first (the primary hands it over when \
                         no client uses it there), or drain node {node}"
                    )));
                }
                let lost = only_whole_on(entry, &replicas, node);
                if !lost.is_empty() {
                    return Err(only_whole(node, &lost));
                }
                replicas.retain(|replica| *replica != node);
            }
            // Leaving: a replica whose removal loses no snapshot (one it alone holds whole),
            // out of sync first, then one on a node draining or removed, then the highest
            // node id; never the primary.
            let leaving_node = |node: NodeId| {
                (catalog.nodes.get(&node)).is_none_or(|record| record.draining || record.removed)
            };
            while replicas.len() > wanted {
                let Some(leaving) = replicas
                    .iter()
                    .copied()
                    .filter(|node| *node != current.primary)
                    .min_by_key(|node| {
                        let lost = only_whole_on(entry, &replicas, *node).len();
                        (
                            lost,
                            current.in_sync.contains(node),
                            !leaving_node(*node),
                            std::cmp::Reverse(*node),
                        )
                    })
                else {
                    break;
                };
                let lost = only_whole_on(entry, &replicas, leaving);
                if !lost.is_empty() {
                    return Err(only_whole(leaving, &lost));
                }
                replicas.retain(|node| *node != leaving);
            }
            (record, replicas)
        };
        let in_sync_min =
            in_sync_min.unwrap_or_else(|| record.replication.in_sync_min.min(replicas.len() as u8));
        Ok((record, replicas, in_sync_min))
    }

    /// The clients of this node whose I/O is forwarded to another node, per export and node
    /// (for health: they are slower than clients of the node serving the volume).
    pub fn forwarded_clients(&self) -> Vec<ForwardedClients> {
        let live: Vec<Arc<Forwarded>> = {
            let mut handles = lock(&self.shared.forwarded);
            handles.retain(|handle| handle.strong_count() > 0);
            handles.iter().filter_map(Weak::upgrade).collect()
        };
        let mut counted: BTreeMap<(String, NodeId), usize> = BTreeMap::new();
        for forwarded in &live {
            let key = (forwarded.name().to_string(), forwarded.serving_node());
            *counted.entry(key).or_default() += 1;
        }
        (counted.into_iter())
            .map(|((export, node), handles)| ForwardedClients {
                export,
                node,
                handles,
            })
            .collect()
    }

    /// The primary this node serves `volume_id` as, if the catalog names this node the
    /// volume's primary and the primary is not stale ([`Primary::stale_for`]).
    fn served_as_named(&self, volume_id: u64) -> Option<Arc<Primary>> {
        let epoch = {
            let catalog = self.shared.metadata.catalog().read();
            let replication = &catalog.volumes.get(&volume_id)?.record.replication;
            (replication.primary == self.shared.local_node).then_some(replication.epoch)?
        };
        self.served(volume_id)
            .filter(|primary| !primary.stale_for(epoch))
    }

    /// The primary this node serves `volume_id` as, if any.
    fn served(&self, volume_id: u64) -> Option<Arc<Primary>> {
        lock(&self.primaries)
            .get(&volume_id)
            .filter(|primary| !primary.is_closed())
            .cloned()
    }

    /// Records a change of `record`'s replicas through the primary this node serves it as,
    /// or, when nobody serves it, through Raft alone: the background loop serves it as
    /// primary within `MOVE_CHECK_EVERY` (or the next attach does) and catches the new
    /// replicas up.
    async fn change_replicas(
        &self,
        name: &str,
        record: &VolumeRecord,
        replicas: Vec<NodeId>,
        in_sync_min: u8,
    ) -> VolumeResult<()> {
        if let Some(primary) = self.served(record.id) {
            return primary.set_replicas(replicas, in_sync_min).await;
        }
        let command = Command::VolumeSetReplicas {
            volume_id: record.id,
            epoch: record.replication.epoch,
            replicas,
            in_sync_min,
        };
        self.shared
            .cluster
            .propose_async(command)
            .await
            .map(drop)
            .map_err(|error| change_error(name, error))
    }

    /// Opens a session for a client attached to `caller`, a node without a replica.
    fn serve_forward_open(
        &self,
        caller: NodeId,
        request: ForwardOpen,
    ) -> Result<Vec<u8>, RemoteFailure> {
        // The export's name: a volume, or `volume@snapshot` (read-only, served by any node
        // holding the snapshot whole, primary or not).
        let name = request.volume;
        let opened = match name.split_once('@') {
            Some((volume, snapshot)) => self.shared.local.open_local_snapshot(volume, snapshot),
            None => self.shared.runtime.block_on(self.open_hosted(&name)),
        };
        self.forward_opened(caller, &name, opened.map(|io| (io, None)))
    }

    /// [`Self::serve_forward_open`] without blocking (the simulation's): a volume's session
    /// holds its primary itself, served async ([`Sessions::serve_async`]).
    async fn serve_forward_open_async(
        &self,
        caller: NodeId,
        request: ForwardOpen,
    ) -> Result<Vec<u8>, RemoteFailure> {
        let name = request.volume;
        let opened = match name.split_once('@') {
            Some((volume, snapshot)) => (self.shared.local)
                .open_local_snapshot(volume, snapshot)
                .map(|io| (io, None)),
            None => match self.open_replicated(&name, true).await {
                Ok(Some(primary)) => Ok((primary.clone() as Arc<dyn VolumeIo>, Some(primary))),
                Ok(None) => Err(unavailable(&name, "it is not served here".to_string())),
                Err(error) => Err(error),
            },
        };
        self.forward_opened(caller, &name, opened)
    }

    /// Registers the session `opened` for `caller` on export `name` (a volume, or
    /// `volume@snapshot`), or says why it was not opened.
    fn forward_opened(
        &self,
        caller: NodeId,
        name: &str,
        opened: VolumeResult<Served>,
    ) -> Result<Vec<u8>, RemoteFailure> {
        let remote = |code: u16, message: String| RemoteFailure { code, message };
        let (volume, snapshot) = match name.split_once('@') {
            Some((volume, snapshot)) => (volume, Some(snapshot)),
            None => (name, None),
        };
        let (opened, primary) = opened.map_err(|error| match error {
            VolumeError::NotFound { .. } | VolumeError::SnapshotNotFound { .. } => {
                remote(CODE_NOT_FOUND, error.to_string())
            }
            other => remote(CODE_REFUSED, other.to_string()),
        })?;
        let volume_id = self
            .shared
            .metadata
            .catalog()
            .read()
            .volume(volume)
            .map(|entry| entry.record.id)
            .ok_or_else(|| remote(CODE_NOT_FOUND, format!("volume {volume:?} not found")))?;
        let answer = self
            .sessions
            .insert(
                &self.shared,
                caller,
                volume_id,
                opened,
                primary,
                snapshot.is_none(),
            )
            .map_err(|why| remote(CODE_REFUSED, why))?;
        tracing::info!(
            volume = name,
            node = caller,
            "serving the volume for a client attached to a node without a replica"
        );
        postcard::to_allocvec(&answer).map_err(|error| remote(CODE_BAD_REQUEST, error.to_string()))
    }

    /// Answers another node's call: a primary's (to this node as a replica) async, its
    /// store work through [`blocking`]; a forwarding client's on a thread that may block (it
    /// serves through the blocking [`VolumeIo`]).
    async fn serve(
        self: Arc<Self>,
        caller: Caller,
        method: u16,
        payload: Vec<u8>,
    ) -> Result<Vec<u8>, RemoteFailure> {
        let remote = |code: u16, message: String| RemoteFailure { code, message };
        let Caller::Member(sender) = caller else {
            return Err(remote(CODE_BAD_REQUEST, "not a member".to_string()));
        };
        let shared = &self.shared;
        let refused = |refusal: replica::Refusal| remote(refusal.code, refusal.message);
        let encode = |bytes: Result<Vec<u8>, postcard::Error>| {
            bytes.map_err(|error| remote(CODE_BAD_REQUEST, error.to_string()))
        };
        match method {
            METHOD_REPLICATE => {
                // The writes' data stay in the payload (no copy).
                let batch = wire::Batch::decode_shared(payload.into())
                    .map_err(|error| remote(CODE_BAD_REQUEST, error.to_string()))?;
                let ack = replica::apply(shared, sender, batch)
                    .await
                    .map_err(refused)?;
                encode(postcard::to_allocvec(&ack))
            }
            METHOD_HASHES => {
                let request = decode(&payload)?;
                let answer = replica::hashes(shared, sender, request)
                    .await
                    .map_err(refused)?;
                encode(postcard::to_allocvec(&answer))
            }
            METHOD_UNWRITTEN => {
                let request = decode(&payload)?;
                let answer = replica::unwritten(shared, sender, request)
                    .await
                    .map_err(refused)?;
                encode(postcard::to_allocvec(&answer))
            }
            METHOD_CHANGED => {
                let request = decode(&payload)?;
                let answer = replica::changed(shared, sender, request)
                    .await
                    .map_err(refused)?;
                encode(postcard::to_allocvec(&answer))
            }
            METHOD_SNAPSHOT_HASHES => {
                let request = decode(&payload)?;
                let answer = replica::snapshot_hashes(shared, sender, request)
                    .await
                    .map_err(refused)?;
                encode(postcard::to_allocvec(&answer))
            }
            METHOD_SNAPSHOT_READ => {
                let request = decode(&payload)?;
                let answer = replica::snapshot_read(shared, sender, request)
                    .await
                    .map_err(refused)?;
                encode(postcard::to_allocvec(&answer))
            }
            METHOD_SNAPSHOT_REPAIR => {
                let request = decode(&payload)?;
                replica::snapshot_repair(shared, sender, request)
                    .await
                    .map_err(refused)?;
                Ok(Vec::new())
            }
            METHOD_COPY_TURN => {
                let request: wire::CopyTurnRequest = decode(&payload)?;
                let (turns, now) = (&shared.receiving, shared.clock_now());
                let granted = match request.action {
                    wire::TurnAction::Ask => turns.ask(sender, request.volume_id, now),
                    wire::TurnAction::Renew => {
                        turns.renew(sender, request.volume_id, now);
                        true
                    }
                    wire::TurnAction::GiveBack => {
                        turns.give_back(sender, request.volume_id);
                        true
                    }
                };
                encode(postcard::to_allocvec(&wire::CopyTurnAnswer { granted }))
            }
            METHOD_HAND_OVER => {
                let request: wire::HandOverRequest = decode(&payload)?;
                let kept = self.hand_over(sender, request.volume_id).await.err();
                encode(postcard::to_allocvec(&wire::HandOverAnswer { kept }))
            }
            METHOD_HANDED_OFF => {
                let notice: wire::HandedOff = decode(&payload)?;
                // Checked against the catalog when this node starts serving the volume.
                lock(&shared.handed_here).insert(notice.volume_id, notice.epoch);
                Ok(Vec::new())
            }
            METHOD_PRIMARY_STATUS => {
                let request: wire::PrimaryStatusRequest = decode(&payload)?;
                let status = self.primary_status(request.volume_id);
                encode(postcard::to_allocvec(&wire::PrimaryStatusAnswer { status }))
            }
            METHOD_READ_COPY => {
                let request = decode(&payload)?;
                let answer = replica::read_copy(shared, sender, request)
                    .await
                    .map_err(refused)?;
                encode(postcard::to_allocvec(&answer))
            }
            METHOD_FORWARD_OPEN | METHOD_FORWARD_IO | METHOD_FORWARD_CLOSE
                if cfg!(feature = "simulation") =>
            {
                self.serve_forward_async(sender, method, payload).await
            }
            METHOD_FORWARD_OPEN | METHOD_FORWARD_IO | METHOD_FORWARD_CLOSE => {
                tokio::task::spawn_blocking(move || self.serve_forward(sender, method, payload))
                    .await
                    .map_err(|error| remote(wire::CODE_FAILED, error.to_string()))?
            }
            other => Err(remote(CODE_BAD_REQUEST, format!("unknown method {other}"))),
        }
    }

    /// [`Self::serve_forward`] without blocking (the simulation's, whose one thread cannot).
    async fn serve_forward_async(
        &self,
        sender: NodeId,
        method: u16,
        payload: Vec<u8>,
    ) -> Result<Vec<u8>, RemoteFailure> {
        let remote = |code: u16, message: String| RemoteFailure { code, message };
        match method {
            METHOD_FORWARD_OPEN => {
                let request = decode(&payload)?;
                self.serve_forward_open_async(sender, request).await
            }
            METHOD_FORWARD_IO => {
                let request: ForwardRequest = decode(&payload)?;
                let answer = (self.sessions.serve_async(&self.shared, sender, request))
                    .await
                    .map_err(|why| remote(CODE_SESSION_GONE, why))?;
                postcard::to_allocvec(&answer)
                    .map_err(|error| remote(CODE_BAD_REQUEST, error.to_string()))
            }
            _ => self.serve_forward(sender, method, payload),
        }
    }

    /// Serves a client attached to `sender`, a node without a replica (blocking).
    fn serve_forward(
        &self,
        sender: NodeId,
        method: u16,
        payload: Vec<u8>,
    ) -> Result<Vec<u8>, RemoteFailure> {
        let remote = |code: u16, message: String| RemoteFailure { code, message };
        match method {
            METHOD_FORWARD_OPEN => {
                let request = decode(&payload)?;
                self.serve_forward_open(sender, request)
            }
            METHOD_FORWARD_IO => {
                let request: ForwardRequest = decode(&payload)?;
                let answer = self
                    .sessions
                    .serve(&self.shared, sender, request)
                    .map_err(|why| remote(CODE_SESSION_GONE, why))?;
                postcard::to_allocvec(&answer)
                    .map_err(|error| remote(CODE_BAD_REQUEST, error.to_string()))
            }
            _ => {
                let request: ForwardClose = decode(&payload)?;
                self.sessions.close(sender, request.session);
                Ok(Vec::new())
            }
        }
    }
}

/// The record of `entry`'s snapshot named `snapshot`.
/// The replicas of `entry` other than `local` whose copy of `snapshot` is incomplete, in sync
/// or catching up (a catch-up under way must start over after a rollback onto it); none when
/// the snapshot does not exist (the rollback answers that). Refused when `local` is the
/// primary and its own copy is incomplete.
fn lacking_snapshot(
    entry: &keel_catalog::VolumeEntry,
    snapshot: &str,
    local: NodeId,
) -> VolumeResult<Vec<NodeId>> {
    let Some(frozen) = entry.snapshot_by_name(snapshot) else {
        return Ok(Vec::new());
    };
    let replication = &entry.record.replication;
    if replication.primary == local {
        keel_volume::check_snapshot_complete(&entry.record, frozen, local)?;
    }
    Ok(replication
        .replicas
        .iter()
        .copied()
        .filter(|node| *node != local && !frozen.complete_on(*node))
        .collect())
}

/// The snapshots of `entry` that `node` alone holds whole among `replicas`: removing it
/// from them would lose those.
pub(crate) fn only_whole_on(
    entry: &keel_catalog::VolumeEntry,
    replicas: &[NodeId],
    node: NodeId,
) -> Vec<String> {
    entry
        .snapshots
        .values()
        .filter(|snapshot| {
            snapshot.complete_on(node)
                && !replicas
                    .iter()
                    .any(|other| *other != node && snapshot.complete_on(*other))
        })
        .map(|snapshot| snapshot.name.clone())
        .collect()
}

/// The snapshot names, quoted and separated by commas, for a message.
pub fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|name| format!("{name:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) fn snapshot_of<'a>(
    entry: &'a keel_catalog::VolumeEntry,
    snapshot: &str,
) -> VolumeResult<&'a keel_catalog::SnapshotRecord> {
    entry
        .snapshot_by_name(snapshot)
        .ok_or_else(|| VolumeError::SnapshotNotFound {
            volume: entry.record.name.clone(),
            snapshot: snapshot.to_string(),
        })
}

/// Decodes a request; one that does not parse is answered `CODE_BAD_REQUEST`.
fn decode<'a, T: serde::Deserialize<'a>>(payload: &'a [u8]) -> Result<T, RemoteFailure> {
    postcard::from_bytes(payload).map_err(|error| RemoteFailure {
        code: CODE_BAD_REQUEST,
        message: error.to_string(),
    })
}

/// How long a node shutting down waits for its replicas to confirm the primaries' last FLUSH.
const SHUTDOWN_FLUSH_WAIT: Duration = Duration::from_secs(5);
/// How often the primaries served here look for replicas to move.
const MOVE_CHECK_EVERY: Duration = Duration::from_secs(2);

/// Whether `node` was removed or has been down for at least `after_ms` (a reboot comes back
/// sooner).
pub(crate) fn node_lost(
    catalog: &keel_catalog::CatalogState,
    node: NodeId,
    now_ms: i64,
    after_ms: i64,
) -> bool {
    catalog.nodes.get(&node).is_none_or(|record| {
        record.removed
            || (record.state == keel_catalog::NodeState::Down
                && now_ms.saturating_sub(record.state_since_unix_ms) >= after_ms)
    })
}

/// Whether `node` no longer counts as a place for a replica: lost ([`node_lost`]) or draining.
pub(crate) fn node_gone(
    catalog: &keel_catalog::CatalogState,
    node: NodeId,
    now_ms: i64,
    after_ms: i64,
) -> bool {
    node_lost(catalog, node, now_ms, after_ms)
        || catalog
            .nodes
            .get(&node)
            .is_some_and(|record| record.draining)
}

/// The replicas of `entry` that should move, its primary's aside: on nodes that are gone
/// ([`node_gone`]), but not those `answering` on a node only down: in sync and answering the
/// primary after all (its reports lag: it just came back, or only the Raft leader lost it),
/// such a replica would be copied whole elsewhere for nothing (seed 5829 with moves).
/// The first list can move; the second holds replicas whose node alone holds snapshots
/// whole, which stay until snapshot repair copies them (once the node is up again) or they
/// are deleted: moving one would lose those snapshots.
pub(crate) fn replicas_to_move(
    catalog: &keel_catalog::CatalogState,
    entry: &keel_catalog::VolumeEntry,
    answering: impl Fn(NodeId) -> bool,
    now_ms: i64,
    after_ms: i64,
) -> (Vec<NodeId>, Vec<NodeId>) {
    let replication = &entry.record.replication;
    let leaving = |node: NodeId| {
        catalog
            .nodes
            .get(&node)
            .is_none_or(|record| record.removed || record.draining)
    };
    replication
        .replicas
        .iter()
        .copied()
        .filter(|node| {
            *node != replication.primary
                && node_gone(catalog, *node, now_ms, after_ms)
                && (leaving(*node) || !answering(*node))
        })
        .partition(|node| only_whole_on(entry, &replication.replicas, *node).is_empty())
}

/// A whole-volume copy this node waits to send ([`Settings::rebuilds_max`]): the volume and
/// the replica's node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebuildWaiting {
    pub volume: String,
    pub node: NodeId,
}

impl Replication {
    /// The whole-volume copies waiting for one of this node's turns (`rebuilds_max`), by
    /// volume name: what health shows, since their replicas stay out of sync meanwhile.
    pub fn rebuilds_waiting(&self) -> Vec<RebuildWaiting> {
        let primaries: Vec<Arc<Primary>> = lock(&self.primaries).values().cloned().collect();
        let mut waiting: Vec<RebuildWaiting> = primaries
            .iter()
            .filter(|primary| !primary.is_closed())
            .flat_map(|primary| {
                let volume = primary.name().to_string();
                (primary.status().catching_up.into_iter())
                    .filter(|catch_up| catch_up.waiting_for_turn)
                    .map(move |catch_up| RebuildWaiting {
                        volume: volume.clone(),
                        node: catch_up.node,
                    })
            })
            .collect();
        waiting.sort_by(|a, b| (&a.volume, a.node).cmp(&(&b.volume, b.node)));
        waiting
    }

    /// How many whole-volume copies this node sends at once ([`Settings::rebuilds_max`]).
    pub fn rebuilds_max(&self) -> usize {
        self.rebuilds_max
    }
}

/// A replica that would move off its node (down for the move time, draining or removed) but
/// stays: that node alone holds these snapshots whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldReplica {
    pub volume: String,
    pub node: NodeId,
    pub snapshots: Vec<String>,
}

impl Replication {
    /// Every replica held on a node that is gone because it alone holds snapshots whole
    /// ([`replicas_to_move`]), by volume name: what health and `keel node info` show, since
    /// such a replica waits (and a drain with it) until the node is back or the snapshots
    /// are deleted.
    pub fn held_replicas(&self) -> Vec<HeldReplica> {
        let now_ms = self.shared.clock().wall_unix_ms();
        let after_ms = i64::try_from(self.move_after.as_millis()).unwrap_or(i64::MAX);
        let catalog = self.shared.metadata.catalog().read();
        let mut held = Vec::new();
        for entry in catalog.volumes.values() {
            if entry.record.status != keel_catalog::VolumeStatus::Ready {
                continue;
            }
            // (Whether the replica answers its primary is the primary's node's to know.)
            let (_, nodes) = replicas_to_move(&catalog, entry, |_| false, now_ms, after_ms);
            for node in nodes {
                held.push(HeldReplica {
                    volume: entry.record.name.clone(),
                    node,
                    snapshots: only_whole_on(entry, &entry.record.replication.replicas, node),
                });
            }
        }
        held.sort_by(|a, b| (&a.volume, a.node).cmp(&(&b.volume, b.node)));
        held
    }
}

impl Replication {
    /// Replicated volumes that need a primary to restore their redundancy but that no client
    /// attached anywhere: this node serves them in the background, as an attach would.
    /// - Named primary here, not served here, with a replica out of sync or on a node that is
    ///   gone (R raised, a replica lost, a node drained while nobody used the volume), or a
    ///   snapshot copy to repair.
    /// - Primary on a node down (or removed) for `after`, this node the lowest in-sync replica
    ///   whose node is up: it takes the volume over (fenced by the epoch like any take-over).
    fn needing_a_primary(&self, after: Duration) -> Vec<String> {
        let local = self.shared.local_node;
        let now_ms = self.shared.clock().wall_unix_ms();
        let after_ms = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
        // A stale primary (the volume changed hands and came back: [`Primary::stale_for`])
        // serves nothing; the attach that serves the volume anew closes it.
        let named_here: HashMap<u64, u64> = {
            let catalog = self.shared.metadata.catalog().read();
            (catalog.volumes.iter())
                .filter(|(_, entry)| entry.record.replication.primary == local)
                .map(|(id, entry)| (*id, entry.record.replication.epoch))
                .collect()
        };
        let served: Vec<u64> = lock(&self.primaries)
            .iter()
            .filter(|(id, primary)| {
                !primary.is_closed()
                    && !(named_here.get(id)).is_some_and(|epoch| primary.stale_for(*epoch))
            })
            .map(|(id, _)| *id)
            .collect();
        let catalog = self.shared.metadata.catalog().read();
        let up = |node: NodeId| catalog.node_is_up(node);
        catalog
            .ready_volumes()
            .filter(|entry| {
                let replication = &entry.record.replication;
                if replication.replicas.len() <= 1 || served.contains(&entry.record.id) {
                    return false;
                }
                if replication.primary == local {
                    replication.in_sync.len() < replication.replicas.len()
                        || (self.shared.snapshot_repair
                            && snapshot_repair_due(&catalog, entry, local).is_some())
                        || replication
                            .replicas
                            .iter()
                            .any(|node| node_gone(&catalog, *node, now_ms, after_ms))
                } else {
                    node_lost(&catalog, replication.primary, now_ms, after_ms)
                        && replication
                            .in_sync
                            .iter()
                            .copied()
                            .filter(|node| up(*node))
                            .min()
                            == Some(local)
                }
            })
            .map(|entry| entry.record.name.clone())
            .collect()
    }
}

/// Why a node hands the replicated volumes it serves as primary to other replicas
/// ([`Replication::hand_off_primaries`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leaving {
    /// The node is draining: its replicas are moved off, a primary's last.
    Draining,
    /// Its store is about to refuse writes for want of space (`LocalVolumes::space_low`): a
    /// replica with room keeps the volume writable. Only to a node not nearly full.
    SpaceLow,
}

impl Leaving {
    /// How the node's logs and a closed primary say why.
    fn why(self) -> &'static str {
        match self {
            Leaving::Draining => "this node is draining",
            Leaving::SpaceLow => "this node's store is nearly out of space",
        }
    }
}

impl Replication {
    /// Whether this node is draining (as its catalog shows).
    fn draining_here(&self) -> bool {
        let catalog = self.shared.metadata.catalog().read();
        (catalog.nodes.get(&self.shared.local_node)).is_some_and(|record| record.draining)
    }

    /// Why this node hands its primaries off, if it does.
    fn leaving(&self) -> Option<Leaving> {
        if self.draining_here() {
            Some(Leaving::Draining)
        } else if self.shared.local.space_low() {
            Some(Leaving::SpaceLow)
        } else {
            None
        }
    }

    /// On a node that is draining or low on space ([`Leaving`]), hands each replicated volume
    /// served here as primary to another replica in sync
    /// ([`keel_catalog::CatalogState::hand_off_target`], [`Primary::hand_off`]): the drain
    /// then moves this node's replica off like any other; a node low on space stops taking
    /// its clients' writes first (its replica then refuses the new primary's stream, falls
    /// out of sync and moves to a node with room like any replica refusing its catch-ups).
    /// Clients attached here go on through the new primary, forwarded ([`Forwarded`]),
    /// without noticing: their I/O waits while the volume changes hands. Attaches wait too
    /// (the attach lock): none can reach the primary once it is being handed off.
    async fn hand_off_primaries(&self) {
        let Some(leaving) = self.leaving() else {
            return;
        };
        let local = self.shared.local_node;
        let planned: Vec<(Arc<Primary>, NodeId)> = {
            let served: Vec<Arc<Primary>> = lock(&self.primaries)
                .values()
                .filter(|primary| !primary.is_closed())
                .cloned()
                .collect();
            let catalog = self.shared.metadata.catalog().read();
            served
                .into_iter()
                .filter_map(|primary| {
                    let replication = &catalog
                        .volumes
                        .get(&primary.volume_id())?
                        .record
                        .replication;
                    if replication.primary != local {
                        return None;
                    }
                    let to = catalog.hand_off_target(replication, local)?;
                    let room = !catalog.nearfull.contains(&to);
                    (leaving == Leaving::Draining || room).then_some((primary, to))
                })
                .collect()
        };
        for (primary, to) in planned {
            let _attaching = self.attaching.lock().await;
            let name = primary.name().to_string();
            let handed = match self.attached_to(&primary) {
                None => primary.hand_off(to, leaving.why()).await,
                Some(attached) => {
                    let shared = self.shared.clone();
                    let (held, handed) = (attached.clone(), primary.clone());
                    blocking(move || {
                        hand_off_forwarding(&shared, &attached, &primary, to, leaving.why())
                    })
                    .await
                    .unwrap_or_else(|error| Err(unavailable(&name, error)))
                    .inspect(|()| self.forwarded_until_handed_back(&handed, &held))
                }
            };
            match handed {
                Ok(()) => {
                    self.shared
                        .counters
                        .handed_off
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        volume = name,
                        node = to,
                        "{}: handed the volume to another replica",
                        leaving.why()
                    )
                }
                Err(error) => tracing::info!(
                    volume = name,
                    node = to,
                    %error,
                    "could not hand the volume to another replica yet"
                ),
            }
        }
    }
}

impl Replication {
    /// Remembers `attached`, which a hand-off of `primary`'s volume just switched to
    /// forwarding, for [`Self::bring_clients_back`].
    fn forwarded_until_handed_back(&self, primary: &Primary, attached: &Arc<Attached>) {
        let mut returning = lock(&self.returning);
        returning.retain(|entry| entry.attached.strong_count() > 0);
        returning.push(Returning {
            volume_id: primary.volume_id(),
            name: primary.name().to_string(),
            attached: Arc::downgrade(attached),
        });
    }

    /// Switches the handles of clients attached here that a hand-off left forwarded back to
    /// the primary served here, once the volume was handed back and this node serves it
    /// again (not stale, and not handing its volumes off itself): their I/O is local again
    /// rather than a round trip through another node, or two. Each switch waits for the
    /// handle's I/O in flight, FLUSHes through the forwarding (every write its clients were
    /// told of is then durable, whichever way it went), then gives them the handle this
    /// node's own sessions of the volume use, which a later hand-off switches in turn. Not
    /// under the attach lock: the I/O in flight may be opening a forwarding session on this
    /// very node, which takes it. A FLUSH that fails leaves the clients forwarded until the
    /// next look.
    async fn bring_clients_back(&self) {
        let live: Vec<(u64, String, Arc<Attached>)> = {
            let mut returning = lock(&self.returning);
            returning.retain(|entry| entry.attached.strong_count() > 0);
            (returning.iter())
                .filter_map(|entry| {
                    let attached = entry.attached.upgrade()?;
                    Some((entry.volume_id, entry.name.clone(), attached))
                })
                .collect()
        };
        if live.is_empty() || self.leaving().is_some() {
            return;
        }
        for (volume_id, name, attached) in live {
            let Some(primary) = self.served_as_named(volume_id) else {
                continue;
            };
            let handle = self.client_handle(&name, primary);
            let switching = attached.clone();
            let switched = blocking(move || {
                switching.switch(|forwarding| {
                    forwarding.flush()?;
                    Ok::<_, VolumeError>(handle)
                })
            })
            .await
            .unwrap_or_else(|error| Err(unavailable(&name, error)));
            match switched {
                Ok(()) => {
                    lock(&self.returning).retain(|entry| {
                        !std::ptr::eq(entry.attached.as_ptr(), Arc::as_ptr(&attached))
                    });
                    tracing::info!(
                        volume = name,
                        "the volume was handed back: clients attached here use its primary \
                         here again"
                    )
                }
                Err(error) => tracing::info!(
                    volume = name,
                    %error,
                    "could not bring the clients attached here back from forwarding yet"
                ),
            }
        }
    }
}

/// Hands `primary` to `to` while clients attached here use it through `attached` (blocking):
/// their I/O waits for the hand-off, then goes on forwarded to `to` ([`Forwarded`]).
fn hand_off_forwarding(
    shared: &Arc<Shared>,
    attached: &Attached,
    primary: &Arc<Primary>,
    to: NodeId,
    why: &str,
) -> VolumeResult<()> {
    attached.switch(|_| {
        shared.runtime.block_on(primary.hand_off(to, why))?;
        Ok::<Arc<dyn VolumeIo>, VolumeError>(Forwarded::open(shared.clone(), primary.name())?)
    })
}

impl Replication {
    /// Hands volume `name`, whose primary this node is, to `to`, another replica in sync
    /// (`keel volume hand-off`, and `keel volume move` of the primary's own replica),
    /// blocking: at one point of the write stream Raft records `to` as the primary of the
    /// next epoch ([`Primary::hand_off`]). Clients attached here go on through `to`,
    /// forwarded, as after a drain's hand-off (their I/O waits meanwhile); a client of
    /// another node forwarded through this one follows. When nothing serves the volume here,
    /// Raft just names `to` (a compare-and-set on the epoch). Refused, saying why, when
    /// another node is the primary (with its address) or `to`'s replica is not in sync.
    pub fn hand_off(&self, name: &str, to: NodeId) -> VolumeResult<()> {
        let _attaching = self.attaching.blocking_lock();
        let record = self.shared.volume_record(name)?;
        self.shared.refuse_if_served_elsewhere(name, &record)?;
        let replication = &record.replication;
        let local = self.shared.local_node;
        let invalid = |detail: String| VolumeError::Invalid {
            volume: name.to_string(),
            detail,
        };
        if replication.replicas.len() <= 1 {
            return Err(invalid(
                "it has one replica: there is no other to hand it to".to_string(),
            ));
        }
        if to == local {
            return Err(invalid(format!("node {to} is its primary already")));
        }
        if !replication.replicas.contains(&to) {
            return Err(invalid(format!(
                "node {to} holds no replica of it (its replicas: nodes {:?})",
                replication.replicas
            )));
        }
        if !replication.in_sync.contains(&to) {
            return Err(invalid(format!(
                "node {to}'s replica is not in sync: hand the volume off once it is (keel volume \
                 info shows its catch-up)"
            )));
        }
        let why = "an operator handed the volume off";
        match self.served(record.id) {
            Some(primary) => match self.attached_to(&primary) {
                Some(attached) => hand_off_forwarding(&self.shared, &attached, &primary, to, why)
                    .inspect(|()| self.forwarded_until_handed_back(&primary, &attached)),
                None => self.shared.runtime.block_on(primary.hand_off(to, why)),
            },
            None => (self.shared.runtime)
                .block_on(
                    self.shared
                        .cluster
                        .propose_async(Command::VolumeSetReplication {
                            volume_id: record.id,
                            epoch: replication.epoch,
                            primary: to,
                            in_sync: replication.in_sync.clone(),
                        }),
                )
                .map(|_| ())
                .map_err(|error| change_error(name, error)),
        }?;
        self.shared
            .counters
            .handed_off
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(volume = name, node = to, "{why}");
        Ok(())
    }

    /// On a draining node, copies each volume whose one replica (R=1) is here to another
    /// storage node that is up and holds none (`VolumeCopyOffDraining`: R stays 1, the copy
    /// joins out of sync). This node then serves the volume as primary (a client attached
    /// here switches over once its I/O in flight has finished, as when R is raised; nobody
    /// attached: the background loop serves it), catches the copy up and hands it the
    /// volume ([`Self::hand_off_primaries`]); the new primary removes this node's copy
    /// ([`Primary::move_replicas`]). With no node to copy to, the volume stays.
    async fn copy_single_copies_off(&self) {
        if !self.draining_here() {
            return;
        }
        let local = self.shared.local_node;
        let single: Vec<String> = {
            let catalog = self.shared.metadata.catalog().read();
            catalog
                .ready_volumes()
                .filter(|entry| {
                    let replication = &entry.record.replication;
                    replication.factor == 1 && replication.replicas == [local]
                })
                .map(|entry| entry.record.name.clone())
                .collect()
        };
        for name in single {
            // Chosen after the previous copy was recorded, which counts on its node: the
            // copies spread by the nodes' provisioned fraction.
            let to = {
                let catalog = self.shared.metadata.catalog().read();
                catalog.choose_replica_nodes(&[local], 1).first().copied()
            };
            let Some(to) = to else {
                break;
            };
            match self.copy_off(&name, to).await {
                Ok(true) => {
                    self.shared
                        .counters
                        .copied_off
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        volume = name,
                        node = to,
                        "this node is draining: copying the volume's one replica to another node"
                    )
                }
                Ok(false) => {}
                Err(error) => tracing::info!(
                    volume = name,
                    node = to,
                    %error,
                    "could not copy the volume's one replica off this draining node yet"
                ),
            }
        }
    }

    /// [`Self::copy_single_copies_off`] for one volume, under the attach lock: through the
    /// primary serving it here, the client's switch, or Raft alone. False if the volume
    /// changed meanwhile and has more than this one replica.
    async fn copy_off(&self, name: &str, to: NodeId) -> VolumeResult<bool> {
        let _attaching = self.attaching.lock().await;
        let record = self.shared.volume_record(name)?;
        let replication = &record.replication;
        if !(replication.factor == 1 && replication.replicas == [self.shared.local_node]) {
            return Ok(false);
        }
        let command = Command::VolumeCopyOffDraining {
            volume_id: record.id,
            epoch: replication.epoch,
            to,
        };
        if let Some(primary) = self.served(record.id) {
            primary.copy_off(to).await?;
            return Ok(true);
        }
        let attached = lock(&self.singles).get(&record.id).and_then(Weak::upgrade);
        match attached {
            Some(attached) => {
                let this = self
                    .this
                    .upgrade()
                    .ok_or_else(|| unavailable(name, "this node is stopping".to_string()))?;
                let volume = name.to_string();
                blocking(move || {
                    this.widen_attached_single(&attached, &volume, record.id, command)
                })
                .await
                .map_err(|error| unavailable(name, error))??;
            }
            None => {
                self.shared
                    .cluster
                    .propose_async(command)
                    .await
                    .map_err(|error| change_error(name, error))?;
            }
        }
        Ok(true)
    }
}

/// A snapshot copy due for a repair ([`primary`]'s `repair` module): the snapshot's
/// generation, the replica whose copy lacks its data, and the node to copy it from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RepairDue {
    pub generation: u64,
    pub target: NodeId,
    pub source: NodeId,
}

/// The first snapshot of a volume (oldest first) whose copy on an in-sync replica that is up
/// is incomplete, while an in-sync node that is up holds it whole (`local` first).
pub(crate) fn snapshot_repair_due(
    catalog: &keel_catalog::CatalogState,
    entry: &keel_catalog::VolumeEntry,
    local: NodeId,
) -> Option<RepairDue> {
    let replication = &entry.record.replication;
    let up = |node: &NodeId| catalog.node_is_up(*node);
    let ready: Vec<NodeId> = replication.in_sync.iter().copied().filter(up).collect();
    entry.snapshots.values().find_map(|snapshot| {
        let target = ready
            .iter()
            .copied()
            .find(|node| !snapshot.complete_on(*node))?;
        let source = std::iter::once(local)
            .filter(|node| ready.contains(node))
            .chain(ready.iter().copied())
            .find(|node| snapshot.complete_on(*node))?;
        Some(RepairDue {
            generation: snapshot.generation,
            target,
            source,
        })
    })
}

/// Each primary served here moves replicas off nodes that are gone, one at a time, and
/// repairs incomplete snapshot copies; a volume that needs a primary to get its replicas (or
/// its snapshot copies) back and has none is served here first
/// ([`Replication::needing_a_primary`]).
async fn move_loop(replication: std::sync::Weak<Replication>, after: Duration) {
    loop {
        let Some(strong) = replication.upgrade() else {
            return;
        };
        if strong.shared.cluster.is_stopping() {
            return;
        }
        let clock = strong.shared.clock();
        for name in strong.needing_a_primary(after) {
            match strong.open_hosted(&name).await {
                Ok(_) => tracing::info!(
                    volume = name,
                    "serving the volume without a client to restore its replicas"
                ),
                Err(error) => tracing::info!(
                    volume = name,
                    %error,
                    "could not serve the volume to restore its replicas yet"
                ),
            }
        }
        strong.hand_off_primaries().await;
        strong.bring_clients_back().await;
        strong.copy_single_copies_off().await;
        let primaries: Vec<Arc<Primary>> = lock(&strong.primaries).values().cloned().collect();
        let shared = strong.shared.clone();
        drop(strong);
        for primary in primaries {
            primary.move_replicas(after).await;
            primary.spawn_snapshot_repair();
        }
        tokio::select! {
            _ = clock.sleep(MOVE_CHECK_EVERY) => {}
            _ = shared.space.low.notified() => {}
        }
    }
}

impl Handler for Replication {
    fn handle(
        &self,
        caller: Caller,
        method: u16,
        payload: Vec<u8>,
    ) -> BoxFuture<Result<Vec<u8>, RemoteFailure>> {
        let this = self.this.clone();
        Box::pin(async move {
            let Some(this) = this.upgrade() else {
                return Err(RemoteFailure {
                    code: wire::CODE_FAILED,
                    message: "the replication engine is shutting down".to_string(),
                });
            };
            this.serve(caller, method, payload).await
        })
    }

    fn node_id(&self) -> NodeId {
        self.shared.local_node
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use keel_catalog::{
        CatalogState, Command, NodeAddresses, NodeRole, NodeSpec, NodeState, VolumeSettings,
        VolumeStatus,
    };

    use super::replicas_to_move;

    /// The command creating a ready 1 MiB volume `name` on `replicas` (the first its primary).
    pub(crate) fn volume_create(name: &str, replicas: Vec<u64>) -> Command {
        Command::VolumeCreate {
            settings: VolumeSettings {
                name: name.to_string(),
                size_bytes: 1 << 20,
                compression: "none".to_string(),
                iops_max: None,
                bandwidth_max_mib_per_second: None,
            },
            uuid: [1; 16],
            created_unix_seconds: 1,
            replicas,
            status: VolumeStatus::Ready,
        }
    }

    fn apply(state: &mut CatalogState, command: Command) {
        let plan = state.plan(&command).unwrap();
        state.commit(&plan.changes);
    }

    /// Node `index`: the first bootstraps the cluster, the others join it.
    fn node(index: u8) -> Command {
        let node = NodeSpec {
            name: format!("n{index}"),
            instance: [index; 16],
            role: NodeRole::Storage,
            addresses: NodeAddresses {
                cluster: format!("127.0.0.{index}:3902"),
                ..NodeAddresses::default()
            },
            labels: Default::default(),
            devices: Vec::new(),
        };
        match index {
            1 => Command::Bootstrap {
                cluster_id: [7; 16],
                created_unix_ms: 0,
                node,
            },
            _ => Command::NodeAdd {
                node,
                joined_unix_ms: 1,
            },
        }
    }

    /// Nodes 1-3 and the volume "v" on nodes 2 and 1, whose snapshot "s" was taken while node 2
    /// was primary and node 1 out of sync (so node 2 alone holds it whole) when `alone` is
    /// set; node 1 is primary again, both in sync, and node 2 is down since 0 ms.
    fn cluster(alone: bool) -> CatalogState {
        let mut state = CatalogState::default();
        for index in 1..=3 {
            apply(&mut state, node(index));
        }
        apply(&mut state, volume_create("v", vec![2, 1]));
        let volume_id = state.volume("v").unwrap().record.id;
        let mut epoch = state.volume("v").unwrap().record.replication.epoch;
        let mut replication = |state: &mut CatalogState, primary, in_sync: &[u64]| {
            apply(
                state,
                Command::VolumeSetReplication {
                    volume_id,
                    epoch,
                    primary,
                    in_sync: in_sync.to_vec(),
                },
            );
            epoch += 1;
        };
        if alone {
            replication(&mut state, 2, &[2]);
        }
        apply(
            &mut state,
            Command::SnapshotCreate {
                volume: "v".to_string(),
                snapshot: "s".to_string(),
                guid: [2; 16],
                created_unix_seconds: 2,
            },
        );
        // Node 1 back in sync, then primary.
        replication(&mut state, 2, &[2, 1]);
        replication(&mut state, 1, &[1, 2]);
        apply(
            &mut state,
            Command::NodeSetState {
                id: 2,
                state: NodeState::Down,
                at_unix_ms: 0,
            },
        );
        state
    }

    fn planned(state: &CatalogState, answering: bool, now_ms: i64) -> (Vec<u64>, Vec<u64>) {
        let entry = state.volume("v").unwrap();
        replicas_to_move(state, entry, |node| answering && node == 2, now_ms, 1_000)
    }

    // Proves which replicas the primary moves: one on a node down for the move time, but not
    // one that still answers it in sync (its node's reports lag), unless the node is draining;
    // and none whose node alone holds a snapshot whole, which is held instead.
    #[test]
    fn a_replica_moves_off_a_node_gone_unless_it_answers_or_alone_holds_a_snapshot() {
        let mut state = cluster(false);
        assert_eq!(state.volume("v").unwrap().record.replication.primary, 1);
        // Down, but not for the move time yet.
        assert_eq!(planned(&state, false, 999), (vec![], vec![]));
        assert_eq!(planned(&state, false, 1_000), (vec![2], vec![]));
        // Down for long as the catalog says, but answering its primary: it stays.
        assert_eq!(planned(&state, true, 1_000), (vec![], vec![]));
        // Draining: it moves, answering or not.
        apply(
            &mut state,
            Command::NodeSetDraining {
                id: 2,
                draining: true,
            },
        );
        assert_eq!(planned(&state, true, 0), (vec![2], vec![]));

        let state = cluster(true);
        let entry = state.volume("v").unwrap();
        assert_eq!(entry.snapshot_by_name("s").unwrap().incomplete_on, vec![1]);
        assert_eq!(planned(&state, false, 1_000), (vec![], vec![2]));
        // The primary's node is never in either list.
        assert!(!planned(&state, false, 1_000).0.contains(&1));
    }

    // Proves where a draining primary hands its volume: to the lowest other replica in sync
    // whose node is up and not draining; to none while the only other one is down, draining
    // or out of sync.
    #[test]
    fn a_draining_primary_hands_off_to_an_up_replica_in_sync_only() {
        let set_state = |state: &mut CatalogState, id, node_state| {
            apply(
                state,
                Command::NodeSetState {
                    id,
                    state: node_state,
                    at_unix_ms: 5,
                },
            )
        };
        let target = |state: &CatalogState| {
            let replication = &state.volume("v").unwrap().record.replication;
            state.hand_off_target(replication, replication.primary)
        };
        let mut state = cluster(false);
        // Node 2, the other replica, is down.
        assert_eq!(target(&state), None);
        set_state(&mut state, 2, NodeState::Up);
        assert_eq!(target(&state), Some(2));
        apply(
            &mut state,
            Command::NodeSetDraining {
                id: 2,
                draining: true,
            },
        );
        assert_eq!(target(&state), None);
        apply(
            &mut state,
            Command::NodeSetDraining {
                id: 2,
                draining: false,
            },
        );
        // Out of sync: not a target.
        let record = state.volume("v").unwrap().record.clone();
        apply(
            &mut state,
            Command::VolumeSetReplication {
                volume_id: record.id,
                epoch: record.replication.epoch,
                primary: 1,
                in_sync: vec![1],
            },
        );
        assert_eq!(target(&state), None);
    }
}
