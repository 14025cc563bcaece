//! The finalizer bookkeeping of leases (docs/concepts/lifetimes.md#finalizers): each
//! lease handed out and not yet released is tracked under its token, at an object id
//! where the binding keeps a weak reference to its object. A lease collected while
//! still tracked was never released, and is finalized; a release stops the tracking,
//! unless it failed (its finalizer tries again). In a forked child the leases are the
//! parent's: nothing is finalized there. The tracking outlives a close, so leases
//! still alive are finalized at exit.

use crate::tokens::{Freed, LifetimeKind, ObjectId};

use super::{LifetimeHost, Manager};

/// What [`Manager::release_now`] let go.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ReleasedNow {
    /// What the release freed.
    pub freed: Freed,
    /// The id the lease was tracked at, now free (its object the caller's to let go).
    pub untracked: Option<ObjectId>,
}

impl Manager {
    /// Tracks lease `token`: a new object id, at which the caller keeps what finds
    /// the lease object. A token tracked already lets its former id go (in `freed`,
    /// never the new id).
    pub fn track_lease(&self, token: u64, freed: &mut Freed) -> ObjectId {
        let mut inner = self.inner();
        let id = inner.book.allocate();
        if let Some(former) = inner.tracked.insert(token, id) {
            inner.book.unref([former], freed);
        }
        id
    }

    /// Stops tracking lease `token`: the id it was tracked at, free again (the
    /// caller lets its object go); `None` when it was not tracked (released or
    /// finalized already).
    pub fn untrack_lease(&self, token: u64) -> Option<ObjectId> {
        let mut inner = self.inner();
        let id = inner.tracked.remove(&token)?;
        inner.book.unref_one(id).then_some(id)
    }

    /// `untrack_lease`, its object let go by `host`.
    pub fn untrack_lease_with<H: LifetimeHost>(&self, host: &H, token: u64) -> bool {
        let Some(id) = self.untrack_lease(token) else {
            return false;
        };
        host.forget(id);
        true
    }

    /// Whether a collected lease `token` is to be finalized now: not in a forked
    /// child, and only while it is still tracked, which this ends (its id handed
    /// back to `host`). A lease released or finalized already is left alone.
    pub fn finalize_tracked_with<H: LifetimeHost>(&self, host: &H, token: u64) -> bool {
        self.check_process().is_ok() && self.untrack_lease_with(host, token)
    }

    /// The ids of the tracked leases, oldest (lowest token) first.
    pub fn tracked_leases(&self) -> Vec<ObjectId> {
        let inner = self.inner();
        let mut tracked: Vec<(u64, ObjectId)> = inner
            .tracked
            .iter()
            .map(|(&token, &id)| (token, id))
            .collect();
        drop(inner);
        tracked.sort_unstable_by_key(|&(token, _)| token);
        tracked.into_iter().map(|(_, id)| id).collect()
    }

    /// Releases a token at once when the gate is free and nothing is queued (see
    /// [`Manager::try_release_now`]); a lease released is no longer tracked. `None`
    /// sends the caller down the waiting path, nothing changed.
    pub fn release_now(&self, kind: LifetimeKind, token: u64) -> Option<ReleasedNow> {
        let freed = self.try_release_now(kind, token)?;
        let untracked = match kind {
            LifetimeKind::Lease => self.untrack_lease(token),
            LifetimeKind::Hold | LifetimeKind::Reservation => None,
        };
        Some(ReleasedNow { freed, untracked })
    }

    /// Whether lease `token` is tracked.
    pub fn is_tracked(&self, token: u64) -> bool {
        self.inner().tracked.contains_key(&token)
    }
}
