//! Exhaustive model check (stateright) of the epoch / ISR protocol in `src/protocol.rs`: two
//! data nodes and Raft (whose third voter is the witness), with crashes, lost, duplicated-by-
//! retry and reordered messages, lease expiry, ISR shrinks and failovers. Invariants:
//! - every acknowledged FLUSH is durable, with the same history, on every member of the ISR
//!   Raft records;
//! - never two primaries holding a lease at once.
//!
//! Examples the checker must also find (so the model is not vacuous): a FLUSH acknowledged by
//! both nodes, and one acknowledged after a failover.

use std::collections::BTreeSet;

use keel_replication::protocol::{Assignment, Message, Node, NodeId, Tag};
use stateright::{Checker, Model, Property};

const NODES: NodeId = 2;
/// Raft, as the sender of `Message::Assigned` and the receiver of proposals.
const RAFT: NodeId = 9;

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    raft: Assignment,
    nodes: Vec<Node>,
    /// Messages in flight: (from, to, message), kept sorted (a multiset).
    network: Vec<(NodeId, NodeId, Message)>,
    /// Proposals in flight to Raft: (epoch, primary, member to remove).
    proposals: Vec<(u64, NodeId, NodeId)>,
    /// The longest history prefix whose FLUSH was acknowledged to the client.
    acknowledged: Vec<Tag>,
    writes: u8,
    flushes: u8,
    crashes: u8,
    failovers: u8,
    acked_after_failover: bool,
    acked_by_two: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Action {
    Write(NodeId),
    Flush(NodeId),
    FlushDone(NodeId),
    ProposeShrink(NodeId),
    Deliver(usize),
    Lose(usize),
    ApplyProposal(usize),
    LoseProposal(usize),
    LeaseExpires(NodeId),
    Crash(NodeId),
    Failover(NodeId),
}

