//! keel-namespace: what users name and see, mapped onto the store's keys.
//!
//! - [`volume`]: block volumes, their generations, snapshots, clones and send/receive streams.
//! - [`object`]: S3 buckets, objects (manifests of content-addressed chunks), multipart uploads.
//!
//! Each module owns a distinct prefix inside the store's `Meta` keyspace ("v/" and "s3/"), so
//! their records never collide.

pub mod object;
pub mod volume;
