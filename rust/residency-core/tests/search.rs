//! The controller's search on small hand-built states (the Python differential test
//! compares it with a literal transcription of the documented search on thousands more).

#![allow(clippy::panic)] // Test assertions.

use std::collections::BTreeMap;

use residency_core::search::{
    Candidate, EvictionReason, MAX_DETAIL_BYTES, MAX_SEARCH_DEPTH, MEMO_BUDGET_BYTES, MatInfo,
    Planned, Requirement, Search, SearchBound, SearchError, SearchPolicy, SearchValue,
    SearchValues, TieredLru, ValueTable,
};
use residency_core::{ActionKind, CoreError, Location};

const HOST: Location = Location::PageableHost;
const PINNED: Location = Location::PinnedHost;

fn mat(location: Location, charged: u64) -> MatInfo {
    MatInfo {
        location,
        charged,
        use_count: 0,
        hold_count: 0,
        pending_count: 0,
    }
}

fn value(
    index: u32,
    charge: u64,
    source: Option<Location>,
    mats: Vec<MatInfo>,
) -> (SearchValue, Vec<MatInfo>) {
    (SearchValue::new(index, index, charge, false, source), mats)
}

fn table(values: Vec<(SearchValue, Vec<MatInfo>)>) -> SearchValues {
    let mut table = SearchValues::default();
    for (value, mats) in values {
        table.push(value, mats);
    }
    table
}

fn lru(_values: &SearchValues, tiers: &[(Location, Vec<Location>)]) -> TieredLru {
    TieredLru {
        keys: std::sync::Arc::default(),
        tiers: tiers.iter().cloned().collect(),
    }
}

fn books(values: &SearchValues) -> Vec<(Location, u64, u64)> {
    let mut used: BTreeMap<Location, u64> = BTreeMap::new();
    for position in 0..values.len() {
        for mat in values.mats(position) {
            *used.entry(mat.location).or_default() += mat.charged;
        }
    }
    used.into_iter()
        .map(|(location, used)| (location, used, 0))
        .collect()
}

#[test]
fn reconstructible_values_are_dropped_oldest_first() {
    let values = table(vec![
        value(0, 10, Some(HOST), vec![mat(HOST, 10)]),
        value(1, 10, Some(HOST), vec![mat(HOST, 10)]),
        value(2, 10, Some(HOST), vec![]),
    ]);
    let budgets = BTreeMap::from([(HOST, 20)]);
    let requirements = [Requirement {
        value: 2,
        location: HOST,
    }];
    let mut policy = lru(&values, &[]);
    let outcome = Search::new(&values, &budgets, &requirements, &[], &mut policy, 100)
        .run(&books(&values))
        .expect("feasible");
    assert_eq!(
        outcome.reclaim,
        vec![Planned::Drop {
            value: 0,
            location: HOST
        }]
    );
    assert_eq!(
        outcome.enter,
        vec![Planned::Ensure {
            value: 2,
            location: HOST
        }]
    );
    assert_eq!(outcome.evictions[0].rank, 0);
    assert_eq!(
        outcome.evictions[0].reason,
        EvictionReason::RegisteredSource
    );
    assert_eq!(outcome.explored, 2);
}

#[test]
fn a_sole_must_preserve_copy_spills_to_its_tier() {
    let values = table(vec![
        value(0, 10, None, vec![mat(HOST, 10)]),
        value(1, 10, Some(PINNED), vec![]),
    ]);
    let budgets = BTreeMap::from([(HOST, 10)]);
    let requirements = [Requirement {
        value: 1,
        location: HOST,
    }];
    let mut policy = lru(&values, &[(HOST, vec![PINNED])]);
    let outcome = Search::new(&values, &budgets, &requirements, &[], &mut policy, 100)
        .run(&books(&values))
        .expect("feasible");
    assert_eq!(
        outcome.reclaim,
        vec![Planned::Move {
            value: 0,
            to: PINNED,
            from: Some(HOST)
        }]
    );
    assert_eq!(outcome.evictions[0].reason, EvictionReason::MovedTo(PINNED));
    assert!(
        outcome.evictions[0]
            .reason
            .text()
            .contains("requested destination pinned-host")
    );
}

