//! A tiny NBD server for tests (raw tokio TCP: fixed newstyle + NBD_OPT_GO, READ/WRITE/FLUSH,
//! FUA) that models a disk with a volatile write cache: writes land in a volatile list and reach
//! the durable image only on FLUSH (or FUA). `crash()` kills every connection and drops the
//! volatile list, as a power cut would. The honest server writes back before acknowledging a
//! FLUSH (or FUA write); the liar acknowledges both at once and never writes back. With
//! `reorder`, replies are sent after a per-request delay, so they arrive out of order.

#![allow(clippy::unwrap_used, dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};

pub const EXPORT_SIZE_BYTES: usize = 4 * 1024 * 1024;
/// Requests the server handles before the test crashes it.
pub const CRASH_AFTER_REQUESTS: u64 = 600;
/// Upper bound on any wait in these tests.
pub const WAIT_MAX: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Behaviour {
    Honest,
    Liar,
}

/// The simulated disk: a durable image plus writes still in the volatile cache, in order.
pub struct Disk {
    pub durable: Vec<u8>,
    volatile: Vec<(usize, Vec<u8>)>,
    flushes: u64,
}

impl Disk {
    fn write_back(&mut self) {
        for (offset, data) in self.volatile.drain(..) {
            self.durable[offset..offset + data.len()].copy_from_slice(&data);
        }
    }

    fn read(&self, offset: usize, length: usize) -> Vec<u8> {
        let mut data = self.durable[offset..offset + length].to_vec();
        for (write_offset, write) in &self.volatile {
            let start = offset.max(*write_offset);
            let end = (offset + length).min(write_offset + write.len());
            if start < end {
                data[start - offset..end - offset]
                    .copy_from_slice(&write[start - write_offset..end - write_offset]);
            }
        }
        data
    }
}

pub struct TestServer {
    pub address: SocketAddr,
    pub disk: Arc<Mutex<Disk>>,
    connections: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    pub requests: Arc<AtomicU64>,
    /// Owns the server's threads; dropping it stops the server.
    _runtime: tokio::runtime::Runtime,
}

impl TestServer {
    pub fn start(behaviour: Behaviour, reorder: bool) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let disk = Arc::new(Mutex::new(Disk {
            durable: vec![0u8; EXPORT_SIZE_BYTES],
            volatile: Vec::new(),
            flushes: 0,
        }));
        let connections = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(AtomicU64::new(0));
        let listener = runtime.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let address = listener.local_addr().unwrap();
        let (accept_disk, accept_connections, accept_requests) =
            (disk.clone(), connections.clone(), requests.clone());
        runtime.spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let task = tokio::spawn(serve(
                    stream,
                    behaviour,
                    reorder,
                    accept_disk.clone(),
                    accept_requests.clone(),
                ));
                accept_connections.lock().unwrap().push(task);
            }
        });
        Self {
            address,
            disk,
            connections,
            requests,
            _runtime: runtime,
        }
    }

    pub fn uri(&self) -> String {
        format!("nbd://{}/test", self.address)
    }

    /// Power cut: every connection dies and the volatile cache is lost.
    pub fn crash(&self) {
        for task in self.connections.lock().unwrap().drain(..) {
            task.abort();
        }
        // Let the aborts land before the cache is dropped, so no in-flight FLUSH completes after.
        std::thread::sleep(Duration::from_millis(50));
        self.disk.lock().unwrap().volatile.clear();
    }
}

async fn serve(
    mut stream: TcpStream,
    behaviour: Behaviour,
    reorder: bool,
    disk: Arc<Mutex<Disk>>,
    requests: Arc<AtomicU64>,
) {
    if handshake(&mut stream).await.is_ok() {
        let _ = transmit(stream, behaviour, reorder, &disk, &requests).await;
    }
}

