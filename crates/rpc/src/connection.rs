//! One authenticated connection: an outbox its senders write their frames through (MAC'd,
//! counted; a drain task finishes what the socket did not take at once), and a
//! reader that verifies each frame and hands it on — answers to waiting calls (client side),
//! requests to the handler (server side, bounded in flight).
//!
//! Any error on a connection (I/O, a bad frame, an answer nobody asked for) closes it: calls in
//! flight fail with `ConnectionLost`, the next call dials again.

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Notify, Semaphore};
use tokio::time::Instant;

use crate::frame::{self, FrameError, Header, Kind, RemoteError, HEADER_BYTES, MAC_BYTES};
use crate::handshake::{self, Session};
use crate::{lock, Caller, Faults, Handler, LocalIdentity, NodeId, RpcConfig, RpcError};

type Answer = Result<Vec<u8>, RpcError>;

/// Frames on their way out of one connection, in the order they were sent: each is encoded
/// (counted, MAC'd) into one buffer and written by its sender at once while the socket takes
/// it — no hand-over to another task on the path a call waits on. What the socket does not
/// take is written by the connection's [`Outbox::drain`] task once it is writable; frames
/// sent meanwhile join the buffer and go out together. At most `frames_max` frames wait:
/// senders then wait for room until their deadline.
struct Outbox {
    socket: OwnedWriteHalf,
    key: [u8; 32],
    frames_max: usize,
    state: Mutex<OutboxState>,
    /// The socket did not take everything: the drain task takes over.
    backlog: Notify,
    /// Frames left the buffer, or the outbox failed: senders waiting for room look again.
    room: Notify,
}

#[derive(Default)]
struct OutboxState {
    /// Counter of the next frame.
    counter: u64,
    buffer: Vec<u8>,
    /// Bytes of `buffer` already written.
    written: usize,
    /// Where each frame not yet wholly written ends in `buffer`.
    ends: VecDeque<usize>,
    /// The drain task writes (the socket was full); senders only append.
    backlogged: bool,
    /// Why nothing more can be sent.
    failed: Option<String>,
}

/// Why a frame was not sent.
enum SendError {
    /// `frames_max` frames waited until the deadline.
    Full,
    /// The connection failed or closed.
    Closed(String),
}

/// What one round of writing left.
enum Written {
    All,
    SocketFull,
    Failed,
}

/// Above this many written bytes at the front of a buffer still being written, they are
/// dropped from it (a slow peer does not keep every frame it took in memory).
const OUTBOX_COMPACT_BYTES: usize = 1 << 20;
/// A payload at least this large is written from the caller's buffer when nothing waits before
/// it, rather than copied into the outbox first (a smaller one costs less to copy than a
/// second write).
const DIRECT_PAYLOAD_BYTES: usize = 64 << 10;
/// Most buffers given to one vectored write (well under the system's `IOV_MAX`).
const WRITE_SLICES_MAX: usize = 64;

impl Outbox {
    fn new(socket: OwnedWriteHalf, key: [u8; 32], frames_max: usize) -> Arc<Outbox> {
        Arc::new(Outbox {
            socket,
            key,
            frames_max: frames_max.max(1),
            state: Mutex::new(OutboxState::default()),
            backlog: Notify::new(),
            room: Notify::new(),
        })
    }

