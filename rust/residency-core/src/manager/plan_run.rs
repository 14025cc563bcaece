//! Plan runs: the checks, phases, reservations and rollback of `execute_actions`,
//! scope entry and scope exit, and of a direct ensure, move or drop, which is a
//! one-action plan on the same path (docs/concepts/plans.md#phase-order).
//!
//! A [`PlanRun`] owns how far a run got: the phase in progress, the position in it,
//! what each performed action gave back, and the reservation tokens a scope holds.
//! The run drives every action through a [`Device`] (and a whole plan's checks and
//! reservations through a [`PlanDevice`]), which the binding implements:
//! it reads the caller's records, performs the action's transition (the core's
//! tickets: begin, the device work, then commit or abort) and gives back its record.
//! Everything else is decided here, in this order:
//!
//! 1. the device reaps what completed (queued releases, finished transfers);
//! 2. the expected state version, if any, is checked: `CoreError::StaleState`;
//! 3. the device reads its inputs (streams, handle resolutions, reservation labels);
//! 4. the whole plan is simulated: infeasible is `CoreError::Plan` with the
//!    simulation's reason, before any action runs;
//! 5. the phases run: "execute"; or "reclaim", "reserve", "enter"; and later "exit".
//!
//! Execution is not transactional: a failed action leaves the prefix committed. A
//! failed scope entry releases the reservations it admitted, newest first; a scope
//! exit releases them whether or not an exit action failed.

use std::sync::{Arc, Mutex, PoisonError};

use crate::error::{CoreError, CoreResult};
use crate::plan::{Action, Plan, PlanPhase, Reservation};
use crate::simulate::{CudaDevices, Simulation, SlotResolution};
use crate::state::HandleId;

use super::{Begun, Manager};

/// A plan's handle slots as last resolved against one manager: they hold until that
/// manager discards a value (the one change that ends a handle), so a plan preflighted
/// or explained again resolves nothing again.
#[derive(Debug, Default)]
pub struct Resolutions {
    last: Mutex<Option<Resolved>>,
}

/// The manager id and discard count a resolution holds for, and the resolution.
type Resolved = (Arc<str>, u64, Arc<[SlotResolution]>);

impl Resolutions {
    /// The slots' resolution against the manager `manager_id` after `discards`
    /// discards: the one kept, when it holds, else `resolve()`'s, kept.
    pub fn get<E>(
        &self,
        manager_id: &Arc<str>,
        discards: u64,
        resolve: impl FnOnce() -> Result<Arc<[SlotResolution]>, E>,
    ) -> Result<Arc<[SlotResolution]>, E> {
        let kept = self
            .last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .filter(|(known, at, _)| *at == discards && known == manager_id)
            .map(|(.., slots)| Arc::clone(slots));
        if let Some(slots) = kept {
            return Ok(slots);
        }
        // Resolved without the lock: resolving may run the glue's code.
        let slots = resolve()?;
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) =
            Some((Arc::clone(manager_id), discards, Arc::clone(&slots)));
        Ok(slots)
    }
}

/// What a run needs from the device side before its preflight.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// Each handle slot of the plan resolved against the current state.
    pub slots: Arc<[SlotResolution]>,
    /// The CUDA devices that exist, for the simulation's location checks.
    pub cuda: CudaDevices,
    /// The reservations' labels as the simulation's messages quote them.
    pub labels: Vec<String>,
    /// The caller simulated this very plan over these slots, with these CUDA devices and
    /// labels, at the current state under the same hold of the gate, with no completed
    /// lease set aside, and found it feasible: the preflight simulation would repeat it.
    pub simulated: bool,
}

/// The side of a run that touches values and devices: it performs each action. The
/// binding implements it (tests implement it over the core's own tickets).
pub trait Device {
    /// What one performed action gives back (the binding: its transition record).
    type Done;
    /// The device side's own error.
    type Error;

    /// Performs `action`, at `position` of `phase`, as one transition. `index` is the
    /// action's value when the run resolved it already (a preflighted phase).
    fn perform(
        &mut self,
        phase: PlanPhase,
        position: usize,
        action: &Action,
        index: Option<HandleId>,
    ) -> Result<Self::Done, Self::Error>;
}

/// The device side of a whole plan: what its checks read, and its reservations.
pub trait PlanDevice: Device {
    /// Applies queued releases and reaps completed transfers; runs first.
    fn reap(&mut self) -> Result<(), Self::Error>;

    /// The version the caller expects, read (and checked for shape) after the reap.
    fn expected_version(&mut self) -> Result<Option<u64>, Self::Error>;

    /// The run's inputs, read after the version check.
    fn inputs(&mut self) -> Result<Inputs, Self::Error>;

