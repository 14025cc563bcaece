//! Schedule-aware eviction: its order on hand-built candidates, and, used as the
//! victim choice of a cache of equal-size values, exactly the fewest misses any
//! eviction choices could give (computed here by exhaustive search, independently of
//! the farthest-next-use rule).

#![allow(clippy::panic)] // Test assertions.

use std::collections::HashMap;

use proptest::prelude::*;
use residency_core::search::{Candidate, NextUses, ScheduleAware, SearchPolicy, TieredLru};
use residency_core::{FastMap, Location};

fn candidates(values: &[usize]) -> Vec<Candidate> {
    values
        .iter()
        .map(|&value| Candidate {
            value,
            location: Location::PageableHost,
            charged: 1,
        })
        .collect()
}

fn policy(schedule: &[Vec<usize>], cursor: usize) -> ScheduleAware {
    ScheduleAware {
        lru: TieredLru::default(),
        next_use: ScheduleAware::next_uses(schedule, cursor),
    }
}

/// The evicted values, first evicted first.
fn evicted_first(policy: &mut ScheduleAware, values: &[usize]) -> Vec<usize> {
    let order = policy.order(&candidates(values)).expect("a native order");
    order.into_iter().map(|index| values[index]).collect()
}

#[test]
fn never_used_again_goes_first_then_the_farthest_next_use() {
    // Steps: 0 uses {0}, 1 uses {1}, 2 uses {2, 0}; value 3 is never used again.
    let schedule = vec![vec![0], vec![1], vec![2, 0]];
    let mut at_start = policy(&schedule, 0);
    assert_eq!(
        evicted_first(&mut at_start, &[0, 1, 2, 3]),
        vec![3, 2, 1, 0]
    );
    // Past step 0, value 0's next use is step 2, tied with value 2: registration
    // order breaks the tie.
    let mut after_first = policy(&schedule, 1);
    assert_eq!(
        evicted_first(&mut after_first, &[0, 1, 2, 3]),
        vec![3, 0, 2, 1]
    );
    // Past the schedule, nothing is used again: the tiered LRU's order.
    let mut past_end = policy(&schedule, 3);
    assert_eq!(
        evicted_first(&mut past_end, &[2, 0, 3, 1]),
        vec![0, 1, 2, 3]
    );
}

#[test]
fn priority_dominates_the_schedule() {
    let schedule = vec![vec![0], vec![1]];
    let mut keys = FastMap::default();
    // Value 0 is needed next, but has the lowest priority: it goes first.
    keys.insert(0, (-5, -1, None));
    let mut policy = ScheduleAware {
        lru: TieredLru {
            keys: std::sync::Arc::new(keys),
            tiers: std::collections::BTreeMap::default(),
        },
        next_use: ScheduleAware::next_uses(&schedule, 0),
    };
    assert_eq!(evicted_first(&mut policy, &[1, 0, 2]), vec![0, 2, 1]);
}

#[test]
fn fallback_tiers_are_the_tiered_lrus() {
    let mut tiers = std::collections::BTreeMap::new();
    tiers.insert(
        Location::Cuda(0),
        vec![Location::PinnedHost, Location::PageableHost],
    );
    let mut policy = ScheduleAware {
        lru: TieredLru {
            keys: std::sync::Arc::default(),
            tiers,
        },
        next_use: NextUses::default(),
    };
    assert_eq!(
        policy.fallback_locations(Location::Cuda(0)).expect("tiers"),
        vec![Location::PinnedHost, Location::PageableHost]
    );
    assert!(
        policy
            .fallback_locations(Location::PinnedHost)
            .expect("tiers")
            .is_empty()
    );
}

/// Misses of a cache of `capacity` equal-size values serving `requests`, evicting the
/// first candidate of the schedule-aware order (the requests are the schedule, one
/// value per step).
fn policy_misses(requests: &[usize], capacity: usize) -> usize {
    let schedule: Vec<Vec<usize>> = requests.iter().map(|&value| vec![value]).collect();
    let mut cached: Vec<usize> = Vec::new();
    let mut misses = 0;
    for (step, &value) in requests.iter().enumerate() {
        if cached.contains(&value) {
            continue;
        }
        misses += 1;
        if cached.len() == capacity {
            let mut policy = policy(&schedule, step);
            let victim = evicted_first(&mut policy, &cached)[0];
            cached.retain(|&kept| kept != victim);
        }
        cached.push(value);
    }
    misses
}

