//! keel-namespace: what users name and see — volumes, buckets, objects — turned into catalog
//! commands (cluster-wide metadata, through `keel_catalog::Metadata`) and local engine work.
//!
//! - [`volume`]: block volumes, snapshots, clones, send/receive; the block work is the local
//!   volume engine's (`keel_volume`).
//! - [`object`]: S3 buckets and access keys (catalog records), objects (manifests of
//!   content-addressed chunks on this node's store), multipart uploads.

pub mod object;
pub mod volume;
