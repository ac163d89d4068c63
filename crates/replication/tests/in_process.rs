//! The replication engine in one process: real nodes (real stores under `target/`, real
//! openraft, real volumes, the real engine) talking over the cluster's in-process
//! `LocalNetwork`, which cuts links on demand. The engine reaches other nodes only through
//! the cluster's `Transport` and answers them as a cluster `Handler`, so it runs here as it
//! runs over `keel-rpc` in a server. Each test names what it proves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use keel_catalog::{NodeAddresses, NodeId, NodeRole};
use keel_cluster::{
    Cluster, ClusterConfig, ClusterHandler, Dispatch, Handler, LocalNetwork, Timing,
};
use keel_namespace::volume::{VolumeManager, VolumeSpec};
use keel_replication::{LocalVolumes, Placement, Replication, Settings};
use keel_store::{Store, StoreConfig};
use keel_volume::{VolumeIo, VolumeResult};

const SETTLE: Duration = Duration::from_secs(30);

fn timing() -> Timing {
    Timing {
        raft_heartbeat: Duration::from_millis(50),
        election_timeout_min: Duration::from_millis(300),
        election_timeout_max: Duration::from_millis(600),
        report_interval: Duration::from_millis(100),
        // Past the replication batch timeout (2 s): a cut-off replica is dropped by its
        // primary's failed batch, not by the failure detector.
        suspect_after: Duration::from_secs(4),
        down_after: Duration::from_secs(8),
        propose_timeout: Duration::from_secs(4),
        call_timeout: Duration::from_millis(500),
        membership_interval: Duration::from_millis(150),
        snapshot_every_entries: 1000,
    }
}

/// Sends the engine's log to the test's captured output, which the harness shows for a test
/// that failed: `info` for Keel's crates unless `KEEL_LOG` says otherwise.
fn log_to_test_output() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KEEL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,keel_replication=info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

fn node_dir(test: &str, node: &str) -> PathBuf {
    log_to_test_output();
    static RUN: AtomicU64 = AtomicU64::new(0);
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/test-data/replication")
        .join(format!("{test}-{}", RUN.fetch_add(1, Ordering::Relaxed)))
        .join(node);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The node's own volumes, as the server hands them to the engine.
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

struct TestNode {
    address: String,
    cluster: Arc<Cluster>,
    volumes: Arc<VolumeManager>,
    replication: Arc<Replication>,
    _dispatch: Arc<Dispatch>,
}

/// Starts node `name` with failure-domain `labels`, joining through `join`.
async fn start(
    network: &LocalNetwork,
    test: &str,
    name: &str,
    join: Option<String>,
    settings: Settings,
    labels: &[(&str, &str)],
) -> TestNode {
    let dir = node_dir(test, name);
    let address = format!("{name}.test:1");
    let store =
        tokio::task::spawn_blocking(move || Store::open(StoreConfig::new(vec![dir])).unwrap())
            .await
            .unwrap();
    let handler = ClusterHandler::new();
    let dispatch = Dispatch::new(handler.clone());
    let weak: Weak<dyn Handler> = Arc::downgrade(&(dispatch.clone() as Arc<dyn Handler>));
    network.listen(&address, weak);
    let from = handler.clone();
    let transport: Arc<dyn keel_cluster::Transport> =
        Arc::new(network.transport(&address, Arc::new(move || from.current_node_id())));
    let config = ClusterConfig {
        name: name.to_string(),
        role: NodeRole::Storage,
        addresses: NodeAddresses {
            cluster: address.clone(),
            ..NodeAddresses::default()
        },
        labels: labels
            .iter()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect(),
        devices: Vec::new(),
        join,
        cluster_id: None,
        voters: 3,
        timing: timing(),
        clock: Arc::new(keel_clock::SystemClock),
    };
    let cluster = Cluster::start(store.clone(), config, transport.clone(), &handler)
        .await
        .unwrap();
    let metadata: Arc<dyn keel_catalog::Metadata> = cluster.clone();
    let volumes = Arc::new(
        tokio::task::spawn_blocking(move || VolumeManager::open(store, metadata).unwrap())
            .await
            .unwrap(),
    );
    let replication = Replication::new(
        cluster.clone(),
        transport,
        Arc::new(Copies {
            volumes: volumes.clone(),
        }),
        tokio::runtime::Handle::current(),
        settings,
        keel_ops::Ops::disabled(),
    );
    dispatch.set_above(replication.clone());
    TestNode {
        address,
        cluster,
        volumes,
        replication,
        _dispatch: dispatch,
    }
}

/// Stops every node still running (and Raft on all), so that no engine task outlives the test's
/// runtime.
async fn stop(nodes: &[&TestNode], crashed: Option<&TestNode>) {
    for node in nodes {
        if !crashed.is_some_and(|crashed| std::ptr::eq(*node, crashed)) {
            node.cluster.shutdown().await;
        }
    }
    // A proposal retrying when Raft stopped sees it after its pause (at most 0.5 s) and ends
    // before the runtime does.
    tokio::time::sleep(Duration::from_millis(600)).await;
}

async fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + SETTLE;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How long one blocking call of a test may take before the test fails rather than hangs.
const BLOCKED_MAX: Duration = Duration::from_secs(120);

/// Runs blocking volume I/O on a thread of its own, as an NBD worker does: its answer, or
/// nothing if it panicked. A thread still blocked when the test ends is left behind (a
/// runtime's blocking pool would be waited for, and a hung FLUSH would hang the test).
fn on_thread<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> tokio::sync::oneshot::Receiver<T> {
    let (answer, answered) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = answer.send(work());
    });
    answered
}

/// [`on_thread`], waited for: a call blocked for [`BLOCKED_MAX`] fails the test.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::time::timeout(BLOCKED_MAX, on_thread(work))
        .await
        .expect("a blocking call (volume I/O) neither failed nor completed in 2 minutes")
        .expect("a blocking call panicked")
}

fn pattern(round: u8) -> Vec<u8> {
    (0..65536u32)
        .map(|i| (i as u8) ^ round.wrapping_mul(31))
        .collect()
}

/// The volume's replicas as Raft records them, seen from `node`.
fn replica_set(node: &TestNode, volume: &str) -> Vec<NodeId> {
    node.cluster
        .catalog()
        .read()
        .volume(volume)
        .map(|entry| entry.record.replication.replicas.to_vec())
        .unwrap_or_default()
}

/// The volume's in-sync set as Raft records it, seen from `node`.
fn in_sync(node: &TestNode, volume: &str) -> Vec<NodeId> {
    node.cluster
        .catalog()
        .read()
        .volume(volume)
        .map(|entry| entry.record.replication.in_sync.to_vec())
        .unwrap_or_default()
}

/// The volume's id, as `node`'s catalog holds it.
fn volume_id(node: &TestNode, volume: &str) -> u64 {
    node.cluster
        .catalog()
        .read()
        .volume(volume)
        .unwrap()
        .record
        .id
}

// Proves the engine keeps its contract over the cluster's in-process transport: a FLUSH on
// an R=2 volume reaches the replica's own copy; a replica cut off is taken out of the in-sync
// set through Raft and the primary's FLUSHes go on without it; after healing it is caught up
// and taken back in; and when the primary's node dies, the replica takes the volume over with
// every flushed write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_r2_volume_keeps_every_flushed_write_through_a_partition_and_a_lost_primary() {
    let network = LocalNetwork::new();
    let (nodes, primary, replica) =
        replicated_volume(&network, "r2_in_process", 128, 2, None).await;
    let ids: Vec<NodeId> = nodes.iter().map(|n| n.cluster.node_id()).collect();
    let primary_node = &nodes[primary];
    let replica_node = &nodes[replica];

    // Round 0: written and flushed through the primary. The attach made the primary alone in
    // sync and catches the replica up; once back in sync, its own copy holds the write.
    let replication = primary_node.replication.clone();
    let volume = blocking(move || replication.open("v")).await.unwrap();
    let io = volume.clone();
    blocking(move || {
        io.write(0, &pattern(0), false).unwrap();
        io.flush().unwrap();
    })
    .await;
    let replica_id = replica_node.cluster.node_id();
    wait_for("the replica in sync", || {
        in_sync(primary_node, "v").contains(&replica_id)
    })
    .await;
    let replica_volumes = replica_node.volumes.clone();
    let on_replica = blocking(move || {
        let copy = replica_volumes.open_volume("v").unwrap();
        let mut buf = vec![0u8; 65536];
        copy.read(0, &mut buf).unwrap();
        buf
    })
    .await;
    assert!(
        on_replica == pattern(0),
        "the flushed write is not on the replica"
    );

    // Round 1: the replica cut off; the FLUSH completes once Raft took it out of the set,
    // not before (delayed messages keep Raft's commit from racing a FLUSH that did not wait).
    network.partition(&[replica_id], &ids);
    network.set_chaos(1, 0, Duration::from_millis(40));
    let io = volume.clone();
    let catalog = primary_node.cluster.catalog().clone();
    let in_sync_at_flush = blocking(move || {
        io.write(65536, &pattern(1), false).unwrap();
        io.flush().unwrap();
        catalog
            .read()
            .volume("v")
            .unwrap()
            .record
            .replication
            .in_sync
            .clone()
    })
    .await;
    assert!(
        !in_sync_at_flush.contains(&replica_id),
        "a FLUSH completed without the replica while Raft still counted it in sync"
    );

    // Healed: caught up and back in the set (a catch-up call sent into the cut waits out its
    // timeout first, as one lost to a real partition would: this takes about 10 s).
    network.calm();
    network.heal();
    wait_for("the replica back in sync", || {
        in_sync(primary_node, "v").contains(&replica_id)
    })
    .await;

    // Round 2, then the primary's node dies.
    let io = volume.clone();
    blocking(move || {
        io.write(2 * 65536, &pattern(2), false).unwrap();
        io.flush().unwrap();
    })
    .await;
    network.close(&primary_node.address);
    primary_node.cluster.shutdown().await;
    // Its engine stops serving with it (rather than retry against a stopped Raft).
    let volume_id = volume_id(primary_node, "v");
    assert!(
        primary_node.replication.primary_status(volume_id).is_none(),
        "the primary outlived its node's cluster"
    );

    let taken_over = open_when_possible(replica_node).await;
    assert_rounds_kept(taken_over, 3, "in the take-over").await;
    stop(&nodes.iter().collect::<Vec<_>>(), Some(primary_node)).await;
}