/// The fewest misses any eviction choices give, by exhaustive search over them.
fn fewest_misses(requests: &[usize], capacity: usize) -> usize {
    fn search(
        requests: &[usize],
        capacity: usize,
        step: usize,
        cached: u32,
        memo: &mut HashMap<(usize, u32), usize>,
    ) -> usize {
        let Some(&value) = requests.get(step) else {
            return 0;
        };
        if let Some(&known) = memo.get(&(step, cached)) {
            return known;
        }
        let bit = 1u32 << value;
        let best = if cached & bit != 0 {
            search(requests, capacity, step + 1, cached, memo)
        } else if (cached.count_ones() as usize) < capacity {
            1 + search(requests, capacity, step + 1, cached | bit, memo)
        } else {
            (0..32)
                .filter(|victim| cached & (1 << victim) != 0)
                .map(|victim| {
                    1 + search(
                        requests,
                        capacity,
                        step + 1,
                        (cached & !(1 << victim)) | bit,
                        memo,
                    )
                })
                .min()
                .unwrap_or(usize::MAX)
        };
        memo.insert((step, cached), best);
        best
    }
    search(requests, capacity, 0, 0, &mut HashMap::new())
}

/// Misses of the same cache serving `passes` passes of `one_pass`, evicting by a
/// cyclic index of one pass only, standing at each request's step within its pass.
fn cyclic_policy_misses(one_pass: &[usize], passes: usize, capacity: usize) -> usize {
    let schedule: Vec<Vec<usize>> = one_pass.iter().map(|&value| vec![value]).collect();
    let uses = NextUses::cyclic(&schedule);
    let mut cached: Vec<usize> = Vec::new();
    let mut misses = 0;
    for step in 0..passes * one_pass.len() {
        let value = one_pass[step % one_pass.len()];
        if cached.contains(&value) {
            continue;
        }
        misses += 1;
        if cached.len() == capacity {
            let mut policy = ScheduleAware {
                lru: TieredLru::default(),
                // The unrolled step: the index wraps it to the pass's own step.
                next_use: uses.at(step),
            };
            let victim = evicted_first(&mut policy, &cached)[0];
            cached.retain(|&kept| kept != victim);
        }
        cached.push(value);
    }
    misses
}

proptest! {
    /// A one-pass schedule indexed as cyclic and used for several passes misses as
    /// little as any choice of victims over the passes unrolled (ties among values
    /// that the last pass no longer needs cost nothing).
    #[test]
    fn a_cyclic_index_misses_the_fewest_possible_over_several_passes(
        one_pass in prop::collection::vec(0usize..6, 1..9),
        passes in 1usize..4,
        capacity in 1usize..5,
    ) {
        let requests: Vec<usize> = (0..passes).flat_map(|_| one_pass.iter().copied()).collect();
        prop_assert_eq!(
            cyclic_policy_misses(&one_pass, passes, capacity),
            fewest_misses(&requests, capacity)
        );
    }

    #[test]
    fn schedule_aware_misses_are_the_fewest_possible_on_random_schedules(
        requests in prop::collection::vec(0usize..6, 0..24),
        capacity in 1usize..5,
    ) {
        prop_assert_eq!(policy_misses(&requests, capacity), fewest_misses(&requests, capacity));
    }

    #[test]
    fn schedule_aware_misses_are_the_fewest_possible_on_cyclic_schedules(
        cycle in 2usize..7,
        passes in 1usize..5,
        capacity in 1usize..6,
    ) {
        let requests: Vec<usize> = (0..passes).flat_map(|_| 0..cycle).collect();
        let misses = policy_misses(&requests, capacity);
        prop_assert_eq!(misses, fewest_misses(&requests, capacity));
        // The cyclic order is LRU's worst case: once the cycle outgrows the cache, LRU
        // misses every request, while MIN keeps values across passes.
        if cycle > capacity {
            prop_assert_eq!(lru_misses(&requests, capacity), requests.len());
            if passes > 1 && capacity > 1 {
                prop_assert!(misses < requests.len());
            }
        }
    }
}

