//! The lifetime protocol end to end in the core (`LifetimeHost` and the `*_with`
//! methods of `Manager`), driven through a fake event device that logs what the
//! runtime was asked to do (docs/concepts/lifetimes.md,
//! docs/concepts/controller.md#evicting-around-reads-in-flight).

#![allow(clippy::panic)] // Test assertions.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use residency_core::{
    CoreError, CoreResult, Freed, HandleId, LeaseRelease, LeaseState, LifetimeHost, LifetimeKind,
    Location, Manager, ObjectId, Recoverability, ReplicaMode, Unborrowable, ValueSpec,
};

const POLL: Duration = Duration::from_millis(1);
const CUDA: Location = Location::Cuda(0);
const CUDA1: Location = Location::Cuda(1);
const PINNED: Location = Location::PinnedHost;

/// What the fake runtime was asked to do, in order. Events are named by the order
/// they were recorded in (from 1), streams by number.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Record(u32),
    HostWait(u32),
    StreamWait(u32, u32),
    SyncStream(u32),
    SyncDevice(Location),
}

#[derive(Debug, Default)]
struct Device {
    /// The event kept at each core id.
    kept: HashMap<ObjectId, u32>,
    completed: HashSet<u32>,
    calls: Vec<Call>,
    recorded: u32,
    /// Recording fails (an ordinary error) from this many recorded on.
    record_fails_after: Option<u32>,
    /// Recording raises (the runtime's own error) from this many recorded on.
    record_raises_after: Option<u32>,
    host_wait_fails: bool,
    owners: HashMap<HandleId, u32>,
    /// The host's other steps, in order: `place`, `lookup`, `check_stream`,
    /// `closing`, `closed`.
    steps: Vec<&'static str>,
    /// `closed` fails.
    closed_fails: bool,
    /// Every id and reservation handed back, in order.
    freed: Freed,
}

#[derive(Debug, PartialEq)]
enum Failure {
    Core(String),
    Device(&'static str),
    /// A handle that is no live handle of the manager.
    Unknown,
}

#[derive(Debug)]
struct Fake<'a> {
    manager: &'a Manager,
    device: RefCell<Device>,
}

impl<'a> Fake<'a> {
    fn new(manager: &'a Manager) -> Self {
        Self {
            manager,
            device: RefCell::new(Device::default()),
        }
    }

    fn calls(&self) -> Vec<Call> {
        std::mem::take(&mut self.device.borrow_mut().calls)
    }

    fn steps(&self) -> Vec<&'static str> {
        std::mem::take(&mut self.device.borrow_mut().steps)
    }

    fn step(&self, step: &'static str) {
        self.device.borrow_mut().steps.push(step);
    }

    fn complete(&self, event: u32) {
        self.device.borrow_mut().completed.insert(event);
    }

    fn kept(&self) -> usize {
        self.device.borrow().kept.len()
    }

    fn event(&self, id: ObjectId) -> Option<u32> {
        self.device.borrow().kept.get(&id).copied()
    }

    /// A new event kept at a new core id (what a copy in flight records).
    fn new_event(&self) -> ObjectId {
        let id = self.manager.new_object();
        let mut device = self.device.borrow_mut();
        device.recorded += 1;
        let event = device.recorded;
        device.kept.insert(id, event);
        id
    }
}

impl LifetimeHost for Fake<'_> {
    type Stream = u32;
    type Event = u32;
    type Error = Failure;
    /// `None` names no handle of the manager.
    type Handle = Option<HandleId>;
    type Place = Location;

    fn lift(&self, error: CoreError) -> Failure {
        Failure::Core(error.to_string())
    }

    fn enter(&self, check_closed: bool, check_reentrant: bool) -> CoreResult<()> {
        self.manager.enter(POLL, check_closed, check_reentrant)
    }

    fn place(&self, place: &Location) -> Result<Location, Failure> {
        self.step("place");
        Ok(*place)
    }

    fn name(&self, place: &Location) -> Result<String, Failure> {
        Ok(place.to_string())
    }

    /// `HandleId::MAX` is a handle whose lookup raises.
    fn lookup(&self, handle: &Option<HandleId>) -> Result<Option<HandleId>, Failure> {
        self.step("lookup");
        match handle {
            Some(HandleId::MAX) => Err(Failure::Device("lookup raised")),
            _ => Ok(*handle),
        }
    }

    fn unknown(&self, _handle: &Option<HandleId>) -> Failure {
        Failure::Unknown
    }

    /// Stream 0 is no stream; any other is kept as itself plus 100.
    fn check_stream(&self, stream: &u32, _place: &Location, _at: Location) -> Result<u32, Failure> {
        self.step("check_stream");
        match stream {
            0 => Err(Failure::Device("not a stream")),
            _ => Ok(stream + 100),
        }
    }

    fn closing(&self) {
        self.step("closing");
    }

    fn closed(&self) -> Result<(), Failure> {
        self.step("closed");
        if self.device.borrow().closed_fails {
            return Err(Failure::Device("closing the disk failed"));
        }
        Ok(())
    }

    fn free(&self, freed: &Freed) {
        let mut device = self.device.borrow_mut();
        for id in &freed.objects {
            device.kept.remove(id);
        }
        device.freed.append(freed.clone());
    }

    fn forget(&self, id: ObjectId) {
        let mut device = self.device.borrow_mut();
        device.kept.remove(&id);
        device.freed.objects.push(id);
    }

    fn keep(&self, id: ObjectId, event: u32) {
        self.device.borrow_mut().kept.insert(id, event);
    }

    fn query(&self, id: ObjectId) -> Result<bool, Failure> {
        Ok(self
            .event(id)
            .is_none_or(|event| self.device.borrow().completed.contains(&event)))
    }

    fn wait(&self, id: ObjectId) -> Result<(), Failure> {
        let Some(event) = self.event(id) else {
            return Ok(());
        };
        let mut device = self.device.borrow_mut();
        if device.host_wait_fails {
            return Err(Failure::Device("wait failed"));
        }
        device.calls.push(Call::HostWait(event));
        device.completed.insert(event);
        Ok(())
    }

    fn stream_wait(&self, stream: &u32, id: ObjectId) -> Result<(), Failure> {
        if let Some(event) = self.event(id) {
            let call = Call::StreamWait(*stream, event);
            self.device.borrow_mut().calls.push(call);
        }
        Ok(())
    }

    fn record(&self, stream: &u32) -> Result<Option<u32>, Failure> {
        let mut device = self.device.borrow_mut();
        if device
            .record_fails_after
            .is_some_and(|after| device.recorded >= after)
        {
            return Ok(None);
        }
        if device
            .record_raises_after
            .is_some_and(|after| device.recorded >= after)
        {
            return Err(Failure::Device("record raised"));
        }
        device.recorded += 1;
        device.calls.push(Call::Record(*stream));
        Ok(Some(device.recorded))
    }

    fn synchronize_stream(&self, stream: &u32) -> Result<(), Failure> {
        self.device
            .borrow_mut()
            .calls
            .push(Call::SyncStream(*stream));
        Ok(())
    }

    fn synchronize_device(&self, at: Location) -> Result<(), Failure> {
        self.device.borrow_mut().calls.push(Call::SyncDevice(at));
        Ok(())
    }

    fn owner(&self, handle: HandleId, _at: Location) -> Option<u32> {
        self.device.borrow().owners.get(&handle).copied()
    }

    fn same_stream(&self, first: &u32, second: &u32) -> bool {
        first == second
    }

    fn loads_alone(&self, _handle: HandleId) -> Result<bool, Failure> {
        Ok(false)
    }
}

