//! `CoreManager` and `StateView`: the manager core as the Python facade sees it.
//!
//! Locations cross the boundary as codes (0 pageable, 1 pinned, 2 + CUDA index) and
//! handles as their issue index. The gate's blocking wait releases the interpreter,
//! so a thread waiting for the manager lock never holds the GIL.

// pyo3 extracts sequence arguments as owned vectors.
#![allow(clippy::needless_pass_by_value)]

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};
use residency_core::gate::DEFAULT_POLL;
use std::collections::HashMap;

use residency_core::{
    CoreError, CudaDevices, EnsurePlan, HandleId, HandleName, Location, Manager, MovePlan,
    Recoverability, ReplicaMode, Simulation, SlotResolution, State, StorageKey, ValueSpec,
};

use crate::direct::AdoptedShapes;
use crate::execute::Context;
use crate::kinds::{EnsureOutcome, LeaseState, LifetimeKind, MoveOutcome};
use crate::objects::Objects;
use crate::plan::PlanIr;
use crate::records::RecordBuilder;
use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use crate::errors::to_py_err;

fn location(code: u32) -> PyResult<Location> {
    Location::from_code(code).map_err(|err| PyValueError::new_err(err.to_string()))
}

fn codes(locations: &[Location]) -> Vec<u32> {
    locations.iter().map(|location| location.code()).collect()
}

fn spec(logical: u64, storage: u64, exclusive: bool, reconstructible: bool) -> PyResult<ValueSpec> {
    ValueSpec::new(
        logical,
        storage,
        if exclusive {
            ReplicaMode::Exclusive
        } else {
            ReplicaMode::Replicable
        },
        if reconstructible {
            Recoverability::Reconstructible
        } else {
            Recoverability::MustPreserve
        },
    )
    .map_err(|err| PyValueError::new_err(err.to_string()))
}

/// One manager's core state, shared by the facade and its lifetime objects.
#[pyclass(frozen, module = "fhelium._core", name = "CoreManager")]
#[derive(Debug)]
pub struct CoreManager {
    core: Arc<Manager>,
    objects: Objects,
    /// Builds the handle records this manager issues, without running Python code.
    handles: Py<RecordBuilder>,
    /// One string object for the id every handle of this manager carries.
    manager_id: Py<PyString>,
    /// What the one-call transition path needs (see `execute`); `None` disables it.
    context: Option<Context>,
    trace: Mutex<Trace>,
    adopted_shapes: AdoptedShapes,
}

/// The retained transition reports: the newest `capacity`, oldest first.
#[derive(Debug, Default)]
struct Trace {
    capacity: usize,
    reports: VecDeque<Py<PyAny>>,
}

fn unknown_index(index: HandleId) -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err(format!(
        "internal error: handle index {index} was not issued by this manager"
    ))
}

impl CoreManager {
    pub fn core(&self) -> &Arc<Manager> {
        &self.core
    }

    pub(crate) fn context(&self) -> Option<&Context> {
        self.context.as_ref()
    }

    pub(crate) fn adopted_shapes(&self) -> &AdoptedShapes {
        &self.adopted_shapes
    }

    pub(crate) fn enter_gate(
        &self,
        py: Python<'_>,
        check_closed: bool,
        check_reentrant: bool,
    ) -> PyResult<()> {
        self.enter(py, check_closed, check_reentrant)
    }

