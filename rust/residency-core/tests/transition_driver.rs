//! The transition driver (`Manager::transition`): the order of a transition's device
//! work, its charges, pending leases and commit, over a fake device; and, failing the
//! fake at each of its steps in turn, that every failure aborts to exactly the books,
//! records, protections and version it found, with nothing kept, installed or left in
//! flight on the device (docs/concepts/transitions.md).

#![allow(clippy::panic)] // Test assertions.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::{Accounts, accounts, books, spec};

use residency_core::{
    Action, Copied, CoreError, Freed, HandleId, HandleSlot, LeaseState, Location, Manager,
    Measured, ObjectId, Release, RunError, TransitionDevice, Transitioned,
};

const HOST: Location = Location::PageableHost;
const PINNED: Location = Location::PinnedHost;
const CUDA: Location = Location::Cuda(0);
const CUDA1: Location = Location::Cuda(1);

/// A device step, as the fake logs it and fails it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Resident(Location),
    Wait(usize),
    Load,
    Prepare,
    Defer,
    Copy(Location, Location, bool),
    Validate(Location),
    Synchronize(u32),
}

/// What the fake did besides its fallible steps.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Step(Step),
    KeepEvent(u32),
    KeepValue(Location),
    Free(usize),
    Install(Location),
    Forget(Location),
    Discarded(Vec<Location>),
}

/// A value on the fake device: where it is and its storage bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Value {
    at: Location,
    storage: u64,
}

/// What the disk tier does with a deferrable load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tier {
    /// The value has no source object to defer.
    NoSource,
    /// The tier declines (`load_to_cuda` gives `None`).
    Declines,
    /// The tier loads it straight to the destination.
    Takes,
}

#[derive(Debug, Clone, Copy)]
struct Config {
    /// Storage bytes the device measures for what it loads or copies, over the spec's
    /// charge by this much.
    oversize: u64,
    tier: Tier,
    /// The source is held once read, so it is protected while it is copied.
    hold_source: bool,
    /// A copy to CUDA reports an event even when it is not left in flight.
    eager_event: bool,
}

const PLAIN: Config = Config {
    oversize: 0,
    tier: Tier::NoSource,
    hold_source: false,
    eager_event: false,
};

struct Fake<'m> {
    manager: &'m Manager,
    config: Config,
    /// The fallible step (counted from 0) that fails.
    fail_at: Option<usize>,
    /// Every step after `fail_at` fails too.
    onward: bool,
    /// Handed to `release` as a finaliser's while `load()` runs (queued, since a
    /// callback is running).
    finalize: Option<Release>,
    steps: usize,
    calls: Vec<Call>,
    next_event: u32,
    /// Events made, and events host-waited for (or tried).
    events: BTreeSet<u32>,
    waited: BTreeSet<u32>,
    /// Objects kept at the core's ids.
    kept: BTreeMap<ObjectId, Call>,
    installed: BTreeMap<(HandleId, Location), Value>,
    /// Whether `load()` ran as a callback (the gate refused a call meanwhile).
    callback: Option<bool>,
    hold: Option<u64>,
}

impl<'m> Fake<'m> {
    fn new(manager: &'m Manager, config: Config, fail_at: Option<usize>) -> Self {
        Self {
            manager,
            config,
            fail_at,
            onward: false,
            finalize: None,
            steps: 0,
            calls: Vec::new(),
            next_event: 0,
            events: BTreeSet::new(),
            waited: BTreeSet::new(),
            kept: BTreeMap::new(),
            installed: BTreeMap::new(),
            callback: None,
            hold: None,
        }
    }

    fn step(&mut self, step: Step) -> Result<(), Step> {
        self.calls.push(Call::Step(step));
        let this = self.steps;
        self.steps += 1;
        if self.fail_at == Some(this) || (self.onward && self.fail_at.is_some_and(|at| this > at)) {
            Err(step)
        } else {
            Ok(())
        }
    }

    fn made(&self, index: HandleId, at: Location) -> Value {
        let charge = self
            .manager
            .value_spec(index)
            .expect("issued")
            .storage_nbytes();
        Value {
            at,
            storage: charge + self.config.oversize,
        }
    }

    fn event(&mut self) -> u32 {
        self.next_event += 1;
        self.events.insert(self.next_event);
        self.next_event
    }

    fn steps_taken(&self) -> Vec<Step> {
        self.calls
            .iter()
            .filter_map(|call| match call {
                Call::Step(step) => Some(*step),
                _ => None,
            })
            .collect()
    }
}

