//! The Python objects a manager keeps beside the core's records, indexed by the
//! core's handle index: the handle and spec objects it issued, the value objects
//! of every materialisation, the reconstruction sources, and reservation labels.
//!
//! The core owns the records; these are only the objects it cannot hold. Every
//! change here happens in the same binding call as the core change it mirrors, so
//! the two never disagree. The mutex is never held while Python code runs.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::prelude::*;
use residency_core::FastMap;

use crate::lifetimes::Deferred;

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
    /// Releases that arrived while a source callback ran on another thread, applied
    /// oldest first as soon as the callback has returned.
    deferred: VecDeque<Deferred>,
    /// The events recorded at the release of each pending CUDA lease, in release
    /// order; the lease protects its memory until they have all completed.
    pending: Vec<(u64, Vec<Py<PyAny>>)>,
    /// A weak reference to each lease object not yet released, by token: at
    /// interpreter exit the leases still alive are finalised while the runtime works.
    leases: FastMap<u64, Py<PyAny>>,
    /// Asynchronous transfers still in flight: the pending token protecting each
    /// destination, which consumers there wait for on their streams.
    transfers: Vec<Transfer>,
}

/// One asynchronous copy into `(index, code)`, protected by the pending lease
/// `token` until its event completes (docs/concepts/controller.md#prefetch).
#[derive(Debug)]
struct Transfer {
    token: u64,
    index: u32,
    code: u32,
    /// What the copy reads when it is no materialisation (a loaded value), kept
    /// alive until the copy has completed.
    keepalive: Option<Py<PyAny>>,
    /// Empty while `token` is pending (its events are there). Once the protection was
    /// released on the device, the copy's events: consumers still wait for them, and
    /// the record goes when they complete.
    events: Vec<Py<PyAny>>,
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

    pub fn defer(&self, release: Deferred) {
        self.store().deferred.push_back(release);
    }

    pub fn deferred_pending(&self) -> bool {
        !self.store().deferred.is_empty()
    }

    pub fn pop_deferred(&self) -> Option<Deferred> {
        self.store().deferred.pop_front()
    }

    pub fn clear_deferred(&self) -> VecDeque<Deferred> {
        std::mem::take(&mut self.store().deferred)
    }

    pub fn add_pending(&self, token: u64, events: Vec<Py<PyAny>>) {
        self.store().pending.push((token, events));
    }

    /// The pending leases and their events, in release order.
    pub fn pending(&self, py: Python<'_>) -> Vec<(u64, Vec<Py<PyAny>>)> {
        self.store()
            .pending
            .iter()
            .map(|(token, events)| {
                let events = events.iter().map(|event| event.clone_ref(py)).collect();
                (*token, events)
            })
            .collect()
    }

    /// Forgets a pending lease's events, and the transfer it protected; they are
    /// released after the lock.
    pub fn take_pending(&self, token: u64) -> Option<(Released, Released)> {
        let mut store = self.store();
        let position = store
            .pending
            .iter()
            .position(|(known, _)| *known == token)?;
        let events = store.pending.remove(position).1;
        let mut kept = Vec::new();
        store.transfers.retain_mut(|transfer| {
            if transfer.token != token {
                return true;
            }
            kept.extend(transfer.keepalive.take());
            false
        });
        Some((events, kept))
    }

    /// Forgets a pending lease released on the device: its events move to the
    /// transfer it protected, if any, which consumers still wait for until they
    /// complete; otherwise they are returned, to be released after the lock.
    pub fn release_on_device(&self, token: u64) -> Released {
        let mut store = self.store();
        let Some(position) = store.pending.iter().position(|(known, _)| *known == token) else {
            return Vec::new();
        };
        let events = store.pending.remove(position).1;
        match store
            .transfers
            .iter_mut()
            .find(|transfer| transfer.token == token)
        {
            Some(transfer) => {
                transfer.events = events;
                Vec::new()
            }
            None => events,
        }
    }

