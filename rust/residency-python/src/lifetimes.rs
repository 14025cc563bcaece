//! Leases, holds and reservations end to end, and what keeps CUDA memory protected
//! after a lease's release: the events recorded on its consumer streams.
//!
//! Every operation here takes the manager's gate itself. Python code runs only
//! where the runtime must act (stream checks, event recording and queries,
//! synchronisation) and to build the lifetime objects handed back. The rules are
//! written in docs/concepts/lifetimes.md.

use std::ffi::CString;

use pyo3::exceptions::{PyException, PyRuntimeWarning, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyString, PyTuple, PyWeakrefReference};
use residency_core::{
    CoreError, Freed, HandleId, HostCost, LeaseState, Location, ObjectId, Release, SettleWait,
};

use crate::errors::{ResidencyUnavailableError, to_py_err};
use crate::kinds::LifetimeKind;
use crate::manager::CoreManager;

fn lift<T>(py: Python<'_>, result: Result<T, CoreError>) -> PyResult<T> {
    result.map_err(|err| to_py_err(py, err))
}

fn warn(py: Python<'_>, message: &str, stacklevel: i32) -> PyResult<()> {
    let message = CString::new(message.replace('\0', " "))
        .map_err(|err| PyValueError::new_err(err.to_string()))?;
    PyErr::warn(py, &py.get_type::<PyRuntimeWarning>(), &message, stacklevel)
}

/// Asks the runtime whether the event at `id` completed. An id no longer kept
/// belongs to a lease released meanwhile (by code the query ran): nothing waits on it.
fn event_done(
    manager: &CoreManager,
    py: Python<'_>,
    runtime: &Bound<'_, PyAny>,
    id: ObjectId,
) -> PyResult<bool> {
    match manager.objects().object(py, id) {
        Some(event) => runtime
            .call_method1(intern!(py, "event_query"), (event,))?
            .is_truthy(),
        None => Ok(true),
    }
}

/// Waits on the host for the event at `id`.
fn event_wait(
    manager: &CoreManager,
    py: Python<'_>,
    runtime: &Bound<'_, PyAny>,
    id: ObjectId,
) -> PyResult<()> {
    if let Some(event) = manager.objects().object(py, id) {
        runtime.call_method1(intern!(py, "synchronize_event"), (event,))?;
    }
    Ok(())
}

/// Applies the releases queued while a callback ran, then releases the pending CUDA
/// leases whose events have all completed (the core's rule; the runtime answers).
/// The caller holds the gate.
pub fn reap(manager: &CoreManager, py: Python<'_>) -> PyResult<()> {
    let core = manager.core();
    if !core.reap_needed() {
        return Ok(());
    }
    let runtime = manager.context().runtime(py);
    let mut freed = Freed::default();
    let reaped = core.reap(|id| event_done(manager, py, runtime, id), &mut freed);
    manager.free(&freed);
    reaped
}

/// Pending leases whose events all report complete, released or not: they no
/// longer protect anything. A query that raises keeps its lease protecting.
pub fn completed_pending(manager: &CoreManager, py: Python<'_>) -> Vec<u64> {
    let runtime = manager.context().runtime(py);
    manager
        .core()
        .completed_pending(|id| event_done(manager, py, runtime, id).unwrap_or(false))
}

/// Releases a lease, hold or reservation token, waiting for the gate if another
/// thread holds it. While a source callback runs elsewhere (or a finaliser fires
/// inside one) the release is queued instead and applied as soon as it ends.
pub fn release(
    manager: &CoreManager,
    py: Python<'_>,
    kind: LifetimeKind,
    token: u64,
    finalizing: bool,
) -> PyResult<()> {
    let released = if manager.release_now(kind, token) {
        Ok(())
    } else {
        let release = Release::Token {
            kind: kind.into(),
            token,
        };
        release_waiting(manager, py, release, finalizing)
    };
    if kind == LifetimeKind::Lease && released.is_ok() {
        // Released (or queued): the at-exit finalizer has nothing left to do for it.
        drop(manager.objects().untrack_lease(token));
    }
    released
}

