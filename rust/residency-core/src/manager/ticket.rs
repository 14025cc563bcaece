//! Transition tickets: an ensure or a move as begin, the glue's device work, then
//! commit or abort (docs/concepts/transitions.md).
//!
//! `begin` runs every check that needs no device (the handle, the exclusive rule, the
//! source, removability, the destination budget) and takes the temporary charge of a
//! reconstruction. The ticket then names the one piece of device work the glue must
//! do: copy a materialisation, run the source's `load()`, or nothing. `commit` installs
//! the measured result, removes a move's source and protects a copy left in flight
//! with pending leases; `abort` returns every temporary charge. Either way the ticket
//! is consumed, and a refused commit has undone everything the ticket held, so the
//! books after any failure are exactly the books before `begin`.

use std::sync::Arc;

use super::{Inner, Manager, StorageKey};
use crate::error::{CoreError, CoreResult};
use crate::location::Location;
use crate::state::{HandleId, ValueRecord};
use crate::tokens::{Events, Freed, ObjectId};

/// What `begin` decided.
#[derive(Debug)]
pub enum Begun {
    /// Nothing to do; `source` is what the report names (`None` for an ensure, and
    /// for a move unless its explicit source is its destination).
    NoOp { source: Option<Location> },
    /// A transition to perform: do the ticket's [`Work`], then commit or abort.
    Ticket(Ticket),
}

/// The device work a ticket asks of the glue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Nothing to copy: the destination already holds a replica, and commit removes
    /// the move's source.
    Remove,
    /// Copy the materialisation (or the loaded value) at `from` to the destination,
    /// measure the copy and commit it. With `in_flight`, the copy is not waited for:
    /// commit protects it with pending leases on its event.
    Copy { from: Location, in_flight: bool },
    /// Run the source's `load()`, whose value lands at `into` under the temporary
    /// charge the ticket holds there, measure it and report it with
    /// [`Manager::loaded`]. With `deferrable`, the glue may instead let the disk tier
    /// load it straight to the destination ([`Manager::defer`]).
    Load { into: Location, deferrable: bool },
    /// Install the loaded value itself at the destination: measure it and commit.
    Install,
}

/// The measured facts of the value the glue hands to `commit`.
#[derive(Debug, Clone, Copy)]
pub struct Landed<'a> {
    pub logical_nbytes: u64,
    pub storage_nbytes: u64,
    pub keys: &'a [StorageKey],
}

/// The event of a copy left in flight, and what it reads (kept alive until it
/// completes), as the glue stored them (`ObjectId`s of the core's token book).
#[derive(Debug, Clone, Copy)]
pub struct InFlight {
    pub event: ObjectId,
    pub keepalive: Option<ObjectId>,
}

/// What a commit changed beyond the install.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Committed {
    /// The materialisation a move removed: the glue forgets its object.
    pub removed: Option<Location>,
    /// The pending lease protecting a copy left in flight at its destination; the glue
    /// attaches the copy's event to it, and consumers there wait for it.
    pub in_flight: Option<u64>,
    /// The pending lease protecting the materialisation that copy reads.
    pub read: Option<u64>,
}

/// One ensure or move between `begin` and `commit` or `abort`. It holds the
/// reconstruction's temporary charge, if any, until it is consumed: drop it only
/// through [`Manager::commit`] or [`Manager::abort`].
#[derive(Debug)]
#[must_use = "a ticket holds charges: commit or abort it"]
pub struct Ticket {
    handle: HandleId,
    destination: Location,
    /// What the report names as the source: the materialisation copied, the move's
    /// removed replica, or the registered source location.
    source: Location,
    work: Work,
    /// A move: the install may give an EXCLUSIVE value a second materialisation
    /// until `remove` goes.
    relocating: bool,
    /// The move's source materialisation, removed after the install.
    remove: Option<Location>,
    /// Where the temporary reconstruction charge is held.
    temporary: Option<Location>,
    /// The source materialisation an in-flight copy reads (protected at commit).
    read: Option<Location>,
    /// Copies to the destination stay in flight (an ensure in a prefetch, to CUDA).
    in_flight: bool,
}

