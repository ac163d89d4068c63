//! In-memory exports for testing the protocol (the protocol is what is under test, not the
//! storage) and for measuring the server's ceiling (`examples/memserve.rs`).
//!
//! The bytes live in a `Vec<u8>` behind a read-write lock, so a write is visible to every later
//! read from any connection as soon as it returns, and "durable" trivially: `flush` only counts.
//! Nothing here survives the process.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use crate::error::NbdError;
use crate::export::{Export, Exports};

/// A named set of [`MemoryExport`]s.
#[derive(Default)]
pub struct MemoryExports {
    exports: Mutex<BTreeMap<String, Arc<MemoryExport>>>,
}

impl MemoryExports {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a zero-filled, writable export that accepts any byte range (like a
    /// Keel volume).
    pub fn insert(&self, name: &str, size_bytes: u64) -> Arc<MemoryExport> {
        self.insert_export(name, MemoryExport::new(size_bytes, 1, false))
    }

    /// Adds (or replaces) an export built by the caller.
    pub fn insert_export(&self, name: &str, export: MemoryExport) -> Arc<MemoryExport> {
        let export = Arc::new(export);
        self.exports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.to_owned(), Arc::clone(&export));
        export
    }
}

impl Exports for MemoryExports {
    fn list(&self) -> Vec<String> {
        self.exports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect()
    }

    fn open(&self, name: &str) -> Result<Arc<dyn Export>, NbdError> {
        let exports = self.exports.lock().unwrap_or_else(PoisonError::into_inner);
        match exports.get(name) {
            Some(export) => Ok(Arc::clone(export) as Arc<dyn Export>),
            None => Err(NbdError::ExportNotFound {
                name: name.to_owned(),
            }),
        }
    }
}

/// A fixed-size export held in memory.
pub struct MemoryExport {
    bytes: RwLock<Vec<u8>>,
    minimum_block_size_bytes: u32,
    read_only: bool,
    writes: AtomicU64,
    flushes: AtomicU64,
}

impl MemoryExport {
    /// A zero-filled export whose requests must be aligned to `minimum_block_size_bytes` (1:
    /// any byte range). Panics if `size_bytes` does not fit in the address space.
    pub fn new(size_bytes: u64, minimum_block_size_bytes: u32, read_only: bool) -> Self {
        let length =
            usize::try_from(size_bytes).expect("in-memory export fits in the address space");
        Self {
            bytes: RwLock::new(vec![0; length]),
            minimum_block_size_bytes,
            read_only,
            writes: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
        }
    }

    /// Write, trim and write-zeroes calls completed so far.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::SeqCst)
    }

    /// Flush calls completed so far.
    pub fn flushes(&self) -> u64 {
        self.flushes.load(Ordering::SeqCst)
    }

    /// A copy of `length` bytes at `offset` (for assertions).
    pub fn snapshot(&self, offset: usize, length: usize) -> Vec<u8> {
        let bytes = self.bytes.read().unwrap_or_else(PoisonError::into_inner);
        bytes[offset..offset + length].to_vec()
    }

    /// The byte range `[offset, offset + length)` as indices, checked against the buffer (the
    /// server already checked it; this is the second end of that check).
    fn range(&self, offset: u64, length: u64) -> io::Result<std::ops::Range<usize>> {
        let size = self
            .bytes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len() as u64;
        match offset.checked_add(length) {
            Some(end) if end <= size => Ok(offset as usize..end as usize),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("range {offset}+{length} is outside the {size}-byte export"),
            )),
        }
    }
}

impl Export for MemoryExport {
    fn size_bytes(&self) -> u64 {
        self.bytes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len() as u64
    }

    fn block_size_bytes(&self) -> u32 {
        self.minimum_block_size_bytes.max(4096)
    }

    fn minimum_block_size_bytes(&self) -> u32 {
        self.minimum_block_size_bytes
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let range = self.range(offset, buf.len() as u64)?;
        let bytes = self.bytes.read().unwrap_or_else(PoisonError::into_inner);
        buf.copy_from_slice(&bytes[range]);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> io::Result<()> {
        let range = self.range(offset, data.len() as u64)?;
        let mut bytes = self.bytes.write().unwrap_or_else(PoisonError::into_inner);
        bytes[range].copy_from_slice(data);
        self.writes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn trim(&self, offset: u64, length_bytes: u64) -> io::Result<()> {
        // Zeroing is one valid reading of "contents unspecified"; it also makes a trimmed range
        // deterministic for tests.
        self.write_zeroes(offset, length_bytes, false, true)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length_bytes: u64,
        _fua: bool,
        _may_trim: bool,
    ) -> io::Result<()> {
        let range = self.range(offset, length_bytes)?;
        let mut bytes = self.bytes.write().unwrap_or_else(PoisonError::into_inner);
        bytes[range].fill(0);
        self.writes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn read_only(&self) -> bool {
        self.read_only
    }
}
