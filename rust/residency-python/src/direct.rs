//! `adopt` and `register_source` in one call each: the argument checks, the gate,
//! the measurement and placement checks, and the core's record, with the precise
//! error for each refusal.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyTuple, PyType};
use residency_core::placement::PlacementError;
use residency_core::{Location, Refusal, SourceRefusal, ValueSpec};

use crate::errors::{refuse, to_py_err};
use crate::manager::CoreManager;
use crate::measure::Facts;

/// The classes `adopt` and `register_source` check for, looked up once per process.
static VALUE_SPEC: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static REPLICA_MODE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static TENSOR_RESIDENT: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `isinstance(value, TensorResident)`. `TensorResident` is an abstract base class,
/// whose `isinstance` runs a Python-level hook; a class that derives from it answers
/// from its method resolution order alone (the hook would say yes to it too), and
/// anything else (a registered virtual subclass) still asks `isinstance`.
fn is_tensor_resident(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
    let base = TENSOR_RESIDENT.import(py, "fhelium.values.tensor_resident", "TensorResident")?;
    if let Ok(mro) = value.get_type().getattr(intern!(py, "__mro__"))
        && let Ok(mro) = mro.cast::<PyTuple>()
        && mro.iter().any(|class| class.is(base))
    {
        return Ok(true);
    }
    value.is_instance(base)
}

/// Registers a reconstructible value (docs/concepts/values.md#register-a-source).
///
/// Argument types are checked before the gate; the location, the spec's
/// recoverability and its byte counts inside it, in that order.
pub fn register(
    manager: &CoreManager,
    py: Python<'_>,
    spec_record: &Bound<'_, PyAny>,
    source: &Bound<'_, PyAny>,
    source_location: &Bound<'_, PyAny>,
) -> PyResult<Py<PyAny>> {
    let spec_class = VALUE_SPEC.import(py, "fhelium.residency.model", "ResidencyValueSpec")?;
    if !spec_record.is_instance(spec_class)? {
        return Err(refuse(
            py,
            Refusal::NotASpec {
                got: &spec_record.get_type().name()?.to_cow()?,
            },
        ));
    }
    match source.getattr(intern!(py, "load")) {
        Ok(load) if load.is_callable() => {}
        _ => return Err(refuse(py, Refusal::SourceNotLoadable)),
    }
    crate::execute::in_transition(manager, py, || {
        register_locked(manager, py, spec_record, source, source_location)
    })
}

fn register_locked(
    manager: &CoreManager,
    py: Python<'_>,
    spec_record: &Bound<'_, PyAny>,
    source: &Bound<'_, PyAny>,
    source_location: &Bound<'_, PyAny>,
) -> PyResult<Py<PyAny>> {
    let context = manager.context();
    let location = context.location_code(py, source_location)?;
    if location.is_disk() {
        return Err(refuse(
            py,
            Refusal::SourceOnDisk {
                location: &source_location.str()?.to_cow()?,
            },
        ));
    }
    let (type_key, spec, value_type) =
        match manager
            .adopted_shapes()
            .read_spec(py, context, spec_record)?
        {
            Ok(read) => read,
            Err(refusal) => return Err(refused_spec(py, spec_record, refusal)?),
        };
    manager.register_checked(
        py,
        type_key,
        spec,
        location,
        value_type,
        spec_record.clone().unbind(),
        source.clone().unbind(),
    )
}

/// The error for a spec `register_source` refuses (`ValueSpec::source_bytes`).
fn refused_spec(
    py: Python<'_>,
    spec_record: &Bound<'_, PyAny>,
    refusal: SourceRefusal,
) -> PyResult<PyErr> {
    let nbytes = match refusal.field() {
        Some(field) => spec_record.getattr(field.attribute())?.str()?.to_string(),
        None => String::new(),
    };
    Ok(refuse(py, Refusal::of_source(refusal, &nbytes)))
}

/// Adopts a value as a `MUST_PRESERVE` managed value
/// (docs/concepts/values.md#adopt): `at` is a location record, or `None` for the
/// value's own placement.
///
/// The value's type is checked before the gate; inside it the location, the value's
/// placement and then `replica_mode`, in that order.
pub fn adopt(
    manager: &CoreManager,
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    at: &Bound<'_, PyAny>,
    replica_mode: &Bound<'_, PyAny>,
) -> PyResult<Py<PyAny>> {
    if !is_tensor_resident(py, value)? {
        return Err(refuse(
            py,
            Refusal::NotTensorResident {
                got: &value.get_type().name()?.to_cow()?,
                tensor: crate::errors::is_tensor(py, value)?,
            },
        ));
    }
    crate::execute::in_transition(manager, py, || {
        adopt_locked(manager, py, value, at, replica_mode)
    })
}

fn adopt_locked(
    manager: &CoreManager,
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    at: &Bound<'_, PyAny>,
    replica_mode: &Bound<'_, PyAny>,
) -> PyResult<Py<PyAny>> {
    let context = manager.context();
    let (location, facts) = if at.is_none() {
        let facts = crate::measure::measure_value(context, py, value)?;
        (placement_of(manager, py, value, &facts)?, facts)
    } else {
        let location = context.location_code(py, at)?;
        (location, crate::measure::measure_value(context, py, value)?)
    };
    crate::measure::check_measured(context, py, &facts, location, value)?;
    let mode_class = REPLICA_MODE.import(py, "fhelium.residency.model", "ReplicaMode")?;
    if !replica_mode.is_instance(mode_class)? {
        return Err(refuse(
            py,
            Refusal::NotAReplicaMode {
                got: &replica_mode.get_type().name()?.to_cow()?,
            },
        ));
    }
    let exclusive = context.is_exclusive(replica_mode);
    let value_type = value.get_type();
    let spec = ValueSpec::adopted(facts.facts.logical, facts.facts.storage, exclusive);
    let key = (value_type.as_ptr().addr(), spec);
    let (type_key, spec_record) = if let Some(entry) = manager.adopted_shapes().get(py, key) {
        entry
    } else {
        let type_key: u64 = context.type_key(py, &value_type)?;
        let spec_record = context.adopted_spec(
            py,
            &value_type,
            spec.logical_nbytes(),
            spec.storage_nbytes(),
            replica_mode,
        )?;
        let keep_type = value_type.clone().into_any().unbind();
        manager
            .adopted_shapes()
            .insert(key, (type_key, spec_record.clone_ref(py), keep_type));
        (type_key, spec_record)
    };
    manager.adopt_measured(
        py,
        type_key,
        spec,
        location,
        facts.facts.storage,
        &facts.facts.keys,
        value_type.into_any().unbind(),
        spec_record,
        value.clone().unbind(),
    )
}

/// Where a value adopted without `at` lives (the core's `ValueFacts::placement`),
/// its CUDA location checked against the devices the runtime reports.
fn placement_of(
    manager: &CoreManager,
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    facts: &Facts<'_>,
) -> PyResult<Location> {
    let context = manager.context();
    match facts.facts.placement() {
        Ok(cuda @ Location::Cuda(_)) => context.location_code(py, &context.location(py, cuda)?),
        Ok(location) => Ok(location),
        Err(PlacementError::Core(err)) => Err(to_py_err(py, err)),
        Err(PlacementError::Misplaced(why)) => {
            Err(crate::measure::misplaced(py, why, value, "", "")?)
        }
    }
}
