//! Plan runs (docs/concepts/plans.md#phase-order): the order of the checks, the
//! phases, and what a run leaves at every point where it can stop. A stale version
//! or an infeasible preflight stops before anything runs; a failed action keeps the
//! committed prefix; a failed scope entry gives back every reservation it admitted,
//! newest first, to the byte; a scope exit gives them back even when an action
//! fails. The device side here performs each action through the core's transition
//! driver (`Manager::transition`), over a fake device whose copy fails where told.

#![allow(clippy::panic)] // Test assertions.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::spec;

use residency_core::{
    Action, Copied, CoreError, CudaDevices, Device, Freed, HandleId, HandleRef, HandleSlot, Inputs,
    Location, Manager, Measured, ObjectId, Plan, PlanDevice, PlanPhase, PlanRun, Reservation,
    RunError, SlotResolution, TransitionDevice,
};

const HOST: Location = Location::PageableHost;
const CUDA: Location = Location::Cuda(0);

/// What completes while the device side reaps.
type OnReap = Box<dyn FnMut(&Manager)>;

/// A device side that performs actions through the transition driver, records every
/// call in order, and fails where it is told to.
struct Fake<'m> {
    manager: &'m Manager,
    /// The plan's handle slots' values.
    values: Vec<HandleId>,
    expected: Option<u64>,
    /// The action whose device work fails (its copy, after the transition began: the
    /// driver aborts it; a drop fails before it begins).
    fail: Option<(PlanPhase, usize)>,
    /// The reservation position refused at admission.
    refuse: Option<usize>,
    /// Run at the reap: what completed in the meantime (changes the version).
    on_reap: Option<OnReap>,
    /// What its inputs say of the preflight simulation (`Inputs::simulated`).
    simulated: bool,
    calls: Vec<String>,
    released: Vec<u64>,
    copier: Copier<'m>,
}

impl<'m> Fake<'m> {
    fn new(manager: &'m Manager, values: &[HandleId]) -> Self {
        let copier = Copier {
            manager,
            failing: false,
            installed: BTreeSet::new(),
            forgotten: Vec::new(),
        };
        Self {
            manager,
            values: values.to_vec(),
            expected: None,
            fail: None,
            refuse: None,
            on_reap: None,
            simulated: false,
            calls: Vec::new(),
            released: Vec::new(),
            copier,
        }
    }

    fn performed(&self) -> Vec<&str> {
        self.calls
            .iter()
            .filter(|call| call.starts_with("perform"))
            .map(String::as_str)
            .collect()
    }
}

/// The device work of a transition over plain data: copies (measured at the spec's
/// bytes) that fail while `failing`, and the materialisations it holds.
struct Copier<'m> {
    manager: &'m Manager,
    failing: bool,
    /// What it copied and installed, and what the driver had it forget.
    installed: BTreeSet<(HandleId, Location)>,
    forgotten: Vec<(HandleId, Location)>,
}

/// The copy failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CopyFailed;

