//! Where a benchmark sends its I/O: a local file or block device, a Keel volume over NBD, or an
//! S3 bucket. Block-like targets (file, device, NBD) share the [`BlockTarget`] trait so one
//! profile runs unchanged on every layer of a stack.
//!
//! Invariants: buffers handed to a file opened with O_DIRECT are aligned to
//! [`DIRECT_IO_ALIGNMENT_BYTES`] ([`AlignedBuffer`]); a write passed with `durable = true` has
//! reached stable storage when the call returns (O_DSYNC, fdatasync, or NBD FUA).

use std::alloc::Layout;
use std::fs::File;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rand::RngCore;

use crate::nbd::NbdClient;
use crate::BenchError;

/// Alignment of buffers, offsets and lengths for O_DIRECT (the largest logical block size seen
/// in practice).
pub const DIRECT_IO_ALIGNMENT_BYTES: usize = 4096;
/// Size of the writes that lay out (pre-fill) a new benchmark file.
const LAYOUT_CHUNK_BYTES: usize = 1024 * 1024;

/// A parsed `--target` string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetSpec {
    /// A regular file (created if missing) or a block device.
    Path(PathBuf),
    /// `nbd://HOST:PORT/EXPORT` (export may be empty: the server's default).
    Nbd { address: String, export: String },
    /// `s3://BUCKET` (endpoint and keys come from flags or the environment).
    S3 { bucket: String },
}

impl TargetSpec {
    /// Parses `nbd://HOST[:PORT]/EXPORT`, `s3://BUCKET` or a path.
    pub fn parse(text: &str) -> Result<Self, BenchError> {
        if let Some(rest) = text.strip_prefix("nbd://") {
            let (address, export) = rest.split_once('/').unwrap_or((rest, ""));
            if address.is_empty() {
                return Err(BenchError::Target {
                    target: text.to_string(),
                    reason: "expected nbd://HOST:PORT/EXPORT".to_string(),
                });
            }
            let address = if address.contains(':') {
                address.to_string()
            } else {
                format!("{address}:{}", crate::nbd::NBD_DEFAULT_PORT)
            };
            return Ok(Self::Nbd {
                address,
                export: export.to_string(),
            });
        }
        if let Some(bucket) = text.strip_prefix("s3://") {
            let bucket = bucket.trim_end_matches('/');
            if bucket.is_empty() || bucket.contains('/') {
                return Err(BenchError::Target {
                    target: text.to_string(),
                    reason: "expected s3://BUCKET".to_string(),
                });
            }
            return Ok(Self::S3 {
                bucket: bucket.to_string(),
            });
        }
        if text.contains("://") {
            return Err(BenchError::Target {
                target: text.to_string(),
                reason: "unknown scheme; use a path, nbd://HOST:PORT/EXPORT or s3://BUCKET"
                    .to_string(),
            });
        }
        Ok(Self::Path(PathBuf::from(text)))
    }

    /// "file", "block device", "nbd" or "s3".
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Path(path) => match std::fs::metadata(path) {
                Ok(metadata) if metadata.file_type().is_block_device() => "block device",
                _ => "file",
            },
            Self::Nbd { .. } => "nbd",
            Self::S3 { .. } => "s3",
        }
    }
}

/// How each write of a durable profile is made durable.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum SyncMethod {
    /// Files opened with O_DSYNC; NBD writes sent with FUA.
    Dsync,
    /// fdatasync after each write; NBD FLUSH after each write.
    Fdatasync,
}

/// A target that reads and writes blocks at offsets; shared by all worker threads.
pub trait BlockTarget: Send + Sync {
    /// Usable size in bytes.
    fn size_bytes(&self) -> u64;
    /// Reads `buffer.len()` bytes at `offset`.
    fn read_at(&self, buffer: &mut [u8], offset: u64) -> Result<(), BenchError>;
    /// Writes `buffer` at `offset`; with `durable`, returns only once it is on stable storage.
    fn write_at(&self, buffer: &[u8], offset: u64, durable: bool) -> Result<(), BenchError>;
    /// Makes every write that completed before this call durable.
    fn flush(&self) -> Result<(), BenchError>;
    /// How a `durable` write is made durable, for the report.
    fn durable_write_method(&self) -> String;
}

/// Options for opening a file or block device.
#[derive(Clone, Copy, Debug)]
pub struct FileOptions {
    /// Try O_DIRECT (fall back to buffered I/O where the filesystem refuses it).
    pub direct: bool,
    /// How durable writes are made durable.
    pub sync_method: SyncMethod,
    /// Size of the region used; a regular file is extended and laid out to this size.
    pub size_bytes: u64,
}

