//! The tiered LRU's incremental order of each location's residents (`VictimOrder`):
//! after any sequence of key changes, arrivals and departures, it is the order a sort
//! of the residents gives; and a search that walks it decides exactly what a search
//! that sorts every resident decides, on random states.

#![allow(clippy::panic)] // Test assertions.

use std::collections::BTreeMap;
use std::sync::Arc;

use proptest::prelude::*;
use residency_core::search::{
    Candidate, IndexedLru, IndexedSchedule, MatInfo, NextUses, PolicyKeyMap, Requirement,
    ScheduleAware, ScheduleOrder, Search, SearchPolicy, SearchValue, SearchValues, TieredLru,
    ValueTable,
};
use residency_core::victims::{LruKeys, PLAIN_KEYS, ResidentSet, VictimOrder};
use residency_core::{HandleId, Location};

const LOCATIONS: [Location; 3] = [
    Location::PageableHost,
    Location::PinnedHost,
    Location::Cuda(0),
];

/// The residents of `set` sorted as the tiered LRU sorts candidates.
fn sorted(keys: &PolicyKeyMap, set: &ResidentSet) -> Vec<usize> {
    let mut positions: Vec<usize> = set.iter().map(|&handle| handle as usize).collect();
    let mut policy = TieredLru {
        keys: Arc::new(keys.clone()),
        tiers: BTreeMap::new(),
    };
    let candidates: Vec<Candidate> = positions
        .iter()
        .map(|&value| Candidate {
            value,
            location: Location::PageableHost,
            charged: 1,
        })
        .collect();
    let order = policy.order(&candidates).expect("a native order");
    positions = order.into_iter().map(|index| positions[index]).collect();
    positions
}

#[derive(Debug, Clone)]
enum Op {
    /// New keys for a position: priority, epoch, stable key.
    Keys(usize, i64, i64, Option<u8>),
    /// A value arrives at, or leaves, a location (the manager's residents change).
    Arrive(usize, usize),
    Leave(usize, usize),
    /// A decide syncs a location.
    Sync(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..24usize, -1..2i64, -1..6i64, proptest::option::of(0..3u8))
            .prop_map(|(position, priority, epoch, key)| Op::Keys(position, priority, epoch, key)),
        (0..3usize, 0..24usize).prop_map(|(location, position)| Op::Arrive(location, position)),
        (0..3usize, 0..24usize).prop_map(|(location, position)| Op::Leave(location, position)),
        (0..3usize).prop_map(Op::Sync),
    ]
}

fn key_text(key: Option<u8>) -> Option<Arc<str>> {
    key.map(|key| Arc::from(format!("k{key}")))
}

/// Applies `op` to the model: new keys, or a resident arriving at or leaving a
/// location (`None` once a location has none, as the state forgets an empty set).
/// For new keys, the position and its old and new keys, for the order's `rekey`.
fn apply(
    op: &Op,
    keys: &mut PolicyKeyMap,
    residents: &mut [Option<ResidentSet>; 3],
) -> Option<(usize, LruKeys, LruKeys)> {
    match *op {
        Op::Keys(position, priority, epoch, key) => {
            let old: LruKeys = keys.get(&position).cloned().unwrap_or(PLAIN_KEYS);
            let new: LruKeys = (priority, epoch, key_text(key));
            keys.insert(position, new.clone());
            return Some((position, old, new));
        }
        Op::Arrive(location, position) => {
            let handle = HandleId::try_from(position).expect("small");
            residents[location]
                .get_or_insert_with(ResidentSet::new)
                .insert(handle);
        }
        Op::Leave(location, position) => {
            let handle = HandleId::try_from(position).expect("small");
            if let Some(set) = &mut residents[location] {
                set.remove(&handle);
                if set.is_empty() {
                    residents[location] = None;
                }
            }
        }
        Op::Sync(_) => {}
    }
    None
}

