//! End-to-end tests of `keel bench durability` against targets whose honesty we control.
//!
//! The NBD targets are a tiny in-test NBD server (`common`: raw tokio TCP, fixed newstyle +
//! OPT_GO, READ/WRITE/FLUSH/FUA) that models a disk with a volatile write cache: writes land in a
//! volatile list and reach the durable image only on FLUSH (or FUA). A "crash" kills every
//! connection and drops the volatile list, as a power cut would. The honest server moves the
//! volatile writes to the durable image before acknowledging a FLUSH (or FUA write); the liar
//! acknowledges both at once and never writes back, like a cache that ignores flush commands.
//! Writer → crash mid-run → verify must FAIL for the liar and PASS for the honest server. The file test uses a real file with fdatasync under /var/tmp.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{Behaviour, TestServer, CRASH_AFTER_REQUESTS, EXPORT_SIZE_BYTES, WAIT_MAX};
use keel_bench::durability::{self, VerifyOptions, WriteOptions};
use keel_bench::target::SyncMethod;

fn log_path(name: &str) -> PathBuf {
    // Cargo makes this directory when it builds the test, not when it runs it.
    let directory = Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(directory).expect("creating the test's temporary directory");
    directory.join(format!("{name}-{}.log", std::process::id()))
}

fn write_options(target: &str, log: &Path, sync_method: SyncMethod) -> WriteOptions {
    WriteOptions {
        target: target.to_string(),
        log: log.to_path_buf(),
        size_bytes: EXPORT_SIZE_BYTES as u64,
        block_size_bytes: 4096,
        writers: 4,
        writes_per_flush: 8,
        sync_method,
        runtime: WAIT_MAX,
        writes_max: Some(1_000_000),
    }
}

/// Runs the writer against the server, crashes the server mid-run, and returns what verify says.
fn write_crash_verify(behaviour: Behaviour, sync_method: SyncMethod) -> durability::VerifyReport {
    let server = TestServer::start(behaviour, false);
    let log = log_path(&format!("{behaviour:?}-{sync_method:?}"));
    let options = write_options(&server.uri(), &log, sync_method);
    let writer = std::thread::spawn(move || durability::write(&options));
    let started = Instant::now();
    while server.requests.load(Ordering::SeqCst) < CRASH_AFTER_REQUESTS {
        assert!(started.elapsed() < WAIT_MAX, "the writer made no progress");
        std::thread::sleep(Duration::from_millis(1));
    }
    server.crash();
    let summary = writer.join().unwrap().unwrap();
    assert!(
        summary.target_failed,
        "the writer must see the crash: {summary:?}"
    );
    assert!(summary.acknowledged > 0, "{summary:?}");
    // The server "restarts" with whatever was durable; the listener still accepts.
    let report = durability::verify(&VerifyOptions {
        target: server.uri(),
        log: log.clone(),
    })
    .unwrap();
    assert_eq!(report.acknowledged_writes, summary.acknowledged);
    let _ = std::fs::remove_file(&log);
    report
}

// Proves verify PASSes a target that makes flushed writes durable, even though writes it had
// not yet acknowledged were lost in the crash (they must not count against it).
#[test]
fn honest_nbd_target_passes_after_a_crash() {
    let report = write_crash_verify(Behaviour::Honest, SyncMethod::Fdatasync);
    assert!(report.passed(), "{}", report.render_text());
    assert!(report.offsets_checked > 0);
}

// Proves the FUA path: writes acknowledged by an honest FUA survive.
#[test]
fn honest_nbd_target_passes_with_fua_writes() {
    let report = write_crash_verify(Behaviour::Honest, SyncMethod::Dsync);
    assert!(report.passed(), "{}", report.render_text());
}

// Proves verify FAILs a target that acknowledges FLUSH without making data durable: every
// acknowledged write lost with its volatile cache is reported missing.
#[test]
fn lying_nbd_target_fails_after_a_crash() {
    let report = write_crash_verify(Behaviour::Liar, SyncMethod::Fdatasync);
    assert!(!report.passed(), "{}", report.render_text());
    assert_eq!(report.missing.len() as u64, report.offsets_checked);
    assert!(report.render_text().contains("FAIL"));
}

