//! The epoch / in-sync-replica protocol of one replicated volume, as a pure state machine.
//!
//! Raft records per volume an [`Assignment`]: `{epoch, primary, isr}`. The primary orders every
//! write as a [`Tag`] `(epoch, seq)` — `seq` is the write's position in the volume's history —
//! appends it to its own log and streams it to the other ISR members ([`Message::Replicate`]).
//! A FLUSH makes the primary's log durable locally and asks every other ISR member to make the
//! same prefix durable ([`Message::Flush`], answered by [`Message::FlushAck`]); it is
//! acknowledged to the client only when every ISR member has answered ([`Node::flush_done`]).
//! A member that does not answer is removed from the ISR by a Raft proposal (epoch + 1) before
//! a FLUSH can complete without it ([`Node::shrink_proposal`]).
//!
//! Epochs fence: a node never accepts a message of an epoch older than the newest it has seen,
//! and answers it with [`Message::Fenced`], which makes an old primary step down. A new primary
//! (after a failover recorded by Raft, once the old primary's lease ran out) first sends its
//! history to the other members ([`Message::Adopt`]); a member adopting it keeps as durable only
//! the prefix it shares with that history.
//!
//! Time and leases are not in here: the model calls [`Node::lease_expired`] when a lease runs
//! out, and Raft waits out a lease (plus a drift margin) before it records a new primary.
//! Nothing here reads a clock, does I/O or allocates a network connection.
//!
//! This is the specification the model checker explores; the engine ([`crate::primary`],
//! [`crate::replica`]) follows the same rules but does not run this code. One difference: a
//! new primary does not send its history (`Adopt`); it takes over alone in sync and catches
//! the other replicas up by comparing their blocks, which reaches the same state.

use std::collections::{BTreeMap, BTreeSet};

/// A node of the cluster.
pub type NodeId = u8;

/// A write's place in a volume's history: the epoch of the primary that ordered it and its
/// position (1-based).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Tag {
    pub epoch: u64,
    pub seq: u64,
}

/// What Raft records for a replicated volume.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Assignment {
    pub epoch: u64,
    pub primary: NodeId,
    pub isr: BTreeSet<NodeId>,
}

/// Messages between the data nodes of one volume, and from Raft's decisions to them.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Message {
    /// Primary → member: the write at position `tag.seq`.
    Replicate { epoch: u64, tag: Tag },
    /// Primary → member: make positions `1..=upto` durable; `last` is the write at `upto`,
    /// so a member with another history does not answer.
    Flush {
        epoch: u64,
        upto: u64,
        last: Option<Tag>,
    },
    /// Member → primary: positions `1..=upto` are durable here.
    FlushAck { epoch: u64, upto: u64 },
    /// Member → sender: your epoch is older than `epoch`.
    Fenced { epoch: u64 },
    /// New primary → member: the history of the new epoch.
    Adopt { epoch: u64, log: Vec<Tag> },
    /// Raft → node: this assignment was committed (a failover naming it primary, or the ISR
    /// shrink it proposed).
    Assigned(Assignment),
}

/// The primary's volatile state.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Primary {
    /// The ISR as this primary knows it (Raft's, as of its epoch).
    pub isr: BTreeSet<NodeId>,
    /// Highest durable position each member confirmed in this epoch.
    pub acked: BTreeMap<NodeId, u64>,
    /// The FLUSH in progress: the position it must make durable everywhere.
    pub flush: Option<u64>,
}

/// One data node's replica of the volume.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Node {
    /// The newest epoch this node has seen (persisted before acting in it).
    pub epoch: u64,
    /// The volume's history as this node has it; `log[..durable]` is on its disk.
    pub log: Vec<Tag>,
    pub durable: usize,
    /// `Some` while this node is the primary holding a valid lease (volatile).
    pub primary: Option<Primary>,
}

