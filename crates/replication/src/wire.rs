//! What a primary and its replicas say to each other over the cluster's transport (`keel-rpc`
//! in a server): method numbers, message shapes (postcard-encoded) and error codes. Method
//! numbers are part of the wire protocol: never reuse one. They sit above
//! `keel_cluster::messages::METHOD_FIRST_ABOVE`. A new message's types go in
//! `crates/keel/tests/protocol.rs`, and any change of a message's shape comes with a new
//! `keel_rpc::handshake::PROTOCOL` (that test fails until it does).
//!
//! The messages carry the volume's own writes (offset, data), never the store's keys, so each
//! node's store layout can change without touching this protocol.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// Primary → replica: a batch of the volume's stream ([`Batch`] → [`BatchAck`]).
pub const METHOD_REPLICATE: u16 = 0x0200;
/// Primary → replica: hashes of the replica's blocks in a range ([`HashRequest`] →
/// [`HashAnswer`]), to ship only the blocks that differ when it catches up.
pub const METHOD_HASHES: u16 = 0x0201;
/// Primary → replica: whether a range of up to [`crate::RESYNC_PROBE_BYTES`] was never
/// written on the replica ([`HashRequest`] → [`UnwrittenAnswer`]), so a catch-up skips the
/// empty stretches of a sparse volume without comparing them chunk by chunk.
pub const METHOD_UNWRITTEN: u16 = 0x0202;

/// A node without a replica → the node serving the volume: open a session for a client
/// attached there ([`ForwardOpen`] → [`ForwardOpened`]); the serving node opens the volume as
/// a client attaching to it would (it becomes or stays the primary).
pub const METHOD_FORWARD_OPEN: u16 = 0x0203;
/// One request of a forwarding session ([`ForwardRequest`] → [`ForwardAnswer`]).
pub const METHOD_FORWARD_IO: u16 = 0x0204;
/// The forwarding client went away ([`ForwardClose`] → nothing).
pub const METHOD_FORWARD_CLOSE: u16 = 0x0205;

/// Primary → in-sync replica: the replica's copy of a range ([`HashRequest`] → [`CopyAnswer`]),
/// when the primary's own copy fails its checksum.
pub const METHOD_READ_COPY: u16 = 0x0206;

/// Primary → replica being caught up: what the replica changed since its common point with
/// the primary ([`ChangedRequest`] → [`ChangedAnswer`]), so a catch-up after a crash or a
/// take-over compares only that and what the primary changed since its own.
pub const METHOD_CHANGED: u16 = 0x0207;

/// Primary → replica: hashes of the replica's copy of a snapshot's blocks in a range
/// ([`SnapshotRange`] → [`HashAnswer`]), to repair a copy that lacks the snapshot's data.
pub const METHOD_SNAPSHOT_HASHES: u16 = 0x0208;
/// Primary → replica holding a snapshot whole: its copy of a range of the snapshot
/// ([`SnapshotRange`] → [`CopyAnswer`]), the source of a repair.
pub const METHOD_SNAPSHOT_READ: u16 = 0x0209;
/// Primary → replica whose copy of a snapshot is being repaired: blocks that differ, written
/// durably into the generation reserved for the repair ([`SnapshotRepairWrite`] → nothing).
pub const METHOD_SNAPSHOT_REPAIR: u16 = 0x020a;

/// Primary → the node of a replica it is about to copy whole: a turn to receive it, asked
/// before the copy, renewed while it runs, given back at its end ([`CopyTurnRequest`] →
/// [`CopyTurnAnswer`]; `crate::turns`).
pub const METHOD_COPY_TURN: u16 = 0x020b;

/// A node holding a replica in sync, where a client attaches → the volume's primary: hand
/// the volume over, unless a client uses it there ([`HandOverRequest`] → [`HandOverAnswer`]).
pub const METHOD_HAND_OVER: u16 = 0x020c;

/// Any node → a volume's primary: how it serves the volume (replicas catching up, with their
/// progress and ETA), for `keel status` and `keel volume info` on another node
/// ([`PrimaryStatusRequest`] → [`PrimaryStatusAnswer`]).
pub const METHOD_PRIMARY_STATUS: u16 = 0x020d;

