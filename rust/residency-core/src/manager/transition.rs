//! One transition driven end to end: what an ensure, a move, a drop or a discard
//! does, and in which order, over a [`TransitionDevice`] that does only the device
//! work (docs/concepts/transitions.md).
//!
//! [`Manager::transition`] decides everything between the action and its outcome:
//!
//! - an ensure or a move begins a ticket (`ticket.rs`), which holds a
//!   reconstruction's temporary charge; a no-op begins none;
//! - a copy first host-waits for the transfers still in flight into its source,
//!   then copies it; a copy left in flight (an ensure's, to CUDA, in a prefetch) is
//!   protected at the commit by pending leases on its event, which keep what it
//!   reads alive; a copy that is not left in flight after all is waited for then;
//! - a reconstruction runs the source's `load()` as a callback (the releases queued
//!   meanwhile are applied after it), validates what it loaded where it loaded it,
//!   then installs it there or copies it on to the destination; a deferrable one
//!   lets the disk tier load it straight to the destination when the tier takes it,
//!   after the destination's budget check;
//! - every copy is validated and measured at its destination, then committed: the
//!   install, then a move's removal of its source, then the pending leases;
//! - a failure before the commit aborts the ticket, which returns every temporary
//!   charge, and then host-waits for a copy still in flight (it may still be
//!   writing its destination); a refused commit has undone everything itself.
//!
//! So after any failure the books, records and protections are the ones the
//! transition found (a temporary charge's raised peak aside), and the device side
//! was told to keep nothing.

use crate::error::CoreError;
use crate::location::Location;
use crate::plan::Action;
use crate::state::HandleId;
use crate::tokens::{Freed, ObjectId};

use super::{Begun, InFlight, Landed, Manager, RunError, StorageKey, Ticket, Work};

/// The device work of a transition, and the objects it keeps: the binding implements
/// it over the Python runtime (tests implement it over plain data).
pub trait TransitionDevice {
    /// A value the device holds or made (the binding: a Python object, with the
    /// stream that allocated it).
    type Value;
    /// The completion event of a copy.
    type Event;
    /// A load the disk tier could defer, prepared (see `prepare_deferral`).
    type Deferral;
    /// The device side's own error.
    type Error;

    /// The materialisation of value `index` at `at`.
    fn resident(&mut self, index: HandleId, at: Location) -> Result<Self::Value, Self::Error>;

    /// Host-waits for the events at `events`: transfers still in flight into a
    /// materialisation a copy is about to read on another stream.
    fn wait(&mut self, events: &[ObjectId]) -> Result<(), Self::Error>;

    /// Runs the source's `load()` of value `index`.
    fn load(&mut self, index: HandleId) -> Result<Self::Value, Self::Error>;

    /// Prepares the disk tier's load of value `index` straight to `at`: `None` where
    /// the value has no source object to load.
    fn prepare_deferral(
        &mut self,
        index: HandleId,
        at: Location,
    ) -> Result<Option<Self::Deferral>, Self::Error>;

    /// Hands a prepared load to the disk tier: the value it allocated at the
    /// destination, with the event that covers its copies, or `None` where the tier
    /// does not take it (nothing was done).
    #[allow(clippy::type_complexity)] // the value and its event, maybe
    fn defer(
        &mut self,
        deferral: Self::Deferral,
    ) -> Result<Option<Copied<Self::Value, Self::Event>>, Self::Error>;

    /// Copies `value`, held at `from`, to `to`. With `in_flight`, a copy to CUDA is
    /// not waited for and its event comes back; otherwise the copy completed when
    /// this returns. A failed copy no longer reads its source when this returns.
    fn copy(
        &mut self,
        value: &Self::Value,
        from: Location,
        to: Location,
        in_flight: bool,
    ) -> Result<Copied<Self::Value, Self::Event>, Self::Error>;

