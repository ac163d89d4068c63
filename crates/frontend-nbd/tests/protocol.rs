//! Protocol tests: a hand-rolled client speaks raw NBD bytes over TCP to the real server running
//! in this process. Each misbehaving client is followed by `assert_serves`, proving the server
//! still serves a well-behaved one.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tokio::io::AsyncReadExt;

use common::{Client, Server, MEM_SIZE_BYTES};
use keel_nbd::protocol::*;
use keel_nbd::testing::{MemoryExport, MemoryExports};
use keel_nbd::{Export, Exports, NbdError, CONNECTION_REQUESTS_IN_FLIGHT_MAX};
use keel_nbd::{REQUEST_PAYLOAD_MAX_BYTES, WRITE_DISCARD_MAX_BYTES};

const FLAGS: u32 = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;

/// Serves a single export under the name "mem".
struct One(Arc<dyn Export>);

impl Exports for One {
    fn list(&self) -> Vec<String> {
        vec!["mem".into()]
    }
    fn open(&self, name: &str) -> Result<Arc<dyn Export>, NbdError> {
        if name == "mem" {
            Ok(Arc::clone(&self.0))
        } else {
            Err(NbdError::ExportNotFound { name: name.into() })
        }
    }
}

// Proves the full happy path: GO with a block-size request returns the export record with the
// advertised flags (flush, FUA, trim, write-zeroes, multi-conn) and the block sizes; then write,
// read, write-zeroes (with NO_HOLE and FUA), trim and flush behave, and DISC closes cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_then_every_command_works() {
    let (server, exports) = Server::start_memory().await;
    let export = exports.insert("mem", MEM_SIZE_BYTES);
    let mut client = Client::connect(server.address).await;
    client.send_flags(FLAGS).await;
    let infos = client
        .info_or_go(OPT_GO, "mem", &[INFO_BLOCK_SIZE, INFO_NAME])
        .await
        .unwrap();
    let find = |kind: u16| {
        infos
            .iter()
            .find(|(found, _)| *found == kind)
            .map(|(_, data)| data.clone())
            .unwrap_or_else(|| panic!("info {kind} present"))
    };
    let export_info = find(INFO_EXPORT);
    assert_eq!(
        u64::from_be_bytes(export_info[0..8].try_into().unwrap()),
        MEM_SIZE_BYTES
    );
    let flags = u16::from_be_bytes(export_info[8..10].try_into().unwrap());
    let wanted = FLAG_HAS_FLAGS
        | FLAG_SEND_FLUSH
        | FLAG_SEND_FUA
        | FLAG_SEND_TRIM
        | FLAG_SEND_WRITE_ZEROES
        | FLAG_CAN_MULTI_CONN;
    assert_eq!(flags, wanted);
    let block = find(INFO_BLOCK_SIZE);
    // Minimum 1 (any byte range, like a Keel volume), preferred 4096.
    assert_eq!(u32::from_be_bytes(block[0..4].try_into().unwrap()), 1);
    assert_eq!(u32::from_be_bytes(block[4..8].try_into().unwrap()), 4096);
    assert_eq!(
        u32::from_be_bytes(block[8..12].try_into().unwrap()),
        REQUEST_PAYLOAD_MAX_BYTES
    );
    assert_eq!(find(INFO_NAME), b"mem");

    let pattern: Vec<u8> = (0..16384u32).map(|i| (i * 7 % 251) as u8).collect();
    client
        .request(CMD_FLAG_FUA, CMD_WRITE, 1, 8192, 16384, &pattern)
        .await;
    assert_eq!(client.simple_reply(0).await, (0, 1, vec![]));
    assert_eq!(export.snapshot(8192, 16384), pattern);
    client.request(0, CMD_READ, 2, 8192, 16384, &[]).await;
    assert_eq!(client.simple_reply(16384).await, (0, 2, pattern.clone()));
    client
        .request(
            CMD_FLAG_NO_HOLE | CMD_FLAG_FUA,
            CMD_WRITE_ZEROES,
            3,
            8192,
            4096,
            &[],
        )
        .await;
    assert_eq!(client.simple_reply(0).await.0, 0);
    client.request(0, CMD_TRIM, 4, 12288, 4096, &[]).await;
    assert_eq!(client.simple_reply(0).await.0, 0);
    assert_eq!(export.snapshot(8192, 8192), vec![0; 8192]);
    assert_eq!(export.snapshot(16384, 8192), pattern[8192..].to_vec());
    let flushes = export.flushes();
    client.request(0, CMD_FLUSH, 5, 0, 0, &[]).await;
    assert_eq!(client.simple_reply(0).await, (0, 5, vec![]));
    assert_eq!(export.flushes(), flushes + 1);
    // Zero-length requests are answered without disconnecting.
    client.request(0, CMD_READ, 6, 0, 0, &[]).await;
    assert_eq!(client.simple_reply(0).await, (0, 6, vec![]));
    client.request(0, CMD_DISC, 7, 0, 0, &[]).await;
    client.expect_closed().await;
    server.assert_serves().await;
    server.stop().await;
}

