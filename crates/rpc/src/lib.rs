//! keel-rpc: the one node-to-node transport — Raft, joins, forwarded proposals, reports, and
//! later replication and repair — as framed, multiplexed calls over TCP.
//!
//! - **Authenticated.** Every connection starts with a handshake in which both sides prove
//!   they know the cluster secret over fresh nonces ([`handshake`]); every frame then carries a
//!   keyed-BLAKE3 MAC under a per-direction session key and an implicit frame counter
//!   ([`frame`]): corrupted, forged, replayed or reordered frames close the connection. Frames
//!   are not encrypted (run the cluster network privately).
//! - **Multiplexed.** Many calls share one connection per peer and are answered out of order;
//!   a caller writes its frame itself while the socket takes it (no hand-over to another
//!   task on the path it waits on); what waits for room goes out together; TCP_NODELAY.
//! - **Bounded.** Outgoing frames per connection ([`RpcConfig::queue_frames_max`]), requests in
//!   flight per accepted connection ([`RpcConfig::requests_in_flight_max`]), payload size
//!   ([`RpcConfig::payload_max_bytes`]); a caller waits for room until its deadline.
//! - **Deadlines.** Every call has one; the budget left travels in the frame so the callee can
//!   drop work nobody waits for.
//! - **Honest errors.** [`RpcError::never_sent`] tells "it did not happen there" from "it may
//!   have" (a proposal retried after the latter relies on the state machine's deduplication).
//! - **Reconnects with backoff**: a dead peer costs one dial per backoff period, not a loop.
//! - **A fault proxy** ([`Faults`]) for partition tests: traffic with blocked nodes is dropped
//!   in both directions, as silence; calls to a node (or one method of it) can be delayed, to
//!   widen the windows that races live in.
//!
//! Malformed input never panics: it closes that connection with a log line naming the peer.

mod connection;
pub mod frame;
pub mod handshake;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

pub use frame::RemoteError;

pub type NodeId = u64;

/// A call's payload as parts sent one after another: a large buffer the caller holds (a
/// write's data) goes out as it is, with the few bytes around it, rather than copied into one
/// buffer first. The peer receives one contiguous payload either way.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Payload {
    parts: Vec<bytes::Bytes>,
}

impl Payload {
    pub fn from_parts(parts: Vec<bytes::Bytes>) -> Payload {
        Payload { parts }
    }

    /// Bytes in all the parts.
    pub fn len(&self) -> usize {
        self.parts.iter().map(bytes::Bytes::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.parts.iter().all(bytes::Bytes::is_empty)
    }

    pub fn parts(&self) -> &[bytes::Bytes] {
        &self.parts
    }

    /// The parts in one buffer (an in-process transport hands its handler one): a single
    /// part the payload alone holds is taken over, not copied.
    pub fn into_vec(mut self) -> Vec<u8> {
        if self.parts.len() == 1 {
            return self.parts.pop().map(Vec::from).unwrap_or_default();
        }
        let mut out = Vec::with_capacity(self.len());
        for part in &self.parts {
            out.extend_from_slice(part);
        }
        out
    }
}

impl From<Vec<u8>> for Payload {
    fn from(payload: Vec<u8>) -> Payload {
        Payload {
            parts: vec![payload.into()],
        }
    }
}

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// The cluster secret: 32 random bytes, shared out of band (the join token).
#[derive(Clone)]
pub struct ClusterSecret([u8; 32]);

impl ClusterSecret {
    pub fn from_bytes(bytes: [u8; 32]) -> ClusterSecret {
        ClusterSecret(bytes)
    }

    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(<hidden>)")
    }
}

/// Who this node is on the wire.
#[derive(Debug, Clone)]
pub struct Identity {
    pub cluster_id: [u8; 16],
    /// 0: not a member yet (joining).
    pub node_id: NodeId,
    pub secret: ClusterSecret,
}

/// The identity shared by a node's client and server; the node id is set once the node joins.
#[derive(Debug)]
pub struct LocalIdentity {
    cluster_id: [u8; 16],
    node_id: AtomicU64,
    secret: ClusterSecret,
}

impl LocalIdentity {
    pub fn new(identity: Identity) -> Arc<LocalIdentity> {
        Arc::new(LocalIdentity {
            cluster_id: identity.cluster_id,
            node_id: AtomicU64::new(identity.node_id),
            secret: identity.secret,
        })
    }

