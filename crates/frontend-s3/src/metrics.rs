//! Per-bucket request metrics, taken around every request at the HTTP layer (Keel serves
//! path-style addressing only, so the bucket is the path's first segment):
//! - `keel_s3_request_seconds{bucket, method}`: from the request's arrival until the answer's
//!   head is ready (a GET's body streams after it);
//! - `keel_s3_bytes_total{bucket, direction="in|out"}`: request body bytes read, response body
//!   bytes announced (`Content-Length`);
//! - `keel_s3_responses_total{bucket, status="2xx|3xx|4xx|5xx"}`.
//!
//! The first [`BUCKET_SERIES_MAX`] buckets to see requests get series of their own; later ones
//! share `bucket="_other"`, and requests naming no bucket (ListBuckets) count as `_none`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Buckets with series of their own.
pub const BUCKET_SERIES_MAX: usize = 64;
const OTHER_BUCKETS: &str = "_other";
const NO_BUCKET: &str = "_none";

type Labels = [(&'static str, String); 2];

#[derive(Clone)]
pub struct S3Metrics {
    latency: Family<Labels, Histogram, fn() -> Histogram>,
    bytes: Family<Labels, Counter>,
    responses: Family<Labels, Counter>,
    named: Arc<Mutex<HashSet<String>>>,
}

impl Default for S3Metrics {
    fn default() -> S3Metrics {
        S3Metrics {
            latency: Family::new_with_constructor(request_histogram),
            bytes: Family::default(),
            responses: Family::default(),
            named: Arc::default(),
        }
    }
}

fn request_histogram() -> Histogram {
    // 50 us to about 1.6 s.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

/// One request being measured: [`S3Metrics::start`], then [`Request::finish`].
pub(crate) struct Request {
    bucket: String,
    method: String,
    started: Instant,
}

impl S3Metrics {
    /// Adds the families to a registry (prefixed by it, e.g. `keel_`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "s3_request_seconds",
            "S3 request latency until the answer's head, by bucket and method",
            self.latency.clone(),
        );
        registry.register(
            "s3_bytes",
            "S3 body bytes in and out, by bucket",
            self.bytes.clone(),
        );
        registry.register(
            "s3_responses",
            "S3 answers by bucket and status class",
            self.responses.clone(),
        );
    }

    pub(crate) fn start(&self, path: &str, method: &str) -> Request {
        let bucket = path.trim_start_matches('/').split('/').next().unwrap_or("");
        let bucket = if bucket.is_empty() {
            NO_BUCKET.to_string()
        } else {
            let mut named = self.named.lock().unwrap_or_else(|p| p.into_inner());
            if named.contains(bucket) || named.len() < BUCKET_SERIES_MAX {
                named.insert(bucket.to_string());
                bucket.to_string()
            } else {
                OTHER_BUCKETS.to_string()
            }
        };
        Request {
            bucket,
            method: method.to_string(),
            started: Instant::now(),
        }
    }
}

impl Request {
    /// Records the answer: its status, the request body bytes read by then and the response
    /// body length it announced.
    pub(crate) fn finish(
        self,
        metrics: &S3Metrics,
        status: u16,
        body_in: u64,
        body_out: Option<u64>,
    ) {
        metrics
            .latency
            .get_or_create(&[("bucket", self.bucket.clone()), ("method", self.method)])
            .observe(self.started.elapsed().as_secs_f64());
        let class = format!("{}xx", status / 100);
        metrics
            .responses
            .get_or_create(&[("bucket", self.bucket.clone()), ("status", class)])
            .inc();
        if body_in > 0 {
            metrics
                .bytes
                .get_or_create(&[("bucket", self.bucket.clone()), ("direction", "in".into())])
                .inc_by(body_in);
        }
        if let Some(bytes) = body_out {
            metrics
                .bytes
                .get_or_create(&[("bucket", self.bucket), ("direction", "out".into())])
                .inc_by(bytes);
        }
    }
}
