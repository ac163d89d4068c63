//! The Raft log and vote, kept in Keel's own store (its group commit, checksums and mirror).
//!
//! Keys (in the `Meta` keyspace, outside the catalog's prefixes so a snapshot install never
//! touches them):
//! - `r/log/<index, 8 bytes big-endian>` → postcard entry (big-endian: the index order is the key
//!   order, so the last entry is one reverse lookup);
//! - `r/vote` → postcard vote;
//! - `r/purged` → postcard log id of the last purged entry.
//!
//! Durability (openraft's "IO ordering" rules): every write here is one `Durability::Sync`
//! store write, awaited before the call returns, and `append`'s callback fires only after that
//! write's `fdatasync` returned. Writes are issued one at a time in call order, and the store's
//! log is ordered, so a vote and a log write can never be reordered on disk; a truncation
//! deletes the tail in one atomic write, so the log never has a hole.

use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};

use keel_store::{meta_key, Compression, Durability, Store, WriteOp};
use openraft::entry::RaftEntry;
use openraft::storage::{IOFlushed, RaftLogStorage};
use openraft::{LogState, RaftLogReader};

use crate::types::{Entry, LogId, TypeConfig, Vote};

const LOG_PREFIX: &[u8] = b"r/log/";
const VOTE_SUFFIX: &[u8] = b"r/vote";
const PURGED_SUFFIX: &[u8] = b"r/purged";
/// Entries read per store scan.
const READ_PAGE_ENTRIES: usize = 256;

pub(crate) fn log_key(index: u64) -> Vec<u8> {
    let mut suffix = LOG_PREFIX.to_vec();
    suffix.extend_from_slice(&index.to_be_bytes());
    meta_key(&suffix)
}

fn log_end() -> Vec<u8> {
    // Past every 8-byte index: the prefix with its last byte raised.
    let mut suffix = LOG_PREFIX.to_vec();
    if let Some(last) = suffix.last_mut() {
        *last += 1;
    }
    meta_key(&suffix)
}

pub(crate) fn vote_key() -> Vec<u8> {
    meta_key(VOTE_SUFFIX)
}

fn purged_key() -> Vec<u8> {
    meta_key(PURGED_SUFFIX)
}

fn io_error(context: &str, error: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("raft log: {context}: {error}"))
}

pub(crate) fn encode<T: serde::Serialize>(value: &T) -> io::Result<Vec<u8>> {
    postcard::to_allocvec(value).map_err(|error| io_error("encoding", error))
}

pub(crate) fn decode<T: for<'de> serde::Deserialize<'de>>(
    what: &str,
    bytes: &[u8],
) -> io::Result<T> {
    postcard::from_bytes(bytes).map_err(|error| io_error(&format!("decoding {what}"), error))
}

/// Runs blocking store work off the async runtime's workers.
#[cfg(not(feature = "simulation"))]
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| io_error("store task", error))?
}

/// In the simulation store work runs inline: a blocking-pool thread finishing in real time
/// would make the order of events depend on the machine, not on the seed.
#[cfg(feature = "simulation")]
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    work()
}

/// The log store. Cheap to clone (it is a store handle).
#[derive(Clone)]
pub struct LogStore {
    store: Store,
}

impl LogStore {
    pub fn new(store: Store) -> LogStore {
        LogStore { store }
    }

    fn write(&self, ops: Vec<WriteOp>) -> io::Result<()> {
        self.store
            .write_metadata(ops, Durability::Sync)
            .map(|_| ())
            .map_err(|error| io_error("writing", error))
    }

    /// The vote, read synchronously (for tools that run without a Raft instance).
    pub fn read_vote_now(&self) -> io::Result<Option<Vote>> {
        match self
            .store
            .get(&vote_key())
            .map_err(|error| io_error("reading the vote", error))?
        {
            Some(bytes) => Ok(Some(decode("the vote", &bytes)?)),
            None => Ok(None),
        }
    }

    /// The last entry's log id and the purge point, read synchronously.
    pub fn log_state_now(&self) -> io::Result<(Option<LogId>, Option<LogId>)> {
        let purged: Option<LogId> = match self
            .store
            .get(&purged_key())
            .map_err(|error| io_error("reading the purge point", error))?
        {
            Some(bytes) => Some(decode("the purge point", &bytes)?),
            None => None,
        };
        let last = self
            .store
            .floor(&log_key(0), &log_key(u64::MAX))
            .map_err(|error| io_error("reading the last entry", error))?;
        let last = match last {
            Some((_, bytes)) => Some(decode::<Entry>("an entry", &bytes)?.log_id()),
            None => purged,
        };
        Ok((purged, last))
    }

