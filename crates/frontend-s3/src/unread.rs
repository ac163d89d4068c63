//! Keeps kept-alive connections in step when an answer is sent before the request body was
//! read. S3 refuses many requests from their headers alone (a missing upload, a bad signature,
//! a failed condition); the client may still be sending the body (or, having sent
//! `Expect: 100-continue`, may send it after all). If the connection were then reused, the
//! unread body bytes would be parsed as the start of the next request — a request whose method
//! or path no longer matches what the client signed, answered with a spurious
//! `SignatureDoesNotMatch`. So an answer given before its request's body ended closes the
//! connection (`Connection: close`), as HTTP/1.1 allows.
//!
//! The same layer measures each request for `/metrics` ([`crate::metrics`]), registers it for
//! `keel ops` until its answer's head is ready (a GET's body streams after that), applies the
//! bucket's CORS rules ([`crate::cors`]), and gives a PUT sent with `Transfer-Encoding:
//! chunked` and no `Content-Length` a length by spooling its body to an unnamed file in the
//! data directory first ([`spool`]): s3s refuses such a PUT (411), AWS accepts it.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::future::BoxFuture;
use http::header::{
    HeaderValue, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, ORIGIN, TRANSFER_ENCODING,
};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use s3s::service::S3Service;
use s3s::{HttpError, HttpResponse};

use crate::metrics::S3Metrics;

tokio::task_local! {
    /// The request the current task answers.
    static CURRENT_OP: keel_ops::OpHandle;
}

/// The request the current task answers, to carry into blocking work.
pub(crate) fn current_op() -> Option<keel_ops::OpHandle> {
    CURRENT_OP.try_with(Clone::clone).ok()
}

/// Moves the request the current task answers to `phase`.
pub(crate) fn mark_phase(phase: &'static str) {
    let _ = CURRENT_OP.try_with(|op| op.phase(phase));
}

/// The S3 service, with connections closed after answers that left a body unread.
#[derive(Clone)]
pub struct CloseOnUnreadBody {
    pub service: S3Service,
    pub metrics: S3Metrics,
    pub ops: keel_ops::Ops,
    /// For the buckets' CORS rules.
    pub objects: Arc<keel_namespace::object::Objects>,
    /// Browser-form uploads read at once ([`crate::POST_UPLOADS_MAX`]: s3s holds each file in
    /// memory).
    pub form_uploads: Arc<tokio::sync::Semaphore>,
    /// The connection's client (set per connection).
    pub peer: Option<std::net::SocketAddr>,
    /// Where bodies of unknown length are spooled (a directory of the store's disk; without
    /// one, s3s answers such a PUT 411).
    pub spool_dir: Option<Arc<std::path::PathBuf>>,
}

/// Largest body spooled: the largest PUT or part S3 allows.
const SPOOL_MAX_BYTES: u64 = 5 << 30;

/// A PUT whose body has no length (chunked transfer, no `Content-Length`) and is not
/// aws-chunked (which states its decoded length in `x-amz-decoded-content-length`).
fn needs_spool(parts: &http::request::Parts) -> bool {
    let chunked = parts
        .headers
        .get(TRANSFER_ENCODING)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.to_ascii_lowercase().contains("chunked"));
    let streaming = parts
        .headers
        .get("x-amz-content-sha256")
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("STREAMING-"));
    parts.method == http::Method::PUT
        && chunked
        && !parts.headers.contains_key(CONTENT_LENGTH)
        && !streaming
}