/// The positions `next` walks, each after the one before, at most one step more than
/// `count`: a wrong order that cycles fails its comparison instead of walking forever.
fn walk(count: usize, mut next: impl FnMut(Option<usize>) -> Option<usize>) -> Vec<usize> {
    let mut walked = Vec::new();
    let mut after = None;
    for _ in 0..=count {
        let Some(position) = next(after) else {
            break;
        };
        walked.push(position);
        after = Some(position);
    }
    walked
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// After any sequence of changes, each synced location's order is the sort of its
    /// residents by the current keys.
    #[test]
    fn the_incremental_order_is_the_sorted_order(ops in proptest::collection::vec(op(), 1..120)) {
        let mut keys = PolicyKeyMap::default();
        let mut order = VictimOrder::default();
        // The manager's residents per location, persistent as in its state; `None`
        // once a location has none (the state forgets an empty set).
        let mut residents: [Option<ResidentSet>; 3] = [None, None, None];
        let mut synced = [false; 3];
        for op in ops {
            if let Some((position, old, new)) = apply(&op, &mut keys, &mut residents) {
                order.rekey(position, &old, &new);
            }
            if let Op::Sync(location) = op {
                order.sync(&keys, LOCATIONS[location], residents[location].as_ref());
                synced[location] = true;
            }
            for (index, &location) in LOCATIONS.iter().enumerate() {
                if !synced[index] {
                    continue;
                }
                // Synced now (as a decide does first), it is the sort of the residents.
                order.sync(&keys, location, residents[index].as_ref());
                let set = residents[index].clone().unwrap_or_default();
                prop_assert_eq!(order.ordered(location), sorted(&keys, &set));
                let walked = walk(order.count(location), |after| order.next(&keys, location, after));
                prop_assert_eq!(walked, sorted(&keys, &set));
            }
        }
    }
}

/// A search's value table that also offers its per-location resident sets, as a
/// manager's state does, so a policy may walk its own order of them.
struct Walkable {
    values: SearchValues,
    sets: BTreeMap<Location, ResidentSet>,
}

impl ValueTable for Walkable {
    fn value(&self, position: usize) -> Option<SearchValue> {
        self.values.value(position)
    }
    fn mat_at(&self, position: usize, location: Location) -> Option<MatInfo> {
        ValueTable::mat_at(&self.values, position, location)
    }
    fn mats(&self, position: usize) -> Vec<MatInfo> {
        ValueTable::mats(&self.values, position)
    }
    fn mat_count(&self, position: usize) -> usize {
        self.values.mat_count(position)
    }
    fn residents(&self, location: Location) -> Vec<usize> {
        ValueTable::residents(&self.values, location)
    }
    fn resident_set(&self, location: Location) -> Option<Option<&ResidentSet>> {
        Some(self.sets.get(&location))
    }
}

/// One random value: its charge, whether it has a source, and per location whether it
/// is there and how protected (0: not there, 1: there, 2: there and in use).
type ValueSpec = (u64, bool, [u8; 3]);

/// A random state: its values, their `(priority, epoch)` keys, the requirements as
/// `(value, location index)` and the budgets per location.
type RandomState = (
    Vec<ValueSpec>,
    Vec<(i64, i64)>,
    Vec<(usize, usize)>,
    [u64; 3],
);

fn state() -> impl Strategy<Value = RandomState> {
    (
        proptest::collection::vec((1..4u64, any::<bool>(), [0..3u8, 0..3u8, 0..3u8]), 1..14),
        proptest::collection::vec((-1..2i64, -1..8i64), 14),
        proptest::collection::vec((0..14usize, 0..3usize), 1..4),
        [4..16u64, 4..16u64, 2..12u64],
    )
}

/// The tiers of the random searches: the device spills to pinned then pageable memory,
/// pinned memory to pageable memory.
fn tiers() -> BTreeMap<Location, Vec<Location>> {
    [
        (
            Location::Cuda(0),
            vec![Location::PinnedHost, Location::PageableHost],
        ),
        (Location::PinnedHost, vec![Location::PageableHost]),
    ]
    .into_iter()
    .collect()
}

