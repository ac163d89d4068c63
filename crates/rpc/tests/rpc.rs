//! The transport over real loopback sockets. Each test names what it proves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_rpc::{
    frame, BoxFuture, Caller, ClusterSecret, Delay, Faults, Handler, Identity, LocalIdentity,
    Peers, RemoteError, RpcConfig, RpcError, Target,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const CLUSTER: [u8; 16] = [1; 16];
const SECRET: [u8; 32] = [2; 32];

/// Echoes payloads; method 2 sleeps the number of milliseconds in the payload first; method 3
/// answers an error; method 4 reports the caller; method 5 counts completions after a sleep.
struct Echo {
    completed: Arc<AtomicUsize>,
    callers: Mutex<Vec<Caller>>,
}

impl Handler for Echo {
    fn call(
        &self,
        caller: Caller,
        method: u16,
        payload: Vec<u8>,
    ) -> BoxFuture<Result<Vec<u8>, RemoteError>> {
        self.callers.lock().unwrap().push(caller);
        let completed = self.completed.clone();
        Box::pin(async move {
            match method {
                2 => {
                    let millis = u64::from_le_bytes(payload[..8].try_into().unwrap());
                    tokio::time::sleep(Duration::from_millis(millis)).await;
                    Ok(payload)
                }
                3 => Err(RemoteError {
                    code: 9,
                    message: "refused on purpose".to_string(),
                }),
                4 => Ok(format!("{caller:?}").into_bytes()),
                5 => {
                    tokio::time::sleep(Duration::from_millis(600)).await;
                    completed.fetch_add(1, Ordering::SeqCst);
                    Ok(Vec::new())
                }
                _ => Ok(payload),
            }
        })
    }
}

fn identity(node: u64, secret: [u8; 32], cluster: [u8; 16]) -> Arc<LocalIdentity> {
    LocalIdentity::new(Identity {
        cluster_id: cluster,
        node_id: node,
        secret: ClusterSecret::from_bytes(secret),
    })
}

struct Server {
    address: String,
    handler: Arc<Echo>,
    faults: Faults,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

async fn server_at(listener: TcpListener, node: u64) -> Server {
    let address = listener.local_addr().unwrap().to_string();
    let handler = Arc::new(Echo {
        completed: Arc::new(AtomicUsize::new(0)),
        callers: Mutex::new(Vec::new()),
    });
    let faults = Faults::new();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let task = {
        let handler: Arc<dyn Handler> = handler.clone();
        let faults = faults.clone();
        tokio::spawn(async move {
            keel_rpc::serve(
                listener,
                identity(node, SECRET, CLUSTER),
                handler,
                RpcConfig {
                    payload_max_bytes: 4 << 20,
                    ..RpcConfig::default()
                },
                faults,
                async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                },
            )
            .await;
        })
    };
    Server {
        address,
        handler,
        faults,
        stop,
        task,
    }
}

async fn server(node: u64) -> Server {
    server_at(TcpListener::bind("127.0.0.1:0").await.unwrap(), node).await
}

fn client(node: u64) -> Arc<Peers> {
    Peers::new(
        identity(node, SECRET, CLUSTER),
        RpcConfig {
            payload_max_bytes: 4 << 20,
            ..RpcConfig::default()
        },
        Faults::new(),
    )
}

fn node(id: u64, server: &Server) -> Target {
    Target::Node {
        id,
        address: server.address.clone(),
    }
}

const SECOND: Duration = Duration::from_secs(1);

