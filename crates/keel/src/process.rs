//! The server process as Prometheus' standard `process_*` metrics see it: CPU time, memory,
//! file descriptors and threads, read from `/proc/self` at each scrape.

use std::io;
use std::path::Path;

/// One reading of the process.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessStats {
    /// User and system CPU time since the process started.
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub threads: u64,
    pub open_fds: u64,
    /// The soft limit on open file descriptors.
    pub max_fds: u64,
    /// When the process started (Unix time).
    pub start_time_seconds: f64,
}

/// Reads the calling process.
pub fn read() -> io::Result<ProcessStats> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let boot_time = boot_time_seconds(&std::fs::read_to_string("/proc/stat")?)?;
    // SAFETY: sysconf only reads configuration values.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    // SAFETY: as above.
    let page_bytes = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if ticks_per_second <= 0 || page_bytes <= 0 {
        return Err(io::Error::other("sysconf gave no clock tick or page size"));
    }
    let mut stats = parse_stat(&stat, ticks_per_second as f64, page_bytes as u64, boot_time)?;
    stats.open_fds = count_entries(Path::new("/proc/self/fd"))?;
    stats.max_fds = soft_fd_limit(&std::fs::read_to_string("/proc/self/limits")?)?;
    Ok(stats)
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("unexpected {what}"))
}

/// Parses `/proc/self/stat` (fields per proc(5); the command name, in parentheses, may hold
/// spaces, so fields are counted after its closing parenthesis).
fn parse_stat(
    stat: &str,
    ticks_per_second: f64,
    page_bytes: u64,
    boot_time_seconds: u64,
) -> io::Result<ProcessStats> {
    let after_name = stat
        .rfind(')')
        .map(|end| &stat[end + 1..])
        .ok_or_else(|| invalid("/proc/self/stat"))?;
    // Field 3 (state) is the first after the name.
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let field = |number: usize| -> io::Result<u64> {
        fields
            .get(number - 3)
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| invalid("/proc/self/stat field"))
    };
    Ok(ProcessStats {
        cpu_seconds: (field(14)? + field(15)?) as f64 / ticks_per_second,
        threads: field(20)?,
        start_time_seconds: boot_time_seconds as f64 + field(22)? as f64 / ticks_per_second,
        virtual_bytes: field(23)?,
        resident_bytes: field(24)? * page_bytes,
        open_fds: 0,
        max_fds: 0,
    })
}

/// `btime` of `/proc/stat`: when the machine booted (Unix time).
fn boot_time_seconds(proc_stat: &str) -> io::Result<u64> {
    proc_stat
        .lines()
        .find_map(|line| line.strip_prefix("btime "))
        .and_then(|value| value.trim().parse().ok())
        .ok_or_else(|| invalid("/proc/stat btime"))
}

/// The soft limit of "Max open files" in `/proc/self/limits`.
fn soft_fd_limit(limits: &str) -> io::Result<u64> {
    limits
        .lines()
        .find_map(|line| line.strip_prefix("Max open files"))
        .and_then(|rest| rest.split_whitespace().next())
        .map(|soft| soft.parse().unwrap_or(u64::MAX))
        .ok_or_else(|| invalid("/proc/self/limits"))
}

fn count_entries(dir: &Path) -> io::Result<u64> {
    Ok(std::fs::read_dir(dir)?.count() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves the fields are taken after the command name even when it holds spaces and
    // parentheses, and converted with the tick rate and page size.
    #[test]
    fn stat_fields_are_counted_after_the_name() {
        let stat = "4242 (keel (a) b) S 1 4242 4242 0 -1 4194560 9000 0 0 0 250 150 0 0 20 0 \
                    37 0 120000 5000000000 30000 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 \
                    1 0 0 0 0 0";
        let stats = parse_stat(stat, 100.0, 4096, 1_700_000_000).expect("parses");
        assert_eq!(stats.cpu_seconds, 4.0);
        assert_eq!(stats.threads, 37);
        assert_eq!(stats.start_time_seconds, 1_700_001_200.0);
        assert_eq!(stats.virtual_bytes, 5_000_000_000);
        assert_eq!(stats.resident_bytes, 30000 * 4096);
        assert!(parse_stat("4242 (keel) S 1", 100.0, 4096, 0).is_err());
    }

    #[test]
    fn limits_and_boot_time() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max cpu time              unlimited            unlimited            seconds\n\
                      Max open files            1024                 524288               files\n";
        assert_eq!(soft_fd_limit(limits).expect("found"), 1024);
        let unlimited =
            "Max open files            unlimited            unlimited            files\n";
        assert_eq!(soft_fd_limit(unlimited).expect("found"), u64::MAX);
        assert_eq!(
            boot_time_seconds("cpu  1 2 3\nbtime 1700000000\nprocesses 5\n").expect("found"),
            1_700_000_000
        );
    }

    // Proves a reading of this very process is plausible: it runs threads, holds files open
    // and has used memory.
    #[test]
    fn reads_this_process() {
        let stats = read().expect("reads /proc/self");
        assert!(stats.threads >= 1);
        assert!(stats.open_fds >= 3 && stats.open_fds <= stats.max_fds);
        assert!(stats.resident_bytes > 1 << 20);
        assert!(stats.start_time_seconds > 1_600_000_000.0);
    }
}
