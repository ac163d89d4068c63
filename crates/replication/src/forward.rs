//! Serving a volume through a node that holds no replica of it (documented as slower): the node
//! the client attached to opens a session on the node serving the volume — its primary, which
//! the open makes or keeps primary exactly as a client attaching there would — and sends it
//! each request, one RPC each. Durability is the serving node's: a forwarded WRITE is
//! acknowledged once the primary acknowledged it, a forwarded FLUSH once every in-sync replica
//! made the writes before it durable.
//!
//! A snapshot's export (`volume@snapshot`, read-only) is forwarded the same way, to any node
//! holding the snapshot whole (a node without a replica, and a replica that was out of sync
//! when the snapshot was taken, hold no copy of it); with nothing to vouch for, its session
//! moves to another such node whenever its node goes away.
//!
//! When the serving node goes away (it died, or another node took the volume over), a session
//! moves to the new primary without the client noticing if every write acknowledged through
//! this node's sessions of the volume was covered by a successful FLUSH (or was a FUA write):
//! the new primary was in sync, so it holds all of it. Otherwise the session cannot know
//! whether those writes survived; it fails every later request, and the client attaches again
//! (as after losing a disk's volatile cache).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use keel_catalog::NodeId;
use keel_volume::{VolumeError, VolumeIo, VolumeResult};

use crate::primary::{Failure, Primary};
use crate::wire::{
    ForwardAnswer, ForwardClose, ForwardErrorKind, ForwardOp, ForwardOpen, ForwardOpened,
    ForwardRequest, CODE_NOT_FOUND, CODE_SESSION_GONE, METHOD_FORWARD_CLOSE, METHOD_FORWARD_IO,
    METHOD_FORWARD_OPEN,
};
use crate::{lock, unavailable, Shared};

/// How long opening a session keeps trying: past a primary's death, the lease the new primary
/// waits out ([`crate::TAKE_OVER_SILENCE`]) and its wait for replicas to catch up.
const OPEN_DEADLINE: Duration = Duration::from_secs(30);
/// One try at opening a session on one node (the serving node may wait for its replicas).
const OPEN_TRY_TIMEOUT: Duration = Duration::from_secs(15);
/// One forwarded request (a primary may stall a FLUSH while it drops a failed replica).
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// An idle session is kept alive this often.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(20);
/// A serving node drops a session it has not heard of for this long (its client's node died).
const SESSION_IDLE_MAX: Duration = Duration::from_secs(90);
/// Sessions one node serves at most.
const SESSIONS_MAX: usize = 1024;

/// Where a forwarding session is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Route {
    node: NodeId,
    session: u64,
}

/// What the forwarding sessions of one volume on this node had acknowledged and flushed. A
/// FLUSH through any of them covers the writes of all (NBD clients with several connections
/// send it on one), so a session may move to another node only while no session of the volume
/// holds an acknowledged write that no FLUSH covered.
#[derive(Default)]
pub(crate) struct Unflushed {
    /// Non-FUA writes, trims and zeroes acknowledged.
    acknowledged: AtomicU64,
    /// How many of them a FLUSH covered.
    flushed: AtomicU64,
}

impl Unflushed {
    /// What sessions read may not be durable (their opening FLUSH failed): counted as a write
    /// acknowledged, so that none moves to another node until a FLUSH goes through.
    fn not_known_durable(&self) {
        self.acknowledged.fetch_add(1, Ordering::SeqCst);
    }
}

/// A client's view of a volume served elsewhere.
pub struct Forwarded {
    shared: Arc<Shared>,
    name: String,
    size_bytes: u64,
    block_size_bytes: u32,
    read_only: bool,
    route: Mutex<Route>,
    /// Held while a session moves to another node ([`Forwarded::reroute`]).
    rerouting: tokio::sync::Mutex<()>,
    unflushed: Arc<Unflushed>,
    /// Set once the session lost writes it cannot vouch for: every later request fails.
    broken: Mutex<Option<String>>,
}

