//! The controller's decide, one call from Python per decision: under one hold of the
//! gate it reaps, reads the state, searches, builds the plan's core IR and simulates it
//! (the explanation), so the glue never lowers the plan's records again. The built-in
//! policies run natively; any other policy is the application's Python object,
//! consulted through two callables the glue provides (one ordering per candidate list,
//! one tier list per location), as the search reaches them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use residency_core::keys::KeyStore;
use residency_core::search::{
    Candidate, Eviction, IndexedLru, IndexedSchedule, NextUses, PolicyKeyMap, Requirement,
    ScheduleAware, Search, SearchError, SearchOutcome, SearchPolicy, TieredLru,
};
use residency_core::{
    Action, ActionKind, CudaDevices, HandleId, Location, Plan, Reservation, SearchInputs,
    Simulation, SlotResolution,
};

use crate::errors::to_py_err;
use crate::manager::{CoreManager, SimulationView};
use crate::plan::PlanIr;

fn location(code: u32) -> PyResult<Location> {
    Location::from_code(code).map_err(|err| PyValueError::new_err(err.to_string()))
}

/// A Python policy: `order(rows) -> list[int]` over `(handle, code, charged)` rows and
/// `fallbacks(code) -> list[int]`. The first Python error is kept to re-raise as is.
/// Search positions are handle indices (see `Manager::search_inputs`).
struct PythonPolicy<'py> {
    py: Python<'py>,
    order: Bound<'py, PyAny>,
    fallbacks: Bound<'py, PyAny>,
    error: Option<PyErr>,
}

impl PythonPolicy<'_> {
    fn fail(&mut self, err: PyErr) -> SearchError {
        self.error.get_or_insert(err);
        SearchError::Policy
    }
}

impl SearchPolicy for PythonPolicy<'_> {
    fn order(&mut self, candidates: &[Candidate]) -> Result<Vec<usize>, SearchError> {
        let rows: Vec<(u32, u32, u64)> = candidates
            .iter()
            .map(|candidate| {
                (
                    u32::try_from(candidate.value).unwrap_or(u32::MAX),
                    candidate.location.code(),
                    candidate.charged,
                )
            })
            .collect();
        match self
            .order
            .call1((rows,))
            .and_then(|order| order.extract::<Vec<usize>>())
        {
            Ok(order) => Ok(order),
            Err(err) => Err(self.fail(err)),
        }
    }

    fn fallback_locations(&mut self, at: Location) -> Result<Vec<Location>, SearchError> {
        let codes = match self
            .fallbacks
            .call1((at.code(),))
            .and_then(|codes| codes.extract::<Vec<u32>>())
        {
            Ok(codes) => codes,
            Err(err) => return Err(self.fail(err)),
        };
        codes
            .into_iter()
            .map(|code| location(code).map_err(|err| self.fail(err)))
            .collect()
    }

    fn check_interrupt(&mut self) -> Result<(), SearchError> {
        match self.py.check_signals() {
            Ok(()) => Ok(()),
            Err(err) => {
                self.error.get_or_insert(err);
                Err(SearchError::Interrupted)
            }
        }
    }
}

/// A native policy, with Ctrl-C still honoured during long searches.
struct NativePolicy<'py, P> {
    py: Python<'py>,
    policy: P,
    error: Option<PyErr>,
}

impl<P: SearchPolicy> SearchPolicy for NativePolicy<'_, P> {
    fn order(&mut self, candidates: &[Candidate]) -> Result<Vec<usize>, SearchError> {
        self.policy.order(candidates)
    }

    fn fallback_locations(&mut self, at: Location) -> Result<Vec<Location>, SearchError> {
        self.policy.fallback_locations(at)
    }

    fn sync_residents(
        &mut self,
        location: Location,
        residents: Option<&residency_core::victims::ResidentSet>,
    ) -> Option<usize> {
        self.policy.sync_residents(location, residents)
    }

    fn next_resident(&self, location: Location, after: Option<usize>) -> Option<usize> {
        self.policy.next_resident(location, after)
    }

    fn compare(&self, left: usize, right: usize) -> std::cmp::Ordering {
        self.policy.compare(left, right)
    }

    fn check_interrupt(&mut self) -> Result<(), SearchError> {
        self.py.check_signals().map_err(|err| {
            self.error.get_or_insert(err);
            SearchError::Interrupted
        })
    }
}

