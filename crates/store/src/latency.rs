//! Histograms the commit path records into without a lock, read as snapshots: how long the
//! log's fdatasyncs take (`Store::stats`; `/metrics` exports it, health compares its recent p99
//! with a threshold) and how many writes each group commit carried (`/metrics`). Buckets
//! double from a first bound (50 µs for syncs, 1 write for batches), plus one for anything
//! larger.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Buckets with a bound (the last one, unbounded, comes on top).
const BOUNDED_BUCKETS: usize = 16;

/// Counts of values in buckets whose bounds double from `first_bound`.
#[derive(Debug)]
struct Doubling {
    first_bound: u64,
    counts: [AtomicU64; BOUNDED_BUCKETS + 1],
    sum: AtomicU64,
}

impl Doubling {
    fn new(first_bound: u64) -> Doubling {
        Doubling {
            first_bound,
            counts: Default::default(),
            sum: AtomicU64::new(0),
        }
    }

    fn observe(&self, value: u64) {
        let bucket = (0..BOUNDED_BUCKETS)
            .find(|&index| value <= self.first_bound << index)
            .unwrap_or(BOUNDED_BUCKETS);
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(value, Ordering::Relaxed);
    }

    fn bounds(&self) -> impl Iterator<Item = u64> + '_ {
        (0..BOUNDED_BUCKETS).map(|index| self.first_bound << index)
    }

    fn counts(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|count| count.load(Ordering::Relaxed))
            .collect()
    }
}

/// Sync durations, in nanoseconds from 50 µs.
#[derive(Debug)]
pub(crate) struct SyncTimes(Doubling);

impl Default for SyncTimes {
    fn default() -> SyncTimes {
        SyncTimes(Doubling::new(50_000))
    }
}

/// A snapshot of the sync latency histogram.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SyncLatency {
    /// Upper bound of each bucket but the last, in seconds.
    pub bounds_seconds: Vec<f64>,
    /// Syncs per bucket (not cumulative); one more than the bounds: the last is unbounded.
    pub counts: Vec<u64>,
    pub sum_seconds: f64,
}

impl SyncTimes {
    pub(crate) fn observe(&self, took: Duration) {
        self.0
            .observe(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
    }

    pub(crate) fn snapshot(&self) -> SyncLatency {
        SyncLatency {
            bounds_seconds: self.0.bounds().map(|nanos| nanos as f64 / 1e9).collect(),
            counts: self.0.counts(),
            sum_seconds: self.0.sum.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }
}

/// Writes per group commit, from 1.
#[derive(Debug)]
pub(crate) struct BatchSizes(Doubling);

impl Default for BatchSizes {
    fn default() -> BatchSizes {
        BatchSizes(Doubling::new(1))
    }
}

/// A snapshot of the group-commit batch-size histogram.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommitBatches {
    /// Upper bound (writes) of each bucket but the last.
    pub bounds: Vec<u64>,
    /// Group commits per bucket (not cumulative); the last is unbounded.
    pub counts: Vec<u64>,
    /// Writes in all group commits.
    pub writes: u64,
}

impl BatchSizes {
    pub(crate) fn observe(&self, writes: usize) {
        self.0.observe(writes as u64);
    }

    pub(crate) fn snapshot(&self) -> CommitBatches {
        CommitBatches {
            bounds: self.0.bounds().collect(),
            counts: self.0.counts(),
            writes: self.0.sum.load(Ordering::Relaxed),
        }
    }
}

impl SyncLatency {
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The syncs since `earlier` (a snapshot of the same histogram taken before).
    pub fn since(&self, earlier: &SyncLatency) -> SyncLatency {
        SyncLatency {
            bounds_seconds: self.bounds_seconds.clone(),
            counts: self
                .counts
                .iter()
                .zip(earlier.counts.iter().chain(std::iter::repeat(&0)))
                .map(|(now, before)| now.saturating_sub(*before))
                .collect(),
            sum_seconds: (self.sum_seconds - earlier.sum_seconds).max(0.0),
        }
    }

    /// Where the `quantile` (0–1) lies: the bounds of its bucket, (lower, upper] in seconds
    /// (upper infinite in the last bucket); None without syncs.
    pub fn quantile_seconds(&self, quantile: f64) -> Option<(f64, f64)> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let wanted = (quantile * total as f64).ceil().max(1.0) as u64;
        let bound = |index: usize| {
            self.bounds_seconds
                .get(index)
                .copied()
                .unwrap_or(f64::INFINITY)
        };
        let mut seen = 0;
        for (index, count) in self.counts.iter().enumerate() {
            seen += count;
            if seen >= wanted {
                let lower = index.checked_sub(1).map_or(0.0, bound);
                return Some((lower, bound(index)));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves syncs land in the bucket whose bound they do not exceed, the sum adds up, a
    // window is the difference of two snapshots, and a quantile lies in the bucket where its
    // share of the syncs is reached.
    #[test]
    fn buckets_windows_and_quantiles() {
        let times = SyncTimes::default();
        for _ in 0..98 {
            times.observe(Duration::from_micros(40));
        }
        let before = times.snapshot();
        assert_eq!(before.counts[0], 98);
        assert_eq!(before.quantile_seconds(0.99), Some((0.0, 50e-6)));
        times.observe(Duration::from_micros(90));
        times.observe(Duration::from_millis(300));
        times.observe(Duration::from_secs(5));
        let now = times.snapshot();
        assert_eq!(now.count(), 101);
        assert_eq!(now.counts[1], 1);
        assert_eq!(now.counts[BOUNDED_BUCKETS], 1);
        assert!((now.sum_seconds - (98.0 * 40e-6 + 90e-6 + 0.3 + 5.0)).abs() < 1e-9);
        assert_eq!(now.quantile_seconds(0.99), Some((0.2048, 0.4096)));
        let window = now.since(&before);
        assert_eq!(window.count(), 3);
        assert_eq!(window.quantile_seconds(0.5), Some((0.2048, 0.4096)));
        assert_eq!(window.quantile_seconds(0.99), Some((1.6384, f64::INFINITY)));
        assert_eq!(SyncLatency::default().quantile_seconds(0.99), None);
    }

    // Proves group commits land in the bucket of their size (bounds 1, 2, 4, ...) and the
    // writes add up.
    #[test]
    fn batch_sizes_by_doubling_buckets() {
        let batches = BatchSizes::default();
        for writes in [1, 1, 3, 40, 100_000] {
            batches.observe(writes);
        }
        let snapshot = batches.snapshot();
        assert_eq!(&snapshot.bounds[..4], &[1, 2, 4, 8]);
        assert_eq!(snapshot.counts[0], 2);
        assert_eq!(snapshot.counts[2], 1);
        assert_eq!(snapshot.counts[6], 1);
        assert_eq!(snapshot.counts[BOUNDED_BUCKETS], 1);
        assert_eq!(snapshot.writes, 100_045);
    }
}