impl TransitionDevice for Fake<'_> {
    type Value = Value;
    type Event = u32;
    type Deferral = HandleId;
    type Error = Step;

    fn resident(&mut self, index: HandleId, at: Location) -> Result<Value, Step> {
        self.step(Step::Resident(at))?;
        if self.config.hold_source {
            self.hold = Some(self.manager.hold(&[index], at).expect("resident"));
        }
        Ok(self.made(index, at))
    }

    fn wait(&mut self, events: &[ObjectId]) -> Result<(), Step> {
        self.step(Step::Wait(events.len()))
    }

    fn load(&mut self, index: HandleId) -> Result<Value, Step> {
        let refused = match self.manager.try_enter(false, false) {
            Err(CoreError::Reentrancy { .. }) => true,
            Ok(entered) => {
                if entered {
                    self.manager.exit();
                }
                false
            }
            Err(other) => panic!("unexpected {other:?}"),
        };
        self.callback = Some(refused);
        if let Some(release) = self.finalize.take() {
            let mut freed = Freed::default();
            let manager = self.manager;
            manager
                .release(
                    release,
                    true,
                    |check| manager.enter(Duration::ZERO, false, check),
                    &mut freed,
                )
                .expect("queued");
            assert!(freed.is_empty() && manager.releases_queued(), "queued");
        }
        self.step(Step::Load)?;
        let state = self.manager.current();
        let source = state.values[usize::try_from(index).expect("small")]
            .source
            .expect("a source");
        Ok(self.made(index, source))
    }

    fn prepare_deferral(
        &mut self,
        index: HandleId,
        _at: Location,
    ) -> Result<Option<HandleId>, Step> {
        self.step(Step::Prepare)?;
        Ok((self.config.tier != Tier::NoSource).then_some(index))
    }

    fn defer(&mut self, index: HandleId) -> Result<Option<Copied<Value, u32>>, Step> {
        self.step(Step::Defer)?;
        if self.config.tier == Tier::Declines {
            return Ok(None);
        }
        let value = self.made(index, CUDA);
        Ok(Some(Copied {
            value,
            event: Some(self.event()),
        }))
    }

    fn copy(
        &mut self,
        value: &Value,
        from: Location,
        to: Location,
        in_flight: bool,
    ) -> Result<Copied<Value, u32>, Step> {
        assert_eq!(value.at, from, "a copy reads its source");
        self.step(Step::Copy(from, to, in_flight))?;
        let event = ((in_flight || self.config.eager_event) && matches!(to, Location::Cuda(_)))
            .then(|| self.event());
        Ok(Copied {
            value: Value { at: to, ..*value },
            event,
        })
    }

    fn validate(&mut self, index: HandleId, at: Location, value: &Value) -> Result<Measured, Step> {
        assert_eq!(value.at, at, "validated where it is");
        self.step(Step::Validate(at))?;
        let logical = self
            .manager
            .value_spec(index)
            .expect("issued")
            .logical_nbytes();
        Ok(Measured {
            logical_nbytes: logical,
            storage_nbytes: value.storage,
            keys: Vec::new(),
        })
    }

    fn synchronize(&mut self, event: &u32) -> Result<(), Step> {
        self.waited.insert(*event);
        self.step(Step::Synchronize(*event))
    }

    fn keep_event(&mut self, id: ObjectId, event: &u32) {
        self.calls.push(Call::KeepEvent(*event));
        assert!(self.kept.insert(id, Call::KeepEvent(*event)).is_none());
    }

    fn keep_value(&mut self, id: ObjectId, value: &Value) {
        self.calls.push(Call::KeepValue(value.at));
        assert!(self.kept.insert(id, Call::KeepValue(value.at)).is_none());
    }

    fn free(&mut self, freed: &Freed) {
        if freed.is_empty() {
            return;
        }
        self.calls.push(Call::Free(freed.objects.len()));
        for id in &freed.objects {
            assert!(self.kept.remove(id).is_some(), "frees what it kept");
        }
    }

    fn install(&mut self, index: HandleId, at: Location, value: Value) {
        self.calls.push(Call::Install(at));
        assert!(self.installed.insert((index, at), value).is_none());
    }

    fn forget(&mut self, _index: HandleId, at: Location) {
        self.calls.push(Call::Forget(at));
    }

    fn discarded(&mut self, _index: HandleId, removed: &[Location]) {
        self.calls.push(Call::Discarded(removed.to_vec()));
    }
}

