//! The slice of the simulation that runs in CI: a few seeds, each checked for lost, doubled and
//! diverging metadata, and one seed run twice to prove a run replays exactly.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/sim-data/slice")
}

fn seeds() -> u64 {
    std::env::var("KEEL_SIM_SEEDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(12)
}

// Proves the invariants hold over a slice of seeds (crashes, partitions, loss, delay, clock
// jumps).
#[test]
fn a_slice_of_seeds_keeps_every_invariant() {
    let mut total_acknowledged = 0;
    for seed in 1..=seeds() {
        let report = keel_sim::run(seed, 200, &data());
        assert!(report.violations.is_empty(), "seed {seed}: {report:#?}");
        assert!(
            report.proposals > 0 && report.acknowledged > 0,
            "seed {seed} did nothing: {report:?}"
        );
        total_acknowledged += report.acknowledged;
    }
    assert!(total_acknowledged > 100);
}

// Proves a seed replays exactly: the same report, trace hash included.
#[test]
fn a_seed_replays_exactly() {
    let first = keel_sim::run(4242, 150, &data().join("a"));
    let second = keel_sim::run(4242, 150, &data().join("b"));
    assert!(first.violations.is_empty(), "{first:#?}");
    assert_eq!(first, second);
}
