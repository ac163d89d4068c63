//! How the cluster talks to other nodes: one call-and-answer primitive over the node-to-node
//! transport (`keel-rpc` in a server, [`LocalNetwork`] in tests and simulations).
//!
//! Errors distinguish "never sent" (safe to retry anywhere) from "sent, outcome unknown" (a
//! proposal retried after this must be deduplicated, which the state machine does by proposal
//! id), because the difference decides whether a retry can apply a change twice.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use keel_catalog::NodeId;
pub use keel_rpc::Payload;

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Whom a call is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// A member, which must answer as that node id at that address.
    Node { id: NodeId, address: String },
    /// Whichever member of this cluster answers at the address (joining: the caller has no id
    /// yet and does not know the seed's).
    AnyAt { address: String },
}

impl Peer {
    pub fn address(&self) -> &str {
        match self {
            Peer::Node { address, .. } | Peer::AnyAt { address } => address,
        }
    }
}

/// Who made an incoming call (the transport authenticated it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    Member(NodeId),
    /// A node with the cluster's secret and no id yet: it may only ask to join.
    Unassigned,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// The call was not sent (no connection, refused, partitioned): nothing happened there.
    #[error("{peer} is unreachable: {detail}")]
    Unreachable { peer: String, detail: String },
    /// Not sent: the peer refused this node itself at the handshake (another cluster, another
    /// node-to-node protocol, a wrong secret). Retrying does not help.
    #[error("{peer} refused this node: {detail}")]
    Refused { peer: String, detail: String },
    /// Sent, and no answer in time: it may or may not have happened there.
    #[error("{peer} did not answer within {timeout:?}")]
    Timeout { peer: String, timeout: Duration },
    /// Sent, and the connection broke before the answer: it may or may not have happened.
    #[error("connection to {peer} was lost: {detail}")]
    Lost { peer: String, detail: String },
    /// The peer answered with an error.
    #[error("{peer} answered: {message}")]
    Remote {
        peer: String,
        code: u16,
        message: String,
    },
}

impl TransportError {
    /// Whether the call certainly did not take effect at the peer.
    pub fn never_sent(&self) -> bool {
        matches!(
            self,
            TransportError::Unreachable { .. } | TransportError::Refused { .. }
        )
    }
}

/// An error a handler answers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFailure {
    pub code: u16,
    pub message: String,
}

/// The client side of the node-to-node transport.
pub trait Transport: Send + Sync + 'static {
    fn call(
        &self,
        peer: Peer,
        method: u16,
        payload: Payload,
        timeout: Duration,
    ) -> BoxFuture<Result<Vec<u8>, TransportError>>;
}

/// The server side: what a node does with an incoming call.
pub trait Handler: Send + Sync + 'static {
    fn handle(
        &self,
        caller: Caller,
        method: u16,
        payload: Vec<u8>,
    ) -> BoxFuture<Result<Vec<u8>, RemoteFailure>>;
    /// The node id this handler answers as (0 before it has one).
    fn node_id(&self) -> NodeId;
}

struct Endpoint {
    handler: Weak<dyn Handler>,
    /// Which `listen` put it there: a node that crashed, or crashed and came back, answers
    /// none of the calls it was handling (its answers die with it).
    incarnation: u64,
}

/// An in-process network of nodes, for tests and simulations: calls go straight to the
/// target's handler on the same runtime, with partitions that drop traffic between chosen
/// nodes (both directions), seeded loss and delay, and answers lost on demand, so the real
/// cluster code runs without sockets.
#[derive(Clone, Default)]
pub struct LocalNetwork {
    endpoints: Arc<RwLock<HashMap<String, Endpoint>>>,
    /// Pairs of node ids that cannot reach each other.
    cut: Arc<Mutex<BTreeSet<(NodeId, NodeId)>>>,
    chaos: Arc<Mutex<Option<Chaos>>>,
    /// `(caller, method)`: such calls are delivered and handled, and their answers lost.
    answers_lost: Calls,
    /// Counts `listen`s: each endpoint's incarnation.
    listens: Arc<std::sync::atomic::AtomicU64>,
    /// `(callee, method)`: such calls wait, undelivered, until released (or their time is up).
    held: Calls,
    /// How many calls each `(callee, method)` hold caught.
    caught: Arc<Mutex<BTreeMap<(NodeId, u16), u64>>>,
}

/// A set of `(node, method)` pairs that calls are matched against (answers lost, calls held).
#[derive(Clone, Default)]
struct Calls(Arc<Mutex<BTreeSet<(NodeId, u16)>>>);

impl Calls {
    fn set(&self) -> std::sync::MutexGuard<'_, BTreeSet<(NodeId, u16)>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn contains(&self, node: NodeId, method: u16) -> bool {
        self.set().contains(&(node, method))
    }
}