/// A transition to drive: its manager and value as set up, the action, whether it
/// runs in a prefetch, and the fake's configuration.
struct Case {
    name: &'static str,
    setup: fn() -> (Manager, HandleId),
    action: Action,
    asynchronous: bool,
    config: Config,
}

fn ensure(at: Location) -> Action {
    Action::Ensure {
        handle: HandleSlot(0),
        location: at,
    }
}

fn moving(to: Location, from: Option<Location>) -> Action {
    Action::Move {
        handle: HandleSlot(0),
        to,
        from,
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

fn host_value() -> (Manager, HandleId) {
    let manager = Manager::new(&[(HOST, 100), (CUDA, 100)]);
    let value = adopted(&manager, 24, true, HOST);
    (manager, value)
}

fn pinned_value() -> (Manager, HandleId) {
    let manager = Manager::new(&[(CUDA, 100)]);
    let value = adopted(&manager, 16, false, PINNED);
    (manager, value)
}

fn source_only() -> (Manager, HandleId) {
    let manager = Manager::new(&[(HOST, 100), (CUDA, 100)]);
    let value = registered(&manager, 40, false, HOST);
    (manager, value)
}

/// A value whose only materialisation is a copy still in flight into CUDA 0.
fn arriving() -> (Manager, HandleId) {
    let (manager, value) = pinned_value();
    let mut fake = Fake::new(&manager, PLAIN, None);
    manager
        .transition(&ensure(CUDA), value, true, &mut fake)
        .expect("copies");
    let tokens = manager.pending_lease_tokens();
    let read = tokens
        .iter()
        .copied()
        .find(|token| manager.pending_lease_values(*token) == Some((vec![value], PINNED)))
        .expect("the read source is protected");
    assert!(manager.release_pending(read));
    assert!(
        manager
            .drop_materialization(value, PINNED)
            .expect("another copy")
    );
    assert_eq!(manager.transfer_events(&[value], CUDA).len(), 1);
    (manager, value)
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "ensure, a copy",
            setup: pinned_value,
            action: ensure(CUDA),
            asynchronous: false,
            config: PLAIN,
        },
        Case {
            name: "ensure in a prefetch, a copy left in flight",
            setup: pinned_value,
            action: ensure(CUDA),
            asynchronous: true,
            config: PLAIN,
        },
        Case {
            name: "ensure from a materialisation a copy is still writing",
            setup: arriving,
            action: ensure(HOST),
            asynchronous: false,
            config: PLAIN,
        },
        Case {
            name: "move with a source",
            setup: host_value,
            action: moving(CUDA, None),
            asynchronous: false,
            config: PLAIN,
        },
        Case {
            name: "reconstruction loaded at its destination",
            setup: source_only,
            action: moving(HOST, None),
            asynchronous: false,
            config: PLAIN,
        },
        Case {
            name: "reconstruction loaded elsewhere, then copied",
            setup: source_only,
            action: ensure(CUDA),
            asynchronous: false,
            config: PLAIN,
        },
        Case {
            name: "reconstruction in a prefetch, no source to defer, copied in flight",
            setup: source_only,
            action: ensure(CUDA),
            asynchronous: true,
            config: PLAIN,
        },
        Case {
            name: "reconstruction in a prefetch, the tier declines",
            setup: source_only,
            action: ensure(CUDA),
            asynchronous: true,
            config: Config {
                tier: Tier::Declines,
                ..PLAIN
            },
        },
        Case {
            name: "reconstruction in a prefetch, the tier loads it",
            setup: source_only,
            action: ensure(CUDA),
            asynchronous: true,
            config: Config {
                tier: Tier::Takes,
                ..PLAIN
            },
        },
    ]
}

/// The accounts, and how many objects the core's book holds.
type Before = (Accounts, usize);

fn found(manager: &Manager) -> Before {
    (accounts(manager), manager.live_objects())
}

fn prepared(case: &Case) -> (Manager, HandleId, Before) {
    let (manager, value) = (case.setup)();
    let before = found(&manager);
    (manager, value, before)
}

/// A transition's outcome.
fn did(no_op: bool, source: Option<Location>) -> Transitioned {
    Transitioned { no_op, source }
}