// Proves an in-sync change whose answer is lost does not let a FLUSH complete without a
// replica Raft lists in sync: the replica's return to the set is made in Raft but its answer
// never reaches the primary (a metadata timeout: made or not, the primary cannot tell). The
// primary settles it before anything else, so once the replica is cut off again, a FLUSH
// completes only after Raft took the replica out. Then the replica is caught up once more,
// and takes every flushed write over when the primary dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_sync_change_whose_answer_is_lost_is_settled_before_a_flush_goes_on_without_it() {
    let network = LocalNetwork::new();
    let (nodes, primary, replica) = replicated_volume(&network, "unanswered", 64, 2, None).await;
    let ids: Vec<NodeId> = nodes.iter().map(|n| n.cluster.node_id()).collect();
    let primary_node = &nodes[primary];
    let replica_node = &nodes[replica];
    let primary_id = primary_node.cluster.node_id();
    let replica_id = replica_node.cluster.node_id();
    // The third node leads, so the primary's proposals cross the network to it.
    let third = nodes
        .iter()
        .find(|n| ![primary_id, replica_id].contains(&n.cluster.node_id()))
        .unwrap();
    lead(&nodes, third.cluster.node_id()).await;

    let replication = primary_node.replication.clone();
    let volume = blocking(move || replication.open("v")).await.unwrap();
    let write_and_flush = |round: u8| {
        let io = volume.clone();
        let catalog = primary_node.cluster.catalog().clone();
        blocking(move || {
            io.write(u64::from(round) * 65536, &pattern(round), false)
                .unwrap();
            io.flush().unwrap();
            let entry = catalog.read().volume("v").unwrap().clone();
            entry.record.replication.in_sync.clone()
        })
    };
    write_and_flush(0).await;
    wait_for("the replica in sync", || {
        in_sync(primary_node, "v").contains(&replica_id)
    })
    .await;

    // Out of the set, cut off; then back, with every answer to the primary's proposals lost.
    network.partition(&[replica_id], &ids);
    let at_flush = write_and_flush(1).await;
    assert!(!at_flush.contains(&replica_id));
    network.lose_answers(primary_id, keel_cluster::messages::METHOD_PROPOSE);
    network.heal();
    wait_for("Raft to list the replica in sync again", || {
        in_sync(primary_node, "v").contains(&replica_id)
    })
    .await;
    // The primary's proposal times out (4 s), and a catch-up failing would be retried after
    // a second: past both.
    tokio::time::sleep(timing().propose_timeout + Duration::from_secs(2)).await;

    // Cut off again: the FLUSH must wait until Raft took the replica out.
    network.partition(&[replica_id], &ids);
    let at_flush = write_and_flush(2).await;
    assert!(
        !at_flush.contains(&replica_id),
        "a FLUSH completed without the replica while Raft listed it in sync"
    );

    // Answers come again: the replica is caught up, then takes over with every flushed write.
    network.keep_answers();
    network.heal();
    wait_for("the replica back in sync", || {
        in_sync(primary_node, "v").contains(&replica_id)
    })
    .await;
    write_and_flush(3).await;
    network.close(&primary_node.address);
    primary_node.cluster.shutdown().await;
    let taken_over = open_when_possible(replica_node).await;
    assert_rounds_kept(taken_over, 4, "in the take-over").await;
    stop(&nodes.iter().collect::<Vec<_>>(), Some(primary_node)).await;
}

// Proves a change of the replica set whose answer is lost is settled rather than ending the
// primary: R is raised from 2 to 3 while every answer to the primary's proposals is lost, so
// Raft adds the third replica but the primary cannot tell. It must take the change as made
// once its catalog shows it: the raise succeeds, the client attached there goes on writing
// through the same handle, and the primary catches the added replica up until it is in sync
// (before, the primary stopped serving, which failed its client's I/O, and with it the
// catch-up of a replica Raft had added).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_of_the_replicas_whose_answer_is_lost_is_settled_and_the_primary_serves_on() {
    let network = LocalNetwork::new();
    let (nodes, primary, replica) =
        replicated_volume(&network, "unanswered_set", 64, 2, None).await;
    let primary_node = &nodes[primary];
    let primary_id = primary_node.cluster.node_id();
    let replica_id = nodes[replica].cluster.node_id();
    let third = nodes
        .iter()
        .find(|n| ![primary_id, replica_id].contains(&n.cluster.node_id()))
        .unwrap();
    let third_id = third.cluster.node_id();
    // The third node leads, so the primary's proposals cross the network to it.
    lead(&nodes, third_id).await;

    let replication = primary_node.replication.clone();
    let volume = blocking(move || replication.open("v")).await.unwrap();
    let write_and_flush = |round: u8| {
        let io = volume.clone();
        blocking(move || {
            io.write(u64::from(round) * 65536, &pattern(round), false)?;
            io.flush()
        })
    };
    write_and_flush(0).await.unwrap();

    network.lose_answers(primary_id, keel_cluster::messages::METHOD_PROPOSE);
    let replication = primary_node.replication.clone();
    let raised =
        blocking(move || replication.set_replicas("v", Some(3), None, Placement::default())).await;
    network.keep_answers();
    raised.expect("a raise of R that Raft made failed because its answer was lost");
    assert!(replica_set(primary_node, "v").contains(&third_id));
    let volume_id = volume_id(primary_node, "v");
    let status = primary_node.replication.primary_status(volume_id).unwrap();
    assert_eq!(status.closed, None, "the primary stopped serving");

    write_and_flush(1)
        .await
        .expect("the client's I/O failed after the settled change");
    wait_for("the added replica in sync", || {
        in_sync(primary_node, "v").contains(&third_id)
    })
    .await;
    write_and_flush(2).await.unwrap();
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

// Proves a replica refuses a stream from an old primary once another node took the volume
// over: R=3, the primary catching one replica up slowly (rate-limited) when it is cut off
// from the other replica's node, which leads Raft and takes the volume over; the primary can
// still reach the replica it was catching up, and keeps sending it (a catch-up's copies are
// not client I/O, which the lapsed lease stops). That replica must fence it, by the catalog's
// primary, which closes the old primary; without the check the replica takes either
// primary's stream, each replacing the other's, and the old one never learns it was replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_fences_an_old_primary_still_catching_it_up_after_a_take_over() {
    let network = LocalNetwork::new();
    let (nodes, primary, _) = replicated_volume(&network, "fenced", 64, 3, Some(128 << 10)).await;
    let ids: Vec<NodeId> = nodes.iter().map(|n| n.cluster.node_id()).collect();
    let old = &nodes[primary];
    let old_id = old.cluster.node_id();
    let catalog = old
        .cluster
        .catalog()
        .read()
        .volume("v")
        .unwrap()
        .record
        .clone();
    let (heir_id, caught_up_id) = (
        catalog.replication.replicas[1],
        catalog.replication.replicas[2],
    );
    let node = |id: NodeId| nodes.iter().find(|n| n.cluster.node_id() == id).unwrap();
    let heir = node(heir_id);
    lead(&nodes, heir_id).await;

    let replication = old.replication.clone();
    let volume = blocking(move || replication.open("v")).await.unwrap();
    wait_for("all three in sync", || in_sync(old, "v").len() == 3).await;
    // The third replica misses the whole volume's writes: its catch-up ships 4 MiB at
    // 128 KiB/s, about 30 s.
    network.partition(&[caught_up_id], &ids);
    let io = volume.clone();
    blocking(move || {
        for unit in 0..64u64 {
            io.write(unit * 65536, &pattern(unit as u8), false).unwrap();
        }
        io.flush().unwrap();
    })
    .await;
    network.heal();
    let volume_id = catalog.id;
    wait_for("the catch-up under way", || {
        old.replication
            .primary_status(volume_id)
            .is_some_and(|status| !status.catching_up.is_empty())
    })
    .await;

    // Cut off from the leader and the heir, not from the replica it is catching up.
    network.partition(&[old_id], &[old_id, heir_id]);
    let _taken_over = open_when_possible(heir).await;
    wait_for(
        "the old primary fenced by the replica it was catching up",
        || old.replication.primary_status(volume_id).is_none(),
    )
    .await;
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