// Proves calls round-trip, many run at once on one connection and are answered out of order
// (the slow one does not hold up the fast ones), errors come back as Remote, and the handler
// learns who called.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_multiplex_and_answer_out_of_order() {
    let server = server(3).await;
    let peers = client(5);
    assert_eq!(
        peers
            .call(node(3, &server), 1, b"ping".to_vec(), SECOND)
            .await
            .unwrap(),
        b"ping"
    );
    let started = tokio::time::Instant::now();
    let mut calls = Vec::new();
    for index in 0..64u64 {
        let peers = peers.clone();
        let target = node(3, &server);
        calls.push(tokio::spawn(async move {
            let millis: u64 = if index == 0 { 800 } else { 10 };
            let answer = peers
                .call(target, 2, millis.to_le_bytes().to_vec(), 5 * SECOND)
                .await
                .unwrap();
            (index, answer, tokio::time::Instant::now())
        }));
    }
    let mut finished = Vec::new();
    for call in calls {
        finished.push(call.await.unwrap());
    }
    let slow_done = finished[0].2;
    assert!(
        finished[1..].iter().all(|(_, _, at)| *at < slow_done),
        "out of order"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    let refused = peers.call(node(3, &server), 3, Vec::new(), SECOND).await;
    match refused {
        Err(RpcError::Remote { error, .. }) => assert_eq!(error.code, 9),
        other => panic!("{other:?}"),
    }
    let caller = peers
        .call(node(3, &server), 4, Vec::new(), SECOND)
        .await
        .unwrap();
    assert_eq!(String::from_utf8(caller).unwrap(), "Member(5)");
    let joining = client(0);
    let caller = joining
        .call(
            Target::AnyAt {
                address: server.address.clone(),
            },
            4,
            Vec::new(),
            SECOND,
        )
        .await
        .unwrap();
    assert_eq!(String::from_utf8(caller).unwrap(), "Unassigned");
}

/// A payload of parts of these lengths, each byte telling its part and place.
fn parts_of(lengths: &[usize]) -> Vec<bytes::Bytes> {
    (lengths.iter().enumerate())
        .map(|(part, length)| {
            (0..*length)
                .map(|at| ((at * 7 + part * 31) % 251) as u8)
                .collect::<Vec<u8>>()
                .into()
        })
        .collect()
}

// Proves a payload given as parts reaches the handler as one payload, in order: small ones
// (copied into the outbox), large ones (written from the parts), empty parts, and more parts
// than one vectored write takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_in_parts_arrives_as_one_in_order() {
    let server = server(3).await;
    let peers = client(5);
    let many = vec![10_000; 150];
    for lengths in [
        &[3, 0, 5][..],
        &[100, 70_000, 1, 200_000, 7][..],
        &[0, 65_536][..],
        &many[..],
    ] {
        let parts = parts_of(lengths);
        let whole: Vec<u8> = parts.iter().flat_map(|part| part.to_vec()).collect();
        let payload = keel_rpc::Payload::from_parts(parts);
        assert_eq!(payload.len(), whole.len());
        let answer = peers
            .call(node(3, &server), 1, payload, 5 * SECOND)
            .await
            .unwrap();
        assert!(answer == whole, "parts of {lengths:?} arrived otherwise");
    }
    // Too large as a whole, though every part is under the limit: refused before sending.
    let refused = peers
        .call(
            node(3, &server),
            1,
            keel_rpc::Payload::from_parts(parts_of(&[3 << 20, 2 << 20])),
            SECOND,
        )
        .await;
    assert!(
        matches!(refused, Err(RpcError::FrameTooLarge { .. })),
        "{refused:?}"
    );
}

// Proves payloads up to the limit pass and larger ones are refused before sending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_limit() {
    let server = server(3).await;
    let peers = client(5);
    let big = vec![0xA5u8; 4 << 20];
    assert_eq!(
        peers
            .call(node(3, &server), 1, big.clone(), 10 * SECOND)
            .await
            .unwrap(),
        big
    );
    let too_big = vec![0u8; (4 << 20) + 1];
    let refused = peers.call(node(3, &server), 1, too_big, SECOND).await;
    assert!(
        matches!(refused, Err(RpcError::FrameTooLarge { .. })),
        "{refused:?}"
    );
}