    /// Checks that `value` is of value `index`'s type and held at `at`, and measures
    /// it (the ticket checks the bytes).
    fn validate(
        &mut self,
        index: HandleId,
        at: Location,
        value: &Self::Value,
    ) -> Result<Measured, Self::Error>;

    /// Host-waits for `event`.
    fn synchronize(&mut self, event: &Self::Event) -> Result<(), Self::Error>;

    /// Keeps `event` at `id` of the core's object book.
    fn keep_event(&mut self, id: ObjectId, event: &Self::Event);

    /// Keeps `value` at `id` of the core's object book (what a copy in flight reads).
    fn keep_value(&mut self, id: ObjectId, value: &Self::Value);

    /// Releases the objects the core gave back.
    fn free(&mut self, freed: &Freed);

    /// Keeps `value` as the materialisation of value `index` at `at`.
    fn install(&mut self, index: HandleId, at: Location, value: Self::Value);

    /// Forgets the materialisation of value `index` at `at`, which the core removed.
    fn forget(&mut self, index: HandleId, at: Location);

    /// Forgets the objects of the discarded value `index`: its materialisations at
    /// `removed`, and its source.
    fn discarded(&mut self, index: HandleId, removed: &[Location]);
}

/// What a copy made at its destination, and the copy's event while it is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copied<V, E> {
    pub value: V,
    pub event: Option<E>,
}

/// The measured facts of a value the device validated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Measured {
    pub logical_nbytes: u64,
    pub storage_nbytes: u64,
    /// (device code, data pointer) per unique non-empty storage.
    pub keys: Vec<StorageKey>,
}

impl Measured {
    fn landed(&self) -> Landed<'_> {
        Landed {
            logical_nbytes: self.logical_nbytes,
            storage_nbytes: self.storage_nbytes,
            keys: &self.keys,
        }
    }
}

/// What a transition did, for its report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transitioned {
    /// One of the three no-op cases (docs/concepts/transitions.md#no-op-rules).
    pub no_op: bool,
    /// The source the report names: the location copied from, the move's removed
    /// replica or the registered source location; a no-op's (`None`, or a move's
    /// explicit source that is its destination); a drop's location; a discard's
    /// `None`.
    pub source: Option<Location>,
}

type Failed<E> = RunError<E>;

impl Manager {
    /// Performs `action` on value `index` (which the caller resolved, holding the
    /// gate) through `device`; see the module documentation. `asynchronous` is true
    /// inside a prefetch, whose ensures leave their copies to CUDA in flight.
    pub fn transition<D: TransitionDevice>(
        &self,
        action: &Action,
        index: HandleId,
        asynchronous: bool,
        device: &mut D,
    ) -> Result<Transitioned, Failed<D::Error>> {
        match *action {
            Action::Drop { location: at, .. } => {
                let dropped = self
                    .drop_materialization(index, at)
                    .map_err(RunError::Core)?;
                if dropped {
                    device.forget(index, at);
                }
                Ok(Transitioned {
                    no_op: !dropped,
                    source: Some(at),
                })
            }
            Action::Discard { .. } => {
                let removed = self.discard(index).map_err(RunError::Core)?;
                device.discarded(index, &removed);
                Ok(Transitioned {
                    no_op: false,
                    source: None,
                })
            }
            Action::Ensure { .. } | Action::Move { .. } => {
                match self
                    .begin(index, action, asynchronous)
                    .map_err(RunError::Core)?
                {
                    Begun::NoOp { source } => Ok(Transitioned {
                        no_op: true,
                        source,
                    }),
                    Begun::Ticket(ticket) => {
                        let source = ticket.source();
                        Driver {
                            manager: self,
                            device,
                        }
                        .drive(ticket)?;
                        Ok(Transitioned {
                            no_op: false,
                            source: Some(source),
                        })
                    }
                }
            }
        }
    }
}

/// One transition's steps: the manager's rules over the device's work.
struct Driver<'a, D> {
    manager: &'a Manager,
    device: &'a mut D,
}

