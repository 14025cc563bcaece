//! Plans end to end: `execute_actions`, scope entry and scope exit, each one call
//! that takes the transition gate and hands the run to the core's plan runner
//! (`residency_core::PlanRun`), which checks the expected state version, preflights
//! the plan through the core's simulation and runs its phases in order, with the
//! reservations' rollback (docs/concepts/plans.md). This module is the runner's
//! device side: it reaps, reads the caller's records and transfer streams, performs
//! each action as a transition (see `execute`) and admits each reservation.
//!
//! Execution is not transactional. A `PlanRun` records how far a run got: the
//! transitions committed so far (kept as plain data; their report records are built
//! only when read), the phase in progress, and the reservation tokens a scope holds.
//! When a call fails the glue reads the run to wrap the error with the committed
//! prefix and the failed action or reservation.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList, PyMapping, PyString, PyTuple};
use residency_core::{
    Action, CoreError, CudaDevices, HandleId, Inputs, Location, PlanPhase, Reservation, RunError,
    Simulation, SlotResolution,
};

use crate::errors::{stale_state, to_py_err};
use crate::execute;
use crate::manager::CoreManager;
use crate::plan::PlanIr;
use crate::records::RecordBuilder;
use crate::search::{DecidePolicy, Decided, LoweredRequest, decide_held};
use crate::transition::{Transition, reports};

/// The core's run of one plan, with what committed as transition records.
type CoreRun = residency_core::PlanRun<Arc<Transition>>;

/// How far one plan run got; see the module documentation.
#[pyclass(frozen, module = "fhelium._core", name = "PlanRun")]
#[derive(Debug)]
pub struct PlanRun {
    reports: Py<RecordBuilder>,
    state: Mutex<RunState>,
}

#[derive(Debug, Default)]
struct RunState {
    run: CoreRun,
    /// The validated transfer streams by destination, kept for a scope's exit.
    streams: Vec<(Location, Py<PyAny>)>,
}

impl PlanRun {
    fn state(&self) -> MutexGuard<'_, RunState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `operation` on the core's run, taken out of the lock meanwhile: the
    /// lock is never held across Python code.
    fn with_run<T>(&self, operation: impl FnOnce(&mut CoreRun) -> T) -> T {
        let mut run = std::mem::take(&mut self.state().run);
        let result = operation(&mut run);
        self.state().run = run;
        result
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
        self.state().run.done().len()
    }

    /// The phase in progress when the run stopped ("execute", "reclaim", "reserve",
    /// "enter" or "exit"), or `None` if it failed before its first phase.
    #[getter]
    fn phase(&self) -> Option<&'static str> {
        self.state().run.phase().map(PlanPhase::as_str)
    }

    /// The position, within its phase, of the action or reservation in progress.
    #[getter]
    fn position(&self) -> usize {
        self.state().run.position()
    }

    /// The committed transitions' report records, in order (built once each).
    fn reports<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let transitions = self.state().run.done().to_vec();
        reports(py, self.reports.get(), &transitions)
    }

    /// Takes the reservation tokens the run still holds, newest first.
    fn take_tokens(&self) -> Vec<u64> {
        self.state().run.take_tokens()
    }
}

/// `execute_actions`: the core's run of the plan as the one phase "execute".
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
    hold: Option<(&Bound<'_, PyTuple>, &Bound<'_, PyList>)>,
    then: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let operation = || {
        let mut device = RunSide::executing(manager, py, ir, handles, actions, transfer_streams);
        device.expected_version = expected_version;
        manager.set_asynchronous(asynchronous);
        let result = run.with_run(|core| core.execute(manager.core(), ir.plan(), &mut device));
        manager.set_asynchronous(false);
        device.keep_streams(run);
        result.map_err(|error| device.raised(error))
    };
    let Some(hold) = hold else {
        return within_gate_then(manager, py, operation, then, || {});
    };
    manager.enter_transition_gate(py)?;
    manager.core().transition_then(operation, |()| {
        hold_then(manager, py, hold, then, None).map(|()| py.None())
    })?
}

