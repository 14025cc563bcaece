//! Action records' kinds and location fields, and the core's lifetime kinds as a
//! Python enum, so the glue names them instead of numbering them.
//!
//! The enum mirrors the core's; the conversion below matches exhaustively, so a kind
//! added to the core does not compile until it has its Python name here. `eq_int`
//! lets its values compare equal to the numbers the glue used before.

use std::borrow::Borrow;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyString;
use residency_core::{ActionKind, Refusal};

use crate::errors::refuse;

/// The kind of `action` among the action record `classes`, in order: an exact class
/// matches by identity first, then a subclass by `isinstance`; anything else is not an
/// action.
#[inline]
pub(crate) fn kind_of<'py, C: Borrow<Bound<'py, PyAny>>>(
    action: &Bound<'py, PyAny>,
    classes: &[(C, ActionKind)],
) -> PyResult<ActionKind> {
    let action_type = action.get_type();
    if let Some((_, kind)) = classes
        .iter()
        .find(|(class, _)| class.borrow().is(&action_type))
    {
        return Ok(*kind);
    }
    for (class, kind) in classes {
        if action.is_instance(class.borrow())? {
            return Ok(*kind);
        }
    }
    Err(refuse(
        action.py(),
        Refusal::NotAnAction {
            repr: &action.repr()?.to_cow()?,
        },
    ))
}

/// The interned names of the attributes each kind's action record names its
/// locations by (`ActionKind::record_fields`), made once per process.
type FieldNames = Vec<(ActionKind, Option<Py<PyString>>, Option<Py<PyString>>)>;
static FIELD_NAMES: PyOnceLock<FieldNames> = PyOnceLock::new();

/// An action record's location records as its kind names them: the location (a move's
/// destination; `None` for a discard) and a move's source (which may be `None`).
#[allow(clippy::type_complexity)] // the two optional records
pub(crate) fn locations_of<'py>(
    action: &Bound<'py, PyAny>,
    kind: ActionKind,
) -> PyResult<(Option<Bound<'py, PyAny>>, Option<Bound<'py, PyAny>>)> {
    let py = action.py();
    let names = FIELD_NAMES.get_or_init(py, || {
        let intern = |name: Option<&str>| name.map(|name| PyString::intern(py, name).unbind());
        ActionKind::ALL
            .into_iter()
            .map(|kind| {
                let fields = kind.record_fields();
                (kind, intern(fields.location), intern(fields.from))
            })
            .collect()
    });
    let Some((_, location, from)) = names.iter().find(|(known, ..)| *known == kind) else {
        return Ok((None, None));
    };
    let read = |name: &Option<Py<PyString>>| {
        name.as_ref()
            .map(|name| action.getattr(name.bind(py)))
            .transpose()
    };
    Ok((read(location)?, read(from)?))
}

/// Which kind of lifetime a token names, for the one-call release.
#[pyclass(
    eq,
    eq_int,
    frozen,
    from_py_object,
    module = "fhelium._core",
    name = "LifetimeKind"
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LifetimeKind {
    #[pyo3(name = "LEASE")]
    Lease = 0,
    #[pyo3(name = "HOLD")]
    Hold = 1,
    #[pyo3(name = "RESERVATION")]
    Reservation = 2,
}

impl From<LifetimeKind> for residency_core::LifetimeKind {
    fn from(kind: LifetimeKind) -> Self {
        match kind {
            LifetimeKind::Lease => Self::Lease,
            LifetimeKind::Hold => Self::Hold,
            LifetimeKind::Reservation => Self::Reservation,
        }
    }
}
