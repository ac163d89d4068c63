//! `/metrics`: the node's state in the Prometheus/OpenMetrics text format. A registry is built per
//! scrape from one status snapshot, so several nodes can live in one test process and every value
//! in one scrape comes from the same moment.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

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

pub fn render(report: &StatusReport) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::with_prefix("keel");
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
    let mut out = String::new();
    encode(&mut out, &registry)?;
    Ok(out)
}