// Proves a wrong secret, another cluster id and a wrong node id are refused (never sent), and
// that the server goes on serving others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication_refusals() {
    let server = server(3).await;
    let wrong_secret = Peers::new(
        identity(5, [9; 32], CLUSTER),
        RpcConfig::default(),
        Faults::new(),
    );
    let refused = wrong_secret
        .call(node(3, &server), 1, b"x".to_vec(), SECOND)
        .await;
    match &refused {
        Err(error @ RpcError::Auth { detail, .. }) => {
            assert!(error.never_sent());
            assert!(detail.contains("secret"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    let other_cluster = Peers::new(
        identity(5, SECRET, [7; 16]),
        RpcConfig::default(),
        Faults::new(),
    );
    let refused = other_cluster
        .call(node(3, &server), 1, b"x".to_vec(), SECOND)
        .await;
    assert!(
        matches!(&refused, Err(RpcError::Auth { detail, .. }) if detail.contains("another cluster")),
        "{refused:?}"
    );
    let peers = client(5);
    let wrong_node = peers.call(node(4, &server), 1, b"x".to_vec(), SECOND).await;
    assert!(
        matches!(
            wrong_node,
            Err(RpcError::WrongPeer {
                expected: 4,
                found: 3,
                ..
            })
        ),
        "{wrong_node:?}"
    );
    assert_eq!(
        peers
            .call(node(3, &server), 1, b"ok".to_vec(), SECOND)
            .await
            .unwrap(),
        b"ok"
    );
}

/// A client hello as the handshake lays it out, speaking `protocol`.
fn hello_speaking(protocol: u16) -> [u8; 64] {
    let mut hello = [0u8; 64];
    hello[0..4].copy_from_slice(b"KHLO");
    hello[4] = 1;
    hello[6..8].copy_from_slice(&protocol.to_le_bytes());
    hello[8..24].copy_from_slice(&CLUSTER);
    hello[24..32].copy_from_slice(&5u64.to_le_bytes());
    hello
}

// Proves nodes speaking different node-to-node protocols refuse each other at the handshake,
// each side naming both protocols: a server answers a client of another protocol (or of a
// build from before protocol numbers, which sent 0) with the refusal status and closes, and a
// client refuses a server of another protocol before any call is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_of_different_protocols_refuse_each_other() {
    let server = server(3).await;
    for theirs in [0, keel_rpc::handshake::PROTOCOL + 1] {
        let mut stream = TcpStream::connect(&server.address).await.unwrap();
        stream.write_all(&hello_speaking(theirs)).await.unwrap();
        let mut reply = [0u8; 96];
        stream.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply[0..4], b"KHLO");
        assert_eq!(reply[5], 2, "the refusal status for protocol {theirs}");
        assert_eq!(
            u16::from_le_bytes([reply[6], reply[7]]),
            keel_rpc::handshake::PROTOCOL
        );
        assert!(closed_by_server(&mut stream).await);
    }
    // The server still serves a client of its own protocol.
    assert_eq!(
        client(5)
            .call(node(3, &server), 1, b"ok".to_vec(), SECOND)
            .await
            .unwrap(),
        b"ok"
    );

    // A server from before protocol numbers: its hello carries 0 where the protocol goes.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let old_server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut hello = [0u8; 64];
        stream.read_exact(&mut hello).await.unwrap();
        let mut reply = [0u8; 96];
        reply[0..4].copy_from_slice(b"KHLO");
        reply[4] = 1;
        reply[8..24].copy_from_slice(&CLUSTER);
        reply[24..32].copy_from_slice(&3u64.to_le_bytes());
        stream.write_all(&reply).await.unwrap();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
        rest
    });
    let refused = client(5)
        .call(
            Target::Node {
                id: 3,
                address: address.clone(),
            },
            1,
            b"x".to_vec(),
            SECOND,
        )
        .await;
    match &refused {
        Err(error @ RpcError::Auth { detail, .. }) => {
            assert!(error.never_sent());
            assert!(
                detail.contains("protocol 0")
                    && detail.contains(&format!("this node {}", keel_rpc::handshake::PROTOCOL))
                    && detail.contains("same Keel release"),
                "{detail}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        old_server.await.unwrap().is_empty(),
        "the client sent its proof to a server of another protocol"
    );
}

/// A raw authenticated connection (the test plays the client by hand).
async fn raw_session(server: &Server) -> (TcpStream, keel_rpc::handshake::Session) {
    let mut stream = TcpStream::connect(&server.address).await.unwrap();
    let session = keel_rpc::handshake::client(
        &mut stream,
        &Identity {
            cluster_id: CLUSTER,
            node_id: 8,
            secret: ClusterSecret::from_bytes(SECRET),
        },
    )
    .await
    .unwrap();
    (stream, session)
}

fn request(key: &[u8; 32], counter: u64, request_id: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    frame::encode_frame(
        &mut out,
        key,
        counter,
        &frame::Header {
            kind: frame::Kind::Request,
            method: 1,
            request_id,
            deadline_ms: 1000,
            length: payload.len() as u32,
        },
        payload,
    );
    out
}

/// Accepts one connection and plays the server's side of the handshake by hand (as node 3).
async fn accept_session(listener: TcpListener) -> (TcpStream, keel_rpc::handshake::Session) {
    let (mut stream, _) = listener.accept().await.unwrap();
    let session = keel_rpc::handshake::server(
        &mut stream,
        &Identity {
            cluster_id: CLUSTER,
            node_id: 3,
            secret: ClusterSecret::from_bytes(SECRET),
        },
    )
    .await
    .unwrap();
    (stream, session)
}

/// Reads the next frame by hand (within 20 s) and asserts its MAC holds under `key` as frame
/// number `counter` of its direction: it arrived whole and in order.
async fn read_verified(
    stream: &mut TcpStream,
    key: &[u8; 32],
    counter: u64,
) -> (frame::Header, Vec<u8>) {
    let read = async {
        let mut header_bytes = [0u8; frame::HEADER_BYTES];
        stream.read_exact(&mut header_bytes).await.unwrap();
        let header = frame::Header::decode(&header_bytes, 4 << 20).unwrap();
        let mut mac = [0u8; frame::MAC_BYTES];
        stream.read_exact(&mut mac).await.unwrap();
        let mut payload = vec![0u8; header.length as usize];
        stream.read_exact(&mut payload).await.unwrap();
        (header_bytes, header, mac, payload)
    };
    let (header_bytes, header, mac, payload) = tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .expect("every frame comes whole");
    assert!(
        frame::mac_matches(&mac, &frame::mac(key, counter, &header_bytes, &payload)),
        "frame {counter} is whole and in order"
    );
    (header, payload)
}

async fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buffer = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(3), stream.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

// Proves garbage before the handshake, a bit-flipped frame, a replayed frame and a truncated
// frame each close that connection only; the server keeps answering others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_closes_only_that_connection() {
    let server = server(3).await;
    let peers = client(5);

    let mut garbage = TcpStream::connect(&server.address).await.unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    garbage.write_all(&[0xFFu8; 4096]).await.unwrap();
    assert!(closed_by_server(&mut garbage).await, "garbage handshake");

    let (mut stream, session) = raw_session(&server).await;
    let good = request(&session.client_to_server, 0, 1, b"fine");
    stream.write_all(&good).await.unwrap();
    let mut flipped = request(&session.client_to_server, 1, 2, b"flipped");
    let last = flipped.len() - 1;
    flipped[last] ^= 0x01;
    stream.write_all(&flipped).await.unwrap();
    assert!(closed_by_server(&mut stream).await, "bit flip");

    let (mut stream, session) = raw_session(&server).await;
    let first = request(&session.client_to_server, 0, 1, b"once");
    stream.write_all(&first).await.unwrap();
    stream.write_all(&first).await.unwrap();
    assert!(closed_by_server(&mut stream).await, "replay");

    let (mut stream, session) = raw_session(&server).await;
    let whole = request(&session.client_to_server, 0, 1, &[7u8; 1000]);
    stream.write_all(&whole[..whole.len() / 2]).await.unwrap();
    stream.shutdown().await.unwrap();
    assert!(closed_by_server(&mut stream).await, "truncated");

    let (mut stream, session) = raw_session(&server).await;
    let mut oversized = frame::Header {
        kind: frame::Kind::Request,
        method: 1,
        request_id: 1,
        deadline_ms: 0,
        length: u32::MAX,
    }
    .encode()
    .to_vec();
    oversized.extend_from_slice(&[0u8; 16]);
    let _ = session;
    stream.write_all(&oversized).await.unwrap();
    assert!(
        closed_by_server(&mut stream).await,
        "a length over the limit"
    );

    assert_eq!(
        peers
            .call(node(3, &server), 1, b"still".to_vec(), SECOND)
            .await
            .unwrap(),
        b"still"
    );
}