// Proves an export with a minimum block size of 1 serves unaligned reads and writes (what
// nbdfuse sends), leaving the neighbouring bytes intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unaligned_requests_on_a_byte_granular_export() {
    let (server, exports) = Server::start_memory().await;
    let export = exports.insert("mem", MEM_SIZE_BYTES);
    let mut client = Client::connect_go(server.address).await;
    client.request(0, CMD_WRITE, 1, 4097, 3, b"abc").await;
    assert_eq!(client.simple_reply(0).await, (0, 1, vec![]));
    client.request(0, CMD_READ, 2, 4095, 6, &[]).await;
    assert_eq!(client.simple_reply(6).await, (0, 2, b"\0\0abc\0".to_vec()));
    client.request(0, CMD_WRITE_ZEROES, 3, 4098, 1, &[]).await;
    assert_eq!(client.simple_reply(0).await.0, 0);
    assert_eq!(export.snapshot(4096, 5), b"\0a\0c\0".to_vec());
    client.request(0, CMD_DISC, 4, 0, 0, &[]).await;
    client.expect_closed().await;
    server.stop().await;
}

// Proves NBD_OPT_EXPORT_NAME works, with the 124 zero bytes unless the client negotiated
// NO_ZEROES (the request after it is framed correctly either way), and that an unknown name
// there ends the session (it cannot be answered with an error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_name_honours_no_zeroes() {
    let (server, _exports) = Server::start_memory().await;
    for (flags, reply_length) in [(FLAG_C_FIXED_NEWSTYLE, 134), (FLAGS, 10)] {
        let mut client = Client::connect(server.address).await;
        client.send_flags(flags).await;
        client.option(OPT_EXPORT_NAME, b"mem").await;
        let reply = client.read_bytes(reply_length).await;
        assert_eq!(
            u64::from_be_bytes(reply[0..8].try_into().unwrap()),
            MEM_SIZE_BYTES
        );
        assert!(reply[10..].iter().all(|&byte| byte == 0));
        client.request(0, CMD_READ, 11, 0, 4096, &[]).await;
        assert_eq!(client.simple_reply(4096).await.1, 11);
        client.request(0, CMD_DISC, 12, 0, 0, &[]).await;
        client.expect_closed().await;
    }
    let mut client = Client::connect(server.address).await;
    client.send_flags(FLAGS).await;
    client.option(OPT_EXPORT_NAME, b"missing").await;
    client.expect_closed().await;
    server.assert_serves().await;
    server.stop().await;
}

// Proves NBD_OPT_LIST returns one NBD_REP_SERVER per export then an ACK, and that LIST with
// data is refused with NBD_REP_ERR_INVALID without ending the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_names_every_export() {
    let (server, exports) = Server::start_memory().await;
    exports.insert("second", 1 << 20);
    let mut client = Client::connect(server.address).await;
    client.send_flags(FLAGS).await;
    client.option(OPT_LIST, &[]).await;
    let mut names = BTreeSet::new();
    loop {
        let (option, reply_type, data) = client.option_reply().await;
        assert_eq!(option, OPT_LIST);
        if reply_type == REP_ACK {
            break;
        }
        assert_eq!(reply_type, REP_SERVER);
        let length = u32::from_be_bytes(data[0..4].try_into().unwrap()) as usize;
        names.insert(String::from_utf8(data[4..4 + length].to_vec()).unwrap());
    }
    assert_eq!(
        names,
        BTreeSet::from(["mem".to_owned(), "second".to_owned()])
    );
    client.option(OPT_LIST, b"junk").await;
    assert_eq!(client.option_reply().await.1, REP_ERR_INVALID);
    client.option(OPT_ABORT, &[]).await;
    assert_eq!(client.option_reply().await.1, REP_ACK);
    client.expect_closed().await;
    server.assert_serves().await;
    server.stop().await;
}

// Proves NBD_OPT_INFO answers without entering transmission (more options may follow), and that
// INFO and GO for a missing export get NBD_REP_ERR_UNKNOWN and leave the session usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_and_missing_export() {
    let (server, _exports) = Server::start_memory().await;
    let mut client = Client::connect(server.address).await;
    client.send_flags(FLAGS).await;
    let infos = client.info_or_go(OPT_INFO, "mem", &[]).await.unwrap();
    assert!(infos.iter().any(|(kind, _)| *kind == INFO_EXPORT));
    let refused = client.info_or_go(OPT_INFO, "nope", &[]).await.unwrap_err();
    assert_eq!(refused.0, REP_ERR_UNKNOWN);
    assert!(
        refused.1.contains("nope"),
        "message names the export: {}",
        refused.1
    );
    assert_eq!(client.go("nope", &[]).await, Err(REP_ERR_UNKNOWN));
    // A malformed GO (name length past the data) is INVALID, not fatal.
    let mut lying = Client::info_data("mem", &[]);
    lying[0..4].copy_from_slice(&1000u32.to_be_bytes());
    client.option(OPT_GO, &lying).await;
    assert_eq!(client.option_reply().await.1, REP_ERR_INVALID);
    assert_eq!(client.go("mem", &[]).await.unwrap().0, MEM_SIZE_BYTES);
    client.request(0, CMD_DISC, 1, 0, 0, &[]).await;
    client.expect_closed().await;
    server.assert_serves().await;
    server.stop().await;
}

// Proves unknown options, structured replies, STARTTLS and meta contexts get NBD_REP_ERR_UNSUP
// and the server keeps parsing options after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_options_are_unsupported() {
    let (server, _exports) = Server::start_memory().await;
    let mut client = Client::connect(server.address).await;
    client.send_flags(FLAGS).await;
    for option in [
        0xdead_beef,
        OPT_STRUCTURED_REPLY,
        OPT_STARTTLS,
        OPT_SET_META_CONTEXT,
        OPT_LIST_META_CONTEXT,
        OPT_EXTENDED_HEADERS,
        4,
    ] {
        client
            .option(option, b"some data the server must skip")
            .await;
        let (replied, reply_type, _) = client.option_reply().await;
        assert_eq!((replied, reply_type), (option, REP_ERR_UNSUP));
    }
    assert_eq!(client.go("mem", &[]).await.unwrap().0, MEM_SIZE_BYTES);
    client.request(0, CMD_DISC, 1, 0, 0, &[]).await;
    client.expect_closed().await;
    server.assert_serves().await;
    server.stop().await;
}

