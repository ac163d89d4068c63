//! `keel bench`: storage benchmarks that tell the truth, and a durability checker.
//!
//! One profile runs unchanged on every layer of a stack — a local file or block device
//! ([`target::FileTarget`], io_uring with O_DIRECT where possible), a Keel volume over NBD
//! ([`nbd::NbdClient`]), or an S3 bucket ([`s3`]) — timing every operation in an HDR histogram
//! ([`stats`]) and saying what the numbers are worth ([`fsprobe`]: tmpfs, volatile write cache).
//! [`compare`] alternates two targets in rounds; [`report`] turns JSON results into markdown
//! and an SVG CDF; [`durability`] checks that acknowledged writes survive a crash.
//!
//! The `keel` binary wires this in with one variant, `Bench(keel_bench::BenchCommand)`, and a
//! call to [`run`].

pub mod cli;
pub mod compare;
pub mod durability;
pub mod engine;
mod error;
pub mod fsprobe;
pub mod nbd;
pub mod profile;
pub mod report;
pub mod s3;
pub mod stats;
pub mod target;

pub use cli::{run, BenchAction, BenchCommand};
pub use error::BenchError;
pub use profile::{BenchResult, Profile, ResultFile, RunOptions};
