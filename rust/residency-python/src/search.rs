//! The controller's search, called from Python: the built-in tiered LRU runs natively;
//! any other policy is reached through two Python callables the glue provides.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use residency_core::Location;
use residency_core::search::{
    Candidate, Planned, Requirement, Search, SearchError, SearchOutcome, SearchPolicy, TieredLru,
};

use crate::errors::to_py_err;
use crate::kinds::PyActionKind;
use crate::manager::CoreManager;

fn location(code: u32) -> PyResult<Location> {
    Location::from_code(code).map_err(|err| PyValueError::new_err(err.to_string()))
}

/// A Python policy: `order(rows) -> list[int]` over `(handle, code, charged)` rows and
/// `fallbacks(code) -> list[int]`. The first Python error is kept to re-raise as is.
struct PythonPolicy<'py> {
    py: Python<'py>,
    order: Bound<'py, PyAny>,
    fallbacks: Bound<'py, PyAny>,
    handles: Vec<u32>,
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
                    self.handles[candidate.value],
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

/// The native policy, with Ctrl-C still honoured during long searches.
struct NativePolicy<'py> {
    py: Python<'py>,
    lru: TieredLru,
    error: Option<PyErr>,
}

impl SearchPolicy for NativePolicy<'_> {
    fn order(&mut self, candidates: &[Candidate]) -> Result<Vec<usize>, SearchError> {
        self.lru.order(candidates)
    }

    fn fallback_locations(&mut self, at: Location) -> Result<Vec<Location>, SearchError> {
        self.lru.fallback_locations(at)
    }

    fn global_order(
        &mut self,
        values: &[residency_core::search::SearchValue],
    ) -> Option<Vec<usize>> {
        self.lru.global_order(values)
    }

    fn check_interrupt(&mut self) -> Result<(), SearchError> {
        self.py.check_signals().map_err(|err| {
            self.error.get_or_insert(err);
            SearchError::Interrupted
        })
    }
}

type Row = (PyActionKind, u32, u32, i64);
type EvictionRow = (usize, usize, u32, u64, String);
/// `(reclaim, enter, evictions, explored_states, state_version)`.
type Decision = (Vec<Row>, Vec<Row>, Vec<EvictionRow>, u64, u64);

/// The controller's search for the request named `request_name`: the plan's rows
/// (see `encode`), or the failure raised, the search's own as its core error and a
/// Python policy's as the policy raised it.
#[pyfunction]
#[pyo3(signature = (
    manager, request_name, requirements, reservations, limit, native=None, python=None
))]
#[allow(clippy::too_many_arguments, clippy::needless_pass_by_value)] // pyo3 extracts owned values.
pub fn decide_request<'py>(
    py: Python<'py>,
    manager: &CoreManager,
    request_name: &str,
    requirements: Vec<(u32, u32)>,
    reservations: Vec<(u32, u64)>,
    limit: u64,
    native: Option<NativeConfig>,
    python: Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>,
) -> PyResult<Decision> {
    search(
        py,
        manager,
        request_name,
        requirements,
        reservations,
        limit,
        native,
        python,
    )
}

#[allow(clippy::too_many_arguments)]
fn search<'py>(
    py: Python<'py>,
    manager: &CoreManager,
    request_name: &str,
    requirements: Vec<(u32, u32)>,
    reservations: Vec<(u32, u64)>,
    limit: u64,
    native: Option<NativeConfig>,
    python: Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>,
) -> PyResult<Decision> {
    let inputs = manager.core().search_inputs();
    let mut required = Vec::with_capacity(requirements.len());
    for (handle, code) in requirements {
        let Some(&value) = inputs.positions.get(&handle) else {
            return Err(PyValueError::new_err(format!(
                "handle index {handle} is not live"
            )));
        };
        required.push(Requirement {
            value,
            location: location(code)?,
        });
    }
    let reservations = reservations
        .into_iter()
        .map(|(code, nbytes)| Ok((location(code)?, nbytes)))
        .collect::<PyResult<Vec<_>>>()?;
    let handles: Vec<u32> = inputs.values.iter().map(|value| value.handle).collect();
    let (result, error) = if let Some(config) = native {
        let mut lru = TieredLru {
            keys: Vec::with_capacity(inputs.values.len()),
            registration: inputs
                .values
                .iter()
                .map(|value| value.registration_index)
                .collect(),
            tiers: BTreeMap::new(),
        };
        for value in &inputs.values {
            let (priority, key) = config.0.get(&value.handle).cloned().unwrap_or((0, None));
            let epoch = config.1.get(&value.handle).copied().unwrap_or(-1);
            lru.keys.push((priority, epoch, key.map(Arc::from)));
        }
        for (source, destinations) in config.2 {
            lru.tiers.insert(
                location(source)?,
                destinations
                    .into_iter()
                    .map(location)
                    .collect::<PyResult<Vec<_>>>()?,
            );
        }
        let mut policy = NativePolicy {
            py,
            lru,
            error: None,
        };
        let search = Search::new(
            &inputs.values,
            &inputs.budgets,
            &required,
            &reservations,
            &mut policy,
            limit,
        );
        let result = search.run(&inputs.books);
        (result, policy.error)
    } else if let Some((order, fallbacks)) = python {
        let mut policy = PythonPolicy {
            py,
            order,
            fallbacks,
            handles: handles.clone(),
            error: None,
        };
        let search = Search::new(
            &inputs.values,
            &inputs.budgets,
            &required,
            &reservations,
            &mut policy,
            limit,
        );
        let result = search.run(&inputs.books);
        (result, policy.error)
    } else {
        return Err(PyValueError::new_err("decide needs a policy"));
    };
    if let Some(err) = error {
        return Err(err);
    }
    match result {
        Ok(outcome) => Ok(encode(&outcome, &handles, inputs.version)),
        Err(err) => {
            let err = err.into_core_error(request_name, limit, |value| {
                let handle = inputs.values.get(value)?.handle;
                let state = manager.core().current();
                Some(state.record(handle)?.handle_id.to_string())
            });
            Err(to_py_err(py, err))
        }
    }
}

/// A found plan as the glue's rows: actions as `(kind, handle, location code, from
/// code or -1)`, evictions as `(reclaim position, rank, released location code,
/// released bytes, reason)`.
fn encode(outcome: &SearchOutcome, handles: &[u32], version: u64) -> Decision {
    let planned = |action: &Planned| -> Row {
        let kind = action.kind().into();
        match *action {
            Planned::Ensure { value, location } | Planned::Drop { value, location } => {
                (kind, handles[value], location.code(), -1)
            }
            Planned::Move { value, to, from } => (
                kind,
                handles[value],
                to.code(),
                from.map_or(-1, |from| i64::from(from.code())),
            ),
        }
    };
    let evictions = outcome
        .evictions
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
        .collect();
    (
        outcome.reclaim.iter().map(planned).collect(),
        outcome.enter.iter().map(planned).collect(),
        evictions,
        outcome.explored,
        version,
    )
}

/// The built-in policy's configuration: per handle index `(priority, stable key)`,
/// per handle index the last access epoch, and the fallback tiers by location code.
#[derive(Debug, Clone, FromPyObject)]
pub struct NativeConfig(
    pub HashMap<u32, (i64, Option<String>)>,
    pub HashMap<u32, i64>,
    pub Vec<(u32, Vec<u32>)>,
);
