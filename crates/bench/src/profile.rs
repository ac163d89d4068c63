//! The named benchmark profiles, how each maps onto a workload for a target, and the result
//! record they produce (printed for people, written as JSON for `report` and `compare`).
//!
//! Invariants: every result names the engine, whether O_DIRECT was in effect and how writes
//! were made durable, and carries the storage probe's warnings (tmpfs, volatile write cache),
//! so no number travels without what it measured.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::engine::{AccessPattern, RawRun, Workload};
use crate::fsprobe::{StorageProbe, WriteCache};
use crate::nbd::NbdClient;
use crate::stats::OpStats;
use crate::target::{BlockTarget, FileOptions, FileTarget, SyncMethod, TargetSpec};
use crate::BenchError;

/// Version of the JSON result format written by this crate.
pub const RESULT_FORMAT_VERSION: u32 = 1;
/// Writer counts the group-commit profile runs when none are given (from BENCHMARKS.md).
pub const GROUP_COMMIT_WRITERS_DEFAULT: &[usize] = &[1, 8, 64];

/// A named workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// 4 KiB sequential writes, queue depth 1, each durable (fio --sync=1 --direct=1 --iodepth=1).
    SyncQd1,
    /// 4 KiB random I/O, 75 % reads, queue depth 64, O_DIRECT, no syncs.
    RandrwQd64,
    /// 1 MiB sequential reads.
    SeqRead,
    /// 1 MiB sequential buffered writes with one fdatasync at the end, inside the timing.
    SeqWrite,
    /// N writers each doing write+fdatasync of 4 KiB (N = 1, 8, 64 by default).
    GroupCommit,
    /// S3 PUT then GET of 4 KiB objects.
    S3Small,
    /// S3 PUT then GET of 64 MiB objects.
    S3Large,
}

impl Profile {
    /// The kebab-case name used on the command line and in results.
    pub fn name(self) -> &'static str {
        match self {
            Self::SyncQd1 => "sync-qd1",
            Self::RandrwQd64 => "randrw-qd64",
            Self::SeqRead => "seq-read",
            Self::SeqWrite => "seq-write",
            Self::GroupCommit => "group-commit",
            Self::S3Small => "s3-small",
            Self::S3Large => "s3-large",
        }
    }

    /// True for the profiles that need an S3 target.
    pub fn is_s3(self) -> bool {
        matches!(self, Self::S3Small | Self::S3Large)
    }
}

/// Which load generator to use for file targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EngineChoice {
    /// io_uring where it works (Linux, files, queue depth > 1), else threads.
    #[default]
    Auto,
    /// io_uring only (fails where unavailable).
    Uring,
    /// One thread per outstanding operation (pread/pwrite).
    Threads,
}

/// Everything `run` needs besides the profile.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub profile: Profile,
    pub target: String,
    pub runtime: Duration,
    /// Region of a file/device/volume to use; a file is laid out to this size.
    pub size_bytes: u64,
    pub block_size_bytes: Option<usize>,
    pub queue_depth: Option<usize>,
    /// Writer counts for group-commit (one result each).
    pub writers: Vec<usize>,
    pub read_percent: Option<u8>,
    pub sync_method: Option<SyncMethod>,
    pub engine: EngineChoice,
    /// Force O_DIRECT on (true) or off (false); `None` = the profile's default.
    pub direct: Option<bool>,
    pub ops_max: Option<u64>,
    /// Before a profile that reads from an NBD volume, write its region once (untimed), so
    /// reads hit written blocks rather than the holes of a thin volume. Files are always laid
    /// out.
    pub fill_volume: bool,
    pub label: Option<String>,
    pub s3: crate::s3::S3Options,
}

/// One measured run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchResult {
    /// Name shown in reports (the target unless `--label` was given).
    pub label: String,
    pub profile: String,
    pub target: String,
    /// "file", "block device", "nbd" or "s3".
    pub target_kind: String,
    /// "write", "read", "randrw", "put" or "get".
    pub operation: String,
    pub engine: String,
    /// Whether O_DIRECT was in effect (files only).
    pub direct_io: Option<bool>,
    /// How writes were made durable ("none" when they were not).
    pub durability: String,
    pub block_size_bytes: u64,
    pub queue_depth: usize,
    pub read_percent: u8,
    /// Wall time the operations took, in seconds.
    pub elapsed_seconds: f64,
    /// RFC 3339 UTC time the run started.
    pub started_at: String,
    /// All operations together.
    pub all: OpStats,
    pub reads: Option<OpStats>,
    pub writes: Option<OpStats>,
    /// What the storage under a local target is (absent for remote targets).
    pub storage: Option<StorageProbe>,
    /// True when the target's bytes live only in memory (tmpfs/ramfs): numbers are not real.
    pub memory_backed: bool,
    /// True/false when the local device's write cache is known to be volatile or not.
    pub volatile_write_cache: Option<bool>,
    pub warnings: Vec<String>,
}

