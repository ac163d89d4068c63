//! How fast are the data directories filling? A sampler records the free bytes of the fullest
//! data directory every [`SAMPLE_EVERY`], keeping the last [`WINDOW`]. The fill rate is the
//! drop in free bytes from the oldest kept sample to the newest over the time between them,
//! once they are [`SPAN_MIN`] apart; at that rate the directory is full in `free / rate`.
//! It counts everything that fills the filesystem, Keel's writes or not.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use keel_clock::Clock;
use serde::{Deserialize, Serialize};

/// How often the sampler reads the free space.
const SAMPLE_EVERY: Duration = Duration::from_secs(60);
/// How far back the rate looks.
const WINDOW: Duration = Duration::from_secs(6 * 3600);
/// A rate over less time than this says too little.
const SPAN_MIN: Duration = Duration::from_secs(10 * 60);

#[derive(Default)]
pub struct FillWindow {
    samples: Mutex<VecDeque<(Instant, u64)>>,
}

/// The estimate `keel status` and `/metrics` show.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct FillEstimate {
    /// Bytes per day the fullest data directory's free space shrinks by (negative: it grows).
    pub bytes_per_day: f64,
    /// Days until it is full at that rate; none when it is not filling.
    pub days_to_full: Option<f64>,
    /// The time the rate was taken over.
    pub over_seconds: u64,
}

impl FillWindow {
    fn record(&self, at: Instant, free_bytes: u64) {
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        samples.push_back((at, free_bytes));
        while samples
            .front()
            .is_some_and(|(first, _)| at.saturating_duration_since(*first) > WINDOW)
        {
            samples.pop_front();
        }
    }

    /// The rate over the kept samples, once they span [`SPAN_MIN`].
    pub fn estimate(&self) -> Option<FillEstimate> {
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let (first_at, first_free) = *samples.front()?;
        let (last_at, last_free) = *samples.back()?;
        let span = last_at.saturating_duration_since(first_at);
        if span < SPAN_MIN {
            return None;
        }
        let per_second = (first_free as f64 - last_free as f64) / span.as_secs_f64();
        let bytes_per_day = per_second * 86_400.0;
        Some(FillEstimate {
            bytes_per_day,
            days_to_full: (bytes_per_day > 0.0).then(|| last_free as f64 / bytes_per_day),
            over_seconds: span.as_secs(),
        })
    }

    /// Samples the free space of the fullest of `dirs` until `stop` says so.
    pub async fn sample(
        &self,
        dirs: Vec<PathBuf>,
        clock: &dyn Clock,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        loop {
            let free = dirs
                .iter()
                .filter_map(|dir| keel_store::fsinfo::filesystem_info(dir).ok())
                .map(|info| info.available_bytes)
                .min();
            if let Some(free) = free {
                self.record(clock.now(), free);
            }
            tokio::select! {
                _ = clock.sleep(SAMPLE_EVERY) => {}
                _ = stop.wait_for(|stop| *stop) => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    // Proves the rate is the drop in free space over the kept window, needs a span of at
    // least ten minutes, forgets samples older than the window, and gives days to full only
    // while filling.
    #[test]
    fn rate_and_days_to_full_over_the_window() {
        let window = FillWindow::default();
        let start = Instant::now();
        let at = |minutes: u64| start + Duration::from_secs(minutes * 60);
        window.record(at(0), 100 * GIB);
        window.record(at(5), 99 * GIB);
        assert_eq!(window.estimate(), None, "five minutes say too little");
        // 2 GiB less in an hour: 48 GiB a day, 98 GiB left: about two days.
        window.record(at(60), 98 * GIB);
        let estimate = window.estimate().expect("an hour of samples");
        assert_eq!(estimate.bytes_per_day, (48 * GIB) as f64);
        assert_eq!(estimate.over_seconds, 3600);
        let days = estimate.days_to_full.expect("filling");
        assert!((days - 98.0 / 48.0).abs() < 1e-9, "{days}");

        // Almost seven hours on, the first two samples are out of the six-hour window; space
        // was freed since.
        window.record(at(400), 99 * GIB);
        window.record(at(410), 100 * GIB);
        let estimate = window.estimate().expect("samples span the window");
        assert_eq!(estimate.over_seconds, (410 - 60) * 60);
        assert!(estimate.bytes_per_day < 0.0);
        assert_eq!(estimate.days_to_full, None);
    }
}
