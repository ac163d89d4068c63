//! keel-replication: synchronous replication of volumes across nodes.
//!
//! This crate starts with the protocol's core as a pure state machine ([`protocol`]): what a
//! data node does with each message about one replicated volume, with no I/O, clock or network.
//! The I/O engine (streaming writes over `keel-rpc`, fdatasync through the local volume engine,
//! Raft proposals through `keel-cluster`) drives these same transitions; `tests/model.rs` checks
//! them exhaustively with stateright against crashes, lost and reordered messages.
//!
//! The contract (`docs/volumes.md`, replication): a FLUSH is acknowledged only when every write
//! acknowledged before it is durable on every member of the volume's in-sync replica set (ISR),
//! which Raft records per volume as `{epoch, primary, isr}`; a member that stops answering is
//! removed from the ISR through Raft (epoch + 1) before a FLUSH completes without it; replicas
//! refuse messages of an older epoch, so a primary that lost its place cannot get a FLUSH
//! acknowledged.

pub mod protocol;
