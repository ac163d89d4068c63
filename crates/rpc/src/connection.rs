//! One authenticated connection: a writer task that MACs and coalesces queued frames, and a
//! reader that verifies each frame and hands it on — answers to waiting calls (client side),
//! requests to the handler (server side, bounded in flight).
//!
//! Any error on a connection (I/O, a bad frame, an answer nobody asked for) closes it: calls in
//! flight fail with `ConnectionLost`, the next call dials again.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::time::Instant;

use crate::frame::{self, FrameError, Header, Kind, RemoteError, HEADER_BYTES, MAC_BYTES};
use crate::handshake::{self, Session};
use crate::{lock, Caller, Faults, Handler, LocalIdentity, NodeId, RpcConfig, RpcError};

/// A frame for the writer.
struct Outgoing {
    header: Header,
    payload: Vec<u8>,
}

type Answer = Result<Vec<u8>, RpcError>;

/// Writes queued frames, coalescing what is queued into one write; stops when the queue closes
/// or a write fails.
async fn writer(
    mut socket: OwnedWriteHalf,
    mut queue: mpsc::Receiver<Outgoing>,
    key: [u8; 32],
    batch_max_bytes: usize,
) -> std::io::Result<()> {
    let mut counter = 0u64;
    let mut buffer = Vec::with_capacity(64 << 10);
    while let Some(first) = queue.recv().await {
        buffer.clear();
        frame::encode_frame(&mut buffer, &key, counter, &first.header, &first.payload);
        counter += 1;
        while buffer.len() < batch_max_bytes {
            match queue.try_recv() {
                Ok(next) => {
                    frame::encode_frame(&mut buffer, &key, counter, &next.header, &next.payload);
                    counter += 1;
                }
                Err(_) => break,
            }
        }
        socket.write_all(&buffer).await?;
    }
    socket.shutdown().await
}

/// Why reading stopped.
#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Frame(#[from] FrameError),
}

/// Reads and verifies the next frame.
async fn read_frame(
    socket: &mut OwnedReadHalf,
    key: &[u8; 32],
    counter: u64,
    payload_max_bytes: u32,
) -> Result<(Header, Vec<u8>), ReadError> {
    let mut header_bytes = [0u8; HEADER_BYTES];
    socket.read_exact(&mut header_bytes).await?;
    let header = Header::decode(&header_bytes, payload_max_bytes)?;
    let mut received = [0u8; MAC_BYTES];
    socket.read_exact(&mut received).await?;
    let mut payload = vec![0u8; header.length as usize];
    socket.read_exact(&mut payload).await?;
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
    outgoing: mpsc::Sender<Outgoing>,
    pending: Mutex<HashMap<u64, oneshot::Sender<Answer>>>,
    next_request: AtomicU64,
    open: AtomicBool,
    /// The reader and writer tasks, stopped when the connection closes (they hold it alive).
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
        let (outgoing, queue) = mpsc::channel(config.queue_frames_max);
        let connection = Arc::new(ClientConnection {
            peer_node: session.peer_node,
            local_node,
            address,
            outgoing,
            pending: Mutex::new(HashMap::new()),
            next_request: AtomicU64::new(1),
            open: AtomicBool::new(true),
            tasks: Mutex::new(Vec::new()),
        });
        let writer_connection = Arc::downgrade(&connection);
        let writer_task = tokio::spawn(async move {
            if let Err(error) = writer(
                write,
                queue,
                session.client_to_server,
                config.write_batch_max_bytes,
            )
            .await
            {
                if let Some(connection) = writer_connection.upgrade() {
                    connection.close(&format!("write failed: {error}"));
                }
            }
        });
        let reader_connection = connection.clone();
        let key = session.server_to_client;
        let reader_task = tokio::spawn(async move {
            reader_connection
                .read_answers(read, key, config.payload_max_bytes)
                .await;
        });
        lock(&connection.tasks).extend([writer_task.abort_handle(), reader_task.abort_handle()]);
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
        mut socket: OwnedReadHalf,
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
        payload: Vec<u8>,
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
        let queued =
            tokio::time::timeout_at(deadline, self.outgoing.send(Outgoing { header, payload }))
                .await;
        match queued {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                lock(&self.pending).remove(&request_id);
                return Err(RpcError::Unreachable {
                    peer: self.address.clone(),
                    detail: "connection closed".to_string(),
                });
            }
            Err(_) => {
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
    let (mut read, write) = stream.into_split();
    let (outgoing, queue) = mpsc::channel::<Outgoing>(config.queue_frames_max);
    let writer_task = tokio::spawn(writer(
        write,
        queue,
        session.server_to_client,
        config.write_batch_max_bytes,
    ));
    let in_flight = Arc::new(Semaphore::new(config.requests_in_flight_max));
    let mut counter = 0u64;
    loop {
        let (header, payload) = match read_frame(
            &mut read,
            &session.client_to_server,
            counter,
            config.payload_max_bytes,
        )
        .await
        {
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
        let outgoing = outgoing.clone();
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
            let _ = outgoing.send(Outgoing { header, payload }).await;
        });
    }
    drop(outgoing);
    writer_task.abort();
}
