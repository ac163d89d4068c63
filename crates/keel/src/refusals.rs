//! The NBD attaches this node refused, with why: the most recent [`KEPT`].
//!
//! An NBD client learns of a refusal only as the protocol's "export not available"
//! (NBD_REP_ERR_UNKNOWN); the server's text rides along, but libnbd clients (nbdinfo, nbdfuse,
//! so the CSI node plugin) keep it to their debug output and report "server has no export
//! named ...", whatever the reason. The admin API lists these (`GET /api/v1/nbd/refusals`), so
//! the plugin can tell kubelet why, say that the primary's lease has not run out yet.

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::Serialize;

/// Refusals kept, the most recent (each is a name and a sentence).
pub const KEPT: usize = 64;

/// One refused attach.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Counts this node's refusals since it started, from 1.
    pub id: u64,
    /// The export asked for: `VOLUME` or `VOLUME@SNAPSHOT`.
    pub export: String,
    pub reason: String,
    pub unix_ms: i64,
}

/// The refusals a listing asks for, and the id of the last one recorded (0 for none): a
/// caller lists with `after` set to it before attaching, to learn only of its own attach's.
#[derive(Serialize, Debug)]
pub struct Listing {
    pub last: u64,
    pub refusals: Vec<Refusal>,
}

#[derive(Default)]
pub struct Refusals {
    kept: Mutex<(u64, VecDeque<Refusal>)>,
}

impl Refusals {
    pub fn record(&self, export: &str, reason: String, unix_ms: i64) {
        let mut kept = self.lock();
        kept.0 += 1;
        let id = kept.0;
        if kept.1.len() == KEPT {
            kept.1.pop_front();
        }
        kept.1.push_back(Refusal {
            id,
            export: export.to_string(),
            reason,
            unix_ms,
        });
    }

    /// The refusals kept, oldest first: of `export` only when given, after id `after` when
    /// given.
    pub fn list(&self, export: Option<&str>, after: Option<u64>) -> Listing {
        let kept = self.lock();
        Listing {
            last: kept.0,
            refusals: (kept.1.iter())
                .filter(|refusal| export.is_none_or(|export| refusal.export == export))
                .filter(|refusal| after.is_none_or(|after| refusal.id > after))
                .cloned()
                .collect(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, VecDeque<Refusal>)> {
        // A panic elsewhere under this lock left a consistent list (each change is one push).
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves the list keeps the most recent KEPT, filters by export and by id, and reports the
    // last id even when nothing matches.
    #[test]
    fn keeps_the_most_recent_and_filters() {
        let refusals = Refusals::default();
        assert_eq!(refusals.list(None, None).last, 0);
        for n in 0..KEPT + 3 {
            let export = if n % 2 == 0 { "even" } else { "odd" };
            refusals.record(export, format!("refusal {n}"), n as i64);
        }
        let all = refusals.list(None, None);
        assert_eq!(all.last, KEPT as u64 + 3);
        assert_eq!(all.refusals.len(), KEPT);
        assert_eq!(all.refusals[0].reason, "refusal 3");
        assert_eq!(all.refusals[0].id, 4);
        let odd = refusals.list(Some("odd"), Some(all.last - 4));
        let reasons: Vec<&str> = odd.refusals.iter().map(|r| r.reason.as_str()).collect();
        assert_eq!(
            reasons,
            [
                format!("refusal {}", KEPT - 1),
                format!("refusal {}", KEPT + 1)
            ]
        );
        let none = refusals.list(Some("odd"), Some(all.last));
        assert!(none.refusals.is_empty());
        assert_eq!(none.last, all.last);
    }
}
