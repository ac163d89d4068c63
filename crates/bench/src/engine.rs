//! The load generators: keep `queue_depth` operations in flight against a block target for a
//! bounded time (and optionally a bounded op count), timing every operation.
//!
//! Two engines: portable threads (one thread per outstanding op doing pread/pwrite, used for
//! NBD, for fdatasync-per-write profiles and where io_uring is unavailable) and, for files on
//! Linux, io_uring on one thread (`uring`), which gives real queue depth with O_DIRECT as fio's
//! async engines do. Invariants: an op's latency runs from just before it is issued to just
//! after its completion is seen; every op issued before the deadline is completed and counted;
//! the run's elapsed time ends at the last completion (and after the final flush, when asked).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::Rng;

use crate::stats::Recorder;
use crate::target::{AlignedBuffer, BlockTarget};
use crate::BenchError;

/// Most operations a workload may keep in flight (threads, or io_uring entries).
pub const QUEUE_DEPTH_MAX: usize = 1024;
/// Largest block a workload may use.
pub const BLOCK_SIZE_MAX_BYTES: usize = 16 * 1024 * 1024;
/// How often the live progress line is redrawn.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(1);

/// Order in which offsets are visited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessPattern {
    /// Consecutive blocks, wrapping at the end of the region (shared cursor across workers).
    Sequential,
    /// Uniformly random block-aligned offsets.
    Random,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Workload {
    pub block_size_bytes: usize,
    pub queue_depth: usize,
    /// Share of operations that are reads, 0–100.
    pub read_percent: u8,
    pub pattern: AccessPattern,
    /// Each write must be durable before it counts as complete (O_DSYNC/FUA or a sync after it).
    pub durable_writes: bool,
    /// Bytes of the target the workload touches (from offset 0).
    pub region_bytes: u64,
    pub runtime: Duration,
    pub ops_max: Option<u64>,
    /// Flush the target once at the end, inside the measured time (buffered sequential writes).
    pub flush_at_end: bool,
    /// Shown on the progress line.
    pub label: String,
}

impl Workload {
    /// Checks the bounds every engine relies on.
    pub fn validate(&self, target_size_bytes: u64) -> Result<(), BenchError> {
        let invalid = |what, reason: String| Err(BenchError::Invalid { what, reason });
        if self.block_size_bytes == 0
            || self.block_size_bytes > BLOCK_SIZE_MAX_BYTES
            || !self.block_size_bytes.is_multiple_of(512)
        {
            return invalid(
                "block size",
                format!(
                    "{} bytes; must be a multiple of 512 up to {BLOCK_SIZE_MAX_BYTES}",
                    self.block_size_bytes
                ),
            );
        }
        if self.queue_depth == 0 || self.queue_depth > QUEUE_DEPTH_MAX {
            return invalid(
                "queue depth",
                format!("{}; must be 1..={QUEUE_DEPTH_MAX}", self.queue_depth),
            );
        }
        if self.read_percent > 100 {
            return invalid("read percent", format!("{}", self.read_percent));
        }
        if self.region_bytes < self.block_size_bytes as u64 || self.region_bytes > target_size_bytes
        {
            return invalid(
                "region",
                format!(
                    "{} bytes; the target has {target_size_bytes} and a block is {}",
                    self.region_bytes, self.block_size_bytes
                ),
            );
        }
        Ok(())
    }

    fn blocks(&self) -> u64 {
        self.region_bytes / self.block_size_bytes as u64
    }
}

/// What an engine measured.
#[derive(Debug)]
pub struct RawRun {
    pub reads: Recorder,
    pub writes: Recorder,
    pub elapsed: Duration,
    /// "io_uring" or "threads (N × pread/pwrite)".
    pub engine: String,
}

/// Counters shared with the progress line.
#[derive(Debug, Default)]
pub struct Progress {
    ops: AtomicU64,
    bytes: AtomicU64,
}

