//! The crate's one error type. Two kinds of values live here: what an [`crate::Exports`]
//! implementation returns when an export cannot be opened (the handshake turns it into
//! NBD_REP_ERR_UNKNOWN, or a hard disconnect for NBD_OPT_EXPORT_NAME), and why a connection
//! ended early (logged; never fatal to the server).

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("export {name:?} does not exist")]
    ExportNotFound { name: String },

    #[error("export {name:?} cannot be opened: {reason}")]
    ExportUnavailable { name: String, reason: String },

    #[error(
        "export {name:?} reports block sizes of {minimum_bytes} (minimum) and {preferred_bytes} \
         (preferred) bytes; both must be powers of two, the minimum at most 65536"
    )]
    ExportBlockSize {
        name: String,
        minimum_bytes: u32,
        preferred_bytes: u32,
    },

    #[error("{context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: io::Error,
    },

    #[error("client sent unknown handshake flags {flags:#x}")]
    ClientFlagsUnknown { flags: u32 },

    #[error(
        "client flags {flags:#x} lack NBD_FLAG_C_FIXED_NEWSTYLE; only fixed newstyle is served"
    )]
    ClientNotFixedNewstyle { flags: u32 },

    #[error("option header has magic {found:#018x}, expected IHAVEOPT")]
    OptionMagic { found: u64 },

    #[error("option {option} carries {length_bytes} bytes of data, more than this server reads")]
    OptionTooLarge { option: u32, length_bytes: u32 },

    #[error("client sent more than {limit} options during the handshake")]
    OptionsTooMany { limit: usize },

    #[error("NBD_OPT_EXPORT_NAME carried an invalid name: {reason}")]
    ExportNameInvalid { reason: &'static str },

    #[error("handshake did not finish within {seconds} s")]
    HandshakeTimeout { seconds: u64 },

    #[error("request header has magic {found:#010x}, expected 0x25609513")]
    RequestMagic { found: u32 },

    #[error("refused write of {length_bytes} bytes is too large to read and discard")]
    WriteTooLarge { length_bytes: u32 },
}

impl NbdError {
    /// Wraps an I/O error with what the server was doing.
    pub(crate) fn io(context: &'static str) -> impl FnOnce(io::Error) -> NbdError {
        move |source| NbdError::Io { context, source }
    }
}
