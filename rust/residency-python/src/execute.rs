//! One transition end to end in one call: the path every action takes.
//!
//! An ensure, move, drop or discard runs here without returning to the Python glue:
//! the core's transition driver decides, orders and charges (`Manager::transition`),
//! this module does the device work it asks for (`Runtime`: copies, loads, values
//! validated and measured), and the transition report is built here. Python code runs only for the reconstruction
//! source's `load()`, the runtime's copies, event recording and synchronisation,
//! stream checks and allocator samples (docs/concepts/transitions.md).

use std::sync::Arc;

use pyo3::exceptions::{PyException, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use residency_core::messages::cleanup_note;
use residency_core::report::{AllocatorReadings, TransitionFacts};
use residency_core::{
    Action, ActionKind, Copied, CopyRoute, Freed, HandleId, HandleSlot, Location, Measured,
    ObjectId, Place, Refusal, RunError, TransitionDevice,
};

use crate::context::Context;
use crate::errors::{refuse, to_py_err};
use crate::kinds::locations_of;
use crate::manager::CoreManager;
use crate::measure::{self, Facts};
use crate::transition::{Transition, now_ns};

/// Runs `action` as one transition, taking the gate for it: a one-action plan, with
/// no version check or preflight, on the path every plan's actions take (`execute`).
pub fn run(
    manager: &CoreManager,
    py: Python<'_>,
    action: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let transition = manager.in_transition(py, || execute(manager, py, action, stream, None))?;
    report(manager, py, &transition)
}

/// `ensure(handle, at)`, `move(handle, to, from_location)` or `drop(handle, at)`
/// called directly with a handle and location records of the exact classes: the
/// action record is built here, then run as a one-action plan.
pub fn run_direct(
    manager: &CoreManager,
    py: Python<'_>,
    kind: ActionKind,
    fields: &[&Bound<'_, PyAny>],
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let context = manager.context();
    let Some((class, builder)) = context.direct_class(kind) else {
        return Err(PyTypeError::new_err(
            "internal error: discard is not a direct call",
        ));
    };
    // Arguments of other classes (subclasses, or not records at all) go through the
    // action class's own constructor, which checks them.
    let location_class = context.pageable.bind(py).get_type();
    let exact = fields
        .first()
        .is_some_and(|handle| handle.get_type().is(&context.handle_class))
        && fields.iter().skip(1).enumerate().all(|(position, field)| {
            field.get_type().is(&location_class) || (position == 1 && field.is_none())
        });
    if !exact {
        let action = class.bind(py).call1(PyTuple::new(py, fields)?)?;
        return run(manager, py, &action, stream);
    }
    let address = |position: usize| {
        fields
            .get(position)
            .map_or(0, |field| field.as_ptr().addr())
    };
    let key = (kind, [address(0), address(1), address(2)]);
    let action = if let Some(action) = context
        .direct_actions
        .get(&key, |action| action.bind(py).clone())
    {
        action
    } else {
        let action = builder.build(py, fields)?;
        context.direct_actions.keep(key, action.clone().unbind());
        action
    };
    let (Some(handle), Some(location)) = (fields.first(), fields.get(1)) else {
        return Err(PyTypeError::new_err(
            "internal error: a direct call without its arguments",
        ));
    };
    let from = match kind {
        ActionKind::Move => fields.get(2).copied(),
        _ => None,
    };
    let transition = manager.in_transition(py, || {
        perform(
            manager,
            py,
            &action,
            || resolve(manager, py, handle),
            || step(manager, py, kind, location, from, stream),
        )
    })?;
    report(manager, py, &transition)
}

/// The report record of a transition `run` or `run_direct` ran.
fn report(manager: &CoreManager, py: Python<'_>, transition: &Transition) -> PyResult<Py<PyAny>> {
    Ok(transition
        .report(py, manager.context().report_builder(py))?
        .unbind())
}

/// Runs `operation` as a transition (`adopt`, `register_source`): the gate is taken,
/// queued releases applied and completed CUDA leases reaped first, as every transition
/// does (an action's in `perform`), and the gate is released after.
pub(crate) fn in_transition<T>(
    manager: &CoreManager,
    py: Python<'_>,
    operation: impl FnOnce() -> PyResult<T>,
) -> PyResult<T> {
    manager.in_transition(py, || {
        crate::lifetimes::reap(manager, py)?;
        operation()
    })
}

/// What the core's runner or driver gave back, its errors raised: the device's as
/// they were raised, the core's as their documented classes.
fn ran<T>(py: Python<'_>, result: Result<T, RunError<PyErr>>) -> PyResult<T> {
    match result {
        Ok(done) => Ok(done),
        Err(RunError::Device(error)) => Err(error),
        Err(RunError::Core(error)) => Err(to_py_err(py, error)),
    }
}

/// An action record read and checked: the core's action (its one value at slot 0)
/// with its location codes, the location record it names (a move's destination; the
/// record itself for a discard, which names none), and its transfer stream as the
/// runtime binds it to that location's device, which is what the copies, events and
/// synchronisations then use: a default-stream handle names the *current* device's
/// default stream, so the raw object would follow whatever device is current when
/// they run (docs/concepts/simulation.md#current-device-and-default-streams).
struct Step<'py> {
    action: Action,
    location: Bound<'py, PyAny>,
    stream: Option<Bound<'py, PyAny>>,
}

/// The checked step of `action`, with its transfer stream (see `step`).
fn read_step<'py>(
    manager: &CoreManager,
    py: Python<'py>,
    action: &Bound<'py, PyAny>,
    stream: Option<&Bound<'py, PyAny>>,
) -> PyResult<Step<'py>> {
    let kind = manager.context().action_kind(action)?;
    let (location, from) = locations_of(action, kind)?;
    // A discard names no location: the record stands for it.
    let location = location.unwrap_or_else(|| action.clone());
    step(manager, py, kind, &location, from.as_ref(), stream)
}

