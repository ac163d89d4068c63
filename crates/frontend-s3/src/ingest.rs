//! Streaming an upload body into chunks: the body is read into a buffer of at most one chunk;
//! a full buffer is handed to blocking tasks that hash it (MD5 for the ETag and the requested S3
//! checksums, in order) and store it (BLAKE3 address, compression, write), while the next buffer
//! fills from the network. At most [`CHUNKS_IN_MEMORY`] chunks exist per upload, whatever the
//! object size.

use std::sync::Arc;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use keel_namespace::object::{
    Checksums, ChunkRef, Content, ObjectError, Objects, PinSet, CHUNK_SIZE_BYTES,
    INLINE_SIZE_MAX_BYTES,
};
use keel_store::Compression;
use md5::{Digest, Md5};
use s3s::checksum::ChecksumHasher;
use s3s::crypto::Checksum as _;
use s3s::{S3Error, S3ErrorCode, S3Result};

use crate::error::{join_error, s3_error};

/// Chunks of one upload held in memory at most: one filling from the network, one copy being
/// hashed, [`WRITES_IN_FLIGHT`] being stored.
pub const CHUNKS_IN_MEMORY: usize = 2 + WRITES_IN_FLIGHT;
/// Largest object a single PUT may carry, as in S3.
pub const PUT_SIZE_MAX_BYTES: u64 = 5 << 30;

/// Which checksums the client asked for, with the values it sent (if it sent them up front).
#[derive(Debug, Clone, Default)]
pub struct ChecksumRequest {
    pub algorithms: Vec<ChecksumKind>,
    /// Values from request headers (base64), keyed like `algorithms`.
    pub expected: Checksums,
    /// `Content-MD5` (base64), if sent.
    pub content_md5: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChecksumKind {
    Crc32,
    Crc32c,
    Crc64Nvme,
    Sha1,
    Sha256,
}

impl ChecksumKind {
    pub fn parse(name: &str) -> Option<ChecksumKind> {
        match name.to_ascii_uppercase().as_str() {
            "CRC32" => Some(ChecksumKind::Crc32),
            "CRC32C" => Some(ChecksumKind::Crc32c),
            "CRC64NVME" => Some(ChecksumKind::Crc64Nvme),
            "SHA1" => Some(ChecksumKind::Sha1),
            "SHA256" => Some(ChecksumKind::Sha256),
            _ => None,
        }
    }

    pub fn header(self) -> &'static str {
        match self {
            ChecksumKind::Crc32 => "x-amz-checksum-crc32",
            ChecksumKind::Crc32c => "x-amz-checksum-crc32c",
            ChecksumKind::Crc64Nvme => "x-amz-checksum-crc64nvme",
            ChecksumKind::Sha1 => "x-amz-checksum-sha1",
            ChecksumKind::Sha256 => "x-amz-checksum-sha256",
        }
    }

    fn slot(self, checksums: &mut Checksums) -> &mut Option<String> {
        match self {
            ChecksumKind::Crc32 => &mut checksums.crc32,
            ChecksumKind::Crc32c => &mut checksums.crc32c,
            ChecksumKind::Crc64Nvme => &mut checksums.crc64nvme,
            ChecksumKind::Sha1 => &mut checksums.sha1,
            ChecksumKind::Sha256 => &mut checksums.sha256,
        }
    }
}

/// The result of reading an upload body.
pub struct Ingested {
    pub content: Content,
    pub size_bytes: u64,
    pub md5_hex: String,
    /// Checksums computed for the requested algorithms (verified against what the client sent).
    pub checksums: Checksums,
    /// Keeps the written chunks pinned until the caller committed the manifest or part.
    pub pins: PinSet,
}

struct Hashing {
    md5: Md5,
    checksums: ChecksumHasher,
}