// Proves a call slower than its timeout fails with Timeout, and the server drops the work once
// the caller's budget is spent (the handler never completes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_travel_to_the_server() {
    let server = server(3).await;
    let peers = client(5);
    let slow = peers
        .call(node(3, &server), 5, Vec::new(), Duration::from_millis(200))
        .await;
    assert!(matches!(slow, Err(RpcError::Timeout { .. })), "{slow:?}");
    assert!(!slow.unwrap_err().never_sent());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        server.handler.completed.load(Ordering::SeqCst),
        0,
        "the handler was cancelled"
    );
}

// Proves a peer that stops reading makes callers time out (bounded queue) instead of growing
// memory without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_peer_fills_the_bounded_queue() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let accepted = tokio::spawn(async move {
        let (stream, _session) = accept_session(listener).await;
        // Never read again: hold the socket open.
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(stream);
    });
    let peers = Peers::new(
        identity(5, SECRET, CLUSTER),
        RpcConfig {
            queue_frames_max: 8,
            ..RpcConfig::default()
        },
        Faults::new(),
    );
    let payload = vec![0u8; 1 << 20];
    let mut outcomes = Vec::new();
    for _ in 0..40 {
        let outcome = peers
            .call(
                Target::Node {
                    id: 3,
                    address: address.clone(),
                },
                1,
                payload.clone(),
                Duration::from_millis(100),
            )
            .await;
        outcomes.push(outcome);
    }
    assert!(outcomes.iter().all(|outcome| outcome.is_err()));
    assert!(
        outcomes
            .iter()
            .any(|outcome| matches!(outcome, Err(RpcError::Unreachable { detail, .. }) if detail.contains("queue full"))),
        "the queue filled and refused new frames"
    );
    accepted.abort();
}

