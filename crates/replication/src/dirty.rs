//! What a replica may lack, so that catching it up after a short absence compares only that
//! (DRBD's bitmap, on the primary's history positions): the ranges changed while it had no
//! stream, and those of changes its stream carried but it never confirmed durable.

use std::collections::VecDeque;

/// The bitmap's unit: a 4 KiB write marks 64 KiB to compare (2 MiB of bitmap per TiB).
pub(crate) const UNIT_BYTES: u64 = 64 << 10;

/// Changes of a stream remembered until the replica confirms them durable; past this, the
/// tail is unknown and the next catch-up compares everything.
const UNCONFIRMED_MAX: usize = 1 << 20;

/// A set of the volume's [`UNIT_BYTES`] units: one bit each, grown on demand.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Chunks {
    words: Vec<u64>,
}

impl Chunks {
    /// Adds every unit `[offset, offset + length)` touches.
    pub(crate) fn mark(&mut self, offset: u64, length: u64) {
        if length == 0 {
            return;
        }
        let first = offset / UNIT_BYTES;
        let last = (offset + length - 1) / UNIT_BYTES;
        let words = usize::try_from(last / 64 + 1).unwrap_or(usize::MAX);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        for chunk in first..=last {
            self.words[(chunk / 64) as usize] |= 1 << (chunk % 64);
        }
    }

    /// Adds every unit of `other`.
    pub(crate) fn add(&mut self, other: &Chunks) {
        if self.words.len() < other.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (word, theirs) in self.words.iter_mut().zip(&other.words) {
            *word |= theirs;
        }
    }

    /// The byte ranges of consecutive units in the set, in order, widened to whole `block`s
    /// and clipped to `size`.
    pub(crate) fn runs(&self, size: u64, block: u64) -> Vec<(u64, u64)> {
        let block = block.max(1);
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (index, word) in self.words.iter().enumerate() {
            let mut bits = *word;
            while bits != 0 {
                let unit = index as u64 * 64 + u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                let start = unit * UNIT_BYTES / block * block;
                if start >= size {
                    return runs;
                }
                let end = (unit + 1) * UNIT_BYTES;
                let end = end.div_ceil(block).saturating_mul(block).min(size);
                match runs.last_mut() {
                    Some((_, last_end)) if *last_end >= start => *last_end = end.max(*last_end),
                    _ => runs.push((start, end)),
                }
            }
        }
        runs
    }
}

/// The primary's record of what one replica may lack beyond what its stream carries.
#[derive(Debug, Default)]
pub(crate) struct Lacking {
    /// Chunks changed while it had no stream (and those its failed streams never confirmed).
    /// `None`: unknown — it never had a complete stream from this primary (this primary just
    /// started, the replica is new, or a rollback it could not make needs it copied whole),
    /// or its tail overflowed; its catch-up compares every written stretch.
    chunks: Option<Chunks>,
    /// Changes its current stream carries that it has not confirmed durable, with their
    /// history positions, oldest first.
    unconfirmed: VecDeque<(u64, u64, u64)>,
    /// More than [`UNCONFIRMED_MAX`] were unconfirmed: changes up to this position went
    /// unrecorded.
    unrecorded_upto: Option<u64>,
}

impl Lacking {
    /// A replica known to lack `chunks` and nothing else.
    pub(crate) fn known(chunks: Chunks) -> Lacking {
        Lacking {
            chunks: Some(chunks),
            ..Lacking::default()
        }
    }

    /// A change at history `position`: on the replica's stream (`streaming`) it is remembered
    /// until confirmed durable; otherwise the replica lacks it.
    pub(crate) fn note(&mut self, streaming: bool, position: u64, offset: u64, length: u64) {
        if !streaming {
            if let Some(chunks) = self.chunks.as_mut() {
                chunks.mark(offset, length);
            }
        } else if self.unconfirmed.len() >= UNCONFIRMED_MAX {
            self.unrecorded_upto = Some(position);
        } else {
            self.unconfirmed.push_back((position, offset, length));
        }
    }