/// The step of an action of `kind` with its location fields (`location` is the
/// destination of a move and unused for a discard), checked with its stream.
fn step<'py>(
    manager: &CoreManager,
    py: Python<'py>,
    kind: ActionKind,
    location: &Bound<'py, PyAny>,
    from: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, PyAny>>,
) -> PyResult<Step<'py>> {
    let context = manager.context();
    let at = match kind {
        ActionKind::Discard => None,
        _ => Some(context.location_code(py, location)?),
    };
    let from = match from {
        Some(from) if !from.is_none() => Some(context.location_code(py, from)?),
        _ => None,
    };
    let action = Action::new(kind, HandleSlot(0), at, from).map_err(|err| to_py_err(py, err))?;
    let bound = match stream {
        None => None,
        Some(stream) => {
            let to = Refusal::stream_destination(&action).map_err(|err| refuse(py, err))?;
            Some(context.check_stream(py, stream, location, to)?)
        }
    };
    Ok(Step {
        action,
        location: location.clone(),
        stream: bound,
    })
}

/// Runs `action` inside a transition; the caller holds the gate. `resolved` is the
/// action's handle index when the caller resolved it already (a preflighted plan).
pub fn execute(
    manager: &CoreManager,
    py: Python<'_>,
    action: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
    resolved: Option<HandleId>,
) -> PyResult<Arc<Transition>> {
    perform(
        manager,
        py,
        action,
        || match resolved {
            Some(index) => Ok(index),
            None => resolve(manager, py, &action.getattr(intern!(py, "handle"))?),
        },
        || read_step(manager, py, action, stream),
    )
}

/// The live value `handle` names, or the error naming it.
fn resolve(manager: &CoreManager, py: Python<'_>, handle: &Bound<'_, PyAny>) -> PyResult<HandleId> {
    match manager.resolve_live(py, handle)? {
        Some(index) => Ok(index),
        None => Err(manager.handle_error(py, handle)?),
    }
}

/// Runs action record `record` as a transition, the caller holding the gate, with the
/// checks in the order every action takes them: the reap, the handle (`index`), then
/// the locations (`step`).
fn perform<'py>(
    manager: &CoreManager,
    py: Python<'py>,
    record: &Bound<'py, PyAny>,
    index: impl FnOnce() -> PyResult<HandleId>,
    step: impl FnOnce() -> PyResult<Step<'py>>,
) -> PyResult<Arc<Transition>> {
    crate::lifetimes::reap(manager, py)?;
    let started = now_ns();
    let index = index()?;
    let step = step()?;
    execute_step(manager, py, record, index, &step, started)
}

