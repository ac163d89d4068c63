//! The handshake phase: fixed newstyle negotiation only (oldstyle and non-fixed newstyle clients
//! are refused), ending either in the transmission phase with an opened export or in a closed
//! session.
//!
//! Invariants: every option except NBD_OPT_EXPORT_NAME gets exactly one final reply (an ACK or an
//! error), unknown options get NBD_REP_ERR_UNSUP and the loop continues; option data is never
//! read into memory beyond [`OPTION_DATA_MAX_BYTES`]; the number of options per session is
//! bounded by [`crate::HANDSHAKE_OPTIONS_MAX`]; the whole handshake, however slowly the client
//! sends or reads, ends by its deadline.

use std::io::{BufReader, Read};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::NbdError;
use crate::export::{Export, Exports};
use crate::protocol::{
    encode_export_name_reply, encode_greeting, encode_info_block_size, encode_info_export,
    encode_info_name, encode_option_reply, encode_server_entry, parse_client_flags, parse_option,
    transmission_flags, ClientFlags, ExportGeometry, InfoRequest, OptionHeader, OptionRequest,
    BLOCK_SIZE_MAX_BYTES, CLIENT_FLAGS_BYTES, INFO_NAME, OPTION_DATA_MAX_BYTES,
    OPTION_HEADER_BYTES, OPT_EXPORT_NAME, REP_ACK, REP_ERR_INVALID, REP_ERR_TOO_BIG,
    REP_ERR_UNKNOWN, REP_ERR_UNSUP, REP_INFO, REP_SERVER, STRING_MAX_BYTES,
};
use crate::socket::{is_timeout, Socket, SocketReader};
use crate::{HANDSHAKE_OPTIONS_MAX, OPTION_DISCARD_MAX_BYTES, REQUEST_PAYLOAD_MAX_BYTES};

/// An export the client selected, with what the transmission phase checks requests against.
pub(crate) struct Selected {
    pub export: Arc<dyn Export>,
    pub geometry: ExportGeometry,
    pub name: String,
}

pub(crate) enum Outcome {
    Transmission(Selected),
    /// The client sent NBD_OPT_ABORT (and got its ACK).
    Aborted,
}

/// The session's socket during the handshake, with the time left to finish it.
pub(crate) struct Wire<'a> {
    pub reader: &'a mut BufReader<SocketReader>,
    pub socket: &'a dyn Socket,
    pub deadline: Instant,
    pub timeout: Duration,
}

impl Wire<'_> {
    fn timed_out(&self) -> NbdError {
        NbdError::HandshakeTimeout {
            seconds: self.timeout.as_secs(),
        }
    }

    /// Bounds the next socket operations by the time left.
    fn arm(&self, context: &'static str) -> Result<(), NbdError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.timed_out());
        }
        self.socket
            .set_read_timeout(Some(left))
            .and_then(|()| self.socket.set_write_timeout(Some(left)))
            .map_err(NbdError::io(context))
    }

    /// Fills `buf`, re-arming the timeout before every socket read so a client trickling bytes
    /// is still cut off at the deadline.
    fn read_exact(&mut self, buf: &mut [u8], context: &'static str) -> Result<(), NbdError> {
        let mut filled = 0;
        while filled < buf.len() {
            self.arm(context)?;
            match self.reader.read(&mut buf[filled..]) {
                Ok(0) => {
                    return Err(NbdError::Io {
                        context,
                        source: std::io::ErrorKind::UnexpectedEof.into(),
                    })
                }
                Ok(read) => filled += read,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) if is_timeout(&error) => return Err(self.timed_out()),
                Err(source) => return Err(NbdError::Io { context, source }),
            }
        }
        Ok(())
    }

    /// Writes all of `bytes`, re-arming the timeout before every socket write.
    fn send(&mut self, mut bytes: &[u8]) -> Result<(), NbdError> {
        const CONTEXT: &str = "sending an option reply";
        while !bytes.is_empty() {
            self.arm(CONTEXT)?;
            match self.socket.write(bytes) {
                Ok(0) => {
                    return Err(NbdError::Io {
                        context: CONTEXT,
                        source: std::io::ErrorKind::WriteZero.into(),
                    })
                }
                Ok(written) => bytes = &bytes[written..],
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) if is_timeout(&error) => return Err(self.timed_out()),
                Err(source) => {
                    return Err(NbdError::Io {
                        context: CONTEXT,
                        source,
                    })
                }
            }
        }
        Ok(())
    }

    /// Reads and drops `length` bytes.
    fn discard(&mut self, mut length: u64) -> Result<(), NbdError> {
        let mut chunk = [0u8; 8192];
        while length > 0 {
            let take = length.min(chunk.len() as u64) as usize;
            self.read_exact(&mut chunk[..take], "skipping oversized option data")?;
            length -= take as u64;
        }
        Ok(())
    }
}

