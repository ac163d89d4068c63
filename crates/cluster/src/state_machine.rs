//! The Raft state machine: the catalog. Applying an entry is [`Catalog::apply`] — the command's
//! record changes, the applied log id and the proposal's dedup record in one atomic store write
//! (buffered: the entry itself is durable in the log) — so after any crash the applied id and
//! the records agree, and openraft re-applies exactly the entries after the applied id.
//!
//! Exactly once: every proposal carries a random id. The outcome of each id applied in the last
//! [`DEDUP_WINDOW_ENTRIES`] entries is kept (`r/dedup/<id>`); a proposal retried after a lost
//! answer or a leader change is answered with its first outcome instead of being applied again.
//! The table is part of the state (same on every node, carried in snapshots).
//!
//! Snapshots are the catalog's in-memory state plus the dedup table, encoded (records, not
//! data: small). The last snapshot built or installed is kept in the store (`r/snapshot`), as
//! openraft requires after a restart; installing one replaces every catalog record and the dedup
//! table in one atomic write.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use futures::{Stream, TryStreamExt};
use keel_catalog::{Catalog, CatalogState, Outcome};
use keel_store::{meta_key, Compression, Durability, Store, WriteOp};
use openraft::storage::{EntryResponder, RaftStateMachine};
use openraft::{EntryPayload, RaftSnapshotBuilder};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::log_store::{blocking, decode, encode};
use crate::types::{
    CommandResult, Entry, LogId, Snapshot, SnapshotMeta, StoredMembership, TypeConfig,
};

const APPLIED_SUFFIX: &[u8] = b"r/applied";
const SNAPSHOT_SUFFIX: &[u8] = b"r/snapshot";
const DEDUP_PREFIX: &[u8] = b"r/dedup/";
/// Proposal outcomes are remembered for this many entries: far longer than any retry takes.
pub const DEDUP_WINDOW_ENTRIES: u64 = 8192;

/// What `r/applied` holds: the last applied entry and the membership in effect.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Applied {
    log_id: Option<LogId>,
    membership: StoredMembership,
}

/// What `r/snapshot` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta,
    data: Vec<u8>,
}

/// A snapshot's data.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SnapshotData {
    catalog: Vec<u8>,
    /// (proposal id, index applied at, outcome).
    dedup: Vec<([u8; 16], u64, CommandResult)>,
}

/// Recent proposal outcomes.
#[derive(Debug, Default)]
struct Dedup {
    by_id: HashMap<[u8; 16], (u64, CommandResult)>,
    by_index: BTreeMap<u64, [u8; 16]>,
}

impl Dedup {
    fn insert(&mut self, id: [u8; 16], index: u64, result: CommandResult) {
        self.by_id.insert(id, (index, result));
        self.by_index.insert(index, id);
    }

    /// Ids that fall out of the window once `index` is applied.
    fn expiring(&self, index: u64) -> Vec<(u64, [u8; 16])> {
        let floor = index.saturating_sub(DEDUP_WINDOW_ENTRIES);
        self.by_index
            .range(..floor)
            .map(|(&index, &id)| (index, id))
            .collect()
    }

    fn remove(&mut self, index: u64, id: &[u8; 16]) {
        self.by_index.remove(&index);
        self.by_id.remove(id);
    }
}

fn dedup_key(id: &[u8; 16]) -> Vec<u8> {
    let mut suffix = DEDUP_PREFIX.to_vec();
    suffix.extend_from_slice(id);
    meta_key(&suffix)
}

fn dedup_range() -> (Vec<u8>, Vec<u8>) {
    let start = meta_key(DEDUP_PREFIX);
    let mut end = start.clone();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    (start, end)
}

fn io_error(context: &str, error: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("raft state machine: {context}: {error}"))
}

