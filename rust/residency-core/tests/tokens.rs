//! Lifetime tokens in the core: the release queue behind a source callback, reaping
//! pending CUDA leases by their events' ids, token release and the transfers a
//! pending lease protects (docs/concepts/lifetimes.md, deferred releases and reaping).
//! Events are plain ids here; "complete" is whatever the test's closure answers.

#![allow(clippy::panic)] // Test assertions.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use residency_core::{
    CoreError, Freed, HandleId, LeaseState, LifetimeKind, Location, Manager, ObjectId,
    Recoverability, Release, ReplicaMode, SettleWait, ValueSpec,
};

const POLL: Duration = Duration::from_millis(1);
const CUDA: Location = Location::Cuda(0);
const PINNED: Location = Location::PinnedHost;

fn manager() -> Manager {
    Manager::new(&[])
}

fn spec() -> ValueSpec {
    ValueSpec::new(8, 8, ReplicaMode::Replicable, Recoverability::MustPreserve)
        .expect("a valid spec")
}

/// A value resident at `at`.
fn value(manager: &Manager, at: Location) -> HandleId {
    manager.adopt(1, spec(), at, 8, &[]).expect("adopted").0
}

/// A value resident at pinned memory and on CUDA.
fn copied_value(manager: &Manager) -> HandleId {
    let handle = value(manager, PINNED);
    manager
        .install(handle, CUDA, 8, 8, &[], false)
        .expect("installed");
    handle
}

fn counts(manager: &Manager, handle: HandleId, at: Location) -> (u32, u32, u32) {
    let state = manager.current();
    let record = state.record(handle).expect("issued");
    record.materialization(at).map_or((0, 0, 0), |mat| {
        (mat.use_count, mat.hold_count, mat.pending_count)
    })
}

fn enter(manager: &Manager) {
    manager.enter(POLL, false, false).expect("the gate");
}

/// A CUDA lease released on `events` (not yet complete), under the gate.
fn pending_lease(manager: &Manager, handle: HandleId, events: &[ObjectId]) -> u64 {
    let token = manager.acquire(&[handle], CUDA).expect("acquired");
    enter(manager);
    let freed = manager.apply(Release::Pending {
        token,
        events: events.to_vec(),
        completed: false,
    });
    manager.exit();
    assert!(freed.is_empty());
    assert_eq!(manager.lease_state(token), LeaseState::Pending);
    token
}

fn sorted(mut ids: Vec<ObjectId>) -> Vec<ObjectId> {
    ids.sort_unstable();
    ids
}

// ----- token release ------------------------------------------------------------

#[test]
fn releasing_a_token_twice_or_an_unknown_one_changes_nothing() {
    let manager = manager();
    let handle = value(&manager, PINNED);
    let hold = manager.hold(&[handle], PINNED).expect("held");
    let reservation = manager.reserve(PINNED, 16, "r").expect("reserved");
    assert_eq!(counts(&manager, handle, PINNED), (0, 1, 0));

    let freed = manager
        .try_release_now(LifetimeKind::Hold, hold)
        .expect("the gate is free");
    assert!(freed.is_empty());
    assert_eq!(counts(&manager, handle, PINNED), (0, 0, 0));
    let version = manager.version();
    // Again, and a token never issued: no error, no version step.
    assert_eq!(
        manager.try_release_now(LifetimeKind::Hold, hold),
        Some(Freed::default())
    );
    assert_eq!(
        manager.try_release_now(LifetimeKind::Lease, 999),
        Some(Freed::default())
    );
    assert_eq!(manager.version(), version);

    // A released reservation is named, so the binding drops its label; only once.
    let freed = manager
        .try_release_now(LifetimeKind::Reservation, reservation)
        .expect("the gate is free");
    assert_eq!(freed.reservations, vec![reservation]);
    let again = manager.try_release_now(LifetimeKind::Reservation, reservation);
    assert_eq!(again, Some(Freed::default()));
}