/// Why a forwarded call did not get an answer from a node serving the session.
enum Lost {
    /// The serving node is unreachable, restarted, or no longer serves the volume.
    Route(String),
    /// The request reached the serving node and failed there.
    Failed(VolumeError),
}

impl Forwarded {
    /// Opens a session on the node serving `name`, trying its primary first, then its other
    /// in-sync replicas (one of which takes it over once the primary has been silent past its
    /// lease), until [`OPEN_DEADLINE`].
    pub(crate) fn open(shared: Arc<Shared>, name: &str) -> VolumeResult<Arc<Forwarded>> {
        shared
            .runtime
            .clone()
            .block_on(Forwarded::open_async(shared, name))
    }

    /// [`Forwarded::open`], async (the simulation's clients use it).
    pub(crate) async fn open_async(
        shared: Arc<Shared>,
        name: &str,
    ) -> VolumeResult<Arc<Forwarded>> {
        let (route, opened, durable) = open_route(&shared, name).await?;
        let unflushed = {
            let mut volumes = lock(&shared.forwarding);
            volumes.retain(|_, unflushed| unflushed.strong_count() > 0);
            match volumes.get(name).and_then(Weak::upgrade) {
                Some(unflushed) => unflushed,
                None => {
                    let unflushed = Arc::new(Unflushed::default());
                    volumes.insert(name.to_string(), Arc::downgrade(&unflushed));
                    unflushed
                }
            }
        };
        if !durable {
            unflushed.not_known_durable();
        }
        tracing::info!(
            volume = name,
            node = route.node,
            "forwarding the volume's I/O to the node serving it"
        );
        let forwarded = Arc::new(Forwarded {
            shared: shared.clone(),
            name: name.to_string(),
            size_bytes: opened.size_bytes,
            block_size_bytes: opened.block_size_bytes,
            read_only: opened.read_only,
            route: Mutex::new(route),
            rerouting: tokio::sync::Mutex::new(()),
            unflushed,
            broken: Mutex::new(None),
        });
        {
            let mut handles = lock(&shared.forwarded);
            handles.retain(|handle| handle.strong_count() > 0);
            handles.push(Arc::downgrade(&forwarded));
        }
        shared
            .runtime
            .spawn(keepalive(Arc::downgrade(&forwarded), shared.clock()));
        Ok(forwarded)
    }

    fn current(&self) -> Route {
        *lock(&self.route)
    }

    /// The node this session's requests go to now.
    pub(crate) fn serving_node(&self) -> NodeId {
        self.current().node
    }

    /// [`Forwarded::run`] for a client thread (blocking), its time counted as forwarded.
    fn run_blocking(&self, op: ForwardOp<'_>) -> VolumeResult<Option<Vec<u8>>> {
        let _phase = keel_ops::Phase::enter(keel_ops::phase::FORWARDED);
        self.shared.runtime.block_on(self.run(op))
    }

    /// Sends `op` to the session's node; once more on a new route when that node is gone and
    /// nothing acknowledged is at risk.
    async fn run(&self, op: ForwardOp<'_>) -> VolumeResult<Option<Vec<u8>>> {
        if let Some(why) = lock(&self.broken).clone() {
            return Err(unavailable(&self.name, why));
        }
        let counts_as_write = matches!(
            op,
            ForwardOp::Write { fua: false, .. }
                | ForwardOp::Trim { .. }
                | ForwardOp::Zeroes { fua: false, .. }
        );
        let flush_covers = self.unflushed.acknowledged.load(Ordering::SeqCst);
        let route = self.current();
        let answer = match call_route(&self.shared, &self.name, route, op).await {
            Err(Lost::Route(why)) => {
                self.reroute(route, &why).await?;
                match call_route(&self.shared, &self.name, self.current(), op).await {
                    Err(Lost::Route(why)) => Err(unavailable(&self.name, why)),
                    Err(Lost::Failed(error)) => Err(error),
                    Ok(answer) => Ok(answer),
                }
            }
            Err(Lost::Failed(error)) => Err(error),
            Ok(answer) => Ok(answer),
        }?;
        if counts_as_write {
            self.unflushed.acknowledged.fetch_add(1, Ordering::SeqCst);
        }
        if op == ForwardOp::Flush {
            self.unflushed
                .flushed
                .fetch_max(flush_covers, Ordering::SeqCst);
        }
        Ok(answer)
    }

