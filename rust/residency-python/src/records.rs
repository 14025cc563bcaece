//! The records users read in bulk (snapshot value entries, explanation actions),
//! built here in one call rather than one Python call per record, and a plan
//! explanation with its peaks' location records in one call
//! (`RecordBuilder::explanation`).
//!
//! The records are frozen slots dataclasses whose `__setattr__` refuses every
//! assignment. A `RecordBuilder` therefore fills an instance of a plain-assignment
//! subclass the glue derives from the record class (same slots, nothing added), one
//! C-level attribute set per field, and then gives it the record class itself, so the
//! finished object is exactly the record its trusted constructor would have built.
//! No record code runs and no instance of the subclass ever escapes.
//!
//! Records are immutable, so equal ones may be one object: location records come
//! from the glue's shared table, materialisation records with identical fields are
//! built once per call, and repeated strings and byte counts are converted once.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use pyo3::IntoPyObjectExt;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString, PyTuple, PyType};
use residency_core::entries::{
    ACTION_FIELDS, MATERIALIZATION_FIELDS, VALUE_FIELDS, action_fields, materialization_fields,
    value_fields,
};
use residency_core::report::Field;
use residency_core::tables::{ByCode, Last};
use residency_core::{ActionOutcome, FastMap, Location, Materialization, ValueRecord};

/// Builds instances of one record class from field values in declaration order.
#[pyclass(frozen, module = "fhelium._core", name = "RecordBuilder")]
#[derive(Debug)]
pub struct RecordBuilder {
    record: Py<PyType>,
    fill: Py<PyType>,
    names: Vec<Py<PyString>>,
    class_name: Py<PyString>,
    /// The location records `explanation` was given, by code, with the function that
    /// gave them: the glue's shared table gives one record per code for good.
    locations: Mutex<Option<(Py<PyAny>, KnownLocations)>>,
}

/// Location records by code.
type KnownLocations = Vec<(u32, Py<PyAny>)>;

#[pymethods]
impl RecordBuilder {
    /// `fill` must be a subclass of `record` that adds no slots and assigns
    /// attributes plainly; `names` are the record's fields in declaration order.
    #[new]
    #[allow(clippy::needless_pass_by_value)] // pyo3 extracts sequences as owned vectors
    fn new(
        record: &Bound<'_, PyType>,
        fill: &Bound<'_, PyType>,
        names: Vec<Bound<'_, PyString>>,
    ) -> PyResult<Self> {
        if !fill.is_subclass(record)? || fill.is(record) {
            return Err(PyValueError::new_err(
                "fill must be a proper subclass of the record class",
            ));
        }
        let py = record.py();
        Ok(Self {
            record: record.clone().unbind(),
            fill: fill.clone().unbind(),
            names: names
                .iter()
                .map(|name| Ok(PyString::intern(py, name.to_str()?).unbind()))
                .collect::<PyResult<_>>()?,
            class_name: PyString::intern(py, "__class__").unbind(),
            locations: Mutex::new(None),
        })
    }

    /// The record class this builds.
    #[getter]
    fn record_class(&self, py: Python<'_>) -> Py<PyType> {
        self.record.clone_ref(py)
    }

    /// One record from its fields, positionally, in declaration order, unchecked.
    #[pyo3(signature = (*fields))]
    fn __call__<'py>(
        &self,
        py: Python<'py>,
        fields: &Bound<'py, PyTuple>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if fields.len() != self.names.len() {
            return Err(PyTypeError::new_err(format!(
                "a record of {} fields, given {}",
                self.names.len(),
                fields.len()
            )));
        }
        self.build_each(py, fields.iter_borrowed(), |record, name, _, field| {
            record.setattr(name, field)
        })
    }

    /// A plan explanation (docs/concepts/snapshots.md#plan-explanations) of `plan`
    /// from `simulation`, in one call: this builder's names are the record's
    /// `plan_name, reservations, predicted_peak_bytes, feasible, reason` and then the
    /// lazy record's `_actions, _plan, _simulation`. `peaks` are the simulation's
    /// `(location code, bytes)` pairs (`simulation.peaks()` when `None`); location
    /// records come from `location_of(code)`. A plan without actions explains none
    /// (`_actions` is then the empty tuple, otherwise `None`: built when read).
    #[pyo3(signature = (location_of, plan, simulation, peaks=None))]
    fn explanation<'py>(
        &self,
        py: Python<'py>,
        location_of: &Bound<'py, PyAny>,
        plan: &Bound<'py, PyAny>,
        simulation: &Bound<'py, PyAny>,
        peaks: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.expect_fields(EXPLANATION_FIELDS)?;
        let peaks = match peaks {
            Some(peaks) => peaks.clone(),
            None => simulation.call_method0(intern!(py, "peaks"))?,
        };
        let mut pairs = Vec::with_capacity(peaks.len().unwrap_or(0));
        for pair in peaks.try_iter()? {
            let (code, nbytes): (u32, Bound<'py, PyAny>) = pair?.extract()?;
            pairs.push(PyTuple::new(
                py,
                [self.location(location_of, code)?, nbytes],
            )?);
        }
        let mut acts = false;
        for phase in [
            intern!(py, "reclaim"),
            intern!(py, "enter"),
            intern!(py, "exit"),
        ] {
            if plan.getattr(phase)?.is_truthy()? {
                acts = true;
                break;
            }
        }
        let actions = if acts {
            py.None().into_bound(py)
        } else {
            PyTuple::empty(py).into_any()
        };
        let fields = [
            plan.getattr(intern!(py, "name"))?,
            plan.getattr(intern!(py, "reservations"))?,
            PyTuple::new(py, pairs)?.into_any(),
            simulation.getattr(intern!(py, "feasible"))?,
            simulation.getattr(intern!(py, "reason"))?,
            actions,
            plan.clone(),
            simulation.clone(),
        ];
        self.build(py, &fields.each_ref())
    }
}