// Proves a snapshot whose data a replica lacks is copied to it: an R=1 volume is written and
// snapshotted twice (`s1`, then `s2` after an overwrite) and overwritten again; raised to R=2,
// the new replica (placed after both) is caught up with the current contents only. Both
// snapshots then become complete on it, and its own copy of each — and of `s3`, taken with it
// in sync — shows exactly what the primary's does (a block trimmed before `s2` included), while
// its current contents are untouched by the repairs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_a_replica_lacks_are_copied_to_it() {
    let network = LocalNetwork::new();
    let (nodes, primary, replica) =
        replicated_volume(&network, "snapshot_repair", 64, 1, None).await;
    let primary_node = &nodes[primary];
    let replica_node = &nodes[replica];
    let replication = primary_node.replication.clone();
    let volume = blocking(move || replication.open("v")).await.unwrap();
    let write = |unit: u64, round: u8| {
        let io = volume.clone();
        blocking(move || {
            io.write(unit * 65536, &pattern(round), false).unwrap();
            io.flush().unwrap();
        })
    };
    let snapshot = |name: &'static str| {
        let replication = primary_node.replication.clone();
        let volumes = primary_node.volumes.clone();
        blocking(move || {
            replication
                .quiesce("v", || volumes.snapshot_create("v", name))
                .unwrap()
        })
    };
    write(0, 1).await;
    write(1, 2).await;
    // Unit 3: written, then trimmed: the snapshot after shows zeroes there.
    write(3, 9).await;
    snapshot("s1").await;
    write(0, 3).await;
    let io = volume.clone();
    blocking(move || io.trim(3 * 65536, 65536).unwrap()).await;
    snapshot("s2").await;
    write(1, 4).await;
    write(2, 5).await;

    let replication = primary_node.replication.clone();
    blocking(move || replication.set_replicas("v", Some(2), None, Placement::default()))
        .await
        .unwrap();
    let replica_id = replica_node.cluster.node_id();
    wait_for("the new replica in sync", || {
        in_sync(primary_node, "v").contains(&replica_id)
    })
    .await;
    write(2, 6).await;
    snapshot("s3").await;
    let complete = |node: &TestNode| {
        node.cluster
            .catalog()
            .read()
            .volume("v")
            .is_some_and(|entry| {
                entry.snapshots.len() == 3
                    && entry
                        .snapshots
                        .values()
                        .all(|snapshot| snapshot.incomplete_on.is_empty())
            })
    };
    wait_for("every snapshot complete on the new replica", || {
        complete(replica_node)
    })
    .await;

    // (snapshot, unit) → the round written there, or None for zeroes.
    let expected: [(&str, [Option<u8>; 4]); 3] = [
        ("s1", [Some(1), Some(2), None, Some(9)]),
        ("s2", [Some(3), Some(2), None, None]),
        ("s3", [Some(3), Some(4), Some(6), None]),
    ];
    let read_units = |volume: Arc<dyn VolumeIo>| {
        blocking(move || {
            (0..4u64)
                .map(|unit| {
                    let mut buf = vec![0u8; 65536];
                    volume.read(unit * 65536, &mut buf).unwrap();
                    buf
                })
                .collect::<Vec<_>>()
        })
    };
    let shows = |data: &[Vec<u8>], units: &[Option<u8>; 4]| {
        data.iter().zip(units).all(|(data, round)| match round {
            Some(round) => *data == pattern(*round),
            None => data.iter().all(|byte| *byte == 0),
        })
    };
    for (name, units) in &expected {
        for node in [primary_node, replica_node] {
            let volumes = node.volumes.clone();
            let snapshot_name = name.to_string();
            let copy = blocking(move || volumes.open_snapshot("v", &snapshot_name))
                .await
                .unwrap_or_else(|error| panic!("snapshot {name}: {error}"));
            let data = read_units(copy).await;
            assert!(
                shows(&data, units),
                "node {}'s copy of snapshot {name} does not hold its data",
                node.cluster.node_id()
            );
        }
    }
    let volumes = replica_node.volumes.clone();
    let current = blocking(move || volumes.open_volume("v")).await.unwrap();
    let data = read_units(current).await;
    assert!(
        shows(&data, &[Some(3), Some(4), Some(6), None]),
        "the repairs changed the replica's current contents"
    );
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

