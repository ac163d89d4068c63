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
//! `keel ops` until its answer's head is ready (a GET's body streams after that), and applies
//! the bucket's CORS rules ([`crate::cors`]).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::future::BoxFuture;
use http::header::{HeaderValue, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, ORIGIN};
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
        };
        let form_uploads = form_upload.then(|| self.form_uploads.clone());
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
            let mut response = CURRENT_OP.scope(op.handle(), service.call(request)).await?;
            op.phase(keel_ops::phase::REPLYING);
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
