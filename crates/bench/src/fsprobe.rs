//! What the storage under a path really guarantees: is it memory (tmpfs/ramfs/ramdisk, where
//! fsync is a no-op and every durability number is a lie), and does the disk under it have a
//! volatile write cache (so a sync costs a cache flush, and an honest benchmark must include it)?
//!
//! The block device is found from the file's `st_dev` (or a device node's `st_rdev`) through
//! `/sys/dev/block/MAJ:MIN`, walking up from a partition to its whole disk, whose
//! `queue/write_cache` says "write back" (volatile cache) or "write through".
//! The primitives (statfs, device resolution, write-cache mode) are `keel_store::fsinfo`, shared
//! with the store's start-up check and `keel doctor`; this module turns them into the bench's
//! report and warnings.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::BenchError;

/// Block-device major number of the kernel's RAM disk driver (`brd`, /dev/ramN).
const RAM_DISK_MAJOR: u32 = 1;

/// The device's write cache mode as the kernel reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WriteCache {
    /// "write back": acknowledged writes may sit in a volatile cache until a flush.
    WriteBack,
    /// "write through": the device reports no volatile cache.
    WriteThrough,
}

/// What was found about the storage under one path.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StorageProbe {
    /// The path probed.
    pub path: PathBuf,
    /// Filesystem holding the path (for a device node: "block device").
    pub filesystem: String,
    /// `statfs.f_type`, when the path is a file on a filesystem.
    pub filesystem_magic: Option<u64>,
    /// True when the bytes live only in RAM (tmpfs, ramfs, a RAM disk or zram).
    pub memory_backed: bool,
    /// Whole-disk device name under the path (e.g. "nvme0n1"), when it could be resolved.
    pub device: Option<String>,
    /// That device's write cache, when the kernel reports it.
    pub write_cache: Option<WriteCache>,
    /// Human-readable warnings; empty when nothing is suspicious.
    pub warnings: Vec<String>,
}

impl StorageProbe {
    /// One line for a report: filesystem, device and cache.
    pub fn describe(&self) -> String {
        let device = self.device.as_deref().unwrap_or("unknown device");
        let cache = match self.write_cache {
            Some(WriteCache::WriteBack) => "write cache: write back (volatile)",
            Some(WriteCache::WriteThrough) => "write cache: write through",
            None => "write cache: unknown",
        };
        format!("{} on {device}, {cache}", self.filesystem)
    }
}

