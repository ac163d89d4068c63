//! A small NBD client (fixed newstyle handshake, NBD_OPT_GO, simple replies) for benchmarking
//! and checking Keel volumes or any NBD server.
//!
//! Requests are pipelined over one TCP connection: any number of threads (up to
//! [`REQUESTS_IN_FLIGHT_MAX`]) send requests, each tagged with a unique handle, under a lock
//! on the socket's write side; one reader thread reads replies in whatever order the server
//! sends them and hands each to its waiter through the tag map. Invariants: a handle is in the
//! tag map from just before its request is sent until its reply is delivered; when the
//! connection fails every waiter is woken with an error, and no request is sent afterwards.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::target::SyncMethod;
use crate::BenchError;

/// IANA port for NBD.
pub const NBD_DEFAULT_PORT: u16 = 10809;
/// Most requests one client keeps outstanding (senders wait beyond it).
pub const REQUESTS_IN_FLIGHT_MAX: usize = 1024;
/// Longest READ/WRITE payload this client sends or accepts (the protocol's usual limit).
pub const PAYLOAD_MAX_BYTES: usize = 32 * 1024 * 1024;
/// Longest option reply payload accepted during the handshake.
const OPTION_REPLY_MAX_BYTES: u32 = 64 * 1024;
/// How long connecting and the handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
const NBD_IHAVEOPT: u64 = 0x4948_4156_454F_5054; // "IHAVEOPT"
const NBD_OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
const NBD_SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;
const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;

const NBD_OPT_GO: u32 = 7;
const NBD_REP_ACK: u32 = 1;
const NBD_REP_INFO: u32 = 3;
const NBD_REP_FLAG_ERROR: u32 = 1 << 31;
const NBD_INFO_EXPORT: u16 = 0;

/// Transmission flags (from the server's NBD_INFO_EXPORT).
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;

const NBD_CMD_READ: u16 = 0;
const NBD_CMD_WRITE: u16 = 1;
const NBD_CMD_DISC: u16 = 2;
const NBD_CMD_FLUSH: u16 = 3;
const NBD_CMD_FLAG_FUA: u16 = 1 << 0;

/// What a reply carries back to its waiter: the read payload (empty for other commands).
type Reply = Result<Vec<u8>, BenchError>;

struct Pending {
    /// Bytes of payload that follow the reply header (READ only).
    read_length: usize,
    sender: SyncSender<Reply>,
}

struct Shared {
    address: String,
    pending: Mutex<HashMap<u64, Pending>>,
    /// Signalled when a slot in the tag map frees up.
    slot_freed: Condvar,
    /// Set once the connection failed or was closed; no request is sent after it.
    broken: AtomicBool,
}

impl Shared {
    fn error(&self, reason: impl Into<String>) -> BenchError {
        BenchError::Nbd {
            address: self.address.clone(),
            reason: reason.into(),
        }
    }

    /// Marks the connection dead and fails every waiter.
    fn fail_all(&self, reason: &str) {
        self.broken.store(true, Ordering::SeqCst);
        let mut pending = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (_, waiter) in pending.drain() {
            let _ = waiter.sender.send(Err(self.error(reason.to_string())));
        }
        self.slot_freed.notify_all();
    }
}

/// A connected NBD client; share it between threads by reference (it is `Sync`).
pub struct NbdClient {
    shared: Arc<Shared>,
    writer: Mutex<TcpStream>,
    next_handle: AtomicU64,
    export_size_bytes: u64,
    transmission_flags: u16,
    sync_method: SyncMethod,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for NbdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdClient")
            .field("address", &self.shared.address)
            .field("export_size_bytes", &self.export_size_bytes)
            .field("transmission_flags", &self.transmission_flags)
            .finish()
    }
}