/// What a JSON result file holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResultFile {
    pub format_version: u32,
    pub results: Vec<BenchResult>,
}

impl ResultFile {
    pub fn new(results: Vec<BenchResult>) -> Self {
        Self {
            format_version: RESULT_FORMAT_VERSION,
            results,
        }
    }

    /// Reads a result file (a `ResultFile`, a bare result or an array of results).
    pub fn read(path: &std::path::Path) -> Result<Self, BenchError> {
        let text = std::fs::read_to_string(path)
            .map_err(|error| BenchError::io("read result file", path, error))?;
        let failure = |reason: String| BenchError::ResultFile {
            path: path.to_path_buf(),
            reason,
        };
        if let Ok(file) = serde_json::from_str::<ResultFile>(&text) {
            return Ok(file);
        }
        if let Ok(results) = serde_json::from_str::<Vec<BenchResult>>(&text) {
            return Ok(Self::new(results));
        }
        serde_json::from_str::<BenchResult>(&text)
            .map(|result| Self::new(vec![result]))
            .map_err(|error| failure(error.to_string()))
    }
}

/// Now as RFC 3339 UTC.
pub fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| "unknown".to_string())
}

/// The workload shape of a block profile, before target-specific limits.
struct Shape {
    block_size_bytes: usize,
    queue_depth: usize,
    read_percent: u8,
    pattern: AccessPattern,
    durable_writes: bool,
    flush_at_end: bool,
    direct: bool,
    operation: &'static str,
}

fn shape_of(profile: Profile) -> Result<Shape, BenchError> {
    const KIB_4: usize = 4096;
    const MIB_1: usize = 1024 * 1024;
    let shape = match profile {
        Profile::SyncQd1 => Shape {
            block_size_bytes: KIB_4,
            queue_depth: 1,
            read_percent: 0,
            pattern: AccessPattern::Sequential,
            durable_writes: true,
            flush_at_end: false,
            direct: true,
            operation: "write",
        },
        Profile::RandrwQd64 => Shape {
            block_size_bytes: KIB_4,
            queue_depth: 64,
            read_percent: 75,
            pattern: AccessPattern::Random,
            durable_writes: false,
            flush_at_end: false,
            direct: true,
            operation: "randrw",
        },
        Profile::SeqRead => Shape {
            block_size_bytes: MIB_1,
            queue_depth: 1,
            read_percent: 100,
            pattern: AccessPattern::Sequential,
            durable_writes: false,
            flush_at_end: false,
            direct: true,
            operation: "read",
        },
        Profile::SeqWrite => Shape {
            block_size_bytes: MIB_1,
            queue_depth: 1,
            read_percent: 0,
            pattern: AccessPattern::Sequential,
            durable_writes: false,
            flush_at_end: true,
            direct: false,
            operation: "write",
        },
        // Like a write-ahead log: buffered appends, each followed by fdatasync.
        Profile::GroupCommit => Shape {
            block_size_bytes: KIB_4,
            queue_depth: 1,
            read_percent: 0,
            pattern: AccessPattern::Sequential,
            durable_writes: true,
            flush_at_end: false,
            direct: false,
            operation: "write",
        },
        Profile::S3Small | Profile::S3Large => {
            return Err(BenchError::Invalid {
                what: "profile",
                reason: format!("{} is an S3 profile", profile.name()),
            })
        }
    };
    Ok(shape)
}