fn spec() -> ValueSpec {
    ValueSpec::new(8, 8, ReplicaMode::Replicable, Recoverability::MustPreserve)
        .expect("a valid spec")
}

/// A value resident at `at`.
fn value(manager: &Manager, at: Location) -> HandleId {
    manager.adopt(1, spec(), at, 8, &[]).expect("adopted").0
}

fn enter(manager: &Manager) {
    manager.enter(POLL, false, false).expect("the gate");
}

/// A CUDA lease read on `streams` and released without a wait (pending on one
/// event per stream), outside the gate.
fn pending(fake: &Fake<'_>, handles: &[HandleId], streams: &[u32]) -> u64 {
    let manager = fake.manager;
    let token = manager.acquire(handles, CUDA).expect("acquired");
    let released = manager.release_lease_with(fake, token, CUDA, streams, false, false);
    assert_eq!(released, Ok(LeaseRelease::Released));
    assert_eq!(manager.lease_state(token), LeaseState::Pending);
    token
}

// ----- a lease's release ------------------------------------------------------------

#[test]
fn a_cuda_lease_stays_pending_until_every_consumer_streams_event_completed() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let token = pending(&fake, &[handle], &[1, 2]);
    assert_eq!(fake.calls(), vec![Call::Record(1), Call::Record(2)]);
    assert_eq!(fake.kept(), 2);

    enter(&manager);
    manager.reap_with(&fake).expect("reaped");
    assert_eq!(manager.lease_state(token), LeaseState::Pending);
    fake.complete(1);
    manager.reap_with(&fake).expect("reaped");
    assert_eq!(manager.lease_state(token), LeaseState::Pending);
    assert_eq!(manager.completed_pending_with(&fake), Vec::<u64>::new());
    fake.complete(2);
    assert_eq!(manager.completed_pending_with(&fake), vec![token]);
    manager.reap_with(&fake).expect("reaped");
    manager.exit();
    // Released, with no host wait, and its events dropped.
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
    assert_eq!(fake.calls(), vec![]);
    assert_eq!((fake.kept(), manager.live_objects()), (0, 0));
}

#[test]
fn a_waiting_release_waits_on_the_host_and_ends_the_lease() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let token = manager.acquire(&[handle], CUDA).expect("acquired");
    let released = manager.release_lease_with(&fake, token, CUDA, &[3, 4], true, false);
    assert_eq!(released, Ok(LeaseRelease::Released));
    assert_eq!(
        fake.calls(),
        vec![
            Call::Record(3),
            Call::Record(4),
            Call::HostWait(1),
            Call::HostWait(2)
        ]
    );
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
    assert_eq!(manager.pending_leases(), 0);
    assert_eq!((fake.kept(), manager.live_objects()), (0, 0));
}

#[test]
fn a_failed_host_wait_keeps_the_lease_active_and_gives_its_events_back() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let token = manager.acquire(&[handle], CUDA).expect("acquired");
    fake.device.borrow_mut().host_wait_fails = true;
    let released = manager.release_lease_with(&fake, token, CUDA, &[3], true, false);
    assert_eq!(released, Err(Failure::Device("wait failed")));
    assert_eq!(manager.lease_state(token), LeaseState::Active);
    assert_eq!((fake.kept(), manager.live_objects()), (0, 0));
}

#[test]
fn a_host_lease_releases_its_tokens_without_events() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, PINNED);
    let token = manager.acquire(&[handle], PINNED).expect("acquired");
    let released = manager.release_lease_with(&fake, token, PINNED, &[], false, false);
    assert_eq!(released, Ok(LeaseRelease::Released));
    assert_eq!(fake.calls(), vec![]);
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
}

#[test]
fn a_cuda_lease_without_consumer_streams_synchronises_its_device_and_warns() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA1);
    let token = manager.acquire(&[handle], CUDA1).expect("acquired");
    let released = manager.release_lease_with(&fake, token, CUDA1, &[], false, false);
    assert_eq!(released, Ok(LeaseRelease::DeviceSynchronized));
    assert_eq!(fake.calls(), vec![Call::SyncDevice(CUDA1)]);
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
    assert_eq!(
        LeaseRelease::DeviceSynchronized
            .warning("cuda:1")
            .as_deref(),
        Some(
            "a CUDA lease at cuda:1 had no consumer streams; a full-device synchronisation \
             was used to release it"
        )
    );
    assert_eq!(LeaseRelease::Released.warning("cuda:1"), None);
}