/// After a failed transition: the books as before, nothing kept, installed or
/// forgotten on the device, every event it made waited for, and the gate free of the
/// callback mark.
fn assert_aborted(manager: &Manager, fake: &Fake<'_>, before: &Before, context: &str) {
    assert_eq!(accounts(manager), before.0, "{context}");
    assert_eq!(
        manager.live_objects(),
        before.1,
        "{context}: objects left in the book"
    );
    assert!(fake.kept.is_empty(), "{context}: kept {:?}", fake.kept);
    assert!(fake.installed.is_empty(), "{context}");
    assert!(
        !fake
            .calls
            .iter()
            .any(|call| matches!(call, Call::Forget(_))),
        "{context}"
    );
    assert_eq!(fake.events, fake.waited, "{context}: left in flight");
    assert!(
        manager.try_enter(false, false).expect("no callback mark"),
        "{context}"
    );
    manager.exit();
}

#[test]
fn every_failing_device_step_aborts_to_the_books_it_found() {
    for case in cases() {
        let (manager, value, _) = prepared(&case);
        let mut fake = Fake::new(&manager, case.config, None);
        manager
            .transition(&case.action, value, case.asynchronous, &mut fake)
            .unwrap_or_else(|error| panic!("{}: {error:?}", case.name));
        let steps = fake.steps_taken();
        assert!(!steps.is_empty(), "{}", case.name);
        for (position, step) in steps.iter().enumerate() {
            let (manager, value, before) = prepared(&case);
            let mut fake = Fake::new(&manager, case.config, Some(position));
            let failed = manager.transition(&case.action, value, case.asynchronous, &mut fake);
            let context = format!("{}: failing {step:?}", case.name);
            assert_eq!(failed, Err(RunError::Device(*step)), "{context}");
            assert_aborted(&manager, &fake, &before, &context);
            if let Some(hold) = fake.hold {
                assert!(manager.release_hold(hold));
            }
        }
    }
}

#[test]
fn each_transition_does_its_device_work_in_order() {
    let expected: [&[Call]; 9] = [
        &[
            Call::Step(Step::Resident(PINNED)),
            Call::Step(Step::Copy(PINNED, CUDA, false)),
            Call::Step(Step::Validate(CUDA)),
            Call::Install(CUDA),
        ],
        &[
            Call::Step(Step::Resident(PINNED)),
            Call::Step(Step::Copy(PINNED, CUDA, true)),
            Call::Step(Step::Validate(CUDA)),
            Call::KeepEvent(1),
            Call::Install(CUDA),
        ],
        // The copy in flight into the source is waited for before it is read.
        &[
            Call::Step(Step::Wait(1)),
            Call::Step(Step::Resident(CUDA)),
            Call::Step(Step::Copy(CUDA, HOST, false)),
            Call::Step(Step::Validate(HOST)),
            Call::Install(HOST),
        ],
        // Install, then remove the source.
        &[
            Call::Step(Step::Resident(HOST)),
            Call::Step(Step::Copy(HOST, CUDA, false)),
            Call::Step(Step::Validate(CUDA)),
            Call::Install(CUDA),
            Call::Forget(HOST),
        ],
        &[
            Call::Step(Step::Load),
            Call::Step(Step::Validate(HOST)),
            Call::Install(HOST),
        ],
        &[
            Call::Step(Step::Load),
            Call::Step(Step::Validate(HOST)),
            Call::Step(Step::Copy(HOST, CUDA, false)),
            Call::Step(Step::Validate(CUDA)),
            Call::Install(CUDA),
        ],
        // The copy in flight keeps what it reads alive.
        &[
            Call::Step(Step::Prepare),
            Call::Step(Step::Load),
            Call::Step(Step::Validate(HOST)),
            Call::Step(Step::Copy(HOST, CUDA, true)),
            Call::Step(Step::Validate(CUDA)),
            Call::KeepEvent(1),
            Call::KeepValue(HOST),
            Call::Install(CUDA),
        ],
        &[
            Call::Step(Step::Prepare),
            Call::Step(Step::Defer),
            Call::Step(Step::Load),
            Call::Step(Step::Validate(HOST)),
            Call::Step(Step::Copy(HOST, CUDA, true)),
            Call::Step(Step::Validate(CUDA)),
            Call::KeepEvent(1),
            Call::KeepValue(HOST),
            Call::Install(CUDA),
        ],
        &[
            Call::Step(Step::Prepare),
            Call::Step(Step::Defer),
            Call::Step(Step::Validate(CUDA)),
            Call::KeepEvent(1),
            Call::Install(CUDA),
        ],
    ];
    for (case, expected) in cases().iter().zip(expected) {
        let (manager, value, _) = prepared(case);
        let earlier = manager.transfer_events(&[value], CUDA).len();
        let mut fake = Fake::new(&manager, case.config, None);
        let done = manager
            .transition(&case.action, value, case.asynchronous, &mut fake)
            .unwrap_or_else(|error| panic!("{}: {error:?}", case.name));
        assert_eq!(fake.calls, expected, "{}", case.name);
        assert!(!done.no_op, "{}", case.name);
        manager.check_books().expect("balanced");
        // Nothing charged temporarily is left, and what a copy in flight needs is
        // kept until it completes.
        for at in [HOST, PINNED, CUDA] {
            assert_eq!(books(&manager, at).reserved_bytes, 0, "{}", case.name);
        }
        let in_flight = fake.events.len() - fake.waited.len();
        assert_eq!(
            manager.transfer_events(&[value], CUDA).len(),
            earlier + in_flight,
            "{}",
            case.name
        );
        if fake.callback.is_some() {
            assert_eq!(
                fake.callback,
                Some(true),
                "{}: load() is a callback",
                case.name
            );
        }
    }
}

