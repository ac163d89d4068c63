//! Chunk placement and the locks that keep chunk refcounts exact.
//!
//! [`ChunkStore`] is the seam between the object layer and where chunk bytes live: the single-node
//! [`LocalChunkStore`] writes them to the local store; a cluster implementation will place them
//! on R nodes. Its contract: a chunk given to `put_chunk` is durable no later than the next
//! `Durability::Sync` metadata write of the object layer returns (the local store's log is
//! ordered, so a buffered chunk write followed by a synced manifest write is one `fdatasync`), and
//! `get_chunk` never returns bytes whose checksum failed.
//!
//! Invariants kept with the other modules:
//! - a chunk's refcount record equals the number of occurrences of the chunk in all manifests and
//!   part records; it is updated in the same atomic store write as those records;
//! - a chunk is deleted only when its refcount is zero and no upload in progress has pinned it
//!   (an upload pins a chunk before it decides the chunk already exists, under the chunk's stripe
//!   lock, so a concurrent delete either happened before — and the upload rewrites the chunk — or
//!   sees the pin and keeps it);
//! - lock order: key stripes (objects, uploads) first, then chunk stripes, each set in ascending
//!   index order, so no two operations deadlock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use keel_store::{chunk_key, Compression, Durability, Keyspace, Store, WriteOp};

use super::{store_error, ObjectError};

/// Number of lock stripes for object/upload keys and for chunk hashes (each).
pub const LOCK_STRIPES: usize = 1024;

/// Where chunk bytes live. Methods block (disk or network I/O).
pub trait ChunkStore: Send + Sync + 'static {
    /// Stores `data` under its BLAKE3 `hash` (idempotent: same hash, same bytes).
    fn put_chunk(
        &self,
        hash: &[u8; 32],
        data: Vec<u8>,
        compression: Compression,
    ) -> Result<(), ObjectError>;
    /// The chunk's bytes, verified, or `None` if it is not stored.
    fn get_chunk(&self, hash: &[u8; 32]) -> Result<Option<Vec<u8>>, ObjectError>;
    fn has_chunk(&self, hash: &[u8; 32]) -> Result<bool, ObjectError>;
    fn delete_chunk(&self, hash: &[u8; 32]) -> Result<(), ObjectError>;
    /// Stored chunk hashes greater than `after`, in order, at most `limit` (for garbage collection).
    fn list_chunks(
        &self,
        after: Option<&[u8; 32]>,
        limit: usize,
    ) -> Result<Vec<[u8; 32]>, ObjectError>;
}

/// Chunks as `Chunk`-keyspace extents of the local store, with a BLAKE3 content hash checked on
/// every read.
pub struct LocalChunkStore {
    store: Store,
}

impl LocalChunkStore {
    pub fn new(store: Store) -> LocalChunkStore {
        LocalChunkStore { store }
    }
}

impl ChunkStore for LocalChunkStore {
    fn put_chunk(
        &self,
        hash: &[u8; 32],
        data: Vec<u8>,
        compression: Compression,
    ) -> Result<(), ObjectError> {
        let op = WriteOp::Put {
            key: chunk_key(hash),
            value: data.into(),
            compression,
            content_hash: true,
        };
        // Buffered: the object's synced manifest write that follows makes it durable (the log is
        // ordered), so a PUT pays one fdatasync, not one per chunk.
        self.store
            .write(vec![op], Durability::Buffered)
            .map_err(|e| store_error("writing a chunk", e))?;
        Ok(())
    }

    fn get_chunk(&self, hash: &[u8; 32]) -> Result<Option<Vec<u8>>, ObjectError> {
        self.store
            .get(&chunk_key(hash))
            .map_err(|e| store_error("reading a chunk", e))
    }

    fn has_chunk(&self, hash: &[u8; 32]) -> Result<bool, ObjectError> {
        self.store
            .contains(&chunk_key(hash))
            .map_err(|e| store_error("looking up a chunk", e))
    }

    fn delete_chunk(&self, hash: &[u8; 32]) -> Result<(), ObjectError> {
        self.store
            .write(
                vec![WriteOp::Delete {
                    key: chunk_key(hash),
                }],
                Durability::Buffered,
            )
            .map_err(|e| store_error("deleting a chunk", e))?;
        Ok(())
    }

