//! Transition tickets: every point where a transition can stop (begin refused, the
//! device work failed after begin, commit refused) leaves exactly the books, records,
//! protections and version it found; and a committed ticket installs, removes and
//! protects what docs/concepts/transitions.md says.

#![allow(clippy::panic)] // Test assertions.

mod common;

use common::{accounts, books, spec};

use residency_core::{
    Begun, Committed, CoreError, Freed, HandleId, InFlight, Landed, Location, Manager, Ticket,
    Work, charge_of,
};

const HOST: Location = Location::PageableHost;
const PINNED: Location = Location::PinnedHost;
const CUDA: Location = Location::Cuda(0);

fn issued(begun: Begun) -> Ticket {
    match begun {
        Begun::Ticket(ticket) => ticket,
        Begun::NoOp { source } => panic!("expected a ticket, got a no-op from {source:?}"),
    }
}

fn landed(bytes: u64) -> Landed<'static> {
    Landed {
        logical_nbytes: bytes,
        storage_nbytes: bytes,
        keys: &[],
    }
}

fn adopted(manager: &Manager, bytes: u64, exclusive: bool, at: Location) -> HandleId {
    manager
        .adopt(1, spec(bytes, exclusive, false), at, bytes, &[])
        .expect("adopts")
        .0
}

fn registered(manager: &Manager, bytes: u64, exclusive: bool, at: Location) -> HandleId {
    manager
        .register_source(1, spec(bytes, exclusive, true), at)
        .expect("registers")
        .0
}

// ----- begin refused ------------------------------------------------------------

#[test]
fn a_refused_begin_changes_nothing() {
    let manager = Manager::new(&[(HOST, 100), (CUDA, 10)]);
    let replicable = adopted(&manager, 16, false, HOST);
    let exclusive = adopted(&manager, 8, true, HOST);
    let source_only = registered(&manager, 80, false, HOST);
    let lease = manager.acquire(&[replicable], HOST).expect("resident");
    let before = accounts(&manager);
    let peaks = books(&manager, HOST).peak_charged_bytes;

    // The destination budget, before anything is copied.
    assert!(matches!(
        manager.begin_ensure(replicable, CUDA, false),
        Err(CoreError::Budget {
            location: CUDA,
            requested_bytes: 16,
            ..
        })
    ));
    // The exclusive rule.
    assert!(matches!(
        manager.begin_ensure(exclusive, PINNED, false),
        Err(CoreError::Ownership { .. })
    ));
    // A protected source, before anything is copied.
    assert!(matches!(
        manager.begin_move(replicable, PINNED, None),
        Err(CoreError::InUse {
            location: Some(HOST),
            active_reads: 1,
            ..
        })
    ));
    // The temporary charge of a reconstruction: 16 + 8 + 80 > 100.
    assert!(matches!(
        manager.begin_ensure(source_only, PINNED, false),
        Err(CoreError::Budget {
            location: HOST,
            requested_bytes: 80,
            ..
        })
    ));
    // An explicit source that is not resident.
    assert!(matches!(
        manager.begin_move(replicable, CUDA, Some(PINNED)),
        Err(CoreError::Unavailable { .. })
    ));
    assert_eq!(accounts(&manager), before);
    assert_eq!(books(&manager, HOST).peak_charged_bytes, peaks);

    // A value with nothing to copy from and no source.
    manager.release_lease(lease);
    let gone = adopted(&manager, 4, false, PINNED);
    manager.discard(gone).expect("unprotected");
    let before = accounts(&manager);
    assert!(matches!(
        manager.begin_ensure(gone, HOST, false),
        Err(CoreError::Handle { .. })
    ));
    assert_eq!(accounts(&manager), before);
}

#[test]
fn no_ops_hold_nothing() {
    let manager = Manager::new(&[]);
    let value = adopted(&manager, 8, false, HOST);
    manager
        .install(value, PINNED, 8, 8, &[], false)
        .expect("replicable");
    let before = accounts(&manager);
    assert!(matches!(
        manager.begin_ensure(value, PINNED, true),
        Ok(Begun::NoOp { source: None })
    ));
    assert!(matches!(
        manager.begin_move(value, PINNED, Some(PINNED)),
        Ok(Begun::NoOp {
            source: Some(PINNED)
        })
    ));
    let only = adopted(&manager, 8, true, CUDA);
    let before_only = accounts(&manager);
    assert!(matches!(
        manager.begin_move(only, CUDA, None),
        Ok(Begun::NoOp { source: None })
    ));
    assert_eq!(accounts(&manager), before_only);
    assert_eq!(before.version + 2, before_only.version);
}

