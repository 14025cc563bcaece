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

use residency_core::{
    CoreError, Freed, HandleId, HandleName, Location, Manager, ObjectId, Simulation, State,
    StorageKey, ValueSpec,
};

use crate::direct::AdoptedShapes;
use crate::execute::{Context, Transition};
use crate::kinds::LifetimeKind;
use crate::objects::Objects;
use crate::plan::PlanIr;
use crate::plans::PlanRun;
use crate::records::RecordBuilder;
use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use crate::errors::to_py_err;

fn codes(locations: &[Location]) -> Vec<u32> {
    locations.iter().map(|location| location.code()).collect()
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
    /// The engine's classes, builders and runtime (see `execute::Context`).
    context: Context,
    trace: Mutex<Trace>,
    adopted_shapes: AdoptedShapes,
    /// Set while a prefetch runs its plan: CUDA copies of `ensure` actions are
    /// enqueued without waiting for them (docs/concepts/controller.md#prefetch).
    asynchronous: std::sync::atomic::AtomicBool,
}

/// The retained transition reports: the newest `capacity`, oldest first.
#[derive(Debug, Default)]
struct Trace {
    capacity: usize,
    reports: VecDeque<Arc<Transition>>,
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

    /// Runs `operation` holding the gate.
    pub(crate) fn with_gate<T>(
        &self,
        py: Python<'_>,
        check_closed: bool,
        check_reentrant: bool,
        operation: impl FnOnce() -> PyResult<T>,
    ) -> PyResult<T> {
        Self::lift(py, self.enter_core(py, check_closed, check_reentrant))?;
        let result = operation();
        self.core.exit();
        result
    }

    /// The precise error for a handle that does not resolve: another manager's, a
    /// discarded value's, or one this manager never issued.
    pub(crate) fn handle_error(
        &self,
        py: Python<'_>,
        handle: &Bound<'_, PyAny>,
    ) -> PyResult<PyErr> {
        let manager_id = handle.getattr(pyo3::intern!(py, "manager_id"))?;
        let handle_id = handle.getattr(pyo3::intern!(py, "handle_id"))?;
        let own = self.manager_id.bind(py);
        let message = if manager_id.ne(own)? {
            format!(
                "handle {} belongs to manager {}, not {}",
                handle_id.repr()?,
                manager_id.repr()?,
                own.repr()?
            )
        } else if self
            .lookup(py, handle)?
            .is_some_and(|(_, discarded)| discarded)
        {
            format!("Value {} is discarded", handle_id.repr()?)
        } else {
            format!(
                "unknown handle {} (value type {}) for manager {}",
                handle_id.repr()?,
                handle
                    .getattr(pyo3::intern!(py, "value_type"))?
                    .getattr(pyo3::intern!(py, "__name__"))?,
                own.repr()?
            )
        };
        Ok(to_py_err(py, CoreError::Handle { message }))
    }

    /// Releases a lifetime token at once when the gate is free and nothing is queued
    /// (a token already gone is no error); `false` sends the caller down the waiting
    /// path (nothing has changed then).
    pub(crate) fn release_now(&self, kind: LifetimeKind, token: u64) -> bool {
        match self.core.try_release_now(kind.into(), token) {
            Some(freed) => {
                self.free(&freed);
                true
            }
            None => false,
        }
    }

    /// Releases a reservation's bytes and forgets its label; the caller holds the gate.
    pub(crate) fn release_reservation_token(&self, token: u64) -> bool {
        drop(self.objects.take_label(token));
        self.core.release_reservation(token)
    }

    /// Drops the objects the core gave back (after the store's lock).
    pub(crate) fn free(&self, freed: &Freed) {
        drop(self.objects.free(freed));
    }

