//! Real NBD clients against the server: qemu-io (Debian `qemu-utils`), nbdinfo (Debian
//! `libnbd-bin`) and fio's nbd engine (Debian `fio`), each run as a subprocess against `serve`
//! started on 127.0.0.1:0 inside this test process, over an in-memory export.
//!
//! A missing tool FAILS the test with the Debian package to install; nothing is skipped.
//! Every subprocess is bounded by [`CLIENT_TIMEOUT`] and killed (by its own handle) if it
//! overruns.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use common::Server;
use keel_nbd::testing::MemoryExports;
use keel_nbd::Exports;
use tokio::process::Command;

/// Longest a client subprocess may run.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(180);

/// Fails the test unless `program` is on PATH, naming the Debian package that provides it.
fn require_tool(program: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "`{program}` is not installed: run `apt-get install -y {package}` (Debian package `{package}`)"
    );
}

/// Runs a command to completion within [`CLIENT_TIMEOUT`]; returns its output.
async fn run(program: &str, arguments: &[&str]) -> Output {
    let child = Command::new(program)
        .args(arguments)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(CLIENT_TIMEOUT, child)
        .await
        .unwrap_or_else(|_| panic!("{program} did not finish within {CLIENT_TIMEOUT:?}"))
        .unwrap_or_else(|error| panic!("{program} could not be started: {error}"));
    output
}

fn text(output: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Serves `exports` plus the "mem" export that `Server::assert_serves` uses.
async fn start(exports: &Arc<MemoryExports>) -> Server {
    exports.insert("mem", common::MEM_SIZE_BYTES);
    Server::start(Arc::clone(exports) as Arc<dyn Exports>).await
}

// Proves qemu's NBD client negotiates with the server and that its writes (data, zeroes,
// discard, flush) land and read back with the expected patterns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_io_writes_and_reads_back() {
    require_tool("qemu-io", "qemu-utils");
    let exports = Arc::new(MemoryExports::new());
    let export = exports.insert("vol", 16 << 20);
    let server = start(&exports).await;
    let uri = format!("nbd://{}/vol", server.address);
    let output = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            &uri,
            "-c",
            "write -P 0xab 0 1M",
            "-c",
            "read -P 0xab 0 1M",
            "-c",
            "write -P 0xcd 1M 3M",
            "-c",
            "write -z 2M 1M",
            "-c",
            "flush",
            "-c",
            "read -P 0xcd 1M 1M",
            "-c",
            "read -P 0 2M 1M",
            "-c",
            "read -P 0xcd 3M 1M",
            "-c",
            "discard 8M 1M",
        ],
    )
    .await;
    let report = text(&output);
    assert!(output.status.success(), "qemu-io failed:\n{report}");
    assert!(
        !report.contains("failed") && !report.contains("error"),
        "qemu-io reported a failure:\n{report}"
    );
    assert_eq!(
        report.matches("read 1048576/1048576 bytes").count(),
        4,
        "{report}"
    );
    assert_eq!(export.snapshot(0, 1 << 20), vec![0xab; 1 << 20]);
    assert_eq!(export.snapshot(2 << 20, 1 << 20), vec![0; 1 << 20]);
    assert!(export.flushes() >= 1, "qemu's flush reached the export");
    server.assert_serves().await;
    server.stop().await;
}

// Proves libnbd's nbdinfo lists every export with the capabilities the server advertises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_lists_exports() {
    require_tool("nbdinfo", "libnbd-bin");
    let exports = Arc::new(MemoryExports::new());
    exports.insert("alpha", 8 << 20);
    exports.insert("beta", 4 << 20);
    let server = start(&exports).await;
    let uri = format!("nbd://{}", server.address);
    let output = run("nbdinfo", &["--list", &uri]).await;
    let report = text(&output);
    assert!(output.status.success(), "nbdinfo failed:\n{report}");
    for expected in [
        "export=\"alpha\"",
        "export=\"beta\"",
        "export=\"mem\"",
        "export-size: 8388608",
        "export-size: 4194304",
        "can_flush: true",
        "can_fua: true",
        "can_multi_conn: true",
        "can_trim: true",
        "can_zero: true",
        "block_size_minimum: 1",
        "block_size_preferred: 4096",
        "block_size_maximum: 33554432",
    ] {
        assert!(
            report.contains(expected),
            "missing {expected:?} in:\n{report}"
        );
    }
    // A missing export is reported as an error by the client, not a hang or a crash.
    let missing = run("nbdinfo", &[&format!("{uri}/missing")]).await;
    assert!(!missing.status.success(), "{}", text(&missing));
    server.assert_serves().await;
    server.stop().await;
}

