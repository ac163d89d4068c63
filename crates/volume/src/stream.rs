//! Send/receive streams: a volume snapshot (full) or the difference between two snapshots
//! (incremental) as a byte stream, for backup and disaster-recovery mirrors.
//!
//! Format (version 1, little-endian):
//! ```text
//! stream  = magic "KEELVOL1", header record, { block record | trim record }, trailer record
//! record  = tag u8, payload length u32, payload, CRC32C(tag, length, payload) u32
//! header  = postcard StreamHeader (sizes, base and target snapshot identities)
//! block   = block number u64, 4096 bytes of data
//! trim    = first block u64, block count u64   (these blocks read as zeroes at the target)
//! trailer = postcard StreamTrailer (counts, identities again, BLAKE3 of every byte before it)
//! ```
//! A record's length is at most [`RECORD_PAYLOAD_MAX_BYTES`], so a corrupt length cannot make
//! the receiver allocate much. The sender reads [`SEND_CHUNK_BLOCKS`] blocks at a time and the
//! receiver writes [`RECEIVE_BATCH_OPS`] at a time: memory stays bounded for any volume size.
//!
//! Atomicity of a receive: blocks land in a generation no view shows (a new hidden volume for a
//! full stream, an excluded generation of the target volume for an incremental one); only after
//! the trailer verified are they flushed and the snapshot record committed with one synced
//! metadata write. A failed receive leaves garbage that is deleted at once (or, after a crash,
//! by the next collection or at open), never visible data.

use std::io::{self, Read};
use std::sync::Arc;

use keel_store::{block_key, Compression, Durability, Extent, Store, WriteOp};
use serde::{Deserialize, Serialize};

use keel_catalog::view::{self, Layer};
use keel_catalog::{Command, Metadata, MetadataError, Outcome, SnapshotRecord, VolumeStatus};

use super::record::hex;
use super::{
    read, scan, Engine, SnapshotUse, VolumeError, VolumeResult, VolumeShared, BLOCK_SIZE_BYTES,
};

const MAGIC: &[u8; 8] = b"KEELVOL1";
const STREAM_VERSION: u32 = 1;
const TAG_HEADER: u8 = 1;
const TAG_BLOCK: u8 = 2;
const TAG_TRIM: u8 = 3;
const TAG_TRAILER: u8 = 4;
/// Largest record payload (a block record is 4104 bytes).
pub(crate) const RECORD_PAYLOAD_MAX_BYTES: usize = 64 << 10;
/// Blocks the sender examines per step.
pub(crate) const SEND_CHUNK_BLOCKS: u64 = 256;
/// Block writes per `Store::write` while receiving.
pub(crate) const RECEIVE_BATCH_OPS: usize = 256;