impl Progress {
    fn add(&self, bytes: u64) {
        self.ops.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Redraws a one-line status on stderr every second while `done` is false — only when stderr
/// is a terminal, so logs and pipes stay clean.
fn show_progress(label: &str, runtime: Duration, progress: &Progress, done: &AtomicBool) {
    if !std::io::stderr().is_terminal() {
        return;
    }
    let start = Instant::now();
    let mut last_ops = 0;
    let mut last_bytes = 0;
    let mut last_time = start;
    let mut drawn = false;
    while !done.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        let now = Instant::now();
        if now.duration_since(last_time) < PROGRESS_INTERVAL {
            continue;
        }
        let ops = progress.ops.load(Ordering::Relaxed);
        let bytes = progress.bytes.load(Ordering::Relaxed);
        let seconds = now.duration_since(last_time).as_secs_f64();
        eprint!(
            "\r\x1b[2K{label}: {:.0}/{:.0} s  {ops} ops  {:.0} IOPS  {:.1} MiB/s",
            now.duration_since(start).as_secs_f64(),
            runtime.as_secs_f64(),
            (ops - last_ops) as f64 / seconds,
            (bytes - last_bytes) as f64 / seconds / 1048576.0
        );
        drawn = true;
        last_ops = ops;
        last_bytes = bytes;
        last_time = now;
    }
    if drawn {
        eprint!("\r\x1b[2K");
    }
}

/// Runs `workload` with one thread per outstanding operation.
pub fn run_threads(target: &dyn BlockTarget, workload: &Workload) -> Result<RawRun, BenchError> {
    workload.validate(target.size_bytes())?;
    let cursor = AtomicU64::new(0);
    let issued = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let done = AtomicBool::new(false);
    let progress = Progress::default();
    let blocks = workload.blocks();
    let block_size = workload.block_size_bytes as u64;
    let start = Instant::now();
    let deadline = start + workload.runtime;

    let outcome = std::thread::scope(|scope| {
        let progress_thread =
            scope.spawn(|| show_progress(&workload.label, workload.runtime, &progress, &done));
        let workers: Vec<_> = (0..workload.queue_depth)
            .map(|_| {
                scope.spawn(|| -> Result<(Recorder, Recorder), BenchError> {
                    let mut reads = Recorder::new();
                    let mut writes = Recorder::new();
                    let mut buffer = AlignedBuffer::random(workload.block_size_bytes);
                    let mut random = rand::thread_rng();
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        if let Some(ops_max) = workload.ops_max {
                            if issued.fetch_add(1, Ordering::Relaxed) >= ops_max {
                                break;
                            }
                        }
                        let block = match workload.pattern {
                            AccessPattern::Sequential => {
                                cursor.fetch_add(1, Ordering::Relaxed) % blocks
                            }
                            AccessPattern::Random => random.gen_range(0..blocks),
                        };
                        let offset = block * block_size;
                        let is_read = random.gen_range(0..100u8) < workload.read_percent;
                        let began = Instant::now();
                        let result = if is_read {
                            target.read_at(buffer.as_mut_slice(), offset)
                        } else {
                            target.write_at(buffer.as_slice(), offset, workload.durable_writes)
                        };
                        let latency = began.elapsed();
                        if let Err(error) = result {
                            stop.store(true, Ordering::Relaxed);
                            return Err(error);
                        }
                        if is_read {
                            reads.record(latency, block_size);
                        } else {
                            writes.record(latency, block_size);
                        }
                        progress.add(block_size);
                    }
                    Ok((reads, writes))
                })
            })
            .collect();
        let mut reads = Recorder::new();
        let mut writes = Recorder::new();
        let mut first_error = None;
        for worker in workers {
            match worker.join() {
                Ok(Ok((worker_reads, worker_writes))) => {
                    reads.merge(&worker_reads)?;
                    writes.merge(&worker_writes)?;
                }
                Ok(Err(error)) => {
                    first_error.get_or_insert(error);
                }
                Err(_) => {
                    first_error.get_or_insert(BenchError::Internal {
                        reason: "a benchmark worker thread panicked".to_string(),
                    });
                }
            }
        }
        let flushed = if first_error.is_none() && workload.flush_at_end {
            target.flush()
        } else {
            Ok(())
        };
        let elapsed = start.elapsed();
        done.store(true, Ordering::Relaxed);
        let _ = progress_thread.join();
        if let Some(error) = first_error {
            return Err(error);
        }
        flushed?;
        Ok((reads, writes, elapsed))
    });
    let (reads, writes, elapsed) = outcome?;
    Ok(RawRun {
        reads,
        writes,
        elapsed,
        engine: format!("threads ({} × pread/pwrite)", workload.queue_depth),
    })
}

