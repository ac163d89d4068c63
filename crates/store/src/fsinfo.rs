//! What the filesystem and device under a path really guarantee: the filesystem type (tmpfs and
//! ramfs make fsync meaningless), whether the block device has a volatile write cache, and free
//! space. Used by `Store::open` to refuse volatile data directories, by the space check on every
//! batch, and by `keel doctor`.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Filesystem magic numbers from statfs(2).
const KNOWN_FILESYSTEMS: &[(i64, &str)] = &[
    (0xEF53, "ext4"),
    (0x5846_5342, "xfs"),
    (0x9123_683E, "btrfs"),
    (0x2FC1_2FC1, "zfs"),
    (0x0102_1994, "tmpfs"),
    (0x8584_58F6, "ramfs"),
    (0x794C_7630, "overlayfs"),
    (0x6969, "nfs"),
    (0xF2F5_2010, "f2fs"),
    (0x6573_5546, "fuse"),
    (0x4d44, "vfat"),
    (0x0102_1997, "9p"),
    (0x5346_544E, "ntfs"),
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilesystemInfo {
    pub filesystem: String,
    pub magic: i64,
    pub available_bytes: u64,
    pub total_bytes: u64,
    /// Free bytes including those reserved for root (`available_bytes` excludes them).
    pub free_bytes: u64,
}

impl FilesystemInfo {
    /// Bytes in use and the bytes `df` counts its percentage of (in use plus available to
    /// unprivileged writers: root's reserve is neither), so Keel's "percent used" is `df`'s.
    pub fn used_of(&self) -> (u64, u64) {
        let used = self.total_bytes.saturating_sub(self.free_bytes);
        (used, used.saturating_add(self.available_bytes))
    }

    /// tmpfs and ramfs keep data in memory: fsync returns at once and a power cut loses it all.
    pub fn is_volatile(&self) -> bool {
        matches!(self.filesystem.as_str(), "tmpfs" | "ramfs")
    }

    /// Filesystems where `sync_file_range` does not even write the data (it is a no-op on zfs and
    /// only starts writeback on btrfs); on every filesystem it never flushes the device cache and
    /// never persists metadata, so Keel does not use it for durability anywhere.
    pub fn sync_file_range_unsafe(&self) -> bool {
        matches!(self.filesystem.as_str(), "zfs" | "btrfs")
    }
}

fn statvfs_raw(path: &Path) -> io::Result<libc::statfs> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    let mut out: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c_path is a valid NUL-terminated string and `out` is a properly sized statfs.
    let rc = unsafe { libc::statfs(c_path.as_ptr(), &mut out) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(out)
}

pub fn filesystem_info(path: &Path) -> io::Result<FilesystemInfo> {
    let raw = statvfs_raw(path)?;
    let magic = raw.f_type as i64;
    let filesystem = KNOWN_FILESYSTEMS
        .iter()
        .find(|(m, _)| *m == magic)
        .map(|(_, name)| (*name).to_string())
        .unwrap_or_else(|| format!("unknown (0x{magic:x})"));
    let block = raw.f_bsize as u64;
    Ok(FilesystemInfo {
        filesystem,
        magic,
        available_bytes: raw.f_bavail as u64 * block,
        total_bytes: raw.f_blocks as u64 * block,
        free_bytes: raw.f_bfree as u64 * block,
    })
}

/// Free bytes available to unprivileged writers on the filesystem holding `path`.
pub fn available_bytes(path: &Path) -> io::Result<u64> {
    let raw = statvfs_raw(path)?;
    Ok(raw.f_bavail as u64 * raw.f_bsize as u64)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteCacheInfo {
    /// The whole-disk block device, e.g. "nvme0n1" or "vda".
    pub device: String,
    /// `/sys/block/<dev>/queue/write_cache`: "write back" means a volatile cache that the kernel
    /// must flush on fsync; "write through" means writes are durable when complete.
    pub mode: String,
}

impl WriteCacheInfo {
    pub fn volatile(&self) -> bool {
        self.mode == "write back"
    }
}

/// The whole-disk block device name (e.g. "nvme0n1") for a device number, via
/// `/sys/dev/block/MAJ:MIN`, walking up from a partition to its disk. `None` for anonymous
/// devices (major 0: tmpfs, overlayfs, btrfs subvolumes) and anything sysfs does not list.
pub fn whole_disk(major: u32, minor: u32) -> Option<String> {
    if major == 0 {
        return None;
    }
    let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    let resolved = std::fs::canonicalize(&sys).ok()?;
    // A partition's sysfs directory has a `partition` file and sits inside its disk's directory.
    let disk = if resolved.join("partition").exists() {
        resolved.parent()?.to_path_buf()
    } else {
        resolved
    };
    Some(disk.file_name()?.to_string_lossy().into_owned())
}

/// `/sys/block/<device>/queue/write_cache`: "write back" or "write through".
pub fn write_cache_mode(device: &str) -> Option<String> {
    let mode = std::fs::read_to_string(format!("/sys/block/{device}/queue/write_cache")).ok()?;
    Some(mode.trim().to_string())
}

/// RAM disks (`brd`, /dev/ramN) and compressed RAM (zram) look like block devices but lose
/// everything on power loss.
pub fn is_memory_device(device: &str) -> bool {
    device.starts_with("ram") || device.starts_with("zram")
}

/// Why data under `path` would live only in memory, if it would: a tmpfs/ramfs filesystem, or a
/// RAM disk / zram device under it. `None` for a real disk.
pub fn memory_backed(path: &Path) -> io::Result<Option<String>> {
    let fs = filesystem_info(path)?;
    if fs.is_volatile() {
        return Ok(Some(fs.filesystem));
    }
    let dev = std::fs::metadata(path)?.dev();
    Ok(whole_disk(libc::major(dev), libc::minor(dev))
        .filter(|device| is_memory_device(device))
        .map(|device| format!("{} on RAM device {device}", fs.filesystem)))
}

/// The write-cache mode of the block device under `path`, if it has one (tmpfs, overlay and
/// network filesystems have none).
pub fn write_cache(path: &Path) -> Option<WriteCacheInfo> {
    let dev = std::fs::metadata(path).ok()?.dev();
    let device = whole_disk(libc::major(dev), libc::minor(dev))?;
    let mode = write_cache_mode(&device)?;
    Some(WriteCacheInfo { device, mode })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The target directory the tests run in is a real filesystem, reported by name, with
    /// `df`'s figures: in use plus available is at most its size (root's reserve is neither).
    #[test]
    fn reports_a_known_filesystem_for_the_build_dir() {
        let info = filesystem_info(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
        assert!(info.total_bytes > 0);
        assert!(!info.filesystem.is_empty());
        assert!(info.available_bytes <= info.free_bytes && info.free_bytes <= info.total_bytes);
        let (used, counted) = info.used_of();
        assert!(
            used > 0 && used < counted && counted <= info.total_bytes,
            "{info:?}"
        );
    }

    /// /proc is not a block device: no write-cache answer rather than a wrong one.
    #[test]
    fn no_write_cache_for_proc() {
        assert_eq!(write_cache(Path::new("/proc/self")), None);
    }
}
