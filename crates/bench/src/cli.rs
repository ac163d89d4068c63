//! The `keel bench …` command line (clap derive) and its dispatch. The `keel` binary embeds
//! [`BenchCommand`] as one subcommand and calls [`run`]; nothing here reads global state.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};

use crate::durability::{self, VerifyOptions, WriteOptions};
use crate::profile::{self, EngineChoice, Profile, RunOptions};
use crate::s3::S3Options;
use crate::target::SyncMethod;
use crate::BenchError;

/// Most seconds one run may last (bounds every load loop).
pub const RUNTIME_MAX_SECONDS: u64 = 24 * 3600;
/// The pgbench driver script, shipped inside the binary.
const PGBENCH_SCRIPT: &str = include_str!("../../../scripts/bench/pgbench.sh");

/// `keel bench`: measure storage honestly, and check that acknowledged writes survive crashes.
#[derive(Args, Debug, Clone)]
pub struct BenchCommand {
    #[command(subcommand)]
    pub action: BenchAction,
}

/// What `keel bench` does.
#[derive(Subcommand, Debug, Clone)]
pub enum BenchAction {
    /// Run one profile against a target (file, block device, nbd://HOST:PORT/EXPORT, s3://BUCKET).
    Run(RunArgs),
    /// Run one profile on two targets alternately (A B A B …) and print the median ratio B/A.
    Compare(CompareArgs),
    /// Turn JSON results into a markdown table and an SVG latency CDF.
    Report(ReportArgs),
    /// Crash-consistency check: write records, crash the target, verify what was acknowledged.
    #[command(subcommand)]
    Durability(DurabilityCommand),
    /// Postgres pgbench on a Keel volume (NBD → nbdfuse → loop → ext4) and on a local directory.
    Pgbench(PgbenchArgs),
    /// Say what the storage under a path guarantees (tmpfs? volatile write cache?).
    Probe(ProbeArgs),
}

/// Workload flags shared by `run` and `compare`.
#[derive(Args, Debug, Clone)]
pub struct ProfileArgs {
    /// The workload.
    #[arg(long, value_enum)]
    pub profile: Profile,
    /// How long each run lasts.
    #[arg(long, default_value_t = 10)]
    pub runtime_seconds: u64,
    /// Region of the target used; a file is created and laid out to this size (e.g. 1GiB, 256M).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub size: u64,
    /// Override the profile's block size (e.g. 4k, 1M).
    #[arg(long, value_parser = parse_size)]
    pub block_size: Option<u64>,
    /// Override the profile's queue depth (operations in flight; S3: concurrent requests).
    #[arg(long)]
    pub queue_depth: Option<usize>,
    /// group-commit: writer counts to run, comma-separated (default 1,8,64).
    #[arg(long, value_delimiter = ',')]
    pub writers: Vec<usize>,
    /// Override the profile's share of reads (0–100).
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub read_percent: Option<u8>,
    /// How durable writes are made durable: dsync = O_DSYNC / NBD FUA (default), fdatasync =
    /// fdatasync / NBD FLUSH after each write.
    #[arg(long, value_enum)]
    pub sync_method: Option<SyncMethod>,
    /// Load generator for files.
    #[arg(long, value_enum, default_value_t = EngineChoice::Auto)]
    pub engine: EngineChoice,
    /// Force O_DIRECT on or off (default: on, except seq-write and group-commit).
    #[arg(long)]
    pub direct: Option<bool>,
    /// Stop after this many operations (even before the runtime ends).
    #[arg(long)]
    pub ops_max: Option<u64>,
    /// NBD: do not write the region once before a profile that reads (thin volumes answer
    /// reads of never-written blocks without touching the disk).
    #[arg(long)]
    pub no_fill: bool,
    #[command(flatten)]
    pub s3: S3Args,
}

/// S3 endpoint and credentials.
#[derive(Args, Debug, Clone)]
pub struct S3Args {
    /// S3 endpoint URL (e.g. http://127.0.0.1:3900).
    #[arg(long, env = "AWS_ENDPOINT_URL")]
    pub s3_endpoint: Option<String>,
    /// Access key id.
    #[arg(long, env = "AWS_ACCESS_KEY_ID", hide_env_values = true)]
    pub s3_access_key: Option<String>,
    /// Secret access key.
    #[arg(long, env = "AWS_SECRET_ACCESS_KEY", hide_env_values = true)]
    pub s3_secret_key: Option<String>,
    /// Region used in the signature.
    #[arg(long, env = "AWS_REGION", default_value = "us-east-1")]
    pub s3_region: String,
}