const BLOCK_SIZE: usize = BLOCK_SIZE_BYTES as usize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SnapshotIdentity {
    volume_uuid: [u8; 16],
    name: String,
    guid: [u8; 16],
    generation: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct StreamHeader {
    version: u32,
    block_size_bytes: u64,
    /// Size of the target snapshot.
    size_bytes: u64,
    compression: String,
    base: Option<SnapshotIdentity>,
    target: SnapshotIdentity,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct StreamTrailer {
    /// Block and trim records.
    records: u64,
    blocks: u64,
    trimmed_blocks: u64,
    base: Option<SnapshotIdentity>,
    target: SnapshotIdentity,
    stream_blake3: [u8; 32],
}

fn identity(volume_uuid: [u8; 16], snapshot: &SnapshotRecord) -> SnapshotIdentity {
    SnapshotIdentity {
        volume_uuid,
        name: snapshot.name.clone(),
        guid: snapshot.guid,
        generation: snapshot.generation,
    }
}

/// Appends one record (tag, length, payload, CRC32C) to `out`. The stream's hash is taken
/// over whole chunks of records at once, not record by record: BLAKE3 hashes a long input many
/// 1 KiB pieces at a time, a 4 KiB record straddling its pieces one at a time.
fn push_record(out: &mut Vec<u8>, tag: u8, payload: &[&[u8]]) {
    let length: usize = payload.iter().map(|part| part.len()).sum();
    assert!(
        length <= RECORD_PAYLOAD_MAX_BYTES,
        "record payload {length} over the limit"
    );
    let start = out.len();
    out.push(tag);
    out.extend_from_slice(&(length as u32).to_le_bytes());
    for part in payload {
        out.extend_from_slice(part);
    }
    let crc = crc_fast::crc32_iscsi(&out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// What a changed block of a chunk becomes in a send stream.
enum Part {
    /// Its extent at `generation` is read: data becomes a block record, a hole marker zeroes.
    Read {
        generation: u64,
        trim_if_zeroes: bool,
    },
    /// It reads as zeroes at the target and did not at the base: a trim.
    Zeroes,
}

/// A send stream; implements [`Read`]. Reading drives the scan, one chunk of blocks at a time.
pub struct SendStream {
    store: Store,
    shared: Arc<VolumeShared>,
    base_view: Option<Vec<Layer>>,
    target_view: Vec<Layer>,
    base: Option<SnapshotIdentity>,
    target: SnapshotIdentity,
    size_blocks: u64,
    next_block: u64,
    pending_trim: Option<(u64, u64)>,
    buffer: Vec<u8>,
    position: usize,
    hasher: blake3::Hasher,
    records: u64,
    blocks: u64,
    trimmed_blocks: u64,
    finished: bool,
    failed: Option<String>,
    _users: Vec<SnapshotUse>,
}

impl SendStream {
    /// A stream of `target` (full) or of what changed between `base` and `target`.
    pub fn new(
        store: Store,
        shared: Arc<VolumeShared>,
        volume_uuid: [u8; 16],
        compression: Compression,
        base: Option<SnapshotRecord>,
        target: SnapshotRecord,
    ) -> VolumeResult<SendStream> {
        let mut users = vec![shared.use_snapshot(target.generation)];
        if let Some(base) = &base {
            users.push(shared.use_snapshot(base.generation));
        }
        let header = StreamHeader {
            version: STREAM_VERSION,
            block_size_bytes: BLOCK_SIZE_BYTES,
            size_bytes: target.size_bytes,
            compression: compression.name().to_string(),
            base: base.as_ref().map(|base| identity(volume_uuid, base)),
            target: identity(volume_uuid, &target),
        };
        let mut buffer = MAGIC.to_vec();
        let encoded = super::record::encode(&header)?;
        push_record(&mut buffer, TAG_HEADER, &[&encoded]);
        let mut hasher = blake3::Hasher::new();
        hasher.update(&buffer);
        Ok(SendStream {
            store,
            shared,
            base_view: base.as_ref().map(|base| base.view.clone()),
            target_view: target.view.clone(),
            base: header.base,
            target: header.target,
            size_blocks: target.size_bytes / BLOCK_SIZE_BYTES,
            next_block: 0,
            pending_trim: None,
            buffer,
            position: 0,
            hasher,
            records: 0,
            blocks: 0,
            trimmed_blocks: 0,
            finished: false,
            failed: None,
            _users: users,
        })
    }

    fn flush_trim(&mut self) {
        if let Some((first, count)) = self.pending_trim.take() {
            push_record(
                &mut self.buffer,
                TAG_TRIM,
                &[&first.to_le_bytes(), &count.to_le_bytes()],
            );
            self.records += 1;
            self.trimmed_blocks += count;
        }
    }

    fn trim(&mut self, block: u64) {
        match self.pending_trim.as_mut() {
            Some((first, count)) if *first + *count == block => *count += 1,
            _ => {
                self.flush_trim();
                self.pending_trim = Some((block, 1));
            }
        }
    }

    fn vanished(&self, block: u64, generation: u64) -> VolumeError {
        VolumeError::CorruptBlock {
            volume: self.shared.name.clone(),
            block,
            detail: format!("extent of generation {generation} vanished while sending"),
        }
    }

    /// Appends the records of the next chunk of blocks (or the trailer) to the buffer.
    fn fill(&mut self) -> VolumeResult<()> {
        let start = self.buffer.len();
        if self.next_block >= self.size_blocks {
            self.flush_trim();
            self.hasher.update(&self.buffer[start..]);
            let trailer = StreamTrailer {
                records: self.records,
                blocks: self.blocks,
                trimmed_blocks: self.trimmed_blocks,
                base: self.base.clone(),
                target: self.target.clone(),
                stream_blake3: *self.hasher.finalize().as_bytes(),
            };
            let encoded = super::record::encode(&trailer)?;
            push_record(&mut self.buffer, TAG_TRAILER, &[&encoded]);
            self.finished = true;
            return Ok(());
        }
        let chunk_start = self.next_block;
        let chunk_end = self.size_blocks.min(chunk_start + SEND_CHUNK_BLOCKS);
        let volume_ids = self
            .target_view
            .iter()
            .chain(self.base_view.iter().flatten())
            .map(|layer| layer.volume_id);
        let stored = scan::RangeGenerations::collect(
            &self.store,
            &self.shared.name,
            volume_ids,
            chunk_start,
            chunk_end,
        )?;
        // What each block that changed becomes: a block record if its extent holds data, or
        // zeroes (a trim, if the base showed something there). The extents are then read
        // together, in runs ([`Store::read_extents`]), and the records written in block order.
        let mut parts: Vec<(u64, Part)> = Vec::new();
        let mut to_read: Vec<&Extent> = Vec::new();
        for &block in stored.blocks() {
            let generations_of = |volume_id: u64| stored.of(volume_id, block);
            let target_shown = view::resolve(&self.target_view, block, generations_of);
            let base_shown = self
                .base_view
                .as_ref()
                .and_then(|base_view| view::resolve(base_view, block, generations_of));
            if self.base_view.is_some() && target_shown == base_shown {
                continue;
            }
            let trim_if_zeroes = base_shown.is_some();
            match target_shown {
                Some((volume_id, generation)) => {
                    let extent = stored
                        .extent(volume_id, block, generation)
                        .ok_or_else(|| self.vanished(block, generation))?;
                    parts.push((
                        block,
                        Part::Read {
                            generation,
                            trim_if_zeroes,
                        },
                    ));
                    to_read.push(extent);
                }
                None if trim_if_zeroes => parts.push((block, Part::Zeroes)),
                None => {}
            }
        }
        let store = self.store.clone();
        let mut parts = parts.into_iter();
        let mut failure: Option<VolumeError> = None;
        store
            .read_extents(&to_read, &mut |_, value| {
                if failure.is_some() {
                    return;
                }
                // Zeroes listed before this block, then this block.
                for (block, part) in parts.by_ref() {
                    let Part::Read {
                        generation,
                        trim_if_zeroes,
                    } = part
                    else {
                        self.trim(block);
                        continue;
                    };
                    let Some(data) = value else {
                        failure = Some(self.vanished(block, generation));
                        break;
                    };
                    match data.len() {
                        0 if trim_if_zeroes => self.trim(block),
                        0 => {}
                        BLOCK_SIZE => {
                            self.flush_trim();
                            push_record(&mut self.buffer, TAG_BLOCK, &[&block.to_le_bytes(), data]);
                            self.records += 1;
                            self.blocks += 1;
                        }
                        length => {
                            failure = Some(VolumeError::CorruptBlock {
                                volume: self.shared.name.clone(),
                                block,
                                detail: format!("extent holds {length} bytes, not {BLOCK_SIZE}"),
                            })
                        }
                    }
                    break;
                }
            })
            .map_err(VolumeError::store(
                &self.shared.name,
                "reading blocks to send",
            ))?;
        if let Some(failure) = failure {
            return Err(failure);
        }
        // Zeroes after the last block read.
        for (block, _) in parts {
            self.trim(block);
        }
        // (A trim still pending goes with the next chunk's records.)
        self.hasher.update(&self.buffer[start..]);
        self.next_block = chunk_end;
        Ok(())
    }
}

impl Read for SendStream {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.position == self.buffer.len() {
            if self.finished {
                return Ok(0);
            }
            if let Some(error) = &self.failed {
                return Err(io::Error::other(format!(
                    "the send stream already failed: {error}"
                )));
            }
            self.buffer.clear();
            self.position = 0;
            if let Err(error) = self.fill() {
                // A half-filled chunk cannot be resumed: every later read fails too, so a
                // caller cannot build a stream with a hole in it.
                self.failed = Some(error.to_string());
                self.buffer.clear();
                return Err(error.into());
            }
        }
        let count = out.len().min(self.buffer.len() - self.position);
        out[..count].copy_from_slice(&self.buffer[self.position..self.position + count]);
        self.position += count;
        Ok(count)
    }
}

/// What a receive applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiveReport {
    pub volume: String,
    pub snapshot: String,
    pub incremental: bool,
    pub blocks: u64,
    pub trimmed_blocks: u64,
    pub stream_bytes: u64,
}

/// Bytes of records read that a [`StreamReader`] hashes at once ([`push_record`] says why).
const HASH_BATCH_BYTES: usize = 256 * 1024;

/// Reads records, verifying each one's CRC and hashing everything before the trailer.
struct StreamReader<'a> {
    input: &'a mut dyn Read,
    offset: u64,
    hasher: blake3::Hasher,
    /// Read, not yet hashed: at most [`HASH_BATCH_BYTES`] and a record.
    unhashed: Vec<u8>,
}

impl StreamReader<'_> {
    fn error(&self, detail: impl Into<String>) -> VolumeError {
        VolumeError::Stream {
            detail: detail.into(),
            offset: self.offset,
        }
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> VolumeResult<()> {
        match self.input.read_exact(buf) {
            Ok(()) => {
                self.offset += buf.len() as u64;
                Ok(())
            }
            Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => {
                Err(self.error("truncated: the stream ends before its trailer"))
            }
            Err(error) => Err(VolumeError::Io(error)),
        }
    }

    fn read_magic(&mut self) -> VolumeResult<()> {
        let mut magic = [0u8; 8];
        self.read_exact(&mut magic)?;
        if &magic != MAGIC {
            return Err(self.error("not a Keel volume stream (bad magic)"));
        }
        self.unhashed.extend_from_slice(&magic);
        Ok(())
    }

    /// The BLAKE3 hash of every record read so far but the trailer (and of the magic).
    fn digest(&mut self) -> blake3::Hash {
        self.hasher.update(&self.unhashed);
        self.unhashed.clear();
        self.hasher.finalize()
    }

    /// Returns the record's tag and payload (payload into `payload`).
    fn read_record(&mut self, payload: &mut Vec<u8>) -> VolumeResult<u8> {
        let record_offset = self.offset;
        let mut head = [0u8; 5];
        self.read_exact(&mut head)?;
        let tag = head[0];
        let length = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if length > RECORD_PAYLOAD_MAX_BYTES {
            return Err(self.error(format!("record at byte {record_offset} claims {length} bytes, more than {RECORD_PAYLOAD_MAX_BYTES}")));
        }
        payload.resize(length, 0);
        self.read_exact(payload)?;
        let mut crc_bytes = [0u8; 4];
        self.read_exact(&mut crc_bytes)?;
        let mut digest = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
        digest.update(&head);
        digest.update(payload);
        let crc = digest.finalize() as u32;
        if crc != u32::from_le_bytes(crc_bytes) {
            return Err(self.error(format!("record at byte {record_offset} fails its CRC32C")));
        }
        if tag != TAG_TRAILER {
            self.unhashed.extend_from_slice(&head);
            self.unhashed.extend_from_slice(payload);
            self.unhashed.extend_from_slice(&crc_bytes);
            if self.unhashed.len() >= HASH_BATCH_BYTES {
                self.hasher.update(&self.unhashed);
                self.unhashed.clear();
            }
        }
        Ok(tag)
    }
}

/// Where a receive writes, and how to undo it.
/// Where a receive writes.
struct Target {
    shared: Arc<VolumeShared>,
    generation: u64,
    base_generation: Option<u64>,
    _base_user: Option<SnapshotUse>,
}

fn propose(metadata: &dyn Metadata, volume: &str, command: Command) -> VolumeResult<Outcome> {
    metadata.propose(command).map_err(|error| match error {
        MetadataError::Refused(refusal) => VolumeError::from_catalog(refusal),
        other => VolumeError::Unavailable {
            volume: volume.to_string(),
            detail: other.to_string(),
        },
    })
}

/// How a receive's last step runs: it is handed the step (the catalog switching the volume to
/// the received contents, through Raft) and runs it, as it is (`&|publish| publish()`) or
/// within what the volume needs around it (a replicated volume's primary: with its other
/// replicas out of the in-sync set, since only this node's copy holds the stream's blocks).
pub type Publish<'a> = &'a dyn Fn(&mut dyn FnMut() -> VolumeResult<()>) -> VolumeResult<()>;

/// Applies a stream made by [`SendStream`] on this node. A full stream creates volume `volume`
/// (which must not exist) here; an incremental one needs `volume` to be hosted here with the
/// stream's base snapshot, and replaces its current contents by the stream's target snapshot
/// (like `zfs receive -F`), the last step run by `publish`. Nothing is visible until the whole
/// stream verified; a bad, truncated or mismatched stream leaves the volume as it was.
pub fn receive(
    engine: &Engine,
    metadata: &dyn Metadata,
    input: &mut dyn Read,
    volume: &str,
    publish: Publish<'_>,
) -> VolumeResult<ReceiveReport> {
    keel_catalog::validate_name("volume", volume).map_err(VolumeError::from_catalog)?;
    let mut reader = StreamReader {
        input,
        offset: 0,
        hasher: blake3::Hasher::new(),
        unhashed: Vec::with_capacity(HASH_BATCH_BYTES + BLOCK_SIZE + 64),
    };
    reader.read_magic()?;
    let mut payload = Vec::with_capacity(BLOCK_SIZE + 8);
    if reader.read_record(&mut payload)? != TAG_HEADER {
        return Err(reader.error("the first record is not a header"));
    }
    let header: StreamHeader = postcard::from_bytes(&payload)
        .map_err(|error| reader.error(format!("undecodable header: {error}")))?;
    if header.version != STREAM_VERSION || header.block_size_bytes != BLOCK_SIZE_BYTES {
        return Err(reader.error(format!(
            "stream version {} with {}-byte blocks; this build reads version {STREAM_VERSION} with {BLOCK_SIZE_BYTES}-byte blocks",
            header.version, header.block_size_bytes
        )));
    }
    keel_catalog::validate_size(volume, header.size_bytes).map_err(VolumeError::from_catalog)?;
    keel_catalog::validate_name("snapshot", &header.target.name)
        .map_err(VolumeError::from_catalog)?;
    let target = prepare(engine, metadata, volume, &header)?;
    match apply(engine, &mut reader, &header, &target, &mut payload) {
        Ok(blocks) => {
            let published = publish(&mut || {
                propose(
                    metadata,
                    volume,
                    Command::ReceivePublish {
                        volume_id: target.shared.id,
                        generation: target.generation,
                        base_generation: target.base_generation,
                        target_name: header.target.name.clone(),
                        target_guid: header.target.guid,
                        size_bytes: header.size_bytes,
                        created_unix_seconds: super::record::unix_seconds_now(),
                    },
                )
                .map(|_| ())
            });
            match published {
                Ok(_) => Ok(ReceiveReport {
                    volume: volume.to_string(),
                    snapshot: header.target.name.clone(),
                    incremental: header.base.is_some(),
                    blocks: blocks.0,
                    trimmed_blocks: blocks.1,
                    stream_bytes: reader.offset,
                }),
                Err(error) => {
                    abandon(metadata, volume, &target);
                    Err(error)
                }
            }
        }
        Err(error) => {
            abandon(metadata, volume, &target);
            Err(error)
        }
    }
}

/// Reserves where the stream's blocks go: a hidden new volume on this node (full stream) or a
/// fresh generation of the target volume excluded from every view (incremental).
fn prepare(
    engine: &Engine,
    metadata: &dyn Metadata,
    volume: &str,
    header: &StreamHeader,
) -> VolumeResult<Target> {
    let Some(base) = &header.base else {
        let settings = keel_catalog::VolumeSettings {
            name: volume.to_string(),
            size_bytes: header.size_bytes,
            compression: Compression::from_name(&header.compression)
                .unwrap_or_default()
                .name()
                .to_string(),
            iops_max: None,
            bandwidth_max_mib_per_second: None,
        };
        let outcome = propose(
            metadata,
            volume,
            Command::VolumeCreate {
                settings,
                uuid: super::record::new_unique_id(volume.as_bytes()),
                created_unix_seconds: super::record::unix_seconds_now(),
                replicas: vec![engine.local_node()],
                status: VolumeStatus::Receiving,
            },
        )?;
        let Outcome::Volume(volume_id) = outcome else {
            return Err(VolumeError::Metadata {
                detail: format!("creating a volume answered {outcome:?}"),
            });
        };
        let shared = engine.get(volume_id).ok_or_else(|| VolumeError::Metadata {
            detail: format!("volume {volume:?} was created but is not hosted here"),
        })?;
        return Ok(Target {
            shared,
            generation: 1,
            base_generation: None,
            _base_user: None,
        });
    };
    let base_missing = || VolumeError::BaseMissing {
        volume: volume.to_string(),
        base_name: base.name.clone(),
        base_guid: hex(&base.guid),
    };
    let volume_id = {
        let catalog = metadata.catalog().read();
        let entry = catalog.volume(volume).ok_or_else(base_missing)?;
        // A base this node's copy lacks data of would give the received snapshot its holes.
        if let Some(frozen) = entry.snapshot_by_guid(&base.guid) {
            super::check_snapshot_complete(&entry.record, frozen, engine.local_node())?;
        }
        entry.record.id
    };
    let shared = engine.get(volume_id).ok_or_else(base_missing)?;
    let base_generation = read(&shared.state)
        .snapshots
        .values()
        .find(|snapshot| snapshot.guid == base.guid)
        .map(|snapshot| snapshot.generation)
        .ok_or_else(base_missing)?;
    // Held from before the reservation until the receive ends: the namespace refuses to delete
    // a snapshot in use.
    let base_user = shared.use_snapshot(base_generation);
    let outcome = propose(
        metadata,
        volume,
        Command::ReceiveReserve {
            volume: volume.to_string(),
            base_guid: base.guid,
            target_name: header.target.name.clone(),
            target_guid: header.target.guid,
        },
    )
    .map_err(|error| match error {
        VolumeError::BaseMissing { .. } => base_missing(),
        other => other,
    })?;
    let Outcome::Reserved {
        volume_id: reserved_volume,
        generation,
        base_generation: reserved_base,
    } = outcome
    else {
        return Err(VolumeError::Metadata {
            detail: format!("reserving a receive answered {outcome:?}"),
        });
    };
    if reserved_volume != volume_id || reserved_base != base_generation {
        return Err(VolumeError::Metadata {
            detail: format!("volume {volume:?} changed while its receive was being reserved"),
        });
    }
    Ok(Target {
        shared,
        generation,
        base_generation: Some(base_generation),
        _base_user: Some(base_user),
    })
}

/// Writes the stream's blocks into the target generation; returns (blocks, trimmed blocks).
fn apply(
    engine: &Engine,
    reader: &mut StreamReader<'_>,
    header: &StreamHeader,
    target: &Target,
    payload: &mut Vec<u8>,
) -> VolumeResult<(u64, u64)> {
    let store = engine.store();
    let shared = &target.shared;
    // The store writes one batch while the next is read, verified and hashed: a writer
    // thread takes full batches, at most one waiting (memory stays a few batches).
    let applied = std::thread::scope(|scope| {
        let (sender, batches) = std::sync::mpsc::sync_channel::<Vec<WriteOp>>(1);
        let writer = std::thread::Builder::new()
            .name("keel-receive".to_string())
            .spawn_scoped(scope, || -> VolumeResult<()> {
                for ops in batches {
                    // Bulk: nothing reads a received volume while it arrives.
                    store
                        .write_bulk(ops, Durability::Buffered)
                        .map_err(VolumeError::store(&shared.name, "writing received blocks"))?;
                }
                Ok(())
            })
            .map_err(VolumeError::Io)?;
        let parsed = parse(reader, header, target, payload, &|ops| {
            sender.send(ops).is_ok()
        });
        drop(sender);
        let written = writer.join().unwrap_or_else(|_| {
            Err(VolumeError::Unavailable {
                volume: shared.name.clone(),
                detail: "the thread writing received blocks panicked".to_string(),
            })
        });
        // The writer's error first: the parser stops with a stand-in once the writer is gone.
        written.and(parsed)
    })?;
    // The blocks are durable before the snapshot that shows them is published.
    store
        .flush()
        .map_err(VolumeError::store(&shared.name, "flushing received blocks"))?;
    Ok(applied)
}

/// Reads, verifies and hashes the stream's records up to its trailer, handing the blocks'
/// writes to `write` in batches ([`RECEIVE_BATCH_OPS`]); `write` answers false once the
/// writer is gone (it failed). Returns (blocks, trimmed blocks).
fn parse(
    reader: &mut StreamReader<'_>,
    header: &StreamHeader,
    target: &Target,
    payload: &mut Vec<u8>,
    write: &dyn Fn(Vec<WriteOp>) -> bool,
) -> VolumeResult<(u64, u64)> {
    let shared = &target.shared;
    let size_blocks = header.size_bytes / BLOCK_SIZE_BYTES;
    let compression = read(&shared.state).compression;
    let mut ops: Vec<WriteOp> = Vec::with_capacity(RECEIVE_BATCH_OPS);
    let (mut records, mut blocks, mut trimmed_blocks) = (0u64, 0u64, 0u64);
    let submit = |ops: &mut Vec<WriteOp>| -> VolumeResult<()> {
        if ops.is_empty()
            || write(std::mem::replace(
                ops,
                Vec::with_capacity(RECEIVE_BATCH_OPS),
            ))
        {
            return Ok(());
        }
        Err(VolumeError::Unavailable {
            volume: shared.name.clone(),
            detail: "the thread writing received blocks stopped".to_string(),
        })
    };
    let trailer: StreamTrailer = loop {
        match reader.read_record(payload)? {
            TAG_BLOCK => {
                if payload.len() != 8 + BLOCK_SIZE {
                    return Err(reader.error(format!("block record of {} bytes", payload.len())));
                }
                let block = u64::from_le_bytes(payload[..8].try_into().unwrap_or_default());
                if block >= size_blocks {
                    return Err(
                        reader.error(format!("block {block} past the end ({size_blocks} blocks)"))
                    );
                }
                let data = &payload[8..];
                let value = if data.iter().all(|&byte| byte == 0) {
                    Vec::new()
                } else {
                    data.to_vec()
                };
                ops.push(WriteOp::put(
                    block_key(shared.id, block, target.generation),
                    value,
                    compression,
                ));
                records += 1;
                blocks += 1;
            }
            TAG_TRIM => {
                if payload.len() != 16 {
                    return Err(reader.error(format!("trim record of {} bytes", payload.len())));
                }
                let first = u64::from_le_bytes(payload[..8].try_into().unwrap_or_default());
                let count = u64::from_le_bytes(payload[8..].try_into().unwrap_or_default());
                if first.checked_add(count).is_none_or(|end| end > size_blocks) {
                    return Err(
                        reader.error(format!("trim of {count} blocks at {first} past the end"))
                    );
                }
                for block in first..first + count {
                    ops.push(WriteOp::put(
                        block_key(shared.id, block, target.generation),
                        Vec::new(),
                        compression,
                    ));
                    if ops.len() >= RECEIVE_BATCH_OPS {
                        submit(&mut ops)?;
                    }
                }
                records += 1;
                trimmed_blocks += count;
            }
            TAG_TRAILER => {
                let trailer: StreamTrailer = postcard::from_bytes(payload)
                    .map_err(|error| reader.error(format!("undecodable trailer: {error}")))?;
                // (The trailer itself is not hashed.)
                if trailer.stream_blake3 != *reader.digest().as_bytes() {
                    return Err(
                        reader.error("the stream's BLAKE3 checksum does not match its contents")
                    );
                }
                break trailer;
            }
            TAG_HEADER => return Err(reader.error("a second header record")),
            tag => return Err(reader.error(format!("unknown record tag {tag}"))),
        }
        if ops.len() >= RECEIVE_BATCH_OPS {
            submit(&mut ops)?;
        }
    };
    if trailer.records != records
        || trailer.blocks != blocks
        || trailer.trimmed_blocks != trimmed_blocks
        || trailer.base != header.base
        || trailer.target != header.target
    {
        return Err(reader.error("the trailer does not match the stream's header or records"));
    }
    let mut extra = [0u8; 1];
    match reader.input.read(&mut extra) {
        Ok(0) => {}
        Ok(_) => return Err(reader.error("bytes after the trailer")),
        Err(error) => return Err(VolumeError::Io(error)),
    }
    submit(&mut ops)?;
    Ok((blocks, trimmed_blocks))
}

/// Undoes a failed receive: the hidden new volume becomes `Deleting` (the engine erases it), or
/// the reserved generation is released (the engine collects its blocks).
fn abandon(metadata: &dyn Metadata, volume: &str, target: &Target) {
    let result = metadata.propose(Command::ReceiveAbandon {
        volume_id: target.shared.id,
        generation: target.generation,
    });
    if let Err(error) = result {
        tracing::warn!(volume, %error, "could not abandon a failed receive; the next start of this node will");
    }
}
