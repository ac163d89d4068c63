//! The transmission phase of one connection: a reader loop that decodes requests and starts each
//! on a blocking thread, and a writer task that sends replies in completion order (the protocol
//! allows out-of-order replies, matched by cookie).
//!
//! Invariants:
//! - At most [`CONNECTION_REQUESTS_IN_FLIGHT_MAX`] requests and [`CONNECTION_BUFFER_MAX_BYTES`]
//!   of read/write buffers are held per connection; a request's permits are released only after
//!   its reply has been handed to the socket buffer, so a client that stops reading replies stops
//!   being read from.
//! - Every request except NBD_CMD_DISC gets exactly one reply; a refused write's payload is still
//!   consumed so the stream stays framed (or the connection ends if the payload is absurd).
//! - FLUSH: a flush is sent to the export only after every write-like request (write, trim,
//!   write-zeroes) received before it on this connection has finished; the [`crate::Export`]
//!   contract makes the export's flush cover completed writes from all connections. That is
//!   stronger than the protocol's rule (only writes already *replied to* must be covered), and
//!   it is what the Linux block layer and qemu expect of a disk.
//! - On NBD_CMD_DISC, end of stream, a bad magic or server shutdown: no new requests are read,
//!   requests in flight finish and are answered, then the socket is shut down.

use std::collections::BTreeSet;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

use crate::error::NbdError;
use crate::export::Export;
use crate::handshake::Selected;
use crate::protocol::{
    check_request, encode_simple_reply, error_code_from_io, Command, RequestHeader, EIO,
    REQUEST_HEADER_BYTES,
};
use crate::{
    CONNECTION_BUFFER_MAX_BYTES, CONNECTION_REQUESTS_IN_FLIGHT_MAX, REPLY_BUFFER_BYTES,
    WRITE_DISCARD_MAX_BYTES,
};

/// One reply on its way to the writer task, holding the request's permits until it is written.
struct Reply {
    cookie: u64,
    error: u32,
    /// A successful read's data.
    data: Option<Vec<u8>>,
    _request: OwnedSemaphorePermit,
    _buffer: Option<OwnedSemaphorePermit>,
}