#[test]
fn a_recording_that_raises_lets_the_events_recorded_before_it_go() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let token = manager.acquire(&[handle], CUDA).expect("acquired");
    // The first two events record and are kept; the third raises: the error is the
    // runtime's, the kept events go with their ids, and the lease stays active.
    fake.device.borrow_mut().record_raises_after = Some(2);
    let released = manager.release_lease_with(&fake, token, CUDA, &[5, 6, 7], false, false);
    assert_eq!(released, Err(Failure::Device("record raised")));
    assert_eq!(fake.calls(), vec![Call::Record(5), Call::Record(6)]);
    assert_eq!((fake.kept(), manager.live_objects()), (0, 0));
    assert_eq!(fake.device.borrow().freed.objects.len(), 2);
    assert_eq!(manager.lease_state(token), LeaseState::Active);
}

#[test]
fn failed_recording_synchronises_the_consumer_streams_and_warns() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let token = manager.acquire(&[handle], CUDA).expect("acquired");
    // The first event records, the second fails: both streams are synchronised.
    fake.device.borrow_mut().record_fails_after = Some(1);
    let released = manager.release_lease_with(&fake, token, CUDA, &[5, 6], false, false);
    assert_eq!(released, Ok(LeaseRelease::StreamsSynchronized));
    assert_eq!(
        fake.calls(),
        vec![Call::Record(5), Call::SyncStream(5), Call::SyncStream(6)]
    );
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
    assert_eq!((fake.kept(), manager.live_objects()), (0, 0));
    assert_eq!(
        LeaseRelease::StreamsSynchronized
            .warning("cuda:0")
            .as_deref(),
        Some(
            "recording release events at cuda:0 failed; the consumer streams were \
             synchronised instead"
        )
    );
}

#[test]
fn releasing_a_released_or_pending_lease_records_nothing() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let token = pending(&fake, &[handle], &[1]);
    fake.calls();
    // Again (a finaliser racing the explicit release): nothing recorded, still pending.
    let again = manager.release_lease_with(&fake, token, CUDA, &[1], true, true);
    assert_eq!(again, Ok(LeaseRelease::Released));
    assert_eq!(fake.calls(), vec![]);
    assert_eq!(manager.lease_state(token), LeaseState::Pending);
}

// ----- acquire ----------------------------------------------------------------------

#[test]
fn a_consumer_stream_waits_on_the_device_for_a_copy_in_flight() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, PINNED);
    manager
        .install(handle, CUDA, 8, 8, &[], false)
        .expect("installed");
    let event = fake.new_event();
    let mut freed = Freed::default();
    assert!(manager.protect_transfer(handle, CUDA, Some(PINNED), event, None, &mut freed));
    enter(&manager);
    let token = manager.acquire_with(&fake, &[handle], CUDA, Some(&9));
    manager.exit();
    let token = token.expect("acquired");
    assert_eq!(fake.calls(), vec![Call::StreamWait(9, 1)]);
    assert_eq!(manager.lease_state(token), LeaseState::Active);
    // Without a consumer stream (the host reads), no device wait.
    let other = manager.acquire_with(&fake, &[handle], CUDA, None);
    assert!(other.is_ok());
    assert_eq!(fake.calls(), vec![]);
}

#[test]
fn disk_is_never_borrowed_and_cuda_needs_a_consumer_stream() {
    assert_eq!(Manager::borrowable(PINNED, false), Ok(()));
    assert_eq!(Manager::borrowable(CUDA, true), Ok(()));
    assert_eq!(
        Manager::borrowable(CUDA, false),
        Err(Unborrowable::NeedsStream)
    );
    let disk = Location::disk(0).expect("a disk location");
    assert_eq!(Manager::borrowable(disk, true), Err(Unborrowable::Disk));
    let error = Unborrowable::NeedsStream.error("cuda:0");
    assert!(matches!(error, CoreError::InvalidArgument { .. }));
    assert_eq!(
        error.to_string(),
        "acquiring at cuda:0 needs the consumer_stream that will read the values"
    );
}

// ----- settling ---------------------------------------------------------------------

#[test]
fn settling_waits_on_the_host_oldest_first_for_the_chosen_leases_only() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let older = pending(&fake, &[handle], &[1]);
    let newer = pending(&fake, &[handle], &[2]);
    let other = pending(&fake, &[handle], &[3]);
    fake.calls();
    enter(&manager);
    let settled = manager.settle_with(&fake, &[newer, older], false);
    manager.exit();
    assert_eq!(settled, Ok(()));
    assert_eq!(fake.calls(), vec![Call::HostWait(1), Call::HostWait(2)]);
    assert_eq!(manager.lease_state(older), LeaseState::Unknown);
    assert_eq!(manager.lease_state(newer), LeaseState::Unknown);
    assert_eq!(manager.lease_state(other), LeaseState::Pending);
}

#[test]
fn a_device_settle_releases_without_a_host_round_trip() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let (a, b, c) = (
        value(&manager, CUDA),
        value(&manager, CUDA),
        value(&manager, CUDA),
    );
    // `a` and `b` share owning stream 7, `c` is owned by 8: each waits once per event.
    fake.device.borrow_mut().owners = HashMap::from([(a, 7), (b, 7), (c, 8)]);
    let token = pending(&fake, &[a, b, c], &[1, 2]);
    fake.calls();
    enter(&manager);
    let left = manager.settle_on_device_with(&fake, &[token], false);
    manager.exit();
    assert_eq!(left, Ok(vec![]));
    assert_eq!(
        fake.calls(),
        vec![
            Call::StreamWait(7, 1),
            Call::StreamWait(7, 2),
            Call::StreamWait(8, 1),
            Call::StreamWait(8, 2),
        ]
    );
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
    assert_eq!((fake.kept(), manager.live_objects()), (0, 0));
}