/// A regular file or block device.
#[derive(Debug)]
pub struct FileTarget {
    file: File,
    path: PathBuf,
    size_bytes: u64,
    direct: bool,
    dsync: bool,
}

impl FileTarget {
    /// Opens (creating if needed) `path`. Regular files shorter than `size_bytes` are laid out
    /// with incompressible data and synced, so reads hit real blocks and writes overwrite
    /// allocated extents (as fio does before a run).
    pub fn open(path: &Path, options: FileOptions) -> Result<Self, BenchError> {
        let is_block_device = std::fs::metadata(path)
            .map(|metadata| metadata.file_type().is_block_device())
            .unwrap_or(false);
        let dsync = options.sync_method == SyncMethod::Dsync;
        let open = |direct: bool| {
            let mut flags = 0;
            if direct {
                flags |= libc::O_DIRECT;
            }
            if dsync {
                flags |= libc::O_DSYNC;
            }
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(!is_block_device)
                .truncate(false)
                .custom_flags(flags)
                .open(path)
        };
        let (file, direct) = match open(options.direct) {
            Ok(file) => (file, options.direct),
            // EINVAL: the filesystem does not support O_DIRECT; measure buffered I/O and say so.
            Err(error) if options.direct && error.raw_os_error() == Some(libc::EINVAL) => (
                open(false).map_err(|error| BenchError::io("open", path, error))?,
                false,
            ),
            Err(error) => return Err(BenchError::io("open", path, error)),
        };
        let size_bytes = if is_block_device {
            use std::io::Seek;
            let device_bytes = (&file)
                .seek(std::io::SeekFrom::End(0))
                .map_err(|error| BenchError::io("seek to end of", path, error))?;
            if device_bytes < options.size_bytes {
                device_bytes
            } else {
                options.size_bytes
            }
        } else {
            options.size_bytes
        };
        let size_bytes = size_bytes - size_bytes % DIRECT_IO_ALIGNMENT_BYTES as u64;
        if size_bytes == 0 {
            return Err(BenchError::Target {
                target: path.display().to_string(),
                reason: "size is smaller than one block".to_string(),
            });
        }
        let target = Self {
            file,
            path: path.to_path_buf(),
            size_bytes,
            direct,
            dsync,
        };
        if !is_block_device {
            target.lay_out()?;
        }
        Ok(target)
    }

    /// Opens an existing file or device read-only, at its full size, without laying anything
    /// out (for reading back what survived a crash).
    pub fn open_read_only(path: &Path) -> Result<Self, BenchError> {
        use std::io::Seek;
        let file = File::open(path).map_err(|error| BenchError::io("open", path, error))?;
        let size_bytes = (&file)
            .seek(std::io::SeekFrom::End(0))
            .map_err(|error| BenchError::io("seek to end of", path, error))?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
            size_bytes,
            direct: false,
            dsync: false,
        })
    }

    /// Extends a regular file to its size with random data, then syncs it and its directory.
    fn lay_out(&self) -> Result<(), BenchError> {
        let length = self
            .file
            .metadata()
            .map_err(|error| BenchError::io("stat", &self.path, error))?
            .len();
        if length >= self.size_bytes {
            return Ok(());
        }
        let mut chunk = AlignedBuffer::new(LAYOUT_CHUNK_BYTES);
        let mut offset = length - length % DIRECT_IO_ALIGNMENT_BYTES as u64;
        let mut random = rand::thread_rng();
        while offset < self.size_bytes {
            random.fill_bytes(chunk.as_mut_slice());
            let length = (self.size_bytes - offset).min(LAYOUT_CHUNK_BYTES as u64) as usize;
            self.file
                .write_all_at(&chunk.as_slice()[..length], offset)
                .map_err(|error| BenchError::io("lay out", &self.path, error))?;
            offset += length as u64;
        }
        self.sync_data()?;
        sync_parent_directory(&self.path)
    }

    fn sync_data(&self) -> Result<(), BenchError> {
        self.file
            .sync_data()
            .map_err(|error| BenchError::io("fdatasync", &self.path, error))
    }

    /// True when the file is open with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// True when the file is open with O_DSYNC.
    pub fn is_dsync(&self) -> bool {
        self.dsync
    }

    /// The file descriptor, for io_uring.
    pub fn raw_fd(&self) -> std::os::unix::io::RawFd {
        use std::os::unix::io::AsRawFd;
        self.file.as_raw_fd()
    }

    /// The path opened.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl BlockTarget for FileTarget {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, buffer: &mut [u8], offset: u64) -> Result<(), BenchError> {
        self.file
            .read_exact_at(buffer, offset)
            .map_err(|error| BenchError::io("pread", &self.path, error))
    }

    fn write_at(&self, buffer: &[u8], offset: u64, durable: bool) -> Result<(), BenchError> {
        self.file
            .write_all_at(buffer, offset)
            .map_err(|error| BenchError::io("pwrite", &self.path, error))?;
        if durable && !self.dsync {
            self.sync_data()?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), BenchError> {
        self.sync_data()
    }

    fn durable_write_method(&self) -> String {
        if self.dsync {
            "O_DSYNC (each write returns once durable)".to_string()
        } else {
            "fdatasync after each write".to_string()
        }
    }
}