// ----- the device work failed after begin ---------------------------------------

#[test]
fn a_failed_copy_aborts_to_the_books_before_begin() {
    let manager = Manager::new(&[(CUDA, 64)]);
    let value = adopted(&manager, 24, false, HOST);
    let before = accounts(&manager);
    let ticket = issued(manager.begin_ensure(value, CUDA, false).expect("fits"));
    assert_eq!(
        ticket.work(),
        Work::Copy {
            from: HOST,
            in_flight: false
        }
    );
    assert_eq!(ticket.source(), HOST);
    // The copy raised: nothing was measured, the ticket is abandoned.
    manager.abort(ticket).expect("aborts");
    assert_eq!(accounts(&manager), before);

    let moving = issued(manager.begin_move(value, CUDA, None).expect("fits"));
    manager.abort(moving).expect("aborts");
    assert_eq!(accounts(&manager), before, "a move keeps its source");
}

#[test]
fn a_failed_load_returns_the_temporary_charge_and_keeps_the_peak() {
    let manager = Manager::new(&[(HOST, 100), (CUDA, 100)]);
    let value = registered(&manager, 60, false, HOST);
    let before = accounts(&manager);
    let version = manager.version();
    for moving in [false, true] {
        let begun = if moving {
            manager.begin_move(value, CUDA, None)
        } else {
            manager.begin_ensure(value, CUDA, false)
        };
        let ticket = issued(begun.expect("fits"));
        assert_eq!(
            ticket.work(),
            Work::Load {
                into: HOST,
                deferrable: false
            }
        );
        assert_eq!(ticket.temporary(), Some(HOST));
        let held = books(&manager, HOST);
        assert_eq!((held.reserved_bytes, held.peak_charged_bytes), (60, 60));
        assert_eq!(
            manager.version(),
            version,
            "a temporary charge takes no step"
        );
        // A second reconstruction meanwhile would not fit beside the charge.
        assert!(matches!(
            manager.begin_ensure(value, PINNED, false),
            Err(CoreError::Budget {
                reserved_bytes: 60,
                requested_bytes: 60,
                ..
            })
        ));
        // `load()` raised.
        manager.abort(ticket).expect("aborts");
        assert_eq!(accounts(&manager), before);
        let after = books(&manager, HOST);
        assert_eq!(
            (
                after.reserved_bytes,
                after.peak_charged_bytes,
                after.peak_used_bytes
            ),
            (0, 60, 0),
            "the raised peak stays; temporary charges are not materialisations"
        );
    }
}

#[test]
fn a_refused_load_measurement_aborts_cleanly() {
    // Loaded elsewhere than the destination: the bytes are checked and the
    // destination admitted before the copy; either refusal leaves the ticket to abort.
    let manager = Manager::new(&[(HOST, 100), (CUDA, 50)]);
    let value = registered(&manager, 40, false, HOST);
    let before = accounts(&manager);
    let mut oversized = issued(manager.begin_ensure(value, CUDA, false).expect("fits"));
    assert!(matches!(
        manager.loaded(&mut oversized, 40, 41),
        Err(CoreError::Materialization { .. })
    ));
    assert_eq!(oversized.temporary(), Some(HOST), "still held until abort");
    manager.abort(oversized).expect("aborts");
    assert_eq!(accounts(&manager), before);

    let mut crowded = issued(manager.begin_ensure(value, CUDA, false).expect("fits"));
    // The destination filled up while `load()` ran (it may release and reserve).
    let reservation = manager.reserve(CUDA, 20, "meanwhile").expect("fits");
    let before_refusal = accounts(&manager);
    assert!(matches!(
        manager.loaded(&mut crowded, 40, 40),
        Err(CoreError::Budget { location: CUDA, .. })
    ));
    assert_eq!(
        accounts(&manager),
        before_refusal,
        "a refused report changes nothing"
    );
    manager.abort(crowded).expect("aborts");
    assert!(manager.release_reservation(reservation));
    let mut after = accounts(&manager);
    after.version -= 2;
    assert_eq!(after, before);
}

// ----- commit refused -----------------------------------------------------------

