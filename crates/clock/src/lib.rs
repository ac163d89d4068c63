//! keel-clock: the one clock every timeout and time read in Keel goes through, so a simulation
//! can run the real code on simulated time and make wall clocks jump.
//!
//! - Monotonic time and async sleeps come from tokio's clock: under a runtime with paused time
//!   (tokio's test-util, a simulation) they are simulated; otherwise they are the OS's.
//! - Wall time (`SystemTime`) is separate and may jump: [`SimClock`] adds an offset that a test
//!   moves forward or back.
//! - Synchronous callers (the volume QoS limiter on NBD threads) sleep with
//!   [`Clock::sleep_blocking`].

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// Monotonic time.
    fn now(&self) -> Instant;
    /// Wall-clock time; may jump (NTP steps, a simulation).
    fn wall(&self) -> SystemTime;
    /// Sleeps asynchronously.
    fn sleep(&self, duration: Duration) -> Sleep;
    /// Sleeps the calling thread (synchronous code only).
    fn sleep_blocking(&self, duration: Duration);

    /// Milliseconds since the Unix epoch on the wall clock (0 before it).
    fn wall_unix_ms(&self) -> i64 {
        self.wall()
            .duration_since(UNIX_EPOCH)
            .map(|elapsed| elapsed.as_millis() as i64)
            .unwrap_or(0)
    }
}

/// The real clock (tokio's monotonic clock, the OS wall clock).
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn wall(&self) -> SystemTime {
        SystemTime::now()
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        Box::pin(tokio::time::sleep(duration))
    }

    fn sleep_blocking(&self, duration: Duration) {
        std::thread::sleep(duration);
    }
}

/// A clock for simulations and tests: tokio's (pausable) monotonic time, and a wall clock that
/// starts at a fixed instant, advances with monotonic time, and jumps when told to.
#[derive(Debug)]
pub struct SimClock {
    origin_monotonic: Instant,
    origin_wall: SystemTime,
    offset_ms: AtomicI64,
}

impl SimClock {
    /// A wall clock starting at `origin_wall` now.
    pub fn new(origin_wall: SystemTime) -> SimClock {
        SimClock {
            origin_monotonic: tokio::time::Instant::now().into_std(),
            origin_wall,
            offset_ms: AtomicI64::new(0),
        }
    }

    /// Moves the wall clock by `delta_ms` (negative: backwards).
    pub fn jump_wall(&self, delta_ms: i64) {
        self.offset_ms.fetch_add(delta_ms, Ordering::SeqCst);
    }
}

impl Clock for SimClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn wall(&self) -> SystemTime {
        let elapsed = self.now().saturating_duration_since(self.origin_monotonic);
        let offset = self.offset_ms.load(Ordering::SeqCst);
        let base = self.origin_wall + elapsed;
        if offset >= 0 {
            base + Duration::from_millis(offset as u64)
        } else {
            base.checked_sub(Duration::from_millis(offset.unsigned_abs()))
                .unwrap_or(UNIX_EPOCH)
        }
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        Box::pin(tokio::time::sleep(duration))
    }

    fn sleep_blocking(&self, duration: Duration) {
        std::thread::sleep(duration);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves simulated time drives the monotonic clock and sleeps, and wall jumps move only the
    // wall clock.
    #[tokio::test(start_paused = true)]
    async fn simulated_time_and_wall_jumps() {
        let origin = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let clock = SimClock::new(origin);
        let start = clock.now();
        clock.sleep(Duration::from_secs(3600)).await;
        assert_eq!(clock.now() - start, Duration::from_secs(3600));
        assert_eq!(clock.wall(), origin + Duration::from_secs(3600));
        clock.jump_wall(-7_200_000);
        assert_eq!(clock.wall(), origin - Duration::from_secs(3600));
        assert_eq!(
            clock.now() - start,
            Duration::from_secs(3600),
            "monotonic unaffected"
        );
        assert_eq!(clock.wall_unix_ms(), 996_400_000);
    }
}
