//! The caller's objects a binding keeps beside the core's records, indexed by the
//! core's handle index: the handle and spec objects it issued, the value objects of
//! every materialisation and the stream that allocated each, the reconstruction
//! sources, reservation labels, and the objects the core knows by id (events, copies'
//! sources, what finds each lease tracked for its finalizer) in an array at those ids.
//!
//! The core owns the records; this is only the bookkeeping of the objects it cannot
//! hold, generic over the binding's object type `O`. Reading an object shares it
//! (`share`: a new reference). The lock is never held while an object is released:
//! every method that forgets objects returns them, to be dropped after it (releasing
//! an object may run the caller's code).

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::fasthash::FastMap;
use crate::tokens::{Freed, ObjectId};

/// One value's objects. Kept small: a million registered values are a common case,
/// and most have no materialisation at a given moment.
#[derive(Debug)]
struct Entry<O> {
    handle: O,
    spec: O,
    source: Option<O>,
}

#[derive(Debug)]
struct Store<O> {
    entries: Vec<Entry<O>>,
    /// The object of each materialisation, by (handle index, location code).
    values: FastMap<(u32, u32), O>,
    /// The stream that allocated each device materialisation the manager copied
    /// there (its owning stream, docs/concepts/controller.md#evicting-around-reads-in-flight).
    streams: FastMap<(u32, u32), O>,
    labels: FastMap<u64, O>,
    /// The objects the core knows by id (`ObjectId`): the events of pending leases and
    /// transfers in flight, what a copy in flight reads, and a weak reference to each
    /// lease tracked for its finalizer.
    slots: Vec<Option<O>>,
}

/// The objects of one manager (see the module's documentation).
#[derive(Debug)]
pub struct ObjectStore<O> {
    store: Mutex<Store<O>>,
}

impl<O> Default for ObjectStore<O> {
    fn default() -> Self {
        Self {
            store: Mutex::new(Store {
                entries: Vec::new(),
                values: FastMap::default(),
                streams: FastMap::default(),
                labels: FastMap::default(),
                slots: Vec::new(),
            }),
        }
    }
}

