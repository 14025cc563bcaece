//! One pass over a value's tensors: the facts the manager needs to admit it.
//!
//! This is the manager's hottest Python-facing loop (every adopt and install), so it
//! lives here: the same torch calls the Python version makes, without interpreter
//! overhead between them. Inconsistent values (no tensors, mixed devices, one storage
//! reporting two sizes) return `None`; the glue then raises the documented error.

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::{IntoPyObjectExt, intern};
use residency_core::{
    HandleId, Location, Measurement, Misplaced, Misplacement, Refusal, ValueFacts,
};

use crate::context::Context;
use crate::errors::{refuse, to_py_err};
use crate::manager::CoreManager;

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
    // A device that is neither the host nor CUDA (meta, mps, ...) is `ELSEWHERE`: it
    // never matches a residency location's code.
    let device_code: i64 = if first.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
        ValueFacts::HOST
    } else if first.getattr(intern!(py, "is_cuda"))?.is_truthy()? {
        first.call_method0(intern!(py, "get_device"))?.extract()?
    } else {
        ValueFacts::ELSEWHERE
    };
    // Only a device that is neither the host nor CUDA is compared as an object.
    let device = if device_code == ValueFacts::ELSEWHERE {
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
        (ValueFacts::HOST, _) => tensor.getattr(intern!(py, "is_cpu"))?.is_truthy(),
        (ValueFacts::ELSEWHERE, Some(device)) => tensor.getattr(intern!(py, "device"))?.eq(device),
        (index, _) => Ok(tensor.getattr(intern!(py, "is_cuda"))?.is_truthy()?
            && tensor
                .call_method0(intern!(py, "get_device"))?
                .extract::<i64>()?
                == index),
    }
}

/// Type and placement of a candidate value, and its measured facts: the core's ticket
/// checks the bytes (on `loaded` or at the install). `known` are the facts the runtime
/// gave with a copy it made (`copy_to_cuda_measured`): exactly what `measure` would
/// return, so the value is not measured again.
pub(crate) fn validate<'py>(
    manager: &CoreManager,
    py: Python<'py>,
    index: HandleId,
    at: Location,
    value: &Bound<'py, PyAny>,
    known: Option<&Facts<'py>>,
) -> PyResult<Facts<'py>> {
    let context = manager.context();
    if let Location::Disk(_) = at {
        // A stored file: its byte counts are those of the value written.
        let (logical, storage): (u64, u64) = context
            .disk
            .bind(py)
            .call_method1(intern!(py, "facts"), (value,))?
            .extract()?;
        return Ok(Facts {
            device: None,
            first: None,
            facts: ValueFacts::stored(logical, storage),
        });
    }
    let spec = manager.spec_object(py, index)?;
    let value_type = spec.bind(py).getattr(intern!(py, "value_type"))?;
    if !value.is_instance(&value_type)? {
        let handle = manager.handle_object(py, index)?;
        let handle_id = handle.bind(py).getattr(intern!(py, "handle_id"))?;
        return Err(refuse(
            py,
            Refusal::WrongValueType {
                expected: &value_type
                    .getattr(intern!(py, "__name__"))?
                    .str()?
                    .to_cow()?,
                handle: &handle_id.repr()?.to_cow()?,
                got: &value.get_type().name()?.to_cow()?,
                tensor: crate::errors::is_tensor(py, value)?,
            },
        ));
    }
    let facts = match known {
        Some(facts) => facts.clone(),
        None => measure_value(context, py, value)?,
    };
    check_measured(context, py, &facts, at, value)?;
    Ok(facts)
}

/// The facts of `value`: from one pass over its tensors where the runtime measures
/// with torch, else from the runtime's `measure`.
pub(crate) fn measure_value<'py>(
    context: &Context,
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
) -> PyResult<Facts<'py>> {
    let runtime = context.runtime.bind(py);
    if context.native_measure {
        let tensors = value.getattr(intern!(py, "_resident_tensors"))?;
        if let Ok(tensors) = tensors.cast::<PyTuple>()
            && let Some(facts) = measure(py, tensors, context.pinning_possible)?
        {
            return Ok(facts);
        }
    }
    // The runtime's own measurement: it raises the documented error for a value
    // whose tensors disagree.
    facts_of(&runtime.call_method1(intern!(py, "measure"), (value,))?)
}

/// The runtime's `ValueFacts` (what its `measure` returns) read into `Facts`.
pub(crate) fn facts_of<'py>(facts: &Bound<'py, PyAny>) -> PyResult<Facts<'py>> {
    Ok(Facts {
        device: Some(item(facts, 0)?),
        first: None,
        facts: ValueFacts {
            device_code: item(facts, 1)?.extract()?,
            pinned: item(facts, 2)?.extract()?,
            logical: item(facts, 3)?.extract()?,
            storage: item(facts, 4)?.extract()?,
            keys: keys_of(&item(facts, 5)?)?,
        },
    })
}

/// The facts of a simulated runtime's native copy (`residency_sim::Copied`): what its
/// `measure` says of the copy.
pub(crate) fn copied_facts<'py>(copied: &residency_sim::Copied<'py>) -> Facts<'py> {
    Facts {
        device: Some(copied.device.clone()),
        first: None,
        facts: ValueFacts::device_copy(
            copied.index,
            copied.nbytes,
            copied.pointers.iter().copied(),
        ),
    }
}

/// Item `index` of what the runtime gave back: a tuple's (a named tuple's too) read
/// directly, another sequence's indexed.
pub(crate) fn item<'py>(sequence: &Bound<'py, PyAny>, index: usize) -> PyResult<Bound<'py, PyAny>> {
    match sequence.cast::<PyTuple>() {
        Ok(tuple) => tuple.get_item(index),
        Err(_) => sequence.get_item(index),
    }
}

/// A value's storage keys, `(device code, data pointer)` pairs: a list of tuples read
/// directly, anything else extracted as a sequence.
fn keys_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<(i64, u64)>> {
    let Ok(list) = keys.cast::<PyList>() else {
        return keys.extract();
    };
    list.iter()
        .map(|key| match key.cast::<PyTuple>() {
            Ok(pair) if pair.len() == 2 => {
                Ok((pair.get_item(0)?.extract()?, pair.get_item(1)?.extract()?))
            }
            _ => key.extract(),
        })
        .collect()
}

/// Refuses a value measured somewhere other than `at`, by name: the core's placement
/// rule and diagnosis (`ValueFacts::misplaced`), with the names its message needs.
pub(crate) fn check_measured(
    context: &Context,
    py: Python<'_>,
    facts: &Facts<'_>,
    at: Location,
    value: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let Some(why) = facts.facts.misplaced(at) else {
        return Ok(());
    };
    let device = if why.names_device() {
        facts.device()?.str()?.to_string()
    } else {
        String::new()
    };
    let location = context.location(py, at)?.str()?;
    Err(misplaced(py, why, value, &location.to_cow()?, &device)?)
}

/// The error refusing `value` as misplaced (`why`), naming the location it should be
/// at and the device it was measured on where the message needs them.
pub(crate) fn misplaced(
    py: Python<'_>,
    why: Misplaced,
    value: &Bound<'_, PyAny>,
    location: &str,
    device: &str,
) -> PyResult<PyErr> {
    let misplacement = Misplacement {
        why,
        value: &value.get_type().name()?.to_cow()?,
        location,
        device,
    }
    .error();
    Ok(to_py_err(py, misplacement))
}