// Proves frames a socket cannot take at once are not lost or reordered: a peer that reads
// nothing for a while (the client's socket fills, its later frames wait in its outbox) then
// gets every frame whole, MAC-checked in counter order, and the calls are answered. Each
// payload is sent as parts, so a frame the socket took part of continues from the right part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_a_full_socket_held_back_arrive_whole_and_in_order() {
    const CALLS: usize = 16;
    const PAYLOAD: usize = 1 << 20;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let accepted = tokio::spawn(async move {
        let (mut stream, session) = accept_session(listener).await;
        // Read nothing until the client's socket is full and frames wait behind it.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut seen = Vec::new();
        for counter in 0..CALLS as u64 {
            let (header, payload) =
                read_verified(&mut stream, &session.client_to_server, counter).await;
            // Sent as three parts: the middle one's bytes differ, so parts out of order or
            // repeated show.
            let fill = payload[0];
            let mut expected = vec![fill; PAYLOAD];
            expected[PAYLOAD / 2..PAYLOAD / 2 + 10].fill(fill.wrapping_add(100));
            assert!(payload == expected, "frame {counter} arrived damaged");
            seen.push(fill);
            let mut answer = Vec::new();
            frame::encode_frame(
                &mut answer,
                &session.server_to_client,
                counter,
                &frame::Header {
                    kind: frame::Kind::Response,
                    method: 0,
                    request_id: header.request_id,
                    deadline_ms: 0,
                    length: 1,
                },
                &[payload[0]],
            );
            stream.write_all(&answer).await.unwrap();
        }
        seen
    });
    let peers = client(5);
    let mut calls = Vec::new();
    for index in 0..CALLS {
        let peers = peers.clone();
        let target = Target::Node {
            id: 3,
            address: address.clone(),
        };
        calls.push(tokio::spawn(async move {
            let fill = index as u8 + 1;
            let parts: Vec<bytes::Bytes> = vec![
                vec![fill; PAYLOAD / 2].into(),
                vec![fill.wrapping_add(100); 10].into(),
                vec![fill; PAYLOAD / 2 - 10].into(),
            ];
            let answer = peers
                .call(
                    target,
                    1,
                    keel_rpc::Payload::from_parts(parts),
                    Duration::from_secs(20),
                )
                .await
                .unwrap();
            assert_eq!(answer, vec![fill]);
        }));
        // One dial, then the rest on its connection.
        if index == 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for call in calls {
        call.await.unwrap();
    }
    let mut seen = accepted.await.unwrap();
    seen.sort_unstable();
    assert_eq!(
        seen,
        (1..=CALLS as u8).collect::<Vec<_>>(),
        "every frame arrived once"
    );
}