/// The fields and lazy slots `RecordBuilder::explanation` sets.
const EXPLANATION_FIELDS: usize = 8;

impl RecordBuilder {
    /// The location record of `code`, from `location_of` once per code (no lock is
    /// held while it runs).
    fn location<'py>(
        &self,
        location_of: &Bound<'py, PyAny>,
        code: u32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = location_of.py();
        let lock = || {
            self.locations
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        if let Some((known_of, known)) = lock().as_ref()
            && known_of.is(location_of)
            && let Some((_, location)) = known.iter().find(|(known, _)| *known == code)
        {
            return Ok(location.bind(py).clone());
        }
        let location = location_of.call1((code,))?;
        let mut locations = lock();
        match locations.as_mut() {
            Some((known_of, known)) if known_of.is(location_of) => {
                if known.iter().all(|(known, _)| *known != code) {
                    known.push((code, location.clone().unbind()));
                }
            }
            _ => {
                *locations = Some((
                    location_of.clone().unbind(),
                    vec![(code, location.clone().unbind())],
                ));
            }
        }
        Ok(location)
    }

    /// Fails unless the record has exactly `count` fields: checked once per bulk call.
    pub fn expect_fields(&self, count: usize) -> PyResult<()> {
        if self.names.len() == count {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "internal error: a record with {count} fields was expected, the builder has {}",
                self.names.len()
            )))
        }
    }

    /// One record; `fields` are in declaration order, as many as `expect_fields` said.
    pub fn build<'py>(
        &self,
        py: Python<'py>,
        fields: &[&Bound<'py, PyAny>],
    ) -> PyResult<Bound<'py, PyAny>> {
        self.build_each(py, fields, |record, name, _, field| {
            record.setattr(name, field)
        })
    }

    /// One record from `fields` in declaration order, each set by `set(record, name,
    /// column, field)`.
    pub fn build_each<'py, F>(
        &self,
        py: Python<'py>,
        fields: impl IntoIterator<Item = F>,
        mut set: impl FnMut(&Bound<'py, PyAny>, &Bound<'py, PyString>, usize, F) -> PyResult<()>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let record = self.fill.bind(py).call0()?;
        for (column, (name, value)) in self.names.iter().zip(fields).enumerate() {
            set(&record, name.bind(py), column, value)?;
        }
        record.setattr(self.class_name.bind(py), self.record.bind(py))?;
        Ok(record)
    }
}