    /// Moves the session off `failed` (unless another request did already): allowed only
    /// while every write acknowledged through this node is known durable, else the session
    /// breaks for good.
    async fn reroute(&self, failed: Route, why: &str) -> VolumeResult<()> {
        let _rerouting = self.rerouting.lock().await;
        if self.current() != failed {
            return Ok(());
        }
        let acknowledged = self.unflushed.acknowledged.load(Ordering::SeqCst);
        if acknowledged > self.unflushed.flushed.load(Ordering::SeqCst) {
            let message = format!(
                "the node serving it (node {}) stopped answering with writes not yet flushed \
                 ({why}); attach again: every flushed write is kept",
                failed.node
            );
            *lock(&self.broken) = Some(message.clone());
            tracing::warn!(volume = self.name, "{message}");
            return Err(unavailable(&self.name, message));
        }
        let (next, opened, durable) = open_route(&self.shared, &self.name).await?;
        if !durable {
            self.unflushed.not_known_durable();
        }
        if opened.size_bytes < self.size_bytes {
            return Err(unavailable(
                &self.name,
                format!(
                    "node {} serves it with {} bytes, fewer than this client attached with",
                    next.node, opened.size_bytes
                ),
            ));
        }
        tracing::info!(
            volume = self.name,
            from = failed.node,
            to = next.node,
            "forwarding moved to the volume's new primary ({why})"
        );
        *lock(&self.route) = next;
        Ok(())
    }
}

/// Sends one request of session `route` for export `name` and takes its answer.
async fn call_route(
    shared: &Shared,
    name: &str,
    route: Route,
    op: ForwardOp<'_>,
) -> Result<Option<Vec<u8>>, Lost> {
    let request = ForwardRequest {
        session: route.session,
        op,
    };
    let payload = postcard::to_allocvec(&request)
        .map_err(|error| Lost::Failed(unavailable(name, error.to_string())))?;
    let reply = (shared.call(route.node, METHOD_FORWARD_IO, payload, IO_TIMEOUT))
        .await
        .map_err(|failure| match failure {
            Failure {
                code: None,
                message,
            } => Lost::Route(message),
            Failure {
                code: Some(CODE_SESSION_GONE),
                message,
            } => Lost::Route(message),
            Failure { message, .. } => Lost::Failed(unavailable(name, message)),
        })?;
    let answer: ForwardAnswer = postcard::from_bytes(&reply)
        .map_err(|error| Lost::Failed(unavailable(name, error.to_string())))?;
    match answer {
        ForwardAnswer::Done => Ok(None),
        ForwardAnswer::Data(data) => Ok(Some(data)),
        ForwardAnswer::Failed { kind, message } => Err(Lost::Failed(VolumeError::Remote {
            volume: name.to_string(),
            node: route.node,
            kind: match kind {
                ForwardErrorKind::InvalidInput => std::io::ErrorKind::InvalidInput,
                ForwardErrorKind::ReadOnly => std::io::ErrorKind::PermissionDenied,
                ForwardErrorKind::NoSpace => std::io::ErrorKind::StorageFull,
                ForwardErrorKind::Other => std::io::ErrorKind::Other,
            },
            detail: message,
        })),
    }
}

/// Client I/O, async (the simulation's clients; a server's go through [`VolumeIo`]).
impl Forwarded {
    pub async fn read_async(&self, offset: u64, buf: &mut [u8]) -> VolumeResult<()> {
        let data = self.run(self.read_op(offset, buf.len())?).await?;
        self.fill(buf, data)
    }

    pub async fn write_async(&self, offset: u64, data: &[u8], fua: bool) -> VolumeResult<()> {
        self.run(ForwardOp::Write { offset, data, fua })
            .await
            .map(drop)
    }

    pub async fn flush_async(&self) -> VolumeResult<()> {
        self.run(ForwardOp::Flush).await.map(drop)
    }