impl TransitionDevice for Copier<'_> {
    type Value = (HandleId, Location);
    type Event = ();
    type Deferral = ();
    type Error = CopyFailed;

    fn resident(&mut self, index: HandleId, at: Location) -> Result<Self::Value, CopyFailed> {
        assert!(
            self.manager
                .materialization_locations(index)
                .expect("issued")
                .contains(&at),
            "reads a materialisation"
        );
        Ok((index, at))
    }

    fn wait(&mut self, _events: &[ObjectId]) -> Result<(), CopyFailed> {
        panic!("no copies in flight in these tests")
    }

    fn load(&mut self, _index: HandleId) -> Result<Self::Value, CopyFailed> {
        panic!("no sources in these tests")
    }

    fn prepare_deferral(
        &mut self,
        _index: HandleId,
        _at: Location,
    ) -> Result<Option<()>, CopyFailed> {
        panic!("no sources in these tests")
    }

    fn defer(&mut self, (): ()) -> Result<Option<Copied<Self::Value, ()>>, CopyFailed> {
        panic!("no sources in these tests")
    }

    fn copy(
        &mut self,
        &(index, at): &Self::Value,
        from: Location,
        to: Location,
        in_flight: bool,
    ) -> Result<Copied<Self::Value, ()>, CopyFailed> {
        assert_eq!(at, from, "a copy reads its source");
        assert!(!in_flight, "no prefetches in these tests");
        if self.failing {
            return Err(CopyFailed);
        }
        Ok(Copied {
            value: (index, to),
            event: None,
        })
    }

    fn validate(
        &mut self,
        index: HandleId,
        at: Location,
        value: &Self::Value,
    ) -> Result<Measured, CopyFailed> {
        assert_eq!(*value, (index, at), "validated where it is");
        let spec = self.manager.value_spec(index).expect("issued");
        Ok(Measured {
            logical_nbytes: spec.logical_nbytes(),
            storage_nbytes: spec.storage_nbytes(),
            keys: Vec::new(),
        })
    }

    fn synchronize(&mut self, (): &()) -> Result<(), CopyFailed> {
        panic!("no copies in flight in these tests")
    }

    fn keep_event(&mut self, _id: ObjectId, (): &()) {
        panic!("no copies in flight in these tests")
    }

    fn keep_value(&mut self, _id: ObjectId, _value: &Self::Value) {
        panic!("no copies in flight in these tests")
    }

    fn free(&mut self, freed: &Freed) {
        assert!(freed.objects.is_empty(), "keeps no objects");
    }

    fn install(&mut self, index: HandleId, at: Location, value: Self::Value) {
        assert_eq!(value, (index, at));
        assert!(self.installed.insert(value), "installed twice");
    }

    fn forget(&mut self, index: HandleId, at: Location) {
        self.installed.remove(&(index, at));
        self.forgotten.push((index, at));
    }

    fn discarded(&mut self, index: HandleId, removed: &[Location]) {
        for &at in removed {
            self.forget(index, at);
        }
    }
}

impl Device for Fake<'_> {
    type Done = (PlanPhase, usize);
    type Error = CoreError;

    fn perform(
        &mut self,
        phase: PlanPhase,
        position: usize,
        action: &Action,
        index: Option<HandleId>,
    ) -> Result<(PlanPhase, usize), CoreError> {
        self.calls.push(format!("perform {phase} {position}"));
        // An exit resolves its own handle.
        let index = index.unwrap_or(self.values[action.handle().index()]);
        let failing = self.fail == Some((phase, position));
        if failing && matches!(action, Action::Drop { .. }) {
            return Err(CoreError::Unavailable {
                message: "the drop failed".to_owned(),
            });
        }
        self.copier.failing = failing;
        match self
            .manager
            .transition(action, index, false, &mut self.copier)
        {
            Ok(_) => Ok((phase, position)),
            Err(RunError::Core(error)) => Err(error),
            Err(RunError::Device(CopyFailed)) => Err(CoreError::Unavailable {
                message: "the copy failed".to_owned(),
            }),
        }
    }
}

impl PlanDevice for Fake<'_> {
    fn reap(&mut self) -> Result<(), CoreError> {
        self.calls.push("reap".to_owned());
        if let Some(on_reap) = self.on_reap.as_mut() {
            on_reap(self.manager);
        }
        Ok(())
    }

    fn expected_version(&mut self) -> Result<Option<u64>, CoreError> {
        self.calls.push("version".to_owned());
        Ok(self.expected)
    }

    fn inputs(&mut self) -> Result<Inputs, CoreError> {
        self.calls.push("inputs".to_owned());
        Ok(Inputs {
            slots: self.values.iter().map(|&index| Ok(index)).collect(),
            cuda: CudaDevices::Count(1),
            labels: Vec::new(),
            simulated: self.simulated,
        })
    }

    fn reserve(&mut self, position: usize, reservation: &Reservation) -> Result<u64, CoreError> {
        self.calls.push(format!("reserve {position}"));
        if self.refuse == Some(position) {
            // As the binding refuses a byte count past 2**64 - 1, which the
            // simulation saturates (and an unbudgeted location admits).
            return Err(CoreError::InvalidArgument {
                message: "nbytes exceeds the supported maximum".to_owned(),
            });
        }
        self.manager
            .reserve(reservation.location, reservation.nbytes, &reservation.label)
    }

    fn release(&mut self, token: u64) {
        self.calls.push(format!("release {token}"));
        assert!(
            self.manager.release_reservation(token),
            "token {token} held"
        );
        self.released.push(token);
    }
}

fn adopted(manager: &Manager, bytes: u64, at: Location) -> HandleId {
    manager
        .adopt(1, spec(bytes, false, false), at, bytes, &[])
        .expect("adopts")
        .0
}

