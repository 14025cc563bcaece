//! The built-in policies' keys by handle index, as the controller keeps them
//! (docs/concepts/controller.md#candidates): `(priority, last access epoch or -1,
//! stable key)` per value with metadata or an access, one entry per change, so a
//! decide reads them without converting or copying them. With them, each built-in
//! policy's order of every location's residents ([`VictimOrder`], [`ScheduleOrder`]),
//! moved as the keys change, so a decide walks it instead of sorting the residents.
//!
//! A decide takes an order out ([`KeyStore::take_order`]) and hands it back
//! ([`KeyStore::put_order`]); a key that changes meanwhile makes the order handed back
//! stale, and it is forgotten (synced again from nothing by the next decide).

use std::sync::Arc;

use crate::search::ScheduleOrder;
use crate::victims::{LruKeys, PolicyKeyMap, VictimOrder};

/// An order kept with the keys: out while a decide walks it, and stale if a key
/// changed meanwhile.
#[derive(Debug, Default)]
struct Kept<T> {
    order: Option<T>,
    stale: bool,
}

impl<T: Default> Kept<T> {
    /// The order for one decide; another decide meanwhile (a signal handler's) gets an
    /// empty one, synced from nothing.
    fn take(&mut self) -> T {
        self.order.take().unwrap_or_default()
    }

    /// Hands back what [`Self::take`] gave out: kept unless a key changed meanwhile
    /// (then forgotten, to be synced again from nothing).
    fn put(&mut self, order: T) {
        if std::mem::take(&mut self.stale) {
            self.order.get_or_insert_with(T::default);
            return;
        }
        if self.order.is_none() {
            self.order = Some(order);
        }
    }

    /// A key changed: the order moves the value (`rekey`), or is stale while out.
    fn changed(&mut self, rekey: impl FnOnce(&mut T)) {
        match &mut self.order {
            Some(order) => rekey(order),
            None => self.stale = true,
        }
    }
}

/// The keys and both built-in policies' orders.
#[derive(Debug, Default)]
pub struct KeyStore {
    map: Arc<PolicyKeyMap>,
    lru: Kept<VictimOrder>,
    schedule: Kept<ScheduleOrder>,
    /// The controller's last access epoch: each use takes the next one
    /// (docs/concepts/controller.md#access-epochs).
    epoch: i64,
}

impl KeyStore {
    /// The keys now and the tiered LRU's order kept with them, for one decide to walk
    /// (and sync) and then hand back ([`Self::put_order`]).
    pub fn take_order(&mut self) -> (Arc<PolicyKeyMap>, VictimOrder) {
        (Arc::clone(&self.map), self.lru.take())
    }

    /// Hands back the tiered LRU's order [`Self::take_order`] gave out.
    pub fn put_order(&mut self, order: VictimOrder) {
        self.lru.put(order);
    }

    /// The keys now and the schedule-aware policy's order, as [`Self::take_order`].
    pub fn take_schedule_order(&mut self) -> (Arc<PolicyKeyMap>, ScheduleOrder) {
        (Arc::clone(&self.map), self.schedule.take())
    }

    /// Hands back the schedule-aware policy's order.
    pub fn put_schedule_order(&mut self, order: ScheduleOrder) {
        self.schedule.put(order);
    }

    /// Changes the keys of the value at `index` with `change`; both orders move it.
    pub fn update(&mut self, index: u32, change: impl FnOnce(&mut LruKeys)) {
        let entry = Arc::make_mut(&mut self.map)
            .entry(index as usize)
            .or_insert((0, -1, None));
        let old = entry.clone();
        change(entry);
        let position = index as usize;
        self.lru.changed(|order| order.rekey(position, &old, entry));
        self.schedule
            .changed(|order| order.rekey(position, &old, entry));
    }

    /// Sets the last access epoch of the value at `index`.
    pub fn set_epoch(&mut self, index: u32, epoch: i64) {
        self.update(index, |entry| entry.1 = epoch);
    }

    /// Takes the next access epoch: one use's.
    pub fn next_epoch(&mut self) -> i64 {
        self.epoch = self.epoch.saturating_add(1);
        self.epoch
    }

    /// Takes the next access epoch and sets it as the last access epoch of each value
    /// at `indices`: a use's access record.
    pub fn record_use(&mut self, indices: impl IntoIterator<Item = u32>) {
        let epoch = self.next_epoch();
        for index in indices {
            self.set_epoch(index, epoch);
        }
    }

    /// Sets the priority and stable key of the value at `index`.
    pub fn set_metadata(&mut self, index: u32, priority: i64, key: Option<&str>) {
        self.update(index, |entry| {
            entry.0 = priority;
            entry.2 = key.map(Arc::from);
        });
    }

    /// The values with keys.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no value has keys.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The keys of the value at `index`, when it has any.
    pub fn keys(&self, index: u32) -> Option<&LruKeys> {
        self.map.get(&(index as usize))
    }
}
