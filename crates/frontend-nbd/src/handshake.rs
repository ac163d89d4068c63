//! The handshake phase: fixed newstyle negotiation only (oldstyle and non-fixed newstyle clients
//! are refused), ending either in the transmission phase with an opened export or in a closed
//! session.
//!
//! Invariants: every option except NBD_OPT_EXPORT_NAME gets exactly one final reply (an ACK or an
//! error), unknown options get NBD_REP_ERR_UNSUP and the loop continues; option data is never
//! read into memory beyond [`OPTION_DATA_MAX_BYTES`]; the number of options per session is
//! bounded by [`crate::HANDSHAKE_OPTIONS_MAX`] (the caller bounds the time).

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

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

/// Runs the handshake on a fresh connection.
pub(crate) async fn negotiate<R, W>(
    reader: &mut R,
    writer: &mut W,
    exports: &Arc<dyn Exports>,
) -> Result<Outcome, NbdError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    writer
        .write_all(&encode_greeting())
        .await
        .map_err(NbdError::io("sending the greeting"))?;
    writer
        .flush()
        .await
        .map_err(NbdError::io("sending the greeting"))?;
    let mut flag_bytes = [0u8; CLIENT_FLAGS_BYTES];
    reader
        .read_exact(&mut flag_bytes)
        .await
        .map_err(NbdError::io("reading the client flags"))?;
    let client = parse_client_flags(flag_bytes)?;

    for _ in 0..HANDSHAKE_OPTIONS_MAX {
        let mut header_bytes = [0u8; OPTION_HEADER_BYTES];
        reader
            .read_exact(&mut header_bytes)
            .await
            .map_err(NbdError::io("reading an option header"))?;
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
            discard(reader, u64::from(header.length_bytes)).await?;
            let mut out = Vec::new();
            encode_option_reply(
                &mut out,
                header.option,
                REP_ERR_TOO_BIG,
                b"option data is larger than this server accepts",
            );
            send(writer, &out).await?;
            continue;
        }
        let mut data = vec![0u8; length];
        reader
            .read_exact(&mut data)
            .await
            .map_err(NbdError::io("reading option data"))?;
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
                send(writer, &out).await?;
                continue;
            }
        };
        if let Some(outcome) = answer(request, header.option, client, writer, exports).await? {
            return Ok(outcome);
        }
    }
    Err(NbdError::OptionsTooMany {
        limit: HANDSHAKE_OPTIONS_MAX,
    })
}

/// Answers one decoded option; `Some` ends the handshake.
async fn answer<W>(
    request: OptionRequest,
    option: u32,
    client: ClientFlags,
    writer: &mut W,
    exports: &Arc<dyn Exports>,
) -> Result<Option<Outcome>, NbdError>
where
    W: AsyncWrite + Unpin,
{
    let mut out = Vec::new();
    match request {
        OptionRequest::ExportName { name } => {
            // No way to report an error here: a missing export ends the session.
            let selected = open(exports, name).await?;
            let flags = transmission_flags(selected.geometry.read_only);
            let reply =
                encode_export_name_reply(selected.geometry.size_bytes, flags, client.no_zeroes);
            send(writer, &reply).await?;
            return Ok(Some(Outcome::Transmission(selected)));
        }
        OptionRequest::Abort => {
            encode_option_reply(&mut out, option, REP_ACK, &[]);
            // The client may already have closed; the ACK is a courtesy.
            let _ = send(writer, &out).await;
            return Ok(Some(Outcome::Aborted));
        }
        OptionRequest::List => {
            let exports = Arc::clone(exports);
            let names = tokio::task::spawn_blocking(move || exports.list())
                .await
                .unwrap_or_default();
            for name in names.iter().filter(|name| name.len() <= STRING_MAX_BYTES) {
                encode_option_reply(&mut out, option, REP_SERVER, &encode_server_entry(name));
            }
            encode_option_reply(&mut out, option, REP_ACK, &[]);
        }
        OptionRequest::Info(info) | OptionRequest::Go(info) => {
            let go = option == crate::protocol::OPT_GO;
            match open(exports, info.name.clone()).await {
                Ok(selected) => {
                    encode_info_replies(&mut out, option, &info, &selected.geometry);
                    encode_option_reply(&mut out, option, REP_ACK, &[]);
                    send(writer, &out).await?;
                    if go {
                        return Ok(Some(Outcome::Transmission(selected)));
                    }
                    return Ok(None);
                }
                Err(error) => {
                    tracing::debug!(%error, "refusing NBD_OPT_INFO/GO");
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
    send(writer, &out).await?;
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

/// Opens an export on a blocking thread and checks what it reports about itself.
async fn open(exports: &Arc<dyn Exports>, name: String) -> Result<Selected, NbdError> {
    let exports = Arc::clone(exports);
    let opened_name = name.clone();
    let opened = tokio::task::spawn_blocking(move || {
        let export = exports.open(&opened_name)?;
        let minimum = export.minimum_block_size_bytes();
        let geometry = ExportGeometry {
            size_bytes: export.size_bytes(),
            minimum_block_size_bytes: minimum,
            // The protocol wants the preferred size at least 512 and at least the minimum.
            preferred_block_size_bytes: export.block_size_bytes().max(minimum).max(512),
            read_only: export.read_only(),
        };
        Ok::<_, NbdError>((export, geometry))
    })
    .await;
    let (export, geometry) = match opened {
        Ok(result) => result?,
        Err(join) => {
            return Err(NbdError::ExportUnavailable {
                name,
                reason: format!("opening the export panicked: {join}"),
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

async fn send<W: AsyncWrite + Unpin>(writer: &mut W, bytes: &[u8]) -> Result<(), NbdError> {
    writer
        .write_all(bytes)
        .await
        .map_err(NbdError::io("sending an option reply"))?;
    writer
        .flush()
        .await
        .map_err(NbdError::io("sending an option reply"))
}

/// Reads and drops `length` bytes.
async fn discard<R: AsyncRead + Unpin>(reader: &mut R, length: u64) -> Result<(), NbdError> {
    let copied = tokio::io::copy(&mut reader.take(length), &mut tokio::io::sink())
        .await
        .map_err(NbdError::io("skipping oversized option data"))?;
    if copied != length {
        return Err(NbdError::Io {
            context: "skipping oversized option data",
            source: std::io::ErrorKind::UnexpectedEof.into(),
        });
    }
    Ok(())
}

/// An error message cut to the protocol's string limit, on a character boundary.
fn truncate(message: &str) -> &[u8] {
    let mut end = message.len().min(STRING_MAX_BYTES);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message.as_bytes()[..end]
}
