//! The one table from core error variants to the classes in `fhelium.errors`.
//!
//! The classes are defined in Python (documented, picklable, typed); this module
//! imports them once per interpreter and builds instances with their fields.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};
use pyo3::{IntoPyObjectExt, PyTypeInfo};
use residency_core::{CoreError, Location, PlanPhase};

pyo3::import_exception!(fhelium.errors, ResidencyHandleError);
pyo3::import_exception!(fhelium.errors, ResidencyUnavailableError);
pyo3::import_exception!(fhelium.errors, ResidencyBudgetError);
pyo3::import_exception!(fhelium.errors, ResidencyInUseError);
pyo3::import_exception!(fhelium.errors, ResidencyLifetimeClosedError);
pyo3::import_exception!(fhelium.errors, ResidencyMaterializationError);
pyo3::import_exception!(fhelium.errors, ResidencyOwnershipError);
pyo3::import_exception!(fhelium.errors, ResidencyPlanError);
pyo3::import_exception!(fhelium.errors, ResidencyStaleStateError);
pyo3::import_exception!(fhelium.errors, ResidencySearchLimitError);
pyo3::import_exception!(fhelium.errors, ResidencyReentrancyError);
pyo3::import_exception!(fhelium.errors, ResidencyClosedError);

/// Keyword fields of a structured exception.
type Fields<'py> = Vec<(&'static str, Bound<'py, PyAny>)>;

/// Instantiates `class(*args, **fields)`; a failure to build becomes the raised error.
fn structured<'py>(
    py: Python<'py>,
    class: &Bound<'py, PyType>,
    args: Vec<Bound<'py, PyAny>>,
    fields: impl FnOnce() -> PyResult<Fields<'py>>,
) -> PyErr {
    let built = fields().and_then(|fields| {
        let kwargs = PyDict::new(py);
        for (key, value) in fields {
            kwargs.set_item(key, value)?;
        }
        class.call(pyo3::types::PyTuple::new(py, args)?, Some(&kwargs))
    });
    match built {
        Ok(instance) => PyErr::from_value(instance),
        Err(err) => err,
    }
}