/// A random search's inputs: its values (with their resident sets), keys,
/// requirements, budgets and books.
type RandomSearch = (
    SearchValues,
    BTreeMap<Location, ResidentSet>,
    PolicyKeyMap,
    Vec<Requirement>,
    BTreeMap<Location, u64>,
    Vec<(Location, u64, u64)>,
);

fn random_search(
    specs: &[ValueSpec],
    keyed: &[(i64, i64)],
    wanted: &[(usize, usize)],
    budgets: [u64; 3],
) -> RandomSearch {
    let mut values = SearchValues::default();
    let mut sets: BTreeMap<Location, ResidentSet> = BTreeMap::new();
    let mut keys = PolicyKeyMap::default();
    for (position, &(charge, source, places)) in specs.iter().enumerate() {
        let handle = HandleId::try_from(position).expect("small");
        let mats: Vec<MatInfo> = LOCATIONS
            .iter()
            .zip(places)
            .filter(|&(_, place)| place > 0)
            .map(|(&location, place)| MatInfo {
                location,
                charged: charge,
                use_count: u32::from(place == 2),
                hold_count: 0,
                pending_count: 0,
            })
            .collect();
        for mat in &mats {
            sets.entry(mat.location).or_default().insert(handle);
        }
        let source = source.then_some(Location::PageableHost);
        values.push(
            SearchValue::new(handle, handle, charge, false, source),
            mats,
        );
        let (priority, epoch) = keyed[position];
        keys.insert(position, (priority, epoch, None));
    }
    let requirements: Vec<Requirement> = wanted
        .iter()
        .filter(|&&(value, _)| value < specs.len())
        .map(|&(value, location)| Requirement {
            value,
            location: LOCATIONS[location],
        })
        .collect();
    let budgets: BTreeMap<Location, u64> = LOCATIONS.iter().copied().zip(budgets).collect();
    let mut used: BTreeMap<Location, u64> = BTreeMap::new();
    for position in 0..values.len() {
        for mat in values.mats(position) {
            *used.entry(mat.location).or_default() += mat.charged;
        }
    }
    let books: Vec<(Location, u64, u64)> = LOCATIONS
        .iter()
        .map(|&location| (location, used.get(&location).copied().unwrap_or(0), 0))
        .collect();
    (values, sets, keys, requirements, budgets, books)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The search walking the incremental order decides exactly what the search sorting
    /// every resident decides: the same plan, evictions and explored states, or the
    /// same failure.
    #[test]
    fn walking_the_order_decides_as_sorting((specs, keyed, wanted, budgets) in state()) {
        let (values, sets, keys, requirements, budgets, books) =
            random_search(&specs, &keyed, &wanted, budgets);
        let tiers = tiers();
        let keys = Arc::new(keys);
        let mut sorting = TieredLru { keys: Arc::clone(&keys), tiers: tiers.clone() };
        let sorted = Search::new(&values, &budgets, &requirements, &[], &mut sorting, 2_000)
            .run(&books);
        let walkable = Walkable { values: values.clone(), sets };
        let mut order = VictimOrder::default();
        let mut walking = IndexedLru {
            lru: TieredLru { keys: Arc::clone(&keys), tiers },
            order: &mut order,
        };
        let walked = Search::new(&walkable, &budgets, &requirements, &[], &mut walking, 2_000)
            .run(&books);
        match (sorted, walked) {
            (Ok(sorted), Ok(walked)) => {
                prop_assert_eq!(&sorted.reclaim, &walked.reclaim);
                prop_assert_eq!(&sorted.enter, &walked.enter);
                prop_assert_eq!(&sorted.evictions, &walked.evictions);
                prop_assert_eq!(sorted.explored, walked.explored);
            }
            (sorted, walked) => prop_assert_eq!(sorted.err(), walked.err()),
        }
    }
}

