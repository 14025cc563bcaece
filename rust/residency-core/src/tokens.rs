//! Lifetime tokens beyond their records: the releases deferred behind a source
//! callback, the CUDA events each pending lease waits on, and which pending token
//! protects which asynchronous transfer.
//!
//! Events (and the objects a transfer keeps alive) are known here only by id. The
//! binding keeps each object in an array at its id; an id is counted once per
//! record that refers to it (one event protects a copy's destination and its source)
//! and handed back in [`Freed`] when the last one goes, for the binding to drop. The
//! rules are written in docs/concepts/lifetimes.md (deferred releases, reaping) and
//! docs/concepts/controller.md (copies in flight).

use std::collections::VecDeque;
use std::sync::PoisonError;

#[cfg(loom)]
use loom::sync::Mutex;
#[cfg(loom)]
use loom::sync::atomic::{AtomicUsize, Ordering};
#[cfg(not(loom))]
use std::sync::Mutex;
#[cfg(not(loom))]
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{CoreError, CoreResult};
use crate::gate::Gate;
use crate::location::Location;
use crate::state::HandleId;

/// The id of an object the binding keeps for the core: a CUDA event, or what a copy
/// in flight reads.
pub type ObjectId = usize;

/// The lifetime a token belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LifetimeKind {
    Lease,
    Hold,
    Reservation,
}

/// One release of a lifetime's tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Release {
    /// A lease's, hold's or reservation's tokens go. A token already gone is no
    /// error: two threads may release one lifetime at once, a finaliser may race an
    /// explicit release, and a forced close ends every token.
    Token { kind: LifetimeKind, token: u64 },
    /// A CUDA lease's use tokens become pending on `events`, or go at once when the
    /// events are known `completed`.
    Pending {
        token: u64,
        events: Vec<ObjectId>,
        completed: bool,
    },
}

/// What a change gave back: the objects no record refers to any more, and the
/// reservations released (whose labels the binding keeps).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Freed {
    pub objects: Vec<ObjectId>,
    pub reservations: Vec<u64>,
}

impl Freed {
    pub fn is_empty(&self) -> bool {
        self.objects.is_empty() && self.reservations.is_empty()
    }

    pub fn append(&mut self, other: Freed) {
        self.objects.extend(other.objects);
        self.reservations.extend(other.reservations);
    }
}

/// A release that failed: the error, and the release when it was neither applied
/// nor queued (its event ids are still the caller's).
#[derive(Debug)]
pub struct Refused {
    pub error: CoreError,
    pub release: Option<Release>,
}

/// Releases that arrived while a source callback ran, applied oldest first as soon as
/// it has returned. Its own lock, never held while anything else is taken.
#[derive(Debug, Default)]
pub struct ReleaseQueue {
    queue: Mutex<VecDeque<Release>>,
    /// How many are queued, read without the lock on every operation's fast path.
    queued: AtomicUsize,
}

impl ReleaseQueue {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&self, release: Release) {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        queue.push_back(release);
        self.queued.store(queue.len(), Ordering::Release);
    }

    /// The oldest queued release. Always under the lock: the thread that ends a
    /// callback clears its flag and then pops, the releasing thread pushes and then
    /// reads the flag, and only the lock orders the two (a count read without it may
    /// be stale, and the release lost).
    pub fn pop(&self) -> Option<Release> {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let release = queue.pop_front();
        self.queued.store(queue.len(), Ordering::Release);
        release
    }

    /// True when nothing is queued (without the lock: a hint for fast paths, which
    /// may miss a release being queued; the drain after a callback never relies on it).
    pub fn is_empty(&self) -> bool {
        self.queued.load(Ordering::Acquire) == 0
    }

    /// Everything queued, oldest first; the queue is left empty.
    pub fn take_all(&self) -> VecDeque<Release> {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        self.queued.store(0, Ordering::Release);
        std::mem::take(&mut *queue)
    }

    /// Applies every queued release, oldest first, including those queued meanwhile.
    /// The caller holds the gate.
    pub fn drain(&self, mut apply: impl FnMut(Release)) {
        while let Some(release) = self.pop() {
            apply(release);
        }
    }
}