impl Ticket {
    pub fn handle(&self) -> HandleId {
        self.handle
    }

    pub fn destination(&self) -> Location {
        self.destination
    }

    /// The source the transition's report names.
    pub fn source(&self) -> Location {
        self.source
    }

    /// The device work to do next.
    pub fn work(&self) -> Work {
        self.work
    }

    /// Where the temporary reconstruction charge is held, while it is.
    pub fn temporary(&self) -> Option<Location> {
        self.temporary
    }

    fn new(handle: HandleId, destination: Location, source: Location, work: Work) -> Self {
        Self {
            handle,
            destination,
            source,
            work,
            relocating: false,
            remove: None,
            temporary: None,
            read: None,
            in_flight: false,
        }
    }
}

/// Whether a copy to `at` stays in flight: only an ensure's, in an asynchronous
/// plan (a prefetch), to a CUDA location; a move removes its source at once.
fn copies_in_flight(at: Location, relocating: bool, asynchronous: bool) -> bool {
    asynchronous && !relocating && matches!(at, Location::Cuda(_))
}

impl Manager {
    /// Begins an ensure of `handle` at `at` (docs/concepts/transitions.md#ensure-and-copy).
    /// `asynchronous` is true inside a prefetch, whose copies to CUDA stay in flight.
    pub fn begin_ensure(
        &self,
        handle: HandleId,
        at: Location,
        asynchronous: bool,
    ) -> CoreResult<Begun> {
        let mut inner = self.inner();
        let record = inner.live_record(handle)?;
        if record.is_resident(at) {
            return Ok(Begun::NoOp { source: None });
        }
        let record = Arc::clone(record);
        if record.spec.is_exclusive() && !record.materializations.is_empty() {
            return Err(CoreError::Ownership {
                message: format!(
                    "value {:?} is EXCLUSIVE and already materialized at {}; use move() to relocate it",
                    record.handle_id,
                    record
                        .best_source(None)
                        .map_or_else(String::new, Location::name)
                ),
            });
        }
        let in_flight = copies_in_flight(at, false, asynchronous);
        let mut ticket = if let Some(source) = record.best_source(None) {
            inner.state.admit(at, record.spec.storage_nbytes())?;
            let work = Work::Copy {
                from: source,
                in_flight,
            };
            let mut ticket = Ticket::new(handle, at, source, work);
            ticket.read = Some(source);
            ticket
        } else {
            let into = inner.charge_temporary(&record)?;
            let deferrable =
                in_flight && matches!(into, Location::PageableHost | Location::PinnedHost);
            let mut ticket = Ticket::new(handle, at, into, Work::Load { into, deferrable });
            ticket.temporary = Some(into);
            ticket
        };
        ticket.in_flight = in_flight;
        Ok(Begun::Ticket(ticket))
    }

    /// Begins a move of `handle` to `to`, from `from` or the first other
    /// materialisation (docs/concepts/transitions.md#move).
    pub fn begin_move(
        &self,
        handle: HandleId,
        to: Location,
        from: Option<Location>,
    ) -> CoreResult<Begun> {
        let mut inner = self.inner();
        let record = Arc::clone(inner.live_record(handle)?);
        let source = match from {
            Some(explicit) => {
                if !record.is_resident(explicit) {
                    return Err(CoreError::Unavailable {
                        message: format!(
                            "explicit source {explicit} of value {:?} is not resident",
                            record.handle_id
                        ),
                    });
                }
                Some(explicit)
            }
            None => record.best_source(Some(to)),
        };
        if record.is_resident(to) {
            return match source {
                None => Ok(Begun::NoOp { source: None }),
                Some(source) if source == to => Ok(Begun::NoOp { source: Some(to) }),
                Some(source) => {
                    inner.check_removable(handle, source)?;
                    let mut ticket = Ticket::new(handle, to, source, Work::Remove);
                    ticket.relocating = true;
                    ticket.remove = Some(source);
                    Ok(Begun::Ticket(ticket))
                }
            };
        }
        let mut ticket = if let Some(source) = source {
            // Removable before anything is copied.
            inner.check_removable(handle, source)?;
            inner.state.admit(to, record.spec.storage_nbytes())?;
            let work = Work::Copy {
                from: source,
                in_flight: false,
            };
            let mut ticket = Ticket::new(handle, to, source, work);
            ticket.remove = Some(source);
            ticket
        } else {
            let into = inner.charge_temporary(&record)?;
            let work = Work::Load {
                into,
                deferrable: false,
            };
            let mut ticket = Ticket::new(handle, to, into, work);
            ticket.temporary = Some(into);
            ticket
        };
        ticket.relocating = true;
        Ok(Begun::Ticket(ticket))
    }

