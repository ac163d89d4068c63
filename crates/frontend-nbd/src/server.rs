//! The accept loop: one task per connection, each running the handshake then the transmission
//! phase. A connection's failure (protocol violation, I/O error, even a panic) ends only that
//! connection and is logged; the server keeps accepting.
//!
//! Invariants: at most [`CONNECTIONS_MAX`] connections are served at once (more are accepted and
//! closed at once, so clients fail fast instead of hanging in the backlog); a handshake lasts at
//! most [`HANDSHAKE_TIMEOUT`]; on shutdown no new connection is accepted and open ones get
//! [`SHUTDOWN_DRAIN_TIMEOUT`] to answer what is in flight before their tasks are aborted.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use crate::error::NbdError;
use crate::export::Exports;
use crate::handshake::{negotiate, Outcome};
use crate::transmission::{signalled, transmit};
use crate::{
    ACCEPT_ERROR_BACKOFF, CONNECTIONS_MAX, HANDSHAKE_TIMEOUT, REQUEST_BUFFER_BYTES,
    SHUTDOWN_DRAIN_TIMEOUT,
};

/// Serves NBD on `listener` until `shutdown` resolves (its output is ignored, so
/// `tokio::signal::ctrl_c()` works as is), then lets open connections finish the requests they
/// have in flight (up to [`SHUTDOWN_DRAIN_TIMEOUT`]) and returns.
///
/// Errors of single connections are logged, never returned; the function only returns once
/// shut down.
pub async fn serve<F>(
    listener: TcpListener,
    exports: Arc<dyn Exports>,
    shutdown: F,
) -> io::Result<()>
where
    F: Future,
{
    let (stop, stop_signal) = watch::channel(false);
    let slots = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                        tracing::warn!(%peer, limit = CONNECTIONS_MAX, "too many NBD connections; closing");
                        drop(stream);
                        continue;
                    };
                    // Replies are small and latency-bound; do not let Nagle hold them back.
                    if let Err(error) = stream.set_nodelay(true) {
                        tracing::debug!(%peer, %error, "could not set TCP_NODELAY");
                    }
                    let exports = Arc::clone(&exports);
                    let stop_signal = stop_signal.clone();
                    connections.spawn(async move {
                        let (reader, writer) = stream.into_split();
                        log_end(peer, serve_connection(reader, writer, exports, stop_signal).await);
                        drop(slot);
                    });
                }
                Err(error) => {
                    // Typically EMFILE/ENFILE: wait for descriptors to free up instead of spinning.
                    tracing::warn!(%error, "accepting an NBD connection failed");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                }
            },
            Some(joined) = connections.join_next(), if !connections.is_empty() => {
                if let Err(join) = joined {
                    tracing::error!(%join, "an NBD connection task panicked");
                }
            }
        }
    }
    let _ = stop.send(true);
    let drained = tokio::time::timeout(SHUTDOWN_DRAIN_TIMEOUT, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            remaining = connections.len(),
            "NBD connections did not finish in time; aborting them"
        );
        connections.shutdown().await;
    }
    Ok(())
}

/// Serves one NBD session over any byte stream (a TCP socket, a Unix socket, an in-memory pipe in
/// tests). Returns why the session ended, if it ended abnormally.
pub async fn serve_stream<S>(stream: S, exports: Arc<dyn Exports>) -> Result<(), NbdError>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (reader, writer) = tokio::io::split(stream);
    // Nobody will ever ask this session to stop early; keep the sender alive for its duration.
    let (_stop, stop_signal) = watch::channel(false);
    serve_connection(reader, writer, exports, stop_signal).await
}

async fn serve_connection<R, W>(
    reader: R,
    mut writer: W,
    exports: Arc<dyn Exports>,
    mut stop_signal: watch::Receiver<bool>,
) -> Result<(), NbdError>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send + 'static,
{
    // One buffered reader for both phases: bytes a client pipelines right after NBD_OPT_GO stay
    // in the buffer for the transmission phase.
    let mut reader = BufReader::with_capacity(REQUEST_BUFFER_BYTES, reader);
    let negotiated = tokio::select! {
        negotiated = tokio::time::timeout(
            HANDSHAKE_TIMEOUT,
            negotiate(&mut reader, &mut writer, &exports),
        ) => negotiated.map_err(|_| NbdError::HandshakeTimeout {
            seconds: HANDSHAKE_TIMEOUT.as_secs(),
        })??,
        () = signalled(&mut stop_signal) => return Ok(()),
    };
    match negotiated {
        Outcome::Aborted => Ok(()),
        Outcome::Transmission(selected) => {
            tracing::debug!(export = %selected.name, "NBD client entered transmission");
            transmit(reader, writer, selected, stop_signal).await
        }
    }
}

fn log_end(peer: SocketAddr, ended: Result<(), NbdError>) {
    match ended {
        Ok(()) => tracing::debug!(%peer, "NBD connection closed"),
        Err(error) => tracing::info!(%peer, %error, "NBD connection ended"),
    }
}
