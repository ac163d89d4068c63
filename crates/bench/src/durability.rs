//! A diskchecker-style durability check: `write` fills a target with self-describing records
//! and logs every write it saw acknowledged as durable; after the target is crashed (kill -9 of
//! the server, a power cut), `verify` reads every logged record back and lists each one that is
//! missing or corrupt.
//!
//! Record layout (one block, `block_size` bytes, big-endian):
//! `magic "KEELDUR1" | run id u64 | sequence u64 | offset u64 | block size u32 | fill … | crc32c`
//! where fill is derived from (run id, sequence) and the CRC32C covers everything before it.
//!
//! The log is a local file, or `tcp://HOST:PORT` of a `durability log-server` on another
//! machine (which answers each batch only after its own fdatasync), so a power cut of the
//! machine under test cannot take the log with it.
//!
//! Invariants: a write is logged only after the target acknowledged it as durable (O_DSYNC/FUA
//! write returned, or fdatasync/NBD FLUSH returned after the write completed); the log line is
//! fdatasync'ed before more writes are acknowledged from that writer; writers own disjoint
//! offsets and have one write per offset in flight, so for every offset the newest logged
//! sequence is the one the target must hold (or a newer, unacknowledged one).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::Rng;

use crate::nbd::NbdClient;
use crate::target::{
    sync_parent_directory, AlignedBuffer, BlockTarget, FileOptions, FileTarget, SyncMethod,
    TargetSpec,
};
use crate::BenchError;

const RECORD_MAGIC: &[u8; 8] = b"KEELDUR1";
/// Bytes of header before the fill (magic, run id, sequence, offset, block size).
const RECORD_HEADER_BYTES: usize = 36;
/// Smallest record: header plus checksum, rounded to a sector.
pub const RECORD_MIN_BYTES: usize = 512;
/// First line of every log.
const LOG_HEADER_PREFIX: &str = "keel-durability-log v1";
/// Most writers (threads) a durability run may use.
pub const WRITERS_MAX: usize = 256;
/// Most writes one writer acknowledges per flush.
pub const WRITES_PER_FLUSH_MAX: usize = 1024;
/// Line that ends a batch sent to a log server, and the server's answer once it is durable.
const LOG_BATCH_END: &str = ".\n";
const LOG_BATCH_DURABLE: &str = "ok\n";
/// Longest line a log server accepts.
const LOG_LINE_MAX_BYTES: u64 = 4096;
/// Largest batch a log server buffers before syncing it.
const LOG_BATCH_MAX_BYTES: usize = 1024 * 1024;
/// How long a writer waits for the log server's "ok".
const LOG_REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// Most findings printed in full (all are counted).
const FINDINGS_SHOWN_MAX: usize = 20;

/// Options of `durability write`.
#[derive(Clone, Debug)]
pub struct WriteOptions {
    pub target: String,
    pub log: PathBuf,
    /// Region of the target to use (from offset 0).
    pub size_bytes: u64,
    pub block_size_bytes: usize,
    pub writers: usize,
    /// Writes each writer makes before it flushes and acknowledges them (with `fdatasync`).
    pub writes_per_flush: usize,
    pub sync_method: SyncMethod,
    pub runtime: Duration,
    pub writes_max: Option<u64>,
}

/// What `durability write` did.
#[derive(Clone, Debug)]
pub struct WriteSummary {
    pub run_id: u64,
    pub issued: u64,
    pub acknowledged: u64,
    /// Why it stopped: "time limit", "write limit", or the target's error (expected after a crash).
    pub stopped_by: String,
    pub target_failed: bool,
    /// What the storage probe found under a local target or log (tmpfs, volatile cache).
    pub warnings: Vec<String>,
}

/// Options of `durability verify`.
#[derive(Clone, Debug)]
pub struct VerifyOptions {
    pub target: String,
    pub log: PathBuf,
}