/// Runs the checked `step` of record `record` on value `index`; the caller holds the
/// gate.
fn execute_step<'py>(
    manager: &CoreManager,
    py: Python<'py>,
    record: &Bound<'py, PyAny>,
    index: HandleId,
    step: &Step<'py>,
    started: u64,
) -> PyResult<Arc<Transition>> {
    let (action, location) = (&step.action, &step.location);
    let context = manager.context();
    let core = manager.core();
    let asynchronous = manager.asynchronous();
    let telemetry = action.telemetry(asynchronous, || core.materialization_locations(index));
    let telemetry = CoreManager::lift(py, telemetry)?;
    let device = place(context, py, location, telemetry.device)?
        .map(|place| place.getattr(intern!(py, "device")))
        .transpose()?;
    let before = match &device {
        Some(cuda) if telemetry.readings => sample(context, py, cuda)?,
        _ => None,
    };
    let mut runtime = Runtime {
        manager,
        py,
        stream: step.stream.as_ref(),
    };
    let done = ran(
        py,
        core.transition(action, index, asynchronous, &mut runtime),
    )?;
    let places = action.report_places(done.source, done.no_op);
    let reason = places.no_op.and_then(|kind| context.no_op_reason(py, kind));
    let source = place(context, py, location, places.source)?;
    let destination = place(context, py, location, places.destination)?;
    let after = match &device {
        Some(cuda) if telemetry.readings => sample(context, py, cuda)?,
        _ => None,
    };
    let spec = CoreManager::lift(py, core.value_spec(index))?;
    let allocator = device.map(|device| {
        Box::new(AllocatorReadings {
            device: device.unbind(),
            before: before.map(unbind),
            after: after.map(unbind),
        })
    });
    let transition = Arc::new(Transition::new(TransitionFacts::completed_now(
        record.clone().unbind(),
        done.no_op,
        source.map(Bound::unbind),
        destination.map(Bound::unbind),
        spec.logical_nbytes(),
        spec.storage_nbytes(),
        started,
        allocator,
        reason,
    )));
    manager.record(&transition);
    Ok(transition)
}

/// The location record of `place`: `named` is the record the action names.
#[inline]
fn place<'py>(
    context: &Context,
    py: Python<'py>,
    named: &Bound<'py, PyAny>,
    place: Place,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    match place {
        Place::None => Ok(None),
        Place::Named => Ok(Some(named.clone())),
        Place::At(location) => context.location(py, location).map(Some),
    }
}

/// Allocator figures around a transition that touches a CUDA device: allocated and
/// reserved bytes.
type Sample<'py> = (Bound<'py, PyAny>, Bound<'py, PyAny>);

fn unbind((allocated, reserved): Sample<'_>) -> (Py<PyAny>, Py<PyAny>) {
    (allocated.unbind(), reserved.unbind())
}

/// The allocator's figures on `device`; a runtime that cannot say gives none.
fn sample<'py>(
    context: &Context,
    py: Python<'py>,
    device: &Bound<'py, PyAny>,
) -> PyResult<Option<Sample<'py>>> {
    let runtime = context.runtime.bind(py);
    // One call reads both figures (the runtime's `memory_sample`); `None` reads as
    // no reading, like a failure.
    let native = match context.seam() {
        Some(seam) => seam.sample(runtime, device),
        None => Ok(None),
    };
    let figures = native
        .and_then(|native| match native {
            Some(figures) => Ok(figures.into_any()),
            None => runtime.call_method1(intern!(py, "memory_sample"), (device,)),
        })
        .and_then(|figures| {
            if figures.is_none() {
                let none = py.None().into_bound(py);
                return Ok((none.clone(), none));
            }
            Ok((measure::item(&figures, 0)?, measure::item(&figures, 1)?))
        });
    match figures {
        Ok(sample) => Ok(Some(sample)),
        Err(err) if err.is_instance_of::<PyException>(py) => Ok(None),
        Err(err) => Err(err),
    }
}