fn new_hasher(kinds: &[ChecksumKind]) -> ChecksumHasher {
    let mut hasher = ChecksumHasher::default();
    for kind in kinds {
        match kind {
            ChecksumKind::Crc32 => hasher.crc32 = Some(s3s::crypto::Crc32::new()),
            ChecksumKind::Crc32c => hasher.crc32c = Some(s3s::crypto::Crc32c::new()),
            ChecksumKind::Crc64Nvme => hasher.crc64nvme = Some(s3s::crypto::Crc64Nvme::new()),
            ChecksumKind::Sha1 => hasher.sha1 = Some(s3s::crypto::Sha1::new()),
            ChecksumKind::Sha256 => hasher.sha256 = Some(s3s::crypto::Sha256::new()),
        }
    }
    hasher
}

type HashTask = tokio::task::JoinHandle<Hashing>;
type WriteTask = tokio::task::JoinHandle<Result<(PinSet, ChunkRef), ObjectError>>;

/// Reads `body` to its end into chunks of `objects` (or inline when small and `allow_inline`).
/// `size_max_bytes` bounds the body; `trailing` yields checksum values sent as trailers.
///
/// Two lanes run beside the network read: the hashing lane (MD5 and S3 checksums must see the
/// bytes in order: one task at a time) and the writing lane (BLAKE3 address, compression and
/// store write: up to [`WRITES_IN_FLIGHT`] chunks at once), so a large PUT uses both cores.
pub async fn ingest<S, E>(
    objects: Arc<Objects>,
    compression: Compression,
    mut body: S,
    request: &ChecksumRequest,
    allow_inline: bool,
    size_max_bytes: u64,
    trailing: impl FnOnce() -> Checksums,
) -> S3Result<Ingested>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let mut lanes = Lanes {
        objects: objects.clone(),
        compression,
        hashing: Some(Hashing {
            md5: Md5::new(),
            checksums: new_hasher(&request.algorithms),
        }),
        hash_task: None,
        writes: std::collections::VecDeque::new(),
        pins: objects.pin_set(),
        chunks: Vec::new(),
    };
    let mut buffer: Vec<u8> = Vec::with_capacity(INLINE_SIZE_MAX_BYTES);
    let mut size_bytes = 0u64;

    while let Some(piece) = body.next().await {
        let piece = piece.map_err(|e| {
            S3Error::with_message(
                S3ErrorCode::IncompleteBody,
                format!("reading the request body failed: {e}"),
            )
        })?;
        size_bytes += piece.len() as u64;
        if size_bytes > size_max_bytes {
            return Err(S3Error::with_message(
                S3ErrorCode::EntityTooLarge,
                format!("the body is larger than {size_max_bytes} bytes"),
            ));
        }
        let mut rest: &[u8] = &piece;
        while !rest.is_empty() {
            if buffer.capacity() < CHUNK_SIZE_BYTES && buffer.len() + rest.len() > buffer.capacity()
            {
                buffer.reserve_exact(CHUNK_SIZE_BYTES - buffer.len());
            }
            let take = rest.len().min(CHUNK_SIZE_BYTES - buffer.len());
            buffer.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if buffer.len() == CHUNK_SIZE_BYTES {
                let full = std::mem::replace(&mut buffer, Vec::with_capacity(CHUNK_SIZE_BYTES));
                lanes.push(full).await?;
            }
        }
    }
    let content = if lanes.chunks.is_empty()
        && lanes.writes.is_empty()
        && lanes.hash_task.is_none()
        && allow_inline
        && buffer.len() <= INLINE_SIZE_MAX_BYTES
    {
        let hashing = lanes.hashing.as_mut().ok_or_else(lost_state)?;
        hashing.md5.update(&buffer);
        hashing.checksums.update(&buffer);
        Content::Inline(buffer)
    } else {
        if !buffer.is_empty() {
            lanes.push(buffer).await?;
        }
        lanes.drain().await?;
        Content::Chunks(std::mem::take(&mut lanes.chunks))
    };
    let Lanes { hashing, pins, .. } = lanes;
    let hashing = hashing.ok_or_else(lost_state)?;
    let md5 = hashing.md5.finalize();
    let computed = hashing.checksums.finalize();
    let checksums = Checksums {
        crc32: computed.checksum_crc32,
        crc32c: computed.checksum_crc32c,
        crc64nvme: computed.checksum_crc64nvme,
        sha1: computed.checksum_sha1,
        sha256: computed.checksum_sha256,
    };
    if let Some(expected) = &request.content_md5 {
        let actual = base64_encode(&md5);
        if expected.trim() != actual {
            return Err(S3Error::with_message(
                S3ErrorCode::BadDigest,
                "the Content-MD5 you specified did not match what was received",
            ));
        }
    }
    let trailers = trailing();
    for kind in &request.algorithms {
        let mut computed_all = checksums.clone();
        let actual = kind.slot(&mut computed_all).clone();
        let mut sent_headers = request.expected.clone();
        let mut sent_trailers = trailers.clone();
        let sent = kind
            .slot(&mut sent_headers)
            .clone()
            .or_else(|| kind.slot(&mut sent_trailers).clone());
        if let (Some(sent), Some(actual)) = (sent, actual) {
            if sent.trim() != actual {
                return Err(S3Error::with_message(
                    S3ErrorCode::BadDigest,
                    format!(
                        "the {} you specified did not match the calculated checksum",
                        kind.header()
                    ),
                ));
            }
        }
    }
    Ok(Ingested {
        content,
        size_bytes,
        md5_hex: hex::encode(md5),
        checksums,
        pins,
    })
}

