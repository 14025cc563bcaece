//! One pass over a value's tensors: the facts the manager needs to admit it.
//!
//! This is the manager's hottest Python-facing loop (every adopt and install), so it
//! lives here: the same torch calls the Python version makes, without interpreter
//! overhead between them. Inconsistent values (no tensors, mixed devices, one storage
//! reporting two sizes) return `None`; the glue then raises the documented error.

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::{IntoPyObjectExt, intern};

/// What one pass over a value's tensors found.
#[derive(Clone, Debug)]
pub struct Facts<'py> {
    /// The value's `torch.device` where already known; else `first`'s is asked for
    /// when needed (only messages name it).
    pub device: Option<Bound<'py, PyAny>>,
    pub first: Option<Bound<'py, PyAny>>,
    /// -1 on the host, the CUDA index on CUDA, -2 elsewhere.
    pub device_code: i64,
    /// `Some(all pinned)`, or `None` for a host value mixing pinned and pageable.
    pub pinned: Option<bool>,
    pub logical: u64,
    pub storage: u64,
    /// (device code, data pointer) per unique non-empty storage.
    pub keys: Vec<(i64, u64)>,
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

/// Measures `tensors`, or `None` for an inconsistent value (no tensors, mixed
/// devices, one storage reporting two sizes).
pub fn measure<'py>(
    py: Python<'py>,
    tensors: &Bound<'py, PyTuple>,
    pinning_possible: bool,
) -> PyResult<Option<Facts<'py>>> {
    let Ok(first) = tensors.get_item(0) else {
        return Ok(None);
    };
    let on_host = first.getattr(intern!(py, "is_cpu"))?.is_truthy()?;
    // -2 marks a device that is neither the host nor CUDA (meta, mps, ...): it never
    // matches a residency location's code.
    let device_code: i64 = if on_host {
        -1
    } else if first.getattr(intern!(py, "is_cuda"))?.is_truthy()? {
        first.call_method0(intern!(py, "get_device"))?.extract()?
    } else {
        -2
    };
    let mut all_pinned = on_host;
    let mut any_pinned = false;
    let mut logical: u64 = 0;
    // Only a device that is neither the host nor CUDA is compared as an object.
    let device = if device_code == -2 {
        Some(first.getattr(intern!(py, "device"))?)
    } else {
        None
    };
    let mut storages: Vec<(u64, u64)> = Vec::with_capacity(tensors.len());
    for (position, tensor) in tensors.iter().enumerate() {
        if position > 0 && !same_device(py, &tensor, device.as_ref(), device_code)? {
            return Ok(None);
        }
        let nbytes: u64 = tensor.getattr(intern!(py, "nbytes"))?.extract()?;
        logical = logical.saturating_add(nbytes);
        let storage = tensor.call_method0(intern!(py, "untyped_storage"))?;
        let size: u64 = storage.call_method0(intern!(py, "nbytes"))?.extract()?;
        if size > 0 {
            let pointer: u64 = storage.call_method0(intern!(py, "data_ptr"))?.extract()?;
            match storages.iter().find(|(known, _)| *known == pointer) {
                Some(&(_, known_size)) if known_size != size => return Ok(None),
                Some(_) => {}
                None => storages.push((pointer, size)),
            }
            // Only memory can be pinned: a tensor without storage bytes is neither
            // pinned nor pageable (docs/concepts/locations-and-budgets.md#pinned-host).
            if on_host && pinning_possible {
                let pinned = tensor.call_method0(intern!(py, "is_pinned"))?.is_truthy()?;
                all_pinned &= pinned;
                any_pinned |= pinned;
            }
        }
    }
    // A host value without storage bytes reads as pageable; `execute::check_measured`
    // accepts it at either host location.
    let all_pinned = all_pinned && pinning_possible && !storages.is_empty();
    let pinned = (all_pinned || !any_pinned).then_some(all_pinned);
    let storage = storages
        .iter()
        .fold(0u64, |total, (_, size)| total.saturating_add(*size));
    let keys = storages
        .iter()
        .map(|(pointer, _)| (device_code, *pointer))
        .collect();
    Ok(Some(Facts {
        device,
        first: Some(first),
        device_code,
        pinned,
        logical,
        storage,
        keys,
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
    let keys = PyList::empty(py);
    for key in &facts.keys {
        keys.append(*key)?;
    }
    Ok(Some(PyTuple::new(
        py,
        [
            facts.device()?,
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