/// Runs the transmission phase until the client disconnects, breaks the protocol, or the server
/// shuts down. Returns the reason if it was an error.
pub(crate) async fn transmit<R, W>(
    mut reader: R,
    writer: W,
    selected: Selected,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), NbdError>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let Selected {
        export, geometry, ..
    } = selected;
    let requests = Arc::new(Semaphore::new(CONNECTION_REQUESTS_IN_FLIGHT_MAX));
    let buffers = Arc::new(Semaphore::new(CONNECTION_BUFFER_MAX_BYTES as usize));
    let (replies, reply_queue) = mpsc::channel::<Reply>(CONNECTION_REQUESTS_IN_FLIGHT_MAX);
    let writer_task = tokio::spawn(write_replies(writer, reply_queue));
    let tracker = Arc::new(WriteTracker::default());

    let ended: Result<(), NbdError> = loop {
        let mut header_bytes = [0u8; REQUEST_HEADER_BYTES];
        let read = tokio::select! {
            biased;
            () = signalled(&mut shutdown) => break Ok(()),
            () = replies.closed() => break Ok(()),
            read = reader.read_exact(&mut header_bytes) => read,
        };
        match read {
            Ok(_) => {}
            // The client closed without NBD_CMD_DISC (a hard disconnect): not an error here.
            Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(source) => {
                break Err(NbdError::Io {
                    context: "reading a request header",
                    source,
                })
            }
        }
        let header = match RequestHeader::parse(&header_bytes) {
            Ok(header) => header,
            Err(error) => break Err(error),
        };
        let request_permit = tokio::select! {
            biased;
            () = signalled(&mut shutdown) => break Ok(()),
            permit = Arc::clone(&requests).acquire_owned() => {
                permit.expect("the request semaphore is never closed")
            }
        };
        let command = match check_request(&header, &geometry) {
            Ok(command) => command,
            Err(code) => {
                let payload = header.payload_bytes();
                if payload > WRITE_DISCARD_MAX_BYTES {
                    break Err(NbdError::WriteTooLarge {
                        length_bytes: payload,
                    });
                }
                if let Err(error) = discard(&mut reader, u64::from(payload)).await {
                    break Err(error);
                }
                tracing::debug!(?header, code, "refusing request");
                let reply = Reply {
                    cookie: header.cookie,
                    error: code,
                    data: None,
                    _request: request_permit,
                    _buffer: None,
                };
                if replies.send(reply).await.is_err() {
                    break Ok(());
                }
                continue;
            }
        };
        if command == Command::Disconnect {
            break Ok(());
        }
        let buffer_permit = match command.buffer_bytes() {
            0 => None,
            bytes => Some(
                Arc::clone(&buffers)
                    .acquire_many_owned(bytes)
                    .await
                    .expect("the buffer semaphore is never closed"),
            ),
        };
        let payload = match command {
            Command::Write { length, .. } => {
                let mut payload = vec![0u8; length as usize];
                if let Err(source) = reader.read_exact(&mut payload).await {
                    break Err(NbdError::Io {
                        context: "reading a write payload",
                        source,
                    });
                }
                payload
            }
            _ => Vec::new(),
        };
        // Sequence numbers are taken here, in receive order, so a flush knows which writes came
        // before it.
        let ticket = command.is_write().then(|| tracker.begin());
        let barrier = tracker.barrier();
        let work = Work {
            export: Arc::clone(&export),
            command,
            payload,
        };
        let replies = replies.clone();
        let cookie = header.cookie;
        // The pool worker runs the export call and hands the reply straight to the writer task:
        // no task in between, so a request costs two thread hand-offs, not four.
        let finish = move || {
            let (error, data) = work.execute();
            let reply = Reply {
                cookie,
                error,
                data,
                _request: request_permit,
                _buffer: buffer_permit,
            };
            // If the writer is gone the connection is closing; the reply has nowhere to go.
            let _ = replies.blocking_send(reply);
            // Release the write only once its reply is queued: a flush waiting for it then
            // queues its own reply after this one, so replies of earlier writes always precede
            // the flush's.
            drop(ticket);
        };
        if command == Command::Flush && !tracker.writes_done_before(barrier) {
            // A flush first waits (asynchronously) for the writes received before it.
            let tracker = Arc::clone(&tracker);
            tokio::spawn(async move {
                tracker.wait_for_writes_before(barrier).await;
                crate::pool::spawn(finish);
            });
        } else {
            crate::pool::spawn(finish);
        }
    };

    // Requests in flight hold clones of `replies`; the writer ends once the last one is sent.
    drop(replies);
    let written = match writer_task.await {
        Ok(result) => result,
        Err(join) => Err(NbdError::Io {
            context: "writing replies",
            source: io::Error::other(join.to_string()),
        }),
    };
    ended.and(written)
}

/// One request's execution, run on a pool thread.
struct Work {
    export: Arc<dyn Export>,
    command: Command,
    payload: Vec<u8>,
}

impl Work {
    /// Runs the request on the calling (pool) thread; returns the NBD error value (0 on
    /// success) and a read's data. A panicking export becomes EIO for this request only.
    fn execute(self) -> (u32, Option<Vec<u8>>) {
        let Work {
            export,
            command,
            payload,
        } = self;
        let outcome = catch_unwind(AssertUnwindSafe(|| -> io::Result<Option<Vec<u8>>> {
            match command {
                Command::Read { offset, length } => {
                    let mut buffer = vec![0u8; length as usize];
                    if length > 0 {
                        export.read(offset, &mut buffer)?;
                    }
                    Ok(Some(buffer))
                }
                Command::Write { offset, fua, .. } => {
                    if !payload.is_empty() {
                        export.write(offset, &payload, fua)?;
                    }
                    Ok(None)
                }
                Command::Flush => export.flush().map(|()| None),
                Command::Trim {
                    offset,
                    length,
                    fua,
                } => {
                    if length > 0 {
                        export.trim(offset, u64::from(length))?;
                        // Trim has no FUA variant in the export API; a flush gives the same
                        // guarantee.
                        if fua {
                            export.flush()?;
                        }
                    }
                    Ok(None)
                }
                Command::WriteZeroes {
                    offset,
                    length,
                    fua,
                    may_trim,
                } => {
                    if length > 0 {
                        export.write_zeroes(offset, u64::from(length), fua, may_trim)?;
                    }
                    Ok(None)
                }
                Command::Disconnect => Ok(None),
            }
        }));
        match outcome {
            Ok(Ok(data)) => (0, data),
            Ok(Err(error)) => {
                tracing::warn!(?command, %error, "export request failed");
                (error_code_from_io(&error), None)
            }
            // A panicking export must not take the connection (or the server) down with it.
            Err(_) => {
                tracing::error!(?command, "export request panicked");
                (EIO, None)
            }
        }
    }
}