// Proves a server's answers that its socket cannot take at once are not lost or reordered: a
// client that reads nothing for a while (the server's socket fills, later answers wait in its
// outbox) then gets every answer whole, MAC-checked in counter order, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_a_full_socket_held_back_arrive_whole_and_in_order() {
    const CALLS: u64 = 16;
    const PAYLOAD: usize = 1 << 20;
    let server = server(3).await;
    let (mut stream, session) = raw_session(&server).await;
    for index in 0..CALLS {
        let payload = vec![index as u8 + 1; PAYLOAD];
        let frame = request(&session.client_to_server, index, index + 1, &payload);
        stream.write_all(&frame).await.unwrap();
    }
    // Read nothing until the server's socket is full and answers wait behind it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut answered = Vec::new();
    for counter in 0..CALLS {
        let (header, payload) =
            read_verified(&mut stream, &session.server_to_client, counter).await;
        assert_eq!(header.kind, frame::Kind::Response);
        assert_eq!(
            payload,
            vec![header.request_id as u8; PAYLOAD],
            "the answer to request {}",
            header.request_id
        );
        answered.push(header.request_id);
    }
    answered.sort_unstable();
    assert_eq!(
        answered,
        (1..=CALLS).collect::<Vec<_>>(),
        "every request answered once"
    );
}

