//! A deterministic simulation of replicated volumes: real nodes — real openraft, the real
//! replication engine (`keel-replication`, built with its `simulation` feature: its store work
//! runs inline), real volume engines and real stores — each store on a simulated disk that loses
//! what was not synced when its node loses power, over an in-process network with seeded
//! faults, on simulated time, driven by one seed.
//!
//! One run ([`run`]): three nodes (R=2 on three storage nodes, R=3 on three, or R=2 on two
//! storage nodes and a metadata-only witness, chosen by the seed; with [`Mode::Singles`], R=1
//! or R=2 on three storage nodes; with [`Mode::Fours`], R=3 on four storage nodes) and one
//! volume.
//! Two clients write 4 KiB blocks to their own units of the volume, FLUSH, take snapshots and
//! roll the volume back onto one, each through the node it attached to, as NBD clients and the
//! admin API do; a client whose
//! request fails (or whose node lost power under it) attaches again wherever the volume is
//! served — the same node, or another replica taking the volume over once the primary's lease
//! ran out. Meanwhile, for a number of
//! steps, the seed picks among: a node's power cut (its unsynced writes lost, dropped, kept or
//! torn) and restart, partitions and healing, message loss and delay, a node's disk filling
//! until room comes back, idle time. Then every
//! link heals, every node comes back, and the volume is served until every replica is in sync.
//! With [`Mode::Moves`] the engine also acts on outages of its own: a node down for seconds
//! has its replicas moved and a volume it was primary of taken over in the background; with
//! [`Mode::Deletes`] clients also delete snapshots, with [`Mode::Drains`] they also drain
//! storage nodes and stop draining them, and with [`Mode::Singles`] they also lower R to 1, so
//! that a drain copies the volume's one replica off its node. With [`Mode::Fours`] an R=3
//! volume lives on four storage nodes: its replicas move to the fourth online (R 4 for the
//! move), and a drain copies one there (four replicas at R=3). With [`Mode::Syncs`] a node's
//! disk now and then fails a sync (its store then refuses writes), and the node's process is
//! restarted a few seconds later, as its supervisor does once `keel server` stopped itself.
//! With [`Mode::Forwards`] a third of the clients' attaches are forwarded through a node that
//! is not the primary, as a server forwards a client attached to a node without a replica.
//!
//! What it checks, the contract of `docs/volumes.md`:
//! 1. **No acknowledged FLUSH is lost.** Each client keeps, per unit, the value its last
//!    acknowledged FLUSH covered and the values written since (acknowledged or not). Whatever
//!    a read returns — during the run, after a take-over, and at the end — is one of those.
//! 2. **A primary reads its own writes.** Until a request fails, a read returns exactly what
//!    the client last wrote there (or read back when it attached).
//! 3. **One primary per epoch.** No two nodes acknowledge a FLUSH in the same epoch.
//! 4. **The copies converge.** Once every replica is back in sync and a FLUSH went through,
//!    every node's own copy holds the same bytes as the primary's.
//! 5. **Snapshots cut the same writes everywhere.** Every snapshot acknowledged exists, and
//!    on every replica holding it whole — those in sync when it was taken, and those its
//!    repair copied it to afterwards — it shows exactly what its client's units held then
//!    (and in the other client's units, a value its model allowed then or written meanwhile).
//! 6. **A rollback makes the volume its snapshot again**, for both clients: once it is
//!    acknowledged, a unit holds what the snapshot may hold or a write ordered after it. One
//!    that failed may still have been made: both stay allowed until the next FLUSH.
//!
//! Determinism: as the cluster simulation (a current-thread runtime with paused time and a
//! seeded scheduler, openraft's randomness seeded), plus the engine's store work inline and
//! its stream ids derived, not drawn. The stores' own background threads (index checkpoints,
//! segment preparation) are not the seed's, so a power cut may keep a different torn tail
//! between two runs of one seed; the trace records what the sim saw, and a seed replays.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use keel_catalog::{Command, NodeAddresses, NodeId, NodeRole, VolumeSettings, VolumeStatus};
use keel_cluster::{Cluster, ClusterConfig, ClusterHandler, Dispatch, LocalNetwork, Timing};
use keel_namespace::volume::{BackgroundWork, VolumeError, VolumeIo, VolumeManager, VolumeResult};
use keel_replication::primary::Primary;
use keel_replication::{Forwarded, LocalVolumes, Placement, Replication, Settings};
use keel_store::simdisk::{FaultOp, SimDisk};

/// The space each node's store keeps free: writes that add data are refused below it.
const STORE_RESERVE_BYTES: u64 = 16 << 20;
use keel_store::{Store, StoreConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What one seed did and found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub seed: u64,
    pub mode: Mode,
    /// The volume's replicas, and whether the third node was a witness.
    pub replicas: u8,
    pub witness: bool,
    pub steps: u32,
    pub writes: u64,
    pub flushes: u64,
    pub flushes_failed: u64,
    pub reads_checked: u64,
    /// Attaches that made a node the volume's primary anew (a take-over or a re-attach).
    pub attaches: u64,
    /// Snapshots acknowledged, and the copies of them checked at the end.
    pub snapshots: u64,
    pub snapshot_copies_checked: u64,
    /// Rollbacks acknowledged.
    pub rollbacks: u64,
    /// Changes of R acknowledged (between 2 and 3, on three storage nodes; with
    /// [`Mode::Fours`] between 3 and 4, a replica's move).
    pub replica_changes: u64,
    /// Of those, moves begun (with [`Mode::Fours`]: R 3 -> 4, a replica added on the fourth
    /// node).
    pub moves_begun: u64,
    pub power_cuts: u64,
    pub partitions: u64,
    /// Times a node's disk filled (its store refusing writes that add data) until room came
    /// back.
    pub disks_filled: u64,
    /// Syncs a node's disk failed (with [`Mode::Syncs`] and [`Mode::Fours`]), each followed by
    /// a restart of its process.
    pub syncs_failed: u64,
    /// With [`Mode::Moves`]: how long a node must be down before its replicas move and a
    /// volume whose primary it was is taken over in the background (`move_after`).
    pub move_after_ms: Option<u64>,
    /// Replicas moved off a node gone that long, as Raft recorded them.
    pub replicas_moved: u64,
    /// Snapshots deleted (with [`Mode::Deletes`]: deleting one is what lets a replica holding it
    /// alone move).
    pub snapshots_deleted: u64,
    /// Drains of a storage node begun or ended (with [`Mode::Drains`], [`Mode::Singles`] and
    /// [`Mode::Fours`]).
    pub drains: u64,
    /// Volumes a draining node handed to another replica (with [`Mode::Drains`]).
    pub primaries_handed_off: u64,
    /// Replicas on draining nodes copied to another node before they go (the one replica of
    /// an R=1 volume with [`Mode::Singles`], or any replica of a replicated volume).
    pub copies_off_draining: u64,
    /// Attaches forwarded through a node the catalog did not name primary (with
    /// [`Mode::Forwards`]).
    pub forwarded_attaches: u64,
    /// Hash of everything observable, in order: two runs of a seed must agree on it.
    pub trace_hash: String,
    pub violations: Vec<String>,
}

/// What the engine may do on its own besides serving clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Nodes are never down long enough for the engine to act on it (`move_after` of an hour):
    /// the schedules the seeds that found bugs were found on.
    Standard,
    /// A node is down after 3 s without a report, and `move_after` is 0.5-3 s (drawn from the
    /// seed apart from the schedule's draws): a node down or cut off that long has its
    /// replicas moved to another storage node (R=2 on three) and a volume it was primary of
    /// taken over by the lowest in-sync replica up, in the background, racing the clients' own
    /// attaches.
    Moves,
    /// As [`Mode::Moves`], and clients also delete snapshots (a move held for a snapshot that
    /// a node down alone holds whole waits for that, or for snapshot repair). Its own mode so
    /// that the seeds that found bugs with moves keep their schedules.
    Deletes,
    /// As [`Mode::Deletes`], and clients also drain a storage node or stop draining it
    /// (`keel node drain [--undo]`): a replica on a draining node moves at once, unless its
    /// node alone holds snapshots whole (the move then follows their repair). Every drain
    /// ends before the final check.
    Drains,
    /// As [`Mode::Drains`], and R also goes down to 1 (from 2, on three storage nodes; 1 goes
    /// back to 2): the volume's one replica is served by its primary, and a drain of its node
    /// copies it to another node (`VolumeCopyOffDraining`, R staying 1), hands it to the copy
    /// and removes the old copy, under the same faults. Its clients attach a volume with one
    /// replica as its primary ([`Replication::open_primary`]), as one whose R was lowered
    /// while attached stays served; a server's clients of such a volume use its local copy
    /// (the blocking switch to a primary when R is raised is not simulated).
    Singles,
    /// As [`Mode::Standard`], and a third of the clients' attaches go through a node the
    /// catalog does not name primary, forwarded ([`Replication::open_forwarded`]): from the
    /// node without a replica, or from a replica's (as a pod on a replica's node whose primary
    /// keeps the volume). Such a client only writes, FLUSHes and reads; when the serving node
    /// goes away, its session moves to the new primary without the client noticing if every
    /// write it acknowledged was flushed, else fails and the client attaches again.
    Forwards,
    /// As [`Mode::Drains`], on four storage nodes with an R=3 volume: a change of R moves a
    /// replica as `keel volume move` does (R 3 -> 4 adding the fourth node's, then 4 -> 3,
    /// naming the replica that leaves half the time), and a drain copies a replica to the
    /// node holding none (four replicas while R stays 3) — states three nodes never reach.
    /// Disks fail syncs as with [`Mode::Syncs`].
    Fours,
    /// As [`Mode::Standard`], and a node's disk fails one sync now and then (EIO, after 0-7
    /// more syncs go through): as Linux after a writeback error, the writes that sync covered
    /// never reach the disk while reads still see them, and the store refuses writes from
    /// then on (`KEEL_STORE_POISONED`). 1-6 s later the node's process is restarted, as its
    /// supervisor does once `keel server` stopped itself (within 100 ms; the simulation keeps
    /// the node running longer), its page cache without those writes; its store replays the
    /// log.
    Syncs,
}