// Proves fio's nbd engine (libnbd, queue depth 32, two jobs on two connections to one export,
// a flush every 64 writes) writes random 4 KiB blocks and reads every one back with a valid
// CRC32C.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fio_random_writes_verify() {
    require_tool("fio", "fio");
    let help = run("fio", &["--enghelp=nbd"]).await;
    assert!(
        help.status.success() && String::from_utf8_lossy(&help.stdout).contains("uri"),
        "this fio was built without the nbd engine (Debian's `fio` package has it):\n{}",
        text(&help)
    );
    let exports = Arc::new(MemoryExports::new());
    exports.insert("vol", 64 << 20);
    let server = start(&exports).await;
    let uri = format!("--uri=nbd://{}/vol", server.address);
    let output = run(
        "fio",
        &[
            "--name=nbdcheck",
            "--ioengine=nbd",
            &uri,
            "--rw=randwrite",
            "--bs=4k",
            "--size=32M",
            "--numjobs=2",
            "--offset_increment=32M",
            "--iodepth=32",
            "--fsync=64",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--group_reporting",
        ],
    )
    .await;
    let report = text(&output);
    assert!(output.status.success(), "fio failed:\n{report}");
    assert!(report.contains("err= 0"), "fio reported errors:\n{report}");
    assert!(
        !report.contains("verify failed") && !report.contains("bad magic"),
        "fio verification failed:\n{report}"
    );
    // Both jobs wrote and then read back their 32 MiB.
    assert!(
        report.contains("io=64.0MiB"),
        "fio did less I/O than asked:\n{report}"
    );
    server.assert_serves().await;
    server.stop().await;
}

/// An nbdfuse mount; dropping it unmounts (lazily, so a panicking test still cleans up) and the
/// nbdfuse child is killed by its handle (`kill_on_drop`).
struct FuseMount {
    directory: tempfile::TempDir,
    _nbdfuse: tokio::process::Child,
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.directory.path())
            .status();
    }
}

// Proves the path BENCHMARKS.md uses for Postgres (NBD → nbdfuse → file → ext4) works against
// the server: nbdfuse exposes the export as a file, unaligned writes through it land, mkfs.ext4
// builds a filesystem on it (its superblock reaches the export) and e2fsck finds it clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdfuse_file_holds_an_ext4_filesystem() {
    require_tool("nbdfuse", "libnbd-bin");
    require_tool("mkfs.ext4", "e2fsprogs");
    require_tool("e2fsck", "e2fsprogs");
    assert!(
        std::path::Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing: nbdfuse needs the fuse kernel module (Debian package `fuse3`)"
    );
    let exports = Arc::new(MemoryExports::new());
    let export = exports.insert("vol", 64 << 20);
    let server = start(&exports).await;
    let directory = tempfile::Builder::new()
        .prefix("keel-nbdfuse-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let file = directory.path().join("disk");
    let nbdfuse = Command::new("nbdfuse")
        .arg(&file)
        .arg(format!("nbd://{}/vol", server.address))
        .kill_on_drop(true)
        .spawn()
        .expect("nbdfuse starts");
    let mount = FuseMount {
        directory,
        _nbdfuse: nbdfuse,
    };
    // Wait (bounded) for the mount to show the export as a file of the right size.
    let mut ready = false;
    for _ in 0..200 {
        if std::fs::metadata(&file).is_ok_and(|meta| meta.len() == 64 << 20) {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "nbdfuse did not expose {} in time", file.display());

    let path = file.clone();
    tokio::task::spawn_blocking(move || {
        use std::os::unix::fs::FileExt;
        let disk = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        disk.write_all_at(b"hello", 4097).unwrap();
        disk.sync_all().unwrap();
        let mut back = [0u8; 7];
        disk.read_exact_at(&mut back, 4096).unwrap();
        assert_eq!(&back, b"\0hello\0");
    })
    .await
    .unwrap();
    assert_eq!(export.snapshot(4097, 5), b"hello");

    let file_argument = file.to_str().unwrap();
    let mkfs = run("mkfs.ext4", &["-q", "-F", file_argument]).await;
    assert!(mkfs.status.success(), "mkfs.ext4 failed:\n{}", text(&mkfs));
    let fsck = run("e2fsck", &["-f", "-n", file_argument]).await;
    assert!(
        fsck.status.success(),
        "e2fsck found problems:\n{}",
        text(&fsck)
    );
    // The ext4 superblock (at byte 1024) carries its magic 0xEF53 at offset 56, little-endian.
    assert_eq!(export.snapshot(1024 + 56, 2), vec![0x53, 0xef]);
    drop(mount);
    server.assert_serves().await;
    server.stop().await;
}
