//! `keel-sim`: runs the deterministic simulations over many seeds: the metadata cluster's, or
//! with `--replication` the replicated volumes' (with `--moves`, nodes down for seconds have
//! their replicas moved and their volumes taken over in the background; `--deletes` as
//! `--moves`, and clients delete snapshots too; `--drains` as `--deletes`, and clients drain
//! storage nodes and stop draining them; `--singles` as `--drains`, and R also goes down to 1,
//! so that a drain copies the volume's one replica off; `--fours` as `--drains`, with an R=3
//! volume on four storage nodes whose replicas move (R 4 meanwhile) and are copied off
//! draining nodes; `--syncs` as the default, and a node's disk fails a sync now and then, its
//! process restarted a few seconds later; `--forwards` as the default, and a third of the
//! clients' attaches are forwarded through a node that is not the primary).
//!
//! ```text
//! keel-sim [--replication [--moves | --deletes | --drains | --singles | --fours | --syncs | --forwards]] [--seed FIRST] [--seeds N | --minutes M] [--steps K]
//!          [--reproduce SEED]
//! ```
//! Prints one line per failing seed with the command that replays it, and a summary; exits 1 on
//! any violation. The cluster simulation's data lives under `target/sim-data` (a real
//! filesystem); the replication simulation's stores are on simulated disks, in memory.

use std::path::PathBuf;
use std::time::{Duration, Instant};

fn value(args: &[String], flag: &str) -> Option<u64> {
    args.iter()
        .position(|arg| arg == flag)
        .and_then(|index| args.get(index + 1))
        .and_then(|text| text.parse().ok())
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KEEL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|arg| arg == "--replication") {
        replication(&args);
    }
    let steps = value(&args, "--steps").unwrap_or(300) as u32;
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/sim-data");
    if let Some(seed) = value(&args, "--reproduce") {
        let report = keel_sim::run(seed, steps, &data);
        println!("{report:#?}");
        std::process::exit(if report.violations.is_empty() { 0 } else { 1 });
    }
    let first = value(&args, "--seed").unwrap_or(1);
    let seeds = value(&args, "--seeds");
    let minutes = value(&args, "--minutes");
    let started = Instant::now();
    let (mut runs, mut failures, mut proposals, mut acknowledged, mut crashes, mut partitions) =
        (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let mut seed = first;
    loop {
        let done = match (seeds, minutes) {
            (Some(count), _) => runs >= count,
            (None, Some(limit)) => started.elapsed() >= Duration::from_secs(limit * 60),
            (None, None) => runs >= 100,
        };
        if done {
            break;
        }
        let report = keel_sim::run(seed, steps, &data);
        runs += 1;
        proposals += report.proposals;
        acknowledged += report.acknowledged;
        crashes += report.crashes;
        partitions += report.partitions;
        if !report.violations.is_empty() {
            failures += 1;
            println!(
                "seed {seed}: {} violation(s): {:?}\n  replay: cargo run --release --bin keel-sim -- --reproduce {seed} --steps {steps}",
                report.violations.len(),
                report.violations
            );
        }
        seed += 1;
    }
    println!(
        "{runs} seeds ({first}..{}), {steps} steps each, {:.0} s: {proposals} proposals, {acknowledged} acknowledged, {crashes} crashes, {partitions} partitions; {failures} failing seed(s)",
        seed.saturating_sub(1),
        started.elapsed().as_secs_f64()
    );
    std::process::exit(if failures == 0 { 0 } else { 1 });
}

/// `--replication`: the replicated-volume simulation over many seeds (exits).
fn replication(args: &[String]) -> ! {
    let steps = value(args, "--steps").unwrap_or(200) as u32;
    let has = |flag: &str| args.iter().any(|arg| arg == flag);
    let (mode, flag) = if has("--syncs") {
        (keel_sim::replication::Mode::Syncs, " --syncs")
    } else if has("--fours") {
        (keel_sim::replication::Mode::Fours, " --fours")
    } else if has("--singles") {
        (keel_sim::replication::Mode::Singles, " --singles")
    } else if has("--drains") {
        (keel_sim::replication::Mode::Drains, " --drains")
    } else if has("--deletes") {
        (keel_sim::replication::Mode::Deletes, " --deletes")
    } else if has("--forwards") {
        (keel_sim::replication::Mode::Forwards, " --forwards")
    } else if has("--moves") {
        (keel_sim::replication::Mode::Moves, " --moves")
    } else {
        (keel_sim::replication::Mode::Standard, "")
    };
    if let Some(seed) = value(args, "--reproduce") {
        let report = keel_sim::replication::run_in(seed, steps, mode);
        println!("{report:#?}");
        std::process::exit(if report.violations.is_empty() { 0 } else { 1 });
    }
    let first = value(args, "--seed").unwrap_or(1);
    let seeds = value(args, "--seeds");
    let minutes = value(args, "--minutes");
    let started = Instant::now();
    let (mut runs, mut failures) = (0u64, 0u64);
    let (mut writes, mut flushes, mut attaches, mut cuts, mut partitions) = (0, 0, 0, 0, 0);
    let (mut filled, mut syncs) = (0, 0);
    let (mut rollbacks, mut replica_changes, mut moved, mut deleted) = (0, 0, 0, 0);
    let mut drains = 0;
    let mut handed = 0;
    let mut copied = 0;
    let mut forwarded = 0;
    let mut seed = first;
    loop {
        let done = match (seeds, minutes) {
            (Some(count), _) => runs >= count,
            (None, Some(limit)) => started.elapsed() >= Duration::from_secs(limit * 60),
            (None, None) => runs >= 100,
        };
        if done {
            break;
        }
        let report = keel_sim::replication::run_in(seed, steps, mode);
        runs += 1;
        writes += report.writes;
        flushes += report.flushes;
        attaches += report.attaches;
        cuts += report.power_cuts;
        filled += report.disks_filled;
        syncs += report.syncs_failed;
        partitions += report.partitions;
        rollbacks += report.rollbacks;
        replica_changes += report.replica_changes;
        moved += report.replicas_moved;
        deleted += report.snapshots_deleted;
        drains += report.drains;
        handed += report.primaries_handed_off;
        copied += report.copies_off_draining;
        forwarded += report.forwarded_attaches;
        if !report.violations.is_empty() {
            failures += 1;
            println!(
                "seed {seed} (R={}, witness: {}): {} violation(s): {:?}\n  replay: cargo run --release --bin keel-sim -- --replication{flag} --reproduce {seed} --steps {steps}",
                report.replicas,
                report.witness,
                report.violations.len(),
                report.violations
            );
        }
        seed += 1;
    }
    println!(
        "{runs} seeds ({first}..{}), {steps} steps each, {:.0} s: {writes} writes, {flushes} FLUSHes acknowledged, {attaches} attaches, {cuts} power cuts, {partitions} partitions, {filled} disks filled, {syncs} syncs failed, {rollbacks} rollbacks, {replica_changes} changes of R, {moved} replicas moved, {deleted} snapshots deleted, {drains} drains begun or ended, {handed} primaries handed off, {copied} copies off draining nodes, {forwarded} forwarded attaches; {failures} failing seed(s)",
        seed.saturating_sub(1),
        started.elapsed().as_secs_f64()
    );
    std::process::exit(if failures == 0 { 0 } else { 1 });
}
