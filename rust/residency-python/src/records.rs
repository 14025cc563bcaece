//! The records users read in bulk (snapshot value entries, explanation actions),
//! built here in one call rather than one Python call per record.
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

use pyo3::IntoPyObjectExt;
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString, PyTuple, PyType};
use residency_core::tables::{ByCode, Last};
use residency_core::{ActionOutcome, Location, Materialization, ValueRecord};

/// Builds instances of one record class from field values in declaration order.
#[pyclass(frozen, module = "fhelium._core", name = "RecordBuilder")]
#[derive(Debug)]
pub struct RecordBuilder {
    record: Py<PyType>,
    fill: Py<PyType>,
    names: Vec<Py<PyString>>,
    class_name: Py<PyString>,
}

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
        })
    }

    /// The record class this builds.
    #[getter]
    fn record_class(&self, py: Python<'_>) -> Py<PyType> {
        self.record.clone_ref(py)
    }
}

impl RecordBuilder {
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
        self.build_with(py, fields.iter().map(|field| Ok(*field)))
    }

    /// One record from fields made one at a time, in declaration order.
    pub fn build_with<'py, V: IntoPyObject<'py>>(
        &self,
        py: Python<'py>,
        fields: impl IntoIterator<Item = PyResult<V>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let record = self.fill.bind(py).call0()?;
        for (name, value) in self.names.iter().zip(fields) {
            record.setattr(name.bind(py), value?)?;
        }
        record.setattr(self.class_name.bind(py), self.record.bind(py))?;
        Ok(record)
    }
}

/// Location records by core code, each asked of the glue once per bulk call.
pub struct Locations<'a, 'py> {
    location_of: &'a Bound<'py, PyAny>,
    known: ByCode<Bound<'py, PyAny>>,
}

impl<'a, 'py> Locations<'a, 'py> {
    pub fn new(location_of: &'a Bound<'py, PyAny>) -> Self {
        Self {
            location_of,
            known: ByCode::default(),
        }
    }

    pub fn get(&mut self, code: u32) -> PyResult<Bound<'py, PyAny>> {
        let location_of = self.location_of;
        self.known.get_or_try(code, || location_of.call1((code,)))
    }
}

/// Python ints for one column of byte counts, which mostly repeats the previous
/// row's value: that one is kept.
type Ints<'py> = Last<u64, Bound<'py, PyAny>>;

/// Python strings for reasons, converted once per distinct text in a bulk call.
#[derive(Default)]
pub struct Strings<'s, 'py> {
    known: HashMap<&'s str, Bound<'py, PyAny>>,
}

impl<'s, 'py> Strings<'s, 'py> {
    pub fn optional(&mut self, py: Python<'py>, text: Option<&'s str>) -> Bound<'py, PyAny> {
        let Some(text) = text else {
            return py.None().into_bound(py);
        };
        self.known
            .entry(text)
            .or_insert_with(|| PyString::new(py, text).into_any())
            .clone()
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
    value_records.expect_fields(6)?;
    materialization_records.expect_fields(7)?;
    let logical_name = intern!(py, "logical_nbytes");
    let none = py.None().into_bound(py);
    let empty = PyTuple::empty(py).into_any();
    let mut locations = Locations::new(location_of);
    // Equal materialisations (same spec, place and counts) share one record, and a
    // value with only that materialisation shares its one-element tuple too.
    let mut shared: HashMap<MaterializationKey, (Bound<'py, PyAny>, Bound<'py, PyAny>)> =
        HashMap::new();
    let mut entries = Vec::with_capacity(objects.len());
    for (record, (handle, spec)) in values.into_iter().zip(objects) {
        let spec = spec.bind(py);
        let mut materialization = |m: &Materialization| -> PyResult<_> {
            let key = (spec.as_ptr().addr(), *m);
            if let Some(built) = shared.get(&key) {
                return Ok(built.clone());
            }
            let built = materialization_records.build(
                py,
                &[
                    &locations.get(m.location.code())?,
                    &spec.getattr(logical_name)?,
                    &m.storage_nbytes.into_bound_py_any(py)?,
                    &m.charged_nbytes.into_bound_py_any(py)?,
                    &m.use_count.into_bound_py_any(py)?,
                    &m.hold_count.into_bound_py_any(py)?,
                    &m.pending_count.into_bound_py_any(py)?,
                ],
            )?;
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
        let source = match record.source {
            Some(location) => locations.get(location.code())?,
            None => none.clone(),
        };
        entries.push(
            value_records.build(
                py,
                &[
                    handle.bind(py),
                    spec,
                    &materializations,
                    &PyBool::new(py, record.source.is_some())
                        .to_owned()
                        .into_any(),
                    &source,
                    &PyBool::new(py, record.discarded).to_owned().into_any(),
                ],
            )?,
        );
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
    action_records.expect_fields(8)?;
    let mut locations = Locations::new(location_of);
    let mut logical = Ints::default();
    let mut storage = Ints::default();
    let mut reasons = Strings::default();
    let none = py.None().into_bound(py);
    let mut entries = Vec::with_capacity(outcomes.len().min(actions.len()));
    for (outcome, action) in outcomes.iter().zip(actions.iter()) {
        let mut location = |code: Option<Location>| match code {
            Some(location) => locations.get(location.code()),
            None => Ok(none.clone()),
        };
        entries.push(action_records.build(
            py,
            &[
                &action,
                &PyBool::new(py, outcome.executable).to_owned().into_any(),
                &PyBool::new(py, outcome.no_op).to_owned().into_any(),
                &location(outcome.source)?,
                &location(outcome.destination)?,
                &logical.get_or_try(outcome.logical_nbytes, || {
                    outcome.logical_nbytes.into_bound_py_any(py)
                })?,
                &storage.get_or_try(outcome.storage_nbytes, || {
                    outcome.storage_nbytes.into_bound_py_any(py)
                })?,
                &reasons.optional(py, outcome.reason.as_deref()),
            ],
        )?);
    }
    PyTuple::new(py, entries)
}