    fn read_op(&self, offset: u64, length: usize) -> VolumeResult<ForwardOp<'static>> {
        let length = u32::try_from(length).map_err(|_| VolumeError::Invalid {
            volume: self.name.clone(),
            detail: format!("a read of {length} bytes is too long to forward"),
        })?;
        Ok(ForwardOp::Read { offset, length })
    }

    /// Copies a read's answer into `buf`, which it must fill exactly.
    fn fill(&self, buf: &mut [u8], data: Option<Vec<u8>>) -> VolumeResult<()> {
        match data {
            Some(data) if data.len() == buf.len() => {
                buf.copy_from_slice(&data);
                Ok(())
            }
            other => Err(unavailable(
                &self.name,
                format!(
                    "the serving node answered a read of {} bytes with {}",
                    buf.len(),
                    other.map_or(0, |data| data.len())
                ),
            )),
        }
    }
}

/// Keeps the session alive on its serving node while the client stays attached.
async fn keepalive(forwarded: Weak<Forwarded>, clock: Arc<dyn keel_clock::Clock>) {
    loop {
        clock.sleep(KEEPALIVE_EVERY).await;
        let Some(strong) = forwarded.upgrade() else {
            return;
        };
        let route = strong.current();
        let Ok(payload) = postcard::to_allocvec(&ForwardRequest {
            session: route.session,
            op: ForwardOp::Ping,
        }) else {
            return;
        };
        let shared = strong.shared.clone();
        drop(strong);
        // A lost session is noticed (and moved) by the next request.
        let _ = shared
            .call(route.node, METHOD_FORWARD_IO, payload, IO_TIMEOUT)
            .await;
    }
}

impl Drop for Forwarded {
    fn drop(&mut self) {
        let route = self.current();
        let Ok(payload) = postcard::to_allocvec(&ForwardClose {
            session: route.session,
        }) else {
            return;
        };
        let shared = self.shared.clone();
        // Best effort: a session nobody closes expires on its own.
        self.shared.runtime.spawn(async move {
            let _ = shared
                .call(route.node, METHOD_FORWARD_CLOSE, payload, IO_TIMEOUT)
                .await;
        });
    }
}

/// The nodes that may serve export `name` now, best first: for a volume, its primary then its
/// other in-sync replicas (one of which takes it over once the primary is gone); for
/// `volume@snapshot`, the replicas holding the snapshot whole, its primary first.
fn serving_nodes(shared: &Shared, name: &str) -> VolumeResult<Vec<NodeId>> {
    let catalog = shared.metadata.catalog().read();
    let (volume, snapshot) = match name.split_once('@') {
        Some((volume, snapshot)) => (volume, Some(snapshot)),
        None => (name, None),
    };
    let entry = catalog
        .volume(volume)
        .ok_or_else(|| VolumeError::NotFound {
            name: volume.to_string(),
        })?;
    let replication = &entry.record.replication;
    let others = match snapshot {
        None => &replication.in_sync,
        Some(_) => &replication.replicas,
    };
    let mut nodes: Vec<NodeId> = std::iter::once(replication.primary)
        .chain(
            others
                .iter()
                .copied()
                .filter(|node| *node != replication.primary),
        )
        .filter(|node| *node != shared.local_node)
        .collect();
    if let Some(snapshot) = snapshot {
        let frozen = crate::snapshot_of(entry, snapshot)?;
        nodes.retain(|node| replication.replicas.contains(node) && frozen.complete_on(*node));
    }
    Ok(nodes)
}