/// The device work of one transition, which the core's driver sequences
/// (`residency_core::Manager::transition`): the runtime's copies, events and
/// synchronisations, the source's `load()`, the disk tier's deferred load, the
/// validation of what they made, and the objects the manager keeps.
struct Runtime<'a, 'py> {
    manager: &'a CoreManager,
    py: Python<'py>,
    /// The transfer stream, bound to the destination's device.
    stream: Option<&'a Bound<'py, PyAny>>,
}

/// A value the runtime holds or made, with the stream that allocated it (a CUDA copy's)
/// and its facts where the runtime gave them with the copy (`copy_to_cuda_measured`).
struct Made<'py> {
    value: Bound<'py, PyAny>,
    owner: Option<Bound<'py, PyAny>>,
    facts: Option<Facts<'py>>,
}

impl<'py> Made<'py> {
    fn held(value: Bound<'py, PyAny>) -> Self {
        Self {
            value,
            owner: None,
            facts: None,
        }
    }
}

/// A load the disk tier may defer: the source, the destination's device and the
/// stream its copies go on.
struct Deferral<'py> {
    source: Py<PyAny>,
    device: Bound<'py, PyAny>,
    stream: Bound<'py, PyAny>,
}

impl<'py> TransitionDevice for Runtime<'_, 'py> {
    type Value = Made<'py>;
    type Event = Bound<'py, PyAny>;
    type Deferral = Deferral<'py>;
    type Error = PyErr;

    fn resident(&mut self, index: HandleId, at: Location) -> PyResult<Made<'py>> {
        self.manager
            .value_object(self.py, index, at)
            .map(Made::held)
    }

    fn wait(&mut self, events: &[ObjectId]) -> PyResult<()> {
        let py = self.py;
        let runtime = self.manager.context().runtime(py);
        for event in self.manager.objects().objects(py, events) {
            runtime.call_method1(intern!(py, "synchronize_event"), (event,))?;
        }
        Ok(())
    }

    fn load(&mut self, index: HandleId) -> PyResult<Made<'py>> {
        self.manager.load_for(self.py, index).map(Made::held)
    }

    fn prepare_deferral(
        &mut self,
        index: HandleId,
        at: Location,
    ) -> PyResult<Option<Deferral<'py>>> {
        let py = self.py;
        let Some(source) = self.manager.objects().source(py, index) else {
            return Ok(None);
        };
        let (device, stream) = device_stream(self.manager.context(), py, at, self.stream)?;
        Ok(Some(Deferral {
            source,
            device,
            stream,
        }))
    }

    /// `DiskTier.load_to_cuda`, on the tier's I/O thread
    /// (docs/concepts/values.md#reconstructions-a-pipeline-defers).
    fn defer(
        &mut self,
        deferral: Deferral<'py>,
    ) -> PyResult<Option<Copied<Made<'py>, Bound<'py, PyAny>>>> {
        let py = self.py;
        let context = self.manager.context();
        let made = context.disk.bind(py).call_method1(
            intern!(py, "load_to_cuda"),
            (
                deferral.source.bind(py),
                &deferral.device,
                &deferral.stream,
                context.runtime(py),
            ),
        )?;
        if made.is_none() {
            return Ok(None);
        }
        let (value, event): (Bound<'py, PyAny>, Bound<'py, PyAny>) = made.extract()?;
        let value = Made {
            value,
            owner: Some(deferral.stream),
            facts: None,
        };
        Ok(Some(Copied {
            value,
            event: Some(event),
        }))
    }

    /// Host copies are synchronous. A CUDA copy is enqueued on the transfer stream (the
    /// device's current stream without one) and waited for through an event; if it
    /// fails, the stream is synchronised before the error propagates, because the copy
    /// may still be reading its source (docs/concepts/transitions.md).
    /// With `asynchronous`, a CUDA copy is not waited for: its event comes back with it.
    /// A CUDA copy also gives back the stream that allocated it, and, from a runtime with
    /// `copy_to_cuda_measured`, the copy's facts (docs/architecture.md#the-device-seam).
    fn copy(
        &mut self,
        made: &Made<'py>,
        source: Location,
        at: Location,
        asynchronous: bool,
    ) -> PyResult<Copied<Made<'py>, Bound<'py, PyAny>>> {
        let (context, py, stream) = (self.manager.context(), self.py, self.stream);
        let value = &made.value;
        let runtime = context.runtime.bind(py);
        let disk = context.disk.bind(py);
        match CopyRoute::between(source, at) {
            // Read back: mapped into pageable memory, read into pinned memory, or through
            // the disk tier's pinned staging ring to a device, a chunk at a time, with the
            // copies on the transfer stream (docs/concepts/locations-and-budgets.md#disk).
            CopyRoute::ReadToHost { pinned } => Ok(host(
                disk.call_method1(intern!(py, "read"), (value, pinned, runtime))?,
            )),
            CopyRoute::ReadToCuda => {
                let (device, copy_stream) = device_stream(context, py, at, stream)?;
                // The tier waits for its own copies before it raises.
                let (read, event): (Bound<'py, PyAny>, Bound<'py, PyAny>) = disk
                    .call_method1(
                        intern!(py, "read_to_cuda"),
                        (value, &device, &copy_stream, runtime),
                    )?
                    .extract()?;
                Ok(Copied {
                    event: settle(runtime, event, asynchronous)?,
                    value: Made {
                        value: read,
                        owner: Some(copy_stream),
                        facts: None,
                    },
                })
            }
            CopyRoute::Write => Ok(host(disk.call_method1(
                intern!(py, "write"),
                (context.location(py, at)?, value, runtime),
            )?)),
            CopyRoute::ToPinned => Ok(host(
                runtime.call_method1(intern!(py, "copy_to_pinned"), (value,))?,
            )),
            CopyRoute::ToPageable => Ok(host(
                runtime.call_method1(intern!(py, "copy_to_pageable"), (value,))?,
            )),
            CopyRoute::ToCuda { non_blocking } => {
                let (device, copy_stream) = device_stream(context, py, at, stream)?;
                match enqueue_cuda_copy(
                    context,
                    py,
                    value,
                    &device,
                    &copy_stream,
                    non_blocking,
                    asynchronous,
                ) {
                    Ok((copied, facts, event)) => Ok(Copied {
                        value: Made {
                            value: copied,
                            owner: Some(copy_stream),
                            facts,
                        },
                        event,
                    }),
                    Err(error) => Err(after_failed_copy(runtime, &device, &copy_stream, error)?),
                }
            }
        }
    }

    fn validate(&mut self, index: HandleId, at: Location, value: &Made<'py>) -> PyResult<Measured> {
        let facts = measure::validate(
            self.manager,
            self.py,
            index,
            at,
            &value.value,
            value.facts.as_ref(),
        )?;
        Ok(Measured {
            logical_nbytes: facts.facts.logical,
            storage_nbytes: facts.facts.storage,
            keys: facts.facts.keys,
        })
    }

    fn synchronize(&mut self, event: &Bound<'py, PyAny>) -> PyResult<()> {
        let runtime = self.manager.context().runtime(self.py);
        runtime.call_method1(intern!(self.py, "synchronize_event"), (event,))?;
        Ok(())
    }

    fn keep_event(&mut self, id: ObjectId, event: &Bound<'py, PyAny>) {
        drop(self.manager.objects().put(id, event.clone().unbind()));
    }

    fn keep_value(&mut self, id: ObjectId, value: &Made<'py>) {
        drop(self.manager.objects().put(id, value.value.clone().unbind()));
    }

    fn free(&mut self, freed: &Freed) {
        self.manager.free(freed);
    }

    fn install(&mut self, index: HandleId, at: Location, made: Made<'py>) {
        self.manager.keep_value(self.py, index, at, &made.value);
        if let Some(owner) = made.owner {
            // The installed copy's owning stream
            // (docs/concepts/controller.md#evicting-around-reads-in-flight).
            drop(
                self.manager
                    .objects()
                    .set_stream(index, at.code(), owner.unbind()),
            );
        }
    }

    fn forget(&mut self, index: HandleId, at: Location) {
        self.manager.forget_value(index, at);
    }

    fn discarded(&mut self, index: HandleId, removed: &[Location]) {
        self.manager.forget_discarded(self.py, index, removed);
    }
}

