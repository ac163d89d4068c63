//! `keel bench compare A B`: the same profile on two targets, alternating A B A B … for N
//! rounds, reporting the median per-round ratio B/A with its spread (min–max). Alternating in
//! rounds means slow drift of a shared machine hits both sides equally, and the spread shows
//! when the machine is too noisy for the difference to mean anything.

use serde::{Deserialize, Serialize};

use crate::profile::{format_latency, BenchResult, RunOptions};
use crate::stats::{median, OpStats};
use crate::BenchError;

/// Most rounds a comparison may run.
pub const ROUNDS_MAX: usize = 100;

/// One compared figure over all rounds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ratio {
    /// "IOPS", "MiB/s", "p50 latency", "p99 latency".
    pub metric: String,
    /// B/A per round.
    pub per_round: Vec<f64>,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// The outcome of a comparison.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    pub profile: String,
    pub a: String,
    pub b: String,
    pub rounds: usize,
    pub ratios: Vec<Ratio>,
    /// Every run, in the order it ran (A, B, A, B, …).
    pub results: Vec<BenchResult>,
}

/// The stats a ratio is taken over: writes for write profiles, reads for read profiles, all
/// operations for mixed ones.
fn headline(result: &BenchResult) -> &OpStats {
    match (&result.reads, &result.writes) {
        (Some(reads), None) => reads,
        (None, Some(writes)) => writes,
        _ => &result.all,
    }
}

fn ratio(metric: &str, per_round: Vec<f64>) -> Ratio {
    let median = median(&per_round).unwrap_or(f64::NAN);
    let min = per_round.iter().copied().fold(f64::INFINITY, f64::min);
    let max = per_round.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Ratio {
        metric: metric.to_string(),
        per_round,
        median,
        min,
        max,
    }
}

/// Runs `options.profile` on `a` and `b` alternately for `rounds` rounds.
/// Profiles that yield several results (group-commit) are compared on their first one.
pub fn compare(
    options: &RunOptions,
    a: &str,
    b: &str,
    rounds: usize,
) -> Result<Comparison, BenchError> {
    if rounds == 0 || rounds > ROUNDS_MAX {
        return Err(BenchError::Invalid {
            what: "rounds",
            reason: format!("{rounds}; must be 1..={ROUNDS_MAX}"),
        });
    }
    let mut results = Vec::with_capacity(rounds * 2);
    let mut pairs = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let mut pair = Vec::with_capacity(2);
        for (name, target) in [("A", a), ("B", b)] {
            let mut run_options = options.clone();
            run_options.target = target.to_string();
            run_options.label = Some(format!("{name} {target}"));
            let run = crate::profile::run(&run_options)?;
            let result = run.into_iter().next().ok_or_else(|| BenchError::Internal {
                reason: "a profile run produced no result".to_string(),
            })?;
            let stats = headline(&result);
            eprintln!(
                "round {}/{rounds} {name}: {:.0} IOPS, {:.2} MiB/s, p50 {}, p99 {}",
                round + 1,
                stats.iops,
                stats.mib_per_second,
                format_latency(stats.latency.p50_us),
                format_latency(stats.latency.p99_us)
            );
            pair.push(result);
        }
        pairs.push((pair[0].clone(), pair[1].clone()));
        results.extend(pair);
    }
    let per_round = |value: fn(&OpStats) -> f64| -> Vec<f64> {
        pairs
            .iter()
            .map(|(a, b)| value(headline(b)) / value(headline(a)))
            .collect()
    };
    let ratios = vec![
        ratio("IOPS", per_round(|stats| stats.iops)),
        ratio("MiB/s", per_round(|stats| stats.mib_per_second)),
        ratio("p50 latency", per_round(|stats| stats.latency.p50_us)),
        ratio("p99 latency", per_round(|stats| stats.latency.p99_us)),
    ];
    Ok(Comparison {
        profile: options.profile.name().to_string(),
        a: a.to_string(),
        b: b.to_string(),
        rounds,
        ratios,
        results,
    })
}

impl Comparison {
    /// The comparison for a terminal.
    pub fn render_text(&self) -> String {
        let mut text = format!(
            "{} — B/A over {} alternating rounds\n  A = {}\n  B = {}\n",
            self.profile, self.rounds, self.a, self.b
        );
        for ratio in &self.ratios {
            text.push_str(&format!(
                "  {:<12} B/A median {:.3}  (spread {:.3}–{:.3})\n",
                ratio.metric, ratio.median, ratio.min, ratio.max
            ));
        }
        let mut warnings: Vec<&String> = self
            .results
            .iter()
            .flat_map(|result| result.warnings.iter())
            .collect();
        warnings.sort();
        warnings.dedup();
        for warning in warnings {
            text.push_str(&format!("  WARNING: {warning}\n"));
        }
        text
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    // Proves the spread is the min–max of per-round ratios and the median their middle value.
    #[test]
    fn ratio_reports_median_and_spread() {
        let computed = ratio("IOPS", vec![1.2, 0.9, 1.0, 1.1, 5.0]);
        assert_eq!(computed.median, 1.1);
        assert_eq!(computed.min, 0.9);
        assert_eq!(computed.max, 5.0);
    }
}