/// Finds the node that serves `name` now and opens a session there. A volume's primary may
/// be taking over, so that is retried until [`OPEN_DEADLINE`]; a snapshot is frozen, and every
/// node holding it whole is tried once.
/// Also whether what the session reads is known durable: its opening FLUSH went through (a
/// serving node that refused it, with fewer replicas in sync than the volume's minimum, say,
/// still serves reads).
async fn open_route(shared: &Shared, name: &str) -> VolumeResult<(Route, ForwardOpened, bool)> {
    let payload = postcard::to_allocvec(&ForwardOpen {
        volume: name.to_string(),
    })
    .map_err(|error| unavailable(name, error.to_string()))?;
    let snapshot = name.contains('@');
    let clock = shared.clock();
    let deadline = clock.now()
        + if snapshot {
            Duration::ZERO
        } else {
            OPEN_DEADLINE
        };
    let mut last = String::from(if snapshot {
        "no other node holds the snapshot whole"
    } else {
        "no node holds a replica"
    });
    loop {
        for node in serving_nodes(shared, name)? {
            if node == shared.local_node {
                continue;
            }
            let call = shared.call(node, METHOD_FORWARD_OPEN, payload.clone(), OPEN_TRY_TIMEOUT);
            match call.await {
                Ok(reply) => {
                    let opened: ForwardOpened = postcard::from_bytes(&reply)
                        .map_err(|error| unavailable(name, error.to_string()))?;
                    let route = Route {
                        node,
                        session: opened.session,
                    };
                    if snapshot {
                        return Ok((route, opened, true));
                    }
                    // What the client reads from here on must survive the serving node: a
                    // write another session acknowledged there but nobody flushed (its own
                    // before it attached again, say) would otherwise vanish under a session
                    // that moves on without its client noticing (simulation seed 7283).
                    match flush_session(shared, name, route).await {
                        Ok(durable) => return Ok((route, opened, durable)),
                        Err(why) => last = format!("node {node}: {why}"),
                    }
                }
                Err(Failure {
                    code: Some(CODE_NOT_FOUND),
                    ..
                }) => {
                    return Err(match name.split_once('@') {
                        Some((volume, snapshot)) => VolumeError::SnapshotNotFound {
                            volume: volume.to_string(),
                            snapshot: snapshot.to_string(),
                        },
                        None => VolumeError::NotFound {
                            name: name.to_string(),
                        },
                    })
                }
                Err(failure) => last = format!("node {node}: {}", failure.message),
            }
        }
        if clock.now() >= deadline {
            let holding = if snapshot {
                "holding the snapshot whole"
            } else {
                "holding a replica"
            };
            return Err(unavailable(
                name,
                format!("no node {holding} would serve it through this one: {last}"),
            ));
        }
        clock.sleep(Duration::from_millis(250)).await;
    }
}

/// What a session serves: its handle, and the primary it is when opened on one directly.
pub(crate) type Served = (Arc<dyn VolumeIo>, Option<Arc<Primary>>);

/// Flushes the volume through session `route` (every write acknowledged there before is
/// then durable on every replica in sync): whether the FLUSH went through; `Err` when the
/// serving node did not answer.
async fn flush_session(shared: &Shared, name: &str, route: Route) -> Result<bool, String> {
    match call_route(shared, name, route, ForwardOp::Flush).await {
        Ok(_) => Ok(true),
        Err(Lost::Failed(VolumeError::Remote { detail, .. })) => {
            tracing::info!(
                node = route.node,
                "a forwarding session's opening FLUSH failed ({detail}): it moves to another \
                 node only after a FLUSH of its client's goes through"
            );
            Ok(false)
        }
        Err(Lost::Route(why)) => Err(why),
        Err(Lost::Failed(error)) => Err(error.to_string()),
    }
}

/// One session a node serves for a client attached elsewhere.
struct Session {
    caller: NodeId,
    io: Arc<dyn VolumeIo>,
    /// The primary `io` is, when the session was opened on it directly: served async
    /// ([`Sessions::serve_async`], the simulation's, whose one thread cannot block).
    primary: Option<Arc<Primary>>,
    volume_id: u64,
    /// A volume's session is served by its primary only; a snapshot's by any node holding it.
    follows_primary: bool,
    used: Instant,
}

/// The sessions this node serves for clients attached to nodes without a replica.
#[derive(Default)]
pub(crate) struct Sessions {
    sessions: Mutex<HashMap<u64, Session>>,
}