#[test]
fn the_fast_path_never_waits_for_a_busy_gate() {
    let manager = Arc::new(manager());
    let handle = value(&manager, PINNED);
    let hold = manager.hold(&[handle], PINNED).expect("held");
    // Another thread holds the gate: the fast path does not wait, and changes nothing.
    enter(&manager);
    let other = Arc::clone(&manager);
    let attempt = thread::spawn(move || other.try_release_now(LifetimeKind::Hold, hold));
    assert_eq!(attempt.join().expect("joined"), None);
    assert_eq!(counts(&manager, handle, PINNED), (0, 1, 0));
    manager.exit();
}

/// Whether another thread may enter `manager`'s gate now.
fn free_elsewhere(manager: &Arc<Manager>) -> bool {
    let other = Arc::clone(manager);
    thread::spawn(move || {
        let entered = other.try_enter(false, false).expect("open");
        if entered {
            other.exit();
        }
        entered
    })
    .join()
    .expect("joined")
}

#[test]
fn what_follows_a_transition_runs_under_the_same_hold_of_the_gate() {
    let manager = Arc::new(manager());
    enter(&manager);
    manager.begin_transition();
    let done = manager.transition_then(
        || Ok::<_, ()>(1),
        |one| {
            // The transition is over (a public operation may begin) and the gate held.
            let reentered = manager.enter(POLL, false, true);
            manager.exit();
            (one + 1, reentered.is_ok(), free_elsewhere(&manager))
        },
    );
    assert_eq!(done, Ok((2, true, false)));
    assert!(free_elsewhere(&manager));
    // A failed operation ends the transition and lets the gate go; nothing follows.
    enter(&manager);
    manager.begin_transition();
    let failed = manager.transition_then(|| Err::<(), _>("failed"), |()| unreachable!());
    assert_eq!(failed, Err("failed"));
    assert!(free_elsewhere(&manager));
    assert!(manager.enter(POLL, false, true).is_ok());
    manager.exit();
}

#[test]
fn a_lease_released_active_is_not_a_pending_release() {
    let manager = manager();
    let handle = value(&manager, CUDA);
    let token = manager.acquire(&[handle], CUDA).expect("acquired");
    let event = manager.new_object();
    enter(&manager);
    manager.apply(Release::Token {
        kind: LifetimeKind::Lease,
        token,
    });
    // Its CUDA release arrives after: nothing is pending, and its event is given back.
    let freed = manager.apply(Release::Pending {
        token,
        events: vec![event],
        completed: false,
    });
    manager.exit();
    assert_eq!(freed.objects, vec![event]);
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
    assert!(manager.pending_events().is_empty());
    assert_eq!(manager.live_objects(), 0);
    assert_eq!(counts(&manager, handle, CUDA), (0, 0, 0));
}

#[test]
fn a_pending_release_known_complete_ends_the_lease_at_once() {
    let manager = manager();
    let handle = value(&manager, CUDA);
    let token = manager.acquire(&[handle], CUDA).expect("acquired");
    let events = vec![manager.new_object(), manager.new_object()];
    enter(&manager);
    let freed = manager.apply(Release::Pending {
        token,
        events: events.clone(),
        completed: true,
    });
    manager.exit();
    assert_eq!(sorted(freed.objects), sorted(events));
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
    assert_eq!(manager.pending_leases(), 0);
    assert_eq!(manager.live_objects(), 0);
}

