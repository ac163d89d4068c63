//! Views: which block extents a volume, a snapshot or a clone sees.
//!
//! A view is a list of layers, newest first. Layer 0 is the volume's own extents; the following
//! layers are the parents a clone falls through to (each frozen at the snapshot it was cloned
//! from). Reading block `b` asks each layer in turn for "the newest generation at or below
//! `generation_max`, above the truncation floor, outside the excluded ranges"; the first layer that
//! answers wins, and a layer with a truncation covering `b` ends the walk (everything below it is
//! hidden).
//!
//! Invariants:
//! - `excluded` is sorted, disjoint, non-adjacent inclusive ranges, none containing generation 0;
//! - generations start at 1, so `block_key(vol, b, 0)` is a lower bound for every extent of `b`;
//! - the resolution rule is the same whether it runs against the store ([`Layer::floor_range`]
//!   loop in the handle) or against a list of generations in memory ([`resolve`]): scans (GC,
//!   send, usage) and reads must agree on what a view sees.

use serde::{Deserialize, Serialize};

/// Blocks at or past `block_from` see nothing at generations `<= generation_upto` in this layer,
/// nor anything in lower layers. Written by a shrink, so that growing again shows zeroes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Truncation {
    pub block_from: u64,
    pub generation_upto: u64,
}

/// One volume's extents as one view sees them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layer {
    pub volume_id: u64,
    /// Newest generation this view sees in this volume.
    pub generation_max: u64,
    /// Inclusive generation ranges this view skips (discarded by a rollback, or reserved by a
    /// receive that has not committed).
    pub excluded: Vec<(u64, u64)>,
    pub truncations: Vec<Truncation>,
}

impl Layer {
    pub fn new(volume_id: u64, generation_max: u64) -> Layer {
        Layer {
            volume_id,
            generation_max,
            excluded: Vec::new(),
            truncations: Vec::new(),
        }
    }

    /// Adds `[low, high]` to the excluded ranges, keeping them sorted and merged.
    pub fn exclude(&mut self, low: u64, high: u64) {
        if low > high {
            return;
        }
        assert!(low >= 1, "generation 0 is never written, so never excluded");
        self.excluded.push((low, high));
        self.excluded.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.excluded.len());
        for &(range_low, range_high) in &self.excluded {
            match merged.last_mut() {
                Some(last) if range_low <= last.1.saturating_add(1) => {
                    last.1 = last.1.max(range_high);
                }
                _ => merged.push((range_low, range_high)),
            }
        }
        self.excluded = merged;
    }

    /// Makes `generation` visible: above `generation_max`, raises it there and excludes the
    /// generations in between (this layer saw none of them); otherwise takes it out of the
    /// excluded ranges.
    pub fn include(&mut self, generation: u64) {
        if generation > self.generation_max {
            let below = self.generation_max + 1;
            self.generation_max = generation;
            self.exclude(below, generation - 1);
            return;
        }
        let mut kept = Vec::with_capacity(self.excluded.len() + 1);
        for &(low, high) in &self.excluded {
            if generation < low || generation > high {
                kept.push((low, high));
                continue;
            }
            if low < generation {
                kept.push((low, generation - 1));
            }
            if generation < high {
                kept.push((generation + 1, high));
            }
        }
        self.excluded = kept;
    }

    /// The excluded range holding `generation`, if any.
    pub fn excluded_range(&self, generation: u64) -> Option<(u64, u64)> {
        // Ranges are sorted and disjoint: the candidate is the last one starting at or below.
        let index = self.excluded.partition_point(|&(low, _)| low <= generation);
        if index == 0 {
            return None;
        }
        let (low, high) = self.excluded[index - 1];
        (generation <= high).then_some((low, high))
    }

    /// Generations at or below this are hidden for `block` (0: nothing hidden).
    pub fn hidden_upto(&self, block: u64) -> u64 {
        self.truncations
            .iter()
            .filter(|truncation| block >= truncation.block_from)
            .map(|truncation| truncation.generation_upto)
            .max()
            .unwrap_or(0)
    }

    /// The generation this layer shows for a block whose extents in this volume are at
    /// `generations` (ascending), or None.
    pub fn visible(&self, block: u64, generations: &[u64]) -> Option<u64> {
        let hidden = self.hidden_upto(block);
        generations.iter().rev().copied().find(|&generation| {
            generation <= self.generation_max
                && generation > hidden
                && self.excluded_range(generation).is_none()
        })
    }
}