/// Outgoing messages: (destination, message).
pub type Outbox = Vec<(NodeId, Message)>;

impl Node {
    /// A node starting as the primary of `assignment`.
    pub fn first_primary(assignment: &Assignment) -> Node {
        Node {
            epoch: assignment.epoch,
            primary: Some(Primary {
                isr: assignment.isr.clone(),
                ..Primary::default()
            }),
            ..Node::default()
        }
    }

    /// A node starting as a member (not primary) in `epoch`.
    pub fn member(epoch: u64) -> Node {
        Node {
            epoch,
            ..Node::default()
        }
    }

    fn others(&self, me: NodeId) -> Vec<NodeId> {
        self.primary
            .as_ref()
            .map(|p| p.isr.iter().copied().filter(|n| *n != me).collect())
            .unwrap_or_default()
    }

    /// A client write on the primary: ordered, appended, streamed. `None` if not primary.
    pub fn write(&mut self, me: NodeId) -> Option<(Tag, Outbox)> {
        self.primary.as_ref()?;
        let tag = Tag {
            epoch: self.epoch,
            seq: self.log.len() as u64 + 1,
        };
        self.log.push(tag);
        let epoch = self.epoch;
        let out = self
            .others(me)
            .into_iter()
            .map(|to| (to, Message::Replicate { epoch, tag }))
            .collect();
        Some((tag, out))
    }

    /// A client FLUSH on the primary: local fdatasync of the whole log, then the members are
    /// asked for the same prefix. `None` if not primary.
    pub fn start_flush(&mut self, me: NodeId) -> Option<Outbox> {
        self.primary.as_ref()?;
        let upto = self.log.len() as u64;
        let last = self.log.last().copied();
        self.durable = self.log.len();
        let epoch = self.epoch;
        let others = self.others(me);
        if let Some(primary) = self.primary.as_mut() {
            primary.flush = Some(upto);
        }
        Some(
            others
                .into_iter()
                .map(|to| (to, Message::Flush { epoch, upto, last }))
                .collect(),
        )
    }

    /// The position the FLUSH in progress made durable on every ISR member, once it has: the
    /// client's FLUSH may then be acknowledged (and the flush is over).
    pub fn flush_done(&mut self, me: NodeId) -> Option<u64> {
        let others = self.others(me);
        let primary = self.primary.as_mut()?;
        let upto = primary.flush?;
        let everyone = others
            .iter()
            .all(|n| primary.acked.get(n).is_some_and(|acked| *acked >= upto));
        if everyone && self.durable as u64 >= upto {
            primary.flush = None;
            Some(upto)
        } else {
            None
        }
    }

    /// A member the FLUSH in progress still waits for: the primary proposes to Raft that it leave
    /// the ISR (`Assignment` with `epoch + 1`), after a timeout, and acknowledges nothing until
    /// Raft committed it.
    pub fn shrink_proposal(&self, me: NodeId) -> Option<(u64, NodeId)> {
        let primary = self.primary.as_ref()?;
        let upto = primary.flush?;
        self.others(me)
            .into_iter()
            .find(|n| primary.acked.get(n).is_none_or(|acked| *acked < upto))
            .map(|n| (self.epoch, n))
    }

    /// The lease this node holds as primary ran out: it stops serving at once.
    pub fn lease_expired(&mut self) {
        self.primary = None;
    }

    /// A crash: what was not durable is gone, and so is the lease.
    pub fn crash(&mut self) {
        self.log.truncate(self.durable);
        self.primary = None;
    }

