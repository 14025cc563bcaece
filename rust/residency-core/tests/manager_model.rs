//! Model-based tests of the manager core: random operation sequences against a small
//! reference model of materialisation sets, per-location charges and the pending
//! leases of copies in flight. Every ensure, move, drop and discard goes through the
//! core's transition driver (`Manager::transition`) over a fake device that fails
//! where the sequence says: at any of its steps (and, optionally, at every step after
//! it, so the wait of the failure path fails too), by measuring the wrong bytes, or
//! by something else taking the source or the destination's budget meanwhile. The
//! model predicts each transition's device work, in order, and its outcome; after
//! every operation the books, records, pending leases, transfers and object book
//! equal the model's, and the device holds exactly the materialisations the records
//! name (docs/concepts/transitions.md).

#![allow(clippy::panic)] // Test assertions.

mod common;

use common::{Accounts, accounts, spec};

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;
use residency_core::{
    Action, Copied, CoreError, Freed, HandleId, HandleSlot, Location, Manager, Measured, ObjectId,
    RunError, TransitionDevice, Transitioned,
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
        tier: Tier,
        fault: Fault,
    },
    Move {
        value: usize,
        to: usize,
        asynchronous: bool,
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
    /// A copy left in flight completed: the pending lease is settled (its event, and
    /// the transfer it protected, are forgotten).
    Complete {
        which: usize,
    },
}

/// Where the device side of a transition fails, if it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// The device step at `at` (counted from 0) fails; with `onward`, every later one
    /// too (the wait for a copy still in flight after the failure).
    Step {
        at: usize,
        onward: bool,
    },
    /// Validation measures one storage byte above the charge.
    Oversized,
    /// Validation measures another logical size than the spec's.
    Mislogical,
    /// The materialisation a copy reads is held meanwhile: a move's commit refuses
    /// to remove it.
    Hold,
    /// The destination's free budget is reserved elsewhere during a copy or the disk
    /// tier's load: the commit's admission refuses (unless the value is empty).
    Crowd,
}

/// What the disk tier does with a deferrable load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tier {
    /// The value has no source object to defer.
    NoSource,
    /// The tier declines it.
    Declines,
    /// The tier loads it straight to the destination.
    Takes,
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        4 => Just(Fault::None),
        4 => (0..7usize, any::<bool>()).prop_map(|(at, onward)| Fault::Step { at, onward }),
        1 => Just(Fault::Oversized),
        1 => Just(Fault::Mislogical),
        1 => Just(Fault::Hold),
        1 => Just(Fault::Crowd),
    ]
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![
        Just(Tier::NoSource),
        Just(Tier::Declines),
        Just(Tier::Takes)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let at = 0..LOCATIONS.len();
    prop_oneof![
        1 => (at.clone(), 0..64u64, any::<bool>()).prop_map(|(at, bytes, exclusive)| Op::Adopt {
            at,
            bytes,
            exclusive
        }),
        1 => (at.clone(), 0..64u64, any::<bool>()).prop_map(|(at, bytes, exclusive)| Op::Register {
            at,
            bytes,
            exclusive
        }),
        3 => (0..6usize, at.clone(), any::<bool>(), tier(), fault()).prop_map(
            |(value, at, asynchronous, tier, fault)| Op::Ensure {
                value,
                at,
                asynchronous,
                tier,
                fault
            }
        ),
        2 => (0..6usize, at.clone(), any::<bool>(), fault()).prop_map(
            |(value, to, asynchronous, fault)| Op::Move {
                value,
                to,
                asynchronous,
                fault
            }
        ),
        1 => (0..6usize, at.clone()).prop_map(|(value, at)| Op::Drop { value, at }),
        1 => (0..6usize).prop_map(|value| Op::Discard { value }),
        1 => (at.clone(), 0..64u64).prop_map(|(at, bytes)| Op::Reserve { at, bytes }),
        1 => (0..4usize).prop_map(|which| Op::ReleaseReservation { which }),
        1 => (0..6usize, at).prop_map(|(value, at)| Op::Acquire { value, at }),
        1 => (0..4usize).prop_map(|which| Op::ReleaseLease { which }),
        2 => (0..4usize).prop_map(|which| Op::Complete { which }),
    ]
}

// ----- the fake device ---------------------------------------------------------------

/// A fallible device step, as the fake logs it and the model predicts it.
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