/// Runs the profile on the target; group-commit yields one result per writer count, S3
/// profiles one per operation (PUT, GET).
pub fn run(options: &RunOptions) -> Result<Vec<BenchResult>, BenchError> {
    let spec = TargetSpec::parse(&options.target)?;
    if options.profile.is_s3() {
        let TargetSpec::S3 { bucket } = &spec else {
            return Err(BenchError::Target {
                target: options.target.clone(),
                reason: format!(
                    "profile {} needs an s3://BUCKET target",
                    options.profile.name()
                ),
            });
        };
        return crate::s3::run(options, bucket);
    }
    if matches!(spec, TargetSpec::S3 { .. }) {
        return Err(BenchError::Target {
            target: options.target.clone(),
            reason: format!(
                "profile {} is a block profile; use s3-small or s3-large on S3",
                options.profile.name()
            ),
        });
    }
    let shape = shape_of(options.profile)?;
    let queue_depths: Vec<usize> = if options.profile == Profile::GroupCommit {
        if options.writers.is_empty() {
            GROUP_COMMIT_WRITERS_DEFAULT.to_vec()
        } else {
            options.writers.clone()
        }
    } else {
        vec![options.queue_depth.unwrap_or(shape.queue_depth)]
    };
    let mut results = Vec::with_capacity(queue_depths.len());
    for queue_depth in queue_depths {
        results.push(run_block(options, &spec, &shape, queue_depth)?);
    }
    Ok(results)
}

fn run_block(
    options: &RunOptions,
    spec: &TargetSpec,
    shape: &Shape,
    queue_depth: usize,
) -> Result<BenchResult, BenchError> {
    // group-commit is defined as write + fdatasync; the others default to O_DSYNC/FUA.
    // Profiles without durable writes use fdatasync as their method, which opens files without
    // O_DSYNC: their writes must not be synced one by one.
    let sync_method = if options.profile == Profile::GroupCommit || !shape.durable_writes {
        SyncMethod::Fdatasync
    } else {
        options.sync_method.unwrap_or(SyncMethod::Dsync)
    };
    let mut workload = Workload {
        block_size_bytes: options.block_size_bytes.unwrap_or(shape.block_size_bytes),
        queue_depth,
        read_percent: options.read_percent.unwrap_or(shape.read_percent),
        pattern: shape.pattern,
        durable_writes: shape.durable_writes,
        region_bytes: options.size_bytes,
        runtime: options.runtime,
        ops_max: options.ops_max,
        flush_at_end: shape.flush_at_end,
        label: format!("{} {}", options.profile.name(), options.target),
    };
    if options.profile == Profile::GroupCommit {
        workload.label = format!("{} ×{queue_depth}", workload.label);
    }
    let started_at = now_rfc3339();
    let mut warnings = Vec::new();
    let (raw, durability, direct_io, storage) = match spec {
        TargetSpec::Path(path) => {
            let storage = crate::fsprobe::probe(path)?;
            let want_direct = options.direct.unwrap_or(shape.direct);
            let target = FileTarget::open(
                path,
                FileOptions {
                    direct: want_direct,
                    sync_method,
                    size_bytes: options.size_bytes,
                },
            )?;
            if want_direct && !target.is_direct() {
                warnings.push(format!(
                    "the filesystem under {} refused O_DIRECT: this run used the page cache",
                    path.display()
                ));
            }
            workload.region_bytes = workload.region_bytes.min(target.size_bytes());
            let durability = durability_text(&workload, &target);
            let raw = run_file(&target, &workload, options.engine, &mut warnings)?;
            (raw, durability, Some(target.is_direct()), Some(storage))
        }
        TargetSpec::Nbd { address, export } => {
            let client = NbdClient::connect(address, export, sync_method)?;
            workload.region_bytes = workload.region_bytes.min(client.export_size_bytes());
            workload.region_bytes -= workload.region_bytes % workload.block_size_bytes as u64;
            if options.fill_volume && workload.read_percent > 0 {
                fill_region(&client, workload.region_bytes)?;
            } else if workload.read_percent > 0 {
                warnings.push(
                    "the volume was not filled first: reads of never-written blocks may be \
                     answered without touching the disk"
                        .to_string(),
                );
            }
            warnings.push(
                "remote target: the storage under the NBD server was not probed (run `keel \
                 bench probe` on the server's data directory)"
                    .to_string(),
            );
            let durability = durability_text(&workload, &client);
            let raw = crate::engine::run_threads(&client, &workload)?;
            (raw, durability, None, None)
        }
        TargetSpec::S3 { .. } => {
            return Err(BenchError::Internal {
                reason: "S3 targets are handled before block profiles".to_string(),
            })
        }
    };
    if let Some(storage) = &storage {
        warnings.extend(storage.warnings.iter().cloned());
    }
    Ok(make_result(
        options,
        spec,
        &workload,
        raw,
        durability,
        direct_io,
        storage,
        warnings,
        started_at,
        shape.operation,
    ))
}

