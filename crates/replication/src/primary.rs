//! The primary side: a replicated volume as a [`VolumeIo`]. Each write is applied locally and
//! queued, in order, to a stream per replica; a FLUSH is acknowledged when the local store and
//! every counted replica (the in-sync set, and a replica about to join it) have made it durable.
//! A replica that fails is taken out of the in-sync set through Raft before a FLUSH completes
//! without it; a replica outside the set catches up (`Primary::resync`) and is put back
//! through Raft.

mod repair;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use keel_catalog::{Command, MetadataError, NodeId, VolumeEntry};
use keel_volume::{VolumeError, VolumeIo, VolumeResult};

use crate::dirty::{Chunks, Lacking, ShutdownNote};
use crate::turns::{TURN_RENEW, TURN_RETRY};
use crate::wire::{
    self, Batch, BatchAck, ChangedAnswer, ChangedRequest, CopyAnswer, CopyTurnAnswer,
    CopyTurnRequest, HashAnswer, HashRequest, Op, TurnAction, UnwrittenAnswer, BLOCK_HASH_BYTES,
    CODE_BEHIND, CODE_FENCED, CODE_NO_SPACE, METHOD_CHANGED, METHOD_COPY_TURN, METHOD_HANDED_OFF,
    METHOD_HASHES, METHOD_READ_COPY, METHOD_REPLICATE, METHOD_UNWRITTEN,
};
use crate::{lock, Point, Shared, RESYNC_CHUNK_BYTES, RESYNC_PROBE_BYTES};

/// Bytes queued for one replica before writers wait for it (bounded memory).
const QUEUE_BYTES_MAX: usize = 64 << 20;
/// Most bytes of writes in one batch.
const BATCH_BYTES_MAX: usize = 4 << 20;
/// Batches of one replica's stream in flight at once: the next travels and is decoded while
/// the replica applies one.
const BATCHES_IN_FLIGHT: usize = 4;
/// A batch not answered within this is a failed replica (it is then taken out of the
/// in-sync set). Covers a replica's fdatasync on a busy shared disk.
const BATCH_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a replica outside the in-sync set is retried.
const RESYNC_RETRY: Duration = Duration::from_secs(1);
/// The longest wait between catch-ups of a replica that keeps refusing what it is sent
/// ([`retry_after`]).
const RESYNC_RETRY_MAX: Duration = Duration::from_secs(30);

/// How long a catch-up that failed waits before the next try, after `failures` failed tries
/// in a row: [`RESYNC_RETRY`], doubled for each try in a row that the replica itself refused
/// (`refused`: its store is out of space, [`CODE_NO_SPACE`], which the next second rarely
/// changes), up to [`RESYNC_RETRY_MAX`]. A node that does not answer, or that refuses for
/// another reason, is tried every second: it may be ready at any moment, and its catch-up
/// should start then.
fn retry_after(failures: u32, refused: bool) -> Duration {
    if !refused {
        return RESYNC_RETRY;
    }
    let doublings = failures.saturating_sub(1).min(5);
    RESYNC_RETRY
        .saturating_mul(1 << doublings)
        .min(RESYNC_RETRY_MAX)
}
/// A call about a whole copy's turn on the replica's node not answered within this fails
/// (the catch-up is retried).
const TURN_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Reads of a resync chunk without the order lock before the last one, under it throughout
/// (a chunk clients keep writing to still makes progress).
const RESYNC_READ_ATTEMPTS: u32 = 3;
/// How long a sender waits for more writes (or a FLUSH) before it sends what it has.
const LINGER: Duration = Duration::from_millis(1);
/// Queued bytes that are sent at once, without lingering.
const LINGER_BYTES_MAX: usize = 256 << 10;
/// A resync to a replica whose node served clients within this (as its answers tell) yields.
const REPLICA_BUSY_WINDOW: Duration = Duration::from_secs(1);
/// How long an I/O waits for this node's lease to come back before it fails.
const LEASE_WAIT: Duration = Duration::from_secs(3);
/// How long a metadata change waits for the replicas to apply the writes before it.
const QUIESCE_WAIT: Duration = Duration::from_secs(10);
/// How long a change of R waits for a rollback under way to be made (its quiesce, and a
/// replica it drops again once Raft answers).
const REPLICA_SET_WAIT: Duration = Duration::from_secs(15);
/// FLUSHes remembered until both nodes made them durable (bounded memory; a point found
/// nowhere is only kept later).
const FLUSH_POINTS_KEPT: usize = 4096;
/// How long a replica may take to list what it changed since its common point: it reads
/// every block key of the volume, never its data (about 0.1 s per GiB measured), so a base
/// plus ten times that per GiB, at most [`CHANGED_TIMEOUT_MAX`]. Not one long bound for every
/// volume: a call lost with its replica's node (no answer ever comes) holds the catch-up
/// until it runs out.
fn changed_timeout(volume_bytes: u64) -> Duration {
    Duration::from_secs(10 + (volume_bytes >> 30)).min(CHANGED_TIMEOUT_MAX)
}
const CHANGED_TIMEOUT_MAX: Duration = Duration::from_secs(300);
/// How long a replica's stream stays idle before an empty batch tells it its common point.
const TELL_WHEN_IDLE: Duration = Duration::from_millis(200);
/// How long a primary that handed a volume off waits for the new primary to take the notice.
const HANDED_OFF_TIMEOUT: Duration = Duration::from_secs(1);
/// How long an unanswered in-sync change may keep being refused (the epoch moved on) without
/// this node's catalog showing the change that moved it, before the primary stops serving.
const SETTLE_REFUSED_MAX: Duration = Duration::from_secs(30);

/// How long a FLUSH waits in one round before it checks the lease and the epoch again.
const WAIT_ROUND: Duration = Duration::from_millis(100);

/// One item of a replica's stream: a change (a write, or resync data), or a flush of the
/// history through a position.
enum Item {
    Op(Op),
    Flush { upto: u64 },
}

impl Item {
    fn bytes(&self) -> usize {
        match self {
            Item::Op(Op::Write { data, .. }) => data.len(),
            _ => 64,
        }
    }
}

/// A change of the in-sync set this primary proposes.
#[derive(Clone, Copy)]
enum InSyncChange {
    Drop(NodeId),
    /// A replica caught up on its stream (the id): refused if that stream failed meanwhile.
    Add(NodeId, u64),
    /// The same set, in a new epoch: a barrier in the Raft log (see [`Primary::quiesce_async`]).
    Keep,
}

/// Whether a replica's queue should be sent now.
enum Readiness {
    Empty,
    Linger,
    Now,
}

/// The primary's view of one other replica.
struct Peer {
    queue: VecDeque<Item>,
    queued_bytes: usize,
    /// Writes are queued for it (it is in sync, or catching up).
    streaming: bool,
    /// FLUSHes wait for it (it is in sync, or about to be put back).
    counted: bool,
    /// Its stream failed; it waits for a resync.
    failed: bool,
    /// Highest history position it confirmed durable in the current stream.
    durable_upto: u64,
    /// Flushes queued, taken into batches, and confirmed in the current stream. A resync waits
    /// for its own final flush by count: its data has no history position, so a position an
    /// earlier flush (a client's, during the catch-up) confirmed says nothing about it.
    flushes_queued: u64,
    flushes_taken: u64,
    flushes_confirmed: u64,
    stream: u64,
    next_index: u64,
    /// Batches and questions about its copy carry it: the replica applies or answers them
    /// only after its catalog reached it ([`Primary::asked_as`]).
    catalog_index: u64,
    /// The volume's write generation then: batches carry it, and a replica whose catalog
    /// moved past it refuses them ([`crate::wire::Batch::generation`]).
    generation: u64,
    sender_running: bool,
    resync_running: bool,
    /// Its catch-up copies the whole volume and waits for a turn ([`Settings::rebuilds_max`]).
    rebuild_waiting: bool,
    /// The resync in progress: when it started, and bytes compared of the volume's size.
    resync_started: Option<Instant>,
    resync_compared: u64,
    resync_total: u64,
    /// The client requests its node had started at its last answer ([`BatchAck`]), and when
    /// an answer last showed that count grow.
    client_requests: u64,
    client_requests_grew: Option<Instant>,
    /// When a batch of its current stream was last answered.
    answered: Option<Instant>,
    /// The chunk its resync reads without the order lock: `(start, end, touched)`, touched
    /// when a change ordered meanwhile overlaps it (the read is then done again).
    resync_reading: Option<(u64, u64, bool)>,
    /// What it may lack beyond its stream: what its next catch-up compares.
    lacking: Lacking,
    /// FLUSH batches of its stream it confirmed, taken while it was in sync, not yet known
    /// durable here too: `(batch index, position covered)`, oldest first.
    confirmed_flushes: VecDeque<(u64, u64)>,
    /// The latest batch of its stream whose FLUSH both nodes made durable while it was in
    /// sync: batches tell it (its common point with this node).
    common_index: Option<u64>,
    /// The position that FLUSH covers.
    common_upto: u64,
    /// When this node last kept its common point with it ([`crate::Settings::point_every`]),
    /// and a newer point not kept yet (too soon after the last).
    point_kept: Option<Instant>,
    point_due: Option<Point>,
    /// The last `common_index` a batch carried to it.
    common_told: Option<u64>,
    /// Placed on its node by this primary and not caught up yet: a point it may still hold
    /// (its copy's erase never ran, or a trim deleted blocks while the volume had one replica)
    /// says nothing, so its catch-up compares everything.
    added: bool,
    wake: Arc<tokio::sync::Notify>,
    /// This entry's identity: a replica removed and added back (R lowered and raised) gets a
    /// new entry, and the catch-up task of the old one must not work on it
    /// ([`Primary::spawn_resync`]).
    id: u64,
    /// Catch-ups of it that failed in a row since it was last in sync.
    failures: u32,
    /// Why it last failed: `keel volume info` and health show it.
    last_failure: Option<PeerFailure>,
    /// Since when every failure of it was its own refusal (it answered that applying failed:
    /// its disk is full, or its store stopped): once that lasts [`Settings::move_after`] it
    /// moves to another node ([`Primary::move_replicas`]).
    refusing_since: Option<Instant>,
}

/// Why a replica's stream or catch-up last failed.
struct PeerFailure {
    /// The replica's own answer when it refused a batch; the catch-up's error otherwise.
    message: String,
    at: Instant,
    /// The replica's store refused what it was sent for want of space ([`CODE_NO_SPACE`]):
    /// it is up, but cannot take it until room is made. Other refusals (its catalog or copy
    /// not ready yet, say while a rollback restarts it) pass within seconds.
    refused: bool,
}

/// Identities of [`Peer`] entries, never reused.
static PEER_IDS: AtomicU64 = AtomicU64::new(1);

impl Peer {
    fn new() -> Peer {
        Peer {
            id: PEER_IDS.fetch_add(1, Ordering::Relaxed),
            queue: VecDeque::new(),
            queued_bytes: 0,
            streaming: false,
            counted: false,
            failed: false,
            durable_upto: 0,
            flushes_queued: 0,
            flushes_taken: 0,
            flushes_confirmed: 0,
            stream: 0,
            next_index: 0,
            catalog_index: 0,
            generation: 0,
            sender_running: false,
            resync_running: false,
            rebuild_waiting: false,
            resync_started: None,
            resync_compared: 0,
            resync_total: 0,
            client_requests: 0,
            client_requests_grew: None,
            answered: None,
            resync_reading: None,
            lacking: Lacking::default(),
            confirmed_flushes: VecDeque::new(),
            common_index: None,
            common_upto: 0,
            point_kept: None,
            point_due: None,
            common_told: None,
            added: false,
            wake: Arc::new(tokio::sync::Notify::new()),
            failures: 0,
            last_failure: None,
            refusing_since: None,
        }
    }

    /// Stops the stream: nothing more is queued or sent to it.
    fn end_stream(&mut self) {
        self.lacking.stream_ended();
        self.streaming = false;
        self.queue.clear();
        self.queued_bytes = 0;
    }

    fn push(&mut self, item: Item) {
        if matches!(item, Item::Flush { .. }) {
            self.flushes_queued += 1;
        }
        self.queued_bytes += item.bytes();
        self.queue.push_back(item);
        self.wake.notify_one();
    }
}

struct State {
    epoch: u64,
    in_sync: BTreeSet<NodeId>,
    in_sync_min: usize,
    /// The next write's position in the volume's history.
    next_seq: u64,
    /// FLUSHes queued, oldest first: the position each covers, and the common point it
    /// would make (this node's store sequence then, every change ordered after it having a
    /// greater one; and the view then).
    flush_points: VecDeque<(u64, Point)>,
    /// Every change through this position is durable on this node.
    local_durable_upto: u64,
    peers: BTreeMap<NodeId, Peer>,
    /// Set once this node may no longer act as primary (fenced, or the volume moved on).
    closed: Option<String>,
    /// Bytes shipped to catch replicas up (resync), for `volume info` and tests.
    resync_bytes: u64,
    /// Bytes catch-ups skipped without comparing, neither side having ever written them.
    resync_skipped_bytes: u64,
    /// Bytes catch-ups compared.
    resync_compared_bytes: u64,
    /// Blocks of the local copy that failed their checksum on read and were replaced by an
    /// in-sync replica's copy.
    repaired_blocks: u64,
    /// The snapshot copy being repaired, and how far it got.
    snapshot_repair: Option<repair::SnapshotRepairProgress>,
    /// Changes under way that hold ordering back while they wait (a metadata change waiting
    /// for the replicas, a shutdown's last FLUSH): no write, FLUSH or catch-up copy is ordered
    /// until they end.
    paused: usize,
}

/// The move [`Primary::move_replicas`] makes of a replica `refusing` its catch-ups that
/// long, when no replica's node is gone: to a storage node holding none (placement skips
/// nearly full nodes). None while the replica alone holds some snapshot whole, or while a
/// copy off a draining node is under way (`extra`: that copy ends first).
fn plan_refusing_move(
    catalog: &keel_catalog::CatalogState,
    entry: &keel_catalog::VolumeEntry,
    refusing: &BTreeMap<NodeId, String>,
    extra: bool,
) -> Option<Planned> {
    if extra {
        return None;
    }
    let replication = &entry.record.replication;
    let from = (refusing.keys().copied()).find(|node| {
        *node != replication.primary
            && crate::only_whole_on(entry, &replication.replicas, *node).is_empty()
    })?;
    let to = (catalog.choose_replica_nodes(&replication.replicas, 1))
        .first()
        .copied()?;
    Some(Planned::Move { from, to })
}

/// The next change [`Primary::move_replicas`] makes to the replica set.
enum Planned {
    /// A replica off a node that is lost (down for the move time, or removed), or that has
    /// refused its catch-ups that long, to another (`VolumeMoveReplica`).
    Move { from: NodeId, to: NodeId },
    /// A replica on a draining node copied to `to` first (`VolumeCopyOffDraining`): the
    /// draining node's copy goes once `to` is in sync ([`Planned::Remove`]).
    CopyOff { from: NodeId, to: NodeId },
    /// A copy a drain had the volume keep beside R replicas, once the others are in sync.
    Remove {
        leaving: NodeId,
        replicas: Vec<NodeId>,
        in_sync_min: u8,
    },
}

/// The removal of the copy beside R replicas ([`Planned::Remove`]) that `local`, the primary
/// and not draining, makes now, if any: the copy on a draining (or lost) node first, else one
/// out of sync (a drain undone), never one alone holding snapshots whole, and only once every
/// replica that stays is in sync.
fn plan_removal(
    catalog: &keel_catalog::CatalogState,
    entry: &keel_catalog::VolumeEntry,
    local: NodeId,
    now_ms: i64,
    after_ms: i64,
) -> Option<Planned> {
    let replication = &entry.record.replication;
    let only_whole = |node: NodeId| crate::only_whole_on(entry, &replication.replicas, node);
    let leaving = (replication.replicas.iter().copied())
        .filter(|node| *node != local)
        .min_by_key(|node| {
            (
                only_whole(*node).len(),
                !crate::node_gone(catalog, *node, now_ms, after_ms),
                replication.in_sync.contains(node),
                std::cmp::Reverse(*node),
            )
        })
        .filter(|node| only_whole(*node).is_empty())?;
    let replicas: Vec<NodeId> = (replication.replicas.iter().copied())
        .filter(|node| *node != leaving)
        .collect();
    if !replicas
        .iter()
        .all(|node| replication.in_sync.contains(node))
    {
        return None;
    }
    let in_sync_min = replication.in_sync_min.min(replicas.len() as u8);
    Some(Planned::Remove {
        leaving,
        replicas,
        in_sync_min,
    })
}