fn location_name(py: Python<'_>, location: Option<Location>) -> PyResult<Bound<'_, PyAny>> {
    match location {
        Some(location) => location.name().into_bound_py_any(py),
        None => Ok(py.None().into_bound(py)),
    }
}

/// Converts a core error into its documented Python exception.
pub fn to_py_err(py: Python<'_>, err: CoreError) -> PyErr {
    let message = err.to_string();
    match err {
        CoreError::InvalidArgument { .. } => PyValueError::new_err(message),
        CoreError::Handle { .. } => ResidencyHandleError::new_err(message),
        CoreError::Unavailable { .. } => ResidencyUnavailableError::new_err(message),
        CoreError::LifetimeClosed { .. } => ResidencyLifetimeClosedError::new_err(message),
        CoreError::Materialization { .. } => ResidencyMaterializationError::new_err(message),
        CoreError::Ownership { .. } => ResidencyOwnershipError::new_err(message),
        CoreError::Plan { .. } => ResidencyPlanError::new_err(message),
        CoreError::Reentrancy { .. } => ResidencyReentrancyError::new_err(message),
        CoreError::Closed { .. } => ResidencyClosedError::new_err(message),
        CoreError::Internal { .. } => PyRuntimeError::new_err(message),
        CoreError::Budget {
            location,
            budget_bytes,
            used_bytes,
            reserved_bytes,
            requested_bytes,
        } => structured(py, &ResidencyBudgetError::type_object(py), vec![], || {
            Ok(vec![
                ("location", location_name(py, Some(location))?),
                ("budget_bytes", budget_bytes.into_bound_py_any(py)?),
                ("used_bytes", used_bytes.into_bound_py_any(py)?),
                ("reserved_bytes", reserved_bytes.into_bound_py_any(py)?),
                ("requested_bytes", requested_bytes.into_bound_py_any(py)?),
            ])
        }),
        CoreError::InUse {
            message,
            location,
            active_reads,
            holds,
            pending_events,
        } => {
            let text = message.clone().into_bound_py_any(py);
            match text {
                Ok(text) => structured(
                    py,
                    &ResidencyInUseError::type_object(py),
                    vec![text],
                    || {
                        Ok(vec![
                            ("location", location_name(py, location)?),
                            ("active_reads", active_reads.into_bound_py_any(py)?),
                            ("holds", holds.into_bound_py_any(py)?),
                            ("pending_events", pending_events.into_bound_py_any(py)?),
                        ])
                    },
                ),
                Err(err) => err,
            }
        }
        CoreError::StaleState { expected, actual } => structured(
            py,
            &ResidencyStaleStateError::type_object(py),
            vec![],
            || {
                Ok(vec![
                    ("expected_version", expected.into_bound_py_any(py)?),
                    ("actual_version", actual.into_bound_py_any(py)?),
                ])
            },
        ),
        CoreError::SearchLimit {
            request_name,
            state_limit,
            explored_states,
            detail,
        } => structured(
            py,
            &ResidencySearchLimitError::type_object(py),
            vec![],
            || {
                Ok(vec![
                    ("request_name", request_name.into_bound_py_any(py)?),
                    ("state_limit", state_limit.into_bound_py_any(py)?),
                    ("explored_states", explored_states.into_bound_py_any(py)?),
                    ("detail", detail.into_bound_py_any(py)?),
                ])
            },
        ),
        // Only the glue holds the partial report's Python records, so it builds plan
        // execution errors itself; reaching this arm is a glue bug, reported as such.
        CoreError::PlanExecution { .. } => PyRuntimeError::new_err(format!(
            "internal error: unwrapped plan execution failure: {message}"
        )),
    }
}

/// A representative core error of each kind, for the probe below.
fn sample(kind: &str) -> Option<CoreError> {
    let message = format!("probe {kind}");
    Some(match kind {
        "invalid" => CoreError::InvalidArgument { message },
        "handle" => CoreError::Handle { message },
        "unavailable" => CoreError::Unavailable { message },
        "budget" => CoreError::Budget {
            location: Location::Cuda(1),
            budget_bytes: 100,
            used_bytes: 60,
            reserved_bytes: 30,
            requested_bytes: 20,
        },
        "in_use" => CoreError::InUse {
            message,
            location: Some(Location::PinnedHost),
            active_reads: 1,
            holds: 2,
            pending_events: 3,
        },
        "lifetime_closed" => CoreError::LifetimeClosed { message },
        "materialization" => CoreError::Materialization { message },
        "ownership" => CoreError::Ownership { message },
        "plan" => CoreError::Plan { reason: message },
        "stale_state" => CoreError::StaleState {
            expected: 4,
            actual: 7,
        },
        "search_limit" => CoreError::SearchLimit {
            request_name: "request".into(),
            state_limit: 10,
            explored_states: 10,
            detail: message,
        },
        "plan_execution" => CoreError::PlanExecution {
            plan_name: "plan".into(),
            phase: PlanPhase::Enter,
            failed_index: Some(0),
            committed: 0,
            cause: Box::new(CoreError::Closed { message }),
        },
        "reentrancy" => CoreError::Reentrancy { message },
        "closed" => CoreError::Closed { message },
        "internal" => CoreError::Internal { message },
        _ => return None,
    })
}

/// Test hook: raises what the table maps a representative error of `kind` onto, so
/// pytest pins the table (class and structured fields) without a manager.
#[pyfunction]
#[pyo3(signature = (kind, /))]
pub fn error_table_probe(py: Python<'_>, kind: &str) -> PyResult<()> {
    match sample(kind) {
        Some(err) => Err(to_py_err(py, err)),
        None => Err(PyValueError::new_err(format!(
            "unknown error kind {kind:?}"
        ))),
    }
}