/// Runs the search with `policy`; returns its result and the first Python error the
/// policy met.
fn search_with<P: SearchPolicy>(
    inputs: &SearchInputs,
    required: &[Requirement],
    searched: &[(Location, u64)],
    limit: u64,
    policy: &mut P,
) -> Result<SearchOutcome, SearchError> {
    let search = Search::new(
        &inputs.values,
        &inputs.budgets,
        required,
        searched,
        policy,
        limit,
    );
    search.run(&inputs.books)
}

/// A schedule's steps as handle indices of one manager, resolved once
/// (`CoreManager.schedule_index`) and valid until the manager next discards a value:
/// each handle's steps are kept sorted, so a decide finds a next use from its
/// position by a binary search (docs/concepts/controller.md#schedule-aware-eviction).
#[pyclass(frozen, module = "fhelium._core", name = "ScheduleIndex")]
#[derive(Debug)]
pub struct ScheduleIndex {
    uses: NextUses,
    len: usize,
    discards: u64,
}

impl ScheduleIndex {
    /// The index of `steps`, one pass of them or, `cyclic`, repeated forever.
    pub fn new(steps: &[Vec<usize>], discards: u64, cyclic: bool) -> Self {
        Self {
            uses: if cyclic {
                NextUses::cyclic(steps)
            } else {
                NextUses::new(steps)
            },
            len: steps.len(),
            discards,
        }
    }
}

/// The built-in policies' keys by handle index and their orders, kept by the
/// controller as they change (`residency_core::keys::KeyStore`).
#[pyclass(frozen, module = "fhelium._core", name = "PolicyKeys")]
#[derive(Debug, Default)]
pub struct PolicyKeys {
    keys: Mutex<KeyStore>,
}

impl PolicyKeys {
    fn lock(&self) -> std::sync::MutexGuard<'_, KeyStore> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets the last access epoch of each value at `indices` (one lock).
    pub(crate) fn set_epochs(&self, indices: impl Iterator<Item = u32>, epoch: i64) {
        let mut keys = self.lock();
        for index in indices {
            keys.set_epoch(index, epoch);
        }
    }
}

#[pymethods]
impl PolicyKeys {
    #[new]
    fn py_new() -> Self {
        Self::default()
    }

    /// Sets the last access epoch of the value at handle index `index`.
    fn set_epoch(&self, index: u32, epoch: i64) {
        self.lock().set_epoch(index, epoch);
    }

    /// Sets the priority and stable key of the value at handle index `index`.
    #[pyo3(signature = (index, priority, key=None))]
    fn set_metadata(&self, index: u32, priority: i64, key: Option<&str>) {
        self.lock().set_metadata(index, priority, key);
    }

    /// The values with keys.
    fn __len__(&self) -> usize {
        self.lock().len()
    }
}

#[pymethods]
impl ScheduleIndex {
    /// The manager's discard count the handles were resolved at.
    #[getter]
    fn discards(&self) -> u64 {
        self.discards
    }

    /// Whether the schedule repeats: past its last step, its first step comes next.
    #[getter]
    fn cyclic(&self) -> bool {
        self.uses.is_cyclic()
    }

    fn __len__(&self) -> usize {
        self.len
    }
}

/// `(kind code, plan handle slot, location code, from code or -1)`; the kind codes are
/// [`kind_code`]'s.
pub type Row = (u8, u32, u32, i64);
pub type EvictionRow = (usize, usize, u32, u64, String);

/// An action kind as a decided plan's rows name it: 0 ensure, 1 move, 2 drop, 3 discard
/// (small integers, so reading a row builds no object).
fn kind_code(kind: ActionKind) -> u8 {
    match kind {
        ActionKind::Ensure => 0,
        ActionKind::Move => 1,
        ActionKind::Drop => 2,
        ActionKind::Discard => 3,
    }
}