async fn handshake(stream: &mut TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    // Greeting: NBDMAGIC, IHAVEOPT, FIXED_NEWSTYLE | NO_ZEROES.
    let mut greeting = Vec::new();
    greeting.extend_from_slice(b"NBDMAGIC");
    greeting.extend_from_slice(b"IHAVEOPT");
    greeting.extend_from_slice(&3u16.to_be_bytes());
    stream.write_all(&greeting).await?;
    let _client_flags = stream.read_u32().await?;
    loop {
        let magic = stream.read_u64().await?;
        assert_eq!(magic, u64::from_be_bytes(*b"IHAVEOPT"));
        let option = stream.read_u32().await?;
        let length = stream.read_u32().await?;
        let mut data = vec![0u8; length as usize];
        stream.read_exact(&mut data).await?;
        let reply = |reply_type: u32, payload: &[u8]| {
            let mut message = Vec::new();
            message.extend_from_slice(&0x0003_e889_0455_65a9u64.to_be_bytes());
            message.extend_from_slice(&option.to_be_bytes());
            message.extend_from_slice(&reply_type.to_be_bytes());
            message.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            message.extend_from_slice(payload);
            message
        };
        match option {
            // NBD_OPT_GO: NBD_INFO_EXPORT (size, HAS_FLAGS | SEND_FLUSH | SEND_FUA), then ACK.
            7 => {
                let mut info = Vec::new();
                info.extend_from_slice(&0u16.to_be_bytes());
                info.extend_from_slice(&(EXPORT_SIZE_BYTES as u64).to_be_bytes());
                info.extend_from_slice(&(1u16 | 4 | 8).to_be_bytes());
                stream.write_all(&reply(3, &info)).await?;
                stream.write_all(&reply(1, &[])).await?;
                return Ok(());
            }
            2 => return Err(std::io::ErrorKind::ConnectionAborted.into()),
            _ => stream.write_all(&reply(0x8000_0001, &[])).await?,
        }
    }
}

/// Sends `reply` now, or (reordering) after a delay derived from the handle, from a task owned
/// by `replies` so a crash (aborting the connection task) also drops the pending replies.
async fn send_reply(
    writer: &Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    replies: &mut tokio::task::JoinSet<()>,
    reorder: bool,
    handle: u64,
    reply: Vec<u8>,
) -> std::io::Result<()> {
    if !reorder {
        return writer.lock().await.write_all(&reply).await;
    }
    while replies.try_join_next().is_some() {}
    let delay = Duration::from_micros(handle.wrapping_mul(2_654_435_761) % 2000);
    let writer = writer.clone();
    replies.spawn(async move {
        tokio::time::sleep(delay).await;
        let _ = writer.lock().await.write_all(&reply).await;
    });
    Ok(())
}

async fn transmit(
    stream: TcpStream,
    behaviour: Behaviour,
    reorder: bool,
    disk: &Mutex<Disk>,
    requests: &AtomicU64,
) -> std::io::Result<()> {
    let (mut stream, writer) = stream.into_split();
    let writer = Arc::new(tokio::sync::Mutex::new(writer));
    let mut replies = tokio::task::JoinSet::new();
    loop {
        let magic = stream.read_u32().await?;
        assert_eq!(magic, 0x2560_9513);
        let flags = stream.read_u16().await?;
        let command = stream.read_u16().await?;
        let handle = stream.read_u64().await?;
        let offset = stream.read_u64().await? as usize;
        let length = stream.read_u32().await? as usize;
        requests.fetch_add(1, Ordering::SeqCst);
        let mut reply = Vec::with_capacity(16 + length);
        reply.extend_from_slice(&0x6744_6698u32.to_be_bytes());
        let in_range = offset + length <= EXPORT_SIZE_BYTES;
        match command {
            0 => {
                let data = if in_range {
                    Some(disk.lock().unwrap().read(offset, length))
                } else {
                    None
                };
                reply.extend_from_slice(&(if data.is_some() { 0u32 } else { 22 }).to_be_bytes());
                reply.extend_from_slice(&handle.to_be_bytes());
                if let Some(data) = data {
                    reply.extend_from_slice(&data);
                }
            }
            1 => {
                let mut data = vec![0u8; length];
                stream.read_exact(&mut data).await?;
                if in_range {
                    let mut disk = disk.lock().unwrap();
                    disk.volatile.push((offset, data));
                    if flags & 1 != 0 && behaviour == Behaviour::Honest {
                        disk.write_back();
                    }
                }
                reply.extend_from_slice(&(if in_range { 0u32 } else { 22 }).to_be_bytes());
                reply.extend_from_slice(&handle.to_be_bytes());
            }
            2 => {
                while replies.join_next().await.is_some() {}
                return Ok(());
            }
            3 => {
                {
                    let mut disk = disk.lock().unwrap();
                    disk.flushes += 1;
                    if behaviour == Behaviour::Honest {
                        disk.write_back();
                    }
                }
                reply.extend_from_slice(&0u32.to_be_bytes());
                reply.extend_from_slice(&handle.to_be_bytes());
            }
            _ => {
                reply.extend_from_slice(&22u32.to_be_bytes());
                reply.extend_from_slice(&handle.to_be_bytes());
            }
        }
        send_reply(&writer, &mut replies, reorder, handle, reply).await?;
    }
}
