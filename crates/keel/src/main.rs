//! `keel`: the one binary. Nouns and verbs: `keel server`, `keel status`, `keel doctor`,
//! `keel volume|snapshot|bucket|key|store ...` (through the admin API), `keel bench ...`.

mod admin;
mod bench_store;
mod cli;
mod cluster_net;
mod config;
mod csi;
mod diskstats;
mod doctor;
mod files;
mod fill_rate;
mod jobs;
mod lifecycle;
mod metrics;
mod nearfull;
mod process;
mod refusals;
mod scrub_schedule;
mod server;
mod sync_health;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "keel",
    version,
    about = "Keel: checksummed, self-healing storage served as S3 objects and NBD block volumes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a node (default: single-node cluster with data in ./keel-data).
    Server(server::ServerArgs),
    /// Health of a running server: HEALTH_OK / HEALTH_WARN / HEALTH_ERR with reasons.
    Status {
        #[command(flatten)]
        connection: cli::Connection,
        #[arg(long)]
        json: bool,
    },
    /// NBD and S3 requests in flight (oldest first), or the slowest of the last 10 minutes,
    /// with the time each spent in each phase.
    Ops {
        #[command(flatten)]
        connection: cli::Connection,
        #[command(flatten)]
        view: cli::OpsView,
    },
    /// Examine what the disk under a data directory really guarantees. Exits non-zero when
    /// the directory is not durable storage (tmpfs, ramfs).
    Doctor(doctor::DoctorArgs),
    /// Block volumes.
    Volume {
        #[command(flatten)]
        connection: cli::Connection,
        #[command(subcommand)]
        command: cli::VolumeCommand,
    },
    /// Snapshots, clones, rollback and send/receive.
    Snapshot {
        #[command(flatten)]
        connection: cli::Connection,
        #[command(subcommand)]
        command: cli::SnapshotCommand,
    },
    /// S3 buckets.
    Bucket {
        #[command(flatten)]
        connection: cli::Connection,
        #[command(subcommand)]
        command: cli::BucketCommand,
    },
    /// S3 access keys.
    Key {
        #[command(flatten)]
        connection: cli::Connection,
        #[command(subcommand)]
        command: cli::KeyCommand,
    },
    /// Store maintenance: scrub and compaction; offline, rebuilding a lost index.
    Store {
        #[command(flatten)]
        connection: cli::Connection,
        #[command(subcommand)]
        command: StoreAction,
    },
    /// The cluster: status, join token, leadership transfer, and the force-primary repair.
    Cluster {
        #[command(flatten)]
        connection: cli::Connection,
        #[command(subcommand)]
        command: ClusterAction,
    },
    /// Cluster nodes: list, info, drain, remove.
    Node {
        #[command(flatten)]
        connection: cli::Connection,
        #[command(subcommand)]
        command: cli::NodeCommand,
    },
    /// The Kubernetes CSI driver (controller, node or both) over a Keel server.
    Csi(csi::CsiArgs),
    /// Benchmarks and durability checks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand, Debug)]
enum ClusterAction {
    #[command(flatten)]
    Online(cli::ClusterCommand),
    /// LAST RESORT, server stopped: make this node the only metadata voter, when the other
    /// voters are lost for good (two storage nodes and a witness, both others gone).
    ForcePrimary {
        /// The stopped survivor's first data directory.
        #[arg(long)]
        data: std::path::PathBuf,
        /// Confirms you accept losing metadata the lost nodes committed.
        #[arg(long = "yes-i-accept-losing-metadata")]
        confirmed: bool,
    },
}

#[derive(Subcommand, Debug)]
enum StoreAction {
    #[command(flatten)]
    Online(cli::StoreCommand),
    /// Server stopped: rebuild a lost or damaged index.redb from the whole log. Reads every
    /// segment; the old index, if any, is kept as index.redb.replaced.
    RebuildIndex {
        /// Every data directory of the store, in the order the server is given them.
        #[arg(long, required = true)]
        data: Vec<std::path::PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Group commit: N writers of durable 4 KiB appends through the store vs raw write+fdatasync.
    Store(bench_store::StoreBenchArgs),
    #[command(flatten)]
    Workload(keel_bench::BenchAction),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KEEL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Server(args) => server::run(args),
        Command::Status { connection, json } => cli::status(&connection, json),
        Command::Ops { connection, view } => cli::ops(&connection, &view),
        Command::Doctor(args) => doctor::run(args),
        Command::Volume {
            connection,
            command,
        } => cli::volume(&connection, command),
        Command::Snapshot {
            connection,
            command,
        } => cli::snapshot(&connection, command),
        Command::Bucket {
            connection,
            command,
        } => cli::bucket(&connection, command),
        Command::Key {
            connection,
            command,
        } => cli::key(&connection, command),
        Command::Store {
            connection,
            command,
        } => match command {
            StoreAction::Online(command) => cli::store(&connection, command),
            StoreAction::RebuildIndex { data } => cli::rebuild_index(&data),
        },
        Command::Cluster {
            connection,
            command,
        } => match command {
            ClusterAction::Online(command) => cli::cluster(&connection, command),
            ClusterAction::ForcePrimary { data, confirmed } => cli::force_primary(&data, confirmed),
        },
        Command::Node {
            connection,
            command,
        } => cli::node(&connection, command),
        Command::Csi(args) => csi::run(args),
        Command::Bench(BenchCommand::Store(args)) => bench_store::run(args),
        Command::Bench(BenchCommand::Workload(action)) => {
            keel_bench::run(keel_bench::BenchCommand { action })
        }
    };
    if let Err(error) = result {
        eprintln!("keel: {error:#}");
        std::process::exit(1);
    }
}
