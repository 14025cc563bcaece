//! The Python objects a manager keeps beside the core's records, indexed by the
//! core's handle index: the handle and spec objects it issued, the value objects
//! of every materialisation, the reconstruction sources, reservation labels, and
//! the events (and copies' sources) the core knows by id, in an array at those ids.
//!
//! The core owns the records; these are only the objects it cannot hold. Every
//! change here happens in the same binding call as the core change it mirrors, so
//! the two never disagree. The mutex is never held while Python code runs.

use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::prelude::*;
use residency_core::{FastMap, Freed, ObjectId};

/// One value's objects. Kept small: a million registered values are a common case,
/// and most have no materialisation at a given moment.
#[derive(Debug)]
struct Entry {
    handle: Py<PyAny>,
    spec: Py<PyAny>,
    source: Option<Py<PyAny>>,
}

#[derive(Debug, Default)]
struct Store {
    entries: Vec<Entry>,
    /// The object of each materialisation, by (handle index, location code).
    values: FastMap<(u32, u32), Py<PyAny>>,
    /// The stream that allocated each device materialisation the manager copied
    /// there (its owning stream, docs/concepts/controller.md#evicting-around-reads-in-flight).
    streams: FastMap<(u32, u32), Py<PyAny>>,
    labels: FastMap<u64, Py<PyAny>>,
    /// The objects the core knows by id (`residency_core::ObjectId`): the events of
    /// pending leases and transfers in flight, what a copy in flight reads, and a
    /// weak reference to each lease tracked for its finalizer.
    slots: Vec<Option<Py<PyAny>>>,
}

/// Python objects released together, after the store's lock.
pub type Released = Vec<Py<PyAny>>;

#[derive(Debug, Default)]
pub struct Objects {
    store: Mutex<Store>,
}

impl Objects {
    fn store(&self) -> MutexGuard<'_, Store> {
        // Every method leaves the store consistent before it can panic.
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers the objects of the value the core just issued as `index`.
    pub fn push(
        &self,
        index: u32,
        handle: Py<PyAny>,
        spec: Py<PyAny>,
        source: Option<Py<PyAny>>,
        value: Option<(u32, Py<PyAny>)>,
    ) {
        let mut store = self.store();
        debug_assert_eq!(store.entries.len(), index as usize);
        store.entries.push(Entry {
            handle,
            spec,
            source,
        });
        if let Some((code, value)) = value {
            store.values.insert((index, code), value);
        }
    }

    pub fn handle(&self, py: Python<'_>, index: u32) -> Option<Py<PyAny>> {
        let store = self.store();
        store
            .entries
            .get(index as usize)
            .map(|entry| entry.handle.clone_ref(py))
    }

    /// The issued handle objects at `indices`, under one lock.
    pub fn handles_at(
        &self,
        py: Python<'_>,
        indices: impl IntoIterator<Item = Option<u32>>,
    ) -> Vec<Option<Py<PyAny>>> {
        let store = self.store();
        indices
            .into_iter()
            .map(|index| {
                index
                    .and_then(|index| store.entries.get(index as usize))
                    .map(|entry| entry.handle.clone_ref(py))
            })
            .collect()
    }

    pub fn spec(&self, py: Python<'_>, index: u32) -> Option<Py<PyAny>> {
        let store = self.store();
        store
            .entries
            .get(index as usize)
            .map(|entry| entry.spec.clone_ref(py))
    }

    pub fn source(&self, py: Python<'_>, index: u32) -> Option<Py<PyAny>> {
        let store = self.store();
        store
            .entries
            .get(index as usize)
            .and_then(|entry| entry.source.as_ref().map(|source| source.clone_ref(py)))
    }

    /// Handles and specs of the first `count` values, for snapshot entries.
    pub fn handles_and_specs(&self, py: Python<'_>, count: usize) -> Vec<(Py<PyAny>, Py<PyAny>)> {
        let store = self.store();
        store
            .entries
            .iter()
            .take(count)
            .map(|entry| (entry.handle.clone_ref(py), entry.spec.clone_ref(py)))
            .collect()
    }

    pub fn value(&self, py: Python<'_>, index: u32, code: u32) -> Option<Py<PyAny>> {
        let store = self.store();
        store
            .values
            .get(&(index, code))
            .map(|value| value.clone_ref(py))
    }

    /// Keeps `value` as the object of the materialisation; a replaced object is
    /// returned so it dies after the lock.
    /// A new object has no known owning stream until `set_stream` names it.
    pub fn set_value(&self, index: u32, code: u32, value: Py<PyAny>) -> Option<Py<PyAny>> {
        let mut store = self.store();
        let stream = store.streams.remove(&(index, code));
        let replaced = store.values.insert((index, code), value);
        drop(store);
        drop(stream);
        replaced
    }