/// A synchronous copy that no stream allocated.
fn host(value: Bound<'_, PyAny>) -> Copied<Made<'_>, Bound<'_, PyAny>> {
    Copied {
        value: Made::held(value),
        event: None,
    }
}

/// The error of a failed CUDA copy, once its stream is synchronised: the copy may still
/// be reading the source on the stream (interrupts too). A failed synchronisation is a
/// note on the error, or, if it is not an `Exception`, the error raised, with the
/// copy's error as its context, as a raise inside an except block would make it.
fn after_failed_copy(
    runtime: &Bound<'_, PyAny>,
    device: &Bound<'_, PyAny>,
    copy_stream: &Bound<'_, PyAny>,
    error: PyErr,
) -> PyResult<PyErr> {
    let py = runtime.py();
    let Err(cleanup) = runtime.call_method1(intern!(py, "synchronize_stream"), (copy_stream,))
    else {
        return Ok(error);
    };
    if !cleanup.is_instance_of::<PyException>(py) {
        cleanup
            .value(py)
            .setattr(intern!(py, "__context__"), error.value(py))?;
        return Ok(cleanup);
    }
    let note = cleanup_note(
        &device.str()?.to_cow()?,
        &cleanup.value(py).repr()?.to_cow()?,
    );
    error
        .value(py)
        .call_method1(intern!(py, "add_note"), (note,))?;
    Ok(error)
}

