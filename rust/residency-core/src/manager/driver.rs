//! The lifetime protocol end to end: which lease becomes pending on which events,
//! when the host must wait, which stream waits on the device for what, and what a
//! close settles. The runtime's work (querying, recording and waiting for events,
//! synchronising streams and devices) is the caller's [`LifetimeHost`]; events are
//! known here by id. The rules are written in docs/concepts/lifetimes.md and
//! docs/concepts/controller.md#evicting-around-reads-in-flight.

use crate::error::{CoreError, CoreResult};
use crate::location::Location;
use crate::state::HandleId;
use crate::tokens::{Freed, LifetimeKind, ObjectId, Release};

use super::{HostCost, LeaseState, Manager, SettleWait};

/// What the runtime does for the lifetime protocol. Every method answers at once
/// or waits; none calls back into the manager's lifetime operations.
pub trait LifetimeHost {
    /// A stream that reads or owns memory.
    type Stream;
    /// A recorded event, before the core gives it an id.
    type Event;
    /// The caller's error.
    type Error;
    /// A value's handle as the caller names it.
    type Handle;
    /// A location as the caller names it.
    type Place;

    /// The caller's error for a refusal of the core's.
    fn lift(&self, error: CoreError) -> Self::Error;
    /// Takes the gate, waiting for another thread's operation; fails with the closed
    /// manager's error (`check_closed`), and fast with a re-entrancy error while a
    /// source callback runs (`check_reentrant`).
    fn enter(&self, check_closed: bool, check_reentrant: bool) -> CoreResult<()>;
    /// The location `place` names (checked, and registered on first use).
    fn place(&self, place: &Self::Place) -> Result<Location, Self::Error>;
    /// How an error message names `place`.
    fn name(&self, place: &Self::Place) -> Result<String, Self::Error>;
    /// The index of the live handle of this manager that `handle` is, else `None`.
    fn lookup(&self, handle: &Self::Handle) -> Result<Option<HandleId>, Self::Error>;
    /// The error for `handle`, which is no live handle of this manager.
    fn unknown(&self, handle: &Self::Handle) -> Self::Error;
    /// Checks a consumer stream for `place` (`at`): the stream the manager keeps for
    /// it there.
    fn check_stream(
        &self,
        stream: &Self::Stream,
        place: &Self::Place,
        at: Location,
    ) -> Result<Self::Stream, Self::Error>;
    /// The manager is closing, its queued releases applied: what is kept of its
    /// direct calls goes.
    fn closing(&self);
    /// The manager closed: the objects kept for its values go, and the files of its
    /// disk locations with them.
    fn closed(&self) -> Result<(), Self::Error>;
    /// Drops the objects the core gave back (and the labels of released reservations).
    fn free(&self, freed: &Freed);
    /// Drops the object at `id`, which no record refers to any more.
    fn forget(&self, id: ObjectId);
    /// Keeps `event` at the core's new id `id`.
    fn keep(&self, id: ObjectId, event: Self::Event);
    /// Whether the event at `id` completed. An id no longer kept belongs to a lease
    /// released meanwhile: nothing waits on it (`true`).
    fn query(&self, id: ObjectId) -> Result<bool, Self::Error>;
    /// Waits on the host for the event at `id` (nothing for an id no longer kept).
    fn wait(&self, id: ObjectId) -> Result<(), Self::Error>;
    /// Makes `stream` wait on the device for the event at `id`.
    fn stream_wait(&self, stream: &Self::Stream, id: ObjectId) -> Result<(), Self::Error>;
    /// Records an event on `stream`; `Ok(None)` when recording failed with an
    /// ordinary error (the streams are then synchronised instead).
    fn record(&self, stream: &Self::Stream) -> Result<Option<Self::Event>, Self::Error>;
    /// Waits on the host for everything queued on `stream`.
    fn synchronize_stream(&self, stream: &Self::Stream) -> Result<(), Self::Error>;
    /// Waits on the host for everything queued on the device of `at`.
    fn synchronize_device(&self, at: Location) -> Result<(), Self::Error>;
    /// The stream that owns the memory of `handle` at `at`, when known.
    fn owner(&self, handle: HandleId, at: Location) -> Option<Self::Stream>;
    /// Whether two streams are one.
    fn same_stream(&self, first: &Self::Stream, second: &Self::Stream) -> bool;
    /// Whether the value's source never calls a manager while it loads.
    fn loads_alone(&self, handle: HandleId) -> Result<bool, Self::Error>;
}

/// How a lease's release went; all but `Released` carry a warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseRelease {
    /// Released, pending on its events, or already gone.
    Released,
    /// A CUDA lease without consumer streams: the device was synchronised.
    DeviceSynchronized,
    /// Recording the release events failed: the consumer streams were synchronised.
    StreamsSynchronized,
}