    /// Runs `work`, pure computation over the core's state, where other threads may
    /// go on meanwhile (the binding: without the interpreter).
    fn detached<R: Send>(&mut self, work: impl FnOnce() -> R + Send) -> R {
        work()
    }

    /// Admits `reservation`, at `position` of the plan's reservations; its token.
    fn reserve(&mut self, position: usize, reservation: &Reservation) -> Result<u64, Self::Error>;

    /// Releases an admitted reservation.
    fn release(&mut self, token: u64);
}

/// Why a run stopped: a rule of the run's own, or the device side's error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunError<E> {
    Core(CoreError),
    Device(E),
}

/// How far one plan run got; see the module documentation.
#[derive(Debug)]
pub struct PlanRun<T> {
    /// The plan a scope entered, kept for its exit.
    plan: Option<Arc<Plan>>,
    /// What each performed action gave back, in order.
    done: Vec<T>,
    /// The phase in progress, or the one that failed; `None` before the first.
    phase: Option<PlanPhase>,
    /// How many actions were done when the current phase began.
    phase_start: usize,
    /// The position of the reservation being admitted while `phase` is "reserve".
    reservation: Option<usize>,
    /// Reservation tokens a scope holds, in admission order.
    tokens: Vec<u64>,
}

impl<T> Default for PlanRun<T> {
    fn default() -> Self {
        Self {
            plan: None,
            done: Vec::new(),
            phase: None,
            phase_start: 0,
            reservation: None,
            tokens: Vec::new(),
        }
    }
}

impl<T> PlanRun<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// The phase in progress when the run stopped, `None` if it stopped before its
    /// first phase (a check or the preflight refused it).
    pub fn phase(&self) -> Option<PlanPhase> {
        self.phase
    }

    /// The position, within its phase, of the action or reservation in progress.
    pub fn position(&self) -> usize {
        self.reservation
            .unwrap_or_else(|| self.done.len().saturating_sub(self.phase_start))
    }

    /// What the performed actions gave back, in order.
    pub fn done(&self) -> &[T] {
        &self.done
    }

    /// The reservation tokens the run holds, in admission order.
    pub fn tokens(&self) -> &[u64] {
        &self.tokens
    }

    /// Takes the reservation tokens the run still holds, newest first: the order
    /// they are released in.
    pub fn take_tokens(&mut self) -> Vec<u64> {
        let mut tokens = std::mem::take(&mut self.tokens);
        tokens.reverse();
        tokens
    }

    /// Releases the reservations the run holds, newest first.
    pub fn release_tokens<D: PlanDevice<Done = T>>(&mut self, device: &mut D) {
        for token in self.take_tokens() {
            device.release(token);
        }
    }

    /// `execute_actions`: the checks and the preflight, then the plan's actions (its
    /// enter phase) as the one phase "execute".
    pub fn execute<D: PlanDevice<Done = T>>(
        &mut self,
        manager: &Manager,
        plan: &Plan,
        device: &mut D,
    ) -> Result<(), RunError<D::Error>> {
        let slots = prepare(manager, plan, device)?;
        self.run_phase(
            PlanPhase::Execute,
            plan.enter(),
            |action| resolved(&slots, action),
            device,
        )
    }

    /// Scope entry: the checks and the preflight, then reclaim, reserve and enter.
    /// On a failure the reservations admitted so far are released, newest first.
    pub fn enter<D: PlanDevice<Done = T>>(
        &mut self,
        manager: &Manager,
        plan: &Arc<Plan>,
        device: &mut D,
    ) -> Result<(), RunError<D::Error>> {
        let slots = prepare(manager, plan, device)?;
        self.plan = Some(Arc::clone(plan));
        let resolve = |action: &Action| resolved(&slots, action);
        let entered = self
            .run_phase(PlanPhase::Reclaim, plan.reclaim(), resolve, device)
            .and_then(|()| self.reserve(plan.reservations(), device))
            .and_then(|()| self.run_phase(PlanPhase::Enter, plan.enter(), resolve, device));
        if entered.is_err() {
            self.release_tokens(device);
        }
        entered
    }

    /// Scope exit: the entered plan's exit actions, no preflight (each resolves its
    /// own handle), then its reservations, released whether or not an action failed.
    pub fn exit<D: PlanDevice<Done = T>>(
        &mut self,
        device: &mut D,
    ) -> Result<(), RunError<D::Error>> {
        let exited = match self.plan.clone() {
            Some(plan) => self.run_phase(PlanPhase::Exit, plan.exit(), |_| None, device),
            None => Err(RunError::Core(CoreError::Internal {
                message: "a scope exit without its entry".to_owned(),
            })),
        };
        self.release_tokens(device);
        exited
    }

    /// A direct ensure, move or drop: `action` on value `index`, which the caller
    /// resolved and checked, as a one-action plan with no version or preflight. What
    /// it gave back is returned, not kept (nobody reads a one-action run's prefix).
    pub fn perform<D: Device<Done = T>>(
        &mut self,
        action: &Action,
        index: HandleId,
        device: &mut D,
    ) -> Result<T, RunError<D::Error>> {
        self.begin(PlanPhase::Execute);
        perform(device, PlanPhase::Execute, 0, action, Some(index))
    }

    /// Performs `actions` in order as `phase`, keeping what each gives back.
    fn run_phase<D: Device<Done = T>>(
        &mut self,
        phase: PlanPhase,
        actions: &[Action],
        resolve: impl Fn(&Action) -> Option<HandleId>,
        device: &mut D,
    ) -> Result<(), RunError<D::Error>> {
        self.begin(phase);
        for (position, action) in actions.iter().enumerate() {
            let done = perform(device, phase, position, action, resolve(action))?;
            self.done.push(done);
        }
        Ok(())
    }

    /// Admits the plan's reservations in order, keeping each token as it is taken.
    fn reserve<D: PlanDevice<Done = T>>(
        &mut self,
        reservations: &[Reservation],
        device: &mut D,
    ) -> Result<(), RunError<D::Error>> {
        self.begin(PlanPhase::Reserve);
        for (position, reservation) in reservations.iter().enumerate() {
            self.reservation = Some(position);
            let token = device
                .reserve(position, reservation)
                .map_err(RunError::Device)?;
            self.tokens.push(token);
        }
        self.reservation = None;
        Ok(())
    }

    fn begin(&mut self, phase: PlanPhase) {
        self.phase = Some(phase);
        self.phase_start = self.done.len();
        self.reservation = None;
    }
}