#[test]
fn a_refused_commit_undoes_everything() {
    let manager = Manager::new(&[(HOST, 100), (CUDA, 100)]);
    let value = adopted(&manager, 32, true, HOST);
    let other = adopted(&manager, 8, false, PINNED);
    manager
        .install(other, CUDA, 8, 8, &[(0, 0xA000)], false)
        .expect("replicable");
    let before = accounts(&manager);

    // Measured above its charge: nothing installed, the source kept.
    let moving = issued(manager.begin_move(value, CUDA, None).expect("fits"));
    let over = Landed {
        logical_nbytes: 32,
        storage_nbytes: 33,
        keys: &[],
    };
    assert!(matches!(
        common::commit(&manager, moving, Some(over)),
        Err(CoreError::Materialization { .. })
    ));
    assert_eq!(accounts(&manager), before);

    // The copy aliases managed storage.
    let moving = issued(manager.begin_move(value, CUDA, None).expect("fits"));
    let alias = Landed {
        logical_nbytes: 32,
        storage_nbytes: 32,
        keys: &[(0, 0xA000)],
    };
    assert!(matches!(
        common::commit(&manager, moving, Some(alias)),
        Err(CoreError::Ownership { .. })
    ));
    assert_eq!(accounts(&manager), before);

    // The source became protected during the copy: refused before the install.
    let moving = issued(manager.begin_move(value, CUDA, None).expect("fits"));
    let hold = manager.hold(&[value], HOST).expect("resident");
    let protected = accounts(&manager);
    assert!(matches!(
        common::commit(&manager, moving, Some(landed(32))),
        Err(CoreError::InUse { holds: 1, .. })
    ));
    assert_eq!(accounts(&manager), protected);
    assert!(manager.release_hold(hold));

    // The destination filled up during the copy.
    let copying = issued(manager.begin_move(value, CUDA, None).expect("fits"));
    let reservation = manager.reserve(CUDA, 80, "meanwhile").expect("fits");
    let reserved = accounts(&manager);
    assert!(matches!(
        common::commit(&manager, copying, Some(landed(32))),
        Err(CoreError::Budget { .. })
    ));
    assert_eq!(accounts(&manager), reserved);
    assert!(manager.release_reservation(reservation));
}

#[test]
fn a_refused_commit_returns_the_temporary_charge() {
    let manager = Manager::new(&[(HOST, 100), (CUDA, 100)]);
    let value = registered(&manager, 30, false, HOST);
    let before = accounts(&manager);
    // Loaded elsewhere, copied, and the copy measured above the charge.
    let mut copying = issued(manager.begin_ensure(value, CUDA, false).expect("fits"));
    let next = manager.loaded(&mut copying, 30, 30).expect("in place");
    assert_eq!(
        next,
        Work::Copy {
            from: HOST,
            in_flight: false
        }
    );
    let over = Landed {
        logical_nbytes: 30,
        storage_nbytes: 31,
        keys: &[],
    };
    assert!(matches!(
        common::commit(&manager, copying, Some(over)),
        Err(CoreError::Materialization { .. })
    ));
    assert_eq!(accounts(&manager), before);

    // Loaded at the destination: the install pays the one charge, and its byte check
    // refuses the commit.
    let mut here = issued(manager.begin_ensure(value, HOST, false).expect("fits"));
    assert_eq!(
        manager.loaded(&mut here, 30, 31).expect("next"),
        Work::Install
    );
    assert_eq!(here.temporary(), None, "returned before the install");
    assert!(matches!(
        common::commit(&manager, here, Some(over)),
        Err(CoreError::Materialization { .. })
    ));
    assert_eq!(accounts(&manager), before);

    // Committing a load that never happened is refused, and still undoes the charge.
    let unloaded = issued(manager.begin_ensure(value, CUDA, false).expect("fits"));
    assert!(matches!(
        common::commit(&manager, unloaded, Some(landed(30))),
        Err(CoreError::Internal { .. })
    ));
    assert_eq!(accounts(&manager), before);
}

// ----- commits ------------------------------------------------------------------

#[test]
fn a_move_installs_then_removes_its_source() {
    let manager = Manager::new(&[(CUDA, 32)]);
    let value = adopted(&manager, 32, true, HOST);
    let version = manager.version();
    let moving = issued(manager.begin_move(value, CUDA, None).expect("fits"));
    assert_eq!(moving.source(), HOST);
    let committed = common::commit(&manager, moving, Some(landed(32))).expect("commits");
    assert_eq!(
        committed,
        Committed {
            removed: Some(HOST),
            in_flight: None,
            read: None
        }
    );
    assert_eq!(
        manager.materialization_locations(value).expect("issued"),
        [CUDA]
    );
    assert_eq!(manager.version(), version + 2, "one install, one removal");
    assert_eq!(books(&manager, HOST).used_bytes, 0);
    assert_eq!(books(&manager, CUDA).used_bytes, 32);
}

