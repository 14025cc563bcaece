//! Leases, holds and reservations end to end, and what keeps CUDA memory protected
//! after a lease's release: the events recorded on its consumer streams.
//!
//! The rules and their order are the core's (`residency_core::LifetimeHost` and the
//! `*_with` methods of `Manager`, written in docs/concepts/lifetimes.md): this file
//! converts the arguments, does the runtime's part for the core (event recording,
//! queries and waits, synchronisation, stream checks, handle lookups), builds the
//! lifetime objects handed back and maps the errors.

use std::ffi::CString;

use pyo3::exceptions::{PyException, PyRuntimeWarning, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyString, PyTuple, PyWeakrefReference};
use residency_core::{
    Admitted, CoreError, Freed, HandleId, LeaseRelease, LifetimeHost, Location, Manager, ObjectId,
    Refusal,
};

use crate::errors::{refuse, to_py_err};
use crate::kinds::LifetimeKind;
use crate::manager::CoreManager;
use crate::objects::share;

fn warn(py: Python<'_>, message: &str, stacklevel: i32) -> PyResult<()> {
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

/// Releases a lease, hold or reservation token (queued behind a source callback
/// running elsewhere).
pub fn release(
    manager: &CoreManager,
    py: Python<'_>,
    kind: LifetimeKind,
    token: u64,
    finalizing: bool,
) -> PyResult<()> {
    let host = Host::new(manager, py);
    manager
        .core()
        .release_token_with(&host, kind.into(), token, finalizing)
}

/// A lease's release (the core's rule), with its warning raised at `stacklevel`.
#[allow(clippy::too_many_arguments)]
pub fn release_lease(
    manager: &CoreManager,
    py: Python<'_>,
    token: u64,
    location: &Bound<'_, PyAny>,
    streams: &Bound<'_, PyList>,
    wait: bool,
    finalizing: bool,
    stacklevel: i32,
) -> PyResult<()> {
    let at = manager.context().location_code(py, location)?;
    let streams: Vec<Bound<'_, PyAny>> = streams.iter().collect();
    let host = Host::new(manager, py);
    let released = manager
        .core()
        .release_lease_with(&host, token, at, &streams, wait, finalizing)?;
    if released == LeaseRelease::Released {
        return Ok(());
    }
    match released.warning(&location.str()?.to_string_lossy()) {
        Some(message) => warn(py, &message, stacklevel),
        None => Ok(()),
    }
}

/// Borrows the ready materialisations of `handles` at `at`, atomically (the core's
/// admission, then the lease object, tracked for its finalizer).
/// A CUDA location needs the consumer stream that will read them.
pub fn acquire(
    manager: &CoreManager,
    py: Python<'_>,
    engine: &Bound<'_, PyAny>,
    handles: &Bound<'_, PyAny>,
    at: &Bound<'_, PyAny>,
    consumer_stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let handles = &manager.context().normalized_handles(py, handles)?;
    let host = Host::new(manager, py);
    let build = |admitted: Admitted<Bound<'_, PyAny>>| {
        let streams = match admitted.stream {
            Some(stream) => PyList::new(py, [stream])?,
            None => PyList::empty(py),
        };
        let token = admitted.token;
        let lease = manager
            .context()
            .new_lease
            .bind(py)
            .call1((engine, token, handles, at, &streams))?;
        track_lease(manager, py, engine, token, at, streams.as_any(), &lease)?;
        Ok(lease.unbind())
    };
    manager
        .core()
        .lease_with(&host, handles.iter(), at, consumer_stream, build)
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

/// `ResidencyLease.add_consumer_stream`'s wait: the joining stream waits for the
/// transfers still in flight into the lease's values.
pub fn wait_transfers(
    manager: &CoreManager,
    py: Python<'_>,
    handles: &Bound<'_, PyAny>,
    at: &Bound<'_, PyAny>,
    stream: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let core = manager.core();
    if core.transfer_count() == 0 {
        return Ok(());
    }
    let handles = manager.context().normalized_handles(py, handles)?;
    let host = Host::new(manager, py);
    core.with_resolved(&host, handles, at, true, |ids, at| {
        core.wait_transfers_with(&host, ids, at, stream)
    })
}

/// The pending tokens of the transfers still in flight into `handles` at `at`.
pub fn transfers_into(
    manager: &CoreManager,
    py: Python<'_>,
    handles: &Bound<'_, PyAny>,
    at: &Bound<'_, PyAny>,
) -> PyResult<Vec<u64>> {
    let core = manager.core();
    if core.transfer_count() == 0 {
        return Ok(Vec::new());
    }
    let handles = manager.context().normalized_handles(py, handles)?;
    let host = Host::new(manager, py);
    core.with_resolved(&host, handles, at, false, |ids, at| {
        Ok(core.transfer_tokens_into(ids, at))
    })
}

/// Whether bringing `handles` to `at` would block the host on a copy (the core's
/// rule, docs/concepts/controller.md#staging). Changes nothing.
pub fn blocks_host(
    manager: &CoreManager,
    py: Python<'_>,
    handles: &Bound<'_, PyAny>,
    at: &Bound<'_, PyAny>,
    disk_deferred: bool,
) -> PyResult<bool> {
    let core = manager.core();
    let handles = manager.context().normalized_handles(py, handles)?;
    let host = Host::new(manager, py);
    core.with_resolved(&host, handles, at, false, |ids, at| {
        core.blocks_host_with(&host, ids, at, disk_deferred)
    })
}

/// Tracks an unreleased lease by a weak reference whose callback finalizes it if it
/// is collected before its release (docs/concepts/lifetimes.md#finalizers; the
/// bookkeeping is the core's).
pub fn track_lease(
    manager: &CoreManager,
    py: Python<'_>,
    engine: &Bound<'_, PyAny>,
    token: u64,
    location: &Bound<'_, PyAny>,
    streams: &Bound<'_, PyAny>,
    lease: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let finalizer = Bound::new(
        py,
        LeaseFinalizer {
            engine: engine.clone().unbind(),
            token,
            location: location.clone().unbind(),
            streams: streams.clone().unbind(),
        },
    )?;
    let reference = PyWeakrefReference::new_with(lease, finalizer)?;
    manager.keep_lease(token, reference.into_any().unbind());
    Ok(())
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
    engine: Py<PyAny>,
    token: u64,
    location: Py<PyAny>,
    streams: Py<PyAny>,
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

/// The lease objects not yet released that are still alive, oldest first.
pub fn live_leases(manager: &CoreManager, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
    let ids = manager.core().tracked_leases();
    let mut live = Vec::new();
    for reference in manager.objects().objects(py, &ids) {
        let lease = reference.bind(py).call0()?;
        if !lease.is_none() {
            live.push(lease.unbind());
        }
    }
    Ok(live)
}

/// Protects the ready materialisations of `handles` at `at` from removal.
pub fn hold(
    manager: &CoreManager,
    py: Python<'_>,
    engine: &Bound<'_, PyAny>,
    handles: &Bound<'_, PyAny>,
    at: &Bound<'_, PyAny>,
) -> PyResult<Py<PyAny>> {
    let handles = &manager.context().normalized_handles(py, handles)?;
    let (new_hold, host) = (manager.context().new_hold.bind(py), Host::new(manager, py));
    manager.core().hold_with(&host, handles, at, |token| {
        Ok(new_hold.call1((engine, token, handles, at))?.unbind())
    })
}

/// Charges `nbytes` of headroom at `location` until released. The label is checked by
/// the caller; the core keeps its UTF-8 form for diagnostics.
pub fn reserve(
    manager: &CoreManager,
    py: Python<'_>,
    engine: &Bound<'_, PyAny>,
    location: &Bound<'_, PyAny>,
    nbytes: &Bound<'_, PyAny>,
    label: &Bound<'_, PyString>,
) -> PyResult<Py<PyAny>> {
    let (core, host) = (manager.core(), Host::new(manager, py));
    let new_reservation = manager.context().new_reservation.bind(py);
    core.gated(&host, true, true, || {
        let at = host.place(location)?;
        let token = reserve_locked(manager, py, at, nbytes, label)?;
        let kind = residency_core::LifetimeKind::Reservation;
        core.hand_out(&host, kind, token, || {
            let reservation = new_reservation.call1((engine, token, location, nbytes, label));
            Ok(reservation?.unbind())
        })
    })
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

/// The managed object a lease borrows, while the lease still covers it.
pub fn borrowed(
    manager: &CoreManager,
    py: Python<'_>,
    token: u64,
    handle: &Bound<'_, PyAny>,
    location: &Bound<'_, PyAny>,
) -> PyResult<Py<PyAny>> {
    borrowed_known(manager, py, token, handle, location, None)
}

/// `borrowed`, given the handle's index and the location when the caller knows them
/// (a step's lease, by the handle's identity).
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
