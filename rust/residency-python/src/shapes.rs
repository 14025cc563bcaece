//! The spec records and type keys of adopted values, kept by shape: values of one
//! shape share one immutable spec record (see `direct`).

use pyo3::intern;
use pyo3::prelude::*;
use residency_core::tables::{Memo, Recent};
use residency_core::{SourceRefusal, ValueSpec};

use crate::context::Context;
use crate::errors::to_py_err;

/// Spec records and type keys of adopted values, by (type address, core spec): values
/// of one shape share one immutable spec record. The type object is kept alive by the
/// entry, so its address stays a valid key.
pub(crate) type ShapeKey = (usize, ValueSpec);

/// (type key, spec record, the type object that keeps the address valid).
pub(crate) type ShapeEntry = (u64, Py<PyAny>, Py<PyAny>);

/// What `read_spec` reads from a spec record: its type key, core spec and value type.
pub(crate) type SpecRead = (u64, ValueSpec, Py<PyAny>);

#[derive(Debug)]
pub struct AdoptedShapes {
    shapes: Memo<ShapeKey, ShapeEntry>,
    /// Type keys by type address, the type kept alive beside its key.
    type_keys: Memo<usize, (u64, Py<PyAny>)>,
    /// The spec record registered last and what was read from it: callers register
    /// many values with one immutable spec record.
    last_spec: Recent<SpecReading>,
}

impl Default for AdoptedShapes {
    fn default() -> Self {
        Self {
            shapes: Memo::default(),
            type_keys: Memo::default(),
            last_spec: Recent::new(1),
        }
    }
}

#[derive(Debug)]
struct SpecReading {
    record: Py<PyAny>,
    value_type: Py<PyAny>,
    type_key: u64,
    spec: ValueSpec,
}

impl AdoptedShapes {
    pub(crate) fn get(&self, py: Python<'_>, key: ShapeKey) -> Option<(u64, Py<PyAny>)> {
        self.shapes
            .get(&key, |(type_key, spec, _)| (*type_key, spec.clone_ref(py)))
    }

    pub(crate) fn insert(&self, key: ShapeKey, entry: ShapeEntry) {
        self.shapes.insert(key, entry);
    }

    /// What registering with `spec_record` needs: its type key, core spec and value
    /// type; or why `register_source` refuses the spec (`ValueSpec::source_bytes`).
    pub(crate) fn read_spec(
        &self,
        py: Python<'_>,
        context: &Context,
        spec_record: &Bound<'_, PyAny>,
    ) -> PyResult<Result<SpecRead, SourceRefusal>> {
        if let Some(read) = self.last_spec.find_map(|last| {
            last.record
                .bind(py)
                .is(spec_record)
                .then(|| (last.type_key, last.spec, last.value_type.clone_ref(py)))
        }) {
            return Ok(Ok(read));
        }
        let recoverability = spec_record.getattr(intern!(py, "recoverability"))?;
        let logical = spec_record.getattr(intern!(py, "logical_nbytes"))?;
        let storage = spec_record.getattr(intern!(py, "storage_nbytes"))?;
        let bytes = ValueSpec::source_bytes(
            context.is_must_preserve(&recoverability),
            logical.extract::<u64>().ok(),
            storage.extract::<u64>().ok(),
        );
        let (logical, storage) = match bytes {
            Ok(bytes) => bytes,
            Err(refusal) => return Ok(Err(refusal)),
        };
        let exclusive = context.is_exclusive(&spec_record.getattr(intern!(py, "replica_mode"))?);
        let value_type = spec_record.getattr(intern!(py, "value_type"))?;
        let type_key = self.type_key(py, context, &value_type)?;
        let spec = ValueSpec::reconstructible(logical, storage, exclusive)
            .map_err(|err| to_py_err(py, err))?;
        let value_type = value_type.unbind();
        self.last_spec.remember(SpecReading {
            record: spec_record.clone().unbind(),
            value_type: value_type.clone_ref(py),
            type_key,
            spec,
        });
        Ok(Ok((type_key, spec, value_type)))
    }

    pub(crate) fn type_key(
        &self,
        py: Python<'_>,
        context: &Context,
        value_type: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let address = value_type.as_ptr() as usize;
        if let Some(key) = self.type_keys.get(&address, |(key, _)| *key) {
            return Ok(key);
        }
        let key = context.type_key(py, value_type)?;
        self.type_keys
            .insert(address, (key, value_type.clone().unbind()));
        Ok(key)
    }
}
