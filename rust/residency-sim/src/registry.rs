//! The simulated runtime's storage registry, as native data
//! (`simulated_storage.StorageRegistry`, docs/concepts/simulation.md#allocator-readings).
//!
//! [`Table`] holds the entries and the per-device counters (pyo3-free);
//! [`SimulatedStorages`] owns one, with a weak reference per registered storage whose
//! callback reports its death into a queue (on any thread: the callback is the queue's
//! own `list.append`, which runs no Python code), and is what both the
//! registry's Python methods and [`crate::SimulatedSeam`] use, under the runtime's lock
//! where they change it.

use std::sync::{Mutex, PoisonError};

use pyo3::exceptions::PyIndexError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple, PyWeakrefMethods, PyWeakrefReference};

use residency_core::FastMap;

use crate::reserved_nbytes;
use crate::reuse::ReuseOrder;

/// One registered storage: where it lives and what it counts.
#[derive(Debug)]
pub struct Slot<P> {
    /// The storage's key: the address of its Python object, which torch keeps for as
    /// long as the storage lives (`key_of`).
    pub key: u64,
    /// -1 on the host, the CUDA index on a simulated device.
    pub code: i64,
    pub pinned: bool,
    pub nbytes: u64,
    /// Whether its bytes are in its device's counters (a simulated device's are, until
    /// it is taken out or registered again).
    pub counted: bool,
    pub payload: P,
}

impl<P> Slot<P> {
    /// Whether it lives on a simulated CUDA device.
    pub const fn cuda(&self) -> bool {
        self.code >= 0
    }
}

/// The entries by id (one per registration, unique while it is in the table) and by
/// key, and each device's allocated and reserved bytes.
///
/// An entry stays under its key from its storage's death until it is taken out
/// (`freed`); meanwhile a new storage at the same address may be registered, whose
/// entry then takes the key, and the dead one's is taken out later without touching it.
#[derive(Debug)]
pub struct Table<P> {
    // Keyed by addresses: the fast hasher (`residency_core::fasthash`).
    slots: FastMap<usize, Slot<P>>,
    keys: FastMap<u64, usize>,
    allocated: Vec<i64>,
    reserved: Vec<i64>,
}

impl<P> Table<P> {
    /// An empty table of `devices` simulated devices.
    pub fn new(devices: usize) -> Self {
        Self {
            slots: FastMap::default(),
            keys: FastMap::default(),
            allocated: vec![0; devices],
            reserved: vec![0; devices],
        }
    }

    /// The entry under `key`, with its id.
    pub fn find(&self, key: u64) -> Option<(usize, &Slot<P>)> {
        let id = *self.keys.get(&key)?;
        self.slots.get(&id).map(|slot| (id, slot))
    }

    /// Registers `slot` as entry `id` (counted where it is on a device). The entry it
    /// replaces under its key is taken out and returned when `same` says it refers to
    /// the same storage (registered again: its bytes are counted once); another one is
    /// a dead storage's, which stays until `freed`.
    pub fn insert(
        &mut self,
        id: usize,
        mut slot: Slot<P>,
        same: impl FnOnce(&P) -> bool,
    ) -> Option<Slot<P>> {
        let key = slot.key;
        slot.counted = slot.cuda();
        self.count(&slot, true);
        let replaced = self.keys.insert(key, id).and_then(|previous| {
            let same = self
                .slots
                .get(&previous)
                .is_some_and(|old| same(&old.payload));
            if same {
                let old = self.slots.remove(&previous)?;
                self.count(&old, false);
                Some(old)
            } else {
                None
            }
        });
        self.slots.insert(id, slot);
        replaced
    }

    /// Takes entry `id`, whose storage was freed, out: uncounted, and out of its key
    /// unless a newer entry holds it. Returns it, and whether it held its key.
    pub fn freed(&mut self, id: usize) -> Option<(Slot<P>, bool)> {
        let slot = self.slots.remove(&id)?;
        self.count(&slot, false);
        let current = self.keys.get(&slot.key) == Some(&id);
        if current {
            self.keys.remove(&slot.key);
        }
        Some((slot, current))
    }

    /// (allocated, reserved) bytes of device `index`.
    pub fn counters(&self, index: usize) -> Option<(i64, i64)> {
        Some((*self.allocated.get(index)?, *self.reserved.get(index)?))
    }

    /// The entries under their keys.
    pub fn current(&self) -> impl Iterator<Item = &Slot<P>> {
        self.keys.values().filter_map(|id| self.slots.get(id))
    }

    fn count(&mut self, slot: &Slot<P>, up: bool) {
        if !slot.counted {
            return;
        }
        let Ok(code) = usize::try_from(slot.code) else {
            return;
        };
        let (Some(allocated), Some(reserved)) =
            (self.allocated.get_mut(code), self.reserved.get_mut(code))
        else {
            return;
        };
        let nbytes = i64::try_from(slot.nbytes).unwrap_or(i64::MAX);
        let blocks = i64::try_from(reserved_nbytes(slot.nbytes)).unwrap_or(i64::MAX);
        if up {
            *allocated += nbytes;
            *reserved += blocks;
        } else {
            *allocated -= nbytes;
            *reserved -= blocks;
        }
    }
}

