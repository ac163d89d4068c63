//! The threads that run the export's blocking calls.
//!
//! tokio's `spawn_blocking` starts a thread whenever none is idle, so queue depth 64 means ~64
//! threads fighting for the cores, and context switches ate ~40% of the CPU in profiles. This
//! pool keeps `IO_WORKERS_CORE` long-lived workers pulling from one queue — a busy worker takes
//! the next request without sleeping — and grows only when queued work makes no progress for
//! `GROW_AFTER`, which means the workers are blocked (a volume waiting on its IOPS limit, a slow
//! disk), not merely busy. Extra workers leave after `IDLE_EXTRA_WORKER_EXIT_AFTER` idle, so a
//! stuck export can delay others by at most a few milliseconds, never starve them.
//! Jobs catch their own panics and report them to their request only.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Workers that live as long as the process.
pub const IO_WORKERS_CORE: usize = 16;
/// Upper bound on workers, however many requests block.
pub const IO_WORKERS_MAX: usize = 1024;
/// Queued work that has seen no job start for this long makes the pool grow.
const GROW_AFTER: Duration = Duration::from_millis(2);
/// Workers added per growth step (one step per `GROW_AFTER`).
const GROW_STEP_WORKERS: usize = 8;
const IDLE_EXTRA_WORKER_EXIT_AFTER: Duration = Duration::from_secs(10);

type Job = Box<dyn FnOnce() + Send + 'static>;

struct State {
    queue: VecDeque<Job>,
    workers: usize,
    idle: usize,
    /// When a worker last took a job from the queue.
    last_start: Instant,
}

struct Pool {
    state: Mutex<State>,
    /// Idle workers wait here for jobs.
    work: Condvar,
    /// The monitor waits here while the queue is empty.
    monitor: Condvar,
}

fn lock(pool: &Pool) -> MutexGuard<'_, State> {
    pool.state.lock().unwrap_or_else(|p| p.into_inner())
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        state: Mutex::new(State {
            queue: VecDeque::new(),
            workers: 0,
            idle: 0,
            last_start: Instant::now(),
        }),
        work: Condvar::new(),
        monitor: Condvar::new(),
    })
}

fn start_monitor_and_core() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        let pool = pool();
        {
            let mut state = lock(pool);
            for _ in 0..IO_WORKERS_CORE {
                spawn_worker(&mut state);
            }
        }
        let spawned = std::thread::Builder::new()
            .name("nbd-io-monitor".into())
            .spawn(monitor);
        if let Err(error) = spawned {
            tracing::error!(%error, "could not start the NBD I/O pool monitor");
        }
    });
}

fn spawn_worker(state: &mut State) {
    let spawned = std::thread::Builder::new()
        .name("nbd-io".into())
        .spawn(worker);
    match spawned {
        Ok(_) => state.workers += 1,
        Err(error) => tracing::error!(%error, "could not start an NBD I/O worker"),
    }
}

fn worker() {
    let pool = pool();
    let mut state = lock(pool);
    loop {
        if let Some(job) = state.queue.pop_front() {
            state.last_start = Instant::now();
            drop(state);
            job();
            state = lock(pool);
            continue;
        }
        state.idle += 1;
        let (next, timeout) = pool
            .work
            .wait_timeout(state, IDLE_EXTRA_WORKER_EXIT_AFTER)
            .unwrap_or_else(|p| p.into_inner());
        state = next;
        state.idle -= 1;
        if timeout.timed_out() && state.queue.is_empty() && state.workers > IO_WORKERS_CORE {
            state.workers -= 1;
            return;
        }
    }
}

fn monitor() {
    let pool = pool();
    let mut state = lock(pool);
    loop {
        if state.queue.is_empty() {
            state = pool.monitor.wait(state).unwrap_or_else(|p| p.into_inner());
            continue;
        }
        if state.idle == 0
            && state.last_start.elapsed() >= GROW_AFTER
            && state.workers < IO_WORKERS_MAX
        {
            let step = GROW_STEP_WORKERS
                .min(state.queue.len())
                .min(IO_WORKERS_MAX - state.workers);
            for _ in 0..step {
                spawn_worker(&mut state);
            }
            tracing::debug!(
                workers = state.workers,
                "NBD I/O pool grew: workers are blocked"
            );
            state.last_start = Instant::now();
        }
        state = pool
            .monitor
            .wait_timeout(state, GROW_AFTER)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// Runs `job` on a pool thread. The job reports its own outcome and must catch its panics.
pub(crate) fn spawn<F>(job: F)
where
    F: FnOnce() + Send + 'static,
{
    start_monitor_and_core();
    let pool = pool();
    let mut state = lock(pool);
    if state.queue.is_empty() && state.idle == 0 {
        // Nobody was waiting: progress is measured from now, not from the last job long ago.
        state.last_start = Instant::now();
    }
    state.queue.push_back(Box::new(job));
    if state.idle > 0 {
        pool.work.notify_one();
    } else {
        pool.monitor.notify_one();
    }
}