// Proves oversized option data is skipped and answered with NBD_REP_ERR_TOO_BIG (session goes
// on), while an absurd length, or an oversized NBD_OPT_EXPORT_NAME, ends the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_options() {
    let (server, _exports) = Server::start_memory().await;
    let mut client = Client::connect(server.address).await;
    client.send_flags(FLAGS).await;
    client.option(OPT_GO, &vec![0u8; 100_000]).await;
    let (option, reply_type, _) = client.option_reply().await;
    assert_eq!((option, reply_type), (OPT_GO, REP_ERR_TOO_BIG));
    assert!(client.go("mem", &[]).await.is_ok());
    client.request(0, CMD_DISC, 1, 0, 0, &[]).await;
    client.expect_closed().await;

    let mut client = Client::connect(server.address).await;
    client.send_flags(FLAGS).await;
    let header = OptionHeader {
        option: OPT_LIST,
        length_bytes: u32::MAX,
    };
    client.send(&header.encode()).await;
    client.expect_closed().await;

    let mut client = Client::connect(server.address).await;
    client.send_flags(FLAGS).await;
    client.option(OPT_EXPORT_NAME, &vec![b'a'; 20_000]).await;
    client.expect_closed().await;
    server.assert_serves().await;
    server.stop().await;
}

// Proves the server refuses what it must: clients without fixed newstyle, unknown client flags,
// a bad option magic; each ends only that session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_handshakes_close_the_session() {
    let (server, _exports) = Server::start_memory().await;
    for flags in [0u32, FLAG_C_NO_ZEROES, FLAGS | 1 << 7] {
        let mut client = Client::connect(server.address).await;
        client.send_flags(flags).await;
        client.expect_closed().await;
        server.assert_serves().await;
    }
    let mut client = Client::connect(server.address).await;
    client.send_flags(FLAGS).await;
    client.send(b"IHAVEOPS\0\0\0\x03\0\0\0\0").await;
    client.expect_closed().await;
    // A client that connects and goes away mid-greeting.
    let client = Client::connect(server.address).await;
    drop(client);
    server.assert_serves().await;
    server.stop().await;
}

// Proves a bad request magic closes the connection (after answering what was already in
// flight) and does not affect other clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_request_magic_closes() {
    let (server, _exports) = Server::start_memory().await;
    let mut client = Client::connect_go(server.address).await;
    let mut bytes = Client::request_bytes(0, CMD_READ, 1, 0, 4096, &[]);
    bytes.extend_from_slice(&[0xee; 28]);
    client.send(&bytes).await;
    assert_eq!(client.simple_reply(4096).await.0, 0);
    client.expect_closed().await;
    server.assert_serves().await;
    server.stop().await;
}

// Proves the error mapping for out-of-range and unaligned requests: read or trim past the end
// → EINVAL, write or write-zeroes past the end → ENOSPC (and the refused write's payload is
// consumed: the next request is framed right), unaligned on an export with a 4096-byte minimum
// block size → EINVAL, unknown command or flag → EINVAL, and offset+length overflowing 64 bits
// is caught.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_and_unaligned_requests() {
    let (server, exports) = Server::start_memory().await;
    exports.insert_export("mem", MemoryExport::new(MEM_SIZE_BYTES, 4096, false));
    let mut client = Client::connect_go(server.address).await;
    let end = MEM_SIZE_BYTES;
    let cases: [(u16, u16, u64, u32, u32); 9] = [
        (0, CMD_READ, end - 4096, 8192, EINVAL),
        (0, CMD_TRIM, end, 4096, EINVAL),
        (0, CMD_WRITE, end - 4096, 8192, ENOSPC),
        (0, CMD_WRITE_ZEROES, end, 4096, ENOSPC),
        (0, CMD_READ, u64::MAX - 4095, 8192, EINVAL),
        (0, CMD_READ, 100, 4096, EINVAL),
        (0, CMD_WRITE, 0, 1000, EINVAL),
        (0, 42, 0, 0, EINVAL),
        (CMD_FLAG_DF, CMD_READ, 0, 4096, EINVAL),
    ];
    for (cookie, (flags, command, offset, length, expected)) in cases.into_iter().enumerate() {
        let payload = if command == CMD_WRITE {
            vec![0xcd; length as usize]
        } else {
            Vec::new()
        };
        client
            .request(flags, command, cookie as u64, offset, length, &payload)
            .await;
        assert_eq!(
            client.simple_reply(0).await,
            (expected, cookie as u64, vec![]),
            "case {cookie}"
        );
    }
    client.request(0, CMD_READ, 100, 0, 4096, &[]).await;
    assert_eq!(client.simple_reply(4096).await.0, 0);
    client.request(0, CMD_DISC, 101, 0, 0, &[]).await;
    client.expect_closed().await;
    server.assert_serves().await;
    server.stop().await;
}