fn handles(manager: &Manager, count: usize) -> Vec<HandleRef> {
    (0..count)
        .map(|slot| HandleRef {
            manager_id: Arc::clone(manager.manager_id()),
            handle_id: Arc::from(format!("slot-{slot}")),
            type_key: 1,
        })
        .collect()
}

fn slot(index: u32) -> HandleSlot {
    HandleSlot(index)
}

fn ensure(index: u32, location: Location) -> Action {
    Action::Ensure {
        handle: slot(index),
        location,
    }
}

fn drop_at(index: u32, location: Location) -> Action {
    Action::Drop {
        handle: slot(index),
        location,
    }
}

fn reservation(location: Location, nbytes: u64, label: &str) -> Reservation {
    Reservation {
        location,
        nbytes,
        label: Arc::from(label),
    }
}

fn plan(
    manager: &Manager,
    slots: usize,
    reclaim: Vec<Action>,
    enter: Vec<Action>,
    exit: Vec<Action>,
    reservations: Vec<Reservation>,
) -> Arc<Plan> {
    Arc::new(
        Plan::new(
            "plan",
            handles(manager, slots),
            reclaim,
            enter,
            exit,
            reservations,
        )
        .expect("a valid plan"),
    )
}

fn resident(manager: &Manager, index: HandleId, at: Location) -> bool {
    manager
        .materialization_locations(index)
        .expect("issued")
        .contains(&at)
}

/// The books a failed entry must leave reserved as it found them (and balanced).
fn reserved(manager: &Manager, at: Location) -> u64 {
    manager.check_books().expect("books balance");
    manager.current().books(at).reserved_bytes
}

// ----- the checks -------------------------------------------------------------------

#[test]
fn the_checks_run_in_order_then_the_phases() {
    let manager = Manager::new(&[(CUDA, 100)]);
    let value = adopted(&manager, 10, HOST);
    let plan = plan(
        &manager,
        1,
        vec![],
        vec![ensure(0, CUDA)],
        vec![drop_at(0, CUDA)],
        vec![reservation(CUDA, 30, "workspace")],
    );
    let mut device = Fake::new(&manager, &[value]);
    let mut run = PlanRun::new();
    run.enter(&manager, &plan, &mut device).expect("enters");
    assert_eq!(
        device.calls,
        ["reap", "version", "inputs", "reserve 0", "perform enter 0"]
    );
    assert_eq!(run.phase(), Some(PlanPhase::Enter));
    assert_eq!(run.done(), [(PlanPhase::Enter, 0)]);
    assert_eq!(run.tokens().len(), 1);
    assert_eq!(reserved(&manager, CUDA), 30);
    assert!(resident(&manager, value, CUDA));

    run.exit(&mut device).expect("exits");
    assert_eq!(run.phase(), Some(PlanPhase::Exit));
    assert_eq!(run.done().len(), 2);
    assert!(run.tokens().is_empty());
    assert_eq!(reserved(&manager, CUDA), 0);
    assert!(!resident(&manager, value, CUDA));
    // The device forgot the copy the entry installed at the exit's drop.
    assert!(device.copier.installed.is_empty());
    assert_eq!(device.copier.forgotten, [(value, CUDA)]);
}

#[test]
fn a_stale_version_stops_the_run_before_anything() {
    let manager = Manager::new(&[(CUDA, 100)]);
    let value = adopted(&manager, 10, HOST);
    let plan = plan(&manager, 1, vec![], vec![ensure(0, CUDA)], vec![], vec![]);
    let before = manager.version();
    let mut device = Fake::new(&manager, &[value]);
    device.expected = Some(before);
    // The reap releases something meanwhile: the version checked is the one after.
    let hold = manager.hold(&[value], HOST).expect("resident");
    device.on_reap = Some(Box::new(move |manager: &Manager| {
        assert!(manager.release_hold(hold));
    }));
    let after_hold = manager.version();
    let mut run: PlanRun<(PlanPhase, usize)> = PlanRun::new();
    let stopped = run.execute(&manager, &plan, &mut device);
    let actual = manager.version();
    assert_eq!(actual, after_hold + 1, "the reap ran first");
    assert_eq!(
        stopped,
        Err(RunError::Core(CoreError::StaleState {
            expected_version: before,
            actual_version: actual,
        }))
    );
    assert_eq!(device.calls, ["reap", "version"]);
    assert_eq!(run.phase(), None);
    assert!(run.done().is_empty());
    assert!(!resident(&manager, value, CUDA));

    // The version read after the reap is the one to expect.
    let mut device = Fake::new(&manager, &[value]);
    device.expected = Some(actual);
    PlanRun::new()
        .execute(&manager, &plan, &mut device)
        .expect("the current version runs");
    assert!(resident(&manager, value, CUDA));
}

