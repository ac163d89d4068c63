//! The transmission phase of one connection, on blocking threads in the manner of nbdkit: each
//! worker takes the read side, reads one request, lets the read side go, runs the request
//! against the export and writes the reply itself. A request crosses no thread: the thread the
//! kernel wakes for the request's bytes is the one that answers it. Replies go out in
//! completion order (the protocol allows out-of-order replies, matched by cookie).
//!
//! Invariants:
//! - At most [`CONNECTION_REQUESTS_IN_FLIGHT_MAX`] workers, hence requests in flight, per
//!   connection. Workers start lazily: one that takes a request while no other is waiting to read
//!   starts another, so a queue-depth-1 client uses two threads and a deep queue at most the
//!   bound.
//! - At most [`CONNECTION_BUFFER_MAX_BYTES`] of read/write buffers per connection. A request's
//!   share is released only after its reply has been handed to the socket, so a client that
//!   stops reading replies stops being read from. Buffers of answered requests are kept for the
//!   next ones, up to [`SPARE_BYTES_MAX`] ([`Spares`]).
//! - Every request except NBD_CMD_DISC gets exactly one reply (while the socket takes them); a
//!   refused write's payload is still consumed so the stream stays framed (or the connection ends
//!   if the payload is absurd).
//! - FLUSH: a flush is sent to the export only after every write-like request (write, trim,
//!   write-zeroes) received before it on this connection has finished and been answered; the
//!   [`crate::Export`] contract makes the export's flush cover completed writes from all
//!   connections. That is stronger than the protocol's rule (only writes already *replied to*
//!   must be covered), and it is what the Linux block layer and qemu expect of a disk.
//! - On NBD_CMD_DISC, end of stream, a bad magic, a failed reply, or server shutdown (which shuts
//!   the socket's read side): no new requests are read, requests in flight finish and are
//!   answered, then the socket is shut down.

