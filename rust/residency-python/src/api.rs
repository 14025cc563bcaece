//! `CoreManager`'s Python methods: each is one call into the operation modules
//! (`direct`, `execute`, `plans`, `lifetimes`, `search`), which take the manager's
//! shared part (`manager`), or, for a lifetime, into the core with the runtime's part
//! (`lifetimes::Host`); this module alone sees them all.

// pyo3 extracts sequence arguments as owned vectors.
#![allow(clippy::needless_pass_by_value)]

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple, PyWeakrefReference};
use residency_core::manager::not_issued;
use residency_core::tables::Recent;
use residency_core::{Admitted, HandleId, LeaseRelease, Manager};

use crate::context::Context;
use crate::errors::to_py_err;
use crate::kinds::LifetimeKind;
use crate::lifetimes::{Host, LeaseFinalizer};
use crate::manager::{CoreManager, SimulationView, StateView};
use crate::objects::{Objects, share};
use crate::plan::PlanIr;
use crate::plans::PlanRun;
use crate::records::RecordBuilder;
use crate::shapes::AdoptedShapes;
use crate::transition::{now_ns, reports};

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
            trace: Recent::new(trace_capacity),
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

    /// Borrows the ready materialisations of normalised `handles` at `at`, atomically
    /// (the core's admission, then the lease object, tracked for its finalizer). A
    /// CUDA location needs the consumer stream that will read them.
    #[pyo3(signature = (engine, handles, at, consumer_stream=None))]
    fn acquire(
        &self,
        py: Python<'_>,
        engine: &Bound<'_, PyAny>,
        handles: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
        consumer_stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let handles = &self.context.normalized_handles(py, handles)?;
        let build = |admitted: Admitted<Bound<'_, PyAny>>| {
            let streams = match admitted.stream {
                Some(stream) => PyList::new(py, [stream])?,
                None => PyList::empty(py),
            };
            let token = admitted.token;
            let new_lease = self.context.new_lease.bind(py);
            let lease = new_lease.call1((engine, token, handles, at, &streams))?;
            self.track_lease(py, token, &lease, engine, at, streams.as_any())?;
            Ok(lease.unbind())
        };
        let host = Host::new(self, py);
        (self.core).lease_with(&host, handles.iter(), at, consumer_stream, build)
    }

    /// Protects the ready materialisations of normalised `handles` at `at` from removal.
    fn hold(
        &self,
        py: Python<'_>,
        engine: &Bound<'_, PyAny>,
        handles: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let handles = &self.context.normalized_handles(py, handles)?;
        let (new_hold, host) = (self.context.new_hold.bind(py), Host::new(self, py));
        self.core.hold_with(&host, handles, at, |token| {
            Ok(new_hold.call1((engine, token, handles, at))?.unbind())
        })
    }

    /// Charges `nbytes` (a non-negative int) of headroom at `location` until released;
    /// `label` is a checked non-empty string, the core keeps its UTF-8 form for
    /// diagnostics.
    fn reserve(
        &self,
        py: Python<'_>,
        engine: &Bound<'_, PyAny>,
        location: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        label: &Bound<'_, PyString>,
    ) -> PyResult<Py<PyAny>> {
        let (core, host) = (&self.core, Host::new(self, py));
        let new_reservation = self.context.new_reservation.bind(py);
        core.gated(&host, true, true, || {
            let at = self.context.location_code(py, location)?;
            let token = crate::lifetimes::reserve_locked(self, py, at, nbytes, label)?;
            let kind = residency_core::LifetimeKind::Reservation;
            core.hand_out(&host, kind, token, || {
                let reservation = new_reservation.call1((engine, token, location, nbytes, label));
                Ok(reservation?.unbind())
            })
        })
    }

    /// Releases a hold, a reservation or a host lease, waiting for the gate or
    /// queueing behind a running source callback as needed.
    #[pyo3(signature = (kind, token, finalizing=false))]
    pub(crate) fn release(
        &self,
        py: Python<'_>,
        kind: LifetimeKind,
        token: u64,
        finalizing: bool,
    ) -> PyResult<()> {
        let host = Host::new(self, py);
        (self.core).release_token_with(&host, kind.into(), token, finalizing)
    }

    /// Releases a lease at `location` (the core's rule); a CUDA lease records events on
    /// `streams`. `stacklevel` places the warnings a fallback raises.
    #[pyo3(signature = (token, location, streams, *, wait, finalizing=false, stacklevel=2))]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn release_lease(
        &self,
        py: Python<'_>,
        token: u64,
        location: &Bound<'_, PyAny>,
        streams: &Bound<'_, PyList>,
        wait: bool,
        finalizing: bool,
        stacklevel: i32,
    ) -> PyResult<()> {
        let at = self.context.location_code(py, location)?;
        let streams: Vec<Bound<'_, PyAny>> = streams.iter().collect();
        let host = Host::new(self, py);
        let released =
            (self.core).release_lease_with(&host, token, at, &streams, wait, finalizing)?;
        if released == LeaseRelease::Released {
            return Ok(());
        }
        match released.warning(&location.str()?.to_string_lossy()) {
            Some(message) => crate::lifetimes::warn(py, &message, stacklevel),
            None => Ok(()),
        }
    }

    /// Releases a host lease at once when the gate is free and nothing is queued;
    /// `False` sends the caller down the waiting path (nothing has changed then).
    fn release_host_lease_now(&self, token: u64) -> bool {
        self.release_now(LifetimeKind::Lease, token)
    }

    /// Tracks a lease object built by the glue itself, until it is released, by a weak
    /// reference whose callback finalizes it if it is collected before its release
    /// (docs/concepts/lifetimes.md#finalizers; the bookkeeping is the core's): its
    /// finalizer releases `token` at `location` on `streams` through `engine`.
    pub(crate) fn track_lease(
        &self,
        py: Python<'_>,
        token: u64,
        lease: &Bound<'_, PyAny>,
        engine: &Bound<'_, PyAny>,
        location: &Bound<'_, PyAny>,
        streams: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let finalizer = LeaseFinalizer {
            engine: engine.clone().unbind(),
            token,
            location: location.clone().unbind(),
            streams: streams.clone().unbind(),
        };
        let reference = PyWeakrefReference::new_with(lease, Bound::new(py, finalizer)?)?;
        self.keep_lease(token, reference.into_any().unbind());
        Ok(())
    }

    /// Stops tracking a lease (finalized by its own object, at exit).
    fn untrack_lease(&self, token: u64) {
        self.forget_lease(token);
    }

    /// The lease objects not yet released that are still alive, oldest first.
    fn live_leases(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        let ids = self.core.tracked_leases();
        let mut live = Vec::new();
        for reference in self.objects.objects(py, &ids) {
            let lease = reference.bind(py).call0()?;
            if !lease.is_none() {
                live.push(lease.unbind());
            }
        }
        Ok(live)
    }

    /// The managed object a lease borrows, while the lease still covers it.
    fn borrowed(
        &self,
        py: Python<'_>,
        token: u64,
        handle: &Bound<'_, PyAny>,
        location: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        crate::lifetimes::borrowed_known(self, py, token, handle, location, None)
    }

    /// Closes the manager in the core's order (docs/concepts/lifetimes.md#close); a
    /// closed manager returns at once.
    #[pyo3(signature = (*, wait, force))]
    fn close(&self, py: Python<'_>, wait: bool, force: bool) -> PyResult<()> {
        let (core, host) = (&self.core, Host::new(self, py));
        core.gated(&host, false, false, || {
            core.close_with(&host, wait, force).map(drop)
        })
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
        Ok(crate::search::ScheduleIndex(
            residency_core::ScheduleIndex::new(&resolved, discards, cyclic),
        ))
    }

    /// How many values this manager has discarded (a schedule index's validity).
    fn discard_count(&self) -> u64 {
        self.core.discards()
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
        Ok(to_py_err(py, residency_core::CoreError::Handle { message }))
    }

    /// `execute_actions` in one call: gate, checks, preflight and the "execute"
    /// phase (see `plans`).
    /// With `asynchronous`, the CUDA copies of `ensure` actions are enqueued and left
    /// in flight, each protected by its event (a prefetch).
    /// `then`, when given, is called after the phase under the same hold of the gate
    /// (see `plans`); its result is returned. `hold`, when given, is `(groups, held)`:
    /// each `(handles, location)` pair of `groups` is held first under that same hold,
    /// its token appended to the list `held` (released and taken out again when a
    /// later hold or `then` fails).
    #[pyo3(signature = (run, ir, handles, actions, transfer_streams, expected_version, *, asynchronous=false, hold=None, then=None))]
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
        hold: Option<(Bound<'_, PyTuple>, Bound<'_, PyList>)>,
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
            hold.as_ref().map(|(groups, held)| (groups, held)),
            then,
        )
    }

    /// Makes `stream`, a consumer stream joining a lease of `handles` at `at`, wait
    /// for the transfers still in flight into them (`ResidencyLease.add_consumer_stream`).
    pub(crate) fn wait_transfers(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
        stream: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        if self.core.transfer_count() == 0 {
            return Ok(());
        }
        self.with_resolved(py, handles, at, true, |host, ids, at| {
            self.core.wait_transfers_with(host, ids, at, stream)
        })
    }

    /// Host-waits for the pending leases `tokens` (and, with `transfers`, every
    /// transfer in flight) and releases them.
    #[pyo3(signature = (tokens, *, transfers=false))]
    #[allow(clippy::needless_pass_by_value)] // pyo3 extracts owned vectors.
    fn settle(&self, py: Python<'_>, tokens: Vec<u64>, transfers: bool) -> PyResult<()> {
        let (core, host) = (&self.core, Host::new(self, py));
        core.gated(&host, true, true, || {
            core.settle_with(&host, &tokens, transfers)
        })
    }

    /// Releases the pending leases among `tokens` with device-side waits of their
    /// values' owning streams; what needs a host wait is waited for with `host`, else
    /// left pending and returned (docs/concepts/controller.md#evicting-around-reads-in-flight).
    #[pyo3(signature = (tokens, *, host))]
    #[allow(clippy::needless_pass_by_value)] // pyo3 extracts owned vectors.
    fn settle_on_device(&self, py: Python<'_>, tokens: Vec<u64>, host: bool) -> PyResult<Vec<u64>> {
        let (core, runtime) = (&self.core, Host::new(self, py));
        core.gated(&runtime, true, true, || {
            core.settle_on_device_with(&runtime, &tokens, host)
        })
    }

    /// Whether bringing `handles` to `at` would block the host on a copy (from disk or
    /// pageable memory, or to the host; the core's rule,
    /// docs/concepts/controller.md#staging). Changes nothing. With `disk_deferred`, a read from disk to a
    /// device does not: the disk tier reads it on its I/O thread.
    #[pyo3(signature = (handles, at, *, disk_deferred = false))]
    fn blocks_host(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
        disk_deferred: bool,
    ) -> PyResult<bool> {
        self.with_resolved(py, handles, at, false, |host, ids, at| {
            self.core.blocks_host_with(host, ids, at, disk_deferred)
        })
    }

    /// The pending tokens of the transfers still in flight into `handles` at `at`.
    fn transfers_into(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u64>> {
        if self.core.transfer_count() == 0 {
            return Ok(Vec::new());
        }
        self.with_resolved(py, handles, at, false, |_, ids, at| {
            Ok(self.core.transfer_tokens_into(ids, at))
        })
    }

    /// The tokens among `tokens` of leases still pending on their events, after
    /// reaping the leases whose events completed.
    fn pending_among(&self, py: Python<'_>, tokens: Vec<u64>) -> PyResult<Vec<u64>> {
        let (core, host) = (&self.core, Host::new(self, py));
        core.gated(&host, true, true, || core.pending_among_with(&host, tokens))
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
        request: PyRef<'py, crate::search::LoweredRequest>,
        limit: u64,
        cuda_count: i64,
        native: Option<crate::search::NativeConfig>,
        python: Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>,
        schedule: Option<(PyRef<'py, crate::search::ScheduleIndex>, usize)>,
    ) -> PyResult<Option<crate::search::Decided>> {
        let policy = crate::search::DecidePolicy::new(native, python, schedule)?;
        crate::search::decide_request(self, py, &request, limit, cuda_count, policy)
    }

    /// A pipeline staging's decide of `request` (as `decide_request`, with a built-in
    /// policy) and, when it decided what `previous` decided, the plan that decision
    /// ran (`ir`, `handles`, `actions`) run again at once, in one hold of the gate, as
    /// `execute_plan` runs it asynchronously with `hold` and `then`; a plan that evicts
    /// runs only with `reclaim`. Returns the decision (`None` when a value was
    /// discarded since the request was lowered) and whether the plan ran; with
    /// `blocking` (whether reads from disk are deferred), `None` when the held groups'
    /// copies would block the host, checked first (see `plans::stage_request`).
    #[pyo3(signature = (request, limit, cuda_count, previous, run, ir, handles, actions, transfer_streams, hold, native, schedule=None, then=None, reclaim=false, blocking=None))]
    #[allow(clippy::too_many_arguments)] // the call's arguments, as the glue passes them
    fn stage_request<'py>(
        &self,
        py: Python<'py>,
        request: PyRef<'py, crate::search::LoweredRequest>,
        limit: u64,
        cuda_count: i64,
        previous: PyRef<'py, crate::search::Decided>,
        run: &PlanRun,
        ir: &PlanIr,
        handles: &Bound<'py, PyTuple>,
        actions: &Bound<'py, PyTuple>,
        transfer_streams: Option<&Bound<'py, PyAny>>,
        hold: (Bound<'py, PyTuple>, Bound<'py, PyList>),
        native: crate::search::NativeConfig,
        schedule: Option<(PyRef<'py, crate::search::ScheduleIndex>, usize)>,
        then: Option<&Bound<'py, PyAny>>,
        reclaim: bool,
        blocking: Option<bool>,
    ) -> PyResult<Option<(Option<crate::search::Decided>, bool)>> {
        let policy = crate::search::DecidePolicy::new(Some(native), None, schedule)?;
        let rerun = crate::plans::Rerun {
            previous: &previous,
            ir,
            handles,
            actions,
        };
        crate::plans::stage_request(
            self,
            py,
            (&request, limit, cuda_count, policy),
            &rerun,
            run,
            transfer_streams,
            (&hold.0, &hold.1),
            then,
            reclaim,
            blocking,
        )
    }

    /// A staged pipeline step's entry in one hold of the gate: the state view, a lease
    /// per `(location, handles)` group (CUDA ones on `consumers[location]`), then the
    /// staging's hold tokens, taken out of the list `holds`, released (see
    /// `step::enter_step`); with `keys`, a built-in policy's, the use's access
    /// epochs are recorded once its leases are taken.
    #[allow(clippy::too_many_arguments)] // the step's parts
    fn enter_step(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        engine: &Bound<'_, PyAny>,
        groups: &Bound<'_, PyTuple>,
        consumers: &Bound<'_, pyo3::types::PyDict>,
        holds: &Bound<'_, PyList>,
        keys: Option<PyRef<'_, crate::search::PolicyKeys>>,
    ) -> PyResult<(StateView, Py<crate::step::StepEntry>, Vec<u64>)> {
        crate::step::enter_step(slf, py, engine, groups, consumers, holds, keys.as_deref())
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
        let transitions = self.with_gate(py, false, false, || Ok(self.trace.to_vec()))?;
        // Built outside the gate: building allocates, and a collection it triggers may
        // run finalizers that release leases.
        reports(py, self.context().report_builder(py), &transitions)
    }

    /// Empties the trace; state and version are unchanged.
    fn clear_trace(&self, py: Python<'_>) -> PyResult<()> {
        self.with_gate(py, false, false, || {
            self.trace.clear();
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

    /// The state version after reaping completed CUDA leases, under the gate.
    fn checked_version(&self, py: Python<'_>) -> PyResult<u64> {
        self.core.reaped_version_with(&Host::new(self, py))
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
        let host = Host::new(self, py);
        self.core
            .snapshot_with(&host, |state| (StateView { state }, now_ns()))
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
    #[pyo3(name = "resolve")]
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

    /// The handle at `index`.
    #[pyo3(name = "handle")]
    pub(crate) fn handle_object(&self, py: Python<'_>, index: HandleId) -> PyResult<Py<PyAny>> {
        let handle = self.objects.handle(index, share(py));
        handle.ok_or_else(|| to_py_err(py, not_issued(index)))
    }

    /// The spec record of the value at `index`.
    #[pyo3(name = "spec")]
    pub(crate) fn spec_object(&self, py: Python<'_>, index: HandleId) -> PyResult<Py<PyAny>> {
        let spec = self.objects.spec(index, share(py));
        spec.ok_or_else(|| to_py_err(py, not_issued(index)))
    }

    /// The label a reservation was made with, exactly as given.
    fn label(&self, py: Python<'_>, token: u64) -> Option<Py<PyAny>> {
        self.objects.label(token, share(py))
    }
}