/// A replicated volume served by this node as its primary.
pub struct Primary {
    volume_id: u64,
    name: String,
    local: Arc<dyn VolumeIo>,
    shared: Arc<Shared>,
    /// Serializes ordering: a write takes its position, is applied locally and is queued to
    /// every stream under this lock, so every replica applies overlapping writes in the order
    /// the primary did. Held only for sections that never wait (many client threads take it:
    /// a fair async mutex would convoy them); a change that must hold ordering back while it
    /// waits pauses it instead ([`State::paused`], [`Primary::ordering`]).
    order: Mutex<()>,
    state: Mutex<State>,
    /// Woken whenever the state changes in a way a waiter may want (a confirmation, room in a
    /// queue, a replica out of the set, the primary closed).
    changed: tokio::sync::Notify,
    /// One in-sync-set proposal at a time (each is a compare-and-set on the epoch).
    proposing: tokio::sync::Mutex<()>,
    /// Held by a change of the replica set (R changed, a replica moved) and by a rollback
    /// throughout: a rollback decides from the replica set which replicas start over, so
    /// none may join the set between that decision and the rollback. Taken before
    /// `proposing`.
    replica_set: tokio::sync::Mutex<()>,
    /// Client requests served so far: a resync that sees it move yields to them.
    client_requests: AtomicU64,
    /// A snapshot repair runs (one at a time).
    repairing: AtomicBool,
    /// Snapshot repairs that failed in a row (logged once, then every 30th).
    repair_failures: AtomicU64,
    /// The node a move last waited for because it alone holds snapshots whole (0: none),
    /// so the wait is logged once.
    move_held_for: AtomicU64,
}

/// A replica being caught up: how far the comparison got, and when it should be done at the
/// rate so far.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CatchUp {
    pub node: NodeId,
    /// It copies the whole volume and waits for one of this node's turns for that.
    pub waiting_for_turn: bool,
    pub compared_bytes: u64,
    pub total_bytes: u64,
    pub eta_seconds: Option<u64>,
    /// Tries that failed in a row (each retried, sooner or later: [`retry_after`]). While
    /// the next try has not begun, `eta_seconds` is `None`.
    pub failures: u32,
    /// Why the last one failed, and how long ago.
    pub last_failure: Option<String>,
    pub last_failure_seconds_ago: Option<u64>,
}

/// What a scrub of a replicated volume found and repaired.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ScrubReport {
    /// Replicas in sync at the end, this node's included.
    pub replicas: u64,
    pub compared_bytes: u64,
    /// Stretches no replica ever wrote, skipped.
    pub skipped_bytes: u64,
    /// Blocks of this node's copy that failed their checksum, healed from a replica.
    pub local_blocks_repaired: u64,
    /// Blocks of replicas that differed from this copy (or were damaged there), replaced.
    pub replica_blocks_repaired: u64,
    /// Stopped before the end (asked to).
    pub interrupted: bool,
}

/// Whether a replica's hashes (empty: never written, zeroes) differ from `ours`.
fn differs(ours: &[u8], theirs: &[u8], block: u64) -> bool {
    if theirs.is_empty() {
        let zero = wire::zero_block_hash(block as usize);
        return ours.chunks(BLOCK_HASH_BYTES).any(|hash| hash != zero);
    }
    ours != theirs
}

/// What `volume info` shows of a replicated volume served here (and a primary tells other
/// nodes: [`crate::wire::METHOD_PRIMARY_STATUS`]).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PrimaryStatus {
    pub epoch: u64,
    pub in_sync: Vec<NodeId>,
    pub catching_up: Vec<CatchUp>,
    pub resync_bytes: u64,
    pub resync_skipped_bytes: u64,
    /// Bytes catch-ups went through chunk by chunk (the rest they skipped).
    pub resync_compared_bytes: u64,
    /// Damaged blocks of this node's copy replaced by a replica's copy since it became primary.
    pub repaired_blocks: u64,
    /// The snapshot copy being repaired now.
    pub snapshot_repair: Option<repair::SnapshotRepairProgress>,
    pub closed: Option<String>,
}

/// Whether a primary holding epoch `held` is stale once the catalog names its node primary in
/// `recorded`: its own proposals take the catalog at most one epoch past the one it holds
/// (each is made from it, a compare-and-set, and it takes the new one before its next), so an
/// epoch two or more ahead was made by other nodes (one took the volume over, then handed it
/// back here). Such a primary must not apply a write: the new epoch's replicas in sync would
/// not get it.
fn stale(held: u64, recorded: u64) -> bool {
    recorded > held + 1
}

fn unavailable(name: &str, detail: String) -> VolumeError {
    VolumeError::Unavailable {
        volume: name.to_string(),
        detail,
    }
}

/// The phase a wait for the replicas shows in (`keel ops`): that of the request on the
/// calling thread.
fn replicating() -> keel_ops::Phase {
    keel_ops::Phase::enter(keel_ops::phase::REPLICATING)
}

impl Primary {
    /// Starts serving a volume this node just took over: `taken` is its replication record
    /// as Raft now holds it, this node primary. Replicas it lists in sync besides this node
    /// (only after a hand-off: each holds every write this copy holds, durable, and no
    /// other) are streamed to at once; the others start catching up.
    pub(crate) fn start(
        shared: Arc<Shared>,
        volume_id: u64,
        name: String,
        local: Arc<dyn VolumeIo>,
        taken: &keel_catalog::Replication,
        mut known: BTreeMap<NodeId, Chunks>,
    ) -> Arc<Primary> {
        let primary = taken.primary;
        let peers = taken
            .replicas
            .iter()
            .filter(|node| **node != primary)
            .map(|node| {
                let mut peer = Peer::new();
                if let Some(chunks) = known.remove(node) {
                    peer.lacking = Lacking::known(chunks);
                }
                (*node, peer)
            })
            .collect();
        let this = Arc::new(Primary {
            volume_id,
            name,
            local,
            shared,
            order: Mutex::new(()),
            state: Mutex::new(State {
                epoch: taken.epoch,
                in_sync: taken.in_sync.iter().copied().collect(),
                in_sync_min: usize::from(taken.in_sync_min),
                next_seq: 1,
                flush_points: VecDeque::new(),
                local_durable_upto: 0,
                peers,
                closed: None,
                resync_bytes: 0,
                resync_skipped_bytes: 0,
                resync_compared_bytes: 0,
                repaired_blocks: 0,
                snapshot_repair: None,
                paused: 0,
            }),
            changed: tokio::sync::Notify::new(),
            proposing: tokio::sync::Mutex::new(()),
            replica_set: tokio::sync::Mutex::new(()),
            client_requests: AtomicU64::new(0),
            repairing: AtomicBool::new(false),
            repair_failures: AtomicU64::new(0),
            move_held_for: AtomicU64::new(0),
        });
        let others: Vec<NodeId> = lock(&this.state).peers.keys().copied().collect();
        for node in others {
            if taken.in_sync.contains(&node) {
                this.stream_in_sync(node);
            } else {
                this.spawn_resync(node);
            }
        }
        this
    }