    /// Appends entries and syncs, synchronously (force-primary's offline repair).
    pub fn append_now(&self, entries: Vec<Entry>) -> io::Result<()> {
        let mut ops = Vec::with_capacity(entries.len());
        for entry in &entries {
            ops.push(WriteOp::put(
                log_key(entry.index()),
                encode(entry)?,
                Compression::None,
            ));
        }
        self.write(ops)
    }

    /// Saves a vote synchronously (force-primary's offline repair).
    pub fn save_vote_now(&self, vote: &Vote) -> io::Result<()> {
        self.write(vec![WriteOp::put(
            vote_key(),
            encode(vote)?,
            Compression::None,
        )])
    }

    /// Every entry still in the log below `end` (synchronously; small logs only).
    pub fn entries_before(&self, end: u64) -> io::Result<Vec<Entry>> {
        self.entries(0, Some(end))
    }

    fn entries(&self, start: u64, end_exclusive: Option<u64>) -> io::Result<Vec<Entry>> {
        let end_key = match end_exclusive {
            Some(end) => log_key(end),
            None => log_end(),
        };
        let mut cursor = log_key(start);
        let mut out = Vec::new();
        loop {
            let page = self
                .store
                .scan(&cursor, &end_key, READ_PAGE_ENTRIES)
                .map_err(|error| io_error("reading entries", error))?;
            let full = page.len() == READ_PAGE_ENTRIES;
            for (key, value) in &page {
                let entry: Entry = decode("an entry", value)?;
                if *key != log_key(entry.index()) {
                    return Err(io_error(
                        "reading entries",
                        format!(
                            "entry {} is stored under another index's key",
                            entry.index()
                        ),
                    ));
                }
                out.push(entry);
            }
            match page.last() {
                Some((key, _)) if full => {
                    cursor = key.clone();
                    cursor.push(0);
                }
                _ => return Ok(out),
            }
        }
    }
}

fn range_bounds(range: &impl RangeBounds<u64>) -> (u64, Option<u64>) {
    let start = match range.start_bound() {
        Bound::Included(&index) => index,
        Bound::Excluded(&index) => index.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&index) => index.checked_add(1),
        Bound::Excluded(&index) => Some(index),
        Bound::Unbounded => None,
    };
    (start, end)
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> io::Result<Vec<Entry>> {
        let (start, end) = range_bounds(&range);
        if end.is_some_and(|end| end <= start) {
            return Ok(Vec::new());
        }
        let this = self.clone();
        blocking(move || this.entries(start, end)).await
    }

    async fn read_vote(&mut self) -> io::Result<Option<Vote>> {
        let this = self.clone();
        blocking(move || this.read_vote_now()).await
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> io::Result<LogState<TypeConfig>> {
        let this = self.clone();
        let (purged, last) = blocking(move || this.log_state_now()).await?;
        Ok(LogState {
            last_purged_log_id: purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> io::Result<()> {
        let this = self.clone();
        let vote = *vote;
        blocking(move || this.save_vote_now(&vote)).await
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<TypeConfig>) -> io::Result<()>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        let this = self.clone();
        let result = blocking(move || this.append_now(entries)).await;
        // The callback reports the same outcome: openraft treats a failed append as fatal.
        match &result {
            Ok(()) => callback.io_completed(Ok(())),
            Err(error) => {
                callback.io_completed(Err(io::Error::new(error.kind(), error.to_string())))
            }
        }
        result
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> io::Result<()> {
        let from = last_log_id.map(|id| id.index() + 1).unwrap_or(0);
        let this = self.clone();
        blocking(move || {
            let keys = this
                .store
                .keys(&log_key(from), &log_end(), usize::MAX)
                .map_err(|error| io_error("listing entries to truncate", error))?;
            if keys.is_empty() {
                return Ok(());
            }
            this.write(
                keys.into_iter()
                    .map(|key| WriteOp::Delete { key })
                    .collect(),
            )
        })
        .await
    }

    async fn purge(&mut self, log_id: LogId) -> io::Result<()> {
        let this = self.clone();
        blocking(move || {
            let upto = log_id.index();
            let mut ops: Vec<WriteOp> = this
                .store
                .keys(&log_key(0), &log_key(upto.saturating_add(1)), usize::MAX)
                .map_err(|error| io_error("listing entries to purge", error))?
                .into_iter()
                .map(|key| WriteOp::Delete { key })
                .collect();
            ops.push(WriteOp::put(
                purged_key(),
                encode(&log_id)?,
                Compression::None,
            ));
            this.write(ops)
        })
        .await
    }
}
