//! `keel doctor DIR`: what the disk under a data directory really guarantees — filesystem type
//! (tmpfs/ramfs make fsync meaningless), whether the device has a volatile write cache, the
//! latency of durable 4 KiB appends (write + fdatasync, every op timed), and whether
//! `sync_file_range` would be unsafe there. Readable output, or JSON with `--json`.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use serde::Serialize;

/// Appends timed by the fdatasync probe.
const PROBE_APPENDS: u64 = 200;
const PROBE_BLOCK_BYTES: usize = 4096;

#[derive(clap::Args, Debug)]
pub struct DoctorArgs {
    /// Data directory to examine (created if missing).
    pub dir: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Number of timed 4 KiB write+fdatasync appends.
    #[arg(long, default_value_t = PROBE_APPENDS)]
    pub appends: u64,
}

#[derive(Serialize, Debug)]
pub struct DoctorReport {
    pub dir: PathBuf,
    pub filesystem: String,
    pub volatile_filesystem: bool,
    pub device: Option<String>,
    pub write_cache: Option<String>,
    pub volatile_write_cache: bool,
    pub sync_file_range_unsafe: bool,
    pub available_bytes: u64,
    pub fdatasync_appends: u64,
    pub fdatasync_us_min: u64,
    pub fdatasync_us_p50: u64,
    pub fdatasync_us_p99: u64,
    pub fdatasync_us_max: u64,
    pub verdict: String,
}

pub fn examine(dir: &Path, appends: u64) -> anyhow::Result<DoctorReport> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let fs = keel_store::fsinfo::filesystem_info(dir)
        .with_context(|| format!("statfs {}", dir.display()))?;
    let cache = keel_store::fsinfo::write_cache(dir);
    let memory = keel_store::fsinfo::memory_backed(dir)?;
    let probe = dir.join(".keel-doctor-probe");
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&probe)
        .with_context(|| format!("creating {}", probe.display()))?;
    let block = vec![0x5au8; PROBE_BLOCK_BYTES];
    let mut histogram = hdrhistogram::Histogram::<u64>::new(3)?;
    for _ in 0..appends.max(1) {
        let started = Instant::now();
        file.write_all(&block)?;
        file.sync_data()?;
        histogram.record(started.elapsed().as_micros() as u64)?;
    }
    drop(file);
    let _ = std::fs::remove_file(&probe);
    let volatile_cache = cache.as_ref().is_some_and(|c| c.volatile());
    let verdict = if let Some(what) = &memory {
        format!(
            "NOT DURABLE: {what} keeps data in memory; fsync returns at once and a power cut \
             loses everything. `keel server` refuses this directory unless started with --ephemeral."
        )
    } else if volatile_cache {
        "OK with care: the device has a volatile write cache; Keel issues fdatasync, which the \
         kernel turns into a cache flush, so acknowledged writes survive power loss only if the \
         device honours flushes (enterprise drives with power-loss protection do)."
            .to_string()
    } else {
        "OK: real filesystem, write-through device cache.".to_string()
    };
    Ok(DoctorReport {
        dir: dir.to_path_buf(),
        filesystem: fs.filesystem.clone(),
        volatile_filesystem: memory.is_some(),
        device: cache.as_ref().map(|c| c.device.clone()),
        write_cache: cache.as_ref().map(|c| c.mode.clone()),
        volatile_write_cache: volatile_cache,
        sync_file_range_unsafe: fs.sync_file_range_unsafe(),
        available_bytes: fs.available_bytes,
        fdatasync_appends: histogram.len(),
        fdatasync_us_min: histogram.min(),
        fdatasync_us_p50: histogram.value_at_quantile(0.5),
        fdatasync_us_p99: histogram.value_at_quantile(0.99),
        fdatasync_us_max: histogram.max(),
        verdict,
    })
}

pub fn run(args: DoctorArgs) -> anyhow::Result<()> {
    let report = examine(&args.dir, args.appends)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    // A check that fails must stop what runs it (the Kubernetes init container, a script).
    if report.volatile_filesystem {
        anyhow::bail!(
            "{} is not durable storage: keel server refuses it (see the verdict)",
            report.dir.display()
        );
    }
    Ok(())
}

fn print_report(report: &DoctorReport) {
    println!("keel doctor: {}", report.dir.display());
    println!(
        "  filesystem        {}{}",
        report.filesystem,
        if report.volatile_filesystem {
            "  (VOLATILE: memory only)"
        } else {
            ""
        }
    );
    match (&report.device, &report.write_cache) {
        (Some(device), Some(mode)) => println!(
            "  device            {device}, write cache: {mode}{}",
            if report.volatile_write_cache {
                "  (volatile: needs flushes)"
            } else {
                ""
            }
        ),
        _ => println!("  device            none found (not a local block device)"),
    }
    println!(
        "  sync_file_range   {}",
        if report.sync_file_range_unsafe {
            "UNSAFE here (does not write data on this filesystem); Keel never uses it"
        } else {
            "never flushes the device cache nor metadata; Keel never uses it for durability"
        }
    );
    println!(
        "  free space        {:.1} GiB",
        report.available_bytes as f64 / (1u64 << 30) as f64
    );
    println!(
        "  fdatasync 4 KiB   {} appends: min {} us, p50 {} us, p99 {} us, max {} us",
        report.fdatasync_appends,
        report.fdatasync_us_min,
        report.fdatasync_us_p50,
        report.fdatasync_us_p99,
        report.fdatasync_us_max
    );
    println!("  verdict           {}", report.verdict);
}