/// `keel bench run`.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// File, block device, nbd://HOST:PORT/EXPORT or s3://BUCKET.
    #[arg(long)]
    pub target: String,
    #[command(flatten)]
    pub workload: ProfileArgs,
    /// Write the results as JSON to this file ("-" for stdout).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Name for this result in reports (default: the target).
    #[arg(long)]
    pub label: Option<String>,
}

/// `keel bench compare`.
#[derive(Args, Debug, Clone)]
pub struct CompareArgs {
    /// Baseline target.
    pub a: String,
    /// Target compared with the baseline.
    pub b: String,
    /// Rounds (each runs A then B).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    #[command(flatten)]
    pub workload: ProfileArgs,
    /// Write the comparison (with every run) as JSON to this file ("-" for stdout).
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `keel bench report`.
#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// JSON result files written by `run --json` or `compare --json`.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Write the markdown table here (default: stdout).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Write the SVG latency CDF here.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

/// `keel bench durability`.
#[derive(Subcommand, Debug, Clone)]
pub enum DurabilityCommand {
    /// Write checksummed records and log each write acknowledged as durable; crash the target
    /// while it runs (kill -9 the server, or cut the power), then run `verify`.
    Write(DurabilityWriteArgs),
    /// Read back every logged write; prints PASS only when none is missing or corrupt (exit
    /// code 1 on FAIL).
    Verify(DurabilityVerifyArgs),
    /// Keep the acknowledgement log for a writer on another machine: `write --log
    /// tcp://THIS_HOST:PORT`; each batch is fdatasync'ed here before the writer goes on.
    LogServer(DurabilityLogServerArgs),
}

/// `keel bench durability log-server`.
#[derive(Args, Debug, Clone)]
pub struct DurabilityLogServerArgs {
    /// Address to listen on (HOST:PORT).
    #[arg(long)]
    pub listen: String,
    /// Log file to write (on this machine's disk).
    #[arg(long)]
    pub log: PathBuf,
}

/// `keel bench durability write`.
#[derive(Args, Debug, Clone)]
pub struct DurabilityWriteArgs {
    /// File, block device or nbd://HOST:PORT/EXPORT (its contents are overwritten).
    #[arg(long)]
    pub target: String,
    /// Acknowledgement log: a file (keep it on another disk than the target) or
    /// tcp://HOST:PORT of a `durability log-server` (on another machine).
    #[arg(long)]
    pub log: PathBuf,
    /// Region of the target used.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub size: u64,
    /// Record size.
    #[arg(long, default_value = "4KiB", value_parser = parse_size)]
    pub block_size: u64,
    /// Concurrent writers (they own disjoint blocks).
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
    /// Writes each writer makes before one flush acknowledges them all (fdatasync method).
    #[arg(long, default_value_t = 8)]
    pub writes_per_flush: usize,
    /// dsync = every write O_DSYNC / FUA; fdatasync = writes then fdatasync / NBD FLUSH.
    #[arg(long, value_enum, default_value_t = SyncMethod::Fdatasync)]
    pub sync_method: SyncMethod,
    /// Stop after this long if the target has not failed by then.
    #[arg(long, default_value_t = 60)]
    pub runtime_seconds: u64,
    /// Stop after this many writes.
    #[arg(long)]
    pub writes_max: Option<u64>,
}

/// `keel bench durability verify`.
#[derive(Args, Debug, Clone)]
pub struct DurabilityVerifyArgs {
    /// The same target, after the crash and restart.
    #[arg(long)]
    pub target: String,
    /// The log written by `durability write`.
    #[arg(long)]
    pub log: PathBuf,
}

/// `keel bench pgbench` (runs scripts/bench/pgbench.sh, embedded in the binary).
#[derive(Args, Debug, Clone)]
pub struct PgbenchArgs {
    /// Keel volume to put Postgres on (nbd://HOST:PORT/EXPORT); omit to run only locally.
    #[arg(long)]
    pub nbd: Option<String>,
    /// Local directory for the baseline cluster (on a real disk).
    #[arg(long, default_value = "/var/tmp/keel-pgbench")]
    pub local_dir: PathBuf,
    /// pgbench scale factor (-s).
    #[arg(long, default_value_t = 50)]
    pub scale: u32,
    /// Clients (-c).
    #[arg(long, default_value_t = 8)]
    pub clients: u32,
    /// Threads (-j).
    #[arg(long, default_value_t = 2)]
    pub threads: u32,
    /// Seconds per run (-T).
    #[arg(long, default_value_t = 60)]
    pub seconds: u32,
}

/// `keel bench probe`.
#[derive(Args, Debug, Clone)]
pub struct ProbeArgs {
    /// A file, directory or block device.
    pub path: PathBuf,
}

/// Parses sizes like `4096`, `4k`, `4KiB`, `1M`, `1GiB` (binary units).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|character: char| !character.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 4096, 4k, 1MiB)"))?;
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {text:?}")),
    };
    number
        .checked_mul(multiplier)
        .ok_or_else(|| format!("{text:?} is too large"))
}

