//! Shared test harness: starts the real `serve` loop on 127.0.0.1:0 inside the test process, and
//! a hand-rolled NBD client speaking raw bytes over TCP (so tests control every byte, including
//! the wrong ones). Every network wait is bounded by [`IO_TIMEOUT`].
#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use keel_nbd::protocol::*;
use keel_nbd::testing::MemoryExports;
use keel_nbd::Exports;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Longest any single network wait in a test may take.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// Size of the default export "mem" in tests.
pub const MEM_SIZE_BYTES: u64 = 4 << 20;

pub struct Server {
    pub address: SocketAddr,
    /// Every request the server registered (`keel ops`).
    pub ops: keel_ops::Ops,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// Serves `exports` on an ephemeral loopback port.
    pub async fn start(exports: Arc<dyn Exports>) -> Server {
        Server::start_with(exports, keel_nbd::Limits::default()).await
    }

    /// Serves `exports` with other limits.
    pub async fn start_with(exports: Arc<dyn Exports>, limits: keel_nbd::Limits) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let ops = keel_ops::Ops::new(Arc::new(keel_clock::SystemClock), Duration::from_secs(1));
        let task = tokio::spawn(keel_nbd::serve_with(
            listener,
            exports,
            shutdown,
            limits,
            ops.clone(),
        ));
        Server {
            address,
            ops,
            stop: Some(stop),
            task,
        }
    }

    /// Serves the in-memory export "mem" ([`MEM_SIZE_BYTES`]) and returns it too.
    pub async fn start_memory() -> (Server, Arc<MemoryExports>) {
        let exports = Arc::new(MemoryExports::new());
        exports.insert("mem", MEM_SIZE_BYTES);
        let server = Server::start(Arc::clone(&exports) as Arc<dyn Exports>).await;
        (server, exports)
    }

    /// Asks the server to stop and waits for `serve` to return.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(60), &mut self.task)
            .await
            .expect("serve returns after shutdown")
            .expect("serve task did not panic")
            .expect("serve returned Ok");
    }

    /// The server accepts a new client, negotiates "mem", writes, reads back and disconnects
    /// cleanly: proof it survived whatever the previous client did.
    pub async fn assert_serves(&self) {
        let mut client = Client::connect(self.address).await;
        client
            .send_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
            .await;
        let (size, _) = client.go("mem", &[]).await.expect("GO mem succeeds");
        let pattern = vec![0x5a; 4096];
        let offset = size - 4096;
        client
            .request(0, CMD_WRITE, 901, offset, 4096, &pattern)
            .await;
        assert_eq!(client.simple_reply(0).await, (0, 901, vec![]));
        client.request(0, CMD_READ, 902, offset, 4096, &[]).await;
        assert_eq!(client.simple_reply(4096).await, (0, 902, pattern));
        client.request(0, CMD_DISC, 903, 0, 0, &[]).await;
        client.expect_closed().await;
    }
}

pub struct Client {
    pub stream: TcpStream,
}

impl Client {
    /// Connects and checks the server's greeting.
    pub async fn connect(address: SocketAddr) -> Client {
        let stream = tokio::time::timeout(IO_TIMEOUT, TcpStream::connect(address))
            .await
            .expect("connect in time")
            .expect("connect");
        stream.set_nodelay(true).unwrap();
        let mut client = Client { stream };
        let greeting = client.read_bytes(GREETING_BYTES).await;
        assert_eq!(&greeting[0..8], b"NBDMAGIC");
        assert_eq!(&greeting[8..16], b"IHAVEOPT");
        assert_eq!(
            u16::from_be_bytes([greeting[16], greeting[17]]),
            FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES
        );
        client
    }

    /// A client past the handshake, on export "mem".
    pub async fn connect_go(address: SocketAddr) -> Client {
        let mut client = Client::connect(address).await;
        client
            .send_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
            .await;
        client.go("mem", &[]).await.expect("GO mem succeeds");
        client
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        tokio::time::timeout(IO_TIMEOUT, self.stream.write_all(bytes))
            .await
            .expect("send in time")
            .expect("send");
    }

    pub async fn read_bytes(&mut self, length: usize) -> Vec<u8> {
        let mut buffer = vec![0u8; length];
        tokio::time::timeout(IO_TIMEOUT, self.stream.read_exact(&mut buffer))
            .await
            .expect("server answers in time")
            .expect("server answers");
        buffer
    }

    pub async fn send_flags(&mut self, flags: u32) {
        self.send(&flags.to_be_bytes()).await;
    }