#[test]
fn a_freed_object_id_is_given_again_only_once_its_object_was_let_go() {
    // The event ids a release gives back are not given to another release before the
    // binding has dropped their objects (`recycle`): given again earlier, a late drop
    // of the old object would drop the new one, and its lease would read as complete.
    let manager = manager();
    let handle = value(&manager, CUDA);
    let token = manager.acquire(&[handle], CUDA).expect("acquired");
    let event = manager.new_object();
    enter(&manager);
    let freed = manager.apply(Release::Pending {
        token,
        events: vec![event],
        completed: true,
    });
    manager.exit();
    assert_eq!(freed.objects, vec![event]);
    // Quarantined: a new object gets another id, and nothing counts it as live.
    let other = manager.new_object();
    assert_ne!(other, event);
    assert_eq!(manager.live_objects(), 1);
    // Let go: the id is free again, once, however often it is handed back.
    manager.recycle(&freed.objects);
    manager.recycle(&freed.objects);
    assert_eq!(manager.new_object(), event);
    assert_ne!(manager.new_object(), event);
}

// ----- reaping --------------------------------------------------------------------

#[test]
fn reaping_releases_a_pending_lease_only_once_every_event_completed() {
    let manager = manager();
    let handle = copied_value(&manager);
    let (first, second) = (manager.new_object(), manager.new_object());
    let token = pending_lease(&manager, handle, &[first, second]);
    assert_eq!(counts(&manager, handle, CUDA), (0, 0, 1));
    let refused = manager.drop_materialization(handle, CUDA);
    assert!(
        matches!(refused, Err(CoreError::InUse { .. })),
        "{refused:?}"
    );

    // The second is still running: the lease keeps protecting, and the question stops
    // at the first event that is not complete.
    let mut asked = Vec::new();
    let mut freed = Freed::default();
    let reaped: Result<(), ()> = manager.reap(
        |event| {
            asked.push(event);
            Ok(event == first)
        },
        &mut freed,
    );
    assert_eq!(reaped, Ok(()));
    assert_eq!(asked, vec![first, second]);
    assert!(freed.is_empty());
    assert_eq!(manager.lease_state(token), LeaseState::Pending);

    let version = manager.version();
    let reaped: Result<(), ()> = manager.reap(|_| Ok(true), &mut freed);
    assert_eq!(reaped, Ok(()));
    assert_eq!(sorted(freed.objects), sorted(vec![first, second]));
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
    assert_eq!(manager.version(), version + 1);
    assert_eq!(counts(&manager, handle, CUDA), (0, 0, 0));
    assert_eq!(manager.live_objects(), 0);
    assert_eq!(manager.drop_materialization(handle, CUDA), Ok(true));
}

#[test]
fn a_failing_event_question_stops_reaping_and_keeps_the_lease() {
    let manager = manager();
    let handle = value(&manager, CUDA);
    let event = manager.new_object();
    let token = pending_lease(&manager, handle, &[event]);
    // A hold's release queued behind a callback is applied before the question.
    let hold = manager.hold(&[handle], CUDA).expect("held");
    enter(&manager);
    manager.begin_transition();
    manager.set_callback_active(true);
    let mut freed = Freed::default();
    let queued = manager.release(
        Release::Token {
            kind: LifetimeKind::Hold,
            token: hold,
        },
        true,
        |check| manager.enter(POLL, false, check),
        &mut freed,
    );
    assert_eq!(queued, Ok(()));
    assert!(manager.releases_queued());
    manager.set_callback_active(false);
    manager.end_transition();

    let reaped = manager.reap(|_| Err("query raised"), &mut freed);
    manager.exit();
    assert_eq!(reaped, Err("query raised"));
    assert!(!manager.releases_queued());
    assert_eq!(counts(&manager, handle, CUDA), (0, 0, 1));
    assert_eq!(manager.lease_state(token), LeaseState::Pending);
    assert_eq!(manager.live_objects(), 1);
    // Explain's rule: an event whose question fails keeps protecting.
    assert!(manager.completed_pending(|_| false).is_empty());
    assert_eq!(manager.completed_pending(|_| true), vec![token]);
}

