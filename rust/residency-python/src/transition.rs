//! Committed transitions as plain data, and their report records, built once each
//! when first read (docs/concepts/transitions.md#reports).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use pyo3::IntoPyObjectExt;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyTuple};

use crate::records::RecordBuilder;

pub(crate) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX)
        })
}

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
    pub(crate) action: Py<PyAny>,
    pub(crate) no_op: bool,
    pub(crate) source: Option<Py<PyAny>>,
    pub(crate) destination: Option<Py<PyAny>>,
    pub(crate) logical: u64,
    pub(crate) storage: u64,
    pub(crate) started: u64,
    pub(crate) completed: u64,
    pub(crate) allocator: Option<Box<Allocator>>,
    pub(crate) reason: Option<Py<PyAny>>,
    pub(crate) report: PyOnceLock<Py<PyAny>>,
}

impl std::fmt::Debug for Transition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transition")
            .field("action", &self.action)
            .field("no_op", &self.no_op)
            .field("started", &self.started)
            .field("completed", &self.completed)
            .finish_non_exhaustive()
    }
}

/// The allocator's device and figures around a transition that touched CUDA.
#[derive(Debug)]
pub(crate) struct Allocator {
    pub(crate) device: Py<PyAny>,
    pub(crate) before: Option<(Py<PyAny>, Py<PyAny>)>,
    pub(crate) after: Option<(Py<PyAny>, Py<PyAny>)>,
}

impl Transition {
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
        let none = py.None().into_bound(py);
        let optional = |object: &Option<Py<PyAny>>| {
            object
                .as_ref()
                .map_or_else(|| none.clone(), |object| object.bind(py).clone())
        };
        let figures = |sample: Option<&(Py<PyAny>, Py<PyAny>)>| match sample {
            Some((allocated, reserved)) => (allocated.bind(py).clone(), reserved.bind(py).clone()),
            None => (none.clone(), none.clone()),
        };
        let allocator = self.allocator.as_deref();
        let (allocated_before, reserved_before) =
            figures(allocator.and_then(|allocator| allocator.before.as_ref()));
        let (allocated_after, reserved_after) =
            figures(allocator.and_then(|allocator| allocator.after.as_ref()));
        let fields = [
            self.action.bind(py).clone(),
            PyBool::new(py, self.no_op).to_owned().into_any(),
            optional(&self.source),
            optional(&self.destination),
            self.logical.into_bound_py_any(py)?,
            self.storage.into_bound_py_any(py)?,
            self.started.into_bound_py_any(py)?,
            self.completed.into_bound_py_any(py)?,
            allocator.map_or_else(
                || none.clone(),
                |allocator| allocator.device.bind(py).clone(),
            ),
            allocated_before,
            reserved_before,
            allocated_after,
            reserved_after,
            optional(&self.reason),
        ];
        let fields: Vec<&Bound<'_, PyAny>> = fields.iter().collect();
        Ok(builder.build(py, &fields)?.unbind())
    }
}