/// A primary that just handed a volume off → the replica it named the next primary: the
/// epoch its hand-off made, in which every replica in sync holds the same writes, durable
/// ([`HandedOff`] → nothing). The new primary then keeps them in sync rather than catch
/// them up; a notice it never gets (or forgets, restarting) only costs it that catch-up.
pub const METHOD_HANDED_OFF: u16 = 0x020e;

/// The sender is not the volume's primary in the replica's view (an older epoch or another
/// node): it must stop acknowledging anything for the volume.
pub const CODE_FENCED: u16 = 0x0201;
/// The replica's catalog has not applied the sender's epoch yet: try again shortly.
pub const CODE_BEHIND: u16 = 0x0202;
/// The batch does not continue the stream the replica holds (it restarted and lost its
/// place): the primary must take it out of the in-sync set and resync it.
pub const CODE_OUT_OF_ORDER: u16 = 0x0203;
/// The replica could not apply the batch (store error, volume missing here).
pub const CODE_FAILED: u16 = 0x0204;
/// The request could not be decoded.
pub const CODE_BAD_REQUEST: u16 = 0x0205;

/// The session is not (or no longer) served here: the node restarted, the session expired,
/// or another node took the volume over. The forwarding node opens a new one, where it may.
pub const CODE_SESSION_GONE: u16 = 0x0206;
/// Opening a session was refused: the volume is not found, or this node cannot serve it now
/// (the message says why and which node can).
pub const CODE_REFUSED: u16 = 0x0207;
/// Opening a session was refused because the volume does not exist.
pub const CODE_NOT_FOUND: u16 = 0x0208;
/// The replica's store refused the batch for want of space: it is up, and the next second
/// rarely changes that, so the primary tries its catch-up further apart (and moves a replica
/// refusing that long). Any other failure to apply is [`CODE_FAILED`], tried every second.
pub const CODE_NO_SPACE: u16 = 0x0209;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardOpen {
    pub volume: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardOpened {
    pub session: u64,
    pub size_bytes: u64,
    pub block_size_bytes: u32,
    pub read_only: bool,
}

/// A client's request, as its NBD server received it (ranges already checked there). A write's
/// data is borrowed: encoded straight from the client's buffer, decoded in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ForwardOp<'a> {
    Read {
        offset: u64,
        length: u32,
    },
    Write {
        offset: u64,
        data: &'a [u8],
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        length: u64,
    },
    Zeroes {
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    },
    /// Keeps an idle session from expiring.
    Ping,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardRequest<'a> {
    pub session: u64,
    #[serde(borrow)]
    pub op: ForwardOp<'a>,
}

/// How a forwarded request failed, as the client is to be told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ForwardErrorKind {
    InvalidInput,
    ReadOnly,
    NoSpace,
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ForwardAnswer {
    Done,
    Data(#[serde(with = "serde_bytes")] Vec<u8>),
    Failed {
        kind: ForwardErrorKind,
        message: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardClose {
    pub session: u64,
}

/// One change to the volume, in the primary's order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    Write {
        offset: u64,
        /// Shared, not copied: one buffer serves every replica's queue on the primary, and
        /// on a replica the batch's payload itself ([`Batch::decode_shared`]).
        #[serde(with = "shared_bytes")]
        data: Bytes,
    },
    Trim {
        offset: u64,
        length: u64,
    },
    Zeroes {
        offset: u64,
        length: u64,
        may_trim: bool,
    },
}

/// A run of the primary → replica stream. Batches of one stream are sent one at a time, in
/// order; `index` 0 starts a new stream (the replica forgets its place in any older one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    pub volume_id: u64,
    /// The primary's epoch when it sent the batch.
    pub epoch: u64,
    pub stream: u64,
    pub index: u64,
    pub ops: Vec<Op>,
    /// Make everything applied so far durable before answering.
    pub flush: bool,
    /// Apply the ops only once this node's catalog applied at least this Raft index: a
    /// snapshot, rollback or resize the primary made between two writes then falls between
    /// them here too.
    pub catalog_index: u64,
    /// The volume's write generation when the primary's view of it last changed for this
    /// stream (as `catalog_index`). A replica whose catalog shows a later one refuses the
    /// batch: it was queued before a snapshot, rollback, resize or received stream that this
    /// node has applied since, on a stream the primary ended first (a replica it dropped for
    /// the change), and applied now it would land on the wrong side of the change.
    pub generation: u64,
    /// The latest batch of this stream ending in a FLUSH that both nodes made durable while
    /// the replica was in sync: the replica keeps its store sequence at that FLUSH as its
    /// common point with the primary.
    pub common_index: Option<u64>,
    /// Other replicas in sync that made that FLUSH durable too: the replica keeps the same
    /// common point with each of them (after a take-over one of them may catch it up).
    pub common_with: Vec<u64>,
}