#[test]
fn settling_waits_for_the_chosen_leases_and_stops_at_a_failed_wait() {
    let manager = manager();
    let handle = value(&manager, CUDA);
    let (a, b) = (manager.new_object(), manager.new_object());
    let first = pending_lease(&manager, handle, &[a]);
    let second = pending_lease(&manager, handle, &[b]);
    let mut waited = Vec::new();
    let mut freed = Freed::default();
    let settled: Result<(), ()> = manager.settle(
        |token| token == second,
        false,
        |event| {
            waited.push(event);
            Ok(())
        },
        &mut freed,
    );
    assert_eq!(settled, Ok(()));
    assert_eq!(waited, vec![b]);
    assert_eq!(freed.objects, vec![b]);
    assert_eq!(manager.lease_state(first), LeaseState::Pending);
    assert_eq!(manager.lease_state(second), LeaseState::Unknown);

    let failed = manager.settle(|_| true, false, |_| Err("sync raised"), &mut freed);
    assert_eq!(failed, Err("sync raised"));
    assert_eq!(manager.lease_state(first), LeaseState::Pending);
}

#[test]
fn settling_on_the_device_needs_every_owning_stream_or_a_host_wait() {
    let manager = manager();
    let (known, unknown) = (value(&manager, CUDA), value(&manager, CUDA));
    let (a, b) = (manager.new_object(), manager.new_object());
    let owned = pending_lease(&manager, known, &[a]);
    let mixed = manager.acquire(&[known, unknown], CUDA).expect("acquired");
    enter(&manager);
    manager.apply(Release::Pending {
        token: mixed,
        events: vec![b],
        completed: false,
    });
    manager.exit();
    let owner_of = |handle: HandleId, _: Location| (handle == known).then_some("stream");
    let mut waits = Vec::new();
    let mut freed = Freed::default();
    let left: Result<Vec<u64>, ()> = manager.settle_on_device(
        &[owned, mixed],
        false,
        owner_of,
        |wait| {
            waits.push(match wait {
                SettleWait::Device { owners, events } => (owners, events.to_vec()),
                SettleWait::Host { events } => (vec!["host"], events.to_vec()),
            });
            Ok(())
        },
        &mut freed,
    );
    // The lease whose every value has a known owning stream: a device wait, released.
    assert_eq!(left, Ok(vec![mixed]));
    assert_eq!(waits, vec![(vec!["stream"], vec![a])]);
    assert_eq!(freed.objects, vec![a]);
    assert_eq!(manager.lease_state(owned), LeaseState::Unknown);
    assert_eq!(manager.lease_state(mixed), LeaseState::Pending);

    // A failing wait leaves the lease pending.
    let failed = manager.settle_on_device(&[mixed], true, owner_of, |_| Err("raised"), &mut freed);
    assert_eq!(failed, Err("raised"));
    assert_eq!(manager.lease_state(mixed), LeaseState::Pending);
    // With `host`, the rest is waited for on the host.
    waits.clear();
    let left: Result<Vec<u64>, ()> = manager.settle_on_device(
        &[mixed],
        true,
        owner_of,
        |wait| {
            waits.push(match wait {
                SettleWait::Device { owners, events } => (owners, events.to_vec()),
                SettleWait::Host { events } => (vec!["host"], events.to_vec()),
            });
            Ok(())
        },
        &mut freed,
    );
    assert_eq!(left, Ok(vec![]));
    assert_eq!(waits, vec![(vec!["host"], vec![b])]);
    assert_eq!(manager.lease_state(mixed), LeaseState::Unknown);
    assert_eq!(manager.live_objects(), 0);
}

// ----- transfers in flight ----------------------------------------------------------

