//! The NBD wire format (doc/proto.md of the NetworkBlockDevice/nbd project): constants, and pure
//! parsers and encoders for the handshake and the transmission phase.
//!
//! Nothing here does I/O, so every decoder can be fed arbitrary bytes (see `tests/fuzz.rs` and
//! `fuzz/`). Invariants kept by this module: a parser never panics, never allocates more than the
//! bytes it was handed, and either accepts a message whole or names why it refused it; an encoder
//! always writes exactly the length its header announces. All integers are big-endian on the wire.

use std::io;

use crate::error::NbdError;
use crate::REQUEST_PAYLOAD_MAX_BYTES;

// ---------------------------------------------------------------------------------------------
// Magic numbers.

/// "NBDMAGIC": first 8 bytes the server sends.
pub const INIT_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": second 8 bytes of the newstyle greeting, and the first 8 bytes of every option.
pub const OPTION_MAGIC: u64 = 0x4948_4156_454f_5054;
/// Magic of every fixed-newstyle option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply (the only reply form this server sends).
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

// ---------------------------------------------------------------------------------------------
// Handshake flags (server, 16 bits) and client flags (32 bits).

pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Handshake flags this server advertises.
pub const HANDSHAKE_FLAGS: u16 = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES;

pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---------------------------------------------------------------------------------------------
// Transmission flags (16 bits, per export).

pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_SEND_DF: u16 = 1 << 7;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// The transmission flags advertised for an export. `CAN_MULTI_CONN` is always set: the
/// [`crate::Export`] contract makes a flush cover writes completed on every connection.
pub fn transmission_flags(read_only: bool) -> u16 {
    let mut flags = FLAG_HAS_FLAGS
        | FLAG_SEND_FLUSH
        | FLAG_SEND_FUA
        | FLAG_SEND_TRIM
        | FLAG_SEND_WRITE_ZEROES
        | FLAG_CAN_MULTI_CONN;
    if read_only {
        flags |= FLAG_READ_ONLY;
    }
    flags
}

// ---------------------------------------------------------------------------------------------
// Options (client → server during the handshake).

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
const REP_ERROR_BIT: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERROR_BIT | 1;
pub const REP_ERR_POLICY: u32 = REP_ERROR_BIT | 2;
pub const REP_ERR_INVALID: u32 = REP_ERROR_BIT | 3;
pub const REP_ERR_PLATFORM: u32 = REP_ERROR_BIT | 4;
pub const REP_ERR_TLS_REQD: u32 = REP_ERROR_BIT | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERROR_BIT | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERROR_BIT | 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERROR_BIT | 8;
pub const REP_ERR_TOO_BIG: u32 = REP_ERROR_BIT | 9;

/// Whether an option reply type is an error (bit 31 set).
pub fn is_option_error(reply_type: u32) -> bool {
    reply_type & REP_ERROR_BIT != 0
}

// Information types inside NBD_REP_INFO.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------------------------
// Transmission phase.

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Error values of the reply's error field (the protocol fixes these numbers; they are not the
// host's errno).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

// ---------------------------------------------------------------------------------------------
// Sizes.

/// Bytes the server sends first: INIT_MAGIC, OPTION_MAGIC, handshake flags.
pub const GREETING_BYTES: usize = 18;
pub const CLIENT_FLAGS_BYTES: usize = 4;
pub const OPTION_HEADER_BYTES: usize = 16;
pub const OPTION_REPLY_HEADER_BYTES: usize = 20;
pub const REQUEST_HEADER_BYTES: usize = 28;
pub const SIMPLE_REPLY_HEADER_BYTES: usize = 16;
/// Zero padding after the NBD_OPT_EXPORT_NAME reply unless NO_ZEROES was negotiated.
pub const EXPORT_NAME_PADDING_BYTES: usize = 124;
/// Longest string (export name, message) the protocol allows.
pub const STRING_MAX_BYTES: usize = 4096;
/// Largest option payload the server reads: an NBD_OPT_GO carries a name (at most
/// [`STRING_MAX_BYTES`]) and a list of 16-bit information requests; anything larger is answered
/// with NBD_REP_ERR_TOO_BIG (or ends the session, see `handshake.rs`).
pub const OPTION_DATA_MAX_BYTES: usize = 16 * 1024;
/// Largest minimum block size the protocol allows an export to advertise.
pub const BLOCK_SIZE_MAX_BYTES: u32 = 64 * 1024;