/// Probes the storage under `path`. A path that does not exist yet is probed through its
/// nearest existing ancestor (the file a benchmark is about to create).
pub fn probe(path: &Path) -> Result<StorageProbe, BenchError> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let mut existing = path.to_path_buf();
    while std::fs::symlink_metadata(&existing).is_err() {
        match existing.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => existing = parent.to_path_buf(),
            _ => {
                existing = PathBuf::from(".");
                break;
            }
        }
    }
    let metadata =
        std::fs::metadata(&existing).map_err(|error| BenchError::io("stat", &existing, error))?;
    let mut warnings = Vec::new();
    let (filesystem, filesystem_magic, device_number, mut memory_backed) =
        if metadata.file_type().is_block_device() {
            // A device node lives on devtmpfs, whose magic is tmpfs': that says nothing about
            // the device itself, so look at the device instead.
            let rdev = metadata.rdev();
            let major = libc::major(rdev);
            (
                "block device".to_string(),
                None,
                rdev,
                major == RAM_DISK_MAJOR,
            )
        } else {
            let info = keel_store::fsinfo::filesystem_info(&existing)
                .map_err(|error| BenchError::io("statfs", &existing, error))?;
            let volatile = info.is_volatile();
            (
                info.filesystem,
                Some(info.magic as u64 & 0xFFFF_FFFF),
                metadata.dev(),
                volatile,
            )
        };
    let device =
        keel_store::fsinfo::whole_disk(libc::major(device_number), libc::minor(device_number));
    if device
        .as_deref()
        .is_some_and(keel_store::fsinfo::is_memory_device)
    {
        memory_backed = true;
    }
    let write_cache = device
        .as_deref()
        .and_then(keel_store::fsinfo::write_cache_mode)
        .and_then(|mode| match mode.as_str() {
            "write back" => Some(WriteCache::WriteBack),
            "write through" => Some(WriteCache::WriteThrough),
            _ => None,
        });
    if memory_backed {
        warnings.push(format!(
            "{} is on {} — memory, not a disk: fsync/fdatasync are no-ops there, so durability \
             and sync latency numbers measured here are meaningless",
            path.display(),
            device
                .as_deref()
                .filter(|_| filesystem_magic.is_none())
                .unwrap_or(&filesystem)
        ));
    }
    if write_cache == Some(WriteCache::WriteBack) {
        warnings.push(format!(
            "the device under {} ({}) has a volatile write cache (write back): a write is durable \
             only after a cache flush (fdatasync/FUA); numbers without one measure the cache",
            path.display(),
            device.as_deref().unwrap_or("?")
        ));
    }
    Ok(StorageProbe {
        path: path.to_path_buf(),
        filesystem,
        filesystem_magic,
        memory_backed,
        device,
        write_cache,
        warnings,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::process::Command;

    /// What `stat -f -c %T` (the coreutils view) says the filesystem type is.
    fn stat_filesystem_type(path: &Path) -> String {
        let output = Command::new("stat")
            .args(["-f", "-c", "%T"])
            .arg(path)
            .output()
            .expect("`stat` must be installed (Debian package coreutils)");
        assert!(output.status.success(), "stat -f {} failed", path.display());
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    }

    /// Unmounts the tmpfs when the test ends, pass or fail.
    struct MountGuard(PathBuf);
    impl Drop for MountGuard {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
            let _ = std::fs::remove_dir(&self.0);
        }
    }

    // Proves a tmpfs is flagged as memory-backed with a warning, and a directory on the real
    // disk is not — each checked against what `stat -f` says. The tmpfs is mounted by the test
    // under /var/tmp (we run as root) and unmounted afterwards.
    #[test]
    fn detects_tmpfs_and_not_the_real_disk() {
        let mount_point =
            PathBuf::from(format!("/var/tmp/keel-bench-tmpfs-{}", std::process::id()));
        std::fs::create_dir_all(&mount_point).unwrap();
        let _guard = MountGuard(mount_point.clone());
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=4m", "keel-bench-test"])
            .arg(&mount_point)
            .status()
            .expect("`mount` must be installed (Debian package mount) and the tests run as root");
        assert!(
            status.success(),
            "mount -t tmpfs failed: the tests must run as root"
        );
        assert_eq!(stat_filesystem_type(&mount_point), "tmpfs");

        let file = mount_point.join("not-yet-created");
        let found = probe(&file).unwrap();
        assert_eq!(found.filesystem_magic, Some(0x0102_1994));
        assert_eq!(found.filesystem, "tmpfs");
        assert!(found.memory_backed);
        assert!(
            found
                .warnings
                .iter()
                .any(|warning| warning.contains("memory, not a disk")),
            "{found:?}"
        );

        let real = Path::new("/var/tmp");
        let real_type = stat_filesystem_type(real);
        assert_ne!(
            real_type, "tmpfs",
            "/var/tmp itself must be on a disk for this test"
        );
        let found = probe(real).unwrap();
        assert!(!found.memory_backed, "{found:?}");
        assert!(!found
            .warnings
            .iter()
            .any(|warning| warning.contains("memory")));
    }

    // Proves the write-cache report agrees with sysfs for the disk under /var/tmp, and that
    // a volatile cache produces a warning.
    #[test]
    fn reports_the_write_cache_of_the_disk_under_a_path() {
        use std::os::unix::fs::MetadataExt;
        let metadata = std::fs::metadata("/var/tmp").unwrap();
        let found = probe(Path::new("/var/tmp")).unwrap();
        let expected_device = keel_store::fsinfo::whole_disk(
            libc::major(metadata.dev()),
            libc::minor(metadata.dev()),
        );
        assert_eq!(found.device, expected_device);
        if let Some(device) = &found.device {
            let text =
                std::fs::read_to_string(format!("/sys/block/{device}/queue/write_cache")).unwrap();
            let expected = match text.trim() {
                "write back" => Some(WriteCache::WriteBack),
                "write through" => Some(WriteCache::WriteThrough),
                _ => None,
            };
            assert_eq!(found.write_cache, expected);
            assert_eq!(
                found
                    .warnings
                    .iter()
                    .any(|warning| warning.contains("volatile write cache")),
                expected == Some(WriteCache::WriteBack)
            );
        }
    }
}
