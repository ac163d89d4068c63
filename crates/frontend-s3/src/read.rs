//! Reading objects: conditional requests, byte ranges, and a body stream that reads chunks in
//! blocking tasks with at most [`READ_AHEAD_CHUNKS`] chunks requested ahead of the client.

use std::collections::VecDeque;
use std::future::Future as _;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::Stream;
use keel_namespace::object::{ChunkRef, Content, Manifest, ObjectError, Objects, PinSet};

/// Chunks read ahead of what the client consumed (bounds a GET's memory to this many chunks).
pub const READ_AHEAD_CHUNKS: usize = 4;

/// Outcome of evaluating conditional headers against an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precondition {
    Proceed,
    /// 304 (If-None-Match matched or not modified since).
    NotModified,
    /// 412 (If-Match did not match or modified since).
    Failed,
}

/// The conditional headers of a GET or HEAD (or the `x-amz-copy-source-if-*` of a copy).
#[derive(Debug, Clone, Default)]
pub struct Conditions {
    /// `None`: header absent; `Some(None)`: `*`; `Some(Some(etag))`.
    pub if_match: Option<Option<String>>,
    pub if_none_match: Option<Option<String>>,
    pub if_modified_since_unix_s: Option<i64>,
    pub if_unmodified_since_unix_s: Option<i64>,
}

/// RFC 7232 section 6 order: If-Match, If-Unmodified-Since, If-None-Match, If-Modified-Since.
/// `etag` is unquoted; times compare at whole seconds, as HTTP dates carry.
pub fn evaluate(conditions: &Conditions, etag: &str, modified_unix_ms: i64) -> Precondition {
    let modified_s = modified_unix_ms.div_euclid(1000);
    let matches = |wanted: &Option<String>| match wanted {
        None => true,
        Some(value) => value.trim_matches('"') == etag,
    };
    if let Some(wanted) = &conditions.if_match {
        if !matches(wanted) {
            return Precondition::Failed;
        }
    } else if let Some(since) = conditions.if_unmodified_since_unix_s {
        if modified_s > since {
            return Precondition::Failed;
        }
    }
    if let Some(wanted) = &conditions.if_none_match {
        if matches(wanted) {
            return Precondition::NotModified;
        }
    } else if let Some(since) = conditions.if_modified_since_unix_s {
        if modified_s <= since {
            return Precondition::NotModified;
        }
    }
    Precondition::Proceed
}

/// Parses `bytes=first-last` (the `x-amz-copy-source-range` form: both ends required).
pub fn parse_copy_range(value: &str) -> Option<(u64, u64)> {
    let rest = value.trim().strip_prefix("bytes=")?;
    let (first, last) = rest.split_once('-')?;
    let first: u64 = first.parse().ok()?;
    let last: u64 = last.parse().ok()?;
    (first <= last).then_some((first, last))
}

/// A chunk being read by a blocking task.
type ChunkRead = tokio::task::JoinHandle<Result<Vec<u8>, ObjectError>>;

/// A body stream over `[start, end)` of an object.
pub struct ObjectBody {
    objects: Arc<Objects>,
    chunks: Arc<Vec<ChunkRef>>,
    /// Offset of each chunk in the object.
    offsets: Arc<Vec<u64>>,
    next_chunk: usize,
    start: u64,
    end: u64,
    in_flight: VecDeque<(usize, ChunkRead)>,
    inline: Option<Bytes>,
    /// The object's chunks, pinned until the body is dropped: an overwrite or delete during a
    /// long read cannot free them under it.
    _pins: PinSet,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BodyError(String);

impl ObjectBody {
    /// The bytes `[start, end)` of `manifest` (the caller checked the range against the size).
    pub fn new(
        objects: Arc<Objects>,
        manifest: &Manifest,
        pins: PinSet,
        start: u64,
        end: u64,
    ) -> ObjectBody {
        match &manifest.content {
            Content::Inline(data) => {
                let slice = data
                    .get(start as usize..end as usize)
                    .map(Bytes::copy_from_slice)
                    .unwrap_or_default();
                ObjectBody {
                    objects,
                    chunks: Arc::new(Vec::new()),
                    offsets: Arc::new(Vec::new()),
                    next_chunk: 0,
                    start,
                    end,
                    in_flight: VecDeque::new(),
                    inline: Some(slice),
                    _pins: pins,
                }
            }
            Content::Chunks(chunks) => {
                let mut offsets = Vec::with_capacity(chunks.len());
                let mut offset = 0u64;
                for chunk in chunks {
                    offsets.push(offset);
                    offset += u64::from(chunk.length_bytes);
                }
                // First chunk that ends after `start`.
                let first = offsets.partition_point(|&o| o <= start).saturating_sub(1);
                ObjectBody {
                    objects,
                    chunks: Arc::new(chunks.clone()),
                    offsets: Arc::new(offsets),
                    next_chunk: first,
                    start,
                    end,
                    in_flight: VecDeque::new(),
                    inline: None,
                    _pins: pins,
                }
            }
        }
    }

    fn refill(&mut self) {
        while self.in_flight.len() < READ_AHEAD_CHUNKS
            && self.next_chunk < self.chunks.len()
            && self.offsets[self.next_chunk] < self.end
        {
            let index = self.next_chunk;
            let objects = self.objects.clone();
            let chunks = self.chunks.clone();
            let task = tokio::task::spawn_blocking(move || objects.read_chunk(&chunks[index]));
            self.in_flight.push_back((index, task));
            self.next_chunk += 1;
        }
    }
}

impl Stream for ObjectBody {
    type Item = Result<Bytes, BodyError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(inline) = this.inline.take() {
            if inline.is_empty() {
                return Poll::Ready(None);
            }
            return Poll::Ready(Some(Ok(inline)));
        }
        if this.start >= this.end {
            return Poll::Ready(None);
        }
        this.refill();
        let Some((index, task)) = this.in_flight.front_mut() else {
            return Poll::Ready(None);
        };
        let index = *index;
        let result = match Pin::new(task).poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(result) => result,
        };
        this.in_flight.pop_front();
        let data = match result {
            Ok(Ok(data)) => data,
            Ok(Err(error)) => {
                tracing::error!(%error, "reading an object chunk failed; aborting the response");
                this.start = this.end;
                return Poll::Ready(Some(Err(BodyError(error.to_string()))));
            }
            Err(error) => {
                this.start = this.end;
                return Poll::Ready(Some(Err(BodyError(error.to_string()))));
            }
        };
        let chunk_start = this.offsets[index];
        let from = this.start.saturating_sub(chunk_start) as usize;
        let to = ((this.end - chunk_start) as usize).min(data.len());
        this.start = chunk_start + to as u64;
        this.refill();
        let piece = if from == 0 && to == data.len() {
            Bytes::from(data)
        } else {
            Bytes::copy_from_slice(&data[from.min(to)..to])
        };
        Poll::Ready(Some(Ok(piece)))
    }
}