    /// The transfers whose protection was released on the device, with their events.
    pub fn released_transfers(&self, py: Python<'_>) -> Vec<(u64, Vec<Py<PyAny>>)> {
        self.store()
            .transfers
            .iter()
            .filter(|transfer| !transfer.events.is_empty())
            .map(|transfer| {
                let events = transfer.events.iter().map(|event| event.clone_ref(py));
                (transfer.token, events.collect())
            })
            .collect()
    }

    /// Forgets a released transfer whose events completed; its objects are released
    /// after the lock.
    pub fn forget_released_transfer(&self, token: u64) -> Released {
        let mut store = self.store();
        let mut released = Vec::new();
        store.transfers.retain_mut(|transfer| {
            if transfer.token != token || transfer.events.is_empty() {
                return true;
            }
            released.append(&mut transfer.events);
            released.extend(transfer.keepalive.take());
            false
        });
        released
    }

    /// Records an asynchronous copy into `(index, code)` protected by `token`.
    pub fn add_transfer(&self, token: u64, index: u32, code: u32, keepalive: Option<Py<PyAny>>) {
        self.store().transfers.push(Transfer {
            token,
            index,
            code,
            keepalive,
            events: Vec::new(),
        });
    }

    /// The events of the transfers still in flight into any of `indices` at `code`.
    pub fn transfer_events(&self, py: Python<'_>, indices: &[u32], code: u32) -> Vec<Py<PyAny>> {
        let store = self.store();
        if store.transfers.is_empty() {
            return Vec::new();
        }
        let mut events = Vec::new();
        for transfer in &store.transfers {
            if transfer.code != code || !indices.contains(&transfer.index) {
                continue;
            }
            if let Some((_, pending)) = store.pending.iter().find(|(t, _)| *t == transfer.token) {
                events.extend(pending.iter().map(|event| event.clone_ref(py)));
            }
            events.extend(transfer.events.iter().map(|event| event.clone_ref(py)));
        }
        events
    }

    /// The pending tokens of the transfers in flight.
    pub fn transfer_tokens(&self) -> Vec<u64> {
        self.store()
            .transfers
            .iter()
            .map(|transfer| transfer.token)
            .collect()
    }

    /// The pending tokens of the transfers in flight into any of `indices` at `code`.
    pub fn transfer_tokens_into(&self, indices: &[u32], code: u32) -> Vec<u64> {
        self.store()
            .transfers
            .iter()
            .filter(|transfer| transfer.code == code && indices.contains(&transfer.index))
            .map(|transfer| transfer.token)
            .collect()
    }

    /// How many asynchronous transfers are in flight.
    pub fn transfer_count(&self) -> usize {
        self.store().transfers.len()
    }

    pub fn track_lease(&self, token: u64, reference: Py<PyAny>) {
        drop(self.store().leases.insert(token, reference));
    }

    /// Forgets a lease object; its weak reference is released after the lock.
    pub fn untrack_lease(&self, token: u64) -> Option<Py<PyAny>> {
        self.store().leases.remove(&token)
    }

    /// The weak references of the leases not yet released, in token order.
    pub fn tracked_leases(&self, py: Python<'_>) -> Vec<Py<PyAny>> {
        let store = self.store();
        let mut tracked: Vec<(u64, Py<PyAny>)> = store
            .leases
            .iter()
            .map(|(token, reference)| (*token, reference.clone_ref(py)))
            .collect();
        drop(store);
        tracked.sort_by_key(|(token, _)| *token);
        tracked
            .into_iter()
            .map(|(_, reference)| reference)
            .collect()
    }

    /// Forgets every pending lease and transfer; the objects are released after the
    /// lock.
    pub fn clear_pending(&self) -> (Vec<(u64, Released)>, Released) {
        let mut store = self.store();
        let pending = std::mem::take(&mut store.pending);
        let kept = std::mem::take(&mut store.transfers)
            .into_iter()
            .flat_map(|transfer| transfer.events.into_iter().chain(transfer.keepalive))
            .collect();
        (pending, kept)
    }
}
