//! `CoreManager` and `StateView`: the manager core as the Python facade sees it.
//!
//! Locations cross the boundary as codes (0 pageable, 1 pinned, 2 + CUDA index) and
//! handles as their issue index. The gate's blocking wait releases the interpreter,
//! so a thread waiting for the manager lock never holds the GIL.

// pyo3 extracts sequence arguments as owned vectors.
#![allow(clippy::needless_pass_by_value)]

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};
use residency_core::gate::DEFAULT_POLL;
use residency_core::manager::not_issued;
use residency_core::tables::Recent;

use residency_core::{
    CoreError, Freed, HandleId, HandleName, Location, Manager, Simulation, State, StorageKey,
    ValueSpec,
};

use crate::context::Context;
use crate::kinds::LifetimeKind;
use crate::objects::{Objects, share};
use crate::records::RecordBuilder;
use crate::shapes::AdoptedShapes;
use crate::transition::Transition;

use crate::errors::to_py_err;

fn codes(locations: &[Location]) -> Vec<u32> {
    locations.iter().map(|location| location.code()).collect()
}

/// One manager's core state, shared by the facade and its lifetime objects.
#[pyclass(frozen, module = "fhelium._core", name = "CoreManager")]
#[derive(Debug)]
pub struct CoreManager {
    pub(crate) core: Arc<Manager>,
    pub(crate) objects: Objects,
    /// Builds the handle records this manager issues, without running Python code.
    pub(crate) handles: Py<RecordBuilder>,
    /// One string object for the id every handle of this manager carries.
    pub(crate) manager_id: Py<PyString>,
    /// The engine's classes, builders and runtime (see `context::Context`).
    pub(crate) context: Context,
    /// The retained transition reports: the newest `trace_capacity`, oldest first.
    pub(crate) trace: Recent<Arc<Transition>>,
    pub(crate) adopted_shapes: AdoptedShapes,
    /// Set while a prefetch runs its plan: CUDA copies of `ensure` actions are
    /// enqueued without waiting for them (docs/concepts/controller.md#prefetch).
    pub(crate) asynchronous: std::sync::atomic::AtomicBool,
}

impl CoreManager {
    pub fn core(&self) -> &Arc<Manager> {
        &self.core
    }