/// Runs the handshake on a fresh connection.
pub(crate) fn negotiate(
    wire: &mut Wire<'_>,
    exports: &Arc<dyn Exports>,
) -> Result<Outcome, NbdError> {
    wire.send(&encode_greeting())?;
    let mut flag_bytes = [0u8; CLIENT_FLAGS_BYTES];
    wire.read_exact(&mut flag_bytes, "reading the client flags")?;
    let client = parse_client_flags(flag_bytes)?;

    for _ in 0..HANDSHAKE_OPTIONS_MAX {
        let mut header_bytes = [0u8; OPTION_HEADER_BYTES];
        wire.read_exact(&mut header_bytes, "reading an option header")?;
        let header = OptionHeader::parse(&header_bytes)?;
        let length = header.length_bytes as usize;
        if length > OPTION_DATA_MAX_BYTES {
            // NBD_OPT_EXPORT_NAME cannot be answered with an error; anything else is answered
            // with TOO_BIG after its data is skipped, unless skipping it would itself be abuse.
            if header.option == OPT_EXPORT_NAME || length > OPTION_DISCARD_MAX_BYTES {
                return Err(NbdError::OptionTooLarge {
                    option: header.option,
                    length_bytes: header.length_bytes,
                });
            }
            wire.discard(u64::from(header.length_bytes))?;
            let mut out = Vec::new();
            encode_option_reply(
                &mut out,
                header.option,
                REP_ERR_TOO_BIG,
                b"option data is larger than this server accepts",
            );
            wire.send(&out)?;
            continue;
        }
        let mut data = vec![0u8; length];
        wire.read_exact(&mut data, "reading option data")?;
        let request = match parse_option(header.option, &data) {
            Ok(request) => request,
            Err(invalid) => {
                if header.option == OPT_EXPORT_NAME {
                    return Err(NbdError::ExportNameInvalid {
                        reason: invalid.message,
                    });
                }
                let mut out = Vec::new();
                encode_option_reply(
                    &mut out,
                    header.option,
                    REP_ERR_INVALID,
                    invalid.message.as_bytes(),
                );
                wire.send(&out)?;
                continue;
            }
        };
        if let Some(outcome) = answer(request, header.option, client, wire, exports)? {
            return Ok(outcome);
        }
    }
    Err(NbdError::OptionsTooMany {
        limit: HANDSHAKE_OPTIONS_MAX,
    })
}