/// What one layer of a view says of a block ([`Layer::answer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerAnswer {
    /// The extent of this generation, in this layer's volume.
    Shows(u64),
    /// Zeroes: a truncation hides the block here and in every layer below.
    Hidden,
    /// Nothing here: the next layer answers.
    Below,
}

impl Layer {
    /// What this layer says of a block whose extents in its volume are at `generations`
    /// (ascending): the rule every read of a view applies, layer by layer.
    pub fn answer(&self, block: u64, generations: &[u64]) -> LayerAnswer {
        match self.visible(block, generations) {
            Some(generation) => LayerAnswer::Shows(generation),
            None if self.hidden_upto(block) > 0 => LayerAnswer::Hidden,
            None => LayerAnswer::Below,
        }
    }
}

/// What a view shows for one block: the extent's (volume id, generation), or None (zeroes).
///
/// `generations_of(volume_id)` gives the ascending generations of the block's extents in that
/// volume.
pub fn resolve<'a>(
    view: &[Layer],
    block: u64,
    mut generations_of: impl FnMut(u64) -> &'a [u64],
) -> Option<(u64, u64)> {
    for layer in view {
        match layer.answer(block, generations_of(layer.volume_id)) {
            LayerAnswer::Shows(generation) => return Some((layer.volume_id, generation)),
            LayerAnswer::Hidden => return None,
            LayerAnswer::Below => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves exclusion ranges merge and answer membership exactly at their edges.
    #[test]
    fn exclude_merges_and_finds() {
        let mut layer = Layer::new(1, 100);
        layer.exclude(5, 7);
        layer.exclude(10, 12);
        layer.exclude(8, 9);
        layer.exclude(20, 19); // empty: ignored
        assert_eq!(layer.excluded, vec![(5, 12)]);
        layer.exclude(30, 31);
        assert_eq!(layer.excluded_range(4), None);
        assert_eq!(layer.excluded_range(5), Some((5, 12)));
        assert_eq!(layer.excluded_range(12), Some((5, 12)));
        assert_eq!(layer.excluded_range(13), None);
        assert_eq!(layer.excluded_range(31), Some((30, 31)));
        assert_eq!(layer.excluded_range(32), None);
    }

    // Proves including a generation raises the layer past it (hiding what lies between) or
    // splits the excluded range holding it, and shows nothing else.
    #[test]
    fn include_shows_one_generation() {
        let mut layer = Layer::new(1, 4);
        layer.exclude(2, 2);
        layer.include(9);
        assert_eq!(layer.generation_max, 9);
        assert_eq!(layer.excluded, vec![(2, 2), (5, 8)]);
        layer.include(7);
        assert_eq!(layer.excluded, vec![(2, 2), (5, 6), (8, 8)]);
        layer.include(8);
        layer.include(5);
        assert_eq!(layer.excluded, vec![(2, 2), (6, 6)]);
        layer.include(3); // already visible
        assert_eq!(layer.excluded, vec![(2, 2), (6, 6)]);
        let shown: Vec<u64> = (1..=10)
            .filter(|&generation| layer.visible(0, &[generation]).is_some())
            .collect();
        assert_eq!(shown, vec![1, 3, 4, 5, 7, 8, 9]);
    }

    // Proves resolution skips excluded generations, honours truncations and falls through to
    // parent layers only when no truncation covers the block.
    #[test]
    fn resolve_walks_layers() {
        let mut top = Layer::new(2, 10);
        top.exclude(6, 8);
        let parent = Layer::new(1, 4);
        let view = vec![top.clone(), parent];
        let generations = |volume: u64| -> &'static [u64] {
            if volume == 2 {
                &[3, 7]
            } else {
                &[2, 5]
            }
        };
        assert_eq!(resolve(&view, 0, generations), Some((2, 3)));
        let only_excluded = |volume: u64| -> &'static [u64] {
            if volume == 2 {
                &[7]
            } else {
                &[2, 5]
            }
        };
        assert_eq!(resolve(&view, 0, only_excluded), Some((1, 2)));
        let mut truncated = top;
        truncated.truncations.push(Truncation {
            block_from: 10,
            generation_upto: 3,
        });
        let view = vec![truncated, Layer::new(1, 4)];
        assert_eq!(resolve(&view, 9, only_excluded), Some((1, 2)));
        assert_eq!(resolve(&view, 10, only_excluded), None);
        assert_eq!(resolve(&view, 10, generations), None);
    }
}