    fn list_chunks(
        &self,
        after: Option<&[u8; 32]>,
        limit: usize,
    ) -> Result<Vec<[u8; 32]>, ObjectError> {
        let start = match after {
            Some(hash) => {
                let mut key = chunk_key(hash);
                key.push(0);
                key
            }
            None => vec![Keyspace::Chunk as u8],
        };
        let end = vec![Keyspace::Chunk as u8 + 1];
        let keys = self
            .store
            .keys(&start, &end, limit)
            .map_err(|e| store_error("listing chunks", e))?;
        Ok(keys
            .iter()
            .filter_map(|key| key.get(1..33).and_then(|h| <[u8; 32]>::try_from(h).ok()))
            .collect())
    }
}

/// Striped mutexes: an operation locks the stripes of the keys or chunks it changes.
pub struct Stripes {
    locks: Vec<Mutex<()>>,
}

impl Stripes {
    pub fn new() -> Stripes {
        Stripes {
            locks: (0..LOCK_STRIPES).map(|_| Mutex::new(())).collect(),
        }
    }

    pub fn index_of_bytes(bytes: &[u8]) -> usize {
        let hash = blake3::hash(bytes);
        let mut first = [0u8; 8];
        first.copy_from_slice(&hash.as_bytes()[..8]);
        (u64::from_le_bytes(first) % LOCK_STRIPES as u64) as usize
    }

    pub fn index_of_chunk(hash: &[u8; 32]) -> usize {
        let mut first = [0u8; 8];
        first.copy_from_slice(&hash[..8]);
        (u64::from_le_bytes(first) % LOCK_STRIPES as u64) as usize
    }

    /// Locks the given stripes in ascending order (duplicates removed).
    pub fn lock(&self, mut indexes: Vec<usize>) -> Vec<MutexGuard<'_, ()>> {
        indexes.sort_unstable();
        indexes.dedup();
        indexes
            .into_iter()
            .map(|i| {
                self.locks[i % LOCK_STRIPES]
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
            })
            .collect()
    }
}

impl Default for Stripes {
    fn default() -> Self {
        Stripes::new()
    }
}

/// Called with the hashes a [`PinSet`] unpinned when it was dropped.
pub type Reaper = Box<dyn Fn(&[[u8; 32]]) + Send + Sync>;

/// Chunks pinned by uploads and reads in progress: count per hash.
#[derive(Default)]
pub struct PinTable {
    pins: Mutex<HashMap<[u8; 32], u32>>,
    /// Frees, at once, the chunks a dropped pin set leaves unreferenced (a failed upload's, or
    /// those of an object deleted during a read) instead of leaving them to garbage collection.
    reaper: std::sync::OnceLock<Reaper>,
}

impl PinTable {
    fn map(&self) -> MutexGuard<'_, HashMap<[u8; 32], u32>> {
        self.pins
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn pin(&self, hash: &[u8; 32]) {
        *self.map().entry(*hash).or_insert(0) += 1;
    }

    pub fn unpin(&self, hash: &[u8; 32]) {
        let mut map = self.map();
        if let Some(count) = map.get_mut(hash) {
            *count -= 1;
            if *count == 0 {
                map.remove(hash);
            }
        }
    }

    pub fn is_pinned(&self, hash: &[u8; 32]) -> bool {
        self.map().contains_key(hash)
    }

    /// Installs the reaper (once, by the object layer that owns the table).
    pub fn set_reaper(&self, reaper: Reaper) {
        let _ = self.reaper.set(reaper);
    }
}

/// The chunks one upload or read pinned; unpinned when dropped (after the commit or the read,
/// or when the upload failed — then any chunk it wrote that nobody references is freed at once
/// by the table's reaper).
pub struct PinSet {
    table: Arc<PinTable>,
    hashes: Vec<[u8; 32]>,
}

impl PinSet {
    pub fn new(table: Arc<PinTable>) -> PinSet {
        PinSet {
            table,
            hashes: Vec::new(),
        }
    }

    pub(super) fn push(&mut self, hash: [u8; 32]) {
        self.hashes.push(hash);
    }

    /// Takes over the pins of `other` (which then unpins nothing when dropped).
    pub fn absorb(&mut self, mut other: PinSet) {
        self.hashes.append(&mut other.hashes);
    }

    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }
}

impl Drop for PinSet {
    fn drop(&mut self) {
        for hash in &self.hashes {
            self.table.unpin(hash);
        }
        if let Some(reaper) = self.table.reaper.get() {
            if !self.hashes.is_empty() {
                reaper(&self.hashes);
            }
        }
    }
}