// Proves oversized requests: a read or write larger than the maximum payload gets EINVAL (the
// write's payload is read and dropped so the stream stays in sync), and a write announcing more
// than can safely be discarded ends the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_requests() {
    let exports = Arc::new(MemoryExports::new());
    exports.insert("mem", 64 << 20);
    let server = Server::start(Arc::clone(&exports) as Arc<dyn Exports>).await;
    let mut client = Client::connect_go(server.address).await;
    let too_big = REQUEST_PAYLOAD_MAX_BYTES + 4096;
    client.request(0, CMD_READ, 1, 0, too_big, &[]).await;
    assert_eq!(client.simple_reply(0).await, (EINVAL, 1, vec![]));
    client
        .request(0, CMD_WRITE, 2, 0, too_big, &vec![1u8; too_big as usize])
        .await;
    assert_eq!(client.simple_reply(0).await, (EINVAL, 2, vec![]));
    // The maximum itself is served.
    client
        .request(0, CMD_READ, 3, 0, REQUEST_PAYLOAD_MAX_BYTES, &[])
        .await;
    let (error, cookie, data) = client
        .simple_reply(REQUEST_PAYLOAD_MAX_BYTES as usize)
        .await;
    assert_eq!(
        (error, cookie, data.len()),
        (0, 3, REQUEST_PAYLOAD_MAX_BYTES as usize)
    );
    client
        .request(0, CMD_WRITE, 4, 0, WRITE_DISCARD_MAX_BYTES + 4096, &[])
        .await;
    client.expect_closed().await;
    server.assert_serves().await;
    server.stop().await;
}

// Proves NBD_CMD_DISC answers every request already in flight before closing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_finishes_in_flight_requests() {
    let (server, _exports) = Server::start_memory().await;
    let mut client = Client::connect_go(server.address).await;
    let mut bytes = Vec::new();
    for cookie in 0..16u64 {
        bytes.extend(Client::request_bytes(
            0,
            CMD_WRITE,
            cookie,
            cookie * 4096,
            4096,
            &[cookie as u8; 4096],
        ));
    }
    bytes.extend(Client::request_bytes(0, CMD_DISC, 99, 0, 0, &[]));
    client.send(&bytes).await;
    let mut cookies = BTreeSet::new();
    for _ in 0..16 {
        let (error, cookie, _) = client.simple_reply(0).await;
        assert_eq!(error, 0);
        cookies.insert(cookie);
    }
    assert_eq!(cookies, (0..16).collect());
    client.expect_closed().await;
    server.assert_serves().await;
    server.stop().await;
}

// Proves a read-only export is advertised as such and refuses writes, trims and write-zeroes
// with EPERM while serving reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_export_refuses_writes() {
    let exports = Arc::new(MemoryExports::new());
    exports.insert("mem", MEM_SIZE_BYTES);
    exports.insert_export("ro", MemoryExport::new(1 << 20, 4096, true));
    let server = Server::start(Arc::clone(&exports) as Arc<dyn Exports>).await;
    let mut client = Client::connect(server.address).await;
    client.send_flags(FLAGS).await;
    let (_, flags) = client.go("ro", &[]).await.unwrap();
    assert_ne!(flags & FLAG_READ_ONLY, 0);
    client.request(0, CMD_WRITE, 1, 0, 4096, &[7; 4096]).await;
    assert_eq!(client.simple_reply(0).await.0, EPERM);
    client.request(0, CMD_TRIM, 2, 0, 4096, &[]).await;
    assert_eq!(client.simple_reply(0).await.0, EPERM);
    client.request(0, CMD_WRITE_ZEROES, 3, 0, 4096, &[]).await;
    assert_eq!(client.simple_reply(0).await.0, EPERM);
    client.request(0, CMD_READ, 4, 0, 4096, &[]).await;
    assert_eq!(client.simple_reply(4096).await, (0, 4, vec![0; 4096]));
    server.assert_serves().await;
    server.stop().await;
}

/// An export whose writes take a while, recording at each flush how many writes had finished.
struct SlowWrites {
    inner: MemoryExport,
    started: AtomicU64,
    finished: AtomicU64,
    finished_at_flush: Mutex<Vec<(u64, u64)>>,
}

impl Export for SlowWrites {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let index = self.started.fetch_add(1, Ordering::SeqCst);
        // Later writes finish sooner, so completion order differs from receive order.
        std::thread::sleep(Duration::from_millis(10 + 80 / (index + 1)));
        self.inner.write(offset, data, fua)?;
        self.finished.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        let started = self.started.load(Ordering::SeqCst);
        let finished = self.finished.load(Ordering::SeqCst);
        self.finished_at_flush
            .lock()
            .unwrap()
            .push((started, finished));
        Ok(())
    }
    fn trim(&self, offset: u64, length_bytes: u64) -> io::Result<()> {
        self.inner.trim(offset, length_bytes)
    }
    fn write_zeroes(&self, offset: u64, length: u64, fua: bool, may_trim: bool) -> io::Result<()> {
        self.inner.write_zeroes(offset, length, fua, may_trim)
    }
    fn read_only(&self) -> bool {
        false
    }
}

// Proves FLUSH is sent to the export only after every write received before it on the
// connection has finished, even when those writes are still in flight when the FLUSH arrives,
// and that the FLUSH reply comes after their replies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_waits_for_earlier_writes() {
    let export = Arc::new(SlowWrites {
        inner: MemoryExport::new(1 << 20, 4096, false),
        started: AtomicU64::new(0),
        finished: AtomicU64::new(0),
        finished_at_flush: Mutex::new(Vec::new()),
    });
    let server = Server::start(Arc::new(One(Arc::clone(&export) as Arc<dyn Export>))).await;
    let mut client = Client::connect_go(server.address).await;
    let writes = 8u64;
    let mut bytes = Vec::new();
    for cookie in 0..writes {
        bytes.extend(Client::request_bytes(
            0,
            CMD_WRITE,
            cookie,
            cookie * 4096,
            4096,
            &[1; 4096],
        ));
    }
    bytes.extend(Client::request_bytes(0, CMD_FLUSH, 100, 0, 0, &[]));
    client.send(&bytes).await;
    let mut order = Vec::new();
    for _ in 0..=writes {
        let (error, cookie, _) = client.simple_reply(0).await;
        assert_eq!(error, 0);
        order.push(cookie);
    }
    assert_eq!(order.last(), Some(&100), "flush replied last: {order:?}");
    assert_eq!(
        *export.finished_at_flush.lock().unwrap(),
        vec![(writes, writes)],
        "every earlier write had finished when the export was flushed"
    );
    server.stop().await;
}