    pub fn set_node_id(&self, node: NodeId) {
        self.node_id.store(node, Ordering::SeqCst);
    }

    pub fn node_id(&self) -> NodeId {
        self.node_id.load(Ordering::SeqCst)
    }

    fn snapshot(&self) -> Identity {
        Identity {
            cluster_id: self.cluster_id,
            node_id: self.node_id(),
            secret: self.secret.clone(),
        }
    }
}

/// Limits and timeouts. Every field is a bound on memory or time.
#[derive(Debug, Clone)]
pub struct RpcConfig {
    /// Largest payload of one frame. Default 64 MiB.
    pub payload_max_bytes: u32,
    /// Frames waiting to be written on one connection (the socket did not take them yet).
    /// Default 1024.
    pub queue_frames_max: usize,
    /// Requests one accepted connection runs at once; more wait (backpressure). Default 256.
    pub requests_in_flight_max: usize,
    /// Dialing one peer (TCP connect). Default 2 s.
    pub dial_timeout: Duration,
    /// The handshake, either side. Default 5 s.
    pub handshake_timeout: Duration,
    /// First wait after a failed dial; doubles per failure up to `backoff_max`. Default 100 ms.
    pub backoff_initial: Duration,
    /// Longest wait between dials of a dead peer. Default 5 s.
    pub backoff_max: Duration,
}

impl Default for RpcConfig {
    fn default() -> RpcConfig {
        RpcConfig {
            payload_max_bytes: 64 << 20,
            queue_frames_max: 1024,
            requests_in_flight_max: 256,
            dial_timeout: Duration::from_secs(2),
            handshake_timeout: Duration::from_secs(5),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
        }
    }
}

/// Whom a call is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A member, which must answer as that node id.
    Node { id: NodeId, address: String },
    /// Whichever member of this cluster answers at the address (joining).
    AnyAt { address: String },
}

impl Target {
    pub fn address(&self) -> &str {
        match self {
            Target::Node { address, .. } | Target::AnyAt { address } => address,
        }
    }
}

/// Who made an incoming call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    Member(NodeId),
    /// Proved the secret, has no id yet.
    Unassigned,
}

/// A transport failure. Each names the peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RpcError {
    #[error("{peer} is unreachable: {detail}")]
    Unreachable { peer: String, detail: String },
    #[error("{peer} refused our authentication or failed its own: {detail}")]
    Auth { peer: String, detail: String },
    #[error("{peer} is node {found}, not node {expected}")]
    WrongPeer {
        peer: String,
        expected: NodeId,
        found: NodeId,
    },
    #[error("{peer} did not answer within {timeout:?}")]
    Timeout { peer: String, timeout: Duration },
    #[error("connection to {peer} was lost with the call in flight: {detail}")]
    ConnectionLost { peer: String, detail: String },
    #[error("payload of {length} bytes is over the {limit}-byte frame limit")]
    FrameTooLarge { length: usize, limit: u32 },
    #[error("{peer} answered: {}", error.message)]
    Remote { peer: String, error: RemoteError },
}

impl RpcError {
    /// True when the call certainly did not reach the peer's handler.
    pub fn never_sent(&self) -> bool {
        matches!(
            self,
            RpcError::Unreachable { .. }
                | RpcError::Auth { .. }
                | RpcError::WrongPeer { .. }
                | RpcError::FrameTooLarge { .. }
        )
    }
}

/// What a node does with incoming calls.
pub trait Handler: Send + Sync + 'static {
    fn call(
        &self,
        caller: Caller,
        method: u16,
        payload: Vec<u8>,
    ) -> BoxFuture<Result<Vec<u8>, RemoteError>>;
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Fault injection shared by a node's client and server (partition tests): traffic with a
/// blocked node is dropped in both directions, so calls to it time out and its calls get no
/// answer, as in a real partition; a delayed call waits before it is sent (within its
/// deadline), as on a slow link.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    blocked: Arc<RwLock<HashSet<NodeId>>>,
    delays: Arc<RwLock<Vec<Delay>>>,
}

/// Calls this node makes to `node` wait `by` before they are sent: every call, or only those
/// of `method`; with `jitter`, a random wait up to `by` each (so calls sent together arrive
/// out of order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delay {
    pub node: NodeId,
    pub method: Option<u16>,
    pub by: Duration,
    pub jitter: bool,
}