/// Sends replies as they complete. Replies already queued are written together before one flush
/// of the socket buffer.
async fn write_replies<W>(writer: W, mut queue: mpsc::Receiver<Reply>) -> Result<(), NbdError>
where
    W: AsyncWrite + Unpin,
{
    let mut out = BufWriter::with_capacity(REPLY_BUFFER_BYTES, writer);
    while let Some(reply) = queue.recv().await {
        write_reply(&mut out, reply).await?;
        for _ in 0..CONNECTION_REQUESTS_IN_FLIGHT_MAX {
            match queue.try_recv() {
                Ok(reply) => write_reply(&mut out, reply).await?,
                Err(_) => break,
            }
        }
        out.flush().await.map_err(NbdError::io("sending replies"))?;
    }
    // Every request is answered: close our side (the TCP FIN ends the session cleanly).
    out.shutdown()
        .await
        .map_err(NbdError::io("closing the connection"))
}

async fn write_reply<W: AsyncWrite + Unpin>(
    out: &mut BufWriter<W>,
    reply: Reply,
) -> Result<(), NbdError> {
    out.write_all(&encode_simple_reply(reply.error, reply.cookie))
        .await
        .map_err(NbdError::io("sending a reply"))?;
    if reply.error == 0 {
        if let Some(data) = &reply.data {
            out.write_all(data)
                .await
                .map_err(NbdError::io("sending read data"))?;
        }
    }
    Ok(())
}

/// Reads and drops a refused write's payload, so the next request header is where the client
/// put it.
async fn discard<R: AsyncRead + Unpin>(reader: &mut R, length: u64) -> Result<(), NbdError> {
    if length == 0 {
        return Ok(());
    }
    let copied = tokio::io::copy(&mut reader.take(length), &mut tokio::io::sink())
        .await
        .map_err(NbdError::io("skipping a refused write payload"))?;
    if copied != length {
        return Err(NbdError::Io {
            context: "skipping a refused write payload",
            source: io::ErrorKind::UnexpectedEof.into(),
        });
    }
    Ok(())
}

/// Resolves once the server asks connections to stop. A dropped sender means nobody can ask any
/// more, so it never resolves then.
pub(crate) async fn signalled(shutdown: &mut watch::Receiver<bool>) {
    if shutdown.wait_for(|stop| *stop).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The write-like requests of one connection that are received but not finished, by receive
/// sequence number; flushes wait on it.
#[derive(Default)]
struct WriteTracker {
    in_flight: Mutex<BTreeSet<u64>>,
    next: AtomicU64,
    finished: watch::Sender<()>,
}

/// Marks one write-like request in flight; dropping it (when the export call returned, or if the
/// task died) marks it finished.
struct WriteTicket {
    tracker: Arc<WriteTracker>,
    sequence: u64,
}

impl WriteTracker {
    fn begin(self: &Arc<Self>) -> WriteTicket {
        let sequence = self.next.fetch_add(1, Ordering::SeqCst);
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(sequence);
        WriteTicket {
            tracker: Arc::clone(self),
            sequence,
        }
    }

    /// The sequence number the next write will get: writes below it were received earlier.
    fn barrier(&self) -> u64 {
        self.next.load(Ordering::SeqCst)
    }

    /// Whether no write with a sequence number below `barrier` is in flight.
    fn writes_done_before(&self, barrier: u64) -> bool {
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .first()
            .is_none_or(|&oldest| oldest >= barrier)
    }

    /// Waits until no write with a sequence number below `barrier` is in flight.
    async fn wait_for_writes_before(&self, barrier: u64) {
        // Subscribing before checking means a write finishing between the check and the wait
        // still wakes us.
        let mut finished = self.finished.subscribe();
        loop {
            if self.writes_done_before(barrier) || finished.changed().await.is_err() {
                return;
            }
        }
    }
}

impl Drop for WriteTicket {
    fn drop(&mut self) {
        self.tracker
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.sequence);
        self.tracker.finished.send_replace(());
    }
}