/// The core's release protocol, with the gate taken without the interpreter.
fn release_waiting(
    manager: &CoreManager,
    py: Python<'_>,
    release: Release,
    finalizing: bool,
) -> PyResult<()> {
    let mut freed = Freed::default();
    let released = manager.core().release(
        release,
        finalizing,
        |check_reentrant| manager.enter_core(py, false, check_reentrant),
        &mut freed,
    );
    manager.free(&freed);
    lift(py, released)
}

/// A lease's release. On the host its use tokens go at once. On CUDA an event is
/// recorded on every consumer stream and the memory stays protected until they have
/// all completed (`wait=True` waits for that here).
/// A lease whose release fails stays tracked, so the at-exit finalizer tries again.
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
    let released = release_lease_tokens(
        manager, py, token, location, streams, wait, finalizing, stacklevel,
    );
    if released.is_ok() {
        drop(manager.objects().untrack_lease(token));
    }
    released
}

#[allow(clippy::too_many_arguments)]
fn release_lease_tokens(
    manager: &CoreManager,
    py: Python<'_>,
    token: u64,
    location: &Bound<'_, PyAny>,
    streams: &Bound<'_, PyList>,
    wait: bool,
    finalizing: bool,
    stacklevel: i32,
) -> PyResult<()> {
    let context = manager.context();
    let core = manager.core();
    if !matches!(context.location_code(py, location)?, Location::Cuda(_)) {
        return release(manager, py, LifetimeKind::Lease, token, finalizing);
    }
    if core.lease_state(token) != LeaseState::Active {
        return Ok(()); // unknown (a forced close) or already released
    }
    let runtime = context.runtime(py);
    let streams: Vec<Bound<'_, PyAny>> = streams.iter().collect();
    if streams.is_empty() {
        let device = location.getattr(intern!(py, "device"))?;
        runtime.call_method1(intern!(py, "synchronize_device"), (device,))?;
        release(manager, py, LifetimeKind::Lease, token, finalizing)?;
        return warn(
            py,
            &format!(
                "a CUDA lease at {} had no consumer streams; a full-device synchronisation \
                 was used to release it",
                location.str()?
            ),
            stacklevel,
        );
    }
    // Every stream was checked against this location when it joined the lease, and a
    // stream never changes device.
    let record = intern!(py, "record_event");
    let recorded: PyResult<Vec<Py<PyAny>>> = streams
        .iter()
        .map(|stream| Ok(runtime.call_method1(record, (stream,))?.unbind()))
        .collect();
    let events = match recorded {
        Ok(events) => events,
        Err(err) if err.is_instance_of::<PyException>(py) => {
            // Without events, the streams are waited for instead.
            for stream in &streams {
                runtime.call_method1(intern!(py, "synchronize_stream"), (stream,))?;
            }
            release(manager, py, LifetimeKind::Lease, token, finalizing)?;
            return warn(
                py,
                &format!(
                    "recording release events at {} failed; the consumer streams were \
                     synchronised instead",
                    location.str()?
                ),
                stacklevel,
            );
        }
        Err(err) => return Err(err),
    };
    if wait {
        for event in &events {
            runtime.call_method1(intern!(py, "synchronize_event"), (event,))?;
        }
    }
    let pending = Release::Pending {
        token,
        events: events
            .into_iter()
            .map(|event| manager.store_object(event))
            .collect(),
        completed: wait,
    };
    release_waiting(manager, py, pending, finalizing)
}

/// The lifetime object built for a new token, or, when building it failed, the
/// error after `give_back` released the token: nothing may keep the tokens of a
/// lifetime that was never handed out.
fn handed_out(built: PyResult<Bound<'_, PyAny>>, give_back: impl FnOnce()) -> PyResult<Py<PyAny>> {
    built.map(Bound::unbind).inspect_err(|_| give_back())
}

/// Per handle in order, the lookup and then residency: a non-resident handle before
/// an unknown one reports unavailability. The caller holds the gate.
fn resolve_in_order(
    manager: &CoreManager,
    py: Python<'_>,
    handles: &Bound<'_, PyTuple>,
    at: Location,
) -> PyResult<Vec<HandleId>> {
    let mut indices = Vec::with_capacity(handles.len());
    for handle in handles.iter() {
        if let Some(index) = manager.resolve_live(py, &handle)? {
            indices.push(index);
            continue;
        }
        if !indices.is_empty() {
            lift(py, manager.core().check_resident(&indices, at))?;
        }
        return Err(manager.handle_error(py, &handle)?);
    }
    Ok(indices)
}

