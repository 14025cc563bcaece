//! Plans end to end: `execute_actions`, scope entry and scope exit, each one call
//! that takes the transition gate, checks the expected state version and the
//! transfer streams, preflights the plan through the core's simulation and runs its
//! phases in order (docs/concepts/plans.md).
//!
//! Execution is not transactional. A `PlanRun` records how far a run got: the
//! transitions committed so far (kept as plain data; their report records are built
//! only when read), the phase in progress, and the reservation tokens a scope holds.
//! When a call fails the glue reads the run to wrap the error with the committed
//! prefix and the failed action or reservation.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyMapping, PyString, PyTuple};
use residency_core::{Action, CudaDevices, HandleId, Location, Simulation, SlotResolution};

use crate::errors::{ResidencyPlanError, ResidencyStaleStateError};
use crate::execute::{self, Transition};
use crate::manager::CoreManager;
use crate::plan::PlanIr;
use crate::records::RecordBuilder;

/// How far one plan run got; see the module documentation.
#[pyclass(frozen, module = "fhelium._core", name = "PlanRun")]
#[derive(Debug)]
pub struct PlanRun {
    reports: Py<RecordBuilder>,
    state: Mutex<RunState>,
}

#[derive(Debug, Default)]
struct RunState {
    transitions: Vec<Arc<Transition>>,
    /// The phase in progress, or the one that failed; `None` before the first.
    phase: Option<&'static str>,
    /// How many transitions were committed when the current phase began.
    phase_start: usize,
    /// The position of the reservation being admitted while `phase` is "reserve".
    reservation: Option<usize>,
    /// The validated transfer streams by destination, kept for a scope's exit.
    streams: Vec<(Location, Py<PyAny>)>,
    /// Reservation tokens a scope holds, in admission order.
    tokens: Vec<u64>,
}

impl PlanRun {
    fn state(&self) -> MutexGuard<'_, RunState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl PlanRun {
    /// An empty run whose transition reports `reports` builds.
    #[new]
    fn new(reports: Py<RecordBuilder>) -> Self {
        Self {
            reports,
            state: Mutex::new(RunState::default()),
        }
    }

    /// The number of committed transitions.
    fn __len__(&self) -> usize {
        self.state().transitions.len()
    }

    /// The phase in progress when the run stopped ("execute", "reclaim", "reserve",
    /// "enter" or "exit"), or `None` if it failed before its first phase.
    #[getter]
    fn phase(&self) -> Option<&'static str> {
        self.state().phase
    }

    /// The position, within its phase, of the action or reservation in progress.
    #[getter]
    fn position(&self) -> usize {
        let state = self.state();
        state
            .reservation
            .unwrap_or(state.transitions.len() - state.phase_start)
    }

    /// The committed transitions' report records, in order (built once each).
    fn reports<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let transitions = self.state().transitions.clone();
        execute::reports(py, self.reports.get(), &transitions)
    }

    /// Takes the reservation tokens the run still holds, newest first.
    fn take_tokens(&self) -> Vec<u64> {
        let mut tokens = std::mem::take(&mut self.state().tokens);
        tokens.reverse();
        tokens
    }
}

/// `execute_actions`: one phase, named "execute", after the checks and the preflight.
#[allow(clippy::too_many_arguments)] // the call's arguments, as the glue passes them
pub fn execute_plan(
    manager: &CoreManager,
    py: Python<'_>,
    run: &PlanRun,
    ir: &PlanIr,
    handles: &Bound<'_, PyTuple>,
    actions: &Bound<'_, PyTuple>,
    transfer_streams: Option<&Bound<'_, PyAny>>,
    expected_version: Option<&Bound<'_, PyAny>>,
    asynchronous: bool,
    then: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let operation = || {
        let slots = prepare(
            manager,
            py,
            run,
            ir,
            handles,
            &[],
            transfer_streams,
            expected_version,
        )?;
        let resolved = Resolved::new(ir.plan().enter(), &slots);
        manager.set_asynchronous(asynchronous);
        let result = run_phase(manager, py, run, "execute", actions, Some(&resolved));
        manager.set_asynchronous(false);
        result
    };
    within_gate_then(manager, py, operation, then, || {})
}

