//! One transition end to end in one call: the path every host action takes.
//!
//! An ensure, move, drop or discard whose locations are all on the host runs here
//! without returning to the Python glue: the core decides and charges, the
//! reconstruction source's `load()` and the runtime's host copy are the only Python
//! code called, values are measured and validated here, and the transition report is
//! built here. Anything else (a CUDA location, a transfer stream, pending CUDA
//! leases to reap, a subclassed action, a handle that does not resolve) is declined
//! before any state changes, and the glue takes its general path, which follows the
//! same rules (docs/concepts/transitions.md).

use std::time::{SystemTime, UNIX_EPOCH};

use pyo3::IntoPyObjectExt;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};
use residency_core::{CoreError, EnsurePlan, HandleId, Location, MovePlan};

use crate::errors::to_py_err;
use crate::manager::CoreManager;
use crate::measure::{self, Facts};
use crate::records::RecordBuilder;

/// What the engine hands over once: the classes it recognises, the report builder,
/// the runtime, and the shared records and strings reports carry.
#[derive(Debug)]
pub struct Context {
    ensure: Py<PyAny>,
    move_: Py<PyAny>,
    drop: Py<PyAny>,
    discard: Py<PyAny>,
    /// Builds transition reports without running Python code.
    report: Py<RecordBuilder>,
    runtime: Py<PyAny>,
    /// The runtime measures with torch directly, so this crate can too.
    native_measure: bool,
    pinning_possible: bool,
    /// Shared location records by code; `location_of` builds the others.
    pageable: Py<PyAny>,
    pinned: Py<PyAny>,
    location_of: Py<PyAny>,
    ensure_noop: Py<PyAny>,
    move_noop: Py<PyAny>,
    drop_noop: Py<PyAny>,
    /// The process-wide integer key of a value type.
    type_key: Py<PyAny>,
    /// Builds an adopted value's spec record: `(type, logical, charge, mode, recoverability)`.
    spec_builder: Py<PyAny>,
    must_preserve: Py<PyAny>,
    /// Builds a lease: `(engine, token, handles, location, streams)`.
    new_lease: Py<PyAny>,
    exclusive: Py<PyAny>,
}

impl Context {
    /// From the engine's tuple: `(ensure, move, drop, discard, report_builder,
    /// runtime, native_measure, pinning_possible, pageable, pinned, location_of,
    /// (ensure_noop, move_noop, drop_noop), type_key, spec_builder, must_preserve,
    /// new_lease, exclusive)`.
    pub fn from_tuple(items: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let item = |index: usize| items.get_item(index).map(Bound::unbind);
        let reasons = items.get_item(11)?;
        let reasons = reasons.cast::<PyTuple>()?;
        Ok(Self {
            ensure: item(0)?,
            move_: item(1)?,
            drop: item(2)?,
            discard: item(3)?,
            report: items.get_item(4)?.cast::<RecordBuilder>()?.clone().unbind(),
            runtime: item(5)?,
            native_measure: items.get_item(6)?.extract()?,
            pinning_possible: items.get_item(7)?.extract()?,
            pageable: item(8)?,
            pinned: item(9)?,
            location_of: item(10)?,
            ensure_noop: reasons.get_item(0)?.unbind(),
            move_noop: reasons.get_item(1)?.unbind(),
            drop_noop: reasons.get_item(2)?.unbind(),
            type_key: item(12)?,
            spec_builder: item(13)?,
            must_preserve: item(14)?,
            new_lease: item(15)?,
            exclusive: item(16)?,
        })
    }

    pub(crate) fn type_key(&self, py: Python<'_>, value_type: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.type_key.bind(py).call1((value_type,))?.extract()
    }

    pub(crate) fn adopted_spec(
        &self,
        py: Python<'_>,
        value_type: &Bound<'_, PyAny>,
        logical: u64,
        charge: u64,
        replica_mode: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        Ok(self
            .spec_builder
            .bind(py)
            .call1((
                value_type,
                logical,
                charge,
                replica_mode,
                self.must_preserve.bind(py),
            ))?
            .unbind())
    }

    pub(crate) fn is_exclusive(&self, replica_mode: &Bound<'_, PyAny>) -> bool {
        replica_mode.is(&self.exclusive)
    }