/// Releases `release` under the gate, waiting for it if another thread holds it; while
/// a source callback runs on another thread (or a finaliser fires inside one, or in
/// the middle of this thread's own transition) it is queued instead, and applied as
/// soon as the callback ends (docs/concepts/lifetimes.md#deferred-releases).
///
/// `enter(check_reentrant)` takes the gate, waiting for it, and fails with a
/// re-entrancy error while a callback runs; `apply` applies one release under the
/// gate and `exit` leaves it. A release on the callback's own thread (not a
/// finaliser's) fails with the re-entrancy error, and nothing is queued then: the
/// refusal hands the release back.
pub fn release_or_queue(
    gate: &Gate,
    queue: &ReleaseQueue,
    release: Release,
    finalizing: bool,
    mut enter: impl FnMut(bool) -> CoreResult<()>,
    mut apply: impl FnMut(Release),
    exit: impl Fn(),
) -> Result<(), Refused> {
    let refused = |error: CoreError, release: Release| Refused {
        error,
        release: Some(release),
    };
    loop {
        match enter(true) {
            Ok(()) => {
                queue.drain(&mut apply);
                apply(release);
                exit();
                return Ok(());
            }
            Err(err @ CoreError::Reentrancy { .. }) => {
                // A finaliser never fails for re-entrancy: inside a callback, or in the
                // middle of this thread's own transition, its release waits in the queue.
                if gate.callback_running_elsewhere()
                    || (finalizing && (gate.callback_active() || gate.check_reentrant().is_err()))
                {
                    break;
                }
                if gate.callback_active() {
                    // The callback is this thread's own.
                    return Err(refused(err, release));
                }
                // Either this thread is mid-transition (this fails), or the callback
                // ended since the attempt: try again.
                if let Err(err) = gate.check_reentrant() {
                    return Err(refused(err, release));
                }
            }
            Err(err) => return Err(refused(err, release)),
        }
    }
    queue.push(release);
    if !gate.callback_active() && gate.check_reentrant().is_ok() {
        // The callback ended while the release was queued: apply it now. (In the
        // middle of this thread's transition the queue waits for the next operation.)
        match enter(false) {
            Ok(()) => {
                queue.drain(&mut apply);
                exit();
            }
            // Another callback started; its transition drains the queue.
            Err(CoreError::Reentrancy { .. }) => {}
            // Queued: the next operation applies it.
            Err(error) => {
                return Err(Refused {
                    error,
                    release: None,
                });
            }
        }
    }
    Ok(())
}

/// One asynchronous copy into `(handle, location)`, protected by the pending lease
/// `token` until its event completes (docs/concepts/controller.md#copies-in-flight).
#[derive(Debug, Clone)]
struct Transfer {
    token: u64,
    handle: HandleId,
    location: Location,
    /// What the copy reads when it is no materialisation (a loaded value), kept
    /// alive until the copy has completed.
    keepalive: Option<ObjectId>,
    /// Empty while `token` is pending (its events are there). Once the protection
    /// was released on the device, the copy's events: consumers still wait for them,
    /// and the record goes when they complete.
    events: Vec<ObjectId>,
}

/// A pending lease's events: most wait on one, kept inline (no allocation to store
/// or to copy it).
#[derive(Debug, Clone)]
pub(crate) enum Events {
    One(ObjectId),
    Many(Vec<ObjectId>),
}

impl std::ops::Deref for Events {
    type Target = [ObjectId];

    fn deref(&self) -> &[ObjectId] {
        match self {
            Self::One(event) => std::slice::from_ref(event),
            Self::Many(events) => events,
        }
    }
}

impl From<Vec<ObjectId>> for Events {
    fn from(events: Vec<ObjectId>) -> Self {
        match *events.as_slice() {
            [event] => Self::One(event),
            _ => Self::Many(events),
        }
    }
}