// Proves a catch-up compares the replica's copy as the volume is after the change that made
// it necessary: a rollback onto a snapshot the replica never had the data of takes it out of
// the in-sync set, and its catch-up must ship every block the snapshot holds. Raft's appends
// to the replica are held from just before the rollback, so its metadata still shows the
// volume as it was. Without waiting for the primary's metadata first, the replica compared
// its pre-rollback view (the same data, written after the snapshot), the catch-up shipped
// only the block rewritten since, and once the rollback reached the replica its copy read
// zeroes everywhere else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_compares_the_replica_as_the_change_left_it_not_as_its_metadata_lags() {
    use keel_cluster::messages::METHOD_RAFT_APPEND;
    let network = LocalNetwork::new();
    let (nodes, primary, replica) = replica_lacking_a_snapshot(
        &network,
        "catch-up-metadata",
        8,
        keel_replication::POINT_EVERY,
    )
    .await;
    let (primary_node, replica_node) = (&nodes[primary], &nodes[replica]);
    let replica_id = replica_node.cluster.node_id();
    let write = |volume: Arc<dyn VolumeIo>, unit: u64, round: u8| {
        blocking(move || {
            volume.write(unit * 65536, &pattern(round), false).unwrap();
            volume.flush().unwrap();
        })
    };
    let replication = primary_node.replication.clone();
    let volume = blocking(move || replication.open("v")).await.unwrap();
    write(volume.clone(), 0, 100).await;
    drop(volume);

    let (replication, volumes) = (
        primary_node.replication.clone(),
        primary_node.volumes.clone(),
    );
    let (held, lagging, leader) = (
        network.clone(),
        replica_node.cluster.clone(),
        primary_node.cluster.clone(),
    );
    blocking(move || {
        replication.rollback("v", "s1", || {
            // The replica applied its removal from the in-sync set (its epoch): only what
            // comes next, the rollback, is held from it.
            while lagging.applied_index() < leader.applied_index() {
                std::thread::sleep(Duration::from_millis(2));
            }
            held.hold(replica_id, METHOD_RAFT_APPEND);
            volumes.rollback("v", "s1")
        })
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    network.release();
    wait_for("the replica back in sync after the rollback", || {
        in_sync(primary_node, "v").contains(&replica_id)
    })
    .await;
    let volumes = replica_node.volumes.clone();
    let copy = blocking(move || volumes.open_volume("v")).await.unwrap();
    assert_rounds_kept(copy, 8, "from the replica's copy in the catch-up").await;
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

// Proves a replica refuses a late batch of the stream a rollback dropped it from: the batch
// was queued before the rollback, and once the replica's own catalog took the rollback,
// applied it would land in the rolled-back volume (and, naming an earlier FLUSH common, keep
// a common point), after the catch-up may already have compared that block. The simulation
// found it (seed 318 once R changed: a copy that differed from the primary's once in sync).
// The replica lacks the snapshot, so the rollback drops it; its stream's batches and the
// catch-up's questions are held from before the rollback until the replica's catalog has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_batch_of_the_stream_a_rollback_ended_is_refused() {
    use keel_replication::wire::{
        METHOD_CHANGED, METHOD_HASHES, METHOD_REPLICATE, METHOD_UNWRITTEN,
    };
    let network = LocalNetwork::new();
    let every = Duration::from_secs(1);
    let (nodes, primary, replica) =
        replica_lacking_a_snapshot(&network, "late-after-rollback", 0, every).await;
    let (primary_node, replica_node) = (&nodes[primary], &nodes[replica]);
    let (primary_id, replica_id) = (
        primary_node.cluster.node_id(),
        replica_node.cluster.node_id(),
    );
    let generation = |node: &TestNode| {
        node.cluster
            .catalog()
            .read()
            .volume("v")
            .unwrap()
            .record
            .generation
    };
    let before = generation(replica_node);
    let replication = primary_node.replication.clone();
    let volume = blocking(move || replication.open("v")).await.unwrap();
    let write = |unit: u64, flush: bool| {
        let volume = volume.clone();
        blocking(move || {
            volume
                .write(unit * 65536, &pattern(unit as u8), false)
                .unwrap();
            if flush {
                volume.flush().unwrap();
            }
        })
    };
    write(0, true).await;
    tokio::time::sleep(every + Duration::from_millis(200)).await;
    network.hold(replica_id, METHOD_REPLICATE);
    // (The catch-up after the rollback waits too, for the replica's answers, so its new
    // stream starts after the late batch.)
    for method in [METHOD_CHANGED, METHOD_UNWRITTEN, METHOD_HASHES] {
        network.hold(replica_id, method);
    }
    // This write's batch (naming the FLUSH before it common) waits, undelivered.
    write(3, false).await;
    drop(volume);
    wait_for("a batch of the replica's stream, held", || {
        network.calls_held(replica_id, METHOD_REPLICATE) > 0
    })
    .await;
    let (replication, volumes) = (
        primary_node.replication.clone(),
        primary_node.volumes.clone(),
    );
    blocking(move || replication.rollback("v", "s1", || volumes.rollback("v", "s1")))
        .await
        .unwrap();
    wait_for("the replica's catalog to take the rollback", || {
        generation(replica_node) > before
    })
    .await;
    let point_before = replica_node
        .replication
        .common_point("v", primary_id)
        .unwrap();
    let received = replica_node.replication.counters().received_bytes();
    network.release_calls(replica_id, METHOD_REPLICATE);
    // Delivered and answered at once in-process; nothing else reaches the replica meanwhile.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        replica_node.replication.counters().received_bytes(),
        received,
        "the replica applied a batch queued before the rollback after it"
    );
    let volumes = replica_node.volumes.clone();
    let unit3 = blocking(move || {
        let copy = volumes.open_volume("v").unwrap();
        let mut buf = vec![0u8; 65536];
        copy.read(3 * 65536, &mut buf).unwrap();
        buf
    })
    .await;
    assert!(
        unit3.iter().all(|byte| *byte == 0),
        "a write made before the rollback shows in the replica's rolled-back copy"
    );
    assert_eq!(
        replica_node
            .replication
            .common_point("v", primary_id)
            .unwrap(),
        point_before,
        "the late batch kept a common point after the rollback"
    );
    network.release();
    wait_for("the replica back in sync after the rollback", || {
        in_sync(primary_node, "v").contains(&replica_id)
    })
    .await;
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

// Proves a replica never applies a late batch of a replaced stream over what a newer stream
// wrote: a batch that starts a stream (index 0) in an epoch older than the stream the replica
// applies — one a primary's node sent before it restarted and took the volume over again, or
// one of a primary that was replaced — is refused, the replica's copy keeps the newer data,
// and the current stream goes on (the replica stays in sync). Without the check the replica
// took it as a new stream: the late write landed over the flushed one, and the current stream
// failed on its next batch, leaving a copy the primary does not know differs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_batch_of_a_replaced_stream_is_not_applied_over_a_newer_one() {
    use keel_replication::wire::{Batch, Op, CODE_OUT_OF_ORDER, METHOD_REPLICATE};
    let network = LocalNetwork::new();
    let (nodes, primary, replica) = replicated_volume(&network, "late-stream", 16, 2, None).await;
    let primary_node = &nodes[primary];
    let replica_node = &nodes[replica];
    let (primary_id, replica_id) = (
        primary_node.cluster.node_id(),
        replica_node.cluster.node_id(),
    );
    let replication = primary_node.replication.clone();
    let volume = blocking(move || replication.open("v")).await.unwrap();
    wait_for("the replica in sync", || {
        in_sync(primary_node, "v").contains(&replica_id)
    })
    .await;
    let io = volume.clone();
    blocking(move || {
        io.write(0, &pattern(1), false).unwrap();
        io.flush().unwrap();
    })
    .await;
    let record = primary_node
        .cluster
        .catalog()
        .read()
        .volume("v")
        .unwrap()
        .record
        .clone();
    assert!(record.replication.epoch > 1);

    // A first batch of another stream, from the primary's node, in an older epoch.
    let late = Batch {
        volume_id: record.id,
        epoch: record.replication.epoch - 1,
        stream: 0x1a7e,
        index: 0,
        ops: vec![Op::Write {
            offset: 0,
            data: pattern(9).into(),
        }],
        flush: true,
        catalog_index: 0,
        generation: record.generation,
        common_index: None,
        common_with: Vec::new(),
    };
    let transport = network.transport(&primary_node.address, Arc::new(move || primary_id));
    let answer = keel_cluster::Transport::call(
        &transport,
        keel_cluster::Peer::Node {
            id: replica_id,
            address: replica_node.address.clone(),
        },
        METHOD_REPLICATE,
        postcard::to_allocvec(&late).unwrap().into(),
        Duration::from_secs(5),
    )
    .await;
    match answer {
        Err(keel_cluster::TransportError::Remote { code, .. }) => {
            assert_eq!(code, CODE_OUT_OF_ORDER, "refused, but not as out of order")
        }
        other => panic!("a late batch of an older stream was taken: {other:?}"),
    }
    let replica_volumes = replica_node.volumes.clone();
    let unit0 = blocking(move || {
        let copy = replica_volumes.open_volume("v").unwrap();
        let mut buf = vec![0u8; 65536];
        copy.read(0, &mut buf).unwrap();
        buf
    })
    .await;
    assert!(unit0 == pattern(1), "the late write landed on the replica");

    // The current stream goes on: the next FLUSH counts the replica, still in sync.
    let io = volume.clone();
    let catalog = primary_node.cluster.catalog().clone();
    let in_sync_at_flush = blocking(move || {
        io.write(65536, &pattern(2), false).unwrap();
        io.flush().unwrap();
        let state = catalog.read();
        state
            .volume("v")
            .unwrap()
            .record
            .replication
            .in_sync
            .to_vec()
    })
    .await;
    assert!(
        in_sync_at_flush.contains(&replica_id),
        "the current stream failed after the late batch"
    );
    let replica_volumes = replica_node.volumes.clone();
    let unit1 = blocking(move || {
        let copy = replica_volumes.open_volume("v").unwrap();
        let mut buf = vec![0u8; 65536];
        copy.read(65536, &mut buf).unwrap();
        buf
    })
    .await;
    assert!(unit1 == pattern(2), "the next write is not on the replica");
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

// Proves a node sends at most `rebuilds_max` whole-volume catch-ups at once: two R=1 volumes
// with their one replica on the same node are raised to R=2 together, with one turn and a
// rate that makes each copy last seconds. The second copy must wait (shown as waiting for a
// turn) until the first replica is in sync, then go; without the limit both copy at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_copies_sent_from_a_node_take_turns() {
    let network = LocalNetwork::new();
    let settings = one_turn(2 << 20);
    let (nodes, primary, _) = replicated_volume_with(&network, "turns", 64, 1, settings).await;
    let primary_node = &nodes[primary];
    let volumes = primary_node.volumes.clone();
    blocking(move || volumes.create(&VolumeSpec::new("w", 64 * 65536)).unwrap()).await;
    let names = ["v", "w"];
    for name in names {
        assert_eq!(
            replica_set(primary_node, name),
            vec![primary_node.cluster.node_id()]
        );
        let (replication, volumes) = (
            primary_node.replication.clone(),
            primary_node.volumes.clone(),
        );
        blocking(move || {
            let io = volumes.open_volume(name).unwrap();
            for unit in 0..64u8 {
                io.write(u64::from(unit) * 65536, &pattern(unit), false)
                    .unwrap();
            }
            io.flush().unwrap();
            replication
                .set_replicas(name, Some(2), None, Placement::default())
                .unwrap();
        })
        .await;
    }
    let copies = names.map(|name| (primary_node, name));
    let (waited, overlapped) = watch_copies(&copies, Duration::from_secs(60)).await;
    assert!(!overlapped, "two whole copies went at once with one turn");
    assert!(waited, "no copy was shown waiting for its turn");
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

// Proves a node receives at most `rebuilds_max` whole-volume copies at once, from any number
// of primaries: nodes a and b share a zone, c is alone in another; an R=1 volume on a and one
// on b, raised to R=2 together, both get their new replica on c. Each primary has a turn of
// its own to send with, and a rate that makes each copy last longer than a turn's 10 s lease
// (so it holds the turn only by renewing it): the second copy must wait (shown as waiting
// for a turn) until the first replica is in sync, then go; without the receiving node's
// limit, or with renewals lost, both copy at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_copies_received_by_a_node_take_turns() {
    let network = LocalNetwork::new();
    // 64 MiB each: about 11 s, a 1 MiB chunk every 0.17 s.
    let settings = one_turn(6 << 20);
    let (x, y) = ([("zone", "x")], [("zone", "y")]);
    let nodes = start_three(&network, "receive-turns", settings, [&x, &x, &y]).await;
    let receiver = nodes[2].cluster.node_id();
    let copies = [(&nodes[0], "v"), (&nodes[1], "w")];
    for (node, name) in copies {
        let (replication, volumes) = (node.replication.clone(), node.volumes.clone());
        blocking(move || {
            volumes
                .create(&VolumeSpec::new(name, 1024 * 65536))
                .unwrap();
            let io = volumes.open_volume(name).unwrap();
            for unit in 0..1024u64 {
                io.write(unit * 65536, &pattern(unit as u8), false).unwrap();
            }
            io.flush().unwrap();
            replication
                .set_replicas(name, Some(2), None, Placement::default())
                .unwrap();
        })
        .await;
        let placed = replica_set(node, name);
        assert_eq!(placed, vec![node.cluster.node_id(), receiver], "{name}");
    }
    let (waited, overlapped) = watch_copies(&copies, Duration::from_secs(120)).await;
    assert!(
        !overlapped,
        "node c received two whole copies at once with one turn"
    );
    assert!(waited, "no copy was shown waiting for its turn");
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

/// Settings with one turn for whole copies, which a resync ships at `bytes_per_second`.
fn one_turn(bytes_per_second: u64) -> Settings {
    Settings {
        move_after: Duration::from_secs(3600),
        resync_bytes_per_second: Some(bytes_per_second),
        resync_busy_percent: 100,
        rebuilds_max: 1,
        snapshot_repair: true,
        point_every: keel_replication::POINT_EVERY,
    }
}

/// Watches the whole copies of `volumes` (each: the node serving it as primary, its name)
/// until each has two replicas in sync, failing after `within`: whether any copy was shown
/// waiting for a turn, and whether two ever compared at once.
async fn watch_copies(volumes: &[(&TestNode, &str)], within: Duration) -> (bool, bool) {
    let ids: Vec<_> = (volumes.iter())
        .map(|(node, name)| {
            node.cluster
                .catalog()
                .read()
                .volume(name)
                .unwrap()
                .record
                .id
        })
        .collect();
    let deadline = std::time::Instant::now() + within;
    let (mut waited, mut overlapped) = (false, false);
    while !(volumes.iter()).all(|(node, name)| in_sync(node, name).len() == 2) {
        assert!(
            std::time::Instant::now() < deadline,
            "the copies never ended"
        );
        let copying: Vec<_> = (volumes.iter().zip(&ids))
            .filter_map(|((node, _), id)| node.replication.primary_status(*id))
            .flat_map(|status| status.catching_up)
            .collect();
        waited |= copying.iter().any(|catch_up| catch_up.waiting_for_turn);
        overlapped |= copying
            .iter()
            .filter(|catch_up| catch_up.compared_bytes > 0)
            .count()
            > 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (waited, overlapped)
}

/// Starts nodes a, b and c (b and c joining through a) with failure-domain `labels`, and
/// waits until every node sees three voters.
async fn start_three(
    network: &LocalNetwork,
    test: &str,
    settings: Settings,
    labels: [&[(&str, &str)]; 3],
) -> Vec<TestNode> {
    let a = start(network, test, "a", None, settings, labels[0]).await;
    let join = Some(a.address.clone());
    let b = start(network, test, "b", join.clone(), settings, labels[1]).await;
    let c = start(network, test, "c", join, settings, labels[2]).await;
    let nodes = vec![a, b, c];
    wait_for("three voters on every node", || {
        nodes.iter().all(|n| {
            let metrics = n.cluster.metrics();
            metrics.membership_config.voter_ids().count() == 3
                && metrics.membership_config.get_joint_config().len() == 1
        })
    })
    .await;
    nodes
}

/// Starts three nodes and a volume `v` of `units` 64 KiB units with `replicas` replicas;
/// returns the nodes and the indexes of the volume's first replica (where it is attached) and
/// its second (or another node, with one replica).
async fn replicated_volume(
    network: &LocalNetwork,
    test: &str,
    units: u64,
    replicas: u8,
    resync_bytes_per_second: Option<u64>,
) -> (Vec<TestNode>, usize, usize) {
    let settings = Settings {
        move_after: Duration::from_secs(3600),
        resync_bytes_per_second,
        resync_busy_percent: 100,
        rebuilds_max: 2,
        snapshot_repair: true,
        point_every: keel_replication::POINT_EVERY,
    };
    replicated_volume_with(network, test, units, replicas, settings).await
}

// Proves a client attaching while R is raised writes through the primary: the attach reads
// the volume's record and then waits for the engine's attach lock, which raising R holds
// while Raft records the new replicas. An attach that read R=1 before must not go on serving
// the local copy alone once R=2 is recorded: its writes would never reach the new replica,
// which the primary nevertheless catches up and counts in sync. Each round starts the two at
// once on a fresh volume (either may take the lock first), then writes through the attached
// handle once the new replica is in sync and reads the replica's own copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_attaching_as_r_is_raised_writes_through_the_primary() {
    let network = LocalNetwork::new();
    let (nodes, primary, _) = replicated_volume(&network, "attach_raise", 4, 1, None).await;
    let primary_node = &nodes[primary];
    let primary_id = primary_node.cluster.node_id();
    lead(&nodes, primary_id).await;
    for round in 0..8u8 {
        let name = format!("raised{round}");
        let volume = attach_as_r_changes(primary_node, &name, 1, 2)
            .await
            .unwrap();
        let replica_id = *replica_set(primary_node, &name)
            .iter()
            .find(|id| **id != primary_id)
            .unwrap();
        wait_for("the new replica in sync", || {
            in_sync(primary_node, &name).contains(&replica_id)
        })
        .await;
        let io = volume.clone();
        blocking(move || {
            io.write(65536, &pattern(round), false).unwrap();
            io.flush().unwrap();
        })
        .await;
        let replica_node = nodes
            .iter()
            .find(|node| node.cluster.node_id() == replica_id)
            .unwrap();
        let (volumes, copy_name) = (replica_node.volumes.clone(), name.clone());
        let held = blocking(move || {
            let copy = volumes.open_volume(&copy_name).unwrap();
            let mut buf = vec![0u8; 65536];
            copy.read(65536, &mut buf).unwrap();
            buf
        })
        .await;
        assert!(
            held == pattern(round),
            "round {round}: a write flushed through the handle attached as R was raised is not \
             on the new replica, which is in sync"
        );
    }
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

/// Creates volume `name` with `from` replicas through `node` (which hosts the first), then
/// starts an attach of it there and a change of its R to `to` at once (either may take the
/// attach lock first). Returns the attach's answer once both ended; the change must succeed.
async fn attach_as_r_changes(
    node: &TestNode,
    name: &str,
    from: u8,
    to: u8,
) -> VolumeResult<Arc<dyn VolumeIo>> {
    let (volumes, spec_name) = (node.volumes.clone(), name.to_string());
    blocking(move || {
        let mut spec = VolumeSpec::new(&spec_name, 4 * 65536);
        spec.replicas = from;
        volumes.create(&spec).unwrap()
    })
    .await;
    assert_eq!(replica_set(node, name)[0], node.cluster.node_id());
    let start = Arc::new(std::sync::Barrier::new(2));
    let (replication, change_start, change_name) =
        (node.replication.clone(), start.clone(), name.to_string());
    let changed = on_thread(move || {
        change_start.wait();
        replication.set_replicas(&change_name, Some(to), None, Placement::default())
    });
    let (replication, open_name) = (node.replication.clone(), name.to_string());
    let attached = blocking(move || {
        start.wait();
        replication.open(&open_name)
    })
    .await;
    tokio::time::timeout(BLOCKED_MAX, changed)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(replica_set(node, name).len(), usize::from(to));
    attached
}

// Proves a client attaching as R is lowered to one attaches: an attach that read R=2 and then
// waited for the attach lock, which lowering R holds while Raft records it, finds one replica
// once it holds the lock, and serves the local copy rather than fail. Each round starts the
// two at once on a fresh R=2 volume nobody serves, then writes and reads through the handle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_attaching_as_r_is_lowered_attaches() {
    let network = LocalNetwork::new();
    let (nodes, primary, _) = replicated_volume(&network, "attach_lower", 4, 1, None).await;
    let primary_node = &nodes[primary];
    let primary_id = primary_node.cluster.node_id();
    lead(&nodes, primary_id).await;
    for round in 0..8u8 {
        let name = format!("lowered{round}");
        let volume = attach_as_r_changes(primary_node, &name, 2, 1)
            .await
            .unwrap_or_else(|error| {
                panic!("round {round}: the attach failed as R was lowered: {error}")
            });
        assert_eq!(replica_set(primary_node, &name), vec![primary_id]);
        let held = blocking(move || {
            volume.write(0, &pattern(round), false).unwrap();
            volume.flush().unwrap();
            let mut buf = vec![0u8; 65536];
            volume.read(0, &mut buf).unwrap();
            buf
        })
        .await;
        assert!(
            held == pattern(round),
            "round {round}: the write was not read back"
        );
    }
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

// Proves a change of a replicated volume that no primary serves yet (a snapshot here) holds
// attaches back until it is made: an attach meanwhile would start a primary whose writes the
// replicas could meet on either side of the change, which then runs at no single point of
// the write stream. The attach starts inside the change and must still be waiting half a
// second later; it completes once the change is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_waits_for_a_change_of_a_volume_nobody_serves() {
    let network = LocalNetwork::new();
    let (nodes, primary, _) = replicated_volume(&network, "change_unserved", 4, 2, None).await;
    let primary_node = &nodes[primary];
    let volume_id = volume_id(primary_node, "v");
    assert!(
        primary_node.replication.primary_status(volume_id).is_none(),
        "the volume is served before any attach: the change would go through its primary"
    );
    let (replication, volumes) = (
        primary_node.replication.clone(),
        primary_node.volumes.clone(),
    );
    let (attached_early, attached) = blocking(move || {
        let (done, attached) = std::sync::mpsc::channel();
        let attacher = replication.clone();
        let early = replication
            .quiesce("v", || {
                std::thread::spawn(move || {
                    let _ = done.send(attacher.open("v").map(|_| ()));
                });
                std::thread::sleep(Duration::from_millis(500));
                let early = attached.try_recv().is_ok();
                volumes.snapshot_create("v", "s1").map(|_| early)
            })
            .unwrap();
        (early, attached)
    })
    .await;
    assert!(
        !attached_early,
        "a client attached while a change of a volume nobody served was being made"
    );
    blocking(move || attached.recv_timeout(BLOCKED_MAX))
        .await
        .expect("the attach did not complete after the change")
        .expect("the attach failed after the change");
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

// Proves a rollback decides which replicas start over with no change of the replica set in
// flight: a replica added between that decision and the rollback would catch up across it,
// keeping the chunks it copied before (hidden by its own rollback onto a snapshot it never
// had), and join the in-sync set without them. R is raised from 2 to 3 as the rollback
// starts: Raft's appends are held so the raise is on its way when the rollback looks at the
// set, and held again once the new replica is recorded, for the rollback's first drop, while
// the new replica's catch-up copies chunks (paced so that it is still under way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_drops_a_replica_added_as_it_starts() {
    use keel_cluster::messages::METHOD_RAFT_APPEND;
    // 16 MiB, caught up at 16 MiB/s.
    const UNITS: u64 = 256;
    let network = LocalNetwork::new();
    let settings = Settings {
        move_after: Duration::from_secs(3600),
        resync_bytes_per_second: Some(16 << 20),
        resync_busy_percent: 100,
        rebuilds_max: 2,
        snapshot_repair: false,
        point_every: keel_replication::POINT_EVERY,
    };
    let (nodes, primary, _) =
        replicated_volume_with(&network, "rollback_raise", UNITS, 1, settings).await;
    let primary_node = &nodes[primary];
    let primary_id = primary_node.cluster.node_id();
    lead(&nodes, primary_id).await;
    let replication = primary_node.replication.clone();
    let volume = blocking(move || replication.open("v")).await.unwrap();
    let write_units = |volume: Arc<dyn VolumeIo>, round: u8| {
        blocking(move || {
            for unit in 0..UNITS {
                let data = pattern((unit as u8).wrapping_add(round));
                volume.write(unit * 65536, &data, false).unwrap();
            }
            volume.flush().unwrap();
        })
    };
    // The snapshot on the primary alone; the second replica lacks it (no repair).
    write_units(volume.clone(), 0).await;
    let (replication, volumes) = (
        primary_node.replication.clone(),
        primary_node.volumes.clone(),
    );
    blocking(move || replication.quiesce("v", || volumes.snapshot_create("v", "s1")))
        .await
        .unwrap();
    let replication = primary_node.replication.clone();
    blocking(move || replication.set_replicas("v", Some(2), None, Placement::default()))
        .await
        .unwrap();
    let second = *replica_set(primary_node, "v")
        .iter()
        .find(|id| **id != primary_id)
        .unwrap();
    wait_for("the second replica in sync", || {
        in_sync(primary_node, "v").contains(&second)
    })
    .await;
    write_units(volume.clone(), 100).await;
    drop(volume);

    let followers: Vec<NodeId> = nodes
        .iter()
        .map(|node| node.cluster.node_id())
        .filter(|id| *id != primary_id)
        .collect();
    let hold = |network: &LocalNetwork| {
        for id in &followers {
            network.hold(*id, METHOD_RAFT_APPEND);
        }
    };
    hold(&network);
    let replication = primary_node.replication.clone();
    let raised =
        on_thread(move || replication.set_replicas("v", Some(3), None, Placement::default()));
    tokio::time::sleep(Duration::from_millis(30)).await;
    let (replication, volumes) = (
        primary_node.replication.clone(),
        primary_node.volumes.clone(),
    );
    let rolled_back =
        on_thread(move || replication.rollback("v", "s1", || volumes.rollback("v", "s1")));
    tokio::time::sleep(Duration::from_millis(30)).await;
    network.release();
    // Below the election timeout (300 ms): no follower stands for election meanwhile.
    let catalog = primary_node.cluster.catalog().clone();
    let (held, deadline) = (network.clone(), std::time::Instant::now() + SETTLE);
    let cut_off = followers.clone();
    blocking(move || {
        let recorded = || {
            catalog
                .read()
                .volume("v")
                .is_some_and(|entry| entry.record.replication.replicas.len() == 3)
        };
        while !recorded() && std::time::Instant::now() < deadline {
            std::hint::spin_loop();
        }
        for id in cut_off {
            held.hold(id, METHOD_RAFT_APPEND);
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    network.release();
    tokio::time::timeout(BLOCKED_MAX, raised)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    tokio::time::timeout(BLOCKED_MAX, rolled_back)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let volume_id = volume_id(primary_node, "v");
    let caught_up = tokio::time::timeout(SETTLE, async {
        while in_sync(primary_node, "v").len() < 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    assert!(
        caught_up.await.is_ok(),
        "every replica in sync after the rollback; the primary shows {:?}",
        primary_node.replication.primary_status(volume_id)
    );
    for node in &nodes {
        let volumes = node.volumes.clone();
        let copy = blocking(move || volumes.open_volume("v")).await.unwrap();
        let when = format!("on node {}'s copy", node.cluster.node_id());
        assert_rounds_kept(copy, UNITS, &when).await;
    }
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

// Proves a catch-up waiting for the FLUSH behind the last data it queued stops waiting once a
// rollback ended its stream: that FLUSH was still queued, cleared with the queue, so no
// confirmation could come, and the replica stayed out of sync until the wait's 30 s deadline
// (the rollback's own catch-up found this one under way and left the replica to it). A new
// replica's batches are held, so the four in flight fill the window and its catch-up's FLUSH
// stays queued behind more data; the rollback, onto a snapshot that replica lacks, ends the
// stream; the held batches are then delivered (before the replica's catalog has the rollback,
// so they are taken, not refused: a refusal would fail the stream and end the wait anyway).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_whose_stream_a_rollback_ended_starts_over_at_once() {
    use keel_cluster::messages::METHOD_RAFT_APPEND;
    use keel_replication::wire::METHOD_REPLICATE;
    // 24 MiB: more than the four batches in flight take, less than the queue holds.
    const UNITS: u64 = 384;
    let network = LocalNetwork::new();
    let settings = Settings {
        move_after: Duration::from_secs(3600),
        resync_bytes_per_second: None,
        resync_busy_percent: 100,
        rebuilds_max: 2,
        snapshot_repair: false,
        point_every: keel_replication::POINT_EVERY,
    };
    let (nodes, primary, _) =
        replicated_volume_with(&network, "rollback_ends_catch_up", UNITS, 1, settings).await;
    let primary_node = &nodes[primary];
    let primary_id = primary_node.cluster.node_id();
    lead(&nodes, primary_id).await;
    let replication = primary_node.replication.clone();
    let volume = blocking(move || replication.open("v")).await.unwrap();
    blocking(move || {
        for unit in 0..UNITS {
            volume
                .write(unit * 65536, &pattern(unit as u8), false)
                .unwrap();
        }
        volume.flush().unwrap();
    })
    .await;
    let (replication, volumes) = (
        primary_node.replication.clone(),
        primary_node.volumes.clone(),
    );
    blocking(move || replication.quiesce("v", || volumes.snapshot_create("v", "s1")))
        .await
        .unwrap();
    let followers: Vec<NodeId> = nodes
        .iter()
        .map(|node| node.cluster.node_id())
        .filter(|id| *id != primary_id)
        .collect();
    for id in &followers {
        network.hold(*id, METHOD_REPLICATE);
    }
    let replication = primary_node.replication.clone();
    blocking(move || replication.set_replicas("v", Some(2), None, Placement::default()))
        .await
        .unwrap();
    let second = *replica_set(primary_node, "v")
        .iter()
        .find(|id| **id != primary_id)
        .unwrap();
    let second_node = nodes
        .iter()
        .find(|node| node.cluster.node_id() == second)
        .unwrap();
    wait_for("the new replica's catalog to list it", || {
        replica_set(second_node, "v").contains(&second)
    })
    .await;
    // Its batches time out 2 s after they were sent: everything up to their release is quick.
    wait_for("four batches of the new replica's catch-up, held", || {
        network.calls_held(second, METHOD_REPLICATE) >= 4
    })
    .await;
    // (The catch-up queues the rest, then its FLUSH.)
    tokio::time::sleep(Duration::from_millis(100)).await;
    network.hold(second, METHOD_RAFT_APPEND);
    let generation = |node: &TestNode| {
        node.cluster
            .catalog()
            .read()
            .volume("v")
            .unwrap()
            .record
            .generation
    };
    let before = generation(primary_node);
    let (replication, volumes) = (
        primary_node.replication.clone(),
        primary_node.volumes.clone(),
    );
    let rolled_back =
        on_thread(move || replication.rollback("v", "s1", || volumes.rollback("v", "s1")));
    // The rollback ended the stream before it made the change.
    wait_for("the rollback recorded", || {
        generation(primary_node) > before
    })
    .await;
    assert!(
        generation(second_node) <= before,
        "the new replica's catalog took the rollback while its appends were held"
    );
    network.release_calls(second, METHOD_REPLICATE);
    tokio::time::sleep(Duration::from_millis(100)).await;
    network.release();
    tokio::time::timeout(BLOCKED_MAX, rolled_back)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    // Caught up again from the start (24 MiB) without the 30 s wait.
    let volume_id = volume_id(primary_node, "v");
    let caught_up = tokio::time::timeout(Duration::from_secs(15), async {
        while !in_sync(primary_node, "v").contains(&second) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    assert!(
        caught_up.await.is_ok(),
        "the new replica in sync after the rollback; the primary shows {:?}",
        primary_node.replication.primary_status(volume_id)
    );
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

// Proves lowering R never removes the only replica holding a snapshot whole: a snapshot taken
// while one replica was out of the in-sync set is whole on the others only, and after that
// replica took the volume over (no snapshot repair here) the old primary alone holds it.
// Lowering R to 1 would remove that replica, so it is refused naming the snapshot; raised to
// 3 and lowered to 2 with that replica out of sync, the replica placed last leaves instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lowering_r_keeps_the_only_whole_copy_of_a_snapshot() {
    let network = LocalNetwork::new();
    let settings = Settings {
        move_after: Duration::from_secs(3600),
        resync_bytes_per_second: None,
        resync_busy_percent: 100,
        rebuilds_max: 2,
        snapshot_repair: false,
        point_every: keel_replication::POINT_EVERY,
    };
    let (nodes, first, second) =
        replicated_volume_with(&network, "lower_keeps_snapshot", 8, 2, settings).await;
    let ids: Vec<NodeId> = nodes.iter().map(|n| n.cluster.node_id()).collect();
    let (first_node, second_node) = (&nodes[first], &nodes[second]);
    let (first_id, second_id) = (first_node.cluster.node_id(), second_node.cluster.node_id());
    let third = nodes
        .iter()
        .find(|n| ![first_id, second_id].contains(&n.cluster.node_id()))
        .unwrap();
    lead(&nodes, third.cluster.node_id()).await;
    let replication = first_node.replication.clone();
    let volume = blocking(move || replication.open("v")).await.unwrap();
    blocking(move || {
        volume.write(0, &pattern(0), false).unwrap();
        volume.flush().unwrap();
    })
    .await;
    wait_for("the second replica in sync", || {
        in_sync(first_node, "v").contains(&second_id)
    })
    .await;

    // The second replica takes the volume over and takes the snapshot, the first cut off.
    network.partition(&[first_id], &ids);
    drop(open_when_possible(second_node).await);
    let (replication, volumes) = (second_node.replication.clone(), second_node.volumes.clone());
    blocking(move || replication.quiesce("v", || volumes.snapshot_create("v", "s1")))
        .await
        .unwrap();
    network.heal();
    wait_for("the first replica back in sync", || {
        in_sync(second_node, "v").contains(&first_id)
    })
    .await;
    // Then the first takes it back: the second alone holds the snapshot whole.
    network.partition(&[second_id], &ids);
    drop(open_when_possible(first_node).await);
    network.heal();
    wait_for("the second replica back in sync", || {
        in_sync(first_node, "v").contains(&second_id)
    })
    .await;
    let whole_on = |node: NodeId| {
        first_node
            .cluster
            .catalog()
            .read()
            .volume("v")
            .and_then(|entry| entry.snapshot_by_name("s1").cloned())
            .is_some_and(|snapshot| snapshot.complete_on(node))
    };
    assert!(whole_on(second_id) && !whole_on(first_id));

    let replication = first_node.replication.clone();
    let refused =
        blocking(move || replication.set_replicas("v", Some(1), None, Placement::default()))
            .await
            .expect_err("lowering R to 1 removed the only replica holding snapshot s1 whole");
    assert!(
        refused.to_string().contains("\"s1\"") && refused.to_string().contains("only replica"),
        "{refused}"
    );
    assert_eq!(replica_set(first_node, "v").len(), 2);

    let replication = first_node.replication.clone();
    blocking(move || replication.set_replicas("v", Some(3), None, Placement::default()))
        .await
        .unwrap();
    let placed_last = third.cluster.node_id();
    wait_for("the third replica in sync", || {
        in_sync(first_node, "v").contains(&placed_last)
    })
    .await;
    // The holder out of sync (cut off): an out-of-sync replica would leave first otherwise.
    network.partition(&[second_id], &ids);
    let replication = first_node.replication.clone();
    blocking(move || {
        let volume = replication.open("v").unwrap();
        volume.write(65536, &pattern(1), false).unwrap();
        volume.flush().unwrap();
    })
    .await;
    assert!(!in_sync(first_node, "v").contains(&second_id));
    let replication = first_node.replication.clone();
    blocking(move || replication.set_replicas("v", Some(2), None, Placement::default()))
        .await
        .unwrap();
    network.heal();
    let mut kept = replica_set(first_node, "v");
    kept.sort_unstable();
    let mut wanted = vec![first_id, second_id];
    wanted.sort_unstable();
    assert_eq!(
        kept, wanted,
        "lowering R to 2 removed the only whole copy of s1"
    );
    stop(&nodes.iter().collect::<Vec<_>>(), None).await;
}

/// An R=1 volume of 8 units whose first `written` units hold `pattern(unit)`, with a snapshot
/// `s1`, then raised to R=2 and in sync: the second replica's copy of `s1` is incomplete (no
/// snapshot repair), so a rollback onto `s1` drops it. Points at most `point_every` apart.
/// Returns the nodes and the indexes of the primary and of the second replica.
async fn replica_lacking_a_snapshot(
    network: &LocalNetwork,
    test: &str,
    written: u64,
    point_every: Duration,
) -> (Vec<TestNode>, usize, usize) {
    let settings = Settings {
        move_after: Duration::from_secs(3600),
        resync_bytes_per_second: None,
        resync_busy_percent: 100,
        rebuilds_max: 2,
        snapshot_repair: false,
        point_every,
    };
    let (nodes, primary, _) = replicated_volume_with(network, test, 8, 1, settings).await;
    let primary_node = &nodes[primary];
    let primary_id = primary_node.cluster.node_id();
    lead(&nodes, primary_id).await;
    let replication = primary_node.replication.clone();
    blocking(move || {
        let volume = replication.open("v").unwrap();
        for unit in 0..written {
            volume
                .write(unit * 65536, &pattern(unit as u8), false)
                .unwrap();
            volume.flush().unwrap();
        }
    })
    .await;
    let (replication, volumes) = (
        primary_node.replication.clone(),
        primary_node.volumes.clone(),
    );
    blocking(move || replication.quiesce("v", || volumes.snapshot_create("v", "s1")))
        .await
        .unwrap();
    let replication = primary_node.replication.clone();
    blocking(move || replication.set_replicas("v", Some(2), None, Placement::default()))
        .await
        .unwrap();
    let replica_id = *replica_set(primary_node, "v")
        .iter()
        .find(|id| **id != primary_id)
        .unwrap();
    wait_for("the new replica in sync", || {
        in_sync(primary_node, "v").contains(&replica_id)
    })
    .await;
    let replica = nodes
        .iter()
        .position(|n| n.cluster.node_id() == replica_id)
        .unwrap();
    (nodes, primary, replica)
}

/// [`replicated_volume`] with the engine's settings given.
async fn replicated_volume_with(
    network: &LocalNetwork,
    test: &str,
    units: u64,
    replicas: u8,
    settings: Settings,
) -> (Vec<TestNode>, usize, usize) {
    let nodes = start_three(network, test, settings, [&[], &[], &[]]).await;
    let volumes = nodes[0].volumes.clone();
    blocking(move || {
        let mut spec = VolumeSpec::new("v", units * 65536);
        spec.replicas = replicas;
        volumes.create(&spec).unwrap()
    })
    .await;
    let placed = replica_set(&nodes[0], "v");
    assert_eq!(placed.len(), usize::from(replicas));
    let index_of = |id: NodeId| {
        nodes
            .iter()
            .position(|n| n.cluster.node_id() == id)
            .unwrap()
    };
    let primary = index_of(placed[0]);
    // With one replica: the node a second one would go to first.
    let replica = placed
        .get(1)
        .map(|id| index_of(*id))
        .unwrap_or((primary + 1) % nodes.len());
    (nodes, primary, replica)
}

/// Makes node `id` the Raft leader, as every node sees it.
async fn lead(nodes: &[TestNode], id: NodeId) {
    nodes[0].cluster.transfer_leadership(id).await.unwrap();
    wait_for("the chosen node to lead everywhere", || {
        nodes.iter().all(|n| n.cluster.leader() == Some(id))
    })
    .await;
}

/// Reads the first `rounds` 64 KiB units of `volume`: unit `r` must hold `pattern(r)`, or the
/// test fails saying the unit was lost `when`.
async fn assert_rounds_kept(volume: Arc<dyn VolumeIo>, rounds: u64, when: &str) {
    let read = blocking(move || {
        (0..rounds)
            .map(|round| {
                let mut buf = vec![0u8; 65536];
                volume.read(round * 65536, &mut buf).unwrap();
                buf
            })
            .collect::<Vec<_>>()
    })
    .await;
    for (round, data) in read.iter().enumerate() {
        assert!(
            *data == pattern(round as u8),
            "round {round} was lost {when}"
        );
    }
}

/// Opens `v` through `node`, retrying while a take-over waits out the old primary's lease.
async fn open_when_possible(node: &TestNode) -> Arc<dyn VolumeIo> {
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        let replication = node.replication.clone();
        match blocking(move || replication.open("v")).await {
            Ok(volume) => return volume,
            Err(error) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no take-over: {error}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

// Proves no flushed write is lost when the links lose and delay messages (Raft's and the
// replication stream's alike) and the replica is cut off and healed at random: a seeded
// workload of 64 KiB writes and FLUSHes runs through the primary, which then dies (killed, or
// cut off from every node while a client goes on writing through it: it must acknowledge no
// FLUSH), right after a FLUSH that counted the replica when one comes; the replica takes the
// volume over, and every unit holds the last value written to it before a FLUSH that
// succeeded, or one written after it, never one the cut-off primary took.
// R=2, seeds 1 to 4 (the machine's threads still vary the schedule), or `KEEL_TEST_SEED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_writes_survive_lossy_links_cuts_and_a_lost_primary() {
    for seed in seeds(4) {
        lossy_run(seed, 2).await;
    }
}

// The same at R=3 (minimum in sync 2: one replica cut off, the primary goes on with the other),
// seeds 1 and 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_writes_survive_lossy_links_cuts_and_a_lost_primary_at_r3() {
    for seed in seeds(2) {
        lossy_run(seed, 3).await;
    }
}

/// The volume's minimum in sync at `replicas` replicas (1 at R=2, 2 at R=3).
fn minimum(replicas: u8) -> usize {
    if replicas >= 3 {
        2
    } else {
        1
    }
}

/// Whether Raft lists fewer replicas in sync than the minimum (writes and FLUSHes fail then).
fn below_minimum(node: &TestNode, replicas: u8) -> bool {
    in_sync(node, "v").len() < minimum(replicas)
}

async fn wait_for_minimum(node: &TestNode, replicas: u8) {
    wait_for("the minimum in sync again", || {
        !below_minimum(node, replicas)
    })
    .await;
}

/// Seeds 1 to `count`, or the one in `KEEL_TEST_SEED`.
fn seeds(count: u64) -> Vec<u64> {
    match std::env::var("KEEL_TEST_SEED") {
        Ok(seed) => vec![seed.parse().expect("KEEL_TEST_SEED is a number")],
        Err(_) => (1..=count).collect(),
    }
}

async fn lossy_run(seed: u64, replicas: u8) {
    use rand::{Rng, SeedableRng};
    const UNITS: u64 = 64;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let network = LocalNetwork::new();
    let test = format!("lossy-r{replicas}-{seed}");
    let (nodes, primary, replica) = replicated_volume(&network, &test, UNITS, replicas, None).await;
    let ids: Vec<NodeId> = nodes.iter().map(|n| n.cluster.node_id()).collect();
    let replica_id = nodes[replica].cluster.node_id();
    let volume = open_when_possible(&nodes[primary]).await;
    // The attach returns with the minimum in sync; the workload cuts one replica off and
    // expects the others to carry on (at R=3, the second replica must have joined).
    wait_for("every replica in sync", || {
        in_sync(&nodes[primary], "v").len() == usize::from(replicas)
    })
    .await;

    // Per unit: the value a successful FLUSH made durable, and the values written since.
    let mut flushed: Vec<Option<u8>> = vec![None; UNITS as usize];
    let mut since_flush: Vec<Vec<u8>> = vec![Vec::new(); UNITS as usize];
    // Per unit, the last value written; and each snapshot with what it must show.
    let mut current: Vec<Option<u8>> = vec![None; UNITS as usize];
    let mut snapshots: Vec<(String, Vec<Option<u8>>)> = Vec::new();
    let (mut flushes, mut failed_flushes, mut cuts) = (0, 0, 0);
    network.set_chaos(seed, 10_000, Duration::from_millis(15));
    let mut cut = false;
    let mut killed_after_flush = false;
    for step in 0..60u32 {
        let roll = rng.gen_range(0..100);
        if roll < 55 {
            let unit = rng.gen_range(0..UNITS);
            let value = (step % 250) as u8 + 1;
            let io = volume.clone();
            let written = blocking(move || io.write(unit * 65536, &pattern(value), false)).await;
            // A write that failed may still have reached the copies: it counts as written.
            since_flush[unit as usize].push(value);
            if written.is_err() {
                if below_minimum(&nodes[primary], replicas) {
                    wait_for_minimum(&nodes[primary], replicas).await;
                    continue;
                }
                break;
            }
            current[unit as usize] = Some(value);
        } else if roll < 60 {
            // A snapshot (not while the replica is cut off: it would wait for it): it cuts the
            // same writes on every replica in sync.
            if cut {
                continue;
            }
            let name = format!("s{step}");
            let replication = nodes[primary].replication.clone();
            let volumes = nodes[primary].volumes.clone();
            let taken =
                blocking(move || replication.quiesce("v", || volumes.snapshot_create("v", &name)))
                    .await;
            match taken {
                Ok(_) => snapshots.push((format!("s{step}"), current.clone())),
                Err(_) => break,
            }
        } else if roll < 90 {
            let io = volume.clone();
            let catalog = nodes[primary].cluster.catalog().clone();
            let flushed_with = blocking(move || {
                io.flush().map(|()| {
                    let state = catalog.read();
                    let record = &state.volume("v").unwrap().record;
                    record.replication.in_sync.contains(&replica_id)
                })
            })
            .await;
            match flushed_with {
                Ok(replica_in_sync) => {
                    flushes += 1;
                    for (unit, values) in since_flush.iter_mut().enumerate() {
                        if let Some(last) = values.last() {
                            flushed[unit] = Some(*last);
                        }
                        values.clear();
                    }
                    // The primary dies right after a FLUSH that counted the replica while
                    // it was cut off, and now and then otherwise: the replica must hold that
                    // FLUSH's writes without any catch-up.
                    if replica_in_sync && (cut || (step > 20 && rng.gen_range(0..4) == 0)) {
                        killed_after_flush = true;
                        break;
                    }
                }
                Err(_) => {
                    failed_flushes += 1;
                    // The other replica was dropped too (a lost message): FLUSHes fail, as the
                    // minimum asks, until it is back.
                    if below_minimum(&nodes[primary], replicas) {
                        wait_for_minimum(&nodes[primary], replicas).await;
                        continue;
                    }
                    break;
                }
            }
        } else if cut {
            // Healed, the replica is caught up and taken back in sync (the workload waits for
            // it, so that most FLUSHes count it).
            network.heal();
            cut = false;
            wait_for("the replica back in sync", || {
                in_sync(&nodes[primary], "v").contains(&replica_id)
            })
            .await;
        } else {
            network.partition(&[replica_id], &ids);
            cut = true;
            cuts += 1;
        }
    }
    assert!(flushes > 0, "R={replicas} seed {seed}: no FLUSH succeeded");
    if !killed_after_flush {
        network.calm();
        network.heal();
        // The take-over needs the replica in sync (a replica that is not refuses it).
        wait_for("the replica in sync", || {
            in_sync(&nodes[primary], "v").contains(&replica_id)
        })
        .await;
    }
    // The primary's end, before healing (nothing it still has in flight may reach the replica
    // first): killed, or cut off from every node while a client goes on writing and flushing
    // through it, as a partitioned old primary would (it must acknowledge no FLUSH).
    let primary_id = nodes[primary].cluster.node_id();
    let isolated = rng.gen_range(0..2) == 0;
    eprintln!(
        "R={replicas} seed {seed}: {flushes} FLUSHes, {failed_flushes} failed, {cuts} cuts, ended right \
         after a FLUSH: {killed_after_flush}, primary {}",
        if isolated { "cut off" } else { "killed" }
    );
    let zombie = if isolated {
        network.heal();
        network.partition(&[primary_id], &ids);
        let io = volume.clone();
        Some(on_thread(move || {
            let mut written = Vec::new();
            let mut flushed_upto = 0;
            for k in 0..20u8 {
                let (unit, value) = (u64::from(k) % UNITS, 251 + k % 5);
                if io.write(unit * 65536, &pattern(value), false).is_err() {
                    break;
                }
                written.push((unit as usize, value));
                if io.flush().is_err() {
                    break;
                }
                flushed_upto = written.len();
            }
            (written, flushed_upto)
        }))
    } else {
        network.close(&nodes[primary].address);
        nodes[primary].cluster.shutdown().await;
        None
    };
    network.calm();
    if !isolated {
        network.heal();
    }
    let taken_over = open_when_possible(&nodes[replica]).await;
    if let Some(zombie) = zombie {
        let (written, flushed_upto) = tokio::time::timeout(SETTLE, zombie)
            .await
            .expect("the cut-off primary's FLUSH neither failed nor completed")
            .unwrap();
        assert_eq!(
            flushed_upto, 0,
            "R={replicas} seed {seed}: the primary cut off from every node acknowledged a FLUSH"
        );
        // Its writes are not allowed below: none reached the replica while it was cut off, and
        // once healed the replica, now primary, refuses what it still sends (fenced).
        eprintln!(
            "R={replicas} seed {seed}: the cut-off primary took {} writes",
            written.len()
        );
        network.heal();
    }
    let found = blocking(move || {
        (0..UNITS)
            .map(|unit| {
                let mut buf = vec![0u8; 65536];
                taken_over.read(unit * 65536, &mut buf).unwrap();
                buf
            })
            .collect::<Vec<_>>()
    })
    .await;
    for unit in 0..UNITS as usize {
        let mut allowed: Vec<Vec<u8>> = since_flush[unit].iter().map(|v| pattern(*v)).collect();
        allowed.push(match flushed[unit] {
            Some(value) => pattern(value),
            None => vec![0u8; 65536],
        });
        assert!(
            allowed.contains(&found[unit]),
            "R={replicas} seed {seed}: unit {unit} lost its flushed value {:?} ({flushes} FLUSHes, \
             {failed_flushes} failed, {cuts} cuts)",
            flushed[unit]
        );
    }
    // Each snapshot the new primary holds whole shows exactly the writes before it.
    let mut checked = 0;
    for (name, expected) in &snapshots {
        let whole_here = nodes[replica]
            .cluster
            .catalog()
            .read()
            .volume("v")
            .and_then(|entry| {
                entry
                    .snapshot_by_name(name)
                    .map(|snap| !snap.incomplete_on.contains(&replica_id))
            })
            .unwrap_or(false);
        if !whole_here {
            continue;
        }
        checked += 1;
        let replication = nodes[replica].replication.clone();
        let snapshot_name = name.clone();
        let found = blocking(move || {
            let snapshot = replication.open_snapshot("v", &snapshot_name).unwrap();
            (0..UNITS)
                .map(|unit| {
                    let mut buf = vec![0u8; 65536];
                    snapshot.read(unit * 65536, &mut buf).unwrap();
                    buf
                })
                .collect::<Vec<_>>()
        })
        .await;
        for unit in 0..UNITS as usize {
            let wanted = expected[unit]
                .map(pattern)
                .unwrap_or_else(|| vec![0u8; 65536]);
            assert!(
                found[unit] == wanted,
                "R={replicas} seed {seed}: snapshot {name} shows another value of unit {unit} \
                 than {:?}",
                expected[unit]
            );
        }
    }
    eprintln!(
        "R={replicas} seed {seed}: {checked} of {} snapshots checked on the new primary",
        snapshots.len()
    );
    let crashed = (!isolated).then_some(&nodes[primary]);
    stop(&nodes.iter().collect::<Vec<_>>(), crashed).await;
}
