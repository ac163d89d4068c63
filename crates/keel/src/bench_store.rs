//! `keel bench store`: N concurrent writers of durable 4 KiB appends through the store
//! (`Durability::Sync`, so every op waits for its batch's fdatasync), against raw
//! `write + fdatasync` on the same filesystem, alternating the two in rounds. Every op's latency
//! goes into an HDR histogram; the table reports medians over rounds and the two target ratios:
//! ops/s of the largest N over N=1, and the store's 1-writer p50 over raw p50.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use keel_store::{meta_key, Compression, Durability, Store, StoreConfig, WriteOp};
use serde::Serialize;

const VALUE_BYTES: usize = 4096;
/// Upper bound on ops per writer per round, whatever the duration.
const OPS_PER_WRITER_MAX: u64 = 200_000;

#[derive(clap::Args, Debug)]
pub struct StoreBenchArgs {
    /// Directory on the filesystem to measure (a fresh store is made inside it).
    #[arg(long, default_value = "./keel-bench")]
    pub dir: PathBuf,
    /// Writer counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    pub writers: Vec<usize>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Rounds; each round measures raw and store once per writer count, alternating.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Allow a tmpfs directory (the numbers then mean nothing).
    #[arg(long)]
    pub ephemeral: bool,
}

#[derive(Serialize, Debug, Clone)]
pub struct Measurement {
    pub target: String,
    pub writers: usize,
    pub ops: u64,
    pub ops_per_second: f64,
    pub latency_us_min: u64,
    pub latency_us_p50: u64,
    pub latency_us_p99: u64,
    pub latency_us_p999: u64,
    pub latency_us_max: u64,
    /// Store only: log fdatasyncs during the run (ops / syncs = writers served per sync).
    pub syncs: Option<u64>,
}

#[derive(Serialize, Debug)]
pub struct StoreBenchReport {
    pub dir: PathBuf,
    pub filesystem: String,
    pub write_cache: Option<String>,
    pub rounds: Vec<Vec<Measurement>>,
    /// Median over rounds, per (target, writers).
    pub medians: Vec<Measurement>,
    pub scaling_ratio: Option<f64>,
    pub p50_ratio_vs_raw: Option<f64>,
}

fn summarize(
    target: &str,
    writers: usize,
    histogram: &Histogram<u64>,
    elapsed: Duration,
    syncs: Option<u64>,
) -> Measurement {
    Measurement {
        target: target.to_string(),
        writers,
        ops: histogram.len(),
        ops_per_second: histogram.len() as f64 / elapsed.as_secs_f64(),
        latency_us_min: histogram.min(),
        latency_us_p50: histogram.value_at_quantile(0.5),
        latency_us_p99: histogram.value_at_quantile(0.99),
        latency_us_p999: histogram.value_at_quantile(0.999),
        latency_us_max: histogram.max(),
        syncs,
    }
}

fn new_histogram() -> anyhow::Result<Histogram<u64>> {
    Ok(Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?)
}

/// Raw reference: each writer appends 4 KiB and fdatasyncs its own file.
fn measure_raw(dir: &Path, writers: usize, duration: Duration) -> anyhow::Result<Measurement> {
    let started = Instant::now();
    let handles: Vec<_> = (0..writers)
        .map(|w| {
            let path = dir.join(format!("raw-{w}"));
            std::thread::spawn(move || -> anyhow::Result<Histogram<u64>> {
                let mut file = OpenOptions::new()
                    .create(true)
                    .truncate(true)
                    .write(true)
                    .open(&path)?;
                let block = vec![0xa5u8; VALUE_BYTES];
                let mut histogram = new_histogram()?;
                let deadline = Instant::now() + duration;
                for _ in 0..OPS_PER_WRITER_MAX {
                    if Instant::now() >= deadline {
                        break;
                    }
                    let op = Instant::now();
                    file.write_all(&block)?;
                    file.sync_data()?;
                    histogram.record(op.elapsed().as_micros().max(1) as u64)?;
                }
                drop(file);
                std::fs::remove_file(&path)?;
                Ok(histogram)
            })
        })
        .collect();
    let mut total = new_histogram()?;
    for handle in handles {
        let histogram = handle
            .join()
            .map_err(|_| anyhow::anyhow!("raw writer panicked"))??;
        total.add(&histogram)?;
    }
    Ok(summarize(
        "raw write+fdatasync",
        writers,
        &total,
        started.elapsed(),
        None,
    ))
}

