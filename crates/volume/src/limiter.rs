//! Per-volume QoS: token buckets for operations per second and bytes per second.
//!
//! Each request takes its tokens at once and may drive the bucket into debt; the caller then
//! sleeps until the debt would be repaid. Debt makes the long-run rate exact even for requests
//! larger than the bucket, and concurrent callers queue behind each other's debt. The burst a
//! volume may use after idling is [`BURST_WINDOW`] worth of its rate, and no single wait exceeds
//! [`WAIT_MAX`], so a huge request on a tiny limit cannot stall a connection indefinitely.
//!
//! Time comes through the [`Clock`] trait so a simulation can drive it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Idle time a volume can bank as burst.
pub(crate) const BURST_WINDOW: Duration = Duration::from_millis(100);
/// Longest one request waits for its tokens.
pub(crate) const WAIT_MAX: Duration = Duration::from_secs(5);

/// Source of time and of sleeping.
pub trait Clock: Send + Sync {
    fn now(&self) -> Instant;
    fn sleep(&self, duration: Duration);
}

/// The operating system's clock.
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn sleep(&self, duration: Duration) {
        std::thread::sleep(duration);
    }
}

struct Bucket {
    rate_per_second: f64,
    capacity: f64,
    tokens: f64,
}

impl Bucket {
    fn new(rate_per_second: u64, request_max: f64) -> Bucket {
        let rate_per_second = rate_per_second.max(1) as f64;
        let capacity =
            (rate_per_second * BURST_WINDOW.as_secs_f64()).max(request_max.min(rate_per_second));
        Bucket {
            rate_per_second,
            capacity,
            tokens: capacity,
        }
    }

    fn refill(&mut self, elapsed: Duration) {
        self.tokens =
            (self.tokens + elapsed.as_secs_f64() * self.rate_per_second).min(self.capacity);
    }

    /// Takes `amount` and returns how long the taker must wait to be within the rate.
    fn take(&mut self, amount: f64) -> Duration {
        self.tokens -= amount;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate_per_second)
        }
    }
}

struct LimiterState {
    operations: Option<Bucket>,
    bytes: Option<Bucket>,
    last_refill: Instant,
}

/// IOPS and bandwidth limits of one volume.
pub(crate) struct RateLimiter {
    state: Mutex<LimiterState>,
    clock: Box<dyn Clock>,
}

impl RateLimiter {
    pub fn new(
        iops_max: Option<u64>,
        bandwidth_max_bytes_per_second: Option<u64>,
        clock: Box<dyn Clock>,
    ) -> RateLimiter {
        let now = clock.now();
        RateLimiter {
            state: Mutex::new(LimiterState {
                operations: iops_max.map(|rate| Bucket::new(rate, 1.0)),
                // One 1 MiB request fits into the burst, so large sequential I/O is not chopped.
                bytes: bandwidth_max_bytes_per_second
                    .map(|rate| Bucket::new(rate, (1u64 << 20) as f64)),
                last_refill: now,
            }),
            clock,
        }
    }

    /// Blocks until one operation of `bytes` bytes is within the volume's limits; returns how
    /// long it waited.
    pub fn acquire(&self, bytes: u64) -> Duration {
        let wait = {
            // A poisoned limiter (a panic while holding it) must not stop I/O: limits are QoS,
            // not safety.
            let mut state = match self.state.lock() {
                Ok(state) => state,
                Err(poisoned) => poisoned.into_inner(),
            };
            let now = self.clock.now();
            let elapsed = now.saturating_duration_since(state.last_refill);
            state.last_refill = now;
            let mut wait = Duration::ZERO;
            if let Some(bucket) = state.operations.as_mut() {
                bucket.refill(elapsed);
                wait = wait.max(bucket.take(1.0));
            }
            if let Some(bucket) = state.bytes.as_mut() {
                bucket.refill(elapsed);
                wait = wait.max(bucket.take(bytes as f64));
            }
            wait
        };
        let wait = wait.min(WAIT_MAX);
        if !wait.is_zero() {
            let _phase = keel_ops::Phase::enter(keel_ops::phase::THROTTLED);
            self.clock.sleep(wait);
        }
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A clock that only moves when slept on, recording the total sleep.
    struct FakeClock {
        start: Instant,
        slept: Arc<Mutex<Duration>>,
    }

    impl Clock for FakeClock {
        fn now(&self) -> Instant {
            self.start + *self.slept.lock().expect("test clock")
        }
        fn sleep(&self, duration: Duration) {
            *self.slept.lock().expect("test clock") += duration;
        }
    }

    // Proves the bucket enforces the configured IOPS over many operations: 1000 ops at 100
    // IOPS need about 10 s of (simulated) sleeping, minus the burst.
    #[test]
    fn iops_limit_holds_long_run_rate() {
        let slept = Arc::new(Mutex::new(Duration::ZERO));
        let clock = FakeClock {
            start: Instant::now(),
            slept: slept.clone(),
        };
        let limiter = RateLimiter::new(Some(100), None, Box::new(clock));
        for _ in 0..1000 {
            limiter.acquire(4096);
        }
        let total = slept.lock().expect("test clock").as_secs_f64();
        assert!((9.8..=10.1).contains(&total), "slept {total} s");
    }

    // Proves the byte limit applies: 100 MiB at 10 MiB/s takes about 10 s.
    #[test]
    fn bandwidth_limit_holds_long_run_rate() {
        let slept = Arc::new(Mutex::new(Duration::ZERO));
        let clock = FakeClock {
            start: Instant::now(),
            slept: slept.clone(),
        };
        let limiter = RateLimiter::new(None, Some(10 << 20), Box::new(clock));
        for _ in 0..100 {
            limiter.acquire(1 << 20);
        }
        let total = slept.lock().expect("test clock").as_secs_f64();
        assert!((9.8..=10.1).contains(&total), "slept {total} s");
    }
}