#[test]
fn an_exhausted_search_says_what_holds_the_room_and_what_to_do() {
    let mut held = mat(HOST, 3 << 20);
    held.hold_count = 1;
    let mut leased = mat(HOST, 1 << 20);
    leased.use_count = 2;
    let values = table(vec![
        value(0, 3 << 20, Some(HOST), vec![held]),
        value(1, 1 << 20, None, vec![leased]),
        value(2, 2 << 20, None, vec![mat(HOST, 2 << 20)]),
        value(3, 4 << 20, Some(PINNED), vec![]),
    ]);
    let budgets = BTreeMap::from([(HOST, 8 << 20)]);
    let requirements = [Requirement {
        value: 3,
        location: HOST,
    }];
    let mut policy = lru(&values, &[]);
    let result =
        Search::new(&values, &budgets, &requirements, &[], &mut policy, 100).run(&books(&values));
    let Err(SearchError::Infeasible { detail }) = result else {
        panic!("expected infeasible, got {result:?}");
    };
    assert!(
        detail.starts_with(
            "capacity failure at pageable-host for 4194304 bytes (materialization): \
             budget=8388608, used=6291456, reserved=0, protected=2 materialization(s) of \
             4194304 bytes"
        ),
        "{detail}"
    );
    for part in [
        "the value takes 4 MiB (4194304 bytes), and 2 MiB (2097152 bytes) of its budget of \
         8 MiB (8388608 bytes) is free: 2 MiB (2097152 bytes) more is needed",
        "value #0 (3 MiB) is held by 1 hold(s)",
        "value #1 (1 MiB) is in use by 2 lease token(s)",
        "value #2 (2 MiB) is its only copy, with no source to rebuild it",
        "To make room: release the leases",
        "release the holds",
        "give the policy a fallback tier for pageable-host",
        "raise pageable-host's budget",
        "require less at once",
    ] {
        assert!(detail.contains(part), "{part:?} not in {detail}");
    }
    assert!(!detail.contains("in flight"), "{detail}");
    assert!(!detail.contains("reservations"), "{detail}");
}

#[test]
fn protected_values_are_never_victims_and_exhaustion_is_infeasible() {
    let mut protected = mat(HOST, 10);
    protected.hold_count = 1;
    let values = table(vec![
        value(0, 10, Some(HOST), vec![protected]),
        value(1, 10, Some(HOST), vec![]),
    ]);
    let budgets = BTreeMap::from([(HOST, 10)]);
    let requirements = [Requirement {
        value: 1,
        location: HOST,
    }];
    let mut policy = lru(&values, &[]);
    let result =
        Search::new(&values, &budgets, &requirements, &[], &mut policy, 100).run(&books(&values));
    match result {
        Err(SearchError::Infeasible { detail }) => {
            assert!(
                detail.contains("capacity failure at pageable-host"),
                "{detail}"
            );
            assert!(detail.contains("budget=10"), "{detail}");
        }
        other => panic!("expected infeasible, got {other:?}"),
    }
}

#[test]
fn the_state_limit_is_inconclusive_at_exactly_the_limit() {
    let values = table(
        (0..6)
            .map(|index| value(index, 10, Some(HOST), vec![mat(HOST, 10)]))
            .chain((6..9).map(|index| value(index, 10, Some(HOST), vec![])))
            .collect(),
    );
    let budgets = BTreeMap::from([(HOST, 60)]);
    let requirements: Vec<Requirement> = (6..9)
        .map(|value| Requirement {
            value,
            location: HOST,
        })
        .collect();
    let mut policy = lru(&values, &[]);
    let result =
        Search::new(&values, &budgets, &requirements, &[], &mut policy, 2).run(&books(&values));
    assert!(
        matches!(result, Err(SearchError::Limit { explored: 2, .. })),
        "{result:?}"
    );
    let mut policy = lru(&values, &[]);
    let outcome = Search::new(&values, &budgets, &requirements, &[], &mut policy, 100)
        .run(&books(&values))
        .expect("feasible with room to search");
    assert_eq!(outcome.reclaim.len(), 3);
    assert_eq!(outcome.explored, 4);
}