/// One acknowledged write that did not survive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub offset: u64,
    pub acknowledged_sequence: u64,
    pub problem: String,
}

/// What `durability verify` found.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    /// Acknowledged writes in the log.
    pub acknowledged_writes: u64,
    /// Distinct offsets checked (the newest acknowledged write of each).
    pub offsets_checked: u64,
    /// Offsets holding a newer, unacknowledged write (allowed).
    pub newer_than_acknowledged: u64,
    pub missing: Vec<Finding>,
    pub corrupt: Vec<Finding>,
}

impl VerifyReport {
    pub fn passed(&self) -> bool {
        self.missing.is_empty() && self.corrupt.is_empty()
    }

    /// The report for a terminal, ending in PASS or FAIL.
    pub fn render_text(&self) -> String {
        let mut text = format!(
            "{} acknowledged writes in the log, {} offsets checked, {} hold a newer \
             unacknowledged write\n",
            self.acknowledged_writes, self.offsets_checked, self.newer_than_acknowledged
        );
        for (kind, findings) in [("MISSING", &self.missing), ("CORRUPT", &self.corrupt)] {
            for finding in findings.iter().take(FINDINGS_SHOWN_MAX) {
                text.push_str(&format!(
                    "  {kind} offset {} (acknowledged sequence {}): {}\n",
                    finding.offset, finding.acknowledged_sequence, finding.problem
                ));
            }
            if findings.len() > FINDINGS_SHOWN_MAX {
                text.push_str(&format!(
                    "  … and {} more {kind}\n",
                    findings.len() - FINDINGS_SHOWN_MAX
                ));
            }
        }
        if self.passed() {
            text.push_str("PASS: every acknowledged write survived\n");
        } else {
            text.push_str(&format!(
                "FAIL: {} acknowledged writes missing, {} corrupt\n",
                self.missing.len(),
                self.corrupt.len()
            ));
        }
        text
    }
}

/// Deterministic fill for a record, so corruption anywhere in the block is caught.
fn fill(run_id: u64, sequence: u64, bytes: &mut [u8]) {
    // xorshift64*, seeded from the record identity (never zero).
    let mut state = run_id ^ sequence.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in bytes.chunks_mut(8) {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let value = state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        chunk.copy_from_slice(&value[..chunk.len()]);
    }
}

/// Builds the record for (run, sequence, offset) into `block`.
pub fn encode_record(run_id: u64, sequence: u64, offset: u64, block: &mut [u8]) {
    let length = block.len();
    assert!(
        length >= RECORD_MIN_BYTES,
        "record blocks are at least {RECORD_MIN_BYTES} bytes"
    );
    block[0..8].copy_from_slice(RECORD_MAGIC);
    block[8..16].copy_from_slice(&run_id.to_be_bytes());
    block[16..24].copy_from_slice(&sequence.to_be_bytes());
    block[24..32].copy_from_slice(&offset.to_be_bytes());
    block[32..36].copy_from_slice(&(length as u32).to_be_bytes());
    fill(
        run_id,
        sequence,
        &mut block[RECORD_HEADER_BYTES..length - 4],
    );
    let checksum = crc_fast::crc32_iscsi(&block[..length - 4]);
    block[length - 4..].copy_from_slice(&checksum.to_be_bytes());
}

/// What a block read back holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decoded {
    /// A valid record of this run.
    Record { sequence: u64, offset: u64 },
    /// No record (never written, zeroes, another run's or foreign data).
    Absent(String),
    /// Looks like a record but fails its checksum or names another offset.
    Corrupt(String),
}