#[test]
fn a_lease_with_an_unknown_owner_stays_pending_or_is_waited_for_on_the_host() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let (known, unknown) = (value(&manager, CUDA), value(&manager, CUDA));
    fake.device.borrow_mut().owners = HashMap::from([(known, 7)]);
    let token = pending(&fake, &[known, unknown], &[1]);
    fake.calls();
    enter(&manager);
    let left = manager.settle_on_device_with(&fake, &[token], false);
    assert_eq!(left, Ok(vec![token]));
    assert_eq!(fake.calls(), vec![]);
    assert_eq!(manager.lease_state(token), LeaseState::Pending);
    let left = manager.settle_on_device_with(&fake, &[token], true);
    manager.exit();
    assert_eq!(left, Ok(vec![]));
    assert_eq!(fake.calls(), vec![Call::HostWait(1)]);
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
}

#[test]
fn blocking_the_host_is_the_cores_rule() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let (on_device, pinned) = (value(&manager, CUDA), value(&manager, PINNED));
    // A pinned copy to a device is asynchronous; any copy to the host blocks.
    assert_eq!(
        manager.blocks_host_with(&fake, &[on_device, pinned], CUDA, false),
        Ok(false)
    );
    assert_eq!(
        manager.blocks_host_with(&fake, &[pinned, on_device], PINNED, false),
        Ok(true)
    );
}

// ----- close ------------------------------------------------------------------------

#[test]
fn close_with_a_live_lease_is_refused_unless_forced() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let token = manager.acquire(&[handle], CUDA).expect("acquired");
    enter(&manager);
    let refused = manager.close_with(&fake, false, false);
    assert!(
        matches!(&refused, Err(Failure::Core(text)) if text.contains("still has open lifetimes"))
    );
    assert!(!manager.is_closed());
    assert_eq!(fake.calls(), vec![]);
    // Refused: the objects stay.
    assert_eq!(fake.steps(), vec!["closing"]);
    // Forced: each CUDA device is synchronised first, then the tokens end.
    let forced = manager.close_with(&fake, false, true);
    assert_eq!(forced, Ok(true));
    assert!(manager.is_closed());
    assert_eq!(fake.calls(), vec![Call::SyncDevice(CUDA)]);
    // Closed already: nothing is done again.
    assert_eq!(manager.close_with(&fake, true, true), Ok(false));
    manager.exit();
    assert_eq!(fake.steps(), vec!["closing", "closed"]);
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
}

#[test]
fn close_with_wait_settles_every_pending_lease_first() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let first = pending(&fake, &[handle], &[1]);
    let second = pending(&fake, &[handle], &[2]);
    fake.calls();
    enter(&manager);
    let closed = manager.close_with(&fake, true, false);
    manager.clear_tokens_with(&fake);
    manager.exit();
    assert_eq!(closed, Ok(true));
    assert_eq!(fake.calls(), vec![Call::HostWait(1), Call::HostWait(2)]);
    assert_eq!(manager.lease_state(first), LeaseState::Unknown);
    assert_eq!(manager.lease_state(second), LeaseState::Unknown);
    assert_eq!((fake.kept(), manager.live_objects()), (0, 0));
}

#[test]
fn close_without_wait_refuses_a_pending_lease_whose_events_are_incomplete() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let token = pending(&fake, &[handle], &[1]);
    enter(&manager);
    let refused = manager.close_with(&fake, false, false);
    assert!(matches!(refused, Err(Failure::Core(_))));
    // Its event completes: the close reaps it and closes.
    fake.complete(1);
    let closed = manager.close_with(&fake, false, false);
    manager.exit();
    assert_eq!(closed, Ok(true));
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
}

#[test]
fn a_lease_borrows_a_value_only_while_it_covers_it() {
    let manager = Manager::new(&[]);
    let (leased, other) = (value(&manager, PINNED), value(&manager, PINNED));
    let token = manager.acquire(&[leased], PINNED).expect("acquired");
    assert_eq!(manager.borrowed(token, Some(leased)), Some(leased));
    assert_eq!(manager.borrowed(token, Some(other)), None);
    assert_eq!(manager.borrowed(token, None), None);
    // A forced close ends what the lease borrows.
    enter(&manager);
    manager.close(true).expect("closed");
    manager.exit();
    assert_eq!(manager.borrowed(token, Some(leased)), None);
    let error = Manager::no_longer_borrowed("'v1'", "pinned");
    assert!(matches!(error, CoreError::Unavailable { .. }));
    assert_eq!(
        error.to_string(),
        "value 'v1' is no longer borrowed at pinned (its lease ended with a forced close or \
         the value was discarded)"
    );
}

// ----- resolving and admission ------------------------------------------------------

/// `(use_count, hold_count)` at `at`.
fn counts(manager: &Manager, at: Location) -> (u64, u64) {
    let books = manager.current().books(at);
    (books.use_count, books.hold_count)
}

/// A CUDA lease pending on one event that completed (a reap releases it).
fn reapable(fake: &Fake<'_>, handle: HandleId) -> u64 {
    let token = pending(fake, &[handle], &[1]);
    let recorded = fake.device.borrow().recorded;
    fake.complete(recorded);
    fake.calls();
    token
}

#[test]
fn handles_resolve_through_the_host_in_order_until_the_first_unknown_one() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let (resident, elsewhere) = (value(&manager, CUDA), value(&manager, PINNED));
    let resolved = manager.resolve_with(&fake, [Some(resident), Some(elsewhere)], CUDA);
    assert_eq!(resolved, Ok(vec![resident, elsewhere]));
    assert_eq!(fake.steps(), vec!["lookup", "lookup"]);
    // The first unknown handle stops the lookups: its error is the host's.
    let unknown = manager.resolve_with(&fake, [Some(resident), None, Some(elsewhere)], CUDA);
    assert_eq!(unknown, Err(Failure::Unknown));
    assert_eq!(fake.steps(), vec!["lookup", "lookup"]);
    // A handle before it that is not resident there is reported first.
    let refused = manager.resolve_with(&fake, [Some(elsewhere), None], CUDA);
    assert!(matches!(refused, Err(Failure::Core(text)) if text.contains("is not resident at")));
    // A lookup that raises stops there, its error unchanged.
    let raised = manager.resolve_with(&fake, [Some(HandleId::MAX), None], CUDA);
    assert_eq!(raised, Err(Failure::Device("lookup raised")));
}

