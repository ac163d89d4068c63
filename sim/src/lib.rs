//! A deterministic simulation of Keel's metadata cluster: real `keel_cluster::Cluster` nodes
//! (real openraft, real stores under `target/sim-data`) over an in-process network, on
//! simulated time, driven by one seed.
//!
//! One run ([`run`]): form a cluster of 3 or 5 nodes, then for a number of steps pick, from the
//! seed, among: proposals through random nodes (several in flight), crashes and restarts,
//! partitions and healing, message loss and delay (so reordering), wall-clock jumps, idle time.
//! Then heal everything, restart every crashed node, let the cluster converge, and check:
//!
//! 1. every proposal acknowledged as applied is in every node's catalog (nothing lost);
//! 2. no proposal was applied twice (each volume name is proposed once, so a "volume exists"
//!    refusal can only be a second application of the same proposal);
//! 3. all nodes hold one history (equal catalogs);
//! 4. during the run, any two observations of a state at the same applied index, on any node,
//!    are identical (state-machine safety).
//!
//! Determinism: a current-thread runtime with paused time and a seeded tokio RNG (needs
//! `--cfg tokio_unstable`, set in this crate's `.cargo/config.toml`), openraft's randomness
//! from a seeded generator (`keel-cluster/simulation`), every choice here from the seed: the
//! same seed gives the same [`Report`], down to its trace hash.

pub mod replication;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use keel_catalog::{
    CatalogError, Command, MetadataError, NodeAddresses, NodeId, NodeRole, VolumeSettings,
    VolumeStatus,
};
use keel_cluster::{Cluster, ClusterConfig, ClusterHandler, LocalNetwork, Timing};
use keel_store::{Store, StoreConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What one seed did and found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub seed: u64,
    pub nodes: usize,
    pub steps: u32,
    pub proposals: u64,
    pub acknowledged: u64,
    pub failed: u64,
    pub crashes: u64,
    pub partitions: u64,
    pub clock_jumps: u64,
    /// Hash of everything observable, in order: two runs of a seed must agree on it.
    pub trace_hash: String,
    pub violations: Vec<String>,
}

fn timing() -> Timing {
    Timing {
        raft_heartbeat: Duration::from_millis(100),
        election_timeout_min: Duration::from_millis(500),
        election_timeout_max: Duration::from_millis(1000),
        report_interval: Duration::from_millis(250),
        suspect_after: Duration::from_secs(2),
        down_after: Duration::from_secs(5),
        propose_timeout: Duration::from_secs(6),
        call_timeout: Duration::from_secs(1),
        membership_interval: Duration::from_millis(500),
        snapshot_every_entries: 50,
    }
}

struct Node {
    name: String,
    address: String,
    dir: PathBuf,
    role: NodeRole,
    clock: Arc<keel_clock::SimClock>,
    live: Option<Live>,
}

struct Live {
    cluster: Arc<Cluster>,
    _handler: Arc<ClusterHandler>,
}

struct World {
    network: LocalNetwork,
    nodes: Vec<Node>,
    trace: blake3::Hasher,
    /// Applied index → hash of the encoded catalog, as first seen on any node.
    states: HashMap<u64, [u8; 32]>,
    violations: Vec<String>,
}

impl World {
    fn record(&mut self, event: &str) {
        self.trace.update(event.as_bytes());
        self.trace.update(b"\n");
    }

    fn live(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&index| self.nodes[index].live.is_some())
            .collect()
    }

    /// Checks state-machine safety on every live node.
    fn observe(&mut self) {
        for node in &self.nodes {
            let Some(live) = &node.live else { continue };
            let before = live.cluster.applied_index();
            let encoded = live.cluster.catalog().read().encode();
            if live.cluster.applied_index() != before {
                continue;
            }
            let hash = *blake3::hash(&encoded).as_bytes();
            match self.states.get(&before) {
                Some(seen) if *seen != hash => self.violations.push(format!(
                    "state-machine safety: node {} holds a different state at applied index {before}",
                    node.name
                )),
                Some(_) => {}
                None => {
                    self.states.insert(before, hash);
                }
            }
        }
    }
}

