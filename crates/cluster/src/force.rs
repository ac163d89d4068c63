//! `keel cluster force-primary`: the explicit, last-resort way for a lone surviving node to go
//! on when the voters it needs are gone for good (two storage nodes and a witness, and both
//! others lost).
//!
//! Run on the stopped survivor's data directory, it appends to its Raft log a membership entry
//! that makes it the only voter, under a term above any it has seen, and records a vote for
//! itself in that term. At the next start its Raft sees a one-voter membership, elects itself
//! and commits everything in its log. This is what etcd's `--force-new-cluster` does, and it is
//! just as dangerous: metadata changes committed by the lost voters and not replicated here are
//! lost, and if a lost node comes back it must be wiped and joined anew (its old log conflicts).

use std::collections::{BTreeMap, BTreeSet};

use keel_catalog::{CatalogState, NodeId};
use keel_store::Store;
use openraft::entry::RaftEntry;
use openraft::{EntryPayload, Membership, Vote};

use crate::log_store::LogStore;
use crate::types::{Entry, RaftNode};
use crate::{read_identity, ClusterError};

/// What force-primary did.
#[derive(Debug, Clone)]
pub struct ForceReport {
    pub node_id: NodeId,
    pub term: u64,
    pub index: u64,
    /// Voters the membership had before.
    pub previous_voters: BTreeSet<NodeId>,
}

/// Makes this data directory's node the only voter of its cluster. The node's server must be
/// stopped.
pub fn force_primary(store: &Store) -> Result<ForceReport, ClusterError> {
    let identity = read_identity(store)?.ok_or_else(|| {
        ClusterError::Config("this data directory is not a member of a cluster".to_string())
    })?;
    let log = LogStore::new(store.clone());
    let vote = log
        .read_vote_now()
        .map_err(|error| ClusterError::Store(error.to_string()))?;
    let (_, last) = log
        .log_state_now()
        .map_err(|error| ClusterError::Store(error.to_string()))?;
    let last_term = last.as_ref().map(|id| id.leader_id.term).unwrap_or(0);
    let vote_term = vote.as_ref().map(|vote| vote.leader_id.term).unwrap_or(0);
    let term = last_term.max(vote_term) + 1;
    let index = last.as_ref().map(|id| id.index() + 1).unwrap_or(0);
    let catalog = CatalogState::load(store, identity.node_id)
        .map_err(|error| ClusterError::Store(error.to_string()))?;
    let me = catalog
        .nodes
        .get(&identity.node_id)
        .ok_or_else(|| ClusterError::Config("this node is not in its own catalog".to_string()))?;
    let previous_voters: BTreeSet<NodeId> = last_membership_voters(&log, index)?;
    let mut nodes = BTreeMap::new();
    nodes.insert(
        identity.node_id,
        RaftNode {
            name: me.name.clone(),
            address: me.addresses.cluster.clone(),
        },
    );
    let voters: BTreeSet<NodeId> = [identity.node_id].into_iter().collect();
    let membership = Membership::new(vec![voters], nodes)
        .map_err(|error| ClusterError::Raft(error.to_string()))?;
    let log_id = openraft::LogId::new(
        openraft::impls::leader_id_adv::LeaderId {
            term,
            node_id: identity.node_id,
        },
        index,
    );
    let entry: Entry = Entry::new(log_id, EntryPayload::Membership(membership));
    log.append_now(vec![entry])
        .map_err(|error| ClusterError::Store(error.to_string()))?;
    log.save_vote_now(&Vote::new_committed(term, identity.node_id))
        .map_err(|error| ClusterError::Store(error.to_string()))?;
    Ok(ForceReport {
        node_id: identity.node_id,
        term,
        index,
        previous_voters,
    })
}

/// Voters of the newest membership entry before `end` (scanning back through the log).
fn last_membership_voters(log: &LogStore, end: u64) -> Result<BTreeSet<NodeId>, ClusterError> {
    let mut entries = log
        .entries_before(end)
        .map_err(|error| ClusterError::Store(error.to_string()))?;
    entries.reverse();
    for entry in entries {
        if let EntryPayload::Membership(membership) = entry.payload {
            return Ok(membership.voter_ids().collect());
        }
    }
    Ok(BTreeSet::new())
}
