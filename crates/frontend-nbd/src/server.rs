//! The accept loop: one thread per connection, running the handshake then the transmission
//! phase (which starts more threads as the client's queue deepens). A connection's failure (protocol violation, I/O error, even a panic) ends only that
//! connection and is logged; the server keeps accepting.
//!
//! Invariants: at most [`crate::CONNECTIONS_MAX`] connections are served at once (more are
//! accepted and closed at once, so clients fail fast instead of hanging in the backlog, unless a
//! connection idle for [`crate::IDLE_EVICT_AFTER`] gives its slot up); a handshake lasts at
//! most [`HANDSHAKE_TIMEOUT`]; on shutdown no new connection is accepted and open ones get
//! [`SHUTDOWN_DRAIN_TIMEOUT`] to answer what is in flight before their sockets are closed.

use std::collections::HashMap;
use std::future::Future;
use std::io::{self, BufReader};
use std::net::{Shutdown, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};
use tokio::task::JoinSet;

use crate::error::NbdError;
use crate::export::Exports;
use crate::handshake::{negotiate, Outcome, Wire};
use crate::socket::{Socket, SocketReader};
use crate::transmission::transmit;
use crate::{
    Limits, ACCEPT_ERROR_BACKOFF, HANDSHAKE_TIMEOUT, REQUEST_BUFFER_BYTES, SHUTDOWN_DRAIN_TIMEOUT,
};

/// Serves NBD on `listener` until `shutdown` resolves (its output is ignored, so
/// `tokio::signal::ctrl_c()` works as is), then lets open connections finish the requests they
/// have in flight (up to [`SHUTDOWN_DRAIN_TIMEOUT`]) and returns.
///
/// Each connection runs on its own threads (see the transmission module); this task only
/// accepts. Errors of single connections are logged, never returned; the function only returns
/// once shut down.
pub async fn serve<F>(
    listener: TcpListener,
    exports: Arc<dyn Exports>,
    shutdown: F,
) -> io::Result<()>
where
    F: Future,
{
    serve_with(
        listener,
        exports,
        shutdown,
        Limits::default(),
        keel_ops::Ops::disabled(),
    )
    .await
}

/// [`serve`] with other [`Limits`], registering every request with `ops` (`keel ops`).
pub async fn serve_with<F>(
    listener: TcpListener,
    exports: Arc<dyn Exports>,
    shutdown: F,
    limits: Limits,
    ops: keel_ops::Ops,
) -> io::Result<()>
where
    F: Future,
{
    let sessions = Arc::new(Sessions::default());
    let slots = Arc::new(Semaphore::new(limits.connections_max));
    // One task per connection thread, resolving when the thread is done.
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let slot = match Arc::clone(&slots).try_acquire_owned() {
                        Ok(slot) => Some(slot),
                        // Full: take the slot of a connection idle for long, if there is one.
                        Err(_) if sessions.evict_idlest(limits.idle_evict_after) => {
                            tokio::time::timeout(EVICTION_WAIT, Arc::clone(&slots).acquire_owned())
                                .await
                                .ok()
                                .and_then(Result::ok)
                        }
                        Err(_) => None,
                    };
                    let Some(slot) = slot else {
                        tracing::warn!(%peer, limit = limits.connections_max, "too many NBD connections; closing");
                        drop(stream);
                        continue;
                    };
                    // Replies are small and latency-bound; do not let Nagle hold them back.
                    if let Err(error) = stream.set_nodelay(true) {
                        tracing::debug!(%peer, %error, "could not set TCP_NODELAY");
                    }
                    let stream = match stream.into_std().and_then(|stream| {
                        stream.set_nonblocking(false)?;
                        Ok(stream)
                    }) {
                        Ok(stream) => stream,
                        Err(error) => {
                            tracing::warn!(%peer, %error, "could not take over an NBD connection");
                            continue;
                        }
                    };
                    let exports = Arc::clone(&exports);
                    let sessions = Arc::clone(&sessions);
                    let tracing = Tracing { ops: ops.clone(), peer: Some(peer) };
                    let (done, finished) = oneshot::channel::<()>();
                    let spawned = std::thread::Builder::new()
                        .name("nbd-conn".into())
                        .spawn(move || {
                            let socket: Arc<dyn Socket> = Arc::new(stream);
                            if let Some((id, activity)) = sessions.register(&socket) {
                                let ended = run_session(socket, &exports, HANDSHAKE_TIMEOUT, Some(activity), tracing);
                                sessions.remove(id);
                                log_end(peer, ended);
                            }
                            drop(slot);
                            let _ = done.send(());
                        });
                    match spawned {
                        Ok(_) => {
                            connections.spawn(async move {
                                let _ = finished.await;
                            });
                        }
                        Err(error) => tracing::warn!(%peer, %error, "could not start an NBD connection thread"),
                    }
                }
                Err(error) => {
                    // Typically EMFILE/ENFILE: wait for descriptors to free up instead of spinning.
                    tracing::warn!(%error, "accepting an NBD connection failed");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    // Readers see the end of their stream; requests in flight are still answered.
    sessions.stop(Shutdown::Read);
    let drained = tokio::time::timeout(SHUTDOWN_DRAIN_TIMEOUT, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            remaining = connections.len(),
            "NBD connections did not finish in time; closing them"
        );
        // Fails writes blocked on clients that do not read; a thread still inside the export
        // ends when the export returns.
        sessions.stop(Shutdown::Both);
    }
    Ok(())
}

