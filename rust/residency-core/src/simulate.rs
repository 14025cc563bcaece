//! Preflight and `explain`: one pass of a plan over a copy of the manager's state.
//!
//! The simulation follows the documented preflight rules (docs/concepts/plans.md#preflight)
//! literally, action by action, and stops at the first failure. It reads only numbers: handles are the
//! plan's slots resolved by the caller, protection comes from the live token counts,
//! and nothing here calls a source or moves a value.

use std::cell::Cell;

use crate::fasthash::FastMap;
use std::fmt::Write as _;

use crate::location::{Location, LocationSet};
use crate::plan::{Action, ActionKind, Plan};
use crate::state::{HandleId, State, ValueRecord};

/// How the caller resolved one handle slot of the plan: a live handle, or the
/// handle error's message (foreign, unknown, discarded, type-inconsistent).
pub type SlotResolution = Result<HandleId, String>;

/// Which CUDA devices exist, for location validation inside the simulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaDevices {
    Unavailable,
    Count(u32),
}

impl CudaDevices {
    /// The devices a runtime reports, `count` of them (none: no CUDA).
    pub fn from_count(count: u32) -> Self {
        match count {
            0 => Self::Unavailable,
            count => Self::Count(count),
        }
    }

    /// Whether CUDA device `index`, which the caller writes as `location`, can be
    /// used here; the message says why not (docs/concepts/locations-and-budgets.md).
    pub fn check(self, location: impl std::fmt::Display, index: u32) -> Result<(), String> {
        match self {
            Self::Unavailable => Err(crate::location::cuda_unavailable(location)),
            Self::Count(count) if index >= count => Err(format!(
                "{location} is not usable: only {count} CUDA device(s) present"
            )),
            Self::Count(_) => Ok(()),
        }
    }
}

/// One simulated action, as `ResidencyActionExplanation` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionOutcome {
    pub executable: bool,
    pub no_op: bool,
    pub source: Option<Location>,
    pub destination: Option<Location>,
    pub logical_nbytes: u64,
    pub storage_nbytes: u64,
    pub reason: Option<String>,
}

/// The whole simulation, as `ResidencyPlanExplanation` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Simulation {
    pub actions: Vec<ActionOutcome>,
    /// Predicted peak of `used + reserved` per location: registered locations in
    /// registration order, then new ones in the order the plan first prepared them.
    pub peaks: Vec<(Location, u64)>,
    pub feasible: bool,
    pub reason: Option<String>,
}

/// Protection counts a pending lease contributes but that no longer protect (its
/// events completed), keyed by `(handle, location)`.
pub type CompletedPending = FastMap<(HandleId, Location), u32>;

#[derive(Debug, Clone)]
struct Books {
    location: Location,
    budget: Option<u64>,
    used: u64,
    reserved: u64,
    peak: u64,
}

#[derive(Debug, Clone, Copy)]
struct SlotState {
    at: LocationSet,
    discarded: bool,
}

impl SlotState {
    fn contains(&self, location: Location) -> bool {
        self.at.contains(location)
    }

    fn insert(&mut self, location: Location) {
        self.at.insert(location);
    }

    fn remove(&mut self, location: Location) {
        self.at.remove(location);
    }
}