    /// The source's `load()` returned a value at the ticket's load location, measured
    /// as `logical_nbytes` and `storage_nbytes` there. Loaded where it is installed,
    /// the temporary charge goes now (the install pays the one shared charge, and
    /// checks the bytes); loaded elsewhere, the bytes are checked against the spec and
    /// the destination is admitted before the copy. Returns the next work. A refusal
    /// changes nothing: abort the ticket.
    pub fn loaded(
        &self,
        ticket: &mut Ticket,
        logical_nbytes: u64,
        storage_nbytes: u64,
    ) -> CoreResult<Work> {
        let Work::Load { into, .. } = ticket.work else {
            return Err(misused(ticket, "loaded"));
        };
        let mut inner = self.inner();
        if into == ticket.destination {
            inner.release_temporary(ticket.handle, ticket.temporary.take())?;
            ticket.work = Work::Install;
            return Ok(ticket.work);
        }
        let record = inner.record(ticket.handle)?;
        Self::check_bytes(record, logical_nbytes, storage_nbytes)?;
        inner
            .state
            .admit(ticket.destination, record.spec.storage_nbytes())?;
        ticket.work = Work::Copy {
            from: into,
            in_flight: ticket.in_flight,
        };
        Ok(ticket.work)
    }

    /// Checks the destination budget before the disk tier loads a deferrable
    /// reconstruction straight to the destination (it charges nothing). Once the tier
    /// took the load, [`Manager::deferred`] records it.
    pub fn admit_deferred(&self, ticket: &Ticket) -> CoreResult<()> {
        if !matches!(
            ticket.work,
            Work::Load {
                deferrable: true,
                ..
            }
        ) {
            return Err(misused(ticket, "admit_deferred"));
        }
        let inner = self.inner();
        let charge = inner.record(ticket.handle)?.spec.storage_nbytes();
        inner.state.admit(ticket.destination, charge)
    }

    /// The disk tier took a deferrable load: its copy to the destination is in flight,
    /// so commit installs it with a pending lease (and returns the temporary charge,
    /// which nothing loaded into).
    pub fn deferred(&self, ticket: &mut Ticket) -> CoreResult<()> {
        let Work::Load {
            into,
            deferrable: true,
        } = ticket.work
        else {
            return Err(misused(ticket, "deferred"));
        };
        ticket.work = Work::Copy {
            from: into,
            in_flight: true,
        };
        Ok(())
    }

