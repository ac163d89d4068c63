//! What the kernel counts for the block device under each data directory (`/proc/diskstats`,
//! as iostat reads it): requests, bytes, the queue, busy time and cache flushes. These are
//! the whole device's, Keel's I/O and anyone else's.

use std::io;

/// Sectors in `/proc/diskstats` are 512 bytes whatever the device's sector size.
const SECTOR_BYTES: u64 = 512;

/// One device's counters since boot.
#[derive(Debug, Clone, PartialEq)]
pub struct DiskStats {
    pub reads: u64,
    pub read_bytes: u64,
    pub writes: u64,
    pub written_bytes: u64,
    /// Requests in the device's queue now.
    pub in_progress: u64,
    /// Time the device had requests in flight.
    pub busy_ms: u64,
    /// Cache flushes completed and the time they took (kernels from 5.5 count them).
    pub flushes: Option<u64>,
    pub flush_ms: Option<u64>,
}

/// The counters of `device` (a name such as `vda` or `nvme0n1`), if the kernel lists it.
pub fn read(device: &str) -> io::Result<Option<DiskStats>> {
    Ok(parse(&std::fs::read_to_string("/proc/diskstats")?, device))
}

fn parse(diskstats: &str, device: &str) -> Option<DiskStats> {
    diskstats.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(2) != Some(&device) {
            return None;
        }
        // Fields after major, minor and name, numbered from 1 as in the kernel's iostats.
        let field = |number: usize| fields.get(2 + number).and_then(|v| v.parse::<u64>().ok());
        Some(DiskStats {
            reads: field(1)?,
            read_bytes: field(3)? * SECTOR_BYTES,
            writes: field(5)?,
            written_bytes: field(7)? * SECTOR_BYTES,
            in_progress: field(9)?,
            busy_ms: field(10)?,
            flushes: field(16),
            flush_ms: field(17),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves the fields are read by position for the named device only, sectors become bytes,
    // and the flush counters are optional (older kernels have 14 fields or fewer).
    #[test]
    fn fields_of_the_named_device() {
        let text = " 254       0 vda 2183056 43860 115834154 7033753 9315889 215514 1450240632 \
                    3622507 3 791056 10902640 138431 42 796723496 75204 3855621 171174\n \
                    254       1 vda1 10 0 80 1 20 0 160 2 0 3 3\n";
        let vda = parse(text, "vda").expect("listed");
        assert_eq!(vda.reads, 2183056);
        assert_eq!(vda.read_bytes, 115834154 * 512);
        assert_eq!(vda.writes, 9315889);
        assert_eq!(vda.written_bytes, 1450240632 * 512);
        assert_eq!(vda.in_progress, 3);
        assert_eq!(vda.busy_ms, 791056);
        assert_eq!(vda.flushes, Some(3855621));
        assert_eq!(vda.flush_ms, Some(171174));
        let partition = parse(text, "vda1").expect("listed");
        assert_eq!((partition.writes, partition.flushes), (20, None));
        assert_eq!(parse(text, "sda"), None);
    }
}
