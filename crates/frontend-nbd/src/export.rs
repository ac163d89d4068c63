//! The contract between the NBD server and whatever stores the bytes (Keel volumes in the binary,
//! an in-memory buffer in tests). The server validates every request before it reaches these
//! traits, so an implementation only ever sees in-bounds, block-aligned ranges.

use std::io;
use std::sync::Arc;

use crate::error::NbdError;

/// The set of exports a server offers (one per volume).
///
/// Methods are called from a blocking thread (the server's I/O pool), never from the async
/// runtime, so they may do disk or metadata I/O.
pub trait Exports: Send + Sync + 'static {
    /// Names returned to NBD_OPT_LIST. Names longer than 4096 bytes are not listed.
    fn list(&self) -> Vec<String>;

    /// Opens an export for one connection. `name` is what the client sent; the empty name is the
    /// protocol's "default export", which an implementation may map to something or refuse.
    /// Return [`NbdError::ExportNotFound`] or [`NbdError::ExportUnavailable`] to refuse (the
    /// client gets NBD_REP_ERR_UNKNOWN with the error's text).
    fn open(&self, name: &str) -> Result<Arc<dyn Export>, NbdError>;
}

/// One open export. Shared by every in-flight request of a connection; methods run on blocking
/// threads, concurrently with each other (also for overlapping ranges: ordering between
/// overlapping in-flight requests is the client's business, as on a real disk).
///
/// Guarantees the server relies on:
/// - **Validated ranges.** `offset` and lengths are multiples of
///   [`Export::minimum_block_size_bytes`] and `offset + length <= size_bytes()`; zero-length requests never reach the export; writes
///   never reach a read-only export.
/// - **Visibility.** Once `write`, `trim` or `write_zeroes` returned `Ok`, a later `read` of the
///   range, through this or any other `Export` opened for the same name, sees the new contents.
/// - **FUA.** With `fua == true` the written data is durable (survives power loss) when the call
///   returns.
/// - **Flush covers every connection.** When `flush` returns `Ok`, every write, trim and
///   write-zeroes that had returned `Ok` before `flush` was called, through any `Export` opened
///   for the same name (i.e. from any connection), is durable. The server advertises
///   NBD_FLAG_CAN_MULTI_CONN on the strength of this guarantee: clients such as qemu and the
///   Linux kernel then spread one disk over several connections and send the FLUSH on only one
///   of them.
/// - **Errors.** Map failures to `io::Error`s whose kind says what happened: `StorageFull`,
///   `QuotaExceeded` or `FileTooLarge` become ENOSPC, `PermissionDenied`/`ReadOnlyFilesystem`
///   EPERM, `InvalidInput` EINVAL, everything else EIO. A checksum mismatch must be an error,
///   never data.
pub trait Export: Send + Sync + 'static {
    /// Size of the export; read once per connection, when the client selects the export.
    fn size_bytes(&self) -> u64;

    /// Preferred block size: I/O aligned to it needs no read-modify-write. A power of two;
    /// advertised to clients (raised to at least 512 and the minimum).
    fn block_size_bytes(&self) -> u32 {
        4096
    }

    /// Minimum block size: the alignment the server enforces on offsets and lengths (anything
    /// else gets EINVAL). The default, 1, means the export accepts any byte range (a partial
    /// block is read, patched and rewritten below), which clients that cannot align requests
    /// themselves need: nbdfuse passes file writes through unaligned, for example. An export
    /// that cannot do that returns its block size here. A power of two of at most 65536;
    /// `size_bytes` should be a multiple of it.
    fn minimum_block_size_bytes(&self) -> u32 {
        1
    }

    /// Fills `buf` with the bytes at `offset`.
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;

    /// Writes `data` at `offset`; durable on return if `fua`.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()>;

    /// Makes every write completed before this call durable (see the trait documentation).
    fn flush(&self) -> io::Result<()>;

    /// A hint that the range is no longer needed; its contents are unspecified afterwards until
    /// rewritten. Doing nothing is a valid implementation.
    fn trim(&self, offset: u64, length_bytes: u64) -> io::Result<()>;

    /// Makes the range read back as zeroes. `may_trim == false` means the client sent
    /// NBD_CMD_FLAG_NO_HOLE (keep the range allocated); an export may honour it or, like Keel's
    /// log-structured volumes where every write allocates anyway, ignore it. Durable on return
    /// if `fua`.
    fn write_zeroes(
        &self,
        offset: u64,
        length_bytes: u64,
        fua: bool,
        may_trim: bool,
    ) -> io::Result<()>;

    /// Whether writes are refused (advertised as NBD_FLAG_READ_ONLY; the server answers writes
    /// with EPERM without calling the export).
    fn read_only(&self) -> bool;
}