impl Batch {
    /// Decodes a batch whose writes' data stay in `payload`, shared rather than copied out
    /// (what `postcard::from_bytes` gives, without a copy of every byte written).
    pub fn decode_shared(payload: Bytes) -> Result<Batch, postcard::Error> {
        let view: BatchView<'_> = postcard::from_bytes(&payload)?;
        Ok(Batch {
            volume_id: view.volume_id,
            epoch: view.epoch,
            stream: view.stream,
            index: view.index,
            ops: view
                .ops
                .into_iter()
                .map(|op| match op {
                    OpView::Write { offset, data } => Op::Write {
                        offset,
                        data: payload.slice_ref(data),
                    },
                    OpView::Trim { offset, length } => Op::Trim { offset, length },
                    OpView::Zeroes {
                        offset,
                        length,
                        may_trim,
                    } => Op::Zeroes {
                        offset,
                        length,
                        may_trim,
                    },
                })
                .collect(),
            flush: view.flush,
            catalog_index: view.catalog_index,
            generation: view.generation,
            common_index: view.common_index,
            common_with: view.common_with,
        })
    }

    /// Encodes the batch as `postcard::to_allocvec` does, but as parts: each write's data of
    /// at least [`SHARED_PART_BYTES`] is a part of its own, shared rather than copied, between
    /// the bytes encoded around it. The transport writes the parts one after another; the
    /// replica receives the one payload [`Batch::decode_shared`] reads.
    pub fn encode(&self) -> Result<keel_cluster::Payload, postcard::Error> {
        let shared = (self.ops.iter())
            .filter_map(|op| match op {
                Op::Write { data, .. } if data.len() >= SHARED_PART_BYTES => Some(data.clone()),
                _ => None,
            })
            .collect();
        postcard::serialize_with_flavor(
            self,
            Parts {
                shared,
                next: 0,
                encoded: Vec::new(),
                parts: Vec::new(),
            },
        )
    }
}

/// A write's data at least this large travels as its own part of a batch's frame; a smaller
/// one costs less to copy than a part of its own.
const SHARED_PART_BYTES: usize = 16 << 10;

/// The postcard output of [`Batch::encode`]: encoded bytes, with the large writes' data
/// (`shared`, in the order they are encoded) taken as they are where the encoder reaches them.
struct Parts {
    shared: Vec<Bytes>,
    /// The next of `shared` to come.
    next: usize,
    /// Encoded since the last part.
    encoded: Vec<u8>,
    parts: Vec<Bytes>,
}

impl postcard::ser_flavors::Flavor for Parts {
    type Output = keel_cluster::Payload;

    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        // The encoder hands a write's data over as the very slice it holds.
        match self.shared.get(self.next) {
            Some(next) if next.as_ptr() == data.as_ptr() && next.len() == data.len() => {
                if !self.encoded.is_empty() {
                    self.parts.push(std::mem::take(&mut self.encoded).into());
                }
                self.parts.push(next.clone());
                self.next += 1;
            }
            _ => self.encoded.extend_from_slice(data),
        }
        Ok(())
    }

    fn try_push(&mut self, byte: u8) -> postcard::Result<()> {
        self.encoded.push(byte);
        Ok(())
    }

    fn finalize(mut self) -> postcard::Result<keel_cluster::Payload> {
        if !self.encoded.is_empty() {
            self.parts.push(self.encoded.into());
        }
        Ok(keel_cluster::Payload::from_parts(self.parts))
    }
}

