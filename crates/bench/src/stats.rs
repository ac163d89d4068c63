//! Latency recording and the numbers derived from it.
//!
//! Every operation's latency goes into an HDR histogram (nanoseconds, 3 significant digits, so
//! any percentile is exact to 0.1 %); nothing is sampled or averaged per batch. A
//! [`Recorder`] is owned by one worker thread and merged at the end, so the hot path takes no
//! lock. [`OpStats`] is what a result reports: counts, rates, min/p50/p99/p99.9/max, the share of
//! operations slower than ten times the median, and a CDF for plotting.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::BenchError;

/// Lowest latency the histogram tells apart, in nanoseconds.
const LATENCY_LOWEST_NANOSECONDS: u64 = 1;
/// Highest latency the histogram records before it grows (it auto-resizes past this).
const LATENCY_HIGHEST_INITIAL_NANOSECONDS: u64 = 60 * 1_000_000_000;
/// Significant decimal digits kept for every value.
const LATENCY_SIGNIFICANT_DIGITS: u8 = 3;
/// An operation counts as "slow" when its latency exceeds this multiple of the median.
pub const SLOW_FACTOR_OF_MEDIAN: u64 = 10;
/// Percentiles at which the CDF stored in a result is sampled (for the SVG plot).
const CDF_PERCENTILES: &[f64] = &[
    0.0, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0, 45.0, 50.0, 55.0, 60.0, 65.0,
    70.0, 75.0, 80.0, 85.0, 90.0, 92.5, 95.0, 96.0, 97.0, 98.0, 99.0, 99.5, 99.9, 99.95, 99.99,
    99.999, 100.0,
];

/// Latencies of one kind of operation, recorded by one thread.
#[derive(Clone)]
pub struct Recorder {
    histogram: Histogram<u64>,
    bytes: u64,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("ops", &self.histogram.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Default for Recorder {
    fn default() -> Self {
        Self::new()
    }
}

impl Recorder {
    /// An empty recorder.
    pub fn new() -> Self {
        let mut histogram = Histogram::new_with_bounds(
            LATENCY_LOWEST_NANOSECONDS,
            LATENCY_HIGHEST_INITIAL_NANOSECONDS,
            LATENCY_SIGNIFICANT_DIGITS,
        )
        .expect("constant histogram bounds are valid");
        // A stalled device can take longer than a minute; keep such an op rather than drop it.
        histogram.auto(true);
        Self {
            histogram,
            bytes: 0,
        }
    }

    /// Records one completed operation of `bytes` that took `latency`.
    pub fn record(&mut self, latency: Duration, bytes: u64) {
        let nanoseconds = u64::try_from(latency.as_nanos())
            .unwrap_or(u64::MAX)
            .max(LATENCY_LOWEST_NANOSECONDS);
        // With auto-resize on, recording can only fail for values the histogram cannot
        // represent at all (beyond u64 range), which `nanoseconds` never is.
        self.histogram
            .record(nanoseconds)
            .expect("auto-resizing histogram accepts every u64 latency");
        self.bytes += bytes;
    }

    /// Adds another recorder's operations to this one.
    pub fn merge(&mut self, other: &Recorder) -> Result<(), BenchError> {
        self.histogram
            .add(&other.histogram)
            .map_err(|error| BenchError::Internal {
                reason: format!("merging latency histograms: {error:?}"),
            })?;
        self.bytes += other.bytes;
        Ok(())
    }

    /// Number of operations recorded.
    pub fn ops(&self) -> u64 {
        self.histogram.len()
    }

    /// Bytes moved by the recorded operations.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Latency at `percentile` (0–100), in nanoseconds; 0 when nothing was recorded.
    pub fn percentile_nanoseconds(&self, percentile: f64) -> u64 {
        if self.histogram.is_empty() {
            return 0;
        }
        self.histogram.value_at_percentile(percentile)
    }

    /// Operations slower than `SLOW_FACTOR_OF_MEDIAN` × the median, as a share of all (0–1).
    pub fn slow_share(&self) -> f64 {
        let ops = self.histogram.len();
        if ops == 0 {
            return 0.0;
        }
        let median = self.histogram.value_at_percentile(50.0);
        let threshold = median.saturating_mul(SLOW_FACTOR_OF_MEDIAN);
        // Values in the same bucket as the threshold count as not slow: the histogram cannot
        // tell them apart from it.
        let not_slow = self
            .histogram
            .count_between(0, self.histogram.highest_equivalent(threshold));
        ops.saturating_sub(not_slow) as f64 / ops as f64
    }

    /// Summarises the recorded operations over a run of `elapsed` wall time.
    pub fn summarise(&self, elapsed: Duration) -> OpStats {
        let seconds = elapsed.as_secs_f64().max(f64::MIN_POSITIVE);
        let ops = self.ops();
        let to_microseconds = |nanoseconds: u64| nanoseconds as f64 / 1000.0;
        let latency = if ops == 0 {
            LatencySummary::default()
        } else {
            LatencySummary {
                min_us: to_microseconds(self.histogram.min()),
                mean_us: self.histogram.mean() / 1000.0,
                p50_us: to_microseconds(self.percentile_nanoseconds(50.0)),
                p99_us: to_microseconds(self.percentile_nanoseconds(99.0)),
                p999_us: to_microseconds(self.percentile_nanoseconds(99.9)),
                max_us: to_microseconds(self.histogram.max()),
            }
        };
        let cdf = if ops == 0 {
            Vec::new()
        } else {
            CDF_PERCENTILES
                .iter()
                .map(|&percentile| CdfPoint {
                    percentile,
                    latency_us: to_microseconds(self.percentile_nanoseconds(percentile)),
                })
                .collect()
        };
        OpStats {
            ops,
            bytes: self.bytes,
            iops: ops as f64 / seconds,
            mib_per_second: self.bytes as f64 / seconds / (1024.0 * 1024.0),
            latency,
            slow_share: self.slow_share(),
            cdf,
        }
    }
}

/// Latency figures in microseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub min_us: f64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

/// One point of a latency CDF: `percentile` % of operations took at most `latency_us`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CdfPoint {
    pub percentile: f64,
    pub latency_us: f64,
}

/// What a result reports for one kind of operation (or for all of them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpStats {
    pub ops: u64,
    pub bytes: u64,
    pub iops: f64,
    pub mib_per_second: f64,
    pub latency: LatencySummary,
    /// Share (0–1) of operations slower than 10× the median.
    pub slow_share: f64,
    pub cdf: Vec<CdfPoint>,
}