    /// The replica confirmed durable every change of its stream up to `upto`.
    pub(crate) fn confirmed(&mut self, upto: u64) {
        while self
            .unconfirmed
            .front()
            .is_some_and(|(position, _, _)| *position <= upto)
        {
            self.unconfirmed.pop_front();
        }
        if self
            .unrecorded_upto
            .is_some_and(|position| position <= upto)
        {
            self.unrecorded_upto = None;
        }
    }

    /// Its stream ended: what the stream carried unconfirmed, the replica may lack.
    pub(crate) fn stream_ended(&mut self) {
        if self.unrecorded_upto.take().is_some() {
            self.chunks = None;
        }
        let unconfirmed = std::mem::take(&mut self.unconfirmed);
        if let Some(chunks) = self.chunks.as_mut() {
            for (_, offset, length) in unconfirmed {
                chunks.mark(offset, length);
            }
        }
    }

    /// What a catch-up starting now must compare (`None`: everything).
    pub(crate) fn to_compare(&self) -> Option<Chunks> {
        self.chunks.clone()
    }

    /// A catch-up made the replica hold everything its stream did not carry.
    pub(crate) fn caught_up(&mut self) {
        self.chunks = Some(Chunks::default());
    }

    /// Forget what it lacks: its next catch-up compares everything.
    pub(crate) fn unknown(&mut self) {
        self.chunks = None;
    }

    /// Whether what it lacks is unknown.
    pub(crate) fn is_unknown(&self) -> bool {
        self.chunks.is_none()
    }

    /// It also lacks `chunks`, if what it lacks is known.
    pub(crate) fn add(&mut self, chunks: &Chunks) {
        if let Some(known) = self.chunks.as_mut() {
            known.add(chunks);
        }
    }
}

/// A common point of two nodes' copies of a volume, kept by each for the other in its own
/// store: at this node's store sequence `store_sequence`, everything the two copies differ in
/// was written after it on one of them, so comparing what each changed since its own point
/// finds every difference (the store keeps each key's sequence number, and a replicated
/// volume's trims leave hole markers). A node keeps one when both copies are durable through
/// a FLUSH the other confirmed while in sync; losing the newest to a crash leaves an older
/// one, which only widens the comparison. A rollback makes copies differ without writing:
/// a point holds only while the volume's view excludes the same generations as at its
/// FLUSH (`excluded`: taken when the primary queued the FLUSH and when the replica applied
/// it, never when the point is written, which may be after a rollback).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Point {
    pub store_sequence: u64,
    pub excluded: Vec<(u64, u64)>,
}

impl Point {
    /// The point's store sequence, if it still holds for a volume whose view now excludes
    /// `excluded`.
    pub(crate) fn holds(&self, excluded: &[(u64, u64)]) -> Option<u64> {
        (self.excluded == excluded).then_some(self.store_sequence)
    }
}

/// What a primary knew its replicas lack when its node stopped cleanly: kept in the node's
/// store, and trusted by the next primary of the volume on this node only if the volume's
/// epoch has not moved since (no other primary, no change of its replicas).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct ShutdownNote {
    pub epoch: u64,
    pub lacking: Vec<(keel_catalog::NodeId, Chunks)>,
}

