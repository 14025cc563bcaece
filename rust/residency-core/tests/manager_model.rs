//! Model-based tests of the manager core: random operation sequences against a small
//! reference model of materialisation sets and per-location charges.

#![allow(clippy::panic)] // Test assertions.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;
use residency_core::{
    CoreError, EnsurePlan, HandleId, Location, Manager, MovePlan, Recoverability, ReplicaMode,
    ValueSpec,
};

const LOCATIONS: [Location; 4] = [
    Location::PageableHost,
    Location::PinnedHost,
    Location::Cuda(0),
    Location::Cuda(1),
];

#[derive(Debug, Clone)]
enum Op {
    Adopt {
        at: usize,
        bytes: u64,
        exclusive: bool,
    },
    Register {
        at: usize,
        bytes: u64,
        exclusive: bool,
    },
    Ensure {
        value: usize,
        at: usize,
    },
    Move {
        value: usize,
        to: usize,
    },
    Drop {
        value: usize,
        at: usize,
    },
    Discard {
        value: usize,
    },
    Reserve {
        at: usize,
        bytes: u64,
    },
    ReleaseReservation {
        which: usize,
    },
    Acquire {
        value: usize,
        at: usize,
    },
    ReleaseLease {
        which: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let at = 0..LOCATIONS.len();
    prop_oneof![
        (at.clone(), 0..64u64, any::<bool>()).prop_map(|(at, bytes, exclusive)| Op::Adopt {
            at,
            bytes,
            exclusive
        }),
        (at.clone(), 0..64u64, any::<bool>()).prop_map(|(at, bytes, exclusive)| Op::Register {
            at,
            bytes,
            exclusive
        }),
        (0..8usize, at.clone()).prop_map(|(value, at)| Op::Ensure { value, at }),
        (0..8usize, at.clone()).prop_map(|(value, to)| Op::Move { value, to }),
        (0..8usize, at.clone()).prop_map(|(value, at)| Op::Drop { value, at }),
        (0..8usize).prop_map(|value| Op::Discard { value }),
        (at.clone(), 0..64u64).prop_map(|(at, bytes)| Op::Reserve { at, bytes }),
        (0..4usize).prop_map(|which| Op::ReleaseReservation { which }),
        (0..8usize, at).prop_map(|(value, at)| Op::Acquire { value, at }),
        (0..4usize).prop_map(|which| Op::ReleaseLease { which }),
    ]
}

/// The reference model: what must be true after each operation.
#[derive(Debug, Default)]
struct Model {
    values: Vec<ModelValue>,
    reserved: BTreeMap<Location, u64>,
    reservations: Vec<(u64, Location, u64)>,
    leases: Vec<(u64, HandleId, Location)>,
}

#[derive(Debug)]
struct ModelValue {
    handle: HandleId,
    charge: u64,
    exclusive: bool,
    has_source: bool,
    discarded: bool,
    at: BTreeSet<Location>,
    uses: BTreeMap<Location, u32>,
}

impl Model {
    fn used(&self, location: Location) -> u64 {
        self.values
            .iter()
            .filter(|value| value.at.contains(&location))
            .map(|value| value.charge)
            .sum()
    }