/// Borrows the ready materialisations of `handles` at `at`, atomically.
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
    manager.with_gate(py, true, true, || {
        let context = manager.context();
        let location = context.location_code(py, at)?;
        if let Location::Disk(_) = location {
            return Err(PyValueError::new_err(format!(
                "{} cannot be borrowed: a value on disk is a file; ensure it on a host or \
                 CUDA location and acquire it there",
                at.str()?
            )));
        }
        if matches!(location, Location::Cuda(_)) && consumer_stream.is_none() {
            return Err(PyValueError::new_err(format!(
                "acquiring at {} needs the consumer_stream that will read the values",
                at.str()?
            )));
        }
        reap(manager, py)?;
        let consumer_stream = consumer_stream
            .map(|stream| context.check_stream(py, stream, at, location))
            .transpose()?;
        let indices = resolve_in_order(manager, py, handles, location)?;
        let core = manager.core();
        let token = lift(py, core.acquire(&indices, location))?;
        if let Some(stream) = &consumer_stream {
            // A value a prefetch is still copying in is read after its copy: the
            // consumer stream waits for the transfer's event on the device.
            if let Err(error) = wait_for_transfers(manager, py, &indices, location, stream) {
                core.release_lease(token);
                return Err(error);
            }
        }
        let streams = match &consumer_stream {
            Some(stream) => PyList::new(py, [stream])?,
            None => PyList::empty(py),
        };
        let lease = context
            .new_lease(py)
            .call1((engine, token, handles, at, &streams))
            .and_then(|lease| {
                track_lease(manager, py, engine, token, at, streams.as_any(), &lease)?;
                Ok(lease)
            });
        handed_out(lease, || {
            core.release_lease(token);
        })
    })
}

/// Makes `stream` wait on the device for every transfer still in flight into
/// `indices` at `location` (docs/concepts/controller.md#prefetch). The caller holds
/// the gate and has reaped, so only incomplete transfers remain.
fn wait_for_transfers(
    manager: &CoreManager,
    py: Python<'_>,
    indices: &[HandleId],
    location: Location,
    stream: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let ids = manager.core().transfer_events(indices, location);
    if ids.is_empty() {
        return Ok(());
    }
    let events = manager.objects().objects(py, &ids);
    let runtime = manager.context().runtime(py);
    for event in &events {
        runtime.call_method1(intern!(py, "wait_event"), (stream, event))?;
    }
    Ok(())
}

/// Host-waits for the events of the pending leases among `tokens` and releases
/// them; with `transfers`, also for every asynchronous transfer in flight.
pub fn settle(
    manager: &CoreManager,
    py: Python<'_>,
    tokens: &[u64],
    transfers: bool,
) -> PyResult<()> {
    manager.with_gate(py, true, true, || {
        let runtime = manager.context().runtime(py);
        let mut freed = Freed::default();
        let settled = manager.core().settle(
            |token| tokens.contains(&token),
            transfers,
            |id| event_wait(manager, py, runtime, id),
            &mut freed,
        );
        manager.free(&freed);
        settled?;
        // A transfer's source shares its event: now complete, reaping releases it.
        reap(manager, py)
    })
}

