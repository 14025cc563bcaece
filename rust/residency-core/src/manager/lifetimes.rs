//! The manager's lifetime bookkeeping beyond the records: releases (applied at once,
//! or queued behind a source callback), reaping the pending CUDA leases whose events
//! completed, and the transfers a pending lease protects. Events are known by id
//! (`tokens::ObjectId`); asking whether one completed, or waiting for it, is the
//! caller's closure. Every method but `release`, `try_release_now` and `new_object`
//! expects the caller to hold the gate, and none holds a lock while a closure runs.
//! The rules are written in docs/concepts/lifetimes.md.

use crate::error::CoreResult;
use crate::location::Location;
use crate::state::HandleId;
use crate::tokens::{self, Events, Freed, LifetimeKind, ObjectId, Release};

use super::{Inner, Manager};

/// How [`Manager::settle_on_device`] waits for a pending lease's events.
#[derive(Debug)]
pub enum SettleWait<'a, O> {
    /// Each owning stream (one per value, repeats included) waits on the device.
    Device {
        owners: Vec<O>,
        events: &'a [ObjectId],
    },
    /// The host waits.
    Host { events: &'a [ObjectId] },
}

impl Inner {
    /// Applies one release; what it frees is added to `freed`.
    pub(super) fn apply(&mut self, release: Release, freed: &mut Freed) {
        match release {
            Release::Token { kind, token } => match kind {
                LifetimeKind::Lease => {
                    self.release_lease(token);
                }
                LifetimeKind::Hold => {
                    self.release_hold(token);
                }
                LifetimeKind::Reservation => {
                    if self.release_reservation(token) {
                        freed.reservations.push(token);
                    }
                }
            },
            Release::Pending {
                token,
                events,
                completed,
            } => {
                if !self.lease_to_pending(token) {
                    // Released meanwhile, or ended by a forced close.
                    self.book.unref(events, freed);
                } else if completed {
                    self.release_pending(token);
                    self.book.unref(events, freed);
                } else {
                    self.book.add_pending(token, events);
                }
            }
        }
    }

    /// Releases a pending lease and forgets its events and the transfer it protected.
    fn settle_pending(&mut self, token: u64, freed: &mut Freed) -> bool {
        let released = self.release_pending(token);
        self.book.forget_pending(token, freed);
        released
    }
}

impl Manager {
    /// A new object id, referred to once: the binding keeps the object at it until a
    /// [`Freed`] hands it back.
    pub fn new_object(&self) -> ObjectId {
        self.inner().book.allocate()
    }

    /// The object ids of a [`Freed`] whose objects the binding has let go: they may be
    /// given again from now on, never before (docs/concepts/lifetimes.md#object-ids).
    pub fn recycle(&self, ids: &[ObjectId]) {
        if !ids.is_empty() {
            self.inner().book.recycle(ids.iter().copied());
        }
    }

    /// How many object ids are in use (for leak checks).
    pub fn live_objects(&self) -> usize {
        self.inner().book.live_objects()
    }

    /// True when releases are queued behind a callback (read without a lock).
    pub fn releases_queued(&self) -> bool {
        !self.releases.is_empty()
    }

    /// Whether reaping has anything to do: releases queued, leases pending or
    /// transfers in flight.
    pub fn reap_needed(&self) -> bool {
        if !self.releases.is_empty() {
            return true;
        }
        let inner = self.inner();
        inner.book.has_pending() || inner.book.transfer_count() > 0
    }

    /// Applies one release. The caller holds the gate.
    pub fn apply(&self, release: Release) -> Freed {
        let mut freed = Freed::default();
        self.inner().apply(release, &mut freed);
        freed
    }

    /// Applies the queued releases, oldest first. The caller holds the gate.
    pub fn drain_releases(&self, freed: &mut Freed) {
        self.releases
            .drain(|release| self.inner().apply(release, freed));
    }