/// A policy that counts the candidates the search asks the one it wraps to order.
struct Counting<P> {
    policy: P,
    ordered: usize,
}

impl<P: SearchPolicy> SearchPolicy for Counting<P> {
    fn order(
        &mut self,
        candidates: &[Candidate],
    ) -> Result<Vec<usize>, residency_core::search::SearchError> {
        self.ordered += candidates.len();
        self.policy.order(candidates)
    }
    fn fallback_locations(
        &mut self,
        location: Location,
    ) -> Result<Vec<Location>, residency_core::search::SearchError> {
        self.policy.fallback_locations(location)
    }
    fn sync_residents(
        &mut self,
        location: Location,
        residents: Option<&ResidentSet>,
    ) -> Option<usize> {
        self.policy.sync_residents(location, residents)
    }
    fn next_resident(&self, location: Location, after: Option<usize>) -> Option<usize> {
        self.policy.next_resident(location, after)
    }
    fn compare(&self, left: usize, right: usize) -> std::cmp::Ordering {
        self.policy.compare(left, right)
    }
}

/// With 10 000 values resident on a full device, making room for one more reads a
/// handful of them (the least recently used first), not all: after the first decide
/// synced the order, a decide neither sorts the residents nor walks past the victim.
#[test]
fn a_decide_reads_the_victims_it_tries_not_every_resident() {
    const RESIDENT: usize = 10_000;
    let device = Location::Cuda(0);
    let mut values = SearchValues::default();
    let mut sets: BTreeMap<Location, ResidentSet> = BTreeMap::new();
    let mut keys = PolicyKeyMap::default();
    for position in 0..=RESIDENT {
        let handle = HandleId::try_from(position).expect("small");
        let mut mats = vec![MatInfo {
            location: Location::PageableHost,
            charged: 1,
            use_count: 0,
            hold_count: 0,
            pending_count: 0,
        }];
        if position < RESIDENT {
            mats.push(MatInfo {
                location: device,
                ..mats[0]
            });
            sets.entry(device).or_default().insert(handle);
            // Used in a scrambled order: the least recently used is value 7.
            let epoch =
                i64::try_from((position * 7919 + RESIDENT - 7 * 7919 % RESIDENT) % RESIDENT)
                    .expect("small");
            keys.insert(position, (0, epoch, None));
        }
        values.push(SearchValue::new(handle, handle, 1, false, None), mats);
    }
    let walkable = Walkable { values, sets };
    let budgets: BTreeMap<Location, u64> = [(device, RESIDENT as u64)].into_iter().collect();
    let books = [
        (device, RESIDENT as u64, 0),
        (Location::PageableHost, RESIDENT as u64 + 1, 0),
    ];
    let requirements = [Requirement {
        value: RESIDENT,
        location: device,
    }];
    let keys = Arc::new(keys);
    let mut order = VictimOrder::default();
    for decide in 0..2 {
        let mut policy = Counting {
            policy: IndexedLru {
                lru: TieredLru {
                    keys: Arc::clone(&keys),
                    tiers: BTreeMap::new(),
                },
                order: &mut order,
            },
            ordered: 0,
        };
        let outcome = Search::new(&walkable, &budgets, &requirements, &[], &mut policy, 100)
            .run(&books)
            .expect("room is made");
        assert_eq!(
            outcome.reclaim,
            vec![residency_core::search::Planned::Drop {
                value: 7,
                location: device
            }],
            "decide {decide}"
        );
        assert!(
            policy.ordered <= 2,
            "decide {decide} ordered {}",
            policy.ordered
        );
    }
}