impl<O> ObjectStore<O> {
    fn store(&self) -> MutexGuard<'_, Store<O>> {
        // Every method leaves the store consistent before it can panic.
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers the objects of the value the core just issued as `index`, with the
    /// object of its first materialisation (at a location code) if it has one.
    pub fn push(&self, index: u32, handle: O, spec: O, source: Option<O>, value: Option<(u32, O)>) {
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

    pub fn handle(&self, index: u32, share: impl Fn(&O) -> O) -> Option<O> {
        let store = self.store();
        store
            .entries
            .get(index as usize)
            .map(|entry| share(&entry.handle))
    }

    /// The issued handle objects at `indices`, under one lock.
    pub fn handles_at(
        &self,
        indices: impl IntoIterator<Item = Option<u32>>,
        share: impl Fn(&O) -> O,
    ) -> Vec<Option<O>> {
        let store = self.store();
        indices
            .into_iter()
            .map(|index| {
                index
                    .and_then(|index| store.entries.get(index as usize))
                    .map(|entry| share(&entry.handle))
            })
            .collect()
    }

    pub fn spec(&self, index: u32, share: impl Fn(&O) -> O) -> Option<O> {
        let store = self.store();
        store
            .entries
            .get(index as usize)
            .map(|entry| share(&entry.spec))
    }

    pub fn source(&self, index: u32, share: impl Fn(&O) -> O) -> Option<O> {
        let store = self.store();
        store
            .entries
            .get(index as usize)
            .and_then(|entry| entry.source.as_ref().map(&share))
    }

    /// Handles and specs of the first `count` values, for snapshot entries.
    pub fn handles_and_specs(&self, count: usize, share: impl Fn(&O) -> O) -> Vec<(O, O)> {
        let store = self.store();
        store
            .entries
            .iter()
            .take(count)
            .map(|entry| (share(&entry.handle), share(&entry.spec)))
            .collect()
    }

    pub fn value(&self, index: u32, code: u32, share: impl Fn(&O) -> O) -> Option<O> {
        self.store().values.get(&(index, code)).map(share)
    }

    /// Keeps `value` as the object of the materialisation; a replaced object is
    /// returned so it dies after the lock. A new object has no known owning stream
    /// until `set_stream` names it: the replaced one's stream is forgotten.
    pub fn set_value(&self, index: u32, code: u32, value: O) -> Option<O> {
        let mut store = self.store();
        let stream = store.streams.remove(&(index, code));
        let replaced = store.values.insert((index, code), value);
        drop(store);
        drop(stream);
        replaced
    }

    /// Removes one materialisation's object, and its stream; it is released after the
    /// lock.
    pub fn take_value(&self, index: u32, code: u32) -> Option<O> {
        let mut store = self.store();
        let stream = store.streams.remove(&(index, code));
        let value = store.values.remove(&(index, code));
        drop(store);
        drop(stream);
        value
    }

    /// Names the stream that allocated the materialisation's memory. A stream named
    /// for a materialisation without an object is not kept: it is given back.
    pub fn set_stream(&self, index: u32, code: u32, stream: O) -> Option<O> {
        let mut store = self.store();
        if !store.values.contains_key(&(index, code)) {
            return Some(stream);
        }
        store.streams.insert((index, code), stream)
    }

    /// The stream that allocated the materialisation's memory, when the manager
    /// made the copy.
    pub fn stream(&self, index: u32, code: u32, share: impl Fn(&O) -> O) -> Option<O> {
        self.store().streams.get(&(index, code)).map(share)
    }

    /// Forgets a discarded value's materialisations (at `codes`), their streams and
    /// its source; the handle and spec stay for snapshots. The objects are returned so
    /// they die after the lock.
    pub fn discard(&self, index: u32, codes: &[u32]) -> Vec<O> {
        let mut store = self.store();
        let mut released: Vec<O> = codes
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

    pub fn set_label(&self, token: u64, label: O) {
        let replaced = self.store().labels.insert(token, label);
        drop(replaced);
    }

    pub fn label(&self, token: u64, share: impl Fn(&O) -> O) -> Option<O> {
        self.store().labels.get(&token).map(share)
    }

    pub fn take_label(&self, token: u64) -> Option<O> {
        self.store().labels.remove(&token)
    }

    /// Drops every value, stream, source and label object (close); the handles, specs
    /// and objects by id stay. Returned so they are released after the lock.
    pub fn clear(&self) -> Vec<O> {
        let mut store = self.store();
        let store = &mut *store;
        let mut released: Vec<O> = store.values.drain().map(|(_, value)| value).collect();
        released.extend(store.streams.drain().map(|(_, stream)| stream));
        for entry in &mut store.entries {
            released.extend(entry.source.take());
        }
        released.extend(store.labels.drain().map(|(_, label)| label));
        released
    }

    /// Keeps `object` at the id the core just issued for it; an object still there is
    /// returned.
    pub fn put(&self, id: ObjectId, object: O) -> Option<O> {
        let mut store = self.store();
        if store.slots.len() <= id {
            store.slots.resize_with(id + 1, || None);
        }
        store.slots[id].replace(object)
    }

    /// The object at `id`, while the core refers to it.
    pub fn object(&self, id: ObjectId, share: impl Fn(&O) -> O) -> Option<O> {
        self.store().slots.get(id)?.as_ref().map(share)
    }

    /// The objects at `ids` (those still kept), under one lock.
    pub fn objects(&self, ids: &[ObjectId], share: impl Fn(&O) -> O) -> Vec<O> {
        let store = self.store();
        ids.iter()
            .filter_map(|&id| store.slots.get(id)?.as_ref())
            .map(share)
            .collect()
    }

    /// Takes the object at `id`, which the core no longer refers to; it is released
    /// after the lock.
    pub fn take(&self, id: ObjectId) -> Option<O> {
        self.store().slots.get_mut(id)?.take()
    }

    /// Forgets what the core gave back: the objects at its freed ids and the labels
    /// of its released reservations; they are released after the lock.
    pub fn free(&self, freed: &Freed) -> Vec<O> {
        if freed.is_empty() {
            return Vec::new();
        }
        let mut store = self.store();
        let mut released: Vec<O> = freed
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