#[test]
fn a_transfer_protects_destination_and_source_until_its_event_completes() {
    let manager = manager();
    let handle = copied_value(&manager);
    let (event, kept) = (manager.new_object(), manager.new_object());
    let mut freed = Freed::default();
    assert!(manager.protect_transfer(handle, CUDA, Some(PINNED), event, Some(kept), &mut freed));
    assert!(freed.is_empty());
    assert_eq!(counts(&manager, handle, CUDA), (0, 0, 1));
    assert_eq!(counts(&manager, handle, PINNED), (0, 0, 1));
    assert_eq!(manager.transfer_count(), 1);
    assert_eq!(manager.transfer_events(&[handle], CUDA), vec![event]);
    assert!(manager.transfer_events(&[handle], PINNED).is_empty());
    let destination = manager.transfer_tokens()[0];
    assert_eq!(
        manager.transfer_tokens_into(&[handle], CUDA),
        vec![destination]
    );

    // The destination's lease goes first: the source still refers to the event.
    assert!(manager.settle_pending(destination, &mut freed));
    assert_eq!(freed.objects, vec![kept]);
    assert_eq!(manager.transfer_count(), 0);
    assert_eq!(manager.live_objects(), 1);

    let reaped: Result<(), ()> = manager.reap(|_| Ok(true), &mut freed);
    assert_eq!(reaped, Ok(()));
    assert_eq!(sorted(freed.objects), sorted(vec![kept, event]));
    assert_eq!(counts(&manager, handle, PINNED), (0, 0, 0));
    assert_eq!(manager.live_objects(), 0);
}

#[test]
fn a_reap_asks_once_for_an_event_a_transfers_destination_and_source_share() {
    let manager = manager();
    let handle = copied_value(&manager);
    let (event, kept) = (manager.new_object(), manager.new_object());
    let mut freed = Freed::default();
    assert!(manager.protect_transfer(handle, CUDA, Some(PINNED), event, Some(kept), &mut freed));
    assert_eq!(manager.pending_leases(), 2);
    let mut asked = Vec::new();
    let reaped: Result<(), ()> = manager.reap(
        |id| {
            asked.push(id);
            Ok(true)
        },
        &mut freed,
    );
    assert_eq!(reaped, Ok(()));
    // Both protections end, the shared event asked about once.
    assert_eq!(
        asked.iter().filter(|&&id| id == event).count(),
        1,
        "{asked:?}"
    );
    assert_eq!(manager.pending_leases(), 0);
    assert_eq!(counts(&manager, handle, PINNED), (0, 0, 0));
    assert_eq!(counts(&manager, handle, CUDA), (0, 0, 0));
    assert_eq!(manager.live_objects(), 0);
}

#[test]
fn a_transfer_into_nothing_protects_nothing_and_gives_its_ids_back() {
    let manager = manager();
    let handle = value(&manager, PINNED);
    let (event, kept) = (manager.new_object(), manager.new_object());
    let mut freed = Freed::default();
    assert!(!manager.protect_transfer(handle, CUDA, Some(PINNED), event, Some(kept), &mut freed));
    assert_eq!(sorted(freed.objects), sorted(vec![event, kept]));
    assert_eq!(manager.pending_leases(), 0);
    assert_eq!(manager.transfer_count(), 0);
    assert_eq!(manager.live_objects(), 0);
}

#[test]
fn released_on_the_device_a_transfer_keeps_its_event_for_consumers() {
    let manager = manager();
    let handle = copied_value(&manager);
    let event = manager.new_object();
    let mut freed = Freed::default();
    assert!(manager.protect_transfer(handle, CUDA, None, event, None, &mut freed));
    let destination = manager.transfer_tokens()[0];
    assert!(manager.release_on_device(destination, &mut freed));
    assert!(!manager.release_on_device(destination, &mut freed));
    // The memory is free to go; consumers still wait for the copy's event.
    assert_eq!(counts(&manager, handle, CUDA), (0, 0, 0));
    assert!(freed.is_empty());
    assert_eq!(manager.transfer_events(&[handle], CUDA), vec![event]);

    let reaped: Result<(), ()> = manager.reap(|_| Ok(false), &mut freed);
    assert_eq!(reaped, Ok(()));
    assert_eq!(manager.transfer_count(), 1);
    let reaped: Result<(), ()> = manager.reap(|_| Ok(true), &mut freed);
    assert_eq!(reaped, Ok(()));
    assert_eq!(freed.objects, vec![event]);
    assert_eq!(manager.transfer_count(), 0);
    assert_eq!(manager.live_objects(), 0);
}