/// What a decide returns (`CoreManager.decide_request`): the decided plan, its
/// simulation, each plan slot's handle index and the search's evictions, kept as the
/// core's data. A decide builds this one object; the glue reads what it needs (the
/// plan's IR, its rows, the simulation) when a record built from them is first read
/// (docs/concepts/controller.md#decisions-and-evictions).
#[pyclass(frozen, module = "fhelium._core", name = "Decided")]
#[derive(Debug)]
pub struct Decided {
    plan: Arc<Plan>,
    simulation: Simulation,
    slots: Vec<HandleId>,
    evictions: Vec<Eviction>,
    explored: u64,
    version: u64,
    /// The CUDA devices its simulation checked locations against.
    cuda: CudaDevices,
    /// Whether its simulation counted pending leases whose events completed as released.
    set_aside: bool,
}

impl Decided {
    /// Its slots as a run's resolutions, where its simulation is what a run's preflight
    /// of its plan would simulate now, under the same hold of the gate: feasible, with
    /// the CUDA devices `cuda`, no reservation (so no label), no completed lease counted
    /// as released; else `None`.
    /// `ir` is the plan a run runs: its actions, in order, must be this plan's, slot for
    /// slot (so its slot `k` names this plan's slot `k`'s value), and its slots as many.
    /// Without reservations a simulation is the actions in order, whichever phase holds
    /// them (a staging's run keeps them all in one).
    pub(crate) fn preflighted(
        &self,
        ir: &Plan,
        cuda: CudaDevices,
    ) -> Option<Arc<[SlotResolution]>> {
        (self.simulation.feasible
            && !self.set_aside
            && self.cuda == cuda
            && self.plan.reservations().is_empty()
            && ir.reservations().is_empty()
            && ir.exit().is_empty()
            && self.plan.exit().is_empty()
            && ir.handles().len() == self.slots.len()
            && ir
                .ordered_actions()
                .map(|(_, _, action)| action)
                .eq(self.plan.ordered_actions().map(|(_, _, action)| action)))
        .then(|| self.slots.iter().copied().map(Ok).collect())
    }

    /// Whether this decision runs as `previous` ran: feasible, the same actions on the
    /// same slots, and evicting nothing unless `reclaim` allows it.
    pub(crate) fn runs_as(&self, previous: &Self, reclaim: bool) -> bool {
        self.simulation.feasible
            && self.same_as(previous)
            && (reclaim || self.plan.reclaim().is_empty())
    }

    /// The same actions as `other`'s, on the same slots.
    fn same_as(&self, other: &Self) -> bool {
        self.slots == other.slots
            && self.plan.reclaim() == other.plan.reclaim()
            && self.plan.enter() == other.plan.enter()
    }
}

#[pymethods]
impl Decided {
    /// Whether the decided plan's simulation is feasible.
    #[getter]
    fn feasible(&self) -> bool {
        self.simulation.feasible
    }

    /// Why it is not, if it is not.
    #[getter]
    fn reason(&self) -> Option<&str> {
        self.simulation.reason.as_deref()
    }

    /// The search states explored.
    #[getter]
    fn explored(&self) -> u64 {
        self.explored
    }

    /// The state version decided on.
    #[getter]
    fn state_version(&self) -> u64 {
        self.version
    }

    /// Whether the plan has no action (the request is satisfied as the state stands).
    #[getter]
    fn empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The plan's core IR (a new view of the same plan on each call).
    fn ir(&self) -> PlanIr {
        PlanIr::shared(Arc::clone(&self.plan))
    }

    /// The plan's simulation.
    fn simulation(&self) -> SimulationView {
        SimulationView::new(self.simulation.clone())
    }

    /// The handle index of each plan slot.
    fn slots(&self) -> Vec<HandleId> {
        self.slots.clone()
    }