// ---------------------------------------------------------------------------------------------
// Handshake: parsing.

/// What the client asked for in its 32-bit flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientFlags {
    /// NBD_FLAG_C_NO_ZEROES: omit the 124 zero bytes after the NBD_OPT_EXPORT_NAME reply.
    pub no_zeroes: bool,
}

/// Parses the client flags. Unknown bits end the session (the protocol says the server MUST drop
/// the connection); a client without NBD_FLAG_C_FIXED_NEWSTYLE is refused because this server
/// only speaks fixed newstyle.
pub fn parse_client_flags(bytes: [u8; CLIENT_FLAGS_BYTES]) -> Result<ClientFlags, NbdError> {
    let flags = u32::from_be_bytes(bytes);
    let known = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;
    if flags & !known != 0 {
        return Err(NbdError::ClientFlagsUnknown { flags });
    }
    if flags & FLAG_C_FIXED_NEWSTYLE == 0 {
        return Err(NbdError::ClientNotFixedNewstyle { flags });
    }
    Ok(ClientFlags {
        no_zeroes: flags & FLAG_C_NO_ZEROES != 0,
    })
}

/// The fixed 16-byte header of an option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length_bytes: u32,
}

impl OptionHeader {
    /// Parses an option header; a wrong magic means the client is not speaking NBD (or lost
    /// framing), so the session ends.
    pub fn parse(bytes: &[u8; OPTION_HEADER_BYTES]) -> Result<Self, NbdError> {
        let magic = u64::from_be_bytes(array_at(bytes, 0));
        if magic != OPTION_MAGIC {
            return Err(NbdError::OptionMagic { found: magic });
        }
        Ok(Self {
            option: u32::from_be_bytes(array_at(bytes, 8)),
            length_bytes: u32::from_be_bytes(array_at(bytes, 12)),
        })
    }

    pub fn encode(&self) -> [u8; OPTION_HEADER_BYTES] {
        let mut out = [0u8; OPTION_HEADER_BYTES];
        out[0..8].copy_from_slice(&OPTION_MAGIC.to_be_bytes());
        out[8..12].copy_from_slice(&self.option.to_be_bytes());
        out[12..16].copy_from_slice(&self.length_bytes.to_be_bytes());
        out
    }
}

/// The body shared by NBD_OPT_INFO and NBD_OPT_GO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    /// NBD_INFO_* types the client asked for, in its order (unknown ones are kept; the server
    /// ignores them).
    pub information: Vec<u16>,
}

/// An option, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptionRequest {
    ExportName {
        name: String,
    },
    Abort,
    List,
    Info(InfoRequest),
    Go(InfoRequest),
    StructuredReply,
    StartTls,
    /// Any option this server does not implement; answered with NBD_REP_ERR_UNSUP.
    Unsupported {
        option: u32,
    },
}

/// Why a known option was malformed; answered with NBD_REP_ERR_INVALID and this message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionInvalid {
    pub message: &'static str,
}

/// Decodes an option's data. `data` is exactly the bytes the header announced.
pub fn parse_option(option: u32, data: &[u8]) -> Result<OptionRequest, OptionInvalid> {
    match option {
        OPT_EXPORT_NAME => Ok(OptionRequest::ExportName {
            name: parse_string(data)?,
        }),
        // The protocol asks the server to ignore data sent with NBD_OPT_ABORT.
        OPT_ABORT => Ok(OptionRequest::Abort),
        OPT_LIST => {
            if data.is_empty() {
                Ok(OptionRequest::List)
            } else {
                Err(OptionInvalid {
                    message: "NBD_OPT_LIST carries no data",
                })
            }
        }
        OPT_INFO => Ok(OptionRequest::Info(parse_info_request(data)?)),
        OPT_GO => Ok(OptionRequest::Go(parse_info_request(data)?)),
        OPT_STRUCTURED_REPLY => Ok(OptionRequest::StructuredReply),
        OPT_STARTTLS => Ok(OptionRequest::StartTls),
        other => Ok(OptionRequest::Unsupported { option: other }),
    }
}