/// A value on the fake device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Value {
    index: HandleId,
    at: Location,
}

/// What the fake keeps at a core object id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kept {
    Event(u32),
    Value(Value),
}

/// What a test checks while a source loads.
type Probe = Box<dyn FnOnce(&Manager)>;

/// A device over plain data. It lives as long as the manager: the materialisations
/// and objects it keeps are checked against the core's after every operation.
struct Device<'m> {
    manager: &'m Manager,
    /// This transition's fault and tier.
    fault: Fault,
    tier: Tier,
    /// This transition's device steps, failed or not.
    steps: Vec<Step>,
    /// Events made so far (numbered from 1).
    events: u32,
    /// Hold and reservation tokens taken meanwhile (`Fault::Hold`, `Fault::Crowd`).
    holds: Vec<u64>,
    reservations: Vec<u64>,
    kept: BTreeMap<ObjectId, Kept>,
    installed: BTreeSet<(HandleId, Location)>,
    /// Run once when a source's `load()` starts.
    on_load: Option<Probe>,
}

impl<'m> Device<'m> {
    fn new(manager: &'m Manager) -> Self {
        Self {
            manager,
            fault: Fault::None,
            tier: Tier::NoSource,
            steps: Vec::new(),
            events: 0,
            holds: Vec::new(),
            reservations: Vec::new(),
            kept: BTreeMap::new(),
            installed: BTreeSet::new(),
            on_load: None,
        }
    }

    /// Starts a transition with `fault` and `tier`.
    fn arm(&mut self, fault: Fault, tier: Tier) {
        self.fault = fault;
        self.tier = tier;
        self.steps.clear();
    }

    /// Ends a transition: what was taken meanwhile goes back; how many version steps
    /// that made (taking and giving back one each).
    fn disarm(&mut self) -> u64 {
        let taken = self.holds.len() + self.reservations.len();
        for hold in self.holds.drain(..) {
            assert!(self.manager.release_hold(hold));
        }
        for token in self.reservations.drain(..) {
            assert!(self.manager.release_reservation(token));
        }
        self.fault = Fault::None;
        2 * u64::try_from(taken).expect("small")
    }

    fn step(&mut self, step: Step) -> Result<(), Step> {
        let position = self.steps.len();
        self.steps.push(step);
        match self.fault {
            Fault::Step { at, onward } if position == at || (onward && position > at) => Err(step),
            _ => Ok(()),
        }
    }

    fn event(&mut self) -> u32 {
        self.events += 1;
        self.events
    }

    /// `Fault::Crowd`: reserves what the budget of `at` has left.
    fn crowd(&mut self, at: Location) {
        if self.fault != Fault::Crowd {
            return;
        }
        let books = self.manager.current().books(at);
        if let Some(budget) = books.budget_bytes {
            let free = budget - books.used_bytes - books.reserved_bytes;
            let token = self.manager.reserve(at, free, "crowd").expect("fits");
            self.reservations.push(token);
        }
    }
}