/// The volume's name.
const VOLUME: &str = "v";
/// Clients, and units (4 KiB blocks, each in its own 64 KiB stretch) per client.
const CLIENTS: usize = 2;
const UNITS: u64 = 24;
const UNIT_STRIDE_BYTES: u64 = 64 << 10;
const BLOCK_BYTES: usize = 4096;
const VOLUME_BYTES: u64 = 4 << 20;

/// The cluster's timing; with [`Mode::Moves`], a node silent for 3 s is down (rather than
/// 8 s), so the seed's outages of up to 10 s meet `move_after`.
fn timing(mode: Mode) -> Timing {
    Timing {
        raft_heartbeat: Duration::from_millis(50),
        election_timeout_min: Duration::from_millis(300),
        election_timeout_max: Duration::from_millis(600),
        report_interval: Duration::from_millis(100),
        // Past the replication batch timeout (2 s): a cut-off replica is dropped by its
        // primary's failed batch first, not by the failure detector.
        suspect_after: Duration::from_secs(4),
        down_after: match mode {
            Mode::Standard | Mode::Forwards | Mode::Syncs => Duration::from_secs(8),
            Mode::Moves | Mode::Deletes | Mode::Drains | Mode::Singles | Mode::Fours => {
                Duration::from_secs(3)
            }
        },
        propose_timeout: Duration::from_secs(4),
        call_timeout: Duration::from_millis(500),
        membership_interval: Duration::from_millis(150),
        snapshot_every_entries: 200,
    }
}

/// The block a client writes as `value` to `unit` (0 is never written: zeroes).
fn block(client: usize, unit: u64, value: u32) -> Vec<u8> {
    if value == 0 {
        return vec![0u8; BLOCK_BYTES];
    }
    let mut stamp = [0u8; 16];
    stamp[..8].copy_from_slice(&(client as u64).to_le_bytes());
    stamp[8..12].copy_from_slice(&(unit as u32).to_le_bytes());
    stamp[12..].copy_from_slice(&value.to_le_bytes());
    stamp.iter().copied().cycle().take(BLOCK_BYTES).collect()
}

/// The value a block holds, if it is one [`block`] makes for this client and unit.
fn value_of(client: usize, unit: u64, data: &[u8]) -> Option<u32> {
    if data.iter().all(|byte| *byte == 0) {
        return Some(0);
    }
    let value = u32::from_le_bytes([data[12], data[13], data[14], data[15]]);
    (block(client, unit, value) == data).then_some(value)
}

fn offset_of(client: usize, unit: u64) -> u64 {
    (client as u64 * UNITS + unit) * UNIT_STRIDE_BYTES
}

/// One client's knowledge of its units.
#[derive(Clone)]
struct Model {
    /// Per unit: the values its last durable point may hold (0: zeroes). One after an
    /// acknowledged FLUSH through a primary whose contents the client knew; the snapshot's
    /// possible values after a rollback; both sets while a rollback may or may not be made.
    floor: Vec<Vec<u32>>,
    /// Per unit: values written since, acknowledged or not, oldest first: any of them may be
    /// what a later primary holds (a write reaches some replicas and not others).
    since: Vec<Vec<u32>>,
    /// Per unit, what the primary the client is attached to holds: read back when it
    /// attached, then its acknowledged writes. `None` once a request failed, and while a
    /// rollback changes the volume under it.
    current: Option<Vec<u32>>,
    /// Per unit, every value ever written there, oldest first.
    written: Vec<Vec<u32>>,
    /// The last value written (0: none yet). Values only grow.
    issued: u32,
    /// A rollback changed the volume under the client: it attaches again and reads it back.
    reattach: bool,
}

impl Model {
    fn new() -> Model {
        Model {
            floor: vec![vec![0]; UNITS as usize],
            since: vec![Vec::new(); UNITS as usize],
            current: None,
            written: vec![Vec::new(); UNITS as usize],
            issued: 0,
            reattach: false,
        }
    }

    /// What unit `unit` may hold on any primary now.
    fn allowed(&self, unit: u64) -> Vec<u32> {
        let unit = unit as usize;
        let mut allowed = self.floor[unit].clone();
        allowed.extend(&self.since[unit]);
        allowed
    }

    /// What a read of `unit` through the attached primary may return: exactly what it holds
    /// while no request failed, else whatever is allowed.
    fn expected(&self, unit: u64) -> Vec<u32> {
        match &self.current {
            Some(current) => vec![current[unit as usize]],
            None => self.allowed(unit),
        }
    }

    /// A FLUSH was acknowledged: what the primary holds is durable on every replica in sync,
    /// and no value written before can come back.
    fn flushed(&mut self) {
        if let Some(current) = &self.current {
            for (floor, value) in self.floor.iter_mut().zip(current) {
                *floor = vec![*value];
            }
            for since in &mut self.since {
                since.clear();
            }
        }
    }

    /// Client `unit` is about to write `value`.
    fn writing(&mut self, unit: u64, value: u32) {
        let unit = unit as usize;
        // Written or not, it may be found from now on.
        self.since[unit].push(value);
        self.written[unit].push(value);
        self.issued = value;
        if let Some(current) = self.current.as_mut() {
            // (Taken back if it fails: the client attaches again.)
            current[unit] = value;
        }
    }

    /// What a snapshot whose change began when the client's model was `before` may hold
    /// in each unit: what was allowed then, or anything written since.
    fn possible_since(&self, before: &Model) -> Vec<Vec<u32>> {
        (0..UNITS)
            .map(|unit| {
                let mut possible = before.allowed(unit);
                possible.extend(
                    self.written[unit as usize]
                        .iter()
                        .filter(|value| **value > before.issued),
                );
                possible.sort_unstable();
                possible.dedup();
                possible
            })
            .collect()
    }
}

/// A snapshot acknowledged: its name, and per client and unit the values it may hold
/// (exactly one for the client that took it).
#[derive(Clone)]
struct Taken {
    name: String,
    possible: Vec<Vec<Vec<u32>>>,
}

/// What every task of a run shares.
struct World {
    network: LocalNetwork,
    nodes: Vec<Node>,
    trace: blake3::Hasher,
    violations: Vec<String>,
    report: Report,
    /// Per epoch, the node that acknowledged a FLUSH in it.
    flush_epochs: BTreeMap<u64, NodeId>,
    /// Each client's knowledge of its units.
    models: Vec<Model>,
    /// Snapshots acknowledged.
    snapshots: Vec<Taken>,
    /// A snapshot or rollback is being made (one at a time).
    changing: bool,
    /// Snapshot names given so far (one may exist though its creation failed).
    snapshots_named: u64,
    /// The catch-ups' pace (slow ones keep an old primary sending after a take-over).
    resync_bytes_per_second: Option<u64>,
    /// How long a node is down before the engine moves its replicas ([`Mode`]).
    move_after: Duration,
    mode: Mode,
    /// The replica set of the newest epoch seen and the changes of R tried by then, for
    /// counting moves.
    replicas_seen: (u64, Vec<NodeId>, u64),
    /// Changes of R tried (made or not).
    replica_changes_tried: u64,
    /// Nodes down, and when each comes back.
    restarts: Vec<(tokio::time::Instant, usize)>,
    /// When the cut in place heals.
    heal_at: Option<tokio::time::Instant>,
    /// The node whose disk is full, and when it has room again.
    room_at: Option<(tokio::time::Instant, usize)>,
    /// The node whose disk was told to fail a sync, and when its process restarts
    /// ([`Mode::Syncs`], [`Mode::Fours`]).
    restart_at: Option<(tokio::time::Instant, usize)>,
    /// A fault the next client to get a FLUSH acknowledged makes to its primary's node.
    armed: Option<Fault>,
    /// Print every event as it is recorded, with the simulated time (`KEEL_SIM_TRACE=1`).
    print_trace: bool,
    started: tokio::time::Instant,
}

struct Node {
    name: String,
    address: String,
    role: NodeRole,
    dir: PathBuf,
    /// The node's disk as it is now (replaced by its state after a power cut).
    disk: SimDisk,
    clock: Arc<keel_clock::SimClock>,
    live: Option<Live>,
    /// Bumped at every power cut: a client request through an older one never completes.
    incarnation: u64,
}

struct Live {
    cluster: Arc<Cluster>,
    /// `None` on the witness.
    volumes: Option<Arc<VolumeManager>>,
    replication: Option<Arc<Replication>>,
    _dispatch: Arc<Dispatch>,
}

/// The node's own copies of volumes, for the replication engine.
struct Copies {
    volumes: Arc<VolumeManager>,
}

impl LocalVolumes for Copies {
    fn open_local(&self, name: &str) -> VolumeResult<Arc<dyn VolumeIo>> {
        self.volumes.open_volume(name)
    }

    fn open_replica(&self, name: &str) -> VolumeResult<Arc<dyn VolumeIo>> {
        self.volumes.open_replica(name)
    }

    fn open_local_snapshot(&self, volume: &str, snapshot: &str) -> VolumeResult<Arc<dyn VolumeIo>> {
        self.volumes.open_snapshot(volume, snapshot)
    }

    fn open_snapshot_copy(
        &self,
        volume_id: u64,
        generation: u64,
        repair: Option<u64>,
    ) -> VolumeResult<Arc<dyn VolumeIo>> {
        self.volumes
            .open_snapshot_copy(volume_id, generation, repair)
    }

    fn write_snapshot_repair(
        &self,
        volume_id: u64,
        generation: u64,
        repair: u64,
        runs: &[(u64, &[u8])],
    ) -> VolumeResult<()> {
        self.volumes
            .write_snapshot_repair(volume_id, generation, repair, runs)
    }

    fn keep_record(
        &self,
        volume_id: u64,
        name: &[u8],
        value: Vec<u8>,
        sync: bool,
    ) -> VolumeResult<()> {
        self.volumes.keep_copy_record(volume_id, name, value, sync)
    }