    /// Records a reconstructible value and issues its handle.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn register_checked(
        &self,
        py: Python<'_>,
        type_key: u64,
        spec: ValueSpec,
        source_location: Location,
        value_type: Py<PyAny>,
        spec_record: Py<PyAny>,
        source: Py<PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let (index, handle_id) = Self::lift(
            py,
            self.core.register_source(type_key, spec, source_location),
        )?;
        let handle = self.issue_handle(py, handle_id, value_type)?;
        self.objects
            .push(index, handle.clone_ref(py), spec_record, Some(source), None);
        Ok(handle)
    }

    /// Records a measured value as a new adopted record and issues its handle.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn adopt_measured(
        &self,
        py: Python<'_>,
        type_key: u64,
        spec: ValueSpec,
        location: Location,
        storage: u64,
        keys: &[StorageKey],
        value_type: Py<PyAny>,
        spec_record: Py<PyAny>,
        value: Py<PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let (index, handle_id) =
            Self::lift(py, self.core.adopt(type_key, spec, location, storage, keys))?;
        let handle = self.issue_handle(py, handle_id, value_type)?;
        self.objects.push(
            index,
            handle.clone_ref(py),
            spec_record,
            None,
            Some((location.code(), value)),
        );
        Ok(handle)
    }

    /// The gate for a transition: wait without the interpreter, then mark this thread
    /// as the transition owner.
    pub(crate) fn enter_transition_gate(&self, py: Python<'_>) -> PyResult<()> {
        self.enter(py, true, true)?;
        self.core.begin_transition();
        Ok(())
    }

    pub(crate) fn drain_deferred(&self, py: Python<'_>) -> PyResult<()> {
        while let Some(apply) = self.objects.pop_deferred() {
            apply.bind(py).call0()?;
        }
        Ok(())
    }

    /// The index of a live handle of this manager, else `None`.
    pub(crate) fn resolve_live(
        &self,
        py: Python<'_>,
        handle: &Bound<'_, PyAny>,
    ) -> PyResult<Option<HandleId>> {
        Ok(match self.lookup(py, handle)? {
            Some((index, false)) => Some(index),
            _ => None,
        })
    }

    pub(crate) fn drop_value(
        &self,
        py: Python<'_>,
        index: HandleId,
        at: Location,
    ) -> PyResult<bool> {
        let dropped = Self::lift(py, self.core.drop_materialization(index, at))?;
        if dropped {
            drop(self.objects.take_value(index, at.code()));
        }
        Ok(dropped)
    }

    pub(crate) fn discard_value(&self, py: Python<'_>, index: HandleId) -> PyResult<()> {
        let removed = Self::lift(py, self.core.discard(index))?;
        drop(self.objects.discard(index, &codes(&removed)));
        Ok(())
    }

    pub(crate) fn value_object<'py>(
        &self,
        py: Python<'py>,
        index: HandleId,
        at: Location,
    ) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.value(py, index, at.code())?.into_bound(py))
    }

    pub(crate) fn forget_value(&self, index: HandleId, at: Location) {
        drop(self.objects.take_value(index, at.code()));
    }

    pub(crate) fn keep_value(
        &self,
        py: Python<'_>,
        index: HandleId,
        at: Location,
        value: &Bound<'_, PyAny>,
    ) {
        let _ = py;
        drop(
            self.objects
                .set_value(index, at.code(), value.clone().unbind()),
        );
    }

    pub(crate) fn spec_object(&self, py: Python<'_>, index: HandleId) -> PyResult<Py<PyAny>> {
        self.spec(py, index)
    }

    pub(crate) fn handle_object(&self, py: Python<'_>, index: HandleId) -> PyResult<Py<PyAny>> {
        self.handle(py, index)
    }

    /// Runs the source's `load()` after the core took the temporary charge.
    pub(crate) fn load_for<'py>(
        &self,
        py: Python<'py>,
        index: HandleId,
        source_location: Location,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some(loaded) = self.load_charged(py, index, source_location)? {
            Ok(loaded)
        } else {
            Self::lift(py, self.core.release_temporary(index, source_location))?;
            Err(unknown_index(index))
        }
    }

    pub(crate) fn record(&self, py: Python<'_>, report: &Py<PyAny>) {
        let evicted = {
            let mut trace = self.trace.lock().unwrap_or_else(PoisonError::into_inner);
            if trace.capacity == 0 {
                return;
            }
            trace.reports.push_back(report.clone_ref(py));
            if trace.reports.len() > trace.capacity {
                trace.reports.pop_front()
            } else {
                None
            }
        };
        drop(evicted);
    }

    fn issue_handle(
        &self,
        py: Python<'_>,
        handle_id: HandleName,
        value_type: Py<PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let mut buffer = [0u8; 36];
        let text = handle_id.encode(&mut buffer);
        let text = PyString::new(py, text).into_any();
        let value_type = value_type.into_bound(py);
        let manager_id = self.manager_id.bind(py).as_any();
        Ok(self
            .handles
            .get()
            .build(py, &[manager_id, &text, &value_type])?
            .unbind())
    }

    /// `(index, discarded)` when `handle` is (or equals) a handle this manager issued.
    fn lookup(
        &self,
        py: Python<'_>,
        handle: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(HandleId, bool)>> {
        let Ok(handle_id) = handle.getattr(pyo3::intern!(py, "handle_id")) else {
            return Ok(None);
        };
        let Ok(handle_id) = handle_id.cast::<pyo3::types::PyString>() else {
            return Ok(None);
        };
        let Some((index, discarded)) = self.core.lookup(handle_id.to_str()?) else {
            return Ok(None);
        };
        let Some(issued) = self.objects.handle(py, index) else {
            return Ok(None);
        };
        let issued = issued.bind(py);
        if issued.is(handle) || issued.eq(handle)? {
            Ok(Some((index, discarded)))
        } else {
            Ok(None)
        }
    }

    fn lift<T>(py: Python<'_>, result: Result<T, CoreError>) -> PyResult<T> {
        result.map_err(|err| to_py_err(py, err))
    }

    /// Runs a reconstruction's `load()` right after the plan took its temporary
    /// charge. Without a source object the glue loads itself (the charge stays).
    /// A raising load returns the charge before its exception propagates.
    fn load_charged<'py>(
        &self,
        py: Python<'py>,
        handle: HandleId,
        source_location: Location,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(source) = self.objects.source(py, handle) else {
            return Ok(None);
        };
        self.core.set_callback_active(true);
        let loaded = source.bind(py).call_method0(pyo3::intern!(py, "load"));
        self.core.set_callback_active(false);
        match loaded {
            Ok(value) => Ok(Some(value)),
            Err(err) => {
                Self::lift(py, self.core.release_temporary(handle, source_location))?;
                Err(err)
            }
        }
    }
}

