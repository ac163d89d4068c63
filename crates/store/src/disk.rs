//! The store's view of the filesystem: every file and directory operation of the store (segment
//! files, the index file, the store id, the lock) goes through [`Disk`] and [`DiskFile`], so
//! tests can put a simulated disk ([`crate::simdisk::SimDisk`]) under the real engine — one that
//! keeps durable and volatile bytes apart, loses or tears unsynced writes at a power cut, fails a
//! chosen write or sync, and flips bits.
//!
//! [`RealDisk`] is the operating system's filesystem. Its contract is POSIX's: bytes written to a
//! file are durable once `sync_data` returned; a created, renamed or removed directory entry is
//! durable once `sync_dir` of its directory returned.

use std::fmt::Debug;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Offsets, lengths and buffer addresses of [`DiskFile::write_direct_at`] are multiples of this
/// (the largest logical block size of the devices Keel runs on).
pub const DIRECT_ALIGN: usize = 4096;

/// How to open a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// It must exist.
    Existing,
    /// Created if missing.
    Create,
    /// Created; it must not exist.
    CreateNew,
    /// Created if missing, emptied if present.
    Truncate,
}

/// An open file. (`len` is a file's size; "empty" means nothing useful for a file here.)
#[allow(clippy::len_without_is_empty)]
pub trait DiskFile: Send + Sync + Debug {
    /// Reads up to `buf.len()` bytes at `offset`; fewer only at the end of the file.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// [`DiskFile::write_all_at`] around the page cache (`O_DIRECT`): the bytes go from `buf` to
    /// the device, so a large write neither fills memory with pages nobody reads soon nor waits
    /// behind their writeback. `buf`'s address, its length and `offset` are multiples of
    /// [`DIRECT_ALIGN`] (`InvalidInput` otherwise). Durable only after `sync_data`, as any write
    /// (the device may cache it). `Unsupported` when the filesystem refuses direct I/O: write
    /// through the cache instead.
    fn write_direct_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// fdatasync: everything written before is durable when it returns `Ok`.
    fn sync_data(&self) -> io::Result<()>;
    fn set_len(&self, len: u64) -> io::Result<()>;
    fn len(&self) -> io::Result<u64>;
    /// Drops the file's clean cached pages, so the next reads come from the device. After a
    /// failed writeback Linux keeps the lost pages cached and clean: reading them would trust
    /// bytes the disk does not have.
    fn drop_cache(&self) -> io::Result<()>;
}

/// A held directory lock; released when dropped.
pub trait DirLock: Send + Sync + Debug {}

/// A filesystem.
pub trait Disk: Send + Sync + Debug + 'static {
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn DiskFile>>;
    /// The file's length, `None` if it does not exist.
    fn file_len(&self, path: &Path) -> io::Result<Option<u64>>;
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Names of the entries of a directory.
    fn list_dir(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Makes the directory's entries (creations, renames, removals) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// An exclusive lock on the directory, or `None` if another holder has it.
    fn lock_dir(&self, dir: &Path) -> io::Result<Option<Box<dyn DirLock>>>;
    fn available_bytes(&self, dir: &Path) -> io::Result<u64>;
    /// The memory-backed filesystem under `dir` (tmpfs, ramfs...), if it is one.
    fn memory_backed(&self, dir: &Path) -> io::Result<Option<String>>;
}