impl LeaseRelease {
    /// The warning for a release at `at` (its text), if any.
    pub fn warning(self, at: &str) -> Option<String> {
        match self {
            Self::Released => None,
            Self::DeviceSynchronized => Some(format!(
                "a CUDA lease at {at} had no consumer streams; a full-device synchronisation \
                 was used to release it"
            )),
            Self::StreamsSynchronized => Some(format!(
                "recording release events at {at} failed; the consumer streams were \
                 synchronised instead"
            )),
        }
    }
}

impl Manager {
    /// Applies the releases queued while a callback ran, then releases the pending
    /// leases whose events all completed. The caller holds the gate.
    pub fn reap_with<H: LifetimeHost>(&self, host: &H) -> Result<(), H::Error> {
        if !self.reap_needed() {
            return Ok(());
        }
        let mut freed = Freed::default();
        let reaped = self.reap(|id| host.query(id), &mut freed);
        host.free(&freed);
        reaped
    }

    /// Pending leases whose events all report complete, released or not. A query
    /// that fails keeps its lease protecting.
    pub fn completed_pending_with<H: LifetimeHost>(&self, host: &H) -> Vec<u64> {
        self.completed_pending(|id| host.query(id).unwrap_or(false))
    }

    /// Releases `release` under the gate (taken with `host.enter`), or queues it
    /// behind a source callback running elsewhere.
    pub fn release_with<H: LifetimeHost>(
        &self,
        host: &H,
        release: Release,
        finalizing: bool,
    ) -> Result<(), H::Error> {
        let mut freed = Freed::default();
        let released = self.release(
            release,
            finalizing,
            |check_reentrant| host.enter(false, check_reentrant),
            &mut freed,
        );
        host.free(&freed);
        released.map_err(|error| host.lift(error))
    }

    /// Releases a lease, hold or reservation token: at once when the gate is free and
    /// nothing is queued, else by the waiting path (or queued). A lease released is
    /// no longer tracked; one whose release failed still is, so that its finalizer
    /// tries again (docs/concepts/lifetimes.md#finalizers).
    pub fn release_token_with<H: LifetimeHost>(
        &self,
        host: &H,
        kind: LifetimeKind,
        token: u64,
        finalizing: bool,
    ) -> Result<(), H::Error> {
        self.release_token_only(host, kind, token, finalizing)?;
        if kind == LifetimeKind::Lease {
            self.untrack_lease_with(host, token);
        }
        Ok(())
    }

    /// `release_token_with` leaving the lease's tracking as it is.
    fn release_token_only<H: LifetimeHost>(
        &self,
        host: &H,
        kind: LifetimeKind,
        token: u64,
        finalizing: bool,
    ) -> Result<(), H::Error> {
        if let Some(freed) = self.try_release_now(kind, token) {
            host.free(&freed);
            return Ok(());
        }
        self.release_with(host, Release::Token { kind, token }, finalizing)
    }

    /// A lease's release (docs/concepts/lifetimes.md#lease-release). Off CUDA its use
    /// tokens go at once. On CUDA an event is recorded on every consumer stream and
    /// the lease stays pending until they all complete (`wait` waits for them on the
    /// host first). Without consumer streams the device is synchronised; when
    /// recording fails the streams are. A lease not active (released, or ended by a
    /// forced close) is left as it is. Released, the lease is no longer tracked; one
    /// whose release failed still is (its finalizer tries again).
    pub fn release_lease_with<H: LifetimeHost>(
        &self,
        host: &H,
        token: u64,
        at: Location,
        streams: &[H::Stream],
        wait: bool,
        finalizing: bool,
    ) -> Result<LeaseRelease, H::Error> {
        let released = self.release_lease_only(host, token, at, streams, wait, finalizing)?;
        self.untrack_lease_with(host, token);
        Ok(released)
    }