/// The residents of `set` sorted as the schedule-aware policy sorts candidates, with
/// the schedule standing at `uses`.
fn schedule_sorted(keys: &PolicyKeyMap, uses: &NextUses, set: &ResidentSet) -> Vec<usize> {
    let positions: Vec<usize> = set.iter().map(|&handle| handle as usize).collect();
    let mut policy = ScheduleAware {
        lru: TieredLru {
            keys: Arc::new(keys.clone()),
            tiers: BTreeMap::new(),
        },
        next_use: uses.clone(),
    };
    let candidates: Vec<Candidate> = positions
        .iter()
        .map(|&value| Candidate {
            value,
            location: Location::PageableHost,
            charged: 1,
        })
        .collect();
    let order = policy.order(&candidates).expect("a native order");
    order.into_iter().map(|index| positions[index]).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The schedule-aware order, kept as keys change, residents come and go and the
    /// schedule stands at other steps (forward, back, across a cyclic schedule's end),
    /// is the sort of the residents at each moment.
    #[test]
    fn the_schedule_order_is_the_sorted_order(
        schedule in proptest::collection::vec(proptest::collection::vec(0..24usize, 0..4), 1..12),
        cyclic in any::<bool>(),
        ops in proptest::collection::vec((op(), 0..16usize), 1..100),
    ) {
        let steps = if cyclic { NextUses::cyclic(&schedule) } else { NextUses::new(&schedule) };
        let mut keys = PolicyKeyMap::default();
        let mut order = ScheduleOrder::default();
        let mut residents: [Option<ResidentSet>; 3] = [None, None, None];
        for (op, cursor) in ops {
            let uses = steps.at(cursor);
            if let Some((position, old, new)) = apply(&op, &mut keys, &mut residents) {
                order.rekey(position, &old, &new);
            }
            // A decide standing at `cursor` syncs each location it reclaims at.
            let keys_now = Arc::new(keys.clone());
            for (index, &location) in LOCATIONS.iter().enumerate() {
                let mut walking = IndexedSchedule {
                    policy: ScheduleAware {
                        lru: TieredLru { keys: Arc::clone(&keys_now), tiers: BTreeMap::new() },
                        next_use: uses.clone(),
                    },
                    order: &mut order,
                };
                let count = walking.sync_residents(location, residents[index].as_ref());
                let walked = walk(count.unwrap_or(0), |after| walking.next_resident(location, after));
                let set = residents[index].clone().unwrap_or_default();
                let sorted = schedule_sorted(&keys, &uses, &set);
                prop_assert_eq!(count, Some(set.len()));
                prop_assert_eq!(&walked, &sorted);
                prop_assert_eq!(order.ordered(location), sorted);
            }
        }
    }

    /// A search walking the schedule-aware order decides exactly what one sorting every
    /// resident decides.
    #[test]
    fn walking_the_schedule_order_decides_as_sorting(
        (specs, keyed, wanted, budgets) in state(),
        schedule in proptest::collection::vec(proptest::collection::vec(0..14usize, 0..3), 1..8),
        cursor in 0..10usize,
    ) {
        let uses = NextUses::cyclic(&schedule).at(cursor);
        let (values, sets, keys, requirements, budgets, books) =
            random_search(&specs, &keyed, &wanted, budgets);
        let lru = TieredLru { keys: Arc::new(keys), tiers: tiers() };
        let mut sorting = ScheduleAware { lru: lru.clone(), next_use: uses.clone() };
        let sorted = Search::new(&values, &budgets, &requirements, &[], &mut sorting, 2_000)
            .run(&books);
        let walkable = Walkable { values, sets };
        let mut order = ScheduleOrder::default();
        let mut walking = IndexedSchedule {
            policy: ScheduleAware { lru, next_use: uses },
            order: &mut order,
        };
        let walked = Search::new(&walkable, &budgets, &requirements, &[], &mut walking, 2_000)
            .run(&books);
        match (sorted, walked) {
            (Ok(sorted), Ok(walked)) => {
                prop_assert_eq!(&sorted.reclaim, &walked.reclaim);
                prop_assert_eq!(&sorted.enter, &walked.enter);
                prop_assert_eq!(&sorted.evictions, &walked.evictions);
                prop_assert_eq!(sorted.explored, walked.explored);
            }
            (sorted, walked) => prop_assert_eq!(sorted.err(), walked.err()),
        }
    }
}