// Proves the client redials after the server restarts on the same address, and backs off
// against a peer that keeps refusing (a bounded number of dials in a fixed time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_and_backoff() {
    let first = server(3).await;
    let address = first.address.clone();
    let peers = client(5);
    assert!(peers
        .call(node(3, &first), 1, b"a".to_vec(), SECOND)
        .await
        .is_ok());
    first.stop.send_replace(true);
    first.task.await.unwrap();
    let lost = peers
        .call(
            Target::Node {
                id: 3,
                address: address.clone(),
            },
            1,
            b"b".to_vec(),
            SECOND,
        )
        .await;
    assert!(lost.is_err());
    // Rebind the same address: the next call (after the backoff) reaches the new server.
    let listener = loop {
        match TcpListener::bind(&address).await {
            Ok(listener) => break listener,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let second = server_at(listener, 3).await;
    let mut answered = false;
    for _ in 0..100 {
        if peers
            .call(node(3, &second), 1, b"c".to_vec(), SECOND)
            .await
            .is_ok()
        {
            answered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(answered, "reconnected");

    // A listener that accepts and drops every connection: count the dials over 2 seconds.
    let refuser = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let refuser_address = refuser.local_addr().unwrap().to_string();
    let dials = Arc::new(AtomicUsize::new(0));
    let counter = dials.clone();
    let accept_task = tokio::spawn(async move {
        loop {
            if let Ok((stream, _)) = refuser.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                drop(stream);
            }
        }
    });
    let until = tokio::time::Instant::now() + Duration::from_secs(2);
    let mut attempts = 0;
    while tokio::time::Instant::now() < until {
        let _ = peers
            .call(
                Target::AnyAt {
                    address: refuser_address.clone(),
                },
                1,
                Vec::new(),
                Duration::from_millis(200),
            )
            .await;
        attempts += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    accept_task.abort();
    let dialed = dials.load(Ordering::SeqCst);
    assert!(attempts > 50, "the caller kept calling ({attempts})");
    assert!(dialed <= 8, "{dialed} dials in 2 s: no backoff");
}

// Proves the fault proxy: a blocked node's calls go unanswered and calls to it time out; after
// clearing, traffic flows again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_proxy_partitions_and_heals() {
    let server = server(3).await;
    let peers = client(5);
    assert!(peers
        .call(node(3, &server), 1, b"a".to_vec(), SECOND)
        .await
        .is_ok());
    server.faults.block(5);
    let unanswered = peers
        .call(
            node(3, &server),
            1,
            b"b".to_vec(),
            Duration::from_millis(300),
        )
        .await;
    assert!(
        matches!(unanswered, Err(RpcError::Timeout { .. })),
        "{unanswered:?}"
    );
    server.faults.clear();
    peers.faults().block(3);
    let blocked = peers
        .call(
            node(3, &server),
            1,
            b"c".to_vec(),
            Duration::from_millis(300),
        )
        .await;
    assert!(
        matches!(blocked, Err(RpcError::Timeout { .. })),
        "{blocked:?}"
    );
    peers.faults().clear();
    assert!(peers
        .call(node(3, &server), 1, b"d".to_vec(), SECOND)
        .await
        .is_ok());
}

// Proves a delayed call waits before it is sent, only for the node and method it names; a
// delay longer than the call's deadline times out; clear heals it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_proxy_delays_calls() {
    let server = server(3).await;
    let peers = client(5);
    let timed = |method: u16, timeout: Duration| {
        let peers = peers.clone();
        let target = node(3, &server);
        async move {
            let started = std::time::Instant::now();
            let outcome = peers.call(target, method, b"a".to_vec(), timeout).await;
            (outcome, started.elapsed())
        }
    };
    assert!(timed(1, SECOND).await.0.is_ok());
    peers.faults().delay(Delay {
        node: 3,
        method: Some(1),
        by: Duration::from_millis(300),
        jitter: false,
    });
    let (outcome, took) = timed(1, SECOND).await;
    assert!(outcome.is_ok(), "{outcome:?}");
    assert!(took >= Duration::from_millis(300), "{took:?}");
    let (outcome, took) = timed(4, SECOND).await;
    assert!(outcome.is_ok(), "{outcome:?}");
    assert!(
        took < Duration::from_millis(300),
        "another method waited {took:?}"
    );
    let (outcome, _) = timed(1, Duration::from_millis(200)).await;
    assert!(
        matches!(outcome, Err(RpcError::Timeout { .. })),
        "{outcome:?}"
    );
    peers.faults().clear();
    let (outcome, took) = timed(1, SECOND).await;
    assert!(outcome.is_ok(), "{outcome:?}");
    assert!(
        took < Duration::from_millis(300),
        "healed, still waited {took:?}"
    );
}

mod decoder {
    use keel_rpc::frame::{decode_frame, encode_frame, Header, Kind};
    use proptest::prelude::*;

    proptest! {
        // Proves the decoder never panics on arbitrary bytes.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_frame(&bytes, &[3; 32], 0, 1 << 20);
        }

        // Proves any mutation of a valid frame (a changed byte, a truncation) is refused or
        // incomplete, never accepted.
        #[test]
        fn mutated_frames_are_refused(
            payload in prop::collection::vec(any::<u8>(), 0..200),
            position in any::<prop::sample::Index>(),
            flip in 1u8..=255,
            cut in any::<prop::sample::Index>(),
        ) {
            let mut frame = Vec::new();
            encode_frame(&mut frame, &[3; 32], 5, &Header {
                kind: Kind::Response, method: 0, request_id: 9, deadline_ms: 0,
                length: payload.len() as u32,
            }, &payload);
            let mut mutated = frame.clone();
            let at = position.index(mutated.len());
            mutated[at] ^= flip;
            prop_assert!(!matches!(decode_frame(&mutated, &[3; 32], 5, 1 << 20), Ok(Some(_))));
            let truncated = &frame[..cut.index(frame.len())];
            prop_assert!(!matches!(decode_frame(truncated, &[3; 32], 5, 1 << 20), Ok(Some(_))));
        }
    }
}