/// Releases the pending leases among `tokens` without a host wait where the device's
/// order makes that safe (docs/concepts/controller.md#evicting-around-reads-in-flight):
/// the owning stream of each of the lease's values waits on the device for the
/// lease's events, then the lease is released (a copy in flight keeps its record,
/// its events and the buffer it reads until they complete). A lease with a value
/// whose owning stream is unknown is waited for on the host with `host`, and
/// otherwise left pending. Returns the tokens left pending.
pub fn settle_on_device(
    manager: &CoreManager,
    py: Python<'_>,
    tokens: &[u64],
    host: bool,
) -> PyResult<Vec<u64>> {
    manager.with_gate(py, true, true, || {
        reap(manager, py)?;
        let objects = manager.objects();
        let runtime = manager.context().runtime(py);
        let mut freed = Freed::default();
        let left = manager.core().settle_on_device(
            tokens,
            host,
            |index, location| objects.stream(py, index, location.code()),
            |wait| match wait {
                SettleWait::Device { owners, events } => {
                    let events = objects.objects(py, events);
                    let mut waited: Vec<Py<PyAny>> = Vec::new();
                    for owner in owners {
                        if waited.iter().any(|seen| seen.is(&owner)) {
                            continue;
                        }
                        for event in &events {
                            runtime.call_method1(intern!(py, "wait_event"), (&owner, event))?;
                        }
                        waited.push(owner);
                    }
                    Ok(())
                }
                SettleWait::Host { events } => events
                    .iter()
                    .try_for_each(|&id| event_wait(manager, py, runtime, id)),
            },
            &mut freed,
        );
        manager.free(&freed);
        left
    })
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
    if manager.core().transfer_count() == 0 {
        return Ok(());
    }
    let handles = &manager.context().normalized_handles(py, handles)?;
    manager.with_gate(py, true, true, || {
        let location = manager.context().location_code(py, at)?;
        reap(manager, py)?;
        let indices = resolve_in_order(manager, py, handles, location)?;
        wait_for_transfers(manager, py, &indices, location, stream)
    })
}

/// The pending tokens of the transfers still in flight into `handles` at `at`.
pub fn transfers_into(
    manager: &CoreManager,
    py: Python<'_>,
    handles: &Bound<'_, PyAny>,
    at: &Bound<'_, PyAny>,
) -> PyResult<Vec<u64>> {
    if manager.core().transfer_count() == 0 {
        return Ok(Vec::new());
    }
    let handles = &manager.context().normalized_handles(py, handles)?;
    manager.with_gate(py, true, true, || {
        let location = manager.context().location_code(py, at)?;
        let indices = resolve_in_order(manager, py, handles, location)?;
        Ok(manager.core().transfer_tokens_into(&indices, location))
    })
}

/// Whether bringing `handles` to `at` would block the host on a copy: one from disk or
/// from pageable memory (where a source loads it included), or any copy to the host
/// (docs/concepts/controller.md#staging). With `disk_deferred`, a read from disk to a
/// device does not, nor does a source that `loads_alone` (the disk tier runs them on
/// its I/O thread). Changes nothing.
pub fn blocks_host(
    manager: &CoreManager,
    py: Python<'_>,
    handles: &Bound<'_, PyAny>,
    at: &Bound<'_, PyAny>,
    disk_deferred: bool,
) -> PyResult<bool> {
    let handles = &manager.context().normalized_handles(py, handles)?;
    manager.with_gate(py, true, true, || {
        let location = manager.context().location_code(py, at)?;
        let indices = resolve_in_order(manager, py, handles, location)?;
        let costs = lift(
            py,
            manager.core().host_costs(&indices, location, disk_deferred),
        )?;
        for (index, cost) in indices.into_iter().zip(costs) {
            match cost {
                HostCost::Free => {}
                HostCost::Blocks => return Ok(true),
                HostCost::BlocksUnlessLoadsAlone => {
                    if !loads_alone(manager, py, index)? {
                        return Ok(true);
                    }
                }
            }
        }
        Ok(false)
    })
}

/// Whether the value's source says it never calls a manager (`loads_alone`): the
/// disk tier may then run its `load()` on its I/O thread.
fn loads_alone(manager: &CoreManager, py: Python<'_>, index: HandleId) -> PyResult<bool> {
    let Some(source) = manager.objects().source(py, index) else {
        return Ok(false);
    };
    match source.bind(py).getattr_opt(intern!(py, "loads_alone"))? {
        Some(flag) => flag.is_truthy(),
        None => Ok(false),
    }
}

