//! The cluster's calls between nodes: method numbers and message shapes (postcard-encoded).
//! Method numbers are part of the wire protocol: never reuse one. A new message's types go in
//! `crates/keel/tests/protocol.rs`, and any change of a message's shape comes with a new
//! `keel_rpc::handshake::PROTOCOL` (that test fails until it does).

use keel_catalog::{Command, NodeId, NodeSpec};
use serde::{Deserialize, Serialize};

use crate::types::CommandResult;

pub const METHOD_RAFT_APPEND: u16 = 1;
pub const METHOD_RAFT_VOTE: u16 = 2;
pub const METHOD_RAFT_SNAPSHOT: u16 = 3;
pub const METHOD_RAFT_TRANSFER_LEADER: u16 = 4;
pub const METHOD_RAFT_PRE_VOTE: u16 = 5;
pub const METHOD_JOIN: u16 = 10;
pub const METHOD_PROPOSE: u16 = 11;
pub const METHOD_HEARTBEAT: u16 = 12;
pub const METHOD_STATUS: u16 = 13;
/// How long the leader has heard nothing from a node (a failover waits out its lease).
pub const METHOD_SILENCE: u16 = 14;
/// Asks the leader to hand its leadership to a voter (a node id).
pub const METHOD_TRANSFER_LEADERSHIP: u16 = 15;
/// Asks the leader for an index that covers every command committed before the call (a read
/// barrier: the caller then waits until it applied that far).
pub const METHOD_READ_INDEX: u16 = 16;
/// Methods from this number up belong to the layers above the cluster (replication).
pub const METHOD_FIRST_ABOVE: u16 = 256;

/// Error codes in a [`crate::transport::RemoteFailure`].
pub const CODE_NOT_READY: u16 = 1;
pub const CODE_NOT_LEADER: u16 = 2;
pub const CODE_REFUSED: u16 = 3;
pub const CODE_BAD_REQUEST: u16 = 4;
pub const CODE_FAILED: u16 = 5;

/// A command with the id that makes retrying it safe: the state machine applies each id once
/// and answers a repeat with the first outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proposal {
    pub id: [u8; 16],
    pub command: Command,
}

impl std::fmt::Display for Proposal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.command.kind())
    }
}

/// The leader's answer to a forwarded proposal: the outcome and the index it was applied at
/// (the forwarding node waits until it applied that far, so its caller reads its own write).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Proposed {
    pub result: CommandResult,
    pub index: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinRequest {
    pub node: NodeSpec,
    /// Random, made once per data directory: a join retried after a crash is recognised.
    pub instance: [u8; 16],
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinResponse {
    pub node_id: NodeId,
    pub cluster_id: [u8; 16],
}

/// What each node tells the leader about itself, every heartbeat interval.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    pub node_id: NodeId,
    /// Free bytes per data directory, in the node record's device order.
    pub device_free_bytes: Vec<u64>,
    pub poisoned: bool,
    /// The node's wall clock when it sent this (for clock-skew checks).
    pub sent_unix_ms: i64,
    pub version: String,
}