// Proves the command-line entry point exits with an error (non-zero exit code) on FAIL and
// succeeds on PASS.
#[test]
fn verify_command_errors_on_fail() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: keel_bench::BenchCommand,
    }
    let server = TestServer::start(Behaviour::Liar, false);
    let log = log_path("cli-liar");
    let writer_options = WriteOptions {
        writes_max: Some(64),
        ..write_options(&server.uri(), &log, SyncMethod::Fdatasync)
    };
    let summary = durability::write(&writer_options).unwrap();
    assert_eq!(summary.acknowledged, 64);
    let verify = |log: &Path| {
        let cli = Cli::try_parse_from([
            "keel-bench",
            "durability",
            "verify",
            "--target",
            &server.uri(),
            "--log",
            log.to_str().unwrap(),
        ])
        .unwrap();
        keel_bench::run(cli.bench)
    };
    // Before the crash everything is readable (from the cache): PASS.
    assert!(verify(&log).is_ok());
    server.crash();
    let error = verify(&log).unwrap_err();
    assert!(error.to_string().contains("FAILED"), "{error}");
    let _ = std::fs::remove_file(&log);
}

// Proves the check on a real file: records written with fdatasync on /var/tmp verify PASS;
// a flipped byte in one logged record is reported corrupt and a zeroed one missing.
#[test]
fn file_target_passes_then_fails_on_damage() {
    use std::os::unix::fs::FileExt;
    let directory = tempfile::Builder::new()
        .prefix("keel-bench-durability-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let status = std::process::Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(directory.path())
        .output()
        .expect("`stat` must be installed (Debian package coreutils)");
    assert_ne!(String::from_utf8_lossy(&status.stdout).trim(), "tmpfs");
    let target = directory.path().join("target.dat");
    let log = directory.path().join("ack.log");
    let options = WriteOptions {
        size_bytes: 2 * 1024 * 1024,
        writers: 2,
        writes_max: Some(400),
        ..write_options(target.to_str().unwrap(), &log, SyncMethod::Fdatasync)
    };
    let summary = durability::write(&options).unwrap();
    assert_eq!(summary.acknowledged, 400, "{summary:?}");
    let verify = || {
        durability::verify(&VerifyOptions {
            target: target.to_str().unwrap().to_string(),
            log: log.clone(),
        })
        .unwrap()
    };
    let report = verify();
    assert!(report.passed(), "{}", report.render_text());

    // Damage two logged blocks.
    let logged: Vec<u64> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .skip(1)
        .map(|line| line.split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect();
    let mut offsets = logged.clone();
    offsets.sort_unstable();
    offsets.dedup();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&target)
        .unwrap();
    file.write_all_at(&[0xFF], offsets[0] + 100).unwrap();
    file.write_all_at(&[0u8; 4096], offsets[1]).unwrap();
    file.sync_all().unwrap();
    let report = verify();
    assert!(!report.passed());
    assert_eq!(report.corrupt.len(), 1, "{}", report.render_text());
    assert_eq!(report.corrupt[0].offset, offsets[0]);
    assert_eq!(report.missing.len(), 1, "{}", report.render_text());
    assert_eq!(report.missing[0].offset, offsets[1]);
}

// Proves the log can live in another process: the writer streams acknowledgements over TCP to
// `serve_log`, which makes each batch durable before answering; after a crash of the target
// the log server's file holds every acknowledged write (plus the header) and verify PASSes
// against the honest target and FAILs against the liar.
#[test]
fn log_streamed_to_a_log_server_over_tcp() {
    for behaviour in [Behaviour::Honest, Behaviour::Liar] {
        let server = TestServer::start(behaviour, false);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let log = log_path(&format!("tcp-{behaviour:?}"));
        let log_file = log.clone();
        let log_server = std::thread::spawn(move || durability::serve_log(&listener, &log_file));
        let options = write_options(
            &server.uri(),
            Path::new(&format!("tcp://{address}")),
            SyncMethod::Fdatasync,
        );
        let writer = std::thread::spawn(move || durability::write(&options));
        let started = Instant::now();
        while server.requests.load(Ordering::SeqCst) < CRASH_AFTER_REQUESTS {
            assert!(started.elapsed() < WAIT_MAX, "the writer made no progress");
            std::thread::sleep(Duration::from_millis(1));
        }
        server.crash();
        let summary = writer.join().unwrap().unwrap();
        let lines = log_server.join().unwrap().unwrap();
        assert_eq!(lines, summary.acknowledged + 1, "{summary:?}");
        let report = durability::verify(&VerifyOptions {
            target: server.uri(),
            log: log.clone(),
        })
        .unwrap();
        assert_eq!(report.acknowledged_writes, summary.acknowledged);
        assert_eq!(
            report.passed(),
            behaviour == Behaviour::Honest,
            "{}",
            report.render_text()
        );
        let _ = std::fs::remove_file(&log);
    }
}
