//! The leader's policies, as pure functions (so tests can check them without a cluster):
//! which nodes should vote, when a silent node is suspect or down, and what the cluster's
//! health is.
//!
//! Voters: an odd number (a quorum of an even set tolerates no more failures than one member
//! fewer), at most the configured target (1, 3 or 5), chosen among healthy members (up, not
//! draining, not removed): current voters first (changing the voter set costs a joint
//! consensus round), then a witness (it exists to vote), then learners that caught up with the
//! log (a lagging voter would stall commits until it caught up), lowest id first. A change that
//! cannot reach an odd size keeps the current set, unless a voter was removed from the cluster.

use std::collections::BTreeSet;
use std::time::Duration;

use keel_catalog::{NodeId, NodeRecord, NodeRole, NodeState};

use crate::{ClusterConfig, HealthCheck, NodeStatus, RaftRole, Timing};

/// A learner at most this many entries behind the leader counts as caught up.
pub const CAUGHT_UP_LAG_ENTRIES: u64 = 64;
/// Clocks further apart than this are reported (leases and lifecycle rules read clocks).
pub const CLOCK_SKEW_WARN_MS: i64 = 1000;

/// Liveness from how long a node has been silent.
pub fn verdict(timing: &Timing, silent: Duration) -> NodeState {
    if silent >= timing.down_after {
        NodeState::Down
    } else if silent >= timing.suspect_after {
        NodeState::Suspect
    } else {
        NodeState::Up
    }
}

fn healthy(node: &NodeRecord) -> bool {
    !node.removed && !node.draining && node.state == NodeState::Up
}

/// The voter set the leader should move to.
pub fn desired_voters(
    target: usize,
    leader: NodeId,
    voters: &BTreeSet<NodeId>,
    members: &[NodeRecord],
    caught_up: &BTreeSet<NodeId>,
) -> BTreeSet<NodeId> {
    let member = |id: NodeId| members.iter().find(|node| node.id == id);
    let eligible: Vec<&NodeRecord> = members
        .iter()
        .filter(|node| healthy(node) || node.id == leader)
        .collect();
    let mut size = target.min(eligible.len()).max(1);
    if size.is_multiple_of(2) {
        size -= 1;
    }
    let witness_first = |node: &&NodeRecord| (node.role != NodeRole::Witness, node.id);
    let mut kept: Vec<&NodeRecord> = eligible
        .iter()
        .copied()
        .filter(|node| voters.contains(&node.id) && node.id != leader)
        .collect();
    kept.sort_by_key(witness_first);
    let mut candidates: Vec<&NodeRecord> = eligible
        .iter()
        .copied()
        .filter(|node| !voters.contains(&node.id) && caught_up.contains(&node.id))
        .collect();
    candidates.sort_by_key(witness_first);

    let mut desired: Vec<NodeId> = vec![leader];
    for node in kept.into_iter().chain(candidates) {
        if desired.len() >= size {
            break;
        }
        desired.push(node.id);
    }
    let desired: BTreeSet<NodeId> = desired.into_iter().collect();
    let removed_voter = voters
        .iter()
        .any(|id| member(*id).is_none_or(|node| node.removed));
    if desired.len().is_multiple_of(2) && !removed_voter {
        return voters.clone();
    }
    if desired.len() < voters.len() && !removed_voter {
        // Never shrink below the current set just because voters are unhealthy: a quorum may
        // still be up, and a smaller set tolerates fewer failures. Replace them instead (above).
        let unhealthy_kept = voters
            .iter()
            .filter(|id| member(**id).is_some_and(|node| !node.removed))
            .count();
        if unhealthy_kept >= voters.len() {
            return voters.clone();
        }
    }
    desired
}