impl Sessions {
    /// Registers a session for `io` (opened by the caller), dropping expired ones.
    pub(crate) fn insert(
        &self,
        shared: &Shared,
        caller: NodeId,
        volume_id: u64,
        io: Arc<dyn VolumeIo>,
        primary: Option<Arc<Primary>>,
        follows_primary: bool,
    ) -> Result<ForwardOpened, String> {
        let now = shared.clock_now();
        let mut sessions = lock(&self.sessions);
        sessions.retain(|_, session| now.duration_since(session.used) < SESSION_IDLE_MAX);
        if sessions.len() >= SESSIONS_MAX {
            return Err(format!(
                "this node already serves {SESSIONS_MAX} forwarding sessions"
            ));
        }
        let session = loop {
            let id = rand::random::<u64>();
            if !sessions.contains_key(&id) {
                break id;
            }
        };
        let opened = ForwardOpened {
            session,
            size_bytes: io.size_bytes(),
            block_size_bytes: io.block_size_bytes(),
            read_only: io.read_only(),
        };
        sessions.insert(
            session,
            Session {
                caller,
                io,
                primary,
                volume_id,
                follows_primary,
                used: now,
            },
        );
        Ok(opened)
    }

    /// The session `session` of `caller`, marked used: its handle, its primary if it holds
    /// one, its volume and whether it follows the primary. `Err` if it is not served here.
    fn session(
        &self,
        shared: &Shared,
        caller: NodeId,
        session: u64,
    ) -> Result<(Served, u64, bool), String> {
        let now = shared.clock_now();
        let mut sessions = lock(&self.sessions);
        let Some(found) = sessions
            .get_mut(&session)
            .filter(|found| found.caller == caller)
        else {
            return Err(format!(
                "session {session} is not served here (the node restarted or it expired)"
            ));
        };
        found.used = now;
        Ok((
            (found.io.clone(), found.primary.clone()),
            found.volume_id,
            found.follows_primary,
        ))
    }

    /// Serves one request. `Err` means the session is not served here (any more).
    pub(crate) fn serve(
        &self,
        shared: &Shared,
        caller: NodeId,
        request: ForwardRequest<'_>,
    ) -> Result<ForwardAnswer, String> {
        let ((io, _), volume_id, follows_primary) =
            self.session(shared, caller, request.session)?;
        let outcome = match request.op {
            ForwardOp::Read { offset, length } => {
                let mut data = vec![0u8; length as usize];
                io.read(offset, &mut data).map(|()| Some(data))
            }
            ForwardOp::Write { offset, data, fua } => io.write(offset, data, fua).map(|()| None),
            ForwardOp::Flush => io.flush().map(|()| None),
            ForwardOp::Trim { offset, length } => io.trim(offset, length).map(|()| None),
            ForwardOp::Zeroes {
                offset,
                length,
                fua,
                may_trim,
            } => io
                .write_zeroes(offset, length, fua, may_trim)
                .map(|()| None),
            ForwardOp::Ping => Ok(None),
        };
        self.answer(
            shared,
            caller,
            request.session,
            volume_id,
            follows_primary,
            outcome,
        )
    }

    /// [`Sessions::serve`] without blocking: a session opened on a primary is served through
    /// its async I/O, inline (the simulation's, whose one thread cannot block); any other
    /// (a volume with one replica, a snapshot) through its handle, whose store work the
    /// simulation runs inline too.
    pub(crate) async fn serve_async(
        &self,
        shared: &Shared,
        caller: NodeId,
        request: ForwardRequest<'_>,
    ) -> Result<ForwardAnswer, String> {
        let ((_, primary), volume_id, follows_primary) =
            self.session(shared, caller, request.session)?;
        let Some(primary) = primary else {
            return self.serve(shared, caller, request);
        };
        let outcome = match request.op {
            ForwardOp::Read { offset, length } => {
                let mut data = vec![0u8; length as usize];
                (primary.read_async(offset, &mut data).await).map(|()| Some(data))
            }
            ForwardOp::Write { offset, data, fua } => {
                (primary.write_async(offset, data, fua).await).map(|()| None)
            }
            ForwardOp::Flush => primary.flush_async().await.map(|()| None),
            ForwardOp::Trim { offset, length } => {
                (primary.trim_async(offset, length).await).map(|()| None)
            }
            ForwardOp::Zeroes {
                offset,
                length,
                fua,
                may_trim,
            } => (primary
                .write_zeroes_async(offset, length, fua, may_trim)
                .await)
                .map(|()| None),
            ForwardOp::Ping => Ok(None),
        };
        self.answer(
            shared,
            caller,
            request.session,
            volume_id,
            follows_primary,
            outcome,
        )
    }

