//! Short, bounded runs of the profiles on real files (under /var/tmp, a real disk) and on
//! /dev/shm (tmpfs), checking what the results say rather than how fast anything is: op
//! counts, the read/write mix, the engine and durability method named, the warnings carried,
//! and that `report` turns the JSON into a table and an SVG CDF.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use keel_bench::profile::{self, EngineChoice, Profile, RunOptions};
use keel_bench::{BenchResult, ResultFile};

/// Region every test file uses (small, so laying it out is quick).
const SIZE_BYTES: u64 = 8 * 1024 * 1024;

fn options(profile: Profile, target: &Path) -> RunOptions {
    RunOptions {
        profile,
        target: target.to_str().unwrap().to_string(),
        runtime: Duration::from_secs(20),
        size_bytes: SIZE_BYTES,
        block_size_bytes: None,
        queue_depth: None,
        writers: Vec::new(),
        read_percent: None,
        sync_method: None,
        engine: EngineChoice::Auto,
        direct: None,
        ops_max: Some(200),
        fill_volume: true,
        label: None,
        s3: Default::default(),
    }
}

fn real_disk_directory() -> tempfile::TempDir {
    let directory = tempfile::Builder::new()
        .prefix("keel-bench-profiles-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let output = std::process::Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(directory.path())
        .output()
        .expect("`stat` must be installed (Debian package coreutils)");
    assert_ne!(String::from_utf8_lossy(&output.stdout).trim(), "tmpfs");
    directory
}

// Proves sync-qd1 on a real file does exactly the ops asked, all writes, each made durable by
// O_DSYNC (or fdatasync when asked), on one thread, and records them all.
#[test]
fn sync_qd1_counts_durable_writes() {
    let directory = real_disk_directory();
    let target = directory.path().join("sync.dat");
    let results = profile::run(&options(Profile::SyncQd1, &target)).unwrap();
    assert_eq!(results.len(), 1);
    let result = &results[0];
    assert_eq!(result.all.ops, 200);
    assert!(result.reads.is_none());
    assert_eq!(result.writes.as_ref().unwrap().ops, 200);
    assert!(
        result.durability.contains("O_DSYNC"),
        "{}",
        result.durability
    );
    assert!(result.engine.starts_with("threads (1"), "{}", result.engine);
    assert!(!result.memory_backed);
    assert_eq!(std::fs::metadata(&target).unwrap().len(), SIZE_BYTES);

    let mut fdatasync = options(Profile::SyncQd1, &target);
    fdatasync.sync_method = Some(keel_bench::target::SyncMethod::Fdatasync);
    let result = &profile::run(&fdatasync).unwrap()[0];
    assert!(
        result.durability.contains("fdatasync"),
        "{}",
        result.durability
    );
    assert_eq!(result.writes.as_ref().unwrap().ops, 200);
}

// Proves randrw-qd64 keeps 64 ops in flight with io_uring (where the kernel allows it) or
// threads, with about 75 % reads, and that both engines count every op.
#[test]
fn randrw_mixes_reads_and_writes_on_both_engines() {
    let directory = real_disk_directory();
    let target = directory.path().join("randrw.dat");
    for engine in [EngineChoice::Auto, EngineChoice::Threads] {
        let mut run = options(Profile::RandrwQd64, &target);
        run.engine = engine;
        run.ops_max = Some(4000);
        let result = &profile::run(&run).unwrap()[0];
        assert_eq!(result.queue_depth, 64);
        let reads = result.reads.as_ref().unwrap().ops;
        let writes = result.writes.as_ref().unwrap().ops;
        assert_eq!(reads + writes, 4000, "{engine:?}");
        let read_share = reads as f64 / 4000.0;
        assert!((0.70..=0.80).contains(&read_share), "{read_share}");
        assert!(
            result.durability.starts_with("none"),
            "{}",
            result.durability
        );
        if engine == EngineChoice::Threads {
            assert!(
                result.engine.starts_with("threads (64"),
                "{}",
                result.engine
            );
        }
    }
}

// Proves group-commit yields one result per writer count, each with fdatasync per write.
#[test]
fn group_commit_runs_each_writer_count() {
    let directory = real_disk_directory();
    let target = directory.path().join("group.dat");
    let mut run = options(Profile::GroupCommit, &target);
    run.writers = vec![1, 4];
    run.ops_max = Some(40);
    let results = profile::run(&run).unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0].queue_depth, 1);
    assert_eq!(results[1].queue_depth, 4);
    for result in &results {
        assert_eq!(result.writes.as_ref().unwrap().ops, 40);
        assert!(
            result.durability.contains("fdatasync"),
            "{}",
            result.durability
        );
    }
}