#[test]
fn a_copy_in_flight_is_protected_where_it_lands_and_where_it_reads() {
    let (manager, value) = pinned_value();
    let version = manager.version();
    let mut fake = Fake::new(&manager, PLAIN, None);
    let done = manager
        .transition(&ensure(CUDA), value, true, &mut fake)
        .expect("copies");
    assert_eq!(done, did(false, Some(PINNED)));
    let tokens = manager.pending_lease_tokens();
    assert_eq!(tokens.len(), 2);
    let protected: BTreeSet<_> = tokens
        .iter()
        .map(|token| manager.pending_lease_values(*token).expect("pending"))
        .collect();
    assert_eq!(
        protected,
        BTreeSet::from([(vec![value], CUDA), (vec![value], PINNED)])
    );
    assert_eq!(
        manager.version(),
        version + 5,
        "the install, and an acquire and a release on a stream per lease"
    );
    assert_eq!(fake.kept.len(), 1, "the event, shared by both leases");
    assert!(fake.waited.is_empty(), "not waited for");
    for token in tokens {
        assert!(manager.release_pending(token));
    }
    manager.check_books().expect("balanced");
}

#[test]
fn refusals_of_the_core_abort_and_wait_for_a_copy_in_flight() {
    // The copy measured above its charge: the commit refuses it, the event it kept
    // goes back, and the copy is waited for before the error propagates.
    let (manager, value) = pinned_value();
    let before = found(&manager);
    let oversized = Config {
        oversize: 1,
        ..PLAIN
    };
    let mut fake = Fake::new(&manager, oversized, None);
    let failed = manager.transition(&ensure(CUDA), value, true, &mut fake);
    assert!(matches!(
        failed,
        Err(RunError::Core(CoreError::Materialization { .. }))
    ));
    assert!(fake.calls.contains(&Call::Free(1)));
    assert_aborted(&manager, &fake, &before, "an oversized copy in flight");

    // A reconstruction loaded elsewhere, measured above its charge: `loaded`
    // refuses it before the copy, and the temporary charge goes back.
    let (manager, value) = source_only();
    let before = found(&manager);
    let mut fake = Fake::new(&manager, oversized, None);
    let failed = manager.transition(&ensure(CUDA), value, false, &mut fake);
    assert!(matches!(
        failed,
        Err(RunError::Core(CoreError::Materialization { .. }))
    ));
    assert_eq!(
        fake.steps_taken(),
        [Step::Load, Step::Validate(HOST)],
        "no copy"
    );
    assert_aborted(&manager, &fake, &before, "an oversized load");
    assert_eq!(
        books(&manager, HOST).peak_charged_bytes,
        40,
        "the peak stays"
    );

    // The tier's load is admitted at the destination first: refused there, nothing
    // is handed to the tier.
    let (manager, value) = source_only();
    let reservation = manager.reserve(CUDA, 80, "meanwhile").expect("fits");
    let before = found(&manager);
    let taking = Config {
        tier: Tier::Takes,
        ..PLAIN
    };
    let mut fake = Fake::new(&manager, taking, None);
    let failed = manager.transition(&ensure(CUDA), value, true, &mut fake);
    assert!(matches!(
        failed,
        Err(RunError::Core(CoreError::Budget { location: CUDA, .. }))
    ));
    assert_eq!(fake.steps_taken(), [Step::Prepare]);
    assert_aborted(&manager, &fake, &before, "a deferral over budget");
    assert!(manager.release_reservation(reservation));

    // A move's source protected while it was copied: the commit refuses before the
    // install, and the source stays.
    let (manager, value) = host_value();
    let held = Config {
        hold_source: true,
        ..PLAIN
    };
    let mut fake = Fake::new(&manager, held, None);
    let failed = manager.transition(&moving(CUDA, None), value, false, &mut fake);
    assert!(matches!(
        failed,
        Err(RunError::Core(CoreError::InUse { holds: 1, .. }))
    ));
    assert!(fake.installed.is_empty());
    assert!(manager.release_hold(fake.hold.expect("held")));
    assert_eq!(
        manager.materialization_locations(value).expect("issued"),
        [HOST]
    );
    assert_eq!(books(&manager, CUDA).used_bytes, 0);
    manager.check_books().expect("balanced");
}