impl Faults {
    pub fn new() -> Faults {
        Faults::default()
    }

    pub fn block(&self, node: NodeId) {
        self.blocked
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(node);
    }

    pub fn delay(&self, delay: Delay) {
        self.delays
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(delay);
    }

    /// Heals everything: no node blocked, no call delayed.
    pub fn clear(&self) {
        self.blocked
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clear();
        self.delays
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clear();
    }

    /// How long a call of `method` to `node` waits before it is sent (the longest delay that
    /// matches it; a jittered one drawn anew per call).
    pub fn delay_of(&self, node: NodeId, method: u16) -> Option<Duration> {
        self.delays
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .filter(|delay| delay.node == node && delay.method.is_none_or(|m| m == method))
            .map(|delay| {
                if delay.jitter {
                    delay.by.mul_f64(rand::random::<f64>())
                } else {
                    delay.by
                }
            })
            .max()
    }

    pub fn blocks(&self, node: NodeId) -> bool {
        node != 0
            && self
                .blocked
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .contains(&node)
    }
}

/// A peer's connection and the state of dialing it.
#[derive(Default)]
struct PeerSlot {
    connection: Option<Arc<connection::ClientConnection>>,
    failures: u32,
    retry_at: Option<Instant>,
    dialing: Arc<tokio::sync::Mutex<()>>,
}

/// The client side: calls to other nodes, one connection per peer address.
pub struct Peers {
    identity: Arc<LocalIdentity>,
    config: RpcConfig,
    faults: Faults,
    slots: Mutex<HashMap<String, PeerSlot>>,
}

impl Peers {
    pub fn new(identity: Arc<LocalIdentity>, config: RpcConfig, faults: Faults) -> Arc<Peers> {
        Arc::new(Peers {
            identity,
            config,
            faults,
            slots: Mutex::new(HashMap::new()),
        })
    }

    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Calls `method` on the target with `payload`; waits at most `timeout`.
    pub async fn call(
        &self,
        target: Target,
        method: u16,
        payload: impl Into<Payload>,
        timeout: Duration,
    ) -> Result<Vec<u8>, RpcError> {
        let payload = payload.into();
        let deadline = Instant::now() + timeout;
        let address = target.address().to_string();
        if payload.len() > self.config.payload_max_bytes as usize {
            return Err(RpcError::FrameTooLarge {
                length: payload.len(),
                limit: self.config.payload_max_bytes,
            });
        }
        if let Target::Node { id, .. } = &target {
            if self.faults.blocks(*id) {
                tokio::time::sleep_until(deadline).await;
                return Err(RpcError::Timeout {
                    peer: address,
                    timeout,
                });
            }
        }
        let connection = self.connection(&address, deadline).await?;
        if let Target::Node { id, .. } = &target {
            if connection.peer_node != *id {
                // Another node, or the same one before it had its id (it was joining): forget
                // this connection, so the next call dials and authenticates afresh.
                self.forget(&address, &connection);
                return Err(RpcError::WrongPeer {
                    peer: address,
                    expected: *id,
                    found: connection.peer_node,
                });
            }
        }
        if self.faults.blocks(connection.peer_node) {
            tokio::time::sleep_until(deadline).await;
            return Err(RpcError::Timeout {
                peer: address,
                timeout,
            });
        }
        if let Some(delay) = self.faults.delay_of(connection.peer_node, method) {
            if Instant::now() + delay >= deadline {
                tokio::time::sleep_until(deadline).await;
                return Err(RpcError::Timeout {
                    peer: address,
                    timeout,
                });
            }
            tokio::time::sleep(delay).await;
        }
        connection.call(method, payload, deadline, timeout).await
    }

    fn forget(&self, address: &str, connection: &Arc<connection::ClientConnection>) {
        let mut slots = lock(&self.slots);
        if let Some(slot) = slots.get_mut(address) {
            if slot
                .connection
                .as_ref()
                .is_some_and(|cached| Arc::ptr_eq(cached, connection))
            {
                slot.connection = None;
            }
        }
        drop(slots);
        connection.shut();
    }