    /// Releases a lifetime's tokens now when the gate is free and nothing is queued
    /// (the fast path); `None` sends the caller down `release` (nothing changed then).
    pub fn try_release_now(&self, kind: LifetimeKind, token: u64) -> Option<Freed> {
        // Queued releases go first, in order: the waiting path applies them (and a
        // forked child's refusal is raised there).
        if self.check_process().is_err()
            || !self.releases.is_empty()
            || !matches!(self.try_enter(false, true), Ok(true))
        {
            return None;
        }
        let freed = self.apply(Release::Token { kind, token });
        self.exit();
        Some(freed)
    }

    /// Applies `release` under the gate, which `enter(check_reentrant)` takes
    /// (waiting for it); while a source callback runs elsewhere it is queued instead
    /// (see [`tokens::release_or_queue`]). What it frees is added to `freed`, also
    /// on failure.
    pub fn release(
        &self,
        release: Release,
        finalizing: bool,
        enter: impl FnMut(bool) -> CoreResult<()>,
        freed: &mut Freed,
    ) -> CoreResult<()> {
        let mut applied = Freed::default();
        let result = tokens::release_or_queue(
            &self.gate,
            &self.releases,
            release,
            finalizing,
            enter,
            |release| self.inner().apply(release, &mut applied),
            || self.exit(),
        );
        freed.append(applied);
        result.map_err(|refused| {
            if let Some(Release::Pending { events, .. }) = refused.release {
                // Neither applied nor queued: nothing refers to its events.
                self.inner().book.unref(events, freed);
            }
            refused.error
        })
    }

    /// The pending leases and their events, in release order.
    pub fn pending_events(&self) -> Vec<(u64, Vec<ObjectId>)> {
        self.pending_list()
            .into_iter()
            .map(|(token, events)| (token, events.to_vec()))
            .collect()
    }

    /// The pending leases and their events, in release order, as the book keeps them.
    fn pending_list(&self) -> Vec<(u64, Events)> {
        self.inner().book.pending()
    }

    /// Applies the queued releases, then releases every pending lease whose events
    /// all report complete (`complete` is asked in order, until one is not), then
    /// forgets the transfers released on the device whose events completed. An event
    /// several of them share is asked once: a completed event stays complete. A
    /// failing `complete` stops the reaping; what was freed until then is in `freed`.
    pub fn reap<E>(
        &self,
        mut complete: impl FnMut(ObjectId) -> Result<bool, E>,
        freed: &mut Freed,
    ) -> Result<(), E> {
        // The lock-free hint is enough here: a release queued behind a callback is
        // applied when the callback returns, or by its own thread (`release`).
        if !self.releases.is_empty() {
            self.drain_releases(freed);
        }
        let mut completed = Completed::default();
        let mut complete = |event: ObjectId| {
            if completed.contains(event) {
                return Ok(true);
            }
            let done = complete(event)?;
            if done {
                completed.push(event);
            }
            Ok(done)
        };
        for (token, events) in self.pending_list() {
            if all_complete(&events, &mut complete)? {
                self.inner().settle_pending(token, freed);
            }
        }
        self.reap_transfers(&mut complete, freed)
    }

    /// Forgets the transfers released on the device whose events all completed.
    pub fn reap_transfers<E>(
        &self,
        mut complete: impl FnMut(ObjectId) -> Result<bool, E>,
        freed: &mut Freed,
    ) -> Result<(), E> {
        let released = {
            let inner = self.inner();
            if inner.book.transfer_count() == 0 {
                return Ok(());
            }
            inner.book.released_transfers()
        };
        for (token, events) in released {
            if all_complete(&events, &mut complete)? {
                self.inner().book.forget_released_transfer(token, freed);
            }
        }
        Ok(())
    }

