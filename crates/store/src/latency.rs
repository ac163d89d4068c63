//! How long the log's fdatasyncs take: a lock-free histogram the commit path records into, read
//! as a snapshot by `Store::stats` (`/metrics` exports it, health compares its recent p99 with a
//! threshold). Buckets double from 50 µs to about 1.6 s, plus one for anything longer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bound of the first bucket.
const FIRST_BOUND_NANOS: u64 = 50_000;
/// Buckets with a bound (the last one, unbounded, comes on top).
const BOUNDED_BUCKETS: usize = 16;

#[derive(Debug, Default)]
pub(crate) struct SyncTimes {
    counts: [AtomicU64; BOUNDED_BUCKETS + 1],
    sum_nanos: AtomicU64,
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
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let bucket = (0..BOUNDED_BUCKETS)
            .find(|&index| nanos <= FIRST_BOUND_NANOS << index)
            .unwrap_or(BOUNDED_BUCKETS);
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> SyncLatency {
        SyncLatency {
            bounds_seconds: (0..BOUNDED_BUCKETS)
                .map(|index| (FIRST_BOUND_NANOS << index) as f64 / 1e9)
                .collect(),
            counts: self
                .counts
                .iter()
                .map(|count| count.load(Ordering::Relaxed))
                .collect(),
            sum_seconds: self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9,
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
}