/// Python's `repr()` of a string, for the reason texts that quote a name with `!r`
/// (docs/concepts/plans.md#preflight).
pub fn py_repr(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(text.len() + 2);
    out.push(quote);
    for character in text.chars() {
        match character {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

struct Simulator<'a> {
    state: &'a State,
    resolutions: &'a [SlotResolution],
    cuda: CudaDevices,
    completed: &'a CompletedPending,
    books: Vec<Books>,
    slots: Vec<Option<SlotState>>,
    /// The record read last: an action reads its value's record several times, and
    /// the state's persistent vector is a tree walk per read.
    last_record: Cell<Option<(HandleId, &'a ValueRecord)>>,
}

impl<'a> Simulator<'a> {
    fn new(
        state: &'a State,
        plan: &Plan,
        resolutions: &'a [SlotResolution],
        cuda: CudaDevices,
        completed: &'a CompletedPending,
    ) -> Self {
        let books = state
            .locations
            .iter()
            .map(|books| Books {
                location: books.location,
                budget: books.budget_bytes,
                used: books.used_bytes,
                reserved: books.reserved_bytes,
                peak: books.charged_bytes(),
            })
            .collect();
        Self {
            state,
            resolutions,
            cuda,
            completed,
            books,
            slots: vec![None; plan.handles().len()],
            last_record: Cell::new(None),
        }
    }

    fn record(&self, handle: HandleId) -> &'a ValueRecord {
        if let Some((last, record)) = self.last_record.get()
            && last == handle
        {
            return record;
        }
        // Resolved slots name issued, live handles.
        let state: &'a State = self.state;
        let record: &'a ValueRecord = &state.values[handle as usize];
        self.last_record.set(Some((handle, record)));
        record
    }

    /// Prepares a location: validated, and registered in the simulation on first use.
    fn prepare(&mut self, location: Location) -> Result<usize, String> {
        if let Some(index) = self
            .books
            .iter()
            .position(|books| books.location == location)
        {
            return Ok(index);
        }
        if let Location::Cuda(index) = location {
            self.cuda.check(location, u32::from(index))?;
        }
        self.books.push(Books {
            location,
            budget: None,
            used: 0,
            reserved: 0,
            peak: 0,
        });
        Ok(self.books.len() - 1)
    }

    fn add(
        &mut self,
        slot: usize,
        location: Location,
        charge: u64,
        temporary: bool,
    ) -> Result<(), String> {
        let index = self.prepare(location)?;
        let books = &mut self.books[index];
        let total = books
            .used
            .saturating_add(books.reserved)
            .saturating_add(charge);
        books.peak = books.peak.max(total);
        if books.budget.is_some_and(|budget| total > budget) {
            return Err(format!("Transition exceeds budget at {location}"));
        }
        if !temporary {
            books.used = books.used.saturating_add(charge);
            if let Some(state) = self.slots[slot].as_mut() {
                state.insert(location);
            }
        }
        Ok(())
    }

    fn remove(&mut self, slot: usize, location: Location, charge: u64) {
        if let Some(books) = self
            .books
            .iter_mut()
            .find(|books| books.location == location)
        {
            books.used = books.used.saturating_sub(charge);
        }
        if let Some(state) = self.slots[slot].as_mut() {
            state.remove(location);
        }
    }

    /// Protection of the *live* materialisation; completed pending leases (explain) no
    /// longer protect (docs/concepts/plans.md#protection-in-simulation).
    fn protected(&self, handle: HandleId, location: Location) -> bool {
        let Some(materialization) = self.record(handle).materialization(location) else {
            return false;
        };
        let completed = self
            .completed
            .get(&(handle, location))
            .copied()
            .unwrap_or(0);
        materialization.use_count > 0
            || materialization.hold_count > 0
            || materialization.pending_count > completed
    }

    fn slot_state(&mut self, slot: usize, handle: HandleId) -> &mut SlotState {
        if self.slots[slot].is_none() {
            let mut at = LocationSet::default();
            for materialization in &self.record(handle).materializations {
                at.insert(materialization.location);
            }
            self.slots[slot] = Some(SlotState {
                at,
                discarded: false,
            });
        }
        self.slots[slot].as_mut().expect("initialised above")
    }

    fn admit_reservations(&mut self, plan: &Plan, labels: &[String]) -> Result<(), String> {
        for (position, reservation) in plan.reservations().iter().enumerate() {
            let index = self.prepare(reservation.location)?;
            let books = &mut self.books[index];
            books.reserved = books.reserved.saturating_add(reservation.nbytes);
            let charged = books.used.saturating_add(books.reserved);
            books.peak = books.peak.max(charged);
            if books.budget.is_some_and(|budget| charged > budget) {
                let label = labels
                    .get(position)
                    .cloned()
                    .unwrap_or_else(|| py_repr(&reservation.label));
                return Err(format!(
                    "Reservation {label} exceeds budget at {}",
                    reservation.location
                ));
            }
        }
        Ok(())
    }

    fn action(&mut self, plan: &Plan, action: &Action) -> ActionOutcome {
        let slot = action.handle().index();
        let failed = |reason: String| ActionOutcome {
            executable: false,
            no_op: false,
            source: None,
            destination: None,
            logical_nbytes: 0,
            storage_nbytes: 0,
            reason: Some(reason),
        };
        let handle = match &self.resolutions[slot] {
            Ok(handle) => *handle,
            Err(message) => return failed(message.clone()),
        };
        if self.slot_state(slot, handle).discarded {
            return failed(format!(
                "Value {} is discarded",
                py_repr(&plan.handle(action.handle()).handle_id)
            ));
        }
        let record = self.record(handle);
        let spec = record.spec;
        let charge = spec.storage_nbytes();
        let mut outcome = ActionOutcome {
            executable: true,
            no_op: false,
            source: None,
            destination: None,
            logical_nbytes: spec.logical_nbytes(),
            storage_nbytes: charge,
            reason: None,
        };
        let result = match *action {
            Action::Ensure { location, .. } => {
                outcome.destination = Some(location);
                self.ensure(slot, handle, location, charge, &mut outcome)
            }
            Action::Move { to, from, .. } => {
                outcome.destination = Some(to);
                self.move_to(slot, handle, to, from, charge, &mut outcome)
            }
            Action::Drop { location, .. } => {
                outcome.source = Some(location);
                self.drop_at(slot, handle, location, charge, &mut outcome)
            }
            Action::Discard { .. } => self.discard(slot, handle, charge),
        };
        if let Err(reason) = result {
            outcome.executable = false;
            outcome.reason = Some(reason);
        }
        outcome
    }

    /// Marks the outcome a no-op of `kind`, with the reason its report gives.
    fn no_op(outcome: &mut ActionOutcome, kind: ActionKind) {
        outcome.no_op = true;
        outcome.reason = kind.no_op_reason().map(str::to_owned);
    }

    fn ensure(
        &mut self,
        slot: usize,
        handle: HandleId,
        destination: Location,
        charge: u64,
        outcome: &mut ActionOutcome,
    ) -> Result<(), String> {
        self.prepare(destination)?;
        let state = self.slot_state(slot, handle);
        if state.contains(destination) {
            Self::no_op(outcome, ActionKind::Ensure);
            return Ok(());
        }
        let first = state.at.first();
        let record = self.record(handle);
        if record.spec.is_exclusive() && first.is_some() {
            return Err("EnsureResident would replicate an EXCLUSIVE value".to_owned());
        }
        let source = match (first, record.source) {
            (Some(first), _) => first,
            (None, Some(source_location)) => source_location,
            (None, None) => return Err("value has no materialization or source".to_owned()),
        };
        outcome.source = Some(source);
        if first.is_none() {
            self.add(slot, source, charge, true)?;
        }
        self.add(slot, destination, charge, false)
    }

    fn move_to(
        &mut self,
        slot: usize,
        handle: HandleId,
        to: Location,
        from: Option<Location>,
        charge: u64,
        outcome: &mut ActionOutcome,
    ) -> Result<(), String> {
        self.prepare(to)?;
        let state = *self.slot_state(slot, handle);
        let source = match from {
            Some(explicit) => {
                // The explicit source is settled before anything can fail, so an
                // infeasible move still names it (docs/concepts/plans.md#simulation-results).
                outcome.source = Some(explicit);
                self.prepare(explicit)?;
                if !state.contains(explicit) {
                    return Err(format!("explicit source {explicit} is not resident"));
                }
                Some(explicit)
            }
            None if !state.at.is_empty() => state.at.iter().find(|&location| location != to),
            None => self.record(handle).source,
        };
        outcome.source = source;
        if state.contains(to) {
            return match source {
                None => {
                    Self::no_op(outcome, ActionKind::Move);
                    Ok(())
                }
                Some(source) if source == to => {
                    Self::no_op(outcome, ActionKind::Move);
                    Ok(())
                }
                Some(source) => {
                    if self.protected(handle, source) {
                        return Err(format!("source {source} is protected"));
                    }
                    self.remove(slot, source, charge);
                    Ok(())
                }
            };
        }
        let Some(source) = source else {
            return Err("value has no materialization or source".to_owned());
        };
        let resident = state.contains(source);
        if resident && self.protected(handle, source) {
            return Err(format!("source {source} is protected"));
        }
        if !resident {
            self.add(slot, source, charge, true)?;
        }
        self.add(slot, to, charge, false)?;
        if resident {
            self.remove(slot, source, charge);
        }
        Ok(())
    }

    fn drop_at(
        &mut self,
        slot: usize,
        handle: HandleId,
        location: Location,
        charge: u64,
        outcome: &mut ActionOutcome,
    ) -> Result<(), String> {
        self.prepare(location)?;
        let state = self.slot_state(slot, handle);
        if !state.contains(location) {
            Self::no_op(outcome, ActionKind::Drop);
            return Ok(());
        }
        let sole = state.at.len() == 1;
        if self.protected(handle, location) {
            return Err(format!("materialization at {location} is protected"));
        }
        if sole && self.record(handle).source.is_none() {
            return Err("cannot drop final MUST_PRESERVE materialization".to_owned());
        }
        self.remove(slot, location, charge);
        Ok(())
    }

    fn discard(&mut self, slot: usize, handle: HandleId, charge: u64) -> Result<(), String> {
        let state = *self.slot_state(slot, handle);
        let protected: Vec<String> = state
            .at
            .iter()
            .filter(|&location| self.protected(handle, location))
            .map(|location| py_repr(&location.name()))
            .collect();
        if !protected.is_empty() {
            return Err(format!(
                "discarded value has protected locations [{}]",
                protected.join(", ")
            ));
        }
        for location in state.at.iter() {
            self.remove(slot, location, charge);
        }
        if let Some(state) = self.slots[slot].as_mut() {
            state.discarded = true;
        }
        Ok(())
    }
}

/// Simulates `plan` over `state` (docs/concepts/plans.md#preflight). `labels` are the Python reprs of the
/// reservation labels, in plan order.
pub fn simulate(
    state: &State,
    plan: &Plan,
    resolutions: &[SlotResolution],
    cuda: CudaDevices,
    completed: &CompletedPending,
    labels: &[String],
) -> Simulation {
    let mut simulator = Simulator::new(state, plan, resolutions, cuda, completed);
    let mut actions = Vec::with_capacity(plan.action_count());
    let mut failure: Option<String> = None;
    let reclaim = plan.reclaim().len();
    let mut reservations_admitted = false;
    for (position, (_, _, action)) in plan.ordered_actions().enumerate() {
        if position == reclaim {
            reservations_admitted = true;
            if let Err(reason) = simulator.admit_reservations(plan, labels) {
                failure = Some(reason);
                break;
            }
        }
        let outcome = simulator.action(plan, action);
        let failed = !outcome.executable;
        if failed {
            failure.clone_from(&outcome.reason);
        }
        actions.push(outcome);
        if failed {
            break;
        }
    }
    if failure.is_none() && !reservations_admitted {
        // Every action was a reclaim action (or there were none): reservations come after.
        if let Err(reason) = simulator.admit_reservations(plan, labels) {
            failure = Some(reason);
        }
    }
    Simulation {
        actions,
        // Collected in the books' own allocation.
        peaks: simulator
            .books
            .into_iter()
            .map(|books| (books.location, books.peak))
            .collect(),
        feasible: failure.is_none(),
        reason: failure,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn py_repr_matches_python() {
        assert_eq!(py_repr("abc"), "'abc'");
        assert_eq!(py_repr("it's"), "\"it's\"");
        assert_eq!(py_repr("both ' and \""), "'both \\' and \"'");
        assert_eq!(py_repr("a\\b\n"), "'a\\\\b\\n'");
        assert_eq!(py_repr("\u{1}"), "'\\x01'");
        assert_eq!(py_repr("é"), "'é'");
    }

    #[test]
    fn location_sets_hold_every_location_disks_included() {
        use crate::location::{MAX_CUDA_INDEX, MAX_DISK_INDEX};
        let every: Vec<Location> = [Location::PageableHost, Location::PinnedHost]
            .into_iter()
            .chain((0..=MAX_CUDA_INDEX).map(Location::Cuda))
            .chain((0..=MAX_DISK_INDEX).map(Location::Disk))
            .collect();
        let mut set = LocationSet::default();
        for &location in every.iter().rev() {
            set.insert(location);
            assert!(set.contains(location));
            assert_eq!(set.first(), Some(location));
        }
        assert_eq!(set.len() as usize, every.len());
        assert_eq!(set.iter().collect::<Vec<_>>(), every);
        for &location in &every {
            set.remove(location);
        }
        assert!(set.is_empty());
    }
}
