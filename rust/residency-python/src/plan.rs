//! Lowering of `ResidencyPlan` into the core's plan IR, once per plan.
//!
//! `lower_records` reads the action and reservation records themselves, in one call
//! per plan: it tells the four action classes apart, turns location records into
//! codes, and interns handles into the plan's table with the same hash and equality
//! a Python dict keyed by handle uses.

use std::borrow::Cow;
use std::sync::Arc;

use pyo3::exceptions::{PyAssertionError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyString, PyTuple, PyType};
use residency_core::tables::{FirstSeen, Identity, Interner};
use residency_core::{
    Action, ActionKind, HandleRef, HandleSlot, Location, LocationKind, Plan, Refusal, Reservation,
    Resolutions,
};

use crate::errors::{refuse, to_py_err};
use crate::kinds::{kind_of, locations_of};

/// `(kind, handle_slot, location_code, from_code)`; codes are -1 where absent. Decoded
/// once every record is read, so a record's error comes before any code's.
type ActionTuple = (ActionKind, u32, i64, i64);

fn actions(tuples: Vec<ActionTuple>) -> PyResult<Vec<Action>> {
    tuples
        .into_iter()
        .map(|(kind, slot, code, from)| {
            Action::decode(kind, HandleSlot(slot), code, from)
                .map_err(|err| PyValueError::new_err(err.to_string()))
        })
        .collect()
}

/// A lowered, validated plan. Immutable and shareable across threads.
#[pyclass(frozen, module = "fhelium._core", name = "PlanIR")]
#[derive(Debug)]
pub struct PlanIr {
    plan: Arc<Plan>,
    /// The handle slots' last resolution (see `Resolutions`).
    resolutions: Resolutions,
}

impl PlanIr {
    pub fn new(plan: Plan) -> Self {
        Self {
            plan: Arc::new(plan),
            resolutions: Resolutions::default(),
        }
    }

    /// A view of a plan another object keeps too.
    pub fn shared(plan: Arc<Plan>) -> Self {
        Self {
            plan,
            resolutions: Resolutions::default(),
        }
    }

    pub fn plan(&self) -> &Arc<Plan> {
        &self.plan
    }

    pub fn resolutions(&self) -> &Resolutions {
        &self.resolutions
    }
}

#[pymethods]
impl PlanIr {
    fn __repr__(&self) -> String {
        self.plan.to_string()
    }
}

/// The action record classes and their kinds, in `ActionKind::ALL` order (see
/// `kinds::kind_of`).
struct Kinds<'py> {
    classes: Vec<(Bound<'py, PyAny>, ActionKind)>,
}

impl<'py> Kinds<'py> {
    fn new(classes: &Bound<'py, PyAny>) -> PyResult<Self> {
        let classes = classes
            .try_iter()?
            .zip(ActionKind::ALL)
            .map(|(class, kind)| Ok((class?.cast_into::<PyType>()?.into_any(), kind)))
            .collect::<PyResult<_>>()?;
        Ok(Self { classes })
    }

    fn of(&self, action: &Bound<'py, PyAny>) -> PyResult<ActionKind> {
        kind_of(action, &self.classes)
    }
}

/// The core's location code of a location record: 0 pageable host, 1 pinned host,
/// 2 + CUDA index. The records seen so far are remembered by identity (each is kept
/// alive here, so its address stays its own).
struct Codes<'py> {
    known: FirstSeen<(Bound<'py, PyAny>, i64)>,
}

/// Distinct location objects and value types remembered per call; plans name few.
const KNOWN_LOCATIONS: usize = 16;
const KNOWN_TYPES: usize = 16;

impl<'py> Codes<'py> {
    fn new() -> Self {
        Self {
            known: FirstSeen::new(KNOWN_LOCATIONS),
        }
    }

    fn of(&mut self, location: &Bound<'py, PyAny>) -> PyResult<i64> {
        if let Some(code) = self
            .known
            .find_map(|(known, code)| known.is(location).then_some(*code))
        {
            return Ok(code);
        }
        let code = location_code(location)?;
        self.known.insert((location.clone(), code));
        Ok(code)
    }
}

