//! Crash test: a child process writes under load (8 threads, synced and buffered writes mixed
//! with flushes, overwrites and multi-op groups) and reports every write the store acknowledged
//! as durable on its stdout; the parent kills it with SIGKILL at a random moment, reopens the
//! store, and checks that every acknowledged write is readable with valid checksums (a key holds
//! the acknowledged version or a later one, never older, never corrupt), and that every group is
//! all-or-nothing. Many rounds on a real filesystem.
//!
//! The child is this same test binary re-executed with `KEEL_CRASH_CHILD=<dir>`.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use keel_store::{meta_key, Compression, Durability, Store, StoreConfig, WriteOp};

const ROUNDS: usize = 12;
const WRITER_THREADS: u64 = 8;
const KEYS_PER_THREAD: u64 = 50;

fn key_of(thread: u64, key: u64) -> Vec<u8> {
    meta_key(format!("t{thread:02}/k{key:04}").as_bytes())
}

/// value = 8-byte version, then bytes derived from (key, version).
fn value_of(thread: u64, key: u64, version: u64) -> Vec<u8> {
    let mut value = version.to_le_bytes().to_vec();
    value.extend(value_for(
        thread * 10_000 + key,
        version,
        1000 + (key as usize * 37) % 3000,
    ));
    value
}

fn open_store(dir: &std::path::Path) -> Store {
    let mut config = StoreConfig::new(vec![dir.to_path_buf()]);
    config.segment_size_max_bytes = 4 << 20;
    config.checkpoint_interval_bytes = 1 << 20;
    config.reserve_bytes = 0;
    Store::open(config).unwrap()
}

/// Child: write forever (until killed), printing "ack THREAD KEY VERSION" after each durable ack
/// and "group THREAD VERSION" after each durable group of keys 1000..1004.
fn child(dir: &str) {
    let store = open_store(std::path::Path::new(dir));
    let start_version: u64 = std::env::var("KEEL_CRASH_ROUND")
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1_000_000;
    let threads: Vec<_> = (0..WRITER_THREADS)
        .map(|thread| {
            let store = store.clone();
            std::thread::spawn(move || {
                let stdout = std::io::stdout();
                let mut version = start_version;
                let mut unflushed: Vec<(u64, u64)> = Vec::new();
                loop {
                    version += 1;
                    let key = version % KEYS_PER_THREAD;
                    let op = WriteOp::put(
                        key_of(thread, key),
                        value_of(thread, key, version),
                        Compression::Lz4,
                    );
                    match version % 7 {
                        0 => {
                            let ops = (1000..1004)
                                .map(|k| {
                                    WriteOp::put(
                                        key_of(thread, k),
                                        value_of(thread, k, version),
                                        Compression::None,
                                    )
                                })
                                .collect();
                            store.write(ops, Durability::Sync).unwrap();
                            writeln!(stdout.lock(), "group {thread} {version}").unwrap();
                        }
                        1..=3 => {
                            store.write(vec![op], Durability::Buffered).unwrap();
                            unflushed.push((key, version));
                            if unflushed.len() >= 3 {
                                store.flush().unwrap();
                                let mut out = stdout.lock();
                                for (key, version) in unflushed.drain(..) {
                                    writeln!(out, "ack {thread} {key} {version}").unwrap();
                                }
                            }
                        }
                        _ => {
                            store.write(vec![op], Durability::Sync).unwrap();
                            writeln!(stdout.lock(), "ack {thread} {key} {version}").unwrap();
                        }
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        let _ = thread.join();
    }
}

#[test]
fn acknowledged_writes_survive_kill_9() {
    if let Ok(dir) = std::env::var("KEEL_CRASH_CHILD") {
        child(&dir);
        return;
    }
    let dir = fresh_dir("crash");
    // acknowledged[(thread, key)] = highest acknowledged version; groups[thread] = version.
    let mut acknowledged: HashMap<(u64, u64), u64> = HashMap::new();
    let mut groups: HashMap<u64, u64> = HashMap::new();
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    for round in 1..=ROUNDS {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let run_for = Duration::from_millis(100 + seed % 600);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "acknowledged_writes_survive_kill_9",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("KEEL_CRASH_CHILD", &dir)
            .env("KEEL_CRASH_ROUND", round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut lines = Vec::new();
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(line) => lines.push(line),
                    Err(_) => break,
                }
            }
            lines
        });
        std::thread::sleep(run_for);
        // SIGKILL: no destructor, no flush, no clean close of the index.
        child.kill().unwrap();
        child.wait().unwrap();
        let lines = reader.join().unwrap();
        let mut acks_this_round = 0;
        for line in &lines {
            let fields: Vec<&str> = line.split_whitespace().collect();
            match fields.as_slice() {
                ["ack", t, k, v] => {
                    let entry = acknowledged
                        .entry((t.parse().unwrap(), k.parse().unwrap()))
                        .or_default();
                    *entry = (*entry).max(v.parse().unwrap());
                    acks_this_round += 1;
                }
                ["group", t, v] => {
                    let entry = groups.entry(t.parse().unwrap()).or_default();
                    *entry = (*entry).max(v.parse().unwrap());
                    acks_this_round += 1;
                }
                // The last line may be cut by the kill.
                _ => {}
            }
        }
        assert!(
            acks_this_round > 0 || round > 1,
            "the child acknowledged nothing in round {round}"
        );

        let started = Instant::now();
        let store = open_store(&dir);
        let reopen = started.elapsed();
        for ((thread, key), version) in &acknowledged {
            let value = store
                .get(&key_of(*thread, *key))
                .unwrap_or_else(|e| panic!("round {round}: key {thread}/{key} unreadable: {e}"))
                .unwrap_or_else(|| {
                    panic!("round {round}: acknowledged key {thread}/{key} v{version} lost")
                });
            let stored_version = u64::from_le_bytes(value[..8].try_into().unwrap());
            assert!(
                stored_version >= *version,
                "round {round}: key {thread}/{key} went back from v{version} to v{stored_version}"
            );
            assert_eq!(value, value_of(*thread, *key, stored_version));
        }
        for (thread, version) in &groups {
            let versions: Vec<u64> = (1000..1004)
                .map(|k| {
                    let value = store.get(&key_of(*thread, k)).unwrap().unwrap();
                    u64::from_le_bytes(value[..8].try_into().unwrap())
                })
                .collect();
            assert!(
                versions.iter().all(|v| v == &versions[0]),
                "round {round}: group torn: {versions:?}"
            );
            assert!(
                versions[0] >= *version,
                "round {round}: group of thread {thread} lost v{version}"
            );
        }
        eprintln!("round {round}: {acks_this_round} acks, killed after {run_for:?}, reopened in {reopen:?}");
        drop(store);
    }
}