/// Runs `workload` on a file with io_uring, keeping `queue_depth` ops in flight from one thread.
#[cfg(target_os = "linux")]
pub fn run_uring(
    target: &crate::target::FileTarget,
    workload: &Workload,
) -> Result<RawRun, BenchError> {
    use io_uring::{opcode, types, IoUring};

    workload.validate(target.size_bytes())?;
    if workload.durable_writes && !target.is_dsync() {
        return Err(BenchError::Invalid {
            what: "engine",
            reason: "io_uring runs durable writes only with O_DSYNC; use the threads engine for \
                     fdatasync after each write"
                .to_string(),
        });
    }
    let entries = (workload.queue_depth as u32).next_power_of_two();
    // One thread submits and reaps: let the kernel run completion work only when we wait
    // (DEFER_TASKRUN), which saves interrupts and wake-ups; older kernels refuse the flags.
    let mut ring = IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(entries)
        .or_else(|_| IoUring::new(entries))
        .map_err(|error| BenchError::io("io_uring_setup for", target.path(), error))?;
    struct Slot {
        buffer: AlignedBuffer,
        began: Instant,
        is_read: bool,
    }
    let mut slots: Vec<Slot> = (0..workload.queue_depth)
        .map(|_| Slot {
            buffer: AlignedBuffer::random(workload.block_size_bytes),
            began: Instant::now(),
            is_read: false,
        })
        .collect();
    let mut free: Vec<usize> = (0..workload.queue_depth).rev().collect();
    let mut reads = Recorder::new();
    let mut writes = Recorder::new();
    let progress = Progress::default();
    let done = AtomicBool::new(false);
    let blocks = workload.blocks();
    let block_size = workload.block_size_bytes as u64;
    let length = workload.block_size_bytes as u32;
    let fd = types::Fd(target.raw_fd());
    let mut random = rand::thread_rng();
    let mut cursor = 0u64;
    let mut issued = 0u64;
    let mut in_flight = 0usize;
    let mut completions: Vec<(u64, i32)> = Vec::with_capacity(workload.queue_depth);
    let start = Instant::now();
    let deadline = start + workload.runtime;

    let outcome = std::thread::scope(|scope| -> Result<Duration, BenchError> {
        let progress_thread =
            scope.spawn(|| show_progress(&workload.label, workload.runtime, &progress, &done));
        let result = (|| -> Result<(), BenchError> {
            loop {
                let may_issue = |issued: u64| {
                    Instant::now() < deadline && workload.ops_max.is_none_or(|max| issued < max)
                };
                while let Some(slot_index) = free.last().copied() {
                    if !may_issue(issued) {
                        break;
                    }
                    free.pop();
                    let block = match workload.pattern {
                        AccessPattern::Sequential => {
                            let block = cursor % blocks;
                            cursor += 1;
                            block
                        }
                        AccessPattern::Random => random.gen_range(0..blocks),
                    };
                    let offset = block * block_size;
                    let is_read = random.gen_range(0..100u8) < workload.read_percent;
                    let slot = &mut slots[slot_index];
                    let pointer = slot.buffer.as_mut_ptr();
                    let entry = if is_read {
                        opcode::Read::new(fd, pointer, length)
                            .offset(offset)
                            .build()
                    } else {
                        opcode::Write::new(fd, pointer, length)
                            .offset(offset)
                            .build()
                    }
                    .user_data(slot_index as u64);
                    slot.is_read = is_read;
                    slot.began = Instant::now();
                    // SAFETY: the buffer belongs to the slot, which stays out of `free` (so is
                    // neither reused nor dropped) until this entry's completion is reaped.
                    unsafe { ring.submission().push(&entry) }.map_err(|_| {
                        BenchError::Internal {
                            reason: "io_uring submission queue full despite queue-depth bound"
                                .to_string(),
                        }
                    })?;
                    in_flight += 1;
                    issued += 1;
                    // Submit each op as soon as it is timed (as fio does by default): in a
                    // batch, the kernel issues the entries one after another inline, so the
                    // last op's latency would include issuing all the others (measured: p50
                    // +12 % at queue depth 64 on virtio).
                    ring.submit().map_err(|error| {
                        BenchError::io("io_uring_enter on", target.path(), error)
                    })?;
                }
                if in_flight == 0 {
                    return Ok(());
                }
                ring.submit_and_wait(1)
                    .map_err(|error| BenchError::io("io_uring_enter on", target.path(), error))?;
                completions.clear();
                completions.extend(
                    ring.completion()
                        .map(|entry| (entry.user_data(), entry.result())),
                );
                for &(user_data, result) in &completions {
                    let slot_index = user_data as usize;
                    let slot = &slots[slot_index];
                    let latency = slot.began.elapsed();
                    in_flight -= 1;
                    free.push(slot_index);
                    if result < 0 {
                        return Err(BenchError::io(
                            if slot.is_read {
                                "io_uring read"
                            } else {
                                "io_uring write"
                            },
                            target.path(),
                            std::io::Error::from_raw_os_error(-result),
                        ));
                    }
                    if result as u32 != length {
                        return Err(BenchError::Internal {
                            reason: format!("short io_uring transfer: {result} of {length} bytes"),
                        });
                    }
                    if slot.is_read {
                        reads.record(latency, block_size);
                    } else {
                        writes.record(latency, block_size);
                    }
                    progress.add(block_size);
                }
            }
        })();
        let result = result.and_then(|()| {
            if workload.flush_at_end {
                target.flush()?;
            }
            Ok(start.elapsed())
        });
        done.store(true, Ordering::Relaxed);
        let _ = progress_thread.join();
        result
    });
    // On error, operations may still be in flight in the kernel into our buffers, and dropping
    // the ring does not wait for them: leak the buffers rather than free memory the kernel may
    // still write to.
    let elapsed = match outcome {
        Ok(elapsed) => elapsed,
        Err(error) => {
            std::mem::forget(slots);
            return Err(error);
        }
    };
    Ok(RawRun {
        reads,
        writes,
        elapsed,
        engine: format!("io_uring (queue depth {})", workload.queue_depth),
    })
}