    pub(crate) fn is_must_preserve(&self, recoverability: &Bound<'_, PyAny>) -> bool {
        recoverability.is(&self.must_preserve)
    }

    pub(crate) fn new_lease<'py>(&self, py: Python<'py>) -> &Bound<'py, PyAny> {
        self.new_lease.bind(py)
    }

    /// The code of a host location record; `None` for anything else.
    pub(crate) fn host_code(
        &self,
        py: Python<'_>,
        location: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Location>> {
        if location.is(&self.pageable) {
            return Ok(Some(Location::PageableHost));
        }
        if location.is(&self.pinned) {
            return Ok(Some(Location::PinnedHost));
        }
        // Only location records (or their subclasses) name a location; anything else
        // is the general path's to refuse with its TypeError.
        if !location.is_instance(&self.pageable.bind(py).get_type())? {
            return Ok(None);
        }
        let Ok(kind) = location.getattr(intern!(py, "kind")) else {
            return Ok(None);
        };
        let Ok(kind) = kind.cast::<PyString>() else {
            return Ok(None);
        };
        Ok(match kind.to_str()? {
            "pageable-host" => Some(Location::PageableHost),
            "pinned-host" => Some(Location::PinnedHost),
            _ => None,
        })
    }

    fn location<'py>(&self, py: Python<'py>, location: Location) -> PyResult<Bound<'py, PyAny>> {
        match location {
            Location::PageableHost => Ok(self.pageable.bind(py).clone()),
            Location::PinnedHost => Ok(self.pinned.bind(py).clone()),
            Location::Cuda(_) => self.location_of.bind(py).call1((location.code(),)),
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Ensure,
    Move,
    Drop,
    Discard,
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX)
        })
}

fn lift<T>(py: Python<'_>, result: Result<T, CoreError>) -> PyResult<T> {
    result.map_err(|err| to_py_err(py, err))
}

fn materialization_error(py: Python<'_>, message: String) -> PyErr {
    to_py_err(py, CoreError::Materialization { message })
}

/// A transition's outcome before it becomes a report.
struct Outcome<'py> {
    no_op: bool,
    source: Option<Bound<'py, PyAny>>,
    destination: Option<Bound<'py, PyAny>>,
    reason: Option<Bound<'py, PyAny>>,
}

/// Runs `action` if it is a host action, taking the gate for it; `None` declines.
pub fn run_host(
    manager: &CoreManager,
    py: Python<'_>,
    action: &Bound<'_, PyAny>,
) -> PyResult<Option<Py<PyAny>>> {
    let Some(prepared) = prepare(manager, py, action)? else {
        return Ok(None);
    };
    manager.enter_transition_gate(py)?;
    let result = execute_prepared(manager, py, action, &prepared);
    manager.core().end_transition();
    manager.core().exit();
    result
}

/// Runs `action` if it is a host action; the caller holds the gate (a plan phase).
pub fn execute_host(
    manager: &CoreManager,
    py: Python<'_>,
    action: &Bound<'_, PyAny>,
) -> PyResult<Option<Py<PyAny>>> {
    let Some(prepared) = prepare(manager, py, action)? else {
        return Ok(None);
    };
    execute_prepared(manager, py, action, &prepared)
}

/// What an action names, read before the gate is taken.
struct Prepared<'py> {
    kind: Kind,
    handle: Bound<'py, PyAny>,
    location: Option<(Location, Bound<'py, PyAny>)>,
    from: Option<Location>,
}

fn prepare<'py>(
    manager: &CoreManager,
    py: Python<'py>,
    action: &Bound<'py, PyAny>,
) -> PyResult<Option<Prepared<'py>>> {
    let Some(context) = manager.context() else {
        return Ok(None);
    };
    let action_type = action.get_type();
    let kind = if action_type.is(&context.ensure) {
        Kind::Ensure
    } else if action_type.is(&context.drop) {
        Kind::Drop
    } else if action_type.is(&context.move_) {
        Kind::Move
    } else if action_type.is(&context.discard) {
        Kind::Discard
    } else {
        return Ok(None);
    };
    let handle = action.getattr(intern!(py, "handle"))?;
    let (location, from) = match kind {
        Kind::Discard => (None, None),
        Kind::Ensure | Kind::Drop => {
            let location = action.getattr(intern!(py, "location"))?;
            let Some(code) = context.host_code(py, &location)? else {
                return Ok(None);
            };
            (Some((code, location)), None)
        }
        Kind::Move => {
            let to = action.getattr(intern!(py, "to"))?;
            let Some(code) = context.host_code(py, &to)? else {
                return Ok(None);
            };
            let from = action.getattr(intern!(py, "from_location"))?;
            let from = if from.is_none() {
                None
            } else {
                let Some(from) = context.host_code(py, &from)? else {
                    return Ok(None);
                };
                Some(from)
            };
            (Some((code, to)), from)
        }
    };
    Ok(Some(Prepared {
        kind,
        handle,
        location,
        from,
    }))
}

