//! Scrubs on a schedule, so damage nobody reads is found and repaired while a good copy still
//! exists: every `scrub.interval_seconds` this node scrubs its store (every copy on every
//! device, a bad one rewritten from a good one), then compares the replicas of every
//! replicated volume it is the primary of and repairs what differs. A scheduled scrub works
//! `scrub.busy_percent` of the time and sleeps the rest, leaving the disks to clients.
//!
//! The schedule survives restarts: `<first data dir>/scrub-schedule.json` records when it began
//! and the last run (the next is due one interval after the last finished, or after the
//! schedule began). Each run shows as a job (`keel status`, `GET /api/v1/jobs`); its outcome
//! is in `keel status` and `/metrics`, and a run that found data with no good copy turns the
//! health `HEALTH_ERR` (`KEEL_SCRUB_ERRORS`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use keel_clock::Clock;
use serde::{Deserialize, Serialize};

use crate::files::write_file_atomically;
use crate::jobs::Jobs;

const STATE_FILE: &str = "scrub-schedule.json";
/// Work done between two pauses of a paced scrub, at least.
const PACE_SLICE: Duration = Duration::from_millis(20);
/// How long the schedule sleeps at most before it looks at the clock again.
const CHECK_EVERY: Duration = Duration::from_secs(60);
/// How long a paced scrub sleeps at most before it looks whether the server is stopping.
const STOP_CHECK: Duration = Duration::from_millis(100);

/// What `scrub-schedule.json` holds.
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct ScrubHistory {
    /// When the schedule began (the first start with scheduled scrubs on).
    pub schedule_started_unix_ms: i64,
    pub last: Option<ScrubRun>,
}

/// One scheduled scrub's outcome.
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct ScrubRun {
    pub started_unix_ms: i64,
    pub finished_unix_ms: i64,
    pub extents_checked: u64,
    pub bytes_checked: u64,
    /// Device copies that failed verification and were rewritten from a good copy.
    pub repaired_copies: u64,
    /// Extents with no good copy on any device of this node.
    pub unrecoverable_extents: u64,
    /// Replicated volumes whose replicas were compared.
    pub volumes_compared: u64,
    /// Blocks repaired on a replica or on this node's copy of a replicated volume.
    pub volume_blocks_repaired: u64,
    /// What could not be scrubbed, and why (a volume whose replica was unreachable, ...).
    pub errors: Vec<String>,
}

/// The schedule as `keel status` shows it.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ScrubStatus {
    /// 0: scheduled scrubs are off.
    pub interval_seconds: u64,
    pub next_unix_ms: Option<i64>,
    pub last: Option<ScrubRun>,
}

/// Runs work only `busy_percent` of the time: after each stretch of work of at least
/// [`PACE_SLICE`], sleeps in proportion to it. Says when the server is stopping (a sleep then
/// ends at once), so the work can stop too.
pub struct Pacer<'a> {
    clock: &'a dyn Clock,
    busy_percent: u32,
    resumed: std::time::Instant,
    stopping: &'a AtomicBool,
}

impl<'a> Pacer<'a> {
    pub fn new(clock: &'a dyn Clock, busy_percent: u8, stopping: &'a AtomicBool) -> Pacer<'a> {
        Pacer {
            clock,
            busy_percent: u32::from(busy_percent.clamp(1, 100)),
            resumed: clock.now(),
            stopping,
        }
    }

    /// Called between pieces of work.
    pub fn pause(&mut self) {
        if self.busy_percent >= 100 {
            return;
        }
        let worked = self.clock.now().saturating_duration_since(self.resumed);
        if worked < PACE_SLICE {
            return;
        }
        let mut rest = worked * (100 - self.busy_percent) / self.busy_percent;
        while !rest.is_zero() && !self.stopped() {
            let nap = rest.min(STOP_CHECK);
            self.clock.sleep_blocking(nap);
            rest -= nap;
        }
        self.resumed = self.clock.now();
    }

    fn stopped(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    /// Set once the server is stopping: the work should end.
    pub fn stopping(&self) -> &'a AtomicBool {
        self.stopping
    }
}

pub struct ScrubSchedule {
    path: PathBuf,
    interval: Duration,
    busy_percent: u8,
    clock: Arc<dyn Clock>,
    history: Mutex<ScrubHistory>,
}

