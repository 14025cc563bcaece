//! The controller's decide, one call from Python per decision: under one hold of the
//! gate it reaps, reads the state, searches, builds the plan's core IR and simulates it
//! (the explanation), so the glue never lowers the plan's records again. The built-in
//! policies run natively; any other policy is the application's Python object,
//! consulted through two callables the glue provides (one ordering per candidate list,
//! one tier list per location), as the search reaches them.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::{Arc, Mutex, PoisonError};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use residency_core::keys::KeyStore;
use residency_core::search::{Candidate, SearchError, SearchPolicy};
use residency_core::{
    CudaDevices, DecideFailure, Decision, EvictionRow, HandleId, Location, NativePolicy, Row,
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

/// A schedule's steps as handle indices of one manager, resolved once
/// (`CoreManager.schedule_index`) and valid until the manager next discards a value:
/// each handle's steps are kept sorted, so a decide finds a next use from its
/// position by a binary search (docs/concepts/controller.md#schedule-aware-eviction).
#[pyclass(frozen, module = "fhelium._core", name = "ScheduleIndex")]
#[derive(Debug)]
pub struct ScheduleIndex(pub residency_core::ScheduleIndex);

/// The built-in policies' keys by handle index and their orders, kept by the
/// controller as they change (`residency_core::keys::KeyStore`).
#[pyclass(frozen, module = "fhelium._core", name = "PolicyKeys")]
#[derive(Debug, Default)]
pub struct PolicyKeys {
    pub(crate) keys: Mutex<KeyStore>,
}

impl PolicyKeys {
    fn lock(&self) -> std::sync::MutexGuard<'_, KeyStore> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A use's access record under one lock (`KeyStore::record_use`).
    pub(crate) fn record_use(&self, indices: impl Iterator<Item = u32>) {
        self.lock().record_use(indices);
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

    /// Takes the next access epoch: one use's, for the values it records itself.
    fn next_epoch(&self) -> i64 {
        self.lock().next_epoch()
    }

    /// Sets the priority and stable key of the value at handle index `index`.
    #[pyo3(signature = (index, priority, key=None))]
    fn set_metadata(&self, index: u32, priority: i64, key: Option<&str>) {
        self.lock().set_metadata(index, priority, key);
    }
}

#[pymethods]
impl ScheduleIndex {
    /// The manager's discard count the handles were resolved at.
    #[getter]
    fn discards(&self) -> u64 {
        self.0.discards
    }
}

/// What a decide returns (`CoreManager.decide_request`): the core's [`Decision`], built
/// once; the glue reads what it needs (the plan's IR, its rows, the simulation) when a
/// record built from them is first read
/// (docs/concepts/controller.md#decisions-and-evictions).
#[pyclass(frozen, module = "fhelium._core", name = "Decided")]
#[derive(Debug)]
pub struct Decided(Decision);

impl Deref for Decided {
    type Target = Decision;

    fn deref(&self) -> &Decision {
        &self.0
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
        self.0.reclaim_rows()
    }

    /// The enter actions as rows ([`Row`]).
    fn enter_rows(&self) -> Vec<Row> {
        self.0.enter_rows()
    }

    /// The evictions as `(reclaim position, rank, released location code, released
    /// bytes, reason)`.
    fn eviction_rows(&self) -> Vec<EvictionRow> {
        self.0.eviction_rows()
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
pub struct LoweredRequest(residency_core::LoweredRequest);

impl Deref for LoweredRequest {
    type Target = residency_core::LoweredRequest;

    fn deref(&self) -> &residency_core::LoweredRequest {
        &self.0
    }
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
        residency_core::LoweredRequest::new(discards, rows, name, reservations, labels)
            .map(Self)
            .map_err(|err| PyValueError::new_err(err.to_string()))
    }
}

/// The fallback tiers by location, converted once per policy (`_decider`): a decide
/// shares them.
#[pyclass(frozen, module = "fhelium._core", name = "TierTable")]
#[derive(Debug)]
pub struct TierTable {
    pub(crate) tiers: BTreeMap<Location, Vec<Location>>,
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
/// currency, then the core's decide (`Manager::decide_native`, `Manager::decide_with`).
pub(crate) fn decide_held(
    manager: &CoreManager,
    py: Python<'_>,
    request: &LoweredRequest,
    limit: u64,
    cuda_count: i64,
    policy: DecidePolicy<'_>,
) -> PyResult<Option<Decided>> {
    crate::lifetimes::reap(manager, py)?;
    let core = manager.core();
    let schedule_discards = match &policy {
        DecidePolicy::Native(_, Some((index, _))) => Some(index.0.discards),
        _ => None,
    };
    if !core.is_current(&request.0, schedule_discards) {
        return Ok(None);
    }
    let completed = crate::lifetimes::completed_pending(manager, py);
    let cuda = u32::try_from(cuda_count).map_or(CudaDevices::Unavailable, CudaDevices::Count);
    let mut error: Option<PyErr> = None;
    let decided = match policy {
        DecidePolicy::Native(config, schedule) => {
            let keys = config.0.get();
            let native = NativePolicy {
                keys: &keys.keys,
                tiers: &config.1.get().tiers,
                schedule: schedule
                    .as_ref()
                    .map(|(index, position)| (&index.0, *position)),
            };
            // Ctrl-C is still honoured during long searches.
            let mut interrupted = || match py.check_signals() {
                Ok(()) => false,
                Err(err) => {
                    error.get_or_insert(err);
                    true
                }
            };
            core.decide_native(
                &request.0,
                limit,
                cuda,
                &completed,
                native,
                &mut interrupted,
            )
        }
        DecidePolicy::Python(order, fallbacks) => {
            let mut policy = PythonPolicy {
                py,
                order,
                fallbacks,
                error: None,
            };
            let decided = core.decide_with(&request.0, limit, cuda, &completed, &mut policy);
            error = policy.error;
            decided
        }
    };
    // A policy's own error (or an interrupt) is raised as it was raised.
    if let Some(err) = error {
        return Err(err);
    }
    match decided {
        Ok(decision) => Ok(Some(Decided(decision))),
        Err(DecideFailure::NotLive(value)) => Err(PyValueError::new_err(format!(
            "handle index {value} is not live"
        ))),
        Err(DecideFailure::Refused(err)) => Err(to_py_err(py, err)),
    }
}

/// The built-in policy's configuration: the controller's keys and the fallback tiers.
#[derive(Debug, FromPyObject)]
pub struct NativeConfig(pub Py<PolicyKeys>, pub Py<TierTable>);