struct Replication {
    writes_max: u8,
    flushes_max: u8,
    crashes_max: u8,
    failovers_max: u8,
    network_max: usize,
    /// Clocks drift past the lease margin: Raft may fail over while the old primary still
    /// believes its lease valid. Two primaries then exist for a while (leases are about time);
    /// epoch fencing alone must still keep every acknowledged flush.
    drift: bool,
    /// A deliberately broken variant, to prove the checker catches it.
    bug: Bug,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Bug {
    None,
    /// Acknowledge a FLUSH when the primary alone is durable.
    AckWithoutIsr,
    /// Members accept messages of older epochs.
    NoFencing,
}

fn send(state: &mut State, from: NodeId, out: Vec<(NodeId, Message)>) {
    for (to, message) in out {
        state.network.push((from, to, message));
    }
    state.network.sort();
}

impl Model for Replication {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let raft = Assignment {
            epoch: 1,
            primary: 0,
            isr: BTreeSet::from([0, 1]),
        };
        vec![State {
            nodes: vec![Node::first_primary(&raft), Node::member(1)],
            raft,
            network: Vec::new(),
            proposals: Vec::new(),
            acknowledged: Vec::new(),
            writes: 0,
            flushes: 0,
            crashes: 0,
            failovers: 0,
            acked_after_failover: false,
            acked_by_two: false,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        for n in 0..NODES {
            let node = &state.nodes[n as usize];
            if let Some(primary) = &node.primary {
                if state.writes < self.writes_max {
                    actions.push(Action::Write(n));
                }
                if primary.flush.is_none() && state.flushes < self.flushes_max {
                    actions.push(Action::Flush(n));
                }
                if primary.flush.is_some() {
                    actions.push(Action::FlushDone(n));
                    if node.shrink_proposal(n).is_some() && state.proposals.is_empty() {
                        actions.push(Action::ProposeShrink(n));
                    }
                }
                actions.push(Action::LeaseExpires(n));
            }
            if state.crashes < self.crashes_max {
                actions.push(Action::Crash(n));
            }
        }
        for i in 0..state.network.len() {
            actions.push(Action::Deliver(i));
            actions.push(Action::Lose(i));
        }
        for i in 0..state.proposals.len() {
            actions.push(Action::ApplyProposal(i));
            actions.push(Action::LoseProposal(i));
        }
        // Raft fails over once the primary's lease ran out (the timing assumption: it waits out
        // the lease plus a drift margin), to any ISR member.
        let primary = &state.nodes[state.raft.primary as usize];
        let serving = primary.primary.is_some() && primary.epoch == state.raft.epoch;
        if (!serving || self.drift) && state.failovers < self.failovers_max {
            for candidate in state.raft.isr.iter().copied() {
                actions.push(Action::Failover(candidate));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Write(n) => {
                let (_, out) = state.nodes[n as usize].write(n)?;
                state.writes += 1;
                send(&mut state, n, out);
            }
            Action::Flush(n) => {
                let out = state.nodes[n as usize].start_flush(n)?;
                state.flushes += 1;
                send(&mut state, n, out);
            }
            Action::FlushDone(n) => {
                let node = &mut state.nodes[n as usize];
                let upto = if self.bug == Bug::AckWithoutIsr {
                    let primary = node.primary.as_mut()?;
                    primary.flush.take()?
                } else {
                    node.flush_done(n)?
                };
                let history = node.log[..upto as usize].to_vec();
                let members = node.primary.as_ref().map(|p| p.isr.len()).unwrap_or(0);
                if history.len() >= state.acknowledged.len() {
                    state.acknowledged = history;
                }
                if upto > 0 {
                    state.acked_after_failover |= state.failovers > 0;
                    state.acked_by_two |= members == 2;
                }
            }
            Action::ProposeShrink(n) => {
                let (epoch, member) = state.nodes[n as usize].shrink_proposal(n)?;
                state.proposals.push((epoch, n, member));
            }
            Action::ApplyProposal(i) => {
                let (epoch, primary, member) = state.proposals.remove(i);
                if let Some(next) = state.raft.shrink(epoch, primary, member) {
                    state.raft = next.clone();
                    send(&mut state, RAFT, vec![(primary, Message::Assigned(next))]);
                }
            }
            Action::LoseProposal(i) => {
                state.proposals.remove(i);
            }
            Action::Deliver(i) => {
                let (from, to, message) = state.network.remove(i);
                if to == RAFT {
                    return Some(state);
                }
                let sent_epoch = match &message {
                    Message::Replicate { epoch, .. } | Message::Flush { epoch, .. } => Some(*epoch),
                    _ => None,
                };
                let message = match (self.bug, message) {
                    (Bug::NoFencing, Message::Replicate { tag, .. }) => Message::Replicate {
                        epoch: state.nodes[to as usize].epoch,
                        tag,
                    },
                    (Bug::NoFencing, Message::Flush { upto, last, .. }) => Message::Flush {
                        epoch: state.nodes[to as usize].epoch,
                        upto,
                        last,
                    },
                    (_, message) => message,
                };
                let mut out = state.nodes[to as usize].on_message(to, from, message);
                if let (Bug::NoFencing, Some(sent)) = (self.bug, sent_epoch) {
                    // The broken member answers in the sender's epoch, as if it were current.
                    for (_, reply) in out.iter_mut() {
                        if let Message::FlushAck { epoch, .. } = reply {
                            *epoch = sent;
                        }
                    }
                }
                send(&mut state, to, out);
            }
            Action::Lose(i) => {
                state.network.remove(i);
            }
            Action::LeaseExpires(n) => state.nodes[n as usize].lease_expired(),
            Action::Crash(n) => {
                state.nodes[n as usize].crash();
                state.crashes += 1;
            }
            Action::Failover(candidate) => {
                let next = state.raft.failover(candidate)?;
                // The old epoch's leases have run out: a decision of it still in flight can
                // no longer make anyone primary.
                let old = state.raft.epoch;
                state.network.retain(|(from, _, message)| {
                    !(*from == RAFT && matches!(message, Message::Assigned(a) if a.epoch <= old))
                });
                state.raft = next.clone();
                state.failovers += 1;
                send(&mut state, RAFT, vec![(candidate, Message::Assigned(next))]);
            }
        }
        Some(state)
    }

    fn within_boundary(&self, state: &State) -> bool {
        state.network.len() <= self.network_max
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(FLUSH_KEPT, |_, state: &State| {
                state.raft.isr.iter().all(|n| {
                    let node = &state.nodes[*n as usize];
                    node.durable >= state.acknowledged.len()
                        && node.log[..state.acknowledged.len()] == state.acknowledged[..]
                })
            }),
            Property::always("at most one primary holds a lease", |_, state: &State| {
                state.nodes.iter().filter(|n| n.primary.is_some()).count() <= 1
            }),
            Property::sometimes(
                "a flush is acknowledged by two members",
                |_, state: &State| state.acked_by_two,
            ),
            Property::sometimes(
                "a flush is acknowledged after a failover",
                |_, state: &State| state.acked_after_failover,
            ),
        ]
    }
}

fn model(bug: Bug, drift: bool) -> Replication {
    Replication {
        writes_max: 2,
        flushes_max: 2,
        crashes_max: 1,
        failovers_max: 1,
        network_max: 4,
        drift,
        bug,
    }
}

const FLUSH_KEPT: &str = "an acknowledged flush is durable on every ISR member";

#[test]
fn the_protocol_keeps_every_acknowledged_flush() {
    let checker = model(Bug::None, false).checker().spawn_bfs().join();
    println!("states explored: {}", checker.unique_state_count());
    checker.assert_properties();
}

#[test]
fn fencing_keeps_flushes_when_leases_fail() {
    let checker = model(Bug::None, true).checker().spawn_bfs().join();
    println!("states explored: {}", checker.unique_state_count());
    assert!(
        checker.discovery(FLUSH_KEPT).is_none(),
        "{:?}",
        checker.discovery(FLUSH_KEPT)
    );
}

#[test]
fn the_checker_finds_a_flush_acknowledged_without_the_isr() {
    let checker = model(Bug::AckWithoutIsr, false)
        .checker()
        .spawn_bfs()
        .join();
    assert!(
        checker.discovery(FLUSH_KEPT).is_some(),
        "acknowledging on the primary alone must break the contract"
    );
}

#[test]
fn the_checker_finds_an_unfenced_old_epoch() {
    let checker = model(Bug::NoFencing, true).checker().spawn_bfs().join();
    assert!(
        checker.discovery(FLUSH_KEPT).is_some(),
        "members that accept old epochs must break the contract once leases fail"
    );
}
