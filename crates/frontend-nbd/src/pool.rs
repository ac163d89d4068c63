//! A fixed pool of threads that run the export's blocking calls. Compared with tokio's
//! `spawn_blocking` (a thread per concurrent call, up to hundreds), a few long-lived workers
//! pulling from one queue keep context switches down under load: a busy worker takes the next
//! request without sleeping, and queue depth 64 does not mean 64 threads fighting for two cores.
//! A panicking call is caught and reported to its request only.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

/// Worker threads shared by every connection. Enough for group commit to gather concurrent
/// writes (a FUA write blocks its worker until the batch's sync), few enough not to thrash.
pub const IO_WORKERS: usize = 16;

type Job = Box<dyn FnOnce() + Send + 'static>;

struct Pool {
    queue: mpsc::Sender<Job>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let (queue, jobs) = mpsc::channel::<Job>();
        let jobs = Arc::new(Mutex::new(jobs));
        for worker in 0..IO_WORKERS {
            let jobs = jobs.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("nbd-io-{worker}"))
                .spawn(move || loop {
                    let job = {
                        let receiver = jobs.lock().unwrap_or_else(|p| p.into_inner());
                        receiver.recv()
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                });
            if let Err(error) = spawned {
                tracing::error!(%error, "could not start an NBD I/O worker");
            }
        }
        Pool { queue }
    })
}

/// Runs `work` on a pool thread and returns its result, or `Err(())` if it panicked.
pub(crate) async fn run<T, F>(work: F) -> Result<T, ()>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (done, result) = tokio::sync::oneshot::channel();
    let job: Job = Box::new(move || {
        let outcome = catch_unwind(AssertUnwindSafe(work)).map_err(|_| ());
        let _ = done.send(outcome);
    });
    if pool().queue.send(job).is_err() {
        return Err(());
    }
    result.await.unwrap_or(Err(()))
}
