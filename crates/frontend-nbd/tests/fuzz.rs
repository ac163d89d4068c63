//! Fuzz-style tests: random and mutated bytes fed to the pure parsers (proptest), and whole
//! mutated sessions fed to the server, both over a Unix socket pair (`serve_stream`) and over TCP
//! to the real `serve` loop. The properties: nothing panics, every session ends in bounded time,
//! accepted requests are always in bounds, and the server serves a good client afterwards.
//! Loops are seeded (reproducible) and bounded in count and time.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Client, Server, MEM_SIZE_BYTES};
use keel_nbd::protocol::*;
use keel_nbd::testing::MemoryExports;
use keel_nbd::{Exports, REQUEST_PAYLOAD_MAX_BYTES};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    // Proves the option decoder is total: any option code with any data yields a decoded option
    // or a refusal, never a panic.
    #[test]
    fn option_parser_never_panics(
        option in prop_oneof![0u32..16, any::<u32>()],
        data in proptest::collection::vec(any::<u8>(), 0..600),
    ) {
        let _ = parse_option(option, &data);
    }

    // Proves NBD_OPT_GO/INFO bodies built the way a client builds them decode to what was sent.
    #[test]
    fn go_option_round_trips(
        name in "[a-zA-Z0-9/_.-]{0,64}",
        information in proptest::collection::vec(any::<u16>(), 0..8),
    ) {
        let data = Client::info_data(&name, &information);
        let expected = InfoRequest { name, information };
        prop_assert_eq!(parse_option(OPT_GO, &data), Ok(OptionRequest::Go(expected.clone())));
        prop_assert_eq!(parse_option(OPT_INFO, &data), Ok(OptionRequest::Info(expected)));
    }

    // Proves the fixed-size handshake decoders never panic on any input.
    #[test]
    fn handshake_headers_never_panic(header in any::<[u8; 16]>(), flags in any::<[u8; 4]>()) {
        let _ = OptionHeader::parse(&header);
        let _ = parse_client_flags(flags);
    }

    // Proves any 28 bytes decode without panicking, and every request the checker accepts is
    // aligned, inside the export, within the payload limit, and not a write on a read-only
    // export: the export only ever sees valid ranges.
    #[test]
    fn accepted_requests_are_valid(
        mut bytes in any::<[u8; 28]>(),
        keep_magic in any::<bool>(),
        size_blocks in 0u64..4096,
        block_shift in 0u32..17,
        read_only in any::<bool>(),
        small in any::<bool>(),
    ) {
        if keep_magic {
            bytes[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        }
        if small {
            // Make in-range requests likely: small offsets and lengths.
            bytes[16..22].fill(0);
            bytes[24..26].fill(0);
        }
        let Ok(header) = RequestHeader::parse(&bytes) else { return Ok(()); };
        prop_assert_eq!(header.encode(), bytes);
        let geometry = ExportGeometry {
            size_bytes: size_blocks << block_shift,
            minimum_block_size_bytes: 1 << block_shift,
            preferred_block_size_bytes: (1 << block_shift).max(512),
            read_only,
        };
        let Ok(command) = check_request(&header, &geometry) else { return Ok(()); };
        let block = u64::from(geometry.minimum_block_size_bytes);
        match command {
            Command::Read { offset, length }
            | Command::Write { offset, length, .. }
            | Command::Trim { offset, length, .. }
            | Command::WriteZeroes { offset, length, .. } => {
                prop_assert!(offset % block == 0 && u64::from(length) % block == 0);
                prop_assert!(offset + u64::from(length) <= geometry.size_bytes);
                if matches!(command, Command::Read { .. } | Command::Write { .. }) {
                    prop_assert!(length <= REQUEST_PAYLOAD_MAX_BYTES);
                }
                prop_assert!(!(read_only && command.is_write()));
            }
            Command::Flush | Command::Disconnect => {}
        }
    }
}

/// A valid session: handshake with INFO, LIST and GO, then one of each command, then DISC.
fn valid_session() -> Vec<u8> {
    let mut bytes = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    let option = |bytes: &mut Vec<u8>, code: u32, data: &[u8]| {
        let header = OptionHeader {
            option: code,
            length_bytes: data.len() as u32,
        };
        bytes.extend_from_slice(&header.encode());
        bytes.extend_from_slice(data);
    };
    option(
        &mut bytes,
        OPT_INFO,
        &Client::info_data("mem", &[INFO_BLOCK_SIZE]),
    );
    option(&mut bytes, OPT_LIST, &[]);
    option(&mut bytes, OPT_STRUCTURED_REPLY, &[]);
    option(
        &mut bytes,
        OPT_GO,
        &Client::info_data("mem", &[INFO_BLOCK_SIZE]),
    );
    let requests: [(u16, u16, u64, u32); 7] = [
        (CMD_FLAG_FUA, CMD_WRITE, 0, 4096),
        (0, CMD_READ, 0, 8192),
        (CMD_FLAG_NO_HOLE, CMD_WRITE_ZEROES, 4096, 4096),
        (0, CMD_TRIM, 8192, 4096),
        (0, CMD_FLUSH, 0, 0),
        (0, CMD_READ, MEM_SIZE_BYTES - 4096, 4096),
        (0, CMD_DISC, 0, 0),
    ];
    for (cookie, (flags, command, offset, length)) in requests.into_iter().enumerate() {
        let payload = if command == CMD_WRITE {
            vec![0xa5; length as usize]
        } else {
            Vec::new()
        };
        bytes.extend(Client::request_bytes(
            flags,
            command,
            cookie as u64,
            offset,
            length,
            &payload,
        ));
    }
    bytes
}

