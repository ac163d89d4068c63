//! The crate's one error type: every variant says what was being done and to what.

use std::path::PathBuf;

/// Errors of `keel bench`.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A system call on a file, device or log failed.
    #[error("{context} {path}: {source}")]
    Io {
        context: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The target string or its options make no sense.
    #[error("target {target}: {reason}")]
    Target { target: String, reason: String },
    /// The NBD server broke the protocol, refused an option or answered a command with an error.
    #[error("NBD {address}: {reason}")]
    Nbd { address: String, reason: String },
    /// An S3 request failed.
    #[error("S3 {operation} {key}: {reason}")]
    S3 {
        operation: &'static str,
        key: String,
        reason: String,
    },
    /// A command-line value is out of range or inconsistent with another.
    #[error("invalid {what}: {reason}")]
    Invalid { what: &'static str, reason: String },
    /// A durability log could not be parsed.
    #[error("durability log {path} line {line}: {reason}")]
    Log {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    /// A result file could not be read or parsed.
    #[error("result file {path}: {reason}")]
    ResultFile { path: PathBuf, reason: String },
    /// The durability check found acknowledged writes missing or corrupt.
    #[error(
        "durability check FAILED: {missing} acknowledged writes missing and {corrupt} corrupt, \
         of {checked} checked"
    )]
    DurabilityFailed {
        missing: u64,
        corrupt: u64,
        checked: u64,
    },
    /// An external program (fio, pgbench script) failed or is missing.
    #[error("{program}: {reason}")]
    External { program: String, reason: String },
    /// A bug in this crate (an invariant did not hold).
    #[error("internal error: {reason}")]
    Internal { reason: String },
}

impl BenchError {
    /// Wraps an I/O error with what was being done and to which path.
    pub fn io(context: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            context,
            path: path.into(),
            source,
        }
    }
}
