//! Buffers a whole copy reads its chunks into, used again once a chunk is sent: a fresh 1 MiB
//! buffer is zero-filled and faulted in page by page before the read overwrites it, which
//! took about 7 % of a rebuilding primary's CPU.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::lock;

/// Buffers kept idle at most (bounded memory: a node's copies in flight take more, and give
/// back only this many).
const IDLE_MAX: usize = 4;

#[derive(Default)]
pub(crate) struct ChunkBuffers {
    idle: Mutex<Vec<Vec<u8>>>,
}

impl ChunkBuffers {
    /// A buffer of `length` bytes, holding whatever it held before: for a read that writes
    /// every byte of it.
    pub(crate) fn take(&self, length: usize) -> Vec<u8> {
        match lock(&self.idle).pop() {
            Some(mut buffer) => {
                buffer.resize(length, 0);
                buffer
            }
            None => vec![0; length],
        }
    }

    /// `buffer` shared as it is; it comes back here once every share of it is dropped.
    pub(crate) fn share(self: &Arc<Self>, buffer: Vec<u8>) -> Bytes {
        Bytes::from_owner(Lent {
            buffer,
            home: self.clone(),
        })
    }

    /// Keeps `buffer` for a later [`Self::take`] (unless enough are idle already).
    pub(crate) fn give_back(&self, buffer: Vec<u8>) {
        let mut idle = lock(&self.idle);
        if idle.len() < IDLE_MAX {
            idle.push(buffer);
        }
    }
}

/// A buffer [`ChunkBuffers::share`] lent out.
struct Lent {
    buffer: Vec<u8>,
    home: Arc<ChunkBuffers>,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.buffer
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.home.give_back(std::mem::take(&mut self.buffer));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves a shared buffer comes back once its last share is dropped, is handed out again
    // at the length asked, and that no more than IDLE_MAX are kept.
    #[test]
    fn shared_buffers_come_back_once_dropped() {
        let buffers = Arc::new(ChunkBuffers::default());
        let mut first = buffers.take(8);
        first.copy_from_slice(b"abcdefgh");
        let at = first.as_ptr();
        let shared = buffers.share(first);
        let slice = shared.slice(2..4);
        drop(shared);
        assert!(lock(&buffers.idle).is_empty(), "a slice still holds it");
        assert_eq!(&slice[..], b"cd");
        drop(slice);
        let again = buffers.take(4);
        assert_eq!((again.as_ptr(), again.len()), (at, 4));
        for _ in 0..IDLE_MAX + 2 {
            buffers.give_back(vec![1; 4]);
        }
        assert_eq!(lock(&buffers.idle).len(), IDLE_MAX);
    }
}
