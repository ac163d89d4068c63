//! Turns for the whole-volume copies a node receives ([`crate::Settings::rebuilds_max`]).
//!
//! A primary about to send a whole copy (a replica added, rebuilt elsewhere, copied off a
//! draining node, or with no common point) first takes one of its own node's turns, then asks
//! the replica's node for one ([`crate::wire::METHOD_COPY_TURN`]). Refused, it gives its own
//! back and asks again later, so a node that receives copies from several primaries at once
//! (a drain, a lost node) takes at most `rebuilds_max` of them and each ends sooner, and a
//! primary never holds a turn while it waits for another. A granted turn is renewed while the
//! copy runs and given back at its end; one nobody renewed for [`TURN_LEASE`] lapses (its
//! primary stopped or crashed). Turns are kept in memory: a node that restarts grants anew,
//! and a copy under way renews its turn even past the limit rather than stop.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use keel_catalog::NodeId;

/// A granted turn lapses when not renewed for this long.
pub(crate) const TURN_LEASE: Duration = Duration::from_secs(10);
/// How often a primary renews the turn of a copy under way.
pub(crate) const TURN_RENEW: Duration = Duration::from_secs(2);
/// How long a primary refused a turn waits before asking again.
pub(crate) const TURN_RETRY: Duration = Duration::from_secs(1);

/// The turns this node granted, by (primary's node, volume id): when each lapses.
pub(crate) struct ReceiveTurns {
    max: usize,
    held: Mutex<HashMap<(NodeId, u64), Instant>>,
}

impl ReceiveTurns {
    pub fn new(max: usize) -> ReceiveTurns {
        ReceiveTurns {
            max: max.max(1),
            held: Mutex::new(HashMap::new()),
        }
    }

    /// Grants `sender` a turn for its copy of volume `volume_id`, or renews the one it holds;
    /// false when every turn is held by other copies.
    pub fn ask(&self, sender: NodeId, volume_id: u64, now: Instant) -> bool {
        let mut held = crate::lock(&self.held);
        held.retain(|_, lapses| *lapses > now);
        let free = held.len() < self.max;
        match held.get_mut(&(sender, volume_id)) {
            Some(lapses) => *lapses = now + TURN_LEASE,
            None if free => {
                held.insert((sender, volume_id), now + TURN_LEASE);
            }
            None => return false,
        }
        true
    }

    /// `sender`'s copy of volume `volume_id` ended: its turn is free.
    pub fn give_back(&self, sender: NodeId, volume_id: u64) {
        crate::lock(&self.held).remove(&(sender, volume_id));
    }

    /// Renewals past the limit: a copy under way keeps its turn.
    pub fn renew(&self, sender: NodeId, volume_id: u64, now: Instant) {
        crate::lock(&self.held).insert((sender, volume_id), now + TURN_LEASE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Up to `max` copies hold a turn; a copy asking again renews its own; a turn given back
    /// or not renewed for the lease is free again; a renewal keeps a copy's turn past the
    /// limit.
    #[test]
    fn turns_are_granted_up_to_the_limit_and_lapse() {
        let turns = ReceiveTurns::new(2);
        let now = Instant::now();
        assert!(turns.ask(1, 10, now));
        assert!(turns.ask(2, 20, now));
        assert!(!turns.ask(3, 30, now), "a third copy got a turn");
        assert!(turns.ask(1, 10, now), "a copy's own turn was refused");
        turns.give_back(1, 10);
        assert!(turns.ask(3, 30, now));
        assert!(!turns.ask(1, 10, now));
        let later = now + TURN_LEASE / 2;
        assert!(turns.ask(2, 20, later));
        // (3, 30) was not renewed: lapsed at `now + TURN_LEASE`.
        let lapsed = now + TURN_LEASE + Duration::from_millis(1);
        assert!(turns.ask(1, 10, lapsed));
        assert!(
            !turns.ask(3, 30, lapsed),
            "(2, 20) renewed, (1, 10) granted"
        );
        turns.renew(3, 30, lapsed);
        assert_eq!(crate::lock(&turns.held).len(), 3);
    }
}