fn runtime(seconds: u64) -> Result<Duration, BenchError> {
    if seconds == 0 || seconds > RUNTIME_MAX_SECONDS {
        return Err(BenchError::Invalid {
            what: "runtime",
            reason: format!("{seconds} s; must be 1..={RUNTIME_MAX_SECONDS}"),
        });
    }
    Ok(Duration::from_secs(seconds))
}

fn usize_of(value: u64, what: &'static str) -> Result<usize, BenchError> {
    usize::try_from(value).map_err(|_| BenchError::Invalid {
        what,
        reason: format!("{value} does not fit this machine's address size"),
    })
}

impl ProfileArgs {
    /// The run options these flags describe, for `target`.
    pub fn to_options(
        &self,
        target: &str,
        label: Option<String>,
    ) -> Result<RunOptions, BenchError> {
        Ok(RunOptions {
            profile: self.profile,
            target: target.to_string(),
            runtime: runtime(self.runtime_seconds)?,
            size_bytes: self.size,
            block_size_bytes: self
                .block_size
                .map(|bytes| usize_of(bytes, "block size"))
                .transpose()?,
            queue_depth: self.queue_depth,
            writers: self.writers.clone(),
            read_percent: self.read_percent,
            sync_method: self.sync_method,
            engine: self.engine,
            direct: self.direct,
            ops_max: self.ops_max,
            fill_volume: !self.no_fill,
            label,
            s3: S3Options {
                endpoint: self.s3.s3_endpoint.clone(),
                access_key: self.s3.s3_access_key.clone(),
                secret_key: self.s3.s3_secret_key.clone(),
                region: self.s3.s3_region.clone(),
            },
        })
    }
}

/// Prints human text to stdout, or to stderr when stdout carries JSON.
fn say(json_on_stdout: bool, text: &str) {
    if json_on_stdout {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
}

/// Runs a `keel bench` command. Returns an error (so a non-zero exit) when the command fails,
/// including a durability check that FAILs.
pub fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command.action {
        BenchAction::Run(arguments) => {
            let options = arguments
                .workload
                .to_options(&arguments.target, arguments.label.clone())?;
            let results = profile::run(&options)?;
            let json_on_stdout = profile::json_to_stdout(arguments.json.as_ref());
            for result in &results {
                say(json_on_stdout, &profile::render_text(result));
            }
            if let Some(path) = &arguments.json {
                profile::write_json(path, &results)?;
            }
        }
        BenchAction::Compare(arguments) => {
            let options = arguments.workload.to_options(&arguments.a, None)?;
            let comparison =
                crate::compare::compare(&options, &arguments.a, &arguments.b, arguments.rounds)?;
            let json_on_stdout = profile::json_to_stdout(arguments.json.as_ref());
            say(json_on_stdout, &comparison.render_text());
            if let Some(path) = &arguments.json {
                let text = serde_json::to_string_pretty(&comparison)?;
                if json_on_stdout {
                    println!("{text}");
                } else {
                    std::fs::write(path, text + "\n")
                        .map_err(|error| BenchError::io("write JSON", path, error))?;
                }
            }
        }
        BenchAction::Report(arguments) => {
            let mut results = Vec::new();
            for path in &arguments.files {
                results.extend(read_results(path)?);
            }
            let table = crate::report::markdown_table(&results);
            match &arguments.markdown {
                Some(path) => std::fs::write(path, &table)
                    .map_err(|error| BenchError::io("write markdown", path, error))?,
                None => print!("{table}"),
            }
            if let Some(path) = &arguments.svg {
                std::fs::write(path, crate::report::svg_cdf(&results))
                    .map_err(|error| BenchError::io("write SVG", path, error))?;
            }
        }
        BenchAction::Durability(DurabilityCommand::Write(arguments)) => {
            let summary = durability::write(&WriteOptions {
                target: arguments.target.clone(),
                log: arguments.log.clone(),
                size_bytes: arguments.size,
                block_size_bytes: usize_of(arguments.block_size, "block size")?,
                writers: arguments.writers,
                writes_per_flush: arguments.writes_per_flush,
                sync_method: arguments.sync_method,
                runtime: runtime(arguments.runtime_seconds)?,
                writes_max: arguments.writes_max,
            })?;
            println!(
                "run {:016x}: {} writes issued, {} acknowledged as durable and logged to {}; \
                 stopped by {}",
                summary.run_id,
                summary.issued,
                summary.acknowledged,
                arguments.log.display(),
                summary.stopped_by
            );
            for warning in &summary.warnings {
                println!("WARNING: {warning}");
            }
            if summary.target_failed {
                println!(
                    "(the target failed — expected if it was crashed; now restart it and run \
                     `keel bench durability verify`)"
                );
            }
        }
        BenchAction::Durability(DurabilityCommand::Verify(arguments)) => {
            let report = durability::verify(&VerifyOptions {
                target: arguments.target.clone(),
                log: arguments.log.clone(),
            })?;
            print!("{}", report.render_text());
            if !report.passed() {
                return Err(BenchError::DurabilityFailed {
                    missing: report.missing.len() as u64,
                    corrupt: report.corrupt.len() as u64,
                    checked: report.offsets_checked,
                }
                .into());
            }
        }
        BenchAction::Durability(DurabilityCommand::LogServer(arguments)) => {
            let listener = std::net::TcpListener::bind(&arguments.listen)
                .map_err(|error| BenchError::io("listen on", &arguments.listen, error))?;
            let address = listener
                .local_addr()
                .map_err(|error| BenchError::io("listen on", &arguments.listen, error))?;
            println!(
                "log server on {address}: run `keel bench durability write --log tcp://{address} …`"
            );
            let lines = durability::serve_log(&listener, &arguments.log)?;
            println!(
                "writer disconnected; {lines} lines made durable in {}",
                arguments.log.display()
            );
        }
        BenchAction::Pgbench(arguments) => run_pgbench(&arguments)?,
        BenchAction::Probe(arguments) => {
            let probe = crate::fsprobe::probe(&arguments.path)?;
            println!("{}: {}", arguments.path.display(), probe.describe());
            for warning in &probe.warnings {
                println!("WARNING: {warning}");
            }
        }
    }
    Ok(())
}

