//! The controller's decide over a lowered request (`Manager::decide_with`,
//! `Manager::decide_native`, `Manager::is_current`): a request's currency across a
//! discard, the liveness check, the built-in policies' victims and what a decision
//! runs as (docs/concepts/controller.md#decide).

#![allow(clippy::panic)] // Test assertions.

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;

use common::spec;
use residency_core::keys::KeyStore;
use residency_core::search::{Planned, SearchPolicy, TieredLru};
use residency_core::{
    CoreError, CudaDevices, DecideFailure, Decision, HandleId, Location, LoweredRequest, Manager,
    NativePolicy, ScheduleIndex,
};

const HOST: Location = Location::PageableHost;
const PINNED: Location = Location::PinnedHost;

/// A manager whose pinned host holds two 10-byte values, `a` and `b` (adopted there),
/// and `c`, adopted in pageable memory.
fn full() -> (Manager, [HandleId; 3]) {
    let manager = Manager::new(&[(HOST, 100), (PINNED, 20)]);
    let adopt = |at| {
        manager
            .adopt(1, spec(10, false, false), at, 10, &[])
            .expect("adopts")
            .0
    };
    let handles = [adopt(PINNED), adopt(PINNED), adopt(HOST)];
    (manager, handles)
}

/// `handles`, each required at the pinned host, lowered at the manager's discards now.
fn request(manager: &Manager, handles: &[HandleId]) -> LoweredRequest {
    LoweredRequest::new(
        manager.discards(),
        handles
            .iter()
            .map(|&handle| (handle, PINNED.code()))
            .collect(),
        "step".to_owned(),
        Vec::new(),
        Vec::new(),
    )
    .expect("valid location codes")
}

fn tiers() -> BTreeMap<Location, Vec<Location>> {
    BTreeMap::from([(PINNED, vec![HOST])])
}

/// The values the decision moves out of the pinned host, in order.
fn evicted(decision: &Decision) -> Vec<usize> {
    decision
        .evictions
        .iter()
        .map(|eviction| match eviction.action {
            Planned::Move { value, .. } | Planned::Ensure { value, .. } => value,
            Planned::Drop { .. } => panic!("unexpected drop {:?}", eviction.action),
        })
        .collect()
}

fn no_interrupt() -> bool {
    false
}

#[test]
fn a_request_or_schedule_resolved_before_a_discard_is_not_current() {
    let (manager, [a, b, c]) = full();
    let lowered = request(&manager, &[c]);
    assert!(manager.is_current(&lowered, None));
    assert!(manager.is_current(&lowered, Some(manager.discards())));
    manager.discard(b).expect("discards");
    assert!(!manager.is_current(&lowered, None));
    // Lowered again: current, unless its schedule was resolved before the discard.
    let again = request(&manager, &[a]);
    assert!(manager.is_current(&again, None));
    assert!(!manager.is_current(&again, Some(0)));
}

#[test]
fn a_requirement_on_a_discarded_value_decides_nothing() {
    let (manager, [_, b, _]) = full();
    manager.discard(b).expect("discards");
    let lowered = request(&manager, &[b]);
    let mut policy = TieredLru {
        keys: std::sync::Arc::default(),
        tiers: tiers(),
    };
    match manager.decide_with(&lowered, 1000, CudaDevices::Unavailable, &[], &mut policy) {
        Err(DecideFailure::NotLive(value)) => assert_eq!(value, b as usize),
        other => panic!("expected NotLive, got {other:?}"),
    }
}

/// The built-in tiered LRU (`schedule` None) or schedule-aware policy with `a` used at
/// epoch `epochs[0]` and `b` at `epochs[1]`.
fn decide_native(
    manager: &Manager,
    handles: [HandleId; 3],
    epochs: [i64; 2],
    schedule: Option<(&ScheduleIndex, usize)>,
) -> Decision {
    let [a, b, c] = handles;
    let mut store = KeyStore::default();
    store.set_epoch(a, epochs[0]);
    store.set_epoch(b, epochs[1]);
    let keys = Mutex::new(store);
    let tiers = tiers();
    let policy = NativePolicy {
        keys: &keys,
        tiers: &tiers,
        schedule,
    };
    let lowered = request(manager, &[c]);
    manager
        .decide_native(
            &lowered,
            1000,
            CudaDevices::Unavailable,
            &[],
            policy,
            &mut no_interrupt,
        )
        .expect("decides")
}

