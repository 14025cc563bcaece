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

/// A key of one resident in an order: it knows its value's position.
pub trait Positioned: Ord + Clone {
    fn position(&self) -> usize;
}

/// One resident in the tiered LRU's order: its sort key, field for field (priority,
/// epoch, keyed first, key text, then registration order, which positions follow).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct LruEntry {
    priority: i64,
    epoch: i64,
    unkeyed: bool,
    key: Option<Arc<str>>,
    position: usize,
}

impl LruEntry {
    pub fn new(keys: &LruKeys, position: usize) -> Self {
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

impl Positioned for LruEntry {
    fn position(&self) -> usize {
        self.position
    }
}

/// The values resident at one location as of the last sync, and their order.
#[derive(Debug, Clone)]
struct Residents<K> {
    synced: ResidentSet,
    order: BTreeSet<K>,
}

impl<K> Default for Residents<K> {
    fn default() -> Self {
        Self {
            synced: ResidentSet::new(),
            order: BTreeSet::new(),
        }
    }
}

/// A policy's order of the residents of each location a decide has asked about, by
/// keys `K` that sort as the policy does.
#[derive(Debug, Clone)]
pub struct Ordered<K> {
    locations: BTreeMap<Location, Residents<K>>,
}

impl<K> Default for Ordered<K> {
    fn default() -> Self {
        Self {
            locations: BTreeMap::new(),
        }
    }
}

impl<K: Positioned> Ordered<K> {
    /// The value at `position` changed its key from `old` to `new`: it moves wherever
    /// it is resident.
    pub fn rekey(&mut self, position: usize, old: &K, new: &K) {
        let Ok(handle) = HandleId::try_from(position) else {
            return;
        };
        if old == new {
            return;
        }
        for residents in self.locations.values_mut() {
            if residents.synced.contains(&handle) {
                residents.order.remove(old);
                residents.order.insert(new.clone());
            }
        }
    }

    /// Brings `location`'s residents up to `now` (the manager's residents there, `None`
    /// for none), each keyed by `key`: only the values added or removed since the last
    /// sync are visited.
    pub fn sync(
        &mut self,
        location: Location,
        now: Option<&ResidentSet>,
        key: impl Fn(usize) -> K,
    ) {
        let residents = self.locations.entry(location).or_default();
        let empty = ResidentSet::new();
        let now = now.unwrap_or(&empty);
        if residents.synced.ptr_eq(now) {
            return;
        }
        for change in residents.synced.diff(now) {
            match change {
                DiffItem::Add(&handle) => {
                    residents.order.insert(key(handle as usize));
                }
                DiffItem::Remove(&handle) => {
                    residents.order.remove(&key(handle as usize));
                }
            }
        }
        residents.synced = now.clone();
    }

    /// The resident of `location` next after the one keyed `after` (`None`: the
    /// first).
    pub fn next(&self, location: Location, after: Option<&K>) -> Option<usize> {
        let residents = self.locations.get(&location)?;
        let next = match after {
            None => residents.order.first(),
            Some(from) => residents
                .order
                .range((Bound::Excluded(from), Bound::Unbounded))
                .next(),
        };
        next.map(Positioned::position)
    }

    /// How many residents of `location` the order holds.
    pub fn count(&self, location: Location) -> usize {
        self.locations
            .get(&location)
            .map_or(0, |residents| residents.order.len())
    }

    /// The residents of `location` in order.
    pub fn ordered(&self, location: Location) -> Vec<usize> {
        self.locations
            .get(&location)
            .map(|residents| residents.order.iter().map(Positioned::position).collect())
            .unwrap_or_default()
    }

    /// Forgets every location: the next sync of each starts from nothing.
    pub fn clear(&mut self) {
        self.locations.clear();
    }
}

fn keys_of(keys: &PolicyKeyMap, position: usize) -> &LruKeys {
    keys.get(&position).unwrap_or(&PLAIN_KEYS)
}

/// The tiered LRU's order of the residents of each location a decide has asked about.
#[derive(Debug, Default, Clone)]
pub struct VictimOrder(Ordered<LruEntry>);

impl VictimOrder {
    /// The value at `position` changed its keys from `old` to `new`: it moves wherever
    /// it is resident.
    pub fn rekey(&mut self, position: usize, old: &LruKeys, new: &LruKeys) {
        self.0.rekey(
            position,
            &LruEntry::new(old, position),
            &LruEntry::new(new, position),
        );
    }

    /// Brings `location`'s residents up to `now` (the manager's residents there, `None`
    /// for none), each keyed by `keys`.
    pub fn sync(&mut self, keys: &PolicyKeyMap, location: Location, now: Option<&ResidentSet>) {
        self.0.sync(location, now, |position| {
            LruEntry::new(keys_of(keys, position), position)
        });
    }

    /// The resident of `location` next after `after` in the order (`None`: the first),
    /// with `keys` the keys the order was kept with.
    pub fn next(
        &self,
        keys: &PolicyKeyMap,
        location: Location,
        after: Option<usize>,
    ) -> Option<usize> {
        let after = after.map(|position| LruEntry::new(keys_of(keys, position), position));
        self.0.next(location, after.as_ref())
    }

    /// The residents of `location` in order (tests compare it with a sort).
    pub fn ordered(&self, location: Location) -> Vec<usize> {
        self.0.ordered(location)
    }

    /// How many residents of `location` the order holds.
    pub fn count(&self, location: Location) -> usize {
        self.0.count(location)
    }

    /// Forgets every location: the next sync of each starts from nothing.
    pub fn clear(&mut self) {
        self.0.clear();
    }
}