    /// Sends one frame: written before this returns if the socket takes it, else left to the
    /// drain task. Waits for room until `deadline` (none: as long as it takes).
    async fn send<P: AsRef<[u8]>>(
        &self,
        header: &Header,
        parts: &[P],
        deadline: Option<Instant>,
    ) -> Result<(), SendError> {
        let length: usize = parts.iter().map(|part| part.as_ref().len()).sum();
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            {
                let mut state = lock(&self.state);
                if let Some(reason) = &state.failed {
                    return Err(SendError::Closed(reason.clone()));
                }
                if state.ends.len() < self.frames_max {
                    let counter = state.counter;
                    state.counter += 1;
                    if length >= DIRECT_PAYLOAD_BYTES
                        && !state.backlogged
                        && state.written == state.buffer.len()
                    {
                        // Nothing waits before it: written from the caller's buffers, and only
                        // what the socket did not take is copied into the outbox.
                        let head = frame::frame_head(&self.key, counter, header, parts);
                        return match self.write_direct(&mut state, &head, parts) {
                            Written::All => Ok(()),
                            Written::SocketFull => {
                                state.backlogged = true;
                                self.backlog.notify_one();
                                Ok(())
                            }
                            Written::Failed => {
                                Err(SendError::Closed(state.failed.clone().unwrap_or_default()))
                            }
                        };
                    }
                    frame::encode_frame_parts(&mut state.buffer, &self.key, counter, header, parts);
                    let end = state.buffer.len();
                    state.ends.push_back(end);
                    if !state.backlogged {
                        match self.write_out(&mut state) {
                            Written::All => {}
                            Written::SocketFull => {
                                state.backlogged = true;
                                self.backlog.notify_one();
                            }
                            Written::Failed => {
                                let reason = state.failed.clone().unwrap_or_default();
                                return Err(SendError::Closed(reason));
                            }
                        }
                    }
                    return Ok(());
                }
            }
            match deadline {
                Some(deadline) => {
                    if tokio::time::timeout_at(deadline, room).await.is_err() {
                        return Err(SendError::Full);
                    }
                }
                None => room.await,
            }
        }
    }

    /// Writes one frame (its `head` and payload `parts`) to the socket while the buffer is
    /// empty; what the socket does not take now goes into the buffer, for the drain task.
    fn write_direct<P: AsRef<[u8]>>(
        &self,
        state: &mut OutboxState,
        head: &[u8],
        parts: &[P],
    ) -> Written {
        let pieces: Vec<&[u8]> = std::iter::once(head)
            .chain(parts.iter().map(AsRef::as_ref))
            .filter(|piece| !piece.is_empty())
            .collect();
        // The first piece not wholly written, and how much of it was.
        let (mut piece, mut into) = (0usize, 0usize);
        while piece < pieces.len() {
            let slices: Vec<IoSlice<'_>> = std::iter::once(&pieces[piece][into..])
                .chain(pieces[piece + 1..].iter().copied())
                .take(WRITE_SLICES_MAX)
                .map(IoSlice::new)
                .collect();
            match self.socket.try_write_vectored(&slices) {
                Ok(0) => {
                    self.fail_locked(state, "the socket took no bytes".to_string());
                    return Written::Failed;
                }
                Ok(mut taken) => {
                    while taken > 0 {
                        let left = pieces[piece].len() - into;
                        if taken < left {
                            into += taken;
                            taken = 0;
                        } else {
                            taken -= left;
                            piece += 1;
                            into = 0;
                        }
                    }
                }
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => {
                    self.fail_locked(state, format!("write failed: {error}"));
                    return Written::Failed;
                }
            }
        }
        if piece == pieces.len() {
            return Written::All;
        }
        state.buffer.extend_from_slice(&pieces[piece][into..]);
        for rest in &pieces[piece + 1..] {
            state.buffer.extend_from_slice(rest);
        }
        let end = state.buffer.len();
        state.ends.push_back(end);
        Written::SocketFull
    }

    /// Writes what the socket takes now, without waiting.
    fn write_out(&self, state: &mut OutboxState) -> Written {
        let before = state.ends.len();
        let mut outcome = Written::All;
        while state.written < state.buffer.len() {
            match self.socket.try_write(&state.buffer[state.written..]) {
                Ok(0) => {
                    self.fail_locked(state, "the socket took no bytes".to_string());
                    return Written::Failed;
                }
                Ok(written) => state.written += written,
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                    outcome = Written::SocketFull;
                    break;
                }
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => {
                    self.fail_locked(state, format!("write failed: {error}"));
                    return Written::Failed;
                }
            }
        }
        while state.ends.front().is_some_and(|end| *end <= state.written) {
            state.ends.pop_front();
        }
        if state.written == state.buffer.len() {
            state.buffer.clear();
            state.written = 0;
        } else if state.written >= OUTBOX_COMPACT_BYTES && state.written * 2 >= state.buffer.len() {
            let written = state.written;
            state.buffer.drain(..written);
            for end in state.ends.iter_mut() {
                *end -= written;
            }
            state.written = 0;
        }
        if state.ends.len() < before {
            self.room.notify_waiters();
        }
        outcome
    }

    fn fail_locked(&self, state: &mut OutboxState, reason: String) {
        if state.failed.is_none() {
            state.failed = Some(reason);
        }
        state.buffer = Vec::new();
        state.ends.clear();
        state.written = 0;
        self.room.notify_waiters();
        self.backlog.notify_one();
    }

    /// Refuses every later frame (the connection closed).
    fn close(&self, reason: &str) {
        self.fail_locked(&mut lock(&self.state), reason.to_string());
    }

    /// The drain task: writes what senders left whenever the socket becomes writable. Returns
    /// why it stopped (the outbox failed).
    async fn drain(&self) -> String {
        loop {
            let backlog = self.backlog.notified();
            let backlogged = {
                let state = lock(&self.state);
                if let Some(reason) = &state.failed {
                    return reason.clone();
                }
                state.backlogged
            };
            if !backlogged {
                backlog.await;
                continue;
            }
            if let Err(error) = self.socket.writable().await {
                let reason = format!("write failed: {error}");
                self.close(&reason);
                return reason;
            }
            let mut state = lock(&self.state);
            match self.write_out(&mut state) {
                Written::All => state.backlogged = false,
                Written::SocketFull => {}
                Written::Failed => return state.failed.clone().unwrap_or_default(),
            }
        }
    }
}

