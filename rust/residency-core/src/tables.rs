//! Small tables the bindings keep of the objects callers pass: what was checked or
//! built for an object, found again by the object's identity (its address, kept alive
//! by the entry, so the address stays its own) instead of being asked again.
//!
//! The bindings fill them with their objects; the bounds and the forgetting are here.

use std::collections::VecDeque;
use std::collections::hash_map::Entry;
use std::hash::Hash;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::fasthash::FastMap;
use crate::plan::ActionKind;

/// The last few entries remembered, oldest first: beyond the bound the oldest is
/// forgotten, and a bound of 0 keeps none. Shared between threads.
#[derive(Debug)]
pub struct Recent<T> {
    entries: Mutex<VecDeque<T>>,
    bound: usize,
}

impl<T> Recent<T> {
    pub const fn new(bound: usize) -> Self {
        Self {
            entries: Mutex::new(VecDeque::new()),
            bound,
        }
    }

    fn entries(&self) -> MutexGuard<'_, VecDeque<T>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What `find` reads from the first entry it accepts, oldest first.
    #[inline]
    pub fn find_map<R>(&self, find: impl FnMut(&T) -> Option<R>) -> Option<R> {
        self.entries().iter().find_map(find)
    }

    /// Remembers `entry` (see `keep`).
    pub fn remember(&self, entry: T) {
        self.keep(|| entry);
    }

    /// Keeps the entry `make` gives (made only when one is kept), forgetting the
    /// oldest beyond the bound. A forgotten entry is released after the lock
    /// (releasing an object may run the caller's code).
    pub fn keep(&self, make: impl FnOnce() -> T) {
        if self.bound == 0 {
            return;
        }
        let forgotten = {
            let mut entries = self.entries();
            entries.push_back(make());
            if entries.len() > self.bound {
                entries.pop_front()
            } else {
                None
            }
        };
        drop(forgotten);
    }

    /// The entries, oldest first.
    pub fn to_vec(&self) -> Vec<T>
    where
        T: Clone,
    {
        self.entries().iter().cloned().collect()
    }

    /// Forgets every entry; they are released after the lock.
    pub fn clear(&self) {
        let forgotten = std::mem::take(&mut *self.entries());
        drop(forgotten);
    }
}

/// Values by key, each kept from its first insertion on. Shared between threads.
#[derive(Debug)]
pub struct Memo<K, V> {
    entries: Mutex<FastMap<K, V>>,
}

impl<K, V> Default for Memo<K, V> {
    fn default() -> Self {
        Self {
            entries: Mutex::new(FastMap::default()),
        }
    }
}

impl<K: Hash + Eq, V> Memo<K, V> {
    /// What `read` reads from the value kept for `key`, if one is.
    pub fn get<R>(&self, key: &K, read: impl FnOnce(&V) -> R) -> Option<R> {
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .map(read)
    }

    /// Keeps `value` for `key` unless a value is kept already (which stays); a value
    /// not kept is released after the lock.
    pub fn insert(&self, key: K, value: V) {
        let unkept = {
            let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
            match entries.entry(key) {
                Entry::Vacant(entry) => {
                    entry.insert(value);
                    None
                }
                Entry::Occupied(_) => Some(value),
            }
        };
        drop(unkept);
    }
}

/// Entries remembered while there is room, never forgotten: a table for the span of
/// one call, where few distinct objects appear.
#[derive(Debug)]
pub struct FirstSeen<T> {
    entries: Vec<T>,
    bound: usize,
}

impl<T> FirstSeen<T> {
    pub fn new(bound: usize) -> Self {
        Self {
            entries: Vec::new(),
            bound,
        }
    }

    pub fn find_map<R>(&self, find: impl FnMut(&T) -> Option<R>) -> Option<R> {
        self.entries.iter().find_map(find)
    }

    /// Remembers `entry` if there is room.
    pub fn insert(&mut self, entry: T) {
        if self.entries.len() < self.bound {
            self.entries.push(entry);
        }
    }
}

/// How many records of direct calls a `CallTable` keeps.
pub const KEPT_CALLS: usize = 16;

/// A direct call's kind and the addresses of its handle and location arguments (0
/// where absent).
pub type CallKey = (ActionKind, [usize; 3]);

/// What was built for direct `ensure`, `move` and `drop` calls, kept in a small
/// direct-mapped table keyed by the call's kind and argument objects: a value ensured
/// and dropped again and again gets one entry per call shape, not one per call.
#[derive(Debug)]
pub struct CallTable<V> {
    slots: Mutex<[Option<(CallKey, V)>; KEPT_CALLS]>,
}

impl<V> Default for CallTable<V> {
    fn default() -> Self {
        Self {
            slots: Mutex::new(std::array::from_fn(|_| None)),
        }
    }
}

impl<V> CallTable<V> {
    fn slot(key: &CallKey) -> usize {
        let (kind, [handle, at, from]) = *key;
        ((handle >> 4) ^ (at >> 4) ^ (from >> 4) ^ kind as usize) % KEPT_CALLS
    }

    /// What `read` reads from the entry kept for `key`, if one is.
    #[inline]
    pub fn get<R>(&self, key: &CallKey, read: impl FnOnce(&V) -> R) -> Option<R> {
        let slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        match &slots[Self::slot(key)] {
            Some((known, value)) if known == key => Some(read(value)),
            _ => None,
        }
    }