/// Misses of the same cache evicting the least recently used value.
fn lru_misses(requests: &[usize], capacity: usize) -> usize {
    let mut cached: Vec<usize> = Vec::new(); // least recently used first
    let mut misses = 0;
    for &value in requests {
        if let Some(position) = cached.iter().position(|&kept| kept == value) {
            cached.remove(position);
        } else {
            misses += 1;
            if cached.len() == capacity {
                cached.remove(0);
            }
        }
        cached.push(value);
    }
    misses
}

proptest! {
    /// A next use found by a binary search in the value's steps is the first step at
    /// or after the position that requests it, as a walk of the rest of the schedule
    /// finds it.
    #[test]
    fn next_uses_are_the_first_request_at_or_after_the_position(
        schedule in prop::collection::vec(prop::collection::vec(0usize..8, 0..4), 0..24),
        cursor in 0usize..28,
    ) {
        let uses = NextUses::new(&schedule).at(cursor);
        for position in 0..8 {
            let walked = schedule
                .iter()
                .enumerate()
                .skip(cursor)
                .find(|(_, step)| step.contains(&position))
                .map(|(step, _)| step as u64);
            prop_assert_eq!(uses.get(position), walked);
        }
        let mut listed: Vec<usize> = uses.positions().collect();
        listed.sort_unstable();
        let expected: Vec<usize> =
            (0..8).filter(|&position| uses.get(position).is_some()).collect();
        prop_assert_eq!(listed, expected);
    }

    /// In a cyclic schedule the position wraps (`len` is the next pass's step 0), and a
    /// next use is the first request at or after it in the schedule written out twice:
    /// a step of the next pass counts on from the length, so a farther use is a larger
    /// step across the wrap; a position no step requests is never used.
    #[test]
    fn cyclic_next_uses_are_the_first_request_in_two_passes(
        schedule in prop::collection::vec(prop::collection::vec(0usize..8, 0..4), 0..24),
        cursor in 0usize..50,
    ) {
        let uses = NextUses::cyclic(&schedule).at(cursor);
        prop_assert!(uses.is_cyclic() && !NextUses::new(&schedule).is_cyclic());
        let start = cursor.checked_rem(schedule.len()).unwrap_or(0);
        for position in 0..8 {
            let walked = schedule
                .iter()
                .chain(&schedule)
                .enumerate()
                .skip(start)
                .find(|(_, step)| step.contains(&position))
                .map(|(step, _)| step as u64);
            prop_assert_eq!(uses.get(position), walked);
        }
        let mut listed: Vec<usize> = uses.positions().collect();
        listed.sort_unstable();
        let requested: Vec<usize> = (0..8)
            .filter(|position| schedule.iter().any(|step| step.contains(position)))
            .collect();
        prop_assert_eq!(listed, requested);
    }
}

#[test]
fn a_cyclic_next_use_past_the_wrap_is_the_first_step_plus_the_length() {
    // Eight steps; value 1 only at step 2, value 0 at steps 0 and 6.
    let mut schedule = vec![Vec::new(); 8];
    schedule[2].push(1);
    schedule[0].push(0);
    schedule[6].push(0);
    let cyclic = NextUses::cyclic(&schedule).at(5);
    assert_eq!(
        (cyclic.get(1), cyclic.get(0), cyclic.get(7)),
        (Some(10), Some(6), None)
    );
    assert_eq!(cyclic.at(7).get(0), Some(8));
    assert_eq!(cyclic.at(8).get(1), Some(2)); // 8 is the next pass's step 0
    let once = NextUses::new(&schedule).at(5);
    assert_eq!((once.get(1), once.get(0)), (None, Some(6)));
    // Standing at 5, the farthest is value 1 (step 10), then value 0 (step 6); the
    // one-pass order puts value 1 first too, as never used again.
    let mut policy = ScheduleAware {
        lru: TieredLru::default(),
        next_use: cyclic.at(7),
    };
    // At step 7: value 0 next at 8, value 1 at 10: value 1 goes first.
    assert_eq!(evicted_first(&mut policy, &[0, 1]), vec![1, 0]);
}