/// An export whose reads wait at a gate, counting how many wait at once.
struct GatedReads {
    inner: MemoryExport,
    waiting: AtomicUsize,
    waiting_max: AtomicUsize,
    open: Mutex<bool>,
    opened: Condvar,
}

impl Export for GatedReads {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let now = self.waiting.fetch_add(1, Ordering::SeqCst) + 1;
        self.waiting_max.fetch_max(now, Ordering::SeqCst);
        let open = self.open.lock().unwrap();
        // Bounded wait: a broken server must fail the test, not hang it.
        let (open, _) = self
            .opened
            .wait_timeout_while(open, Duration::from_secs(20), |open| !*open)
            .unwrap();
        drop(open);
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.inner.write(offset, data, fua)
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn trim(&self, offset: u64, length_bytes: u64) -> io::Result<()> {
        self.inner.trim(offset, length_bytes)
    }
    fn write_zeroes(&self, offset: u64, length: u64, fua: bool, may_trim: bool) -> io::Result<()> {
        self.inner.write_zeroes(offset, length, fua, may_trim)
    }
    fn read_only(&self) -> bool {
        false
    }
}

// Proves requests of one connection run concurrently (many reads wait in the export at once),
// that their number is bounded by CONNECTION_REQUESTS_IN_FLIGHT_MAX, and that every request is
// answered once the export proceeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_run_concurrently_up_to_the_bound() {
    let export = Arc::new(GatedReads {
        inner: MemoryExport::new(1 << 20, 4096, false),
        waiting: AtomicUsize::new(0),
        waiting_max: AtomicUsize::new(0),
        open: Mutex::new(false),
        opened: Condvar::new(),
    });
    let server = Server::start(Arc::new(One(Arc::clone(&export) as Arc<dyn Export>))).await;
    let mut client = Client::connect_go(server.address).await;
    let total = CONNECTION_REQUESTS_IN_FLIGHT_MAX as u64 + 72;
    let mut bytes = Vec::new();
    for cookie in 0..total {
        bytes.extend(Client::request_bytes(
            0,
            CMD_READ,
            cookie,
            (cookie % 256) * 4096,
            4096,
            &[],
        ));
    }
    client.send(&bytes).await;
    // Wait (bounded) until the server has started as many reads as it will.
    for _ in 0..100 {
        if export.waiting.load(Ordering::SeqCst) >= CONNECTION_REQUESTS_IN_FLIGHT_MAX {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        export.waiting_max.load(Ordering::SeqCst),
        CONNECTION_REQUESTS_IN_FLIGHT_MAX
    );
    *export.open.lock().unwrap() = true;
    export.opened.notify_all();
    let mut cookies = BTreeSet::new();
    for _ in 0..total {
        let (error, cookie, _) = client.simple_reply(4096).await;
        assert_eq!(error, 0);
        cookies.insert(cookie);
    }
    assert_eq!(cookies, (0..total).collect());
    server.stop().await;
}

/// An export that panics on every write and fails every flush.
struct Broken(MemoryExport);

impl Export for Broken {
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.0.read(offset, buf)
    }
    fn write(&self, _offset: u64, _data: &[u8], _fua: bool) -> io::Result<()> {
        panic!("simulated bug in the export");
    }
    fn flush(&self) -> io::Result<()> {
        Err(io::Error::from(io::ErrorKind::StorageFull))
    }
    fn trim(&self, _offset: u64, _length_bytes: u64) -> io::Result<()> {
        Err(io::Error::other("checksum mismatch"))
    }
    fn write_zeroes(&self, offset: u64, length: u64, fua: bool, may_trim: bool) -> io::Result<()> {
        self.0.write_zeroes(offset, length, fua, may_trim)
    }
    fn read_only(&self) -> bool {
        false
    }
}

// Proves export failures become protocol errors (a panic → EIO, StorageFull → ENOSPC, other →
// EIO) and the connection keeps serving after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_failures_become_errors() {
    let export = Arc::new(Broken(MemoryExport::new(1 << 20, 4096, false)));
    let server = Server::start(Arc::new(One(export as Arc<dyn Export>))).await;
    let mut client = Client::connect_go(server.address).await;
    client.request(0, CMD_WRITE, 1, 0, 4096, &[1; 4096]).await;
    assert_eq!(client.simple_reply(0).await, (EIO, 1, vec![]));
    client.request(0, CMD_FLUSH, 2, 0, 0, &[]).await;
    assert_eq!(client.simple_reply(0).await, (ENOSPC, 2, vec![]));
    client.request(0, CMD_TRIM, 3, 0, 4096, &[]).await;
    assert_eq!(client.simple_reply(0).await, (EIO, 3, vec![]));
    client.request(0, CMD_READ, 4, 0, 4096, &[]).await;
    assert_eq!(client.simple_reply(4096).await, (0, 4, vec![0; 4096]));
    server.stop().await;
}

