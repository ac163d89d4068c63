//! `/metrics`: the node's state in the Prometheus/OpenMetrics text format. A registry is built per
//! scrape from one status snapshot, so several nodes can live in one test process and every value
//! in one scrape comes from the same moment.

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
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
type VolumeLabels = [(&'static str, String); 2];

/// Volumes with series of their own; requests to any further volume count under
/// `volume="_other"`, so a node with thousands of volumes keeps a bounded scrape.
pub const VOLUME_SERIES_MAX: usize = 64;
const OTHER_VOLUMES: &str = "_other";
const OPS: [&str; 5] = ["read", "write", "flush", "trim", "zeroes"];

/// NBD request metrics, kept for the server's life (each scrape registers handles on them):
/// - `keel_nbd_request_seconds{op}`: latency as the server saw it (from the request read to its
///   reply ready), per command, all volumes together;
/// - `keel_volume_request_seconds{volume, op}`: the same per volume (its `_count` is the
///   volume's requests, so `rate()` of it is its IOPS);
/// - `keel_volume_bytes_total{volume, direction="read|write"}`: bytes read and written.
#[derive(Clone)]
pub struct NbdMetrics {
    family: Family<OpLabels, Histogram, fn() -> Histogram>,
    volume_latency: Family<VolumeLabels, Histogram, fn() -> Histogram>,
    volume_bytes: Family<VolumeLabels, Counter>,
    /// Volumes given series of their own so far.
    named: Arc<Mutex<HashSet<String>>>,
}

/// The histograms one kind of request of one volume is recorded in: all volumes', its own.
#[derive(Clone)]
pub struct OpSeries {
    all: Histogram,
    volume: Histogram,
}

/// One volume's series, held by each of its NBD exports.
#[derive(Clone)]
pub struct VolumeSeries {
    pub read: OpSeries,
    pub write: OpSeries,
    pub flush: OpSeries,
    pub trim: OpSeries,
    pub zeroes: OpSeries,
    pub bytes_read: Counter,
    pub bytes_written: Counter,
}

fn request_histogram() -> Histogram {
    // 50 us to about 1.6 s.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

impl NbdMetrics {
    pub fn new() -> NbdMetrics {
        let family: Family<OpLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(request_histogram);
        for op in OPS {
            drop(family.get_or_create(&[("op", op)]));
        }
        NbdMetrics {
            family,
            volume_latency: Family::new_with_constructor(request_histogram),
            volume_bytes: Family::default(),
            named: Arc::default(),
        }
    }

    /// The series of `volume` (of `_other` once [`VOLUME_SERIES_MAX`] volumes have theirs).
    pub fn volume(&self, volume: &str) -> VolumeSeries {
        let label = {
            let mut named = self.named.lock().unwrap_or_else(|p| p.into_inner());
            if named.contains(volume) || named.len() < VOLUME_SERIES_MAX {
                named.insert(volume.to_string());
                volume.to_string()
            } else {
                OTHER_VOLUMES.to_string()
            }
        };
        let op = |name: &'static str| OpSeries {
            all: self.family.get_or_create(&[("op", name)]).clone(),
            volume: self
                .volume_latency
                .get_or_create(&[("volume", label.clone()), ("op", name.to_string())])
                .clone(),
        };
        let bytes = |direction: &str| {
            self.volume_bytes
                .get_or_create(&[
                    ("volume", label.clone()),
                    ("direction", direction.to_string()),
                ])
                .clone()
        };
        VolumeSeries {
            read: op("read"),
            write: op("write"),
            flush: op("flush"),
            trim: op("trim"),
            zeroes: op("zeroes"),
            bytes_read: bytes("read"),
            bytes_written: bytes("write"),
        }
    }
}

/// Prometheus' standard process metrics (no `keel_` prefix, as every exporter names them).
fn register_process(registry: &mut Registry, process: &crate::process::ProcessStats) {
    let counter = Counter::<f64, AtomicU64>::default();
    counter.inc_by(process.cpu_seconds);
    registry.register(
        "process_cpu_seconds",
        "User and system CPU time spent",
        counter,
    );
    gauge_u64(
        registry,
        "process_resident_memory_bytes",
        "Resident memory size",
        process.resident_bytes,
    );
    gauge_u64(
        registry,
        "process_virtual_memory_bytes",
        "Virtual memory size",
        process.virtual_bytes,
    );
    gauge_u64(
        registry,
        "process_open_fds",
        "Open file descriptors",
        process.open_fds,
    );
    gauge_u64(
        registry,
        "process_max_fds",
        "The limit on open file descriptors",
        process.max_fds,
    );
    gauge_u64(registry, "process_threads", "OS threads", process.threads);
    gauge_f64(
        registry,
        "process_start_time_seconds",
        "When the process started (Unix time)",
        process.start_time_seconds,
    );
}

/// The store's sync latency snapshot as a Prometheus histogram.
#[derive(Debug)]
struct SyncHistogram(keel_store::SyncLatency);

/// The buckets of a sync latency snapshot, for `encode_histogram`.
fn sync_buckets(latency: &keel_store::SyncLatency) -> Vec<(f64, u64)> {
    latency
        .bounds_seconds
        .iter()
        .copied()
        .chain(std::iter::once(f64::INFINITY))
        .zip(latency.counts.iter().copied())
        .collect()
}

impl EncodeMetric for SyncHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let latency = &self.0;
        encoder.encode_histogram::<NoLabelSet>(
            latency.sum_seconds,
            latency.count(),
            &sync_buckets(latency),
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// Per data directory sync latency snapshots as one histogram family, labelled `dir`.
#[derive(Debug)]
struct DeviceSyncHistograms(Vec<(std::path::PathBuf, keel_store::SyncLatency)>);

impl EncodeMetric for DeviceSyncHistograms {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (dir, latency) in &self.0 {
            let labels = [("dir", dir.display().to_string())];
            encoder
                .encode_family(&labels)?
                .encode_histogram::<NoLabelSet>(
                    latency.sum_seconds,
                    latency.count(),
                    &sync_buckets(latency),
                    None,
                )?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// Runs `request`, recording how long it took in `series` (whatever its outcome).
pub fn timed<T>(series: &OpSeries, request: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let outcome = request();
    let seconds = started.elapsed().as_secs_f64();
    series.all.observe(seconds);
    series.volume.observe(seconds);
    outcome
}

/// What is read at each scrape besides the status report.
pub struct Readings {
    pub lifecycle: std::sync::Arc<crate::lifecycle::LifecycleStats>,
    pub sync_latency: keel_store::SyncLatency,
    /// Each data directory's share of the log syncs.
    pub device_sync_latency: Vec<(std::path::PathBuf, keel_store::SyncLatency)>,
    pub commit_batches: keel_store::CommitBatches,
    /// Per volume hosted here, the time its QoS limits held requests back.
    pub throttled: Vec<(String, std::time::Duration)>,
    pub jobs: Vec<crate::jobs::JobStatus>,
    pub disks: Vec<DeviceCounters>,
    pub process: Option<crate::process::ProcessStats>,
}

/// One kernel counter of a device: its name, help, and how to read it.
type DiskCounter = (
    &'static str,
    &'static str,
    fn(&crate::diskstats::DiskStats) -> Option<f64>,
);

/// The kernel's counters of the block device under one data directory.
pub struct DeviceCounters {
    pub dir: String,
    pub device: String,
    pub stats: crate::diskstats::DiskStats,
}

/// Per data directory's device, iostat's view: requests, bytes, queue, busy time, flushes.
fn register_disks(registry: &mut Registry, disks: &[DeviceCounters]) {
    type DiskLabels = [(&'static str, String); 2];
    let counters: [DiskCounter; 7] = [
        ("device_reads", "Read requests the device completed", |s| {
            Some(s.reads as f64)
        }),
        ("device_read_bytes", "Bytes the device read", |s| {
            Some(s.read_bytes as f64)
        }),
        (
            "device_writes",
            "Write requests the device completed",
            |s| Some(s.writes as f64),
        ),
        ("device_written_bytes", "Bytes the device wrote", |s| {
            Some(s.written_bytes as f64)
        }),
        (
            "device_busy_seconds",
            "Time the device had requests in flight (its utilization as a rate)",
            |s| Some(s.busy_ms as f64 / 1000.0),
        ),
        (
            "device_flushes",
            "Cache flushes the device completed (fdatasync sends them)",
            |s| s.flushes.map(|flushes| flushes as f64),
        ),
        (
            "device_flush_seconds",
            "Time the device's cache flushes took (over device_flushes: the mean flush time)",
            |s| s.flush_ms.map(|ms| ms as f64 / 1000.0),
        ),
    ];
    for (name, help, value) in counters {
        let family = Family::<DiskLabels, Counter<f64, AtomicU64>>::default();
        for disk in disks {
            if let Some(value) = value(&disk.stats) {
                family
                    .get_or_create(&[("dir", disk.dir.clone()), ("device", disk.device.clone())])
                    .inc_by(value);
            }
        }
        registry.register(name, help, family);
    }
    let queue = Family::<DiskLabels, Gauge>::default();
    for disk in disks {
        queue
            .get_or_create(&[("dir", disk.dir.clone()), ("device", disk.device.clone())])
            .set(i64::try_from(disk.stats.in_progress).unwrap_or(i64::MAX));
    }
    registry.register(
        "device_queue_depth",
        "Requests in the device's queue at the scrape",
        queue,
    );
}

/// The store's group-commit batch sizes as a Prometheus histogram.
#[derive(Debug)]
struct BatchHistogram(keel_store::CommitBatches);

impl EncodeMetric for BatchHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let batches = &self.0;
        let buckets: Vec<(f64, u64)> = batches
            .bounds
            .iter()
            .map(|&bound| bound as f64)
            .chain(std::iter::once(f64::INFINITY))
            .zip(batches.counts.iter().copied())
            .collect();
        let count = batches.counts.iter().sum();
        encoder.encode_histogram::<NoLabelSet>(batches.writes as f64, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

pub fn render(
    report: &StatusReport,
    nbd: &NbdMetrics,
    s3: &keel_s3::metrics::S3Metrics,
    readings: &Readings,
) -> Result<String, std::fmt::Error> {
    let mut root = Registry::default();
    if let Some(process) = &readings.process {
        register_process(&mut root, process);
    }
    let registry = root.sub_registry_with_prefix("keel");
    s3.register(registry);
    registry.register(
        "store_fdatasync_seconds",
        "How long each sync of the log (every device) took",
        SyncHistogram(readings.sync_latency.clone()),
    );
    registry.register(
        "store_device_fdatasync_seconds",
        "How long each data directory's fdatasync of the log took (mirrored devices sync in \
         parallel; the log's sync waits for the slowest)",
        DeviceSyncHistograms(readings.device_sync_latency.clone()),
    );
    registry.register(
        "store_commit_batch_writes",
        "Writes each group commit carried (one pwrite and one fdatasync per device for all)",
        BatchHistogram(readings.commit_batches.clone()),
    );
    registry.register(
        "nbd_request_seconds",
        "NBD request latency in the server, by command",
        nbd.family.clone(),
    );
    registry.register(
        "volume_request_seconds",
        "NBD request latency in the server, by volume and command",
        nbd.volume_latency.clone(),
    );
    registry.register(
        "volume_bytes",
        "Bytes read and written through NBD, by volume",
        nbd.volume_bytes.clone(),
    );
    let store = &report.store;
    let health = match report.health.as_str() {
        "HEALTH_OK" => 0,
        "HEALTH_WARN" => 1,
        _ => 2,
    };
    gauge_u64(
        registry,
        "health",
        "0 = HEALTH_OK, 1 = HEALTH_WARN, 2 = HEALTH_ERR",
        health,
    );
    {
        use std::sync::atomic::Ordering::Relaxed;
        let lifecycle = &readings.lifecycle;
        counter_u64(
            registry,
            "s3_lifecycle_objects_expired",
            "Objects S3 lifecycle rules deleted since the server started",
            lifecycle.objects_expired.load(Relaxed),
        );
        counter_u64(
            registry,
            "s3_lifecycle_versions_expired",
            "Noncurrent object versions S3 lifecycle rules deleted since the server started",
            lifecycle.versions_expired.load(Relaxed),
        );
        counter_u64(
            registry,
            "s3_lifecycle_delete_markers_removed",
            "Delete markers with no versions behind them S3 lifecycle rules removed since the server started",
            lifecycle.delete_markers_removed.load(Relaxed),
        );
        counter_u64(
            registry,
            "s3_lifecycle_uploads_aborted",
            "Incomplete multipart uploads S3 lifecycle rules aborted since the server started",
            lifecycle.uploads_aborted.load(Relaxed),
        );
        counter_u64(
            registry,
            "s3_lifecycle_passes_failed",
            "Lifecycle passes that failed (the server log says why)",
            lifecycle.passes_failed.load(Relaxed),
        );
        gauge_f64(
            registry,
            "s3_lifecycle_last_pass_timestamp_seconds",
            "When the last lifecycle pass finished (0: none since the server started)",
            lifecycle.last_pass_unix_ms.load(Relaxed) as f64 / 1000.0,
        );
    }
    gauge_u64(
        registry,
        "uptime_seconds",
        "Seconds since the server started",
        report.uptime_seconds,
    );
    gauge_u64(
        registry,
        "store_live_extents",
        "Extents the index points to",
        store.live_extents,
    );
    gauge_u64(
        registry,
        "store_live_raw_bytes",
        "Bytes of live values before compression",
        store.live_raw_bytes,
    );
    gauge_u64(
        registry,
        "store_live_stored_bytes",
        "Bytes of live values as stored",
        store.live_stored_bytes,
    );
    gauge_f64(
        registry,
        "store_compression_ratio",
        "Live raw bytes over stored bytes",
        store.compression_ratio,
    );
    gauge_u64(
        registry,
        "store_log_bytes",
        "Bytes of segment files on one device",
        store.log_bytes,
    );
    gauge_u64(registry, "store_segments", "Segment files", store.segments);
    gauge_u64(
        registry,
        "store_last_seq",
        "Sequence number of the last write",
        store.last_seq,
    );
    counter_u64(
        registry,
        "store_log_syncs",
        "Group-commit fdatasyncs since start",
        store.log_syncs,
    );
    counter_u64(
        registry,
        "store_corrupt_reads",
        "Checksum failures seen on read since start",
        store.corrupt_reads,
    );
    counter_u64(
        registry,
        "store_repaired_extents",
        "Extent copies repaired from a mirror since start",
        store.repaired_extents,
    );
    gauge_u64(
        registry,
        "store_poisoned",
        "1 when a failed sync stopped writes",
        store.poisoned as u64,
    );
    gauge_u64(
        registry,
        "store_available_bytes",
        "Free bytes on the fullest data directory",
        store.available_bytes,
    );
    gauge_u64(registry, "volumes", "Block volumes", report.volumes as u64);
    gauge_u64(registry, "buckets", "S3 buckets", report.buckets as u64);
    if let Some(run) = &report.scrub.last {
        gauge_u64(
            registry,
            "scrub_last_finished_timestamp_seconds",
            "When the last scheduled scrub finished (Unix time)",
            u64::try_from(run.finished_unix_ms / 1000).unwrap_or(0),
        );
        gauge_u64(
            registry,
            "scrub_last_repaired",
            "Extent copies and replica blocks the last scheduled scrub repaired",
            run.repaired_copies + run.volume_blocks_repaired,
        );
        gauge_u64(
            registry,
            "scrub_last_unrecoverable_extents",
            "Extents the last scheduled scrub found with no good copy",
            run.unrecoverable_extents,
        );
    }
    counter_u64(
        registry,
        "store_location_cache_hits",
        "Index lookups the in-memory location cache answered",
        store.location_cache_hits,
    );
    counter_u64(
        registry,
        "store_location_cache_misses",
        "Index lookups that read the on-disk index",
        store.location_cache_misses,
    );
    gauge_u64(
        registry,
        "store_dead_bytes",
        "Bytes of closed segments no live extent uses: what compaction can return",
        store.dead_bytes,
    );
    gauge_u64(
        registry,
        "store_reserve_bytes",
        "Free space kept back from writes that add data (compaction and deletes may use it)",
        store.reserve_bytes,
    );
    if let Some(fill) = &store.fill {
        gauge_f64(
            registry,
            "store_fill_rate_bytes_per_second",
            "How fast the fullest data directory's free space shrinks (negative: grows), over \
             the last hours",
            fill.bytes_per_day / 86_400.0,
        );
    }
    // QoS: only volumes that were held back, bounded like the other per-volume series.
    let held_back = Family::<[(&'static str, String); 1], Counter<f64, AtomicU64>>::default();
    for (volume, waited) in readings
        .throttled
        .iter()
        .filter(|(_, waited)| !waited.is_zero())
        .take(VOLUME_SERIES_MAX)
    {
        held_back
            .get_or_create(&[("volume", volume.clone())])
            .inc_by(waited.as_secs_f64());
    }
    registry.register(
        "volume_throttled_seconds",
        "Time requests were held back by the volume's QoS limits (IOPS, bandwidth)",
        held_back,
    );
    register_disks(registry, &readings.disks);
    // Long work (scrub, compaction, volume deletion) by kind: how many run, and how far the
    // running ones are together.
    let running = Family::<[(&'static str, String); 1], Gauge>::default();
    let progress = Family::<[(&'static str, String); 1], Gauge<f64, AtomicU64>>::default();
    let mut by_kind: std::collections::BTreeMap<&str, (i64, u64, u64)> = Default::default();
    for job in readings.jobs.iter().filter(|job| job.state == "running") {
        let entry = by_kind.entry(job.kind.as_str()).or_default();
        entry.0 += 1;
        entry.1 += job.done;
        entry.2 += job.total;
    }
    for (kind, (count, done, total)) in by_kind {
        let label = [("kind", kind.to_string())];
        running.get_or_create(&label).set(count);
        if total > 0 {
            progress
                .get_or_create(&label)
                .set(done.min(total) as f64 / total as f64);
        }
    }
    registry.register(
        "jobs_running",
        "Jobs running now (scrub, compact, volume scrub, volume delete), by kind",
        running,
    );
    registry.register(
        "jobs_progress_ratio",
        "How far the running jobs of a kind are, 0 to 1 (work done over work known)",
        progress,
    );
    // One series per active health check, so alerts can name codes.
    let checks = Family::<[(&'static str, String); 2], Gauge>::default();
    for check in &report.checks {
        checks
            .get_or_create(&[
                ("code", check.code.clone()),
                ("severity", check.severity.clone()),
            ])
            .set(1);
    }
    registry.register(
        "health_check",
        "1 for each health check that fails now, by code and severity (error, warn, info)",
        checks,
    );
    let device_total = Family::<[(&'static str, String); 1], Gauge>::default();
    let device_available = Family::<[(&'static str, String); 1], Gauge>::default();
    let device_cache = Family::<[(&'static str, String); 3], Gauge>::default();
    for device in &report.devices {
        let dir = [("dir", device.dir.clone())];
        device_total
            .get_or_create(&dir)
            .set(i64::try_from(device.total_bytes).unwrap_or(i64::MAX));
        device_available
            .get_or_create(&dir)
            .set(i64::try_from(device.available_bytes).unwrap_or(i64::MAX));
        if let (Some(name), Some(mode)) = (&device.device, &device.write_cache) {
            device_cache
                .get_or_create(&[
                    ("dir", device.dir.clone()),
                    ("device", name.clone()),
                    ("mode", mode.clone()),
                ])
                .set(i64::from(mode == "write back"));
        }
    }
    registry.register(
        "device_size_bytes",
        "Size of each data directory's filesystem",
        device_total,
    );
    registry.register(
        "device_available_bytes",
        "Free bytes of each data directory's filesystem",
        device_available,
    );
    registry.register(
        "device_volatile_write_cache",
        "1 when the block device under a data directory caches writes volatilely (write back)",
        device_cache,
    );
    let mut out = String::new();
    encode(&mut out, &root)?;
    Ok(out)
}

/// The OpenMetrics text `render` gives, in Prometheus' classic text format (version 0.0.4) for
/// scrapers that do not ask for OpenMetrics (`promtool check metrics`, older agents): a
/// counter family is named with its `_total` suffix, and `# UNIT` and `# EOF` lines go.
/// Samples are the same in both.
pub fn classic_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut help: Option<&str> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            // Held until the TYPE line says whether the family is a counter.
            help = Some(rest);
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let name = if kind == "counter" && !name.ends_with("_total") {
                format!("{name}_total")
            } else {
                name.to_string()
            };
            if let Some(text) = help.take() {
                let text = text.split_once(' ').map_or("", |(_, text)| text);
                out += &format!("# HELP {name} {text}\n");
            }
            out += &format!("# TYPE {name} {kind}\n");
            continue;
        }
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        out += line;
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves counters get their `_total` family name in HELP and TYPE, other families keep
    // theirs, samples are untouched, and the OpenMetrics-only lines go.
    #[test]
    fn openmetrics_becomes_the_classic_text_format() {
        let openmetrics = "# HELP keel_store_log_syncs Group-commit fdatasyncs since start.\n\
                           # TYPE keel_store_log_syncs counter\n\
                           keel_store_log_syncs_total 12\n\
                           # HELP keel_uptime_seconds Seconds since start.\n\
                           # TYPE keel_uptime_seconds gauge\n\
                           # UNIT keel_uptime_seconds seconds\n\
                           keel_uptime_seconds 5\n\
                           # EOF\n";
        assert_eq!(
            classic_text(openmetrics),
            "# HELP keel_store_log_syncs_total Group-commit fdatasyncs since start.\n\
             # TYPE keel_store_log_syncs_total counter\n\
             keel_store_log_syncs_total 12\n\
             # HELP keel_uptime_seconds Seconds since start.\n\
             # TYPE keel_uptime_seconds gauge\n\
             keel_uptime_seconds 5\n"
        );
    }
}