    /// The reclaim actions as rows ([`Row`]).
    fn reclaim_rows(&self) -> Vec<Row> {
        rows(self.plan.reclaim())
    }

    /// The enter actions as rows ([`Row`]).
    fn enter_rows(&self) -> Vec<Row> {
        rows(self.plan.enter())
    }

    /// The evictions as `(reclaim position, rank, released location code, released
    /// bytes, reason)`.
    fn eviction_rows(&self) -> Vec<EvictionRow> {
        eviction_rows(&self.evictions)
    }

    /// Whether `other` decided the same actions on the same handle indices (so records
    /// built for one serve the other).
    fn same_actions(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<Self>()
            .is_ok_and(|other| self.same_as(other.get()))
    }
}

/// A request as the glue lowers it (`_decider._lowered`), converted once and kept per
/// request object: the manager's discard count when its handles were resolved, its
/// requirements by handle index, its name, its reservations and their labels as
/// `simulate` takes them. A decide reads it without converting anything again.
#[pyclass(frozen, module = "fhelium._core", name = "LoweredRequest")]
#[derive(Debug)]
pub struct LoweredRequest {
    discards: u64,
    requirements: Vec<Requirement>,
    /// Shared with every plan decided for it (no copy per decide).
    name: Arc<str>,
    reservations: Vec<Reservation>,
    /// The reservations as the search takes them.
    searched: Vec<(Location, u64)>,
    labels: Vec<String>,
}