/// An export whose reads past `failing_from` scribble over the buffer, then fail.
struct ScribblingReads {
    inner: MemoryExport,
    failing_from: u64,
}

impl Export for ScribblingReads {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if offset >= self.failing_from {
            buf.fill(0x5a);
            return Err(io::Error::other("a read that failed halfway"));
        }
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.inner.write(offset, data, fua)
    }
    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }
    fn trim(&self, offset: u64, length_bytes: u64) -> io::Result<()> {
        self.inner.trim(offset, length_bytes)
    }
    fn write_zeroes(&self, offset: u64, length: u64, fua: bool, may_trim: bool) -> io::Result<()> {
        self.inner.write_zeroes(offset, length, fua, may_trim)
    }
    fn read_only(&self) -> bool {
        false
    }
}

// Proves a connection's buffers, kept from one request for the next, never carry one
// request's bytes into another's reply: after a 256 KiB write and a read of it, a read that
// fails halfway (its buffer scribbled on) answers EIO with no data, and reads of other sizes
// and places answer exactly their own bytes (stream framing holds throughout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_buffers_never_leak_into_other_replies() {
    const K: u32 = 1024;
    let export = Arc::new(ScribblingReads {
        inner: MemoryExport::new(1 << 20, 4096, false),
        failing_from: 768 << 10,
    });
    let server = Server::start(Arc::new(One(export as Arc<dyn Export>))).await;
    let mut client = Client::connect_go(server.address).await;
    let data: Vec<u8> = (0..256 * K).map(|i| (i % 251) as u8 + 1).collect();
    client.request(0, CMD_WRITE, 1, 0, 256 * K, &data).await;
    assert_eq!(client.simple_reply(0).await, (0, 1, vec![]));
    client.request(0, CMD_READ, 2, 0, 256 * K, &[]).await;
    assert_eq!(
        client.simple_reply(256 * K as usize).await,
        (0, 2, data.clone())
    );
    client
        .request(0, CMD_READ, 3, 768 << 10, 256 * K, &[])
        .await;
    assert_eq!(client.simple_reply(0).await, (EIO, 3, vec![]));
    client.request(0, CMD_READ, 4, 0, 128 * K, &[]).await;
    assert_eq!(
        client.simple_reply(128 * K as usize).await,
        (0, 4, data[..(128 * K) as usize].to_vec())
    );
    client
        .request(0, CMD_READ, 5, 256 << 10, 512 * K, &[])
        .await;
    assert_eq!(
        client.simple_reply(512 * K as usize).await,
        (0, 5, vec![0; (512 * K) as usize])
    );
    server.stop().await;
}

// Proves a write on one connection is visible to a read on another once replied (what
// CAN_MULTI_CONN promises), and a flush on the second connection reaches the shared export.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_share_the_export() {
    let (server, exports) = Server::start_memory().await;
    let export = exports.insert("mem", MEM_SIZE_BYTES);
    let mut writer = Client::connect_go(server.address).await;
    let mut reader = Client::connect_go(server.address).await;
    writer
        .request(0, CMD_WRITE, 1, 4096, 4096, &[9; 4096])
        .await;
    assert_eq!(writer.simple_reply(0).await.0, 0);
    reader.request(0, CMD_READ, 2, 4096, 4096, &[]).await;
    assert_eq!(reader.simple_reply(4096).await, (0, 2, vec![9; 4096]));
    reader.request(0, CMD_FLUSH, 3, 0, 0, &[]).await;
    assert_eq!(reader.simple_reply(0).await.0, 0);
    assert_eq!(export.flushes(), 1);
    server.stop().await;
}

// Proves shutdown: `serve` returns once asked, after answering a connected client's request,
// and the listener no longer accepts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_serving() {
    let (server, _exports) = Server::start_memory().await;
    let address = server.address;
    let mut client = Client::connect_go(address).await;
    client.request(0, CMD_READ, 1, 0, 4096, &[]).await;
    assert_eq!(client.simple_reply(4096).await.0, 0);
    server.stop().await;
    client.expect_closed().await;
    assert!(tokio::net::TcpStream::connect(address).await.is_err());
}

/// Whether a new connection gets a greeting within a bounded number of tries (slots are
/// released asynchronously, when the server notices a client left).
async fn greeted_soon(server: &Server) -> bool {
    for _ in 0..100 {
        let mut probe = tokio::net::TcpStream::connect(server.address)
            .await
            .unwrap();
        let mut greeting = [0u8; GREETING_BYTES];
        let read = tokio::time::timeout(common::IO_TIMEOUT, probe.read_exact(&mut greeting)).await;
        if matches!(read, Ok(Ok(_))) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

// Proves the connection bound: with CONNECTIONS_MAX clients connected, one more is closed at
// once without a greeting, and once a slot frees up new clients are served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_bound_are_closed() {
    let (server, _exports) = Server::start_memory().await;
    let mut held = Vec::new();
    for _ in 0..keel_nbd::CONNECTIONS_MAX {
        // Reading the greeting proves the server took the connection into a slot.
        held.push(Client::connect(server.address).await);
    }
    let mut extra = tokio::net::TcpStream::connect(server.address)
        .await
        .unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(common::IO_TIMEOUT, extra.read(&mut byte))
        .await
        .expect("the extra connection is closed in time");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "extra connection got a greeting"
    );
    held.truncate(keel_nbd::CONNECTIONS_MAX - 1);
    assert!(greeted_soon(&server).await, "a freed slot is reused");
    drop(held);
    // Slots are released as the server notices the closed connections.
    assert!(greeted_soon(&server).await);
    server.assert_serves().await;
    server.stop().await;
}

