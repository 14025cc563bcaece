//! Leases, holds and reservations end to end, and what keeps CUDA memory protected
//! after a lease's release: the events recorded on its consumer streams.
//!
//! The rules and their order are the core's (`residency_core::LifetimeHost` and the
//! `*_with` methods of `Manager`, written in docs/concepts/lifetimes.md): this file
//! does the runtime's part for the core (event recording, queries and waits,
//! synchronisation, stream checks, handle lookups), the admissions under a gate the
//! caller holds, and the lease finalizer; `CoreManager`'s lifetime methods (`api`)
//! convert the arguments and build the lifetime objects handed back.

use std::ffi::CString;

use pyo3::exceptions::{PyException, PyRuntimeWarning, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyString, PyTuple};
use residency_core::{
    Admitted, CoreError, Freed, HandleId, LifetimeHost, Location, Manager, ObjectId, Refusal,
};

use crate::errors::{refuse, to_py_err};
use crate::manager::CoreManager;
use crate::objects::share;

pub(crate) fn warn(py: Python<'_>, message: &str, stacklevel: i32) -> PyResult<()> {
    let message = CString::new(message.replace('\0', " "))
        .map_err(|err| PyValueError::new_err(err.to_string()))?;
    PyErr::warn(py, &py.get_type::<PyRuntimeWarning>(), &message, stacklevel)
}

/// The runtime's side of the core's lifetime protocol ([`LifetimeHost`]): events
/// kept at the core's ids in the object store, and the runtime's calls.
pub(crate) struct Host<'a, 'py> {
    manager: &'a CoreManager,
    py: Python<'py>,
    runtime: &'a Bound<'py, PyAny>,
}

impl<'a, 'py> Host<'a, 'py> {
    pub(crate) fn new(manager: &'a CoreManager, py: Python<'py>) -> Self {
        let runtime = manager.context().runtime(py);
        Self {
            manager,
            py,
            runtime,
        }
    }

    fn event(&self, id: ObjectId) -> Option<Py<PyAny>> {
        self.manager.objects().object(id, share(self.py))
    }

    /// A `(handles, location)` group: its handles normalised, and its location.
    fn group(
        &self,
        group: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyTuple>, Bound<'py, PyAny>)> {
        let group = group.cast::<PyTuple>()?;
        let handles = self
            .manager
            .context()
            .normalized_handles(self.py, &group.get_item(0)?)?;
        Ok((handles, group.get_item(1)?))
    }
}

impl<'py> LifetimeHost for Host<'_, 'py> {
    type Stream = Bound<'py, PyAny>;
    type Event = Py<PyAny>;
    type Error = PyErr;
    type Handle = Bound<'py, PyAny>;
    type Place = Bound<'py, PyAny>;

    fn lift(&self, error: CoreError) -> PyErr {
        to_py_err(self.py, error)
    }

    fn enter(&self, check_closed: bool, check_reentrant: bool) -> Result<(), CoreError> {
        self.manager
            .enter_core(self.py, check_closed, check_reentrant)
    }

    fn place(&self, place: &Self::Place) -> PyResult<Location> {
        self.manager.context().location_code(self.py, place)
    }

    fn name(&self, place: &Self::Place) -> PyResult<String> {
        Ok(place.str()?.to_string_lossy().into_owned())
    }

    fn lookup(&self, handle: &Self::Handle) -> PyResult<Option<HandleId>> {
        self.manager.resolve_live(self.py, handle)
    }

    fn unknown(&self, handle: &Self::Handle) -> PyErr {
        self.manager
            .handle_error(self.py, handle)
            .unwrap_or_else(|err| err)
    }

    fn check_stream(
        &self,
        stream: &Self::Stream,
        place: &Self::Place,
        at: Location,
    ) -> PyResult<Self::Stream> {
        self.manager
            .context()
            .check_stream(self.py, stream, place, at)
    }

    fn closing(&self) {
        self.manager.context().forget_direct_actions();
    }

    /// Every file of the manager's disk locations goes with it, then its objects.
    fn closed(&self) -> PyResult<()> {
        let py = self.py;
        let disk = self.manager.context().disk.bind(py);
        disk.call_method0(intern!(py, "close"))?;
        drop(self.manager.objects().clear());
        Ok(())
    }

    fn free(&self, freed: &Freed) {
        self.manager.free(freed);
    }

    fn forget(&self, id: ObjectId) {
        drop(self.manager.objects().take(id));
    }

    fn keep(&self, id: ObjectId, event: Py<PyAny>) {
        drop(self.manager.objects().put(id, event));
    }

    fn query(&self, id: ObjectId) -> PyResult<bool> {
        let Some(event) = self.event(id) else {
            return Ok(true);
        };
        let event = event.bind(self.py);
        if let Some(seam) = self.manager.context().seam() {
            if let Some(completed) = seam.query(self.runtime, event)? {
                return Ok(completed);
            }
        }
        self.runtime
            .call_method1(intern!(self.py, "event_query"), (event,))?
            .is_truthy()
    }

    fn wait(&self, id: ObjectId) -> PyResult<()> {
        if let Some(event) = self.event(id) {
            self.runtime
                .call_method1(intern!(self.py, "synchronize_event"), (event,))?;
        }
        Ok(())
    }

    fn stream_wait(&self, stream: &Self::Stream, id: ObjectId) -> PyResult<()> {
        if let Some(event) = self.event(id) {
            self.runtime
                .call_method1(intern!(self.py, "wait_event"), (stream, event))?;
        }
        Ok(())
    }

    fn record(&self, stream: &Self::Stream) -> PyResult<Option<Py<PyAny>>> {
        let native = match self.manager.context().seam() {
            Some(seam) => seam.record(self.runtime, stream),
            None => Ok(None),
        };
        match native.and_then(|native| match native {
            Some(event) => Ok(event),
            None => self
                .runtime
                .call_method1(intern!(self.py, "record_event"), (stream,)),
        }) {
            Ok(event) => Ok(Some(event.unbind())),
            Err(err) if err.is_instance_of::<PyException>(self.py) => Ok(None),
            Err(err) => Err(err),
        }
    }

    fn synchronize_stream(&self, stream: &Self::Stream) -> PyResult<()> {
        self.runtime
            .call_method1(intern!(self.py, "synchronize_stream"), (stream,))
            .map(drop)
    }

    fn synchronize_device(&self, at: Location) -> PyResult<()> {
        let device = self.manager.context().device(self.py, at)?;
        self.runtime
            .call_method1(intern!(self.py, "synchronize_device"), (device,))
            .map(drop)
    }

    fn owner(&self, handle: HandleId, at: Location) -> Option<Self::Stream> {
        let stream = (self.manager.objects()).stream(handle, at.code(), share(self.py))?;
        Some(stream.into_bound(self.py))
    }

    fn same_stream(&self, first: &Self::Stream, second: &Self::Stream) -> bool {
        first.is(second)
    }

    /// Whether the value's source says it never calls a manager (`loads_alone`): the
    /// disk tier may then run its `load()` on its I/O thread.
    fn loads_alone(&self, handle: HandleId) -> PyResult<bool> {
        let py = self.py;
        let Some(source) = self.manager.objects().source(py, handle) else {
            return Ok(false);
        };
        match source.bind(py).getattr_opt(intern!(py, "loads_alone"))? {
            Some(flag) => flag.is_truthy(),
            None => Ok(false),
        }
    }
}