    /// The answer to a request of session `session` that had `outcome`. `Err` (the session
    /// closed) when it failed because the volume is no longer served here: the client's node
    /// moves the session.
    fn answer(
        &self,
        shared: &Shared,
        caller: NodeId,
        session: u64,
        volume_id: u64,
        follows_primary: bool,
        outcome: VolumeResult<Option<Vec<u8>>>,
    ) -> Result<ForwardAnswer, String> {
        Ok(match outcome {
            Ok(Some(data)) => ForwardAnswer::Data(data),
            Ok(None) => ForwardAnswer::Done,
            Err(error) => {
                // A replicated volume another node took over (its primary here refuses
                // everything then): the session moves there.
                if let Some(why) = moved(shared, volume_id, follows_primary) {
                    self.close(caller, session);
                    return Err(why);
                }
                let message = error.to_string();
                let kind = match std::io::Error::from(error).kind() {
                    std::io::ErrorKind::InvalidInput => ForwardErrorKind::InvalidInput,
                    std::io::ErrorKind::PermissionDenied => ForwardErrorKind::ReadOnly,
                    std::io::ErrorKind::StorageFull => ForwardErrorKind::NoSpace,
                    _ => ForwardErrorKind::Other,
                };
                ForwardAnswer::Failed { kind, message }
            }
        })
    }

    /// Whether a session of volume `volume_id` that follows its primary is served here and
    /// not expired: a client attached elsewhere uses the primary here.
    pub(crate) fn serve_volume(&self, shared: &Shared, volume_id: u64) -> bool {
        let now = shared.clock_now();
        lock(&self.sessions).values().any(|session| {
            session.volume_id == volume_id
                && session.follows_primary
                && now.duration_since(session.used) < SESSION_IDLE_MAX
        })
    }

    pub(crate) fn close(&self, caller: NodeId, session: u64) {
        let mut sessions = lock(&self.sessions);
        if sessions
            .get(&session)
            .is_some_and(|found| found.caller == caller)
        {
            sessions.remove(&session);
        }
    }
}

/// Why a session of `volume_id` is no longer served here, if it is not: the volume was deleted,
/// or (for a session that follows the primary) another node is the primary of the replicated
/// volume.
fn moved(shared: &Shared, volume_id: u64, follows_primary: bool) -> Option<String> {
    let catalog = shared.metadata.catalog().read();
    match catalog.volumes.get(&volume_id) {
        None => Some("the volume was deleted".to_string()),
        Some(entry)
            if follows_primary
                && entry.record.replication.replicas.len() > 1
                && entry.record.replication.primary != shared.local_node =>
        {
            Some(format!(
                "node {} serves the volume now",
                entry.record.replication.primary
            ))
        }
        Some(_) => None,
    }
}

impl VolumeIo for Forwarded {
    fn name(&self) -> &str {
        &self.name
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn block_size_bytes(&self) -> u32 {
        self.block_size_bytes
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> VolumeResult<()> {
        let data = self.run_blocking(self.read_op(offset, buf.len())?)?;
        self.fill(buf, data)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> VolumeResult<()> {
        self.run_blocking(ForwardOp::Write { offset, data, fua })
            .map(drop)
    }

    fn flush(&self) -> VolumeResult<()> {
        self.run_blocking(ForwardOp::Flush).map(drop)
    }

    fn trim(&self, offset: u64, length: u64) -> VolumeResult<()> {
        self.run_blocking(ForwardOp::Trim { offset, length })
            .map(drop)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    ) -> VolumeResult<()> {
        self.run_blocking(ForwardOp::Zeroes {
            offset,
            length,
            fua,
            may_trim,
        })
        .map(drop)
    }
}