impl TransitionDevice for Device<'_> {
    type Value = Value;
    type Event = u32;
    type Deferral = (HandleId, Location);
    type Error = Step;

    fn resident(&mut self, index: HandleId, at: Location) -> Result<Value, Step> {
        self.step(Step::Resident(at))?;
        assert!(self.installed.contains(&(index, at)), "reads what it holds");
        if self.fault == Fault::Hold {
            let hold = self.manager.hold(&[index], at).expect("resident");
            self.holds.push(hold);
        }
        Ok(Value { index, at })
    }

    fn wait(&mut self, events: &[ObjectId]) -> Result<(), Step> {
        for id in events {
            assert!(
                matches!(self.kept.get(id), Some(Kept::Event(_))),
                "waits for an event it keeps"
            );
        }
        self.step(Step::Wait(events.len()))
    }

    fn load(&mut self, index: HandleId) -> Result<Value, Step> {
        assert!(
            matches!(
                self.manager.try_enter(false, false),
                Err(CoreError::Reentrancy { .. })
            ),
            "load() runs as a callback"
        );
        if let Some(probe) = self.on_load.take() {
            probe(self.manager);
        }
        self.step(Step::Load)?;
        let source = self.manager.current().record(index).expect("issued").source;
        Ok(Value {
            index,
            at: source.expect("a source"),
        })
    }

    fn prepare_deferral(
        &mut self,
        index: HandleId,
        at: Location,
    ) -> Result<Option<(HandleId, Location)>, Step> {
        self.step(Step::Prepare)?;
        Ok((self.tier != Tier::NoSource).then_some((index, at)))
    }

    fn defer(
        &mut self,
        (index, at): (HandleId, Location),
    ) -> Result<Option<Copied<Value, u32>>, Step> {
        self.step(Step::Defer)?;
        if self.tier == Tier::Declines {
            return Ok(None);
        }
        self.crowd(at);
        Ok(Some(Copied {
            value: Value { index, at },
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
        self.crowd(to);
        let event = (in_flight && matches!(to, Location::Cuda(_))).then(|| self.event());
        Ok(Copied {
            value: Value { at: to, ..*value },
            event,
        })
    }

    fn validate(&mut self, index: HandleId, at: Location, value: &Value) -> Result<Measured, Step> {
        assert_eq!(
            (value.index, value.at),
            (index, at),
            "validated where it is"
        );
        self.step(Step::Validate(at))?;
        let spec = self.manager.value_spec(index).expect("issued");
        Ok(Measured {
            logical_nbytes: spec.logical_nbytes() + u64::from(self.fault == Fault::Mislogical),
            storage_nbytes: spec.storage_nbytes() + u64::from(self.fault == Fault::Oversized),
            keys: Vec::new(),
        })
    }

    fn synchronize(&mut self, event: &u32) -> Result<(), Step> {
        self.step(Step::Synchronize(*event))
    }

    fn keep_event(&mut self, id: ObjectId, event: &u32) {
        assert!(self.kept.insert(id, Kept::Event(*event)).is_none());
    }

    fn keep_value(&mut self, id: ObjectId, value: &Value) {
        assert!(self.kept.insert(id, Kept::Value(*value)).is_none());
    }

    fn free(&mut self, freed: &Freed) {
        for id in &freed.objects {
            assert!(self.kept.remove(id).is_some(), "frees what it kept");
        }
    }

    fn install(&mut self, index: HandleId, at: Location, value: Value) {
        assert_eq!((value.index, value.at), (index, at));
        assert!(self.installed.insert((index, at)), "installed twice");
    }

    fn forget(&mut self, index: HandleId, at: Location) {
        assert!(self.installed.remove(&(index, at)), "forgets what it holds");
    }

    fn discarded(&mut self, index: HandleId, removed: &[Location]) {
        for &at in removed {
            assert!(self.installed.remove(&(index, at)), "forgets what it holds");
        }
        assert!(
            !self.installed.iter().any(|&(held, _)| held == index),
            "every materialisation of a discarded value goes"
        );
    }
}

// ----- the model ---------------------------------------------------------------------

/// The reference model: what must be true after each operation.
#[derive(Debug, Default)]
struct Model {
    values: Vec<ModelValue>,
    reserved: BTreeMap<Location, u64>,
    reservations: Vec<(u64, Location, u64)>,
    leases: Vec<(u64, HandleId, Location)>,
    /// The copies left in flight, while any of their pending leases is.
    copies: Vec<InFlight>,
}

#[derive(Debug)]
struct ModelValue {
    handle: HandleId,
    charge: u64,
    exclusive: bool,
    /// Where its registered source loads it, while it has one.
    source: Option<Location>,
    discarded: bool,
    at: BTreeSet<Location>,
    /// Active and pending leases per location.
    uses: BTreeMap<Location, u32>,
}

/// A copy left in flight: the pending lease at its destination (which protects the
/// transfer, and keeps alive what a reconstruction's copy reads) and the one at the
/// materialisation it reads, while they are pending. Both wait on one event.
#[derive(Debug)]
struct InFlight {
    handle: HandleId,
    destination: (Location, Option<u64>),
    read: Option<(Location, Option<u64>)>,
    keepalive: bool,
}

impl InFlight {
    fn tokens(&self) -> impl Iterator<Item = (u64, Location)> + '_ {
        let (at, token) = self.destination;
        token.map(|token| (token, at)).into_iter().chain(
            self.read
                .and_then(|(at, token)| token.map(|token| (token, at))),
        )
    }

    /// The event while either lease waits on it; what the copy reads while the
    /// transfer is protected.
    fn objects(&self) -> usize {
        let transfer = self.destination.1.is_some();
        usize::from(self.tokens().next().is_some()) + usize::from(transfer && self.keepalive)
    }
}

/// Why the model expects a transition to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Device(Step),
    Handle,
    Ownership,
    Unavailable,
    Budget(Location),
    InUse(Location),
    Materialization,
}

