//! Helpers of the in-process cluster tests: nodes on real stores (under `target/`, never tmpfs)
//! talking over a `LocalNetwork`, with fast timing so elections and failure detection take
//! tenths of seconds.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keel_catalog::{Command, NodeAddresses, NodeId, NodeRole, VolumeSettings, VolumeStatus};
use keel_cluster::{Cluster, ClusterConfig, ClusterHandler, LocalNetwork, Timing};
use keel_store::{Store, StoreConfig};

pub fn fast_timing() -> Timing {
    Timing {
        raft_heartbeat: Duration::from_millis(50),
        election_timeout_min: Duration::from_millis(300),
        election_timeout_max: Duration::from_millis(600),
        report_interval: Duration::from_millis(100),
        suspect_after: Duration::from_millis(800),
        down_after: Duration::from_millis(1600),
        propose_timeout: Duration::from_secs(4),
        call_timeout: Duration::from_millis(500),
        membership_interval: Duration::from_millis(150),
        snapshot_every_entries: 1000,
    }
}

/// A fresh directory for one node of one test.
pub fn node_dir(test: &str, node: &str) -> PathBuf {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/test-data/cluster")
        .join(format!("{test}-{}", RUN.fetch_add(1, Ordering::Relaxed)))
        .join(node);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub struct TestNode {
    pub name: String,
    pub dir: PathBuf,
    pub address: String,
    pub role: NodeRole,
    pub store: Store,
    pub handler: Arc<ClusterHandler>,
    pub cluster: Arc<Cluster>,
}

pub struct Options {
    pub role: NodeRole,
    pub join: Option<String>,
    pub voters: usize,
    pub timing: Timing,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            role: NodeRole::Storage,
            join: None,
            voters: 3,
            timing: fast_timing(),
        }
    }
}

pub async fn start(network: &LocalNetwork, dir: PathBuf, name: &str, options: Options) -> TestNode {
    let address = format!("{name}.test:1");
    let store = {
        let dir = dir.clone();
        tokio::task::spawn_blocking(move || Store::open(StoreConfig::new(vec![dir])).unwrap())
            .await
            .unwrap()
    };
    let handler = ClusterHandler::new();
    let weak: std::sync::Weak<dyn keel_cluster::Handler> =
        Arc::downgrade(&(handler.clone() as Arc<dyn keel_cluster::Handler>));
    network.listen(&address, weak);
    let from = handler.clone();
    let transport = Arc::new(network.transport(&address, Arc::new(move || from.current_node_id())));
    let config = ClusterConfig {
        name: name.to_string(),
        role: options.role,
        addresses: NodeAddresses {
            cluster: address.clone(),
            ..NodeAddresses::default()
        },
        labels: Default::default(),
        devices: Vec::new(),
        join: options.join,
        cluster_id: None,
        voters: options.voters,
        timing: options.timing,
        clock: std::sync::Arc::new(keel_clock::SystemClock),
    };
    let cluster = Cluster::start(store.clone(), config, transport, &handler)
        .await
        .unwrap();
    TestNode {
        name: name.to_string(),
        dir,
        address,
        role: options.role,
        store,
        handler,
        cluster,
    }
}

impl TestNode {
    /// Stops the node as a crash would: its endpoint goes silent and its Raft stops. (The store's
    /// page cache survives, as with kill -9; the store tests cover power loss.)
    pub async fn crash(self, network: &LocalNetwork) -> (PathBuf, String, NodeRole) {
        network.close(&self.address);
        self.cluster.shutdown().await;
        drop(self.cluster);
        drop(self.handler);
        drop(self.store);
        // Tasks the runtime has not yet dropped may hold the store a little longer (a loaded
        // machine); the directory is "crashed" once its lock is free.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            match keel_store::Store::open(keel_store::StoreConfig::new(vec![self.dir.clone()])) {
                Err(keel_store::StoreError::Locked { .. }) => {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "{} stayed locked after the crash",
                        self.dir.display()
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(store) => {
                    drop(store);
                    break;
                }
                Err(other) => panic!("reopening {} failed: {other}", self.dir.display()),
            }
        }
        (self.dir, self.name, self.role)
    }
}

pub async fn wait_for(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether `nodes` formed a cluster of exactly themselves: every node has the final, uniform
/// membership and the same log, not only the leader. While a change of voters is in joint
/// consensus the old configuration must agree too, so a test that cut nodes off then would see
/// no leader elected, as Raft requires, rather than what it means to test.
pub fn formed(nodes: &[&TestNode]) -> bool {
    let ids: BTreeSet<NodeId> = nodes.iter().map(|n| n.cluster.node_id()).collect();
    let Some(first) = nodes.first() else {
        return true;
    };
    let last = first.cluster.metrics().last_log_index;
    nodes.iter().all(|n| {
        let metrics = n.cluster.metrics();
        voters(n) == ids
            && metrics.membership_config.get_joint_config().len() == 1
            && metrics.last_log_index == last
    })
}

pub fn voters(node: &TestNode) -> BTreeSet<NodeId> {
    node.cluster
        .metrics()
        .membership_config
        .voter_ids()
        .collect()
}

pub fn volume_command(name: &str, node: NodeId) -> Command {
    Command::VolumeCreate {
        settings: VolumeSettings {
            name: name.to_string(),
            size_bytes: 1 << 20,
            compression: "none".to_string(),
            iops_max: None,
            bandwidth_max_mib_per_second: None,
        },
        uuid: [7; 16],
        created_unix_seconds: 1,
        replicas: vec![node],
        status: VolumeStatus::Ready,
    }
}

pub fn volume_names(node: &TestNode) -> BTreeSet<String> {
    node.cluster
        .catalog()
        .read()
        .ready_volumes()
        .map(|entry| entry.record.name.clone())
        .collect()
}