#[test]
fn no_ops_removals_drops_and_discards_need_no_device_work() {
    let manager = Manager::new(&[]);
    let value = adopted(&manager, 8, false, HOST);
    manager
        .install(value, CUDA1, 8, 8, &[], false)
        .expect("replicable");
    let before = accounts(&manager);
    let mut fake = Fake::new(&manager, PLAIN, None);
    let cases = [(ensure(HOST), None), (moving(HOST, Some(HOST)), Some(HOST))];
    for (action, source) in cases {
        let done = manager
            .transition(&action, value, false, &mut fake)
            .expect("no-op");
        assert_eq!(done, did(true, source));
    }
    assert_eq!(accounts(&manager), before);
    assert!(fake.calls.is_empty());

    // A move onto a replica only removes its source.
    let done = manager
        .transition(&moving(CUDA1, None), value, false, &mut fake)
        .expect("removes");
    assert_eq!(done, did(false, Some(HOST)));
    assert_eq!(fake.calls, [Call::Forget(HOST)]);
    assert_eq!(manager.version(), before.version + 1);

    let drop = Action::Drop {
        handle: HandleSlot(0),
        location: HOST,
    };
    let done = manager
        .transition(&drop, value, false, &mut fake)
        .expect("absent");
    assert_eq!(done, did(true, Some(HOST)));
    // The last copy of a value with no source cannot be dropped: nothing forgotten.
    let drop_last = Action::Drop {
        handle: HandleSlot(0),
        location: CUDA1,
    };
    assert!(matches!(
        manager.transition(&drop_last, value, false, &mut fake),
        Err(RunError::Core(CoreError::Ownership { .. }))
    ));
    assert_eq!(fake.calls, [Call::Forget(HOST)]);

    let discard = Action::Discard {
        handle: HandleSlot(0),
    };
    let done = manager
        .transition(&discard, value, false, &mut fake)
        .expect("unprotected");
    assert_eq!(done, did(false, None));
    assert_eq!(fake.calls.last(), Some(&Call::Discarded(vec![CUDA1])));
    assert!(matches!(
        manager.transition(&discard, value, false, &mut fake),
        Err(RunError::Core(CoreError::Handle { .. }))
    ));
}

#[test]
fn a_failed_wait_after_a_failure_keeps_the_first_error_and_the_books() {
    // The copy in flight fails its validation, and then the wait for it fails too:
    // the validation's error propagates, and the books are as before.
    let (manager, value) = pinned_value();
    let before = found(&manager);
    let mut fake = Fake::new(&manager, PLAIN, Some(2));
    fake.onward = true;
    let failed = manager.transition(&ensure(CUDA), value, true, &mut fake);
    assert_eq!(failed, Err(RunError::Device(Step::Validate(CUDA))));
    assert_eq!(
        fake.steps_taken(),
        [
            Step::Resident(PINNED),
            Step::Copy(PINNED, CUDA, true),
            Step::Validate(CUDA),
            Step::Synchronize(1),
        ]
    );
    assert_aborted(
        &manager,
        &fake,
        &before,
        "a failed validation, then a failed wait",
    );

    // The same after a refused commit (an oversized copy in flight).
    let (manager, value) = pinned_value();
    let before = found(&manager);
    let oversized = Config {
        oversize: 1,
        ..PLAIN
    };
    let mut fake = Fake::new(&manager, oversized, Some(3));
    let failed = manager.transition(&ensure(CUDA), value, true, &mut fake);
    assert!(matches!(
        failed,
        Err(RunError::Core(CoreError::Materialization { .. }))
    ));
    assert_eq!(fake.steps_taken().last(), Some(&Step::Synchronize(1)));
    assert_aborted(
        &manager,
        &fake,
        &before,
        "a refused commit, then a failed wait",
    );
}