impl NbdClient {
    /// Connects to `address` ("HOST:PORT") and opens `export` with NBD_OPT_GO.
    /// `sync_method` says how durable writes are made durable (FUA or FLUSH).
    pub fn connect(
        address: &str,
        export: &str,
        sync_method: SyncMethod,
    ) -> Result<Self, BenchError> {
        let failure = |reason: String| BenchError::Nbd {
            address: address.to_string(),
            reason,
        };
        let io_failure = |what: &str, error: std::io::Error| failure(format!("{what}: {error}"));
        let mut stream =
            TcpStream::connect(address).map_err(|error| io_failure("connect", error))?;
        stream
            .set_nodelay(true)
            .map_err(|error| io_failure("set TCP_NODELAY", error))?;
        stream
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(|error| io_failure("set timeout", error))?;

        // Server greeting: NBDMAGIC, IHAVEOPT, handshake flags.
        let magic = read_u64(&mut stream).map_err(|error| io_failure("read greeting", error))?;
        let option_magic =
            read_u64(&mut stream).map_err(|error| io_failure("read greeting", error))?;
        if magic != NBD_MAGIC || option_magic != NBD_IHAVEOPT {
            return Err(failure(
                "not a newstyle NBD server (bad greeting magic)".to_string(),
            ));
        }
        let handshake_flags =
            read_u16(&mut stream).map_err(|error| io_failure("read greeting", error))?;
        if handshake_flags & NBD_FLAG_FIXED_NEWSTYLE == 0 {
            return Err(failure(
                "server does not speak fixed newstyle negotiation".to_string(),
            ));
        }
        let no_zeroes = handshake_flags & NBD_FLAG_NO_ZEROES != 0;
        let mut client_flags = NBD_FLAG_C_FIXED_NEWSTYLE;
        if no_zeroes {
            client_flags |= NBD_FLAG_C_NO_ZEROES;
        }
        let mut message = Vec::with_capacity(64);
        message.extend_from_slice(&client_flags.to_be_bytes());
        // NBD_OPT_GO: export name length, name, and no information requests (the server
        // always sends NBD_INFO_EXPORT).
        let name = export.as_bytes();
        let mut data = Vec::with_capacity(name.len() + 6);
        data.extend_from_slice(&(name.len() as u32).to_be_bytes());
        data.extend_from_slice(name);
        data.extend_from_slice(&0u16.to_be_bytes());
        message.extend_from_slice(&NBD_IHAVEOPT.to_be_bytes());
        message.extend_from_slice(&NBD_OPT_GO.to_be_bytes());
        message.extend_from_slice(&(data.len() as u32).to_be_bytes());
        message.extend_from_slice(&data);
        stream
            .write_all(&message)
            .map_err(|error| io_failure("send NBD_OPT_GO", error))?;

        let mut export_info: Option<(u64, u16)> = None;
        loop {
            let reply_magic =
                read_u64(&mut stream).map_err(|error| io_failure("read option reply", error))?;
            let option =
                read_u32(&mut stream).map_err(|error| io_failure("read option reply", error))?;
            let reply_type =
                read_u32(&mut stream).map_err(|error| io_failure("read option reply", error))?;
            let length =
                read_u32(&mut stream).map_err(|error| io_failure("read option reply", error))?;
            if reply_magic != NBD_OPTION_REPLY_MAGIC || option != NBD_OPT_GO {
                return Err(failure(format!(
                    "bad option reply (magic {reply_magic:#x}, option {option})"
                )));
            }
            if length > OPTION_REPLY_MAX_BYTES {
                return Err(failure(format!(
                    "option reply of {length} bytes is too long"
                )));
            }
            let mut payload = vec![0u8; length as usize];
            stream
                .read_exact(&mut payload)
                .map_err(|error| io_failure("read option reply", error))?;
            if reply_type & NBD_REP_FLAG_ERROR != 0 {
                let message = String::from_utf8_lossy(&payload);
                return Err(failure(format!(
                    "server refused export {export:?} (error {:#x}): {message}",
                    reply_type
                )));
            }
            match reply_type {
                NBD_REP_INFO if payload.len() >= 2 => {
                    let info_type = u16::from_be_bytes([payload[0], payload[1]]);
                    if info_type == NBD_INFO_EXPORT && payload.len() >= 12 {
                        let mut size = [0u8; 8];
                        size.copy_from_slice(&payload[2..10]);
                        let flags = u16::from_be_bytes([payload[10], payload[11]]);
                        export_info = Some((u64::from_be_bytes(size), flags));
                    }
                }
                NBD_REP_ACK => break,
                _ => {}
            }
        }
        let (export_size_bytes, transmission_flags) = export_info.ok_or_else(|| {
            failure("server acknowledged NBD_OPT_GO without NBD_INFO_EXPORT".to_string())
        })?;
        stream
            .set_read_timeout(None)
            .map_err(|error| io_failure("clear timeout", error))?;

        let shared = Arc::new(Shared {
            address: address.to_string(),
            pending: Mutex::new(HashMap::new()),
            slot_freed: Condvar::new(),
            broken: AtomicBool::new(false),
        });
        let reader_stream = stream
            .try_clone()
            .map_err(|error| io_failure("clone socket", error))?;
        let reader_shared = Arc::clone(&shared);
        let reader = std::thread::Builder::new()
            .name("nbd-reply-reader".to_string())
            .spawn(move || read_replies(reader_stream, &reader_shared))
            .map_err(|error| io_failure("spawn reader thread", error))?;
        Ok(Self {
            shared,
            writer: Mutex::new(stream),
            next_handle: AtomicU64::new(1),
            export_size_bytes,
            transmission_flags,
            sync_method,
            reader: Some(reader),
        })
    }