/// Scope entry: the checks and the preflight, then reclaim, reserve and enter. On a
/// failure the reservations already admitted are released before the error returns.
#[allow(clippy::too_many_arguments)] // the call's arguments, as the glue passes them
pub fn enter_scope(
    manager: &CoreManager,
    py: Python<'_>,
    run: &PlanRun,
    ir: &PlanIr,
    handles: &Bound<'_, PyTuple>,
    plan: &Bound<'_, PyAny>,
    transfer_streams: Option<&Bound<'_, PyAny>>,
    expected_version: Option<&Bound<'_, PyAny>>,
    then: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let operation = || {
        let reservations = plan.getattr(intern!(py, "reservations"))?;
        let reservations: Vec<Bound<'_, PyAny>> =
            reservations.try_iter()?.collect::<PyResult<_>>()?;
        let slots = prepare(
            manager,
            py,
            run,
            ir,
            handles,
            &reservations,
            transfer_streams,
            expected_version,
        )?;
        let entered = (|| {
            let reclaim = plan.getattr(intern!(py, "reclaim"))?;
            let resolved = Resolved::new(ir.plan().reclaim(), &slots);
            run_phase(
                manager,
                py,
                run,
                "reclaim",
                reclaim.cast::<PyTuple>()?,
                Some(&resolved),
            )?;
            reserve(manager, py, run, &reservations)?;
            let enter = plan.getattr(intern!(py, "enter"))?;
            let resolved = Resolved::new(ir.plan().enter(), &slots);
            run_phase(
                manager,
                py,
                run,
                "enter",
                enter.cast::<PyTuple>()?,
                Some(&resolved),
            )
        })();
        if entered.is_err() {
            release_tokens(manager, run);
        }
        entered
    };
    within_gate_then(manager, py, operation, then, || {
        release_tokens(manager, run);
    })
}

/// Scope exit: the exit actions with the streams given at entry (no preflight), then
/// the reservations, which are released whether or not an action failed. When the
/// gate cannot be entered the run's phase stays as it was and nothing is released:
/// the glue then gives the reservations back on the deferred path.
pub fn exit_scope(
    manager: &CoreManager,
    py: Python<'_>,
    run: &PlanRun,
    actions: &Bound<'_, PyTuple>,
) -> PyResult<()> {
    within_gate(manager, py, || {
        let exited = run_phase(manager, py, run, "exit", actions, None);
        release_tokens(manager, run);
        exited
    })
}

fn within_gate(
    manager: &CoreManager,
    py: Python<'_>,
    operation: impl FnOnce() -> PyResult<()>,
) -> PyResult<()> {
    manager.enter_transition_gate(py)?;
    let result = operation();
    manager.core().end_transition_and_exit();
    result
}

/// `operation` as a transition, then, when it succeeded and `then` is given, `then()`
/// still under the same hold of the gate (the transition over, so it may call back
/// into the manager): what must act on exactly the state the operation left, with no
/// other thread's operation in between, such as borrowing what a scope entry made
/// resident or holding what a prefetch staged (docs/concepts/controller.md#use).
/// When `then` raises, `undo` runs before the gate is let go. Returns what `then`
/// returned, `None` without it.
fn within_gate_then(
    manager: &CoreManager,
    py: Python<'_>,
    operation: impl FnOnce() -> PyResult<()>,
    then: Option<&Bound<'_, PyAny>>,
    undo: impl FnOnce(),
) -> PyResult<Py<PyAny>> {
    let Some(then) = then.filter(|then| !then.is_none()) else {
        within_gate(manager, py, operation)?;
        return Ok(py.None());
    };
    manager.enter_transition_gate(py)?;
    let core = manager.core();
    if let Err(error) = operation() {
        core.end_transition_and_exit();
        return Err(error);
    }
    core.end_transition();
    let result = then.call0();
    if result.is_err() {
        undo();
    }
    core.exit();
    result.map(Bound::unbind)
}

