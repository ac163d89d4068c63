//! QoS: per-volume IOPS and bandwidth limits slow I/O down to the configured rate, measured on
//! the wall clock with a bounded number of operations (each case stays under 2 s).
#![allow(clippy::unwrap_used)]

mod volume_support;

use std::time::{Duration, Instant};

use keel_namespace::volume::VolumeSpec;
use volume_support::*;

// Proves an IOPS limit holds: 150 writes at 200 IOPS (20 of burst) take about 0.65 s, while
// the same writes on an unlimited volume are much faster; lifting the limit takes effect on an
// open handle.
#[test]
fn iops_limit_limits() {
    let dir = test_dir("iops");
    let manager = open_manager(&dir);
    let limited = VolumeSpec {
        iops_max: Some(200),
        ..VolumeSpec::new("limited", 1024 * BLOCK)
    };
    manager.create(&limited).unwrap();
    manager
        .create(&VolumeSpec::new("free", 1024 * BLOCK))
        .unwrap();
    let data = pattern(1, BLOCK as usize);
    let run = |name: &str| -> Duration {
        let handle = manager.open_volume(name).unwrap();
        let start = Instant::now();
        for index in 0..150u64 {
            handle.write(index * BLOCK, &data, false).unwrap();
        }
        start.elapsed()
    };
    let free = run("free");
    let slow = run("limited");
    assert!(
        slow >= Duration::from_millis(550),
        "150 ops at 200 IOPS took {slow:?}"
    );
    assert!(
        slow < Duration::from_secs(2),
        "150 ops at 200 IOPS took {slow:?}"
    );
    assert!(free < slow / 2, "unlimited {free:?} vs limited {slow:?}");
    manager.set_limits("limited", None, None).unwrap();
    let lifted = run("limited");
    assert!(
        lifted < Duration::from_millis(400),
        "after lifting: {lifted:?}"
    );
}

// Proves a bandwidth limit holds for reads: 3 MiB at 4 MiB/s (1 MiB of burst) takes about
// 0.5 s.
#[test]
fn bandwidth_limit_limits() {
    let dir = test_dir("bandwidth");
    let manager = open_manager(&dir);
    let spec = VolumeSpec {
        bandwidth_max_mib_per_second: Some(4),
        ..VolumeSpec::new("bw", 1024 * BLOCK)
    };
    manager.create(&spec).unwrap();
    let handle = manager.open_volume("bw").unwrap();
    let mut buf = vec![0u8; 128 << 10];
    let start = Instant::now();
    for index in 0..24u64 {
        handle.read(index * (128 << 10), &mut buf).unwrap();
    }
    let elapsed = start.elapsed();
    assert!(
        elapsed >= Duration::from_millis(420),
        "3 MiB at 4 MiB/s took {elapsed:?}"
    );
    assert!(
        elapsed < Duration::from_secs(2),
        "3 MiB at 4 MiB/s took {elapsed:?}"
    );
}