    /// Starts a new stream to `node`, a replica in sync from the start: counted for FLUSHes,
    /// lacking nothing (a failure of its stream later sends it through a catch-up of what the
    /// stream carried unconfirmed, as for any replica).
    fn stream_in_sync(self: &Arc<Self>, node: NodeId) {
        let catalog_index = self.shared.cluster.applied_index();
        let generation = self.catalog_generation();
        let mut state = self.state();
        let stream = self.shared.new_stream_id(self.volume_id, state.epoch);
        let Some(peer) = state.peers.get_mut(&node) else {
            return;
        };
        peer.lacking.caught_up();
        peer.streaming = true;
        peer.counted = true;
        peer.stream = stream;
        peer.next_index = 0;
        peer.catalog_index = catalog_index;
        peer.generation = generation;
        self.spawn_sender(node, &mut state);
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    pub(crate) fn volume_id(&self) -> u64 {
        self.volume_id
    }

    pub fn status(&self) -> PrimaryStatus {
        let now = self.shared.clock().now();
        let state = self.state();
        PrimaryStatus {
            epoch: state.epoch,
            in_sync: state.in_sync.iter().copied().collect(),
            catching_up: state
                .peers
                .iter()
                .filter(|(node, _)| !state.in_sync.contains(node))
                .map(|(node, peer)| {
                    let elapsed = peer
                        .resync_started
                        .map(|started| now.saturating_duration_since(started).as_secs_f64());
                    // None while its last try failed and the next has not begun: the rate
                    // of a try that ended says nothing.
                    let eta_seconds = match elapsed {
                        Some(elapsed) if peer.resync_compared > 0 && !peer.failed => {
                            let rate = peer.resync_compared as f64 / elapsed.max(0.001);
                            let left = peer.resync_total.saturating_sub(peer.resync_compared);
                            Some((left as f64 / rate).ceil() as u64)
                        }
                        _ => None,
                    };
                    CatchUp {
                        node: *node,
                        waiting_for_turn: peer.rebuild_waiting,
                        compared_bytes: peer.resync_compared,
                        total_bytes: peer.resync_total,
                        eta_seconds,
                        failures: peer.failures,
                        last_failure: (peer.last_failure.as_ref())
                            .map(|failure| failure.message.clone()),
                        last_failure_seconds_ago: (peer.last_failure.as_ref())
                            .map(|failure| now.saturating_duration_since(failure.at).as_secs()),
                    }
                })
                .collect(),
            resync_bytes: state.resync_bytes,
            resync_skipped_bytes: state.resync_skipped_bytes,
            resync_compared_bytes: state.resync_compared_bytes,
            repaired_blocks: state.repaired_blocks,
            snapshot_repair: state.snapshot_repair.clone(),
            closed: state.closed.clone(),
        }
    }

    /// Whether this primary stopped serving. One whose node's cluster is shutting down, or
    /// whose Raft stopped on a fatal error, is closed here: its loops (catching replicas up,
    /// recording or settling the in-sync set) end with Raft rather than retry against it.
    pub fn is_closed(&self) -> bool {
        if self.shared.cluster.is_stopping() {
            self.close("this node's cluster membership stopped (shutting down)".to_string());
        } else if self.shared.cluster.raft_stopped() {
            self.close("this node's Raft stopped (see its log: a store failure?)".to_string());
        }
        self.state().closed.is_some()
    }

    /// Stops serving because this node is shutting down, and says what each replica lacks:
    /// no write is ordered once it began; a FLUSH of everything goes to every replica
    /// streaming (and this copy) and is waited for, until `deadline`, from those counted for
    /// FLUSHes; what a replica did not confirm is added to what it lacks. `None` when this
    /// copy could not be flushed or the primary had already stopped. Store I/O inline: call
    /// it from a thread that may block ([`Self::stop_for_shutdown`]) or in a simulation.
    pub(crate) async fn stop_for_shutdown_async(&self, deadline: Instant) -> Option<ShutdownNote> {
        let (upto, _paused) = {
            let _order = self.ordering().await.ok()?;
            let mut state = self.state();
            if state.closed.is_some() {
                return None;
            }
            (self.queue_flush(&mut state), self.pause(&mut state))
        };
        if let Err(error) = self.local.flush() {
            tracing::warn!(volume = %self.name, %error, "could not flush this copy at shutdown");
            self.close("this node is shutting down".to_string());
            return None;
        }
        // Only replicas counted for FLUSHes are waited for: one being caught up (or whose
        // node is down) keeps whatever it lacks in the note either way.
        drop(
            self.wait_confirmed(
                |_, peer| peer.streaming && peer.counted && peer.durable_upto < upto,
                Some(deadline),
                None,
                |_| Ok(()),
                replicating,
            )
            .await,
        );
        self.close("this node is shutting down".to_string());
        let mut state = self.state();
        let epoch = state.epoch;
        let lacking = state
            .peers
            .iter_mut()
            .filter_map(|(node, peer)| {
                peer.end_stream();
                peer.lacking.to_compare().map(|chunks| (*node, chunks))
            })
            .collect();
        Some(ShutdownNote { epoch, lacking })
    }

    /// [`Self::stop_for_shutdown_async`], blocking the calling thread (not a runtime worker).
    pub(crate) fn stop_for_shutdown(&self, deadline: Instant) -> Option<ShutdownNote> {
        self.shared
            .runtime
            .block_on(self.stop_for_shutdown_async(deadline))
    }

    /// Stops serving: every later I/O fails with `why`.
    pub(crate) fn close(&self, why: String) {
        let mut state = self.state();
        if state.closed.is_none() {
            tracing::warn!(volume = %self.name, reason = %why, "no longer the primary");
            state.closed = Some(why);
        }
        for peer in state.peers.values() {
            peer.wake.notify_one();
        }
        drop(state);
        self.changed.notify_waiters();
    }

    /// Whether this primary is stale when the catalog names this node primary in `epoch`
    /// ([`stale`]).
    pub(crate) fn stale_for(&self, epoch: u64) -> bool {
        stale(self.state().epoch, epoch)
    }

    /// Whether this node may act as primary now: not closed, the catalog still names it in
    /// this epoch's line ([`stale`]), and it holds its lease.
    fn check_serving(&self, state: &State) -> VolumeResult<()> {
        if let Some(why) = &state.closed {
            return Err(unavailable(&self.name, why.clone()));
        }
        let moved = {
            let catalog = self.shared.metadata.catalog().read();
            match catalog.volumes.get(&self.volume_id) {
                None => Some("the volume was deleted".to_string()),
                Some(entry) if entry.record.replication.primary != self.shared.local_node => {
                    Some(format!(
                        "node {} took the volume over in epoch {}",
                        entry.record.replication.primary, entry.record.replication.epoch
                    ))
                }
                Some(entry) if stale(state.epoch, entry.record.replication.epoch) => Some(format!(
                    "the volume changed hands meanwhile (epoch {}; this primary served epoch {})",
                    entry.record.replication.epoch, state.epoch
                )),
                Some(_) => None,
            }
        };
        if let Some(why) = moved {
            return Err(unavailable(&self.name, why));
        }
        Ok(())
    }

    /// Client requests served on this node's disks: this volume's (forwarded ones included)
    /// and every frontend's. Both counts only grow, so the sum moves when either does.
    fn local_requests(&self) -> u64 {
        self.client_requests.load(Ordering::Relaxed) + self.shared.activity.requests_started()
    }

    /// Whether the node of replica `node` served clients lately: its answers showed its count
    /// grow within [`REPLICA_BUSY_WINDOW`] (they come a batch or a few behind its clients).
    fn replica_node_busy(&self, node: NodeId) -> bool {
        let now = self.shared.clock_now();
        self.state()
            .peers
            .get(&node)
            .and_then(|peer| peer.client_requests_grew)
            .is_some_and(|grew| now.saturating_duration_since(grew) < REPLICA_BUSY_WINDOW)
    }

    /// A client's request arrives: counted (a resync yields while they do), then
    /// [`Primary::lease`].
    async fn client_request(&self) -> VolumeResult<()> {
        self.client_requests.fetch_add(1, Ordering::Relaxed);
        self.lease().await
    }

    /// Waits (briefly) until this node holds its lease: a lapse of a report or two on a busy
    /// machine costs latency, not an error; a node cut off from the leader fails the I/O.
    /// Nothing is served or acknowledged without a lease.
    async fn lease(&self) -> VolumeResult<()> {
        if self.shared.holds_lease() {
            return Ok(());
        }
        let clock = self.shared.clock();
        let deadline = clock.now() + LEASE_WAIT;
        while !self.shared.holds_lease() {
            if clock.now() >= deadline {
                return Err(unavailable(
                    &self.name,
                    "this node has lost touch with the cluster's leader (its lease ran out); it \
                     serves the volume again once it is back in touch"
                        .to_string(),
                ));
            }
            clock.sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    fn check_writable(&self, state: &State) -> VolumeResult<()> {
        self.check_serving(state)?;
        if state.in_sync.len() < state.in_sync_min {
            return Err(unavailable(
                &self.name,
                format!(
                    "only {} replica(s) in sync, fewer than the minimum of {}: writes are \
                     refused until a replica catches up (keel volume info shows progress)",
                    state.in_sync.len(),
                    state.in_sync_min
                ),
            ));
        }
        Ok(())
    }

    /// Waits (without the order lock) until every streaming replica has room in its queue.
    async fn wait_for_room(&self) -> VolumeResult<()> {
        let mut _waiting = None;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let state = self.state();
                self.check_serving(&state)?;
                let full = state
                    .peers
                    .values()
                    .any(|peer| peer.streaming && peer.queued_bytes >= QUEUE_BYTES_MAX);
                if !full {
                    return Ok(());
                }
            }
            _waiting.get_or_insert_with(|| keel_ops::Phase::enter(keel_ops::phase::QUEUED));
            self.wait_changed(changed).await;
        }
    }

    /// Waits until `changed` (a [`Self::changed`] notification enabled before the state was
    /// looked at) fires, or [`WAIT_ROUND`] passes: the caller then looks again.
    async fn wait_changed(&self, changed: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>) {
        tokio::select! {
            _ = changed => {}
            _ = self.shared.clock().sleep(WAIT_ROUND) => {}
        }
    }

    /// The order lock, once no change holds ordering back ([`State::paused`]): waits (without
    /// it) while one does. Hold the guard only for a section that never waits.
    async fn ordering(&self) -> VolumeResult<MutexGuard<'_, ()>> {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let order = lock(&self.order);
                let state = self.state();
                self.check_serving(&state)?;
                if state.paused == 0 {
                    drop(state);
                    return Ok(order);
                }
            }
            self.wait_changed(changed).await;
        }
    }

    /// Holds ordering back until the returned guard is dropped (call it holding the order
    /// lock): writes, FLUSHes and catch-up copies wait in [`Self::ordering`] meanwhile.
    fn pause(&self, state: &mut State) -> Paused<'_> {
        state.paused += 1;
        Paused { primary: self }
    }

    /// Orders one change of `length` bytes at `offset`: applies it locally and queues it to
    /// every streaming replica, built once per replica by `op` (a write's op shares its data);
    /// a resync reading an overlapping chunk reads it again.
    /// `apply` runs inline (client I/O: on the client's thread).
    async fn ordered(
        &self,
        (offset, length): (u64, u64),
        op: impl Fn() -> Op,
        apply: impl FnOnce() -> VolumeResult<()>,
    ) -> VolumeResult<()> {
        self.client_request().await?;
        self.wait_for_room().await?;
        let _order = self.ordering().await?;
        self.check_writable(&self.state())?;
        apply()?;
        let mut state = self.state();
        let position = state.next_seq;
        state.next_seq += 1;
        for peer in state.peers.values_mut() {
            if let Some((start, end, touched)) = peer.resync_reading.as_mut() {
                *touched |= offset < *end && offset + length > *start;
            }
            peer.lacking.note(peer.streaming, position, offset, length);
            if peer.streaming {
                peer.push(Item::Op(op()));
            }
        }
        Ok(())
    }

    /// Queues a FLUSH of everything ordered so far to every streaming replica (call it under
    /// the order lock); returns the position it covers.
    fn queue_flush(&self, state: &mut State) -> u64 {
        let upto = state.next_seq - 1;
        // The view now: a rollback changes it only between two FLUSHes of a quiesce.
        if let Some(excluded) = self.shared.excluded(self.volume_id) {
            let store_sequence = self.shared.local.committed_sequence();
            state.flush_points.push_back((
                upto,
                Point {
                    store_sequence,
                    excluded,
                },
            ));
            if state.flush_points.len() > FLUSH_POINTS_KEPT {
                state.flush_points.pop_front();
            }
        }
        for peer in state.peers.values_mut().filter(|peer| peer.streaming) {
            peer.push(Item::Flush { upto });
        }
        upto
    }

    /// Waits until no replica is `pending` (has yet to confirm something durable), then answers
    /// `done` of the state as it is then. Fails once this node may no longer serve, loses its
    /// lease for good, or at `deadline`. With `since`, a request being tracked (`keel ops`)
    /// records for each replica counted for FLUSHes when, after `since`, it was seen
    /// confirmed. `mark` enters the phase the wait shows in (its guard held while waiting).
    async fn wait_confirmed<T, G>(
        &self,
        pending: impl Fn(NodeId, &Peer) -> bool,
        deadline: Option<Instant>,
        since: Option<Instant>,
        done: impl FnOnce(&State) -> VolumeResult<T>,
        mark: impl FnOnce() -> G,
    ) -> VolumeResult<T> {
        let mut _waiting = None;
        let mut mark = Some(mark);
        let since = since.filter(|_| keel_ops::tracking());
        let mut unconfirmed: Vec<NodeId> = match since {
            Some(_) => self
                .state()
                .peers
                .iter()
                .filter(|(_, peer)| peer.counted)
                .map(|(node, _)| *node)
                .collect(),
            None => Vec::new(),
        };
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let leased = {
                let state = self.state();
                self.check_serving(&state)?;
                let leased = self.shared.holds_lease();
                if leased {
                    if let Some(since) = since {
                        let now = self.shared.clock().now();
                        unconfirmed.retain(|node| {
                            let still = state
                                .peers
                                .get(node)
                                .is_some_and(|peer| pending(*node, peer));
                            if !still {
                                keel_ops::waited_for(
                                    || format!("replica on node {node}"),
                                    now.saturating_duration_since(since),
                                );
                            }
                            still
                        });
                    }
                    if !state.peers.iter().any(|(node, peer)| pending(*node, peer)) {
                        return done(&state);
                    }
                    if deadline.is_some_and(|deadline| self.shared.clock().now() >= deadline) {
                        return Err(unavailable(
                            &self.name,
                            "a replica did not confirm its writes in time; try again".to_string(),
                        ));
                    }
                }
                leased
            };
            if !leased {
                self.lease().await?;
                continue;
            }
            if let Some(mark) = mark.take() {
                _waiting = Some(mark());
            }
            self.wait_changed(changed).await;
        }
    }

    /// A FLUSH's wait: every replica counted for FLUSHes confirmed `upto`, and enough of them
    /// are still in sync.
    async fn wait_durable(&self, upto: u64, since: Instant) -> VolumeResult<()> {
        self.wait_confirmed(
            |_, peer| peer.counted && peer.durable_upto < upto,
            None,
            Some(since),
            |state| {
                if state.in_sync.len() < state.in_sync_min {
                    return Err(unavailable(
                        &self.name,
                        format!(
                            "a replica was lost: only {} in sync, fewer than the minimum of {}",
                            state.in_sync.len(),
                            state.in_sync_min
                        ),
                    ));
                }
                Ok(())
            },
            replicating,
        )
        .await
    }

    fn spawn_sender(self: &Arc<Self>, node: NodeId, state: &mut State) {
        let Some(peer) = state.peers.get_mut(&node) else {
            return;
        };
        if peer.sender_running {
            return;
        }
        peer.sender_running = true;
        let this = self.clone();
        self.shared.runtime.spawn(async move {
            this.send_loop(node).await;
        });
    }

    /// Sends one replica's stream until it fails or the primary closes: up to
    /// [`BATCHES_IN_FLIGHT`] batches at once (the replica applies them in order), their
    /// answers taken in order.
    async fn send_loop(self: Arc<Self>, node: NodeId) {
        let mut lingered = false;
        // Each batch's stream, and its send.
        let mut in_flight: VecDeque<(u64, tokio::task::JoinHandle<Sent>)> = VecDeque::new();
        loop {
            let wake = {
                let mut state = self.state();
                let closed = state.closed.is_some();
                let Some(peer) = state.peers.get_mut(&node) else {
                    return;
                };
                if closed || !peer.streaming {
                    peer.sender_running = false;
                    return;
                }
                peer.wake.clone()
            };
            let notified = wake.notified();
            if in_flight.len() < BATCHES_IN_FLIGHT {
                match self.readiness(node, in_flight.len()) {
                    // Idle: once nothing came for a while, tell the replica its common point
                    // (a burst's last FLUSH is otherwise named only by the next write).
                    Readiness::Empty if in_flight.is_empty() => {
                        if !self.common_untold(node) {
                            notified.await;
                            continue;
                        }
                        tokio::select! {
                            _ = notified => continue,
                            _ = self.shared.clock().sleep(TELL_WHEN_IDLE) => {}
                        }
                        if let Some(taken) = self.take_tell(node) {
                            in_flight.push_back(self.send_taken(node, taken));
                        }
                        continue;
                    }
                    // Writes without a FLUSH behind them: wait a moment for more (a QD1
                    // client's FLUSH follows its write within microseconds), so they travel
                    // together; with batches in flight, until one is answered.
                    Readiness::Linger if in_flight.is_empty() && !lingered => {
                        lingered = true;
                        tokio::select! {
                            _ = notified => {}
                            _ = self.shared.clock().sleep(LINGER) => {}
                        }
                        continue;
                    }
                    Readiness::Empty | Readiness::Linger if !in_flight.is_empty() => {}
                    _ => {
                        lingered = false;
                        if let Some(taken) = self.take_batch(node) {
                            in_flight.push_back(self.send_taken(node, taken));
                        }
                        continue;
                    }
                }
            }
            let room = in_flight.len() < BATCHES_IN_FLIGHT;
            let Some((stream, oldest)) = in_flight.front_mut() else {
                continue;
            };
            let stream = *stream;
            let sent = tokio::select! {
                sent = oldest => sent,
                _ = notified, if room => continue,
            };
            in_flight.pop_front();
            let sent = match sent {
                Ok(sent) => sent,
                Err(error) => Sent {
                    stream,
                    flush: None,
                    bytes: 0,
                    outcome: Err(Failure {
                        code: None,
                        message: format!("sending a batch failed: {error}"),
                    }),
                },
            };
            if !self.settle(node, sent) {
                return;
            }
        }
    }

    /// Queues a FLUSH to every streaming replica and makes everything ordered so far durable
    /// here, inline (a client's FLUSH: on the client's thread); returns the position it covers
    /// (the replicas' confirmations come later).
    async fn flush_here(&self) -> VolumeResult<u64> {
        let upto = self.queue_flush_here().await?;
        self.local.flush()?;
        self.flushed_here(upto);
        Ok(upto)
    }

    /// The first half of [`Self::flush_here`]: a FLUSH queued to every streaming replica.
    async fn queue_flush_here(&self) -> VolumeResult<u64> {
        let _order = self.ordering().await?;
        let mut state = self.state();
        self.check_serving(&state)?;
        Ok(self.queue_flush(&mut state))
    }

    /// The second half of [`Self::flush_here`]: this copy is durable through `upto`.
    fn flushed_here(&self, upto: u64) {
        let points = {
            let mut state = self.state();
            state.local_durable_upto = state.local_durable_upto.max(upto);
            self.advance_common(&mut state)
        };
        self.keep_points(points);
    }

    /// Sends a batch taken from a replica's queue, in the background: its stream and the send.
    fn send_taken(
        self: &Arc<Self>,
        node: NodeId,
        (batch, flush, bytes): (Batch, Option<BatchFlush>, usize),
    ) -> (u64, tokio::task::JoinHandle<Sent>) {
        let this = self.clone();
        let stream = batch.stream;
        let send = self.shared.runtime.spawn(async move {
            let outcome = this.send_batch(node, &batch).await;
            Sent {
                stream: batch.stream,
                flush,
                bytes,
                outcome,
            }
        });
        (stream, send)
    }

    /// Takes in a batch's answer; false once the stream is over (the replica failed, or
    /// fenced this node).
    fn settle(self: &Arc<Self>, node: NodeId, sent: Sent) -> bool {
        let mut state = self.state();
        let epoch = state.epoch;
        let in_sync = state.in_sync.contains(&node);
        let Some(peer) = state.peers.get_mut(&node) else {
            return false;
        };
        peer.queued_bytes = peer.queued_bytes.saturating_sub(sent.bytes);
        match sent.outcome {
            Ok(ack) => {
                let now = self.shared.clock_now();
                if peer.stream == sent.stream {
                    peer.answered = Some(now);
                }
                if ack.client_requests > peer.client_requests {
                    peer.client_requests = ack.client_requests;
                    peer.client_requests_grew = Some(now);
                }
                // An answer of a stream a resync has since replaced confirms nothing.
                if let (Some(flush), true) = (sent.flush, peer.stream == sent.stream) {
                    peer.durable_upto = peer.durable_upto.max(flush.upto);
                    peer.flushes_confirmed = peer.flushes_confirmed.max(flush.count);
                    peer.lacking.confirmed(peer.durable_upto);
                    if flush.in_sync {
                        peer.confirmed_flushes.push_back((flush.index, flush.upto));
                        if peer.confirmed_flushes.len() > FLUSH_POINTS_KEPT {
                            peer.confirmed_flushes.pop_front();
                        }
                    }
                }
                let points = self.advance_common(&mut state);
                drop(state);
                self.changed.notify_waiters();
                self.keep_points(points);
                true
            }
            Err(failure) if failure.code == Some(CODE_FENCED) => {
                drop(state);
                self.refused_by(node, failure.message);
                false
            }
            // A batch of a stream a resync has since replaced (the replica refuses it once
            // the new stream began): the new stream is not at fault.
            Err(_) if peer.stream != sent.stream => true,
            Err(failure) => {
                // Warned once per run of failures: a replica that cannot take what it is
                // sent (its disk is full) fails every catch-up until that changes.
                if in_sync {
                    tracing::warn!(volume = %self.name, node, epoch, error = %failure.message, "a replica failed; taking it out of the in-sync set");
                } else if peer.last_failure.is_none() {
                    tracing::warn!(volume = %self.name, node, epoch, error = %failure.message, "a replica being caught up failed");
                } else {
                    tracing::debug!(volume = %self.name, node, epoch, error = %failure.message, "a replica being caught up failed again");
                }
                let now = self.shared.clock_now();
                let refused = failure.code == Some(CODE_NO_SPACE);
                peer.refusing_since = refused.then(|| peer.refusing_since.unwrap_or(now));
                peer.last_failure = Some(PeerFailure {
                    refused,
                    message: failure.message,
                    at: now,
                });
                peer.failed = true;
                peer.sender_running = false;
                peer.end_stream();
                drop(state);
                self.changed.notify_waiters();
                let this = self.clone();
                let stream = sent.stream;
                self.shared.runtime.spawn(async move {
                    this.drop_replica(node, stream).await;
                });
                false
            }
        }
    }

    /// Moves each replica's common point with this node to the latest FLUSH it confirmed that
    /// is durable here too; returns the points to keep now, as `(node, the point of that
    /// FLUSH)` ([`crate::Settings::point_every`] apart at most per replica).
    fn advance_common(&self, state: &mut State) -> Vec<(NodeId, Point)> {
        let State {
            peers,
            flush_points,
            local_durable_upto,
            ..
        } = state;
        let now = self.shared.clock_now();
        let mut points = Vec::new();
        for (node, peer) in peers.iter_mut() {
            let mut common = None;
            while let Some(&(index, upto)) = peer.confirmed_flushes.front() {
                if upto > *local_durable_upto {
                    break;
                }
                peer.common_index = Some(index);
                peer.common_upto = upto;
                common = Some(upto);
                peer.confirmed_flushes.pop_front();
            }
            let Some(upto) = common else {
                continue;
            };
            // Its sender may be idle already (the replica confirmed before this copy's own
            // sync returned): wake it, so that the empty batch naming the point still goes.
            peer.wake.notify_one();
            // A FLUSH queued at or before that one: every change after it has a greater
            // store sequence here.
            let Some((_, point)) = flush_points.iter().rev().find(|(at, _)| *at <= upto) else {
                continue;
            };
            if peer
                .point_kept
                .is_some_and(|kept| now.saturating_duration_since(kept) < self.shared.point_every)
            {
                peer.point_due = Some(point.clone());
                continue;
            }
            peer.point_kept = Some(now);
            peer.point_due = None;
            points.push((*node, point.clone()));
        }
        points
    }

    /// Keeps common points ([`Self::advance_common`]) in the background: each with the view
    /// of its FLUSH, however late it is kept.
    fn keep_points(&self, points: Vec<(NodeId, Point)>) {
        for (node, point) in points {
            let shared = self.shared.clone();
            let name = self.name.clone();
            let volume_id = self.volume_id;
            self.shared.detached(move || {
                shared.keep_point(&name, volume_id, node, &point);
            });
        }
    }

    /// What a replica and this node changed since their common points, if both hold one that
    /// still holds (`None`: its catch-up compares everything). An error: the replica did not
    /// answer (down, starting, behind): the catch-up tries again rather than compare all.
    async fn changed_since_points(&self, node: NodeId) -> Result<Option<Chunks>, String> {
        let listing = self.shared.clock_now();
        let shared = self.shared.clone();
        let name = self.name.clone();
        let volume_id = self.volume_id;
        let ours =
            crate::blocking(move || shared.changed_since_point(&name, volume_id, node)).await;
        let mut ours = match ours.and_then(|listed| listed.map_err(|error| error.to_string())) {
            Ok(Some(chunks)) => chunks,
            Ok(None) => return Ok(None),
            Err(error) => {
                tracing::warn!(volume = %self.name, node, %error, "listing what changed since the common point failed; comparing everything");
                return Ok(None);
            }
        };
        let (epoch, catalog_index) = self.asked_as(node);
        let request = ChangedRequest {
            volume_id: self.volume_id,
            epoch,
            catalog_index,
        };
        let answer: ChangedAnswer = self
            .ask(
                node,
                METHOD_CHANGED,
                &request,
                changed_timeout(self.local.size_bytes()),
            )
            .await?;
        let Some(theirs) = answer
            .chunks
            .and_then(|bytes| postcard::from_bytes::<Chunks>(&bytes).ok())
        else {
            return Ok(None);
        };
        ours.add(&theirs);
        tracing::info!(volume = %self.name, node, listed_ms = self.shared.clock_now().saturating_duration_since(listing).as_millis() as u64, "the catch-up compares what either node changed since their common points");
        Ok(Some(ours))
    }

    /// Whether a replica's queue is worth a batch now: with none in flight, once it holds a
    /// FLUSH or [`LINGER_BYTES_MAX`]; alongside batches in flight, only a FLUSH or a full
    /// batch (small batches at once cost more CPU than the overlap gains: writes pile up
    /// into the next batch meanwhile).
    fn readiness(&self, node: NodeId, in_flight: usize) -> Readiness {
        let state = self.state();
        let Some(peer) = state.peers.get(&node) else {
            return Readiness::Empty;
        };
        let enough = if in_flight == 0 {
            LINGER_BYTES_MAX
        } else {
            BATCH_BYTES_MAX
        };
        // A FLUSH is queued when more were queued than taken (the counts restart with the
        // queue at each resync): no scan of the queue, which the sender checks at every push.
        if peer.queue.is_empty() {
            Readiness::Empty
        } else if peer.queued_bytes >= enough || peer.flushes_queued > peer.flushes_taken {
            Readiness::Now
        } else {
            Readiness::Linger
        }
    }

    /// Takes the next batch of a replica's queue: writes up to a size, ending at a flush (then
    /// with the position it covers and its count in the stream).
    fn take_batch(&self, node: NodeId) -> Option<(Batch, Option<BatchFlush>, usize)> {
        let mut state = self.state();
        let epoch = state.epoch;
        let in_sync = state.in_sync.contains(&node);
        let others = Self::others_common(&state, node);
        let peer = state.peers.get_mut(&node)?;
        if peer.queue.is_empty() {
            return None;
        }
        Some(Self::next_batch(
            self.volume_id,
            epoch,
            in_sync,
            &others,
            peer,
        ))
    }

    /// The other in-sync replicas and the position of their common point with this node.
    fn others_common(state: &State, node: NodeId) -> Vec<(NodeId, u64)> {
        state
            .peers
            .iter()
            .filter(|(other, peer)| {
                **other != node && state.in_sync.contains(other) && peer.common_index.is_some()
            })
            .map(|(other, peer)| (*other, peer.common_upto))
            .collect()
    }

    /// Whether a replica has not been told its latest common point yet.
    fn common_untold(&self, node: NodeId) -> bool {
        self.state()
            .peers
            .get(&node)
            .is_some_and(|peer| peer.common_index > peer.common_told)
    }

    /// An empty batch telling an idle replica its common point (otherwise only the next
    /// write would), and this node's own point not kept yet; `None` if there is nothing to tell.
    fn take_tell(&self, node: NodeId) -> Option<(Batch, Option<BatchFlush>, usize)> {
        let (taken, point) = {
            let mut state = self.state();
            let epoch = state.epoch;
            let others = Self::others_common(&state, node);
            let peer = state.peers.get_mut(&node)?;
            if !peer.queue.is_empty() || peer.common_index <= peer.common_told {
                return None;
            }
            let point = peer.point_due.take().map(|point| {
                peer.point_kept = Some(self.shared.clock_now());
                (node, point)
            });
            (
                Self::next_batch(self.volume_id, epoch, false, &others, peer),
                point,
            )
        };
        self.keep_points(point.into_iter().collect());
        Some(taken)
    }

    /// The next batch of `peer`'s queue (possibly empty); `others` are the other in-sync
    /// replicas with the position of their common point with this node.
    fn next_batch(
        volume_id: u64,
        epoch: u64,
        in_sync: bool,
        others: &[(NodeId, u64)],
        peer: &mut Peer,
    ) -> (Batch, Option<BatchFlush>, usize) {
        let mut ops = Vec::new();
        let mut bytes = 0usize;
        let mut flush_upto = None;
        while let Some(item) = peer.queue.front() {
            if !ops.is_empty() && bytes + item.bytes() > BATCH_BYTES_MAX {
                break;
            }
            let Some(item) = peer.queue.pop_front() else {
                break;
            };
            bytes += item.bytes();
            match item {
                Item::Op(op) => ops.push(op),
                Item::Flush { upto } => {
                    peer.flushes_taken += 1;
                    flush_upto = Some(BatchFlush {
                        upto,
                        count: peer.flushes_taken,
                        index: peer.next_index,
                        in_sync,
                    });
                    break;
                }
            }
        }
        let batch = Batch {
            volume_id,
            epoch,
            stream: peer.stream,
            index: peer.next_index,
            ops,
            flush: flush_upto.is_some(),
            catalog_index: peer.catalog_index,
            generation: peer.generation,
            common_index: peer.common_index,
            // The replicas durable through that FLUSH too (R=3): a point with each of them.
            common_with: match peer.common_index {
                Some(_) => others
                    .iter()
                    .filter(|(_, upto)| *upto >= peer.common_upto)
                    .map(|(other, _)| *other)
                    .collect(),
                None => Vec::new(),
            },
        };
        peer.next_index += 1;
        peer.common_told = peer.common_index;
        (batch, flush_upto, bytes)
    }

    async fn send_batch(&self, node: NodeId, batch: &Batch) -> Result<BatchAck, Failure> {
        // A replica whose catalog lags a moment behind answers "behind": ask again (encoded
        // anew then, so the common case sends the one encoding it made).
        let mut attempts = 0;
        loop {
            let payload = batch.encode().map_err(|error| Failure {
                code: None,
                message: error.to_string(),
            })?;
            let answer = self
                .shared
                .call(node, METHOD_REPLICATE, payload, BATCH_TIMEOUT)
                .await;
            match answer {
                Err(failure) if failure.code == Some(CODE_BEHIND) && attempts < 5 => {
                    attempts += 1;
                }
                Err(failure) => return Err(failure),
                Ok(bytes) => {
                    return postcard::from_bytes(&bytes).map_err(|error| Failure {
                        code: None,
                        message: error.to_string(),
                    })
                }
            }
        }
    }

    /// Runs a change of the volume's metadata (snapshot, rollback, resize) at one point of its
    /// write stream on every replica: no write is ordered meanwhile; every replica streaming
    /// has applied every earlier write before `change` runs (and one that failed is out of the
    /// in-sync set), and applies later writes only after its catalog has the change.
    /// `change` runs inline, after the wait ([`crate::Replication::quiesce`] is the blocking
    /// form).
    pub async fn quiesce_async<T>(
        &self,
        change: impl std::future::Future<Output = VolumeResult<T>>,
    ) -> VolumeResult<T> {
        self.quiesce_marked(change, replicating).await
    }

    /// [`Self::quiesce_async`], its wait shown by `mark` (a background task's, whose future
    /// must be `Send`, marks nothing).
    async fn quiesce_marked<T, G>(
        &self,
        change: impl std::future::Future<Output = VolumeResult<T>>,
        mark: impl FnOnce() -> G,
    ) -> VolumeResult<T> {
        self.lease().await?;
        let (upto, queued, _paused) = {
            let _order = self.ordering().await?;
            let mut state = self.state();
            self.check_serving(&state)?;
            let upto = self.queue_flush(&mut state);
            // The FLUSH just queued to each replica streaming: once it is confirmed, so is
            // everything queued before it, a catch-up's copies too (they take no position in
            // the volume's history, so `upto` alone does not cover them).
            let queued: BTreeMap<NodeId, (u64, u64)> = (state.peers.iter())
                .filter(|(_, peer)| peer.streaming)
                .map(|(node, peer)| (*node, (peer.stream, peer.flushes_queued)))
                .collect();
            (upto, queued, self.pause(&mut state))
        };
        let deadline = self.shared.clock().now() + QUIESCE_WAIT;
        // A replica that failed is still counted until Raft recorded it out of the in-sync
        // set: wait for that too, so a snapshot never names it complete.
        self.wait_confirmed(
            |node, peer| {
                let copies_pending = queued.get(&node).is_some_and(|(stream, flushes)| {
                    peer.streaming && peer.stream == *stream && peer.flushes_confirmed < *flushes
                });
                (peer.streaming || peer.counted) && (peer.durable_upto < upto || copies_pending)
            },
            Some(deadline),
            None,
            |_| Ok(()),
            mark,
        )
        .await?;
        // Made with no in-sync change in flight or being settled, and only once every replica
        // Raft lists in sync has applied every write before it: a snapshot names complete the
        // replicas the catalog lists in sync, and an addition whose answer was lost while the
        // replica's stream failed lists one that lacks them (seed 1473).
        let made = {
            let _proposing = self.proposing.lock().await;
            let lagging = self.catalog_replication().and_then(|recorded| {
                let state = self.state();
                recorded.in_sync.iter().copied().find(|node| {
                    *node != self.shared.local_node
                        && !state.peers.get(node).is_some_and(|peer| {
                            peer.streaming && !peer.failed && peer.durable_upto >= upto
                        })
                })
            });
            if let Some(node) = lagging {
                // Refused before `change` ran: nothing can commit later, so no barrier.
                return Err(unavailable(
                    &self.name,
                    format!(
                        "replica {node} is in the in-sync set but has not applied every write \
                         before the change; try again"
                    ),
                ));
            }
            change.await
        };
        let outcome = match made {
            Ok(outcome) => outcome,
            Err(error) => {
                // A change that failed may still be made: a proposal that went unanswered can
                // commit later, at a point of the write stream each replica would meet
                // differently. A barrier first (a new epoch of the same set, still paused):
                // once Raft committed it, that proposal is in the log before it or never.
                // Writes go on only after it, each replica applying them once its catalog
                // has it. Without the barrier this node cannot go on serving.
                if let Err(barrier) = self.propose_in_sync(InSyncChange::Keep).await {
                    self.close(format!(
                        "a change of the volume failed ({error}) and whether it was made could \
                         not be settled: {barrier}"
                    ));
                    return Err(error);
                }
                self.after_change();
                return Err(error);
            }
        };
        self.after_change();
        Ok(outcome)
    }

    /// After a change of the volume's metadata (made or not, settled): every replica applies
    /// later writes only once its catalog has it, and a chunk a catch-up is reading is read
    /// again.
    fn after_change(&self) {
        let index = self.shared.cluster.applied_index();
        let generation = self.catalog_generation();
        let mut state = self.state();
        // (FLUSHes before the change may still become common points after it: each carries
        // the view it was queued under, which a rollback's new view does not match.)
        for peer in state.peers.values_mut() {
            peer.catalog_index = peer.catalog_index.max(index);
            peer.generation = peer.generation.max(generation);
            // A rollback or resize changes what any chunk being read holds.
            if let Some((_, _, touched)) = peer.resync_reading.as_mut() {
                *touched = true;
            }
        }
    }

    /// [`Primary::quiesce_async`] for a blocking `change`, with the replicas `dropping` names
    /// out of the in-sync set (Raft records it first) and their streams stopped while `change`
    /// runs; each is caught up afterwards from the start, whatever `change` answered (a
    /// catch-up already under way would keep the chunks it copied before `change`). For a
    /// change those replicas cannot make on their own copy (a rollback onto a snapshot that is
    /// incomplete there, a stream received here only). `dropping` is asked with the volume's
    /// catalog entry once no change of the replica set is in flight, and none lands until
    /// `change` is made: a replica added meanwhile would catch up across it. Blocking.
    pub fn quiesce_dropping<T>(
        self: &Arc<Self>,
        dropping: impl FnOnce(&VolumeEntry) -> VolumeResult<Vec<NodeId>>,
        change: impl FnOnce() -> VolumeResult<T>,
    ) -> VolumeResult<T> {
        self.shared
            .runtime
            .block_on(self.quiesce_dropping_async(dropping, async { change() }))
    }

    /// [`Self::quiesce_dropping`] for a `change` that is a future.
    pub(crate) async fn quiesce_dropping_async<T>(
        self: &Arc<Self>,
        dropping: impl FnOnce(&VolumeEntry) -> VolumeResult<Vec<NodeId>>,
        change: impl std::future::Future<Output = VolumeResult<T>>,
    ) -> VolumeResult<T> {
        let _replica_set = self.replica_set.lock().await;
        let nodes = {
            let catalog = self.shared.metadata.catalog().read();
            match catalog.volumes.get(&self.volume_id) {
                Some(entry) => dropping(entry)?,
                // (Gone: `change` answers that.)
                None => Vec::new(),
            }
        };
        let nodes = &nodes[..];
        let outcome = async {
            for &node in nodes {
                self.drop_and_stop(node)
                    .await
                    .map_err(|error| unavailable(&self.name, error))?;
            }
            let outcome = self.quiesce_async(change).await;
            // A catch-up that restarted meanwhile compared chunks before the change (and may
            // have joined the set: it is taken out again, retried until Raft records it).
            for &node in nodes {
                while let Err(error) = self.drop_and_stop(node).await {
                    if self.is_closed() {
                        break;
                    }
                    tracing::warn!(volume = %self.name, node, %error, "could not record the in-sync set yet; FLUSHes wait");
                    self.shared.clock().sleep(Duration::from_millis(200)).await;
                }
            }
            outcome
        }
        .await;
        for &node in nodes {
            if let Some(peer) = self.state().peers.get_mut(&node) {
                peer.lacking.unknown();
            }
            self.spawn_resync(node);
        }
        outcome
    }

    /// Takes `node` out of the in-sync set (Raft records it first) and ends its stream. The set
    /// is looked at with no change of it in flight, as [`Self::drop_replica`] does: an
    /// addition of the replica on its way lands first and is undone, and none can land once
    /// the stream ended (an addition needs the stream it caught up).
    async fn drop_and_stop(&self, node: NodeId) -> Result<(), String> {
        loop {
            {
                let _proposing = self.proposing.lock().await;
                if !self.state().in_sync.contains(&node) {
                    self.stop_streams(&[node]);
                    return Ok(());
                }
            }
            self.propose_in_sync(InSyncChange::Drop(node)).await?;
        }
    }

    /// Ends these replicas' streams: not counted for FLUSHes, nothing queued; a catch-up
    /// under way fails (and retries).
    fn stop_streams(&self, nodes: &[NodeId]) {
        let mut state = self.state();
        for node in nodes {
            if let Some(peer) = state.peers.get_mut(node) {
                peer.counted = false;
                peer.end_stream();
            }
        }
        drop(state);
        self.changed.notify_waiters();
    }

    /// Moves a replica off a node that has been down for `after`, is draining or was removed,
    /// to a storage node that is up and holds none (Raft records it, epoch + 1); the new
    /// replica is then caught up like any other. One move per call.
    pub(crate) async fn move_replicas(self: &Arc<Self>, after: Duration) {
        if self.is_closed() {
            return;
        }
        // (A rollback under way: the next round moves it.)
        let Ok(replica_set) = self.replica_set.try_lock() else {
            return;
        };
        let local = self.shared.local_node;
        let now_ms = self.shared.clock().wall_unix_ms();
        let after_ms = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
        // The replicas in sync whose stream answered within `after`: their node is not down
        // for that long, whatever its reports say (read before the catalog's lock).
        let answering: BTreeSet<NodeId> = {
            let now = self.shared.clock_now();
            let state = self.state();
            (state.in_sync.iter().copied())
                .filter(|node| {
                    (state.peers.get(node)).is_some_and(|peer| {
                        peer.streaming
                            && !peer.failed
                            && peer.answered.is_some_and(|answered| {
                                now.saturating_duration_since(answered) < after
                            })
                    })
                })
                .collect()
        };
        // The replicas out of sync that have refused their catch-ups for `after`, with why.
        let refusing: BTreeMap<NodeId, String> = {
            let now = self.shared.clock_now();
            let state = self.state();
            (state.peers.iter())
                .filter(|(node, peer)| {
                    !state.in_sync.contains(node)
                        && (peer.refusing_since)
                            .is_some_and(|since| now.saturating_duration_since(since) >= after)
                })
                .map(|(node, peer)| {
                    let why = (peer.last_failure.as_ref())
                        .map(|failure| failure.message.clone())
                        .unwrap_or_default();
                    (*node, why)
                })
                .collect()
        };
        let planned = {
            let catalog = self.shared.metadata.catalog().read();
            let Some(entry) = catalog.volumes.get(&self.volume_id) else {
                return;
            };
            let replication = &entry.record.replication;
            if replication.primary != local {
                return;
            }
            // More replicas than R: a replica copied off a draining node. Once this node is
            // not draining (R=1: the volume was handed to the copy) and the replicas that stay
            // are in sync, the copy on the draining node goes (the drain undone: the new copy
            // not in sync yet goes instead), unless it alone holds snapshots whole (snapshot
            // repair copies them first). Until then a copy on a node that is lost moves like
            // any replica.
            let extra = replication.replicas.len() > usize::from(replication.factor);
            let removal = (extra && !crate::node_gone(&catalog, local, now_ms, after_ms))
                .then(|| plan_removal(&catalog, entry, local, now_ms, after_ms))
                .flatten();
            match removal {
                Some(removal) => Some(removal),
                None => self
                    .plan_move(&catalog, entry, &answering, extra, now_ms, after_ms)
                    .or_else(|| plan_refusing_move(&catalog, entry, &refusing, extra)),
            }
        };
        let (from, to) = match planned {
            None => return,
            Some(Planned::Move { from, to }) => (from, to),
            Some(Planned::CopyOff { from, to }) => {
                // (`copy_off` takes the replica-set lock itself.)
                drop(replica_set);
                match self.copy_off(to).await {
                    Ok(()) => {
                        (self.shared.counters.copied_off).fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            volume = %self.name,
                            from,
                            to,
                            "copying the replica off a draining node; its copy there goes \
                             once the new one is in sync"
                        )
                    }
                    Err(error) => tracing::info!(
                        volume = %self.name,
                        from,
                        to,
                        %error,
                        "could not copy the replica off a draining node yet"
                    ),
                }
                return;
            }
            Some(Planned::Remove {
                leaving,
                replicas,
                in_sync_min,
            }) => {
                // (`set_replicas` takes the replica-set lock itself.)
                drop(replica_set);
                match self.set_replicas(replicas, in_sync_min).await {
                    Ok(()) => tracing::warn!(
                        volume = %self.name,
                        node = leaving,
                        "removed the copy a drain had the volume keep: R is back to its replicas"
                    ),
                    Err(error) => tracing::info!(
                        volume = %self.name,
                        node = leaving,
                        %error,
                        "could not remove the copy a drain had the volume keep yet"
                    ),
                }
                return;
            }
        };
        let _proposing = self.proposing.lock().await;
        let (epoch, replicas, in_sync_min) = {
            let state = self.state();
            let replicas: Vec<NodeId> = std::iter::once(local)
                .chain(state.peers.keys().copied().filter(|node| *node != from))
                .chain(std::iter::once(to))
                .collect();
            (state.epoch, replicas, state.in_sync_min)
        };
        let command = Command::VolumeMoveReplica {
            volume_id: self.volume_id,
            epoch,
            from,
            to,
        };
        match (self.propose_replica_set(epoch, command, &replicas, in_sync_min)).await {
            Ok(()) => {
                let mut state = self.state();
                state.epoch = epoch + 1;
                state.in_sync.remove(&from);
                if let Some(peer) = state.peers.remove(&from) {
                    peer.wake.notify_one();
                }
                state.peers.insert(to, Peer::new());
                drop(state);
                self.changed.notify_waiters();
                match refusing.get(&from) {
                    Some(why) => {
                        tracing::warn!(volume = %self.name, from, to, after = ?after, error = %why, "replica moved off a node that refused its catch-ups that long; catching the new one up")
                    }
                    None => {
                        tracing::warn!(volume = %self.name, from, to, "replica moved off a node that is gone; catching the new one up")
                    }
                }
                self.spawn_resync(to);
            }
            Err(error) => {
                tracing::info!(volume = %self.name, %error, "could not move a replica yet");
            }
        }
    }

    /// Proposes `command`, a change of the replica set to `replicas` (this node included)
    /// with the in-sync minimum `in_sync_min`, made against `epoch` (call it holding
    /// `proposing`). An unanswered one is settled ([`Self::settle_unanswered`]): made, it is
    /// as if answered; otherwise it fails, with nothing changed. Found by the simulation with
    /// single copies (seed 5810): a replica added by a change taken as failed was never
    /// caught up.
    async fn propose_replica_set(
        &self,
        epoch: u64,
        command: Command,
        replicas: &[NodeId],
        in_sync_min: usize,
    ) -> VolumeResult<()> {
        match self.propose(command).await {
            Ok(()) => Ok(()),
            Err(MetadataError::Timeout { detail }) => {
                tracing::warn!(volume = %self.name, epoch, %detail, "a change of the replicas went unanswered; settling whether it was made");
                let wanted: BTreeSet<NodeId> = replicas.iter().copied().collect();
                let made = |recorded: &keel_catalog::Replication| {
                    usize::from(recorded.in_sync_min) == in_sync_min
                        && recorded.replicas.iter().copied().collect::<BTreeSet<_>>() == wanted
                };
                match self
                    .settle_unanswered(epoch, "change of the replicas", made)
                    .await
                {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(unavailable(
                        &self.name,
                        format!(
                            "the change of its replicas went unanswered and was not made: {detail}"
                        ),
                    )),
                    Err(why) => Err(unavailable(&self.name, why)),
                }
            }
            Err(error) => Err(crate::change_error(&self.name, error)),
        }
    }

    /// The move [`Self::move_replicas`] makes of a replica on a node that is gone, if any.
    fn plan_move(
        &self,
        catalog: &keel_catalog::CatalogState,
        entry: &keel_catalog::VolumeEntry,
        answering: &BTreeSet<NodeId>,
        extra: bool,
        now_ms: i64,
        after_ms: i64,
    ) -> Option<Planned> {
        let replication = &entry.record.replication;
        // A replica whose node alone holds snapshots whole stays (health shows it).
        let (movable, held) = crate::replicas_to_move(
            catalog,
            entry,
            |node| answering.contains(&node),
            now_ms,
            after_ms,
        );
        match held.first().copied() {
            Some(node) if self.move_held_for.swap(node, Ordering::Relaxed) != node => {
                tracing::warn!(
                    volume = %self.name,
                    node,
                    snapshots = %crate::quoted(&crate::only_whole_on(entry, &replication.replicas, node)),
                    "the replica on a node that is gone stays where it is: it alone holds \
                     these snapshots whole; snapshot repair copies them once the node is \
                     back, or delete them to let the replica move"
                );
            }
            Some(_) => {}
            None => self.move_held_for.store(0, Ordering::Relaxed),
        }
        // A replica on a draining node that is not lost is copied before it goes: once per
        // volume (`extra`: a copy is under way); one on a lost node moves.
        let lost = |node: NodeId| crate::node_lost(catalog, node, now_ms, after_ms);
        let from = movable.iter().copied().find(|node| lost(*node) || !extra)?;
        if lost(from) {
            let staying: Vec<NodeId> = (replication.replicas.iter().copied())
                .filter(|node| *node != from)
                .collect();
            let to = catalog.choose_replica_nodes(&staying, 1).first().copied()?;
            Some(Planned::Move { from, to })
        } else {
            let to = (catalog.choose_replica_nodes(&replication.replicas, 1))
                .first()
                .copied()?;
            Some(Planned::CopyOff { from, to })
        }
    }

    /// Hands the volume to `to`, a replica in sync, because of `why` (this node is draining,
    /// or low on space; a client still reaching this primary is told). At one point of the
    /// write stream ([`Self::quiesce_async`]: every replica in sync holds every earlier write
    /// durable), with this copy flushed too, Raft records `to` as the primary of the next
    /// epoch with the same in-sync set; this primary then stops serving (a refused or
    /// unanswered proposal is settled by the quiesce's barrier, which closes it if the
    /// hand-off was made after all). `to`, told so ([`Self::tell_handed_off`]), serves the
    /// next epoch with the same in-sync set once a client attaches or is forwarded to it.
    pub(crate) async fn hand_off(&self, to: NodeId, why: &str) -> VolumeResult<()> {
        let unmarked = || ();
        self.quiesce_marked(
            async {
                let local = self.local.clone();
                crate::blocking(move || local.flush())
                    .await
                    .map_err(|error| unavailable(&self.name, error))??;
                let (epoch, in_sync) = {
                    let state = self.state();
                    (state.epoch, state.in_sync.clone())
                };
                if !in_sync.contains(&to) {
                    return Err(unavailable(
                        &self.name,
                        format!("node {to} left the in-sync set before the hand-off"),
                    ));
                }
                let command = Command::VolumeSetReplication {
                    volume_id: self.volume_id,
                    epoch,
                    primary: to,
                    in_sync: in_sync.into_iter().collect(),
                };
                self.propose(command)
                    .await
                    .map_err(|error| unavailable(&self.name, error.to_string()))?;
                self.tell_handed_off(to, epoch + 1).await;
                self.close(format!(
                    "{why}: node {to} serves the volume from epoch {}",
                    epoch + 1
                ));
                Ok(())
            },
            unmarked,
        )
        .await
    }

    /// Tells `to` that Raft recorded it primary of `epoch` by this node's hand-off, so that it
    /// keeps the replicas in sync ([`crate::wire::METHOD_HANDED_OFF`]). Unanswered, `to`
    /// catches them up instead, as after a take-over.
    async fn tell_handed_off(&self, to: NodeId, epoch: u64) {
        let notice = wire::HandedOff {
            volume_id: self.volume_id,
            epoch,
        };
        let told = match postcard::to_allocvec(&notice) {
            Ok(payload) => (self.shared)
                .call(to, METHOD_HANDED_OFF, payload, HANDED_OFF_TIMEOUT)
                .await
                .map(|_| ())
                .map_err(|failure| failure.message),
            Err(error) => Err(error.to_string()),
        };
        if let Err(error) = told {
            tracing::info!(volume = %self.name, node = to, %error, "could not tell the new primary of the hand-off: it catches the replicas up instead");
        }
    }

    /// Changes the volume's replica set and in-sync minimum through Raft (epoch + 1): added
    /// replicas start out of sync and are caught up; removed ones get no more writes and stop
    /// counting for FLUSHes.
    pub(crate) async fn set_replicas(
        self: &Arc<Self>,
        replicas: Vec<NodeId>,
        in_sync_min: u8,
    ) -> VolumeResult<()> {
        let volume_id = self.volume_id;
        let command = |epoch, replicas: &[NodeId]| Command::VolumeSetReplicas {
            volume_id,
            epoch,
            replicas: replicas.to_vec(),
            in_sync_min,
        };
        self.change_replica_set(replicas, in_sync_min, command)
            .await
    }

    /// Adds `to` as a replica beside R because one of them is on a draining node
    /// (`VolumeCopyOffDraining`: R stays, `to` starts out of sync and is caught up). Once it
    /// is in sync, the draining node's copy goes ([`Self::move_replicas`]); with R=1, on this
    /// node, only after the drain handed `to` the volume.
    pub(crate) async fn copy_off(self: &Arc<Self>, to: NodeId) -> VolumeResult<()> {
        let volume_id = self.volume_id;
        let Some(current) = self.catalog_replication() else {
            return Err(VolumeError::NotFound {
                name: self.name.clone(),
            });
        };
        let mut replicas = current.replicas;
        replicas.push(to);
        let in_sync_min = current.in_sync_min;
        let command = |epoch, _: &[NodeId]| Command::VolumeCopyOffDraining {
            volume_id,
            epoch,
            to,
        };
        self.change_replica_set(replicas, in_sync_min, command)
            .await
    }

    /// Proposes `command(epoch, replicas)` (a change of the replica set to `replicas`, with
    /// the in-sync minimum `in_sync_min`) and applies it to this primary's state.
    async fn change_replica_set(
        self: &Arc<Self>,
        replicas: Vec<NodeId>,
        in_sync_min: u8,
        command: impl FnOnce(u64, &[NodeId]) -> Command,
    ) -> VolumeResult<()> {
        let _replica_set = tokio::select! {
            held = self.replica_set.lock() => held,
            _ = self.shared.clock().sleep(REPLICA_SET_WAIT) => {
                return Err(unavailable(
                    &self.name,
                    format!(
                        "a rollback or a stream received into it has not been made within {} \
                         s; change R again once it is",
                        REPLICA_SET_WAIT.as_secs()
                    ),
                ));
            }
        };
        let _proposing = self.proposing.lock().await;
        let epoch = {
            let state = self.state();
            self.check_serving(&state)?;
            state.epoch
        };
        let command = command(epoch, &replicas);
        (self.propose_replica_set(epoch, command, &replicas, usize::from(in_sync_min))).await?;
        let local = self.shared.local_node;
        let added: Vec<NodeId> = {
            let mut state = self.state();
            state.epoch = epoch + 1;
            state.in_sync_min = usize::from(in_sync_min);
            state.in_sync.retain(|node| replicas.contains(node));
            let removed: Vec<NodeId> = state
                .peers
                .keys()
                .copied()
                .filter(|node| !replicas.contains(node))
                .collect();
            for node in removed {
                if let Some(peer) = state.peers.remove(&node) {
                    peer.wake.notify_one();
                }
            }
            let added: Vec<NodeId> = replicas
                .iter()
                .copied()
                .filter(|node| *node != local && !state.peers.contains_key(node))
                .collect();
            for node in &added {
                let mut peer = Peer::new();
                peer.added = true;
                state.peers.insert(*node, peer);
            }
            added
        };
        self.changed.notify_waiters();
        tracing::info!(volume = %self.name, ?replicas, in_sync_min, ?added, "replica set changed");
        for node in added {
            self.spawn_resync(node);
        }
        Ok(())
    }

    /// Proposes a change of this volume's replication through Raft, made against this
    /// primary's epoch (call it holding `proposing`). A refusal because the volume moved on to
    /// another epoch means another node changed it meanwhile (each change is a compare-and-set
    /// on the epoch): this node stops serving the volume. Any other refusal (a move's target
    /// became draining meanwhile, a minimum above R) changes nothing and leaves it serving.
    async fn propose(&self, command: Command) -> Result<(), MetadataError> {
        let outcome = self.propose_raw(command).await;
        if let Err(MetadataError::Refused(refusal)) = &outcome {
            let epoch = self.state().epoch;
            let moved_on = self
                .catalog_replication()
                .is_none_or(|recorded| recorded.epoch != epoch);
            if moved_on {
                self.close(format!("its replication changed elsewhere: {refusal}"));
            }
        }
        outcome
    }

    /// Proposes `command` through Raft and waits until this node applied it.
    async fn propose_raw(&self, command: Command) -> Result<(), MetadataError> {
        self.shared.cluster.propose_async(command).await.map(|_| ())
    }

    /// Records through Raft that this node's in-sync set is now `in_sync` (epoch + 1).
    /// Serialized with [`Self::drop_replica`]'s look at the set: a replica whose stream fails
    /// while it is being added is seen in the set once the addition lands, and dropped again.
    async fn propose_in_sync(&self, change: InSyncChange) -> Result<(), String> {
        let _proposing = self.proposing.lock().await;
        let (epoch, in_sync) = {
            let state = self.state();
            let mut in_sync = state.in_sync.clone();
            match change {
                InSyncChange::Drop(node) => {
                    in_sync.remove(&node);
                }
                InSyncChange::Add(node, stream) => {
                    let healthy = state.peers.get(&node).is_some_and(|peer| {
                        peer.streaming && !peer.failed && peer.stream == stream
                    });
                    if !healthy {
                        return Err("the replica's stream failed before it joined".to_string());
                    }
                    in_sync.insert(node);
                }
                InSyncChange::Keep => {}
            };
            (state.epoch, in_sync)
        };
        match self.propose(self.in_sync_command(epoch, &in_sync)).await {
            Ok(()) => {
                self.recorded(epoch + 1, in_sync);
                Ok(())
            }
            Err(MetadataError::Timeout { detail }) => {
                tracing::warn!(volume = %self.name, epoch, %detail, "an in-sync change went unanswered; settling whether it was made");
                let made = |recorded: &keel_catalog::Replication| {
                    self.same_replicas(recorded)
                        && recorded.in_sync.iter().copied().collect::<BTreeSet<_>>() == in_sync
                };
                match self
                    .settle_unanswered(epoch, "in-sync change", made)
                    .await?
                {
                    true => {
                        self.recorded(epoch + 1, in_sync);
                        Ok(())
                    }
                    false => Err("the in-sync change was not made".to_string()),
                }
            }
            Err(error) => Err(error.to_string()),
        }
    }

    /// The volume's replication as this node's catalog shows it (`None`: deleted).
    /// The volume's write generation in this node's catalog (0 once it is gone).
    fn catalog_generation(&self) -> u64 {
        let catalog = self.shared.metadata.catalog().read();
        catalog
            .volumes
            .get(&self.volume_id)
            .map_or(0, |entry| entry.record.generation)
    }

    fn catalog_replication(&self) -> Option<keel_catalog::Replication> {
        let catalog = self.shared.metadata.catalog().read();
        let entry = catalog.volumes.get(&self.volume_id)?;
        Some(entry.record.replication.clone())
    }

    /// The change of this primary's in-sync set to `in_sync`, made against `epoch`.
    fn in_sync_command(&self, epoch: u64, in_sync: &BTreeSet<NodeId>) -> Command {
        Command::VolumeSetReplication {
            volume_id: self.volume_id,
            epoch,
            primary: self.shared.local_node,
            in_sync: in_sync.iter().copied().collect(),
        }
    }

    /// Takes `epoch` and `in_sync` as Raft recorded them.
    fn recorded(&self, epoch: u64, in_sync: BTreeSet<NodeId>) {
        let mut state = self.state();
        state.epoch = epoch;
        state.in_sync = in_sync;
    }

    /// Whether `recorded` lists this primary's replicas (itself and its peers) and in-sync
    /// minimum.
    fn same_replicas(&self, recorded: &keel_catalog::Replication) -> bool {
        let others: BTreeSet<NodeId> = (recorded.replicas.iter().copied())
            .filter(|node| *node != self.shared.local_node)
            .collect();
        let state = self.state();
        others.iter().eq(state.peers.keys())
            && usize::from(recorded.in_sync_min) == state.in_sync_min
    }

    /// Settles a change of the volume's replication made against `epoch` whose answer never
    /// came (it may have been made or not), before anything else about it is decided (call it
    /// holding `proposing`): either this node's catalog shows epoch + 1 as `made` describes
    /// it, and it is taken as made (true); or a change against the same epoch that keeps the
    /// in-sync set as it was is made, and then the unanswered one never can be (each is a
    /// compare-and-set on the epoch): false, with the kept set recorded. Until then nothing
    /// changes here: a replica Raft may list in sync stays counted for FLUSHes, so no FLUSH
    /// completes without a replica a take-over could pick, and a replica Raft may have added
    /// or removed is neither caught up nor dropped before it is known. Anything else at
    /// epoch + 1 was made by another node: this primary stops serving.
    async fn settle_unanswered(
        &self,
        epoch: u64,
        what: &str,
        made: impl Fn(&keel_catalog::Replication) -> bool,
    ) -> Result<bool, String> {
        let clock = self.shared.clock();
        let local = self.shared.local_node;
        let kept = self.state().in_sync.clone();
        let mut refused_since: Option<Instant> = None;
        loop {
            if self.is_closed() {
                return Err("this node stopped serving the volume".to_string());
            }
            let Some(recorded) = self.catalog_replication() else {
                self.close("the volume was deleted".to_string());
                return Err("the volume was deleted".to_string());
            };
            if recorded.epoch > epoch {
                if recorded.epoch == epoch + 1 && recorded.primary == local {
                    if made(&recorded) {
                        tracing::info!(volume = %self.name, epoch = epoch + 1, "the unanswered {what} is settled: made");
                        return Ok(true);
                    }
                    let set: BTreeSet<NodeId> = recorded.in_sync.iter().copied().collect();
                    if set == kept && self.same_replicas(&recorded) {
                        self.recorded(epoch + 1, set);
                        tracing::info!(volume = %self.name, epoch = epoch + 1, "the unanswered {what} is settled: not made");
                        return Ok(false);
                    }
                }
                let why = format!(
                    "its replication changed elsewhere (epoch {}) while the {what} went unanswered",
                    recorded.epoch
                );
                self.close(why.clone());
                return Err(why);
            }
            // Not seen here: the same set as before, against the same epoch.
            match self.propose_raw(self.in_sync_command(epoch, &kept)).await {
                Ok(()) => {
                    self.recorded(epoch + 1, kept);
                    tracing::info!(volume = %self.name, epoch = epoch + 1, "the unanswered {what} is settled: not made");
                    return Ok(false);
                }
                // The epoch moved on (by the unanswered change, or another node's): this
                // node's catalog shows which once it applied it.
                Err(MetadataError::Refused(refusal)) => {
                    let since = *refused_since.get_or_insert_with(|| clock.now());
                    if clock.now().saturating_duration_since(since) > SETTLE_REFUSED_MAX {
                        let why = format!("the unanswered {what} could not be settled: {refusal}");
                        self.close(why.clone());
                        return Err(why);
                    }
                    clock.sleep(Duration::from_millis(20)).await;
                }
                Err(MetadataError::Failed { detail }) => {
                    let why = format!("the unanswered {what} could not be settled: {detail}");
                    self.close(why.clone());
                    return Err(why);
                }
                Err(error) => {
                    tracing::info!(volume = %self.name, %error, "could not settle the unanswered {what} yet; retrying");
                    clock.sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// Takes a replica whose stream `stream` failed out of the in-sync set (FLUSHes wait until
    /// Raft recorded it), then starts catching it up. Nothing once a newer stream replaced the
    /// failed one: the catch-up that began it (the replica was out of the set then) owns the
    /// replica's count, and uncounting it here while its addition lands would let FLUSHes go on
    /// without a replica Raft lists in sync.
    async fn drop_replica(self: Arc<Self>, node: NodeId, stream: u64) {
        loop {
            // Looked at with no change of the set in flight (an addition of this replica that
            // was on its way lands first), and uncounted only while out of it.
            let member = {
                let _proposing = self.proposing.lock().await;
                let mut state = self.state();
                if state.closed.is_some() {
                    return;
                }
                let member = state.in_sync.contains(&node);
                let Some(peer) = state.peers.get_mut(&node) else {
                    return;
                };
                if peer.stream != stream {
                    return;
                }
                if !member {
                    peer.counted = false;
                }
                member
            };
            if !member {
                break;
            }
            match self.propose_in_sync(InSyncChange::Drop(node)).await {
                Ok(()) => {
                    tracing::warn!(volume = %self.name, node, "replica taken out of the in-sync set");
                }
                Err(error) => {
                    if self.is_closed() {
                        return;
                    }
                    tracing::warn!(volume = %self.name, node, %error, "could not record the in-sync set yet; FLUSHes wait");
                    self.shared.clock().sleep(Duration::from_millis(200)).await;
                }
            }
        }
        self.changed.notify_waiters();
        self.spawn_resync(node);
    }

    fn spawn_resync(self: &Arc<Self>, node: NodeId) {
        let id = {
            let mut state = self.state();
            let Some(peer) = state.peers.get_mut(&node) else {
                return;
            };
            if peer.resync_running {
                return;
            }
            peer.resync_running = true;
            peer.id
        };
        let this = self.clone();
        self.shared.runtime.spawn(async move {
            loop {
                // The replica's entry, if it is still the one this task catches up: one removed
                // and added back while this task slept has a task of its own, and two catch-ups
                // of one replica would undo each other (one starting a stream, uncounted, while
                // the other's addition to the in-sync set is on its way: found by the
                // simulation with single copies, seed 6165).
                if this.state().peers.get(&node).is_none_or(|peer| peer.id != id) {
                    return;
                }
                let attempt = this.shared.clock_now();
                let outcome = this.resync(node, id).await;
                if outcome.is_err() && this.is_closed() {
                    break;
                }
                // Done, unless the replica's stream failed meanwhile (as it joined the set, or
                // while the FLUSH after it waited): the drop_replica that followed found this
                // catch-up running and left the next one to it. Looked at under the same lock
                // that ends it, so no failure falls in between.
                let retry = {
                    let mut state = this.state();
                    let Some(peer) = state.peers.get_mut(&node).filter(|peer| peer.id == id)
                    else {
                        return;
                    };
                    match &outcome {
                        Ok(()) if !peer.failed && peer.streaming => {
                            peer.resync_running = false;
                            peer.failures = 0;
                            peer.last_failure = None;
                            peer.refusing_since = None;
                            return;
                        }
                        Ok(()) => {}
                        // The stream's failure, if one came during this try, says more (the
                        // replica's own answer) than what the catch-up saw of it.
                        Err(error) => {
                            if peer.last_failure.as_ref().is_none_or(|last| last.at < attempt) {
                                peer.last_failure = Some(PeerFailure {
                                    message: error.clone(),
                                    at: this.shared.clock_now(),
                                    refused: false,
                                });
                                peer.refusing_since = None;
                            }
                        }
                    }
                    peer.failures = peer.failures.saturating_add(1);
                    let refused = peer.last_failure.as_ref().is_some_and(|last| last.refused);
                    (peer.failures, retry_after(peer.failures, refused))
                };
                if let (Err(error), (failures, after)) = (&outcome, retry) {
                    // Said once, then every 60th try: a node that is down fails every try.
                    if failures % 60 == 1 {
                        tracing::info!(volume = %this.name, node, %error, failures, ?after, "catching a replica up failed; retrying");
                    }
                }
                this.shared.clock().sleep(retry.1).await;
            }
            if let Some(peer) = this.state().peers.get_mut(&node) {
                if peer.id == id {
                    peer.resync_running = false;
                }
            }
        });
    }

    /// Turns for catching `node` up ([`Settings::rebuilds_max`]), if it lacks the whole volume:
    /// one of this node's, waited for in order, then one of the replica's node's
    /// (`crate::turns`; refused, this node's is given back and both are asked again after
    /// [`TURN_RETRY`]); the replica marked waiting meanwhile (`keel volume info`). `None` for
    /// a catch-up of what changed during an absence, which never waits behind whole copies.
    /// Fails once the replica's entry `id` is gone, this primary stopped, or the replica's
    /// node does not answer.
    async fn rebuild_turn(self: &Arc<Self>, node: NodeId, id: u64) -> Result<Option<Turn>, String> {
        let whole = |this: &Self| -> Result<bool, String> {
            let state = this.state();
            if state.closed.is_some() {
                return Err("this node stopped serving the volume".to_string());
            }
            let peer = (state.peers.get(&node))
                .filter(|peer| peer.id == id)
                .ok_or("replica gone")?;
            Ok(peer.lacking.to_compare().is_none())
        };
        if !whole(self)? {
            return Ok(None);
        }
        let mark_waiting = |waiting: bool| {
            if let Some(peer) = (self.state().peers.get_mut(&node)).filter(|peer| peer.id == id) {
                peer.rebuild_waiting = waiting;
            }
        };
        let clock = self.shared.clock();
        let (mut waited_here, mut waited_there) = (false, false);
        loop {
            let acquire = self.shared.rebuilds.clone().acquire_owned();
            tokio::pin!(acquire);
            let sending = loop {
                tokio::select! {
                    turn = &mut acquire => break turn.map_err(|error| error.to_string())?,
                    _ = clock.sleep(Duration::from_millis(500)) => {
                        if !waited_here {
                            waited_here = true;
                            tracing::info!(volume = %self.name, node, "a whole copy to this replica waits for a turn (rebuilds_max)");
                        }
                        mark_waiting(true);
                        whole(self)?;
                    }
                }
            };
            if copy_turn(&self.shared, node, self.volume_id, TurnAction::Ask).await? {
                mark_waiting(false);
                return Ok(Some(Turn::new(sending, &self.shared, node, self.volume_id)));
            }
            drop(sending);
            if !waited_there {
                waited_there = true;
                tracing::info!(volume = %self.name, node, "a whole copy to this replica waits for a turn on its node (rebuilds_max there)");
            }
            mark_waiting(true);
            clock.sleep(TURN_RETRY).await;
            whole(self)?;
        }
    }

    /// Catches a replica up and puts it back in the in-sync set: a new stream carries every
    /// write from now on; meanwhile each chunk of the volume it may lack ([`Lacking`]: after a
    /// short absence, the chunks changed meanwhile; otherwise all) is compared by block hashes
    /// and the blocks that differ are queued on the same stream (so a later write to a block
    /// always lands after its copy); then the replica flushes, counts for FLUSHes, and Raft
    /// records it in sync.
    /// `id` is the replica's entry this catch-up works on ([`Peer::id`]): another (the replica
    /// removed and added back meanwhile) is left alone, as a replica gone.
    async fn resync(self: &Arc<Self>, node: NodeId, id: u64) -> Result<(), String> {
        let size = self.local.size_bytes();
        let block = u64::from(self.local.block_size_bytes());
        // What it lacks is unknown (this node just became primary, after a crash or a
        // take-over): if both nodes hold a common point, it lacks at most what either changed
        // since. Changes ordered from now on are recorded as they come, before the lists are
        // made, so none falls between.
        let unknown = {
            let mut state = self.state();
            let Some(peer) = state.peers.get_mut(&node).filter(|peer| peer.id == id) else {
                return Ok(());
            };
            // (A stream an earlier attempt left behind: what it carries unconfirmed is folded
            // in below, as for any catch-up.)
            let unknown = peer.lacking.is_unknown() && !peer.added;
            if unknown {
                peer.lacking.caught_up();
            }
            unknown
        };
        if unknown {
            let found = self.changed_since_points(node).await;
            let mut state = self.state();
            if let Some(peer) = state.peers.get_mut(&node) {
                match &found {
                    Ok(Some(chunks)) => peer.lacking.add(chunks),
                    Ok(None) | Err(_) => peer.lacking.unknown(),
                }
            }
            // Not answered (a replica starting up may not have applied the epoch yet): ask
            // again at the next attempt, rather than compare the whole volume now.
            found?;
        }
        // Held to the end of the catch-up.
        let turn = self.rebuild_turn(node, id).await?;
        let generation = self.catalog_generation();
        let (runs, probing, stream) = {
            let mut state = self.state();
            if state.closed.is_some() {
                return Ok(());
            }
            // A replica still in the in-sync set stays counted for FLUSHes until Raft records
            // it out ([`Self::drop_replica`]); its catch-up starts after that.
            if state.in_sync.contains(&node) {
                return Err("still in the in-sync set: waiting for it to be taken out".to_string());
            }
            let stream = self.shared.new_stream_id(self.volume_id, state.epoch);
            let Some(peer) = state.peers.get_mut(&node).filter(|peer| peer.id == id) else {
                return Ok(());
            };
            // A stream an earlier attempt began: what it carried unconfirmed is lacked too.
            peer.lacking.stream_ended();
            // Written stretches are found by probing when everything is compared; what the
            // replica lacks after an absence was written by definition.
            let (runs, probing) = match peer.lacking.to_compare() {
                Some(chunks) => (chunks.runs(size, block), false),
                None if turn.is_none() => {
                    return Err("it now lacks the whole volume: waiting for a turn".to_string());
                }
                None => (vec![(0, size)], true),
            };
            peer.queue.clear();
            peer.queued_bytes = 0;
            peer.streaming = true;
            peer.counted = false;
            peer.failed = false;
            peer.durable_upto = 0;
            peer.flushes_queued = 0;
            peer.flushes_taken = 0;
            peer.flushes_confirmed = 0;
            peer.stream = stream;
            peer.next_index = 0;
            // Batch indexes start over with the stream: a common point is named anew.
            peer.confirmed_flushes.clear();
            peer.common_index = None;
            peer.common_upto = 0;
            peer.common_told = None;
            peer.catalog_index = self.shared.cluster.applied_index();
            // (Read before the state was locked: a change made since raised it already.)
            peer.generation = peer.generation.max(generation);
            peer.resync_started = Some(self.shared.clock().now());
            peer.resync_compared = 0;
            peer.resync_total = runs.iter().map(|(start, end)| end - start).sum();
            let mut state_ref = state;
            self.spawn_sender(node, &mut state_ref);
            (runs, probing, stream)
        };
        let mut shipped = 0u64;
        // Bytes of the runs before the current one.
        let mut runs_done = 0u64;
        let clock = self.shared.clock();
        let started = clock.now();
        let busy_percent = u32::from(self.shared.resync_busy_percent.clamp(1, 100));
        let mut requests_seen = self.local_requests();
        for (start, end) in runs {
            let mut offset = start;
            // The end of the stretch already known to hold writes (compared chunk by chunk),
            // and whether the replica had never written it when asked: then its chunks read
            // as zeroes there, and are compared with zeroes without asking for hashes (a
            // client write to the stretch since then is on the replica's stream and on this
            // copy alike).
            let mut probed_to = if probing { start } else { end };
            let mut theirs_unwritten = false;
            // The next chunk's hashes, asked for while this chunk is read and queued.
            let mut prefetched: Option<(u64, HashesAsked)> = None;
            while offset < end {
                let chunk_started = clock.now();
                if offset >= probed_to {
                    let stretch = RESYNC_PROBE_BYTES.min(end - offset);
                    match self.probe_stretch(node, offset, stretch).await? {
                        Stretch::Unwritten => {
                            offset += stretch;
                            let mut state = self.state();
                            state.resync_skipped_bytes += stretch;
                            if let Some(peer) = state.peers.get_mut(&node) {
                                peer.resync_compared = runs_done + offset - start;
                            }
                            continue;
                        }
                        Stretch::TheirsUnwritten => theirs_unwritten = true,
                        Stretch::Written => theirs_unwritten = false,
                    }
                    probed_to = offset + stretch;
                }
                let length = RESYNC_CHUNK_BYTES.min(end - offset);
                let theirs = match prefetched.take() {
                    _ if theirs_unwritten => Vec::new(),
                    Some((at, hashes)) if at == offset => {
                        hashes.await.map_err(|error| error.to_string())??
                    }
                    _ => self.remote_hashes(node, offset, length).await?,
                };
                let next = offset + length;
                if !theirs_unwritten && next < probed_to {
                    let this = self.clone();
                    let next_length = RESYNC_CHUNK_BYTES.min(end - next);
                    prefetched = Some((
                        next,
                        tokio::spawn(
                            async move { this.remote_hashes(node, next, next_length).await },
                        ),
                    ));
                }
                // Room first (never wait for the queue with the order lock held).
                loop {
                    {
                        let state = self.state();
                        let peer = (state.peers.get(&node))
                            .filter(|peer| peer.stream == stream)
                            .ok_or("replica gone")?;
                        if state.closed.is_some() {
                            return Ok(());
                        }
                        if peer.failed || !peer.streaming {
                            return Err("the replica's stream failed during the resync".to_string());
                        }
                        if peer.queued_bytes < QUEUE_BYTES_MAX / 2 {
                            break;
                        }
                    }
                    self.shared.clock().sleep(Duration::from_millis(5)).await;
                }
                let copied = self
                    .queue_differences((node, stream), offset, length, block, theirs)
                    .await?;
                shipped += copied;
                self.state().resync_compared_bytes += length;
                offset += length;
                let worked = clock.now().saturating_duration_since(chunk_started);
                // The configured rate: wait until what was shipped so far is due.
                if let Some(rate) = self.shared.resync_bytes_per_second {
                    let due = Duration::from_secs_f64(shipped as f64 / rate.max(1) as f64);
                    let elapsed = clock.now().saturating_duration_since(started);
                    if due > elapsed {
                        clock.sleep(due - elapsed).await;
                    }
                }
                // Clients came meanwhile, on either node: work only `busy_percent` of the time
                // while they do.
                let requests = self.local_requests();
                if (requests != requests_seen || self.replica_node_busy(node)) && busy_percent < 100
                {
                    clock
                        .sleep(worked * (100 - busy_percent) / busy_percent)
                        .await;
                    requests_seen = self.local_requests();
                }
                if let Some(peer) = self.state().peers.get_mut(&node) {
                    peer.resync_compared = runs_done + offset - start;
                }
            }
            runs_done += end - start;
        }
        let compared = clock.now().saturating_duration_since(started);
        // Everything is queued: the replica becomes counted, flushes, and joins once that
        // flush (the one behind the last data queued) is confirmed.
        let flush = {
            let _order = self.ordering().await.map_err(|error| error.to_string())?;
            let mut state = self.state();
            let upto = state.next_seq - 1;
            let peer = (state.peers.get_mut(&node))
                .filter(|peer| peer.stream == stream)
                .ok_or("replica gone")?;
            if peer.failed {
                return Err("the replica's stream failed during the resync".to_string());
            }
            peer.counted = true;
            peer.push(Item::Flush { upto });
            peer.flushes_queued
        };
        let deadline = self.shared.clock().now() + Duration::from_secs(30);
        loop {
            {
                let state = self.state();
                let peer = (state.peers.get(&node))
                    .filter(|peer| peer.stream == stream)
                    .ok_or("replica gone")?;
                if peer.failed {
                    return Err("the replica failed before it was in sync".to_string());
                }
                // Ended without failing (a rollback's drop stopped it, say): its queue, the
                // FLUSH with it, was cleared, so no confirmation can come.
                if !peer.streaming {
                    return Err("the replica's stream ended before it was in sync".to_string());
                }
                if peer.flushes_confirmed >= flush {
                    break;
                }
            }
            if self.shared.clock().now() > deadline {
                if let Some(peer) =
                    (self.state().peers.get_mut(&node)).filter(|peer| peer.stream == stream)
                {
                    peer.counted = false;
                }
                return Err("the replica did not confirm its flush".to_string());
            }
            self.shared.clock().sleep(Duration::from_millis(2)).await;
        }
        // On an error it stays counted: the addition may have landed all the same (its answer
        // lost), and waiting for a replica that streams costs nothing.
        self.propose_in_sync(InSyncChange::Add(node, stream))
            .await?;
        // Unless its stream failed meanwhile: then what it carried unconfirmed was added to
        // what the replica lacks, it is dropped again ([`Self::drop_replica`], which waited for
        // this addition), and the next catch-up compares that and all of this one.
        {
            let mut state = self.state();
            let peer = state.peers.get_mut(&node).ok_or("replica gone")?;
            if !(peer.streaming && !peer.failed && peer.stream == stream) {
                return Err("the replica's stream failed as it joined the in-sync set".to_string());
            }
            peer.lacking.caught_up();
            peer.added = false;
        }
        self.changed.notify_waiters();
        // A FLUSH with the replica in sync gives both nodes a common point at once, rather
        // than at the client's next FLUSH (a volume left idle after the catch-up keeps none).
        let flushed = match self.queue_flush_here().await {
            Ok(upto) => {
                let local = self.local.clone();
                crate::blocking(move || local.flush().map_err(|error| error.to_string()))
                    .await
                    .and_then(|flushed| flushed)
                    .map(|()| self.flushed_here(upto))
            }
            Err(error) => Err(error.to_string()),
        };
        if let Err(error) = flushed {
            tracing::info!(volume = %self.name, node, %error, "the FLUSH after a catch-up failed; the next one gives the common point");
        }
        let took = clock.now().saturating_duration_since(started);
        tracing::info!(
            volume = %self.name,
            node,
            shipped_bytes = shipped,
            compare_ms = compared.as_millis() as u64,
            total_ms = took.as_millis() as u64,
            "replica back in sync"
        );
        // Snapshots it lacks can be copied now (rather than at the engine's next check).
        self.spawn_snapshot_repair();
        Ok(())
    }

    /// Compares every replica in sync with this copy, 1 MiB at a time, and repairs what
    /// differs: a damaged block of this copy is healed from a replica on read
    /// ([`Primary::read_repairing`]); a replica's block that differs still after a FLUSH (so no
    /// write in flight explains it) is replaced by this copy's, on the replica's stream.
    /// Stretches neither side ever wrote are skipped. `stop` is asked after each chunk: true
    /// ends the scrub early (`interrupted`). Blocking.
    pub fn scrub(
        self: &Arc<Self>,
        progress: &mut dyn FnMut(u64, u64),
        stop: &dyn Fn() -> bool,
    ) -> VolumeResult<ScrubReport> {
        let size = self.local.size_bytes();
        let block = u64::from(self.local.block_size_bytes());
        let failed = |error: String| unavailable(&self.name, error);
        let mut report = ScrubReport::default();
        let repaired_before = self.state().repaired_blocks;
        let mut offset = 0u64;
        let mut probed_to = 0u64;
        while offset < size {
            let replicas: Vec<NodeId> = {
                let state = self.state();
                self.check_serving(&state)?;
                state
                    .in_sync
                    .iter()
                    .copied()
                    .filter(|node| *node != self.shared.local_node)
                    .collect()
            };
            if offset >= probed_to {
                let stretch = RESYNC_PROBE_BYTES.min(size - offset);
                let mut unwritten = true;
                for node in &replicas {
                    unwritten &= self
                        .shared
                        .runtime
                        .block_on(self.probe_stretch(*node, offset, stretch))
                        .map_err(failed)?
                        == Stretch::Unwritten;
                }
                if unwritten && self.local.range_unwritten(offset, stretch)? {
                    offset += stretch;
                    report.skipped_bytes += stretch;
                    progress(offset, size);
                    if stop() {
                        report.interrupted = true;
                        break;
                    }
                    continue;
                }
                probed_to = offset + stretch;
            }
            let length = RESYNC_CHUNK_BYTES.min(size - offset);
            let mut data = vec![0u8; length as usize];
            self.read(offset, &mut data)?;
            let ours: Vec<u8> = data
                .chunks(block as usize)
                .flat_map(wire::block_hash)
                .collect();
            for node in &replicas {
                let theirs = self
                    .shared
                    .runtime
                    .block_on(self.remote_hashes(*node, offset, length))
                    .map_err(failed)?;
                if differs(&ours, &theirs, block) {
                    // Writes in flight may explain it: compare again once they are durable.
                    self.flush()?;
                    let theirs = self
                        .shared
                        .runtime
                        .block_on(self.remote_hashes(*node, offset, length))
                        .map_err(failed)?;
                    // Onto the replica's stream as it is now (one replaced meanwhile is
                    // left alone: "replica gone").
                    let stream = (self.state().peers.get(node)).map_or(0, |peer| peer.stream);
                    let shipped = self
                        .shared
                        .runtime
                        .block_on(self.queue_differences(
                            (*node, stream),
                            offset,
                            length,
                            block,
                            theirs,
                        ))
                        .map_err(failed)?;
                    report.replica_blocks_repaired += shipped / block;
                }
            }
            report.compared_bytes += length;
            offset += length;
            progress(offset, size);
            if stop() {
                report.interrupted = true;
                break;
            }
        }
        // What was shipped is durable on every replica before the report says so.
        self.shared.runtime.block_on(self.flush_shipped())?;
        report.replicas = self.state().in_sync.len() as u64;
        report.local_blocks_repaired = self.state().repaired_blocks - repaired_before;
        Ok(report)
    }

    /// Makes what was queued without a history position (a scrub's repairs) durable on every
    /// replica counted for FLUSHes: a flush is queued, and each replica's wait ends when that
    /// flush of its stream is confirmed (its position alone may have been confirmed by an
    /// earlier flush). A replica that fails meanwhile is out of the in-sync set.
    async fn flush_shipped(&self) -> VolumeResult<()> {
        self.lease().await?;
        let wanted: BTreeMap<NodeId, u64> = {
            let _order = self.ordering().await?;
            let mut state = self.state();
            self.check_serving(&state)?;
            self.queue_flush(&mut state);
            state
                .peers
                .iter()
                .filter(|(_, peer)| peer.counted)
                .map(|(node, peer)| (*node, peer.flushes_queued))
                .collect()
        };
        self.local.flush()?;
        self.wait_confirmed(
            |node, peer| {
                peer.counted
                    && !peer.failed
                    && wanted
                        .get(&node)
                        .is_some_and(|flush| peer.flushes_confirmed < *flush)
            },
            None,
            None,
            |_| Ok(()),
            replicating,
        )
        .await
    }

    /// A read that met a block failing its checksum here: block by block, each damaged block
    /// is read from an in-sync replica and written back to the local copy.
    async fn read_repairing(&self, offset: u64, buf: &mut [u8]) -> VolumeResult<()> {
        let block = self.local.block_size_bytes() as usize;
        for (index, chunk) in buf.chunks_mut(block).enumerate() {
            let at = offset + (index * block) as u64;
            match self.local.read(at, chunk) {
                Err(error) if error.is_corrupt() => self.repair_block(at, chunk, error).await?,
                other => other?,
            }
        }
        Ok(())
    }

    /// Replaces a damaged block of the local copy with an in-sync replica's, read once that
    /// replica applied every write ordered before (no write is ordered meanwhile, so the
    /// copies agree). Fails with `damage` when no replica can give it.
    async fn repair_block(
        &self,
        offset: u64,
        chunk: &mut [u8],
        damage: VolumeError,
    ) -> VolumeResult<()> {
        let sources: Vec<NodeId> = self
            .state()
            .in_sync
            .iter()
            .copied()
            .filter(|node| *node != self.shared.local_node)
            .collect();
        let length = chunk.len() as u64;
        self.quiesce_async(async {
            for node in sources {
                let copy = self
                    .ask_range::<CopyAnswer>(node, METHOD_READ_COPY, offset, length)
                    .await;
                match copy {
                    Ok(copy) if copy.data.len() == chunk.len() => {
                        // No fdatasync here (writes wait behind this quiesce): a repair lost
                        // to a crash is made again, and the next FLUSH makes it durable.
                        self.local.write(offset, &copy.data, false)?;
                        chunk.copy_from_slice(&copy.data);
                        self.state().repaired_blocks += 1;
                        tracing::warn!(
                            volume = %self.name,
                            offset,
                            from = node,
                            %damage,
                            "a damaged block of this copy was replaced by a replica's"
                        );
                        return Ok(());
                    }
                    Ok(_) => {
                        tracing::warn!(volume = %self.name, node, "a replica's copy has the wrong size")
                    }
                    Err(error) => {
                        tracing::warn!(volume = %self.name, node, %error, "no copy from a replica")
                    }
                }
            }
            Err(damage)
        })
        .await
    }

    /// Which of the replica and this node ever wrote `[offset, offset + length)`: the replica
    /// is asked first, then the local copy is looked at under the order lock, so a write that
    /// lands after that is on the replica's stream (as in `queue_differences`).
    async fn probe_stretch(
        self: &Arc<Self>,
        node: NodeId,
        offset: u64,
        length: u64,
    ) -> Result<Stretch, String> {
        let answer: UnwrittenAnswer = self
            .ask_range(node, METHOD_UNWRITTEN, offset, length)
            .await?;
        if !answer.unwritten {
            return Ok(Stretch::Written);
        }
        let ours_unwritten = loop {
            drop(self.ordering().await.map_err(|error| error.to_string())?);
            let this = self.clone();
            let looked = crate::blocking(move || {
                let _order = lock(&this.order);
                if this.state().paused > 0 {
                    return Ok(None);
                }
                this.local
                    .range_unwritten(offset, length)
                    .map(Some)
                    .map_err(|error| error.to_string())
            })
            .await??;
            if let Some(unwritten) = looked {
                break unwritten;
            }
        };
        Ok(if ours_unwritten {
            Stretch::Unwritten
        } else {
            Stretch::TheirsUnwritten
        })
    }

    async fn remote_hashes(
        &self,
        node: NodeId,
        offset: u64,
        length: u64,
    ) -> Result<Vec<u8>, String> {
        let answer: HashAnswer = self.ask_range(node, METHOD_HASHES, offset, length).await?;
        Ok(answer.hashes)
    }

    /// What a question to a replica about its copy carries: this primary's epoch, and the
    /// Raft index the replica must have applied before it answers (the primary's when the
    /// volume's view last changed for that replica: its catch-up began, or a change quiesced
    /// the volume). A replica whose metadata lags a rollback or a received stream would
    /// otherwise compare its copy as it was before, and a catch-up would skip what the change
    /// made it lack.
    fn asked_as(&self, node: NodeId) -> (u64, u64) {
        let state = self.state();
        let catalog_index = state.peers.get(&node).map_or(0, |peer| peer.catalog_index);
        (state.epoch, catalog_index)
    }

    /// Whether `node` refusing this primary ([`CODE_FENCED`]) means this primary must stop,
    /// as this primary knows it now: not when its own change removed `node`'s replica (R
    /// lowered, a replica moved: `node` is no longer its peer), Raft recorded that change
    /// keeping this node primary, and `node` applied it before a request sent earlier
    /// reached it. `node` then holds no replica, and its refusal says nothing about this
    /// primary. Otherwise it stops: another primary took over, or Raft recorded a change
    /// whose answer this primary never saw (its state is stale; a fresh primary reads the
    /// catalog again). A catalog that has not seen the removal (this node cut off) still
    /// lists `node`. While a change of this primary is being proposed the answer is not
    /// known yet: [`Self::refused_by`] waits for it.
    fn fenced_by(&self, node: NodeId) -> bool {
        self.state().peers.contains_key(&node)
            || self.catalog_replication().is_none_or(|replication| {
                replication.primary != self.shared.local_node || replication.hosts(node)
            })
    }

    /// `node` answered a batch with [`CODE_FENCED`]: this primary stops if
    /// [`Self::fenced_by`] says so, once no change of its own is being proposed (the change
    /// may be the one that removed `node`, which it applied first). Meanwhile the FLUSHes
    /// counting `node` wait: none is acknowledged without it.
    fn refused_by(self: &Arc<Self>, node: NodeId, message: String) {
        let settle = move |primary: &Primary| {
            if primary.fenced_by(node) {
                primary.close(format!("a replica fenced this node: {message}"));
            }
        };
        if self.proposing.try_lock().is_ok() {
            settle(self);
            return;
        }
        let this = self.clone();
        self.shared.runtime.spawn(async move {
            drop(this.proposing.lock().await);
            settle(&this);
        });
    }

    /// Asks a replica about a range of the volume (`METHOD_HASHES`, `METHOD_UNWRITTEN`) in
    /// this primary's epoch; a replica that fences it closes this primary.
    async fn ask_range<T: serde::de::DeserializeOwned>(
        &self,
        node: NodeId,
        method: u16,
        offset: u64,
        length: u64,
    ) -> Result<T, String> {
        let (epoch, catalog_index) = self.asked_as(node);
        let request = HashRequest {
            volume_id: self.volume_id,
            epoch,
            catalog_index,
            offset,
            length,
        };
        self.ask(node, method, &request, Duration::from_secs(10))
            .await
    }

    /// One call to a replica, encoded and decoded; a replica that fenced this node closes it.
    async fn ask<T: serde::de::DeserializeOwned>(
        &self,
        node: NodeId,
        method: u16,
        request: &impl serde::Serialize,
        timeout: Duration,
    ) -> Result<T, String> {
        let payload = postcard::to_allocvec(request).map_err(|error| error.to_string())?;
        let answer = self
            .shared
            .call(node, method, payload, timeout)
            .await
            .map_err(|failure| {
                // (While a change of this primary is being proposed, the question fails and
                // is asked again after it: a peer it removed is asked no more.)
                if failure.code == Some(CODE_FENCED)
                    && self.proposing.try_lock().is_ok()
                    && self.fenced_by(node)
                {
                    self.close(format!("a replica fenced this node: {}", failure.message));
                }
                failure.message
            })?;
        postcard::from_bytes(&answer).map_err(|error| error.to_string())
    }

    /// Queues the blocks of a chunk whose hash differs from the replica's (a replica that
    /// never wrote the chunk answers no hashes: it reads as zeroes, so every block of this
    /// copy that is not zeroes travels, and nothing is hashed), at the chunk's place in the
    /// stream: the chunk is read and compared without the order lock (client writes go on
    /// meanwhile), then queued under it only if no change ordered meanwhile overlapped it;
    /// otherwise it is read again, the last time under the lock throughout. Returns the
    /// bytes queued.
    async fn queue_differences(
        self: &Arc<Self>,
        (node, stream): (NodeId, u64),
        offset: u64,
        length: u64,
        block: u64,
        theirs: Vec<u8>,
    ) -> Result<u64, String> {
        let block = block as usize;
        let blocks = length as usize / block;
        if !theirs.is_empty() && theirs.len() != blocks * BLOCK_HASH_BYTES {
            return Err(format!(
                "the replica sent {} bytes of hashes for {blocks} blocks",
                theirs.len()
            ));
        }
        let theirs = Arc::new(theirs);
        let mut attempt = 0;
        loop {
            attempt += 1;
            // Not while a change holds ordering back (the chunk may change under it).
            drop(self.ordering().await.map_err(|error| error.to_string())?);
            let this = self.clone();
            let hashes = theirs.clone();
            let last = attempt >= RESYNC_READ_ATTEMPTS;
            let step = crate::blocking(move || {
                this.difference_step((node, stream), (offset, length), block, &hashes, last)
            })
            .await??;
            match step {
                Step::Queued(bytes) => return Ok(bytes),
                Step::Again => {}
                Step::Paused => attempt -= 1,
            }
        }
    }

    /// One attempt of [`Self::queue_differences`] (blocking: reads the local copy): the chunk
    /// read and compared without the order lock, then queued under it unless a change ordered
    /// meanwhile overlapped it; the `last` attempt reads it under the lock throughout.
    fn difference_step(
        &self,
        (node, stream): (NodeId, u64),
        (offset, length): (u64, u64),
        block: usize,
        theirs: &[u8],
        last: bool,
    ) -> Result<Step, String> {
        let blocks = length as usize / block;
        let mut order = Some(lock(&self.order));
        if self.state().paused > 0 {
            return Ok(Step::Paused);
        }
        if theirs.is_empty()
            && self
                .local
                .range_unwritten(offset, length)
                .map_err(|error| error.to_string())?
        {
            return Ok(Step::Queued(0));
        }
        self.state()
            .peers
            .get_mut(&node)
            .filter(|peer| peer.stream == stream)
            .ok_or("replica gone")?
            .resync_reading = Some((offset, offset + length, false));
        if !last {
            order = None;
        }
        let compared = self.read_differences(offset, length, block, theirs);
        let _order = order.unwrap_or_else(|| lock(&self.order));
        let mut state = self.state();
        let paused = state.paused > 0;
        let next_position = state.next_seq;
        let peer = (state.peers.get_mut(&node))
            .filter(|peer| peer.stream == stream)
            .ok_or("replica gone")?;
        let touched = peer
            .resync_reading
            .take()
            .is_none_or(|(_, _, touched)| touched);
        let (ours, runs) = compared?;
        if paused || (touched && !last) {
            self.shared.chunk_buffers.give_back(ours);
            return Ok(if paused { Step::Paused } else { Step::Again });
        }
        let mut queued = 0u64;
        if runs == [(0, blocks)] {
            // The whole chunk: no copy.
            queued = length;
            peer.push(Item::Op(Op::Write {
                offset,
                data: self.shared.chunk_buffers.share(ours),
            }));
        } else {
            // Copies, so that a queue of a few blocks from each chunk does not keep whole
            // chunks in memory (the queue's bound counts the bytes queued).
            for (first, end) in runs {
                let (start, stop) = (first * block, end * block);
                peer.push(Item::Op(Op::Write {
                    offset: offset + start as u64,
                    data: bytes::Bytes::copy_from_slice(&ours[start..stop]),
                }));
                queued += (stop - start) as u64;
            }
            self.shared.chunk_buffers.give_back(ours);
        }
        // A scrub's repair of a replica in sync: data without a history position, which a
        // FLUSH queued after the next write confirms. (A catch-up's copies need no note:
        // until it succeeds, what the replica lacks keeps all it compares.)
        if queued > 0 && peer.counted {
            peer.lacking
                .note(peer.streaming, next_position, offset, length);
        }
        state.resync_bytes += queued;
        Ok(Step::Queued(queued))
    }

    /// Reads a chunk of this copy and finds the runs of blocks that differ from the replica's
    /// hashes (`theirs` empty: from zeroes).
    fn read_differences(
        &self,
        offset: u64,
        length: u64,
        block: usize,
        theirs: &[u8],
    ) -> Result<(Vec<u8>, Vec<BlockRun>), String> {
        let mut ours = self.shared.chunk_buffers.take(length as usize);
        if let Err(error) = self.local.read(offset, &mut ours) {
            self.shared.chunk_buffers.give_back(ours);
            return Err(error.to_string());
        }
        let mut runs: Vec<BlockRun> = Vec::new();
        for (index, mine) in ours.chunks(block).enumerate() {
            let differs = if theirs.is_empty() {
                mine.iter().any(|byte| *byte != 0)
            } else {
                wire::block_hash(mine)[..]
                    != theirs[index * BLOCK_HASH_BYTES..(index + 1) * BLOCK_HASH_BYTES]
            };
            match runs.last_mut() {
                Some((_, end)) if differs && *end == index => *end = index + 1,
                _ if differs => runs.push((index, index + 1)),
                _ => {}
            }
        }
        Ok((ours, runs))
    }
}

/// What one attempt of [`Primary::queue_differences`] did.
enum Step {
    /// Queued this many bytes of blocks that differ (maybe none).
    Queued(u64),
    /// A change ordered meanwhile overlapped the chunk: read it again.
    Again,
    /// A change holds ordering back: wait for it, then read the chunk again.
    Paused,
}

/// Consecutive blocks of a chunk, as (first, end) block indexes.
type BlockRun = (usize, usize);

/// Who ever wrote a stretch of the volume ([`Primary::probe_stretch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stretch {
    /// Neither the replica nor this node.
    Unwritten,
    /// This node, not the replica.
    TheirsUnwritten,
    /// The replica (and maybe this node).
    Written,
}

/// The flush a batch ends with: the history position it covers, and its count in the stream.
/// A batch ending in a FLUSH: the position it covers, its count in the stream, the batch's
/// index, and whether the replica was in sync when it was taken.
#[derive(Clone, Copy)]
struct BatchFlush {
    upto: u64,
    count: u64,
    index: u64,
    in_sync: bool,
}

/// A whole copy's turns ([`Primary::rebuild_turn`]): one of this node's, and one of the
/// replica's node's, renewed every [`TURN_RENEW`] until dropped, then given back.
struct Turn {
    _sending: tokio::sync::OwnedSemaphorePermit,
    renewal: tokio::task::JoinHandle<()>,
    shared: Arc<Shared>,
    node: NodeId,
    volume_id: u64,
}

impl Turn {
    fn new(
        sending: tokio::sync::OwnedSemaphorePermit,
        shared: &Arc<Shared>,
        node: NodeId,
        volume_id: u64,
    ) -> Turn {
        let renewing = shared.clone();
        let renewal = shared.runtime.spawn(async move {
            let clock = renewing.clock();
            loop {
                clock.sleep(TURN_RENEW).await;
                // (Not answered: the copy fails on its own, or the turn lapses.)
                let _ = copy_turn(&renewing, node, volume_id, TurnAction::Renew).await;
            }
        });
        Turn {
            _sending: sending,
            renewal,
            shared: shared.clone(),
            node,
            volume_id,
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.renewal.abort();
        let (shared, node, volume_id) = (self.shared.clone(), self.node, self.volume_id);
        // (Not answered: the turn lapses.)
        self.shared.runtime.spawn(async move {
            let _ = copy_turn(&shared, node, volume_id, TurnAction::GiveBack).await;
        });
    }
}

/// Asks `node` for, renews or gives back its turn for a whole copy of volume `volume_id`;
/// whether it was granted.
async fn copy_turn(
    shared: &Shared,
    node: NodeId,
    volume_id: u64,
    action: TurnAction,
) -> Result<bool, String> {
    let request = CopyTurnRequest { volume_id, action };
    let payload = postcard::to_allocvec(&request).map_err(|error| error.to_string())?;
    let answer = shared
        .call(node, METHOD_COPY_TURN, payload, TURN_CALL_TIMEOUT)
        .await
        .map_err(|failure| format!("asking node {node} for a turn: {}", failure.message))?;
    let answer: CopyTurnAnswer =
        postcard::from_bytes(&answer).map_err(|error| error.to_string())?;
    Ok(answer.granted)
}

/// Ordering held back by a change under way ([`Primary::pause`]); released when dropped, also
/// when the change's future is dropped half way.
struct Paused<'a> {
    primary: &'a Primary,
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        let mut state = self.primary.state();
        state.paused -= 1;
        drop(state);
        self.primary.changed.notify_waiters();
    }
}

/// A replica's block hashes of a chunk, asked for ahead of their use.
type HashesAsked = tokio::task::JoinHandle<Result<Vec<u8>, String>>;

/// A batch sent, and what its replica answered.
struct Sent {
    stream: u64,
    flush: Option<BatchFlush>,
    /// Its share of the replica's queue.
    bytes: usize,
    outcome: Result<BatchAck, Failure>,
}

/// A failed call to a replica.
pub(crate) struct Failure {
    pub code: Option<u16>,
    pub message: String,
}

/// Client I/O, async: store I/O runs inline (on the client's thread in a server, which blocks
/// on these through [`VolumeIo`]; on the simulation's one thread in `sim/`).
impl Primary {
    pub async fn read_async(&self, offset: u64, buf: &mut [u8]) -> VolumeResult<()> {
        self.client_request().await?;
        self.check_serving(&self.state())?;
        match self.local.read(offset, buf) {
            Err(error) if error.is_corrupt() => self.read_repairing(offset, buf).await,
            other => other,
        }
    }

    pub async fn write_async(&self, offset: u64, data: &[u8], fua: bool) -> VolumeResult<()> {
        // One copy of the data, for this node's store and whichever replicas stream (none,
        // one or two).
        let shared = bytes::Bytes::copy_from_slice(data);
        let written = self
            .ordered(
                (offset, data.len() as u64),
                || Op::Write {
                    offset,
                    data: shared.clone(),
                },
                || self.local.write_shared(offset, &shared, false),
            )
            .await;
        self.shared.wrote();
        written?;
        if fua {
            self.flush_async().await?;
        }
        Ok(())
    }

    pub async fn flush_async(&self) -> VolumeResult<()> {
        let started = self.shared.clock().now();
        self.client_request().await?;
        let upto = self.flush_here().await?;
        self.wait_durable(upto, started).await
    }

    pub async fn trim_async(&self, offset: u64, length: u64) -> VolumeResult<()> {
        self.ordered(
            (offset, length),
            || Op::Trim { offset, length },
            || self.local.trim(offset, length),
        )
        .await
    }

    pub async fn write_zeroes_async(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    ) -> VolumeResult<()> {
        let written = self
            .ordered(
                (offset, length),
                || Op::Zeroes {
                    offset,
                    length,
                    may_trim,
                },
                || self.local.write_zeroes(offset, length, false, may_trim),
            )
            .await;
        self.shared.wrote();
        written?;
        if fua {
            self.flush_async().await?;
        }
        Ok(())
    }
}

/// The blocking form for NBD workers and other threads that may block (never a runtime
/// worker): each call drives its async form to completion on the calling thread.
impl VolumeIo for Primary {
    fn name(&self) -> &str {
        &self.name
    }

    fn size_bytes(&self) -> u64 {
        self.local.size_bytes()
    }

    fn block_size_bytes(&self) -> u32 {
        self.local.block_size_bytes()
    }

    fn read_only(&self) -> bool {
        false
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> VolumeResult<()> {
        self.shared.runtime.block_on(self.read_async(offset, buf))
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> VolumeResult<()> {
        self.shared
            .runtime
            .block_on(self.write_async(offset, data, fua))
    }

    fn flush(&self) -> VolumeResult<()> {
        self.shared.runtime.block_on(self.flush_async())
    }

    fn trim(&self, offset: u64, length: u64) -> VolumeResult<()> {
        self.shared
            .runtime
            .block_on(self.trim_async(offset, length))
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    ) -> VolumeResult<()> {
        self.shared
            .runtime
            .block_on(self.write_zeroes_async(offset, length, fua, may_trim))
    }
}

#[cfg(test)]
mod tests {
    use super::{retry_after, RESYNC_RETRY, RESYNC_RETRY_MAX};
    use std::time::Duration;

    // Proves a replica that keeps refusing is tried further and further apart, never more
    // than RESYNC_RETRY_MAX apart, and that one that does not answer is tried every second.
    #[test]
    fn a_refusing_replica_is_retried_further_apart_and_a_silent_one_every_second() {
        let waits: Vec<u64> = (1..=8).map(|n| retry_after(n, true).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(retry_after(u32::MAX, true), RESYNC_RETRY_MAX);
        for failures in [0, 1, 5, 100] {
            assert_eq!(retry_after(failures, false), RESYNC_RETRY);
        }
        assert_eq!(RESYNC_RETRY, Duration::from_secs(1));
    }
}