/// The cluster's health findings.
pub fn health(
    config: &ClusterConfig,
    leader: Option<NodeId>,
    nodes: &[NodeStatus],
    leader_answered: bool,
    voter_count: usize,
) -> Vec<HealthCheck> {
    let mut checks = Vec::new();
    let check = |code: &str, severity: &str, message: String, action: &str| HealthCheck {
        code: code.to_string(),
        severity: severity.to_string(),
        message,
        action: action.to_string(),
    };
    let members: Vec<&NodeStatus> = nodes.iter().filter(|node| !node.record.removed).collect();
    if leader.is_none() {
        checks.push(check(
            "KEEL_NO_QUORUM",
            "error",
            "no metadata leader: this node cannot reach a quorum of voters; metadata changes \
             (volume and bucket creation, snapshots, failover) are refused"
                .to_string(),
            "bring voters back or reconnect the network; with two storage nodes and a lost \
             witness, see `keel cluster force-primary`",
        ));
    } else if !leader_answered && members.len() > 1 {
        checks.push(check(
            "KEEL_LEADER_UNREACHABLE",
            "warn",
            format!(
                "the metadata leader (node {}) did not answer a status request",
                leader.unwrap_or_default()
            ),
            "check the network between this node and the leader",
        ));
    }
    for node in &members {
        let name = &node.record.name;
        match node.record.state {
            NodeState::Down => checks.push(check(
                "KEEL_NODE_DOWN",
                if node.raft_role == RaftRole::Voter {
                    "error"
                } else {
                    "warn"
                },
                format!(
                    "node {name} (id {}) is down{}",
                    node.record.id,
                    if node.raft_role == RaftRole::Voter {
                        " and still a voter: one more voter failure stops metadata changes"
                    } else {
                        ""
                    }
                ),
                "restart it, or `keel node remove` it if it is gone for good",
            )),
            NodeState::Suspect => checks.push(check(
                "KEEL_NODE_SUSPECT",
                "warn",
                format!("node {name} (id {}) stopped reporting", node.record.id),
                "check that its keel process runs and the network reaches it",
            )),
            NodeState::Up => {}
        }
        if let Some(liveness) = &node.liveness {
            if liveness.clock_skew_ms.abs() > CLOCK_SKEW_WARN_MS {
                checks.push(check(
                    "KEEL_CLOCK_SKEW",
                    "warn",
                    format!(
                        "node {name}'s clock is {} ms off the leader's",
                        liveness.clock_skew_ms
                    ),
                    "run NTP (chrony or systemd-timesyncd) on every node",
                ));
            }
            if liveness.report.poisoned {
                checks.push(check(
                    "KEEL_NODE_POISONED",
                    "error",
                    format!("node {name}'s store stopped after a failed disk sync"),
                    "check the disk and kernel log on that node, then restart it",
                ));
            }
        }
    }
    let storage = members
        .iter()
        .filter(|node| node.record.role == NodeRole::Storage)
        .count();
    let witnesses = members
        .iter()
        .filter(|node| node.record.role == NodeRole::Witness)
        .count();
    if storage == 2 && witnesses == 0 {
        checks.push(check(
            "KEEL_NO_WITNESS",
            "warn",
            "two storage nodes and no witness: metadata has one voter, and losing its node \
             stops metadata changes"
                .to_string(),
            "add a witness (`keel server --witness --join ...`) on a third machine",
        ));
    }
    let wanted = config.voters.min(members.len());
    let wanted = if wanted.is_multiple_of(2) {
        wanted.saturating_sub(1)
    } else {
        wanted
    };
    if voter_count < wanted && leader.is_some() {
        checks.push(check(
            "KEEL_FEW_VOTERS",
            "warn",
            format!("{voter_count} metadata voters where {wanted} are wanted"),
            "wait for new members to catch up; check that the learners are up",
        ));
    }
    checks
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use keel_catalog::NodeAddresses;

    use super::*;

    fn node(id: NodeId, role: NodeRole, state: NodeState) -> NodeRecord {
        NodeRecord {
            id,
            name: format!("n{id}"),
            instance: [id as u8; 16],
            role,
            addresses: NodeAddresses::default(),
            labels: BTreeMap::new(),
            devices: Vec::new(),
            state,
            state_since_unix_ms: 0,
            draining: false,
            removed: false,
            joined_unix_ms: 0,
        }
    }

    fn set(ids: &[NodeId]) -> BTreeSet<NodeId> {
        ids.iter().copied().collect()
    }

    // Proves the voter set grows only to odd sizes, prefers a witness, and waits for learners to
    // catch up.
    #[test]
    fn voters_grow_to_odd_sizes() {
        let storage = |id| node(id, NodeRole::Storage, NodeState::Up);
        let members = vec![storage(1), storage(2)];
        assert_eq!(
            desired_voters(3, 1, &set(&[1]), &members, &set(&[2])),
            set(&[1]),
            "two nodes: one voter"
        );
        let mut members = members;
        members.push(node(3, NodeRole::Witness, NodeState::Up));
        assert_eq!(
            desired_voters(3, 1, &set(&[1]), &members, &set(&[2, 3])),
            set(&[1, 2, 3])
        );
        assert_eq!(
            desired_voters(3, 1, &set(&[1]), &members, &set(&[3])),
            set(&[1]),
            "only one caught-up learner: stay at one voter, not two"
        );
        members.push(storage(4));
        members.push(storage(5));
        assert_eq!(
            desired_voters(3, 1, &set(&[1]), &members, &set(&[2, 3, 4, 5])),
            set(&[1, 2, 3]),
            "target 3: the witness and the lowest id"
        );
        assert_eq!(
            desired_voters(5, 1, &set(&[1, 2, 3]), &members, &set(&[2, 3, 4, 5])),
            set(&[1, 2, 3, 4, 5])
        );
    }

    // Proves a down or draining voter is replaced by a healthy caught-up learner, and kept when
    // there is none.
    #[test]
    fn unhealthy_voters_are_replaced_when_possible() {
        let mut members: Vec<NodeRecord> = (1..=4)
            .map(|id| node(id, NodeRole::Storage, NodeState::Up))
            .collect();
        members[2].state = NodeState::Down;
        assert_eq!(
            desired_voters(3, 1, &set(&[1, 2, 3]), &members, &set(&[2, 4])),
            set(&[1, 2, 4])
        );
        assert_eq!(
            desired_voters(3, 1, &set(&[1, 2, 3]), &members, &set(&[2])),
            set(&[1, 2, 3]),
            "no replacement: keep the set"
        );
        members[2].state = NodeState::Up;
        members[1].draining = true;
        assert_eq!(
            desired_voters(3, 1, &set(&[1, 2, 3]), &members, &set(&[2, 3, 4])),
            set(&[1, 3, 4])
        );
        members[1].draining = false;
        members[1].removed = true;
        assert_eq!(
            desired_voters(3, 1, &set(&[1, 2, 3]), &members, &set(&[3])),
            set(&[1, 3]),
            "a removed voter leaves even without a replacement"
        );
    }

    // Proves the silence thresholds.
    #[test]
    fn verdicts_follow_silence() {
        let timing = Timing::default();
        assert_eq!(verdict(&timing, Duration::from_millis(100)), NodeState::Up);
        assert_eq!(verdict(&timing, timing.suspect_after), NodeState::Suspect);
        assert_eq!(verdict(&timing, timing.down_after), NodeState::Down);
    }
}