/// Decodes a block read back from `offset` for run `run_id`.
pub fn decode_record(run_id: u64, offset: u64, block: &[u8]) -> Decoded {
    let length = block.len();
    let read_u64 = |at: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&block[at..at + 8]);
        u64::from_be_bytes(bytes)
    };
    if length < RECORD_MIN_BYTES || &block[0..8] != RECORD_MAGIC {
        let zeroes = block.iter().all(|&byte| byte == 0);
        return Decoded::Absent(if zeroes {
            "block reads as zeroes".to_string()
        } else {
            "no record here (old or foreign data)".to_string()
        });
    }
    let mut stored = [0u8; 4];
    stored.copy_from_slice(&block[length - 4..]);
    if crc_fast::crc32_iscsi(&block[..length - 4]) != u32::from_be_bytes(stored) {
        return Decoded::Corrupt("record fails its CRC32C (torn or corrupted block)".to_string());
    }
    let record_run = read_u64(8);
    let sequence = read_u64(16);
    let record_offset = read_u64(24);
    if record_run != run_id {
        return Decoded::Absent(format!("record of another run ({record_run:#x})"));
    }
    if record_offset != offset {
        return Decoded::Corrupt(format!(
            "record for offset {record_offset} found at offset {offset} (misdirected write)"
        ));
    }
    Decoded::Record {
        sequence,
        offset: record_offset,
    }
}

fn open_target(
    target: &str,
    sync_method: SyncMethod,
    size_bytes: Option<u64>,
) -> Result<Box<dyn BlockTarget>, BenchError> {
    match TargetSpec::parse(target)? {
        TargetSpec::Path(path) => match size_bytes {
            Some(size_bytes) => Ok(Box::new(FileTarget::open(
                &path,
                FileOptions {
                    direct: false,
                    sync_method,
                    size_bytes,
                },
            )?)),
            None => Ok(Box::new(FileTarget::open_read_only(&path)?)),
        },
        TargetSpec::Nbd { address, export } => Ok(Box::new(NbdClient::connect(
            &address,
            &export,
            sync_method,
        )?)),
        TargetSpec::S3 { .. } => Err(BenchError::Target {
            target: target.to_string(),
            reason: "the durability check runs on block targets (file, device, nbd://)".to_string(),
        }),
    }
}

/// Where acknowledged writes are recorded: a local file, or a log server over TCP.
enum Sink {
    File(File),
    Tcp {
        stream: TcpStream,
        replies: BufReader<TcpStream>,
    },
}

/// The acknowledgement log: append-only lines, each batch durable (fdatasync'ed here, or by the
/// log server before it answers "ok") before the writer acknowledges more.
struct Log {
    sink: Sink,
    path: PathBuf,
}

impl Log {
    /// Creates the log at `path`, or connects to `tcp://HOST:PORT` (a `log-server`).
    fn create(path: &Path, header: &str) -> Result<Self, BenchError> {
        if let Some(address) = path.to_str().and_then(|text| text.strip_prefix("tcp://")) {
            let failure =
                |error: std::io::Error| BenchError::io("connect to log server", path, error);
            let stream = TcpStream::connect(address).map_err(failure)?;
            stream.set_nodelay(true).map_err(failure)?;
            stream
                .set_read_timeout(Some(LOG_REPLY_TIMEOUT))
                .map_err(failure)?;
            let replies = BufReader::new(stream.try_clone().map_err(failure)?);
            let mut log = Self {
                sink: Sink::Tcp { stream, replies },
                path: path.to_path_buf(),
            };
            log.send(header)?;
            return Ok(log);
        }
        let mut file =
            File::create(path).map_err(|error| BenchError::io("create log", path, error))?;
        file.write_all(header.as_bytes())
            .and_then(|()| file.sync_all())
            .map_err(|error| BenchError::io("write log", path, error))?;
        sync_parent_directory(path)?;
        Ok(Self {
            sink: Sink::File(file),
            path: path.to_path_buf(),
        })
    }

    /// Appends acknowledged (sequence, offset) pairs and makes them durable.
    fn append(&mut self, acknowledged: &[(u64, u64)]) -> Result<(), BenchError> {
        let mut text = String::with_capacity(acknowledged.len() * 24);
        for (sequence, offset) in acknowledged {
            text.push_str(&format!("{sequence} {offset}\n"));
        }
        self.send(&text)
    }

