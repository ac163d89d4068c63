//! The store's one error type. Operating errors (disk full, corrupt extent, failed sync) are typed
//! and carry the context an operator needs: which path, which key, which segment.

use std::io;
use std::path::PathBuf;

pub type StoreResult<T> = Result<T, StoreError>;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("I/O error on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },

    #[error(
        "data directory {path} is on {filesystem}, where fsync does not reach stable storage; \
         put it on a real disk, or pass --ephemeral for throwaway data"
    )]
    VolatileFilesystem { path: PathBuf, filesystem: String },

    #[error(
        "no space left on {path}: {available_bytes} bytes free and {reserve_bytes} kept in reserve; \
         delete data and run compaction, then retry"
    )]
    NoSpace {
        path: PathBuf,
        available_bytes: u64,
        reserve_bytes: u64,
    },

    #[error("store is poisoned after a failed {operation}: {reason}; it accepts no writes until reopened")]
    Poisoned { operation: String, reason: String },

    #[error(
        "corrupt extent for key {key_hex} at segment {segment} offset {offset}: {detail}; \
         no device holds a good copy"
    )]
    Corrupt {
        key_hex: String,
        segment: u64,
        offset: u64,
        detail: String,
    },

    #[error(
        "the log is damaged in the middle, not at its end: segment {segment} offset {offset} does \
         not verify on any device ({detail}), but writes acknowledged after it follow; Keel will not \
         cut acknowledged data. Restore the device from its mirror or a backup, or copy the data \
         directory aside and ask for help"
    )]
    LogCorrupt {
        segment: u64,
        offset: u64,
        detail: String,
    },

    #[error(
        "the index {path} is missing while the log holds data; the store will not guess. With \
         the server stopped, run `keel store rebuild-index --data DIR` (every --data of the \
         store) to rebuild it from the whole log"
    )]
    IndexMissing { path: PathBuf },

    #[error("index error: {0}")]
    Index(String),

    #[error("invalid request: {0}")]
    Invalid(String),

    #[error("data directory {path} is in use by another process")]
    Locked { path: PathBuf },

    #[error("data directories do not belong together: {0}")]
    Mismatch(String),
}

impl StoreError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> StoreError {
        StoreError::Io {
            path: path.into(),
            source,
        }
    }

    /// Whether the error says the disk is full (callers map it to ENOSPC / HTTP 507).
    pub fn is_no_space(&self) -> bool {
        match self {
            StoreError::NoSpace { .. } => true,
            StoreError::Io { source, .. } => source.raw_os_error() == Some(libc::ENOSPC),
            _ => false,
        }
    }

    /// Whether the error says stored data failed its checksum on every device.
    pub fn is_corrupt(&self) -> bool {
        matches!(self, StoreError::Corrupt { .. })
    }

    /// Maps the error to the errno a block device would report.
    pub fn errno(&self) -> i32 {
        match self {
            _ if self.is_no_space() => libc::ENOSPC,
            StoreError::Invalid(_) => libc::EINVAL,
            _ => libc::EIO,
        }
    }
}

impl From<StoreError> for io::Error {
    fn from(error: StoreError) -> io::Error {
        let errno = error.errno();
        io::Error::new(
            io::Error::from_raw_os_error(errno).kind(),
            error.to_string(),
        )
    }
}

macro_rules! index_error_from {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(error: $t) -> StoreError {
                StoreError::Index(error.to_string())
            }
        }
    )*};
}

index_error_from!(
    redb::Error,
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError,
    redb::SetDurabilityError
);