#[test]
fn search_failures_become_the_core_errors_of_their_kind() {
    let name = |value: usize| (value == 0).then(|| "h0".to_owned());
    assert_eq!(
        SearchError::Limit {
            explored: 2,
            bound: SearchBound::Depth,
            detail: "d".into()
        }
        .into_core_error("r", 2, name),
        CoreError::SearchLimit {
            request_name: "r".into(),
            state_limit: 2,
            explored_states: 2,
            bound: "depth",
            detail: "d".into(),
        }
    );
    assert_eq!(
        SearchError::Infeasible { detail: "d".into() }.into_core_error("r", 2, name),
        CoreError::SearchInfeasible {
            request_name: "r".into(),
            detail: "d".into(),
        }
    );
    assert_eq!(
        SearchError::Unavailable { value: 0 }.into_core_error("r", 2, name),
        CoreError::SearchUnavailable {
            handle_id: "h0".into()
        }
    );
    assert!(matches!(
        SearchError::Unavailable { value: 1 }.into_core_error("r", 2, name),
        CoreError::Internal { .. }
    ));
    assert_eq!(
        SearchError::BadOrdering { detail: "d".into() }.into_core_error("r", 2, name),
        CoreError::Policy {
            message: "d".into()
        }
    );
    assert_eq!(
        SearchError::Interrupted.into_core_error("r", 2, name),
        CoreError::Policy {
            message: "the policy failed".into()
        }
    );
}

#[test]
fn planned_actions_name_their_kind() {
    let kinds: Vec<ActionKind> = [
        Planned::Ensure {
            value: 0,
            location: Location::Cuda(0),
        },
        Planned::Move {
            value: 0,
            to: Location::PinnedHost,
            from: None,
        },
        Planned::Drop {
            value: 0,
            location: Location::Cuda(0),
        },
    ]
    .iter()
    .map(Planned::kind)
    .collect();
    assert_eq!(
        kinds,
        [ActionKind::Ensure, ActionKind::Move, ActionKind::Drop]
    );
}

type Keys = (i64, i64, Option<std::sync::Arc<str>>);

#[test]
fn the_tiered_lru_orders_values_in_its_documented_order() {
    use residency_core::search::SearchPolicy;
    use std::sync::Arc;

    let values = table((0..12).map(|index| value(index, 1, None, vec![])).collect());
    let keyed: [(usize, Keys); 7] = [
        (3, (0, -1, Some(Arc::from("b")))),
        (5, (0, -1, Some(Arc::from("a")))),
        (1, (-2, 4, None)),
        (7, (0, 2, None)),
        (9, (0, -1, None)),
        (10, (1, -1, None)),
        (11, (0, 2, None)),
    ];
    let mut policy = TieredLru {
        keys: std::sync::Arc::new(keyed.iter().cloned().collect()),
        tiers: BTreeMap::new(),
    };
    let candidates: Vec<Candidate> = (0..values.len())
        .map(|value| Candidate {
            value,
            location: HOST,
            charged: 1,
        })
        .collect();
    let listed: Vec<usize> = policy.order(&candidates).expect("an order");
    let key = |position: usize| {
        let (priority, epoch, stable) = keyed
            .iter()
            .find(|(known, _)| *known == position)
            .map_or((0, -1, None), |(_, keys)| keys.clone());
        (
            priority,
            epoch,
            u8::from(stable.is_none()),
            stable.as_deref().unwrap_or("").to_owned(),
            position,
        )
    };
    let mut expected: Vec<usize> = (0..12).collect();
    expected.sort_by_key(|&position| key(position));
    assert_eq!(listed, expected);
}

// ----- The search's bounds (docs/concepts/controller.md#search-bounds) -----------------

const CUDA0: Location = Location::Cuda(0);
const CUDA1: Location = Location::Cuda(1);

/// Two tiers pointing at each other: the search moves value 0 between them, one level
/// deeper per state, and never ends on its own.
fn cycle() -> (
    SearchValues,
    BTreeMap<Location, u64>,
    Vec<Requirement>,
    TieredLru,
) {
    let exclusive = |index: u32, at: Location| {
        (
            SearchValue::new(index, index, 16, true, None),
            vec![mat(at, 16)],
        )
    };
    let values = table(vec![
        exclusive(0, CUDA0),
        exclusive(1, HOST),
        exclusive(2, HOST),
    ]);
    let budgets = BTreeMap::from([(CUDA0, 16), (CUDA1, 16)]);
    let requirements = vec![
        Requirement {
            value: 1,
            location: CUDA0,
        },
        Requirement {
            value: 2,
            location: CUDA1,
        },
    ];
    let policy = lru(&values, &[(CUDA0, vec![CUDA1]), (CUDA1, vec![CUDA0])]);
    (values, budgets, requirements, policy)
}