#[test]
fn a_move_onto_a_replica_only_removes_the_source() {
    let manager = Manager::new(&[]);
    let value = adopted(&manager, 8, false, HOST);
    manager
        .install(value, CUDA, 8, 8, &[], false)
        .expect("replicable");
    let lease = manager.acquire(&[value], HOST).expect("resident");
    assert!(matches!(
        manager.begin_move(value, CUDA, None),
        Err(CoreError::InUse { .. })
    ));
    assert!(manager.release_lease(lease));
    let version = manager.version();
    let removing = issued(manager.begin_move(value, CUDA, None).expect("removable"));
    assert_eq!(removing.work(), Work::Remove);
    assert_eq!(manager.version(), version, "begin removes nothing");
    let committed = common::commit(&manager, removing, None).expect("commits");
    assert_eq!(committed.removed, Some(HOST));
    assert_eq!(
        manager.materialization_locations(value).expect("issued"),
        [CUDA]
    );
    assert_eq!(manager.version(), version + 1);
}

#[test]
fn a_reconstruction_loaded_at_its_destination_pays_one_charge() {
    // The budget fits one charge: the temporary charge goes before the install.
    let manager = Manager::new(&[(HOST, 50)]);
    let value = registered(&manager, 50, true, HOST);
    let version = manager.version();
    let mut moving = issued(manager.begin_move(value, HOST, None).expect("fits"));
    assert_eq!(
        manager.loaded(&mut moving, 50, 50).expect("next"),
        Work::Install
    );
    let committed = common::commit(&manager, moving, Some(landed(50))).expect("one charge");
    assert_eq!(committed, Committed::default(), "nothing removed after");
    let host = books(&manager, HOST);
    assert_eq!(
        (
            host.used_bytes,
            host.reserved_bytes,
            host.peak_charged_bytes
        ),
        (50, 0, 50)
    );
    assert_eq!(manager.version(), version + 1);
}

#[test]
fn a_copy_left_in_flight_is_protected_by_pending_leases() {
    let manager = Manager::new(&[(CUDA, 100)]);
    let value = adopted(&manager, 16, false, PINNED);
    // Only an ensure's copy to CUDA in an asynchronous plan stays in flight.
    let host = issued(manager.begin_ensure(value, HOST, true).expect("fits"));
    assert_eq!(
        host.work(),
        Work::Copy {
            from: PINNED,
            in_flight: false
        }
    );
    manager.abort(host).expect("aborts");
    let version = manager.version();
    let copying = issued(manager.begin_ensure(value, CUDA, true).expect("fits"));
    assert_eq!(
        copying.work(),
        Work::Copy {
            from: PINNED,
            in_flight: true
        }
    );
    let committed = common::commit(&manager, copying, Some(landed(16))).expect("commits");
    let (Some(destination), Some(read)) = (committed.in_flight, committed.read) else {
        panic!("expected two pending leases, got {committed:?}");
    };
    assert_eq!(committed.removed, None);
    assert_eq!(manager.pending_lease_tokens(), vec![destination, read]);
    assert_eq!(
        manager.pending_lease_values(destination),
        Some((vec![value], CUDA))
    );
    assert_eq!(
        manager.pending_lease_values(read),
        Some((vec![value], PINNED))
    );
    assert_eq!(
        manager.version(),
        version + 5,
        "the install, and an acquire and a release on a stream per lease"
    );
    for at in [CUDA, PINNED] {
        assert!(matches!(
            manager.drop_materialization(value, at),
            Err(CoreError::InUse {
                pending_events: 1,
                ..
            })
        ));
    }
    assert!(manager.release_pending(destination));
    assert!(manager.release_pending(read));
    assert!(manager.drop_materialization(value, CUDA).expect("free"));
    manager.check_books().expect("balanced");

    // A move's copy is never left in flight.
    let moving = issued(manager.begin_move(value, CUDA, None).expect("fits"));
    assert_eq!(
        moving.work(),
        Work::Copy {
            from: PINNED,
            in_flight: false
        }
    );
    manager.abort(moving).expect("aborts");
}