/// What follows a staging's plan under its hold of the gate: what the plan made
/// resident is held (each `(handles, location)` pair of `groups`) before any other
/// thread can evict it, then `then` runs, still finding the state the plan left. The
/// tokens are appended to `held` as they are taken, so the caller has them even if an
/// interrupt arrives as the call returns; on a failure they are released and taken
/// out again.
fn hold_then(
    manager: &CoreManager,
    py: Python<'_>,
    (groups, held): (&Bound<'_, PyTuple>, &Bound<'_, PyList>),
    then: Option<&Bound<'_, PyAny>>,
    indexed: Option<&[(Location, Vec<HandleId>)]>,
) -> PyResult<()> {
    let kept = held.len();
    let holds = match indexed {
        // The same groups by handle index (a staging's request, lowered): held without
        // resolving its handle objects; a refusal is raised as the handles' path
        // raises it, by taking that path.
        Some(indexed) => match manager
            .core()
            .hold_indices(indexed, |token| held.append(token))
        {
            Ok(true) => Ok(()),
            Ok(false) => release_held(manager, held, kept)
                .and_then(|()| crate::lifetimes::hold_locked(manager, py, groups, held)),
            Err(error) => Err(error),
        },
        None => crate::lifetimes::hold_locked(manager, py, groups, held),
    };
    let result = holds.and_then(|()| match then.filter(|then| !then.is_none()) {
        Some(then) => then.call0().map(drop),
        None => Ok(()),
    });
    if let Err(error) = result {
        release_held(manager, held, kept)?;
        return Err(error);
    }
    Ok(())
}

/// What a pipeline's staging runs again when it decides what its last staging of the
/// same request ran (docs/concepts/controller.md#staging): that decision, and the plan
/// it ran: its lowering, handles and action records.
pub struct Rerun<'a, 'py> {
    pub previous: &'a Decided,
    pub ir: &'a PlanIr,
    pub handles: &'a Bound<'py, PyTuple>,
    pub actions: &'a Bound<'py, PyTuple>,
}

/// A pipeline staging's decide and plan in one hold of the gate
/// (docs/concepts/controller.md#staging): `request` decided as `decide_request`
/// decides it, then, when the decision runs as `rerun.previous` ran (the same actions,
/// evicting nothing unless `reclaim`), that plan at once, asynchronously, at the very
/// state it was decided on (nothing is reaped in between, so no version can have
/// moved), followed by `hold` and `then` as `execute_plan` takes them. Returns the
/// decision (`None` when a value was discarded since the request was lowered) and
/// whether its plan ran.
#[allow(clippy::too_many_arguments)] // the call's arguments, as the glue passes them
pub fn stage_request(
    manager: &CoreManager,
    py: Python<'_>,
    (request, limit, cuda_count, policy): (&LoweredRequest, u64, i64, DecidePolicy<'_>),
    rerun: &Rerun<'_, '_>,
    run: &PlanRun,
    transfer_streams: Option<&Bound<'_, PyAny>>,
    hold: (&Bound<'_, PyTuple>, &Bound<'_, PyList>),
    then: Option<&Bound<'_, PyAny>>,
    reclaim: bool,
    blocking: Option<bool>,
) -> PyResult<Option<(Option<Decided>, bool)>> {
    manager.enter_transition_gate(py)?;
    let core = manager.core();
    // The request's hold groups by handle index: the lowering is current under this
    // hold of the gate (the decide refuses it otherwise, before anything runs).
    let groups = core.is_current(request, None).then(|| request.groups());
    // What the call returns: set where the staging stops short of its plan (the
    // operation's `Err` is then `Ok(())`, or else the error to raise) or once it ran.
    let mut outcome = None;
    let staged = core.transition_then(
        || {
            if let Some(disk_deferred) = blocking {
                // Before anything is decided: whether its copies would block the host.
                let blocks = match &groups {
                    Some(groups) => {
                        let host = crate::lifetimes::Host::new(manager, py);
                        core.blocks_host_indices(&host, groups, disk_deferred)
                    }
                    None => {
                        crate::lifetimes::blocks_host_locked(manager, py, hold.0, disk_deferred)
                    }
                };
                match blocks {
                    Ok(false) => {}
                    other => return Err(other.map(drop)),
                }
            }
            let decided = match decide_held(manager, py, request, limit, cuda_count, policy) {
                Ok(Some(decided)) if decided.runs_as(rerun.previous, reclaim) => decided,
                other => return Err(other.map(|decided| outcome = Some((decided, false)))),
            };
            let mut device = RunSide::executing(
                manager,
                py,
                rerun.ir,
                rerun.handles,
                rerun.actions,
                transfer_streams,
            );
            // The decide reaped under this hold of the gate: nothing to reap, no version
            // to compare; and it simulated this very plan (the same actions on the same
            // slots as the plan `rerun` lowered), which the preflight would simulate again.
            device.reaped = true;
            device.simulated = decided.preflighted(rerun.ir.plan(), cuda_devices(manager));
            manager.set_asynchronous(true);
            let result = run.with_run(|state| state.execute(core, rerun.ir.plan(), &mut device));
            manager.set_asynchronous(false);
            result.map_err(|error| Err(device.raised(error)))?;
            outcome = Some((Some(decided), true));
            Ok(())
        },
        |()| hold_then(manager, py, hold, then, groups.as_deref()),
    );
    staged.unwrap_or_else(|stopped| stopped)?;
    Ok(outcome)
}

/// Releases the hold tokens `held` gained past its first `kept` items, and takes them
/// out of it. The caller holds the gate.
fn release_held(manager: &CoreManager, held: &Bound<'_, PyList>, kept: usize) -> PyResult<()> {
    for token in held.iter().skip(kept) {
        manager.core().release_hold(token.extract()?);
    }
    held.del_slice(kept, held.len())
}

/// Scope entry: the core's run of the plan's checks, preflight, reclaim, reserve and
/// enter; on a failure it releases the reservations already admitted.
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
        let reservations = reservation_records(plan)?;
        let records = vec![
            (
                PlanPhase::Reclaim,
                phase_records(plan, intern!(py, "reclaim"))?,
            ),
            (PlanPhase::Enter, phase_records(plan, intern!(py, "enter"))?),
        ];
        let mut device = RunSide::new(manager, py, records);
        device.inputs = Some((ir, handles, transfer_streams, reservations));
        device.expected_version = expected_version;
        let result = run.with_run(|core| core.enter(manager.core(), ir.plan(), &mut device));
        device.keep_streams(run);
        result.map_err(|error| device.raised(error))
    };
    within_gate_then(manager, py, operation, then, || {
        for token in run.take_tokens() {
            manager.release_reservation_token(token);
        }
    })
}

