//! keel-ops: the requests in flight and the recent slowest, each with the time it spent in each
//! phase (Ceph's `dump_ops_in_flight` and `dump_historic_ops`, for Keel).
//!
//! A frontend calls [`Ops::start`] when a request arrives and holds the returned [`OpGuard`]
//! until the answer is on its way. Code below the frontend names the phase the request is in
//! without being handed anything: [`Phase::enter`] marks the request the calling thread works
//! for (set by [`OpGuard::enter`] or [`OpHandle::enter`]), and restores the phase before it when
//! dropped. The store marks its group-commit wait, `pwrite`, `fdatasync` and index update this
//! way; on a thread that serves no request the marks cost one thread-local read.
//!
//! Finished requests are kept in two bounded lists: the [`SLOWEST_MAX`] slowest of the last
//! [`WINDOW`], and the last [`OVER_THRESHOLD_MAX`] that took longer than the slow threshold.
//! Most requests are faster than the slowest kept and cost only two atomic reads to finish.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use keel_clock::Clock;
use serde::Serialize;

/// How far back the slowest requests are kept.
pub const WINDOW: Duration = Duration::from_secs(600);
/// Slowest finished requests kept (of the last [`WINDOW`]).
pub const SLOWEST_MAX: usize = 100;
/// Requests over the slow threshold kept, the most recent.
pub const OVER_THRESHOLD_MAX: usize = 1000;
/// Requests slower than this are kept whatever else is slower.
pub const DEFAULT_SLOW_THRESHOLD: Duration = Duration::from_secs(1);

const SHARDS: usize = 16;

/// The phases Keel's layers mark. A request starts in [`RECEIVING`].
pub mod phase {
    /// Reading the request (an NBD write's payload, an S3 body).
    pub const RECEIVING: &str = "receiving";
    /// Waiting before any work: buffer budget, earlier writes a flush waits for, QoS.
    pub const QUEUED: &str = "queued";
    /// In the object layer (S3): metadata, reads, and writes before the store's own phases.
    pub const HANDLING: &str = "handling";
    /// Held back by the volume's QoS limits (IOPS, bandwidth).
    pub const THROTTLED: &str = "throttled";
    /// Reading data (the store's index and log).
    pub const READING: &str = "reading";
    /// Writing, before the store's own phases (splitting into blocks, compressing).
    pub const WRITING: &str = "writing";
    /// Waiting for another writer's group commit to take this write along.
    pub const COMMIT_WAIT: &str = "group commit wait";
    /// Appending the group commit's batch to the log.
    pub const PWRITE: &str = "pwrite";
    /// Syncing the log.
    pub const FDATASYNC: &str = "fdatasync";
    /// Updating the index after the log write.
    pub const APPLYING: &str = "applying";
    /// Waiting for the volume's replicas to acknowledge.
    pub const REPLICATING: &str = "replicating";
    /// Waiting for the volume's primary on another node to answer a forwarded request.
    pub const FORWARDED: &str = "forwarded to the primary";
    /// Making earlier writes durable (an NBD flush, before the store's phases).
    pub const FLUSHING: &str = "flushing";
    /// Handing the answer to the client.
    pub const REPLYING: &str = "replying";
}

/// What a request works on.
#[derive(Debug, Clone)]
pub enum Target {
    None,
    /// A byte range of a block volume.
    Volume {
        name: Arc<str>,
        offset: u64,
        length: u64,
    },
    /// An S3 path (`bucket/key`, or `bucket`).
    Path(String),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::None => Ok(()),
            Target::Volume {
                name,
                offset,
                length,
            } if *length == 0 => f.write_str(name),
            Target::Volume {
                name,
                offset,
                length,
            } => write!(f, "{name} offset {offset} length {length}"),
            Target::Path(path) => f.write_str(path),
        }
    }
}

/// A request as it arrives.
#[derive(Debug, Clone)]
pub struct Start {
    /// `nbd`, `s3`.
    pub frontend: &'static str,
    /// The command or method: `write`, `flush`, `PUT`.
    pub operation: &'static str,
    pub target: Target,
    pub client: Option<SocketAddr>,
}

/// The tracker of one server; cheap to clone. [`Ops::disabled`] tracks nothing but still
/// counts requests ([`Ops::requests_started`]).
#[derive(Clone)]
pub struct Ops {
    inner: Option<Arc<Inner>>,
    started: Arc<AtomicU64>,
}