impl Refusal {
    fn of(error: &RunError<Step>) -> Self {
        match error {
            RunError::Device(step) => Self::Device(*step),
            RunError::Core(CoreError::Handle { .. }) => Self::Handle,
            RunError::Core(CoreError::Ownership { .. }) => Self::Ownership,
            RunError::Core(CoreError::Unavailable { .. }) => Self::Unavailable,
            RunError::Core(CoreError::Budget { location, .. }) => Self::Budget(*location),
            RunError::Core(CoreError::InUse {
                location: Some(location),
                ..
            }) => Self::InUse(*location),
            RunError::Core(CoreError::Materialization { .. }) => Self::Materialization,
            RunError::Core(other) => panic!("unexpected {other:?}"),
        }
    }
}

/// What a successful ensure or move changes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Landing {
    no_op: bool,
    source: Option<Location>,
    install: Option<Location>,
    remove: Option<Location>,
    /// A copy left in flight into `install`: the location it reads (a copy of a
    /// materialisation), and whether it keeps the loaded value alive (a
    /// reconstruction's).
    in_flight: Option<(Option<Location>, bool)>,
}

/// The model's prediction of one ensure or move: its device steps in order, and its
/// outcome.
struct Predict<'a> {
    model: &'a Model,
    budgets: &'a BTreeMap<Location, u64>,
    value: usize,
    fault: Fault,
    tier: Tier,
    /// The event a copy of this transition makes.
    event: u32,
    steps: Vec<Step>,
    /// A hold taken on the materialisation read (`Fault::Hold`).
    held: Option<Location>,
    /// The destination whose free budget a copy or the tier's load let something
    /// else reserve (`Fault::Crowd`).
    crowded: Option<Location>,
}