#[test]
fn ids_are_reused_only_once_free() {
    let manager = manager();
    let handle = value(&manager, CUDA);
    let first = manager.new_object();
    let token = pending_lease(&manager, handle, &[first]);
    let second = manager.new_object();
    assert_ne!(first, second);
    let mut freed = Freed::default();
    assert!(manager.settle_pending(token, &mut freed));
    assert_eq!(freed.objects, vec![first]);
    // Free once its object was let go (`recycle`), not before.
    let third = manager.new_object();
    assert_ne!(third, first);
    manager.recycle(&freed.objects);
    assert_eq!(manager.new_object(), first);
}

// ----- the release queue ----------------------------------------------------------

/// Runs `during` on a thread while this one holds the gate with a source callback
/// running, then ends the callback and applies the queue, as a transition does.
fn with_callback_elsewhere<T: Send + 'static>(
    manager: &Arc<Manager>,
    during: impl FnOnce(Arc<Manager>) -> T + Send + 'static,
) -> T {
    enter(manager);
    manager.begin_transition();
    manager.set_callback_active(true);
    let other = Arc::clone(manager);
    let result = thread::spawn(move || during(other)).join().expect("joined");
    manager.set_callback_active(false);
    manager.end_transition();
    let mut freed = Freed::default();
    manager.drain_releases(&mut freed);
    manager.exit();
    result
}

#[test]
fn a_release_during_a_callback_elsewhere_is_queued_then_applied_once() {
    let manager = Arc::new(manager());
    let handle = value(&manager, CUDA);
    let hold = manager.hold(&[handle], CUDA).expect("held");
    let lease = manager.acquire(&[handle], CUDA).expect("acquired");
    let event = manager.new_object();
    let seen = with_callback_elsewhere(&manager, move |manager| {
        let mut freed = Freed::default();
        let hold_release = manager.release(
            Release::Token {
                kind: LifetimeKind::Hold,
                token: hold,
            },
            false,
            |check| manager.enter(POLL, false, check),
            &mut freed,
        );
        let lease_release = manager.release(
            Release::Pending {
                token: lease,
                events: vec![event],
                completed: false,
            },
            false,
            |check| manager.enter(POLL, false, check),
            &mut freed,
        );
        // Queued: nothing changed while the callback runs, and the fast path waits too.
        let fast = manager.try_release_now(LifetimeKind::Hold, hold);
        (
            hold_release,
            lease_release,
            fast,
            manager.releases_queued(),
            freed,
        )
    });
    assert_eq!(seen.0, Ok(()));
    assert_eq!(seen.1, Ok(()));
    assert_eq!(seen.2, None);
    assert!(seen.3);
    assert!(seen.4.is_empty());
    // Applied, oldest first, once the callback returned.
    assert!(!manager.releases_queued());
    assert_eq!(counts(&manager, handle, CUDA), (0, 0, 1));
    assert_eq!(manager.lease_state(lease), LeaseState::Pending);
    assert_eq!(manager.pending_events(), vec![(lease, vec![event])]);
}

#[test]
fn a_release_on_the_callbacks_own_thread_is_refused_and_nothing_is_kept() {
    let manager = manager();
    let handle = value(&manager, CUDA);
    let lease = manager.acquire(&[handle], CUDA).expect("acquired");
    let event = manager.new_object();
    enter(&manager);
    manager.begin_transition();
    manager.set_callback_active(true);
    let mut freed = Freed::default();
    let refused = manager.release(
        Release::Pending {
            token: lease,
            events: vec![event],
            completed: false,
        },
        false,
        |check| manager.enter(POLL, false, check),
        &mut freed,
    );
    manager.set_callback_active(false);
    manager.end_transition();
    manager.exit();
    assert!(
        matches!(refused, Err(CoreError::Reentrancy { .. })),
        "{refused:?}"
    );
    // Neither applied nor queued: the lease stays active and its event is given back.
    assert!(!manager.releases_queued());
    assert_eq!(freed.objects, vec![event]);
    assert_eq!(manager.lease_state(lease), LeaseState::Active);
    assert_eq!(manager.live_objects(), 0);
}