/// Why reading stopped.
#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Frame(#[from] FrameError),
}

/// What a connection's reader takes from its socket per read: a small frame's header, MAC and
/// payload, and frames queued behind it, come in one read instead of one each (a larger
/// payload is read straight into its own buffer).
const READ_BUFFER_BYTES: usize = 64 << 10;

/// A connection's socket as its reader reads it.
type FrameReader = BufReader<OwnedReadHalf>;

fn frame_reader(socket: OwnedReadHalf) -> FrameReader {
    BufReader::with_capacity(READ_BUFFER_BYTES, socket)
}

/// Reads and verifies the next frame.
async fn read_frame(
    socket: &mut (impl AsyncRead + Unpin),
    key: &[u8; 32],
    counter: u64,
    payload_max_bytes: u32,
) -> Result<(Header, Vec<u8>), ReadError> {
    let mut header_bytes = [0u8; HEADER_BYTES];
    socket.read_exact(&mut header_bytes).await?;
    let header = Header::decode(&header_bytes, payload_max_bytes)?;
    let mut received = [0u8; MAC_BYTES];
    socket.read_exact(&mut received).await?;
    // Read into spare capacity: no zero-fill of a payload about to be overwritten.
    let length = header.length as usize;
    let mut payload = Vec::with_capacity(length);
    while payload.len() < length {
        let want = length - payload.len();
        if socket.take(want as u64).read_buf(&mut payload).await? == 0 {
            return Err(ReadError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
    }
    if !frame::mac_matches(
        &received,
        &frame::mac(key, counter, &header_bytes, &payload),
    ) {
        return Err(FrameError::Mac.into());
    }
    Ok((header, payload))
}

/// The client side of a connection.
pub(crate) struct ClientConnection {
    pub(crate) peer_node: NodeId,
    /// The id this node had when it authenticated (a node that joined since must redial).
    pub(crate) local_node: NodeId,
    address: String,
    outbox: Arc<Outbox>,
    pending: Mutex<HashMap<u64, oneshot::Sender<Answer>>>,
    next_request: AtomicU64,
    open: AtomicBool,
    /// The reader and drain tasks, stopped when the connection closes (they hold it alive).
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl ClientConnection {
    pub(crate) fn start(
        stream: TcpStream,
        session: Session,
        local_node: NodeId,
        address: String,
        config: RpcConfig,
    ) -> Arc<ClientConnection> {
        let (read, write) = stream.into_split();
        let connection = Arc::new(ClientConnection {
            peer_node: session.peer_node,
            local_node,
            address,
            outbox: Outbox::new(write, session.client_to_server, config.queue_frames_max),
            pending: Mutex::new(HashMap::new()),
            next_request: AtomicU64::new(1),
            open: AtomicBool::new(true),
            tasks: Mutex::new(Vec::new()),
        });
        let drain_connection = Arc::downgrade(&connection);
        let outbox = connection.outbox.clone();
        let drain_task = tokio::spawn(async move {
            let reason = outbox.drain().await;
            if let Some(connection) = drain_connection.upgrade() {
                connection.close(&reason);
            }
        });
        let reader_connection = connection.clone();
        let key = session.server_to_client;
        let reader_task = tokio::spawn(async move {
            reader_connection
                .read_answers(frame_reader(read), key, config.payload_max_bytes)
                .await;
        });
        lock(&connection.tasks).extend([drain_task.abort_handle(), reader_task.abort_handle()]);
        if !connection.is_open() {
            connection.close("closed while starting");
        }
        connection
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open.load(Ordering::SeqCst)
    }

    /// Closes the connection (calls in flight fail).
    pub(crate) fn shut(&self) {
        self.close("no longer wanted");
    }

    /// Fails every call in flight and refuses new ones.
    fn close(&self, reason: &str) {
        if self.open.swap(false, Ordering::SeqCst) {
            tracing::info!(peer = %self.address, reason, "node-to-node connection closed");
        }
        self.outbox.close(reason);
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
        let pending: Vec<_> = lock(&self.pending).drain().collect();
        for (_, waiter) in pending {
            let _ = waiter.send(Err(RpcError::ConnectionLost {
                peer: self.address.clone(),
                detail: reason.to_string(),
            }));
        }
    }

    async fn read_answers(
        self: Arc<Self>,
        mut socket: FrameReader,
        key: [u8; 32],
        payload_max_bytes: u32,
    ) {
        let mut counter = 0u64;
        let reason = loop {
            match read_frame(&mut socket, &key, counter, payload_max_bytes).await {
                Ok((header, payload)) => {
                    counter += 1;
                    let waiter = lock(&self.pending).remove(&header.request_id);
                    let answer = match header.kind {
                        Kind::Response => Ok(payload),
                        Kind::Error => match postcard::from_bytes::<RemoteError>(&payload) {
                            Ok(error) => Err(RpcError::Remote {
                                peer: self.address.clone(),
                                error,
                            }),
                            Err(error) => {
                                break format!("undecodable error answer: {error}");
                            }
                        },
                        Kind::Request => {
                            break "the peer sent a request on our connection".to_string()
                        }
                    };
                    // An answer to a call that timed out meanwhile has no waiter: dropped.
                    if let Some(waiter) = waiter {
                        let _ = waiter.send(answer);
                    }
                }
                Err(ReadError::Io(error)) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
                    break "closed by the peer".to_string()
                }
                Err(ReadError::Frame(error)) => {
                    tracing::warn!(peer = %self.address, %error, "bad frame from a node; closing the connection");
                    break format!("bad frame: {error}");
                }
                Err(ReadError::Io(error)) => break error.to_string(),
            }
        };
        self.close(&reason);
    }

    pub(crate) async fn call(
        &self,
        method: u16,
        payload: crate::Payload,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Vec<u8>, RpcError> {
        if !self.is_open() {
            return Err(RpcError::Unreachable {
                peer: self.address.clone(),
                detail: "connection closed".to_string(),
            });
        }
        let request_id = self.next_request.fetch_add(1, Ordering::Relaxed);
        let (waiter, answer) = oneshot::channel();
        lock(&self.pending).insert(request_id, waiter);
        let budget = deadline.saturating_duration_since(Instant::now());
        let header = Header {
            kind: Kind::Request,
            method,
            request_id,
            deadline_ms: u32::try_from(budget.as_millis()).unwrap_or(u32::MAX).max(1),
            length: payload.len() as u32,
        };
        let timed_out = || RpcError::Timeout {
            peer: self.address.clone(),
            timeout,
        };
        match self
            .outbox
            .send(&header, payload.parts(), Some(deadline))
            .await
        {
            Ok(()) => {}
            Err(SendError::Closed(reason)) => {
                // Its frame did not wholly reach the socket: the peer never got it.
                lock(&self.pending).remove(&request_id);
                self.close(&reason);
                return Err(RpcError::Unreachable {
                    peer: self.address.clone(),
                    detail: format!("connection closed: {reason}"),
                });
            }
            Err(SendError::Full) => {
                // Never queued: the peer did not get it.
                lock(&self.pending).remove(&request_id);
                return Err(RpcError::Unreachable {
                    peer: self.address.clone(),
                    detail: format!("send queue full for {timeout:?}"),
                });
            }
        }
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(RpcError::ConnectionLost {
                peer: self.address.clone(),
                detail: "connection closed".to_string(),
            }),
            Err(_) => {
                lock(&self.pending).remove(&request_id);
                Err(timed_out())
            }
        }
    }
}

/// Serves one accepted connection until it closes.
pub(crate) async fn serve_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    identity: Arc<LocalIdentity>,
    handler: Arc<dyn Handler>,
    config: RpcConfig,
    faults: Faults,
) {
    if let Err(error) = stream.set_nodelay(true) {
        tracing::debug!(%peer, %error, "could not set TCP_NODELAY");
    }
    let own = identity.snapshot();
    let session = match tokio::time::timeout(
        config.handshake_timeout,
        handshake::server(&mut stream, &own),
    )
    .await
    {
        Ok(Ok(session)) => session,
        Ok(Err(handshake::HandshakeError::Io(error))) => {
            tracing::info!(%peer, %error, "node-to-node handshake broke off");
            return;
        }
        Ok(Err(error)) => {
            tracing::warn!(%peer, %error, "refused a node-to-node connection");
            return;
        }
        Err(_) => {
            tracing::warn!(%peer, "refused a node-to-node connection: the handshake timed out");
            return;
        }
    };
    let caller = if session.peer_node == 0 {
        Caller::Unassigned
    } else {
        Caller::Member(session.peer_node)
    };
    let (read, write) = stream.into_split();
    let mut read = frame_reader(read);
    let outbox = Outbox::new(write, session.server_to_client, config.queue_frames_max);
    let drain = outbox.clone();
    // Stopped with this connection, also when its server drops it mid-read (its socket then
    // closes once the answers in flight are done).
    let mut drain_task = AbortOnDrop(tokio::spawn(async move { drain.drain().await }));
    let in_flight = Arc::new(Semaphore::new(config.requests_in_flight_max));
    let mut counter = 0u64;
    loop {
        let read = tokio::select! {
            read = read_frame(
                &mut read,
                &session.client_to_server,
                counter,
                config.payload_max_bytes,
            ) => read,
            // Writing failed: nothing this connection answers can reach the peer.
            stopped = &mut drain_task.0 => {
                let reason = stopped.unwrap_or_else(|error| error.to_string());
                tracing::info!(%peer, reason, "node-to-node connection failed");
                break;
            }
        };
        let (header, payload) = match read {
            Ok(frame) => frame,
            Err(ReadError::Io(error)) if error.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(ReadError::Frame(error)) => {
                tracing::warn!(%peer, node = session.peer_node, %error, "bad frame from a node; closing the connection");
                break;
            }
            Err(ReadError::Io(error)) => {
                tracing::info!(%peer, %error, "node-to-node connection failed");
                break;
            }
        };
        counter += 1;
        if header.kind != Kind::Request {
            tracing::warn!(%peer, "a node sent an answer on a connection it opened; closing it");
            break;
        }
        if faults.blocks(session.peer_node) {
            // Partitioned (fault injection): the request is lost, as on a cut network.
            continue;
        }
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            break;
        };
        let handler = handler.clone();
        let outbox = outbox.clone();
        let faults = faults.clone();
        let budget = Duration::from_millis(u64::from(header.deadline_ms.max(1)));
        tokio::spawn(async move {
            let _permit = permit;
            let answer =
                tokio::time::timeout(budget, handler.call(caller, header.method, payload)).await;
            let Ok(answer) = answer else {
                // The caller gave up: nobody waits for the answer.
                return;
            };
            if let Caller::Member(node) = caller {
                if faults.blocks(node) {
                    return;
                }
            }
            let (kind, payload) = match answer {
                Ok(payload) => (Kind::Response, payload),
                Err(error) => match postcard::to_allocvec(&error) {
                    Ok(encoded) => (Kind::Error, encoded),
                    Err(_) => return,
                },
            };
            let header = Header {
                kind,
                method: 0,
                request_id: header.request_id,
                deadline_ms: 0,
                length: payload.len() as u32,
            };
            let _ = outbox.send(&header, &[payload], None).await;
        });
    }
    outbox.close("the connection closed");
}

/// A task stopped when this is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