impl Predict<'_> {
    fn entry(&self) -> &ModelValue {
        &self.model.values[self.value]
    }

    fn fits(&self, at: Location) -> bool {
        self.model.fits(self.budgets, at, self.entry().charge)
    }

    fn protected(&self, at: Location) -> bool {
        self.entry().uses.get(&at).copied().unwrap_or(0) > 0
    }

    fn bad_bytes(&self) -> bool {
        matches!(self.fault, Fault::Oversized | Fault::Mislogical)
    }

    /// Whether `Fault::Crowd` left the destination no room for this value.
    fn crowded(&self, at: Location) -> bool {
        self.crowded == Some(at) && self.budgets.contains_key(&at) && self.entry().charge > 0
    }

    /// A copy to `at`, or the tier's load there, made.
    fn arrived(&mut self, at: Location) {
        if self.fault == Fault::Crowd {
            self.crowded = Some(at);
        }
    }

    fn step(&mut self, step: Step) -> Result<(), Refusal> {
        let position = self.steps.len();
        self.steps.push(step);
        match self.fault {
            Fault::Step { at, onward } if position == at || (onward && position > at) => {
                Err(Refusal::Device(step))
            }
            _ => Ok(()),
        }
    }

    /// Reading the materialisation at `from`: the transfers still in flight into it
    /// are waited for first.
    fn read(&mut self, from: Location) -> Result<(), Refusal> {
        let handle = self.entry().handle;
        let arriving = self
            .model
            .copies
            .iter()
            .filter(|copy| {
                copy.handle == handle && copy.destination.0 == from && copy.destination.1.is_some()
            })
            .count();
        if arriving > 0 {
            self.step(Step::Wait(arriving))?;
        }
        self.step(Step::Resident(from))?;
        if self.fault == Fault::Hold {
            self.held = Some(from);
        }
        Ok(())
    }

    /// Validating what landed at `at`: a failure waits for the copy in flight.
    fn land(&mut self, at: Location, event: Option<u32>) -> Result<(), Refusal> {
        self.step(Step::Validate(at)).inspect_err(|_| {
            self.steps.extend(event.map(Step::Synchronize));
        })
    }

    /// The commit of `landing`: the source's removability, then the install's bytes
    /// and budget; a refusal waits for the copy in flight.
    fn commit(&mut self, landing: Landing, event: Option<u32>) -> Result<Landing, Refusal> {
        let refusal = if let Some(source) = landing
            .remove
            .filter(|&source| self.protected(source) || self.held == Some(source))
        {
            Some(Refusal::InUse(source))
        } else if let Some(at) = landing.install {
            if self.bad_bytes() {
                Some(Refusal::Materialization)
            } else if self.crowded(at) || !self.fits(at) {
                Some(Refusal::Budget(at))
            } else {
                None
            }
        } else {
            None
        };
        match refusal {
            Some(refusal) => {
                self.steps.extend(event.map(Step::Synchronize));
                Err(refusal)
            }
            None => Ok(landing),
        }
    }

    fn ensure(&mut self, at: Location, asynchronous: bool) -> Result<Landing, Refusal> {
        let entry = self.entry();
        if entry.discarded {
            return Err(Refusal::Handle);
        }
        if entry.at.contains(&at) {
            return Ok(Landing {
                no_op: true,
                ..Landing::default()
            });
        }
        if entry.exclusive && !entry.at.is_empty() {
            return Err(Refusal::Ownership);
        }
        let in_flight = asynchronous && matches!(at, Location::Cuda(_));
        if let Some(&from) = entry.at.first() {
            if !self.fits(at) {
                return Err(Refusal::Budget(at));
            }
            self.read(from)?;
            self.step(Step::Copy(from, at, in_flight))?;
            self.arrived(at);
            let event = in_flight.then_some(self.event);
            self.land(at, event)?;
            let landing = Landing {
                source: Some(from),
                install: Some(at),
                in_flight: in_flight.then_some((Some(from), false)),
                ..Landing::default()
            };
            return self.commit(landing, event);
        }
        let into = entry.source.ok_or(Refusal::Unavailable)?;
        if !self.fits(into) {
            return Err(Refusal::Budget(into));
        }
        if in_flight && matches!(into, Location::PageableHost | Location::PinnedHost) {
            self.step(Step::Prepare)?;
            if self.tier != Tier::NoSource {
                // Admitted at the destination before the tier allocates.
                if !self.fits(at) {
                    return Err(Refusal::Budget(at));
                }
                self.step(Step::Defer)?;
                if self.tier == Tier::Takes {
                    self.arrived(at);
                    self.land(at, Some(self.event))?;
                    let landing = Landing {
                        source: Some(into),
                        install: Some(at),
                        in_flight: Some((None, false)),
                        ..Landing::default()
                    };
                    return self.commit(landing, Some(self.event));
                }
            }
        }
        self.reconstruct(into, at, in_flight)
    }

    fn moving(&mut self, to: Location) -> Result<Landing, Refusal> {
        let entry = self.entry();
        if entry.discarded {
            return Err(Refusal::Handle);
        }
        let source = entry.at.iter().copied().find(|&at| at != to);
        if entry.at.contains(&to) {
            let Some(source) = source else {
                return Ok(Landing {
                    no_op: true,
                    ..Landing::default()
                });
            };
            if self.protected(source) {
                return Err(Refusal::InUse(source));
            }
            let landing = Landing {
                source: Some(source),
                remove: Some(source),
                ..Landing::default()
            };
            return self.commit(landing, None);
        }
        if let Some(from) = source {
            if self.protected(from) {
                return Err(Refusal::InUse(from));
            }
            if !self.fits(to) {
                return Err(Refusal::Budget(to));
            }
            self.read(from)?;
            self.step(Step::Copy(from, to, false))?;
            self.arrived(to);
            self.land(to, None)?;
            let landing = Landing {
                source: Some(from),
                install: Some(to),
                remove: Some(from),
                ..Landing::default()
            };
            return self.commit(landing, None);
        }
        let into = entry.source.ok_or(Refusal::Unavailable)?;
        if !self.fits(into) {
            return Err(Refusal::Budget(into));
        }
        self.reconstruct(into, to, false)
    }

    /// The source's `load()` into `into` under the temporary charge, validated there,
    /// then installed there or copied on to `at`.
    fn reconstruct(
        &mut self,
        into: Location,
        at: Location,
        in_flight: bool,
    ) -> Result<Landing, Refusal> {
        self.step(Step::Load)?;
        self.step(Step::Validate(into))?;
        let mut landing = Landing {
            source: Some(into),
            install: Some(at),
            ..Landing::default()
        };
        if into == at {
            return self.commit(landing, None);
        }
        if self.bad_bytes() {
            return Err(Refusal::Materialization);
        }
        // The temporary charge is at `into`, not at `at`.
        if !self.fits(at) {
            return Err(Refusal::Budget(at));
        }
        self.step(Step::Copy(into, at, in_flight))?;
        self.arrived(at);
        let event = in_flight.then_some(self.event);
        self.land(at, event)?;
        landing.in_flight = in_flight.then_some((None, true));
        self.commit(landing, event)
    }
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

    fn entry(&mut self, handle: HandleId) -> &mut ModelValue {
        self.values
            .iter_mut()
            .find(|entry| entry.handle == handle)
            .expect("modelled")
    }

    /// The pending leases of copies in flight, in token order.
    fn pending(&self) -> Vec<(u64, HandleId, Location)> {
        let mut pending: Vec<_> = self
            .copies
            .iter()
            .flat_map(|copy| copy.tokens().map(|(token, at)| (token, copy.handle, at)))
            .collect();
        pending.sort_unstable();
        pending
    }

    /// Applies a successful ensure or move of `value` to the model; `tokens` are the
    /// pending leases the commit made.
    fn land(&mut self, value: usize, landing: Landing, tokens: &[(u64, Location)]) {
        let entry = &mut self.values[value];
        let handle = entry.handle;
        if let Some(at) = landing.install {
            assert!(entry.at.insert(at));
        }
        if let Some(at) = landing.remove {
            assert!(entry.at.remove(&at));
        }
        let Some((read, keepalive)) = landing.in_flight else {
            assert!(tokens.is_empty(), "nothing left in flight: {tokens:?}");
            return;
        };
        let destination = landing.install.expect("a copy installs");
        let token_at = |at: Location| {
            tokens
                .iter()
                .find(|&&(_, location)| location == at)
                .map(|&(token, _)| token)
                .expect("a pending lease")
        };
        assert_eq!(tokens.len(), 1 + usize::from(read.is_some()), "{tokens:?}");
        let copy = InFlight {
            handle,
            destination: (destination, Some(token_at(destination))),
            read: read.map(|at| (at, Some(token_at(at)))),
            keepalive,
        };
        for (_, at) in copy.tokens() {
            *entry.uses.entry(at).or_default() += 1;
        }
        self.copies.push(copy);
    }

    /// The copy in flight's pending lease `token` settled.
    fn settle(&mut self, token: u64) {
        let (handle, at) = {
            let copy = self
                .copies
                .iter_mut()
                .find(|copy| copy.tokens().any(|(held, _)| held == token))
                .expect("a pending lease of a copy");
            let handle = copy.handle;
            if copy.destination.1 == Some(token) {
                copy.destination.1 = None;
                (handle, copy.destination.0)
            } else {
                let read = copy.read.as_mut().expect("the read's lease");
                read.1 = None;
                (handle, read.0)
            }
        };
        self.copies.retain(|copy| copy.tokens().next().is_some());
        *self.entry(handle).uses.entry(at).or_default() -= 1;
    }

    /// How many objects the core's book holds for the copies in flight.
    fn objects(&self) -> usize {
        self.copies.iter().map(InFlight::objects).sum()
    }
}