/// The checks every plan entry makes first, in order (see the module
/// documentation); each handle slot's resolution.
fn prepare<D: PlanDevice>(
    manager: &Manager,
    plan: &Plan,
    device: &mut D,
) -> Result<Arc<[SlotResolution]>, RunError<D::Error>> {
    device.reap().map_err(RunError::Device)?;
    if let Some(expected) = device.expected_version().map_err(RunError::Device)? {
        manager.check_version(expected).map_err(RunError::Core)?;
    }
    let Inputs {
        slots,
        cuda,
        labels,
        simulated,
    } = device.inputs().map_err(RunError::Device)?;
    if simulated {
        return Ok(slots);
    }
    let simulation: Simulation =
        device.detached(|| manager.simulate(plan, &slots, cuda, &[], &labels));
    if !simulation.feasible {
        return Err(RunError::Core(CoreError::Plan {
            message: simulation
                .reason
                .unwrap_or_else(|| "the plan is infeasible".to_owned()),
        }));
    }
    Ok(slots)
}

/// One action of `phase`, at `position`, performed by the device: the step every
/// action of a run takes.
fn perform<D: Device>(
    device: &mut D,
    phase: PlanPhase,
    position: usize,
    action: &Action,
    index: Option<HandleId>,
) -> Result<D::Done, RunError<D::Error>> {
    device
        .perform(phase, position, action, index)
        .map_err(RunError::Device)
}

/// The handle index of an action of a preflighted phase.
///
/// The preflight resolved every handle of the plan while the caller held the gate,
/// which it keeps until the last phase: nothing but the plan's own actions changes
/// the state meanwhile, and a plan whose actions would end a value before a later
/// action names it is infeasible, so each index stays the action's value.
fn resolved(slots: &[SlotResolution], action: &Action) -> Option<HandleId> {
    match slots.get(action.handle().index()) {
        Some(Ok(index)) => Some(*index),
        _ => None,
    }
}

impl Manager {
    /// Begins the ticket of an ensure or a move of value `index` (see `ticket.rs`);
    /// `asynchronous` leaves an ensure's CUDA copy in flight. A drop or a discard
    /// takes no ticket: an internal error.
    pub fn begin(&self, index: HandleId, action: &Action, asynchronous: bool) -> CoreResult<Begun> {
        match *action {
            Action::Ensure { location, .. } => self.begin_ensure(index, location, asynchronous),
            Action::Move { to, from, .. } => self.begin_move(index, to, from),
            Action::Drop { .. } | Action::Discard { .. } => Err(CoreError::Internal {
                message: "a drop or a discard takes no ticket".to_owned(),
            }),
        }
    }

    /// `CoreError::StaleState` unless the state is at version `expected`.
    pub fn check_version(&self, expected: u64) -> Result<(), CoreError> {
        let actual = self.version();
        if actual == expected {
            Ok(())
        } else {
            Err(CoreError::StaleState {
                expected_version: expected,
                actual_version: actual,
            })
        }
    }
}