/// Answers one decoded option; `Some` ends the handshake.
fn answer(
    request: OptionRequest,
    option: u32,
    client: ClientFlags,
    wire: &mut Wire<'_>,
    exports: &Arc<dyn Exports>,
) -> Result<Option<Outcome>, NbdError> {
    let mut out = Vec::new();
    match request {
        OptionRequest::ExportName { name } => {
            // No way to report an error here: a missing export ends the session.
            let selected = open(exports, name)?;
            let flags = transmission_flags(selected.geometry.read_only);
            let reply =
                encode_export_name_reply(selected.geometry.size_bytes, flags, client.no_zeroes);
            wire.send(&reply)?;
            return Ok(Some(Outcome::Transmission(selected)));
        }
        OptionRequest::Abort => {
            encode_option_reply(&mut out, option, REP_ACK, &[]);
            // The client may already have closed; the ACK is a courtesy.
            let _ = wire.send(&out);
            return Ok(Some(Outcome::Aborted));
        }
        OptionRequest::List => {
            for name in exports
                .list()
                .iter()
                .filter(|name| name.len() <= STRING_MAX_BYTES)
            {
                encode_option_reply(&mut out, option, REP_SERVER, &encode_server_entry(name));
            }
            encode_option_reply(&mut out, option, REP_ACK, &[]);
        }
        OptionRequest::Info(info) | OptionRequest::Go(info) => {
            let go = option == crate::protocol::OPT_GO;
            match open(exports, info.name.clone()) {
                Ok(selected) => {
                    encode_info_replies(&mut out, option, &info, &selected.geometry);
                    encode_option_reply(&mut out, option, REP_ACK, &[]);
                    wire.send(&out)?;
                    if go {
                        return Ok(Some(Outcome::Transmission(selected)));
                    }
                    return Ok(None);
                }
                Err(error) => {
                    // Logged where an operator looks: libnbd clients (nbdfuse, nbdinfo, the
                    // CSI node plugin's attach) keep the reply's text to their debug output.
                    tracing::warn!(export = info.name, %error, "refused to open an NBD export");
                    let message = error.to_string();
                    encode_option_reply(&mut out, option, REP_ERR_UNKNOWN, truncate(&message));
                }
            }
        }
        // Simple replies only; TLS is not offered (NOTLS mode may answer STARTTLS with UNSUP).
        OptionRequest::StructuredReply | OptionRequest::StartTls => {
            encode_option_reply(&mut out, option, REP_ERR_UNSUP, &[]);
        }
        OptionRequest::Unsupported { option } => {
            encode_option_reply(&mut out, option, REP_ERR_UNSUP, &[]);
        }
    }
    wire.send(&out)?;
    Ok(None)
}

/// NBD_REP_INFO replies for a successful NBD_OPT_INFO/GO: always the export record and the block
/// sizes (unrequested information is allowed and harmless), the name when asked.
fn encode_info_replies(
    out: &mut Vec<u8>,
    option: u32,
    info: &InfoRequest,
    geometry: &ExportGeometry,
) {
    let flags = transmission_flags(geometry.read_only);
    encode_option_reply(
        out,
        option,
        REP_INFO,
        &encode_info_export(geometry.size_bytes, flags),
    );
    encode_option_reply(
        out,
        option,
        REP_INFO,
        &encode_info_block_size(
            geometry.minimum_block_size_bytes,
            geometry.preferred_block_size_bytes,
            REQUEST_PAYLOAD_MAX_BYTES,
        ),
    );
    if info.information.contains(&INFO_NAME) {
        encode_option_reply(out, option, REP_INFO, &encode_info_name(&info.name));
    }
}

/// Opens an export and checks what it reports about itself. A panicking implementation is
/// refused like a missing export.
fn open(exports: &Arc<dyn Exports>, name: String) -> Result<Selected, NbdError> {
    let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let export = exports.open(&name)?;
        let minimum = export.minimum_block_size_bytes();
        let geometry = ExportGeometry {
            size_bytes: export.size_bytes(),
            minimum_block_size_bytes: minimum,
            // The protocol wants the preferred size at least 512 and at least the minimum.
            preferred_block_size_bytes: export.block_size_bytes().max(minimum).max(512),
            read_only: export.read_only(),
        };
        Ok::<_, NbdError>((export, geometry))
    }));
    let (export, geometry) = match opened {
        Ok(result) => result?,
        Err(_) => {
            return Err(NbdError::ExportUnavailable {
                name,
                reason: "opening the export panicked".to_string(),
            })
        }
    };
    let minimum = geometry.minimum_block_size_bytes;
    let preferred = geometry.preferred_block_size_bytes;
    if !minimum.is_power_of_two() || minimum > BLOCK_SIZE_MAX_BYTES || !preferred.is_power_of_two()
    {
        return Err(NbdError::ExportBlockSize {
            name,
            minimum_bytes: minimum,
            preferred_bytes: preferred,
        });
    }
    Ok(Selected {
        export,
        geometry,
        name,
    })
}

/// An error message cut to the protocol's string limit, on a character boundary.
fn truncate(message: &str) -> &[u8] {
    let mut end = message.len().min(STRING_MAX_BYTES);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message.as_bytes()[..end]
}