/// Writes `region_bytes` of random data from offset 0 (1 MiB requests, `FILL_THREADS` in
/// flight), then flushes: untimed preparation for reading profiles.
fn fill_region(target: &dyn BlockTarget, region_bytes: u64) -> Result<(), BenchError> {
    const FILL_CHUNK_BYTES: u64 = 1024 * 1024;
    const FILL_THREADS: u64 = 8;
    let chunks = region_bytes.div_ceil(FILL_CHUNK_BYTES);
    let results: Vec<Result<(), BenchError>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..FILL_THREADS)
            .map(|worker| {
                scope.spawn(move || {
                    let data = crate::target::AlignedBuffer::random(FILL_CHUNK_BYTES as usize);
                    let mut chunk = worker;
                    while chunk < chunks {
                        let offset = chunk * FILL_CHUNK_BYTES;
                        let length = (region_bytes - offset).min(FILL_CHUNK_BYTES) as usize;
                        target.write_at(&data.as_slice()[..length], offset, false)?;
                        chunk += FILL_THREADS;
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| {
                worker.join().unwrap_or_else(|_| {
                    Err(BenchError::Internal {
                        reason: "a fill thread panicked".to_string(),
                    })
                })
            })
            .collect()
    });
    for result in results {
        result?;
    }
    target.flush()
}

fn durability_text(workload: &Workload, target: &dyn BlockTarget) -> String {
    if workload.durable_writes {
        target.durable_write_method()
    } else if workload.flush_at_end {
        "none per write; one flush (fdatasync / NBD FLUSH) at the end, inside the timing"
            .to_string()
    } else if workload.read_percent == 100 {
        "not applicable (reads only)".to_string()
    } else {
        "none (writes are not synced)".to_string()
    }
}

fn run_file(
    target: &FileTarget,
    workload: &Workload,
    engine: EngineChoice,
    warnings: &mut Vec<String>,
) -> Result<RawRun, BenchError> {
    // At queue depth 1 a thread doing pread/pwrite is real queue depth 1 with the least
    // overhead; io_uring would punt O_DSYNC writes to a kernel worker and add a wake-up to
    // every op. io_uring is for keeping many ops in flight from one thread.
    let uring_fits = (!workload.durable_writes || target.is_dsync()) && workload.queue_depth > 1;
    match engine {
        EngineChoice::Threads => crate::engine::run_threads(target, workload),
        #[cfg(target_os = "linux")]
        EngineChoice::Uring => crate::engine::run_uring(target, workload),
        #[cfg(target_os = "linux")]
        EngineChoice::Auto if uring_fits => match crate::engine::run_uring(target, workload) {
            Err(BenchError::Io {
                context, source, ..
            }) if context.starts_with("io_uring_setup") => {
                warnings.push(format!(
                    "io_uring unavailable ({source}); used one thread per outstanding op"
                ));
                crate::engine::run_threads(target, workload)
            }
            other => other,
        },
        #[cfg(not(target_os = "linux"))]
        EngineChoice::Uring => Err(BenchError::Invalid {
            what: "engine",
            reason: "io_uring exists only on Linux".to_string(),
        }),
        EngineChoice::Auto => {
            let _ = uring_fits;
            crate::engine::run_threads(target, workload)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn make_result(
    options: &RunOptions,
    spec: &TargetSpec,
    workload: &Workload,
    raw: RawRun,
    durability: String,
    direct_io: Option<bool>,
    storage: Option<StorageProbe>,
    warnings: Vec<String>,
    started_at: String,
    operation: &str,
) -> BenchResult {
    let mut all = raw.reads.clone();
    // Merging two recorders built with the same bounds cannot fail.
    let _ = all.merge(&raw.writes);
    let reads = (raw.reads.ops() > 0).then(|| raw.reads.summarise(raw.elapsed));
    let writes = (raw.writes.ops() > 0).then(|| raw.writes.summarise(raw.elapsed));
    let memory_backed = storage.as_ref().is_some_and(|probe| probe.memory_backed);
    let volatile_write_cache = storage
        .as_ref()
        .and_then(|probe| probe.write_cache)
        .map(|cache| cache == WriteCache::WriteBack);
    BenchResult {
        label: options
            .label
            .clone()
            .unwrap_or_else(|| options.target.clone()),
        profile: options.profile.name().to_string(),
        target: options.target.clone(),
        target_kind: spec.kind().to_string(),
        operation: operation.to_string(),
        engine: raw.engine,
        direct_io,
        durability,
        block_size_bytes: workload.block_size_bytes as u64,
        queue_depth: workload.queue_depth,
        read_percent: workload.read_percent,
        elapsed_seconds: raw.elapsed.as_secs_f64(),
        started_at,
        all: all.summarise(raw.elapsed),
        reads,
        writes,
        storage,
        memory_backed,
        volatile_write_cache,
        warnings,
    }
}

/// Human-readable byte size ("4 KiB", "1 MiB").
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: &[(u64, &str)] = &[(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for &(size, unit) in UNITS {
        if bytes >= size && bytes.is_multiple_of(size) {
            return format!("{} {unit}", bytes / size);
        }
    }
    format!("{bytes} B")
}

/// Latency in µs as a short human string ("85 µs", "2.61 ms", "1.20 s").
pub fn format_latency(microseconds: f64) -> String {
    if microseconds >= 1_000_000.0 {
        format!("{:.2} s", microseconds / 1_000_000.0)
    } else if microseconds >= 1000.0 {
        format!("{:.2} ms", microseconds / 1000.0)
    } else {
        format!("{microseconds:.1} µs")
    }
}

fn stats_line(name: &str, stats: &OpStats) -> String {
    let latency = &stats.latency;
    format!(
        "  {name:<5} {:>10.0} IOPS {:>9.2} MiB/s  lat min {} p50 {} p99 {} p99.9 {} max {}  \
         ({} ops, {:.2}% > 10× median)",
        stats.iops,
        stats.mib_per_second,
        format_latency(latency.min_us),
        format_latency(latency.p50_us),
        format_latency(latency.p99_us),
        format_latency(latency.p999_us),
        format_latency(latency.max_us),
        stats.ops,
        stats.slow_share * 100.0
    )
}

/// The result as text for a terminal: what ran, how, the numbers, and warnings (loud).
pub fn render_text(result: &BenchResult) -> String {
    let mut text = String::new();
    if result.memory_backed {
        text.push_str(
            "!!! WARNING: this target lives in memory (tmpfs/ramfs/RAM disk), not on a disk: \
             syncs are no-ops and the numbers below say nothing about storage !!!\n",
        );
    }
    let storage = result
        .storage
        .as_ref()
        .map(|probe| format!(" ({})", probe.describe()))
        .unwrap_or_default();
    text.push_str(&format!(
        "{} on {} [{}]{storage}\n",
        result.profile, result.target, result.target_kind
    ));
    let direct = match result.direct_io {
        Some(true) => ", O_DIRECT",
        Some(false) => ", buffered (page cache)",
        None => "",
    };
    text.push_str(&format!(
        "  {} {}, queue depth {}, {}% reads, {:.1} s; engine {}{direct}; durability: {}\n",
        format_bytes(result.block_size_bytes),
        result.operation,
        result.queue_depth,
        result.read_percent,
        result.elapsed_seconds,
        result.engine,
        result.durability
    ));
    if result.reads.is_some() && result.writes.is_some() {
        text.push_str(&stats_line("all", &result.all));
        text.push('\n');
    }
    if let Some(reads) = &result.reads {
        text.push_str(&stats_line(
            if result.operation == "get" {
                "get"
            } else {
                "read"
            },
            reads,
        ));
        text.push('\n');
    }
    if let Some(writes) = &result.writes {
        text.push_str(&stats_line(
            if result.operation == "put" {
                "put"
            } else {
                "write"
            },
            writes,
        ));
        text.push('\n');
    }
    if result.reads.is_none() && result.writes.is_none() {
        text.push_str(&stats_line("all", &result.all));
        text.push('\n');
    }
    for warning in &result.warnings {
        text.push_str(&format!("  WARNING: {warning}\n"));
    }
    text
}

/// Writes results as JSON to `path`, or to stdout when `path` is "-".
pub fn write_json(path: &std::path::Path, results: &[BenchResult]) -> Result<(), BenchError> {
    let file = ResultFile::new(results.to_vec());
    let text = serde_json::to_string_pretty(&file).map_err(|error| BenchError::Internal {
        reason: format!("serialising results: {error}"),
    })?;
    if path == std::path::Path::new("-") {
        println!("{text}");
        return Ok(());
    }
    std::fs::write(path, text + "\n").map_err(|error| BenchError::io("write JSON", path, error))
}

/// Where to send the human text: stderr when JSON goes to stdout.
pub fn json_to_stdout(json: Option<&PathBuf>) -> bool {
    json.is_some_and(|path| path == std::path::Path::new("-"))
}