#[test]
fn a_finalizers_release_inside_a_transition_waits_for_the_next_operation() {
    let manager = manager();
    let handle = value(&manager, PINNED);
    let hold = manager.hold(&[handle], PINNED).expect("held");
    enter(&manager);
    manager.begin_transition();
    let mut freed = Freed::default();
    let release = Release::Token {
        kind: LifetimeKind::Hold,
        token: hold,
    };
    // Not a finaliser: the thread's own transition refuses it.
    let refused = manager.release(
        release.clone(),
        false,
        |check| manager.enter(POLL, false, check),
        &mut freed,
    );
    assert!(matches!(refused, Err(CoreError::Reentrancy { .. })));
    assert!(!manager.releases_queued());
    // A finaliser's is queued, and stays queued until the transition is over.
    let queued = manager.release(
        release,
        true,
        |check| manager.enter(POLL, false, check),
        &mut freed,
    );
    assert_eq!(queued, Ok(()));
    assert!(manager.releases_queued());
    assert_eq!(counts(&manager, handle, PINNED), (0, 1, 0));
    manager.end_transition();
    let reaped: Result<(), ()> = manager.reap(|_| Ok(true), &mut freed);
    manager.exit();
    assert_eq!(reaped, Ok(()));
    assert_eq!(counts(&manager, handle, PINNED), (0, 0, 0));
}

#[test]
fn a_closed_manager_drops_every_token_and_id() {
    let manager = Arc::new(manager());
    let handle = copied_value(&manager);
    let lease = manager.acquire(&[handle], CUDA).expect("acquired");
    let pending = manager.new_object();
    let _ = pending_lease(&manager, handle, &[pending]);
    let event = manager.new_object();
    let mut freed = Freed::default();
    assert!(manager.protect_transfer(handle, CUDA, Some(PINNED), event, None, &mut freed));
    let queued_event = manager.new_object();
    with_callback_elsewhere(&manager, move |manager| {
        // Queued behind the callback; applied when it ends (the lease goes pending).
        let mut freed = Freed::default();
        manager
            .release(
                Release::Pending {
                    token: lease,
                    events: vec![queued_event],
                    completed: false,
                },
                true,
                |check| manager.enter(POLL, false, check),
                &mut freed,
            )
            .expect("queued");
    });
    enter(&manager);
    manager.close(true).expect("forced close");
    let mut freed = Freed::default();
    manager.clear_tokens(&mut freed);
    manager.exit();
    assert_eq!(manager.live_objects(), 0);
    assert_eq!(manager.pending_leases(), 0);
    assert_eq!(manager.transfer_count(), 0);
    assert!(manager.pending_events().is_empty());
    assert!(!manager.reap_needed());
}

