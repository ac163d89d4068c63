//! `/metrics`: the node's state in the Prometheus/OpenMetrics text format. A registry is built per
//! scrape from one status snapshot, so several nodes can live in one test process and every value
//! in one scrape comes from the same moment.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use crate::admin::StatusReport;

fn gauge_u64(registry: &mut Registry, name: &str, help: &str, value: u64) {
    let gauge = Gauge::<u64, AtomicU64>::default();
    gauge.set(value);
    registry.register(name, help, gauge);
}

/// A count since the server started, exposed as a counter (`NAME_total`), so `rate()` works.
fn counter_u64(registry: &mut Registry, name: &str, help: &str, value: u64) {
    let counter = Counter::<u64, AtomicU64>::default();
    counter.inc_by(value);
    registry.register(name, help, counter);
}

fn gauge_f64(registry: &mut Registry, name: &str, help: &str, value: f64) {
    let gauge = Gauge::<f64, AtomicU64>::default();
    gauge.set(value);
    registry.register(name, help, gauge);
}

type OpLabels = [(&'static str, &'static str); 1];

/// Latency of NBD requests as the server saw them (from the request read to its reply ready),
/// one histogram per command: `keel_nbd_request_seconds{op="read|write|flush|trim|zeroes"}`.
/// Kept for the server's life; each scrape registers a handle on the same histograms.
#[derive(Clone)]
pub struct NbdLatency {
    family: Family<OpLabels, Histogram, fn() -> Histogram>,
    pub read: Histogram,
    pub write: Histogram,
    pub flush: Histogram,
    pub trim: Histogram,
    pub zeroes: Histogram,
}

fn request_histogram() -> Histogram {
    // 50 us to about 1.6 s.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

impl NbdLatency {
    pub fn new() -> NbdLatency {
        let family: Family<OpLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(request_histogram);
        let op = |name: &'static str| family.get_or_create(&[("op", name)]).clone();
        NbdLatency {
            read: op("read"),
            write: op("write"),
            flush: op("flush"),
            trim: op("trim"),
            zeroes: op("zeroes"),
            family,
        }
    }
}

/// Runs `request`, recording how long it took in `histogram` (whatever its outcome).
pub fn timed<T>(histogram: &Histogram, request: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let outcome = request();
    histogram.observe(started.elapsed().as_secs_f64());
    outcome
}

pub fn render(report: &StatusReport, nbd: &NbdLatency) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::with_prefix("keel");
    registry.register(
        "nbd_request_seconds",
        "NBD request latency in the server, by command",
        nbd.family.clone(),
    );
    let store = &report.store;
    let health = match report.health.as_str() {
        "HEALTH_OK" => 0,
        "HEALTH_WARN" => 1,
        _ => 2,
    };
    gauge_u64(
        &mut registry,
        "health",
        "0 = HEALTH_OK, 1 = HEALTH_WARN, 2 = HEALTH_ERR",
        health,
    );
    gauge_u64(
        &mut registry,
        "uptime_seconds",
        "Seconds since the server started",
        report.uptime_seconds,
    );
    gauge_u64(
        &mut registry,
        "store_live_extents",
        "Extents the index points to",
        store.live_extents,
    );
    gauge_u64(
        &mut registry,
        "store_live_raw_bytes",
        "Bytes of live values before compression",
        store.live_raw_bytes,
    );
    gauge_u64(
        &mut registry,
        "store_live_stored_bytes",
        "Bytes of live values as stored",
        store.live_stored_bytes,
    );
    gauge_f64(
        &mut registry,
        "store_compression_ratio",
        "Live raw bytes over stored bytes",
        store.compression_ratio,
    );
    gauge_u64(
        &mut registry,
        "store_log_bytes",
        "Bytes of segment files on one device",
        store.log_bytes,
    );
    gauge_u64(
        &mut registry,
        "store_segments",
        "Segment files",
        store.segments,
    );
    gauge_u64(
        &mut registry,
        "store_last_seq",
        "Sequence number of the last write",
        store.last_seq,
    );
    counter_u64(
        &mut registry,
        "store_log_syncs",
        "Group-commit fdatasyncs since start",
        store.log_syncs,
    );
    counter_u64(
        &mut registry,
        "store_corrupt_reads",
        "Checksum failures seen on read since start",
        store.corrupt_reads,
    );
    counter_u64(
        &mut registry,
        "store_repaired_extents",
        "Extent copies repaired from a mirror since start",
        store.repaired_extents,
    );
    gauge_u64(
        &mut registry,
        "store_poisoned",
        "1 when a failed sync stopped writes",
        store.poisoned as u64,
    );
    gauge_u64(
        &mut registry,
        "store_available_bytes",
        "Free bytes on the fullest data directory",
        store.available_bytes,
    );
    gauge_u64(
        &mut registry,
        "volumes",
        "Block volumes",
        report.volumes as u64,
    );
    gauge_u64(
        &mut registry,
        "buckets",
        "S3 buckets",
        report.buckets as u64,
    );
    if let Some(run) = &report.scrub.last {
        gauge_u64(
            &mut registry,
            "scrub_last_finished_timestamp_seconds",
            "When the last scheduled scrub finished (Unix time)",
            u64::try_from(run.finished_unix_ms / 1000).unwrap_or(0),
        );
        gauge_u64(
            &mut registry,
            "scrub_last_repaired",
            "Extent copies and replica blocks the last scheduled scrub repaired",
            run.repaired_copies + run.volume_blocks_repaired,
        );
        gauge_u64(
            &mut registry,
            "scrub_last_unrecoverable_extents",
            "Extents the last scheduled scrub found with no good copy",
            run.unrecoverable_extents,
        );
    }
    let mut out = String::new();
    encode(&mut out, &registry)?;
    Ok(out)
}