#[test]
fn refused_commits_of_reconstructions_in_flight_free_what_they_kept() {
    // The tier's load measured above its charge: the commit refuses it, its event
    // goes back and is waited for, and the temporary charge goes back.
    let (manager, value) = source_only();
    let before = found(&manager);
    let config = Config {
        tier: Tier::Takes,
        oversize: 1,
        ..PLAIN
    };
    let mut fake = Fake::new(&manager, config, None);
    let failed = manager.transition(&ensure(CUDA), value, true, &mut fake);
    assert!(matches!(
        failed,
        Err(RunError::Core(CoreError::Materialization { .. }))
    ));
    assert_eq!(
        fake.steps_taken(),
        [
            Step::Prepare,
            Step::Defer,
            Step::Validate(CUDA),
            Step::Synchronize(1)
        ]
    );
    assert!(fake.calls.contains(&Call::Free(1)));
    assert_aborted(&manager, &fake, &before, "an oversized deferred load");
    assert_eq!(
        books(&manager, HOST).peak_charged_bytes,
        40,
        "the peak stays"
    );

    // A reconstruction copied on in flight, whose destination filled meanwhile:
    // the commit refuses, and the event and the loaded value it kept both go back.
    let (manager, value) = source_only();
    let (mut accounts_before, objects) = found(&manager);
    let mut fake = Fake::new(&manager, PLAIN, None);
    let mut taken = None;
    let failed = {
        let mut crowding = Crowding {
            fake: &mut fake,
            taken: &mut taken,
        };
        manager.transition(&ensure(CUDA), value, true, &mut crowding)
    };
    assert!(matches!(
        failed,
        Err(RunError::Core(CoreError::Budget { location: CUDA, .. }))
    ));
    assert!(manager.release_reservation(taken.expect("crowded")));
    assert!(fake.calls.contains(&Call::Free(2)), "{:?}", fake.calls);
    // The reservation made and released meanwhile: two version steps.
    accounts_before.version += 2;
    let before = (accounts_before, objects);
    assert_aborted(&manager, &fake, &before, "a crowded destination");
}

/// The fake, with the destination's free budget reserved elsewhere right after a
/// copy (as a release of a reservation and a new one could while a copy runs).
struct Crowding<'f, 'm> {
    fake: &'f mut Fake<'m>,
    taken: &'f mut Option<u64>,
}

impl TransitionDevice for Crowding<'_, '_> {
    type Value = Value;
    type Event = u32;
    type Deferral = HandleId;
    type Error = Step;

    fn resident(&mut self, index: HandleId, at: Location) -> Result<Value, Step> {
        self.fake.resident(index, at)
    }
    fn wait(&mut self, events: &[ObjectId]) -> Result<(), Step> {
        self.fake.wait(events)
    }
    fn load(&mut self, index: HandleId) -> Result<Value, Step> {
        self.fake.load(index)
    }
    fn prepare_deferral(
        &mut self,
        index: HandleId,
        at: Location,
    ) -> Result<Option<HandleId>, Step> {
        self.fake.prepare_deferral(index, at)
    }
    fn defer(&mut self, index: HandleId) -> Result<Option<Copied<Value, u32>>, Step> {
        self.fake.defer(index)
    }
    fn copy(
        &mut self,
        value: &Value,
        from: Location,
        to: Location,
        in_flight: bool,
    ) -> Result<Copied<Value, u32>, Step> {
        let copied = self.fake.copy(value, from, to, in_flight)?;
        let books = books(self.fake.manager, to);
        let free = books.budget_bytes.expect("budgeted") - books.used_bytes - books.reserved_bytes;
        *self.taken = Some(
            self.fake
                .manager
                .reserve(to, free, "meanwhile")
                .expect("fits"),
        );
        Ok(copied)
    }
    fn validate(&mut self, index: HandleId, at: Location, value: &Value) -> Result<Measured, Step> {
        self.fake.validate(index, at, value)
    }
    fn synchronize(&mut self, event: &u32) -> Result<(), Step> {
        self.fake.synchronize(event)
    }
    fn keep_event(&mut self, id: ObjectId, event: &u32) {
        self.fake.keep_event(id, event);
    }
    fn keep_value(&mut self, id: ObjectId, value: &Value) {
        self.fake.keep_value(id, value);
    }
    fn free(&mut self, freed: &Freed) {
        self.fake.free(freed);
    }
    fn install(&mut self, index: HandleId, at: Location, value: Value) {
        self.fake.install(index, at, value);
    }
    fn forget(&mut self, index: HandleId, at: Location) {
        self.fake.forget(index, at);
    }
    fn discarded(&mut self, index: HandleId, removed: &[Location]) {
        self.fake.discarded(index, removed);
    }
}