#[test]
fn a_lease_is_refused_before_anything_where_it_cannot_be_taken() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let waiting = reapable(&fake, handle);
    enter(&manager);
    let disk = Location::disk(0).expect("a disk location");
    let on_disk = manager.admit_with(&fake, [Some(handle)], &disk, Some(&5), true);
    assert!(matches!(on_disk, Err(Failure::Core(text)) if text.contains("cannot be borrowed")));
    let no_stream = manager.admit_with(&fake, [Some(handle)], &CUDA, None, true);
    manager.exit();
    assert!(
        matches!(no_stream, Err(Failure::Core(text)) if text.contains("needs the consumer_stream"))
    );
    // Only the locations were read: no reap, no stream check, no lookup.
    assert_eq!(fake.steps(), vec!["place", "place"]);
    assert_eq!(manager.lease_state(waiting), LeaseState::Pending);
}

#[test]
fn an_admission_reaps_then_checks_the_stream_then_looks_the_handles_up() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let waiting = reapable(&fake, handle);
    enter(&manager);
    // The stream's check fails after the reap: the completed lease is released.
    let bad_stream = manager.admit_with(&fake, [Some(handle)], &CUDA, Some(&0), true);
    assert_eq!(
        bad_stream.map(|admitted| admitted.token),
        Err(Failure::Device("not a stream"))
    );
    assert_eq!(fake.steps(), vec!["place", "check_stream"]);
    assert_eq!(manager.lease_state(waiting), LeaseState::Unknown);
    // A checked stream, then an unknown handle: no lease is taken.
    let unknown = manager.admit_with(&fake, [Some(handle), None], &CUDA, Some(&5), true);
    assert_eq!(
        unknown.map(|admitted| admitted.token),
        Err(Failure::Unknown)
    );
    assert_eq!(
        fake.steps(),
        vec!["place", "check_stream", "lookup", "lookup"]
    );
    assert_eq!(counts(&manager, CUDA), (0, 0));
    // Admitted: the lease, on the stream as the manager keeps it.
    let admitted = manager
        .admit_with(&fake, [Some(handle)], &CUDA, Some(&5), false)
        .expect("admitted");
    manager.exit();
    assert_eq!(admitted.at, CUDA);
    assert_eq!(admitted.indices, vec![handle]);
    assert_eq!(admitted.stream, Some(105));
    assert_eq!(admitted.transfers, Vec::<u64>::new());
    assert_eq!(manager.lease_state(admitted.token), LeaseState::Active);
    assert_eq!(counts(&manager, CUDA), (1, 0));
}

#[test]
fn without_a_reap_an_admission_leaves_completed_leases_pending() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let waiting = reapable(&fake, handle);
    enter(&manager);
    let admitted = manager.admit_with(&fake, [Some(handle)], &CUDA, Some(&5), false);
    manager.exit();
    assert!(admitted.is_ok());
    assert_eq!(manager.lease_state(waiting), LeaseState::Pending);
}

#[test]
fn a_cuda_admission_names_the_transfers_in_flight_into_its_values() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, PINNED);
    manager
        .install(handle, CUDA, 8, 8, &[], false)
        .expect("installed");
    let event = fake.new_event();
    let mut freed = Freed::default();
    assert!(manager.protect_transfer(handle, CUDA, Some(PINNED), event, None, &mut freed));
    let in_flight = manager.transfer_tokens();
    assert_eq!(in_flight.len(), 1);
    enter(&manager);
    let on_device = manager.admit_with(&fake, [Some(handle)], &CUDA, Some(&9), true);
    let on_host = manager.admit_with(&fake, [Some(handle)], &PINNED, None, true);
    manager.exit();
    // The kept stream waits on the device for the copy; the host lease names none.
    assert_eq!(on_device.expect("admitted").transfers, in_flight);
    assert_eq!(fake.calls(), vec![Call::StreamWait(109, 1)]);
    assert_eq!(on_host.expect("admitted").transfers, Vec::<u64>::new());
}

// ----- handing lifetimes out --------------------------------------------------------

#[test]
fn a_lease_or_hold_whose_object_is_not_built_gives_its_tokens_back() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, PINNED);
    let failed: Result<(), Failure> =
        manager.lease_with(&fake, [Some(handle)], &PINNED, None, |admitted| {
            assert_eq!(manager.lease_state(admitted.token), LeaseState::Active);
            Err(Failure::Device("the lease object"))
        });
    assert_eq!(failed, Err(Failure::Device("the lease object")));
    let failed: Result<(), Failure> = manager.hold_with(&fake, [Some(handle)], &PINNED, |_| {
        Err(Failure::Device("the hold object"))
    });
    assert_eq!(failed, Err(Failure::Device("the hold object")));
    assert_eq!(counts(&manager, PINNED), (0, 0));
    // Built: handed out, and the gate let go (another operation enters).
    let token = manager.lease_with(&fake, [Some(handle)], &PINNED, None, |admitted| {
        Ok(admitted.token)
    });
    let hold = manager.hold_with(&fake, [Some(handle)], &PINNED, Ok);
    assert_eq!(counts(&manager, PINNED), (1, 1));
    assert_eq!(
        manager.lease_state(token.expect("a lease")),
        LeaseState::Active
    );
    assert!(hold.is_ok());
}

#[test]
fn a_reservation_whose_object_is_not_built_goes_with_its_label() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    enter(&manager);
    let token = manager.reserve(PINNED, 64, "scratch").expect("reserved");
    let failed: Result<(), Failure> =
        manager.hand_out(&fake, LifetimeKind::Reservation, token, || {
            Err(Failure::Device("the reservation object"))
        });
    manager.exit();
    assert_eq!(failed, Err(Failure::Device("the reservation object")));
    assert_eq!(manager.current().books(PINNED).reserved_bytes, 0);
    assert_eq!(fake.device.borrow().freed.reservations, vec![token]);
}