    /// Size of the export in bytes.
    pub fn export_size_bytes(&self) -> u64 {
        self.export_size_bytes
    }

    /// The transmission flags the server announced.
    pub fn transmission_flags(&self) -> u16 {
        self.transmission_flags
    }

    /// True when the server accepts FUA writes.
    pub fn supports_fua(&self) -> bool {
        self.transmission_flags & NBD_FLAG_SEND_FUA != 0
    }

    /// How durable writes are made durable.
    pub fn sync_method(&self) -> SyncMethod {
        self.sync_method
    }

    /// Reads `buffer.len()` bytes at `offset`.
    pub fn read(&self, offset: u64, buffer: &mut [u8]) -> Result<(), BenchError> {
        let data = self.request(NBD_CMD_READ, 0, offset, buffer.len(), &[])?;
        if data.len() != buffer.len() {
            return Err(self.shared.error(format!(
                "READ returned {} bytes, asked for {}",
                data.len(),
                buffer.len()
            )));
        }
        buffer.copy_from_slice(&data);
        Ok(())
    }

    /// Writes `data` at `offset`; with `fua`, the server replies only once it is durable.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), BenchError> {
        let flags = if fua {
            if !self.supports_fua() {
                return Err(self.shared.error("server does not support FUA"));
            }
            NBD_CMD_FLAG_FUA
        } else {
            0
        };
        self.request(NBD_CMD_WRITE, flags, offset, data.len(), data)
            .map(|_| ())
    }

    /// NBD_CMD_FLUSH: every write completed before it is durable when it returns.
    pub fn flush(&self) -> Result<(), BenchError> {
        if self.transmission_flags & NBD_FLAG_SEND_FLUSH == 0 {
            return Err(self
                .shared
                .error("server does not accept FLUSH (no NBD_FLAG_SEND_FLUSH)"));
        }
        self.request(NBD_CMD_FLUSH, 0, 0, 0, &[]).map(|_| ())
    }

    /// Sends one request and waits for its reply.
    fn request(
        &self,
        command: u16,
        flags: u16,
        offset: u64,
        length: usize,
        payload: &[u8],
    ) -> Result<Vec<u8>, BenchError> {
        if length > PAYLOAD_MAX_BYTES {
            return Err(self.shared.error(format!(
                "request of {length} bytes exceeds {PAYLOAD_MAX_BYTES}"
            )));
        }
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let receiver = self.register(handle, command, length)?;
        let mut message = Vec::with_capacity(28 + payload.len());
        message.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        message.extend_from_slice(&flags.to_be_bytes());
        message.extend_from_slice(&command.to_be_bytes());
        message.extend_from_slice(&handle.to_be_bytes());
        message.extend_from_slice(&offset.to_be_bytes());
        message.extend_from_slice(&(length as u32).to_be_bytes());
        message.extend_from_slice(payload);
        {
            let mut writer = self
                .writer
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if self.shared.broken.load(Ordering::SeqCst) {
                self.unregister(handle);
                return Err(self.shared.error("connection is closed"));
            }
            if let Err(error) = writer.write_all(&message) {
                drop(writer);
                self.shared.fail_all(&format!("send failed: {error}"));
                return Err(self.shared.error(format!("send: {error}")));
            }
        }
        receiver
            .recv()
            .map_err(|_| self.shared.error("reply reader stopped"))?
    }

    /// Puts `handle` in the tag map, waiting while the map is full.
    fn register(
        &self,
        handle: u64,
        command: u16,
        length: usize,
    ) -> Result<Receiver<Reply>, BenchError> {
        let (sender, receiver) = sync_channel(1);
        let mut pending = self
            .shared
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while pending.len() >= REQUESTS_IN_FLIGHT_MAX && !self.shared.broken.load(Ordering::SeqCst)
        {
            pending = self
                .shared
                .slot_freed
                .wait(pending)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        if self.shared.broken.load(Ordering::SeqCst) {
            return Err(self.shared.error("connection is closed"));
        }
        let read_length = if command == NBD_CMD_READ { length } else { 0 };
        let previous = pending.insert(
            handle,
            Pending {
                read_length,
                sender,
            },
        );
        assert!(previous.is_none(), "NBD handles are unique per connection");
        Ok(receiver)
    }

    fn unregister(&self, handle: u64) {
        let mut pending = self
            .shared
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        pending.remove(&handle);
        self.shared.slot_freed.notify_one();
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        // Tell the server we leave (NBD_CMD_DISC has no reply), then stop the reader.
        if let Ok(mut writer) = self.writer.lock() {
            if !self.shared.broken.load(Ordering::SeqCst) {
                let mut message = Vec::with_capacity(28);
                message.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
                message.extend_from_slice(&0u16.to_be_bytes());
                message.extend_from_slice(&NBD_CMD_DISC.to_be_bytes());
                message.extend_from_slice(&0u64.to_be_bytes());
                message.extend_from_slice(&0u64.to_be_bytes());
                message.extend_from_slice(&0u32.to_be_bytes());
                let _ = writer.write_all(&message);
            }
            self.shared.broken.store(true, Ordering::SeqCst);
            let _ = writer.shutdown(Shutdown::Both);
        }
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

/// The reader thread: matches every reply to its waiter by handle.
fn read_replies(mut stream: TcpStream, shared: &Shared) {
    let reason = loop {
        let mut header = [0u8; 16];
        if let Err(error) = stream.read_exact(&mut header) {
            break format!("connection lost: {error}");
        }
        let magic = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
        let error_code = u32::from_be_bytes([header[4], header[5], header[6], header[7]]);
        let mut handle_bytes = [0u8; 8];
        handle_bytes.copy_from_slice(&header[8..16]);
        let handle = u64::from_be_bytes(handle_bytes);
        if magic != NBD_SIMPLE_REPLY_MAGIC {
            break format!("bad reply magic {magic:#x} (structured replies were not negotiated)");
        }
        let waiter = {
            let mut pending = shared
                .pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let waiter = pending.remove(&handle);
            shared.slot_freed.notify_one();
            waiter
        };
        let Some(waiter) = waiter else {
            break format!("reply for unknown handle {handle}");
        };
        if error_code != 0 {
            let _ = waiter.sender.send(Err(shared.error(format!(
                "server returned error {error_code} ({})",
                errno_name(error_code)
            ))));
            continue;
        }
        let mut data = vec![0u8; waiter.read_length];
        if let Err(error) = stream.read_exact(&mut data) {
            let reason = format!("connection lost in a READ payload: {error}");
            let _ = waiter.sender.send(Err(shared.error(reason.clone())));
            break reason;
        }
        let _ = waiter.sender.send(Ok(data));
    };
    shared.fail_all(&reason);
}

fn errno_name(code: u32) -> &'static str {
    match code {
        1 => "EPERM",
        5 => "EIO",
        12 => "ENOMEM",
        22 => "EINVAL",
        28 => "ENOSPC",
        75 => "EOVERFLOW",
        95 => "ENOTSUP",
        108 => "ESHUTDOWN",
        _ => "unknown",
    }
}

fn read_u64(stream: &mut TcpStream) -> std::io::Result<u64> {
    let mut bytes = [0u8; 8];
    stream.read_exact(&mut bytes)?;
    Ok(u64::from_be_bytes(bytes))
}

fn read_u32(stream: &mut TcpStream) -> std::io::Result<u32> {
    let mut bytes = [0u8; 4];
    stream.read_exact(&mut bytes)?;
    Ok(u32::from_be_bytes(bytes))
}

fn read_u16(stream: &mut TcpStream) -> std::io::Result<u16> {
    let mut bytes = [0u8; 2];
    stream.read_exact(&mut bytes)?;
    Ok(u16::from_be_bytes(bytes))
}
