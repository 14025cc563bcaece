//! Model-based tests of the manager core: random operation sequences against a small
//! reference model of materialisation sets and per-location charges.

#![allow(clippy::panic)] // Test assertions.

mod common;

use common::spec;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;
use residency_core::{
    Begun, Committed, CoreError, CoreResult, HandleId, Landed, Location, Manager, Ticket, Work,
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
        asynchronous: bool,
        fault: Fault,
    },
    Move {
        value: usize,
        to: usize,
        fault: Fault,
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
    /// A copy left in flight completed: its pending leases are released.
    Complete {
        which: usize,
    },
}

/// Where the glue's part of a transition fails, if it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// The copy or the source's `load()` raised after begin.
    DeviceWork,
    /// The value measured above its charge: the ticket's byte check refuses it.
    Oversized,
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        3 => Just(Fault::None),
        1 => Just(Fault::DeviceWork),
        1 => Just(Fault::Oversized),
    ]
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
        (0..8usize, at.clone(), any::<bool>(), fault()).prop_map(
            |(value, at, asynchronous, fault)| Op::Ensure {
                value,
                at,
                asynchronous,
                fault
            }
        ),
        (0..8usize, at.clone(), fault()).prop_map(|(value, to, fault)| Op::Move {
            value,
            to,
            fault
        }),
        (0..8usize, at.clone()).prop_map(|(value, at)| Op::Drop { value, at }),
        (0..8usize).prop_map(|value| Op::Discard { value }),
        (at.clone(), 0..64u64).prop_map(|(at, bytes)| Op::Reserve { at, bytes }),
        (0..4usize).prop_map(|which| Op::ReleaseReservation { which }),
        (0..8usize, at).prop_map(|(value, at)| Op::Acquire { value, at }),
        (0..4usize).prop_map(|which| Op::ReleaseLease { which }),
        (0..4usize).prop_map(|which| Op::Complete { which }),
    ]
}