fn execute_prepared(
    manager: &CoreManager,
    py: Python<'_>,
    action: &Bound<'_, PyAny>,
    prepared: &Prepared<'_>,
) -> PyResult<Option<Py<PyAny>>> {
    let Some(context) = manager.context() else {
        return Ok(None);
    };
    let core = manager.core();
    // Reaping pending CUDA leases needs their events, which the glue holds.
    if core.pending_leases() > 0 {
        return Ok(None);
    }
    manager.drain_deferred(py)?;
    let Some(index) = manager.resolve_live(py, &prepared.handle)? else {
        return Ok(None);
    };
    // A discard, or a move choosing its own source, that may involve a CUDA
    // materialisation samples the allocator: the general path does that.
    let samples_cuda = matches!(prepared.kind, Kind::Discard)
        || (matches!(prepared.kind, Kind::Move) && prepared.from.is_none());
    if samples_cuda
        && lift(py, core.materialization_locations(index))?
            .iter()
            .any(|location| matches!(location, Location::Cuda(_)))
    {
        return Ok(None);
    }
    let started = now_ns();
    let outcome = match (prepared.kind, &prepared.location) {
        (Kind::Ensure, Some((at, location))) => ensure(manager, py, index, *at, location)?,
        (Kind::Move, Some((to, location))) => {
            move_(manager, py, index, *to, location, prepared.from)?
        }
        (Kind::Drop, Some((at, location))) => {
            let dropped = manager.drop_value(py, index, *at)?;
            Outcome {
                no_op: !dropped,
                source: Some(location.clone()),
                destination: None,
                reason: (!dropped).then(|| context.drop_noop.bind(py).clone()),
            }
        }
        _ => {
            manager.discard_value(py, index)?;
            Outcome {
                no_op: false,
                source: None,
                destination: None,
                reason: None,
            }
        }
    };
    let spec = lift(py, core.value_spec(index))?;
    let none = py.None().into_bound(py);
    let fields = [
        action.clone(),
        outcome.no_op.into_bound_py_any(py)?,
        outcome.source.unwrap_or_else(|| none.clone()),
        outcome.destination.unwrap_or_else(|| none.clone()),
        spec.logical_nbytes().into_bound_py_any(py)?,
        spec.storage_nbytes().into_bound_py_any(py)?,
        started.into_bound_py_any(py)?,
        now_ns().max(started).into_bound_py_any(py)?,
        none.clone(),
        none.clone(),
        none.clone(),
        none.clone(),
        none.clone(),
        outcome.reason.unwrap_or(none),
    ];
    let fields: Vec<&Bound<'_, PyAny>> = fields.iter().collect();
    let report = context.report.get().build(py, &fields)?.unbind();
    manager.record(py, &report);
    Ok(Some(report))
}

fn ensure<'py>(
    manager: &CoreManager,
    py: Python<'py>,
    index: HandleId,
    at: Location,
    location: &Bound<'py, PyAny>,
) -> PyResult<Outcome<'py>> {
    let context = manager.context().expect("checked by the caller");
    let core = manager.core();
    let source = match lift(py, core.plan_ensure(index, at))? {
        EnsurePlan::NoOp => {
            return Ok(Outcome {
                no_op: true,
                source: None,
                destination: Some(location.clone()),
                reason: Some(context.ensure_noop.bind(py).clone()),
            });
        }
        EnsurePlan::Copy { source } => {
            copy_in(manager, py, index, source, at, false)?;
            source
        }
        EnsurePlan::Reconstruct { source_location } => {
            load_in(manager, py, index, source_location, at, false)?;
            source_location
        }
    };
    installed(context, py, source, location)
}