/// `count` droppable values of 1 byte filling `HOST`, and a request for a value of
/// `count + 1` bytes there: infeasible, after visiting every subset of the droppable ones.
fn wide(count: u32) -> (SearchValues, BTreeMap<Location, u64>, Vec<Requirement>) {
    let mut values: Vec<(SearchValue, Vec<MatInfo>)> = (0..count)
        .map(|index| value(index, 1, Some(HOST), vec![mat(HOST, 1)]))
        .collect();
    values.push(value(count, u64::from(count) + 1, Some(PINNED), vec![]));
    let budgets = BTreeMap::from([(HOST, u64::from(count))]);
    let requirements = vec![Requirement {
        value: count as usize,
        location: HOST,
    }];
    (table(values), budgets, requirements)
}

#[test]
fn a_cycling_search_stops_at_the_depth_bound_whatever_the_state_limit() {
    let (values, budgets, requirements, mut policy) = cycle();
    let result = Search::new(&values, &budgets, &requirements, &[], &mut policy, 1 << 40)
        .with_bounds(100, MEMO_BUDGET_BYTES)
        .run(&books(&values));
    match result {
        Err(SearchError::Limit {
            explored,
            bound: SearchBound::Depth,
            detail,
        }) => {
            assert_eq!(explored, 100);
            assert!(detail.contains("depth bound of 100"), "{detail}");
        }
        other => panic!("expected the depth bound, got {other:?}"),
    }
    // The default bound, through a path of that many levels (and its clean-up).
    let result = Search::new(&values, &budgets, &requirements, &[], &mut policy, 1 << 40)
        .run(&books(&values));
    assert!(
        matches!(
            result,
            Err(SearchError::Limit {
                explored: MAX_SEARCH_DEPTH,
                bound: SearchBound::Depth,
                ..
            })
        ),
        "{result:?}"
    );
    // The default state limit (100 000) is below the default depth bound: a cycling search
    // under it ends at exactly that limit, as the contract says.
    const { assert!(MAX_SEARCH_DEPTH >= 100_000) };
    let result = Search::new(&values, &budgets, &requirements, &[], &mut policy, 100_000)
        .run(&books(&values));
    assert!(
        matches!(
            result,
            Err(SearchError::Limit {
                explored: 100_000,
                bound: SearchBound::States,
                ..
            })
        ),
        "{result:?}"
    );
    // A state limit below the depth bound is reached first, and reported as before.
    let result = Search::new(&values, &budgets, &requirements, &[], &mut policy, 50)
        .with_bounds(100, MEMO_BUDGET_BYTES)
        .run(&books(&values));
    assert!(
        matches!(
            result,
            Err(SearchError::Limit {
                explored: 50,
                bound: SearchBound::States,
                ..
            })
        ),
        "{result:?}"
    );
}

#[test]
fn the_memo_stops_at_its_budget_and_below_it_changes_nothing() {
    let (values, budgets, requirements) = wide(8);
    let mut policy = lru(&values, &[]);
    // Every subset of the eight values once: 2**8 states, each remembered as exhausted.
    let result = Search::new(&values, &budgets, &requirements, &[], &mut policy, 1 << 40)
        .run(&books(&values));
    assert!(
        matches!(result, Err(SearchError::Infeasible { .. })),
        "{result:?}"
    );
    let result = Search::new(&values, &budgets, &requirements, &[], &mut policy, 1 << 40)
        .with_bounds(MAX_SEARCH_DEPTH, 4096)
        .run(&books(&values));
    match result {
        Err(SearchError::Limit {
            explored,
            bound: SearchBound::Memory,
            detail,
        }) => {
            assert!(explored > 0 && explored < 256, "{explored}");
            assert!(detail.contains("budget of 4096 bytes"), "{detail}");
        }
        other => panic!("expected the memory bound, got {other:?}"),
    }
}

#[test]
fn an_exhausted_search_keeps_its_detail_short() {
    let (values, budgets, requirements) = wide(10);
    let mut policy = lru(&values, &[]);
    let result = Search::new(&values, &budgets, &requirements, &[], &mut policy, 1 << 40)
        .run(&books(&values));
    let Err(SearchError::Infeasible { detail }) = result else {
        panic!("expected infeasible, got {result:?}");
    };
    // Every level's notes nest its candidates' details: cut, they stay near the cap.
    assert!(detail.len() <= MAX_DETAIL_BYTES + 512, "{}", detail.len());
    assert!(detail.contains("more candidate(s) failed"), "{detail}");
    assert!(
        detail.starts_with("capacity failure at pageable-host"),
        "{detail}"
    );
}