/// Values that tend to sit on boundaries the server checks.
const INTERESTING: [u32; 10] = [
    0,
    1,
    4095,
    4096,
    0x7fff_ffff,
    0xffff_ffff,
    REQUEST_PAYLOAD_MAX_BYTES,
    REQUEST_PAYLOAD_MAX_BYTES + 1,
    3 << 20,
    16 * 1024 + 1,
];

/// Applies 1-4 random mutations: byte changes, truncation, insertion, boundary values,
/// duplication.
fn mutate(rng: &mut StdRng, mut bytes: Vec<u8>) -> Vec<u8> {
    for _ in 0..rng.gen_range(1..=4) {
        if bytes.is_empty() {
            bytes.push(rng.gen());
        }
        let at = rng.gen_range(0..bytes.len());
        match rng.gen_range(0..5) {
            0 => bytes[at] = rng.gen(),
            1 => bytes.truncate(at),
            2 => {
                let insert: Vec<u8> = (0..rng.gen_range(1..32)).map(|_| rng.gen()).collect();
                bytes.splice(at..at, insert);
            }
            3 => {
                let value = INTERESTING[rng.gen_range(0..INTERESTING.len())].to_be_bytes();
                let end = (at + 4).min(bytes.len());
                bytes[at..end].copy_from_slice(&value[..end - at]);
            }
            _ => {
                let end = rng.gen_range(at..=bytes.len().min(at + 64));
                let copy = bytes[at..end].to_vec();
                bytes.splice(at..at, copy);
            }
        }
    }
    bytes
}

/// Sends `bytes` as one client session over `stream`, reading whatever comes back until the
/// server closes. Returns the bytes received.
async fn play<S>(stream: S, bytes: Vec<u8>) -> Vec<u8>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let (mut reader, mut writer) = tokio::io::split(stream);
    let send = async move {
        // The server may close early (bad magic, refused flags): a failed write is expected.
        let _ = writer.write_all(&bytes).await;
        let _ = writer.shutdown().await;
        writer
    };
    let receive = async move {
        let mut received = Vec::new();
        let _ = reader.read_to_end(&mut received).await;
        received
    };
    let (_writer, received) = tokio::join!(send, receive);
    received
}

/// A session over a Unix socket pair, served by `serve_stream` on a blocking thread; returns
/// the client's end and the session.
fn unix_session(
    exports: &Arc<dyn Exports>,
) -> (
    tokio::net::UnixStream,
    tokio::task::JoinHandle<Result<(), keel_nbd::NbdError>>,
) {
    let (client, server) = std::os::unix::net::UnixStream::pair().unwrap();
    client.set_nonblocking(true).unwrap();
    let exports = Arc::clone(exports);
    let session = tokio::task::spawn_blocking(move || {
        keel_nbd::serve_stream(server, exports, keel_nbd::HANDSHAKE_TIMEOUT)
    });
    (tokio::net::UnixStream::from_std(client).unwrap(), session)
}

fn memory_exports() -> Arc<dyn Exports> {
    let exports = MemoryExports::new();
    exports.insert("mem", MEM_SIZE_BYTES);
    Arc::new(exports)
}

// Proves the unmutated script is a valid session end to end (so the mutations below start from
// something the server accepts), then that 3000 mutated sessions over a Unix socket pair each end
// in bounded time without a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_sessions_end_cleanly_in_memory() {
    let exports = memory_exports();
    let (client, session) = unix_session(&exports);
    let received = play(client, valid_session()).await;
    session.await.unwrap().unwrap();
    // Greeting, 5 option replies for INFO (export, block size, ACK), LIST (one entry, ACK),
    // STRUCTURED_REPLY (UNSUP), GO (export, block size, ACK), then 6 replies and 12 KiB of data.
    assert!(
        received.len() > 18 + 6 * 16 + 12288,
        "got {} bytes",
        received.len()
    );

    let mut rng = StdRng::seed_from_u64(0x6e62_6400);
    let deadline = Instant::now() + Duration::from_secs(60);
    for case in 0..3000 {
        if Instant::now() > deadline {
            break;
        }
        let bytes = mutate(&mut rng, valid_session());
        let (client, session) = unix_session(&exports);
        let played =
            tokio::time::timeout(Duration::from_secs(10), play(client, bytes.clone())).await;
        assert!(played.is_ok(), "case {case} hung; input {bytes:02x?}");
        let ended = tokio::time::timeout(Duration::from_secs(10), session).await;
        match ended {
            Ok(Ok(_)) => {}
            Ok(Err(join)) => panic!("case {case} panicked the session: {join}; input {bytes:02x?}"),
            Err(_) => panic!("case {case}: session did not end; input {bytes:02x?}"),
        }
    }
}

// Proves random and mutated sessions over TCP never take the real server down: after 500 of
// them (bounded in time) a good client is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_sessions_over_tcp_leave_the_server_serving() {
    let server = Server::start(memory_exports()).await;
    let mut rng = StdRng::seed_from_u64(0x6b65_656c);
    let deadline = Instant::now() + Duration::from_secs(60);
    for case in 0..500 {
        if Instant::now() > deadline {
            break;
        }
        let bytes = if case % 5 == 0 {
            // Pure noise after the greeting.
            (0..rng.gen_range(0..256)).map(|_| rng.gen()).collect()
        } else {
            mutate(&mut rng, valid_session())
        };
        let stream = tokio::net::TcpStream::connect(server.address)
            .await
            .unwrap();
        let played = tokio::time::timeout(Duration::from_secs(10), play(stream, bytes)).await;
        assert!(played.is_ok(), "case {case} hung");
        if case % 25 == 0 {
            server.assert_serves().await;
        }
    }
    server.assert_serves().await;
    server.stop().await;
}