    /// The pending leases whose events all report complete, released or not: they no
    /// longer protect anything (explain's rule). An event whose question fails
    /// (`complete` returns `false` for it) keeps its lease protecting.
    pub fn completed_pending(&self, mut complete: impl FnMut(ObjectId) -> bool) -> Vec<u64> {
        self.pending_list()
            .into_iter()
            .filter(|(_, events)| events.iter().all(|&event| complete(event)))
            .map(|(token, _)| token)
            .collect()
    }

    /// Waits (`wait`) for the events of the pending leases `selected` picks, releasing
    /// each after its wait; with `transfers`, also for every transfer in flight. A
    /// failing wait stops there; what was freed until then is in `freed`.
    pub fn settle<E>(
        &self,
        selected: impl Fn(u64) -> bool,
        transfers: bool,
        mut wait: impl FnMut(ObjectId) -> Result<(), E>,
        freed: &mut Freed,
    ) -> Result<(), E> {
        self.drain_releases(freed);
        let in_flight = if transfers {
            self.inner().book.transfer_tokens()
        } else {
            Vec::new()
        };
        for (token, events) in self.pending_list() {
            if !selected(token) && !in_flight.contains(&token) {
                continue;
            }
            for &event in events.iter() {
                wait(event)?;
            }
            self.inner().settle_pending(token, freed);
        }
        if transfers {
            self.reap_transfers(|event| wait(event).map(|()| true), freed)?;
        }
        Ok(())
    }

    /// Releases a pending lease whose events completed, and forgets them and the
    /// transfer it protected. `false` when the token is no pending lease.
    pub fn settle_pending(&self, token: u64, freed: &mut Freed) -> bool {
        self.inner().settle_pending(token, freed)
    }

    /// Releases a pending lease whose events the device orders before any reuse of
    /// its memory (docs/concepts/controller.md#evicting-around-reads-in-flight): a
    /// transfer it protected keeps the events, which consumers still wait for, until
    /// they complete. `false` when the token is no pending lease.
    pub fn release_on_device(&self, token: u64, freed: &mut Freed) -> bool {
        let mut inner = self.inner();
        let released = inner.release_pending(token);
        if released {
            inner.book.forget_on_device(token, freed);
        }
        released
    }