/// Scope exit: the core's run of the exit actions with the streams given at entry
/// (no preflight), then the reservations, which it releases whether or not an action
/// failed. When the gate cannot be entered the run's phase stays as it was and
/// nothing is released: the glue then gives the reservations back on the deferred
/// path.
pub fn exit_scope(
    manager: &CoreManager,
    py: Python<'_>,
    run: &PlanRun,
    actions: &Bound<'_, PyTuple>,
) -> PyResult<()> {
    manager.in_transition(py, || {
        let mut device = RunSide::new(manager, py, vec![(PlanPhase::Exit, actions.clone())]);
        device.streams = run
            .state()
            .streams
            .iter()
            .map(|(code, stream)| (*code, stream.bind(py).clone()))
            .collect();
        let result = run.with_run(|core| core.exit(&mut device));
        result.map_err(|error| device.raised(error))
    })
}

/// A plan's reservation records, in order.
fn reservation_records<'py>(plan: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    plan.getattr(intern!(plan.py(), "reservations"))?
        .try_iter()?
        .collect()
}

fn phase_records<'py>(
    plan: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
) -> PyResult<Bound<'py, PyTuple>> {
    Ok(plan.getattr(name)?.cast_into::<PyTuple>()?)
}

/// The plan runner's device side for one call (see the module documentation).
struct RunSide<'a, 'py> {
    manager: &'a CoreManager,
    py: Python<'py>,
    /// The action records of each phase the call runs, by position: the tuples the
    /// plan's lowering was made from.
    records: Vec<(PlanPhase, Bound<'py, PyTuple>)>,
    /// What a preflight reads: the plan's lowering and handles, the transfer streams
    /// given, and the reservation records.
    #[allow(clippy::type_complexity)]
    inputs: Option<(
        &'a PlanIr,
        &'a Bound<'py, PyTuple>,
        Option<&'a Bound<'py, PyAny>>,
        Vec<Bound<'py, PyAny>>,
    )>,
    expected_version: Option<&'a Bound<'py, PyAny>>,
    /// The expected version as an index int, once checked for shape.
    expected: Option<Bound<'py, PyAny>>,
    /// The validated transfer streams by destination.
    streams: Vec<(Location, Bound<'py, PyAny>)>,
    /// Whether the caller reaped under this hold of the gate already (a staging that
    /// decided there): the run does not reap again.
    reaped: bool,
    /// The slots of a plan the caller simulated already under this hold of the gate
    /// (a staging whose decide found this very plan): no second preflight simulation.
    simulated: Option<std::sync::Arc<[SlotResolution]>>,
}

impl<'a, 'py> RunSide<'a, 'py> {
    fn new(
        manager: &'a CoreManager,
        py: Python<'py>,
        records: Vec<(PlanPhase, Bound<'py, PyTuple>)>,
    ) -> Self {
        Self {
            manager,
            py,
            records,
            inputs: None,
            expected_version: None,
            expected: None,
            streams: Vec::new(),
            reaped: false,
            simulated: None,
        }
    }

    /// The device side of `execute_actions`' run (one phase, "execute").
    fn executing(
        manager: &'a CoreManager,
        py: Python<'py>,
        ir: &'a PlanIr,
        handles: &'a Bound<'py, PyTuple>,
        actions: &Bound<'py, PyTuple>,
        transfer_streams: Option<&'a Bound<'py, PyAny>>,
    ) -> Self {
        let mut device = Self::new(manager, py, vec![(PlanPhase::Execute, actions.clone())]);
        device.inputs = Some((ir, handles, transfer_streams, Vec::new()));
        device
    }

    /// Keeps the validated streams on the run, for a scope's exit.
    fn keep_streams(&self, run: &PlanRun) {
        if !self.streams.is_empty() {
            run.state().streams = self
                .streams
                .iter()
                .map(|(code, stream)| (*code, stream.clone().unbind()))
                .collect();
        }
    }

    /// The error a stopped run raises: a stale version names the expected version
    /// as the caller gave it.
    fn raised(&self, error: RunError<PyErr>) -> PyErr {
        match error {
            RunError::Device(error) => error,
            RunError::Core(error) => stale_or(self.py, self.expected.as_ref(), error),
        }
    }

    fn internal(what: &str) -> PyErr {
        PyRuntimeError::new_err(format!("internal error: a plan run without {what}"))
    }
}

impl residency_core::Device for RunSide<'_, '_> {
    type Done = Arc<Transition>;
    type Error = PyErr;

    fn perform(
        &mut self,
        phase: PlanPhase,
        position: usize,
        action: &Action,
        index: Option<HandleId>,
    ) -> PyResult<Arc<Transition>> {
        // A signal handler runs between actions, as between a loop's iterations.
        self.py.check_signals()?;
        let Some((_, records)) = self.records.iter().find(|(known, _)| *known == phase) else {
            return Err(Self::internal("its action records"));
        };
        let record = records.get_item(position)?;
        let stream = action.destination().and_then(|code| {
            self.streams
                .iter()
                .find(|(known, _)| *known == code)
                .map(|(_, stream)| stream)
        });
        execute::execute(self.manager, self.py, &record, stream, index)
    }
}

impl residency_core::PlanDevice for RunSide<'_, '_> {
    fn reap(&mut self) -> PyResult<()> {
        if self.reaped {
            return Ok(());
        }
        crate::lifetimes::reap(self.manager, self.py)
    }

    fn expected_version(&mut self) -> PyResult<Option<u64>> {
        let Some((index, version)) = expected_index(self.py, self.expected_version)? else {
            return Ok(None);
        };
        self.expected = Some(index);
        Ok(Some(version))
    }

    fn inputs(&mut self) -> PyResult<Inputs> {
        let (manager, py) = (self.manager, self.py);
        let Some((ir, handles, transfer_streams, reservations)) = &self.inputs else {
            return Err(Self::internal("its inputs"));
        };
        self.streams = read_streams(manager, py, *transfer_streams)?;
        let labels = labels(py, reservations)?;
        // The staging's decide simulated this very plan (see `stage_request`).
        let simulated = self.simulated.take();
        Ok(Inputs {
            simulated: simulated.is_some(),
            slots: match simulated {
                Some(slots) => slots,
                None => resolve(manager, py, ir, handles)?,
            },
            cuda: cuda_devices(manager),
            labels,
        })
    }

    fn detached<R: Send>(&mut self, work: impl FnOnce() -> R + Send) -> R {
        // Pure computation over the core's state: other threads may wait meanwhile.
        self.py.detach(work)
    }

    fn reserve(&mut self, position: usize, _reservation: &Reservation) -> PyResult<u64> {
        let py = self.py;
        let reservation = self
            .inputs
            .as_ref()
            .and_then(|(.., reservations)| reservations.get(position))
            .ok_or_else(|| Self::internal("its reservation records"))?;
        let location = reservation.getattr(intern!(py, "location"))?;
        let at = self.manager.context().location_code(py, &location)?;
        let nbytes = reservation.getattr(intern!(py, "nbytes"))?;
        let label = reservation.getattr(intern!(py, "label"))?;
        crate::lifetimes::reserve_locked(self.manager, py, at, &nbytes, label.cast::<PyString>()?)
    }

    fn release(&mut self, token: u64) {
        self.manager.release_reservation_token(token);
    }
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
        manager.in_transition(py, operation)?;
        return Ok(py.None());
    };
    manager.enter_transition_gate(py)?;
    manager.core().transition_then(operation, |()| {
        let result = then.call0();
        if result.is_err() {
            undo();
        }
        result.map(Bound::unbind)
    })?
}

/// `expected_state_version` as an index int and as the version the core compares:
/// `None` when not given. A version past 2**64 - 1 is never reached (one step per
/// change), so such an expectation compares as stale.
fn expected_index<'py>(
    py: Python<'py>,
    expected_version: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<(Bound<'py, PyAny>, u64)>> {
    let Some(expected) = expected_version.filter(|expected| !expected.is_none()) else {
        return Ok(None);
    };
    let index = version_index(py, expected)?;
    let version = index.extract::<u64>().unwrap_or(u64::MAX);
    Ok(Some((index, version)))
}

/// `error` as Python sees it; a stale version names `expected` as the caller gave it.
fn stale_or(py: Python<'_>, expected: Option<&Bound<'_, PyAny>>, error: CoreError) -> PyErr {
    match (&error, expected) {
        (CoreError::StaleState { actual_version, .. }, Some(expected)) => {
            stale_state(py, expected, *actual_version)
        }
        _ => to_py_err(py, error),
    }
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
fn read_streams<'py>(
    manager: &CoreManager,
    py: Python<'py>,
    transfer_streams: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<(Location, Bound<'py, PyAny>)>> {
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
        let (location, stream): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item.extract()?;
        let code = context.location_code(py, &location)?;
        // Kept as bound to the location's device: a default-stream handle would
        // otherwise name whichever device is current when the plan's copies run.
        let bound = context.check_stream(py, &stream, &location, code)?;
        streams.push((code, bound));
    }
    Ok(streams)
}

fn cuda_devices(manager: &CoreManager) -> CudaDevices {
    CudaDevices::from_count(manager.context().cuda_count())
}

/// `explain`: the version check, then the simulation with completed pending leases
/// no longer protecting (docs/concepts/plans.md#explain). Nothing is reaped: explain
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
        if let Some((index, version)) = expected_index(py, expected_version)? {
            manager
                .core()
                .check_version(version)
                .map_err(|error| stale_or(py, Some(&index), error))?;
        }
        let labels = labels(py, &reservation_records(plan)?)?;
        let completed = crate::lifetimes::completed_pending(manager, py);
        let slots = resolve(manager, py, ir, handles)?;
        let cuda = cuda_devices(manager);
        let core = Arc::clone(manager.core());
        let plan = Arc::clone(ir.plan());
        // Pure computation over the core's state: other threads may wait meanwhile.
        Ok(py.detach(move || core.simulate(&plan, &slots, cuda, &completed, &labels)))
    })
}

/// Each handle slot's index, or the error naming it, against the current state; the
/// plan's last resolution while it holds (see `residency_core::Resolutions`).
fn resolve(
    manager: &CoreManager,
    py: Python<'_>,
    ir: &PlanIr,
    handles: &Bound<'_, PyTuple>,
) -> PyResult<Arc<[SlotResolution]>> {
    let core = manager.core();
    ir.resolutions()
        .get(core.manager_id(), core.discards(), || {
            let handles: Vec<Bound<'_, PyAny>> = handles.iter().collect();
            manager
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
                .collect()
        })
}