use std::collections::BTreeSet;
use std::io::{self, BufReader, Read};
use std::net::Shutdown;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::NbdError;
use crate::export::Export;
use crate::handshake::Selected;
use crate::protocol::{
    check_request, encode_simple_reply, error_code_from_io, Command, ExportGeometry, RequestHeader,
    EIO, REQUEST_HEADER_BYTES, SIMPLE_REPLY_HEADER_BYTES,
};
use crate::server::Tracing;
use crate::socket::{write_all_vectored, Socket, SocketReader};
use crate::{
    CONNECTION_BUFFER_MAX_BYTES, CONNECTION_REQUESTS_IN_FLIGHT_MAX, WRITE_DISCARD_MAX_BYTES,
};
use keel_ops::phase;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs the transmission phase on the calling thread (and the workers it starts) until the
/// client disconnects, breaks the protocol, or the socket's read side is shut down. Returns the
/// reason if it was an error.
pub(crate) fn transmit(
    reader: BufReader<SocketReader>,
    socket: Arc<dyn Socket>,
    selected: Selected,
    tracing: Tracing,
) -> Result<(), NbdError> {
    let Selected {
        export,
        geometry,
        name,
    } = selected;
    let connection = Arc::new(Connection {
        export,
        geometry,
        name: Arc::from(name),
        tracing,
        socket,
        read_side: Mutex::new(ReadSide {
            reader,
            closed: false,
        }),
        readers_waiting: AtomicUsize::new(0),
        workers: Mutex::new(1),
        workers_gone: Condvar::new(),
        outbox: Mutex::new(Outbox::default()),
        tracker: WriteTracker::default(),
        buffers: Budget::new(u64::from(CONNECTION_BUFFER_MAX_BYTES)),
        spares: Spares::default(),
        failure: Mutex::new(None),
    });
    run_worker(&connection);
    let mut workers = lock(&connection.workers);
    while *workers > 0 {
        workers = connection
            .workers_gone
            .wait(workers)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
    }
    drop(workers);
    // Every request is answered: close our side (the TCP FIN ends the session cleanly). The
    // client may be gone already; that is not this session's error.
    let _ = connection.socket.shutdown(Shutdown::Write);
    let failure = lock(&connection.failure).take();
    match failure {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

struct ReadSide {
    reader: BufReader<SocketReader>,
    /// No more requests will be read (disconnect, end of stream, protocol error).
    closed: bool,
}

struct Connection {
    export: Arc<dyn Export>,
    geometry: ExportGeometry,
    /// The export's name, for `keel ops`.
    name: Arc<str>,
    tracing: Tracing,
    socket: Arc<dyn Socket>,
    read_side: Mutex<ReadSide>,
    /// Workers waiting for `read_side`; when none is, a worker taking a request starts another.
    readers_waiting: AtomicUsize,
    /// Workers alive (including the session's own thread).
    workers: Mutex<usize>,
    workers_gone: Condvar,
    /// Replies waiting for the socket, and whether a worker is writing them.
    outbox: Mutex<Outbox>,
    tracker: WriteTracker,
    buffers: Budget,
    spares: Spares,
    /// The first error that ended the session.
    failure: Mutex<Option<NbdError>>,
}

/// Replies are written by one worker at a time, the sender; replies finished meanwhile queue
/// here and the sender writes them all in one `writev` when its write returns (a reply write
/// costs about as much as the request on loopback, so batching them matters at depth).
#[derive(Default)]
struct Outbox {
    replies: Vec<Vec<u8>>,
    /// Buffer budget the queued replies hold, released once they are written.
    buffer_bytes: u64,
    sending: bool,
    /// A write failed: nothing more will be sent.
    failed: bool,
}

/// One request taken from the stream, in receive order.
enum Request<'a> {
    /// Answered with `code` without reaching the export.
    Refused { cookie: u64, code: u32 },
    Run {
        cookie: u64,
        command: Command,
        /// A write's data.
        payload: Vec<u8>,
        /// The request's share of the connection's buffer budget, held until it is answered.
        buffer_bytes: u64,
        /// Write-like requests are tracked until answered, for later flushes.
        ticket: Option<WriteTicket<'a>>,
        /// For a flush: the writes with a lower sequence number came before it.
        barrier: u64,
        /// The request in `keel ops`, finished once its reply is queued.
        op: keel_ops::OpGuard,
    },
}

/// Decrements the worker count when a worker ends, however it ends.
struct WorkerExit<'a>(&'a Connection);

impl Drop for WorkerExit<'_> {
    fn drop(&mut self) {
        *lock(&self.0.workers) -= 1;
        self.0.workers_gone.notify_all();
    }
}

fn run_worker(connection: &Arc<Connection>) {
    let _exit = WorkerExit(connection);
    while let Some(request) = connection.next_request() {
        connection.answer(request);
    }
}