    fn record(&self, volume_id: u64, name: &[u8]) -> VolumeResult<Option<Vec<u8>>> {
        self.volumes.copy_record(volume_id, name)
    }

    fn forget_record(&self, volume_id: u64, name: &[u8]) -> VolumeResult<()> {
        self.volumes.forget_copy_record(volume_id, name)
    }

    fn committed_sequence(&self) -> u64 {
        self.volumes.store().committed_sequence()
    }

    fn space_low(&self) -> bool {
        self.volumes.store().space_low().unwrap_or(false)
    }

    fn changed_since(
        &self,
        name: &str,
        volume_id: u64,
        since: u64,
        changed: &mut dyn FnMut(u64, u64),
    ) -> VolumeResult<()> {
        self.volumes.changed_since(name, volume_id, since, changed)
    }
}

type Shared = Rc<RefCell<World>>;

/// What a client attaches through on a node.
struct Engine {
    replication: Arc<Replication>,
    cluster: Arc<Cluster>,
    volumes: Arc<VolumeManager>,
    incarnation: u64,
}

impl World {
    fn record(&mut self, event: &str) {
        self.trace.update(event.as_bytes());
        self.trace.update(b"\n");
        if self.print_trace {
            let at = tokio::time::Instant::now().saturating_duration_since(self.started);
            eprintln!("[{:>9.3} s] {event}", at.as_secs_f64());
        }
    }

    fn violation(&mut self, what: String) {
        self.record(&format!("violation {what}"));
        self.violations.push(what);
    }

    fn ids(&self) -> Vec<NodeId> {
        (1..=self.nodes.len() as u64).collect()
    }

    /// The replication engine of node `index`, if it is up and holds volumes.
    fn engine(&self, index: usize) -> Option<Engine> {
        let node = &self.nodes[index];
        let live = node.live.as_ref()?;
        Some(Engine {
            replication: live.replication.clone()?,
            cluster: live.cluster.clone(),
            volumes: live.volumes.clone()?,
            incarnation: node.incarnation,
        })
    }

    /// Counts a move when the newest epoch any node shows has another replica set of the
    /// same size than the newest seen before, with no change of R tried in between (a raise
    /// and a lowering can leave another set of the same size).
    fn count_moves(&mut self) {
        let newest = (0..self.nodes.len())
            .filter_map(|index| self.replication_seen(index))
            .max_by_key(|replication| replication.epoch);
        let Some(newest) = newest else {
            return;
        };
        let (epoch, replicas, tried) = &self.replicas_seen;
        if newest.epoch <= *epoch {
            return;
        }
        let mut now = newest.replicas.clone();
        now.sort_unstable();
        if !replicas.is_empty()
            && replicas.len() == now.len()
            && *replicas != now
            && *tried == self.replica_changes_tried
        {
            self.report.replicas_moved += 1;
            self.record(&format!("replicas moved to {now:?}"));
        }
        self.replicas_seen = (newest.epoch, now, self.replica_changes_tried);
    }

    /// The volume's replication as node `index` sees it.
    fn replication_seen(&self, index: usize) -> Option<keel_catalog::Replication> {
        let live = self.nodes[index].live.as_ref()?;
        let catalog = live.cluster.catalog().read();
        Some(catalog.volume(VOLUME)?.record.replication.clone())
    }
}

fn start_node(world: &Shared, index: usize, join: Option<String>) -> StartNode {
    let (name, address, role, dir, disk, clock, nodes) = {
        let world = world.borrow();
        let node = &world.nodes[index];
        (
            node.name.clone(),
            node.address.clone(),
            node.role,
            node.dir.clone(),
            node.disk.clone(),
            node.clock.clone(),
            // Three voters, as Keel keeps on four nodes (an odd number).
            world.nodes.len().min(3),
        )
    };
    StartNode {
        name,
        address,
        role,
        dir,
        disk,
        clock,
        join,
        voters: nodes,
        resync_bytes_per_second: world.borrow().resync_bytes_per_second,
        move_after: world.borrow().move_after,
        mode: world.borrow().mode,
    }
}

/// What a node starts from (taken out of the world, which is not held across the start).
struct StartNode {
    name: String,
    address: String,
    role: NodeRole,
    dir: PathBuf,
    disk: SimDisk,
    clock: Arc<keel_clock::SimClock>,
    join: Option<String>,
    voters: usize,
    resync_bytes_per_second: Option<u64>,
    move_after: Duration,
    mode: Mode,
}

impl StartNode {
    async fn start(self, network: &LocalNetwork) -> Result<Live, String> {
        let mut config = StoreConfig::new(vec![self.dir.clone()]);
        config.disk = Arc::new(self.disk);
        // Small segments: a simulated disk holds them in memory.
        config.segment_size_max_bytes = 8 << 20;
        config.reserve_bytes = STORE_RESERVE_BYTES;
        config.clock = self.clock.clone();
        // No thread racing the seed's schedule.
        config.prepare_segments = false;
        let store =
            Store::open(config).map_err(|error| format!("opening {}: {error}", self.name))?;
        let handler = ClusterHandler::new();
        let dispatch = Dispatch::new(handler.clone());
        let weak: std::sync::Weak<dyn keel_cluster::Handler> =
            Arc::downgrade(&(dispatch.clone() as Arc<dyn keel_cluster::Handler>));
        network.listen(&self.address, weak);
        let from = handler.clone();
        let transport: Arc<dyn keel_cluster::Transport> =
            Arc::new(network.transport(&self.address, Arc::new(move || from.current_node_id())));
        let clock: Arc<dyn keel_clock::Clock> = self.clock;
        let config = ClusterConfig {
            name: self.name.clone(),
            role: self.role,
            addresses: NodeAddresses {
                cluster: self.address.clone(),
                ..NodeAddresses::default()
            },
            labels: BTreeMap::new(),
            devices: Vec::new(),
            join: self.join,
            cluster_id: Some([9; 16]),
            voters: self.voters,
            timing: timing(self.mode),
            clock,
        };
        let cluster = Cluster::start(store.clone(), config, transport.clone(), &handler)
            .await
            .map_err(|error| format!("starting {}: {error}", self.name))?;
        if self.role == NodeRole::Witness {
            return Ok(Live {
                cluster,
                volumes: None,
                replication: None,
                _dispatch: dispatch,
            });
        }
        let metadata: Arc<dyn keel_catalog::Metadata> = cluster.clone();
        let volumes = Arc::new(
            // Erasing and garbage collection run at the steps' own points (no worker thread).
            VolumeManager::open_with(store, metadata, BackgroundWork::Caller)
                .map_err(|error| format!("opening {}'s volumes: {error}", self.name))?,
        );
        let replication = Replication::new(
            cluster.clone(),
            transport,
            Arc::new(Copies {
                volumes: volumes.clone(),
            }),
            tokio::runtime::Handle::current(),
            Settings {
                move_after: self.move_after,
                resync_bytes_per_second: self.resync_bytes_per_second,
                resync_busy_percent: 100,
                rebuilds_max: 2,
                snapshot_repair: true,
                point_every: keel_replication::POINT_EVERY,
            },
            keel_ops::Ops::disabled(),
        );
        dispatch.set_above(replication.clone());
        Ok(Live {
            cluster,
            volumes: Some(volumes),
            replication: Some(replication),
            _dispatch: dispatch,
        })
    }
}

async fn bring_up(world: &Shared, index: usize, join: Option<String>) -> Result<(), String> {
    let network = world.borrow().network.clone();
    let live = start_node(world, index, join).start(&network).await?;
    world.borrow_mut().nodes[index].live = Some(live);
    Ok(())
}

/// Node `index` loses power: nothing it does reaches anyone any more, and its disk comes back
/// with only what it synced (each unsynced write dropped, kept or torn).
async fn power_cut(world: &Shared, index: usize) {
    // A sync failure still to come ([`Mode::Syncs`]) is the old process's: gone with it.
    world.borrow().nodes[index].disk.clear_faults();
    stop(world, index, SimDisk::power_cut).await;
}

/// Restarts node `index`'s process without a power cut, its disk as the page cache held it
/// (without the writes a failed sync never wrote back: [`SimDisk::process_restart`]) and its
/// pending faults cleared; the syncs its disk failed since its process started are counted
/// (each start is a new disk: [`SimDisk::process_restart`]). Its supervisor's restart once
/// `keel server` stopped itself on `KEEL_STORE_POISONED` ([`Mode::Syncs`], [`Mode::Fours`]);
/// a node down already stays down (its restart is scheduled).
async fn restart_process(world: &Shared, index: usize) {
    {
        let mut world = world.borrow_mut();
        let disk = &world.nodes[index].disk;
        disk.clear_faults();
        let failed = (disk.fired().into_iter())
            .filter(|(op, _)| *op == FaultOp::Sync)
            .count();
        world.report.syncs_failed += failed as u64;
    }
    if world.borrow().nodes[index].live.is_some() {
        stop(world, index, SimDisk::process_restart).await;
        if let Err(error) = bring_up(world, index, None).await {
            world.borrow_mut().violation(format!("restart: {error}"));
        }
    }
}

/// Stops node `index` (its links closed, its Raft and engine shut down), its disk replaced
/// by what `successor` makes of it.
async fn stop(world: &Shared, index: usize, successor: fn(&SimDisk) -> SimDisk) {
    let live = {
        let mut world = world.borrow_mut();
        let address = world.nodes[index].address.clone();
        world.network.close(&address);
        let node = &mut world.nodes[index];
        node.incarnation += 1;
        node.disk = successor(&node.disk);
        node.live.take()
    };
    if let Some(live) = live {
        if let Some(replication) = &live.replication {
            let mut world = world.borrow_mut();
            world.report.primaries_handed_off += replication.counters().handed_off();
            world.report.copies_off_draining += replication.counters().copied_off();
        }
        // Stops its Raft and, through it, its engine's tasks (they write to the old disk,
        // which nothing reads any more).
        live.cluster.shutdown().await;
    }
}