/// Sets one record field (the one conversion of `Field`): the caller's objects as
/// they are (`object` reads one), flags and `None` as the interpreter's own objects,
/// and the others (counts, locations, texts) as `made` makes them.
#[inline]
pub fn set_field<'a, 'py: 'a, O>(
    record: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
    value: Field<'a, O>,
    object: impl FnOnce(&'a O) -> &'a Bound<'py, PyAny>,
    made: impl FnOnce(Field<'a, O>) -> PyResult<Bound<'py, PyAny>>,
) -> PyResult<()> {
    let py = record.py();
    match value {
        Field::Object(known) => record.setattr(name, object(known)),
        Field::Flag(flag) => record.setattr(name, PyBool::new(py, flag)),
        Field::None => record.setattr(name, py.None()),
        other => record.setattr(name, made(other)?),
    }
}

/// The fields of records built in bulk, set as `set_field` does, each distinct
/// location and text once per call, and each column's byte count once per run of
/// equal counts (a column mostly repeats the previous row's value).
struct Fields<'a, 'py> {
    py: Python<'py>,
    location_of: &'a Bound<'py, PyAny>,
    locations: ByCode<Bound<'py, PyAny>>,
    texts: HashMap<String, Bound<'py, PyAny>>,
    counts: Vec<Last<u64, Bound<'py, PyAny>>>,
}

impl<'a, 'py> Fields<'a, 'py> {
    fn new(py: Python<'py>, location_of: &'a Bound<'py, PyAny>) -> Self {
        Self {
            py,
            location_of,
            locations: ByCode::default(),
            texts: HashMap::new(),
            counts: Vec::new(),
        }
    }

    /// One record of `builder` from `fields`, in declaration order (see `set_field`).
    fn build<const N: usize>(
        &mut self,
        builder: &RecordBuilder,
        fields: [Field<'_, Bound<'py, PyAny>>; N],
    ) -> PyResult<Bound<'py, PyAny>> {
        if self.counts.len() < N {
            self.counts.resize_with(N, Last::default);
        }
        let py = self.py;
        builder.build_each(py, fields, |record, name, column, value| {
            set_field(
                record,
                name,
                value,
                |object| object,
                |other| match other {
                    Field::Count(count) => match self.counts.get_mut(column) {
                        Some(last) => last.get_or_try(count, || count.into_bound_py_any(py)),
                        None => count.into_bound_py_any(py),
                    },
                    Field::Location(at) => self.location(at),
                    Field::Text(text) => Ok(self.text(text)),
                    Field::Object(object) => Ok(object.clone()),
                    Field::Flag(_) | Field::None => Err(PyRuntimeError::new_err(
                        "internal error: a record field converted twice",
                    )),
                },
            )
        })
    }

    fn text(&mut self, text: &str) -> Bound<'py, PyAny> {
        if let Some(known) = self.texts.get(text) {
            return known.clone();
        }
        let converted = PyString::new(self.py, text).into_any();
        self.texts.insert(text.to_owned(), converted.clone());
        converted
    }

    fn location(&mut self, at: Location) -> PyResult<Bound<'py, PyAny>> {
        let location_of = self.location_of;
        self.locations
            .get_or_try(at.code(), || location_of.call1((at.code(),)))
    }
}

/// A materialisation record's fields: the core's, with its value's spec object (by
/// address; the spec is alive for the whole call) standing for the logical size it
/// supplies.
type MaterializationKey = (usize, Materialization);

/// Snapshot value entries (docs/concepts/snapshots.md), one per value of `values`
/// in issue order; `objects` holds each value's handle and spec object.
pub fn value_entries<'a, 'py>(
    py: Python<'py>,
    values: impl IntoIterator<Item = &'a ValueRecord>,
    objects: &[(Py<PyAny>, Py<PyAny>)],
    value_records: &RecordBuilder,
    materialization_records: &RecordBuilder,
    location_of: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyTuple>> {
    value_records.expect_fields(VALUE_FIELDS)?;
    materialization_records.expect_fields(MATERIALIZATION_FIELDS)?;
    let logical_name = intern!(py, "logical_nbytes");
    let empty = PyTuple::empty(py).into_any();
    let mut fields = Fields::new(py, location_of);
    // Equal materialisations (same spec, place and counts) share one record, and a
    // value with only that materialisation shares its one-element tuple too.
    let mut shared: FastMap<MaterializationKey, (Bound<'py, PyAny>, Bound<'py, PyAny>)> =
        FastMap::default();
    let mut entries = Vec::with_capacity(objects.len());
    for (record, (handle, spec)) in values.into_iter().zip(objects) {
        let spec = spec.bind(py);
        let mut materialization = |m: &Materialization| -> PyResult<_> {
            let key = (spec.as_ptr().addr(), *m);
            if let Some(built) = shared.get(&key) {
                return Ok(built.clone());
            }
            let logical = spec.getattr(logical_name)?;
            let built =
                fields.build(materialization_records, materialization_fields(m, &logical))?;
            let alone = PyTuple::new(py, [&built])?.into_any();
            shared.insert(key, (built.clone(), alone.clone()));
            Ok((built, alone))
        };
        let materializations = match record.materializations.as_slice() {
            [] => empty.clone(),
            [only] => materialization(only)?.1,
            several => PyTuple::new(
                py,
                several
                    .iter()
                    .map(|m| Ok(materialization(m)?.0))
                    .collect::<PyResult<Vec<_>>>()?,
            )?
            .into_any(),
        };
        entries.push(fields.build(
            value_records,
            value_fields(record, handle.bind(py), spec, &materializations),
        )?);
    }
    PyTuple::new(py, entries)
}

/// Explanation action records (docs/concepts/snapshots.md), one per simulated
/// action, paired with the plan's actions in execution order.
pub fn action_entries<'py>(
    py: Python<'py>,
    outcomes: &[ActionOutcome],
    actions: &Bound<'py, PyTuple>,
    action_records: &RecordBuilder,
    location_of: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyTuple>> {
    action_records.expect_fields(ACTION_FIELDS)?;
    let mut fields = Fields::new(py, location_of);
    let mut entries = Vec::with_capacity(outcomes.len().min(actions.len()));
    for (outcome, action) in outcomes.iter().zip(actions.iter()) {
        entries.push(fields.build(action_records, action_fields(outcome, &action))?);
    }
    PyTuple::new(py, entries)
}