#[test]
fn an_infeasible_preflight_raises_the_simulations_reason_and_runs_nothing() {
    let manager = Manager::new(&[(CUDA, 100)]);
    let small = adopted(&manager, 40, HOST);
    let large = adopted(&manager, 70, HOST);
    let plan = plan(
        &manager,
        2,
        vec![],
        vec![ensure(0, CUDA), ensure(1, CUDA)],
        vec![],
        vec![reservation(CUDA, 5, "scratch")],
    );
    let slots: Vec<SlotResolution> = vec![Ok(small), Ok(large)];
    let simulation = manager.simulate(&plan, &slots, CudaDevices::Count(1), &[], &[]);
    assert!(!simulation.feasible);
    let reason = simulation
        .reason
        .expect("an infeasible simulation says why");
    let version = manager.version();

    let mut device = Fake::new(&manager, &[small, large]);
    let mut run = PlanRun::new();
    let stopped = run.enter(&manager, &plan, &mut device);
    assert_eq!(
        stopped,
        Err(RunError::Core(CoreError::Plan { message: reason }))
    );
    assert_eq!(device.calls, ["reap", "version", "inputs"]);
    assert_eq!(run.phase(), None);
    assert!(run.tokens().is_empty());
    assert_eq!(manager.version(), version, "nothing changed");
    assert_eq!(reserved(&manager, CUDA), 0);
    assert!(!resident(&manager, small, CUDA));
}

#[test]
fn inputs_that_were_simulated_already_skip_only_the_preflight_simulation() {
    // The caller vouches that it simulated this very plan at this state (a staging's
    // decide): the run does not simulate it again, and the transitions' own checks
    // still refuse what does not fit.
    let manager = Manager::new(&[(CUDA, 100)]);
    let small = adopted(&manager, 40, HOST);
    let large = adopted(&manager, 70, HOST);
    let plan = plan(
        &manager,
        2,
        vec![],
        vec![ensure(0, CUDA), ensure(1, CUDA)],
        vec![],
        vec![],
    );
    let slots: Vec<SlotResolution> = vec![Ok(small), Ok(large)];
    assert!(
        !manager
            .simulate(&plan, &slots, CudaDevices::Count(1), &[], &[])
            .feasible
    );

    let mut device = Fake::new(&manager, &[small, large]);
    assert!(
        PlanRun::new()
            .execute(&manager, &plan, &mut device)
            .is_err()
    );
    assert!(device.performed().is_empty(), "the preflight refused it");

    let mut device = Fake::new(&manager, &[small, large]);
    device.simulated = true;
    let stopped = PlanRun::new().execute(&manager, &plan, &mut device);
    assert!(stopped.is_err(), "the second ensure does not fit");
    assert_eq!(
        device.performed(),
        ["perform execute 0", "perform execute 1"]
    );
    assert!(
        resident(&manager, small, CUDA),
        "the committed prefix stays"
    );
    assert!(!resident(&manager, large, CUDA));
}

// ----- failures inside the phases ---------------------------------------------------

#[test]
fn an_execute_failure_keeps_the_committed_prefix() {
    let manager = Manager::new(&[(CUDA, 100)]);
    let values: Vec<HandleId> = (0..3).map(|_| adopted(&manager, 10, HOST)).collect();
    let plan = plan(
        &manager,
        3,
        vec![],
        vec![ensure(0, CUDA), ensure(1, CUDA), ensure(2, CUDA)],
        vec![],
        vec![],
    );
    let mut device = Fake::new(&manager, &values);
    device.fail = Some((PlanPhase::Execute, 2));
    let mut run = PlanRun::new();
    let stopped = run.execute(&manager, &plan, &mut device);
    assert!(matches!(
        stopped,
        Err(RunError::Device(CoreError::Unavailable { .. }))
    ));
    assert_eq!(run.phase(), Some(PlanPhase::Execute));
    assert_eq!(run.position(), 2);
    assert_eq!(
        run.done(),
        [(PlanPhase::Execute, 0), (PlanPhase::Execute, 1)]
    );
    // Not transactional: the first two stay; the failed one left nothing charged.
    assert!(resident(&manager, values[0], CUDA));
    assert!(resident(&manager, values[1], CUDA));
    assert!(!resident(&manager, values[2], CUDA));
    manager.check_books().expect("books balance");
    assert_eq!(manager.current().books(CUDA).used_bytes, 20);
    // The device keeps the two copies it committed, not the failed one.
    assert_eq!(
        device.copier.installed,
        BTreeSet::from([(values[0], CUDA), (values[1], CUDA)])
    );
}