/// Message loss and delay (hence reordering), from a seeded generator: the same seed and the
/// same sequence of calls give the same fates.
struct Chaos {
    rng: rand::rngs::StdRng,
    /// Calls lost out of a million (half lose the request, half the answer).
    loss_per_million: u32,
    delay_max: Duration,
}

/// What happens to one call.
enum Fate {
    Delivered { delay: Duration },
    RequestLost,
    AnswerLost { delay: Duration },
}

impl LocalNetwork {
    pub fn new() -> LocalNetwork {
        LocalNetwork::default()
    }

    /// Makes `handler` answer at `address` (replacing whatever answered there).
    pub fn listen(&self, address: &str, handler: Weak<dyn Handler>) {
        self.endpoints
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(
                address.to_string(),
                Endpoint {
                    handler,
                    incarnation: self
                        .listens
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                },
            );
    }

    /// Nothing answers at `address` any more, and calls its node made are not delivered (the
    /// node crashed).
    pub fn close(&self, address: &str) {
        self.endpoints
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(address);
    }

    /// Cuts every link between a node of `side` and a node not in it.
    pub fn partition(&self, side: &[NodeId], all: &[NodeId]) {
        let mut cut = self
            .cut
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for &a in side {
            for &b in all.iter().filter(|b| !side.contains(b)) {
                cut.insert((a.min(b), a.max(b)));
            }
        }
    }

    /// Loses `loss_per_million` of calls and delays each by up to `delay_max`, seeded.
    pub fn set_chaos(&self, seed: u64, loss_per_million: u32, delay_max: Duration) {
        *self
            .chaos
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(Chaos {
            rng: rand::SeedableRng::seed_from_u64(seed),
            loss_per_million,
            delay_max,
        });
    }

    /// No more loss or delay.
    pub fn calm(&self) {
        *self
            .chaos
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
    }

    /// Loses the answer of every call `from` makes with `method`, after the callee handled
    /// it: the caller cannot know whether what it asked was done.
    pub fn lose_answers(&self, from: NodeId, method: u16) {
        self.answers_lost.set().insert((from, method));
    }

    /// Answers are no longer lost on purpose ([`LocalNetwork::lose_answers`]).
    pub fn keep_answers(&self) {
        self.answers_lost.set().clear();
    }

    /// Holds every call to `to` with `method` (Raft's appends, say: that node's metadata then
    /// lags the others') until [`LocalNetwork::release`]; a call whose time runs out first
    /// times out, as one into a partition does.
    pub fn hold(&self, to: NodeId, method: u16) {
        self.held.set().insert((to, method));
    }

    /// How many calls to `to` with `method` a [`LocalNetwork::hold`] caught, ever.
    pub fn calls_held(&self, to: NodeId, method: u16) -> u64 {
        let caught = self
            .caught
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        caught.get(&(to, method)).copied().unwrap_or(0)
    }

    /// Delivers the calls to `to` with `method` held by [`LocalNetwork::hold`], and holds
    /// no more of them.
    pub fn release_calls(&self, to: NodeId, method: u16) {
        self.held.set().remove(&(to, method));
    }

    /// Delivers the calls held by [`LocalNetwork::hold`], and holds no more.
    pub fn release(&self) {
        self.held.set().clear();
    }

    fn fate(&self) -> Fate {
        use rand::Rng;
        let mut chaos = self
            .chaos
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(chaos) = chaos.as_mut() else {
            return Fate::Delivered {
                delay: Duration::ZERO,
            };
        };
        let delay_ms = chaos.delay_max.as_millis() as u64;
        let delay = Duration::from_millis(chaos.rng.gen_range(0..=delay_ms));
        let roll = chaos.rng.gen_range(0..1_000_000u32);
        if roll < chaos.loss_per_million / 2 {
            Fate::RequestLost
        } else if roll < chaos.loss_per_million {
            Fate::AnswerLost { delay }
        } else {
            Fate::Delivered { delay }
        }
    }

    pub fn heal(&self) {
        self.cut
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clear();
    }

    /// Whether a node answers at some address (a crashed node was closed).
    fn is_live(&self, node: NodeId) -> bool {
        self.endpoints
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .values()
            .any(|endpoint| {
                endpoint
                    .handler
                    .upgrade()
                    .is_some_and(|handler| handler.node_id() == node)
            })
    }

    /// The incarnation of what listens at `address` now.
    fn incarnation(&self, address: &str) -> Option<u64> {
        self.endpoints
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(address)
            .map(|endpoint| endpoint.incarnation)
    }

    fn is_cut(&self, a: NodeId, b: NodeId) -> bool {
        self.cut
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(&(a.min(b), a.max(b)))
    }

