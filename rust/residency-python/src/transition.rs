//! Committed transitions as the core's plain data (`residency_core::report`), and
//! their report records, built once each when first read
//! (docs/concepts/transitions.md#reports).

use std::sync::Arc;

use pyo3::IntoPyObjectExt;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTuple;
pub(crate) use residency_core::report::now_ns;
use residency_core::report::{Field, TransitionFacts};

use crate::records::{RecordBuilder, set_field};

/// The report records of `transitions`, in order, each built once.
pub fn reports<'py>(
    py: Python<'py>,
    builder: &RecordBuilder,
    transitions: &[Arc<Transition>],
) -> PyResult<Bound<'py, PyTuple>> {
    let reports = transitions
        .iter()
        .map(|transition| transition.report(py, builder))
        .collect::<PyResult<Vec<_>>>()?;
    PyTuple::new(py, reports)
}

/// One committed transition, kept as plain data until its report is read: a plan
/// builds no report objects while it runs, and the trace and the plan's report share
/// one record per transition, built once (docs/concepts/transitions.md#reports).
pub struct Transition {
    pub(crate) facts: TransitionFacts<Py<PyAny>>,
    pub(crate) report: PyOnceLock<Py<PyAny>>,
}

impl std::fmt::Debug for Transition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transition")
            .field("facts", &self.facts)
            .finish_non_exhaustive()
    }
}

impl Transition {
    pub(crate) fn new(facts: TransitionFacts<Py<PyAny>>) -> Self {
        Self {
            facts,
            report: PyOnceLock::new(),
        }
    }

    /// The transition's report record, built on first use without running Python
    /// code; later calls return the same object.
    pub fn report<'py>(
        &self,
        py: Python<'py>,
        builder: &RecordBuilder,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.report
            .get_or_try_init(py, || self.build(py, builder))
            .map(|report| report.bind(py).clone())
    }

    fn build(&self, py: Python<'_>, builder: &RecordBuilder) -> PyResult<Py<PyAny>> {
        let fields = self.facts.fields();
        let report = builder.build_each(py, fields, |record, name, _, value| {
            set_field(
                record,
                name,
                value,
                |object| object.bind(py),
                |other| match other {
                    Field::Count(count) => count.into_bound_py_any(py),
                    _ => Err(PyRuntimeError::new_err(
                        "internal error: a report field that is not a count",
                    )),
                },
            )
        })?;
        Ok(report.unbind())
    }
}