/// Tracks an unreleased lease by a weak reference whose callback finalizes it if it
/// is collected before its release (docs/concepts/lifetimes.md#finalizers).
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
    manager
        .objects()
        .track_lease(token, reference.into_any().unbind());
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
        let core = core.cast::<CoreManager>()?;
        // In a forked child the lease is the parent's: nothing here may release it
        // (docs/concepts/lifetimes.md#fork).
        if core.get().core().check_process().is_err() {
            return Ok(());
        }
        // Already released or finalized (at exit, say): nothing is left to do.
        let Some(reference) = core.get().objects().untrack_lease(self.token) else {
            return Ok(());
        };
        drop(reference);
        let finalize = FINALIZE_LEASE.import(py, "fhelium.residency.lease", "finalize_lease")?;
        finalize.call1((
            engine,
            self.token,
            self.location.bind(py),
            self.streams.bind(py),
        ))?;
        Ok(())
    }
}

/// The lease objects not yet released that are still alive, oldest first.
pub fn live_leases(manager: &CoreManager, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
    let mut live = Vec::new();
    for reference in manager.objects().tracked_leases(py) {
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
    manager.with_gate(py, true, true, || {
        let context = manager.context();
        let location = context.location_code(py, at)?;
        reap(manager, py)?;
        let indices = resolve_in_order(manager, py, handles, location)?;
        let core = manager.core();
        let token = lift(py, core.hold(&indices, location))?;
        handed_out(
            context.new_hold(py).call1((engine, token, handles, at)),
            || {
                core.release_hold(token);
            },
        )
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
    manager.with_gate(py, true, true, || {
        let context = manager.context();
        let code = context.location_code(py, location)?;
        let token = reserve_locked(manager, py, code, nbytes, label)?;
        handed_out(
            context
                .new_reservation(py)
                .call1((engine, token, location, nbytes, label)),
            || {
                manager.release_reservation_token(token);
            },
        )
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
        return Err(PyValueError::new_err(format!(
            "nbytes of {nbytes} bytes exceeds the supported maximum of 2**64 - 1"
        )));
    };
    let text = label.to_string_lossy();
    let token = lift(py, manager.core().reserve(at, count, &text))?;
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
    manager.with_gate(py, false, true, || {
        let core = manager.core();
        let index = manager
            .resolve_live(py, handle)?
            .filter(|index| core.lease_covers(token, *index));
        let value = match index {
            Some(index) => {
                let at = manager.context().location_code(py, location)?;
                manager.objects().value(py, index, at.code())
            }
            None => None,
        };
        value.ok_or_else(|| {
            let handle_id = handle
                .getattr(intern!(py, "handle_id"))
                .and_then(|id| id.repr().map(|text| text.to_string()))
                .unwrap_or_default();
            let location = location
                .str()
                .map(|text| text.to_string())
                .unwrap_or_default();
            ResidencyUnavailableError::new_err(format!(
                "value {handle_id} is no longer borrowed at {location} (its lease ended \
                 with a forced close or the value was discarded)"
            ))
        })
    })
}

/// Closes the manager (see docs/concepts/lifetimes.md#close). A closed manager
/// returns at once.
pub fn close(manager: &CoreManager, py: Python<'_>, wait: bool, force: bool) -> PyResult<()> {
    manager.with_gate(py, false, false, || {
        let core = manager.core();
        if core.is_closed() {
            return Ok(());
        }
        lift(py, core.gate().check_reentrant())?;
        manager.drain_deferred();
        let context = manager.context();
        context.forget_direct_actions();
        let runtime = context.runtime(py);
        if wait {
            let mut freed = Freed::default();
            let settled = core.settle(
                |_| true,
                false,
                |id| event_wait(manager, py, runtime, id),
                &mut freed,
            );
            manager.free(&freed);
            settled?;
        } else {
            reap(manager, py)?;
        }
        if force && context.cuda_count() > 0 {
            for location in core.locations() {
                if matches!(location, Location::Cuda(_)) {
                    let device = context
                        .location(py, location)?
                        .getattr(intern!(py, "device"))?;
                    runtime.call_method1(intern!(py, "synchronize_device"), (device,))?;
                }
            }
        }
        lift(py, core.close(force))?;
        // Every file of the manager's disk locations goes with it.
        context.disk.bind(py).call_method0(intern!(py, "close"))?;
        drop(manager.objects().clear());
        let mut freed = Freed::default();
        core.clear_tokens(&mut freed);
        manager.free(&freed);
        Ok(())
    })
}
