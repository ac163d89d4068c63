//! The Raft type configuration: what the metadata log carries (catalog commands), what applying
//! an entry answers, and what openraft knows about a node (its name and cluster address).

use std::fmt;

use keel_catalog::{CatalogError, Outcome};
use serde::{Deserialize, Serialize};

use crate::messages::Proposal;
use crate::state_machine::StateMachine;

/// A member as openraft's membership config records it: enough to dial it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RaftNode {
    pub name: String,
    /// Node-to-node RPC address (`host:port`).
    pub address: String,
}

impl fmt::Display for RaftNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.name, self.address)
    }
}

/// What applying one entry answered: the command's outcome or its deterministic refusal
/// (membership and blank entries answer `Done`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandResult(pub Result<Outcome, CatalogError>);

#[cfg(not(feature = "simulation"))]
openraft::declare_raft_types!(
    /// Keel's metadata Raft group.
    pub TypeConfig:
        D = Proposal,
        R = CommandResult,
        NodeId = u64,
        Node = RaftNode,
);

#[cfg(feature = "simulation")]
openraft::declare_raft_types!(
    /// Keel's metadata Raft group, with openraft's randomness from a seeded generator (the
    /// deterministic simulation in `sim/`).
    pub TypeConfig:
        D = Proposal,
        R = CommandResult,
        NodeId = u64,
        Node = RaftNode,
        AsyncRuntime = openraft_rt::deterministic_rng::DeterministicRng<openraft::TokioRuntime>,
);

pub type Raft = openraft::Raft<TypeConfig, StateMachine>;
pub type LogId = openraft::alias::LogIdOf<TypeConfig>;
pub type Vote = openraft::alias::VoteOf<TypeConfig>;
pub type Entry = openraft::alias::EntryOf<TypeConfig>;
pub type StoredMembership = openraft::alias::StoredMembershipOf<TypeConfig>;
pub type SnapshotMeta = openraft::alias::SnapshotMetaOf<TypeConfig>;
pub type Snapshot = openraft::alias::SnapshotOf<TypeConfig, Vec<u8>>;
