//! The S3 lifecycle worker: every [`INTERVAL`], one pass of every bucket's lifecycle rules
//! (`keel_namespace::object::lifecycle`) as of the server's wall clock. `POST
//! /api/v1/s3/lifecycle` runs a pass at once.

use std::sync::Arc;
use std::time::Duration;

use keel_clock::Clock;
use keel_namespace::object::Objects;
use tokio::sync::watch;

/// Between passes. S3 applies rules once a day; objects expire within this of their time.
pub const INTERVAL: Duration = Duration::from_secs(3600);

pub async fn run(objects: Arc<Objects>, mut stopped: watch::Receiver<bool>) {
    let clock = keel_clock::SystemClock;
    loop {
        tokio::select! {
            _ = clock.sleep(INTERVAL) => {}
            _ = stopped.wait_for(|stop| *stop) => return,
        }
        let now = clock.wall_unix_ms();
        let objects = objects.clone();
        match tokio::task::spawn_blocking(move || objects.apply_lifecycle(now)).await {
            Ok(Ok(report)) if report.objects_expired + report.uploads_aborted > 0 => {
                tracing::info!(?report, "applied S3 lifecycle rules");
            }
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::warn!(%error, "applying S3 lifecycle rules failed"),
            Err(error) => tracing::warn!(%error, "the S3 lifecycle pass panicked"),
        }
    }
}