/// The tiered LRU, counting its interrupt polls and interrupting at the `stop`-th.
struct Polled {
    policy: TieredLru,
    polls: u64,
    stop: u64,
}

impl SearchPolicy for Polled {
    fn order(&mut self, candidates: &[Candidate]) -> Result<Vec<usize>, SearchError> {
        self.policy.order(candidates)
    }

    fn fallback_locations(&mut self, location: Location) -> Result<Vec<Location>, SearchError> {
        self.policy.fallback_locations(location)
    }

    fn check_interrupt(&mut self) -> Result<(), SearchError> {
        self.polls += 1;
        if self.polls == self.stop {
            return Err(SearchError::Interrupted);
        }
        Ok(())
    }
}

#[test]
fn the_search_polls_for_interrupts_every_few_steps() {
    let (values, budgets, requirements, policy) = cycle();
    let mut polled = Polled {
        policy,
        polls: 0,
        stop: u64::MAX,
    };
    let result =
        Search::new(&values, &budgets, &requirements, &[], &mut polled, 1000).run(&books(&values));
    assert!(matches!(result, Err(SearchError::Limit { .. })));
    // 1000 counted states take at least 1000 steps: a poll at least every 32.
    assert!(polled.polls >= 1000 / 32, "{} polls", polled.polls);
    polled.polls = 0;
    polled.stop = 3;
    let result = Search::new(&values, &budgets, &requirements, &[], &mut polled, 1 << 40)
        .run(&books(&values));
    assert_eq!(result.err(), Some(SearchError::Interrupted));
}

/// A table that counts the values the search reads.
struct Counting {
    table: SearchValues,
    reads: std::cell::Cell<usize>,
}

impl Counting {
    fn read(&self) {
        self.reads.set(self.reads.get() + 1);
    }
}

impl ValueTable for Counting {
    fn value(&self, position: usize) -> Option<SearchValue> {
        self.read();
        ValueTable::value(&self.table, position)
    }

    fn mat_at(&self, position: usize, location: Location) -> Option<MatInfo> {
        self.read();
        ValueTable::mat_at(&self.table, position, location)
    }

    fn mats(&self, position: usize) -> Vec<MatInfo> {
        self.read();
        ValueTable::mats(&self.table, position)
    }

    fn mat_count(&self, position: usize) -> usize {
        self.read();
        ValueTable::mat_count(&self.table, position)
    }

    fn residents(&self, location: Location) -> Vec<usize> {
        let residents = ValueTable::residents(&self.table, location);
        self.reads.set(self.reads.get() + residents.len());
        residents
    }
}

/// A decide's cost does not grow with the values the manager holds: with 4 values at
/// the device and many more elsewhere, the search reads the request's values and the
/// device's residents, whatever the count (docs/concepts/controller.md#candidates).
#[test]
fn a_search_reads_only_the_values_it_touches() {
    let mut reads = Vec::new();
    for others in [10u32, 10_000] {
        // Values 0..4 at HOST (full), 4 wanted there, the others at PINNED only or
        // nowhere.
        let mut values: Vec<(SearchValue, Vec<MatInfo>)> = (0..4)
            .map(|index| value(index, 8, Some(PINNED), vec![mat(HOST, 8)]))
            .collect();
        values.push(value(4, 8, Some(PINNED), vec![mat(PINNED, 8)]));
        for index in 5..5 + others {
            let mats = if index % 2 == 0 {
                vec![mat(PINNED, 8)]
            } else {
                vec![]
            };
            values.push(value(index, 8, Some(PINNED), mats));
        }
        let values = Counting {
            table: table(values),
            reads: std::cell::Cell::new(0),
        };
        let budgets = BTreeMap::from([(HOST, 32)]);
        let requirements = [Requirement {
            value: 4,
            location: HOST,
        }];
        let mut policy = lru(&values.table, &[]);
        let initial = books(&values.table);
        let outcome = Search::new(&values, &budgets, &requirements, &[], &mut policy, 100)
            .run(&initial)
            .expect("feasible");
        assert_eq!(
            outcome.reclaim,
            vec![Planned::Drop {
                value: 0,
                location: HOST
            }]
        );
        reads.push(values.reads.get());
    }
    assert_eq!(reads[0], reads[1], "reads at 10 and 10k other values");
    assert!(reads[0] < 64, "{reads:?}");
}