/// Reads results from a `run` or `compare` JSON file.
fn read_results(path: &std::path::Path) -> Result<Vec<crate::BenchResult>, BenchError> {
    if let Ok(text) = std::fs::read_to_string(path) {
        if let Ok(comparison) = serde_json::from_str::<crate::compare::Comparison>(&text) {
            return Ok(comparison.results);
        }
    }
    Ok(crate::ResultFile::read(path)?.results)
}

fn run_pgbench(arguments: &PgbenchArgs) -> Result<(), BenchError> {
    let mut command = std::process::Command::new("bash");
    command
        .arg("-c")
        .arg(PGBENCH_SCRIPT)
        .arg("pgbench.sh")
        .arg("--local-dir")
        .arg(&arguments.local_dir)
        .args(["--scale", &arguments.scale.to_string()])
        .args(["--clients", &arguments.clients.to_string()])
        .args(["--threads", &arguments.threads.to_string()])
        .args(["--seconds", &arguments.seconds.to_string()]);
    if let Some(nbd) = &arguments.nbd {
        command.args(["--nbd", nbd]);
    }
    let status = command.status().map_err(|error| BenchError::External {
        program: "bash".to_string(),
        reason: error.to_string(),
    })?;
    if !status.success() {
        return Err(BenchError::External {
            program: "scripts/bench/pgbench.sh".to_string(),
            reason: format!("exited with {status}"),
        });
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Top,
    }
    #[derive(Subcommand)]
    enum Top {
        Bench(BenchCommand),
    }

    // Proves sizes parse with binary units and reject junk.
    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert!(parse_size("1x").is_err());
        assert!(parse_size("k").is_err());
    }

    // Proves the command embeds as one plain variant in a parent CLI, as the `keel` binary
    // will use it, and that the clap definition is consistent.
    #[test]
    fn embeds_in_a_parent_cli() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let parsed = Cli::try_parse_from([
            "keel",
            "bench",
            "run",
            "--target",
            "/var/tmp/x",
            "--profile",
            "sync-qd1",
            "--runtime-seconds",
            "3",
        ])
        .unwrap();
        let Top::Bench(BenchCommand {
            action: BenchAction::Run(arguments),
        }) = parsed.command
        else {
            panic!("expected bench run");
        };
        assert_eq!(arguments.workload.profile, Profile::SyncQd1);
        assert_eq!(arguments.workload.runtime_seconds, 3);
        let parsed = Cli::try_parse_from([
            "keel",
            "bench",
            "durability",
            "verify",
            "--target",
            "nbd://127.0.0.1:1/v",
            "--log",
            "/var/tmp/log",
        ]);
        assert!(parsed.is_ok());
    }
}