    /// Keeps `value` for `key`, replacing what its slot held (released after the lock).
    pub fn keep(&self, key: CallKey, value: V) {
        let replaced = {
            let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
            slots[Self::slot(&key)].replace((key, value))
        };
        drop(replaced);
    }

    /// Forgets every entry (released after the lock).
    pub fn clear(&self) {
        let forgotten = std::mem::replace(
            &mut *self.slots.lock().unwrap_or_else(PoisonError::into_inner),
            std::array::from_fn(|_| None),
        );
        drop(forgotten);
    }
}

/// Values by location code, each made once.
#[derive(Debug)]
pub struct ByCode<V> {
    known: Vec<Option<V>>,
}

impl<V> Default for ByCode<V> {
    fn default() -> Self {
        Self { known: Vec::new() }
    }
}

impl<V: Clone> ByCode<V> {
    /// The value of `code`, made by `make` the first time.
    pub fn get_or_try<E>(
        &mut self,
        code: u32,
        make: impl FnOnce() -> Result<V, E>,
    ) -> Result<V, E> {
        let index = code as usize;
        if let Some(Some(known)) = self.known.get(index) {
            return Ok(known.clone());
        }
        let value = make()?;
        if self.known.len() <= index {
            self.known.resize_with(index + 1, || None);
        }
        self.known[index] = Some(value.clone());
        Ok(value)
    }
}

/// The value of the last key asked, kept: for a column that mostly repeats the
/// previous row.
#[derive(Debug)]
pub struct Last<K, V> {
    last: Option<(K, V)>,
}

impl<K, V> Default for Last<K, V> {
    fn default() -> Self {
        Self { last: None }
    }
}

impl<K: PartialEq, V: Clone> Last<K, V> {
    pub fn get_or_try<E>(&mut self, key: K, make: impl FnOnce() -> Result<V, E>) -> Result<V, E> {
        if let Some((last, value)) = &self.last
            && *last == key
        {
            return Ok(value.clone());
        }
        let value = make()?;
        self.last = Some((key, value.clone()));
        Ok(value)
    }
}

/// A table of distinct items in first-appearance order, keyed as a Python dict keyed
/// by them would be: by their hash, then identity or the caller's equality. Every
/// item offered is remembered by address with its slot, and kept, so no address is
/// reused while the table lives.
#[derive(Debug)]
pub struct Interner<T> {
    items: Vec<T>,
    /// The first slot whose item has a given hash; `collisions` holds the others.
    by_hash: FastMap<isize, u32>,
    collisions: Vec<(isize, u32)>,
    seen: FastMap<usize, u32>,
    /// Items offered that equal one in the table: kept alive, not in it.
    kept: Vec<T>,
}

impl<T> Default for Interner<T> {
    fn default() -> Self {
        Self {
            items: Vec::new(),
            by_hash: FastMap::default(),
            collisions: Vec::new(),
            seen: FastMap::default(),
            kept: Vec::new(),
        }
    }
}

/// How an `Interner` asks about its caller's items.
pub trait Identity<T> {
    type Error;
    fn address(&self, item: &T) -> usize;
    fn hash(&self, item: &T) -> Result<isize, Self::Error>;
    /// Whether `known` (in the table) and `item` are the same key.
    fn same(&self, known: &T, item: &T) -> Result<bool, Self::Error>;
    /// The error for a table past 2**32 items.
    fn too_many(&self) -> Self::Error;
}

impl<T> Interner<T> {
    /// The table, in slot order.
    pub fn items(&self) -> &[T] {
        &self.items
    }

    /// The slot of `item`, appended to the table when no equal item is in it.
    #[inline]
    pub fn slot<I: Identity<T>>(&mut self, item: T, identity: &I) -> Result<u32, I::Error> {
        let address = identity.address(&item);
        if let Some(slot) = self.seen.get(&address) {
            return Ok(*slot);
        }
        let hash = identity.hash(&item)?;
        let slot = if let Some(slot) = self.find(hash, &item, identity)? {
            self.kept.push(item);
            slot
        } else {
            let slot = u32::try_from(self.items.len()).map_err(|_| identity.too_many())?;
            match self.by_hash.entry(hash) {
                Entry::Vacant(entry) => {
                    entry.insert(slot);
                }
                // The first item with this hash keeps the map's entry.
                Entry::Occupied(_) => self.collisions.push((hash, slot)),
            }
            self.items.push(item);
            slot
        };
        self.seen.insert(address, slot);
        Ok(slot)
    }

    #[inline]
    fn find<I: Identity<T>>(
        &self,
        hash: isize,
        item: &T,
        identity: &I,
    ) -> Result<Option<u32>, I::Error> {
        let Some(&first) = self.by_hash.get(&hash) else {
            return Ok(None);
        };
        let candidates = std::iter::once(first).chain(
            self.collisions
                .iter()
                .filter(move |(other, _)| *other == hash)
                .map(|(_, slot)| *slot),
        );
        for slot in candidates {
            if identity.same(&self.items[slot as usize], item)? {
                return Ok(Some(slot));
            }
        }
        Ok(None)
    }
}
