//! The finalizer bookkeeping of leases (docs/concepts/lifetimes.md#finalizers): each
//! lease handed out and not yet released is tracked under its token, at an object id
//! where the binding keeps a weak reference to its object. A lease collected while
//! still tracked was never released, and is finalized; a release stops the tracking,
//! unless it failed (its finalizer tries again). In a forked child the leases are the
//! parent's: nothing is finalized there. The tracking outlives a close, so leases
//! still alive are finalized at exit.

use crate::tokens::{Freed, LifetimeKind, ObjectId, Release};

use super::{LifetimeHost, Manager};

impl Manager {
    /// Tracks lease `token`: a new object id, at which the caller keeps what finds
    /// the lease object. A token tracked already has its former object let go by
    /// `forget` (without the manager's lock), before its id can be given again.
    pub fn track_lease(&self, token: u64, forget: impl FnOnce(ObjectId)) -> ObjectId {
        let (id, former) = {
            let mut inner = self.inner();
            let id = inner.book.allocate();
            (id, inner.tracked.insert(token, id))
        };
        if let Some(former) = former {
            forget(former);
            self.inner().book.unref_let_go(former);
        }
        id
    }

    /// Stops tracking lease `token`: `forget` lets its object go (without the
    /// manager's lock), then its id is free again, so that no record given the id
    /// meanwhile can lose its object. `false` when it was not tracked (released or
    /// finalized already).
    pub fn untrack_lease(&self, token: u64, forget: impl FnOnce(ObjectId)) -> bool {
        let Some(id) = self.inner().tracked.remove(&token) else {
            return false;
        };
        forget(id);
        self.inner().book.unref_let_go(id);
        true
    }

    /// `untrack_lease`, its object let go by `host`.
    pub fn untrack_lease_with<H: LifetimeHost>(&self, host: &H, token: u64) -> bool {
        self.untrack_lease(token, |id| host.forget(id))
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
    /// [`Manager::try_release_now`]); a lease released is no longer tracked, its
    /// object let go by `forget` (see `untrack_lease`). What the release freed is in
    /// the result; `None` sends the caller down the waiting path, nothing changed.
    pub fn release_now(
        &self,
        kind: LifetimeKind,
        token: u64,
        forget: impl FnOnce(ObjectId),
    ) -> Option<Freed> {
        // `try_release_now`, the tracking ended under the same lock as the release.
        if self.check_process().is_err()
            || self.releases_queued()
            || !matches!(self.try_enter(false, true), Ok(true))
        {
            return None;
        }
        let mut freed = Freed::default();
        let tracked = {
            let mut inner = self.inner();
            inner.apply(Release::Token { kind, token }, &mut freed);
            if kind == LifetimeKind::Lease {
                inner.tracked.remove(&token)
            } else {
                None
            }
        };
        self.exit();
        if let Some(id) = tracked {
            forget(id);
            self.inner().book.unref_let_go(id);
        }
        Some(freed)
    }

    /// Whether lease `token` is tracked.
    pub fn is_tracked(&self, token: u64) -> bool {
        self.inner().tracked.contains_key(&token)
    }
}