/// Each live node's volume background work queued so far (erasing copies it no longer
/// hosts, collecting garbage), at this point of the schedule.
fn run_background_work(world: &Shared) {
    let managers: Vec<Arc<VolumeManager>> = (world.borrow().nodes.iter())
        .filter_map(|node| node.live.as_ref()?.volumes.clone())
        .collect();
    for volumes in managers {
        volumes.run_background_work();
    }
}

/// What happens to a node.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// It loses power and comes back within 10 s.
    PowerCut,
    /// Its links to every other node are cut, and heal within 8 s.
    Isolate,
}

/// Makes `fault` happen to node `index` now, and schedules its end.
async fn fail_node(world: &Shared, index: usize, fault: Fault, rng: &mut StdRng) {
    let now = tokio::time::Instant::now();
    match fault {
        Fault::PowerCut => {
            world.borrow_mut().report.power_cuts += 1;
            power_cut(world, index).await;
            let back = now + Duration::from_millis(rng.gen_range(500..10_000));
            world.borrow_mut().restarts.push((back, index));
        }
        Fault::Isolate => {
            let mut world = world.borrow_mut();
            let ids = world.ids();
            world.report.partitions += 1;
            world.network.partition(&[index as u64 + 1], &ids);
            world.heal_at = Some(now + Duration::from_millis(rng.gen_range(200..8_000)));
        }
    }
}

/// The outcome of a client request.
enum Answer<T> {
    Done(T),
    Failed(VolumeError),
    /// The node lost power with the request in flight: it may or may not have been done.
    Cut,
}

impl World {
    /// Records how request `what` ended; true if it failed or was cut (the client then
    /// attaches again).
    fn settled<T>(&mut self, what: &str, answer: &Answer<T>) -> bool {
        match answer {
            Answer::Done(_) => {
                self.record(&format!("{what} ok"));
                false
            }
            Answer::Failed(error) => {
                self.record(&format!("{what} failed: {error}"));
                true
            }
            Answer::Cut => {
                self.record(&format!("{what} cut"));
                true
            }
        }
    }
}

/// Runs `request` through the primary `primary` of node `index` (incarnation `incarnation`),
/// unless the node loses power first.
async fn through<T>(
    world: &Shared,
    index: usize,
    incarnation: u64,
    request: impl std::future::Future<Output = VolumeResult<T>>,
) -> Answer<T> {
    tokio::pin!(request);
    loop {
        if world.borrow().nodes[index].incarnation != incarnation {
            return Answer::Cut;
        }
        tokio::select! {
            answer = &mut request => {
                // Answered after a power cut: nothing reached the client.
                if world.borrow().nodes[index].incarnation != incarnation {
                    return Answer::Cut;
                }
                return match answer {
                    Ok(value) => Answer::Done(value),
                    Err(error) => Answer::Failed(error),
                };
            }
            _ = tokio::time::sleep(Duration::from_millis(5)) => {}
        }
    }
}

/// A client attached to the volume through one node.
#[derive(Clone)]
struct Attached {
    index: usize,
    incarnation: u64,
    primary: Arc<Primary>,
    /// The node's cluster, volumes and replication engine (a snapshot or rollback is
    /// proposed through them).
    cluster: Arc<Cluster>,
    replication: Arc<Replication>,
    volumes: Arc<VolumeManager>,
}

/// How a client reaches the volume: the primary on the node it attached to, or a forwarding
/// session from that node to the node serving the volume ([`Mode::Forwards`]).
enum Session {
    Direct(Attached),
    Forwarded {
        index: usize,
        incarnation: u64,
        io: Arc<Forwarded>,
    },
}

impl Session {
    /// The node the client attached to, and that node's incarnation then.
    fn node(&self) -> (usize, u64) {
        match self {
            Session::Direct(attached) => (attached.index, attached.incarnation),
            Session::Forwarded {
                index, incarnation, ..
            } => (*index, *incarnation),
        }
    }

    async fn read(&self, offset: u64, buf: &mut [u8]) -> VolumeResult<()> {
        match self {
            Session::Direct(attached) => attached.primary.read_async(offset, buf).await,
            Session::Forwarded { io, .. } => io.read_async(offset, buf).await,
        }
    }

    async fn write(&self, offset: u64, data: &[u8]) -> VolumeResult<()> {
        match self {
            Session::Direct(attached) => attached.primary.write_async(offset, data, false).await,
            Session::Forwarded { io, .. } => io.write_async(offset, data, false).await,
        }
    }

    async fn flush(&self) -> VolumeResult<()> {
        match self {
            Session::Direct(attached) => attached.primary.flush_async().await,
            Session::Forwarded { io, .. } => io.flush_async().await,
        }
    }

    /// How a record names the node: "n2", or "n2 forwarded".
    fn name(&self) -> String {
        match self {
            Session::Direct(attached) => format!("n{}", attached.index + 1),
            Session::Forwarded { index, .. } => format!("n{} forwarded", index + 1),
        }
    }
}