// Proves a client that sends many large reads and never reads the replies stalls only its own
// connection: its buffers stay bounded and another client is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_not_reading_replies_does_not_block_others() {
    let (server, _exports) = Server::start_memory().await;
    let mut greedy = Client::connect_go(server.address).await;
    let mut bytes = Vec::new();
    for cookie in 0..512u64 {
        bytes.extend(Client::request_bytes(0, CMD_READ, cookie, 0, 1 << 20, &[]));
    }
    // 512 MiB of replies requested; the server stops reading once its buffers are full, so this
    // send may not complete: bound it and carry on.
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        tokio::io::AsyncWriteExt::write_all(&mut greedy.stream, &bytes),
    )
    .await;
    server.assert_serves().await;
    drop(greedy);
    server.assert_serves().await;
    server.stop().await;
}

// Proves data integrity against a model: 600 random writes, reads, trims and write-zeroes
// (seeded, sequential) on a small export read back exactly what the model holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_operations_match_a_model() {
    use rand::{Rng, SeedableRng};
    const SIZE: usize = 256 * 1024;
    const BLOCK: usize = 4096;
    let exports = Arc::new(MemoryExports::new());
    exports.insert("mem", SIZE as u64);
    let server = Server::start(Arc::clone(&exports) as Arc<dyn Exports>).await;
    let mut client = Client::connect_go(server.address).await;
    let mut model = vec![0u8; SIZE];
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for cookie in 0..600u64 {
        let blocks = SIZE / BLOCK;
        let first = rng.gen_range(0..blocks);
        let count = rng.gen_range(1..=(blocks - first).min(16));
        let (offset, length) = (first * BLOCK, count * BLOCK);
        match rng.gen_range(0..4) {
            0 => {
                let data: Vec<u8> = (0..length).map(|_| rng.gen()).collect();
                client
                    .request(0, CMD_WRITE, cookie, offset as u64, length as u32, &data)
                    .await;
                assert_eq!(client.simple_reply(0).await, (0, cookie, vec![]));
                model[offset..offset + length].copy_from_slice(&data);
            }
            1 => {
                client
                    .request(0, CMD_READ, cookie, offset as u64, length as u32, &[])
                    .await;
                let (error, replied, data) = client.simple_reply(length).await;
                assert_eq!((error, replied), (0, cookie));
                assert!(
                    data == model[offset..offset + length],
                    "read {cookie} differs"
                );
            }
            2 => {
                client
                    .request(
                        0,
                        CMD_WRITE_ZEROES,
                        cookie,
                        offset as u64,
                        length as u32,
                        &[],
                    )
                    .await;
                assert_eq!(client.simple_reply(0).await, (0, cookie, vec![]));
                model[offset..offset + length].fill(0);
            }
            _ => {
                // The in-memory export zeroes trimmed ranges, so the model can follow.
                client
                    .request(
                        CMD_FLAG_FUA,
                        CMD_TRIM,
                        cookie,
                        offset as u64,
                        length as u32,
                        &[],
                    )
                    .await;
                assert_eq!(client.simple_reply(0).await, (0, cookie, vec![]));
                model[offset..offset + length].fill(0);
            }
        }
    }
    client.request(0, CMD_READ, 9999, 0, SIZE as u32, &[]).await;
    let (error, _, data) = client.simple_reply(SIZE).await;
    assert_eq!(error, 0);
    assert!(data == model, "final contents match the model");
    server.stop().await;
}

/// A session over a Unix socket pair, served by `serve_stream` on a blocking thread with the
/// given handshake timeout; returns the client's end and the session.
fn unix_session(
    exports: &Arc<MemoryExports>,
    handshake_timeout: Duration,
) -> (
    tokio::net::UnixStream,
    tokio::task::JoinHandle<Result<(), NbdError>>,
) {
    let (client, server) = std::os::unix::net::UnixStream::pair().unwrap();
    client.set_nonblocking(true).unwrap();
    let exports = Arc::clone(exports) as Arc<dyn Exports>;
    let session = tokio::task::spawn_blocking(move || {
        keel_nbd::serve_stream(server, exports, handshake_timeout)
    });
    (tokio::net::UnixStream::from_std(client).unwrap(), session)
}

/// Waits (bounded) for the session to end and checks it ended by the handshake timeout.
async fn expect_handshake_timeout(session: tokio::task::JoinHandle<Result<(), NbdError>>) {
    let ended = tokio::time::timeout(common::IO_TIMEOUT, session)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(ended, Err(NbdError::HandshakeTimeout { .. })),
        "{ended:?}"
    );
}