    /// Whether CUDA copies of `ensure` actions are left in flight (a prefetch).
    pub(crate) fn asynchronous(&self) -> bool {
        self.asynchronous.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn set_asynchronous(&self, asynchronous: bool) {
        self.asynchronous
            .store(asynchronous, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn context(&self) -> &Context {
        &self.context
    }

    pub(crate) fn objects(&self) -> &Objects {
        &self.objects
    }

    /// Passes the gate and the requested guards, waiting (without the interpreter)
    /// for another thread's operation; fails fast if a source callback starts
    /// meanwhile.
    pub(crate) fn enter_core(
        &self,
        py: Python<'_>,
        check_closed: bool,
        check_reentrant: bool,
    ) -> Result<(), CoreError> {
        if self.core.try_enter(check_closed, check_reentrant)? {
            return Ok(());
        }
        let core = Arc::clone(&self.core);
        py.detach(move || core.enter(DEFAULT_POLL, check_closed, check_reentrant))
    }

    /// Releases a lifetime token at once when the gate is free and nothing is queued
    /// (a token already gone is no error); `false` sends the caller down the waiting
    /// path (nothing has changed then). A lease released is no longer tracked.
    pub(crate) fn release_now(&self, kind: LifetimeKind, token: u64) -> bool {
        let forget = |id| drop(self.objects.take(id));
        match self.core.release_now(kind.into(), token, forget) {
            Some(freed) => {
                self.free(&freed);
                true
            }
            None => false,
        }
    }

    /// Tracks lease `token` for its finalizer (the core's bookkeeping), `reference`
    /// kept at the core's id for it.
    pub(crate) fn keep_lease(&self, token: u64, reference: Py<PyAny>) {
        let id = self
            .core
            .track_lease(token, |former| drop(self.objects.take(former)));
        drop(self.objects.put(id, reference));
    }

    /// Stops tracking lease `token`; its reference goes. `false` when it was not tracked.
    pub(crate) fn forget_lease(&self, token: u64) -> bool {
        self.core
            .untrack_lease(token, |id| drop(self.objects.take(id)))
    }

    /// Releases a reservation's bytes and forgets its label; the caller holds the gate.
    pub(crate) fn release_reservation_token(&self, token: u64) -> bool {
        drop(self.objects.take_label(token));
        self.core.release_reservation(token)
    }

    /// Drops the objects the core gave back (after the store's lock).
    pub(crate) fn free(&self, freed: &Freed) {
        drop(self.objects.free(freed));
        // Let go: the ids may be given again only now.
        self.core.recycle(&freed.objects);
    }

    pub(crate) fn adopted_shapes(&self) -> &AdoptedShapes {
        &self.adopted_shapes
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

    /// The gate for a transition: at once when it is free and nothing is off (one
    /// step), else the general way, which waits without the interpreter or raises;
    /// then this thread is the transition owner.
    pub(crate) fn enter_transition_gate(&self, py: Python<'_>) -> PyResult<()> {
        if self.core.try_begin_quiet_transition() {
            return Ok(());
        }
        Self::lift(py, self.enter_core(py, true, true))?;
        self.core.begin_transition();
        Ok(())
    }

    /// Runs `operation` as a transition: the gate taken (see `enter_transition_gate`)
    /// for it, and let go after.
    pub(crate) fn in_transition<T>(
        &self,
        py: Python<'_>,
        operation: impl FnOnce() -> PyResult<T>,
    ) -> PyResult<T> {
        self.enter_transition_gate(py)?;
        let result = operation();
        self.core.end_transition_and_exit();
        result
    }

    /// The index of each live handle of this manager, else `None`: one core lookup
    /// and one object-store pass for them all.
    pub(crate) fn resolve_handles(
        &self,
        py: Python<'_>,
        handles: &[Bound<'_, PyAny>],
    ) -> PyResult<Vec<Option<HandleId>>> {
        let ids: Vec<Option<Bound<'_, PyString>>> = handles
            .iter()
            .map(|handle| {
                handle
                    .getattr(pyo3::intern!(py, "handle_id"))
                    .ok()
                    .and_then(|id| id.cast_into::<PyString>().ok())
            })
            .collect();
        let texts: Vec<Option<&str>> = ids
            .iter()
            .map(|id| id.as_ref().and_then(|id| id.to_str().ok()))
            .collect();
        let found = self.core.lookup_many(texts.iter().copied());
        let indices = found.iter().map(|entry| entry.map(|(index, _)| index));
        let issued = self.objects.handles_at(indices, share(py));
        handles
            .iter()
            .zip(found)
            .zip(issued)
            .map(|((handle, entry), issued)| {
                Ok(match (entry, issued) {
                    (Some((index, false)), Some(issued))
                        if issued.bind(py).is(handle) || issued.bind(py).eq(handle)? =>
                    {
                        Some(index)
                    }
                    _ => None,
                })
            })
            .collect()
    }

    /// Forgets the objects of the discarded value `index`: its materialisations at
    /// `removed` (a file on disk is removed), its source and the direct calls' records.
    pub(crate) fn forget_discarded(&self, py: Python<'_>, index: HandleId, removed: &[Location]) {
        let values = self.objects.discard(index, &codes(removed));
        for (location, value) in removed.iter().zip(&values) {
            if location.is_disk() {
                self.remove_file(py, value);
            }
        }
        drop(values);
        self.context.forget_direct_actions();
    }

    /// Removes the file of a materialisation on disk; a failure is reported as
    /// unraisable (the record is gone either way, and the directory goes at close).
    fn remove_file(&self, py: Python<'_>, file: &Py<PyAny>) {
        let removed = self
            .context
            .disk
            .bind(py)
            .call_method1(pyo3::intern!(py, "remove"), (file,));
        if let Err(error) = removed {
            error.write_unraisable(py, None);
        }
    }

    pub(crate) fn value_object<'py>(
        &self,
        py: Python<'py>,
        index: HandleId,
        at: Location,
    ) -> PyResult<Bound<'py, PyAny>> {
        let value = self
            .objects
            .value(index, at.code(), share(py))
            .ok_or_else(|| {
                pyo3::exceptions::PyRuntimeError::new_err(format!(
                    "internal error: value {index} has no object at location code {}",
                    at.code()
                ))
            })?;
        Ok(value.into_bound(py))
    }

    pub(crate) fn forget_value(&self, index: HandleId, at: Location) {
        let value = self.objects.take_value(index, at.code());
        if let (Location::Disk(_), Some(file)) = (at, &value) {
            // A materialisation on disk is a file: it goes with its record.
            Python::attach(|py| self.remove_file(py, file));
        }
        drop(value);
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

    /// Runs the source's `load()` for a ticket that holds its temporary charge (the
    /// core's driver marks it as a callback, and aborts the ticket if this fails).
    pub(crate) fn load_for<'py>(
        &self,
        py: Python<'py>,
        index: HandleId,
    ) -> PyResult<Bound<'py, PyAny>> {
        let Some(source) = self.objects.source(py, index) else {
            return Err(to_py_err(py, not_issued(index)));
        };
        source.bind(py).call_method0(pyo3::intern!(py, "load"))
    }

    pub(crate) fn record(&self, transition: &Arc<Transition>) {
        self.trace.keep(|| Arc::clone(transition));
    }

    pub(crate) fn issue_handle(
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
    pub(crate) fn lookup(
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
        let Some(issued) = self.objects.handle(index, share(py)) else {
            return Ok(None);
        };
        let issued = issued.bind(py);
        if issued.is(handle) || issued.eq(handle)? {
            Ok(Some((index, discarded)))
        } else {
            Ok(None)
        }
    }

    pub(crate) fn lift<T>(py: Python<'_>, result: Result<T, CoreError>) -> PyResult<T> {
        result.map_err(|err| to_py_err(py, err))
    }
}

/// An immutable published state. Rows are produced on demand, once per call.
#[pyclass(frozen, module = "fhelium._core", name = "StateView")]
#[derive(Debug)]
pub struct StateView {
    pub(crate) state: Arc<State>,
}

#[pymethods]
impl StateView {
    #[getter]
    fn version(&self) -> u64 {
        self.state.version
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
        let objects = (manager.objects).handles_and_specs(self.state.values.len(), share(py));
        crate::records::value_entries(
            py,
            self.state.values.iter().map(|record| &**record),
            &objects,
            value_records,
            materialization_records,
            location_of,
        )
    }

    /// `(code, used + reserved)` per location in registration order: the peaks the
    /// core's simulation gives a plan with no action and no reservation on this state
    /// (docs/concepts/controller.md#steps).
    fn charged_peaks(&self) -> Vec<(u32, u64)> {
        self.state
            .locations
            .iter()
            .map(|books| {
                (
                    books.location.code(),
                    books.used_bytes.saturating_add(books.reserved_bytes),
                )
            })
            .collect()
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