#[test]
fn a_failed_reclaim_action_admits_no_reservation() {
    let manager = Manager::new(&[(CUDA, 100)]);
    let old = adopted(&manager, 30, HOST);
    let other = adopted(&manager, 30, HOST);
    let new = adopted(&manager, 10, HOST);
    let mut setup = Fake::new(&manager, &[old, other]);
    let resident_both = plan(
        &manager,
        2,
        vec![],
        vec![ensure(0, CUDA), ensure(1, CUDA)],
        vec![],
        vec![],
    );
    PlanRun::new()
        .execute(&manager, &resident_both, &mut setup)
        .expect("both fit");

    let plan = plan(
        &manager,
        3,
        vec![drop_at(0, CUDA), drop_at(1, CUDA)],
        vec![ensure(2, CUDA)],
        vec![],
        vec![reservation(CUDA, 50, "workspace")],
    );
    let mut device = Fake::new(&manager, &[old, other, new]);
    device.fail = Some((PlanPhase::Reclaim, 1));
    let mut run = PlanRun::new();
    assert!(run.enter(&manager, &plan, &mut device).is_err());
    assert_eq!(run.phase(), Some(PlanPhase::Reclaim));
    assert_eq!(run.position(), 1);
    assert_eq!(run.done(), [(PlanPhase::Reclaim, 0)]);
    assert!(!device.calls.iter().any(|call| call.starts_with("reserve")));
    assert!(device.released.is_empty());
    assert_eq!(reserved(&manager, CUDA), 0);
    // The first reclaim stays done.
    assert!(!resident(&manager, old, CUDA));
    assert!(resident(&manager, other, CUDA));
}

#[test]
fn a_refused_reservation_gives_back_the_earlier_ones_newest_first() {
    for refused in 0..3 {
        let manager = Manager::new(&[(CUDA, 1000), (HOST, 1000)]);
        let value = adopted(&manager, 10, HOST);
        // Some headroom held before the scope: it must stay exactly as it was.
        let outside = manager.reserve(CUDA, 7, "outside").expect("fits");
        let before_cuda = reserved(&manager, CUDA);
        let before_host = reserved(&manager, HOST);
        let plan = plan(
            &manager,
            1,
            vec![],
            vec![ensure(0, CUDA)],
            vec![],
            vec![
                reservation(CUDA, 100, "first"),
                reservation(HOST, 200, "second"),
                reservation(CUDA, 300, "third"),
            ],
        );
        let mut device = Fake::new(&manager, &[value]);
        device.refuse = Some(refused);
        let mut run = PlanRun::new();
        let stopped = run.enter(&manager, &plan, &mut device);
        assert!(matches!(
            stopped,
            Err(RunError::Device(CoreError::InvalidArgument { .. }))
        ));
        assert_eq!(run.phase(), Some(PlanPhase::Reserve));
        assert_eq!(run.position(), refused);
        assert!(run.tokens().is_empty(), "the run holds nothing after it");
        // The `refused` earlier tokens, each released once, newest first.
        assert_eq!(device.released.len(), refused);
        let mut admitted = device.released.clone();
        admitted.sort_unstable();
        admitted.reverse();
        assert_eq!(device.released, admitted, "newest first");
        assert_eq!(
            reserved(&manager, CUDA),
            before_cuda,
            "refused at {refused}"
        );
        assert_eq!(
            reserved(&manager, HOST),
            before_host,
            "refused at {refused}"
        );
        assert!(device.performed().is_empty(), "enter never ran");
        assert!(!resident(&manager, value, CUDA));
        assert!(manager.release_reservation(outside));
    }
}