// Proves the sequential profiles move 1 MiB blocks: seq-write writes (buffered, one flush at
// the end), seq-read reads, and MiB/s is IOPS × 1 MiB.
#[test]
fn sequential_profiles_use_one_mebibyte_blocks() {
    let directory = real_disk_directory();
    let target = directory.path().join("sequential.dat");
    let mut write = options(Profile::SeqWrite, &target);
    write.ops_max = Some(16);
    let result = &profile::run(&write).unwrap()[0];
    assert_eq!(result.block_size_bytes, 1024 * 1024);
    assert_eq!(result.direct_io, Some(false));
    assert!(
        result.durability.contains("one flush"),
        "{}",
        result.durability
    );
    let writes = result.writes.as_ref().unwrap();
    assert_eq!(writes.ops, 16);
    assert!((writes.mib_per_second - writes.iops).abs() < 1e-6);
    let mut read = options(Profile::SeqRead, &target);
    read.ops_max = Some(16);
    let result = &profile::run(&read).unwrap()[0];
    assert_eq!(result.reads.as_ref().unwrap().ops, 16);
    assert!(result.writes.is_none());
}

// Proves a run on tmpfs carries the memory-backed flag and the loud warning into its result
// (/dev/shm is tmpfs on Linux; `stat -f` confirms it first).
#[test]
fn tmpfs_run_is_flagged_in_the_result() {
    let output = std::process::Command::new("stat")
        .args(["-f", "-c", "%T", "/dev/shm"])
        .output()
        .expect("`stat` must be installed (Debian package coreutils)");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        "tmpfs",
        "this test needs /dev/shm to be a tmpfs"
    );
    let target = Path::new("/dev/shm").join(format!("keel-bench-{}.dat", std::process::id()));
    let mut run = options(Profile::SyncQd1, &target);
    run.size_bytes = 1024 * 1024;
    run.ops_max = Some(10);
    let result = profile::run(&run);
    let _ = std::fs::remove_file(&target);
    let result = &result.unwrap()[0];
    assert!(result.memory_backed);
    assert!(result
        .warnings
        .iter()
        .any(|warning| warning.contains("memory, not a disk")));
    let json = serde_json::to_value(result).unwrap();
    assert_eq!(json["memory_backed"], serde_json::Value::Bool(true));
}

// Proves JSON results round-trip through a file and `report` renders a markdown row per
// operation and an SVG with one polyline per result.
#[test]
fn report_renders_markdown_and_svg() {
    let directory = real_disk_directory();
    let target = directory.path().join("report.dat");
    let mut results: Vec<BenchResult> = Vec::new();
    results.extend(profile::run(&options(Profile::SyncQd1, &target)).unwrap());
    let mut randrw = options(Profile::RandrwQd64, &target);
    randrw.label = Some("mixed".to_string());
    results.extend(profile::run(&randrw).unwrap());
    let json = directory.path().join("results.json");
    profile::write_json(&json, &results).unwrap();
    let read_back = ResultFile::read(&json).unwrap();
    // Floats may come back one ULP off (serde_json's fast float parser); all else is exact.
    assert_eq!(read_back.results.len(), results.len());
    for (read, written) in read_back.results.iter().zip(&results) {
        assert_eq!(read.label, written.label);
        assert_eq!(read.warnings, written.warnings);
        assert_eq!(read.all.ops, written.all.ops);
        assert_eq!(read.all.cdf.len(), written.all.cdf.len());
        assert!((read.all.iops - written.all.iops).abs() <= written.all.iops * 1e-12);
        assert_eq!(read.storage, written.storage);
    }

    let table = keel_bench::report::markdown_table(&read_back.results);
    let rows: Vec<&str> = table.lines().collect();
    // Header, separator, 1 row for sync-qd1 (writes), 2 for randrw (reads, writes).
    assert_eq!(rows.len(), 5, "{table}");
    assert!(rows[2].contains("sync-qd1") && rows[2].contains("| write |"));
    assert!(
        rows[3].contains("| mixed | randrw-qd64 | read |"),
        "{}",
        rows[3]
    );

    let svg = keel_bench::report::svg_cdf(&read_back.results);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<polyline").count(), 2);
    assert!(svg.contains("mixed randrw-qd64"));
}
