//! Long-running admin operations (scrub, compaction, volume deletion) run as jobs on blocking
//! threads; the admin API reports their progress so the CLI can show a live progress line.
//! The registry is bounded: finished jobs beyond `FINISHED_JOBS_KEPT_MAX` are forgotten.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::Serialize;

const FINISHED_JOBS_KEPT_MAX: usize = 64;

#[derive(Debug, Clone, Serialize)]
pub struct JobStatus {
    pub id: u64,
    pub kind: String,
    /// "running", "done" or "failed".
    pub state: String,
    pub done: u64,
    pub total: u64,
    pub result: Option<serde_json::Value>,
    pub error: Option<String>,
}

#[derive(Clone, Default)]
pub struct Jobs {
    inner: Arc<Mutex<JobsInner>>,
}

#[derive(Default)]
struct JobsInner {
    next_id: u64,
    jobs: BTreeMap<u64, JobStatus>,
}

/// Handed to the job's closure to report progress.
pub struct JobProgress {
    jobs: Jobs,
    id: u64,
}

impl JobProgress {
    pub fn report(&self, done: u64, total: u64) {
        self.jobs.update(self.id, |job| {
            job.done = done;
            job.total = total;
        });
    }
}

impl Jobs {
    fn update(&self, id: u64, change: impl FnOnce(&mut JobStatus)) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(job) = inner.jobs.get_mut(&id) {
            change(job);
        }
    }

    /// Starts `work` on a blocking thread and returns the job's id at once.
    pub fn start<F>(&self, kind: &str, work: F) -> u64
    where
        F: FnOnce(&JobProgress) -> anyhow::Result<serde_json::Value> + Send + 'static,
    {
        let id = self.register(kind);
        let jobs = self.clone();
        tokio::task::spawn_blocking(move || jobs.work(id, work));
        id
    }

    /// Runs `work` as a job on a blocking thread and waits for its outcome.
    pub async fn run_blocking<F>(&self, kind: &str, work: F) -> anyhow::Result<serde_json::Value>
    where
        F: FnOnce(&JobProgress) -> anyhow::Result<serde_json::Value> + Send + 'static,
    {
        let id = self.register(kind);
        let jobs = self.clone();
        tokio::task::spawn_blocking(move || jobs.work(id, work)).await?
    }

    fn register(&self, kind: &str) -> u64 {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.next_id += 1;
        let id = inner.next_id;
        inner.jobs.insert(
            id,
            JobStatus {
                id,
                kind: kind.to_string(),
                state: "running".into(),
                done: 0,
                total: 0,
                result: None,
                error: None,
            },
        );
        let finished: Vec<u64> = inner
            .jobs
            .values()
            .filter(|j| j.state != "running")
            .map(|j| j.id)
            .collect();
        for old in finished
            .iter()
            .take(finished.len().saturating_sub(FINISHED_JOBS_KEPT_MAX))
        {
            inner.jobs.remove(old);
        }
        id
    }

    fn work<F>(&self, id: u64, work: F) -> anyhow::Result<serde_json::Value>
    where
        F: FnOnce(&JobProgress) -> anyhow::Result<serde_json::Value>,
    {
        let progress = JobProgress {
            jobs: self.clone(),
            id,
        };
        let outcome = work(&progress);
        self.update(id, |job| match &outcome {
            Ok(result) => {
                job.state = "done".into();
                job.result = Some(result.clone());
            }
            Err(error) => {
                job.state = "failed".into();
                job.error = Some(format!("{error:#}"));
            }
        });
        outcome
    }

    pub fn get(&self, id: u64) -> Option<JobStatus> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.jobs.get(&id).cloned()
    }

    pub fn list(&self) -> Vec<JobStatus> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.jobs.values().cloned().collect()
    }
}