/// Applies the releases queued while a callback ran, then releases the pending CUDA
/// leases whose events have all completed. The caller holds the gate.
pub fn reap(manager: &CoreManager, py: Python<'_>) -> PyResult<()> {
    if !manager.core().reap_needed() {
        return Ok(());
    }
    manager.core().reap_with(&Host::new(manager, py))
}

/// Pending leases whose events all report complete, released or not.
pub fn completed_pending(manager: &CoreManager, py: Python<'_>) -> Vec<u64> {
    manager
        .core()
        .completed_pending_with(&Host::new(manager, py))
}

/// `acquire`'s admission under the gate the caller holds (`handles` normalised), in
/// the core's order (`Manager::admit_with`, reaping with `reap`), and its stream list:
/// the consumer stream (bound to its device) in a list, or an empty list.
pub(crate) fn admit_locked<'py>(
    manager: &CoreManager,
    host: &Host<'_, 'py>,
    handles: &Bound<'py, PyTuple>,
    at: &Bound<'py, PyAny>,
    consumer_stream: Option<&Bound<'py, PyAny>>,
    reap: bool,
) -> PyResult<(Admitted<Bound<'py, PyAny>>, Bound<'py, PyList>)> {
    let py = host.py;
    let core = manager.core();
    let admitted = core.admit_with(host, handles.iter(), at, consumer_stream, reap)?;
    let streams = core.hand_out(
        host,
        residency_core::LifetimeKind::Lease,
        admitted.token,
        || match &admitted.stream {
            Some(stream) => PyList::new(py, [stream]),
            None => Ok(PyList::empty(py)),
        },
    )?;
    Ok((admitted, streams))
}

/// Holds per group `(handles, location)` of `groups` under the gate the caller holds,
/// right after a plan ran there (`Manager::hold_groups_with`): each token appended to
/// `held` as it is taken. When one fails, the error propagates, the tokens taken
/// still in `held`.
pub fn hold_locked(
    manager: &CoreManager,
    py: Python<'_>,
    groups: &Bound<'_, PyTuple>,
    held: &Bound<'_, PyList>,
) -> PyResult<()> {
    let host = Host::new(manager, py);
    let groups = groups.iter().map(|group| host.group(&group));
    manager
        .core()
        .hold_groups_with(&host, groups, |token| held.append(token))
}

/// Whether bringing the values of any `(handles, location)` group of `groups` there
/// would block the host on a copy (`blocks_host`'s rule), under the gate the caller
/// holds. Changes nothing.
pub fn blocks_host_locked(
    manager: &CoreManager,
    py: Python<'_>,
    groups: &Bound<'_, PyTuple>,
    disk_deferred: bool,
) -> PyResult<bool> {
    let host = Host::new(manager, py);
    let groups = groups.iter().map(|group| host.group(&group));
    manager
        .core()
        .blocks_host_groups_with(&host, groups, disk_deferred)
}