/// What an entry holds of Python: its weak reference, its device and its owner (the
/// handle of the stream that allocated it, for the reuse order).
#[derive(Debug)]
pub struct Entry {
    reference: Py<PyWeakrefReference>,
    device: Py<PyAny>,
    owner: Option<i64>,
}

/// A live registered storage's entry, as `SimulatedStorages::lookup` finds it.
#[derive(Debug)]
pub struct Found<'py> {
    pub device: Bound<'py, PyAny>,
    /// -1 on the host, the CUDA index on a simulated device.
    pub code: i64,
    pub pinned: bool,
    pub key: u64,
}

/// A storage's key: the address of its Python object. torch keeps a storage's Python
/// object for as long as the storage lives, and hands out that one object, so the
/// key names one storage while it lives; a storage made after one died may get the
/// dead one's key (its entry refers to the dead one: `lookup`).
pub fn key_of(storage: &Bound<'_, PyAny>) -> u64 {
    storage.as_ptr().addr() as u64
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The registry's data (see the module): entries, counters, the freed queue. No Python
/// code runs while its table is locked.
#[pyclass(module = "fhelium._core", frozen)]
#[derive(Debug)]
pub struct SimulatedStorages {
    table: Mutex<Table<Entry>>,
    /// The weak references whose storages died, in order (an entry's id is its
    /// reference's address). Their callback is `on_free`, this list's bound `append`:
    /// a C function, so a storage's death runs no Python code and only appends, under
    /// the interpreter's lock, on whatever thread frees it.
    queue: Py<PyList>,
    on_free: Py<PyAny>,
}

#[pymethods]
impl SimulatedStorages {
    /// An empty registry of ``devices`` simulated devices.
    #[new]
    fn py_new(py: Python<'_>, devices: usize) -> PyResult<Self> {
        let queue = PyList::empty(py);
        Ok(Self {
            table: Mutex::new(Table::new(devices)),
            on_free: queue.getattr(intern!(py, "append"))?.unbind(),
            queue: queue.unbind(),
        })
    }

    /// ``(device, code, pinned, cuda)`` of a live storage the runtime registered, else
    /// ``None``. Lock-free for the runtime.
    fn find<'py>(&self, storage: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = storage.py();
        let Some(found) = self.lookup(storage)? else {
            return Ok(None);
        };
        let cuda = found.code >= 0;
        let items = (found.device, found.code, found.pinned, cuda).into_pyobject(py)?;
        Ok(Some(items))
    }

    /// Registers ``storage`` on simulated ``device`` (``code``: -1 on the host, else
    /// its index), pinned or not, allocated by ``owner`` (a stream's handle, or
    /// ``None``). With the runtime's lock held.
    fn register(
        &self,
        storage: &Bound<'_, PyAny>,
        device: &Bound<'_, PyAny>,
        code: i64,
        pinned: bool,
        owner: Option<i64>,
    ) -> PyResult<()> {
        let py = storage.py();
        let nbytes: u64 = storage.call_method0(intern!(py, "nbytes"))?.extract()?;
        self.add(storage, device, code, pinned, nbytes, owner)
    }

    /// Takes the storages freed since the last call out of the entries and counters,
    /// and gives each simulated device storage's readers to its owner's pool in
    /// ``order`` (`ReuseOrder.freed`). With the runtime's lock held.
    fn drain(&self, order: &Bound<'_, ReuseOrder>) -> PyResult<()> {
        self.drain_into(order.py(), order.get())
    }

    /// ``(allocated, reserved)`` bytes of the simulated device of index ``index``, as
    /// counted (`drain` first takes the freed out).
    fn counters(&self, index: usize) -> PyResult<(i64, i64)> {
        lock(&self.table)
            .counters(index)
            .ok_or_else(|| PyIndexError::new_err("no simulated device of that index"))
    }

    /// The entries under their keys: ``{key: weak reference}``, a snapshot.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let snapshot: Vec<(u64, Py<PyWeakrefReference>)> = lock(&self.table)
            .current()
            .map(|slot| (slot.key, slot.payload.reference.clone_ref(py)))
            .collect();
        let out = PyDict::new(py);
        for (key, reference) in snapshot {
            out.set_item(key, reference)?;
        }
        Ok(out)
    }
}

