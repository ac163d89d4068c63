//! Is the data device slow? The store times every sync of its log; a sampler keeps a snapshot
//! of that histogram every [`SAMPLE_EVERY`], and health compares the p99 of the syncs since the
//! oldest kept snapshot (the last few minutes) with `slow_sync_ms`: `KEEL_SLOW_DEVICE` when
//! the p99 is surely above it (its bucket's lower bound is), over at least [`SYNCS_MIN`] syncs.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use keel_clock::Clock;
use keel_store::{Store, SyncLatency};

/// How often the sampler takes a snapshot.
const SAMPLE_EVERY: Duration = Duration::from_secs(30);
/// Snapshots kept: the window is about this many times [`SAMPLE_EVERY`] (5 minutes).
const SAMPLES_KEPT: usize = 10;
/// Fewer syncs than this in the window say nothing about the device.
const SYNCS_MIN: u64 = 20;

#[derive(Default)]
pub struct SyncWindow {
    samples: Mutex<VecDeque<SyncLatency>>,
}

impl SyncWindow {
    fn record(&self, sample: SyncLatency) {
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        samples.push_back(sample);
        while samples.len() > SAMPLES_KEPT {
            samples.pop_front();
        }
    }

    /// The syncs in `now` since the oldest kept sample (since the start before the first).
    fn recent(&self, now: &SyncLatency) -> SyncLatency {
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        match samples.front() {
            Some(oldest) => now.since(oldest),
            None => now.clone(),
        }
    }

    /// Samples `store` until `stop` says so.
    pub async fn sample(
        &self,
        store: Store,
        clock: &dyn Clock,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        loop {
            self.record(store.sync_latency());
            tokio::select! {
                _ = clock.sleep(SAMPLE_EVERY) => {}
                _ = stop.wait_for(|stop| *stop) => return,
            }
        }
    }

    /// The health finding, if the device is slow: `slow_sync_ms` of 0 turns the check off.
    pub fn finding(
        &self,
        now: &SyncLatency,
        slow_sync_ms: f64,
    ) -> Option<keel_cluster::HealthCheck> {
        if slow_sync_ms <= 0.0 {
            return None;
        }
        let recent = self.recent(now);
        let syncs = recent.count();
        if syncs < SYNCS_MIN {
            return None;
        }
        let (lower, upper) = recent.quantile_seconds(0.99)?;
        if lower * 1000.0 < slow_sync_ms {
            return None;
        }
        let range = if upper.is_finite() {
            format!("{:.1}–{:.1} ms", lower * 1000.0, upper * 1000.0)
        } else {
            format!("over {:.0} ms", lower * 1000.0)
        };
        Some(keel_cluster::HealthCheck {
            code: "KEEL_SLOW_DEVICE".to_string(),
            severity: "warn".to_string(),
            message: format!(
                "the log's fdatasync p99 is {range} over the last {syncs} syncs, above \
                 slow_sync_ms ({slow_sync_ms} ms)"
            ),
            action: "check the device with keel doctor, what else writes to it, and its health; \
                     every flushed write waits for it"
                .to_string(),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn latency(counts: &[(usize, u64)]) -> SyncLatency {
        let mut latency = SyncLatency {
            bounds_seconds: (0..16).map(|i| (50_000u64 << i) as f64 / 1e9).collect(),
            counts: vec![0; 17],
            sum_seconds: 0.0,
        };
        for (bucket, count) in counts {
            latency.counts[*bucket] = *count;
        }
        latency
    }

    // Proves the check fires only on a p99 surely above the threshold, over enough syncs,
    // within the window (old slow syncs age out), and never when turned off.
    #[test]
    fn slow_only_when_the_recent_p99_is_surely_above_the_threshold() {
        let window = SyncWindow::default();
        // 100 syncs, the slowest 2 in (204.8, 409.6] ms: p99 there.
        let slow = latency(&[(4, 98), (13, 2)]);
        let finding = window.finding(&slow, 200.0).unwrap();
        assert_eq!(finding.code, "KEEL_SLOW_DEVICE");
        assert_eq!(finding.severity, "warn");
        assert!(finding.message.contains("204.8–409.6 ms"), "{finding:?}");
        assert!(
            window.finding(&slow, 300.0).is_none(),
            "p99 may be under 300 ms"
        );
        assert!(window.finding(&slow, 0.0).is_none(), "off");
        assert!(
            window.finding(&latency(&[(13, 19)]), 200.0).is_none(),
            "too few syncs"
        );
        // The slow syncs are older than the window: the recent ones are fast.
        window.record(slow.clone());
        let later = latency(&[(4, 198), (13, 2)]);
        assert!(window.finding(&later, 200.0).is_none());
    }
}