/// Serves one NBD session over a connected blocking socket, on the calling thread (and the
/// worker threads it starts), giving the client `handshake_timeout` to reach the transmission
/// phase. Returns why the session ended, if it ended abnormally. [`serve`] uses it for every
/// TCP connection with [`HANDSHAKE_TIMEOUT`]; tests use it over a Unix socket pair.
pub fn serve_stream<S: Socket>(
    stream: S,
    exports: Arc<dyn Exports>,
    handshake_timeout: Duration,
) -> Result<(), NbdError> {
    let tracing = Tracing {
        ops: keel_ops::Ops::disabled(),
        peer: None,
    };
    run_session(Arc::new(stream), &exports, handshake_timeout, None, tracing)
}

/// Where a session registers its requests, and the client they come from.
pub(crate) struct Tracing {
    pub ops: keel_ops::Ops,
    pub peer: Option<std::net::SocketAddr>,
}

fn run_session(
    socket: Arc<dyn Socket>,
    exports: &Arc<dyn Exports>,
    handshake_timeout: Duration,
    activity: Option<Arc<Activity>>,
    tracing: Tracing,
) -> Result<(), NbdError> {
    // One buffered reader for both phases: bytes a client pipelines right after NBD_OPT_GO stay
    // in the buffer for the transmission phase.
    let mut reader = BufReader::with_capacity(
        REQUEST_BUFFER_BYTES,
        SocketReader {
            socket: Arc::clone(&socket),
            activity,
        },
    );
    let mut wire = Wire {
        reader: &mut reader,
        socket: &*socket,
        deadline: Instant::now() + handshake_timeout,
        timeout: handshake_timeout,
    };
    match negotiate(&mut wire, exports)? {
        Outcome::Aborted => Ok(()),
        Outcome::Transmission(selected) => {
            tracing::debug!(export = %selected.name, "NBD client entered transmission");
            // In transmission there is no idle timeout: a kernel client may sit idle for hours.
            // An idle connection only gives its slot up to a new client when all are taken.
            socket
                .set_read_timeout(None)
                .and_then(|()| socket.set_write_timeout(None))
                .map_err(NbdError::io("clearing the handshake timeout"))?;
            transmit(reader, socket, selected, tracing)
        }
    }
}

/// The sockets of open sessions, so that shutdown can wake their threads.
#[derive(Default)]
struct Sessions {
    state: Mutex<SessionsState>,
}

#[derive(Default)]
struct SessionsState {
    stopping: bool,
    next_id: u64,
    sockets: HashMap<u64, (Arc<dyn Socket>, Arc<Activity>)>,
}

/// Time a new client waits for the slot of an evicted idle connection to free up.
const EVICTION_WAIT: Duration = Duration::from_secs(2);

/// When a session last received bytes.
pub(crate) struct Activity {
    last: Mutex<Instant>,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            last: Mutex::new(Instant::now()),
        }
    }

    pub(crate) fn touch(&self) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    fn idle(&self) -> Duration {
        self.last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }
}

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, SessionsState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Adds a session; `None` if the server is already stopping (the session must not start).
    fn register(&self, socket: &Arc<dyn Socket>) -> Option<(u64, Arc<Activity>)> {
        let mut state = self.lock();
        if state.stopping {
            return None;
        }
        let id = state.next_id;
        state.next_id += 1;
        let activity = Arc::new(Activity::new());
        state
            .sockets
            .insert(id, (Arc::clone(socket), Arc::clone(&activity)));
        Some((id, activity))
    }

    /// Closes the session idle the longest if it has been idle at least `after`; whether one was.
    fn evict_idlest(&self, after: Duration) -> bool {
        let state = self.lock();
        let idlest = state
            .sockets
            .values()
            .map(|(socket, activity)| (activity.idle(), socket))
            .max_by_key(|(idle, _)| *idle);
        match idlest {
            Some((idle, socket)) if idle >= after => {
                tracing::info!(
                    idle_s = idle.as_secs(),
                    "every NBD connection slot is taken: closing the connection idle the longest"
                );
                let _ = socket.shutdown(Shutdown::Both);
                true
            }
            _ => false,
        }
    }

    fn remove(&self, id: u64) {
        self.lock().sockets.remove(&id);
    }

    /// Refuses new sessions and shuts down the sockets of open ones.
    fn stop(&self, how: Shutdown) {
        let mut state = self.lock();
        state.stopping = true;
        for (socket, _) in state.sockets.values() {
            let _ = socket.shutdown(how);
        }
    }
}

fn log_end(peer: SocketAddr, ended: Result<(), NbdError>) {
    match ended {
        Ok(()) => tracing::debug!(%peer, "NBD connection closed"),
        Err(error) => tracing::info!(%peer, %error, "NBD connection ended"),
    }
}