/// Median of `values` (mean of the two middle values for an even count); `None` when empty.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let middle = sorted.len() / 2;
    Some(if sorted.len().is_multiple_of(2) {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    } else {
        sorted[middle]
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn microseconds(value: u64) -> Duration {
        Duration::from_micros(value)
    }

    // Proves percentiles come from every recorded op: 1..=1000 µs uniformly gives p50 = 500 µs,
    // p99 = 990 µs, p99.9 = 999 µs, min 1 µs and max 1000 µs, within the histogram's precision
    // (3 significant digits, reported as the bucket's highest value) plus one rank of rounding.
    #[test]
    fn percentiles_of_a_uniform_distribution() {
        let mut recorder = Recorder::new();
        for value in 1..=1000 {
            recorder.record(microseconds(value), 4096);
        }
        let stats = recorder.summarise(Duration::from_secs(2));
        let close =
            |actual: f64, expected: f64| (actual - expected).abs() <= expected * 0.0015 + 1.0;
        assert_eq!(stats.ops, 1000);
        assert_eq!(stats.bytes, 4096 * 1000);
        assert!(close(stats.latency.min_us, 1.0), "{:?}", stats.latency);
        assert!(close(stats.latency.p50_us, 500.0), "{:?}", stats.latency);
        assert!(close(stats.latency.p99_us, 990.0), "{:?}", stats.latency);
        assert!(close(stats.latency.p999_us, 999.0), "{:?}", stats.latency);
        assert!(close(stats.latency.max_us, 1000.0), "{:?}", stats.latency);
        assert!(close(stats.latency.mean_us, 500.5), "{:?}", stats.latency);
        assert!((stats.iops - 500.0).abs() < 1e-9);
        assert!((stats.mib_per_second - 4096.0 * 1000.0 / 2.0 / 1048576.0).abs() < 1e-9);
        // The CDF is monotonic and ends at the maximum.
        assert!(stats
            .cdf
            .windows(2)
            .all(|pair| pair[0].latency_us <= pair[1].latency_us));
        assert!(close(stats.cdf.last().unwrap().latency_us, 1000.0));
    }

    // Proves the tail share counts exactly the ops above 10× the median: 990 ops at 100 µs and
    // 10 at 5 ms → median 100 µs, 10 ops over 1 ms → 1 %. An op at exactly 10× is not slow.
    #[test]
    fn slow_share_counts_ops_beyond_ten_times_the_median() {
        let mut recorder = Recorder::new();
        for _ in 0..989 {
            recorder.record(microseconds(100), 0);
        }
        recorder.record(microseconds(1000), 0);
        for _ in 0..10 {
            recorder.record(microseconds(5000), 0);
        }
        assert!(
            (recorder.slow_share() - 0.01).abs() < 1e-12,
            "{}",
            recorder.slow_share()
        );
        assert_eq!(Recorder::new().slow_share(), 0.0);
    }

    // Proves merging per-thread recorders equals recording everything in one.
    #[test]
    fn merged_recorders_equal_one_recorder() {
        let mut all = Recorder::new();
        let mut first = Recorder::new();
        let mut second = Recorder::new();
        for value in 1..=500 {
            first.record(microseconds(value), 1);
            all.record(microseconds(value), 1);
        }
        for value in 501..=1000 {
            second.record(microseconds(value * 7), 1);
            all.record(microseconds(value * 7), 1);
        }
        first.merge(&second).unwrap();
        let elapsed = Duration::from_secs(1);
        assert_eq!(first.summarise(elapsed), all.summarise(elapsed));
    }

    // Proves the median helper used by `compare` handles odd, even and empty inputs.
    #[test]
    fn median_of_rounds() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }
}