impl<D: TransitionDevice> Driver<'_, D> {
    /// Performs the device work `ticket` names, then commits it; any failure before
    /// the commit aborts it.
    fn drive(&mut self, mut ticket: Ticket) -> Result<(), Failed<D::Error>> {
        let index = ticket.handle();
        match ticket.work() {
            Work::Remove => self.conclude(ticket, None, None, None),
            Work::Copy { from, in_flight } => {
                let copied = self.read(index, from).and_then(|value| {
                    self.device
                        .copy(&value, from, ticket.destination(), in_flight)
                });
                match copied {
                    Ok(copied) => self.land(ticket, copied, None),
                    Err(error) => Err(self.aborted(ticket, RunError::Device(error))),
                }
            }
            Work::Load { into, deferrable } => {
                if deferrable {
                    match self.defer_load(&ticket) {
                        Ok(Some(copied)) => {
                            if let Err(error) = self.manager.deferred(&mut ticket) {
                                let error = self.aborted(ticket, RunError::Core(error));
                                return Err(self.synchronized(copied.event.as_ref(), error));
                            }
                            return self.land(ticket, copied, None);
                        }
                        Ok(None) => {}
                        Err(error) => return Err(self.aborted(ticket, error)),
                    }
                }
                // The source's `load()` is a callback: no other gated call may run
                // meanwhile, and a release queued while it ran is applied after it,
                // whether or not it loaded.
                self.manager.set_callback_active(true);
                let loaded = self.device.load(index);
                self.manager.set_callback_active(false);
                let mut freed = Freed::default();
                self.manager.drain_releases(&mut freed);
                self.device.free(&freed);
                match loaded {
                    Ok(loaded) => self.reconstruct(ticket, into, loaded),
                    Err(error) => Err(self.aborted(ticket, RunError::Device(error))),
                }
            }
            Work::Install => {
                let error = CoreError::Internal {
                    message: "a ticket begun at its install".to_owned(),
                };
                Err(self.aborted(ticket, RunError::Core(error)))
            }
        }
    }

    /// The materialisation of value `index` at `from`, once the transfers still in
    /// flight into it completed.
    fn read(&mut self, index: HandleId, from: Location) -> Result<D::Value, D::Error> {
        let events = self.manager.transfer_events(&[index], from);
        if !events.is_empty() {
            self.device.wait(&events)?;
        }
        self.device.resident(index, from)
    }

    /// The disk tier's load straight to the ticket's destination, admitted there
    /// first (docs/concepts/values.md#reconstructions-a-pipeline-defers): `None`
    /// (nothing done) where the tier does not take it.
    #[allow(clippy::type_complexity)] // the value and its event, maybe
    fn defer_load(
        &mut self,
        ticket: &Ticket,
    ) -> Result<Option<Copied<D::Value, D::Event>>, Failed<D::Error>> {
        let prepared = self
            .device
            .prepare_deferral(ticket.handle(), ticket.destination())
            .map_err(RunError::Device)?;
        let Some(deferral) = prepared else {
            return Ok(None);
        };
        // The budget check (it charges nothing) before anything is allocated.
        self.manager
            .admit_deferred(ticket)
            .map_err(RunError::Core)?;
        self.device.defer(deferral).map_err(RunError::Device)
    }

    /// After the source's `load()` returned `loaded` at `into`: validated there and
    /// reported to the ticket, which says whether it is installed there or copied on
    /// to the destination (docs/concepts/values.md#reconstruction).
    fn reconstruct(
        &mut self,
        mut ticket: Ticket,
        into: Location,
        loaded: D::Value,
    ) -> Result<(), Failed<D::Error>> {
        let facts = match self.device.validate(ticket.handle(), into, &loaded) {
            Ok(facts) => facts,
            Err(error) => return Err(self.aborted(ticket, RunError::Device(error))),
        };
        let next = self
            .manager
            .loaded(&mut ticket, facts.logical_nbytes, facts.storage_nbytes);
        match next {
            Ok(Work::Copy { from, in_flight }) => {
                match self
                    .device
                    .copy(&loaded, from, ticket.destination(), in_flight)
                {
                    // The copy in flight reads what was loaded: kept alive with it.
                    Ok(copied) => self.land(ticket, copied, Some(&loaded)),
                    Err(error) => Err(self.aborted(ticket, RunError::Device(error))),
                }
            }
            // Loaded where it is installed (the install checks the bytes).
            Ok(_) => self.conclude(ticket, Some((loaded, facts)), None, None),
            Err(error) => Err(self.aborted(ticket, RunError::Core(error))),
        }
    }

    /// Validates `value`, which the device work produced at the ticket's
    /// destination, and commits it there; `event` is its copy's when the copy was
    /// left in flight, `keepalive` what that copy reads.
    fn land(
        &mut self,
        ticket: Ticket,
        copied: Copied<D::Value, D::Event>,
        keepalive: Option<&D::Value>,
    ) -> Result<(), Failed<D::Error>> {
        let Copied { value, event } = copied;
        match self
            .device
            .validate(ticket.handle(), ticket.destination(), &value)
        {
            Ok(facts) => self.conclude(ticket, Some((value, facts)), event.as_ref(), keepalive),
            Err(error) => {
                let error = self.aborted(ticket, RunError::Device(error));
                Err(self.synchronized(event.as_ref(), error))
            }
        }
    }

    /// Commits `ticket` with the measured value `landed` (none for a removal), then
    /// has the device keep what the commit decided: the value at its destination,
    /// and not the removed source. A copy left in flight (`event`, and what it reads)
    /// goes to the core's book, which protects it with pending leases if the ticket
    /// left it in flight; otherwise it is waited for.
    fn conclude(
        &mut self,
        ticket: Ticket,
        landed: Option<(D::Value, Measured)>,
        event: Option<&D::Event>,
        keepalive: Option<&D::Value>,
    ) -> Result<(), Failed<D::Error>> {
        let (index, at) = (ticket.handle(), ticket.destination());
        let in_flight = event.map(|event| {
            let id = self.manager.new_object();
            self.device.keep_event(id, event);
            let keepalive = keepalive.map(|value| {
                let kept = self.manager.new_object();
                self.device.keep_value(kept, value);
                kept
            });
            InFlight {
                event: id,
                keepalive,
            }
        });
        let mut freed = Freed::default();
        let committed = self.manager.commit(
            ticket,
            landed.as_ref().map(|(_, facts)| facts.landed()),
            in_flight,
            &mut freed,
        );
        self.device.free(&freed);
        let committed = match committed {
            Ok(committed) => committed,
            Err(error) => {
                return Err(self.synchronized(event, RunError::Core(error)));
            }
        };
        if let Some((value, _)) = landed {
            self.device.install(index, at, value);
        }
        if let Some(removed) = committed.removed {
            self.device.forget(index, removed);
        }
        if let (None, Some(event)) = (committed.in_flight, event) {
            // Not left in flight after all: waited for now.
            self.device.synchronize(event).map_err(RunError::Device)?;
        }
        Ok(())
    }

    /// Aborts `ticket` after its device work failed with `error`, which is returned:
    /// the abort returns the ticket's temporary charge, and can itself fail only for
    /// a value this manager never issued, which the original error outranks.
    fn aborted<E>(&self, ticket: Ticket, error: Failed<E>) -> Failed<E> {
        drop(self.manager.abort(ticket));
        error
    }

    /// Host-waits for a copy still in flight (`event`) before `error` propagates: the
    /// copy may still be writing its destination. The original error outranks a failed
    /// wait.
    fn synchronized(
        &mut self,
        event: Option<&D::Event>,
        error: Failed<D::Error>,
    ) -> Failed<D::Error> {
        if let Some(event) = event {
            drop(self.device.synchronize(event));
        }
        error
    }
}