impl IntoIterator for Events {
    type Item = ObjectId;
    type IntoIter = std::iter::Chain<std::option::IntoIter<ObjectId>, std::vec::IntoIter<ObjectId>>;

    fn into_iter(self) -> Self::IntoIter {
        match self {
            Self::One(event) => Some(event).into_iter().chain(Vec::new()),
            Self::Many(events) => None.into_iter().chain(events),
        }
    }
}

/// The pending leases' events, the transfers in flight and the object ids, kept
/// with the lease records (under the manager's inner lock).
#[derive(Debug, Default)]
pub(crate) struct TokenBook {
    /// The events of each pending CUDA lease, in release order.
    pending: Vec<(u64, Events)>,
    transfers: Vec<Transfer>,
    /// How many records refer to each id; 0 for a free one, [`QUARANTINED`] for one no
    /// record refers to whose object the binding has not let go yet.
    refs: Vec<u32>,
    free: Vec<ObjectId>,
}

/// An id no record refers to, handed back in a [`Freed`] and not given again until the
/// binding has let its object go (`Manager::recycle`): an id given again before that
/// would have its new object dropped in the old one's place
/// (docs/concepts/lifetimes.md#object-ids).
const QUARANTINED: u32 = u32::MAX;

impl TokenBook {
    /// A new id, referred to once.
    pub(crate) fn allocate(&mut self) -> ObjectId {
        if let Some(id) = self.free.pop() {
            self.refs[id] = 1;
            return id;
        }
        self.refs.push(1);
        self.refs.len() - 1
    }

    /// One more record refers to `id`.
    fn retain(&mut self, id: ObjectId) {
        if let Some(count) = self.refs.get_mut(id).filter(|count| **count != QUARANTINED) {
            *count = count.saturating_add(1).min(QUARANTINED - 1);
        }
    }

    /// One record less refers to each of `ids`; the last reference frees it.
    pub(crate) fn unref(&mut self, ids: impl IntoIterator<Item = ObjectId>, freed: &mut Freed) {
        for id in ids {
            if self.unref_one(id) {
                freed.objects.push(id);
            }
        }
    }

    /// One record less refers to `id`; `true` when that was the last one: its object
    /// is the caller's to let go, and the id is quarantined until [`Self::recycle`]
    /// says it was.
    pub(crate) fn unref_one(&mut self, id: ObjectId) -> bool {
        match self.refs.get_mut(id) {
            Some(count) if *count > 1 && *count != QUARANTINED => {
                *count -= 1;
                false
            }
            Some(count) if *count == 1 => {
                *count = QUARANTINED;
                true
            }
            // Unknown, quarantined or free: nothing refers to it.
            _ => false,
        }
    }

    /// `unref_one` of an id whose object the caller has let go already: free at once.
    pub(crate) fn unref_let_go(&mut self, id: ObjectId) {
        if self.unref_one(id) {
            self.recycle([id]);
        }
    }

    /// The quarantined `ids` are free again: their objects were let go. An id given
    /// back twice, or never quarantined, is left as it is.
    pub(crate) fn recycle(&mut self, ids: impl IntoIterator<Item = ObjectId>) {
        for id in ids {
            if let Some(count) = self.refs.get_mut(id).filter(|count| **count == QUARANTINED) {
                *count = 0;
                self.free.push(id);
            }
        }
    }

    /// How many ids are referred to (for the tests' leak checks); quarantined ones
    /// are not.
    pub(crate) fn live_objects(&self) -> usize {
        self.refs
            .iter()
            .filter(|count| **count > 0 && **count != QUARANTINED)
            .count()
    }

    pub(crate) fn add_pending(&mut self, token: u64, events: impl Into<Events>) {
        self.pending.push((token, events.into()));
    }

    pub(crate) fn pending(&self) -> Vec<(u64, Events)> {
        self.pending.clone()
    }

    pub(crate) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn take_pending_events(&mut self, token: u64) -> Option<Events> {
        let position = self.pending.iter().position(|(known, _)| *known == token)?;
        Some(self.pending.remove(position).1)
    }