    /// Removes one materialisation's object; it is released after the lock.
    pub fn take_value(&self, index: u32, code: u32) -> Option<Py<PyAny>> {
        let mut store = self.store();
        let stream = store.streams.remove(&(index, code));
        let value = store.values.remove(&(index, code));
        drop(store);
        drop(stream);
        value
    }

    /// Names the stream that allocated the materialisation's memory.
    pub fn set_stream(&self, index: u32, code: u32, stream: Py<PyAny>) -> Option<Py<PyAny>> {
        let mut store = self.store();
        if !store.values.contains_key(&(index, code)) {
            return Some(stream);
        }
        store.streams.insert((index, code), stream)
    }

    /// The stream that allocated the materialisation's memory, when the manager
    /// made the copy.
    pub fn stream(&self, py: Python<'_>, index: u32, code: u32) -> Option<Py<PyAny>> {
        self.store()
            .streams
            .get(&(index, code))
            .map(|stream| stream.clone_ref(py))
    }

    /// Forgets a discarded value's materialisations (at `codes`) and source; the
    /// handle and spec stay for snapshots. The objects are returned so they die after
    /// the lock.
    pub fn discard(&self, index: u32, codes: &[u32]) -> Vec<Py<PyAny>> {
        let mut store = self.store();
        let mut released: Vec<Py<PyAny>> = codes
            .iter()
            .filter_map(|code| store.values.remove(&(index, *code)))
            .collect();
        for code in codes {
            released.extend(store.streams.remove(&(index, *code)));
        }
        if let Some(entry) = store.entries.get_mut(index as usize) {
            released.extend(entry.source.take());
        }
        released
    }

    pub fn set_label(&self, token: u64, label: Py<PyAny>) {
        self.store().labels.insert(token, label);
    }

    pub fn label(&self, py: Python<'_>, token: u64) -> Option<Py<PyAny>> {
        self.store()
            .labels
            .get(&token)
            .map(|label| label.clone_ref(py))
    }

    pub fn take_label(&self, token: u64) -> Option<Py<PyAny>> {
        self.store().labels.remove(&token)
    }

    /// Drops every value, source and label object (close). Returned so that their
    /// destructors run after the lock is released.
    pub fn clear(&self) -> Vec<Py<PyAny>> {
        let mut store = self.store();
        let mut released: Vec<Py<PyAny>> = store.values.drain().map(|(_, value)| value).collect();
        released.extend(store.streams.drain().map(|(_, stream)| stream));
        for entry in &mut store.entries {
            released.extend(entry.source.take());
        }
        released.extend(store.labels.drain().map(|(_, label)| label));
        released
    }

    /// Keeps `object` at the id the core just issued for it.
    pub fn put(&self, id: ObjectId, object: Py<PyAny>) -> Option<Py<PyAny>> {
        let mut store = self.store();
        if store.slots.len() <= id {
            store.slots.resize_with(id + 1, || None);
        }
        store.slots[id].replace(object)
    }

    /// The object at `id`, while the core refers to it.
    pub fn object(&self, py: Python<'_>, id: ObjectId) -> Option<Py<PyAny>> {
        self.store()
            .slots
            .get(id)
            .and_then(|slot| slot.as_ref().map(|object| object.clone_ref(py)))
    }

    /// The objects at `ids`, under one lock.
    pub fn objects(&self, py: Python<'_>, ids: &[ObjectId]) -> Vec<Py<PyAny>> {
        let store = self.store();
        ids.iter()
            .filter_map(|&id| store.slots.get(id)?.as_ref())
            .map(|object| object.clone_ref(py))
            .collect()
    }

    /// Takes the object at `id`, which the core no longer refers to; it is released
    /// after the lock.
    pub fn take(&self, id: ObjectId) -> Option<Py<PyAny>> {
        self.store().slots.get_mut(id)?.take()
    }

    /// Forgets what the core gave back: the objects at its freed ids and the labels
    /// of its released reservations; they are released after the lock.
    pub fn free(&self, freed: &Freed) -> Released {
        if freed.is_empty() {
            return Vec::new();
        }
        let mut store = self.store();
        let mut released: Released = freed
            .objects
            .iter()
            .filter_map(|&id| store.slots.get_mut(id)?.take())
            .collect();
        for token in &freed.reservations {
            released.extend(store.labels.remove(token));
        }
        released
    }
}
