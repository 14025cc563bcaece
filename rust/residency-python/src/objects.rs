//! The Python objects a manager keeps beside the core's records, in the core's store
//! (`residency_core::objects::ObjectStore`), which keeps them by the core's handle
//! index and object ids. Every change here happens in the same binding call as the
//! core change it mirrors, so the two never disagree. The store's lock is never held
//! while Python code runs.
//!
//! The store's methods are used as they are, those that read an object given `share`
//! with the interpreter; `source` and `objects` are also given here with it.

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

/// A new reference to `object`, for the store's methods that read one.
pub(crate) fn share(py: Python<'_>) -> impl Fn(&Py<PyAny>) -> Py<PyAny> + '_ {
    move |object| object.clone_ref(py)
}

impl Objects {
    pub fn source(&self, py: Python<'_>, index: u32) -> Option<Py<PyAny>> {
        self.0.source(index, share(py))
    }

    /// The objects at `ids`, under one lock.
    pub fn objects(&self, py: Python<'_>, ids: &[ObjectId]) -> Vec<Py<PyAny>> {
        self.0.objects(ids, share(py))
    }
}