impl ShutdownNote {
    /// What the replicas lack, for a primary taking over from `epoch`: only if the note was
    /// written in that epoch.
    pub(crate) fn lacking_in(
        self,
        epoch: u64,
    ) -> Option<std::collections::BTreeMap<keel_catalog::NodeId, Chunks>> {
        (self.epoch == epoch).then(|| self.lacking.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: u64 = UNIT_BYTES;

    #[test]
    fn runs_merge_neighbouring_units_and_stop_at_the_size() {
        let mut chunks = Chunks::default();
        chunks.mark(0, 1);
        chunks.mark(U - 1, 2); // units 0 and 1
        chunks.mark(5 * U, 3 * U); // 5, 6, 7
        chunks.mark(130 * U, 1); // in the third word
        chunks.mark(9 * U, 0); // nothing
        assert_eq!(
            chunks.runs(u64::MAX, 4096),
            vec![(0, 2 * U), (5 * U, 8 * U), (130 * U, 131 * U)]
        );
        assert_eq!(
            chunks.runs(6 * U + 4096, 4096),
            vec![(0, 2 * U), (5 * U, 6 * U + 4096)]
        );
        // Blocks larger than a unit: runs widen to whole blocks, and merge.
        let block = 3 * U;
        assert_eq!(
            chunks.runs(u64::MAX, block),
            vec![(0, 9 * U), (129 * U, 132 * U)]
        );
        assert_eq!(Chunks::default().runs(u64::MAX, 4096), Vec::new());
    }

    #[test]
    fn a_replica_lacks_what_it_missed_and_what_it_never_confirmed() {
        let mut lacking = Lacking::default();
        // A primary that never streamed to it in full knows nothing.
        lacking.note(false, 1, 0, 4096);
        assert_eq!(lacking.to_compare(), None);
        lacking.caught_up();
        // In its stream: confirmed changes are forgotten, unconfirmed ones are lacked once
        // the stream ends, and changes while it has none are lacked at once.
        lacking.note(true, 2, 10 * U, 4096);
        lacking.note(true, 3, 20 * U, 4096);
        lacking.confirmed(2);
        lacking.stream_ended();
        lacking.note(false, 4, 30 * U, 4096);
        let chunks = lacking.to_compare().expect("known");
        assert_eq!(
            chunks.runs(u64::MAX, 4096),
            vec![(20 * U, 21 * U), (30 * U, 31 * U)]
        );
        lacking.caught_up();
        assert_eq!(lacking.to_compare(), Some(Chunks::default()));
        lacking.unknown();
        assert_eq!(lacking.to_compare(), None);
    }

    #[test]
    fn what_a_replica_lacks_grows_by_the_chunks_added_once_known() {
        let mut other = Chunks::default();
        other.mark(200 * U, 1);
        let mut lacking = Lacking::default();
        lacking.add(&other);
        assert!(lacking.is_unknown());
        lacking.caught_up();
        lacking.note(false, 1, 2 * U, 1);
        lacking.add(&other);
        assert_eq!(
            lacking.to_compare().expect("known").runs(u64::MAX, 4096),
            vec![(2 * U, 3 * U), (200 * U, 201 * U)]
        );
    }

    #[test]
    fn a_point_holds_only_while_the_same_generations_are_excluded() {
        let point = Point {
            store_sequence: 42,
            excluded: vec![(3, 5)],
        };
        assert_eq!(point.holds(&[(3, 5)]), Some(42));
        assert_eq!(point.holds(&[(3, 5), (7, 7)]), None);
        assert_eq!(point.holds(&[]), None);
    }

    #[test]
    fn a_shutdown_note_holds_only_in_its_own_epoch() {
        let mut chunks = Chunks::default();
        chunks.mark(3 * U, 1);
        let note = || ShutdownNote {
            epoch: 7,
            lacking: vec![(2, chunks.clone()), (3, Chunks::default())],
        };
        let bytes = postcard::to_allocvec(&note()).expect("encodes");
        let decoded: ShutdownNote = postcard::from_bytes(&bytes).expect("decodes");
        let lacking = decoded.lacking_in(7).expect("same epoch");
        assert_eq!(lacking.get(&2), Some(&chunks));
        assert_eq!(lacking.get(&3), Some(&Chunks::default()));
        assert_eq!(note().lacking_in(8), None);
        assert_eq!(note().lacking_in(6), None);
    }

    #[test]
    fn an_overflowing_tail_makes_it_unknown_until_confirmed() {
        let mut lacking = Lacking::default();
        lacking.caught_up();
        for position in 0..=UNCONFIRMED_MAX as u64 {
            lacking.note(true, position, 0, 1);
        }
        assert_eq!(lacking.unrecorded_upto, Some(UNCONFIRMED_MAX as u64));
        // Confirmed through the last unrecorded change: known again.
        lacking.confirmed(UNCONFIRMED_MAX as u64);
        lacking.stream_ended();
        assert_eq!(lacking.to_compare(), Some(Chunks::default()));
        for position in 0..=UNCONFIRMED_MAX as u64 {
            lacking.note(true, position, 0, 1);
        }
        lacking.stream_ended();
        assert_eq!(lacking.to_compare(), None);
    }
}