/// The device of CUDA location `at` and the stream a copy to it goes on: the transfer
/// stream, else the device's current stream.
fn device_stream<'py>(
    context: &Context,
    py: Python<'py>,
    at: Location,
    stream: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let device = context.device(py, at)?;
    let stream = match stream {
        Some(stream) => stream.clone(),
        None => context
            .runtime(py)
            .call_method1(intern!(py, "current_stream"), (&device,))?,
    };
    Ok((device, stream))
}

/// A copy's `event`, waited for here unless `asynchronous` (it then comes back).
fn settle<'py>(
    runtime: &Bound<'py, PyAny>,
    event: Bound<'py, PyAny>,
    asynchronous: bool,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    if asynchronous {
        return Ok(Some(event));
    }
    runtime.call_method1(intern!(runtime.py(), "synchronize_event"), (event,))?;
    Ok(None)
}

/// The copy `copy_to` enqueues on `copy_stream` for a CUDA destination, with its facts
/// where the runtime gives them (`copy_to_cuda_measured`), and the event recorded after
/// it (see `settle`).
#[allow(clippy::type_complexity)] // the copy, its facts and its event
fn enqueue_cuda_copy<'py>(
    context: &Context,
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
    device: &Bound<'py, PyAny>,
    copy_stream: &Bound<'py, PyAny>,
    non_blocking: bool,
    asynchronous: bool,
) -> PyResult<(
    Bound<'py, PyAny>,
    Option<Facts<'py>>,
    Option<Bound<'py, PyAny>>,
)> {
    let runtime = context.runtime.bind(py);
    let options = context.copy_options(py, non_blocking);
    let native = match context.seam() {
        Some(seam) => seam.copy_measured(runtime, value, device, copy_stream, non_blocking)?,
        None => None,
    };
    let (copied, facts) = if let Some(made) = native {
        let facts = measure::copied_facts(&made);
        (made.value, Some(facts))
    } else if context.measured_copies {
        // The copy and what `measure` would say of it, from one call; `None` for
        // facts: the runtime could not say, and the copy is measured as usual.
        let made = runtime.call_method(
            intern!(py, "copy_to_cuda_measured"),
            (value, device, copy_stream),
            Some(options),
        )?;
        let facts = measure::item(&made, 1)?;
        let facts = if facts.is_none() {
            None
        } else {
            Some(measure::facts_of(&facts)?)
        };
        (measure::item(&made, 0)?, facts)
    } else {
        let copied = runtime.call_method(
            intern!(py, "copy_to_cuda"),
            (value, device, copy_stream),
            Some(options),
        )?;
        (copied, None)
    };
    let event = match context.seam() {
        Some(seam) => seam.record(runtime, copy_stream)?,
        None => None,
    };
    let event = match event {
        Some(event) => event,
        None => runtime.call_method1(intern!(py, "record_event"), (copy_stream,))?,
    };
    Ok((copied, facts, settle(runtime, event, asynchronous)?))
}