fn measure_store(
    dir: &Path,
    writers: usize,
    duration: Duration,
    ephemeral: bool,
) -> anyhow::Result<Measurement> {
    let store_dir = dir.join(format!("store-{writers}"));
    let _ = std::fs::remove_dir_all(&store_dir);
    let mut config = StoreConfig::new(vec![store_dir.clone()]);
    config.ephemeral = ephemeral;
    let store = Arc::new(Store::open(config)?);
    let syncs_before = store.stats()?.log_syncs;
    let started = Instant::now();
    let handles: Vec<_> = (0..writers)
        .map(|w| {
            let store = store.clone();
            std::thread::spawn(move || -> anyhow::Result<Histogram<u64>> {
                let mut histogram = new_histogram()?;
                let deadline = Instant::now() + duration;
                let value = vec![0x5au8; VALUE_BYTES];
                for i in 0..OPS_PER_WRITER_MAX {
                    if Instant::now() >= deadline {
                        break;
                    }
                    let key = meta_key(format!("bench/{w}/{i}").as_bytes());
                    let op = Instant::now();
                    store.write(
                        vec![WriteOp::put(key, value.clone(), Compression::None)],
                        Durability::Sync,
                    )?;
                    histogram.record(op.elapsed().as_micros().max(1) as u64)?;
                }
                Ok(histogram)
            })
        })
        .collect();
    let mut total = new_histogram()?;
    for handle in handles {
        let histogram = handle
            .join()
            .map_err(|_| anyhow::anyhow!("store writer panicked"))??;
        total.add(&histogram)?;
    }
    let elapsed = started.elapsed();
    let syncs = store.stats()?.log_syncs - syncs_before;
    drop(store);
    std::fs::remove_dir_all(&store_dir)?;
    Ok(summarize(
        "keel store",
        writers,
        &total,
        elapsed,
        Some(syncs),
    ))
}

fn median_of(measurements: &[&Measurement]) -> Measurement {
    let mut sorted: Vec<&Measurement> = measurements.to_vec();
    sorted.sort_by(|a, b| a.ops_per_second.total_cmp(&b.ops_per_second));
    let mut median = sorted[sorted.len() / 2].clone();
    let mut p50s: Vec<u64> = measurements.iter().map(|m| m.latency_us_p50).collect();
    p50s.sort_unstable();
    median.latency_us_p50 = p50s[p50s.len() / 2];
    median
}