/// What every plan entry does first, in this order: apply queued releases, check the
/// expected version, validate the transfer streams, and preflight the whole plan.
#[allow(clippy::too_many_arguments)] // the checks' inputs
fn prepare(
    manager: &CoreManager,
    py: Python<'_>,
    run: &PlanRun,
    ir: &PlanIr,
    handles: &Bound<'_, PyTuple>,
    reservations: &[Bound<'_, PyAny>],
    transfer_streams: Option<&Bound<'_, PyAny>>,
    expected_version: Option<&Bound<'_, PyAny>>,
) -> PyResult<Arc<[SlotResolution]>> {
    crate::lifetimes::reap(manager, py)?;
    check_version(manager, py, expected_version)?;
    let streams = read_streams(manager, py, transfer_streams)?;
    let slots = preflight(manager, py, ir, handles, labels(py, reservations)?)?;
    run.state().streams = streams;
    Ok(slots)
}

/// Raises `ResidencyStaleStateError` unless `expected_version` is `None` or the
/// current version.
fn check_version(
    manager: &CoreManager,
    py: Python<'_>,
    expected_version: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    if let Some(expected) = expected_version
        .filter(|expected| !expected.is_none())
        .map(|expected| version_index(py, expected))
        .transpose()?
    {
        let actual = manager.core().version();
        if expected.extract::<u64>().ok() != Some(actual) {
            let arguments = PyDict::new(py);
            arguments.set_item(intern!(py, "expected_version"), expected)?;
            arguments.set_item(intern!(py, "actual_version"), actual)?;
            let error = py
                .get_type::<ResidencyStaleStateError>()
                .call((), Some(&arguments))?;
            return Err(PyErr::from_value(error));
        }
    }
    Ok(())
}

/// The reservations' labels as the simulation's messages quote them.
fn labels(py: Python<'_>, reservations: &[Bound<'_, PyAny>]) -> PyResult<Vec<String>> {
    reservations
        .iter()
        .map(|reservation| {
            Ok(reservation
                .getattr(intern!(py, "label"))?
                .repr()?
                .to_string_lossy()
                .into_owned())
        })
        .collect()
}

/// `expected_state_version` as an index int: a bool or a non-integer is a
/// `TypeError`, a negative one a `ValueError`.
fn version_index<'py>(py: Python<'py>, value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let refused = || -> PyResult<PyErr> {
        Ok(PyTypeError::new_err(format!(
            "expected_state_version must be an int, got {}",
            value.get_type().name()?
        )))
    };
    if value.is_instance_of::<PyBool>() {
        return Err(refused()?);
    }
    let index = match py
        .import(intern!(py, "operator"))?
        .getattr(intern!(py, "index"))?
        .call1((value,))
    {
        Ok(index) => index,
        Err(err) if err.is_instance_of::<PyTypeError>(py) => return Err(refused()?),
        Err(err) => return Err(err),
    };
    if index.lt(0)? {
        return Err(PyValueError::new_err(format!(
            "expected_state_version must be >= 0, got {index}"
        )));
    }
    Ok(index)
}