fn ensure(at: Location) -> Action {
    Action::Ensure {
        handle: HandleSlot(0),
        location: at,
    }
}

fn moving(to: Location) -> Action {
    Action::Move {
        handle: HandleSlot(0),
        to,
        from: None,
    }
}

/// One ensure or move to drive: the value (its position in the model), the action,
/// whether it runs in a prefetch, what the disk tier does and where the device fails.
struct Attempt {
    value: usize,
    action: Action,
    asynchronous: bool,
    tier: Tier,
    fault: Fault,
}

/// Runs `attempt` through the driver and checks it against the model's prediction:
/// the device steps in order, the outcome, and, on any failure, the accounts and the
/// object book as they were.
fn transition(
    manager: &Manager,
    device: &mut Device<'_>,
    model: &mut Model,
    budgets: &BTreeMap<Location, u64>,
    attempt: &Attempt,
) {
    let &Attempt {
        value,
        ref action,
        asynchronous,
        tier,
        fault,
    } = attempt;
    let Some(entry) = model.values.get(value) else {
        return;
    };
    let handle = entry.handle;
    let mut predict = Predict {
        model,
        budgets,
        value,
        fault,
        tier,
        event: device.events + 1,
        steps: Vec::new(),
        held: None,
        crowded: None,
    };
    let expected = match *action {
        Action::Ensure { location, .. } => predict.ensure(location, asynchronous),
        Action::Move { to, .. } => predict.moving(to),
        _ => unreachable!("only ensures and moves are predicted"),
    };
    let steps = predict.steps;
    let before: (Accounts, usize) = (accounts(manager), manager.live_objects());
    let known: BTreeSet<u64> = manager.pending_lease_tokens().into_iter().collect();
    device.arm(fault, tier);
    let result = manager.transition(action, handle, asynchronous, device);
    let context = format!("{action:?} of {entry:?} with {fault:?}, {tier:?}: {result:?}");
    assert_eq!(device.steps, steps, "{context}");
    let meanwhile = device.disarm();
    // Whatever happened, the gate is free of the callback mark.
    assert!(manager.try_enter(false, false).expect("no callback mark"));
    manager.exit();
    match (result, expected) {
        (Ok(done), Ok(landing)) => {
            assert_eq!(
                done,
                Transitioned {
                    no_op: landing.no_op,
                    source: landing.source
                },
                "{context}"
            );
            let tokens: Vec<(u64, Location)> = manager
                .pending_lease_tokens()
                .into_iter()
                .filter(|token| !known.contains(token))
                .map(|token| {
                    let (handles, at) = manager.pending_lease_values(token).expect("pending");
                    assert_eq!(handles, [handle], "{context}");
                    (token, at)
                })
                .collect();
            model.land(value, landing, &tokens);
        }
        (Err(error), Err(refusal)) => {
            assert_eq!(Refusal::of(&error), refusal, "{context}");
            // Whatever failed, and wherever: the accounts the transition found.
            let mut after = (accounts(manager), manager.live_objects());
            after.0.version -= meanwhile;
            assert_eq!(after, before, "{context}");
        }
        (result, expected) => panic!("{context}: expected {expected:?}, got {result:?}"),
    }
}