impl Connection {
    /// Takes the next request off the stream, or `None` once the stream is finished.
    fn next_request(self: &Arc<Self>) -> Option<Request<'_>> {
        self.readers_waiting.fetch_add(1, Ordering::SeqCst);
        let mut side = lock(&self.read_side);
        self.readers_waiting.fetch_sub(1, Ordering::SeqCst);
        if side.closed {
            return None;
        }
        match self.read_request(&mut side.reader) {
            Ok(Some(request)) => {
                if self.readers_waiting.load(Ordering::SeqCst) == 0 {
                    self.add_worker();
                }
                Some(request)
            }
            Ok(None) => {
                side.closed = true;
                None
            }
            Err(error) => {
                side.closed = true;
                self.fail(error);
                None
            }
        }
    }

    /// Reads one request (with a write's payload). `None` means the session is over: the
    /// client sent NBD_CMD_DISC or closed its side, or the server shut the read side down.
    fn read_request(
        &self,
        reader: &mut BufReader<SocketReader>,
    ) -> Result<Option<Request<'_>>, NbdError> {
        let mut header_bytes = [0u8; REQUEST_HEADER_BYTES];
        match reader.read_exact(&mut header_bytes) {
            Ok(()) => {}
            // The client closed without NBD_CMD_DISC (a hard disconnect): not an error here.
            Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(source) => {
                return Err(NbdError::Io {
                    context: "reading a request header",
                    source,
                })
            }
        }
        let header = RequestHeader::parse(&header_bytes)?;
        let command = match check_request(&header, &self.geometry) {
            Ok(command) => command,
            Err(code) => {
                let payload = header.payload_bytes();
                if payload > WRITE_DISCARD_MAX_BYTES {
                    return Err(NbdError::WriteTooLarge {
                        length_bytes: payload,
                    });
                }
                discard(reader, u64::from(payload))?;
                tracing::debug!(?header, code, "refusing request");
                return Ok(Some(Request::Refused {
                    cookie: header.cookie,
                    code,
                }));
            }
        };
        if command == Command::Disconnect {
            return Ok(None);
        }
        let op = self.tracing.ops.start(self.describe(command));
        let buffer_bytes = u64::from(command.buffer_bytes());
        op.phase(phase::QUEUED);
        self.buffers.acquire(buffer_bytes);
        op.phase(phase::RECEIVING);
        let payload = match command {
            Command::Write { length, .. } => {
                let mut payload = self.spares.take(length as usize);
                if let Err(source) = reader.read_exact(&mut payload) {
                    self.buffers.release(buffer_bytes);
                    return Err(NbdError::Io {
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
        let ticket = command.is_write().then(|| self.tracker.begin());
        Ok(Some(Request::Run {
            cookie: header.cookie,
            command,
            payload,
            buffer_bytes,
            ticket,
            barrier: self.tracker.barrier(),
            op,
        }))
    }

    /// A request as `keel ops` shows it.
    fn describe(&self, command: Command) -> keel_ops::Start {
        let (operation, offset, length) = match command {
            Command::Read { offset, length } => ("read", offset, length),
            Command::Write { offset, length, .. } => ("write", offset, length),
            Command::Trim { offset, length, .. } => ("trim", offset, length),
            Command::WriteZeroes { offset, length, .. } => ("write_zeroes", offset, length),
            Command::Flush => ("flush", 0, 0),
            Command::Disconnect => ("disconnect", 0, 0),
        };
        keel_ops::Start {
            frontend: "nbd",
            operation,
            target: keel_ops::Target::Volume {
                name: Arc::clone(&self.name),
                offset,
                length: u64::from(length),
            },
            client: self.tracing.peer,
        }
    }

    /// Starts one more worker, up to the bound.
    fn add_worker(self: &Arc<Self>) {
        let mut workers = lock(&self.workers);
        if *workers >= CONNECTION_REQUESTS_IN_FLIGHT_MAX {
            return;
        }
        let connection = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || run_worker(&connection));
        match spawned {
            Ok(_) => *workers += 1,
            // The workers already running carry on; requests just wait longer.
            Err(error) => tracing::warn!(%error, "could not start an NBD connection worker"),
        }
    }

    /// Runs one request and sends its reply.
    fn answer(&self, request: Request<'_>) {
        match request {
            Request::Refused { cookie, code } => {
                self.send(encode_simple_reply(code, cookie).to_vec(), 0, None);
            }
            Request::Run {
                cookie,
                command,
                payload,
                buffer_bytes,
                ticket,
                barrier,
                op,
            } => {
                if command == Command::Flush {
                    op.phase(phase::QUEUED);
                    self.tracker.wait_for_writes_before(barrier);
                }
                op.phase(match command {
                    Command::Read { .. } => phase::READING,
                    Command::Flush => phase::FLUSHING,
                    _ => phase::WRITING,
                });
                let reply =
                    op.enter(|| execute(&*self.export, &self.spares, command, payload, cookie));
                op.phase(phase::REPLYING);
                self.send(reply, buffer_bytes, ticket);
            }
        }
    }

    /// Queues one reply and, unless another worker is already writing, writes the queue until
    /// it is empty. `ticket` is released once the reply is queued: a flush waiting for that
    /// write then queues its own reply after this one. Once a reply cannot be written, none
    /// can: the session stops reading and ends.
    fn send(&self, reply: Vec<u8>, buffer_bytes: u64, ticket: Option<WriteTicket<'_>>) {
        let mut outbox = lock(&self.outbox);
        if outbox.failed {
            drop(outbox);
            self.buffers.release(buffer_bytes);
            return;
        }
        outbox.replies.push(reply);
        outbox.buffer_bytes += buffer_bytes;
        drop(ticket);
        if outbox.sending {
            return;
        }
        outbox.sending = true;
        loop {
            let replies = std::mem::take(&mut outbox.replies);
            let released = std::mem::take(&mut outbox.buffer_bytes);
            if replies.is_empty() {
                outbox.sending = false;
                return;
            }
            drop(outbox);
            let written = write_all_vectored(&*self.socket, &replies);
            for reply in replies {
                self.spares.keep(reply);
            }
            self.buffers.release(released);
            outbox = lock(&self.outbox);
            if let Err(source) = written {
                outbox.failed = true;
                outbox.sending = false;
                outbox.replies.clear();
                let stranded = std::mem::take(&mut outbox.buffer_bytes);
                drop(outbox);
                self.buffers.release(stranded);
                self.fail(NbdError::Io {
                    context: "sending a reply",
                    source,
                });
                // Wakes the worker blocked reading the next request.
                let _ = self.socket.shutdown(Shutdown::Both);
                return;
            }
        }
    }

    fn fail(&self, error: NbdError) {
        lock(&self.failure).get_or_insert(error);
    }
}

/// Runs one request on the calling thread and returns its encoded reply (header, then a
/// successful read's data). A panicking export becomes EIO for this request only.
fn execute(
    export: &dyn Export,
    spares: &Spares,
    command: Command,
    payload: Vec<u8>,
    cookie: u64,
) -> Vec<u8> {
    let mut read_reply = Vec::new();
    let outcome = catch_unwind(AssertUnwindSafe(|| -> io::Result<()> {
        match command {
            Command::Read { offset, length } => {
                // Whatever a kept buffer held is overwritten: the export fills every byte
                // it answers, and a failed read answers the header alone.
                read_reply = spares.take(SIMPLE_REPLY_HEADER_BYTES + length as usize);
                if length > 0 {
                    export.read(offset, &mut read_reply[SIMPLE_REPLY_HEADER_BYTES..])?;
                }
                Ok(())
            }
            Command::Write { offset, fua, .. } => {
                if !payload.is_empty() {
                    export.write(offset, &payload, fua)?;
                }
                Ok(())
            }
            Command::Flush => export.flush(),
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
                Ok(())
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
                Ok(())
            }
            Command::Disconnect => Ok(()),
        }
    }));
    spares.keep(payload);
    let error = match outcome {
        Ok(Ok(())) => 0,
        Ok(Err(error)) => {
            tracing::warn!(?command, %error, "export request failed");
            error_code_from_io(&error)
        }
        // A panicking export must not take the connection (or the server) down with it.
        Err(_) => {
            tracing::error!(?command, "export request panicked");
            EIO
        }
    };
    let header = encode_simple_reply(error, cookie);
    if error == 0 && read_reply.len() >= SIMPLE_REPLY_HEADER_BYTES {
        read_reply[..SIMPLE_REPLY_HEADER_BYTES].copy_from_slice(&header);
        read_reply
    } else {
        spares.keep(read_reply);
        header.to_vec()
    }
}

/// Bytes of answered requests' buffers a connection keeps for its next requests.
const SPARE_BYTES_MAX: usize = 8 << 20;
/// Smaller buffers are not kept: a reply header, a small read.
const SPARE_BYTES_MIN: usize = 64 << 10;

/// Buffers of answered requests (read replies, write payloads), kept for the next ones: a new
/// buffer is zero-filled at every request (and a large one mapped afresh), 7 % of the CPU of
/// 1 MiB reads. A kept buffer's bytes are stale, never sent: each use overwrites
/// what it sends.
#[derive(Default)]
struct Spares {
    kept: Mutex<(Vec<Vec<u8>>, usize)>,
}

impl Spares {
    /// A buffer of `length` bytes, of any content: only what it grows by is zero-filled. A
    /// small one is new (no lock taken: small requests come by the hundred thousand).
    fn take(&self, length: usize) -> Vec<u8> {
        if length < SPARE_BYTES_MIN {
            return vec![0; length];
        }
        let mut buffer = {
            let mut kept = lock(&self.kept);
            let (buffers, bytes) = &mut *kept;
            match buffers.pop() {
                Some(buffer) => {
                    *bytes -= buffer.capacity();
                    buffer
                }
                None => Vec::new(),
            }
        };
        buffer.resize(length, 0);
        buffer
    }

    /// Keeps `buffer` for a later [`Spares::take`], within [`SPARE_BYTES_MAX`].
    fn keep(&self, buffer: Vec<u8>) {
        let capacity = buffer.capacity();
        if capacity < SPARE_BYTES_MIN {
            return;
        }
        let mut kept = lock(&self.kept);
        let (buffers, bytes) = &mut *kept;
        if *bytes + capacity <= SPARE_BYTES_MAX {
            *bytes += capacity;
            buffers.push(buffer);
        }
    }
}

/// Reads and drops a refused write's payload, so the next request header is where the client
/// put it.
fn discard(reader: &mut BufReader<SocketReader>, length: u64) -> Result<(), NbdError> {
    if length == 0 {
        return Ok(());
    }
    let copied = io::copy(&mut reader.by_ref().take(length), &mut io::sink())
        .map_err(NbdError::io("skipping a refused write payload"))?;
    if copied != length {
        return Err(NbdError::Io {
            context: "skipping a refused write payload",
            source: io::ErrorKind::UnexpectedEof.into(),
        });
    }
    Ok(())
}

/// A counting budget of buffer bytes; `acquire` waits until enough is free.
struct Budget {
    state: Mutex<BudgetState>,
    released: Condvar,
}

struct BudgetState {
    free: u64,
    /// Threads waiting in `acquire` (a notification is a system call; skip it when nobody
    /// waits).
    waiting: usize,
}

impl Budget {
    fn new(bytes: u64) -> Budget {
        Budget {
            state: Mutex::new(BudgetState {
                free: bytes,
                waiting: 0,
            }),
            released: Condvar::new(),
        }
    }

    /// Takes `bytes` (at most the whole budget, which the request limits guarantee).
    fn acquire(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut state = lock(&self.state);
        while state.free < bytes {
            state.waiting += 1;
            state = self
                .released
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            state.waiting -= 1;
        }
        state.free -= bytes;
    }

    fn release(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut state = lock(&self.state);
        state.free += bytes;
        if state.waiting > 0 {
            self.released.notify_all();
        }
    }
}

/// The write-like requests of one connection that are received but not answered, by receive
/// sequence number; flushes wait on it.
#[derive(Default)]
struct WriteTracker {
    state: Mutex<TrackerState>,
    finished: Condvar,
}

#[derive(Default)]
struct TrackerState {
    in_flight: BTreeSet<u64>,
    next: u64,
    /// Flushes waiting in `wait_for_writes_before`.
    waiting: usize,
}

/// Marks one write-like request in flight; dropping it (once answered, or if its worker died)
/// marks it finished.
struct WriteTicket<'a> {
    tracker: &'a WriteTracker,
    sequence: u64,
}

impl WriteTracker {
    fn begin(&self) -> WriteTicket<'_> {
        let mut state = lock(&self.state);
        let sequence = state.next;
        state.next += 1;
        state.in_flight.insert(sequence);
        WriteTicket {
            tracker: self,
            sequence,
        }
    }

    /// The sequence number the next write will get: writes below it were received earlier.
    fn barrier(&self) -> u64 {
        lock(&self.state).next
    }

    /// Waits until no write with a sequence number below `barrier` is in flight.
    fn wait_for_writes_before(&self, barrier: u64) {
        let mut state = lock(&self.state);
        while state
            .in_flight
            .first()
            .is_some_and(|&oldest| oldest < barrier)
        {
            state.waiting += 1;
            state = self
                .finished
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            state.waiting -= 1;
        }
    }
}

impl Drop for WriteTicket<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.tracker.state);
        state.in_flight.remove(&self.sequence);
        if state.waiting > 0 {
            self.tracker.finished.notify_all();
        }
    }
}