    /// Handles one message from `from`.
    pub fn on_message(&mut self, me: NodeId, from: NodeId, message: Message) -> Outbox {
        match message {
            Message::Assigned(assignment) => self.on_assigned(me, assignment),
            Message::Replicate { epoch, .. }
            | Message::Flush { epoch, .. }
            | Message::Adopt { epoch, .. }
                if epoch < self.epoch =>
            {
                vec![(from, Message::Fenced { epoch: self.epoch })]
            }
            Message::Replicate { epoch, tag } => {
                // Writes of an epoch this member has not adopted yet wait for its Adopt.
                if epoch == self.epoch && tag.seq == self.log.len() as u64 + 1 {
                    self.log.push(tag);
                }
                Vec::new()
            }
            Message::Flush { epoch, upto, last } => {
                let holds = epoch == self.epoch
                    && self.log.len() as u64 >= upto
                    && (upto == 0 || self.log.get(upto as usize - 1).copied() == last);
                if !holds {
                    return Vec::new();
                }
                self.durable = self.durable.max(upto as usize);
                vec![(from, Message::FlushAck { epoch, upto })]
            }
            Message::Adopt { epoch, log } => {
                let shared = self
                    .log
                    .iter()
                    .zip(&log)
                    .take_while(|(a, b)| a == b)
                    .count();
                self.epoch = epoch;
                self.durable = self.durable.min(shared);
                self.log = log;
                if from != me {
                    self.primary = None;
                }
                Vec::new()
            }
            Message::FlushAck { epoch, upto } => {
                if epoch == self.epoch {
                    if let Some(primary) = self.primary.as_mut() {
                        let acked = primary.acked.entry(from).or_insert(0);
                        *acked = (*acked).max(upto);
                    }
                }
                Vec::new()
            }
            Message::Fenced { epoch } => {
                if epoch > self.epoch {
                    self.primary = None;
                }
                Vec::new()
            }
        }
    }

    /// Raft committed `assignment`: if it names this node primary in a newer epoch (a failover,
    /// or the ISR shrink this primary proposed), it takes the role and sends its history to the
    /// other members, whose answers to the next FLUSH then count.
    fn on_assigned(&mut self, me: NodeId, assignment: Assignment) -> Outbox {
        if assignment.primary != me || assignment.epoch <= self.epoch {
            return Vec::new();
        }
        let shrink = self.primary.is_some();
        self.epoch = assignment.epoch;
        let flush = self.primary.as_ref().and_then(|p| p.flush);
        self.primary = Some(Primary {
            isr: assignment.isr.clone(),
            acked: BTreeMap::new(),
            flush: if shrink { flush } else { None },
        });
        let epoch = self.epoch;
        let mut out: Outbox = self
            .others(me)
            .into_iter()
            .map(|to| {
                (
                    to,
                    Message::Adopt {
                        epoch,
                        log: self.log.clone(),
                    },
                )
            })
            .collect();
        // A flush in progress across the shrink asks the remaining members again, in the new
        // epoch.
        if let Some(upto) = self.primary.as_ref().and_then(|p| p.flush) {
            let last = upto
                .checked_sub(1)
                .and_then(|i| self.log.get(i as usize))
                .copied();
            for to in self.others(me) {
                out.push((to, Message::Flush { epoch, upto, last }));
            }
        }
        out
    }
}

/// Raft's side, as the state machine applies it.
impl Assignment {
    /// The primary of `epoch` asks that `member` leave the ISR: applied only if nothing changed
    /// since (same epoch, same primary); returns the new assignment.
    pub fn shrink(&self, epoch: u64, primary: NodeId, member: NodeId) -> Option<Assignment> {
        if epoch != self.epoch || primary != self.primary || member == primary {
            return None;
        }
        let mut isr = self.isr.clone();
        isr.remove(&member);
        Some(Assignment {
            epoch: self.epoch + 1,
            primary,
            isr,
        })
    }

    /// A failover to `candidate`, an ISR member, once the old primary's lease ran out.
    pub fn failover(&self, candidate: NodeId) -> Option<Assignment> {
        if !self.isr.contains(&candidate) {
            return None;
        }
        Some(Assignment {
            epoch: self.epoch + 1,
            primary: candidate,
            isr: self.isr.clone(),
        })
    }
}