/// With [`Mode::Forwards`], a third of the time: attaches forwarded through a node the
/// catalog (as the first node that has one sees it) does not name primary, until `limit`.
/// `None` to attach directly instead.
async fn attach_forwarded(world: &Shared, rng: &mut StdRng, limit: Duration) -> Option<Session> {
    if world.borrow().mode != Mode::Forwards || !rng.gen_bool(1.0 / 3.0) {
        return None;
    }
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        let found = {
            let world = world.borrow();
            let count = world.nodes.len();
            let primary = (0..count)
                .find_map(|index| world.replication_seen(index))
                .map(|replication| replication.primary);
            let start = rng.gen_range(0..count);
            (0..count)
                .map(|k| (start + k) % count)
                .filter(|index| Some(*index as u64 + 1) != primary)
                .find_map(|index| world.engine(index).map(|engine| (index, engine)))
        };
        let Some((index, engine)) = found else {
            tokio::time::sleep(Duration::from_millis(250)).await;
            continue;
        };
        let opened = through(
            world,
            index,
            engine.incarnation,
            engine.replication.open_forwarded(VOLUME),
        )
        .await;
        match opened {
            Answer::Done(io) => {
                let mut world = world.borrow_mut();
                world.report.forwarded_attaches += 1;
                world.record(&format!("attach n{} forwarded", index + 1));
                return Some(Session::Forwarded {
                    index,
                    incarnation: engine.incarnation,
                    io,
                });
            }
            _ => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
    None
}

/// Attaches through a node holding a replica that serves the volume or may take it over,
/// retrying (a take-over waits out the old primary's lease) until `limit`.
async fn attach(world: &Shared, rng: &mut StdRng, limit: Duration) -> Option<Attached> {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        // Now and then the client asks the node for the volume first, as a server's client
        // attaching to a replica's node does (`Replication::open`): a live primary hands it
        // over, here even while the other client uses it there (it holds the primary itself,
        // not an attached handle the primary would count), which then attaches again. Those
        // tries go to the nodes from a random start; the others to the node the catalog names
        // primary first.
        let ask = rng.gen_bool(0.25);
        let candidates: Vec<usize> = {
            let world = world.borrow();
            let count = world.nodes.len();
            let start = rng.gen_range(0..count);
            let named = (0..count)
                .find_map(|index| world.replication_seen(index))
                .map(|replication| replication.primary);
            let mut order: Vec<usize> = (0..count).map(|k| (start + k) % count).collect();
            if let Some(named) = named.filter(|_| !ask) {
                order.sort_by_key(|index| (*index as u64 + 1) != named);
            }
            order
        };
        for index in candidates {
            let Some(engine) = world.borrow().engine(index) else {
                continue;
            };
            let incarnation = engine.incarnation;
            if ask {
                let asked = through(
                    world,
                    index,
                    incarnation,
                    engine.replication.ask_for_volume(VOLUME),
                )
                .await;
                if let Answer::Done(Some(_)) = asked {
                    // Kept, or this replica is not in sync: a server would forward.
                    continue;
                }
            }
            let opened = through(
                world,
                index,
                incarnation,
                engine.replication.open_primary(VOLUME),
            )
            .await;
            if let Answer::Done(primary) = opened {
                let mut world = world.borrow_mut();
                world.report.attaches += 1;
                world.record(&format!("attach n{}", index + 1));
                return Some(Attached {
                    index,
                    incarnation,
                    primary,
                    cluster: engine.cluster,
                    replication: engine.replication,
                    volumes: engine.volumes,
                });
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    None
}

/// Whether `found`, read from client `client`'s unit `unit`, is what the client's model
/// expected ([`Model::expected`]) when the read began (`before`) or when it ended: a rollback
/// may have changed the volume in between. Records a violation if not.
fn check_read(
    world: &mut World,
    client: usize,
    unit: u64,
    found: Option<u32>,
    before: &[u32],
    what: impl FnOnce() -> String,
) {
    world.report.reads_checked += 1;
    let mut expected = before.to_vec();
    expected.extend(world.models[client].expected(unit));
    if !found.is_some_and(|value| expected.contains(&value)) {
        let floor = &world.models[client].floor[unit as usize];
        let what = format!(
            "{}: client {client} unit {unit} holds {found:?}, not one of {expected:?} (its last \
             durable point held one of {floor:?})",
            what()
        );
        world.violation(what);
    }
}

/// Reads every unit of client `client` through `attached` (`None` if a read failed) and
/// checks each against the client's model.
async fn read_units(
    world: &Shared,
    client: usize,
    session: &Session,
    when: &str,
) -> Option<Vec<u32>> {
    let mut values = Vec::new();
    let (index, incarnation) = session.node();
    for unit in 0..UNITS {
        let mut data = vec![0u8; BLOCK_BYTES];
        let before = world.borrow().models[client].expected(unit);
        let read = through(
            world,
            index,
            incarnation,
            session.read(offset_of(client, unit), &mut data),
        )
        .await;
        if !matches!(read, Answer::Done(())) {
            return None;
        }
        let found = value_of(client, unit, &data);
        let node = session.name();
        check_read(
            &mut world.borrow_mut(),
            client,
            unit,
            found,
            &before,
            || format!("{when}: read through {node}"),
        );
        values.push(found.unwrap_or(0));
    }
    Some(values)
}

/// One client: writes and FLUSHes through the node it attached to; on any failure, or once a
/// rollback changed the volume, attaches again and checks what it finds. Its model is
/// `world.models[client]`.
async fn client(world: Shared, client: usize, seed: u64, stop: Rc<RefCell<bool>>) {
    let mut rng = StdRng::seed_from_u64(seed ^ (0xc11e_0000 + client as u64));
    let mut next_value = 1u32;
    let mut attached: Option<Session> = None;
    while !*stop.borrow() {
        {
            let mut world = world.borrow_mut();
            let changing = world.changing;
            let model = &mut world.models[client];
            if model.reattach && !changing {
                model.reattach = false;
                model.current = None;
                attached = None;
            }
        }
        let Some(current) = attached.as_ref() else {
            let new = match attach_forwarded(&world, &mut rng, Duration::from_secs(30)).await {
                Some(forwarded) => Some(forwarded),
                None => {
                    (attach(&world, &mut rng, Duration::from_secs(30)).await).map(Session::Direct)
                }
            };
            match new {
                Some(new) => {
                    // What survived is one of the values the model allows per unit; from now
                    // on it is what this primary holds (the next FLUSH makes it the floor).
                    world.borrow_mut().models[client].current = None;
                    let Some(found) = read_units(&world, client, &new, "after attaching").await
                    else {
                        continue;
                    };
                    let mut world = world.borrow_mut();
                    // (Not while a rollback may change it: read back again after.)
                    if !world.changing {
                        world.models[client].current = Some(found);
                    }
                    attached = Some(new);
                }
                None => {
                    world
                        .borrow_mut()
                        .record(&format!("client {client} found no node to attach to"));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
            continue;
        };
        let (index, incarnation) = current.node();
        let roll = rng.gen_range(0..100);
        let failed = if roll < 55 {
            let unit = rng.gen_range(0..UNITS);
            let value = next_value;
            next_value += 1;
            let data = block(client, unit, value);
            world.borrow_mut().models[client].writing(unit, value);
            let answer = through(
                &world,
                index,
                incarnation,
                current.write(offset_of(client, unit), &data),
            )
            .await;
            let mut world = world.borrow_mut();
            world.report.writes += 1;
            world.settled(&format!("c{client} write {unit}={value}"), &answer)
        } else if roll < 85 {
            let answer = through(&world, index, incarnation, current.flush()).await;
            let (failed, armed) = {
                let mut world = world.borrow_mut();
                match answer {
                    Answer::Done(()) => {
                        world.report.flushes += 1;
                        // (A forwarded FLUSH was acknowledged by a primary elsewhere.)
                        if let Session::Direct(attached) = current {
                            let epoch = attached.primary.status().epoch;
                            let node = index as u64 + 1;
                            match world.flush_epochs.get(&epoch).copied() {
                                Some(other) if other != node => world.violation(format!(
                                    "n{node} and n{other} both acknowledged a FLUSH in epoch \
                                     {epoch}"
                                )),
                                _ => {
                                    world.flush_epochs.insert(epoch, node);
                                }
                            }
                            world.record(&format!("c{client} flush ok (epoch {epoch})"));
                        } else {
                            world.record(&format!("c{client} flush ok ({})", current.name()));
                        }
                        world.models[client].flushed();
                        (false, world.armed.take())
                    }
                    Answer::Failed(error) => {
                        world.report.flushes_failed += 1;
                        world.record(&format!("c{client} flush failed: {error}"));
                        (true, None)
                    }
                    Answer::Cut => {
                        world.report.flushes_failed += 1;
                        world.record(&format!("c{client} flush cut"));
                        (true, None)
                    }
                }
            };
            if let Some(fault) = armed {
                world
                    .borrow_mut()
                    .record(&format!("{fault:?} n{} right after that FLUSH", index + 1));
                fail_node(&world, index, fault, &mut rng).await;
            }
            failed
        } else if roll < 95 {
            let unit = rng.gen_range(0..UNITS);
            let mut data = vec![0u8; BLOCK_BYTES];
            let before = world.borrow().models[client].expected(unit);
            let answer = through(
                &world,
                index,
                incarnation,
                current.read(offset_of(client, unit), &mut data),
            )
            .await;
            match answer {
                Answer::Done(()) => {
                    let found = value_of(client, unit, &data);
                    check_read(
                        &mut world.borrow_mut(),
                        client,
                        unit,
                        found,
                        &before,
                        || format!("read through {}", current.name()),
                    );
                    false
                }
                _ => true,
            }
        } else if let Session::Direct(current) = current {
            if roll < 97 {
                snapshot(&world, client, current).await
            } else if roll < 98 {
                rollback(&world, client, current, &mut rng).await
            } else if roll < 99 {
                change_replicas(&world, client, current, &mut rng).await
            } else if matches!(
                world.borrow().mode,
                Mode::Deletes | Mode::Drains | Mode::Singles | Mode::Fours
            ) && rng.gen_bool(0.5)
            {
                delete_snapshot(&world, client, current, &mut rng).await
            } else if matches!(
                world.borrow().mode,
                Mode::Drains | Mode::Singles | Mode::Fours
            ) && rng.gen_bool(0.5)
            {
                drain(&world, client, current, &mut rng).await
            } else {
                tokio::time::sleep(Duration::from_millis(rng.gen_range(0..300))).await;
                false
            }
        } else {
            // Snapshots, rollbacks and changes of R go through the primary's admin API, not
            // a forwarded session.
            tokio::time::sleep(Duration::from_millis(rng.gen_range(0..300))).await;
            false
        };
        if failed {
            world.borrow_mut().models[client].current = None;
            attached = None;
            // A moment before attaching again, as a client reconnects.
            tokio::time::sleep(Duration::from_millis(rng.gen_range(50..500))).await;
        } else {
            tokio::time::sleep(Duration::from_millis(rng.gen_range(0..20))).await;
        }
    }
}

/// Takes a snapshot through the primary `attached`, as the admin API does: at one point of
/// the volume's write stream on every replica (the change runs once every replica applied
/// the writes before it). It must show exactly what this client's units held then, and in
/// the other client's units one of the values its model allowed then or wrote meanwhile.
/// True if it failed (the client then attaches again). Nothing while another change runs.
async fn snapshot(world: &Shared, client: usize, attached: &Attached) -> bool {
    let (name, before) = {
        let mut world = world.borrow_mut();
        if world.changing {
            return false;
        }
        if world.models[client].current.is_none() {
            return true;
        }
        world.changing = true;
        world.snapshots_named += 1;
        (format!("s{}", world.snapshots_named), world.models.clone())
    };
    let cluster = attached.cluster.clone();
    let volumes = attached.volumes.clone();
    let command = Command::SnapshotCreate {
        volume: VOLUME.to_string(),
        snapshot: name.clone(),
        guid: *blake3::hash(name.as_bytes())
            .as_bytes()
            .first_chunk()
            .unwrap_or(&[0; 16]),
        created_unix_seconds: 1,
    };
    let change = async move {
        cluster
            .propose_async(command)
            .await
            .map_err(|error| VolumeError::Metadata {
                detail: error.to_string(),
            })?;
        // As VolumeManager::snapshot_create: every write before it is durable here first.
        volumes
            .store()
            .flush()
            .map_err(VolumeError::store(VOLUME, "flushing before a snapshot"))
    };
    let answer = through(
        world,
        attached.index,
        attached.incarnation,
        attached.primary.quiesce_async(change),
    )
    .await;
    let mut world = world.borrow_mut();
    world.changing = false;
    let failed = world.settled(&format!("c{client} snapshot {name}"), &answer);
    if !failed {
        world.report.snapshots += 1;
        let possible = (0..CLIENTS)
            .map(|other| match &before[other].current {
                Some(values) if other == client => {
                    values.iter().map(|value| vec![*value]).collect()
                }
                _ => world.models[other].possible_since(&before[other]),
            })
            .collect();
        world.snapshots.push(Taken { name, possible });
    }
    failed
}

/// Deletes an acknowledged snapshot through the node `attached`, as the admin API does (a
/// proposal; no quiesce). It leaves the snapshots checked at the end whether or not it was
/// made (one that failed may still be). True if it failed. Nothing while a snapshot or
/// rollback is being made.
async fn delete_snapshot(
    world: &Shared,
    client: usize,
    attached: &Attached,
    rng: &mut StdRng,
) -> bool {
    let name = {
        let mut world = world.borrow_mut();
        if world.changing || world.snapshots.is_empty() {
            return false;
        }
        let at = rng.gen_range(0..world.snapshots.len());
        world.snapshots.remove(at).name
    };
    world
        .borrow_mut()
        .record(&format!("c{client} delete snapshot {name}"));
    let command = Command::SnapshotDelete {
        volume: VOLUME.to_string(),
        snapshot: name.clone(),
    };
    let cluster = attached.cluster.clone();
    let answer = through(world, attached.index, attached.incarnation, async move {
        cluster
            .propose_async(command)
            .await
            .map(drop)
            .map_err(|error| VolumeError::Metadata {
                detail: error.to_string(),
            })
    })
    .await;
    let mut world = world.borrow_mut();
    let failed = world.settled(&format!("c{client} delete snapshot {name}"), &answer);
    if !failed {
        world.report.snapshots_deleted += 1;
    }
    failed
}

/// Drains a storage node, or stops draining one that is, through the node `attached`, as
/// `keel node drain [--undo]` does (a proposal). True if it failed.
async fn drain(world: &Shared, client: usize, attached: &Attached, rng: &mut StdRng) -> bool {
    let (node, draining) = {
        let world = world.borrow();
        let storage = if world.report.witness {
            2
        } else {
            world.nodes.len() as u64
        };
        let node = rng.gen_range(1..=storage);
        let draining = !attached
            .cluster
            .catalog()
            .read()
            .nodes
            .get(&node)
            .is_some_and(|record| record.draining);
        (node, draining)
    };
    let what = format!(
        "c{client} {} n{node}",
        if draining { "drain" } else { "undrain" }
    );
    world.borrow_mut().record(&what);
    let cluster = attached.cluster.clone();
    let answer = through(world, attached.index, attached.incarnation, async move {
        cluster
            .drain(node, draining)
            .await
            .map_err(|error| VolumeError::Metadata {
                detail: error.to_string(),
            })
    })
    .await;
    let mut world = world.borrow_mut();
    let failed = world.settled(&what, &answer);
    if !failed {
        world.report.drains += 1;
    }
    failed
}

/// Ends every drain (the clients have stopped, every node is up and every link healed), as an
/// operator would after maintenance: the final check then compares replicas that stay put.
/// Done once every node's catalog lists none draining at one applied index (a node whose
/// catalog lags may not show a drain yet: seed 1660 with drains).
async fn end_drains(world: &Shared) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while tokio::time::Instant::now() < deadline {
        let (clusters, draining, agreed) = {
            let world = world.borrow();
            let clusters: Vec<Arc<Cluster>> = (world.nodes.iter())
                .filter_map(|node| node.live.as_ref().map(|live| live.cluster.clone()))
                .collect();
            let mut draining = std::collections::BTreeSet::new();
            let mut indexes = std::collections::BTreeSet::new();
            for cluster in &clusters {
                indexes.insert(cluster.applied_index());
                let catalog = cluster.catalog().read();
                draining.extend(
                    (catalog.nodes.values())
                        .filter(|record| record.draining)
                        .map(|record| record.id),
                );
            }
            (clusters, draining, indexes.len() == 1)
        };
        let Some(node) = draining.first().copied() else {
            if agreed {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Some(cluster) = clusters.first() else {
            return;
        };
        world.borrow_mut().record(&format!("undrain n{node}"));
        if let Err(error) = cluster.drain(node, false).await {
            world
                .borrow_mut()
                .record(&format!("undrain n{node} failed: {error}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    world
        .borrow_mut()
        .violation("a drain could not be ended within 60 s of healing".to_string());
}

/// Rolls the volume back onto an acknowledged snapshot through the primary `attached`, as the
/// admin API does ([`Replication::rollback_async`]: replicas whose copy of the snapshot is
/// incomplete are dropped first and caught up after). From its start every client reads
/// what its model allowed or what the snapshot may hold, and attaches again once it is done;
/// after it, only what the snapshot may hold or was written meanwhile. One that failed may
/// still have been made: both stay allowed. True if it failed. Nothing while another change
/// runs.
async fn rollback(world: &Shared, client: usize, attached: &Attached, rng: &mut StdRng) -> bool {
    let (target, cut) = {
        let mut world = world.borrow_mut();
        if world.changing || world.snapshots.is_empty() {
            return false;
        }
        let target = world.snapshots[rng.gen_range(0..world.snapshots.len())].clone();
        world.changing = true;
        world.record(&format!("c{client} rollback onto {}", target.name));
        let mut cut = Vec::new();
        for (model, possible) in world.models.iter_mut().zip(&target.possible) {
            model.current = None;
            for (floor, possible) in model.floor.iter_mut().zip(possible) {
                floor.extend(possible);
                floor.sort_unstable();
                floor.dedup();
            }
            cut.push(model.issued);
        }
        (target, cut)
    };
    let cluster = attached.cluster.clone();
    let command = Command::VolumeRollback {
        volume: VOLUME.to_string(),
        snapshot: target.name.clone(),
    };
    let change = async move {
        cluster
            .propose_async(command)
            .await
            .map(drop)
            .map_err(|error| VolumeError::Metadata {
                detail: error.to_string(),
            })
    };
    let answer = through(
        world,
        attached.index,
        attached.incarnation,
        attached
            .replication
            .rollback_async(VOLUME, &target.name, change),
    )
    .await;
    let mut world = world.borrow_mut();
    world.changing = false;
    for model in &mut world.models {
        model.current = None;
        model.reattach = true;
    }
    let failed = world.settled(&format!("c{client} rollback onto {}", target.name), &answer);
    if !failed {
        world.report.rollbacks += 1;
        // Only the snapshot's values, and writes that may have come after the change (the
        // one in flight when it began, and later ones).
        for ((model, possible), cut) in world.models.iter_mut().zip(&target.possible).zip(cut) {
            model.floor.clone_from(possible);
            for since in &mut model.since {
                since.retain(|value| *value >= cut);
            }
        }
    }
    failed
}

/// Raises R from 2 to 3 or lowers it from 3 to 2 through the primary `attached`, as the
/// admin API does ([`Replication::set_replicas_async`]), at any moment: during another
/// client's snapshot or rollback too; with [`Mode::Singles`], R 2 goes to 1 or 3 (half each)
/// and R 1 back to 2; with [`Mode::Fours`], a replica moves (R 3 -> 4 -> 3). The contents stay what they were: the checks at the end cover the
/// replicas it added (caught up, copies converged, snapshots repaired onto them). Nothing on
/// a run with a witness (two storage nodes). True if it failed.
async fn change_replicas(
    world: &Shared,
    client: usize,
    attached: &Attached,
    rng: &mut StdRng,
) -> bool {
    let (wanted, placement) = {
        let world = world.borrow();
        if world.report.witness {
            return false;
        }
        let singles = world.mode == Mode::Singles;
        let fours = world.mode == Mode::Fours;
        match world.replication_seen(attached.index) {
            // A move's steps (`keel volume move`): R 3 -> 4 with the replica added on the
            // node holding none, then 4 -> 3 (or a drain's copy removed: four replicas at
            // R=3), naming the replica that leaves half the time, in or out of sync.
            Some(replication) if fours && replication.replicas.len() >= 4 => {
                (3u8, leaving_named(&replication, rng))
            }
            Some(replication) if fours => {
                let placement = Placement {
                    add_to: (1..=world.nodes.len() as NodeId)
                        .find(|node| !replication.replicas.contains(node)),
                    ..Placement::default()
                };
                (4, placement)
            }
            Some(replication) if replication.replicas.len() == 3 => {
                (2, leaving_named(&replication, rng))
            }
            Some(replication) if singles && replication.factor == 1 => (2, Placement::default()),
            // Drawn in this mode alone: the other modes' seeds keep their schedules.
            Some(_) if singles && rng.gen_bool(0.5) => (1, Placement::default()),
            Some(_) => (3, Placement::default()),
            None => return false,
        }
    };
    {
        let mut world = world.borrow_mut();
        world.replica_changes_tried += 1;
        let named = (placement.remove_from)
            .map(|node| format!(" without n{node}"))
            .or_else(|| (placement.add_to).map(|node| format!(" adding n{node}")))
            .unwrap_or_default();
        world.record(&format!("c{client} R to {wanted}{named}"));
    }
    let answer = through(
        world,
        attached.index,
        attached.incarnation,
        attached
            .replication
            .set_replicas_async(VOLUME, Some(wanted), None, placement),
    )
    .await;
    let mut world = world.borrow_mut();
    let failed = world.settled(&format!("c{client} R to {wanted}"), &answer);
    if !failed {
        world.report.replica_changes += 1;
        world.report.moves_begun += u64::from(wanted == 4);
    }
    failed
}

/// Lowering R: half the time the user names the replica that leaves (`--remove-from`), in or
/// out of sync: any but the primary's.
fn leaving_named(replication: &keel_catalog::Replication, rng: &mut StdRng) -> Placement {
    let others: Vec<NodeId> = (replication.replicas.iter().copied())
        .filter(|node| *node != replication.primary)
        .collect();
    Placement {
        remove_from: rng
            .gen_bool(0.5)
            .then(|| others[rng.gen_range(0..others.len())]),
        ..Placement::default()
    }
}

/// Runs one seed to completion (blocking).
pub fn run(seed: u64, steps: u32) -> Report {
    run_in(seed, steps, Mode::Standard)
}

/// [`run`] in `mode`.
pub fn run_in(seed: u64, steps: u32, mode: Mode) -> Report {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_all().start_paused(true);
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(&seed.to_le_bytes()));
    let mut report = Report {
        seed,
        mode,
        replicas: 0,
        witness: false,
        steps,
        writes: 0,
        flushes: 0,
        flushes_failed: 0,
        reads_checked: 0,
        attaches: 0,
        snapshots: 0,
        snapshot_copies_checked: 0,
        rollbacks: 0,
        replica_changes: 0,
        moves_begun: 0,
        power_cuts: 0,
        disks_filled: 0,
        syncs_failed: 0,
        partitions: 0,
        move_after_ms: match mode {
            Mode::Standard | Mode::Forwards | Mode::Syncs => None,
            // Its own draw: the schedule's draws stay those of the seed in either mode.
            Mode::Moves | Mode::Deletes | Mode::Drains | Mode::Singles | Mode::Fours => {
                Some(StdRng::seed_from_u64(seed ^ 0x6d6f_7665).gen_range(500..3000))
            }
        },
        replicas_moved: 0,
        snapshots_deleted: 0,
        forwarded_attaches: 0,
        drains: 0,
        primaries_handed_off: 0,
        copies_off_draining: 0,
        trace_hash: String::new(),
        violations: Vec::new(),
    };
    let runtime = match builder.build() {
        Ok(runtime) => runtime,
        Err(error) => {
            report
                .violations
                .push(format!("could not build a runtime: {error}"));
            return report;
        }
    };
    let local = tokio::task::LocalSet::new();
    runtime.block_on(
        local.run_until(openraft_rt::deterministic_rng::DeterministicRng::<
            openraft::TokioRuntime,
        >::scope(seed, simulate(report))),
    )
}

async fn simulate(mut report: Report) -> Report {
    let (seed, steps) = (report.seed, report.steps);
    let move_after = Duration::from_millis(report.move_after_ms.unwrap_or(3_600_000));
    let mode = report.mode;
    let mut rng = StdRng::seed_from_u64(seed);
    let (replicas, witness) = match (rng.gen_range(0..3), mode) {
        // With one replica to copy off from the start, on three storage nodes.
        (0 | 1, Mode::Singles) => (1u8, false),
        (_, Mode::Singles) => (2, false),
        (_, Mode::Fours) => (3, false),
        (0, _) => (2, false),
        (1, _) => (3, false),
        _ => (2, true),
    };
    report.replicas = replicas;
    report.witness = witness;
    let count: u64 = if mode == Mode::Fours { 4 } else { 3 };
    let world: Shared = Rc::new(RefCell::new(World {
        network: LocalNetwork::new(),
        nodes: (1..=count)
            .map(|index| Node {
                name: format!("n{index}"),
                address: format!("n{index}.sim:1"),
                role: if witness && index == 3 {
                    NodeRole::Witness
                } else {
                    NodeRole::Storage
                },
                dir: PathBuf::from(format!("/sim/n{index}")),
                disk: SimDisk::new(seed.wrapping_mul(31).wrapping_add(index)),
                clock: Arc::new(keel_clock::SimClock::new(
                    UNIX_EPOCH + Duration::from_secs(1_800_000_000),
                )),
                live: None,
                incarnation: 0,
            })
            .collect(),
        trace: blake3::Hasher::new(),
        violations: Vec::new(),
        report,
        flush_epochs: BTreeMap::new(),
        models: vec![Model::new(); CLIENTS],
        snapshots: Vec::new(),
        changing: false,
        snapshots_named: 0,
        resync_bytes_per_second: rng.gen_bool(0.3).then_some(256 << 10),
        move_after,
        mode,
        replicas_seen: (0, Vec::new(), 0),
        replica_changes_tried: 0,
        restarts: Vec::new(),
        heal_at: None,
        room_at: None,
        restart_at: None,
        armed: None,
        print_trace: std::env::var_os("KEEL_SIM_TRACE").is_some(),
        started: tokio::time::Instant::now(),
    }));
    let finish = |world: Shared| {
        let mut world = world.borrow_mut();
        let mut report = world.report.clone();
        report.trace_hash = world.trace.finalize().to_hex().to_string();
        report.violations.append(&mut world.violations);
        report
    };

    // Form the cluster and create the volume on a calm network.
    for index in 0..count as usize {
        let join = (index > 0).then(|| world.borrow().nodes[0].address.clone());
        if let Err(error) = bring_up(&world, index, join).await {
            world.borrow_mut().violation(format!("forming: {error}"));
            return finish(world);
        }
    }
    let formed = wait_for(Duration::from_secs(30), || {
        let world = world.borrow();
        world.nodes.iter().all(|node| {
            node.live.as_ref().is_some_and(|live| {
                let metrics = live.cluster.metrics();
                metrics.membership_config.voter_ids().count() == 3
                    && metrics.membership_config.get_joint_config().len() == 1
            })
        })
    })
    .await;
    if !formed {
        world
            .borrow_mut()
            .violation("the cluster did not reach three voters".to_string());
        return finish(world);
    }
    let create = Command::VolumeCreate {
        settings: VolumeSettings {
            name: VOLUME.to_string(),
            size_bytes: VOLUME_BYTES,
            compression: "none".to_string(),
            iops_max: None,
            bandwidth_max_mib_per_second: None,
        },
        uuid: [5; 16],
        created_unix_seconds: 1,
        replicas: (1..=u64::from(replicas)).collect(),
        status: VolumeStatus::Ready,
    };
    let cluster = world.borrow().nodes[0]
        .live
        .as_ref()
        .map(|live| live.cluster.clone());
    let created = match cluster {
        Some(cluster) => cluster.propose_async(create).await.map(drop),
        None => Ok(()),
    };
    if let Err(error) = created {
        world
            .borrow_mut()
            .violation(format!("creating the volume: {error}"));
        return finish(world);
    }
    // The clients, and the faults.
    let stop = Rc::new(RefCell::new(false));
    let clients: Vec<tokio::task::JoinHandle<()>> = (0..CLIENTS)
        .map(|index| tokio::task::spawn_local(client(world.clone(), index, seed, stop.clone())))
        .collect();
    {
        let world = world.borrow();
        world.network.set_chaos(
            seed ^ 0x5eed,
            rng.gen_range(0..20_000),
            Duration::from_millis(rng.gen_range(0..30)),
        );
    }
    for step in 0..steps {
        let now = tokio::time::Instant::now();
        let due: Vec<usize> = {
            let mut world = world.borrow_mut();
            let due = world
                .restarts
                .iter()
                .filter(|(at, _)| *at <= now)
                .map(|(_, index)| *index)
                .collect();
            world.restarts.retain(|(at, _)| *at > now);
            due
        };
        for index in due {
            world
                .borrow_mut()
                .record(&format!("{step} restart n{}", index + 1));
            if let Err(error) = bring_up(&world, index, None).await {
                world.borrow_mut().violation(format!("restart: {error}"));
            }
        }
        let restart = {
            let mut world = world.borrow_mut();
            let due = world.restart_at.filter(|(at, _)| *at <= now);
            if due.is_some() {
                world.restart_at = None;
            }
            due
        };
        if let Some((_, index)) = restart {
            world
                .borrow_mut()
                .record(&format!("{step} process restart n{}", index + 1));
            restart_process(&world, index).await;
        }
        {
            let mut world = world.borrow_mut();
            if world.heal_at.is_some_and(|at| at <= now) {
                world.record(&format!("{step} heal"));
                world.network.heal();
                world.heal_at = None;
            }
            if let Some((_, index)) = world.room_at.filter(|(at, _)| *at <= now) {
                world.record(&format!("{step} room on n{}", index + 1));
                world.nodes[index].disk.set_capacity(None);
                world.room_at = None;
            }
        }
        let (down, cut, armed, full, failing) = {
            let world = world.borrow();
            (
                world.restarts.len(),
                world.heal_at.is_some(),
                world.armed.is_some(),
                world.room_at.is_some(),
                world.restart_at.is_some(),
            )
        };
        // At most one node down at a time, and one cut at a time: the cluster keeps a Raft
        // majority.
        match rng.gen_range(0..100) {
            0..=5 if down == 0 => {
                let index = rng.gen_range(0..count as usize);
                world
                    .borrow_mut()
                    .record(&format!("{step} power cut n{}", index + 1));
                fail_node(&world, index, Fault::PowerCut, &mut rng).await;
            }
            6..=11 if !cut => {
                let index = rng.gen_range(0..count as usize);
                world
                    .borrow_mut()
                    .record(&format!("{step} partition n{}", index + 1));
                fail_node(&world, index, Fault::Isolate, &mut rng).await;
            }
            16..=19 if !cut => {
                // (Drawn as i32, as they always were: the seeds keep their schedules.)
                let nodes = count as i32;
                let a = rng.gen_range(0..nodes);
                let b = (a + rng.gen_range(1..nodes)) % nodes;
                let mut world = world.borrow_mut();
                world.record(&format!("{step} cut the link n{}-n{}", a + 1, b + 1));
                world.report.partitions += 1;
                let (a, b) = (a as u64 + 1, b as u64 + 1);
                world.network.partition(&[a], &[a, b]);
                world.heal_at = Some(now + Duration::from_millis(rng.gen_range(200..8_000)));
            }
            // The moment that matters most: right after a FLUSH was acknowledged, its primary
            // loses power or is cut off (a client does it as it gets the answer).
            12..=15 if down == 0 && !cut && !armed => {
                let fault = if rng.gen_bool(0.5) {
                    Fault::PowerCut
                } else {
                    Fault::Isolate
                };
                let mut world = world.borrow_mut();
                world.record(&format!("{step} armed: {fault:?} after the next FLUSH"));
                world.armed = Some(fault);
            }
            // A node's disk fills: its store keeps the reserve it always keeps (16 MiB, for
            // metadata and the index) and room for a few more blocks, then refuses writes
            // that add data, whether it is the primary (client writes fail) or a replica
            // (its catch-ups are refused until there is room again).
            20..=23 if !full => {
                let index = rng.gen_range(0..count as usize);
                let room = rng.gen_range(0..128 * 1024);
                let mut world = world.borrow_mut();
                world.record(&format!(
                    "{step} disk full on n{} ({room} bytes over the reserve)",
                    index + 1
                ));
                world.report.disks_filled += 1;
                let disk = &world.nodes[index].disk;
                disk.set_capacity(Some(disk.used_bytes() + STORE_RESERVE_BYTES + room));
                world.room_at = Some((
                    now + Duration::from_millis(rng.gen_range(500..8_000)),
                    index,
                ));
            }
            // A node's disk fails one of its next syncs (after `skip` more go through); its
            // process restarts a few seconds later, whether the failure came by then or not.
            24..=27 if matches!(mode, Mode::Syncs | Mode::Fours) && !failing && down == 0 => {
                let index = rng.gen_range(0..count as usize);
                let skip = rng.gen_range(0..8);
                let mut world = world.borrow_mut();
                world.record(&format!(
                    "{step} a sync fails on n{} after {skip}",
                    index + 1
                ));
                (world.nodes[index].disk).inject(FaultOp::Sync, "", libc::EIO, skip, 1);
                world.restart_at = Some((
                    now + Duration::from_millis(rng.gen_range(1_000..6_000)),
                    index,
                ));
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(10..250))).await;
        world.borrow_mut().count_moves();
        run_background_work(&world);
    }

    // Heal everything, give every disk room, bring every node back, and stop the clients.
    {
        let mut world = world.borrow_mut();
        world.record("converge");
        world.network.heal();
        world.network.calm();
        if let Some((_, index)) = world.room_at.take() {
            world.nodes[index].disk.set_capacity(None);
        }
    }
    let restart = world.borrow_mut().restart_at.take();
    if let Some((_, index)) = restart {
        world
            .borrow_mut()
            .record("process restart before converging");
        restart_process(&world, index).await;
    }
    let down = {
        let mut world = world.borrow_mut();
        world.armed = None;
        std::mem::take(&mut world.restarts)
    };
    for (_, index) in down {
        if let Err(error) = bring_up(&world, index, None).await {
            world
                .borrow_mut()
                .violation(format!("final restart: {error}"));
        }
    }
    *stop.borrow_mut() = true;
    for handle in clients {
        if let Err(error) = handle.await {
            world
                .borrow_mut()
                .violation(format!("a client panicked: {error}"));
        }
    }
    if matches!(mode, Mode::Drains | Mode::Singles | Mode::Fours) {
        end_drains(&world).await;
    }
    converge(&world, &mut rng).await;
    world.borrow_mut().count_moves();
    for index in 0..count as usize {
        power_cut(&world, index).await;
    }
    finish(world)
}

/// Attaches (again if the primary it attached to stops serving) until every replica is in
/// sync — as Raft records it and as the primary counts it, with no change of the set in flight
/// and as many replicas as R — across a FLUSH that went through; the primary and the volume's
/// replicas then. A violation at `deadline`.
async fn serve_in_sync(
    world: &Shared,
    rng: &mut StdRng,
    deadline: tokio::time::Instant,
) -> Option<(Attached, Vec<NodeId>)> {
    let mut last = String::from("no node served the volume");
    while tokio::time::Instant::now() < deadline {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let Some(attached) = attach(world, rng, left).await else {
            break;
        };
        // The replicas as Raft records them now (a move changes them, not their number),
        // when every one is in sync as Raft records it and as the primary counts it.
        let all_in_sync = |world: &Shared| -> Option<Vec<NodeId>> {
            let status = attached.primary.status();
            let recorded = world.borrow().replication_seen(attached.index)?;
            let mut placed = recorded.replicas.to_vec();
            placed.sort_unstable();
            let mut counted: Vec<NodeId> = status.in_sync.to_vec();
            counted.sort_unstable();
            let mut listed = recorded.in_sync.to_vec();
            listed.sort_unstable();
            // As many replicas as R: a copy a drain began and then had removed (R=1 with two
            // replicas) is gone first ([`Mode::Singles`]).
            (counted == placed
                && listed == placed
                && status.catching_up.is_empty()
                && placed.len() == usize::from(recorded.factor))
            .then_some(placed)
        };
        while tokio::time::Instant::now() < deadline {
            let status = attached.primary.status();
            if let Some(why) = &status.closed {
                last = format!("n{} stopped serving it: {why}", attached.index + 1);
                break;
            }
            let placed = world
                .borrow()
                .replication_seen(attached.index)
                .map(|replication| replication.replicas.to_vec())
                .unwrap_or_default();
            last = format!(
                "n{} serves it in epoch {} with {:?} in sync of {placed:?}, catching up {:?}",
                attached.index + 1,
                status.epoch,
                status.in_sync,
                status
                    .catching_up
                    .iter()
                    .map(|catch_up| (catch_up.node, catch_up.compared_bytes))
                    .collect::<Vec<_>>()
            );
            let Some(placed) = all_in_sync(world) else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let flushed = through(
                world,
                attached.index,
                attached.incarnation,
                attached.primary.flush_async(),
            )
            .await;
            if matches!(flushed, Answer::Done(()))
                && all_in_sync(world).as_ref() == Some(&placed)
                && attached.primary.status().epoch == status.epoch
            {
                return Some((attached, placed));
            }
        }
    }
    world.borrow_mut().violation(format!(
        "the replicas did not all come back in sync after healing: {last}"
    ));
    None
}

/// Serves the volume until every replica is back in sync, checks every client's units through
/// it, and compares every node's own copy with the primary's.
async fn converge(world: &Shared, rng: &mut StdRng) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let Some((attached, placed)) = serve_in_sync(world, rng, deadline).await else {
        return;
    };
    for client in 0..CLIENTS {
        world.borrow_mut().models[client].current = None;
        if read_units(
            world,
            client,
            &Session::Direct(attached.clone()),
            "after healing",
        )
        .await
        .is_none()
        {
            world.borrow_mut().violation(format!(
                "client {client}'s units could not be read after healing"
            ));
        }
    }
    // Every node's own copy holds what the primary's does, read through the node's own
    // catalog once it applied as far as the primary's: a replica durable through every
    // FLUSH may still lag a change of the view (a rollback committed while it was cut off
    // shows in its copy once its catalog has it; seed 3329 with deletes).
    let applied = |index: usize| {
        let world = world.borrow();
        world.nodes[index]
            .live
            .as_ref()
            .map(|live| live.cluster.applied_index())
    };
    let wanted = applied(attached.index).unwrap_or(0);
    for node in &placed {
        let index = (*node - 1) as usize;
        let caught_up = wait_for(Duration::from_secs(30), || {
            applied(index).is_some_and(|at| at >= wanted)
        })
        .await;
        if !caught_up {
            world.borrow_mut().violation(format!(
                "n{node} did not apply the catalog as far as the primary (index {wanted}) \
                 within 30 s of being in sync: at {:?}",
                applied(index)
            ));
        }
    }
    let mut primary_bytes = vec![0u8; VOLUME_BYTES as usize];
    if through(
        world,
        attached.index,
        attached.incarnation,
        attached.primary.read_async(0, &mut primary_bytes),
    )
    .await
    .is_failure()
    {
        world
            .borrow_mut()
            .violation("the primary's copy could not be read".to_string());
        return;
    }
    let copies: Vec<(usize, Arc<VolumeManager>)> = {
        let world = world.borrow();
        world
            .nodes
            .iter()
            .enumerate()
            .filter(|(index, _)| placed.contains(&(*index as u64 + 1)))
            .filter_map(|(index, node)| {
                let volumes = node.live.as_ref()?.volumes.clone()?;
                Some((index, volumes))
            })
            .collect()
    };
    for (index, volumes) in &copies {
        let index = *index;
        if index == attached.index {
            continue;
        }
        let mut copy = vec![0u8; VOLUME_BYTES as usize];
        let read = volumes
            .open_volume(VOLUME)
            .and_then(|volume| volume.read(0, &mut copy));
        let mut world = world.borrow_mut();
        match read {
            Ok(()) if copy == primary_bytes => {
                world.record(&format!("n{} holds the primary's copy", index + 1));
            }
            Ok(()) => {
                let first = copy
                    .iter()
                    .zip(&primary_bytes)
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                let at = first - first % BLOCK_BYTES;
                world.violation(format!(
                    "n{}'s copy differs from the primary's (n{}) from byte {first}: unit at {at} \
                     holds {:?} there, {:?} on the primary",
                    index + 1,
                    attached.index + 1,
                    &copy[at..at + 16],
                    &primary_bytes[at..at + 16]
                ));
            }
            Err(error) => {
                world.violation(format!("n{}'s copy could not be read: {error}", index + 1))
            }
        }
    }
    check_snapshots(world, &copies).await;
}

/// Every snapshot acknowledged is in the catalog and, on every replica holding it whole (the
/// one it was taken on, and those its repair copied it to: given a while to finish), shows
/// exactly what its client's units held when it was taken.
async fn check_snapshots(world: &Shared, copies: &[(usize, Arc<VolumeManager>)]) {
    let taken = world.borrow().snapshots.clone();
    if taken.is_empty() {
        return;
    }
    let Some((_, volumes)) = copies.first() else {
        return;
    };
    // Every node's catalog shows every acknowledged snapshot once it applied as far as the
    // primary (a node just back from a partition may lag a moment).
    let all_known = || {
        copies.iter().all(|(_, volumes)| {
            let catalog = volumes.metadata().catalog().read();
            catalog.volume(VOLUME).is_some_and(|entry| {
                taken
                    .iter()
                    .all(|taken| entry.snapshot_by_name(&taken.name).is_some())
            })
        })
    };
    wait_for(Duration::from_secs(30), all_known).await;
    // Repairs copy one snapshot at a time; give them a while (a slow catch-up pace too).
    let whole_everywhere = || {
        let catalog = volumes.metadata().catalog().read();
        catalog.volume(VOLUME).is_some_and(|entry| {
            entry
                .snapshots
                .values()
                .all(|snapshot| snapshot.incomplete_on.is_empty())
        })
    };
    wait_for(Duration::from_secs(300), whole_everywhere).await;
    for Taken { name, possible } in taken {
        let mut found_whole = 0;
        for (index, volumes) in copies {
            let node = *index as u64 + 1;
            let entry = volumes.metadata().catalog().read().volume(VOLUME).cloned();
            let Some(record) = entry
                .as_ref()
                .and_then(|entry| entry.snapshot_by_name(&name))
            else {
                world.borrow_mut().violation(format!(
                    "snapshot {name} (acknowledged) is not in n{node}'s catalog"
                ));
                break;
            };
            if !record.complete_on(node) {
                continue;
            }
            found_whole += 1;
            let snapshot = match volumes.open_snapshot(VOLUME, &name) {
                Ok(snapshot) => snapshot,
                Err(error) => {
                    world.borrow_mut().violation(format!(
                        "snapshot {name} is whole on n{node} but does not open there: {error}"
                    ));
                    continue;
                }
            };
            'units: for (client, possible) in possible.iter().enumerate() {
                for (unit, wanted) in (0..UNITS).zip(possible) {
                    let mut data = vec![0u8; BLOCK_BYTES];
                    let read = snapshot.read(offset_of(client, unit), &mut data);
                    let found = read.ok().and_then(|()| value_of(client, unit, &data));
                    let mut world = world.borrow_mut();
                    world.report.snapshot_copies_checked += u64::from(client == 0 && unit == 0);
                    if !found.is_some_and(|value| wanted.contains(&value)) {
                        world.violation(format!(
                            "snapshot {name} on n{node}: client {client} unit {unit} holds \
                             {found:?}, not one of {wanted:?} as when it was taken"
                        ));
                        break 'units;
                    }
                }
            }
        }
        if found_whole == 0 {
            world
                .borrow_mut()
                .violation(format!("snapshot {name} is whole on no replica"));
        }
    }
}

impl<T> Answer<T> {
    fn is_failure(&self) -> bool {
        !matches!(self, Answer::Done(_))
    }
}

async fn wait_for(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    check()
}