/// Runs one op on both sides and checks that the outcome kinds agree.
#[allow(clippy::too_many_lines)]
fn apply(
    manager: &Manager,
    device: &mut Device<'_>,
    model: &mut Model,
    budgets: &BTreeMap<Location, u64>,
    op: &Op,
) {
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
                device.installed.insert((handle, location));
                model.values.push(ModelValue {
                    handle,
                    charge: bytes,
                    exclusive,
                    source: None,
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
                source: Some(LOCATIONS[at]),
                discarded: false,
                at: BTreeSet::new(),
                uses: BTreeMap::new(),
            });
        }
        Op::Ensure {
            value,
            at,
            asynchronous,
            tier,
            fault,
        } => {
            let attempt = Attempt {
                value,
                action: ensure(LOCATIONS[at]),
                asynchronous,
                tier,
                fault,
            };
            transition(manager, device, model, budgets, &attempt);
        }
        Op::Move {
            value,
            to,
            asynchronous,
            fault,
        } => {
            let attempt = Attempt {
                value,
                action: moving(LOCATIONS[to]),
                asynchronous,
                tier: Tier::NoSource,
                fault,
            };
            transition(manager, device, model, budgets, &attempt);
        }
        Op::Drop { value, at } => {
            let Some(entry) = model.values.get_mut(value) else {
                return;
            };
            let location = LOCATIONS[at];
            let action = Action::Drop {
                handle: HandleSlot(0),
                location,
            };
            let result = manager.transition(&action, entry.handle, false, device);
            if entry.discarded {
                assert!(matches!(
                    result,
                    Err(RunError::Core(CoreError::Handle { .. }))
                ));
                return;
            }
            let protected = entry.uses.get(&location).copied().unwrap_or(0) > 0;
            match result {
                Ok(done) => {
                    assert_eq!(done.source, Some(location));
                    if done.no_op {
                        assert!(!entry.at.contains(&location));
                    } else {
                        assert!(!protected);
                        assert!(entry.at.remove(&location));
                    }
                }
                Err(RunError::Core(CoreError::InUse { .. })) => assert!(protected),
                Err(RunError::Core(CoreError::Ownership { .. })) => {
                    assert!(entry.at.len() == 1 && entry.source.is_none());
                }
                Err(other) => panic!("unexpected {other:?}"),
            }
        }
        Op::Discard { value } => {
            let Some(entry) = model.values.get_mut(value) else {
                return;
            };
            let action = Action::Discard {
                handle: HandleSlot(0),
            };
            let result = manager.transition(&action, entry.handle, false, device);
            if entry.discarded {
                assert!(matches!(
                    result,
                    Err(RunError::Core(CoreError::Handle { .. }))
                ));
                return;
            }
            match result {
                Ok(done) => {
                    assert_eq!(
                        done,
                        Transitioned {
                            no_op: false,
                            source: None
                        }
                    );
                    assert!(entry.uses.values().all(|&count| count == 0));
                    entry.at.clear();
                    entry.discarded = true;
                    entry.source = None;
                }
                Err(RunError::Core(CoreError::InUse { .. })) => {
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
                *model.entry(handle).uses.entry(location).or_default() -= 1;
            }
        }
        Op::Complete { which } => {
            let pending = model.pending();
            if let Some(&(token, _, _)) = pending.get(which) {
                let mut freed = Freed::default();
                assert!(manager.settle_pending(token, &mut freed));
                device.free(&freed);
                assert!(
                    !manager.settle_pending(token, &mut Freed::default()),
                    "settling is one-shot"
                );
                model.settle(token);
            }
        }
    }
    assert!(
        manager.version() >= version_before,
        "the version never decreases"
    );
}