    async fn connection(
        &self,
        address: &str,
        deadline: Instant,
    ) -> Result<Arc<connection::ClientConnection>, RpcError> {
        let dialing = {
            let mut slots = lock(&self.slots);
            let slot = slots.entry(address.to_string()).or_default();
            if let Some(connection) = &slot.connection {
                if connection.is_open() && connection.local_node == self.identity.node_id() {
                    return Ok(connection.clone());
                }
            }
            slot.dialing.clone()
        };
        let _dialing = tokio::time::timeout_at(deadline, dialing.lock())
            .await
            .map_err(|_| RpcError::Unreachable {
                peer: address.to_string(),
                detail: "timed out waiting for another dial".to_string(),
            })?;
        {
            let slots = lock(&self.slots);
            if let Some(slot) = slots.get(address) {
                if let Some(connection) = &slot.connection {
                    if connection.is_open() && connection.local_node == self.identity.node_id() {
                        return Ok(connection.clone());
                    }
                }
                if let Some(retry_at) = slot.retry_at {
                    if Instant::now() < retry_at {
                        return Err(RpcError::Unreachable {
                            peer: address.to_string(),
                            detail: format!(
                                "{} dials failed; backing off for {:?}",
                                slot.failures,
                                retry_at - Instant::now()
                            ),
                        });
                    }
                }
            }
        }
        let dialed = self.dial(address, deadline).await;
        let mut slots = lock(&self.slots);
        let slot = slots.entry(address.to_string()).or_default();
        match dialed {
            Ok(connection) => {
                slot.failures = 0;
                slot.retry_at = None;
                if let Some(stale) = slot.connection.replace(connection.clone()) {
                    stale.shut();
                }
                Ok(connection)
            }
            Err(error) => {
                slot.failures = slot.failures.saturating_add(1);
                let exponent = slot.failures.saturating_sub(1).min(16);
                let backoff = self
                    .config
                    .backoff_initial
                    .saturating_mul(1u32 << exponent)
                    .min(self.config.backoff_max);
                // Jitter: between half and all of the backoff, so dialers do not stampede.
                let jittered = backoff.mul_f64(0.5 + rand::random::<f64>() * 0.5);
                slot.retry_at = Some(Instant::now() + jittered);
                Err(error)
            }
        }
    }

    async fn dial(
        &self,
        address: &str,
        deadline: Instant,
    ) -> Result<Arc<connection::ClientConnection>, RpcError> {
        let unreachable = |detail: String| RpcError::Unreachable {
            peer: address.to_string(),
            detail,
        };
        let dial_deadline = deadline.min(Instant::now() + self.config.dial_timeout);
        let mut stream =
            match tokio::time::timeout_at(dial_deadline, TcpStream::connect(address)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(error)) => return Err(unreachable(error.to_string())),
                Err(_) => return Err(unreachable("connect timed out".to_string())),
            };
        stream
            .set_nodelay(true)
            .map_err(|error| unreachable(error.to_string()))?;
        let identity = self.identity.snapshot();
        let handshake_deadline = deadline.min(Instant::now() + self.config.handshake_timeout);
        let session = match tokio::time::timeout_at(
            handshake_deadline,
            handshake::client(&mut stream, &identity),
        )
        .await
        {
            Ok(Ok(session)) => session,
            Ok(Err(handshake::HandshakeError::Io(error))) => {
                return Err(unreachable(format!("handshake: {error}")))
            }
            Ok(Err(error)) => {
                tracing::warn!(peer = address, %error, "node-to-node authentication failed");
                return Err(RpcError::Auth {
                    peer: address.to_string(),
                    detail: error.to_string(),
                });
            }
            Err(_) => return Err(unreachable("handshake timed out".to_string())),
        };
        Ok(connection::ClientConnection::start(
            stream,
            session,
            identity.node_id,
            address.to_string(),
            self.config.clone(),
        ))
    }
}

/// Accepts connections and answers their calls with `handler`, until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    identity: Arc<LocalIdentity>,
    handler: Arc<dyn Handler>,
    config: RpcConfig,
    faults: Faults,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(%error, "accepting a node-to-node connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let identity = identity.clone();
                let handler = handler.clone();
                let config = config.clone();
                let faults = faults.clone();
                connections.spawn(async move {
                    connection::serve_connection(stream, peer, identity, handler, config, faults).await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    connections.shutdown().await;
}