impl SimulatedStorages {
    /// ``(device, code, pinned)`` of a live registered storage (its entry refers to
    /// it: another one under its key is a dead storage's), and its key.
    pub fn lookup<'py>(&self, storage: &Bound<'py, PyAny>) -> PyResult<Option<Found<'py>>> {
        let py = storage.py();
        let key = key_of(storage);
        let found = {
            let table = lock(&self.table);
            table.find(key).map(|(_, slot)| {
                (
                    slot.payload.reference.clone_ref(py),
                    slot.payload.device.clone_ref(py),
                    slot.code,
                    slot.pinned,
                )
            })
        };
        let Some((reference, device, code, pinned)) = found else {
            return Ok(None);
        };
        if reference
            .bind(py)
            .upgrade()
            .is_some_and(|it| it.is(storage))
        {
            Ok(Some(Found {
                device: device.into_bound(py),
                code,
                pinned,
                key,
            }))
        } else {
            Ok(None)
        }
    }

    /// `register` of a storage of ``nbytes``.
    pub fn add(
        &self,
        storage: &Bound<'_, PyAny>,
        device: &Bound<'_, PyAny>,
        code: i64,
        pinned: bool,
        nbytes: u64,
        owner: Option<i64>,
    ) -> PyResult<()> {
        let py = storage.py();
        let key = key_of(storage);
        let reference = PyWeakrefReference::new_with(storage, self.on_free.bind(py))?;
        let id = reference.as_ptr().addr();
        let slot = Slot {
            key,
            code,
            pinned,
            nbytes,
            counted: false,
            payload: Entry {
                reference: reference.unbind(),
                device: device.clone().unbind(),
                owner,
            },
        };
        // The entry it replaces is dropped with the table unlocked.
        let replaced = lock(&self.table).insert(id, slot, |old| {
            old.reference
                .bind(py)
                .upgrade()
                .is_some_and(|it| it.is(storage))
        });
        drop(replaced);
        Ok(())
    }

    /// `drain`: one entry at a time, in the order they died, each dropped with the
    /// table unlocked.
    pub fn drain_into(&self, py: Python<'_>, order: &ReuseOrder) -> PyResult<()> {
        let queue = self.queue.bind(py);
        loop {
            if queue.is_empty() {
                return Ok(());
            }
            // Taken out before anything is dropped (a drop may free another storage,
            // whose callback appends to the queue).
            let reference = queue.get_item(0)?;
            queue.del_item(0)?;
            let id = reference.as_ptr().addr();
            let Some((slot, current)) = lock(&self.table).freed(id) else {
                continue;
            };
            if current && slot.cuda() {
                order.freed_native(slot.key, slot.nbytes, slot.payload.owner);
            }
            drop(slot);
            drop(reference);
        }
    }

    /// Whether a storage was freed since the last `drain_into` (its queue is not empty).
    pub fn has_freed(&self, py: Python<'_>) -> bool {
        !self.queue.bind(py).is_empty()
    }

    /// `counters`, for the seam.
    pub fn sample(&self, index: usize) -> Option<(i64, i64)> {
        lock(&self.table).counters(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(key: u64, code: i64, nbytes: u64, payload: u32) -> Slot<u32> {
        Slot {
            key,
            code,
            pinned: false,
            nbytes,
            counted: false,
            payload,
        }
    }

    #[test]
    fn device_entries_are_counted_in_whole_blocks_and_host_ones_not() {
        let mut table = Table::new(2);
        assert!(table.insert(1, slot(10, 1, 40, 0), |_| false).is_none());
        assert!(table.insert(2, slot(20, -1, 40, 0), |_| false).is_none());
        assert_eq!(table.counters(1), Some((40, 512)));
        assert_eq!(table.counters(0), Some((0, 0)));
        assert_eq!(table.counters(2), None);
        assert_eq!(table.find(20).map(|(id, _)| id), Some(2));
        let (gone, current) = table.freed(1).expect("registered");
        assert!(current && gone.cuda());
        assert_eq!(table.counters(1), Some((0, 0)));
        assert!(table.find(10).is_none());
        assert!(table.freed(1).is_none());
    }

    #[test]
    fn a_storage_registered_again_is_counted_once() {
        let mut table = Table::new(1);
        table.insert(1, slot(10, 0, 100, 7), |_| false);
        let replaced = table.insert(2, slot(10, 0, 100, 7), |old| *old == 7);
        assert_eq!(replaced.map(|old| old.payload), Some(7));
        assert_eq!(table.counters(0), Some((100, 512)));
        assert_eq!(table.current().count(), 1);
        // The replaced entry is gone: its id means nothing any more.
        assert!(table.freed(1).is_none());
        assert_eq!(table.counters(0), Some((100, 512)));
    }

    #[test]
    fn a_dead_entry_leaves_a_new_storage_at_its_address_in_place() {
        let mut table = Table::new(1);
        table.insert(1, slot(10, 0, 100, 1), |_| false);
        // Storage 1 died; storage 2 is allocated where it was before the drain.
        assert!(table.insert(2, slot(10, 0, 600, 2), |_| false).is_none());
        assert_eq!(table.counters(0), Some((700, 1536)));
        let (gone, current) = table.freed(1).expect("registered");
        assert_eq!(gone.payload, 1);
        assert!(!current);
        assert_eq!(table.counters(0), Some((600, 1024)));
        assert_eq!(table.find(10).map(|(id, _)| id), Some(2));
    }
}