    /// Makes `text` (whole lines) durable in the log.
    fn send(&mut self, text: &str) -> Result<(), BenchError> {
        let failure = |error: std::io::Error| BenchError::io("append to log", &self.path, error);
        match &mut self.sink {
            Sink::File(file) => file
                .write_all(text.as_bytes())
                .and_then(|()| file.sync_data())
                .map_err(failure),
            Sink::Tcp { stream, replies } => {
                stream.write_all(text.as_bytes()).map_err(failure)?;
                stream
                    .write_all(LOG_BATCH_END.as_bytes())
                    .map_err(failure)?;
                let mut reply = String::new();
                replies.read_line(&mut reply).map_err(failure)?;
                if reply != LOG_BATCH_DURABLE {
                    return Err(failure(std::io::Error::other(format!(
                        "log server answered {reply:?} instead of {LOG_BATCH_DURABLE:?}"
                    ))));
                }
                Ok(())
            }
        }
    }
}

/// The log server (`durability log-server`): takes one writer's connection on `listener`,
/// appends each batch of lines it sends to `path` and answers "ok" only after fdatasync
/// returned, so the log can live on another machine than the target. Returns the number of
/// lines made durable (header included) when the writer disconnects. A batch cut off by the
/// writer's crash was never acknowledged, and is dropped.
pub fn serve_log(listener: &TcpListener, path: &Path) -> Result<u64, BenchError> {
    let failure = |error: std::io::Error| BenchError::io("serve log", path, error);
    let (stream, _) = listener.accept().map_err(failure)?;
    let mut file = File::create(path).map_err(|error| BenchError::io("create log", path, error))?;
    sync_parent_directory(path)?;
    let mut reader = BufReader::new(stream.try_clone().map_err(failure)?);
    let mut writer = stream;
    let mut batch = String::new();
    let mut batch_lines = 0u64;
    let mut lines = 0u64;
    let mut line = String::new();
    loop {
        line.clear();
        let read = (&mut reader)
            .take(LOG_LINE_MAX_BYTES)
            .read_line(&mut line)
            .map_err(failure)?;
        if read == 0 || !line.ends_with('\n') {
            // Disconnected (or a line too long or torn): the open batch was never acknowledged.
            return Ok(lines);
        }
        if line == LOG_BATCH_END {
            file.write_all(batch.as_bytes())
                .and_then(|()| file.sync_data())
                .map_err(failure)?;
            writer
                .write_all(LOG_BATCH_DURABLE.as_bytes())
                .map_err(failure)?;
            lines += batch_lines;
            batch.clear();
            batch_lines = 0;
            continue;
        }
        if batch.len() + line.len() > LOG_BATCH_MAX_BYTES {
            return Err(failure(std::io::Error::other(format!(
                "a batch exceeded {LOG_BATCH_MAX_BYTES} bytes"
            ))));
        }
        batch.push_str(&line);
        batch_lines += 1;
    }
}