/// `transfer_streams` as (destination code, stream) pairs, each checked against its
/// location (docs/concepts/plans.md#transfer-streams).
fn read_streams(
    manager: &CoreManager,
    py: Python<'_>,
    transfer_streams: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<(Location, Py<PyAny>)>> {
    let Some(transfer_streams) = transfer_streams.filter(|streams| !streams.is_none()) else {
        return Ok(Vec::new());
    };
    let Ok(mapping) = transfer_streams.cast::<PyMapping>() else {
        return Err(PyTypeError::new_err(format!(
            "transfer_streams must be a Mapping, got {}",
            transfer_streams.get_type().name()?
        )));
    };
    let context = manager.context();
    let mut streams = Vec::new();
    for item in mapping.items()?.iter() {
        let (location, stream): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
        let code = context.location_code(py, &location)?;
        // Kept as bound to the location's device: a default-stream handle would
        // otherwise name whichever device is current when the plan's copies run.
        let bound = context.check_stream(py, &stream, &location, code)?;
        streams.push((code, bound.unbind()));
    }
    Ok(streams)
}

/// The core's simulation of the whole plan against the current state; an infeasible
/// plan raises `ResidencyPlanError` with the simulation's reason. Returns each
/// handle slot's resolution.
fn preflight(
    manager: &CoreManager,
    py: Python<'_>,
    ir: &PlanIr,
    handles: &Bound<'_, PyTuple>,
    labels: Vec<String>,
) -> PyResult<Arc<[SlotResolution]>> {
    let slots = resolve(manager, py, ir, handles)?;
    let simulation = simulate(manager, py, ir, &slots, Vec::new(), labels);
    if simulation.feasible {
        Ok(slots)
    } else {
        Err(ResidencyPlanError::new_err(
            simulation
                .reason
                .unwrap_or_else(|| "the plan is infeasible".to_owned()),
        ))
    }
}

/// `explain`: the checks, then the simulation with completed pending leases no
/// longer protecting (docs/concepts/plans.md#explain). Nothing is reaped: explain
/// only observes.
pub fn explain(
    manager: &CoreManager,
    py: Python<'_>,
    ir: &PlanIr,
    handles: &Bound<'_, PyTuple>,
    plan: &Bound<'_, PyAny>,
    expected_version: Option<&Bound<'_, PyAny>>,
) -> PyResult<Simulation> {
    manager.with_gate(py, true, true, || {
        check_version(manager, py, expected_version)?;
        let reservations = plan.getattr(intern!(py, "reservations"))?;
        let reservations: Vec<Bound<'_, PyAny>> =
            reservations.try_iter()?.collect::<PyResult<_>>()?;
        let labels = labels(py, &reservations)?;
        let completed = crate::lifetimes::completed_pending(manager, py);
        let slots = resolve(manager, py, ir, handles)?;
        Ok(simulate(manager, py, ir, &slots, completed, labels))
    })
}

/// Each handle slot's index, or the error naming it, against the current state. A
/// plan keeps its last resolution, which holds until the manager discards a value.
fn resolve(
    manager: &CoreManager,
    py: Python<'_>,
    ir: &PlanIr,
    handles: &Bound<'_, PyTuple>,
) -> PyResult<Arc<[SlotResolution]>> {
    let core = manager.core();
    let discards = core.discards();
    if let Some(slots) = ir.resolution(core.manager_id(), discards) {
        return Ok(slots);
    }
    let handles: Vec<Bound<'_, PyAny>> = handles.iter().collect();
    let slots = manager
        .resolve_handles(py, &handles)?
        .into_iter()
        .zip(&handles)
        .map(|(resolution, handle)| match resolution {
            Some(index) => Ok(Ok(index)),
            None => Ok(Err(manager
                .handle_error(py, handle)?
                .value(py)
                .str()?
                .to_string_lossy()
                .into_owned())),
        })
        .collect::<PyResult<Arc<[SlotResolution]>>>()?;
    ir.remember(core.manager_id(), discards, &slots);
    Ok(slots)
}

fn simulate(
    manager: &CoreManager,
    py: Python<'_>,
    ir: &PlanIr,
    slots: &Arc<[SlotResolution]>,
    completed: Vec<u64>,
    labels: Vec<String>,
) -> Simulation {
    let cuda = match manager.context().cuda_count() {
        0 => CudaDevices::Unavailable,
        count => CudaDevices::Count(count),
    };
    let core = Arc::clone(manager.core());
    let plan = Arc::clone(ir.plan());
    let slots = Arc::clone(slots);
    // Pure computation over the core's state: other threads may wait meanwhile.
    py.detach(move || core.simulate(&plan, &slots, cuda, &completed, &labels))
}

/// The handle index of each action of a preflighted phase, by position.
///
/// The preflight resolved every handle of the plan while holding the gate, which the
/// run keeps until its last phase: nothing but the plan's own actions changes the
/// state meanwhile, and a plan whose actions would end a value before a later action
/// names it is infeasible, so each index stays the action's value.
struct Resolved(Vec<Option<HandleId>>);

impl Resolved {
    fn new(actions: &[Action], slots: &[SlotResolution]) -> Self {
        Self(
            actions
                .iter()
                .map(|action| match slots.get(action.handle().index()) {
                    Some(Ok(index)) => Some(*index),
                    _ => None,
                })
                .collect(),
        )
    }
}

/// Runs `actions` in order as transitions, each with the transfer stream of its
/// destination, recording each as it commits. `resolved` gives the handle indices
/// of a preflighted phase.
fn run_phase(
    manager: &CoreManager,
    py: Python<'_>,
    run: &PlanRun,
    phase: &'static str,
    actions: &Bound<'_, PyTuple>,
    resolved: Option<&Resolved>,
) -> PyResult<()> {
    // The phase's records and its lowering come from one tuple; should they ever
    // differ in length, every action resolves its own handle.
    let resolved = resolved.filter(|resolved| resolved.0.len() == actions.len());
    let streams = {
        let mut state = run.state();
        state.phase = Some(phase);
        state.phase_start = state.transitions.len();
        state.reservation = None;
        state
            .streams
            .iter()
            .map(|(code, stream)| (*code, stream.bind(py).clone()))
            .collect::<Vec<_>>()
    };
    for (position, action) in actions.iter().enumerate() {
        // A signal handler runs between actions, as between a loop's iterations.
        py.check_signals()?;
        let stream = if streams.is_empty() {
            None
        } else {
            stream_for(manager, py, &action, &streams)?
        };
        let index = resolved.and_then(|resolved| resolved.0[position]);
        let transition = execute::execute(manager, py, &action, stream, index)?;
        run.state().transitions.push(transition);
    }
    Ok(())
}

/// The transfer stream for an action's destination: an ensure's location or a
/// move's `to`; drops and discards take none.
fn stream_for<'a, 'py>(
    manager: &CoreManager,
    py: Python<'py>,
    action: &Bound<'py, PyAny>,
    streams: &'a [(Location, Bound<'py, PyAny>)],
) -> PyResult<Option<&'a Bound<'py, PyAny>>> {
    let context = manager.context();
    let destination = if action.is_instance(context.ensure_class(py))? {
        action.getattr(intern!(py, "location"))?
    } else if action.is_instance(context.move_class(py))? {
        action.getattr(intern!(py, "to"))?
    } else {
        return Ok(None);
    };
    let code = context.location_code(py, &destination)?;
    Ok(streams
        .iter()
        .find(|(known, _)| *known == code)
        .map(|(_, stream)| stream))
}

/// Admits the plan's reservations in order, recording each token as it is taken.
fn reserve(
    manager: &CoreManager,
    py: Python<'_>,
    run: &PlanRun,
    reservations: &[Bound<'_, PyAny>],
) -> PyResult<()> {
    {
        let mut state = run.state();
        state.phase = Some("reserve");
        state.phase_start = state.transitions.len();
    }
    let context = manager.context();
    for (position, reservation) in reservations.iter().enumerate() {
        run.state().reservation = Some(position);
        let location = reservation.getattr(intern!(py, "location"))?;
        let at = context.location_code(py, &location)?;
        let nbytes = reservation.getattr(intern!(py, "nbytes"))?;
        let label = reservation.getattr(intern!(py, "label"))?;
        let token =
            crate::lifetimes::reserve_locked(manager, py, at, &nbytes, label.cast::<PyString>()?)?;
        run.state().tokens.push(token);
    }
    run.state().reservation = None;
    Ok(())
}

/// Releases the run's reservations, newest first; the caller holds the gate.
fn release_tokens(manager: &CoreManager, run: &PlanRun) {
    for token in run.take_tokens() {
        manager.release_reservation_token(token);
    }
}