fn location_code(location: &Bound<'_, PyAny>) -> PyResult<i64> {
    let py = location.py();
    let kind = location.getattr(intern!(py, "kind"))?;
    let kind = match kind.cast::<PyString>() {
        Ok(kind) => kind
            .to_str()
            .map_or(LocationKind::Cuda, LocationKind::named),
        Err(_) => LocationKind::Cuda,
    };
    match kind {
        LocationKind::PageableHost => Ok(Location::PageableHost.code().into()),
        LocationKind::PinnedHost => Ok(Location::PinnedHost.code().into()),
        LocationKind::Disk => {
            // The glue numbers disk directories (`_lowering.location_code`).
            let lowering = py.import(intern!(py, "fhelium.residency._lowering"))?;
            lowering
                .getattr(intern!(py, "location_code"))?
                .call1((location,))?
                .extract()
        }
        LocationKind::Cuda => {
            let index = location
                .getattr(intern!(py, "device"))?
                .getattr(intern!(py, "index"))?;
            if index.is_none() {
                // A location record always names an indexed CUDA device.
                return Err(PyAssertionError::new_err(()));
            }
            index.add(2)?.extract()
        }
    }
}

/// `text` as the core's UTF-8 diagnostics: lone surrogates become U+FFFD, exactly as
/// the glue's `diagnostic_text` does.
fn diagnostic_text<'a>(text: &'a Bound<'_, PyAny>) -> PyResult<Cow<'a, str>> {
    if let Ok(exact) = text.cast_exact::<PyString>()
        && let Ok(utf8) = exact.to_str()
    {
        return Ok(Cow::Borrowed(utf8));
    }
    let py = text.py();
    if text.call_method0(intern!(py, "isascii"))?.is_truthy()? {
        return Ok(Cow::Owned(text.extract()?));
    }
    Ok(Cow::Owned(
        text.call_method1(intern!(py, "encode"), ("utf-8", "surrogatepass"))?
            .call_method1(intern!(py, "decode"), ("utf-8", "replace"))?
            .extract()?,
    ))
}

/// The plan's handle table (the core's `Interner`), keyed as a Python dict keyed by
/// the handle records would be: by their hash, then identity or equality.
type Slots<'py> = Interner<Bound<'py, PyAny>>;

/// How the handle table asks about handle records.
struct Handles<'py>(Python<'py>);

impl<'py> Identity<Bound<'py, PyAny>> for Handles<'py> {
    type Error = PyErr;

    fn address(&self, handle: &Bound<'py, PyAny>) -> usize {
        handle.as_ptr().addr()
    }

    fn hash(&self, handle: &Bound<'py, PyAny>) -> PyResult<isize> {
        handle.hash()
    }

    fn same(&self, known: &Bound<'py, PyAny>, handle: &Bound<'py, PyAny>) -> PyResult<bool> {
        Ok(known.is(handle) || known.eq(handle)?)
    }

    fn too_many(&self) -> PyErr {
        refuse(self.0, Refusal::TooManyHandles)
    }
}

fn encode_actions<'py>(
    actions: &Bound<'py, PyAny>,
    kinds: &Kinds<'py>,
    slots: &mut Slots<'py>,
    codes: &mut Codes<'py>,
) -> PyResult<Vec<ActionTuple>> {
    let py = actions.py();
    let mut encoded = Vec::with_capacity(actions.len().unwrap_or(0));
    for action in actions.try_iter()? {
        let action = action?;
        let slot = slots.slot(action.getattr(intern!(py, "handle"))?, &Handles(py))?;
        let kind = kinds.of(&action)?;
        let (location, from) = locations_of(&action, kind)?;
        let at = match location {
            Some(location) => codes.of(&location)?,
            None => -1,
        };
        let from = match from {
            Some(from) if !from.is_none() => codes.of(&from)?,
            _ => -1,
        };
        encoded.push((kind, slot, at, from));
    }
    Ok(encoded)
}

