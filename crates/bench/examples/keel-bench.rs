//! A stand-alone `keel-bench` front end over the library (same commands as `keel bench …`), so
//! benchmarks can run before, or without, the full `keel` binary:
//! `cargo run --release -p keel-bench --example keel-bench -- run --profile sync-qd1 --target F`.

use clap::Parser;

/// `keel-bench`: the `keel bench` commands on their own.
#[derive(Parser, Debug)]
#[command(name = "keel-bench")]
struct Cli {
    #[command(flatten)]
    bench: keel_bench::BenchCommand,
}

fn main() -> anyhow::Result<()> {
    keel_bench::run(Cli::parse().bench)
}