/// Reads the body of `request` into an unnamed file in `dir` (gone when closed, a crash
/// included) and answers a request whose body is that file with its exact length: as if the
/// client had sent `Content-Length`. Memory stays at one frame; a body over
/// [`SPOOL_MAX_BYTES`] is refused (400 `EntityTooLarge`), a failing disk is a 500.
async fn spool(
    request: http::Request<s3s::Body>,
    dir: &std::path::Path,
) -> Result<http::Request<s3s::Body>, HttpResponse> {
    use futures::StreamExt;
    use tokio::io::{AsyncSeekExt, AsyncWriteExt};
    let (mut parts, mut body) = request.into_parts();
    let failed = |code: &str, status: http::StatusCode, message: String| {
        crate::cors::refusal(status, code, &message)
    };
    let internal = |error: std::io::Error| {
        tracing::error!(%error, "spooling a request body of unknown length failed");
        failed(
            "InternalError",
            http::StatusCode::INTERNAL_SERVER_ERROR,
            format!("spooling the body failed: {error}"),
        )
    };
    let file = tokio::task::spawn_blocking({
        let dir = dir.to_path_buf();
        move || {
            std::fs::create_dir_all(&dir)?;
            tempfile::tempfile_in(&dir)
        }
    })
    .await
    .map_err(|error| internal(std::io::Error::other(error)))?
    .map_err(internal)?;
    let mut file = tokio::fs::File::from_std(file);
    let mut length = 0u64;
    while let Some(piece) = body.next().await {
        let piece = piece.map_err(|error| {
            failed(
                "IncompleteBody",
                http::StatusCode::BAD_REQUEST,
                format!("the request body ended early: {error}"),
            )
        })?;
        length += piece.len() as u64;
        if length > SPOOL_MAX_BYTES {
            return Err(failed(
                "EntityTooLarge",
                http::StatusCode::BAD_REQUEST,
                "Your proposed upload exceeds the maximum allowed size".into(),
            ));
        }
        file.write_all(&piece).await.map_err(internal)?;
    }
    file.flush().await.map_err(internal)?;
    file.rewind().await.map_err(internal)?;
    parts.headers.remove(TRANSFER_ENCODING);
    parts
        .headers
        .insert(CONTENT_LENGTH, HeaderValue::from(length));
    let spooled = Spooled {
        file,
        remaining: length,
    };
    Ok(http::Request::from_parts(
        parts,
        s3s::Body::http_body(spooled),
    ))
}

/// A spooled body read back from its file, with its exact length.
struct Spooled {
    file: tokio::fs::File,
    remaining: u64,
}

/// Bytes read from a spool file at once.
const SPOOL_READ_BYTES: usize = 256 << 10;