/// The state machine. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct StateMachine {
    store: Store,
    catalog: Arc<Catalog>,
    applied: Arc<Mutex<Applied>>,
    dedup: Arc<Mutex<Dedup>>,
    /// Held while an entry is applied and while a snapshot is taken or installed, so a
    /// snapshot's data and its last log id always match.
    applying: Arc<Mutex<()>>,
    /// The index of the last applied entry, for waiters (read-your-writes after a forward).
    applied_index: watch::Sender<u64>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl StateMachine {
    /// Reads the applied id and the dedup table from the store; the catalog must have been
    /// loaded from the same store.
    pub fn open(store: Store, catalog: Arc<Catalog>) -> io::Result<StateMachine> {
        let applied: Applied = match store
            .get(&meta_key(APPLIED_SUFFIX))
            .map_err(|error| io_error("reading the applied id", error))?
        {
            Some(bytes) => decode("the applied id", &bytes)?,
            None => Applied::default(),
        };
        let mut dedup = Dedup::default();
        let (start, end) = dedup_range();
        for (key, value) in store
            .scan(&start, &end, usize::MAX)
            .map_err(|error| io_error("reading the dedup table", error))?
        {
            let id: [u8; 16] = key
                .get(start.len()..)
                .and_then(|bytes| bytes.try_into().ok())
                .ok_or_else(|| io_error("reading the dedup table", "a malformed key"))?;
            let (index, result): (u64, CommandResult) = decode("a dedup record", &value)?;
            dedup.insert(id, index, result);
        }
        let index = applied.log_id.as_ref().map(|id| id.index()).unwrap_or(0);
        Ok(StateMachine {
            store,
            catalog,
            applied: Arc::new(Mutex::new(applied)),
            dedup: Arc::new(Mutex::new(dedup)),
            applying: Arc::new(Mutex::new(())),
            applied_index: watch::channel(index).0,
        })
    }

    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    /// Watches the index of the last applied entry.
    pub fn applied_index(&self) -> watch::Receiver<u64> {
        self.applied_index.subscribe()
    }

    fn applied(&self) -> Applied {
        lock(&self.applied).clone()
    }

    fn set_applied(&self, applied: Applied) {
        let index = applied.log_id.as_ref().map(|id| id.index()).unwrap_or(0);
        *lock(&self.applied) = applied;
        self.applied_index.send_replace(index);
    }

    fn applied_op(applied: &Applied) -> io::Result<WriteOp> {
        Ok(WriteOp::put(
            meta_key(APPLIED_SUFFIX),
            encode(applied)?,
            Compression::None,
        ))
    }

    fn snapshot_op(snapshot: &StoredSnapshot) -> io::Result<WriteOp> {
        Ok(WriteOp::put(
            meta_key(SNAPSHOT_SUFFIX),
            encode(snapshot)?,
            Compression::None,
        ))
    }

    /// Applies one entry (blocking): returns what the client gets.
    fn apply_one(&self, entry: Entry) -> io::Result<CommandResult> {
        let _applying = lock(&self.applying);
        let mut applied = self.applied();
        let index = entry.log_id.index();
        applied.log_id = Some(entry.log_id);
        match entry.payload {
            EntryPayload::Normal(proposal) => {
                let repeated = lock(&self.dedup).by_id.get(&proposal.id).cloned();
                if let Some((first_index, result)) = repeated {
                    tracing::info!(
                        command = proposal.command.kind(),
                        first_index,
                        index,
                        "a retried proposal was already applied; answering its first outcome"
                    );
                    self.write_applied(&applied)?;
                    self.set_applied(applied);
                    return Ok(result);
                }
                let expiring = lock(&self.dedup).expiring(index);
                let applied_op = Self::applied_op(&applied)?;
                let encode_failure: Mutex<Option<io::Error>> = Mutex::new(None);
                let extra = |outcome: &Result<Outcome, keel_catalog::CatalogError>| {
                    let mut ops = vec![applied_op.clone()];
                    match encode(&(index, CommandResult(outcome.clone()))) {
                        Ok(value) => ops.push(WriteOp::put(
                            dedup_key(&proposal.id),
                            value,
                            Compression::None,
                        )),
                        Err(error) => *lock(&encode_failure) = Some(error),
                    }
                    ops.extend(
                        expiring
                            .iter()
                            .map(|(_, id)| WriteOp::Delete { key: dedup_key(id) }),
                    );
                    ops
                };
                // Buffered: the entry is already durable in the log (synced before it could
                // commit), and the records and applied id land in one atomic write, so a crash
                // that loses this write only makes openraft apply the entry again. What must be
                // durable when a change returns (a snapshot's data) is flushed by whoever asked.
                let outcome = self
                    .catalog
                    .apply(&self.store, &proposal.command, &extra, Durability::Buffered)
                    .map_err(|error| io_error("applying a command", error))?;
                if let Some(error) = lock(&encode_failure).take() {
                    return Err(error);
                }
                if let Err(refusal) = &outcome {
                    tracing::debug!(command = proposal.command.kind(), %refusal, "command refused");
                }
                let result = CommandResult(outcome);
                {
                    let mut dedup = lock(&self.dedup);
                    for (expired_index, id) in &expiring {
                        dedup.remove(*expired_index, id);
                    }
                    dedup.insert(proposal.id, index, result.clone());
                }
                self.set_applied(applied);
                Ok(result)
            }
            EntryPayload::Membership(membership) => {
                applied.membership = StoredMembership::new(Some(entry.log_id), membership);
                self.write_applied(&applied)?;
                self.set_applied(applied);
                Ok(CommandResult(Ok(Outcome::Done)))
            }
            EntryPayload::Blank => {
                self.write_applied(&applied)?;
                self.set_applied(applied);
                Ok(CommandResult(Ok(Outcome::Done)))
            }
        }
    }

    fn write_applied(&self, applied: &Applied) -> io::Result<()> {
        // Buffered: if it is lost in a crash, the entry is applied again, and applying a blank,
        // membership or repeated entry twice changes nothing.
        self.store
            .write_metadata(vec![Self::applied_op(applied)?], Durability::Buffered)
            .map(|_| ())
            .map_err(|error| io_error("recording the applied id", error))
    }

    fn build(&self) -> io::Result<StoredSnapshot> {
        let (applied, data) = {
            let _applying = lock(&self.applying);
            let dedup = lock(&self.dedup)
                .by_id
                .iter()
                .map(|(id, (index, result))| (*id, *index, result.clone()))
                .collect();
            let data = SnapshotData {
                catalog: self.catalog.read().encode(),
                dedup,
            };
            (self.applied(), encode(&data)?)
        };
        Ok(StoredSnapshot {
            meta: SnapshotMeta {
                last_log_id: applied.log_id,
                last_membership: applied.membership,
            },
            data,
        })
    }

    fn install(&self, meta: &SnapshotMeta, bytes: Vec<u8>) -> io::Result<()> {
        let data: SnapshotData = decode("a snapshot", &bytes)?;
        let state = CatalogState::decode(&data.catalog)
            .map_err(|error| io_error("decoding a snapshot's catalog", error))?;
        let applied = Applied {
            log_id: meta.last_log_id,
            membership: meta.last_membership.clone(),
        };
        let _applying = lock(&self.applying);
        let (start, end) = dedup_range();
        let mut extra: Vec<WriteOp> = self
            .store
            .keys(&start, &end, usize::MAX)
            .map_err(|error| io_error("listing the dedup table", error))?
            .into_iter()
            .map(|key| WriteOp::Delete { key })
            .collect();
        let mut dedup = Dedup::default();
        for (id, index, result) in data.dedup {
            extra.push(WriteOp::put(
                dedup_key(&id),
                encode(&(index, result.clone()))?,
                Compression::None,
            ));
            dedup.insert(id, index, result);
        }
        extra.push(Self::applied_op(&applied)?);
        extra.push(Self::snapshot_op(&StoredSnapshot {
            meta: meta.clone(),
            data: bytes,
        })?);
        self.catalog
            .restore(&self.store, state, extra)
            .map_err(|error| io_error("installing a snapshot", error))?;
        *lock(&self.dedup) = dedup;
        self.set_applied(applied);
        Ok(())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    type SnapshotData = Vec<u8>;

    async fn build_snapshot(&mut self) -> io::Result<Snapshot> {
        let this = self.clone();
        let stored = blocking(move || {
            let stored = this.build()?;
            this.store
                .write_metadata(vec![Self::snapshot_op(&stored)?], Durability::Sync)
                .map_err(|error| io_error("storing a snapshot", error))?;
            Ok(stored)
        })
        .await?;
        Ok(Snapshot {
            meta: stored.meta,
            snapshot: stored.data,
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotData = Vec<u8>;
    type SnapshotBuilder = StateMachine;

    async fn applied_state(&mut self) -> io::Result<(Option<LogId>, StoredMembership)> {
        let applied = self.applied();
        Ok((applied.log_id, applied.membership))
    }

    async fn apply<S>(&mut self, mut entries: S) -> io::Result<()>
    where
        S: Stream<Item = io::Result<EntryResponder<TypeConfig>>> + Unpin + Send,
    {
        while let Some((entry, responder)) = entries.try_next().await? {
            let this = self.clone();
            let result = blocking(move || this.apply_one(entry)).await?;
            if let Some(responder) = responder {
                responder.send(result);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn install_snapshot(&mut self, meta: &SnapshotMeta, snapshot: Vec<u8>) -> io::Result<()> {
        let this = self.clone();
        let meta_owned = meta.clone();
        blocking(move || this.install(&meta_owned, snapshot)).await?;
        tracing::info!(last_log_id = ?meta.last_log_id, "installed a metadata snapshot");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> io::Result<Option<Snapshot>> {
        let store = self.store.clone();
        let stored = blocking(move || {
            store
                .get(&meta_key(SNAPSHOT_SUFFIX))
                .map_err(|error| io_error("reading the snapshot", error))
        })
        .await?;
        match stored {
            Some(bytes) => {
                let stored: StoredSnapshot = decode("the snapshot", &bytes)?;
                Ok(Some(Snapshot {
                    meta: stored.meta,
                    snapshot: stored.data,
                }))
            }
            None => Ok(None),
        }
    }
}