    /// Releases the pending leases among `tokens` without a host wait where the
    /// device's order makes that safe (docs/concepts/controller.md#evicting-around-reads-in-flight):
    /// on CUDA, when `owner` knows the owning stream of every value's memory, those
    /// streams wait for the lease's events on the device, then the lease is released
    /// (a transfer it protected keeps the events until they complete). Otherwise, with
    /// `host`, its events are waited for on the host; else it is left pending, and
    /// returned. A failing wait stops there, its lease still pending.
    pub fn settle_on_device<O, E>(
        &self,
        tokens: &[u64],
        host: bool,
        mut owner: impl FnMut(HandleId, Location) -> Option<O>,
        mut wait: impl FnMut(SettleWait<'_, O>) -> Result<(), E>,
        freed: &mut Freed,
    ) -> Result<Vec<u64>, E> {
        let mut left = Vec::new();
        for (token, events) in self.pending_list() {
            if !tokens.contains(&token) {
                continue;
            }
            let Some((handles, location)) = self.pending_lease_values(token) else {
                continue;
            };
            let owners: Option<Vec<O>> = match location {
                Location::Cuda(_) => handles
                    .iter()
                    .map(|&handle| owner(handle, location))
                    .collect(),
                _ => None,
            };
            match owners {
                Some(owners) => wait(SettleWait::Device {
                    owners,
                    events: &events,
                })?,
                None if host => wait(SettleWait::Host { events: &events })?,
                None => {
                    left.push(token);
                    continue;
                }
            }
            self.release_on_device(token, freed);
        }
        Ok(left)
    }

    /// Protects an asynchronous copy into `(handle, at)` until `event` completes: the
    /// destination, and the `source` materialisation it reads, each get a pending
    /// lease on it (docs/concepts/controller.md#copies-in-flight); `keepalive` is kept
    /// until then too. The ids are the caller's reference, which this takes over.
    /// When the destination is not resident (nothing to protect) the ids are freed
    /// and returned in `freed`, and the result is `false`: the caller waits for the
    /// copy itself.
    pub fn protect_transfer(
        &self,
        handle: HandleId,
        at: Location,
        source: Option<Location>,
        event: ObjectId,
        keepalive: Option<ObjectId>,
        freed: &mut Freed,
    ) -> bool {
        let Ok(token) = self.acquire(&[handle], at) else {
            let mut inner = self.inner();
            inner
                .book
                .unref([event].into_iter().chain(keepalive), freed);
            return false;
        };
        let mut inner = self.inner();
        inner.lease_to_pending(token);
        inner.book.add_pending(token, Events::One(event));
        inner.book.add_transfer(token, handle, at, keepalive);
        drop(inner);
        if let Some(source) = source
            && let Ok(read) = self.acquire(&[handle], source)
        {
            let mut inner = self.inner();
            inner.lease_to_pending(read);
            inner.book.share(&[event]);
            inner.book.add_pending(read, Events::One(event));
        }
        true
    }

    /// The events of the transfers still in flight into any of `handles` at `at`.
    pub fn transfer_events(&self, handles: &[HandleId], at: Location) -> Vec<ObjectId> {
        let inner = self.inner();
        if inner.book.transfer_count() == 0 {
            return Vec::new();
        }
        inner.book.transfer_events(handles, at)
    }

    /// The pending tokens of the transfers in flight.
    pub fn transfer_tokens(&self) -> Vec<u64> {
        self.inner().book.transfer_tokens()
    }

    /// The pending tokens of the transfers in flight into any of `handles` at `at`.
    pub fn transfer_tokens_into(&self, handles: &[HandleId], at: Location) -> Vec<u64> {
        self.inner().book.transfer_tokens_into(handles, at)
    }

    /// How many asynchronous transfers are in flight (not yet reaped).
    pub fn transfer_count(&self) -> usize {
        self.inner().book.transfer_count()
    }

    /// Forgets every pending lease's events, transfer and queued release (after a
    /// close); every id goes back in `freed`.
    pub fn clear_tokens(&self, freed: &mut Freed) {
        let queued = self.releases.take_all();
        let mut inner = self.inner();
        for release in queued {
            if let Release::Pending { events, .. } = release {
                inner.book.unref(events, freed);
            }
        }
        inner.book.clear(freed);
    }
}

/// Whether every event reports complete, asked in order until one does not.
/// The events a reap saw complete: the first few inline (a reap sees few), the
/// rest in a vector.
#[derive(Debug, Default)]
struct Completed {
    inline: [ObjectId; 4],
    len: usize,
    more: Vec<ObjectId>,
}

impl Completed {
    fn contains(&self, event: ObjectId) -> bool {
        self.inline
            .iter()
            .take(self.len)
            .any(|&known| known == event)
            || self.more.contains(&event)
    }

    fn push(&mut self, event: ObjectId) {
        match self.inline.get_mut(self.len) {
            Some(slot) => {
                *slot = event;
                self.len += 1;
            }
            None => self.more.push(event),
        }
    }
}

fn all_complete<E>(
    events: &[ObjectId],
    complete: &mut impl FnMut(ObjectId) -> Result<bool, E>,
) -> Result<bool, E> {
    for &event in events {
        if !complete(event)? {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::Completed;

    #[test]
    fn completed_events_are_known_past_the_inline_ones() {
        let mut completed = Completed::default();
        assert!(!completed.contains(0));
        for event in [7, 0, 3, 9, 12, 5] {
            completed.push(event);
        }
        for event in [7, 0, 3, 9, 12, 5] {
            assert!(completed.contains(event));
        }
        for event in [1, 2, 4, 6, 8, 13] {
            assert!(!completed.contains(event));
        }
    }
}