fn move_<'py>(
    manager: &CoreManager,
    py: Python<'py>,
    index: HandleId,
    to: Location,
    location: &Bound<'py, PyAny>,
    from: Option<Location>,
) -> PyResult<Outcome<'py>> {
    let context = manager.context().expect("checked by the caller");
    let core = manager.core();
    let source = match lift(py, core.plan_move(index, to, from))? {
        MovePlan::NoOp { source } => {
            return Ok(Outcome {
                no_op: true,
                source: source
                    .map(|source| context.location(py, source))
                    .transpose()?,
                destination: Some(location.clone()),
                reason: Some(context.move_noop.bind(py).clone()),
            });
        }
        MovePlan::RemovedSource { source } => {
            manager.forget_value(index, source);
            source
        }
        MovePlan::Copy { source } => {
            copy_in(manager, py, index, source, to, true)?;
            lift(py, core.remove(index, source))?;
            manager.forget_value(index, source);
            source
        }
        MovePlan::Reconstruct { source_location } => {
            load_in(manager, py, index, source_location, to, true)?;
            source_location
        }
    };
    installed(context, py, source, location)
}

/// The outcome of an install at `location` from `source`.
fn installed<'py>(
    context: &Context,
    py: Python<'py>,
    source: Location,
    location: &Bound<'py, PyAny>,
) -> PyResult<Outcome<'py>> {
    Ok(Outcome {
        no_op: false,
        source: Some(context.location(py, source)?),
        destination: Some(location.clone()),
        reason: None,
    })
}

/// Copies the materialisation at `source` to the host location `at` and installs it.
fn copy_in(
    manager: &CoreManager,
    py: Python<'_>,
    index: HandleId,
    source: Location,
    at: Location,
    exclusive_transition: bool,
) -> PyResult<()> {
    let context = manager.context().expect("checked by the caller");
    let value = manager.value_object(py, index, source)?;
    let copied = copy_to_host(context, py, &value, at)?;
    install(manager, py, index, at, &copied, exclusive_transition)
}

/// Runs the source's `load()` (the core has charged `source_location`), applies the
/// releases that arrived meanwhile, and installs the loaded value at `at`.
fn load_in(
    manager: &CoreManager,
    py: Python<'_>,
    index: HandleId,
    source_location: Location,
    at: Location,
    exclusive_transition: bool,
) -> PyResult<()> {
    let loaded = manager.load_for(py, index, source_location)?;
    manager.drain_deferred(py)?;
    reconstruct_into(
        manager,
        py,
        index,
        source_location,
        at,
        &loaded,
        exclusive_transition,
    )
}

fn copy_to_host<'py>(
    context: &Context,
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
    at: Location,
) -> PyResult<Bound<'py, PyAny>> {
    let runtime = context.runtime.bind(py);
    match at {
        Location::PinnedHost => runtime.call_method1(intern!(py, "copy_to_pinned"), (value,)),
        _ => runtime.call_method1(intern!(py, "copy_to_pageable"), (value,)),
    }
}

/// After the core took the temporary charge at `source` and `load()` returned:
/// validate the loaded value there, then install it there or copy it to `at`. The
/// temporary charge is returned on every path.
fn reconstruct_into(
    manager: &CoreManager,
    py: Python<'_>,
    index: HandleId,
    source: Location,
    at: Location,
    loaded: &Bound<'_, PyAny>,
    exclusive_transition: bool,
) -> PyResult<()> {
    let core = manager.core();
    let mut charged = true;
    let result = (|| {
        if source == at {
            // Installing where it was loaded, the core's install checks the bytes.
            let facts = validate(manager, py, index, source, loaded, false)?;
            charged = false;
            lift(py, core.release_temporary(index, source))?;
            commit(manager, py, index, at, loaded, &facts, exclusive_transition)
        } else {
            validate(manager, py, index, source, loaded, true)?;
            lift(py, core.admit(index, at))?;
            let context = manager.context().expect("checked by the caller");
            let copied = copy_to_host(context, py, loaded, at)?;
            install(manager, py, index, at, &copied, exclusive_transition)
        }
    })();
    if charged {
        let released = lift(py, core.release_temporary(index, source));
        result.and(released)
    } else {
        result
    }
}

fn install(
    manager: &CoreManager,
    py: Python<'_>,
    index: HandleId,
    at: Location,
    value: &Bound<'_, PyAny>,
    exclusive_transition: bool,
) -> PyResult<()> {
    let facts = validate(manager, py, index, at, value, false)?;
    commit(manager, py, index, at, value, &facts, exclusive_transition)
}