struct Inner {
    clock: Arc<dyn Clock>,
    /// Monotonic origin of `*_ms` fields below.
    origin: Instant,
    slow_threshold: Duration,
    in_flight: Vec<Mutex<HashMap<u64, Arc<Op>>>>,
    history: Mutex<History>,
    /// Nanoseconds of the fastest request in `history.slowest` once it is full (0 before): a
    /// request no slower, under the threshold, is not kept.
    floor_nanos: AtomicU64,
    /// When the oldest request in `history.slowest` finished (ms since `origin`; `u64::MAX` when
    /// none): once it leaves the window, the next finish prunes.
    oldest_finished_ms: AtomicU64,
}

#[derive(Default)]
struct History {
    slowest: Vec<Finished>,
    over_threshold: VecDeque<Finished>,
}

#[derive(Clone)]
struct Finished {
    op: Arc<Op>,
    duration: Duration,
    finished_ms: u64,
}

struct Op {
    id: u64,
    start: Start,
    started: Instant,
    started_unix_ms: i64,
    log: Mutex<PhaseLog>,
}

struct PhaseLog {
    current: &'static str,
    since: Instant,
    /// Time spent per phase, in the order first entered (the current phase's running time is
    /// not in it yet).
    spent: Vec<(&'static str, Duration)>,
    /// Waits for others that overlap the phases (each replica's confirmation), as marked.
    waited_for: Vec<(String, Duration)>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl PhaseLog {
    fn add(&mut self, phase: &'static str, spent: Duration) {
        match self.spent.iter_mut().find(|(name, _)| *name == phase) {
            Some((_, total)) => *total += spent,
            None => self.spent.push((phase, spent)),
        }
    }

    /// Switches to `phase` at `now`; returns the phase left.
    fn switch(&mut self, phase: &'static str, now: Instant) -> &'static str {
        let left = self.current;
        if left != phase {
            let spent = now.saturating_duration_since(self.since);
            self.add(left, spent);
            self.current = phase;
            self.since = now;
        }
        left
    }

    /// Per-phase times with the current phase counted up to `now`.
    fn report(&self, now: Instant) -> Vec<PhaseTime> {
        let mut spent = self.spent.clone();
        let running = now.saturating_duration_since(self.since);
        match spent.iter_mut().find(|(name, _)| *name == self.current) {
            Some((_, total)) => *total += running,
            None => spent.push((self.current, running)),
        }
        spent
            .into_iter()
            .map(|(phase, spent)| PhaseTime {
                phase,
                ms: millis(spent),
            })
            .collect()
    }
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// A request and the tracker it belongs to.
type Tracked = (Arc<Inner>, Arc<Op>);

thread_local! {
    /// The request the calling thread works for.
    static CURRENT: RefCell<Option<Tracked>> = const { RefCell::new(None) };
}

impl Ops {
    /// A tracker with the given slow threshold, on `clock`.
    pub fn new(clock: Arc<dyn Clock>, slow_threshold: Duration) -> Ops {
        let origin = clock.now();
        Ops {
            inner: Some(Arc::new(Inner {
                clock,
                origin,
                slow_threshold,
                in_flight: (0..SHARDS).map(|_| Mutex::default()).collect(),
                history: Mutex::default(),
                floor_nanos: AtomicU64::new(0),
                oldest_finished_ms: AtomicU64::new(u64::MAX),
            })),
            started: Arc::default(),
        }
    }

    /// A tracker that tracks nothing (tests, benchmarks of the cost of tracking).
    pub fn disabled() -> Ops {
        Ops {
            inner: None,
            started: Arc::default(),
        }
    }

    /// How many client requests (of every frontend, volume and bucket) this server has
    /// started: background work that sees it move yields to clients of the same disks.
    pub fn requests_started(&self) -> u64 {
        self.started.load(Ordering::Relaxed)
    }

    /// Registers a request in flight, in phase [`phase::RECEIVING`]; it finishes when the
    /// guard drops.
    pub fn start(&self, start: Start) -> OpGuard {
        // The count of requests started is also the request's id (from 1).
        let id = self.started.fetch_add(1, Ordering::Relaxed) + 1;
        let Some(inner) = &self.inner else {
            return OpGuard {
                handle: OpHandle { tracked: None },
            };
        };
        let now = inner.clock.now();
        let op = Arc::new(Op {
            id,
            start,
            started: now,
            started_unix_ms: inner.clock.wall_unix_ms(),
            log: Mutex::new(PhaseLog {
                current: phase::RECEIVING,
                since: now,
                spent: Vec::with_capacity(6),
                waited_for: Vec::new(),
            }),
        });
        lock(inner.shard(op.id)).insert(op.id, Arc::clone(&op));
        OpGuard {
            handle: OpHandle {
                tracked: Some((Arc::clone(inner), op)),
            },
        }
    }

    /// Everything tracked now.
    pub fn report(&self) -> OpsReport {
        let Some(inner) = &self.inner else {
            return OpsReport {
                tracking: false,
                slow_threshold_ms: 0.0,
                window_seconds: WINDOW.as_secs(),
                in_flight: Vec::new(),
                slowest: Vec::new(),
                over_threshold: Vec::new(),
            };
        };
        let now = inner.clock.now();
        let mut in_flight: Vec<OpReport> = inner
            .in_flight
            .iter()
            .flat_map(|shard| lock(shard).values().cloned().collect::<Vec<_>>())
            .map(|op| op.report(now.saturating_duration_since(op.started), now, true))
            .collect();
        in_flight.sort_by(|a, b| b.duration_ms.total_cmp(&a.duration_ms));
        let (slowest, over_threshold) = {
            let mut history = lock(&inner.history);
            inner.prune(&mut history, inner.ms_since_origin(now));
            (history.slowest.clone(), history.over_threshold.clone())
        };
        let finished = |list: Vec<Finished>| -> Vec<OpReport> {
            list.into_iter()
                .map(|f| {
                    let end = f.op.started + f.duration;
                    f.op.report(f.duration, end, false)
                })
                .collect()
        };
        let mut slowest = finished(slowest);
        slowest.sort_by(|a, b| b.duration_ms.total_cmp(&a.duration_ms));
        let mut over_threshold = finished(over_threshold.into_iter().collect());
        over_threshold.reverse();
        OpsReport {
            tracking: true,
            slow_threshold_ms: millis(inner.slow_threshold),
            window_seconds: WINDOW.as_secs(),
            in_flight,
            slowest,
            over_threshold,
        }
    }
}

impl Inner {
    fn shard(&self, id: u64) -> &Mutex<HashMap<u64, Arc<Op>>> {
        &self.in_flight[(id % SHARDS as u64) as usize]
    }

    fn ms_since_origin(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.origin).as_millis() as u64
    }

    fn finish(&self, op: &Arc<Op>) {
        let now = self.clock.now();
        lock(self.shard(op.id)).remove(&op.id);
        let duration = now.saturating_duration_since(op.started);
        let now_ms = self.ms_since_origin(now);
        let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let oldest = self.oldest_finished_ms.load(Ordering::Relaxed);
        let window_ms = WINDOW.as_millis() as u64;
        if duration < self.slow_threshold
            && nanos <= self.floor_nanos.load(Ordering::Relaxed)
            && (oldest == u64::MAX || now_ms.saturating_sub(oldest) < window_ms)
        {
            return;
        }
        // Close the last phase at the finish.
        lock(&op.log).switch("", now);
        let finished = Finished {
            op: Arc::clone(op),
            duration,
            finished_ms: now_ms,
        };
        let mut history = lock(&self.history);
        self.prune(&mut history, now_ms);
        if duration >= self.slow_threshold {
            if history.over_threshold.len() == OVER_THRESHOLD_MAX {
                history.over_threshold.pop_front();
            }
            history.over_threshold.push_back(finished.clone());
        }
        if history.slowest.len() < SLOWEST_MAX {
            history.slowest.push(finished);
        } else if let Some(fastest) = history
            .slowest
            .iter_mut()
            .min_by_key(|kept| kept.duration)
            .filter(|kept| kept.duration < duration)
        {
            *fastest = finished;
        }
        self.refresh_marks(&history);
    }

    /// Drops requests that finished before the window.
    fn prune(&self, history: &mut History, now_ms: u64) {
        let window_ms = WINDOW.as_millis() as u64;
        let before = history.slowest.len();
        history
            .slowest
            .retain(|kept| now_ms.saturating_sub(kept.finished_ms) < window_ms);
        if history.slowest.len() != before {
            self.refresh_marks(history);
        }
    }

    fn refresh_marks(&self, history: &History) {
        let floor = if history.slowest.len() < SLOWEST_MAX {
            0
        } else {
            history
                .slowest
                .iter()
                .map(|kept| u64::try_from(kept.duration.as_nanos()).unwrap_or(u64::MAX))
                .min()
                .unwrap_or(0)
        };
        let oldest = history
            .slowest
            .iter()
            .map(|kept| kept.finished_ms)
            .min()
            .unwrap_or(u64::MAX);
        self.floor_nanos.store(floor, Ordering::Relaxed);
        self.oldest_finished_ms.store(oldest, Ordering::Relaxed);
    }
}

impl Op {
    fn report(&self, duration: Duration, now: Instant, in_flight: bool) -> OpReport {
        let log = lock(&self.log);
        let mut phases = log.report(now);
        phases.retain(|p| !p.phase.is_empty());
        OpReport {
            id: self.id,
            frontend: self.start.frontend,
            operation: self.start.operation,
            target: self.start.target.to_string(),
            client: self.start.client.map(|c| c.to_string()),
            started_unix_ms: self.started_unix_ms,
            duration_ms: millis(duration),
            phase: in_flight.then_some(log.current),
            phases,
            waited_for: log
                .waited_for
                .iter()
                .map(|(what, took)| WaitTime {
                    what: what.clone(),
                    ms: millis(*took),
                })
                .collect(),
        }
    }

    fn switch(&self, phase: &'static str, now: Instant) -> &'static str {
        lock(&self.log).switch(phase, now)
    }
}

/// A request in flight; finishes when dropped.
pub struct OpGuard {
    handle: OpHandle,
}

impl OpGuard {
    /// Moves the request to `phase`.
    pub fn phase(&self, phase: &'static str) {
        self.handle.phase(phase);
    }

    /// Runs `work` on this thread as work for this request (see [`Phase::enter`]).
    pub fn enter<T>(&self, work: impl FnOnce() -> T) -> T {
        self.handle.enter(work)
    }

    /// A handle for other threads and tasks working for this request.
    pub fn handle(&self) -> OpHandle {
        self.handle.clone()
    }
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        if let Some((inner, op)) = self.handle.tracked.take() {
            inner.finish(&op);
        }
    }
}

/// Lets other threads mark phases of a request in flight; finishing stays with its
/// [`OpGuard`].
#[derive(Clone)]
pub struct OpHandle {
    tracked: Option<Tracked>,
}

impl OpHandle {
    /// Moves the request to `phase`.
    pub fn phase(&self, phase: &'static str) {
        if let Some((inner, op)) = &self.tracked {
            op.switch(phase, inner.clock.now());
        }
    }

    /// Runs `work` with this request as the calling thread's, so [`Phase::enter`] inside it
    /// marks this request.
    pub fn enter<T>(&self, work: impl FnOnce() -> T) -> T {
        if self.tracked.is_none() {
            return work();
        }
        let previous = CURRENT.with(|current| current.replace(self.tracked.clone()));
        let _restore = Restore(Some(previous));
        work()
    }
}

/// Puts the thread's previous request back, also when the work panics.
struct Restore(Option<Option<Tracked>>);

impl Drop for Restore {
    fn drop(&mut self) {
        if let Some(previous) = self.0.take() {
            CURRENT.with(|current| *current.borrow_mut() = previous);
        }
    }
}

/// The calling thread's request in a phase until dropped, then back in the phase before.
/// Holds no reference to the request (the store enters phases on every write, from many
/// threads at once): the drop finds it again through the thread's current request, by id.
/// A future holding one may move to another thread (a served request awaited inside a
/// handler's task): dropped there, it finds no request with its id and does nothing.
pub struct Phase {
    /// The request's id and the phase to go back to.
    entered: Option<(u64, &'static str)>,
}

impl Phase {
    /// Moves the calling thread's request (if any) to `phase`.
    pub fn enter(phase: &'static str) -> Phase {
        let entered = CURRENT.with(|current| {
            current
                .borrow()
                .as_ref()
                .map(|(inner, op)| (op.id, op.switch(phase, inner.clock.now())))
        });
        Phase { entered }
    }
}

impl Drop for Phase {
    fn drop(&mut self) {
        if let Some((id, previous)) = self.entered.take() {
            CURRENT.with(|current| {
                if let Some((inner, op)) = current.borrow().as_ref().filter(|(_, op)| op.id == id) {
                    op.switch(previous, inner.clock.now());
                }
            });
        }
    }
}

/// Whether the calling thread works for a tracked request (so marks reach one).
pub fn tracking() -> bool {
    CURRENT.with(|current| current.borrow().is_some())
}

/// Records that the calling thread's request (if any) waited `took` for `what` (built only
/// when there is a request): waits that overlap each other and the phases, such as each
/// replica's confirmation of a flush.
pub fn waited_for(what: impl FnOnce() -> String, took: Duration) {
    CURRENT.with(|current| {
        if let Some((_, op)) = current.borrow().as_ref() {
            lock(&op.log).waited_for.push((what(), took));
        }
    });
}

/// How long a request waited for something that overlaps its phases.
#[derive(Debug, Clone, Serialize)]
pub struct WaitTime {
    pub what: String,
    pub ms: f64,
}

/// Time spent in one phase.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseTime {
    pub phase: &'static str,
    pub ms: f64,
}

/// One request, in flight or finished.
#[derive(Debug, Clone, Serialize)]
pub struct OpReport {
    pub id: u64,
    pub frontend: &'static str,
    pub operation: &'static str,
    pub target: String,
    pub client: Option<String>,
    pub started_unix_ms: i64,
    /// For a request in flight, its age.
    pub duration_ms: f64,
    /// The phase a request in flight is in now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<&'static str>,
    pub phases: Vec<PhaseTime>,
    /// Waits that overlap the phases: `replica on node N` (a flush's wait for each replica
    /// counted for flushes, from the flush's start until that replica confirmed).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub waited_for: Vec<WaitTime>,
}

/// `GET /api/v1/ops`.
#[derive(Debug, Clone, Serialize)]
pub struct OpsReport {
    /// False when the server runs with tracking off.
    pub tracking: bool,
    pub slow_threshold_ms: f64,
    pub window_seconds: u64,
    /// Oldest first.
    pub in_flight: Vec<OpReport>,
    /// The slowest of the window, slowest first.
    pub slowest: Vec<OpReport>,
    /// Over the threshold, most recent first.
    pub over_threshold: Vec<OpReport>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    /// Time that moves only when a test moves it.
    #[derive(Debug)]
    struct ManualClock {
        now: Mutex<Instant>,
    }

    impl Clock for ManualClock {
        fn now(&self) -> Instant {
            *lock(&self.now)
        }
        fn wall(&self) -> SystemTime {
            SystemTime::UNIX_EPOCH
        }
        fn sleep(&self, duration: Duration) -> keel_clock::Sleep {
            self.sleep_blocking(duration);
            Box::pin(std::future::ready(()))
        }
        fn sleep_blocking(&self, duration: Duration) {
            *lock(&self.now) += duration;
        }
    }

    fn start(operation: &'static str) -> Start {
        Start {
            frontend: "nbd",
            operation,
            target: Target::Volume {
                name: Arc::from("db"),
                offset: 4096,
                length: 8192,
            },
            client: "127.0.0.1:4000".parse().ok(),
        }
    }

    fn ops() -> (Ops, impl Fn(Duration)) {
        let clock = Arc::new(ManualClock {
            now: Mutex::new(Instant::now()),
        });
        let ops = Ops::new(clock.clone(), Duration::from_secs(1));
        (ops, move |by| clock.sleep_blocking(by))
    }

    fn ms(report: &OpReport, phase: &str) -> f64 {
        report
            .phases
            .iter()
            .find(|p| p.phase == phase)
            .map_or(0.0, |p| p.ms)
    }

    #[test]
    fn a_request_in_flight_shows_its_phases_marked_below_it() {
        let (ops, advance) = ops();
        let guard = ops.start(start("write"));
        advance(Duration::from_millis(3));
        guard.phase(phase::WRITING);
        guard.enter(|| {
            let _wait = Phase::enter(phase::COMMIT_WAIT);
            advance(Duration::from_millis(20));
            {
                let _sync = Phase::enter(phase::FDATASYNC);
                advance(Duration::from_millis(7));
                let report = ops.report();
                assert_eq!(report.in_flight.len(), 1);
                assert_eq!(report.in_flight[0].phase, Some(phase::FDATASYNC));
            }
            advance(Duration::from_millis(5));
        });
        guard.enter(|| {
            assert!(tracking());
            waited_for(|| "replica on node 2".to_string(), Duration::from_millis(9));
        });
        // Outside `enter`, marks reach no request.
        assert!(!tracking());
        waited_for(|| unreachable!("built only for a request"), Duration::ZERO);
        drop(Phase::enter(phase::PWRITE));
        let report = ops.report();
        let op = &report.in_flight[0];
        assert_eq!(op.phase, Some(phase::WRITING), "back in the phase before");
        assert_eq!(op.target, "db offset 4096 length 8192");
        assert_eq!(op.client.as_deref(), Some("127.0.0.1:4000"));
        assert_eq!(ms(op, phase::RECEIVING), 3.0);
        assert_eq!(ms(op, phase::COMMIT_WAIT), 25.0);
        assert_eq!(ms(op, phase::FDATASYNC), 7.0);
        assert_eq!(ms(op, phase::PWRITE), 0.0);
        assert_eq!(op.duration_ms, 35.0);
        assert_eq!(op.waited_for.len(), 1);
        assert_eq!(
            (op.waited_for[0].what.as_str(), op.waited_for[0].ms),
            ("replica on node 2", 9.0)
        );
        drop(guard);
        let report = ops.report();
        assert!(report.in_flight.is_empty());
        assert_eq!(report.slowest.len(), 1);
        assert_eq!(report.slowest[0].phase, None);
        assert!(report.over_threshold.is_empty(), "under the threshold");
    }

    #[test]
    fn only_the_slowest_of_the_window_and_those_over_the_threshold_are_kept() {
        let (ops, advance) = ops();
        // Requests of 1..=150 ms, then one of 2 s.
        for millis in 1..=150u64 {
            let guard = ops.start(start("read"));
            advance(Duration::from_millis(millis));
            drop(guard);
        }
        let slow = ops.start(start("flush"));
        advance(Duration::from_secs(2));
        drop(slow);
        let report = ops.report();
        assert_eq!(report.slowest.len(), SLOWEST_MAX);
        assert_eq!(report.slowest[0].duration_ms, 2000.0);
        assert_eq!(report.slowest[1].duration_ms, 150.0);
        let fastest = report.slowest.last().map(|op| op.duration_ms);
        assert_eq!(fastest, Some(52.0), "the 100 slowest: 2 s and 52..=150 ms");
        assert_eq!(report.over_threshold.len(), 1);
        assert_eq!(report.over_threshold[0].operation, "flush");

        // Once the window has passed, a fast request is kept again.
        advance(WINDOW);
        let quick = ops.start(start("read"));
        advance(Duration::from_millis(1));
        drop(quick);
        let report = ops.report();
        assert_eq!(report.slowest.len(), 1);
        assert_eq!(report.slowest[0].duration_ms, 1.0);
        assert_eq!(report.over_threshold.len(), 1, "kept beyond the window");
    }

    #[test]
    fn over_threshold_keeps_the_most_recent() {
        let (ops, advance) = ops();
        for _ in 0..OVER_THRESHOLD_MAX + 5 {
            let guard = ops.start(start("write"));
            advance(Duration::from_secs(1));
            drop(guard);
        }
        let report = ops.report();
        assert_eq!(report.over_threshold.len(), OVER_THRESHOLD_MAX);
        let newest = report.over_threshold.first().map(|op| op.id);
        assert_eq!(newest, Some(OVER_THRESHOLD_MAX as u64 + 5));
    }

    #[test]
    fn a_disabled_tracker_tracks_nothing() {
        let ops = Ops::disabled();
        let guard = ops.start(start("write"));
        guard.enter(|| drop(Phase::enter(phase::FDATASYNC)));
        let report = ops.report();
        assert!(!report.tracking);
        assert!(report.in_flight.is_empty());
        drop(guard);
        assert!(ops.report().slowest.is_empty());
    }
}
