//! The NBD client against the in-test server with replies deliberately out of order: many
//! threads share one connection, every reply must reach the request with its handle (the tag
//! map), and data must round-trip. Then a profile runs over NBD at queue depth 64.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{Behaviour, TestServer, EXPORT_SIZE_BYTES};
use keel_bench::nbd::NbdClient;
use keel_bench::profile::{self, EngineChoice, Profile, RunOptions};
use keel_bench::target::SyncMethod;

/// Threads sharing the connection, and rounds each makes.
const THREADS: usize = 32;
const ROUNDS: usize = 20;
const BLOCK_BYTES: usize = 4096;

// Proves pipelining is correct with out-of-order replies: 32 threads each write a block
// pattern of their own (thread, round) to their own block and read it back through one
// connection while the server delays each reply differently; every read returns its thread's
// latest data, FLUSH and FUA are answered, and the export size is what the server announced.
#[test]
fn pipelined_requests_get_their_own_replies() {
    let server = TestServer::start(Behaviour::Honest, true);
    let client =
        NbdClient::connect(&server.address.to_string(), "test", SyncMethod::Dsync).unwrap();
    assert_eq!(client.export_size_bytes(), EXPORT_SIZE_BYTES as u64);
    assert!(client.supports_fua());
    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let client = &client;
            scope.spawn(move || {
                let offset = (thread * BLOCK_BYTES) as u64;
                let mut read_back = vec![0u8; BLOCK_BYTES];
                for round in 0..ROUNDS {
                    let pattern: Vec<u8> = (0..BLOCK_BYTES)
                        .map(|index| (index + thread * 7 + round * 13) as u8)
                        .collect();
                    client.write(offset, &pattern, round % 2 == 0).unwrap();
                    if round % 5 == 0 {
                        client.flush().unwrap();
                    }
                    client.read(offset, &mut read_back).unwrap();
                    assert_eq!(read_back, pattern, "thread {thread} round {round}");
                }
            });
        }
    });
    // A request the server rejects comes back as an error, and the connection stays usable.
    let mut beyond = vec![0u8; BLOCK_BYTES];
    assert!(client.read(EXPORT_SIZE_BYTES as u64, &mut beyond).is_err());
    client.read(0, &mut beyond).unwrap();
}

// Proves a block profile runs end to end over NBD at queue depth 64 with out-of-order replies,
// after filling the volume, counting every op and naming how writes were made durable.
#[test]
fn randrw_and_sync_profiles_run_over_nbd() {
    let server = TestServer::start(Behaviour::Honest, true);
    let mut options = RunOptions {
        profile: Profile::RandrwQd64,
        target: server.uri(),
        runtime: Duration::from_secs(20),
        size_bytes: EXPORT_SIZE_BYTES as u64,
        block_size_bytes: None,
        queue_depth: None,
        writers: Vec::new(),
        read_percent: None,
        sync_method: None,
        engine: EngineChoice::Auto,
        direct: None,
        ops_max: Some(3000),
        fill_volume: true,
        label: None,
        s3: Default::default(),
    };
    let result = &profile::run(&options).unwrap()[0];
    assert_eq!(result.target_kind, "nbd");
    assert_eq!(result.all.ops, 3000);
    assert!(
        result.engine.starts_with("threads (64"),
        "{}",
        result.engine
    );
    // The volume was filled (and flushed) before the reads: no block is left unwritten.
    let disk = server.disk.lock().unwrap();
    assert!(disk
        .durable
        .chunks(4096)
        .all(|block| block.iter().any(|&byte| byte != 0)));
    drop(disk);

    options.profile = Profile::SyncQd1;
    options.ops_max = Some(100);
    let result = &profile::run(&options).unwrap()[0];
    assert_eq!(result.writes.as_ref().unwrap().ops, 100);
    assert_eq!(result.durability, "NBD WRITE with FUA");
    options.sync_method = Some(SyncMethod::Fdatasync);
    let result = &profile::run(&options).unwrap()[0];
    assert_eq!(result.durability, "NBD FLUSH after each write");
}