fn check(manager: &Manager, device: &Device<'_>, model: &Model) {
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
            "{}: no temporary charge outlives its transition",
            books.location
        );
    }
    let mut held = BTreeSet::new();
    for entry in &model.values {
        let record = state.record(entry.handle).expect("issued");
        let at: BTreeSet<Location> = record
            .materializations
            .iter()
            .map(|materialization| materialization.location)
            .collect();
        assert_eq!(at, entry.at);
        assert_eq!(record.discarded, entry.discarded);
        assert_eq!(record.source, entry.source);
        if entry.exclusive {
            assert!(at.len() <= 1, "EXCLUSIVE value replicated");
        }
        held.extend(at.iter().map(|&location| (entry.handle, location)));
    }
    assert_eq!(
        device.installed, held,
        "the device holds what the records name"
    );
    // The pending leases are exactly the copies in flight's, on what they protect.
    let pending = model.pending();
    let tokens: Vec<u64> = pending.iter().map(|&(token, ..)| token).collect();
    assert_eq!(manager.pending_lease_tokens(), tokens);
    assert_eq!(
        state.pending_leases,
        u64::try_from(tokens.len()).expect("small")
    );
    for &(token, handle, at) in &pending {
        assert_eq!(
            manager.pending_lease_values(token),
            Some((vec![handle], at))
        );
    }
    let transfers = model
        .copies
        .iter()
        .filter(|copy| copy.destination.1.is_some())
        .count();
    assert_eq!(manager.transfer_count(), transfers);
    // Every object the core's book holds, the device keeps, and no other.
    assert_eq!(manager.live_objects(), model.objects());
    assert_eq!(device.kept.len(), model.objects());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

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
        let mut device = Device::new(&manager);
        let mut model = Model::default();
        for op in &ops {
            apply(&manager, &mut device, &mut model, &budgets, op);
            check(&manager, &device, &model);
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
    let mut device = Device::new(&manager);
    // While the source loads, the temporary charge is held: counted as reserved,
    // the peak raised, no version step, and a second reconstruction refused.
    device.on_load = Some(Box::new(move |manager: &Manager| {
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
    }));
    // The load fails: the transition aborts and the charge goes back.
    device.arm(
        Fault::Step {
            at: 0,
            onward: false,
        },
        Tier::NoSource,
    );
    let failed = manager.transition(&ensure(Location::PinnedHost), value, false, &mut device);
    assert_eq!(failed, Err(RunError::Device(Step::Load)));
    assert!(device.on_load.is_none(), "the load ran");
    let books = manager.current().books(Location::PageableHost);
    assert_eq!((books.reserved_bytes, books.peak_charged_bytes), (0, 60));
    assert_eq!(
        books.peak_used_bytes, 0,
        "temporary charges are not materialisations"
    );
    assert_eq!(manager.version(), version);
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