fn lost_state() -> S3Error {
    S3Error::with_message(S3ErrorCode::InternalError, "upload pipeline lost its state")
}

/// Chunks written concurrently by one upload.
pub const WRITES_IN_FLIGHT: usize = 2;

struct Lanes {
    objects: Arc<Objects>,
    compression: Compression,
    /// The hashers when no hashing task holds them.
    hashing: Option<Hashing>,
    hash_task: Option<HashTask>,
    writes: std::collections::VecDeque<WriteTask>,
    pins: PinSet,
    chunks: Vec<ChunkRef>,
}

impl Lanes {
    async fn finish_hashing(&mut self) -> S3Result<()> {
        if let Some(task) = self.hash_task.take() {
            self.hashing = Some(task.await.map_err(join_error)?);
        }
        Ok(())
    }

    async fn finish_oldest_write(&mut self) -> S3Result<()> {
        if let Some(task) = self.writes.pop_front() {
            let (pins, chunk) = task.await.map_err(join_error)?.map_err(s3_error)?;
            self.pins.absorb(pins);
            self.chunks.push(chunk);
        }
        Ok(())
    }

    /// Hands one chunk to both lanes, waiting first so that at most one hashing task and
    /// [`WRITES_IN_FLIGHT`] writes exist.
    async fn push(&mut self, data: Vec<u8>) -> S3Result<()> {
        self.finish_hashing().await?;
        while self.writes.len() >= WRITES_IN_FLIGHT {
            self.finish_oldest_write().await?;
        }
        let mut hashing = self.hashing.take().ok_or_else(lost_state)?;
        let copy = data.clone();
        self.hash_task = Some(tokio::task::spawn_blocking(move || {
            hashing.md5.update(&copy);
            hashing.checksums.update(&copy);
            hashing
        }));
        let objects = self.objects.clone();
        let compression = self.compression;
        self.writes.push_back(tokio::task::spawn_blocking(move || {
            let mut pins = objects.pin_set();
            let chunk = objects.write_chunk(compression, data, &mut pins)?;
            Ok((pins, chunk))
        }));
        Ok(())
    }

    async fn drain(&mut self) -> S3Result<()> {
        crate::unread::mark_phase(keel_ops::phase::WRITING);
        self.finish_hashing().await?;
        while !self.writes.is_empty() {
            self.finish_oldest_write().await?;
        }
        Ok(())
    }
}

pub(crate) fn base64_encode(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}