// Proves the handshake timeout: a client that connects and then says nothing is dropped once
// the timeout passes, so is one that trickles bytes (the deadline covers the whole handshake,
// not each read), and one that completes the handshake is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_clients_time_out_in_the_handshake() {
    let timeout = Duration::from_millis(500);
    let exports = Arc::new(MemoryExports::new());
    exports.insert("mem", MEM_SIZE_BYTES);
    let (mut client, session) = unix_session(&exports, timeout);
    let started = tokio::time::Instant::now();
    let mut greeting = [0u8; GREETING_BYTES];
    client.read_exact(&mut greeting).await.unwrap();
    expect_handshake_timeout(session).await;
    assert!(started.elapsed() >= timeout);

    let (mut client, session) = unix_session(&exports, timeout);
    let started = tokio::time::Instant::now();
    client.read_exact(&mut greeting).await.unwrap();
    let mut bytes = FLAGS.to_be_bytes().to_vec();
    bytes.extend_from_slice(&OPTION_MAGIC.to_be_bytes());
    for byte in bytes {
        if session.is_finished() {
            break;
        }
        if tokio::io::AsyncWriteExt::write_all(&mut client, &[byte])
            .await
            .is_err()
        {
            break;
        }
        tokio::time::sleep(timeout / 5).await;
    }
    expect_handshake_timeout(session).await;
    assert!(started.elapsed() < timeout * 2, "cut off at the deadline");

    // In transmission there is no idle timeout: a kernel client may sit idle for hours.
    let (client, session) = unix_session(&exports, timeout);
    let (mut reader, mut writer) = tokio::io::split(client);
    reader.read_exact(&mut greeting).await.unwrap();
    let mut bytes = FLAGS.to_be_bytes().to_vec();
    let go = Client::info_data("mem", &[]);
    bytes.extend_from_slice(
        &OptionHeader {
            option: OPT_GO,
            length_bytes: go.len() as u32,
        }
        .encode(),
    );
    bytes.extend_from_slice(&go);
    tokio::io::AsyncWriteExt::write_all(&mut writer, &bytes)
        .await
        .unwrap();
    tokio::time::sleep(timeout * 4).await;
    assert!(
        !session.is_finished(),
        "an idle session in transmission stays open"
    );
    tokio::io::AsyncWriteExt::write_all(
        &mut writer,
        &Client::request_bytes(0, CMD_DISC, 1, 0, 0, &[]),
    )
    .await
    .unwrap();
    tokio::time::timeout(common::IO_TIMEOUT, session)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

// Proves a peer holding every connection slot cannot lock clients out (issue 10, defect 8):
// with all slots taken a new client is refused while the holders are active, and takes the slot
// of the connection idle the longest once that one has been idle long enough.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_give_their_slot_to_new_clients_when_full() {
    let exports = Arc::new(MemoryExports::new());
    exports.insert("mem", MEM_SIZE_BYTES);
    let limits = keel_nbd::Limits {
        connections_max: 2,
        idle_evict_after: Duration::from_millis(500),
    };
    let server = Server::start_with(Arc::clone(&exports) as Arc<dyn Exports>, limits).await;
    let mut first = Client::connect_go(server.address).await;
    let mut second = Client::connect_go(server.address).await;
    // Both slots busy and fresh: a third client is turned away.
    let mut refused = tokio::net::TcpStream::connect(server.address)
        .await
        .unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(10), refused.read(&mut byte))
        .await
        .expect("refused in time");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "a third client is refused while both are fresh"
    );
    // The second stays active; the first goes idle past the limit.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        second
            .send(&Client::request_bytes(0, CMD_FLUSH, 1, 0, 0, &[]))
            .await;
        let (error, _, _) = second.simple_reply(0).await;
        assert_eq!(error, 0);
    }
    let mut newcomer = Client::connect_go(server.address).await;
    newcomer
        .send(&Client::request_bytes(0, CMD_FLUSH, 2, 0, 0, &[]))
        .await;
    assert_eq!(newcomer.simple_reply(0).await.0, 0);
    first.expect_closed().await;
    second
        .send(&Client::request_bytes(0, CMD_FLUSH, 3, 0, 0, &[]))
        .await;
    assert_eq!(
        second.simple_reply(0).await.0,
        0,
        "the active connection kept its slot"
    );
    drop((first, second, newcomer));
    server.stop().await;
}

// Proves every request is registered for `keel ops`: a write whose payload has not all arrived
// is in flight, in phase "receiving", with its export, range and client; once answered it is
// among the slowest, with the time it spent receiving, writing and replying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_visible_in_flight_and_after_with_their_phases() {
    let (server, _exports) = Server::start_memory().await;
    let mut client = Client::connect_go(server.address).await;
    let client_address = client.stream.local_addr().unwrap().to_string();
    let payload = vec![7u8; 8192];
    let request = Client::request_bytes(0, CMD_WRITE, 9, 4096, 8192, &payload);
    client.send(&request[..REQUEST_HEADER_BYTES + 100]).await;
    let deadline = std::time::Instant::now() + common::IO_TIMEOUT;
    let in_flight = loop {
        let report = server.ops.report();
        if let Some(op) = report.in_flight.into_iter().next() {
            break op;
        }
        assert!(std::time::Instant::now() < deadline, "the write shows up");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert_eq!(in_flight.frontend, "nbd");
    assert_eq!(in_flight.operation, "write");
    assert_eq!(in_flight.target, "mem offset 4096 length 8192");
    assert_eq!(in_flight.client.as_deref(), Some(client_address.as_str()));
    assert_eq!(in_flight.phase, Some(keel_ops::phase::RECEIVING));

    client.send(&request[REQUEST_HEADER_BYTES + 100..]).await;
    let (error, cookie, _) = client.simple_reply(0).await;
    assert_eq!((error, cookie), (0, 9));
    let deadline = std::time::Instant::now() + common::IO_TIMEOUT;
    let report = loop {
        let report = server.ops.report();
        if report.in_flight.is_empty() {
            break report;
        }
        assert!(std::time::Instant::now() < deadline, "the write finishes");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let done = &report.slowest[0];
    assert_eq!(done.id, in_flight.id);
    assert_eq!(done.phase, None);
    let phases: Vec<&str> = done.phases.iter().map(|p| p.phase).collect();
    assert_eq!(
        phases,
        [
            keel_ops::phase::RECEIVING,
            keel_ops::phase::QUEUED,
            keel_ops::phase::WRITING,
            keel_ops::phase::REPLYING
        ]
    );
    drop(client);
    server.stop().await;
}
