//! The Python objects a manager keeps beside the core's records, in the core's store
//! (`residency_core::objects::ObjectStore`), which keeps them by the core's handle
//! index and object ids. Every change here happens in the same binding call as the
//! core change it mirrors, so the two never disagree. The store's lock is never held
//! while Python code runs.
//!
//! The store's methods that forget or keep objects are used as they are; those that
//! read an object are given here with the interpreter that shares it.

use std::ops::Deref;

use pyo3::prelude::*;
use residency_core::ObjectId;
use residency_core::objects::ObjectStore;

#[derive(Debug, Default)]
pub struct Objects(ObjectStore<Py<PyAny>>);

impl Deref for Objects {
    type Target = ObjectStore<Py<PyAny>>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

/// A new reference to `object`.
fn share(py: Python<'_>) -> impl Fn(&Py<PyAny>) -> Py<PyAny> + '_ {
    move |object| object.clone_ref(py)
}

impl Objects {
    pub fn handle(&self, py: Python<'_>, index: u32) -> Option<Py<PyAny>> {
        self.0.handle(index, share(py))
    }

    /// The issued handle objects at `indices`, under one lock.
    pub fn handles_at(
        &self,
        py: Python<'_>,
        indices: impl IntoIterator<Item = Option<u32>>,
    ) -> Vec<Option<Py<PyAny>>> {
        self.0.handles_at(indices, share(py))
    }

    pub fn spec(&self, py: Python<'_>, index: u32) -> Option<Py<PyAny>> {
        self.0.spec(index, share(py))
    }

    pub fn source(&self, py: Python<'_>, index: u32) -> Option<Py<PyAny>> {
        self.0.source(index, share(py))
    }

    /// Handles and specs of the first `count` values, for snapshot entries.
    pub fn handles_and_specs(&self, py: Python<'_>, count: usize) -> Vec<(Py<PyAny>, Py<PyAny>)> {
        self.0.handles_and_specs(count, share(py))
    }

    pub fn value(&self, py: Python<'_>, index: u32, code: u32) -> Option<Py<PyAny>> {
        self.0.value(index, code, share(py))
    }

    /// The stream that allocated the materialisation's memory, when the manager
    /// made the copy.
    pub fn stream(&self, py: Python<'_>, index: u32, code: u32) -> Option<Py<PyAny>> {
        self.0.stream(index, code, share(py))
    }

    pub fn label(&self, py: Python<'_>, token: u64) -> Option<Py<PyAny>> {
        self.0.label(token, share(py))
    }

    /// The object at `id`, while the core refers to it.
    pub fn object(&self, py: Python<'_>, id: ObjectId) -> Option<Py<PyAny>> {
        self.0.object(id, share(py))
    }

    /// The objects at `ids`, under one lock.
    pub fn objects(&self, py: Python<'_>, ids: &[ObjectId]) -> Vec<Py<PyAny>> {
        self.0.objects(ids, share(py))
    }
}
