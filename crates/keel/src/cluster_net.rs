//! Wires this node into its cluster: the join token (cluster id and secret), the node-to-node
//! listener, the transport, and `keel_cluster::Cluster::start`.
//!
//! The token lives in `<first data dir>/cluster-token` (mode 0600). The first node of a cluster
//! writes it when it forms the cluster; a joining node is given it (`--join-token`,
//! `--join-token-file` or `KEEL_CLUSTER_TOKEN`) and stores it; a member refuses to start with a
//! token of another cluster.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use keel_catalog::{DeviceRecord, NodeAddresses, NodeRole};
use keel_cluster::{Cluster, ClusterConfig, ClusterHandler, Dispatch};
use tokio::net::TcpListener;

use crate::config::Config;

/// The cluster id and the shared secret every node-to-node connection proves it knows.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    pub cluster_id: [u8; 16],
    pub secret: [u8; 32],
}

impl std::fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JoinToken({}, <secret>)", hex::encode(self.cluster_id))
    }
}

const TOKEN_PREFIX: &str = "keel1";

impl JoinToken {
    pub fn generate() -> JoinToken {
        let mut cluster_id = [0u8; 16];
        let mut secret = [0u8; 32];
        rand::Rng::fill(&mut rand::rngs::OsRng, &mut cluster_id);
        rand::Rng::fill(&mut rand::rngs::OsRng, &mut secret);
        JoinToken { cluster_id, secret }
    }

    pub fn parse(text: &str) -> anyhow::Result<JoinToken> {
        let mut parts = text.trim().split('-');
        let (Some(TOKEN_PREFIX), Some(cluster), Some(secret), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            bail!("a join token looks like {TOKEN_PREFIX}-<32 hex digits>-<64 hex digits>");
        };
        let mut token = JoinToken {
            cluster_id: [0; 16],
            secret: [0; 32],
        };
        hex::decode_to_slice(cluster, &mut token.cluster_id)
            .context("the join token's cluster id is not 32 hex digits")?;
        hex::decode_to_slice(secret, &mut token.secret)
            .context("the join token's secret is not 64 hex digits")?;
        Ok(token)
    }

    pub fn text(&self) -> String {
        format!(
            "{TOKEN_PREFIX}-{}-{}",
            hex::encode(self.cluster_id),
            hex::encode(self.secret)
        )
    }
}

fn write_token(path: &Path, token: &JoinToken) -> anyhow::Result<()> {
    crate::files::write_file_atomically(path, token.text().as_bytes(), 0o600)
}

/// Fault injection of the node-to-node transport (`--debug-faults`).
#[derive(Clone)]
pub struct FaultControl {
    faults: keel_rpc::Faults,
}

impl FaultControl {
    /// Replaces every fault: drops all traffic with exactly the `blocked` nodes and delays the
    /// calls `delays` name (both empty: heals).
    pub fn set(&self, blocked: &[u64], delays: &[keel_rpc::Delay]) {
        self.faults.clear();
        for &node in blocked {
            self.faults.block(node);
        }
        for &delay in delays {
            self.faults.delay(delay);
        }
    }
}