#[test]
fn holds_per_group_are_kept_in_order_and_one_not_kept_goes() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let (a, b) = (value(&manager, PINNED), value(&manager, CUDA));
    let mut kept = Vec::new();
    enter(&manager);
    let groups = [Ok((vec![Some(a)], PINNED)), Ok((vec![Some(b)], CUDA))];
    let held = manager.hold_groups_with(&fake, groups, |token| {
        kept.push(token);
        Ok(())
    });
    assert_eq!(held, Ok(()));
    assert_eq!(kept.len(), 2);
    assert_eq!(
        (counts(&manager, PINNED), counts(&manager, CUDA)),
        ((0, 1), (0, 1))
    );
    // The second group's token is refused: it goes; the first stays the caller's.
    let mut calls = 0;
    let groups = [Ok((vec![Some(a)], PINNED)), Ok((vec![Some(b)], CUDA))];
    let held = manager.hold_groups_with(&fake, groups, |_| {
        calls += 1;
        if calls == 2 {
            return Err(Failure::Device("the list"));
        }
        Ok(())
    });
    assert_eq!(held, Err(Failure::Device("the list")));
    assert_eq!(
        (counts(&manager, PINNED), counts(&manager, CUDA)),
        ((0, 2), (0, 1))
    );
    // A group that fails to resolve stops there; the groups after it are not taken.
    let groups = [Ok((vec![None], PINNED)), Ok((vec![Some(b)], CUDA))];
    let held = manager.hold_groups_with(&fake, groups, |_| Ok(()));
    let groups = [Err(Failure::Device("a group")), Ok((vec![Some(b)], CUDA))];
    let unparsed = manager.hold_groups_with(&fake, groups, |_| Ok(()));
    manager.exit();
    assert_eq!(held, Err(Failure::Unknown));
    assert_eq!(unparsed, Err(Failure::Device("a group")));
    assert_eq!(
        (counts(&manager, PINNED), counts(&manager, CUDA)),
        ((0, 2), (0, 1))
    );
}

#[test]
fn blocking_the_host_is_asked_group_by_group_until_one_blocks() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let (on_device, pinned) = (value(&manager, CUDA), value(&manager, PINNED));
    enter(&manager);
    let quiet = [
        Ok((vec![Some(on_device)], CUDA)),
        Ok((vec![Some(pinned)], CUDA)),
    ];
    let quiet = manager.blocks_host_groups_with(&fake, quiet, false);
    // A copy to the host blocks: the groups after it are not looked at.
    let blocking = [Ok((vec![Some(on_device)], PINNED)), Ok((vec![None], CUDA))];
    let blocking = manager.blocks_host_groups_with(&fake, blocking, false);
    let unknown = [Ok((vec![None], CUDA)), Ok((vec![Some(on_device)], PINNED))];
    let unknown = manager.blocks_host_groups_with(&fake, unknown, false);
    manager.exit();
    assert_eq!(quiet, Ok(false));
    assert_eq!(blocking, Ok(true));
    assert_eq!(unknown, Err(Failure::Unknown));
}

#[test]
fn resolved_groups_are_held_in_order_until_one_is_refused_or_not_kept() {
    let manager = Manager::new(&[]);
    let (a, b) = (value(&manager, PINNED), value(&manager, CUDA));
    let mut kept = Vec::new();
    enter(&manager);
    let groups = [(PINNED, vec![a]), (CUDA, vec![b])];
    let held = manager.hold_indices(&groups, |token| {
        kept.push(token);
        Ok::<_, Failure>(())
    });
    assert_eq!(held, Ok(true));
    assert_eq!(kept.len(), 2);
    // `b` is not on the host: that group is refused; the first stays the caller's.
    let groups = [(PINNED, vec![a]), (PINNED, vec![b]), (CUDA, vec![b])];
    let refused = manager.hold_indices(&groups, |_| Ok::<_, Failure>(()));
    // A token not kept goes, and the groups after it are not held.
    let not_kept = manager.hold_indices(&groups, |_| Err(Failure::Device("the list")));
    manager.exit();
    assert_eq!(refused, Ok(false));
    assert_eq!(not_kept, Err(Failure::Device("the list")));
    assert_eq!(
        (counts(&manager, PINNED), counts(&manager, CUDA)),
        ((0, 2), (0, 1))
    );
}

#[test]
fn blocking_the_host_is_asked_of_resolved_groups_until_one_blocks() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let (on_device, pinned) = (value(&manager, CUDA), value(&manager, PINNED));
    enter(&manager);
    let quiet = [(CUDA, vec![on_device]), (CUDA, vec![pinned])];
    let quiet = manager.blocks_host_indices(&fake, &quiet, false);
    let blocking = [(CUDA, vec![pinned]), (PINNED, vec![on_device])];
    let blocking = manager.blocks_host_indices(&fake, &blocking, false);
    manager.exit();
    assert_eq!(quiet, Ok(false));
    assert_eq!(blocking, Ok(true));
}

#[test]
fn the_resolved_operations_read_the_location_then_reap_then_look_up() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let waiting = reapable(&fake, handle);
    let unreaped = manager.with_resolved(&fake, [None], &CUDA, false, |_, _| Ok(()));
    assert_eq!(unreaped, Err(Failure::Unknown));
    assert_eq!(manager.lease_state(waiting), LeaseState::Pending);
    let reaped = manager.with_resolved(&fake, [None], &CUDA, true, |_, _| Ok(()));
    assert_eq!(reaped, Err(Failure::Unknown));
    assert_eq!(manager.lease_state(waiting), LeaseState::Unknown);
    assert_eq!(fake.steps(), vec!["place", "lookup", "place", "lookup"]);
    let seen = manager.with_resolved(&fake, [Some(handle)], &CUDA, true, |ids, at| {
        Ok((ids.to_vec(), at))
    });
    assert_eq!(seen, Ok((vec![handle], CUDA)));
}

