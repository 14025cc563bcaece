//! `adopt` and host leases in one call each.
//!
//! Like the host transitions in `execute`, these decline (return `None`, having
//! changed nothing) whenever the glue's general path is needed: a CUDA location,
//! pending CUDA leases to reap, a value placed somewhere other than it claims, a
//! handle that does not resolve. The general path then raises the precise error.

use std::sync::{Mutex, PoisonError};

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyTuple, PyType};
use residency_core::FastMap;
use residency_core::{Location, Recoverability, ReplicaMode, ValueSpec};

use crate::errors::to_py_err;
use crate::manager::CoreManager;

/// Spec records and type keys of adopted values, by (type, logical, charge,
/// exclusive). Values of one shape share one immutable spec record. The type object
/// is kept alive by the entry, so its address stays a valid key.
/// (type address, logical, charge, exclusive).
type ShapeKey = (usize, u64, u64, bool);

/// (type key, spec record, the type object that keeps the address valid).
type ShapeEntry = (u64, Py<PyAny>, Py<PyAny>);

#[derive(Debug, Default)]
pub struct AdoptedShapes {
    shapes: Mutex<FastMap<ShapeKey, ShapeEntry>>,
    /// Type keys by type address, the type kept alive beside its key.
    type_keys: Mutex<FastMap<usize, (u64, Py<PyAny>)>>,
    /// The spec record registered last and what was read from it: callers register
    /// many values with one immutable spec record.
    last_spec: Mutex<Option<SpecReading>>,
}

#[derive(Debug)]
struct SpecReading {
    record: Py<PyAny>,
    value_type: Py<PyAny>,
    type_key: u64,
    spec: ValueSpec,
}

impl AdoptedShapes {
    fn get(&self, py: Python<'_>, key: ShapeKey) -> Option<(u64, Py<PyAny>)> {
        let shapes = self.shapes.lock().unwrap_or_else(PoisonError::into_inner);
        shapes
            .get(&key)
            .map(|(type_key, spec, _)| (*type_key, spec.clone_ref(py)))
    }

    fn insert(&self, key: ShapeKey, entry: ShapeEntry) {
        let mut shapes = self.shapes.lock().unwrap_or_else(PoisonError::into_inner);
        shapes.entry(key).or_insert(entry);
    }

    /// What registering with `spec_record` needs: its type key, core spec and value
    /// type. `None` for a spec the general path must refuse (`MUST_PRESERVE`, byte
    /// counts past 2**64 - 1).
    fn read_spec(
        &self,
        py: Python<'_>,
        context: &crate::execute::Context,
        spec_record: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(u64, ValueSpec, Py<PyAny>)>> {
        if let Some(last) = self
            .last_spec
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .filter(|last| last.record.bind(py).is(spec_record))
        {
            return Ok(Some((
                last.type_key,
                last.spec,
                last.value_type.clone_ref(py),
            )));
        }
        let recoverability = spec_record.getattr(intern!(py, "recoverability"))?;
        if context.is_must_preserve(&recoverability) {
            return Ok(None);
        }
        let (Ok(logical), Ok(storage)) = (
            spec_record
                .getattr(intern!(py, "logical_nbytes"))?
                .extract::<u64>(),
            spec_record
                .getattr(intern!(py, "storage_nbytes"))?
                .extract::<u64>(),
        ) else {
            return Ok(None);
        };
        let exclusive = context.is_exclusive(&spec_record.getattr(intern!(py, "replica_mode"))?);
        let value_type = spec_record.getattr(intern!(py, "value_type"))?;
        let type_key = self.type_key(py, context, &value_type)?;
        let spec = ValueSpec::new(
            logical,
            storage,
            if exclusive {
                ReplicaMode::Exclusive
            } else {
                ReplicaMode::Replicable
            },
            Recoverability::Reconstructible,
        )
        .map_err(|err| to_py_err(py, err))?;
        let value_type = value_type.unbind();
        let previous = self
            .last_spec
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(SpecReading {
                record: spec_record.clone().unbind(),
                value_type: value_type.clone_ref(py),
                type_key,
                spec,
            });
        drop(previous);
        Ok(Some((type_key, spec, value_type)))
    }

    fn type_key(
        &self,
        py: Python<'_>,
        context: &crate::execute::Context,
        value_type: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let address = value_type.as_ptr() as usize;
        if let Some((key, _)) = self
            .type_keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&address)
        {
            return Ok(*key);
        }
        let key = context.type_key(py, value_type)?;
        self.type_keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(address)
            .or_insert((key, value_type.clone().unbind()));
        Ok(key)
    }
}

/// The classes the one-call paths accept, looked up once per process.
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