    /// Commits the ticket's transition: installs the measured value at the destination
    /// (unless the work was `Remove`), removes a move's source and protects a copy
    /// left in flight with pending leases. A refusal (a budget, the bytes, an alias, a
    /// source that became protected) undoes everything: the temporary charge is
    /// returned and nothing is installed or removed.
    ///
    /// `in_flight` is the event of a copy the ticket left in flight: the pending leases
    /// wait for it, and consumers at the destination with them. On a refusal, or where
    /// nothing is left in flight, its objects are released into `freed`.
    pub fn commit(
        &self,
        ticket: Ticket,
        landed: Option<Landed<'_>>,
        in_flight: Option<InFlight>,
        freed: &mut Freed,
    ) -> CoreResult<Committed> {
        let mut inner = self.inner();
        let result = Self::commit_locked(&mut inner, &ticket, landed);
        let protected = match (&result, in_flight) {
            (
                Ok(Committed {
                    in_flight: Some(token),
                    read,
                    ..
                }),
                Some(InFlight { event, keepalive }),
            ) => {
                inner.book.add_pending(*token, Events::One(event));
                inner
                    .book
                    .add_transfer(*token, ticket.handle, ticket.destination, keepalive);
                if let Some(read) = read {
                    inner.book.share(&[event]);
                    inner.book.add_pending(*read, Events::One(event));
                }
                true
            }
            _ => false,
        };
        if let (false, Some(InFlight { event, keepalive })) = (protected, in_flight) {
            inner
                .book
                .unref([event].into_iter().chain(keepalive), freed);
        }
        // Returned on success and on refusal alike.
        let released = inner.release_temporary(ticket.handle, ticket.temporary);
        drop(ticket);
        result.and_then(|committed| released.map(|()| committed))
    }

    fn commit_locked(
        inner: &mut Inner,
        ticket: &Ticket,
        landed: Option<Landed<'_>>,
    ) -> CoreResult<Committed> {
        let handle = ticket.handle;
        if let Some(source) = ticket.remove {
            inner.check_removable(handle, source)?;
        }
        let mut committed = Committed::default();
        match (ticket.work, landed) {
            (Work::Remove, _) => {}
            (Work::Copy { .. } | Work::Install, Some(landed)) => {
                Self::install_locked(
                    inner,
                    handle,
                    ticket.destination,
                    landed.logical_nbytes,
                    landed.storage_nbytes,
                    landed.keys,
                    ticket.relocating,
                )?;
            }
            _ => return Err(misused(ticket, "commit")),
        }
        if let Some(source) = ticket.remove {
            inner.remove(handle, source);
            committed.removed = Some(source);
        }
        if let Work::Copy {
            in_flight: true, ..
        } = ticket.work
        {
            committed.in_flight = Some(inner.pending_lease(handle, ticket.destination));
            if let Some(read) = ticket.read {
                committed.read = Some(inner.pending_lease(handle, read));
            }
        }
        Ok(committed)
    }

    /// Abandons the ticket (its device work failed, or the glue refused what it
    /// measured): the temporary charge is returned and nothing else changed.
    pub fn abort(&self, ticket: Ticket) -> CoreResult<()> {
        let released = self
            .inner()
            .release_temporary(ticket.handle, ticket.temporary);
        drop(ticket);
        released
    }
}

fn misused(ticket: &Ticket, step: &str) -> CoreError {
    CoreError::Internal {
        message: format!(
            "transition ticket of value index {} cannot {step} at work {:?}",
            ticket.handle, ticket.work
        ),
    }
}

impl Inner {
    /// Charges the temporary reconstruction at the value's source location: budget
    /// checked, counted as reserved, peak raised, no version step.
    fn charge_temporary(&mut self, record: &ValueRecord) -> CoreResult<Location> {
        let Some(source_location) = record.source else {
            return Err(Manager::unavailable(record));
        };
        let charge = record.spec.storage_nbytes();
        self.state.admit(source_location, charge)?;
        self.state.add_reserved(source_location, charge);
        // The raised peak outlives a failed load, so it must be published.
        self.dirty = true;
        Ok(source_location)
    }

    /// Returns a ticket's temporary charge at `location` (`None`: none held).
    fn release_temporary(
        &mut self,
        handle: HandleId,
        location: Option<Location>,
    ) -> CoreResult<()> {
        let Some(location) = location else {
            return Ok(());
        };
        let charge = self.record(handle)?.spec.storage_nbytes();
        self.state.remove_reserved(location, charge);
        self.dirty = true;
        Ok(())
    }

    /// A lease on `(handle, at)` that is pending at once: the protection of a copy
    /// in flight (two version steps, as an acquire and its release on a stream).
    fn pending_lease(&mut self, handle: HandleId, at: Location) -> u64 {
        let token = self.acquire_locked(&[handle], at);
        self.lease_to_pending(token);
        token
    }
}