#[test]
fn a_deferred_reconstruction_is_admitted_then_left_in_flight() {
    let manager = Manager::new(&[(HOST, 100), (CUDA, 20)]);
    let value = registered(&manager, 20, false, HOST);
    let other = adopted(&manager, 10, false, CUDA);
    let before = accounts(&manager);
    let deferring = issued(manager.begin_ensure(value, CUDA, true).expect("fits"));
    assert_eq!(
        deferring.work(),
        Work::Load {
            into: HOST,
            deferrable: true
        }
    );
    // The destination is full: refused before the disk tier allocates anything.
    assert!(matches!(
        manager.admit_deferred(&deferring),
        Err(CoreError::Budget { .. })
    ));
    manager.abort(deferring).expect("aborts");
    assert_eq!(accounts(&manager), before);

    manager
        .drop_materialization(other, CUDA)
        .expect_err("only copy");
    manager
        .install(other, HOST, 10, 10, &[], false)
        .expect("fits");
    manager
        .drop_materialization(other, CUDA)
        .expect("another copy");
    let mut deferring = issued(manager.begin_ensure(value, CUDA, true).expect("fits"));
    manager.admit_deferred(&deferring).expect("fits");
    manager.deferred(&mut deferring).expect("deferrable");
    let committed = common::commit(&manager, deferring, Some(landed(20))).expect("commits");
    assert!(committed.in_flight.is_some());
    assert_eq!(
        committed.read, None,
        "the tier's own copy reads no materialisation"
    );
    let host = books(&manager, HOST);
    assert_eq!(host.reserved_bytes, 0, "the temporary charge went");
    assert_eq!(books(&manager, CUDA).pending_count, 1);

    // A reconstruction loaded into CUDA is not deferrable, nor is a move's.
    let cuda_source = registered(&manager, 4, false, Location::Cuda(1));
    let direct = issued(manager.begin_ensure(cuda_source, CUDA, true).expect("fits"));
    assert!(matches!(
        direct.work(),
        Work::Load {
            deferrable: false,
            ..
        }
    ));
    assert!(matches!(
        manager.admit_deferred(&direct),
        Err(CoreError::Internal { .. })
    ));
    manager.abort(direct).expect("aborts");
}

#[test]
fn the_charge_and_placement_rules() {
    assert_eq!(charge_of(10, 4), 10);
    assert_eq!(charge_of(4, 10), 10);
    // -1 the host, the CUDA index, -2 any other device; `None` mixes pinning.
    assert!(HOST.holds(-1, Some(false), 8));
    assert!(!HOST.holds(-1, Some(true), 8));
    assert!(HOST.holds(-1, Some(true), 0), "nothing to pin");
    assert!(PINNED.holds(-1, Some(true), 8));
    assert!(!PINNED.holds(-1, Some(false), 8));
    assert!(PINNED.holds(-1, Some(false), 0));
    assert!(!PINNED.holds(-1, None, 8));
    assert!(CUDA.holds(0, Some(false), 8));
    assert!(!CUDA.holds(1, Some(false), 8));
    assert!(!CUDA.holds(-2, Some(false), 0));
    assert!(!Location::Disk(0).holds(-1, Some(false), 0));
}

#[test]
fn a_copy_in_flight_hands_its_event_to_the_book_or_back() {
    let manager = Manager::new(&[(CUDA, 16)]);
    let value = adopted(&manager, 16, false, PINNED);
    // Refused (the copy measured above its charge): the event comes back.
    let copying = issued(manager.begin_ensure(value, CUDA, true).expect("fits"));
    let event = manager.new_object();
    let kept = manager.new_object();
    let before = accounts(&manager);
    let mut freed = Freed::default();
    let over = Landed {
        logical_nbytes: 16,
        storage_nbytes: 17,
        keys: &[],
    };
    let in_flight = InFlight {
        event,
        keepalive: Some(kept),
    };
    assert!(matches!(
        manager.commit(copying, Some(over), Some(in_flight), &mut freed),
        Err(CoreError::Materialization { .. })
    ));
    assert_eq!(freed.objects.len(), 2, "the event and what it kept alive");
    assert!(freed.objects.contains(&event) && freed.objects.contains(&kept));
    assert_eq!(accounts(&manager), before);
    assert!(manager.transfer_events(&[value], CUDA).is_empty());

    // Committed: the destination's pending lease and the read source's wait on it.
    let copying = issued(manager.begin_ensure(value, CUDA, true).expect("fits"));
    let event = manager.new_object();
    let mut freed = Freed::default();
    let in_flight = InFlight {
        event,
        keepalive: None,
    };
    let committed = manager
        .commit(copying, Some(landed(16)), Some(in_flight), &mut freed)
        .expect("commits");
    assert!(freed.objects.is_empty());
    assert_eq!(manager.transfer_events(&[value], CUDA), vec![event]);
    assert!(committed.in_flight.is_some() && committed.read.is_some());
}