fn parse_info_request(data: &[u8]) -> Result<InfoRequest, OptionInvalid> {
    const TRUNCATED: OptionInvalid = OptionInvalid {
        message: "NBD_OPT_INFO/GO data is shorter than its name and information list",
    };
    let name_length = data
        .get(0..4)
        .map(|bytes| u32::from_be_bytes(array_at(bytes, 0)) as usize)
        .ok_or(TRUNCATED)?;
    // Checked arithmetic: name_length comes from the client and may be anything up to 4 GiB.
    let name_end = 4usize.checked_add(name_length).ok_or(TRUNCATED)?;
    let name = parse_string(data.get(4..name_end).ok_or(TRUNCATED)?)?;
    let count_end = name_end.checked_add(2).ok_or(TRUNCATED)?;
    let count = data
        .get(name_end..count_end)
        .map(|bytes| u16::from_be_bytes(array_at(bytes, 0)) as usize)
        .ok_or(TRUNCATED)?;
    let list = &data[count_end..];
    if list.len() != count * 2 {
        return Err(OptionInvalid {
            message: "NBD_OPT_INFO/GO information count does not match the option length",
        });
    }
    let information = list
        .chunks_exact(2)
        .map(|pair| u16::from_be_bytes([pair[0], pair[1]]))
        .collect();
    Ok(InfoRequest { name, information })
}