/// [`Batch`] as it is decoded, its writes' data borrowed from the payload: the same fields in
/// the same order (the round-trip test compares the two decodings).
#[derive(Deserialize)]
struct BatchView<'a> {
    volume_id: u64,
    epoch: u64,
    stream: u64,
    index: u64,
    #[serde(borrow)]
    ops: Vec<OpView<'a>>,
    flush: bool,
    catalog_index: u64,
    generation: u64,
    common_index: Option<u64>,
    common_with: Vec<u64>,
}

/// [`Op`] as it is decoded (see [`BatchView`]).
#[derive(Deserialize)]
enum OpView<'a> {
    Write {
        offset: u64,
        data: &'a [u8],
    },
    Trim {
        offset: u64,
        length: u64,
    },
    Zeroes {
        offset: u64,
        length: u64,
        may_trim: bool,
    },
}

/// [`Bytes`] as a byte string: its length, then the bytes (what `serde_bytes` gives a
/// `Vec<u8>`, so the encoding is the same).
mod shared_bytes {
    use bytes::Bytes;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(data: &Bytes, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(data)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Bytes, D::Error> {
        serde_bytes::ByteBuf::deserialize(deserializer).map(|bytes| Bytes::from(bytes.into_vec()))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchAck {
    /// The replica flushed (the batch asked, and it succeeded).
    pub durable: bool,
    /// Client requests the replica's node has started (all its frontends, every volume and
    /// bucket): a resync to it yields while this moves.
    pub client_requests: u64,
}

/// A range of a replica's copy of the volume. `catalog_index`: the Raft index the primary had
/// applied when its view of the volume last changed (its catch-up's start, a snapshot, a
/// rollback), which the replica waits for: it answers about its copy as that view shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HashRequest {
    pub volume_id: u64,
    pub epoch: u64,
    pub catalog_index: u64,
    pub offset: u64,
    pub length: u64,
}

/// A range of a replica's copy of the snapshot at `snapshot_generation`: with `repair`, as
/// the repair into that generation sees it; without, only from a copy holding it whole.
/// `catalog_index`: the Raft index the primary had applied (the repair's start), which the
/// replica waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRange {
    pub volume_id: u64,
    pub epoch: u64,
    pub snapshot_generation: u64,
    pub repair: Option<u64>,
    pub catalog_index: u64,
    pub offset: u64,
    pub length: u64,
}

/// The blocks of a chunk of a snapshot that differ on the replica, for its repair of its
/// copy: written together, durably, in one store write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRepairWrite {
    pub volume_id: u64,
    pub epoch: u64,
    pub snapshot_generation: u64,
    pub repair: u64,
    pub catalog_index: u64,
    pub runs: Vec<RepairRun>,
}

/// Whole blocks of a snapshot at `offset`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RepairRun {
    pub offset: u64,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

/// `catalog_index`: as in [`HashRequest`] (a common point holds only for the view it was
/// kept with).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangedRequest {
    pub volume_id: u64,
    pub epoch: u64,
    pub catalog_index: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangedAnswer {
    /// The units changed since the replica's point (the primary's bitmap, encoded); `None`:
    /// it holds no point with the primary that still holds.
    #[serde(with = "serde_bytes")]
    pub chunks: Option<Vec<u8>>,
}