#[pymethods]
impl LoweredRequest {
    /// From the `(handle index, location code)` rows, the name, the `(code, nbytes,
    /// label)` reservations and the labels `simulate` reports.
    #[new]
    fn py_new(
        discards: u64,
        rows: Vec<(u32, u32)>,
        name: String,
        reservations: Vec<(u32, u64, String)>,
        labels: Vec<String>,
    ) -> PyResult<Self> {
        let requirements = rows
            .into_iter()
            .map(|(handle, code)| {
                Ok(Requirement {
                    value: handle as usize,
                    location: location(code)?,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let reservations = reservations
            .into_iter()
            .map(|(code, nbytes, label)| {
                Ok(Reservation {
                    location: location(code)?,
                    nbytes,
                    label: Arc::from(label),
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let searched = reservations
            .iter()
            .map(|reservation| (reservation.location, reservation.nbytes))
            .collect();
        Ok(Self {
            discards,
            requirements,
            name: Arc::from(name),
            reservations,
            searched,
            labels,
        })
    }

    /// The manager's discard count when the handles were resolved.
    #[getter]
    fn discards(&self) -> u64 {
        self.discards
    }
}

/// The fallback tiers by location, converted once per policy (`_decider`): a decide
/// shares them.
#[pyclass(frozen, module = "fhelium._core", name = "TierTable")]
#[derive(Debug)]
pub struct TierTable {
    tiers: BTreeMap<Location, Vec<Location>>,
}

#[pymethods]
impl TierTable {
    /// From `(source code, [destination codes])` rows.
    #[new]
    fn py_new(rows: Vec<(u32, Vec<u32>)>) -> PyResult<Self> {
        let mut tiers = BTreeMap::new();
        for (source, destinations) in rows {
            tiers.insert(
                location(source)?,
                destinations
                    .into_iter()
                    .map(location)
                    .collect::<PyResult<Vec<_>>>()?,
            );
        }
        Ok(Self { tiers })
    }
}

/// The policy a decide consults: the built-in tiered LRU's configuration, with the
/// schedule-aware policy's index and position; or a Python policy's two callables.
pub enum DecidePolicy<'py> {
    Native(NativeConfig, Option<(PyRef<'py, ScheduleIndex>, usize)>),
    Python(Bound<'py, PyAny>, Bound<'py, PyAny>),
}

impl<'py> DecidePolicy<'py> {
    /// The policy from `decide_request`'s keywords: exactly one of them.
    pub fn new(
        native: Option<NativeConfig>,
        python: Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>,
        schedule: Option<(PyRef<'py, ScheduleIndex>, usize)>,
    ) -> PyResult<Self> {
        match (native, python) {
            (Some(config), None) => Ok(Self::Native(config, schedule)),
            (None, Some((order, fallbacks))) => Ok(Self::Python(order, fallbacks)),
            _ => Err(PyValueError::new_err("decide needs one policy")),
        }
    }
}

/// The controller's decide for one lowered request (`CoreManager.decide_request`), in
/// one call under one hold of the gate (docs/concepts/controller.md#decide): queued
/// releases and completed CUDA leases are reaped and the state version is read; then
/// the search, the plan's core IR and its simulation run against that state, with the
/// pending leases whose events completed (which no longer protect). `cuda_count` is -1
/// without CUDA. Returns `None`, having decided nothing, when a value was discarded
/// since the request (or the schedule index) was resolved: the glue resolves them
/// again. The search's failures raise as their core errors, a Python policy's as the
/// policy raised them.
pub fn decide_request(
    manager: &CoreManager,
    py: Python<'_>,
    request: &LoweredRequest,
    limit: u64,
    cuda_count: i64,
    policy: DecidePolicy<'_>,
) -> PyResult<Option<Decided>> {
    manager.with_gate(py, true, true, || {
        decide_held(manager, py, request, limit, cuda_count, policy)
    })
}

/// [`decide_request`] once the gate is held: the reap, the request's and schedule's
/// currency, then the decide.
pub(crate) fn decide_held(
    manager: &CoreManager,
    py: Python<'_>,
    request: &LoweredRequest,
    limit: u64,
    cuda_count: i64,
    policy: DecidePolicy<'_>,
) -> PyResult<Option<Decided>> {
    crate::lifetimes::reap(manager, py)?;
    let current = manager.core().discards();
    let stale_schedule = matches!(
        &policy,
        DecidePolicy::Native(_, Some((index, _))) if index.discards != current
    );
    if request.discards != current || stale_schedule {
        return Ok(None);
    }
    let version = manager.core().version();
    let completed = crate::lifetimes::completed_pending(manager, py);
    decide_locked(
        py, manager, version, request, limit, cuda_count, &completed, policy,
    )
    .map(Some)
}

/// [`decide_request`]'s work once the gate is held and the request is current.
#[allow(clippy::too_many_arguments)]
fn decide_locked(
    py: Python<'_>,
    manager: &CoreManager,
    version: u64,
    request: &LoweredRequest,
    limit: u64,
    cuda_count: i64,
    completed_leases: &[u64],
    policy: DecidePolicy<'_>,
) -> PyResult<Decided> {
    let request_name: &str = &request.name;
    let core = manager.core();
    let inputs = core.search_inputs();
    for requirement in &request.requirements {
        if !inputs.values.is_live(requirement.value) {
            return Err(PyValueError::new_err(format!(
                "handle index {} is not live",
                requirement.value
            )));
        }
    }
    let required = request.requirements.as_slice();
    let searched = request.searched.as_slice();
    let (result, error) = match policy {
        DecidePolicy::Native(config, schedule) => {
            native_search(py, &config, schedule, &inputs, required, searched, limit)
        }
        DecidePolicy::Python(order, fallbacks) => {
            let mut policy = PythonPolicy {
                py,
                order,
                fallbacks,
                error: None,
            };
            let result = search_with(&inputs, required, searched, limit, &mut policy);
            (result, policy.error)
        }
    };
    if let Some(err) = error {
        return Err(err);
    }
    let outcome = match result {
        Ok(outcome) => outcome,
        Err(err) => {
            let err = err.into_core_error(request_name, limit, |value| {
                let state = core.current();
                let handle = HandleId::try_from(value).ok()?;
                Some(state.record(handle)?.handle_id.to_string())
            });
            return Err(to_py_err(py, err));
        }
    };
    let (plan, slots) = core
        .decided_plan(&request.name, &outcome, request.reservations.clone())
        .map_err(|err| to_py_err(py, err))?;
    let resolutions: Vec<SlotResolution> = slots.iter().copied().map(Ok).collect();
    let cuda = u32::try_from(cuda_count).map_or(CudaDevices::Unavailable, CudaDevices::Count);
    let simulation = core.simulate(&plan, &resolutions, cuda, completed_leases, &request.labels);
    Ok(Decided {
        plan: Arc::new(plan),
        simulation,
        slots,
        evictions: outcome.evictions,
        explored: outcome.explored,
        version,
        cuda,
        set_aside: !completed_leases.is_empty(),
    })
}

/// The search with a native policy: the tiered LRU, or the schedule-aware policy when
/// a schedule index and position are given (current: [`decide_request`] checked it);
/// the first Python error comes back too.
fn native_search(
    py: Python<'_>,
    config: &NativeConfig,
    schedule: Option<(PyRef<'_, ScheduleIndex>, usize)>,
    inputs: &SearchInputs,
    required: &[Requirement],
    searched: &[(Location, u64)],
    limit: u64,
) -> (Result<SearchOutcome, SearchError>, Option<PyErr>) {
    let Some((index, position)) = schedule else {
        // The tiered LRU walks the order of the residents the controller keeps with its
        // keys, and hands it back synced.
        let keys = config.0.get();
        let (map, mut order) = keys.lock().take_order();
        let mut native = NativePolicy {
            py,
            policy: IndexedLru {
                lru: tiered_lru(map, config),
                order: &mut order,
            },
            error: None,
        };
        let result = search_with(inputs, required, searched, limit, &mut native);
        let error = native.error;
        keys.lock().put_order(order);
        return (result, error);
    };
    // The schedule-aware policy (docs/concepts/controller.md#schedule-aware-eviction),
    // walking its order of the residents, kept with the keys and standing at this step.
    let keys = config.0.get();
    let (map, mut order) = keys.lock().take_schedule_order();
    let mut native = NativePolicy {
        py,
        policy: IndexedSchedule {
            policy: ScheduleAware {
                lru: tiered_lru(map, config),
                next_use: index.uses.at(position),
            },
            order: &mut order,
        },
        error: None,
    };
    let result = search_with(inputs, required, searched, limit, &mut native);
    let error = native.error;
    keys.lock().put_schedule_order(order);
    (result, error)
}

/// The built-in policy from the controller's keys as they stand (shared) and the
/// configuration's fallback tiers.
fn tiered_lru(keys: Arc<PolicyKeyMap>, config: &NativeConfig) -> TieredLru {
    TieredLru {
        keys,
        tiers: config.1.get().tiers.clone(),
    }
}

/// Evictions as `(reclaim position, rank, released location code, released bytes,
/// reason)`.
fn eviction_rows(evictions: &[Eviction]) -> Vec<EvictionRow> {
    evictions
        .iter()
        .enumerate()
        .map(|(index, eviction)| {
            (
                index,
                eviction.rank,
                eviction.released_location.code(),
                eviction.released_nbytes,
                eviction.reason.text(),
            )
        })
        .collect()
}

/// A decided plan's actions as the glue's rows, to build its records from when read.
fn rows(actions: &[Action]) -> Vec<Row> {
    actions
        .iter()
        .map(|action| {
            let slot = action.handle().0;
            let (kind, code, from) = match *action {
                Action::Ensure { location, .. } => (ActionKind::Ensure, location.code(), None),
                Action::Drop { location, .. } => (ActionKind::Drop, location.code(), None),
                Action::Move { to, from, .. } => (ActionKind::Move, to.code(), from),
                // A decided plan has no discard; the row shape still names it.
                Action::Discard { .. } => (ActionKind::Discard, 0, None),
            };
            let from = from.map_or(-1, |from| i64::from(from.code()));
            (kind_code(kind), slot, code, from)
        })
        .collect()
}

/// The built-in policy's configuration: the controller's keys and the fallback tiers.
#[derive(Debug, FromPyObject)]
pub struct NativeConfig(pub Py<PolicyKeys>, pub Py<TierTable>);