fn commit(
    manager: &CoreManager,
    py: Python<'_>,
    index: HandleId,
    at: Location,
    value: &Bound<'_, PyAny>,
    facts: &Facts<'_>,
    exclusive_transition: bool,
) -> PyResult<()> {
    lift(
        py,
        manager.core().install(
            index,
            at,
            facts.logical,
            facts.storage,
            &facts.keys,
            exclusive_transition,
        ),
    )?;
    manager.keep_value(py, index, at, value);
    Ok(())
}

/// Type, placement, logical bytes and storage ceiling of a candidate value.
/// `check_bytes=false` leaves the byte checks to the core's install, which makes them
/// in the same order right after.
fn validate<'py>(
    manager: &CoreManager,
    py: Python<'py>,
    index: HandleId,
    at: Location,
    value: &Bound<'py, PyAny>,
    check_bytes: bool,
) -> PyResult<Facts<'py>> {
    let context = manager.context().expect("checked by the caller");
    let spec = manager.spec_object(py, index)?;
    let value_type = spec.bind(py).getattr(intern!(py, "value_type"))?;
    if !value.is_instance(&value_type)? {
        let handle = manager.handle_object(py, index)?;
        let handle_id = handle.bind(py).getattr(intern!(py, "handle_id"))?;
        return Err(materialization_error(
            py,
            format!(
                "expected a {} for value {}, got {}",
                value_type.getattr(intern!(py, "__name__"))?,
                handle_id.repr()?,
                value.get_type().name()?,
            ),
        ));
    }
    let facts = measure(context, py, value)?;
    let expected = match at {
        Location::PageableHost => (-1, Some(false)),
        Location::PinnedHost => (-1, Some(true)),
        Location::Cuda(device) => (i64::from(device), Some(false)),
    };
    if (facts.device_code, facts.pinned) != expected {
        check_placement(context, py, &facts, at, value)?;
    }
    if check_bytes {
        lift(
            py,
            manager
                .core()
                .check_materialization(index, facts.logical, facts.storage),
        )?;
    }
    Ok(facts)
}

pub(crate) fn measure<'py>(
    context: &Context,
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
) -> PyResult<Facts<'py>> {
    let runtime = context.runtime.bind(py);
    if context.native_measure {
        let tensors = value.getattr(intern!(py, "_resident_tensors"))?;
        if let Ok(tensors) = tensors.cast::<PyTuple>()
            && let Some(facts) = measure::measure(py, tensors, context.pinning_possible)?
        {
            return Ok(facts);
        }
    }
    // The runtime's own measurement: it raises the documented error for a value
    // whose tensors disagree.
    let facts = runtime.call_method1(intern!(py, "measure"), (value,))?;
    Ok(Facts {
        device: facts.get_item(0)?,
        device_code: facts.get_item(1)?.extract()?,
        pinned: facts.get_item(2)?.extract()?,
        logical: facts.get_item(3)?.extract()?,
        storage: facts.get_item(4)?.extract()?,
        keys: facts.get_item(5)?.extract()?,
    })
}

/// The placement error for a value measured somewhere other than `at`.
fn check_placement(
    context: &Context,
    py: Python<'_>,
    facts: &Facts<'_>,
    at: Location,
    value: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let name = value.get_type().name()?;
    let location = context.location(py, at)?;
    let device = location.getattr(intern!(py, "device"))?;
    if !facts.device.eq(&device)? {
        return Err(materialization_error(
            py,
            format!(
                "{name} is on {}, but the location is {}",
                facts.device.str()?,
                location.str()?
            ),
        ));
    }
    if !matches!(at, Location::PageableHost | Location::PinnedHost) {
        return Ok(());
    }
    let message = match (facts.pinned, at) {
        (None, _) => format!("{name} mixes pinned and pageable host tensors"),
        (Some(false), Location::PinnedHost) => format!(
            "{name} is not in pinned memory, but the location is {}",
            location.str()?
        ),
        (Some(true), Location::PageableHost) => format!(
            "{name} is in pinned memory, but the location is {}",
            location.str()?
        ),
        _ => return Ok(()),
    };
    Err(materialization_error(py, message))
}
