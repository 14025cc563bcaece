//! The one table from core error variants to the classes in `fhelium.errors`.
//!
//! The classes are defined in Python (documented, picklable, typed); this module
//! imports them once per interpreter and builds instances with their fields.

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyType};
use pyo3::{IntoPyObjectExt, PyTypeInfo};
use residency_core::{CoreError, Location, Refusal, RefusalKind, error};

pyo3::import_exception!(fhelium.errors, ResidencyHandleError);
pyo3::import_exception!(fhelium.errors, ResidencyUnavailableError);
pyo3::import_exception!(fhelium.errors, ResidencyBudgetError);
pyo3::import_exception!(fhelium.errors, ResidencyInUseError);
pyo3::import_exception!(fhelium.errors, ResidencyMaterializationError);
pyo3::import_exception!(fhelium.errors, ResidencyOwnershipError);
pyo3::import_exception!(fhelium.errors, ResidencyPlanError);
pyo3::import_exception!(fhelium.errors, ResidencyStaleStateError);
pyo3::import_exception!(fhelium.errors, ResidencySearchLimitError);
pyo3::import_exception!(fhelium.errors, ResidencyReentrancyError);
pyo3::import_exception!(fhelium.errors, ResidencyClosedError);
pyo3::import_exception!(fhelium.errors, ResidencyForkedError);

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

/// `text` as Python's `repr` writes it: messages that quote a name quote it the way
/// the rest of the glue does.
fn python_repr(py: Python<'_>, text: &str) -> PyResult<String> {
    Ok(PyString::new(py, text).repr()?.to_str()?.to_owned())
}

/// `ResidencyForkedError(message, owner_pid=, pid=)`.
fn forked_error(py: Python<'_>, message: String, owner_pid: u32, pid: u32) -> PyErr {
    match message.into_bound_py_any(py) {
        Ok(text) => structured(
            py,
            &ResidencyForkedError::type_object(py),
            vec![text],
            || {
                Ok(vec![
                    ("owner_pid", owner_pid.into_bound_py_any(py)?),
                    ("pid", pid.into_bound_py_any(py)?),
                ])
            },
        ),
        Err(err) => err,
    }
}

/// `ResidencyStaleStateError(expected_version=, actual_version=)`; `expected` as the
/// caller gave it.
pub fn stale_state(py: Python<'_>, expected: &Bound<'_, PyAny>, actual: u64) -> PyErr {
    structured(
        py,
        &ResidencyStaleStateError::type_object(py),
        vec![],
        || {
            Ok(vec![
                ("expected_version", expected.clone()),
                ("actual_version", actual.into_bound_py_any(py)?),
            ])
        },
    )
}

/// Converts a core error into its documented Python exception.
pub fn to_py_err(py: Python<'_>, err: CoreError) -> PyErr {
    let message = err.to_string();
    match err {
        CoreError::InvalidArgument { .. } => PyValueError::new_err(message),
        CoreError::Handle { .. } => ResidencyHandleError::new_err(message),
        CoreError::Unavailable { .. } => ResidencyUnavailableError::new_err(message),
        CoreError::Materialization { .. } => ResidencyMaterializationError::new_err(message),
        CoreError::Ownership { .. } => ResidencyOwnershipError::new_err(message),
        CoreError::Reentrancy { .. } => ResidencyReentrancyError::new_err(message),
        CoreError::Closed { .. } => ResidencyClosedError::new_err(message),
        CoreError::Forked {
            message,
            owner_pid,
            pid,
        } => forked_error(py, message, owner_pid, pid),
        CoreError::Internal { .. } | CoreError::Policy { .. } => PyRuntimeError::new_err(message),
        CoreError::Plan { .. } => ResidencyPlanError::new_err(message),
        CoreError::StaleState {
            expected_version,
            actual_version,
        } => match expected_version.into_bound_py_any(py) {
            Ok(expected) => stale_state(py, &expected, actual_version),
            Err(err) => err,
        },
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
        CoreError::SearchLimit {
            request_name,
            state_limit,
            explored_states,
            bound,
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
                    ("bound", bound.into_bound_py_any(py)?),
                ])
            },
        ),
        CoreError::SearchInfeasible {
            request_name,
            detail,
        } => match python_repr(py, &request_name) {
            Ok(name) => ResidencyPlanError::new_err(error::infeasible(&name, &detail)),
            Err(err) => err,
        },
        CoreError::SearchUnavailable { handle_id } => match python_repr(py, &handle_id) {
            Ok(handle_id) => ResidencyUnavailableError::new_err(error::unplaceable(&handle_id)),
            Err(err) => err,
        },
    }
}

/// Raises a core refusal (`residency_core::Refusal`) as the class it names.
pub(crate) fn refuse(py: Python<'_>, refusal: Refusal<'_>) -> PyErr {
    let message = refusal.to_string();
    match refusal.kind() {
        RefusalKind::Type => PyTypeError::new_err(message),
        RefusalKind::Value => PyValueError::new_err(message),
        RefusalKind::Materialization => to_py_err(py, CoreError::Materialization { message }),
    }
}

/// Whether `value` is a `torch.Tensor`.
pub(crate) fn is_tensor(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
    let tensor = py
        .import(pyo3::intern!(py, "torch"))?
        .getattr(pyo3::intern!(py, "Tensor"))?;
    value.is_instance(&tensor)
}