#[test]
fn a_lease_to_pending_moves_each_use_token_to_a_pending_one_in_the_books_too() {
    let manager = manager();
    let first = copied_value(&manager);
    let second = copied_value(&manager);
    let hold = manager.hold(&[first], CUDA).expect("held");
    let token = manager.acquire(&[first, second], CUDA).expect("acquired");
    let before = manager.current();
    assert!(manager.lease_to_pending(token));
    assert!(!manager.lease_to_pending(token), "already pending");
    assert_eq!(counts(&manager, first, CUDA), (0, 1, 1));
    assert_eq!(counts(&manager, second, CUDA), (0, 0, 1));
    assert_eq!(counts(&manager, first, PINNED), (0, 0, 0));
    let books = manager.current().books(CUDA);
    assert_eq!(
        (books.use_count, books.hold_count, books.pending_count),
        (0, 1, 2)
    );
    // A snapshot taken before keeps its counts.
    let kept = before.record(first).expect("issued").materialization(CUDA);
    assert_eq!(
        kept.map(|mat| (mat.use_count, mat.pending_count)),
        Some((1, 0))
    );
    assert_eq!(before.books(CUDA).use_count, 2);
    assert!(manager.release_pending(token));
    assert!(manager.release_hold(hold));
    assert_eq!(counts(&manager, first, CUDA), (0, 0, 0));
    let books = manager.current().books(CUDA);
    assert_eq!(
        (books.use_count, books.hold_count, books.pending_count),
        (0, 0, 0)
    );
    manager.check_books().expect("books balance");
}

#[test]
fn the_books_alone_are_the_working_states_and_keep_no_value() {
    let manager = manager();
    let handle = copied_value(&manager);
    let full = manager.current();
    let books = manager.current_books();
    assert_eq!(books.version, full.version);
    assert_eq!(books.closed, full.closed);
    assert_eq!(books.pending_leases, full.pending_leases);
    assert_eq!(&*books.locations, &*full.locations);
    assert_eq!(books.values.len(), 0);
    assert!(books.residents(CUDA).is_none());
    // Kept across later changes, they stay as they were taken.
    let token = manager.acquire(&[handle], CUDA).expect("acquired");
    assert!(manager.release_lease(token));
    assert!(manager.drop_materialization(handle, CUDA).expect("dropped"));
    assert_eq!(books.version, full.version);
    assert_eq!(books.books(CUDA), full.books(CUDA));
    let now = manager.current_books();
    assert!(now.version > books.version);
    assert_eq!(now.books(CUDA).used_bytes, 0);
    assert_eq!(now.books(CUDA).value_count, 0);
}

/// One operation under the gate, as the binding runs them.
fn gated<R>(manager: &Manager, operation: impl FnOnce() -> R) -> R {
    enter(manager);
    let result = operation();
    manager.exit();
    result
}

#[test]
fn a_stale_published_state_is_let_go_and_never_read_lock_free() {
    let manager = manager();
    let handle = gated(&manager, || value(&manager, CUDA));
    // Stale after a changing operation: the lock-free path declines.
    assert!(manager.try_published_snapshot().expect("open").is_none());
    let published = gated(&manager, || manager.current());
    let read = manager
        .try_published_snapshot()
        .expect("open")
        .expect("published and current");
    assert!(Arc::ptr_eq(&read, &published));
    drop(read);
    // Only the manager's published copy shares it besides this one.
    assert_eq!(Arc::strong_count(&published), 2);
    let token = gated(&manager, || {
        manager.acquire(&[handle], CUDA).expect("acquired")
    });
    // Marked stale, the manager let go of it: the change after copies no record of it.
    assert_eq!(Arc::strong_count(&published), 1);
    assert!(manager.try_published_snapshot().expect("open").is_none());
    assert_eq!(
        published
            .record(handle)
            .and_then(|record| record.materialization(CUDA))
            .map(|mat| mat.use_count),
        Some(0)
    );
    // Published again when a reader takes the gate: current, and read lock-free.
    let again = gated(&manager, || manager.current());
    assert!(again.version > published.version);
    let read = manager
        .try_published_snapshot()
        .expect("open")
        .expect("published again");
    assert_eq!(read.version, again.version);
    assert_eq!(counts(&manager, handle, CUDA), (1, 0, 0));
    // An operation that changes nothing keeps it.
    gated(&manager, || manager.lease_state(token));
    assert!(manager.try_published_snapshot().expect("open").is_some());
    assert!(gated(&manager, || manager.release_lease(token)));
    assert!(manager.try_published_snapshot().expect("open").is_none());
}