#[test]
fn a_copy_not_left_in_flight_is_waited_for_after_its_commit() {
    // A device that reports an event for a copy the ticket did not leave in flight:
    // the commit hands the event back, and the copy is waited for.
    let (manager, value) = pinned_value();
    let eager = Config {
        eager_event: true,
        ..PLAIN
    };
    let mut fake = Fake::new(&manager, eager, None);
    manager
        .transition(&ensure(CUDA), value, false, &mut fake)
        .expect("copies");
    assert_eq!(
        fake.calls,
        [
            Call::Step(Step::Resident(PINNED)),
            Call::Step(Step::Copy(PINNED, CUDA, false)),
            Call::Step(Step::Validate(CUDA)),
            Call::KeepEvent(1),
            Call::Free(1),
            Call::Install(CUDA),
            Call::Step(Step::Synchronize(1)),
        ]
    );
    assert!(fake.kept.is_empty() && manager.live_objects() == 0);
    assert!(manager.pending_lease_tokens().is_empty());

    // That wait failing is the transition's error; the commit stands, with nothing
    // left in the object book or pending.
    let (manager, value) = pinned_value();
    let mut fake = Fake::new(&manager, eager, Some(3));
    let failed = manager.transition(&ensure(CUDA), value, false, &mut fake);
    assert_eq!(failed, Err(RunError::Device(Step::Synchronize(1))));
    assert_eq!(
        manager.materialization_locations(value).expect("issued"),
        [PINNED, CUDA]
    );
    assert!(fake.installed.contains_key(&(value, CUDA)));
    assert!(fake.kept.is_empty() && manager.live_objects() == 0);
    assert!(manager.pending_lease_tokens().is_empty());
    manager.check_books().expect("balanced");
}

#[test]
fn releases_queued_while_a_source_loads_are_applied_after_it_even_when_it_fails() {
    for failing in [None, Some(0)] {
        let (manager, value) = source_only();
        let other = adopted(&manager, 8, false, CUDA);
        let lease = manager.acquire(&[other], CUDA).expect("resident");
        // A finaliser releases the lease, its events known complete, while the
        // source loads: queued behind the callback, applied after it.
        let event = manager.new_object();
        let mut fake = Fake::new(&manager, PLAIN, failing);
        assert!(fake.kept.insert(event, Call::KeepEvent(0)).is_none());
        fake.finalize = Some(Release::Pending {
            token: lease,
            events: vec![event],
            completed: true,
        });
        let done = manager.transition(&moving(HOST, None), value, false, &mut fake);
        assert_eq!(done.is_ok(), failing.is_none(), "{done:?}");
        assert!(!manager.releases_queued(), "failing at {failing:?}");
        assert_eq!(manager.lease_state(lease), LeaseState::Unknown);
        assert!(fake.kept.is_empty(), "the event went back to the device");
        assert_eq!(manager.live_objects(), 0);
        manager.check_books().expect("balanced");
    }
}

#[test]
fn a_reconstruction_loaded_elsewhere_is_admitted_at_its_destination_after_the_load() {
    // Begin charges only where the source loads; the destination, full meanwhile,
    // refuses once the load is validated: no copy, and the charge goes back.
    let (manager, value) = source_only();
    let reservation = manager.reserve(CUDA, 80, "meanwhile").expect("fits");
    let before = found(&manager);
    let mut fake = Fake::new(&manager, PLAIN, None);
    let failed = manager.transition(&ensure(CUDA), value, false, &mut fake);
    assert!(matches!(
        failed,
        Err(RunError::Core(CoreError::Budget { location: CUDA, .. }))
    ));
    assert_eq!(fake.steps_taken(), [Step::Load, Step::Validate(HOST)]);
    assert_aborted(
        &manager,
        &fake,
        &before,
        "a destination full after the load",
    );
    assert_eq!(
        books(&manager, HOST).peak_charged_bytes,
        40,
        "the peak stays"
    );
    assert!(manager.release_reservation(reservation));
}
