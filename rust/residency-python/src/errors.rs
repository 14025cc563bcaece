//! The one table from core error variants to the classes in `fhelium.errors`.
//!
//! The classes are defined in Python (documented, picklable, typed); this module
//! imports them once per interpreter and builds instances with their fields.

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyType};
use pyo3::{IntoPyObjectExt, PyTypeInfo};
use residency_core::error::{self, ErrorClass, ErrorField, ErrorShape};
use residency_core::{CoreError, Refusal, RefusalKind};

/// The classes of `fhelium.errors`, each imported once per interpreter, and
/// `class_object`, the Python class of each of the core's error classes.
macro_rules! error_classes {
    ($($class:ident => $name:ident),* $(,)?) => {
        $(pyo3::import_exception!(fhelium.errors, $name);)*

        /// The Python class of an error class.
        fn class_object(py: Python<'_>, class: ErrorClass) -> Bound<'_, PyType> {
            match class {
                ErrorClass::Value => PyValueError::type_object(py),
                ErrorClass::Runtime => PyRuntimeError::type_object(py),
                $(ErrorClass::$class => $name::type_object(py),)*
            }
        }
    };
}

error_classes! {
    Handle => ResidencyHandleError,
    Unavailable => ResidencyUnavailableError,
    Budget => ResidencyBudgetError,
    InUse => ResidencyInUseError,
    Materialization => ResidencyMaterializationError,
    Ownership => ResidencyOwnershipError,
    Plan => ResidencyPlanError,
    StaleState => ResidencyStaleStateError,
    SearchLimit => ResidencySearchLimitError,
    Reentrancy => ResidencyReentrancyError,
    Closed => ResidencyClosedError,
    Forked => ResidencyForkedError,
}

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

/// `text` as Python's `repr` writes it: messages that quote a name quote it the way
/// the rest of the glue does.
fn python_repr(py: Python<'_>, text: &str) -> PyResult<String> {
    Ok(PyString::new(py, text).repr()?.to_str()?.to_owned())
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

/// Converts a core error into its documented Python exception: the class, message
/// and fields the core gives it (`CoreError::class`, `shape`, `fields`).
#[allow(clippy::needless_pass_by_value)] // taken as `map_err` hands it over
pub fn to_py_err(py: Python<'_>, err: CoreError) -> PyErr {
    // Messages that quote a name quote it as Python does.
    let message = match &err {
        CoreError::SearchInfeasible {
            request_name,
            detail,
        } => python_repr(py, request_name).map(|name| error::infeasible(&name, detail)),
        CoreError::SearchUnavailable { handle_id } => {
            python_repr(py, handle_id).map(|handle_id| error::unplaceable(&handle_id))
        }
        _ => Ok(err.to_string()),
    };
    let message = match message {
        Ok(message) => message,
        Err(failed) => return failed,
    };
    let class = class_object(py, err.class());
    let args = match err.shape() {
        ErrorShape::Message => return PyErr::from_type(class, message),
        ErrorShape::MessageAndFields => match message.into_bound_py_any(py) {
            Ok(message) => vec![message],
            Err(failed) => return failed,
        },
        ErrorShape::Fields => vec![],
    };
    structured(py, &class, args, || {
        err.fields()
            .into_iter()
            .map(|(name, field)| {
                let value = match field {
                    ErrorField::Count(count) => count.into_bound_py_any(py)?,
                    ErrorField::Text(text) => text.into_bound_py_any(py)?,
                    ErrorField::Location(Some(location)) => {
                        location.name().into_bound_py_any(py)?
                    }
                    ErrorField::Location(None) => py.None().into_bound(py),
                };
                Ok((name, value))
            })
            .collect()
    })
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