/// The reference model: what must be true after each operation.
#[derive(Debug, Default)]
struct Model {
    values: Vec<ModelValue>,
    reserved: BTreeMap<Location, u64>,
    reservations: Vec<(u64, Location, u64)>,
    leases: Vec<(u64, HandleId, Location)>,
    /// Pending leases protecting copies left in flight.
    in_flight: Vec<(u64, HandleId, Location)>,
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
        Op::Ensure {
            value,
            at,
            asynchronous,
            fault,
        } => {
            let Some(entry) = model.values.get(value) else {
                return;
            };
            let location = LOCATIONS[at];
            let (handle, charge) = (entry.handle, entry.charge);
            let result = manager.begin_ensure(handle, location, asynchronous);
            if entry.discarded {
                assert!(matches!(result, Err(CoreError::Handle { .. })));
                return;
            }
            match result {
                Ok(Begun::NoOp { source }) => {
                    assert!(entry.at.contains(&location) && source.is_none());
                }
                Ok(Begun::Ticket(ticket)) => {
                    match ticket.work() {
                        Work::Copy { from, in_flight } => {
                            assert_eq!(Some(&from), entry.at.iter().next(), "canonical source");
                            assert!(!entry.exclusive);
                            assert_eq!(
                                in_flight,
                                asynchronous && matches!(location, Location::Cuda(_))
                            );
                        }
                        Work::Load { .. } => assert!(entry.at.is_empty() && entry.has_source),
                        other => panic!("an ensure begun at {other:?}"),
                    }
                    let read = match ticket.work() {
                        Work::Copy { from, .. } => Some(from),
                        _ => None,
                    };
                    let copied = glue(manager, ticket, charge, fault);
                    settled(model, budgets, (value, location, read), fault, copied);
                }
                Err(CoreError::Ownership { .. }) => {
                    assert!(entry.exclusive && !entry.at.is_empty());
                }
                Err(CoreError::Budget {
                    location: refused, ..
                }) => {
                    // Either the destination, or the source location of a reconstruction.
                    assert!(!model.fits(budgets, refused, charge));
                }
                Err(other) => panic!("unexpected {other:?}"),
            }
        }
        Op::Move { value, to, fault } => {
            let Some(entry) = model.values.get(value) else {
                return;
            };
            let location = LOCATIONS[to];
            let (handle, charge) = (entry.handle, entry.charge);
            let result = manager.begin_move(handle, location, None);
            if entry.discarded {
                assert!(matches!(result, Err(CoreError::Handle { .. })));
                return;
            }
            match result {
                Ok(Begun::NoOp { source }) => {
                    assert!(entry.at.contains(&location) && source.is_none());
                }
                Ok(Begun::Ticket(ticket)) => {
                    match ticket.work() {
                        Work::Remove => {
                            assert!(entry.at.contains(&location));
                            assert_ne!(ticket.source(), location);
                        }
                        Work::Copy { from, in_flight } => {
                            assert!(!entry.at.contains(&location) && entry.at.contains(&from));
                            assert!(!in_flight, "a move's copy is never left in flight");
                        }
                        Work::Load { .. } => assert!(entry.at.is_empty() && entry.has_source),
                        Work::Install => panic!("a move begun at its install"),
                    }
                    let moved = glue(manager, ticket, charge, fault);
                    settled(model, budgets, (value, location, None), fault, moved);
                }
                Err(CoreError::Budget {
                    location: refused, ..
                }) => {
                    assert!(!model.fits(budgets, refused, charge));
                }
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
        Op::Complete { which } => {
            if which < model.in_flight.len() {
                let (token, handle, location) = model.in_flight.remove(which);
                assert!(manager.release_pending(token));
                assert!(!manager.release_pending(token), "release is one-shot");
                let entry = model
                    .values
                    .iter_mut()
                    .find(|entry| entry.handle == handle)
                    .expect("protected value is modelled");
                *entry.uses.entry(location).or_default() -= 1;
            }
        }
    }
    assert!(
        manager.version() >= version_before,
        "the version never decreases"
    );
}

/// The glue's part of a transition, as the binding does it through the core's ticket
/// API: the ticket's device work (here it "copies" or "loads" by measuring `charge`
/// bytes, or fails as `fault` says), then commit, or abort at the first failure.
fn glue(manager: &Manager, mut ticket: Ticket, charge: u64, fault: Fault) -> CoreResult<Committed> {
    let measured = if fault == Fault::Oversized {
        charge + 1
    } else {
        charge
    };
    let failed = || CoreError::Internal {
        message: "the device work failed".to_owned(),
    };
    loop {
        match ticket.work() {
            Work::Remove => return common::commit(manager, ticket, None),
            Work::Load { .. } | Work::Copy { .. } if fault == Fault::DeviceWork => {
                manager.abort(ticket)?;
                return Err(failed());
            }
            Work::Load { .. } => {
                if let Err(refused) = manager.loaded(&mut ticket, charge, measured) {
                    manager.abort(ticket)?;
                    return Err(refused);
                }
            }
            Work::Copy { .. } | Work::Install => {
                let landed = Landed {
                    logical_nbytes: charge,
                    storage_nbytes: measured,
                    keys: &[],
                };
                return common::commit(manager, ticket, Some(landed));
            }
        }
    }
}

/// Applies a transition of `value` to `location` (copying from `read`, if it copies a
/// materialisation) to the model: a commit installs at `location`, removes what the
/// ticket says and protects a copy left in flight and its source; any failure,
/// wherever the glue stopped, leaves the model (and so the books) as they were.
fn settled(
    model: &mut Model,
    budgets: &BTreeMap<Location, u64>,
    (value, location, read): (usize, Location, Option<Location>),
    fault: Fault,
    outcome: CoreResult<Committed>,
) {
    let charge = model.values[value].charge;
    match outcome {
        Ok(committed) => {
            let entry = &mut model.values[value];
            let installed = entry.at.insert(location);
            assert!(
                fault == Fault::None || (!installed && committed.removed.is_some()),
                "{fault:?} committed {committed:?}"
            );
            if let Some(removed) = committed.removed {
                assert!(entry.at.remove(&removed));
            }
            let handle = entry.handle;
            if let Some(token) = committed.in_flight {
                *entry.uses.entry(location).or_default() += 1;
                model.in_flight.push((token, handle, location));
            }
            if let Some(token) = committed.read {
                let read = read.expect("only a copy of a materialisation reads one");
                *entry.uses.entry(read).or_default() += 1;
                model.in_flight.push((token, handle, read));
            }
        }
        Err(CoreError::Internal { .. }) => assert_eq!(fault, Fault::DeviceWork),
        Err(CoreError::Materialization { .. }) => assert_eq!(fault, Fault::Oversized),
        // A reconstruction loaded elsewhere admits the destination after the load.
        Err(CoreError::Budget {
            location: refused, ..
        }) => assert!(!model.fits(budgets, refused, charge)),
        Err(other) => panic!("unexpected {other:?}"),
    }
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
    let Ok(Begun::Ticket(ticket)) = manager.begin_ensure(value, Location::PinnedHost, false) else {
        panic!("expected a reconstruction ticket");
    };
    assert_eq!(ticket.temporary(), Some(Location::PageableHost));
    let books = manager.current().books(Location::PageableHost);
    assert_eq!((books.reserved_bytes, books.peak_charged_bytes), (60, 60));
    assert_eq!(manager.version(), version);
    assert!(matches!(
        manager.begin_ensure(value, Location::PinnedHost, false),
        Err(CoreError::Budget {
            requested_bytes: 60,
            reserved_bytes: 60,
            ..
        })
    ));
    manager.abort(ticket).expect("charged");
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