/// Reads as many bytes as the file has at `offset`, up to `buf.len()`.
pub fn read_up_to(file: &dyn DiskFile, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The operating system's filesystem.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealDisk;

/// Whether a direct write's buffer, length and offset meet [`DIRECT_ALIGN`].
pub fn direct_aligned(buf: &[u8], offset: u64) -> bool {
    let align = DIRECT_ALIGN as u64;
    (buf.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN)
        && (buf.len() as u64).is_multiple_of(align)
        && offset.is_multiple_of(align)
}

#[derive(Debug)]
struct RealFile {
    file: File,
    /// Where it was opened: a direct write opens it again with `O_DIRECT` (the store never
    /// renames a file it writes to after opening it).
    path: PathBuf,
}

impl DiskFile for RealFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.file.read_at(buf, offset)
    }

    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }

    fn write_direct_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if !direct_aligned(buf, offset) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a direct write of {} bytes at {offset} is not aligned",
                    buf.len()
                ),
            ));
        }
        // Opened per write (a large one: the open is noise beside it) rather than held: a store
        // keeps a descriptor per segment already, and most segments are never written again.
        let direct = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&self.path)
            .map_err(|error| match error.raw_os_error() {
                Some(libc::EINVAL) => io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("{}: the filesystem refuses O_DIRECT", self.path.display()),
                ),
                _ => error,
            })?;
        let mut done = 0usize;
        while done < buf.len() {
            match direct.write_at(&buf[done..], offset + done as u64) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                // A short direct write (the device or the filesystem ran out of room part of the
                // way) may end off the alignment; the rest goes through the cache, where the
                // error that stopped it is reported.
                Ok(written) if !written.is_multiple_of(DIRECT_ALIGN) => {
                    let rest = done + written;
                    return self.file.write_all_at(&buf[rest..], offset + rest as u64);
                }
                Ok(written) => done += written,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                // Opened with O_DIRECT but refused at the write (a device whose blocks are
                // larger than DIRECT_ALIGN, a filesystem that only pretends): the caller writes
                // the whole range again through the cache.
                Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                    return Err(io::Error::new(
                        io::ErrorKind::Unsupported,
                        format!(
                            "{}: a direct write was refused: {error}",
                            self.path.display()
                        ),
                    ))
                }
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }

    fn len(&self) -> io::Result<u64> {
        self.file.metadata().map(|meta| meta.len())
    }

    fn drop_cache(&self) -> io::Result<()> {
        // SAFETY: posix_fadvise on a file descriptor this value owns; it only advises.
        let rc =
            unsafe { libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(rc))
        }
    }
}

#[derive(Debug)]
struct RealLock {
    _file: File,
}

impl DirLock for RealLock {}

impl Disk for RealDisk {
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }

    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn DiskFile>> {
        let mut options = OpenOptions::new();
        options.read(true).write(true);
        match mode {
            OpenMode::Existing => {}
            OpenMode::Create => {
                options.create(true);
            }
            OpenMode::CreateNew => {
                options.create_new(true);
            }
            OpenMode::Truncate => {
                options.create(true).truncate(true);
            }
        }
        Ok(Arc::new(RealFile {
            file: options.open(path)?,
            path: path.to_path_buf(),
        }))
    }

    fn file_len(&self, path: &Path) -> io::Result<Option<u64>> {
        match std::fs::metadata(path) {
            Ok(meta) => Ok(Some(meta.len())),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(error),
        }
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn list_dir(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            names.push(entry?.file_name().to_string_lossy().into_owned());
        }
        Ok(names)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn lock_dir(&self, dir: &Path) -> io::Result<Option<Box<dyn DirLock>>> {
        let path = dir.join("lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        // SAFETY: flock on a file descriptor this function owns.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            return Ok(None);
        }
        Ok(Some(Box::new(RealLock { _file: file })))
    }

    fn available_bytes(&self, dir: &Path) -> io::Result<u64> {
        crate::fsinfo::available_bytes(dir)
    }

    fn memory_backed(&self, dir: &Path) -> io::Result<Option<String>> {
        crate::fsinfo::memory_backed(dir)
    }
}

/// redb's storage on a [`DiskFile`] (so the index file is simulated with the segments).
#[derive(Debug)]
pub(crate) struct IndexBackend(pub Arc<dyn DiskFile>);

impl redb::StorageBackend for IndexBackend {
    fn len(&self) -> io::Result<u64> {
        self.0.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let read = read_up_to(self.0.as_ref(), out, offset)?;
        if read != out.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "index file read of {} bytes at {offset} past its end",
                    out.len()
                ),
            ));
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.write_all_at(data, offset)
    }
}