/// Takes the gate as a transition for a one-call path, then applies queued releases
/// and reaps completed CUDA leases, as every transition does first.
fn begin(manager: &CoreManager, py: Python<'_>) -> PyResult<()> {
    manager.enter_transition_gate(py)?;
    crate::lifetimes::reap(manager, py).inspect_err(|_| manager.core().end_transition_and_exit())
}

/// Registers a reconstructible value whose source lives on the host, from a spec
/// record of the exact class; `None` when the general path is needed.
pub fn register(
    manager: &CoreManager,
    py: Python<'_>,
    spec_record: &Bound<'_, PyAny>,
    source: &Bound<'_, PyAny>,
    source_location: &Bound<'_, PyAny>,
) -> PyResult<Option<Py<PyAny>>> {
    let context = manager.context();
    let spec_class = VALUE_SPEC.import(py, "fhelium.residency.model", "ResidencyValueSpec")?;
    if !spec_record.get_type().is(spec_class) {
        return Ok(None);
    }
    let Some(location) = context.host_code(py, source_location)? else {
        return Ok(None);
    };
    match source.getattr(intern!(py, "load")) {
        Ok(load) if load.is_callable() => {}
        _ => return Ok(None),
    }
    let Some((type_key, spec, value_type)) =
        manager
            .adopted_shapes()
            .read_spec(py, context, spec_record)?
    else {
        return Ok(None);
    };
    begin(manager, py)?;
    let result = {
        manager.register_checked(
            py,
            type_key,
            spec,
            location,
            value_type,
            spec_record.clone().unbind(),
            source.clone().unbind(),
        )
    };
    manager.core().end_transition_and_exit();
    result.map(Some)
}

/// Adopts a host value: `at` is a host location record or `None` (the value's own
/// placement decides), `replica_mode` a `ReplicaMode` member. `None` for anything
/// else (a value that is not a `TensorResident`, a mode of another type).
pub fn adopt(
    manager: &CoreManager,
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    at: &Bound<'_, PyAny>,
    replica_mode: &Bound<'_, PyAny>,
) -> PyResult<Option<Py<PyAny>>> {
    let context = manager.context();
    let mode_class = REPLICA_MODE.import(py, "fhelium.residency.model", "ReplicaMode")?;
    if !replica_mode.get_type().is(mode_class) || !is_tensor_resident(py, value)? {
        return Ok(None);
    }
    let exclusive = context.is_exclusive(replica_mode);
    let requested = if at.is_none() {
        None
    } else {
        match context.host_code(py, at)? {
            Some(location) => Some(location),
            None => return Ok(None),
        }
    };
    begin(manager, py)?;
    let result = adopt_locked(manager, py, value, requested, replica_mode, exclusive);
    manager.core().end_transition_and_exit();
    result
}

fn adopt_locked(
    manager: &CoreManager,
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    requested: Option<Location>,
    replica_mode: &Bound<'_, PyAny>,
    exclusive: bool,
) -> PyResult<Option<Py<PyAny>>> {
    let context = manager.context();
    let facts = crate::execute::measure(context, py, value)?;
    if facts.device_code != -1 {
        return Ok(None);
    }
    // A value placed elsewhere than `at` (or mixing pinned and pageable tensors) is
    // the general path's to refuse, with its precise message.
    let location = match facts.pinned {
        Some(true) => Location::PinnedHost,
        Some(false) => Location::PageableHost,
        None => return Ok(None),
    };
    if requested.is_some_and(|requested| requested != location) {
        return Ok(None);
    }
    let value_type = value.get_type();
    let logical = facts.logical;
    let charge = logical.max(facts.storage);
    let key = (value_type.as_ptr() as usize, logical, charge, exclusive);
    let (type_key, spec_record) = if let Some(entry) = manager.adopted_shapes().get(py, key) {
        entry
    } else {
        let type_key: u64 = context.type_key(py, &value_type)?;
        let spec_record = context.adopted_spec(py, &value_type, logical, charge, replica_mode)?;
        let keep_type = value_type.clone().into_any().unbind();
        manager
            .adopted_shapes()
            .insert(key, (type_key, spec_record.clone_ref(py), keep_type));
        (type_key, spec_record)
    };
    let spec = ValueSpec::new(
        logical,
        charge,
        if exclusive {
            ReplicaMode::Exclusive
        } else {
            ReplicaMode::Replicable
        },
        Recoverability::MustPreserve,
    )
    .map_err(|err| to_py_err(py, err))?;
    let handle = manager.adopt_measured(
        py,
        type_key,
        spec,
        location,
        facts.storage,
        &facts.keys,
        value_type.into_any().unbind(),
        spec_record,
        value.clone().unbind(),
    )?;
    Ok(Some(handle))
}