impl Body for Spooled {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if self.remaining == 0 {
            return Poll::Ready(None);
        }
        let want = SPOOL_READ_BYTES.min(usize::try_from(self.remaining).unwrap_or(usize::MAX));
        let mut buffer = vec![0u8; want];
        let mut read = tokio::io::ReadBuf::new(&mut buffer);
        match tokio::io::AsyncRead::poll_read(Pin::new(&mut self.file), cx, &mut read) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(error)) => Poll::Ready(Some(Err(error))),
            Poll::Ready(Ok(())) => {
                let filled = read.filled().len();
                if filled == 0 {
                    return Poll::Ready(Some(Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the spooled body is shorter than written",
                    ))));
                }
                buffer.truncate(filled);
                self.remaining -= filled as u64;
                Poll::Ready(Some(Ok(Frame::data(Bytes::from(buffer)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

/// The method as a static name for `keel ops`.
fn method_name(method: &http::Method) -> &'static str {
    match *method {
        http::Method::GET => "GET",
        http::Method::PUT => "PUT",
        http::Method::POST => "POST",
        http::Method::DELETE => "DELETE",
        http::Method::HEAD => "HEAD",
        http::Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

impl hyper::service::Service<http::Request<Incoming>> for CloseOnUnreadBody {
    type Response = HttpResponse;
    type Error = HttpError;
    type Future = BoxFuture<'static, Result<HttpResponse, HttpError>>;

    fn call(&self, request: http::Request<Incoming>) -> Self::Future {
        let (parts, body) = request.into_parts();
        let measured = self.metrics.start(parts.uri.path(), parts.method.as_str());
        let op = self.ops.start(keel_ops::Start {
            frontend: "s3",
            operation: method_name(&parts.method),
            target: keel_ops::Target::Path(parts.uri.path().trim_start_matches('/').to_string()),
            client: self.peer,
        });
        if let Some(answer) = crate::cors::preflight(
            &self.objects,
            &parts.method,
            parts.uri.path(),
            &parts.headers,
        ) {
            measured.finish(&self.metrics, answer.status().as_u16(), 0, Some(0));
            return Box::pin(async move { Ok(answer) });
        }
        let origin = parts
            .headers
            .get(ORIGIN)
            .and_then(|origin| origin.to_str().ok())
            .map(str::to_string);
        let cors = origin.map(|origin| {
            (
                self.objects.clone(),
                parts.method.clone(),
                parts.uri.path().to_string(),
                origin,
            )
        });
        let form_upload = parts.method == http::Method::POST
            && parts
                .headers
                .get(CONTENT_TYPE)
                .and_then(|kind| kind.to_str().ok())
                .is_some_and(|kind| kind.starts_with("multipart/form-data"));
        let (mut parts, body) = (parts, body);
        let file_name = form_upload.then(|| {
            let found = FormFileName::default();
            parts.extensions.insert(found.clone());
            FileNameScan::new(found)
        });
        let ended = Arc::new(AtomicBool::new(body.is_end_stream()));
        let read_bytes = Arc::new(AtomicU64::new(0));
        let tracked = Tracked {
            inner: body,
            ended: ended.clone(),
            read_bytes: read_bytes.clone(),
            // s3s's form parser refuses a piece of body over 64 KiB at once (it looks for the
            // boundary in a 64 KiB buffer), and a body that waited for its turn arrives in
            // larger pieces.
            piece_max: form_upload.then_some(FORM_PIECE_MAX_BYTES),
            held: None,
            file_name,
        };
        let form_uploads = form_upload.then(|| self.form_uploads.clone());
        let spool_in = self.spool_dir.clone().filter(|_| needs_spool(&parts));
        let request = http::Request::from_parts(parts, s3s::Body::http_body(tracked));
        let service = self.service.clone();
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let _form_upload = match form_uploads {
                Some(permits) => Some(permits.acquire_owned().await.map_err(|_| {
                    HttpError::new(Box::new(std::io::Error::other("shutting down")))
                })?),
                None => None,
            };
            let request = match spool_in {
                Some(dir) => match spool(request, &dir).await {
                    Ok(request) => request,
                    Err(answer) => {
                        measured.finish(&metrics, answer.status().as_u16(), 0, Some(0));
                        let mut answer = answer;
                        answer
                            .headers_mut()
                            .insert(CONNECTION, HeaderValue::from_static("close"));
                        return Ok(answer);
                    }
                },
                None => request,
            };
            let mut response = CURRENT_OP.scope(op.handle(), service.call(request)).await?;
            op.phase(keel_ops::phase::REPLYING);
            if form_upload && response.status() == http::StatusCode::BAD_REQUEST {
                answer_failed_conditions_as_aws(&mut response).await;
            }
            if let Some((objects, method, path, origin)) = cors {
                crate::cors::decorate(&objects, &method, &path, &origin, &mut response);
            }
            let body_out = response
                .headers()
                .get(CONTENT_LENGTH)
                .and_then(|length| length.to_str().ok()?.parse().ok());
            measured.finish(
                &metrics,
                response.status().as_u16(),
                read_bytes.load(Ordering::Relaxed),
                body_out,
            );
            if !ended.load(Ordering::Acquire) {
                response
                    .headers_mut()
                    .insert(CONNECTION, HeaderValue::from_static("close"));
            }
            drop(op);
            Ok(response)
        })
    }
}

/// A browser form whose fields fail its policy's conditions: s3s answers 400
/// `InvalidPolicyDocument`, AWS 403 `AccessDenied` ("Invalid according to Policy"), and browser
/// code tells the two apart. Rewrites the first into the second; any other answer stays.
async fn answer_failed_conditions_as_aws(response: &mut HttpResponse) {
    const ERROR_BODY_MAX_BYTES: usize = 64 << 10;
    let Ok(bytes) = response
        .body_mut()
        .store_all_limited(ERROR_BODY_MAX_BYTES)
        .await
    else {
        // Unreadable: answer it as it was (the body is gone; the status says enough).
        return;
    };
    let text = String::from_utf8_lossy(&bytes);
    let failed =
        text.contains("<Code>InvalidPolicyDocument</Code>") && text.contains("Policy condition");
    if !failed {
        *response.body_mut() = s3s::Body::from(bytes);
        return;
    }
    let rewritten = text
        .replace(
            "<Code>InvalidPolicyDocument</Code>",
            "<Code>AccessDenied</Code>",
        )
        .replace(
            "<Message>Policy condition",
            "<Message>Invalid according to Policy: Policy condition",
        );
    *response.status_mut() = http::StatusCode::FORBIDDEN;
    response
        .headers_mut()
        .insert(CONTENT_LENGTH, HeaderValue::from(rewritten.len() as u64));
    *response.body_mut() = s3s::Body::from(Bytes::from(rewritten));
}

/// The largest piece of a browser-form body handed to s3s at once.
const FORM_PIECE_MAX_BYTES: usize = 32 << 10;

/// A request body that records how much of it was read, and when it was read to its end; with
/// `piece_max`, it hands its data on in pieces of at most that size.
struct Tracked {
    inner: Incoming,
    ended: Arc<AtomicBool>,
    read_bytes: Arc<AtomicU64>,
    piece_max: Option<usize>,
    /// What is left of a frame cut into pieces.
    held: Option<Bytes>,
    /// For a browser form: looks for the file's name as the body goes by.
    file_name: Option<FileNameScan>,
}

/// The name of the file a browser form uploads (its part's `filename`), for `${filename}` in
/// the form's key: s3s parses the form but does not hand the name on. Set once the body has
/// been read past the file part's header, which s3s does before it calls the operation.
#[derive(Clone, Default)]
pub(crate) struct FormFileName(Arc<std::sync::OnceLock<String>>);

impl FormFileName {
    pub(crate) fn get(&self) -> Option<&str> {
        self.0.get().map(String::as_str)
    }
}

/// Finds `name="file"; filename="..."` (the header s3s's form parser accepts) in a body read
/// piece by piece, keeping a short tail so a header cut between pieces is still found; gives
/// up after the form's first [`FILE_NAME_SCAN_MAX_BYTES`] (the fields before the file are
/// small).
struct FileNameScan {
    found: FormFileName,
    tail: Vec<u8>,
    scanned_bytes: usize,
}

const FILE_PART_HEADER: &[u8] = b"name=\"file\"; filename=\"";
/// Longest file name kept.
const FILE_NAME_MAX_BYTES: usize = 1024;
const FILE_NAME_SCAN_MAX_BYTES: usize = 1 << 20;

impl FileNameScan {
    fn new(found: FormFileName) -> FileNameScan {
        FileNameScan {
            found,
            tail: Vec::new(),
            scanned_bytes: 0,
        }
    }

    fn feed(&mut self, data: &[u8]) {
        if self.found.0.get().is_some() || self.scanned_bytes > FILE_NAME_SCAN_MAX_BYTES {
            return;
        }
        self.scanned_bytes += data.len();
        self.tail.extend_from_slice(data);
        let Some(start) = self
            .tail
            .windows(FILE_PART_HEADER.len())
            .position(|window| window == FILE_PART_HEADER)
        else {
            // Keep what could be the start of a header cut in two.
            let keep = self.tail.len().min(FILE_PART_HEADER.len());
            self.tail.drain(..self.tail.len() - keep);
            return;
        };
        let name_start = start + FILE_PART_HEADER.len();
        match self.tail[name_start..].iter().position(|&b| b == b'"') {
            Some(length) => {
                let name = String::from_utf8_lossy(&self.tail[name_start..name_start + length]);
                let _ = self.found.0.set(name.into_owned());
                self.tail = Vec::new();
            }
            None if self.tail.len() - name_start > FILE_NAME_MAX_BYTES => {
                self.scanned_bytes = usize::MAX;
                self.tail = Vec::new();
            }
            None => {
                self.tail.drain(..start);
            }
        }
    }
}

impl Tracked {
    /// The next piece of `data` (at most `piece_max`), holding the rest back.
    fn piece(&mut self, mut data: Bytes) -> Bytes {
        match self.piece_max {
            Some(max) if data.len() > max => {
                self.held = Some(data.split_off(max));
                data
            }
            _ => data,
        }
    }
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(held) = self.held.take() {
            let piece = self.piece(held);
            return Poll::Ready(Some(Ok(Frame::data(piece))));
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                self.read_bytes
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                let data = data.clone();
                if let Some(scan) = self.file_name.as_mut() {
                    scan.feed(&data);
                }
            }
        }
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.ended.store(true, Ordering::Release);
        }
        match polled {
            Poll::Ready(Some(Ok(frame))) if self.piece_max.is_some() => match frame.into_data() {
                Ok(data) => {
                    let piece = self.piece(data);
                    Poll::Ready(Some(Ok(Frame::data(piece))))
                }
                Err(frame) => Poll::Ready(Some(Ok(frame))),
            },
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(pieces: &[&[u8]]) -> Option<String> {
        let found = FormFileName::default();
        let mut scan = FileNameScan::new(found.clone());
        for piece in pieces {
            scan.feed(piece);
        }
        found.get().map(str::to_string)
    }

    // Proves the file's name is found whole wherever the body is cut, including inside the
    // header or the name, and that a form without a named file part yields none.
    #[test]
    fn the_file_name_is_found_across_pieces() {
        let body: &[u8] = b"--b\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nuploads/${filename}\r\n--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a b.txt\"\r\nContent-Type: text/plain\r\n\r\nbytes\r\n--b--\r\n";
        for cut in 0..body.len() {
            let (first, second) = body.split_at(cut);
            assert_eq!(
                scan(&[first, second]).as_deref(),
                Some("a b.txt"),
                "cut at {cut}"
            );
        }
        let bytewise: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(scan(&bytewise).as_deref(), Some("a b.txt"));
        assert_eq!(
            scan(&[b"--b\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nk\r\n--b--"]),
            None
        );
    }
}