    /// A transport for the node listening at `address` (its id may change once it joins:
    /// read through `from`). Made after [`LocalNetwork::listen`], it dies with that
    /// incarnation of the node: once the node crashed, or crashed and came back, calls its
    /// old tasks make are never delivered (a dead process sends nothing).
    pub fn transport(
        &self,
        address: &str,
        from: Arc<dyn Fn() -> NodeId + Send + Sync>,
    ) -> LocalTransport {
        LocalTransport {
            network: self.clone(),
            from,
            address: address.to_string(),
            incarnation: self.incarnation(address),
        }
    }
}

/// How often a call held by a partition looks whether it healed.
const CUT_POLL: Duration = Duration::from_millis(10);

/// One node's side of a [`LocalNetwork`].
pub struct LocalTransport {
    network: LocalNetwork,
    from: Arc<dyn Fn() -> NodeId + Send + Sync>,
    /// Where its node listens, and in which incarnation (none if it did not listen yet).
    address: String,
    incarnation: Option<u64>,
}

impl Transport for LocalTransport {
    fn call(
        &self,
        peer: Peer,
        method: u16,
        payload: Payload,
        timeout: Duration,
    ) -> BoxFuture<Result<Vec<u8>, TransportError>> {
        let network = self.network.clone();
        let from = (self.from)();
        let own = (self.address.clone(), self.incarnation);
        Box::pin(async move {
            let address = peer.address().to_string();
            let unreachable = |detail: &str| TransportError::Unreachable {
                peer: address.clone(),
                detail: detail.to_string(),
            };
            let found = network
                .endpoints
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .get(&address)
                .and_then(|endpoint| Some((endpoint.handler.upgrade()?, endpoint.incarnation)));
            let Some((handler, incarnation)) = found else {
                return Err(unreachable("nothing listens there"));
            };
            let target = handler.node_id();
            if let Peer::Node { id, .. } = peer {
                if id != target {
                    return Err(unreachable(&format!(
                        "node {target} answers there, not node {id}"
                    )));
                }
            }
            // A partition looks like silence, not like a refusal; and, as TCP retransmits, a
            // call sent into it (or held) still arrives if the partition heals (or the hold is
            // released) before its time is up.
            let deadline = tokio::time::Instant::now() + timeout;
            let mut caught = false;
            loop {
                let held = network.held.contains(target, method);
                if !held && !network.is_cut(from, target) {
                    break;
                }
                if held && !caught {
                    caught = true;
                    *network
                        .caught
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .entry((target, method))
                        .or_default() += 1;
                }
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                if left.is_zero() {
                    return Err(TransportError::Timeout {
                        peer: address,
                        timeout,
                    });
                }
                tokio::time::sleep(left.min(CUT_POLL)).await;
            }
            // A node that crashed sends nothing more: calls it made are never delivered (nor
            // those a task of an incarnation before its restart makes).
            let (own_address, own_incarnation) = &own;
            let restarted =
                own_incarnation.is_some_and(|own| network.incarnation(own_address) != Some(own));
            if restarted || (from != 0 && !network.is_live(from)) {
                return Err(unreachable("the calling node is down"));
            }
            let budget = deadline.saturating_duration_since(tokio::time::Instant::now());
            let caller = if from == 0 {
                Caller::Unassigned
            } else {
                Caller::Member(from)
            };
            let (delay, mut answer_lost) = match network.fate() {
                Fate::Delivered { delay } => (delay, false),
                Fate::RequestLost => {
                    tokio::time::sleep(budget).await;
                    return Err(TransportError::Timeout {
                        peer: address,
                        timeout,
                    });
                }
                Fate::AnswerLost { delay } => (delay, true),
            };
            if !delay.is_zero() {
                tokio::time::sleep(delay.min(budget)).await;
            }
            let answer =
                tokio::time::timeout(budget, handler.handle(caller, method, payload.into_vec()))
                    .await;
            // A node that crashed while it handled the call never answers (what it did
            // after the crash is not on its disk: a power cut ends all of it).
            if network.incarnation(&address) != Some(incarnation) {
                return Err(TransportError::Lost {
                    peer: address,
                    detail: "the node went down with the call in flight".to_string(),
                });
            }
            answer_lost |= network.answers_lost.contains(from, method);
            if answer_lost {
                return Err(TransportError::Lost {
                    peer: address,
                    detail: "the answer was lost (simulated)".to_string(),
                });
            }
            // The answer crosses the partition too.
            if network.is_cut(from, target) {
                return Err(TransportError::Lost {
                    peer: address,
                    detail: "partitioned while the call was in flight".to_string(),
                });
            }
            match answer {
                Ok(Ok(bytes)) => Ok(bytes),
                Ok(Err(failure)) => Err(TransportError::Remote {
                    peer: address,
                    code: failure.code,
                    message: failure.message,
                }),
                Err(_) => Err(TransportError::Timeout {
                    peer: address,
                    timeout,
                }),
            }
        })
    }
}