impl BlockTarget for NbdClient {
    fn size_bytes(&self) -> u64 {
        self.export_size_bytes()
    }

    fn read_at(&self, buffer: &mut [u8], offset: u64) -> Result<(), BenchError> {
        self.read(offset, buffer)
    }

    fn write_at(&self, buffer: &[u8], offset: u64, durable: bool) -> Result<(), BenchError> {
        if durable && self.sync_method() == SyncMethod::Dsync && self.supports_fua() {
            self.write(offset, buffer, true)
        } else {
            self.write(offset, buffer, false)?;
            if durable {
                self.flush()?;
            }
            Ok(())
        }
    }

    fn flush(&self) -> Result<(), BenchError> {
        NbdClient::flush(self)
    }

    fn durable_write_method(&self) -> String {
        if self.sync_method() == SyncMethod::Dsync && self.supports_fua() {
            "NBD WRITE with FUA".to_string()
        } else {
            "NBD FLUSH after each write".to_string()
        }
    }
}

/// A heap buffer aligned for O_DIRECT.
pub struct AlignedBuffer {
    pointer: std::ptr::NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain owned memory; access goes through &self/&mut self.
unsafe impl Send for AlignedBuffer {}
// SAFETY: shared access only hands out shared slices.
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    /// A zeroed buffer of `length` bytes (at least 1) aligned to DIRECT_IO_ALIGNMENT_BYTES.
    pub fn new(length: usize) -> Self {
        let layout = Layout::from_size_align(length.max(1), DIRECT_IO_ALIGNMENT_BYTES)
            .expect("buffer sizes are bounded far below isize::MAX");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let pointer =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { pointer, layout }
    }

    /// A buffer filled with random (incompressible) bytes.
    pub fn random(length: usize) -> Self {
        let mut buffer = Self::new(length);
        rand::thread_rng().fill_bytes(buffer.as_mut_slice());
        buffer
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the allocation is layout.size() bytes, initialised (zeroed) at creation.
        unsafe { std::slice::from_raw_parts(self.pointer.as_ptr(), self.layout.size()) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.pointer.as_ptr(), self.layout.size()) }
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.pointer.as_ptr()
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout.
        unsafe { std::alloc::dealloc(self.pointer.as_ptr(), self.layout) }
    }
}

/// Makes `path`'s directory entry durable (fsync of the directory holding it).
pub(crate) fn sync_parent_directory(path: &Path) -> Result<(), BenchError> {
    if let Some(parent) = path.parent() {
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        File::open(parent)
            .and_then(|directory| directory.sync_all())
            .map_err(|error| BenchError::io("fsync directory", parent, error))?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    // Proves target strings map to the right kind, with the NBD default port filled in.
    #[test]
    fn parses_target_strings() {
        assert_eq!(
            TargetSpec::parse("nbd://127.0.0.1:10809/vol1").unwrap(),
            TargetSpec::Nbd {
                address: "127.0.0.1:10809".into(),
                export: "vol1".into()
            }
        );
        assert_eq!(
            TargetSpec::parse("nbd://localhost/v").unwrap(),
            TargetSpec::Nbd {
                address: "localhost:10809".into(),
                export: "v".into()
            }
        );
        assert_eq!(
            TargetSpec::parse("s3://bucket").unwrap(),
            TargetSpec::S3 {
                bucket: "bucket".into()
            }
        );
        assert_eq!(
            TargetSpec::parse("/var/tmp/x").unwrap(),
            TargetSpec::Path("/var/tmp/x".into())
        );
        assert!(TargetSpec::parse("http://x").is_err());
        assert!(TargetSpec::parse("s3://").is_err());
    }
}