#[test]
fn the_tiered_lru_moves_the_least_recently_used_value_out() {
    let (manager, handles @ [a, b, _]) = full();
    let decision = decide_native(&manager, handles, [2, 1], None);
    assert!(decision.simulation.feasible);
    assert_eq!(evicted(&decision), vec![b as usize]);
    let decision = decide_native(&manager, handles, [1, 2], None);
    assert_eq!(evicted(&decision), vec![a as usize]);
    // One eviction row, then the reclaim and enter rows: move out, then copy in.
    assert_eq!(decision.eviction_rows().len(), 1);
    assert_eq!(decision.reclaim_rows().len(), 1);
    assert_eq!(decision.enter_rows().len(), 1);
    assert_eq!(decision.version, manager.version());
}

#[test]
fn the_schedule_aware_policy_moves_the_value_needed_farthest_ahead_out() {
    let (manager, handles @ [a, b, c]) = full();
    let steps = |order: [HandleId; 3]| -> Vec<Vec<usize>> {
        order.iter().map(|&handle| vec![handle as usize]).collect()
    };
    // At step 0 (c's), a is needed next and b after it: b goes, whatever the epochs say.
    let index = ScheduleIndex::new(&steps([c, a, b]), manager.discards(), false);
    let decision = decide_native(&manager, handles, [1, 2], Some((&index, 0)));
    assert_eq!(evicted(&decision), vec![b as usize]);
    let index = ScheduleIndex::new(&steps([c, b, a]), manager.discards(), false);
    let decision = decide_native(&manager, handles, [2, 1], Some((&index, 0)));
    assert_eq!(evicted(&decision), vec![a as usize]);
}

#[test]
fn a_decision_runs_as_another_only_with_the_same_actions_and_reclaim_allowed() {
    let (manager, handles) = full();
    let first = decide_native(&manager, handles, [2, 1], None);
    let same = decide_native(&manager, handles, [2, 1], None);
    let other = decide_native(&manager, handles, [1, 2], None);
    assert!(same.same_as(&first));
    assert!(same.runs_as(&first, true));
    // It evicts: without reclaim it does not run.
    assert!(!same.runs_as(&first, false));
    assert!(!other.same_as(&first));
    assert!(!other.runs_as(&first, true));
    // Its simulation is the preflight of its own plan with the same CUDA devices only.
    assert!(
        first
            .preflighted(&first.plan, CudaDevices::Unavailable)
            .is_some()
    );
    assert!(
        first
            .preflighted(&first.plan, CudaDevices::Count(1))
            .is_none()
    );
    // A plan with another action list (here: none) is not its plan.
    let empty = residency_core::Plan::new("empty", vec![], vec![], vec![], vec![], vec![])
        .expect("an empty plan");
    assert!(
        first
            .preflighted(&empty, CudaDevices::Unavailable)
            .is_none()
    );
}

/// A policy that fails its first ordering.
struct Failing;

impl SearchPolicy for Failing {
    fn order(
        &mut self,
        _candidates: &[residency_core::search::Candidate],
    ) -> Result<Vec<usize>, residency_core::search::SearchError> {
        Err(residency_core::search::SearchError::Policy)
    }

    fn fallback_locations(
        &mut self,
        _at: Location,
    ) -> Result<Vec<Location>, residency_core::search::SearchError> {
        Ok(vec![HOST])
    }
}

#[test]
fn a_failing_policy_refuses_as_a_policy_error() {
    let (manager, [_, _, c]) = full();
    let lowered = request(&manager, &[c]);
    match manager.decide_with(&lowered, 1000, CudaDevices::Unavailable, &[], &mut Failing) {
        Err(DecideFailure::Refused(CoreError::Policy { .. })) => {}
        other => panic!("expected a policy error, got {other:?}"),
    }
}

#[test]
fn a_requests_groups_are_its_locations_in_order_each_value_once() {
    let cuda = Location::cuda(0).expect("cuda:0");
    let lowered = LoweredRequest::new(
        0,
        vec![
            (3, PINNED.code()),
            (1, cuda.code()),
            (2, PINNED.code()),
            (3, PINNED.code()),
            (1, cuda.code()),
        ],
        "step".to_owned(),
        Vec::new(),
        Vec::new(),
    )
    .expect("valid location codes");
    assert_eq!(
        lowered.groups(),
        vec![(PINNED, vec![3, 2]), (cuda, vec![1])]
    );
}