    /// `release_lease_with` leaving the lease's tracking as it is.
    fn release_lease_only<H: LifetimeHost>(
        &self,
        host: &H,
        token: u64,
        at: Location,
        streams: &[H::Stream],
        wait: bool,
        finalizing: bool,
    ) -> Result<LeaseRelease, H::Error> {
        let lease = LifetimeKind::Lease;
        if !matches!(at, Location::Cuda(_)) {
            self.release_token_only(host, lease, token, finalizing)?;
            return Ok(LeaseRelease::Released);
        }
        if self.lease_state(token) != LeaseState::Active {
            return Ok(LeaseRelease::Released);
        }
        if streams.is_empty() {
            host.synchronize_device(at)?;
            self.release_token_only(host, lease, token, finalizing)?;
            return Ok(LeaseRelease::DeviceSynchronized);
        }
        // Every stream was checked against `at` when it joined the lease. Each event is
        // kept at its id as it is recorded; a failed recording lets the kept ones go.
        let mut ids: Vec<ObjectId> = Vec::with_capacity(streams.len());
        for stream in streams {
            let recorded = host.record(stream);
            let Ok(Some(event)) = recorded else {
                let mut freed = Freed::default();
                self.inner().book.unref(ids, &mut freed);
                host.free(&freed);
                recorded?;
                for stream in streams {
                    host.synchronize_stream(stream)?;
                }
                self.release_token_only(host, lease, token, finalizing)?;
                return Ok(LeaseRelease::StreamsSynchronized);
            };
            let id = self.new_object();
            host.keep(id, event);
            ids.push(id);
        }
        if wait && let Err(error) = ids.iter().try_for_each(|&id| host.wait(id)) {
            let mut freed = Freed::default();
            self.inner().book.unref(ids, &mut freed);
            host.free(&freed);
            return Err(error);
        }
        let pending = Release::Pending {
            token,
            events: ids,
            completed: wait,
        };
        self.release_with(host, pending, finalizing)?;
        Ok(LeaseRelease::Released)
    }

    /// Leases the ready materialisations of `handles` at `at`. With a consumer
    /// stream, it waits on the device for the transfers still in flight into them
    /// (a prefetch's copy is read after it lands); if that fails the lease goes.
    /// The caller holds the gate and has reaped.
    pub fn acquire_with<H: LifetimeHost>(
        &self,
        host: &H,
        handles: &[HandleId],
        at: Location,
        stream: Option<&H::Stream>,
    ) -> Result<u64, H::Error> {
        let token = self
            .acquire(handles, at)
            .map_err(|error| host.lift(error))?;
        if let Some(stream) = stream
            && let Err(error) = self.wait_transfers_with(host, handles, at, stream)
        {
            self.release_lease(token);
            return Err(error);
        }
        Ok(token)
    }

    /// Makes `stream` wait on the device for every transfer still in flight into
    /// `handles` at `at` (docs/concepts/controller.md#prefetch). The caller holds the
    /// gate and has reaped, so only incomplete transfers remain.
    pub fn wait_transfers_with<H: LifetimeHost>(
        &self,
        host: &H,
        handles: &[HandleId],
        at: Location,
        stream: &H::Stream,
    ) -> Result<(), H::Error> {
        self.transfer_events(handles, at)
            .into_iter()
            .try_for_each(|id| host.stream_wait(stream, id))
    }

    /// Host-waits for the events of the pending leases among `tokens`, oldest first,
    /// releasing each after its wait; with `transfers`, also for every transfer in
    /// flight. Then reaps. The caller holds the gate.
    pub fn settle_with<H: LifetimeHost>(
        &self,
        host: &H,
        tokens: &[u64],
        transfers: bool,
    ) -> Result<(), H::Error> {
        let mut freed = Freed::default();
        let settled = self.settle(
            |token| tokens.contains(&token),
            transfers,
            |id| host.wait(id),
            &mut freed,
        );
        host.free(&freed);
        settled?;
        // A transfer's source shares its event: now complete, reaping releases it.
        self.reap_with(host)
    }

    /// Releases the pending leases among `tokens` without a host wait where the
    /// device's order makes that safe (docs/concepts/controller.md#evicting-around-reads-in-flight):
    /// the owning stream of each of the lease's values (each stream once) waits on
    /// the device for the lease's events. A lease with a value whose owning stream
    /// is unknown is waited for on the host with `host_wait`, and otherwise left
    /// pending. Returns the tokens left pending. The caller holds the gate.
    pub fn settle_on_device_with<H: LifetimeHost>(
        &self,
        host: &H,
        tokens: &[u64],
        host_wait: bool,
    ) -> Result<Vec<u64>, H::Error> {
        self.reap_with(host)?;
        let mut freed = Freed::default();
        let left = self.settle_on_device(
            tokens,
            host_wait,
            |handle, at| host.owner(handle, at),
            |wait| match wait {
                SettleWait::Device { owners, events } => {
                    let mut waited: Vec<H::Stream> = Vec::new();
                    for owner in owners {
                        if waited.iter().any(|seen| host.same_stream(seen, &owner)) {
                            continue;
                        }
                        for &event in events {
                            host.stream_wait(&owner, event)?;
                        }
                        waited.push(owner);
                    }
                    Ok(())
                }
                SettleWait::Host { events } => events.iter().try_for_each(|&id| host.wait(id)),
            },
            &mut freed,
        );
        host.free(&freed);
        left
    }