#[test]
fn a_failed_enter_action_gives_back_every_reservation() {
    let manager = Manager::new(&[(CUDA, 1000)]);
    let values: Vec<HandleId> = (0..2).map(|_| adopted(&manager, 10, HOST)).collect();
    let plan = plan(
        &manager,
        2,
        vec![],
        vec![ensure(0, CUDA), ensure(1, CUDA)],
        vec![drop_at(0, CUDA)],
        vec![reservation(CUDA, 100, "a"), reservation(CUDA, 200, "b")],
    );
    let mut device = Fake::new(&manager, &values);
    device.fail = Some((PlanPhase::Enter, 1));
    let mut run = PlanRun::new();
    assert!(run.enter(&manager, &plan, &mut device).is_err());
    assert_eq!(run.phase(), Some(PlanPhase::Enter));
    assert_eq!(run.position(), 1);
    assert_eq!(device.released.len(), 2);
    assert!(device.released[0] > device.released[1], "newest first");
    assert!(run.tokens().is_empty());
    assert_eq!(reserved(&manager, CUDA), 0);
    // The committed prefix stays: the first enter action's copy.
    assert!(resident(&manager, values[0], CUDA));
    assert!(!resident(&manager, values[1], CUDA));
    assert_eq!(manager.current().books(CUDA).used_bytes, 10);
    assert_eq!(device.copier.installed, BTreeSet::from([(values[0], CUDA)]));
}

#[test]
fn exit_gives_back_the_reservations_even_when_an_action_fails() {
    let manager = Manager::new(&[(CUDA, 1000)]);
    let values: Vec<HandleId> = (0..2).map(|_| adopted(&manager, 10, HOST)).collect();
    let plan = plan(
        &manager,
        2,
        vec![],
        vec![ensure(0, CUDA), ensure(1, CUDA)],
        vec![drop_at(0, CUDA), drop_at(1, CUDA)],
        vec![reservation(CUDA, 100, "a"), reservation(CUDA, 200, "b")],
    );
    let mut device = Fake::new(&manager, &values);
    device.fail = Some((PlanPhase::Exit, 0));
    let mut run = PlanRun::new();
    run.enter(&manager, &plan, &mut device).expect("enters");
    assert_eq!(reserved(&manager, CUDA), 300);
    assert!(device.released.is_empty());

    let exited = run.exit(&mut device);
    assert!(matches!(
        exited,
        Err(RunError::Device(CoreError::Unavailable { .. }))
    ));
    assert_eq!(run.phase(), Some(PlanPhase::Exit));
    assert_eq!(run.position(), 0);
    assert_eq!(device.released.len(), 2);
    assert!(device.released[0] > device.released[1], "newest first");
    assert_eq!(reserved(&manager, CUDA), 0);
    // The exit stopped at its first action: both copies stay.
    assert!(resident(&manager, values[0], CUDA));
    assert!(resident(&manager, values[1], CUDA));
    // Exit performs without the preflight's resolution and without checks.
    assert_eq!(
        device.calls.last().map(String::as_str),
        Some(format!("release {}", device.released[1]).as_str())
    );
}

#[test]
fn an_exit_without_its_entry_is_an_internal_error_and_releases_nothing() {
    let manager = Manager::new(&[(CUDA, 100)]);
    let mut device = Fake::new(&manager, &[]);
    let mut run: PlanRun<(PlanPhase, usize)> = PlanRun::new();
    assert!(matches!(
        run.exit(&mut device),
        Err(RunError::Core(CoreError::Internal { .. }))
    ));
    assert!(device.calls.is_empty());
}

// ----- a direct action --------------------------------------------------------------

#[test]
fn a_direct_action_is_a_one_action_plan_without_checks() {
    let manager = Manager::new(&[(CUDA, 100)]);
    let value = adopted(&manager, 10, HOST);
    let mut device = Fake::new(&manager, &[value]);
    device.expected = Some(u64::MAX);
    let mut run = PlanRun::new();
    let done = run
        .perform(&ensure(0, CUDA), value, &mut device)
        .expect("performs");
    assert_eq!(done, (PlanPhase::Execute, 0));
    assert_eq!(device.calls, ["perform execute 0"]);
    assert_eq!(run.phase(), Some(PlanPhase::Execute));
    assert_eq!(run.position(), 0);
    assert!(resident(&manager, value, CUDA));

    // A failed one leaves the books as they were.
    let other = adopted(&manager, 10, HOST);
    let used = manager.current().books(CUDA).used_bytes;
    device.fail = Some((PlanPhase::Execute, 0));
    let mut run = PlanRun::new();
    assert!(run.perform(&ensure(0, CUDA), other, &mut device).is_err());
    assert_eq!(run.position(), 0);
    assert!(run.done().is_empty());
    manager.check_books().expect("books balance");
    assert_eq!(manager.current().books(CUDA).used_bytes, used);
    assert!(!device.copier.installed.contains(&(other, CUDA)));
}