#[test]
fn the_gate_refuses_a_closed_manager_only_when_asked() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    enter(&manager);
    manager.close(false).expect("closed");
    manager.exit();
    let refused = manager.gated(&fake, true, true, || Ok(()));
    assert!(matches!(refused, Err(Failure::Core(text)) if text.contains("closed")));
    assert_eq!(manager.gated(&fake, false, true, || Ok(7)), Ok(7));
    // Let go after: another operation enters.
    assert_eq!(manager.gated(&fake, false, false, || Ok(8)), Ok(8));
}

#[test]
fn pending_among_reaps_the_completed_leases_first() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let done = reapable(&fake, handle);
    let waiting = pending(&fake, &[handle], &[2]);
    let active = manager.acquire(&[handle], CUDA).expect("acquired");
    enter(&manager);
    let left = manager.pending_among_with(&fake, [done, waiting, active, 999]);
    manager.exit();
    assert_eq!(left, Ok(vec![waiting]));
    assert_eq!(manager.lease_state(done), LeaseState::Unknown);
}

// ----- close ------------------------------------------------------------------------

#[test]
fn close_lets_the_objects_go_after_the_core_closed_then_forgets_the_tokens() {
    for closed_fails in [false, true] {
        let manager = Manager::new(&[]);
        let fake = Fake::new(&manager);
        let handle = value(&manager, CUDA);
        pending(&fake, &[handle], &[1]);
        fake.device.borrow_mut().closed_fails = closed_fails;
        enter(&manager);
        let closed = manager.close_with(&fake, false, true);
        manager.exit();
        assert!(manager.is_closed());
        assert_eq!(fake.steps(), vec!["closing", "closed"]);
        if closed_fails {
            // The objects' failure propagates; the token records are still known.
            assert_eq!(closed, Err(Failure::Device("closing the disk failed")));
            assert_eq!(manager.live_objects(), 1);
        } else {
            assert_eq!(closed, Ok(true));
            assert_eq!((fake.kept(), manager.live_objects()), (0, 0));
        }
    }
}

// ----- finalizer bookkeeping --------------------------------------------------------

#[test]
fn a_released_lease_is_no_longer_tracked_and_its_reference_goes() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, PINNED);
    let (first, second, third) = (
        manager.acquire(&[handle], PINNED).expect("acquired"),
        manager.acquire(&[handle], PINNED).expect("acquired"),
        manager.acquire(&[handle], PINNED).expect("acquired"),
    );
    let ids: Vec<ObjectId> = [first, second, third]
        .iter()
        .map(|&token| manager.track_lease(token, |_| {}))
        .collect();
    assert_eq!(manager.live_objects(), 3);
    // The waiting path (`release_token_with`) and the fast one (`release_now`).
    assert_eq!(
        manager.release_token_with(&fake, LifetimeKind::Lease, first, false),
        Ok(())
    );
    assert!(
        manager
            .release_now(LifetimeKind::Lease, second, |id| fake.forget(id))
            .is_some()
    );
    assert!(!manager.is_tracked(first) && !manager.is_tracked(second));
    assert_eq!(manager.tracked_leases(), vec![ids[2]]);
    assert_eq!(fake.device.borrow().freed.objects, vec![ids[0], ids[1]]);
    // A lease's release at its location does too.
    let released = manager.release_lease_with(&fake, third, PINNED, &[], false, false);
    assert_eq!(released, Ok(LeaseRelease::Released));
    assert!(!manager.is_tracked(third));
    assert_eq!(manager.live_objects(), 0);
}

#[test]
fn a_cuda_lease_pending_on_its_events_is_no_longer_tracked() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let token = manager.acquire(&[handle], CUDA).expect("acquired");
    manager.track_lease(token, |_| {});
    let released = manager.release_lease_with(&fake, token, CUDA, &[1], false, false);
    assert_eq!(released, Ok(LeaseRelease::Released));
    assert_eq!(manager.lease_state(token), LeaseState::Pending);
    assert!(!manager.is_tracked(token));
}

#[test]
fn a_lease_whose_release_failed_stays_tracked_for_its_finalizer() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let token = manager.acquire(&[handle], CUDA).expect("acquired");
    let id = manager.track_lease(token, |_| {});
    fake.device.borrow_mut().host_wait_fails = true;
    let released = manager.release_lease_with(&fake, token, CUDA, &[1], true, false);
    assert_eq!(released, Err(Failure::Device("wait failed")));
    assert!(manager.is_tracked(token));
    // A token release refused (on the thread whose source callback runs) too.
    enter(&manager);
    manager.begin_transition();
    manager.set_callback_active(true);
    let refused = manager.release_token_with(&fake, LifetimeKind::Lease, token, false);
    manager.set_callback_active(false);
    manager.end_transition();
    manager.exit();
    assert!(matches!(refused, Err(Failure::Core(_))), "{refused:?}");
    assert!(manager.is_tracked(token));
    assert_eq!(manager.tracked_leases(), vec![id]);
}

#[test]
fn a_collected_lease_is_finalized_once_and_only_while_tracked() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, PINNED);
    let (kept, released) = (
        manager.acquire(&[handle], PINNED).expect("acquired"),
        manager.acquire(&[handle], PINNED).expect("acquired"),
    );
    let id = manager.track_lease(kept, |_| {});
    manager.track_lease(released, |_| {});
    assert!(
        manager
            .release_now(LifetimeKind::Lease, released, |id| fake.forget(id))
            .is_some()
    );
    // Released already: nothing to finalize.
    assert!(!manager.finalize_tracked_with(&fake, released));
    assert!(manager.finalize_tracked_with(&fake, kept));
    assert!(fake.device.borrow().freed.objects.contains(&id));
    assert!(!manager.finalize_tracked_with(&fake, kept));
    assert_eq!(manager.live_objects(), 0);
}