    /// Whether bringing `handles` to `at` would block the host on a copy
    /// (docs/concepts/controller.md#staging): a source's load counts unless the
    /// source loads alone. Changes nothing.
    pub fn blocks_host_with<H: LifetimeHost>(
        &self,
        host: &H,
        handles: &[HandleId],
        at: Location,
        disk_deferred: bool,
    ) -> Result<bool, H::Error> {
        let costs = self
            .host_costs(handles, at, disk_deferred)
            .map_err(|error| host.lift(error))?;
        for (&handle, cost) in handles.iter().zip(costs) {
            match cost {
                HostCost::Free => {}
                HostCost::Blocks => return Ok(true),
                HostCost::BlocksUnlessLoadsAlone => {
                    if !host.loads_alone(handle)? {
                        return Ok(true);
                    }
                }
            }
        }
        Ok(false)
    }

    /// Closes the manager (docs/concepts/lifetimes.md#close): the queued releases are
    /// applied, then `host.closing()`; with `wait` every pending lease's events are
    /// waited for on the host, oldest first, else the completed ones are reaped; with
    /// `force` every CUDA device is synchronised and live tokens end; then the core
    /// closes (refused with live lifetimes unless `force`), `host.closed()` lets the
    /// objects go, and every token record is forgotten. `false` when it was closed
    /// already (nothing done). The caller holds the gate (without its checks).
    pub fn close_with<H: LifetimeHost>(
        &self,
        host: &H,
        wait: bool,
        force: bool,
    ) -> Result<bool, H::Error> {
        if self.is_closed() {
            return Ok(false);
        }
        self.gate()
            .check_reentrant()
            .map_err(|error| host.lift(error))?;
        let mut freed = Freed::default();
        self.drain_releases(&mut freed);
        host.free(&freed);
        host.closing();
        if wait {
            self.settle_with_only(host, |_| true)?;
        } else {
            self.reap_with(host)?;
        }
        if force {
            for at in self.locations() {
                if matches!(at, Location::Cuda(_)) {
                    host.synchronize_device(at)?;
                }
            }
        }
        self.close(force).map_err(|error| host.lift(error))?;
        host.closed()?;
        self.clear_tokens_with(host);
        Ok(true)
    }

    /// Host-waits for the pending leases `selected` picks and releases them (no reap).
    fn settle_with_only<H: LifetimeHost>(
        &self,
        host: &H,
        selected: impl Fn(u64) -> bool,
    ) -> Result<(), H::Error> {
        let mut freed = Freed::default();
        let settled = self.settle(selected, false, |id| host.wait(id), &mut freed);
        host.free(&freed);
        settled
    }

    /// Forgets every token record after a close; their ids go back to `host`.
    pub fn clear_tokens_with<H: LifetimeHost>(&self, host: &H) {
        let mut freed = Freed::default();
        self.clear_tokens(&mut freed);
        host.free(&freed);
    }
}

/// Why a lease cannot be taken at a location.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unborrowable {
    /// A value on disk is a file.
    Disk,
    /// A CUDA lease needs the consumer stream that will read the values.
    NeedsStream,
}

impl Unborrowable {
    /// The argument error for a lease asked at `name`.
    pub fn error(self, name: &str) -> CoreError {
        let message = match self {
            Self::Disk => format!(
                "{name} cannot be borrowed: a value on disk is a file; ensure it on a host or \
                 CUDA location and acquire it there"
            ),
            Self::NeedsStream => {
                format!("acquiring at {name} needs the consumer_stream that will read the values")
            }
        };
        CoreError::InvalidArgument { message }
    }
}

impl Manager {
    /// `handle` while lease `token` still covers it: a forced close or a discard ends
    /// what a lease borrows.
    pub fn borrowed(&self, token: u64, handle: Option<HandleId>) -> Option<HandleId> {
        handle.filter(|&handle| self.lease_covers(token, handle))
    }

    /// The error for a value (`handle_id`, its repr) a lease no longer borrows at `at`.
    pub fn no_longer_borrowed(handle_id: &str, at: &str) -> CoreError {
        CoreError::Unavailable {
            message: format!(
                "value {handle_id} is no longer borrowed at {at} (its lease ended with a \
                 forced close or the value was discarded)"
            ),
        }
    }

    /// Whether a lease may be taken at `at`, given a consumer stream or not.
    pub fn borrowable(at: Location, consumer_stream: bool) -> Result<(), Unborrowable> {
        match at {
            Location::Disk(_) => Err(Unborrowable::Disk),
            Location::Cuda(_) if !consumer_stream => Err(Unborrowable::NeedsStream),
            _ => Ok(()),
        }
    }
}