/// Writes records until the time or write limit, or until the target fails (as it will when it
/// is crashed under us), logging every acknowledged write.
pub fn write(options: &WriteOptions) -> Result<WriteSummary, BenchError> {
    let invalid = |what, reason: String| BenchError::Invalid { what, reason };
    if options.block_size_bytes < RECORD_MIN_BYTES || !options.block_size_bytes.is_multiple_of(512)
    {
        return Err(invalid(
            "block size",
            format!(
                "{}; must be a multiple of 512, at least {RECORD_MIN_BYTES}",
                options.block_size_bytes
            ),
        ));
    }
    if options.writers == 0 || options.writers > WRITERS_MAX {
        return Err(invalid(
            "writers",
            format!("{}; must be 1..={WRITERS_MAX}", options.writers),
        ));
    }
    if options.writes_per_flush == 0 || options.writes_per_flush > WRITES_PER_FLUSH_MAX {
        return Err(invalid(
            "writes per flush",
            format!(
                "{}; must be 1..={WRITES_PER_FLUSH_MAX}",
                options.writes_per_flush
            ),
        ));
    }
    let mut warnings = Vec::new();
    if let TargetSpec::Path(path) = TargetSpec::parse(&options.target)? {
        warnings.extend(crate::fsprobe::probe(&path)?.warnings);
    }
    if !options.log.to_string_lossy().starts_with("tcp://") {
        let log_probe = crate::fsprobe::probe(&options.log)?;
        if log_probe.memory_backed {
            warnings.push(format!(
                "the log {} is in memory: a power cut loses it with the evidence",
                options.log.display()
            ));
        }
    }
    let target = open_target(
        &options.target,
        options.sync_method,
        Some(options.size_bytes),
    )?;
    let block_size = options.block_size_bytes as u64;
    let blocks = options.size_bytes.min(target.size_bytes()) / block_size;
    let blocks_per_writer = blocks / options.writers as u64;
    if blocks_per_writer < options.writes_per_flush as u64 {
        return Err(invalid(
            "size",
            format!(
                "{} blocks of {block_size} bytes is too few for {} writers × {} writes per flush",
                blocks, options.writers, options.writes_per_flush
            ),
        ));
    }
    let run_id: u64 = rand::thread_rng().gen::<u64>() | 1;
    let header = format!(
        "{LOG_HEADER_PREFIX} run={run_id:016x} block_size={block_size} target={}\n",
        options.target
    );
    let log = Mutex::new(Log::create(&options.log, &header)?);
    let next_sequence = AtomicU64::new(1);
    let issued = AtomicU64::new(0);
    let acknowledged = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let deadline = Instant::now() + options.runtime;
    let per_write_durable = options.sync_method == SyncMethod::Dsync;
    let target = target.as_ref();

    let errors: Vec<BenchError> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..options.writers as u64)
            .map(|writer| {
                let log = &log;
                let (next_sequence, issued, acknowledged, stop) =
                    (&next_sequence, &issued, &acknowledged, &stop);
                scope.spawn(move || -> Result<(), BenchError> {
                    let mut random = rand::thread_rng();
                    let mut block = AlignedBuffer::new(options.block_size_bytes);
                    let mut batch: Vec<(u64, u64)> = Vec::with_capacity(options.writes_per_flush);
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        batch.clear();
                        while batch.len() < options.writes_per_flush {
                            if let Some(max) = options.writes_max {
                                if issued.fetch_add(1, Ordering::Relaxed) >= max {
                                    break;
                                }
                            } else {
                                issued.fetch_add(1, Ordering::Relaxed);
                            }
                            // This writer's blocks are writer, writer + writers, …; one write
                            // per offset per batch, so no two in-flight writes share an offset.
                            let offset = loop {
                                let slot = random.gen_range(0..blocks_per_writer);
                                let offset = (slot * options.writers as u64 + writer) * block_size;
                                if !batch.iter().any(|&(_, taken)| taken == offset) {
                                    break offset;
                                }
                            };
                            let sequence = next_sequence.fetch_add(1, Ordering::Relaxed);
                            encode_record(run_id, sequence, offset, block.as_mut_slice());
                            if let Err(error) =
                                target.write_at(block.as_slice(), offset, per_write_durable)
                            {
                                stop.store(true, Ordering::Relaxed);
                                return Err(error);
                            }
                            batch.push((sequence, offset));
                        }
                        if batch.is_empty() {
                            break;
                        }
                        if !per_write_durable {
                            if let Err(error) = target.flush() {
                                stop.store(true, Ordering::Relaxed);
                                return Err(error);
                            }
                        }
                        // Durable now: log before acknowledging anything more.
                        let mut log = log
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        log.append(&batch)?;
                        acknowledged.fetch_add(batch.len() as u64, Ordering::Relaxed);
                        if batch.len() < options.writes_per_flush {
                            break;
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .filter_map(|worker| match worker.join() {
                Ok(Ok(())) => None,
                Ok(Err(error)) => Some(error),
                Err(_) => Some(BenchError::Internal {
                    reason: "a durability writer thread panicked".to_string(),
                }),
            })
            .collect()
    });
    // A failing log is our problem, not the target's: report it as an error.
    if let Some(position) = errors.iter().position(|error| {
        matches!(
            error,
            BenchError::Io {
                context: "append to log",
                ..
            }
        )
    }) {
        let mut errors = errors;
        return Err(errors.swap_remove(position));
    }
    let issued_count = issued.load(Ordering::Relaxed);
    let (stopped_by, target_failed) = match errors.first() {
        Some(error) => (error.to_string(), true),
        None if options.writes_max.is_some_and(|max| issued_count >= max) => {
            ("write limit".to_string(), false)
        }
        None => ("time limit".to_string(), false),
    };
    Ok(WriteSummary {
        run_id,
        issued: issued_count.min(options.writes_max.unwrap_or(u64::MAX)),
        acknowledged: acknowledged.load(Ordering::Relaxed),
        stopped_by,
        target_failed,
        warnings,
    })
}

/// The parsed log: run id, block size, and the newest acknowledged sequence per offset.
struct ParsedLog {
    run_id: u64,
    block_size_bytes: usize,
    newest: HashMap<u64, u64>,
    entries: u64,
}

fn parse_log(path: &Path) -> Result<ParsedLog, BenchError> {
    let text =
        std::fs::read_to_string(path).map_err(|error| BenchError::io("read log", path, error))?;
    let failure = |line: usize, reason: String| BenchError::Log {
        path: path.to_path_buf(),
        line,
        reason,
    };
    let mut lines = text.split_inclusive('\n').enumerate();
    let (_, header) = lines
        .next()
        .ok_or_else(|| failure(1, "empty log".to_string()))?;
    if !header.starts_with(LOG_HEADER_PREFIX) {
        return Err(failure(
            1,
            format!("not a durability log (expected {LOG_HEADER_PREFIX:?})"),
        ));
    }
    let field = |name: &str| {
        header
            .split_whitespace()
            .find_map(|word| word.strip_prefix(name))
            .ok_or_else(|| failure(1, format!("header lacks {name}")))
    };
    let run_id = u64::from_str_radix(field("run=")?, 16)
        .map_err(|error| failure(1, format!("run id: {error}")))?;
    let block_size_bytes: usize = field("block_size=")?
        .parse()
        .map_err(|error| failure(1, format!("block size: {error}")))?;
    let mut newest = HashMap::new();
    let mut entries = 0;
    for (index, line) in lines {
        // A line without its newline was torn by the crash before its fdatasync returned, so
        // it was never acknowledged: ignore it.
        let Some(line) = line.strip_suffix('\n') else {
            break;
        };
        let mut words = line.split_whitespace();
        let (Some(sequence), Some(offset), None) = (words.next(), words.next(), words.next())
        else {
            return Err(failure(
                index + 1,
                format!("expected `SEQUENCE OFFSET`, got {line:?}"),
            ));
        };
        let sequence: u64 = sequence
            .parse()
            .map_err(|error| failure(index + 1, format!("sequence: {error}")))?;
        let offset: u64 = offset
            .parse()
            .map_err(|error| failure(index + 1, format!("offset: {error}")))?;
        let slot = newest.entry(offset).or_insert(sequence);
        *slot = (*slot).max(sequence);
        entries += 1;
    }
    Ok(ParsedLog {
        run_id,
        block_size_bytes,
        newest,
        entries,
    })
}

/// Reads back every offset in the log and checks it holds its newest acknowledged write.
pub fn verify(options: &VerifyOptions) -> Result<VerifyReport, BenchError> {
    let log = parse_log(&options.log)?;
    let target = open_target(&options.target, SyncMethod::Fdatasync, None)?;
    let mut offsets: Vec<(u64, u64)> = log
        .newest
        .iter()
        .map(|(&offset, &sequence)| (offset, sequence))
        .collect();
    offsets.sort_unstable();
    let mut report = VerifyReport {
        acknowledged_writes: log.entries,
        offsets_checked: offsets.len() as u64,
        ..VerifyReport::default()
    };
    let mut block = AlignedBuffer::new(log.block_size_bytes);
    for (offset, acknowledged_sequence) in offsets {
        let finding = |problem: String| Finding {
            offset,
            acknowledged_sequence,
            problem,
        };
        if offset + log.block_size_bytes as u64 > target.size_bytes() {
            report.missing.push(finding(format!(
                "beyond the end of the target ({} bytes)",
                target.size_bytes()
            )));
            continue;
        }
        if let Err(error) = target.read_at(block.as_mut_slice(), offset) {
            report
                .missing
                .push(finding(format!("read failed: {error}")));
            continue;
        }
        match decode_record(log.run_id, offset, block.as_slice()) {
            Decoded::Record { sequence, .. } if sequence == acknowledged_sequence => {}
            Decoded::Record { sequence, .. } if sequence > acknowledged_sequence => {
                report.newer_than_acknowledged += 1;
            }
            Decoded::Record { sequence, .. } => report.missing.push(finding(format!(
                "holds older write {sequence}: the acknowledged write was lost"
            ))),
            Decoded::Absent(problem) => report.missing.push(finding(problem)),
            Decoded::Corrupt(problem) => report.corrupt.push(finding(problem)),
        }
    }
    Ok(report)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    // Proves the log parser keeps the newest acknowledged sequence per offset and ignores a
    // last line torn by a crash (no newline: its fdatasync never returned), but rejects junk.
    #[test]
    fn log_parsing_keeps_newest_and_ignores_a_torn_tail() {
        let directory = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = directory.path().join("ack.log");
        let header = format!("{LOG_HEADER_PREFIX} run=00000000000000ab block_size=4096 target=x\n");
        std::fs::write(&path, format!("{header}5 0\n9 4096\n7 0\n12 40")).unwrap();
        let log = parse_log(&path).unwrap();
        assert_eq!(log.run_id, 0xab);
        assert_eq!(log.block_size_bytes, 4096);
        assert_eq!(log.entries, 3);
        assert_eq!(log.newest.get(&0), Some(&7));
        assert_eq!(log.newest.get(&4096), Some(&9));
        assert_eq!(log.newest.len(), 2);
        std::fs::write(&path, format!("{header}5 zero\n")).unwrap();
        assert!(parse_log(&path).is_err());
        std::fs::write(&path, "something else\n").unwrap();
        assert!(parse_log(&path).is_err());
    }

    // Proves a record round-trips, and that a flipped byte anywhere, a wrong offset and a
    // foreign run are each told apart.
    #[test]
    fn records_detect_corruption_misdirection_and_foreign_runs() {
        let mut block = vec![0u8; 4096];
        encode_record(0xABC, 42, 8192, &mut block);
        assert_eq!(
            decode_record(0xABC, 8192, &block),
            Decoded::Record {
                sequence: 42,
                offset: 8192
            }
        );
        assert!(matches!(
            decode_record(0xABC, 4096, &block),
            Decoded::Corrupt(_)
        ));
        assert!(matches!(
            decode_record(0xDEF, 8192, &block),
            Decoded::Absent(_)
        ));
        for position in [40, 2000, 4095] {
            let mut damaged = block.clone();
            damaged[position] ^= 1;
            assert!(
                matches!(decode_record(0xABC, 8192, &damaged), Decoded::Corrupt(_)),
                "flip at {position}"
            );
        }
        assert!(matches!(
            decode_record(0xABC, 0, &[0u8; 4096]),
            Decoded::Absent(_)
        ));
    }
}
