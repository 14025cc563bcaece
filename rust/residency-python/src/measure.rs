//! One pass over a value's tensors: the facts the manager needs to admit it.
//!
//! This is the manager's hottest Python-facing loop (every adopt and install), so it
//! lives here: the same torch calls the Python version makes, without interpreter
//! overhead between them. Inconsistent values (no tensors, mixed devices, one storage
//! reporting two sizes) return `None`; the glue then raises the documented error.

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::{IntoPyObjectExt, intern};
use residency_core::{Measurement, ValueFacts};

/// What one pass over a value's tensors found: the core's facts, and the objects
/// that name the value's device.
#[derive(Clone, Debug)]
pub struct Facts<'py> {
    /// The value's `torch.device` where already known; else `first`'s is asked for
    /// when needed (only messages name it).
    pub device: Option<Bound<'py, PyAny>>,
    pub first: Option<Bound<'py, PyAny>>,
    pub facts: ValueFacts,
}

impl<'py> Facts<'py> {
    /// The value's `torch.device` (its first tensor's).
    pub fn device(&self) -> PyResult<Bound<'py, PyAny>> {
        match (&self.device, &self.first) {
            (Some(device), _) => Ok(device.clone()),
            (None, Some(first)) => first.getattr(intern!(first.py(), "device")),
            (None, None) => Err(pyo3::exceptions::PyRuntimeError::new_err(
                "internal error: a measurement without a device",
            )),
        }
    }
}

/// Measures `tensors` (the core folds what the tensors say, `Measurement`), or
/// `None` for an inconsistent value (no tensors, mixed devices, one storage
/// reporting two sizes).
pub fn measure<'py>(
    py: Python<'py>,
    tensors: &Bound<'py, PyTuple>,
    pinning_possible: bool,
) -> PyResult<Option<Facts<'py>>> {
    let Ok(first) = tensors.get_item(0) else {
        return Ok(None);
    };
    // -2 marks a device that is neither the host nor CUDA (meta, mps, ...): it never
    // matches a residency location's code.
    let device_code: i64 = if first.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
        -1
    } else if first.getattr(intern!(py, "is_cuda"))?.is_truthy()? {
        first.call_method0(intern!(py, "get_device"))?.extract()?
    } else {
        -2
    };
    // Only a device that is neither the host nor CUDA is compared as an object.
    let device = if device_code == -2 {
        Some(first.getattr(intern!(py, "device"))?)
    } else {
        None
    };
    let mut measurement = Measurement::new(device_code, pinning_possible, tensors.len());
    for (position, tensor) in tensors.iter().enumerate() {
        if position > 0 && !same_device(py, &tensor, device.as_ref(), device_code)? {
            return Ok(None);
        }
        measurement.add_tensor(tensor.getattr(intern!(py, "nbytes"))?.extract()?);
        let storage = tensor.call_method0(intern!(py, "untyped_storage"))?;
        let size: u64 = storage.call_method0(intern!(py, "nbytes"))?.extract()?;
        if size > 0 {
            let pointer: u64 = storage.call_method0(intern!(py, "data_ptr"))?.extract()?;
            if measurement.add_storage(pointer, size).is_err() {
                return Ok(None);
            }
            if measurement.asks_pinned() {
                measurement.add_pinned(tensor.call_method0(intern!(py, "is_pinned"))?.is_truthy()?);
            }
        }
    }
    Ok(Some(Facts {
        device,
        first: Some(first),
        facts: measurement.finish(),
    }))
}

/// `(first_device, device_code, pinned, logical, storage, keys)` or `None`.
///
/// `device_code` is -1 on the host, the CUDA index on CUDA, -2 elsewhere; `pinned` is
/// `True`/`False`, or `None` for a host value mixing pinned and pageable tensors.
///
/// `pinning_possible=False` (no accelerator in this process, so no tensor can be
/// pinned) skips the per-tensor `is_pinned()` query.
#[pyfunction]
#[pyo3(signature = (tensors, pinning_possible=true, /))]
pub fn measure_tensors<'py>(
    py: Python<'py>,
    tensors: &Bound<'py, PyTuple>,
    pinning_possible: bool,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let Some(facts) = measure(py, tensors, pinning_possible)? else {
        return Ok(None);
    };
    let device = facts.device()?;
    let facts = facts.facts;
    let keys = PyList::empty(py);
    for key in &facts.keys {
        keys.append(*key)?;
    }
    Ok(Some(PyTuple::new(
        py,
        [
            device,
            facts.device_code.into_bound_py_any(py)?,
            facts.pinned.into_bound_py_any(py)?,
            facts.logical.into_bound_py_any(py)?,
            facts.storage.into_bound_py_any(py)?,
            keys.into_any(),
        ],
    )?))
}

/// Whether `tensor` is on the first tensor's device, through cheap flags where the
/// device code already says which device that is.
fn same_device(
    py: Python<'_>,
    tensor: &Bound<'_, PyAny>,
    device: Option<&Bound<'_, PyAny>>,
    device_code: i64,
) -> PyResult<bool> {
    match (device_code, device) {
        (-1, _) => tensor.getattr(intern!(py, "is_cpu"))?.is_truthy(),
        (-2, Some(device)) => tensor.getattr(intern!(py, "device"))?.eq(device),
        (index, _) => Ok(tensor.getattr(intern!(py, "is_cuda"))?.is_truthy()?
            && tensor
                .call_method0(intern!(py, "get_device"))?
                .extract::<i64>()?
                == index),
    }
}