/// `fhelium.residency.lease.finalize_lease`, looked up once per process.
static FINALIZE_LEASE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The callback of a tracked lease's weak reference: a lease collected while its
/// manager still tracks it was never released, and is finalized as the lifetime
/// objects' own finalizers do (released safely, with a `ResourceWarning`).
///
/// It holds the manager's engine only while the lease is tracked: releasing the
/// lease drops the weak reference, and this callback with it.
#[pyclass(frozen, module = "fhelium._core", name = "LeaseFinalizer")]
#[derive(Debug)]
pub struct LeaseFinalizer {
    pub(crate) engine: Py<PyAny>,
    pub(crate) token: u64,
    pub(crate) location: Py<PyAny>,
    pub(crate) streams: Py<PyAny>,
}

#[pymethods]
impl LeaseFinalizer {
    fn __call__(&self, py: Python<'_>, _reference: &Bound<'_, PyAny>) -> PyResult<()> {
        let engine = self.engine.bind(py);
        let core = engine.getattr(intern!(py, "core"))?;
        let manager = core.cast::<CoreManager>()?.get();
        // Not in a forked child, and not when released or finalized already (the
        // core's rule, docs/concepts/lifetimes.md#fork).
        let host = Host::new(manager, py);
        if !manager.core().finalize_tracked_with(&host, self.token) {
            return Ok(());
        }
        finalize_lease(
            py,
            engine,
            self.token,
            self.location.bind(py),
            self.streams.bind(py),
        )
    }
}

/// `fhelium.residency.lease.finalize_lease(engine, token, location, streams)`: an
/// abandoned lease released safely, with its `ResourceWarning`.
pub(crate) fn finalize_lease(
    py: Python<'_>,
    engine: &Bound<'_, PyAny>,
    token: u64,
    location: &Bound<'_, PyAny>,
    streams: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let finalize = FINALIZE_LEASE.import(py, "fhelium.residency.lease", "finalize_lease")?;
    finalize.call1((engine, token, location, streams)).map(drop)
}

/// Admits a reservation; the caller holds the gate.
pub fn reserve_locked(
    manager: &CoreManager,
    py: Python<'_>,
    at: Location,
    nbytes: &Bound<'_, PyAny>,
    label: &Bound<'_, PyString>,
) -> PyResult<u64> {
    let Ok(count) = nbytes.extract::<u64>() else {
        let nbytes = &nbytes.to_string();
        return Err(refuse(
            py,
            Refusal::TooManyBytes {
                name: "nbytes",
                nbytes,
            },
        ));
    };
    let text = label.to_string_lossy();
    let reserved = manager.core().reserve(at, count, &text);
    let token = reserved.map_err(|err| to_py_err(py, err))?;
    manager
        .objects()
        .set_label(token, label.clone().into_any().unbind());
    Ok(token)
}

/// The managed object a lease borrows, while the lease still covers it, given the
/// handle's index and the location when the caller knows them (a step's lease, by the
/// handle's identity).
pub(crate) fn borrowed_known(
    manager: &CoreManager,
    py: Python<'_>,
    token: u64,
    handle: &Bound<'_, PyAny>,
    location: &Bound<'_, PyAny>,
    known: Option<(HandleId, Location)>,
) -> PyResult<Py<PyAny>> {
    let (core, host) = (manager.core(), Host::new(manager, py));
    let objects = manager.objects();
    let value = core.borrowed_with(&host, token, handle, location, known, |index, at| {
        objects.value(index, at.code(), share(py))
    })?;
    value.ok_or_else(|| {
        let handle_id = handle.getattr(intern!(py, "handle_id"));
        let handle_id = handle_id.and_then(|id| Ok(id.repr()?.to_string()));
        let at = location.str().map(|text| text.to_string());
        let (handle_id, at) = (handle_id.unwrap_or_default(), at.unwrap_or_default());
        to_py_err(py, Manager::no_longer_borrowed(&handle_id, &at))
    })
}

impl CoreManager {
    /// Runs `operation` holding the gate (`Manager::gated`).
    pub(crate) fn with_gate<T>(
        &self,
        py: Python<'_>,
        check_closed: bool,
        check_reentrant: bool,
        operation: impl FnOnce() -> PyResult<T>,
    ) -> PyResult<T> {
        let host = Host::new(self, py);
        self.core
            .gated(&host, check_closed, check_reentrant, operation)
    }

    /// Runs `operation` under the gate on `handles` (normalised) resolved in order at
    /// `at` (`Manager::with_resolved`, reaping first with `reap`).
    pub(crate) fn with_resolved<T>(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
        reap: bool,
        operation: impl FnOnce(&Host<'_, '_>, &[HandleId], Location) -> PyResult<T>,
    ) -> PyResult<T> {
        let handles = self.context.normalized_handles(py, handles)?;
        let host = Host::new(self, py);
        (self.core).with_resolved(&host, handles, at, reap, |ids, at| {
            operation(&host, ids, at)
        })
    }
}