/// What a primary does with its turn on a replica's node ([`METHOD_COPY_TURN`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TurnAction {
    /// Asks for one, or renews the one it holds: refused when every turn is held.
    Ask,
    /// Renews the turn of a copy under way, granted even past the limit.
    Renew,
    /// The copy ended.
    GiveBack,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyTurnRequest {
    pub volume_id: u64,
    pub action: TurnAction,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyTurnAnswer {
    pub granted: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandOverRequest {
    pub volume_id: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandOverAnswer {
    /// Why the primary kept the volume (`None`: Raft names the caller its primary now).
    pub kept: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandedOff {
    pub volume_id: u64,
    /// The epoch Raft recorded with the receiver as primary and the in-sync set unchanged.
    pub epoch: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrimaryStatusRequest {
    pub volume_id: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrimaryStatusAnswer {
    /// `None`: the node does not serve the volume (any more).
    pub status: Option<crate::primary::PrimaryStatus>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyAnswer {
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnwrittenAnswer {
    pub unwritten: bool,
}

/// Bytes of one block's hash (truncated keyed BLAKE3; collisions are not a concern between
/// honest nodes that authenticate every frame).
pub const BLOCK_HASH_BYTES: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HashAnswer {
    /// [`BLOCK_HASH_BYTES`] per block of the range, in order; empty when no block of the
    /// range was ever written on the replica (it reads as zeroes: [`zero_block_hash`] each).
    #[serde(with = "serde_bytes")]
    pub hashes: Vec<u8>,
}

/// What a replica answers for a block it cannot read (it fails its checksum): not the hash of
/// any content (a 2^-128 chance aside), so the primary ships its copy.
pub const UNREADABLE_BLOCK_HASH: [u8; BLOCK_HASH_BYTES] = [0xff; BLOCK_HASH_BYTES];

/// The hash of a block of zeroes (a never-written block).
pub fn zero_block_hash(block_bytes: usize) -> [u8; BLOCK_HASH_BYTES] {
    block_hash(&vec![0u8; block_bytes])
}

/// The hash a block is compared by.
pub fn block_hash(block: &[u8]) -> [u8; BLOCK_HASH_BYTES] {
    let full = blake3::hash(block);
    let mut out = [0u8; BLOCK_HASH_BYTES];
    out.copy_from_slice(&full.as_bytes()[..BLOCK_HASH_BYTES]);
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A batch of `ops` ending in a FLUSH, its other fields set (a catalog index of two varint
    /// bytes).
    fn batch_of(ops: Vec<Op>) -> Batch {
        Batch {
            volume_id: 7,
            epoch: 3,
            stream: 99,
            index: 2,
            ops,
            flush: true,
            catalog_index: 300,
            generation: 3,
            common_index: Some(1),
            common_with: vec![3],
        }
    }

    // Proves a batch encoded as parts is byte for byte what postcard encodes, with each large
    // write's data sent from the write's own buffer and each small one copied.
    #[test]
    fn a_batch_encoded_as_parts_is_postcards_encoding_sharing_large_writes() {
        let large = |fill: u8, len: usize| Bytes::from(vec![fill; len]);
        let batch = batch_of(vec![
            Op::Write {
                offset: 0,
                data: large(1, SHARED_PART_BYTES),
            },
            Op::Write {
                offset: 1 << 20,
                data: large(2, SHARED_PART_BYTES),
            },
            Op::Write {
                offset: 4096,
                data: large(3, SHARED_PART_BYTES - 1),
            },
            Op::Trim {
                offset: 0,
                length: 8192,
            },
            // The same bytes as the first write's, sent from its own buffer.
            Op::Write {
                offset: 8192,
                data: large(1, SHARED_PART_BYTES),
            },
        ]);
        let payload = batch.encode().unwrap();
        assert_eq!(
            payload.clone().into_vec(),
            postcard::to_allocvec(&batch).unwrap()
        );
        let sent_from = |part: &Bytes| part.as_ptr();
        let data_at = |index: usize| match &batch.ops[index] {
            Op::Write { data, .. } => data.as_ptr(),
            _ => unreachable!("a write"),
        };
        let parts: Vec<_> = payload.parts().iter().map(sent_from).collect();
        // Encoded bytes before each large write's data, that data, and the bytes after the last.
        assert_eq!(parts.len(), 7);
        assert_eq!(
            (parts[1], parts[3], parts[5]),
            (data_at(0), data_at(1), data_at(4))
        );
        assert!(!parts.contains(&data_at(2)));
        // A batch with nothing large is one part, and an empty one encodes as postcard's too.
        let small = Batch {
            ops: vec![batch.ops[2].clone()],
            ..batch.clone()
        };
        assert_eq!(small.encode().unwrap().parts().len(), 1);
        let empty = Batch {
            ops: Vec::new(),
            ..batch
        };
        assert_eq!(
            empty.encode().unwrap().into_vec(),
            postcard::to_allocvec(&empty).unwrap()
        );
    }

    // Proves the messages round-trip through postcard and truncated input is refused.
    #[test]
    fn batches_round_trip_and_truncation_is_refused() {
        let batch = batch_of(vec![
            Op::Write {
                offset: 4096,
                data: Bytes::from(vec![5; 4096]),
            },
            Op::Write {
                offset: 0,
                data: Bytes::new(),
            },
            Op::Trim {
                offset: 0,
                length: 8192,
            },
            Op::Zeroes {
                offset: 8192,
                length: 4096,
                may_trim: true,
            },
        ]);
        let bytes = postcard::to_allocvec(&batch).unwrap();
        assert_eq!(postcard::from_bytes::<Batch>(&bytes).unwrap(), batch);
        // The replica's decoding, which shares the payload, gives the same batch...
        let shared = Bytes::from(bytes.clone());
        let decoded = Batch::decode_shared(shared.clone()).unwrap();
        assert_eq!(decoded, batch);
        // ...whose data point into the payload, not at copies.
        let Op::Write { data, .. } = &decoded.ops[0] else {
            panic!("the first op is a write");
        };
        let within = shared.as_ptr_range();
        assert!(within.contains(&data.as_ptr()));
        for cut in [0, 1, bytes.len() / 2, bytes.len() - 1] {
            assert!(
                postcard::from_bytes::<Batch>(&bytes[..cut]).is_err(),
                "{cut}"
            );
            assert!(
                Batch::decode_shared(Bytes::copy_from_slice(&bytes[..cut])).is_err(),
                "{cut}"
            );
        }
        // Any damage: both decodings agree, and neither panics.
        for at in 0..bytes.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut damaged = bytes.clone();
                damaged[at] ^= flip;
                assert_eq!(
                    Batch::decode_shared(Bytes::from(damaged.clone())).ok(),
                    postcard::from_bytes::<Batch>(&damaged).ok(),
                    "byte {at} ^ {flip:#x}"
                );
            }
        }
        assert_ne!(block_hash(&[0; 4096]), block_hash(&[1; 4096]));
    }

    // Proves a write's data travels as its length and the bytes themselves (serde_bytes): the
    // encoding a sequence of u8 had, so nodes before and after the change understand each other.
    #[test]
    fn write_data_is_length_then_raw_bytes() {
        let op = Op::Write {
            offset: 1,
            data: Bytes::from_static(&[7, 8, 9]),
        };
        assert_eq!(postcard::to_allocvec(&op).unwrap(), [0, 1, 3, 7, 8, 9]);
        let answer = HashAnswer { hashes: vec![1, 2] };
        assert_eq!(postcard::to_allocvec(&answer).unwrap(), [2, 1, 2]);
    }

    // Proves what a replica changed round-trips, its absence is distinct from an empty list,
    // and a truncated answer is refused.
    #[test]
    fn changed_answers_round_trip_and_truncation_is_refused() {
        let listed = ChangedAnswer {
            chunks: Some(vec![3, 0xff, 0, 1]),
        };
        let none = ChangedAnswer { chunks: None };
        for answer in [&listed, &none] {
            let bytes = postcard::to_allocvec(answer).unwrap();
            assert_eq!(
                &postcard::from_bytes::<ChangedAnswer>(&bytes).unwrap(),
                answer
            );
        }
        let bytes = postcard::to_allocvec(&listed).unwrap();
        for cut in [0, 1, bytes.len() - 1] {
            assert!(
                postcard::from_bytes::<ChangedAnswer>(&bytes[..cut]).is_err(),
                "{cut}"
            );
        }
        let request = ChangedRequest {
            volume_id: 9,
            epoch: 4,
            catalog_index: 17,
        };
        let bytes = postcard::to_allocvec(&request).unwrap();
        assert_eq!(
            postcard::from_bytes::<ChangedRequest>(&bytes).unwrap(),
            request
        );
        assert!(postcard::from_bytes::<ChangedRequest>(&bytes[..1]).is_err());
    }

    // Proves a forwarded write round-trips and a truncated one is refused.
    #[test]
    fn forwarded_requests_round_trip_and_truncation_is_refused() {
        let request = ForwardRequest {
            session: 42,
            op: ForwardOp::Write {
                offset: 8192,
                data: &[9; 4096],
                fua: true,
            },
        };
        let bytes = postcard::to_allocvec(&request).unwrap();
        assert_eq!(
            postcard::from_bytes::<ForwardRequest>(&bytes).unwrap(),
            request
        );
        for cut in [0, 1, bytes.len() / 2, bytes.len() - 1] {
            assert!(
                postcard::from_bytes::<ForwardRequest>(&bytes[..cut]).is_err(),
                "{cut}"
            );
        }
    }
}