/// A protocol string: UTF-8, no NUL, at most [`STRING_MAX_BYTES`].
fn parse_string(bytes: &[u8]) -> Result<String, OptionInvalid> {
    if bytes.len() > STRING_MAX_BYTES {
        return Err(OptionInvalid {
            message: "string is longer than 4096 bytes",
        });
    }
    if bytes.contains(&0) {
        return Err(OptionInvalid {
            message: "string contains a NUL byte",
        });
    }
    match std::str::from_utf8(bytes) {
        Ok(text) => Ok(text.to_owned()),
        Err(_) => Err(OptionInvalid {
            message: "string is not valid UTF-8",
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Handshake: encoding.

/// The server's first message.
pub fn encode_greeting() -> [u8; GREETING_BYTES] {
    let mut out = [0u8; GREETING_BYTES];
    out[0..8].copy_from_slice(&INIT_MAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&OPTION_MAGIC.to_be_bytes());
    out[16..18].copy_from_slice(&HANDSHAKE_FLAGS.to_be_bytes());
    out
}

/// Appends one option reply (header and data) to `out`.
pub fn encode_option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, data: &[u8]) {
    // Replies are built by this server from bounded pieces (names ≤ 4096 bytes, fixed info
    // records), so a length that does not fit in 32 bits is a programming error.
    let length = u32::try_from(data.len()).expect("option reply data is bounded well below 4 GiB");
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
    out.extend_from_slice(data);
}

/// NBD_REP_SERVER data: the export name, length-prefixed.
pub fn encode_server_entry(name: &str) -> Vec<u8> {
    let length = u32::try_from(name.len()).expect("export names are at most 4096 bytes");
    let mut out = Vec::with_capacity(4 + name.len());
    out.extend_from_slice(&length.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// NBD_REP_INFO data of type NBD_INFO_EXPORT.
pub fn encode_info_export(size_bytes: u64, flags: u16) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
    out[2..10].copy_from_slice(&size_bytes.to_be_bytes());
    out[10..12].copy_from_slice(&flags.to_be_bytes());
    out
}

/// NBD_REP_INFO data of type NBD_INFO_BLOCK_SIZE.
pub fn encode_info_block_size(minimum: u32, preferred: u32, payload_max: u32) -> [u8; 14] {
    let mut out = [0u8; 14];
    out[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    out[2..6].copy_from_slice(&minimum.to_be_bytes());
    out[6..10].copy_from_slice(&preferred.to_be_bytes());
    out[10..14].copy_from_slice(&payload_max.to_be_bytes());
    out
}

/// NBD_REP_INFO data of type NBD_INFO_NAME.
pub fn encode_info_name(name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + name.len());
    out.extend_from_slice(&INFO_NAME.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// The reply to NBD_OPT_EXPORT_NAME (size, flags, and the padding unless NO_ZEROES).
pub fn encode_export_name_reply(size_bytes: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(10 + EXPORT_NAME_PADDING_BYTES);
    out.extend_from_slice(&size_bytes.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    if !no_zeroes {
        out.extend_from_slice(&[0u8; EXPORT_NAME_PADDING_BYTES]);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Transmission: requests.

/// The fixed 28-byte header of a request (a write's payload follows it on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl RequestHeader {
    /// Parses a request header; a wrong magic means framing is lost, so the session ends.
    pub fn parse(bytes: &[u8; REQUEST_HEADER_BYTES]) -> Result<Self, NbdError> {
        let magic = u32::from_be_bytes(array_at(bytes, 0));
        if magic != REQUEST_MAGIC {
            return Err(NbdError::RequestMagic { found: magic });
        }
        Ok(Self {
            flags: u16::from_be_bytes(array_at(bytes, 4)),
            command: u16::from_be_bytes(array_at(bytes, 6)),
            cookie: u64::from_be_bytes(array_at(bytes, 8)),
            offset: u64::from_be_bytes(array_at(bytes, 16)),
            length: u32::from_be_bytes(array_at(bytes, 24)),
        })
    }

    pub fn encode(&self) -> [u8; REQUEST_HEADER_BYTES] {
        let mut out = [0u8; REQUEST_HEADER_BYTES];
        out[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&self.flags.to_be_bytes());
        out[6..8].copy_from_slice(&self.command.to_be_bytes());
        out[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        out[16..24].copy_from_slice(&self.offset.to_be_bytes());
        out[24..28].copy_from_slice(&self.length.to_be_bytes());
        out
    }

    /// Bytes of payload that follow this header on the wire, whether or not the request is
    /// accepted: only NBD_CMD_WRITE carries one (extended headers are not negotiated).
    pub fn payload_bytes(&self) -> u32 {
        if self.command == CMD_WRITE {
            self.length
        } else {
            0
        }
    }
}

/// What a request is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportGeometry {
    pub size_bytes: u64,
    /// Minimum block size: offsets and lengths must be multiples of it. A power of two, at most
    /// [`BLOCK_SIZE_MAX_BYTES`] (1 means any byte range).
    pub minimum_block_size_bytes: u32,
    /// Preferred block size, advertised to clients: I/O aligned to it avoids read-modify-write.
    /// A power of two, at least 512 and at least the minimum.
    pub preferred_block_size_bytes: u32,
    pub read_only: bool,
}

/// A request that passed every check: in bounds, aligned, flags valid, allowed on the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read {
        offset: u64,
        length: u32,
    },
    Write {
        offset: u64,
        length: u32,
        fua: bool,
    },
    Disconnect,
    Flush,
    Trim {
        offset: u64,
        length: u32,
        fua: bool,
    },
    WriteZeroes {
        offset: u64,
        length: u32,
        fua: bool,
        may_trim: bool,
    },
}

impl Command {
    /// Whether the command changes the export's contents (and so must be covered by a later
    /// flush).
    pub fn is_write(&self) -> bool {
        matches!(
            self,
            Command::Write { .. } | Command::Trim { .. } | Command::WriteZeroes { .. }
        )
    }

    /// Bytes of memory the server holds for this request while it is in flight (the write
    /// payload, or the read buffer).
    pub fn buffer_bytes(&self) -> u32 {
        match *self {
            Command::Read { length, .. } | Command::Write { length, .. } => length,
            _ => 0,
        }
    }
}

/// Checks a request against the export and maps every refusal to the NBD error the protocol
/// document recommends:
/// - unknown command, or a flag not valid for the command → EINVAL;
/// - write, trim or write-zeroes on a read-only export → EPERM;
/// - read or write longer than [`REQUEST_PAYLOAD_MAX_BYTES`] → EINVAL ("will fail"; EOVERFLOW is
///   reserved for DF reads and payload-free commands);
/// - offset or length not a multiple of the minimum block size → EINVAL;
/// - past the end: EINVAL for read and trim, ENOSPC for write and write-zeroes.
pub fn check_request(header: &RequestHeader, geometry: &ExportGeometry) -> Result<Command, u32> {
    let fua = header.flags & CMD_FLAG_FUA != 0;
    let allowed_flags = match header.command {
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        // FUA is valid on every command once NBD_FLAG_SEND_FUA is advertised; it is a no-op on
        // those that do not write.
        CMD_READ | CMD_WRITE | CMD_DISC | CMD_FLUSH | CMD_TRIM => CMD_FLAG_FUA,
        _ => return Err(EINVAL),
    };
    if header.flags & !allowed_flags != 0 {
        return Err(EINVAL);
    }
    match header.command {
        // The protocol says offset and length MUST be zero for these; a client that gets that
        // wrong gains nothing by being refused, so they are ignored.
        CMD_DISC => return Ok(Command::Disconnect),
        CMD_FLUSH => return Ok(Command::Flush),
        _ => {}
    }
    let writes = header.command != CMD_READ;
    if writes && geometry.read_only {
        return Err(EPERM);
    }
    let carries_payload = matches!(header.command, CMD_READ | CMD_WRITE);
    if carries_payload && header.length > REQUEST_PAYLOAD_MAX_BYTES {
        return Err(EINVAL);
    }
    let block = u64::from(geometry.minimum_block_size_bytes.max(1));
    if !header.offset.is_multiple_of(block) || !u64::from(header.length).is_multiple_of(block) {
        return Err(EINVAL);
    }
    let in_bounds = header
        .offset
        .checked_add(u64::from(header.length))
        .is_some_and(|end| end <= geometry.size_bytes);
    if !in_bounds {
        return Err(match header.command {
            CMD_WRITE | CMD_WRITE_ZEROES => ENOSPC,
            _ => EINVAL,
        });
    }
    let (offset, length) = (header.offset, header.length);
    Ok(match header.command {
        CMD_READ => Command::Read { offset, length },
        CMD_WRITE => Command::Write {
            offset,
            length,
            fua,
        },
        CMD_TRIM => Command::Trim {
            offset,
            length,
            fua,
        },
        CMD_WRITE_ZEROES => Command::WriteZeroes {
            offset,
            length,
            fua,
            may_trim: header.flags & CMD_FLAG_NO_HOLE == 0,
        },
        _ => unreachable!("every other command returned above"),
    })
}

// ---------------------------------------------------------------------------------------------
// Transmission: replies.

/// A simple reply header; a successful read's data follows it.
pub fn encode_simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_HEADER_BYTES] {
    let mut out = [0u8; SIMPLE_REPLY_HEADER_BYTES];
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out
}

/// Maps a backend error to the NBD error value the protocol document recommends: quota and
/// file-size errors become ENOSPC, permission errors EPERM, anything unclassified EIO.
pub fn error_code_from_io(error: &io::Error) -> u32 {
    use io::ErrorKind;
    if let Some(code) = error.raw_os_error() {
        match code {
            libc_errno::EPERM | libc_errno::EACCES | libc_errno::EROFS => return EPERM,
            libc_errno::ENOSPC | libc_errno::EDQUOT | libc_errno::EFBIG => return ENOSPC,
            libc_errno::EINVAL => return EINVAL,
            libc_errno::ENOMEM => return ENOMEM,
            _ => {}
        }
    }
    match error.kind() {
        ErrorKind::PermissionDenied | ErrorKind::ReadOnlyFilesystem => EPERM,
        ErrorKind::StorageFull | ErrorKind::QuotaExceeded | ErrorKind::FileTooLarge => ENOSPC,
        // ENOTSUP is reserved for fast-zero requests, which are not advertised.
        ErrorKind::InvalidInput | ErrorKind::Unsupported => EINVAL,
        ErrorKind::OutOfMemory => ENOMEM,
        _ => EIO,
    }
}

/// Linux errno values for the few raw OS errors mapped above (the crate does not depend on libc
/// for six numbers).
mod libc_errno {
    pub const EPERM: i32 = 1;
    pub const ENOMEM: i32 = 12;
    pub const EACCES: i32 = 13;
    pub const EINVAL: i32 = 22;
    pub const EFBIG: i32 = 27;
    pub const ENOSPC: i32 = 28;
    pub const EROFS: i32 = 30;
    pub const EDQUOT: i32 = 122;
}

/// Copies `N` bytes at `offset` out of `bytes`. Callers pass fixed-size headers whose layout
/// guarantees the range exists.
fn array_at<const N: usize>(bytes: &[u8], offset: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[offset..offset + N]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GEOMETRY: ExportGeometry = ExportGeometry {
        size_bytes: 1 << 20,
        minimum_block_size_bytes: 4096,
        preferred_block_size_bytes: 4096,
        read_only: false,
    };

    fn header(command: u16, flags: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader {
            flags,
            command,
            cookie: 7,
            offset,
            length,
        }
    }

    // Proves a request header survives encode → parse unchanged, and a wrong magic is refused.
    #[test]
    fn request_header_round_trips_and_checks_magic() {
        let original = header(CMD_WRITE, CMD_FLAG_FUA, 4096, 8192);
        assert_eq!(
            RequestHeader::parse(&original.encode()).ok(),
            Some(original)
        );
        let mut bytes = original.encode();
        bytes[0] ^= 1;
        assert!(matches!(
            RequestHeader::parse(&bytes),
            Err(NbdError::RequestMagic { .. })
        ));
    }

    // Proves the error mapping for out-of-range, unaligned, oversized and read-only requests
    // follows the protocol document (ENOSPC for writes past the end, EINVAL for reads).
    #[test]
    fn request_checks_map_to_protocol_errors() {
        let end = GEOMETRY.size_bytes;
        assert_eq!(
            check_request(&header(CMD_READ, 0, end, 4096), &GEOMETRY),
            Err(EINVAL)
        );
        assert_eq!(
            check_request(&header(CMD_WRITE, 0, end, 4096), &GEOMETRY),
            Err(ENOSPC)
        );
        assert_eq!(
            check_request(&header(CMD_WRITE_ZEROES, 0, end - 4096, 8192), &GEOMETRY),
            Err(ENOSPC)
        );
        assert_eq!(
            check_request(&header(CMD_TRIM, 0, u64::MAX - 4095, 4096), &GEOMETRY),
            Err(EINVAL)
        );
        assert_eq!(
            check_request(&header(CMD_READ, 0, 512, 4096), &GEOMETRY),
            Err(EINVAL)
        );
        assert_eq!(
            check_request(
                &header(CMD_READ, 0, 0, REQUEST_PAYLOAD_MAX_BYTES + 4096),
                &GEOMETRY
            ),
            Err(EINVAL)
        );
        assert_eq!(
            check_request(&header(CMD_READ, CMD_FLAG_NO_HOLE, 0, 4096), &GEOMETRY),
            Err(EINVAL)
        );
        assert_eq!(check_request(&header(99, 0, 0, 0), &GEOMETRY), Err(EINVAL));
        assert_eq!(
            check_request(&header(CMD_BLOCK_STATUS, 0, 0, 4096), &GEOMETRY),
            Err(EINVAL)
        );
        let read_only = ExportGeometry {
            read_only: true,
            ..GEOMETRY
        };
        assert_eq!(
            check_request(&header(CMD_WRITE, 0, 0, 4096), &read_only),
            Err(EPERM)
        );
        assert_eq!(
            check_request(&header(CMD_READ, CMD_FLAG_FUA, 0, 4096), &read_only),
            Ok(Command::Read {
                offset: 0,
                length: 4096
            })
        );
        assert_eq!(
            check_request(
                &header(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 0, 4096),
                &GEOMETRY
            ),
            Ok(Command::WriteZeroes {
                offset: 0,
                length: 4096,
                fua: false,
                may_trim: false
            })
        );
    }

    // Proves NBD_OPT_GO data is decoded, and that lengths pointing past the data are refused
    // rather than trusted.
    #[test]
    fn go_option_parses_and_refuses_bad_lengths() {
        let mut data = Vec::new();
        data.extend_from_slice(&3u32.to_be_bytes());
        data.extend_from_slice(b"vol");
        data.extend_from_slice(&2u16.to_be_bytes());
        data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        data.extend_from_slice(&INFO_NAME.to_be_bytes());
        assert_eq!(
            parse_option(OPT_GO, &data),
            Ok(OptionRequest::Go(InfoRequest {
                name: "vol".into(),
                information: vec![INFO_BLOCK_SIZE, INFO_NAME]
            }))
        );
        let mut lying = data.clone();
        lying[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_option(OPT_GO, &lying).is_err());
        assert!(parse_option(OPT_INFO, &data[..data.len() - 1]).is_err());
        assert!(parse_option(OPT_LIST, b"x").is_err());
        assert_eq!(
            parse_option(42, b"whatever"),
            Ok(OptionRequest::Unsupported { option: 42 })
        );
    }

    // Proves only fixed-newstyle clients with known flags are accepted.
    #[test]
    fn client_flags_require_fixed_newstyle() {
        assert_eq!(
            parse_client_flags(3u32.to_be_bytes()).ok(),
            Some(ClientFlags { no_zeroes: true })
        );
        assert!(parse_client_flags(0u32.to_be_bytes()).is_err());
        assert!(parse_client_flags(5u32.to_be_bytes()).is_err());
    }

    // Proves backend I/O errors map to the protocol's error values.
    #[test]
    fn io_errors_map_to_protocol_errors() {
        assert_eq!(
            error_code_from_io(&io::Error::from_raw_os_error(libc_errno::EDQUOT)),
            ENOSPC
        );
        assert_eq!(
            error_code_from_io(&io::Error::from(io::ErrorKind::PermissionDenied)),
            EPERM
        );
        assert_eq!(error_code_from_io(&io::Error::other("checksum")), EIO);
    }
}