#[pymethods]
impl CoreManager {
    #[new]
    #[pyo3(signature = (budgets, handle_records, context=None, trace_capacity=0))]
    fn new(
        py: Python<'_>,
        budgets: Vec<(u32, u64)>,
        handle_records: &Bound<'_, PyAny>,
        context: Option<&Bound<'_, PyTuple>>,
        trace_capacity: usize,
    ) -> PyResult<Self> {
        let budgets = budgets
            .into_iter()
            .map(|(code, budget)| Ok((location(code)?, budget)))
            .collect::<PyResult<Vec<_>>>()?;
        let core = Arc::new(Manager::new(&budgets));
        let manager_id = PyString::new(py, core.manager_id()).unbind();
        Ok(Self {
            core,
            manager_id,
            objects: Objects::default(),
            handles: {
                let builder = handle_records.cast::<RecordBuilder>()?;
                builder.get().expect_fields(3)?;
                builder.clone().unbind()
            },
            context: context.map(Context::from_tuple).transpose()?,
            trace: Mutex::new(Trace {
                capacity: trace_capacity,
                reports: VecDeque::new(),
            }),
            adopted_shapes: AdoptedShapes::default(),
        })
    }

    /// Adopts a host value in one call; `None` when the general path is needed (a
    /// value that is not a `TensorResident` or a mode that is not a `ReplicaMode`
    /// among the cases).
    fn adopt_host(
        &self,
        py: Python<'_>,
        value: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
        replica_mode: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Py<PyAny>>> {
        crate::direct::adopt(self, py, value, at, replica_mode)
    }

    /// Borrows normalised `handles` at a host location in one call; `None` when the
    /// general path is needed.
    fn acquire_host(
        &self,
        py: Python<'_>,
        engine: &Bound<'_, PyAny>,
        handles: &Bound<'_, PyTuple>,
        at: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Py<PyAny>>> {
        crate::direct::acquire(self, py, engine, handles, at)
    }

    // ----- one-call transitions ------------------------------------------------------

    /// Runs a host action end to end, taking the gate; `None` when the action needs
    /// the general path (nothing has changed then).
    fn run_host(&self, py: Python<'_>, action: &Bound<'_, PyAny>) -> PyResult<Option<Py<PyAny>>> {
        crate::execute::run_host(self, py, action)
    }

    /// `run_host` for a caller that already holds the gate (a plan phase).
    fn execute_host(
        &self,
        py: Python<'_>,
        action: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Py<PyAny>>> {
        crate::execute::execute_host(self, py, action)
    }

    // ----- the trace and deferred releases ----------------------------------------------

    /// Appends a report the glue built to the trace.
    #[pyo3(name = "record")]
    fn record_report(&self, py: Python<'_>, report: Py<PyAny>) {
        self.record(py, &report);
    }

    fn trace_reports(&self, py: Python<'_>) -> Vec<Py<PyAny>> {
        let trace = self.trace.lock().unwrap_or_else(PoisonError::into_inner);
        trace
            .reports
            .iter()
            .map(|report| report.clone_ref(py))
            .collect()
    }

    fn clear_trace(&self) {
        let released = {
            let mut trace = self.trace.lock().unwrap_or_else(PoisonError::into_inner);
            std::mem::take(&mut trace.reports)
        };
        drop(released);
    }

    /// Queues a release that arrived while a source callback ran on another thread.
    fn defer(&self, apply: Py<PyAny>) {
        self.objects.defer(apply);
    }

    fn deferred_pending(&self) -> bool {
        self.objects.deferred_pending()
    }

    /// Applies the queued releases, oldest first; the caller holds the gate.
    #[pyo3(name = "drain_deferred")]
    fn drain_deferred_py(&self, py: Python<'_>) -> PyResult<()> {
        self.drain_deferred(py)
    }

    fn clear_deferred(&self) {
        drop(self.objects.clear_deferred());
    }

    #[getter]
    fn manager_id(&self, py: Python<'_>) -> Py<PyString> {
        self.manager_id.clone_ref(py)
    }

    // ----- the gate -------------------------------------------------------------

    /// Passes the gate and the requested guards; waits (without the GIL) for another
    /// thread's operation, failing fast if a source callback starts meanwhile.
    fn enter(&self, py: Python<'_>, check_closed: bool, check_reentrant: bool) -> PyResult<()> {
        let entered = Self::lift(py, self.core.try_enter(check_closed, check_reentrant))?;
        if entered {
            return Ok(());
        }
        let core = Arc::clone(&self.core);
        let result = py.detach(move || core.enter(DEFAULT_POLL, check_closed, check_reentrant));
        Self::lift(py, result)
    }

    fn exit(&self) {
        self.core.exit();
    }

    /// `enter(closed, reentrant)` and mark this thread as the transition owner.
    fn enter_transition(&self, py: Python<'_>) -> PyResult<()> {
        self.enter(py, true, true)?;
        self.core.begin_transition();
        Ok(())
    }

    fn exit_transition(&self) {
        self.core.end_transition();
        self.core.exit();
    }

    /// Fails when this thread is executing a transition on this manager.
    fn check_reentrant(&self, py: Python<'_>) -> PyResult<()> {
        Self::lift(py, self.core.gate().check_reentrant())
    }

    // ----- observations -------------------------------------------------------

    #[getter]
    fn version(&self) -> u64 {
        self.core.version()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.core.is_closed()
    }

    fn locations(&self) -> Vec<u32> {
        codes(&self.core.locations())
    }

    /// The lock-free snapshot, or `None` when pending leases must be reaped first.
    fn try_published(&self, py: Python<'_>) -> PyResult<Option<StateView>> {
        let state = Self::lift(py, self.core.try_published_snapshot())?;
        Ok(state.map(|state| StateView { state }))
    }

    /// The working state, inside the gate.
    fn current(&self) -> StateView {
        StateView {
            state: self.core.current(),
        }
    }

    fn materialization_locations(&self, py: Python<'_>, handle: HandleId) -> PyResult<Vec<u32>> {
        Ok(codes(&Self::lift(
            py,
            self.core.materialization_locations(handle),
        )?))
    }

    // ----- registration ---------------------------------------------------------

    /// Adopts a measured value installed at `at` and returns its new handle.
    #[allow(clippy::too_many_arguments)]
    fn adopt(
        &self,
        py: Python<'_>,
        type_key: u64,
        logical: u64,
        charge: u64,
        exclusive: bool,
        at: u32,
        storage: u64,
        keys: Vec<StorageKey>,
        value_type: Py<PyAny>,
        spec_record: Py<PyAny>,
        value: Py<PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let spec = spec(logical, charge, exclusive, false)?;
        let (index, handle_id) = Self::lift(
            py,
            self.core
                .adopt(type_key, spec, location(at)?, storage, &keys),
        )?;
        let handle = self.issue_handle(py, handle_id, value_type)?;
        self.objects.push(
            index,
            handle.clone_ref(py),
            spec_record,
            None,
            Some((at, value)),
        );
        Ok(handle)
    }

    /// Registers a reconstructible value and returns its new handle.
    #[allow(clippy::too_many_arguments)]
    fn register_source(
        &self,
        py: Python<'_>,
        type_key: u64,
        logical: u64,
        storage: u64,
        exclusive: bool,
        source_location: u32,
        value_type: Py<PyAny>,
        spec_record: Py<PyAny>,
        source: Py<PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let spec = spec(logical, storage, exclusive, true)?;
        self.register_checked(
            py,
            type_key,
            spec,
            location(source_location)?,
            value_type,
            spec_record,
            source,
        )
    }

    /// Registers a host-sourced value from its spec record in one call; `None` when
    /// the general path is needed.
    fn register_host(
        &self,
        py: Python<'_>,
        spec_record: &Bound<'_, PyAny>,
        source: &Bound<'_, PyAny>,
        source_location: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Py<PyAny>>> {
        crate::direct::register(self, py, spec_record, source, source_location)
    }

    // ----- handles and objects -----------------------------------------------------

    /// The index of a live handle this manager issued (the very object, or one equal
    /// to it); `None` for anything else, which the glue turns into a precise error.
    fn resolve(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> PyResult<Option<HandleId>> {
        let Some((index, discarded)) = self.lookup(py, handle)? else {
            return Ok(None);
        };
        Ok((!discarded).then_some(index))
    }

    /// `resolve` for each handle, with -1 where it gives `None`.
    fn resolve_many(&self, py: Python<'_>, handles: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<i64>> {
        // The ids first, then one core lookup and one object-store pass for them all.
        let ids: Vec<Option<Bound<'_, pyo3::types::PyString>>> = handles
            .iter()
            .map(|handle| {
                handle
                    .getattr(pyo3::intern!(py, "handle_id"))
                    .ok()
                    .and_then(|id| id.cast_into::<pyo3::types::PyString>().ok())
            })
            .collect();
        let texts: Vec<Option<&str>> = ids
            .iter()
            .map(|id| id.as_ref().and_then(|id| id.to_str().ok()))
            .collect();
        let found = self.core.lookup_many(texts.iter().copied());
        let issued = self
            .objects
            .handles_at(py, found.iter().map(|entry| entry.map(|(index, _)| index)));
        handles
            .iter()
            .zip(found)
            .zip(issued)
            .map(|((handle, entry), issued)| {
                Ok(match (entry, issued) {
                    (Some((index, false)), Some(issued))
                        if issued.bind(py).is(handle) || issued.bind(py).eq(handle)? =>
                    {
                        i64::from(index)
                    }
                    _ => -1,
                })
            })
            .collect()
    }

    /// Whether `handle` names a value of this manager that was discarded.
    fn is_discarded(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self
            .lookup(py, handle)?
            .is_some_and(|(_, discarded)| discarded))
    }

    fn handle(&self, py: Python<'_>, index: HandleId) -> PyResult<Py<PyAny>> {
        self.objects
            .handle(py, index)
            .ok_or_else(|| unknown_index(index))
    }

    fn spec(&self, py: Python<'_>, index: HandleId) -> PyResult<Py<PyAny>> {
        self.objects
            .spec(py, index)
            .ok_or_else(|| unknown_index(index))
    }

    fn source(&self, py: Python<'_>, index: HandleId) -> Option<Py<PyAny>> {
        self.objects.source(py, index)
    }

    /// The object of the materialisation at `at`.
    fn value(&self, py: Python<'_>, index: HandleId, at: u32) -> PyResult<Py<PyAny>> {
        self.objects.value(py, index, at).ok_or_else(|| {
            pyo3::exceptions::PyRuntimeError::new_err(format!(
                "internal error: value {index} has no object at location code {at}"
            ))
        })
    }

    /// The label a reservation was made with, exactly as given.
    fn label(&self, py: Python<'_>, token: u64) -> Option<Py<PyAny>> {
        self.objects.label(py, token)
    }

    // ----- transitions ------------------------------------------------------------

    /// What an ensure needs, with the location it names (-1 for none) and, for a
    /// reconstruction, the loaded value.
    fn plan_ensure<'py>(
        &self,
        py: Python<'py>,
        handle: HandleId,
        at: u32,
    ) -> PyResult<(EnsureOutcome, i64, Option<Bound<'py, PyAny>>)> {
        let plan = Self::lift(py, self.core.plan_ensure(handle, location(at)?))?;
        let outcome = EnsureOutcome::from(&plan);
        Ok(match plan {
            EnsurePlan::NoOp => (outcome, -1, None),
            EnsurePlan::Copy { source } => (outcome, i64::from(source.code()), None),
            EnsurePlan::Reconstruct { source_location } => (
                outcome,
                i64::from(source_location.code()),
                self.load_charged(py, handle, source_location)?,
            ),
        })
    }

    /// What a move needs, with the source it names (-1 for none) and, for a
    /// reconstruction, the loaded value. A removed source is already committed.
    #[pyo3(signature = (handle, to, from_location=None))]
    fn plan_move<'py>(
        &self,
        py: Python<'py>,
        handle: HandleId,
        to: u32,
        from_location: Option<u32>,
    ) -> PyResult<(MoveOutcome, i64, Option<Bound<'py, PyAny>>)> {
        let from = from_location.map(location).transpose()?;
        let code = |location: Location| i64::from(location.code());
        let plan = Self::lift(py, self.core.plan_move(handle, location(to)?, from))?;
        let outcome = MoveOutcome::from(&plan);
        Ok(match plan {
            MovePlan::NoOp { source } => (outcome, source.map_or(-1, code), None),
            MovePlan::RemovedSource { source } => {
                drop(self.objects.take_value(handle, source.code()));
                (outcome, code(source), None)
            }
            MovePlan::Copy { source } => (outcome, code(source), None),
            MovePlan::Reconstruct { source_location } => (
                outcome,
                code(source_location),
                self.load_charged(py, handle, source_location)?,
            ),
        })
    }

    fn admit(&self, py: Python<'_>, handle: HandleId, at: u32) -> PyResult<()> {
        Self::lift(py, self.core.admit(handle, location(at)?))
    }

    /// Installs a value loaded at its source location there, returning the
    /// temporary charge just before the install (load and install share it).
    #[allow(clippy::too_many_arguments)]
    fn install_loaded(
        &self,
        py: Python<'_>,
        handle: HandleId,
        at: u32,
        logical: u64,
        storage: u64,
        keys: Vec<StorageKey>,
        exclusive_transition: bool,
        value: Py<PyAny>,
    ) -> PyResult<()> {
        let code = at;
        let at = location(at)?;
        Self::lift(py, self.core.release_temporary(handle, at))?;
        Self::lift(
            py,
            self.core
                .install(handle, at, logical, storage, &keys, exclusive_transition),
        )?;
        drop(self.objects.set_value(handle, code, value));
        Ok(())
    }

    fn release_temporary(&self, py: Python<'_>, handle: HandleId, at: u32) -> PyResult<()> {
        Self::lift(py, self.core.release_temporary(handle, location(at)?))
    }

    fn check_materialization(
        &self,
        py: Python<'_>,
        handle: HandleId,
        logical: u64,
        storage: u64,
    ) -> PyResult<()> {
        Self::lift(
            py,
            self.core.check_materialization(handle, logical, storage),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn install(
        &self,
        py: Python<'_>,
        handle: HandleId,
        at: u32,
        logical: u64,
        storage: u64,
        keys: Vec<StorageKey>,
        exclusive_transition: bool,
        value: Py<PyAny>,
    ) -> PyResult<()> {
        Self::lift(
            py,
            self.core.install(
                handle,
                location(at)?,
                logical,
                storage,
                &keys,
                exclusive_transition,
            ),
        )?;
        drop(self.objects.set_value(handle, at, value));
        Ok(())
    }

    fn remove(&self, py: Python<'_>, handle: HandleId, at: u32) -> PyResult<()> {
        Self::lift(py, self.core.remove(handle, location(at)?))?;
        drop(self.objects.take_value(handle, at));
        Ok(())
    }

    /// Drops one materialisation and its object; `False` is the no-op.
    fn drop_materialization(&self, py: Python<'_>, handle: HandleId, at: u32) -> PyResult<bool> {
        let dropped = Self::lift(py, self.core.drop_materialization(handle, location(at)?))?;
        if dropped {
            drop(self.objects.take_value(handle, at));
        }
        Ok(dropped)
    }

    /// Ends a value: its materialisations and source object go with it.
    fn discard(&self, py: Python<'_>, handle: HandleId) -> PyResult<()> {
        self.discard_value(py, handle)
    }

    // ----- protections and lifetimes ----------------------------------------------

    fn check_resident(&self, py: Python<'_>, handles: Vec<HandleId>, at: u32) -> PyResult<()> {
        Self::lift(py, self.core.check_resident(&handles, location(at)?))
    }

    fn acquire(&self, py: Python<'_>, handles: Vec<HandleId>, at: u32) -> PyResult<u64> {
        Self::lift(py, self.core.acquire(&handles, location(at)?))
    }

    fn hold(&self, py: Python<'_>, handles: Vec<HandleId>, at: u32) -> PyResult<u64> {
        Self::lift(py, self.core.hold(&handles, location(at)?))
    }

    fn lease_state(&self, token: u64) -> LeaseState {
        LeaseState::from(self.core.lease_state(token))
    }

    #[getter]
    fn callback_active(&self) -> bool {
        self.core.gate().callback_active()
    }

    fn callback_running_elsewhere(&self) -> bool {
        self.core.gate().callback_running_elsewhere()
    }

    fn lease_covers(&self, token: u64, handle: HandleId) -> bool {
        self.core.lease_covers(token, handle)
    }

    fn release_lease(&self, token: u64) -> bool {
        self.core.release_lease(token)
    }

    fn lease_to_pending(&self, token: u64) -> bool {
        self.core.lease_to_pending(token)
    }

    fn release_pending(&self, token: u64) -> bool {
        self.core.release_pending(token)
    }

    /// Releases a lifetime token in one call if the gate is free: `None` when another
    /// thread holds it (take the waiting path).
    fn release_now(
        &self,
        py: Python<'_>,
        kind: LifetimeKind,
        token: u64,
    ) -> PyResult<Option<bool>> {
        // Queued releases go first, in order: the waiting path applies them.
        if self.objects.deferred_pending() || !Self::lift(py, self.core.try_enter(false, true))? {
            return Ok(None);
        }
        let released = match kind {
            LifetimeKind::Lease => self.core.release_lease(token),
            LifetimeKind::Hold => self.core.release_hold(token),
            LifetimeKind::Reservation => self.release_reservation(token),
        };
        self.core.exit();
        Ok(Some(released))
    }

    /// Releases a host lease at once when the gate is free and nothing is queued;
    /// `False` sends the caller down the waiting path (nothing has changed then).
    fn release_host_lease_now(&self, token: u64) -> bool {
        if self.objects.deferred_pending() || !matches!(self.core.try_enter(false, true), Ok(true))
        {
            return false;
        }
        self.core.release_lease(token);
        self.core.exit();
        true
    }

    fn release_hold(&self, token: u64) -> bool {
        self.core.release_hold(token)
    }

    /// Admits a reservation; `text` is the label's UTF-8 form the core keeps, and
    /// `label` the object itself, reported back exactly as given.
    fn reserve(
        &self,
        py: Python<'_>,
        at: u32,
        nbytes: u64,
        text: &str,
        label: Py<PyAny>,
    ) -> PyResult<u64> {
        let token = Self::lift(py, self.core.reserve(location(at)?, nbytes, text))?;
        self.objects.set_label(token, label);
        Ok(token)
    }

    fn release_reservation(&self, token: u64) -> bool {
        drop(self.objects.take_label(token));
        self.core.release_reservation(token)
    }

    /// Simulates a lowered plan (preflight and `explain`). `resolutions[slot]` is the
    /// handle index or -1, with the handle error's message in `errors[slot]`;
    /// `cuda_count` is -1 without CUDA.
    #[allow(clippy::too_many_arguments)]
    fn simulate(
        &self,
        py: Python<'_>,
        plan: &PlanIr,
        resolutions: Vec<i64>,
        errors: HashMap<usize, String>,
        cuda_count: i64,
        completed_leases: Vec<u64>,
        labels: Vec<String>,
    ) -> SimulationView {
        let slots: Vec<SlotResolution> = resolutions
            .iter()
            .enumerate()
            .map(|(slot, &index)| match HandleId::try_from(index) {
                Ok(handle) => Ok(handle),
                Err(_) => Err(errors
                    .get(&slot)
                    .cloned()
                    .unwrap_or_else(|| "unknown handle".to_owned())),
            })
            .collect();
        let cuda = u32::try_from(cuda_count).map_or(CudaDevices::Unavailable, CudaDevices::Count);
        let core = Arc::clone(&self.core);
        let plan = Arc::clone(plan.plan());
        // Pure computation over the core's state: other threads may run meanwhile.
        let simulation =
            py.detach(move || core.simulate(&plan, &slots, cuda, &completed_leases, &labels));
        SimulationView { simulation }
    }

    fn close(&self, py: Python<'_>, force: bool) -> PyResult<()> {
        Self::lift(py, self.core.close(force))?;
        drop(self.objects.clear());
        drop(self.objects.clear_deferred());
        Ok(())
    }
}

/// An immutable published state. Rows are produced on demand, once per call.
#[pyclass(frozen, module = "fhelium._core", name = "StateView")]
#[derive(Debug)]
pub struct StateView {
    state: Arc<State>,
}

#[pymethods]
impl StateView {
    #[getter]
    fn version(&self) -> u64 {
        self.state.version
    }

    #[getter]
    fn closed(&self) -> bool {
        self.state.closed
    }

    #[getter]
    fn value_count(&self) -> usize {
        self.state.values.len()
    }

    /// Every value entry in issue order, built by `value_records` with
    /// materialisations built by `materialization_records`; handle and spec objects
    /// come from `manager`, location records from `location_of(code)`.
    fn value_entries<'py>(
        &self,
        py: Python<'py>,
        manager: &CoreManager,
        value_records: &RecordBuilder,
        materialization_records: &RecordBuilder,
        location_of: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        // Handle and spec objects are only ever appended: the view's prefix of them
        // is the one it describes.
        let objects = manager
            .objects
            .handles_and_specs(py, self.state.values.len());
        crate::records::value_entries(
            py,
            self.state.values.iter().map(|record| &**record),
            &objects,
            value_records,
            materialization_records,
            location_of,
        )
    }

    /// Per location in registration order: `(code, budget | None, used, reserved,
    /// peak_used, peak_charged, value_count, reservation_count, use, hold, pending)`.
    #[allow(clippy::type_complexity)]
    fn location_rows(
        &self,
    ) -> Vec<(
        u32,
        Option<u64>,
        u64,
        u64,
        u64,
        u64,
        u64,
        u64,
        u64,
        u64,
        u64,
    )> {
        self.state
            .locations
            .iter()
            .map(|books| {
                (
                    books.location.code(),
                    books.budget_bytes,
                    books.used_bytes,
                    books.reserved_bytes,
                    books.peak_used_bytes,
                    books.peak_charged_bytes,
                    books.value_count,
                    books.reservation_count,
                    books.use_count,
                    books.hold_count,
                    books.pending_count,
                )
            })
            .collect()
    }

    /// Active reservations in creation order: `(token, code, nbytes, label)`.
    fn reservation_rows(&self) -> Vec<(u64, u32, u64, String)> {
        self.state
            .reservations
            .iter()
            .map(|(&token, reservation)| {
                (
                    token,
                    reservation.location.code(),
                    reservation.nbytes,
                    reservation.label.to_string(),
                )
            })
            .collect()
    }
}

/// The result of one simulation. Per-action rows are produced only when asked for,
/// so an `explain` whose caller reads only `feasible` builds no per-action objects.
#[pyclass(frozen, module = "fhelium._core", name = "SimulationView")]
#[derive(Debug)]
pub struct SimulationView {
    simulation: Simulation,
}

impl SimulationView {
    pub fn new(simulation: Simulation) -> Self {
        Self { simulation }
    }
}

#[pymethods]
impl SimulationView {
    #[getter]
    fn feasible(&self) -> bool {
        self.simulation.feasible
    }

    #[getter]
    fn reason(&self) -> Option<&str> {
        self.simulation.reason.as_deref()
    }

    /// `(code, peak_bytes)` per simulated location, in the documented order
    /// (docs/concepts/plans.md#simulation-results).
    fn peaks(&self) -> Vec<(u32, u64)> {
        self.simulation
            .peaks
            .iter()
            .map(|(location, peak)| (location.code(), *peak))
            .collect()
    }

    /// The action records, `actions` (the plan's, in execution order) paired with
    /// the simulated outcomes up to the first failure; location records come from
    /// `location_of(code)`.
    fn action_entries<'py>(
        &self,
        py: Python<'py>,
        actions: &Bound<'py, PyTuple>,
        action_records: &RecordBuilder,
        location_of: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        crate::records::action_entries(
            py,
            &self.simulation.actions,
            actions,
            action_records,
            location_of,
        )
    }
}
