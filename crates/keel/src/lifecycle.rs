//! The S3 lifecycle worker: every [`INTERVAL`], one pass of every bucket's lifecycle rules
//! (`keel_namespace::object::lifecycle`) as of the server's wall clock. `POST
//! /api/v1/s3/lifecycle` runs a pass at once. [`LifecycleStats`] counts what the passes did,
//! for `/metrics`.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keel_clock::Clock;
use keel_namespace::object::lifecycle::LifecycleReport;
use keel_namespace::object::{ObjectError, Objects};
use tokio::sync::watch;

/// Between passes. S3 applies rules once a day; objects expire within this of their time.
pub const INTERVAL: Duration = Duration::from_secs(3600);

/// What the lifecycle passes of this server did since it started.
#[derive(Default)]
pub struct LifecycleStats {
    pub objects_expired: AtomicU64,
    pub versions_expired: AtomicU64,
    pub delete_markers_removed: AtomicU64,
    pub uploads_aborted: AtomicU64,
    pub passes_failed: AtomicU64,
    /// When the last pass finished (ms since the epoch; 0: none yet).
    pub last_pass_unix_ms: AtomicI64,
}

impl LifecycleStats {
    /// One pass as of `as_of_unix_ms` (blocking), counted.
    pub fn pass(
        &self,
        objects: &Objects,
        as_of_unix_ms: i64,
        clock: &dyn Clock,
    ) -> Result<LifecycleReport, ObjectError> {
        let outcome = objects.apply_lifecycle(as_of_unix_ms);
        match &outcome {
            Ok(report) => {
                self.objects_expired
                    .fetch_add(report.objects_expired, Ordering::Relaxed);
                self.versions_expired
                    .fetch_add(report.versions_expired, Ordering::Relaxed);
                self.delete_markers_removed
                    .fetch_add(report.delete_markers_removed, Ordering::Relaxed);
                self.uploads_aborted
                    .fetch_add(report.uploads_aborted, Ordering::Relaxed);
            }
            Err(_) => {
                self.passes_failed.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.last_pass_unix_ms
            .store(clock.wall_unix_ms(), Ordering::Relaxed);
        outcome
    }
}

pub async fn run(
    objects: Arc<Objects>,
    stats: Arc<LifecycleStats>,
    mut stopped: watch::Receiver<bool>,
) {
    let clock = keel_clock::SystemClock;
    loop {
        tokio::select! {
            _ = clock.sleep(INTERVAL) => {}
            _ = stopped.wait_for(|stop| *stop) => return,
        }
        let (objects, stats) = (objects.clone(), stats.clone());
        let pass = tokio::task::spawn_blocking(move || {
            let clock = keel_clock::SystemClock;
            stats.pass(&objects, clock.wall_unix_ms(), &clock)
        });
        match pass.await {
            Ok(Ok(report)) if report != LifecycleReport::default() => {
                tracing::info!(?report, "applied S3 lifecycle rules");
            }
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::warn!(%error, "applying S3 lifecycle rules failed"),
            Err(error) => tracing::warn!(%error, "the S3 lifecycle pass panicked"),
        }
    }
}