    /// Keeps `object` (an event, or what a copy in flight reads) at a new core id.
    pub(crate) fn store_object(&self, object: Py<PyAny>) -> ObjectId {
        let id = self.core.new_object();
        drop(self.objects.put(id, object));
        id
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

    /// Applies the releases queued while a source callback ran, oldest first; the
    /// caller holds the gate.
    pub(crate) fn drain_deferred(&self) {
        // Under the queue's lock, never the lock-free hint: after a callback this is
        // what applies a release queued while it ran.
        let mut freed = Freed::default();
        self.core.drain_releases(&mut freed);
        self.free(&freed);
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
                        Some(index)
                    }
                    _ => None,
                })
            })
            .collect()
    }

    pub(crate) fn drop_value(
        &self,
        py: Python<'_>,
        index: HandleId,
        at: Location,
    ) -> PyResult<bool> {
        let dropped = Self::lift(py, self.core.drop_materialization(index, at))?;
        if dropped {
            self.forget_value(index, at);
        }
        Ok(dropped)
    }

    pub(crate) fn discard_value(&self, py: Python<'_>, index: HandleId) -> PyResult<()> {
        let removed = Self::lift(py, self.core.discard(index))?;
        let values = self.objects.discard(index, &codes(&removed));
        for (location, value) in removed.iter().zip(&values) {
            if location.is_disk() {
                self.remove_file(py, value);
            }
        }
        drop(values);
        self.context.forget_direct_actions();
        Ok(())
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
        let value = self.objects.value(py, index, at.code()).ok_or_else(|| {
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

    pub(crate) fn spec_object(&self, py: Python<'_>, index: HandleId) -> PyResult<Py<PyAny>> {
        self.spec(py, index)
    }

    pub(crate) fn handle_object(&self, py: Python<'_>, index: HandleId) -> PyResult<Py<PyAny>> {
        self.handle(py, index)
    }

    /// Runs the source's `load()` for a ticket that holds its temporary charge (the
    /// caller aborts the ticket if this fails); no other gated call may run meanwhile.
    pub(crate) fn load_for<'py>(
        &self,
        py: Python<'py>,
        index: HandleId,
    ) -> PyResult<Bound<'py, PyAny>> {
        let Some(source) = self.objects.source(py, index) else {
            return Err(unknown_index(index));
        };
        self.core.set_callback_active(true);
        let loaded = source.bind(py).call_method0(pyo3::intern!(py, "load"));
        self.core.set_callback_active(false);
        loaded
    }

    pub(crate) fn record(&self, transition: &Arc<Transition>) {
        let evicted = {
            let mut trace = self.trace.lock().unwrap_or_else(PoisonError::into_inner);
            if trace.capacity == 0 {
                return;
            }
            trace.reports.push_back(Arc::clone(transition));
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
}

#[pymethods]
impl CoreManager {
    #[new]
    #[pyo3(signature = (budgets, budget_bytes, handle_records, context, trace_capacity=0))]
    fn new(
        py: Python<'_>,
        budgets: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
        budget_bytes: &Bound<'_, PyAny>,
        handle_records: &Bound<'_, PyAny>,
        context: &Bound<'_, PyTuple>,
        trace_capacity: usize,
    ) -> PyResult<Self> {
        let context = Context::from_tuple(context)?;
        // Per entry, the location first, then its byte count (`budget_bytes` checks it).
        let budgets = budgets
            .iter()
            .map(|(location, budget)| {
                let code = context.location_code(py, location)?;
                Ok((code, budget_bytes.call1((budget, location))?.extract()?))
            })
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
            context,
            trace: Mutex::new(Trace {
                capacity: trace_capacity,
                reports: VecDeque::new(),
            }),
            adopted_shapes: AdoptedShapes::default(),
            asynchronous: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// `adopt` in one call (see `direct`).
    fn adopt(
        &self,
        py: Python<'_>,
        value: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
        replica_mode: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        crate::direct::adopt(self, py, value, at, replica_mode)
    }

    // ----- one-call operations ------------------------------------------------------

    /// Runs one action as a transition, taking the gate (docs/concepts/transitions.md).
    #[pyo3(signature = (action, stream=None))]
    fn run(
        &self,
        py: Python<'_>,
        action: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        crate::execute::run(self, py, action, stream)
    }

    /// `ensure` with a handle and location of the exact record classes, the action
    /// record built here (see `execute::run_direct`).
    #[pyo3(signature = (handle, at, stream=None))]
    fn ensure(
        &self,
        py: Python<'_>,
        handle: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        crate::execute::run_direct(
            self,
            py,
            residency_core::ActionKind::Ensure,
            &[handle, at],
            stream,
        )
    }

    /// `move`, as `ensure` is above.
    #[pyo3(signature = (handle, to, from_location, stream=None))]
    fn move_to(
        &self,
        py: Python<'_>,
        handle: &Bound<'_, PyAny>,
        to: &Bound<'_, PyAny>,
        from_location: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        crate::execute::run_direct(
            self,
            py,
            residency_core::ActionKind::Move,
            &[handle, to, from_location],
            stream,
        )
    }

    /// `drop`, as `ensure` is above.
    fn drop(
        &self,
        py: Python<'_>,
        handle: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        crate::execute::run_direct(
            self,
            py,
            residency_core::ActionKind::Drop,
            &[handle, at],
            None,
        )
    }

    /// Borrows normalised `handles` at `at`; CUDA needs the consumer stream.
    #[pyo3(signature = (engine, handles, at, consumer_stream=None))]
    fn acquire(
        &self,
        py: Python<'_>,
        engine: &Bound<'_, PyAny>,
        handles: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
        consumer_stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        crate::lifetimes::acquire(self, py, engine, handles, at, consumer_stream)
    }

    /// Protects the ready materialisations of normalised `handles` at `at`.
    fn hold(
        &self,
        py: Python<'_>,
        engine: &Bound<'_, PyAny>,
        handles: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        crate::lifetimes::hold(self, py, engine, handles, at)
    }

    /// Charges `nbytes` (a non-negative int) of headroom at `location`; `label` is a
    /// checked non-empty string.
    fn reserve(
        &self,
        py: Python<'_>,
        engine: &Bound<'_, PyAny>,
        location: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        label: &Bound<'_, PyString>,
    ) -> PyResult<Py<PyAny>> {
        crate::lifetimes::reserve(self, py, engine, location, nbytes, label)
    }

    /// Releases a hold, a reservation or a host lease, waiting for the gate or
    /// queueing behind a running source callback as needed.
    #[pyo3(signature = (kind, token, finalizing=false))]
    fn release(
        &self,
        py: Python<'_>,
        kind: LifetimeKind,
        token: u64,
        finalizing: bool,
    ) -> PyResult<()> {
        crate::lifetimes::release(self, py, kind, token, finalizing)
    }

    /// Releases a lease at `location`; a CUDA lease records events on `streams`.
    /// `stacklevel` places the warnings a fallback raises.
    #[pyo3(signature = (token, location, streams, *, wait, finalizing=false, stacklevel=2))]
    #[allow(clippy::too_many_arguments)]
    fn release_lease(
        &self,
        py: Python<'_>,
        token: u64,
        location: &Bound<'_, PyAny>,
        streams: &Bound<'_, pyo3::types::PyList>,
        wait: bool,
        finalizing: bool,
        stacklevel: i32,
    ) -> PyResult<()> {
        crate::lifetimes::release_lease(
            self, py, token, location, streams, wait, finalizing, stacklevel,
        )
    }

    /// Releases a host lease at once when the gate is free and nothing is queued;
    /// `False` sends the caller down the waiting path (nothing has changed then).
    fn release_host_lease_now(&self, token: u64) -> bool {
        let released = self.release_now(LifetimeKind::Lease, token);
        if released {
            drop(self.objects.untrack_lease(token));
        }
        released
    }

    /// Tracks a lease object built by the glue itself, until it is released; its
    /// finalizer releases `token` at `location` on `streams` through `engine`.
    fn track_lease(
        &self,
        py: Python<'_>,
        token: u64,
        lease: &Bound<'_, PyAny>,
        engine: &Bound<'_, PyAny>,
        location: &Bound<'_, PyAny>,
        streams: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        crate::lifetimes::track_lease(self, py, engine, token, location, streams, lease)
    }

    /// Stops tracking a lease (finalized by its own object, at exit).
    fn untrack_lease(&self, token: u64) {
        drop(self.objects.untrack_lease(token));
    }

    /// The lease objects not yet released that are still alive, oldest first.
    fn live_leases(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        crate::lifetimes::live_leases(self, py)
    }

    /// The managed object a lease borrows, while the lease still covers it.
    fn borrowed(
        &self,
        py: Python<'_>,
        token: u64,
        handle: &Bound<'_, PyAny>,
        location: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        crate::lifetimes::borrowed(self, py, token, handle, location)
    }

    /// Closes the manager (docs/concepts/lifetimes.md#close).
    #[pyo3(signature = (*, wait, force))]
    fn close(&self, py: Python<'_>, wait: bool, force: bool) -> PyResult<()> {
        crate::lifetimes::close(self, py, wait, force)
    }

    /// Checks a location record, returning its code.
    fn location_code(&self, py: Python<'_>, location: &Bound<'_, PyAny>) -> PyResult<u32> {
        Ok(self.context.location_code(py, location)?.code())
    }

    /// Checks a stream for `location`, returning the stream the manager keeps for it
    /// there (see `DeviceRuntime.bind_stream`).
    fn check_stream<'py>(
        &self,
        py: Python<'py>,
        stream: &Bound<'py, PyAny>,
        location: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let at = self.context.location_code(py, location)?;
        self.context.check_stream(py, stream, location, at)
    }

    /// A schedule's steps (lists of handles) as live handle indices of this manager,
    /// one pass or, `cyclic`, repeating forever; handles that do not resolve are left
    /// out (see `search::ScheduleIndex`).
    #[pyo3(signature = (steps, cyclic=false))]
    #[allow(clippy::needless_pass_by_value)] // pyo3 extracts owned vectors.
    fn schedule_index(
        &self,
        py: Python<'_>,
        steps: Vec<Vec<Bound<'_, PyAny>>>,
        cyclic: bool,
    ) -> PyResult<crate::search::ScheduleIndex> {
        let discards = self.core.discards();
        let mut resolved = Vec::with_capacity(steps.len());
        for step in &steps {
            let mut indices = Vec::with_capacity(step.len());
            for handle in step {
                if let Some(index) = self.resolve_live(py, handle)? {
                    indices.push(index as usize);
                }
            }
            resolved.push(indices);
        }
        Ok(crate::search::ScheduleIndex::new(
            &resolved, discards, cyclic,
        ))
    }

    /// How many values this manager has discarded (a schedule index's validity).
    fn discard_count(&self) -> u64 {
        self.core.discards()
    }

    /// The precise error for a handle that does not resolve.
    #[pyo3(name = "handle_error")]
    fn handle_error_py(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> PyResult<PyErr> {
        self.handle_error(py, handle)
    }

    /// `execute_actions` in one call: gate, checks, preflight and the "execute"
    /// phase (see `plans`).
    /// With `asynchronous`, the CUDA copies of `ensure` actions are enqueued and left
    /// in flight, each protected by its event (a prefetch).
    /// `then`, when given, is called after the phase under the same hold of the gate
    /// (see `plans`); its result is returned.
    #[pyo3(signature = (run, ir, handles, actions, transfer_streams, expected_version, *, asynchronous=false, then=None))]
    #[allow(clippy::too_many_arguments)] // the call's arguments, as the glue passes them
    fn execute_plan(
        &self,
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
        crate::plans::execute_plan(
            self,
            py,
            run,
            ir,
            handles,
            actions,
            transfer_streams,
            expected_version,
            asynchronous,
            then,
        )
    }

    /// Makes `stream`, a consumer stream joining a lease of `handles` at `at`, wait
    /// for the transfers still in flight into them.
    fn wait_transfers(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
        stream: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        crate::lifetimes::wait_transfers(self, py, handles, at, stream)
    }

    /// Host-waits for the pending leases `tokens` (and, with `transfers`, every
    /// transfer in flight) and releases them.
    #[pyo3(signature = (tokens, *, transfers=false))]
    #[allow(clippy::needless_pass_by_value)] // pyo3 extracts owned vectors.
    fn settle(&self, py: Python<'_>, tokens: Vec<u64>, transfers: bool) -> PyResult<()> {
        crate::lifetimes::settle(self, py, &tokens, transfers)
    }

    /// Releases the pending leases among `tokens` with device-side waits of their
    /// values' owning streams; what needs a host wait is waited for with `host`, else
    /// left pending and returned (docs/concepts/controller.md#evicting-around-reads-in-flight).
    #[pyo3(signature = (tokens, *, host))]
    #[allow(clippy::needless_pass_by_value)] // pyo3 extracts owned vectors.
    fn settle_on_device(&self, py: Python<'_>, tokens: Vec<u64>, host: bool) -> PyResult<Vec<u64>> {
        crate::lifetimes::settle_on_device(self, py, &tokens, host)
    }

    /// Whether bringing `handles` to `at` would block the host on a copy (from disk or
    /// pageable memory, or to the host). With `disk_deferred`, a read from disk to a
    /// device does not: the disk tier reads it on its I/O thread.
    #[pyo3(signature = (handles, at, *, disk_deferred = false))]
    fn blocks_host(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
        disk_deferred: bool,
    ) -> PyResult<bool> {
        crate::lifetimes::blocks_host(self, py, handles, at, disk_deferred)
    }

    /// The pending tokens of the transfers still in flight into `handles` at `at`.
    fn transfers_into(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u64>> {
        crate::lifetimes::transfers_into(self, py, handles, at)
    }

    /// The tokens among `tokens` of leases still pending on their events, after
    /// reaping the leases whose events completed.
    #[allow(clippy::needless_pass_by_value)] // pyo3 extracts owned vectors.
    fn pending_among(&self, py: Python<'_>, tokens: Vec<u64>) -> PyResult<Vec<u64>> {
        self.with_gate(py, true, true, || {
            crate::lifetimes::reap(self, py)?;
            Ok(tokens
                .into_iter()
                .filter(|&token| {
                    self.core.lease_state(token) == residency_core::LeaseState::Pending
                })
                .collect())
        })
    }

    /// True when this thread cannot pass the gate now: it is inside a transition of
    /// this manager (a source callback runs only there). What a finaliser releases
    /// then is queued (docs/concepts/lifetimes.md#deferred-releases).
    fn blocked_here(&self) -> bool {
        self.core.gate().check_reentrant().is_err()
    }

    /// How many asynchronous transfers are still in flight (not yet reaped).
    fn transfer_count(&self) -> usize {
        self.core.transfer_count()
    }

    /// Scope entry in one call: gate, checks, preflight, reclaim, reserve, enter; then
    /// `then`, when given, under the same hold of the gate (a use borrows there), its
    /// result returned. When `then` raises, the scope's reservations are released.
    #[pyo3(signature = (run, ir, handles, plan, transfer_streams, expected_version, *, then=None))]
    #[allow(clippy::too_many_arguments)] // the call's arguments, as the glue passes them
    fn enter_scope(
        &self,
        py: Python<'_>,
        run: &PlanRun,
        ir: &PlanIr,
        handles: &Bound<'_, PyTuple>,
        plan: &Bound<'_, PyAny>,
        transfer_streams: Option<&Bound<'_, PyAny>>,
        expected_version: Option<&Bound<'_, PyAny>>,
        then: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        crate::plans::enter_scope(
            self,
            py,
            run,
            ir,
            handles,
            plan,
            transfer_streams,
            expected_version,
            then,
        )
    }

    /// `explain` in one call: gate, version check, handle resolution, simulation.
    #[pyo3(signature = (ir, handles, plan, expected_version))]
    fn explain_plan(
        &self,
        py: Python<'_>,
        ir: &PlanIr,
        handles: &Bound<'_, PyTuple>,
        plan: &Bound<'_, PyAny>,
        expected_version: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<SimulationView> {
        crate::plans::explain(self, py, ir, handles, plan, expected_version)
            .map(SimulationView::new)
    }

    /// The controller's decide for one lowered request, in one call under one hold of
    /// the gate: the built-in policy's configuration (`native`, with the schedule-aware
    /// policy's index and position in `schedule`) or a Python policy's `(order,
    /// fallbacks)` callables. `None` when a value was discarded since the request was
    /// lowered (see `search::decide_request`).
    #[pyo3(signature = (request, limit, cuda_count, *, native=None, python=None, schedule=None))]
    #[allow(clippy::too_many_arguments)] // the call's arguments, as the glue passes them
    fn decide_request<'py>(
        &self,
        py: Python<'py>,
        request: crate::search::LoweredRequest,
        limit: u64,
        cuda_count: i64,
        native: Option<crate::search::NativeConfig>,
        python: Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>,
        schedule: Option<(PyRef<'py, crate::search::ScheduleIndex>, usize)>,
    ) -> PyResult<Option<crate::search::Decision>> {
        let policy = crate::search::DecidePolicy::new(native, python, schedule)?;
        crate::search::decide_request(self, py, request, limit, cuda_count, policy)
    }

    /// `operation()` under one hold of the gate, after queued releases and completed
    /// CUDA leases are reaped: what must read the state and act on it with no other
    /// thread's operation in between (a staged step's entry reads the state its
    /// decision describes and takes its leases; docs/concepts/controller.md#steps).
    /// Returns what `operation` returned.
    fn locked(&self, py: Python<'_>, operation: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        self.with_gate(py, true, true, || {
            crate::lifetimes::reap(self, py)?;
            Ok(operation.call0()?.unbind())
        })
    }

    /// Scope exit in one call: the exit actions, then the scope's reservations.
    fn exit_scope(
        &self,
        py: Python<'_>,
        run: &PlanRun,
        actions: &Bound<'_, PyTuple>,
    ) -> PyResult<()> {
        crate::plans::exit_scope(self, py, run, actions)
    }

    // ----- the trace and deferred releases ----------------------------------------------

    /// The retained transition reports, oldest first.
    fn trace_reports<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let transitions: Vec<Arc<Transition>> = self.with_gate(py, false, false, || {
            let trace = self.trace.lock().unwrap_or_else(PoisonError::into_inner);
            Ok(trace.reports.iter().cloned().collect())
        })?;
        // Built outside the gate: building allocates, and a collection it triggers may
        // run finalizers that release leases.
        crate::execute::reports(py, self.context().report_builder(py), &transitions)
    }

    /// Empties the trace; state and version are unchanged.
    fn clear_trace(&self, py: Python<'_>) -> PyResult<()> {
        self.with_gate(py, false, false, || {
            let released = {
                let mut trace = self.trace.lock().unwrap_or_else(PoisonError::into_inner);
                std::mem::take(&mut trace.reports)
            };
            drop(released);
            Ok(())
        })
    }

    #[getter]
    fn manager_id(&self, py: Python<'_>) -> Py<PyString> {
        self.manager_id.clone_ref(py)
    }

    // ----- observations -------------------------------------------------------

    /// Raises `ResidencyClosedError` on a closed manager, after any running
    /// operation has finished.
    fn check_open(&self, py: Python<'_>) -> PyResult<()> {
        self.with_gate(py, true, false, || Ok(()))
    }

    /// Raises `ResidencyForkedError` in a process forked from the manager's owner,
    /// touching no lock (for the Python paths that take a lock of their own first).
    fn check_process(&self, py: Python<'_>) -> PyResult<()> {
        Self::lift(py, self.core.check_process())
    }

    /// The id of the process that made the manager.
    #[getter]
    fn owner_pid(&self) -> u32 {
        self.core.owner_pid()
    }

    #[getter]
    fn version(&self) -> u64 {
        self.core.version()
    }

    /// The state version after reaping completed CUDA leases, under the gate.
    fn checked_version(&self, py: Python<'_>) -> PyResult<u64> {
        self.with_gate(py, true, true, || {
            crate::lifetimes::reap(self, py)?;
            Ok(self.core.version())
        })
    }

    #[getter]
    fn closed(&self) -> bool {
        self.core.is_closed()
    }

    /// The registered location records: budgeted ones first, then in first-use order.
    fn location_records(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        self.with_gate(py, false, false, || {
            self.core
                .locations()
                .into_iter()
                .map(|location| Ok(self.context.location(py, location)?.unbind()))
                .collect()
        })
    }

    /// A consistent published state for a snapshot and the time it was captured: the
    /// lock-free one when nothing waits to be reaped, else one taken under the gate.
    fn snapshot_state(&self, py: Python<'_>) -> PyResult<(StateView, u64)> {
        Self::lift(py, self.core.check_process())?;
        if !self.core.releases_queued()
            && let Some(state) = Self::lift(py, self.core.try_published_snapshot())?
        {
            return Ok((StateView { state }, crate::execute::now_ns()));
        }
        self.with_gate(py, true, true, || {
            crate::lifetimes::reap(self, py)?;
            let state = self.core.current();
            Ok((StateView { state }, crate::execute::now_ns()))
        })
    }

    // ----- registration ---------------------------------------------------------

    /// `register_source` in one call (see `direct`).
    fn register_source(
        &self,
        py: Python<'_>,
        spec_record: &Bound<'_, PyAny>,
        source: &Bound<'_, PyAny>,
        source_location: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
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

    /// The label a reservation was made with, exactly as given.
    fn label(&self, py: Python<'_>, token: u64) -> Option<Py<PyAny>> {
        self.objects.label(py, token)
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
