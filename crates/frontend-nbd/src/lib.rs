//! Keel's NBD (Network Block Device) server: serves block volumes to qemu, libnbd tools (nbdfuse,
//! nbdcopy, nbdinfo), fio and the Linux kernel's `nbd` driver. Written from the protocol document
//! (doc/proto.md of NetworkBlockDevice/nbd); see `docs/nbd.md` for what is supported.
//!
//! Layout: `protocol` holds the wire format as pure functions (fuzzable), `handshake` and
//! `transmission` drive one connection, `server` accepts connections, `export` is the contract
//! with the storage below (implemented by the volume layer), `testing` an in-memory export.
//!
//! Every per-connection resource is bounded by a constant below; the server-wide memory bound is
//! [`CONNECTIONS_MAX`] × [`CONNECTION_BUFFER_MAX_BYTES`] of request buffers.

use std::time::Duration;

mod error;
mod export;
mod handshake;
pub mod protocol;
mod server;
mod socket;
pub mod testing;
mod transmission;

pub use error::NbdError;
pub use export::{Export, Exports};
pub use server::{serve, serve_stream, serve_with};
pub use socket::Socket;

/// Largest read or write a client may request (2^25, the size the protocol says a server should
/// accept; advertised as the maximum payload in NBD_INFO_BLOCK_SIZE). Larger reads and writes
/// are answered with EINVAL.
pub const REQUEST_PAYLOAD_MAX_BYTES: u32 = 32 * 1024 * 1024;

/// Worker threads of one connection, so requests executing or writing their reply at once
/// (nbdkit's default is 16 too). Clients queue deeper (fio and qemu up to 64-128); the rest wait
/// in the socket until a worker is free. A queue-depth-1 client uses two threads.
pub const CONNECTION_REQUESTS_IN_FLIGHT_MAX: usize = 16;

/// Read and write buffers one connection may hold at once. At least
/// [`REQUEST_PAYLOAD_MAX_BYTES`], so one maximal request always fits.
pub const CONNECTION_BUFFER_MAX_BYTES: u32 = 64 * 1024 * 1024;

/// A refused write's payload is read and dropped (keeping the stream framed) up to this size;
/// a client announcing more is disconnected instead.
pub const WRITE_DISCARD_MAX_BYTES: u32 = 2 * REQUEST_PAYLOAD_MAX_BYTES;

/// Connections served at once by [`serve`].
pub const CONNECTIONS_MAX: usize = 128;

/// When every connection slot is taken, a new client may take the slot of the connection that
/// has been idle (sent no byte) the longest, once that idle time passed this. A kernel client
/// may sit idle for hours and keeps its slot while slots are free; a peer holding slots it does
/// not use cannot lock real clients out.
pub const IDLE_EVICT_AFTER: Duration = Duration::from_secs(60);

/// Limits of [`serve_with`]; [`serve`] uses [`Limits::default`].
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub connections_max: usize,
    pub idle_evict_after: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            connections_max: CONNECTIONS_MAX,
            idle_evict_after: IDLE_EVICT_AFTER,
        }
    }
}

/// Options one session may send before the server gives up on it (a real client sends fewer than
/// ten).
pub const HANDSHAKE_OPTIONS_MAX: usize = 256;

/// Oversized option data (beyond [`protocol::OPTION_DATA_MAX_BYTES`]) is skipped and answered with
/// NBD_REP_ERR_TOO_BIG up to this size; beyond it the session ends.
pub const OPTION_DISCARD_MAX_BYTES: usize = 1024 * 1024;

/// Time a client has from connecting to entering the transmission phase.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// Time open connections get, once shutdown is requested, to answer requests in flight.
pub const SHUTDOWN_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Pause after a failed `accept` (usually out of file descriptors) before trying again.
pub const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// Socket read buffer per connection (request headers are 28 bytes; this batches them).
pub const REQUEST_BUFFER_BYTES: usize = 256 * 1024;

// Compile-time checks of the relations the limits rely on.
const _: () = assert!(CONNECTION_BUFFER_MAX_BYTES >= REQUEST_PAYLOAD_MAX_BYTES);
const _: () = assert!(WRITE_DISCARD_MAX_BYTES >= REQUEST_PAYLOAD_MAX_BYTES);
const _: () = assert!(OPTION_DISCARD_MAX_BYTES >= protocol::OPTION_DATA_MAX_BYTES);
