//! The tiered LRU's eviction order of the values resident at each location, kept
//! incrementally (docs/concepts/controller.md#candidates): a decide walks it from the
//! first victim on, so finding the next candidate costs `O(log n)` in the values
//! resident there, not a sort of all of them.
//!
//! The order is kept by the controller with its keys ([`PolicyKeyMap`]):
//! a key change (a recorded access, new metadata) moves the value within each
//! location it is resident at ([`VictimOrder::rekey`]), and a decide first brings a
//! location's residents up to the manager's state ([`VictimOrder::sync`]): the
//! manager's per-location resident sets are persistent, so the values added and removed
//! since the last sync are found without visiting the ones shared.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;
use std::sync::Arc;

use imbl::OrdSet;
use imbl::ordset::DiffItem;

use crate::fasthash::FastMap;
use crate::location::Location;
use crate::state::HandleId;

/// The values resident at one location, as the manager's state keeps them.
pub type ResidentSet = OrdSet<HandleId>;

/// A value's tiered LRU keys: `(priority, last access epoch or -1, stable key)`.
pub type LruKeys = (i64, i64, Option<Arc<str>>);

/// Keys of a value without metadata and never accessed.
pub const PLAIN_KEYS: LruKeys = (0, -1, None);

/// The tiered LRU's keys by value position, for values with metadata or an access
/// epoch; every other value has [`PLAIN_KEYS`].
pub type PolicyKeyMap = FastMap<usize, LruKeys>;

/// One resident in the order: the tiered LRU's sort key, field for field (priority,
/// epoch, keyed first, key text, then registration order, which positions follow).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    priority: i64,
    epoch: i64,
    unkeyed: bool,
    key: Option<Arc<str>>,
    position: usize,
}

impl Entry {
    fn new(keys: &LruKeys, position: usize) -> Self {
        let (priority, epoch, key) = keys;
        Self {
            priority: *priority,
            epoch: *epoch,
            unkeyed: key.is_none(),
            key: key.clone(),
            position,
        }
    }
}

/// The values resident at one location as of the last sync, and their order.
#[derive(Debug, Default, Clone)]
struct Residents {
    synced: OrdSet<HandleId>,
    order: BTreeSet<Entry>,
}

/// The tiered LRU's order of the residents of each location a decide has asked about.
#[derive(Debug, Default, Clone)]
pub struct VictimOrder {
    locations: BTreeMap<Location, Residents>,
}

fn keys_of(keys: &PolicyKeyMap, position: usize) -> &LruKeys {
    keys.get(&position).unwrap_or(&PLAIN_KEYS)
}

impl VictimOrder {
    /// The value at `position` changed its keys from `old` to `new`: it moves wherever
    /// it is resident.
    pub fn rekey(&mut self, position: usize, old: &LruKeys, new: &LruKeys) {
        let Ok(handle) = HandleId::try_from(position) else {
            return;
        };
        for residents in self.locations.values_mut() {
            if residents.synced.contains(&handle) {
                residents.order.remove(&Entry::new(old, position));
                residents.order.insert(Entry::new(new, position));
            }
        }
    }

    /// Brings `location`'s residents up to `now` (the manager's residents there, `None`
    /// for none), each keyed by `keys`: only the values added or removed since the last
    /// sync are visited.
    pub fn sync(
        &mut self,
        keys: &PolicyKeyMap,
        location: Location,
        now: Option<&OrdSet<HandleId>>,
    ) {
        let residents = self.locations.entry(location).or_default();
        let empty = OrdSet::new();
        let now = now.unwrap_or(&empty);
        if residents.synced.ptr_eq(now) {
            return;
        }
        for change in residents.synced.diff(now) {
            match change {
                DiffItem::Add(&handle) => {
                    let position = handle as usize;
                    residents
                        .order
                        .insert(Entry::new(keys_of(keys, position), position));
                }
                DiffItem::Remove(&handle) => {
                    let position = handle as usize;
                    residents
                        .order
                        .remove(&Entry::new(keys_of(keys, position), position));
                }
            }
        }
        residents.synced = now.clone();
    }

    /// The resident of `location` next after `after` in the order (`None`: the first),
    /// with `keys` the keys the order was kept with.
    pub fn next(
        &self,
        keys: &PolicyKeyMap,
        location: Location,
        after: Option<usize>,
    ) -> Option<usize> {
        let residents = self.locations.get(&location)?;
        let next = match after {
            None => residents.order.first(),
            Some(position) => {
                let from = Entry::new(keys_of(keys, position), position);
                residents
                    .order
                    .range((Bound::Excluded(from), Bound::Unbounded))
                    .next()
            }
        };
        next.map(|entry| entry.position)
    }

    /// The residents of `location` in order (tests compare it with a sort).
    pub fn ordered(&self, location: Location) -> Vec<usize> {
        self.locations
            .get(&location)
            .map(|residents| residents.order.iter().map(|entry| entry.position).collect())
            .unwrap_or_default()
    }

    /// Forgets every location: the next sync of each starts from nothing.
    pub fn clear(&mut self) {
        self.locations.clear();
    }
}