async fn start_node(world: &mut World, index: usize, join: Option<String>) -> Result<(), String> {
    let node = &world.nodes[index];
    let dir = node.dir.clone();
    let store = Store::open(StoreConfig::new(vec![dir.clone()]))
        .map_err(|error| format!("opening {}: {error}", dir.display()))?;
    let handler = ClusterHandler::new();
    let weak: std::sync::Weak<dyn keel_cluster::Handler> =
        Arc::downgrade(&(handler.clone() as Arc<dyn keel_cluster::Handler>));
    world.network.listen(&node.address, weak);
    let from = handler.clone();
    let transport = Arc::new(
        world
            .network
            .transport(&node.address, Arc::new(move || from.current_node_id())),
    );
    let clock: Arc<dyn keel_clock::Clock> = node.clock.clone();
    let config = ClusterConfig {
        name: node.name.clone(),
        role: node.role,
        addresses: NodeAddresses {
            cluster: node.address.clone(),
            ..NodeAddresses::default()
        },
        labels: BTreeMap::new(),
        devices: Vec::new(),
        join,
        cluster_id: Some([7; 16]),
        voters: if world.nodes.len() >= 5 { 5 } else { 3 },
        timing: timing(),
        clock,
    };
    let cluster = Cluster::start(store, config, transport, &handler)
        .await
        .map_err(|error| format!("starting {}: {error}", node.name))?;
    world.nodes[index].live = Some(Live {
        cluster,
        _handler: handler,
    });
    Ok(())
}

async fn crash_node(world: &mut World, index: usize) {
    let node = &mut world.nodes[index];
    world.network.close(&node.address);
    if let Some(live) = node.live.take() {
        live.cluster.shutdown().await;
    }
}

fn volume_command(name: &str, node: NodeId) -> Command {
    Command::VolumeCreate {
        settings: VolumeSettings {
            name: name.to_string(),
            size_bytes: 1 << 20,
            compression: "none".to_string(),
            iops_max: None,
            bandwidth_max_mib_per_second: None,
        },
        uuid: [3; 16],
        created_unix_seconds: 1,
        replicas: vec![node],
        status: VolumeStatus::Ready,
    }
}

/// The outcome of one proposal, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    Applied,
    Refused(String),
    /// Unavailable or timed out: may or may not have been applied.
    Unknown,
}

/// Runs one seed to completion (blocking). `data_root` holds the nodes' stores.
pub fn run(seed: u64, steps: u32, data_root: &Path) -> Report {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_all().start_paused(true);
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(&seed.to_le_bytes()));
    let runtime = match builder.build() {
        Ok(runtime) => runtime,
        Err(error) => {
            return Report {
                seed,
                nodes: 0,
                steps,
                proposals: 0,
                acknowledged: 0,
                failed: 0,
                crashes: 0,
                partitions: 0,
                clock_jumps: 0,
                trace_hash: String::new(),
                violations: vec![format!("could not build a runtime: {error}")],
            }
        }
    };
    let dir = data_root.join(format!("seed-{seed}"));
    let _ = std::fs::remove_dir_all(&dir);
    let report = runtime.block_on(openraft_rt::deterministic_rng::DeterministicRng::<
        openraft::TokioRuntime,
    >::scope(seed, simulate(seed, steps, dir.clone())));
    if report.violations.is_empty() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    report
}