pub fn run(args: StoreBenchArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let fs = keel_store::fsinfo::filesystem_info(&args.dir)?;
    let cache = keel_store::fsinfo::write_cache(&args.dir);
    if fs.is_volatile() {
        eprintln!(
            "WARNING: {} is on {}: fsync is a no-op there and these numbers mean nothing.",
            args.dir.display(),
            fs.filesystem
        );
        if !args.ephemeral {
            anyhow::bail!(
                "refusing to benchmark durability on {} (pass --ephemeral to do it anyway)",
                fs.filesystem
            );
        }
    }
    if let Some(cache) = &cache {
        if cache.volatile() {
            eprintln!(
                "note: {} has a volatile write cache (\"write back\"); fdatasync flushes it.",
                cache.device
            );
        }
    }
    let duration = Duration::from_secs_f64(args.seconds.clamp(0.1, 600.0));
    let mut rounds = Vec::new();
    for round in 0..args.rounds.max(1) {
        let mut results = Vec::new();
        for &writers in &args.writers {
            // Raw and store alternate so drift on a shared machine hits both alike.
            let pair = if round % 2 == 0 {
                let raw = measure_raw(&args.dir, writers, duration)?;
                let store = measure_store(&args.dir, writers, duration, args.ephemeral)?;
                [raw, store]
            } else {
                let store = measure_store(&args.dir, writers, duration, args.ephemeral)?;
                let raw = measure_raw(&args.dir, writers, duration)?;
                [raw, store]
            };
            eprintln!(
                "round {}: {writers:>3} writers: raw {:>8.0} ops/s p50 {:>6} us | store {:>8.0} ops/s p50 {:>6} us",
                round + 1,
                pair[0].ops_per_second,
                pair[0].latency_us_p50,
                pair[1].ops_per_second,
                pair[1].latency_us_p50
            );
            results.extend(pair);
        }
        rounds.push(results);
    }
    let mut medians = Vec::new();
    for target in ["raw write+fdatasync", "keel store"] {
        for &writers in &args.writers {
            let matching: Vec<&Measurement> = rounds
                .iter()
                .flatten()
                .filter(|m| m.target == target && m.writers == writers)
                .collect();
            if !matching.is_empty() {
                medians.push(median_of(&matching));
            }
        }
    }
    let find = |target: &str, writers: usize| {
        medians
            .iter()
            .find(|m| m.target == target && m.writers == writers)
    };
    let max_writers = args.writers.iter().copied().max().unwrap_or(1);
    let scaling_ratio = match (find("keel store", 1), find("keel store", max_writers)) {
        (Some(one), Some(many)) if max_writers > 1 => {
            Some(many.ops_per_second / one.ops_per_second)
        }
        _ => None,
    };
    let p50_ratio_vs_raw = match (find("keel store", 1), find("raw write+fdatasync", 1)) {
        (Some(store), Some(raw)) => {
            Some(store.latency_us_p50 as f64 / raw.latency_us_p50.max(1) as f64)
        }
        _ => None,
    };
    println!(
        "keel bench store: {} on {}{} — 4 KiB durable appends, {} rounds of {:.1} s, medians",
        args.dir.display(),
        fs.filesystem,
        cache
            .as_ref()
            .map(|c| format!(" ({}: write cache {})", c.device, c.mode))
            .unwrap_or_default(),
        args.rounds,
        duration.as_secs_f64()
    );
    println!(
        "{:<22} {:>7} {:>10} {:>8} {:>8} {:>8} {:>9} {:>10}",
        "target", "writers", "ops/s", "p50 us", "p99 us", "p99.9 us", "max us", "ops/sync"
    );
    for m in &medians {
        let per_sync = m
            .syncs
            .map(|s| format!("{:.1}", m.ops as f64 / s.max(1) as f64))
            .unwrap_or_else(|| "1.0".into());
        println!(
            "{:<22} {:>7} {:>10.0} {:>8} {:>8} {:>8} {:>9} {:>10}",
            m.target,
            m.writers,
            m.ops_per_second,
            m.latency_us_p50,
            m.latency_us_p99,
            m.latency_us_p999,
            m.latency_us_max,
            per_sync
        );
    }
    if let Some(ratio) = scaling_ratio {
        println!("scaling: {max_writers} writers reach {ratio:.1}x the ops/s of 1 writer (target >= 20x)");
    }
    if let Some(ratio) = p50_ratio_vs_raw {
        println!("latency: 1-writer p50 is {ratio:.2}x raw write+fdatasync (target <= 1.2x)");
    }
    let report = StoreBenchReport {
        dir: args.dir.clone(),
        filesystem: fs.filesystem,
        write_cache: cache.map(|c| c.mode),
        rounds,
        medians,
        scaling_ratio,
        p50_ratio_vs_raw,
    };
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