/// A reservation's byte count as the core keeps it: larger counts saturate.
fn saturated(nbytes: &Bound<'_, PyAny>) -> PyResult<u64> {
    match nbytes.extract::<u64>() {
        Ok(nbytes) => Ok(nbytes),
        Err(err) => {
            if nbytes.cast::<PyInt>().is_ok() && nbytes.gt(u64::MAX)? {
                Ok(u64::MAX)
            } else {
                Err(err)
            }
        }
    }
}

/// Lowers a plan from its records in one call: `reclaim`, `enter` and `exit` are
/// iterables of action records, `reservations` of reservation records; `classes`
/// are the action classes in `ActionKind::ALL` order (ensure, move, drop, discard)
/// and `type_key` gives a value type's process-wide key. Returns the IR and the handle table (slot order: first appearance).
#[pyfunction]
#[pyo3(signature = (name, reclaim, enter, exit, reservations, classes, type_key, /))]
#[allow(clippy::too_many_arguments)] // the plan's fields, positionally
pub fn lower_records<'py>(
    py: Python<'py>,
    name: &Bound<'py, PyAny>,
    reclaim: &Bound<'py, PyAny>,
    enter: &Bound<'py, PyAny>,
    exit: &Bound<'py, PyAny>,
    reservations: &Bound<'py, PyAny>,
    classes: &Bound<'py, PyAny>,
    type_key: &Bound<'py, PyAny>,
) -> PyResult<(PlanIr, Bound<'py, PyTuple>)> {
    let kinds = Kinds::new(classes)?;
    let mut slots = Slots::default();
    let mut codes = Codes::new();
    let reclaim = encode_actions(reclaim, &kinds, &mut slots, &mut codes)?;
    let enter = encode_actions(enter, &kinds, &mut slots, &mut codes)?;
    let exit = encode_actions(exit, &kinds, &mut slots, &mut codes)?;
    let mut type_keys: FirstSeen<(Bound<'py, PyAny>, u64)> = FirstSeen::new(KNOWN_TYPES);
    // Handles of one manager share their manager id object: converted once.
    let mut manager_ids: Option<(Bound<'py, PyAny>, Arc<str>)> = None;
    let mut handles = Vec::with_capacity(slots.items().len());
    for handle in slots.items() {
        let manager_id = handle.getattr(intern!(py, "manager_id"))?;
        let manager_id = match &manager_ids {
            Some((known, text)) if known.is(&manager_id) => Arc::clone(text),
            _ => {
                let text: Arc<str> = Arc::from(diagnostic_text(&manager_id)?);
                manager_ids = Some((manager_id, Arc::clone(&text)));
                text
            }
        };
        let handle_id = Arc::from(diagnostic_text(&handle.getattr(intern!(py, "handle_id"))?)?);
        let value_type = handle.getattr(intern!(py, "value_type"))?;
        let key = if let Some(key) =
            type_keys.find_map(|(known, key)| known.is(&value_type).then_some(*key))
        {
            key
        } else {
            let key: u64 = type_key.call1((&value_type,))?.extract()?;
            type_keys.insert((value_type, key));
            key
        };
        handles.push(HandleRef {
            manager_id,
            handle_id,
            type_key: key,
        });
    }
    let mut encoded_reservations = Vec::new();
    for reservation in reservations.try_iter()? {
        let reservation = reservation?;
        encoded_reservations.push((
            codes.of(&reservation.getattr(intern!(py, "location"))?)?,
            saturated(&reservation.getattr(intern!(py, "nbytes"))?)?,
            diagnostic_text(&reservation.getattr(intern!(py, "label"))?)?.into_owned(),
        ));
    }
    let name = diagnostic_text(name)?.into_owned();
    let reservations = encoded_reservations
        .into_iter()
        .map(|(code, nbytes, label)| {
            Reservation::decode(code, nbytes, label)
                .map_err(|err| PyValueError::new_err(err.to_string()))
        })
        .collect::<PyResult<Vec<_>>>()?;
    let plan = Plan::new(
        name,
        handles,
        actions(reclaim)?,
        actions(enter)?,
        actions(exit)?,
        reservations,
    )
    .map_err(|err| to_py_err(py, err))?;
    Ok((PlanIr::new(plan), PyTuple::new(py, slots.items())?))
}