async fn simulate(seed: u64, steps: u32, dir: PathBuf) -> Report {
    let mut rng = StdRng::seed_from_u64(seed);
    let node_count = if rng.gen_bool(0.3) { 5 } else { 3 };
    let mut world = World {
        network: LocalNetwork::new(),
        nodes: (1..=node_count)
            .map(|index| Node {
                name: format!("n{index}"),
                address: format!("n{index}.sim:1"),
                dir: dir.join(format!("n{index}")),
                role: NodeRole::Storage,
                clock: Arc::new(keel_clock::SimClock::new(
                    UNIX_EPOCH + Duration::from_secs(1_800_000_000),
                )),
                live: None,
            })
            .collect(),
        trace: blake3::Hasher::new(),
        states: HashMap::new(),
        violations: Vec::new(),
    };
    for node in &world.nodes {
        if let Err(error) = std::fs::create_dir_all(&node.dir) {
            world
                .violations
                .push(format!("creating {}: {error}", node.dir.display()));
        }
    }
    let mut report = Report {
        seed,
        nodes: node_count,
        steps,
        proposals: 0,
        acknowledged: 0,
        failed: 0,
        crashes: 0,
        partitions: 0,
        clock_jumps: 0,
        trace_hash: String::new(),
        violations: Vec::new(),
    };

    // Form the cluster on a calm network.
    for index in 0..node_count {
        let join = (index > 0).then(|| world.nodes[0].address.clone());
        if let Err(error) = start_node(&mut world, index, join).await {
            report.violations.push(format!("forming: {error}"));
            report.violations.append(&mut world.violations);
            return report;
        }
    }
    let settled = wait_for(Duration::from_secs(30), || {
        world.nodes[0]
            .live
            .as_ref()
            .map(|live| {
                live.cluster.metrics().membership_config.voter_ids().count()
                    == node_count.min(if node_count >= 5 { 5 } else { 3 })
            })
            .unwrap_or(false)
    })
    .await;
    if !settled {
        report
            .violations
            .push("the cluster did not reach its voter count".to_string());
        return report;
    }
    world.network.set_chaos(
        seed ^ 0x5eed,
        rng.gen_range(0..50_000),
        Duration::from_millis(rng.gen_range(0..80)),
    );

    let outcomes: Arc<Mutex<BTreeMap<String, Outcome>>> = Arc::new(Mutex::new(BTreeMap::new()));
    let mut in_flight = tokio::task::JoinSet::new();
    let mut restarts: Vec<(tokio::time::Instant, usize)> = Vec::new();
    let mut heal_at: Option<tokio::time::Instant> = None;
    let mut counter = 0u64;
    // In-flight proposals by the node they go through: a crash ends them (as kill -9 would).
    let mut through: Vec<Vec<tokio::task::AbortHandle>> = vec![Vec::new(); node_count];
    for step in 0..steps {
        while in_flight.try_join_next().is_some() {}
        world.observe();
        let now = tokio::time::Instant::now();
        // Restarts and heals that are due.
        let due: Vec<usize> = restarts
            .iter()
            .filter(|(at, _)| *at <= now)
            .map(|(_, index)| *index)
            .collect();
        restarts.retain(|(at, _)| *at > now);
        for index in due {
            world.record(&format!("{step} restart n{}", index + 1));
            if let Err(error) = start_node(&mut world, index, None).await {
                world.violations.push(format!("restart: {error}"));
            }
        }
        if heal_at.is_some_and(|at| at <= now) {
            world.record(&format!("{step} heal"));
            world.network.heal();
            heal_at = None;
        }
        let live = world.live();
        match rng.gen_range(0..100) {
            0..=59 if !live.is_empty() && in_flight.len() < 4 => {
                counter += 1;
                let name = format!("v{counter}");
                let via = live[rng.gen_range(0..live.len())];
                let Some(cluster) = world.nodes[via].live.as_ref().map(|l| l.cluster.clone())
                else {
                    continue;
                };
                let target = cluster.node_id();
                report.proposals += 1;
                world.record(&format!("{step} propose {name} via n{}", via + 1));
                // Unknown until answered (a crash may end the call: it may or may not apply).
                outcomes
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .insert(name.clone(), Outcome::Unknown);
                let outcomes = outcomes.clone();
                let handle = in_flight.spawn(async move {
                    let outcome = match cluster.propose_async(volume_command(&name, target)).await {
                        Ok(_) => Outcome::Applied,
                        Err(MetadataError::Refused(refusal)) => Outcome::Refused(match refusal {
                            CatalogError::VolumeExists { .. } => "exists".to_string(),
                            other => other.to_string(),
                        }),
                        Err(_) => Outcome::Unknown,
                    };
                    outcomes
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .insert(name, outcome);
                });
                through[via].retain(|task| !task.is_finished());
                through[via].push(handle);
            }
            60..=69 if live.len() > 1 => {
                let index = live[rng.gen_range(0..live.len())];
                report.crashes += 1;
                world.record(&format!("{step} crash n{}", index + 1));
                for task in through[index].drain(..) {
                    task.abort();
                }
                crash_node(&mut world, index).await;
                let back = now + Duration::from_millis(rng.gen_range(500..8_000));
                restarts.push((back, index));
            }
            70..=77 if heal_at.is_none() => {
                let ids: Vec<NodeId> = (1..=node_count as u64).collect();
                let size = rng.gen_range(1..=node_count / 2);
                let mut side: BTreeSet<NodeId> = BTreeSet::new();
                while side.len() < size {
                    side.insert(ids[rng.gen_range(0..ids.len())]);
                }
                let side: Vec<NodeId> = side.into_iter().collect();
                report.partitions += 1;
                world.record(&format!("{step} partition {side:?}"));
                world.network.partition(&side, &ids);
                heal_at = Some(now + Duration::from_millis(rng.gen_range(200..6_000)));
            }
            78..=82 => {
                let index = rng.gen_range(0..node_count);
                let jump = rng.gen_range(-60_000i64..60_000);
                report.clock_jumps += 1;
                world.record(&format!(
                    "{step} wall clock of n{} jumps {jump} ms",
                    index + 1
                ));
                world.nodes[index].clock.jump_wall(jump);
            }
            _ => {
                let idle = rng.gen_range(0..400);
                tokio::time::sleep(Duration::from_millis(idle)).await;
            }
        }
        // Let every task run a little between steps.
        tokio::time::sleep(Duration::from_millis(rng.gen_range(1..30))).await;
    }

    // Heal everything and converge.
    world.record("converge");
    world.network.heal();
    world.network.calm();
    for (_, index) in std::mem::take(&mut restarts) {
        if world.nodes[index].live.is_none() {
            if let Err(error) = start_node(&mut world, index, None).await {
                world.violations.push(format!("final restart: {error}"));
            }
        }
    }
    while in_flight.join_next().await.is_some() {}
    // One more proposal after healing makes sure everything before it is committed everywhere.
    let probe = loop_propose(&world, "final-probe").await;
    if !probe {
        world
            .violations
            .push("the healed cluster did not accept a proposal".to_string());
    }
    let converged = wait_for(Duration::from_secs(60), || {
        let indexes: BTreeSet<u64> = world
            .nodes
            .iter()
            .filter_map(|node| node.live.as_ref())
            .map(|live| live.cluster.applied_index())
            .collect();
        indexes.len() == 1
    })
    .await;
    world.observe();
    if !converged {
        world
            .violations
            .push("nodes did not converge on one applied index after healing".to_string());
    }

    // Final checks.
    let outcomes = outcomes
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone();
    let catalogs: Vec<(String, keel_catalog::CatalogState)> = world
        .nodes
        .iter()
        .filter_map(|node| {
            node.live
                .as_ref()
                .map(|live| (node.name.clone(), live.cluster.catalog().read().clone()))
        })
        .collect();
    if let Some((first_name, first)) = catalogs.first() {
        for (name, catalog) in &catalogs[1..] {
            if catalog != first {
                world.violations.push(format!(
                    "one history: {name}'s catalog differs from {first_name}'s"
                ));
            }
        }
        let names: BTreeSet<String> = first
            .volumes
            .values()
            .map(|entry| entry.record.name.clone())
            .collect();
        for (name, outcome) in &outcomes {
            world.record(&format!("outcome {name} {outcome:?}"));
            match outcome {
                Outcome::Applied => {
                    report.acknowledged += 1;
                    if !names.contains(name) {
                        world.violations.push(format!(
                            "lost: {name} was acknowledged but is not in the catalog"
                        ));
                    }
                }
                Outcome::Refused(reason) if reason == "exists" => world.violations.push(format!(
                    "applied twice: {name} (proposed once) was refused as already existing"
                )),
                Outcome::Refused(reason) => world
                    .violations
                    .push(format!("unexpected refusal of {name}: {reason}")),
                Outcome::Unknown => report.failed += 1,
            }
        }
        for name in &names {
            if name != "final-probe" && !outcomes.contains_key(name) {
                world.violations.push(format!(
                    "phantom: {name} is in the catalog but was never proposed"
                ));
            }
        }
        world.record(&format!("final volumes {}", names.len()));
    }
    for index in 0..world.nodes.len() {
        crash_node(&mut world, index).await;
    }
    report.trace_hash = world.trace.finalize().to_hex().to_string();
    report.violations.append(&mut world.violations);
    report
}

/// Proposes `name` through live nodes until one accepts (bounded).
async fn loop_propose(world: &World, name: &str) -> bool {
    for _ in 0..20 {
        for node in &world.nodes {
            let Some(live) = &node.live else { continue };
            let target = live.cluster.node_id();
            match live
                .cluster
                .propose_async(volume_command(name, target))
                .await
            {
                Ok(_) => return true,
                Err(MetadataError::Refused(CatalogError::VolumeExists { .. })) => return true,
                Err(_) => {}
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    false
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