#[test]
fn tracked_leases_come_oldest_first_and_outlive_a_close() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, PINNED);
    let tokens: Vec<u64> = (0..3)
        .map(|_| manager.acquire(&[handle], PINNED).expect("acquired"))
        .collect();
    let mut ids: Vec<(u64, ObjectId)> = tokens
        .iter()
        .rev()
        .map(|&token| (token, manager.track_lease(token, |_| {})))
        .collect();
    ids.sort_unstable();
    let oldest_first: Vec<ObjectId> = ids.iter().map(|&(_, id)| id).collect();
    assert_eq!(manager.tracked_leases(), oldest_first);
    enter(&manager);
    assert_eq!(manager.close_with(&fake, false, true), Ok(true));
    manager.exit();
    // The leases still alive are finalized at exit: the close forgets no tracking.
    assert_eq!(manager.tracked_leases(), oldest_first);
}

#[test]
fn tracking_a_lease_again_lets_its_former_id_go() {
    let manager = Manager::new(&[]);
    let handle = value(&manager, PINNED);
    let token = manager.acquire(&[handle], PINNED).expect("acquired");
    let former = manager.track_lease(token, |_| panic!("nothing tracked before"));
    let mut forgotten = Vec::new();
    let latter = manager.track_lease(token, |id| forgotten.push(id));
    assert_ne!(former, latter);
    assert_eq!(forgotten, vec![former]);
    assert_eq!(manager.tracked_leases(), vec![latter]);
    assert_eq!(manager.live_objects(), 1);
}

#[test]
fn an_untracked_leases_id_is_given_again_only_after_its_object_went() {
    let manager = Manager::new(&[]);
    let handle = value(&manager, PINNED);
    let token = manager.acquire(&[handle], PINNED).expect("acquired");
    let id = manager.track_lease(token, |_| {});
    // While its object is let go, a new record (an event another thread records, say)
    // gets another id: the object at the id is never one that record just kept.
    let mut given = None;
    assert!(manager.untrack_lease(token, |forgotten| {
        assert_eq!(forgotten, id);
        given = Some(manager.new_object());
    }));
    assert_ne!(given, Some(id));
    assert_eq!(manager.new_object(), id);
    // Again: not tracked any more.
    assert!(!manager.untrack_lease(token, |_| panic!("untracked already")));
    let again = manager.track_lease(token, |_| {});
    assert!(
        manager
            .release_now(LifetimeKind::Lease, token, |forgotten| {
                assert_eq!(forgotten, again);
                assert_ne!(manager.new_object(), again);
            })
            .is_some()
    );
}

#[test]
fn a_borrowed_lookup_reads_the_location_and_value_only_while_the_lease_covers_it() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let (leased, other) = (value(&manager, PINNED), value(&manager, PINNED));
    let token = manager.acquire(&[leased], PINNED).expect("acquired");
    let mut read = Vec::new();
    let mut borrowed = |handle: Option<HandleId>, known: Option<(HandleId, Location)>| {
        manager.borrowed_with(&fake, token, &handle, &PINNED, known, |index, at| {
            read.push((index, at));
            Some(index)
        })
    };
    assert_eq!(borrowed(Some(leased), None), Ok(Some(leased)));
    assert_eq!(borrowed(Some(other), None), Ok(None));
    assert_eq!(borrowed(None, None), Ok(None));
    // A known index and location are not looked up again.
    assert_eq!(borrowed(None, Some((leased, PINNED))), Ok(Some(leased)));
    assert_eq!(read, vec![(leased, PINNED), (leased, PINNED)]);
    assert_eq!(fake.steps(), vec!["lookup", "place", "lookup", "lookup"]);
    // A forced close ends what the lease borrows; the lookup is no closed-manager error.
    enter(&manager);
    manager.close(true).expect("closed");
    manager.exit();
    let after = manager.borrowed_with(&fake, token, &Some(leased), &PINNED, None, |_, _| Some(0));
    assert_eq!(after, Ok(None));
}

#[test]
fn a_finalizers_release_queued_behind_a_callback_untracks_the_lease_at_once() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, PINNED);
    let token = manager.acquire(&[handle], PINNED).expect("acquired");
    manager.track_lease(token, |_| {});
    enter(&manager);
    manager.begin_transition();
    manager.set_callback_active(true);
    let queued = manager.release_token_with(&fake, LifetimeKind::Lease, token, true);
    manager.set_callback_active(false);
    manager.end_transition();
    // Queued, not yet applied: the lease is still active, but no longer tracked (its
    // release is certain, and at exit nothing may finalize it a second time).
    assert_eq!(queued, Ok(()));
    assert!(manager.releases_queued());
    assert_eq!(manager.lease_state(token), LeaseState::Active);
    assert!(!manager.is_tracked(token));
    manager.reap_with(&fake).expect("reaped");
    manager.exit();
    assert_eq!(manager.lease_state(token), LeaseState::Unknown);
    assert_eq!(manager.live_objects(), 0);
}

#[test]
fn a_snapshot_reaps_the_completed_leases_before_it_observes() {
    let manager = Manager::new(&[]);
    let fake = Fake::new(&manager);
    let handle = value(&manager, CUDA);
    let quiet = manager.snapshot_with(&fake, |state| state.pending_leases);
    assert_eq!(quiet, Ok(0));
    let done = reapable(&fake, handle);
    let waiting = pending(&fake, &[handle], &[2]);
    let observed = manager.snapshot_with(&fake, |state| (state.pending_leases, state.version));
    // The completed lease is gone from what is observed; the other still protects.
    let (pending_leases, version) = observed.expect("observed");
    assert_eq!(pending_leases, 1);
    assert_eq!(manager.lease_state(done), LeaseState::Unknown);
    assert_eq!(manager.lease_state(waiting), LeaseState::Pending);
    assert_eq!(manager.reaped_version_with(&fake), Ok(version));
    fake.complete(2);
    assert_eq!(manager.reaped_version_with(&fake), Ok(version + 1));
    enter(&manager);
    manager.close(false).expect("closed");
    manager.exit();
    let closed = manager.snapshot_with(&fake, |state| state.version);
    assert!(matches!(closed, Err(Failure::Core(text)) if text.contains("closed")));
}