impl ScrubSchedule {
    /// Loads the schedule of the data directory `dir` (beginning it now if it has none).
    pub fn open(
        dir: &Path,
        interval: Duration,
        busy_percent: u8,
        clock: Arc<dyn Clock>,
    ) -> anyhow::Result<ScrubSchedule> {
        let path = dir.join(STATE_FILE);
        let begun = || ScrubHistory {
            schedule_started_unix_ms: clock.wall_unix_ms(),
            last: None,
        };
        // (history, whether the file must be written: it is missing or unreadable)
        let (history, begins) = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice(&bytes) {
                Ok(history) => (history, false),
                Err(error) => {
                    // Only the schedule is lost: it begins again.
                    tracing::warn!(path = %path.display(), %error, "the scrub schedule is unreadable; beginning a new one");
                    (begun(), true)
                }
            },
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => (begun(), true),
            Err(error) => {
                return Err(error).with_context(|| format!("reading {}", path.display()));
            }
        };
        if begins && !interval.is_zero() {
            write_file_atomically(&path, &serde_json::to_vec_pretty(&history)?, 0o644)?;
        }
        Ok(ScrubSchedule {
            path,
            interval,
            busy_percent,
            clock,
            history: Mutex::new(history),
        })
    }

    fn history(&self) -> ScrubHistory {
        self.history
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    fn next_unix_ms(&self, history: &ScrubHistory) -> Option<i64> {
        if self.interval.is_zero() {
            return None;
        }
        let from = history
            .last
            .as_ref()
            .map_or(history.schedule_started_unix_ms, |run| run.finished_unix_ms);
        Some(from.saturating_add(i64::try_from(self.interval.as_millis()).unwrap_or(i64::MAX)))
    }

    pub fn status(&self) -> ScrubStatus {
        let history = self.history();
        ScrubStatus {
            interval_seconds: self.interval.as_secs(),
            next_unix_ms: self.next_unix_ms(&history),
            last: history.last,
        }
    }

    /// Records a finished run, durably first (the one scheduler calls it; `status` readers do
    /// not wait for the write).
    fn record(&self, run: ScrubRun) -> anyhow::Result<()> {
        let next = ScrubHistory {
            last: Some(run),
            ..self.history()
        };
        write_file_atomically(&self.path, &serde_json::to_vec_pretty(&next)?, 0o644)?;
        *self
            .history
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = next;
        Ok(())
    }

    /// Runs scrubs when they are due, until `stop` says so. `scrub` does one run's work, or
    /// answers None when the [`Pacer`] said the server is stopping (the run is not recorded:
    /// it is due again at the next start).
    pub async fn run(
        self: Arc<Self>,
        jobs: Jobs,
        scrub: impl Fn(&mut Pacer, &crate::jobs::JobProgress) -> Option<ScrubRun>
            + Send
            + Sync
            + 'static,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        if self.interval.is_zero() {
            return;
        }
        let scrub = Arc::new(scrub);
        let stopping = Arc::new(AtomicBool::new(false));
        loop {
            let Some(due) = self.next_unix_ms(&self.history()) else {
                return;
            };
            let wait_ms = due.saturating_sub(self.clock.wall_unix_ms());
            if wait_ms > 0 {
                let wait = Duration::from_millis(wait_ms.unsigned_abs()).min(CHECK_EVERY);
                tokio::select! {
                    _ = self.clock.sleep(wait) => continue,
                    _ = stop.wait_for(|stop| *stop) => return,
                }
            }
            let this = self.clone();
            let scrub = scrub.clone();
            let stopping_flag = stopping.clone();
            let job = jobs.run_blocking("scheduled scrub", move |progress| {
                let started_unix_ms = this.clock.wall_unix_ms();
                let mut pacer = Pacer::new(this.clock.as_ref(), this.busy_percent, &stopping_flag);
                let Some(mut run) = scrub(&mut pacer, progress) else {
                    return Ok(serde_json::json!({ "interrupted": true }));
                };
                run.started_unix_ms = started_unix_ms;
                run.finished_unix_ms = this.clock.wall_unix_ms();
                this.record(run.clone())?;
                if run.unrecoverable_extents > 0 || !run.errors.is_empty() {
                    tracing::warn!(?run, "a scheduled scrub found problems");
                } else {
                    tracing::info!(?run, "scheduled scrub done");
                }
                Ok(serde_json::to_value(run)?)
            });
            tokio::pin!(job);
            let finished = tokio::select! {
                outcome = &mut job => Some(outcome),
                _ = stop.wait_for(|stop| *stop) => None,
            };
            let Some(outcome) = finished else {
                // Stopping: the scrub ends at its next page or chunk.
                stopping.store(true, Ordering::Relaxed);
                let _ = job.await;
                return;
            };
            if let Err(error) = outcome {
                // Recording failed (the data directory is full, say): try again next round.
                tracing::warn!(error = %format!("{error:#}"), "a scheduled scrub could not be recorded");
                tokio::select! {
                    _ = self.clock.sleep(CHECK_EVERY) => {}
                    _ = stop.wait_for(|stop| *stop) => return,
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::time::{Instant, SystemTime, UNIX_EPOCH};

    /// Time moves only when told to (or by a sleep, which it records).
    #[derive(Debug)]
    struct StepClock {
        origin: Instant,
        now: Mutex<Instant>,
        slept: Mutex<Vec<Duration>>,
    }

    impl StepClock {
        fn new() -> StepClock {
            let origin = Instant::now();
            StepClock {
                origin,
                now: Mutex::new(origin),
                slept: Mutex::new(Vec::new()),
            }
        }

        fn advance(&self, by: Duration) {
            *self.now.lock().unwrap() += by;
        }
    }

    impl Clock for StepClock {
        fn now(&self) -> Instant {
            *self.now.lock().unwrap()
        }
        fn wall(&self) -> SystemTime {
            UNIX_EPOCH + Duration::from_secs(1_000_000) + (self.now() - self.origin)
        }
        fn sleep(&self, _: Duration) -> keel_clock::Sleep {
            Box::pin(std::future::ready(()))
        }
        fn sleep_blocking(&self, duration: Duration) {
            self.slept.lock().unwrap().push(duration);
            self.advance(duration);
        }
    }

    // Proves a paced scrub sleeps three times what it worked at 25%, waits for a whole slice of
    // work before it sleeps, never sleeps at 100%, and not at all once the server is stopping.
    #[test]
    fn a_pacer_works_its_share_of_the_time() {
        let clock = StepClock::new();
        let slept = || clock.slept.lock().unwrap().iter().sum::<Duration>();
        let stopping = AtomicBool::new(false);
        let mut pacer = Pacer::new(&clock, 25, &stopping);
        clock.advance(Duration::from_millis(5));
        pacer.pause();
        assert_eq!(slept(), Duration::ZERO);
        clock.advance(Duration::from_millis(35));
        pacer.pause();
        assert_eq!(slept(), Duration::from_millis(120));
        clock.advance(Duration::from_millis(20));
        pacer.pause();
        assert_eq!(slept(), Duration::from_millis(180));

        let mut flat_out = Pacer::new(&clock, 100, &stopping);
        clock.advance(Duration::from_secs(1));
        flat_out.pause();
        assert_eq!(slept(), Duration::from_millis(180));

        // Stopping: no rest, however long the work was.
        clock.advance(Duration::from_secs(10));
        stopping.store(true, Ordering::Relaxed);
        pacer.pause();
        assert_eq!(slept(), Duration::from_millis(180));
    }

    // Proves the schedule begins on first open (a reopen keeps that), the first scrub is due an
    // interval later, a recorded run survives a reopen and moves the next one to an interval
    // after it finished, an interval of 0 schedules nothing, and an unreadable file begins a
    // new schedule.
    #[test]
    fn the_schedule_survives_a_restart() {
        let directory = tempfile::tempdir_in("/var/tmp").unwrap();
        let dir = directory.path();
        let steps = Arc::new(StepClock::new());
        let clock: Arc<dyn Clock> = steps.clone();
        let began = clock.wall_unix_ms();
        let hour = Duration::from_secs(3600);
        ScrubSchedule::open(dir, hour, 25, clock.clone()).unwrap();
        steps.advance(Duration::from_secs(600));
        let schedule = ScrubSchedule::open(dir, hour, 25, clock.clone()).unwrap();
        assert_eq!(schedule.status().next_unix_ms, Some(began + 3_600_000));
        schedule
            .record(ScrubRun {
                finished_unix_ms: began + 10_000,
                repaired_copies: 3,
                ..ScrubRun::default()
            })
            .unwrap();
        let reopened = ScrubSchedule::open(dir, hour, 25, clock.clone()).unwrap();
        let status = reopened.status();
        assert_eq!(status.last.unwrap().repaired_copies, 3);
        assert_eq!(status.next_unix_ms, Some(began + 10_000 + 3_600_000));
        let off = ScrubSchedule::open(dir, Duration::ZERO, 25, clock.clone()).unwrap();
        assert_eq!(off.status().next_unix_ms, None);
        std::fs::write(dir.join(STATE_FILE), b"{\"schedule_sta").unwrap();
        let anew = ScrubSchedule::open(dir, hour, 25, clock.clone()).unwrap();
        assert_eq!(
            anew.status().next_unix_ms,
            Some(clock.wall_unix_ms() + 3_600_000)
        );
    }
}