/// This node's place in the cluster, and what serves it.
pub struct Membership {
    pub cluster: Arc<Cluster>,
    /// The client side of node-to-node calls (replication uses it too).
    pub transport: Arc<dyn keel_cluster::Transport>,
    /// Routes incoming calls; the replication engine's handler goes in once it is open.
    pub dispatch: Arc<Dispatch>,
    /// This start formed a new cluster.
    pub formed: bool,
    pub listen: SocketAddr,
    pub faults: Option<FaultControl>,
    server: tokio::task::JoinHandle<()>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Membership {
    pub async fn shutdown(self) {
        self.cluster.shutdown().await;
        self.stop.send_replace(true);
        let _ = self.server.await;
    }
}

fn devices(config: &Config) -> Vec<DeviceRecord> {
    config
        .data
        .iter()
        .map(|dir| {
            let info = keel_store::fsinfo::filesystem_info(dir).ok();
            DeviceRecord {
                path: dir.display().to_string(),
                filesystem: info
                    .as_ref()
                    .map(|info| info.filesystem.clone())
                    .unwrap_or_default(),
                capacity_bytes: info.map(|info| info.total_bytes).unwrap_or(0),
            }
        })
        .collect()
}

/// Reads (or, forming a cluster, makes) the token; starts the node-to-node server and the
/// cluster.
pub async fn start_cluster(
    config: &Config,
    store: keel_store::Store,
    listener: TcpListener,
) -> anyhow::Result<Membership> {
    let member = {
        let store = store.clone();
        tokio::task::spawn_blocking(move || keel_cluster::read_identity(&store)).await??
    };
    let path = config.token_path();
    let stored = match std::fs::read_to_string(&path) {
        Ok(text) => Some(
            JoinToken::parse(&text)
                .with_context(|| format!("reading the join token in {}", path.display()))?,
        ),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => None,
        Err(error) => return Err(error).with_context(|| format!("reading {}", path.display())),
    };
    let given = match &config.cluster.join_token {
        Some(text) => Some(JoinToken::parse(text).context("the join token given")?),
        None => None,
    };
    let (token, formed) = match (&member, stored, given, &config.cluster.join) {
        (Some(identity), stored, given, _) => {
            let token = stored.or(given).with_context(|| {
                format!(
                    "this node is a member of cluster {} but {} is missing: copy it from \
                     another member (keel cluster token) or pass --join-token",
                    hex::encode(identity.cluster_id),
                    path.display()
                )
            })?;
            if token.cluster_id != identity.cluster_id {
                bail!(
                    "the join token is for cluster {}, but this node is a member of cluster {}",
                    hex::encode(token.cluster_id),
                    hex::encode(identity.cluster_id)
                );
            }
            (token, false)
        }
        (None, _, Some(given), Some(_)) => (given, false),
        (None, _, None, Some(seed)) => bail!(
            "joining through {seed} needs the cluster's join token: pass --join-token TOKEN \
             (or --join-token-file, or KEEL_CLUSTER_TOKEN); `keel cluster token` on a member \
             prints it"
        ),
        (None, stored, given, None) => (given.or(stored).unwrap_or_else(JoinToken::generate), true),
    };
    if config.cluster.witness && formed {
        bail!("a witness cannot form a cluster: start it with --join ADDR --join-token TOKEN");
    }

    let listen = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let identity = keel_rpc::LocalIdentity::new(keel_rpc::Identity {
        cluster_id: token.cluster_id,
        node_id: member.map(|identity| identity.node_id).unwrap_or(0),
        secret: keel_rpc::ClusterSecret::from_bytes(token.secret),
    });
    let handler = {
        let identity = identity.clone();
        ClusterHandler::with_node_id_hook(Box::new(move |node| identity.set_node_id(node)))
    };
    let faults = keel_rpc::Faults::new();
    let rpc_config = keel_rpc::RpcConfig::default();
    let peers = keel_rpc::Peers::new(identity.clone(), rpc_config.clone(), faults.clone());
    let dispatch = Dispatch::new(handler.clone());
    let server = {
        let identity = identity.clone();
        let faults = faults.clone();
        let handler: Arc<dyn keel_rpc::Handler> = Arc::new(
            keel_cluster::rpc_transport::RpcHandler::new(dispatch.clone()),
        );
        tokio::spawn(async move {
            let mut stopped = stopped;
            keel_rpc::serve(
                listener,
                identity,
                handler,
                rpc_config,
                faults,
                async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                },
            )
            .await;
        })
    };
    let transport: Arc<dyn keel_cluster::Transport> = Arc::new(
        keel_cluster::rpc_transport::RpcTransport::new(peers.clone()),
    );
    let cluster_config = ClusterConfig {
        name: config.cluster.node_name(),
        role: if config.cluster.witness {
            NodeRole::Witness
        } else {
            NodeRole::Storage
        },
        addresses: NodeAddresses {
            cluster: config.cluster_advertise(),
            admin: Some(config.admin.to_string()),
            s3: (!config.cluster.witness).then(|| config.s3.to_string()),
            nbd: (!config.cluster.witness).then(|| config.nbd.to_string()),
        },
        labels: config.cluster.labels.clone(),
        devices: if config.cluster.witness {
            Vec::new()
        } else {
            devices(config)
        },
        join: config.cluster.join.clone(),
        cluster_id: Some(token.cluster_id),
        voters: config.cluster.voters,
        timing: config.cluster.timing(),
        clock: Arc::new(keel_clock::SystemClock),
    };
    let cluster = Cluster::start(store, cluster_config, transport.clone(), &handler).await?;
    if formed || member.is_none() {
        write_token(&path, &token)?;
    }
    Ok(Membership {
        cluster,
        transport,
        dispatch,
        formed,
        listen,
        faults: config
            .cluster
            .debug_faults
            .then_some(FaultControl { faults }),
        server,
        stop,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    // Proves tokens round-trip through their text and malformed ones are refused.
    #[test]
    fn tokens_round_trip_and_refuse_garbage() {
        let token = JoinToken::generate();
        assert_eq!(JoinToken::parse(&token.text()).unwrap(), token);
        assert_eq!(
            JoinToken::parse(&format!(" {}\n", token.text())).unwrap(),
            token
        );
        for bad in [
            "",
            "keel1",
            "keel1-00-11",
            "keel2-00000000000000000000000000000000-00",
            "keel1-zz-zz-zz",
        ] {
            assert!(JoinToken::parse(bad).is_err(), "{bad}");
        }
        assert!(!format!("{token:?}").contains(&hex::encode(token.secret)));
    }
}