    fn fits(&self, budgets: &BTreeMap<Location, u64>, location: Location, incoming: u64) -> bool {
        budgets.get(&location).is_none_or(|&budget| {
            self.used(location) + self.reserved.get(&location).copied().unwrap_or(0) + incoming
                <= budget
        })
    }
}

fn spec(bytes: u64, exclusive: bool, reconstructible: bool) -> ValueSpec {
    ValueSpec::new(
        bytes,
        bytes,
        if exclusive {
            ReplicaMode::Exclusive
        } else {
            ReplicaMode::Replicable
        },
        if reconstructible {
            Recoverability::Reconstructible
        } else {
            Recoverability::MustPreserve
        },
    )
    .expect("equal byte counts are a valid spec")
}

/// Runs one op on both sides and checks that the outcome kinds agree.
#[allow(clippy::too_many_lines)]
fn apply(manager: &Manager, model: &mut Model, budgets: &BTreeMap<Location, u64>, op: &Op) {
    let version_before = manager.version();
    match *op {
        Op::Adopt {
            at,
            bytes,
            exclusive,
        } => {
            let location = LOCATIONS[at];
            let fits = model.fits(budgets, location, bytes);
            let result = manager.adopt(1, spec(bytes, exclusive, false), location, bytes, &[]);
            assert_eq!(result.is_ok(), fits, "adopt admission {result:?}");
            if let Ok((handle, _)) = result {
                model.values.push(ModelValue {
                    handle,
                    charge: bytes,
                    exclusive,
                    has_source: false,
                    discarded: false,
                    at: BTreeSet::from([location]),
                    uses: BTreeMap::new(),
                });
            } else {
                assert!(matches!(result, Err(CoreError::Budget { .. })));
            }
        }
        Op::Register {
            at,
            bytes,
            exclusive,
        } => {
            let (handle, _) = manager
                .register_source(1, spec(bytes, exclusive, true), LOCATIONS[at])
                .expect("registration never checks budgets");
            model.values.push(ModelValue {
                handle,
                charge: bytes,
                exclusive,
                has_source: true,
                discarded: false,
                at: BTreeSet::new(),
                uses: BTreeMap::new(),
            });
        }
        Op::Ensure { value, at } => {
            let Some(entry) = model.values.get_mut(value) else {
                return;
            };
            let location = LOCATIONS[at];
            let result = manager.plan_ensure(entry.handle, location);
            if entry.discarded {
                assert!(matches!(result, Err(CoreError::Handle { .. })));
                return;
            }
            match result {
                Ok(EnsurePlan::NoOp) => assert!(entry.at.contains(&location)),
                Ok(EnsurePlan::Copy { source }) => {
                    assert_eq!(Some(&source), entry.at.iter().next(), "canonical source");
                    assert!(!entry.exclusive);
                    manager
                        .install(
                            entry.handle,
                            location,
                            entry.charge,
                            entry.charge,
                            &[],
                            false,
                        )
                        .expect("admitted by plan_ensure");
                    entry.at.insert(location);
                }
                Ok(EnsurePlan::Reconstruct {
                    source_location: source,
                }) => {
                    assert!(entry.at.is_empty() && entry.has_source);
                    let handle = entry.handle;
                    let charge = entry.charge;
                    let installed = if source == location {
                        manager.release_temporary(handle, source).expect("charged");
                        manager.install(handle, location, charge, charge, &[], false)
                    } else {
                        let installed =
                            manager.install(handle, location, charge, charge, &[], false);
                        manager.release_temporary(handle, source).expect("charged");
                        installed
                    };
                    match installed {
                        Ok(()) => {
                            model.values[value].at.insert(location);
                        }
                        Err(CoreError::Budget { .. }) => {}
                        Err(other) => panic!("unexpected {other:?}"),
                    }
                }
                Err(CoreError::Ownership { .. }) => {
                    assert!(entry.exclusive && !entry.at.is_empty());
                }
                Err(CoreError::Budget {
                    location: refused, ..
                }) => {
                    // Either the destination, or the source location of a reconstruction.
                    assert!(!model.fits(budgets, refused, model.values[value].charge));
                }
                Err(other) => panic!("unexpected {other:?}"),
            }
        }
        Op::Move { value, to } => {
            let Some(entry) = model.values.get(value) else {
                return;
            };
            let location = LOCATIONS[to];
            let handle = entry.handle;
            let result = manager.plan_move(handle, location, None);
            if entry.discarded {
                assert!(matches!(result, Err(CoreError::Handle { .. })));
                return;
            }
            match result {
                Ok(MovePlan::NoOp { .. }) => {
                    assert!(entry.at.contains(&location));
                }
                Ok(MovePlan::RemovedSource { source }) => {
                    model.values[value].at.remove(&source);
                }
                Ok(MovePlan::Copy { source }) => {
                    let charge = entry.charge;
                    manager
                        .install(handle, location, charge, charge, &[], true)
                        .expect("admitted by plan_move");
                    manager.remove(handle, source).expect("checked removable");
                    let entry = &mut model.values[value];
                    entry.at.insert(location);
                    entry.at.remove(&source);
                }
                Ok(MovePlan::Reconstruct { source_location }) => {
                    // The glue's failure path: the load failed, the charge comes back.
                    manager
                        .release_temporary(handle, source_location)
                        .expect("charged by plan_move");
                }
                Err(CoreError::Budget { .. }) => {}
                Err(CoreError::InUse { .. }) => {
                    assert!(entry.uses.values().any(|&count| count > 0));
                }
                Err(CoreError::Unavailable { .. }) => {
                    assert!(entry.at.is_empty() && !entry.has_source);
                }
                Err(other) => panic!("unexpected {other:?}"),
            }
        }
        Op::Drop { value, at } => {
            let Some(entry) = model.values.get_mut(value) else {
                return;
            };
            let location = LOCATIONS[at];
            let result = manager.drop_materialization(entry.handle, location);
            if entry.discarded {
                assert!(matches!(result, Err(CoreError::Handle { .. })));
                return;
            }
            let protected = entry.uses.get(&location).copied().unwrap_or(0) > 0;
            match result {
                Ok(false) => assert!(!entry.at.contains(&location)),
                Ok(true) => {
                    assert!(!protected);
                    entry.at.remove(&location);
                }
                Err(CoreError::InUse { .. }) => assert!(protected),
                Err(CoreError::Ownership { .. }) => {
                    assert!(entry.at.len() == 1 && !entry.has_source);
                }
                Err(other) => panic!("unexpected {other:?}"),
            }
        }
        Op::Discard { value } => {
            let Some(entry) = model.values.get_mut(value) else {
                return;
            };
            let result = manager.discard(entry.handle);
            if entry.discarded {
                assert!(matches!(result, Err(CoreError::Handle { .. })));
                return;
            }
            match result {
                Ok(removed) => {
                    assert_eq!(removed.len(), entry.at.len());
                    entry.at.clear();
                    entry.discarded = true;
                    entry.has_source = false;
                }
                Err(CoreError::InUse { .. }) => {
                    assert!(entry.uses.values().any(|&count| count > 0));
                }
                Err(other) => panic!("unexpected {other:?}"),
            }
        }
        Op::Reserve { at, bytes } => {
            let location = LOCATIONS[at];
            let fits = model.fits(budgets, location, bytes);
            match manager.reserve(location, bytes, "model") {
                Ok(token) => {
                    assert!(fits);
                    *model.reserved.entry(location).or_default() += bytes;
                    model.reservations.push((token, location, bytes));
                }
                Err(CoreError::Budget { .. }) => assert!(!fits),
                Err(other) => panic!("unexpected {other:?}"),
            }
        }
        Op::ReleaseReservation { which } => {
            if which < model.reservations.len() {
                let (token, location, bytes) = model.reservations.remove(which);
                assert!(manager.release_reservation(token));
                assert!(!manager.release_reservation(token), "release is one-shot");
                *model.reserved.entry(location).or_default() -= bytes;
            }
        }
        Op::Acquire { value, at } => {
            let Some(entry) = model.values.get_mut(value) else {
                return;
            };
            let location = LOCATIONS[at];
            match manager.acquire(&[entry.handle], location) {
                Ok(token) => {
                    assert!(entry.at.contains(&location) && !entry.discarded);
                    *entry.uses.entry(location).or_default() += 1;
                    model.leases.push((token, entry.handle, location));
                }
                Err(CoreError::Unavailable { .. }) => assert!(!entry.at.contains(&location)),
                Err(CoreError::Handle { .. }) => assert!(entry.discarded),
                Err(other) => panic!("unexpected {other:?}"),
            }
        }
        Op::ReleaseLease { which } => {
            if which < model.leases.len() {
                let (token, handle, location) = model.leases.remove(which);
                assert!(manager.release_lease(token));
                let entry = model
                    .values
                    .iter_mut()
                    .find(|entry| entry.handle == handle)
                    .expect("leased value is modelled");
                *entry.uses.entry(location).or_default() -= 1;
            }
        }
    }
    assert!(
        manager.version() >= version_before,
        "the version never decreases"
    );
}

fn check(manager: &Manager, model: &Model) {
    manager.check_books().expect("books balance");
    let state = manager.current();
    for books in &state.locations {
        assert_eq!(
            books.used_bytes,
            model.used(books.location),
            "{}",
            books.location
        );
        assert_eq!(
            books.reserved_bytes,
            model.reserved.get(&books.location).copied().unwrap_or(0),
            "{}",
            books.location
        );
    }
    for entry in &model.values {
        let record = state.record(entry.handle).expect("issued");
        let at: BTreeSet<Location> = record
            .materializations
            .iter()
            .map(|materialization| materialization.location)
            .collect();
        assert_eq!(at, entry.at);
        assert_eq!(record.discarded, entry.discarded);
        if entry.exclusive {
            assert!(at.len() <= 1, "EXCLUSIVE value replicated");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_books_balanced_and_match_the_model(
        budget_pageable in prop::option::of(0..160u64),
        budget_cuda in prop::option::of(0..160u64),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut budgets = BTreeMap::new();
        if let Some(budget) = budget_pageable {
            budgets.insert(Location::PageableHost, budget);
        }
        if let Some(budget) = budget_cuda {
            budgets.insert(Location::Cuda(0), budget);
        }
        let list: Vec<(Location, u64)> = budgets.iter().map(|(&l, &b)| (l, b)).collect();
        let manager = Manager::new(&list);
        manager.enter(Duration::from_millis(10), true, true).expect("fresh manager");
        let mut model = Model::default();
        for op in &ops {
            apply(&manager, &mut model, &budgets, op);
            check(&manager, &model);
        }
        manager.exit();
    }
}

#[test]
fn version_steps_follow_the_documented_rules_for_a_simple_sequence() {
    let manager = Manager::new(&[(Location::PageableHost, 1_000)]);
    assert_eq!(manager.version(), 0, "budgeted registration does not count");
    let (value, _) = manager
        .adopt(1, spec(8, false, false), Location::PageableHost, 8, &[])
        .expect("fits");
    assert_eq!(manager.version(), 1, "install only: the location was known");
    let (_, _) = manager
        .register_source(1, spec(8, true, true), Location::PinnedHost)
        .expect("registers");
    assert_eq!(manager.version(), 3, "new location + record");
    manager
        .install(value, Location::Cuda(0), 8, 8, &[], false)
        .expect("replicable");
    assert_eq!(manager.version(), 5, "new location + install");
    assert!(
        manager
            .drop_materialization(value, Location::Cuda(0))
            .expect("droppable")
    );
    assert_eq!(manager.version(), 6);
    let token = manager
        .reserve(Location::Cuda(0), 4, "w")
        .expect("unbudgeted");
    assert_eq!(manager.version(), 7);
    assert!(manager.release_reservation(token));
    assert_eq!(manager.version(), 8);
    let removed = manager.discard(value).expect("unprotected");
    assert_eq!(removed, vec![Location::PageableHost]);
    assert_eq!(manager.version(), 10, "one removal + the discard mark");
}

#[test]
fn failed_adopt_leaves_nothing_behind() {
    let manager = Manager::new(&[(Location::PageableHost, 10)]);
    let (first, _) = manager
        .adopt(
            1,
            spec(8, true, false),
            Location::PageableHost,
            8,
            &[(-1, 0x1000)],
        )
        .expect("fits");
    let before = manager.current();
    let over = manager.adopt(1, spec(4, true, false), Location::PageableHost, 4, &[]);
    assert!(matches!(
        over,
        Err(CoreError::Budget {
            budget_bytes: 10,
            used_bytes: 8,
            reserved_bytes: 0,
            requested_bytes: 4,
            ..
        })
    ));
    let alias = manager.adopt(
        1,
        spec(0, true, false),
        Location::Cuda(0),
        0,
        &[(-1, 0x1000)],
    );
    assert!(
        matches!(alias, Err(CoreError::Ownership { .. })),
        "{alias:?}"
    );
    let after = manager.current();
    assert_eq!(after.version, before.version);
    assert_eq!(after.values.len(), before.values.len());
    assert_eq!(
        after.locations.len(),
        before.locations.len(),
        "no location registered"
    );
    assert!(
        manager
            .drop_materialization(first, Location::PageableHost)
            .is_err()
    );
}

#[test]
fn temporary_charge_raises_peak_without_a_version_step_and_is_returned() {
    let manager = Manager::new(&[(Location::PageableHost, 100)]);
    let (value, _) = manager
        .register_source(1, spec(60, true, true), Location::PageableHost)
        .expect("registers");
    let version = manager.version();
    let source = manager.charge_temporary(value).expect("fits");
    assert_eq!(source, Location::PageableHost);
    let books = manager.current().books(Location::PageableHost);
    assert_eq!((books.reserved_bytes, books.peak_charged_bytes), (60, 60));
    assert_eq!(manager.version(), version);
    assert!(matches!(
        manager.charge_temporary(value),
        Err(CoreError::Budget {
            requested_bytes: 60,
            reserved_bytes: 60,
            ..
        })
    ));
    manager.release_temporary(value, source).expect("charged");
    let books = manager.current().books(Location::PageableHost);
    assert_eq!((books.reserved_bytes, books.peak_charged_bytes), (0, 60));
    assert_eq!(
        books.peak_used_bytes, 0,
        "temporary charges are not materialisations"
    );
}

#[test]
fn protected_materialisations_cannot_be_removed_and_discard_changes_nothing() {
    let manager = Manager::new(&[]);
    let (value, _) = manager
        .adopt(1, spec(8, false, false), Location::PageableHost, 8, &[])
        .expect("adopts");
    manager
        .install(value, Location::PinnedHost, 8, 8, &[], false)
        .expect("replicable");
    let lease = manager
        .acquire(&[value], Location::PinnedHost)
        .expect("resident");
    let hold = manager
        .hold(&[value], Location::PinnedHost)
        .expect("resident");
    let version = manager.version();
    match manager.discard(value) {
        Err(CoreError::InUse {
            active_reads: 1,
            holds: 1,
            pending_events: 0,
            location: Some(Location::PinnedHost),
            ..
        }) => {}
        other => panic!("expected a protected discard, got {other:?}"),
    }
    assert_eq!(
        manager.version(),
        version,
        "a refused discard changes nothing"
    );
    assert!(manager.lease_to_pending(lease));
    assert!(
        !manager.release_lease(lease),
        "a pending lease is not active"
    );
    assert!(manager.release_hold(hold));
    assert!(matches!(
        manager.drop_materialization(value, Location::PinnedHost),
        Err(CoreError::InUse {
            pending_events: 1,
            ..
        })
    ));
    assert_eq!(manager.pending_lease_tokens(), vec![lease]);
    assert!(manager.release_pending(lease));
    assert!(
        manager
            .drop_materialization(value, Location::PinnedHost)
            .expect("free")
    );
    manager.check_books().expect("balanced");
}

#[test]
fn close_refuses_open_lifetimes_unless_forced_and_keeps_peaks() {
    let manager = Manager::new(&[(Location::PageableHost, 64)]);
    manager
        .adopt(1, spec(8, true, false), Location::PageableHost, 8, &[])
        .expect("adopts");
    let token = manager
        .reserve(Location::PageableHost, 16, "w")
        .expect("fits");
    assert!(matches!(manager.close(false), Err(CoreError::InUse { .. })));
    assert!(!manager.is_closed());
    assert!(manager.release_reservation(token));
    manager.close(false).expect("nothing open");
    assert!(manager.is_closed());
    let books = manager.current().books(Location::PageableHost);
    assert_eq!((books.used_bytes, books.reserved_bytes), (0, 0));
    assert_eq!((books.peak_used_bytes, books.peak_charged_bytes), (8, 24));
    assert_eq!(books.budget_bytes, Some(64));
    manager.close(true).expect("closing twice is silent");
}