    /// Forgets a released pending lease: its events, and the transfer it protected.
    pub(crate) fn forget_pending(&mut self, token: u64, freed: &mut Freed) {
        if let Some(events) = self.take_pending_events(token) {
            self.unref(events, freed);
        }
        let mut gone = Vec::new();
        self.transfers.retain_mut(|transfer| {
            if transfer.token != token {
                return true;
            }
            gone.extend(transfer.keepalive.take());
            gone.append(&mut transfer.events);
            false
        });
        self.unref(gone, freed);
    }

    /// Forgets a pending lease released on the device: its events move to the
    /// transfer it protected, if any, which consumers still wait for until they
    /// complete; otherwise they are freed.
    pub(crate) fn forget_on_device(&mut self, token: u64, freed: &mut Freed) {
        let Some(events) = self.take_pending_events(token) else {
            return;
        };
        match self
            .transfers
            .iter_mut()
            .find(|transfer| transfer.token == token)
        {
            Some(transfer) => transfer.events.extend(events),
            None => self.unref(events, freed),
        }
    }

    pub(crate) fn add_transfer(
        &mut self,
        token: u64,
        handle: HandleId,
        location: Location,
        keepalive: Option<ObjectId>,
    ) {
        self.transfers.push(Transfer {
            token,
            handle,
            location,
            keepalive,
            events: Vec::new(),
        });
    }

    /// The ids shared by another record.
    pub(crate) fn share(&mut self, ids: &[ObjectId]) {
        for &id in ids {
            self.retain(id);
        }
    }

    /// The transfers whose protection was released on the device, with their events.
    pub(crate) fn released_transfers(&self) -> Vec<(u64, Vec<ObjectId>)> {
        self.transfers
            .iter()
            .filter(|transfer| !transfer.events.is_empty())
            .map(|transfer| (transfer.token, transfer.events.clone()))
            .collect()
    }

    /// Forgets a released transfer (its events completed).
    pub(crate) fn forget_released_transfer(&mut self, token: u64, freed: &mut Freed) {
        let mut gone = Vec::new();
        self.transfers.retain_mut(|transfer| {
            if transfer.token != token || transfer.events.is_empty() {
                return true;
            }
            gone.append(&mut transfer.events);
            gone.extend(transfer.keepalive.take());
            false
        });
        self.unref(gone, freed);
    }

    /// The events of the transfers still in flight into any of `handles` at
    /// `location`: the pending lease's while it protects the copy, else the copy's own.
    pub(crate) fn transfer_events(
        &self,
        handles: &[HandleId],
        location: Location,
    ) -> Vec<ObjectId> {
        let mut events = Vec::new();
        for transfer in &self.transfers {
            if transfer.location != location || !handles.contains(&transfer.handle) {
                continue;
            }
            if let Some((_, pending)) = self.pending.iter().find(|(t, _)| *t == transfer.token) {
                events.extend_from_slice(pending);
            }
            events.extend_from_slice(&transfer.events);
        }
        events
    }

    pub(crate) fn transfer_tokens(&self) -> Vec<u64> {
        self.transfers
            .iter()
            .map(|transfer| transfer.token)
            .collect()
    }

    pub(crate) fn transfer_tokens_into(
        &self,
        handles: &[HandleId],
        location: Location,
    ) -> Vec<u64> {
        self.transfers
            .iter()
            .filter(|transfer| transfer.location == location && handles.contains(&transfer.handle))
            .map(|transfer| transfer.token)
            .collect()
    }

    pub(crate) fn transfer_count(&self) -> usize {
        self.transfers.len()
    }

    /// Forgets every pending lease and transfer (close); their ids are freed.
    pub(crate) fn clear(&mut self, freed: &mut Freed) {
        let mut gone = Vec::new();
        for (_, events) in std::mem::take(&mut self.pending) {
            gone.extend(events);
        }
        for transfer in std::mem::take(&mut self.transfers) {
            gone.extend(transfer.events);
            gone.extend(transfer.keepalive);
        }
        self.unref(gone, freed);
    }
}