    pub async fn option(&mut self, option: u32, data: &[u8]) {
        let header = OptionHeader {
            option,
            length_bytes: data.len() as u32,
        };
        let mut bytes = header.encode().to_vec();
        bytes.extend_from_slice(data);
        self.send(&bytes).await;
    }

    /// Reads one option reply: (option, reply type, data).
    pub async fn option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let header = self.read_bytes(OPTION_REPLY_HEADER_BYTES).await;
        assert_eq!(
            u64::from_be_bytes(header[0..8].try_into().unwrap()),
            OPTION_REPLY_MAGIC
        );
        let option = u32::from_be_bytes(header[8..12].try_into().unwrap());
        let reply_type = u32::from_be_bytes(header[12..16].try_into().unwrap());
        let length = u32::from_be_bytes(header[16..20].try_into().unwrap());
        assert!(length < 1 << 20, "option reply length {length} is sane");
        let data = self.read_bytes(length as usize).await;
        (option, reply_type, data)
    }

    /// NBD_OPT_GO/INFO body.
    pub fn info_data(name: &str, information: &[u16]) -> Vec<u8> {
        let mut data = (name.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&(information.len() as u16).to_be_bytes());
        for info in information {
            data.extend_from_slice(&info.to_be_bytes());
        }
        data
    }

    /// Sends NBD_OPT_INFO or NBD_OPT_GO; returns the INFO replies (type → payload) on success,
    /// or the error reply type.
    pub async fn info_or_go(
        &mut self,
        option: u32,
        name: &str,
        information: &[u16],
    ) -> Result<Vec<(u16, Vec<u8>)>, (u32, String)> {
        self.option(option, &Client::info_data(name, information))
            .await;
        let mut infos = Vec::new();
        loop {
            let (replied_option, reply_type, data) = self.option_reply().await;
            assert_eq!(replied_option, option);
            match reply_type {
                REP_INFO => {
                    let kind = u16::from_be_bytes([data[0], data[1]]);
                    infos.push((kind, data[2..].to_vec()));
                }
                REP_ACK => return Ok(infos),
                error => return Err((error, String::from_utf8_lossy(&data).into_owned())),
            }
        }
    }

    /// NBD_OPT_GO; returns (size, transmission flags) from NBD_INFO_EXPORT.
    pub async fn go(&mut self, name: &str, information: &[u16]) -> Result<(u64, u16), u32> {
        let infos = self
            .info_or_go(OPT_GO, name, information)
            .await
            .map_err(|(code, _)| code)?;
        let export = infos
            .iter()
            .find(|(kind, _)| *kind == INFO_EXPORT)
            .expect("GO success carries NBD_INFO_EXPORT");
        assert_eq!(export.1.len(), 10);
        Ok((
            u64::from_be_bytes(export.1[0..8].try_into().unwrap()),
            u16::from_be_bytes(export.1[8..10].try_into().unwrap()),
        ))
    }

    pub fn request_bytes(
        flags: u16,
        command: u16,
        cookie: u64,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Vec<u8> {
        let header = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        let mut bytes = header.encode().to_vec();
        bytes.extend_from_slice(payload);
        bytes
    }

    pub async fn request(
        &mut self,
        flags: u16,
        command: u16,
        cookie: u64,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) {
        let bytes = Client::request_bytes(flags, command, cookie, offset, length, payload);
        self.send(&bytes).await;
    }

    /// Reads a simple reply; `data_length` bytes of data follow a successful read's reply.
    /// Returns (error, cookie, data).
    pub async fn simple_reply(&mut self, data_length: usize) -> (u32, u64, Vec<u8>) {
        let header = self.read_bytes(SIMPLE_REPLY_HEADER_BYTES).await;
        assert_eq!(
            u32::from_be_bytes(header[0..4].try_into().unwrap()),
            SIMPLE_REPLY_MAGIC
        );
        let error = u32::from_be_bytes(header[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(header[8..16].try_into().unwrap());
        let data = if error == 0 && data_length > 0 {
            self.read_bytes(data_length).await
        } else {
            Vec::new()
        };
        (error, cookie, data)
    }

    /// The server closed the connection (EOF, or a reset) within [`IO_TIMEOUT`], sending
    /// nothing more.
    pub async fn expect_closed(&mut self) {
        let mut byte = [0u8; 1];
        match tokio::time::timeout(IO_TIMEOUT, self.stream.read(&mut byte))
            .await
            .expect("server closes in time")
        {
            Ok(0) | Err(_) => {}
            Ok(_) => panic!("server sent byte {:#x} instead of closing", byte[0]),
        }
    }
}
