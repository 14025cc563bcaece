//! The controller's decide over a lowered request (docs/concepts/controller.md#decide):
//! under one hold of the gate, the request's currency, then the search, the decided
//! plan's core IR and its simulation against one state. The glue reaps first and hands
//! in the pending leases whose events completed; the built-in policies run here, any
//! other policy is the glue's [`SearchPolicy`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::CoreError;
use crate::keys::KeyStore;
use crate::location::{InvalidLocation, Location};
use crate::plan::{Action, ActionKind, Plan, Reservation};
use crate::search::{
    Candidate, Eviction, IndexedLru, IndexedSchedule, NextUses, Requirement, ScheduleAware, Search,
    SearchError, SearchOutcome, SearchPolicy, TieredLru,
};
use crate::simulate::{CudaDevices, Simulation, SlotResolution};
use crate::state::HandleId;
use crate::victims::ResidentSet;

use super::{Manager, SearchInputs};

/// A request as a decide reads it, converted once and kept per request object: the
/// manager's discard count when its handles were resolved, its requirements by handle
/// index, its name, its reservations and their labels as `simulate` takes them.
#[derive(Debug)]
pub struct LoweredRequest {
    pub discards: u64,
    pub requirements: Vec<Requirement>,
    /// Shared with every plan decided for it (no copy per decide).
    pub name: Arc<str>,
    pub reservations: Vec<Reservation>,
    /// The reservations as the search takes them.
    pub searched: Vec<(Location, u64)>,
    pub labels: Vec<String>,
}

impl LoweredRequest {
    /// From `(handle index, location code)` rows, the name, `(code, nbytes, label)`
    /// reservations and the labels `simulate` reports.
    pub fn new(
        discards: u64,
        rows: Vec<(u32, u32)>,
        name: String,
        reservations: Vec<(u32, u64, String)>,
        labels: Vec<String>,
    ) -> Result<Self, InvalidLocation> {
        let requirements = rows
            .into_iter()
            .map(|(handle, code)| {
                Ok(Requirement {
                    value: handle as usize,
                    location: Location::from_code(code)?,
                })
            })
            .collect::<Result<Vec<_>, InvalidLocation>>()?;
        let reservations = reservations
            .into_iter()
            .map(|(code, nbytes, label)| {
                Ok(Reservation {
                    location: Location::from_code(code)?,
                    nbytes,
                    label: Arc::from(label),
                })
            })
            .collect::<Result<Vec<_>, InvalidLocation>>()?;
        let searched = reservations
            .iter()
            .map(|reservation| (reservation.location, reservation.nbytes))
            .collect();
        Ok(Self {
            discards,
            requirements,
            name: Arc::from(name),
            reservations,
            searched,
            labels,
        })
    }
}

impl LoweredRequest {
    /// Its requirements grouped by location in order of first appearance, each group's
    /// values in requirement order, each once: the groups a staging holds (its handle
    /// objects' groups, resolved).
    pub fn groups(&self) -> Vec<(Location, Vec<HandleId>)> {
        let mut groups: Vec<(Location, Vec<HandleId>)> = Vec::new();
        for requirement in &self.requirements {
            let Ok(index) = HandleId::try_from(requirement.value) else {
                continue;
            };
            match groups
                .iter_mut()
                .find(|(at, _)| *at == requirement.location)
            {
                Some((_, indices)) if indices.contains(&index) => {}
                Some((_, indices)) => indices.push(index),
                None => groups.push((requirement.location, vec![index])),
            }
        }
        groups
    }
}

/// A schedule's steps as handle indices of one manager, resolved once and valid until
/// the manager next discards a value: each handle's steps are kept sorted, so a decide
/// finds a next use from its position by a binary search
/// (docs/concepts/controller.md#schedule-aware-eviction).
#[derive(Debug)]
pub struct ScheduleIndex {
    pub uses: NextUses,
    pub len: usize,
    pub discards: u64,
}

impl ScheduleIndex {
    /// The index of `steps`, one pass of them or, `cyclic`, repeated forever.
    pub fn new(steps: &[Vec<usize>], discards: u64, cyclic: bool) -> Self {
        Self {
            uses: if cyclic {
                NextUses::cyclic(steps)
            } else {
                NextUses::new(steps)
            },
            len: steps.len(),
            discards,
        }
    }
}

/// The built-in policy a decide consults: the controller's keys (with the orders of
/// the residents it keeps), the fallback tiers, and the schedule-aware policy's index
/// and position when it is that policy.
#[derive(Debug, Clone, Copy)]
pub struct NativePolicy<'a> {
    pub keys: &'a Mutex<KeyStore>,
    pub tiers: &'a BTreeMap<Location, Vec<Location>>,
    pub schedule: Option<(&'a ScheduleIndex, usize)>,
}

/// `(kind code, plan handle slot, location code, from code or -1)`; the kind codes are
/// [`kind_code`]'s.
pub type Row = (u8, u32, u32, i64);
/// `(reclaim position, rank, released location code, released bytes, reason)`.
pub type EvictionRow = (usize, usize, u32, u64, String);

/// An action kind as a decided plan's rows name it: 0 ensure, 1 move, 2 drop, 3 discard
/// (small integers, so reading a row builds no object).
pub fn kind_code(kind: ActionKind) -> u8 {
    match kind {
        ActionKind::Ensure => 0,
        ActionKind::Move => 1,
        ActionKind::Drop => 2,
        ActionKind::Discard => 3,
    }
}

/// What a decide found: the decided plan, its simulation, each plan slot's handle index
/// and the search's evictions, kept as the core's data; the glue reads what it needs
/// when a record built from them is first read
/// (docs/concepts/controller.md#decisions-and-evictions).
#[derive(Debug)]
pub struct Decision {
    pub plan: Arc<Plan>,
    pub simulation: Simulation,
    pub slots: Vec<HandleId>,
    pub evictions: Vec<Eviction>,
    pub explored: u64,
    pub version: u64,
    /// The CUDA devices its simulation checked locations against.
    pub cuda: CudaDevices,
    /// Whether its simulation counted pending leases whose events completed as released.
    pub set_aside: bool,
}

impl Decision {
    /// Its slots as a run's resolutions, where its simulation is what a run's preflight
    /// of its plan would simulate now, under the same hold of the gate: feasible, with
    /// the CUDA devices `cuda`, no reservation (so no label), no completed lease counted
    /// as released; else `None`.
    /// `ir` is the plan a run runs: its actions, in order, must be this plan's, slot for
    /// slot (so its slot `k` names this plan's slot `k`'s value), and its slots as many.
    /// Without reservations a simulation is the actions in order, whichever phase holds
    /// them (a staging's run keeps them all in one).
    pub fn preflighted(&self, ir: &Plan, cuda: CudaDevices) -> Option<Arc<[SlotResolution]>> {
        (self.simulation.feasible
            && !self.set_aside
            && self.cuda == cuda
            && self.plan.reservations().is_empty()
            && ir.reservations().is_empty()
            && ir.exit().is_empty()
            && self.plan.exit().is_empty()
            && ir.handles().len() == self.slots.len()
            && ir
                .ordered_actions()
                .map(|(_, _, action)| action)
                .eq(self.plan.ordered_actions().map(|(_, _, action)| action)))
        .then(|| self.slots.iter().copied().map(Ok).collect())
    }

    /// Whether this decision runs as `previous` ran: feasible, the same actions on the
    /// same slots, and evicting nothing unless `reclaim` allows it.
    pub fn runs_as(&self, previous: &Self, reclaim: bool) -> bool {
        self.simulation.feasible
            && self.same_as(previous)
            && (reclaim || self.plan.reclaim().is_empty())
    }

    /// The same actions as `other`'s, on the same slots.
    pub fn same_as(&self, other: &Self) -> bool {
        self.slots == other.slots
            && self.plan.reclaim() == other.plan.reclaim()
            && self.plan.enter() == other.plan.enter()
    }

    /// The reclaim actions as [`Row`]s.
    pub fn reclaim_rows(&self) -> Vec<Row> {
        rows(self.plan.reclaim())
    }

    /// The enter actions as [`Row`]s.
    pub fn enter_rows(&self) -> Vec<Row> {
        rows(self.plan.enter())
    }

    /// The evictions as [`EvictionRow`]s.
    pub fn eviction_rows(&self) -> Vec<EvictionRow> {
        self.evictions
            .iter()
            .enumerate()
            .map(|(index, eviction)| {
                (
                    index,
                    eviction.rank,
                    eviction.released_location.code(),
                    eviction.released_nbytes,
                    eviction.reason.text(),
                )
            })
            .collect()
    }
}

/// A decided plan's actions as rows.
fn rows(actions: &[Action]) -> Vec<Row> {
    actions
        .iter()
        .map(|action| {
            let slot = action.handle().0;
            let (kind, code, from) = match *action {
                Action::Ensure { location, .. } => (ActionKind::Ensure, location.code(), None),
                Action::Drop { location, .. } => (ActionKind::Drop, location.code(), None),
                Action::Move { to, from, .. } => (ActionKind::Move, to.code(), from),
                // A decided plan has no discard; the row shape still names it.
                Action::Discard { .. } => (ActionKind::Discard, 0, None),
            };
            let from = from.map_or(-1, |from| i64::from(from.code()));
            (kind_code(kind), slot, code, from)
        })
        .collect()
}

/// Why a decide decided nothing.
#[derive(Debug)]
pub enum DecideFailure {
    /// A requirement names a handle index with no live value.
    NotLive(usize),
    /// The search (or the plan's lowering) refused, as its core error. A policy's own
    /// failure (`SearchError::Policy`) or an interrupt is here too, as a policy error:
    /// the glue raises the error its policy kept instead.
    Refused(CoreError),
}

/// A policy with an interrupt check from the glue (Ctrl-C during a long search).
struct Interruptible<'f, P> {
    policy: P,
    interrupted: &'f mut dyn FnMut() -> bool,
}

impl<P: SearchPolicy> SearchPolicy for Interruptible<'_, P> {
    fn order(&mut self, candidates: &[Candidate]) -> Result<Vec<usize>, SearchError> {
        self.policy.order(candidates)
    }

    fn fallback_locations(&mut self, at: Location) -> Result<Vec<Location>, SearchError> {
        self.policy.fallback_locations(at)
    }

    fn sync_residents(
        &mut self,
        location: Location,
        residents: Option<&ResidentSet>,
    ) -> Option<usize> {
        self.policy.sync_residents(location, residents)
    }

    fn next_resident(&self, location: Location, after: Option<usize>) -> Option<usize> {
        self.policy.next_resident(location, after)
    }

    fn compare(&self, left: usize, right: usize) -> std::cmp::Ordering {
        self.policy.compare(left, right)
    }

    fn check_interrupt(&mut self) -> Result<(), SearchError> {
        if (self.interrupted)() {
            Err(SearchError::Interrupted)
        } else {
            Ok(())
        }
    }
}

impl Manager {
    /// Whether a decide of `request` (with a schedule resolved at `schedule_discards`)
    /// may run: nothing was discarded since they were resolved. A stale one decides
    /// nothing; the glue resolves them again.
    pub fn is_current(&self, request: &LoweredRequest, schedule_discards: Option<u64>) -> bool {
        let current = self.discards();
        request.discards == current && schedule_discards.is_none_or(|discards| discards == current)
    }

    /// The decide of a current `request` with a built-in policy, the gate held and
    /// reaped: [`Manager::decide_with`] with the tiered LRU, or the schedule-aware
    /// policy standing at its position, each walking the order of the residents it
    /// keeps with the keys (handed back synced). `interrupted` is asked between search
    /// states.
    pub fn decide_native(
        &self,
        request: &LoweredRequest,
        limit: u64,
        cuda: CudaDevices,
        completed_leases: &[u64],
        policy: NativePolicy<'_>,
        interrupted: &mut dyn FnMut() -> bool,
    ) -> Result<Decision, DecideFailure> {
        let lock = || policy.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let lru = |keys| TieredLru {
            keys,
            tiers: policy.tiers.clone(),
        };
        let Some((index, position)) = policy.schedule else {
            let (map, mut order) = lock().take_order();
            let native = IndexedLru {
                lru: lru(map),
                order: &mut order,
            };
            let mut policy = Interruptible {
                policy: native,
                interrupted,
            };
            let decided = self.decide_with(request, limit, cuda, completed_leases, &mut policy);
            lock().put_order(order);
            return decided;
        };
        let (map, mut order) = lock().take_schedule_order();
        let native = IndexedSchedule {
            policy: ScheduleAware {
                lru: lru(map),
                next_use: index.uses.at(position),
            },
            order: &mut order,
        };
        let mut policy = Interruptible {
            policy: native,
            interrupted,
        };
        let decided = self.decide_with(request, limit, cuda, completed_leases, &mut policy);
        lock().put_schedule_order(order);
        decided
    }

    /// The decide of a current `request` under the gate, reaped: the search against
    /// the state as it stands, with `policy`; then the decided plan's core IR and its
    /// simulation (with the CUDA devices `cuda`, the pending leases
    /// `completed_leases` counted as released).
    pub fn decide_with<P: SearchPolicy>(
        &self,
        request: &LoweredRequest,
        limit: u64,
        cuda: CudaDevices,
        completed_leases: &[u64],
        policy: &mut P,
    ) -> Result<Decision, DecideFailure> {
        let inputs: SearchInputs = self.search_inputs();
        if let Some(requirement) = request
            .requirements
            .iter()
            .find(|requirement| !inputs.values.is_live(requirement.value))
        {
            return Err(DecideFailure::NotLive(requirement.value));
        }
        let search = Search::new(
            &inputs.values,
            &inputs.budgets,
            &request.requirements,
            &request.searched,
            policy,
            limit,
        );
        let outcome: SearchOutcome = search.run(&inputs.books).map_err(|error| {
            DecideFailure::Refused(error.into_core_error(&request.name, limit, |value| {
                let state = self.current();
                let handle = HandleId::try_from(value).ok()?;
                Some(state.record(handle)?.handle_id.to_string())
            }))
        })?;
        let (plan, slots) = self
            .decided_plan(&request.name, &outcome, request.reservations.clone())
            .map_err(DecideFailure::Refused)?;
        let resolutions: Vec<SlotResolution> = slots.iter().copied().map(Ok).collect();
        let simulation =
            self.simulate(&plan, &resolutions, cuda, completed_leases, &request.labels);
        Ok(Decision {
            plan: Arc::new(plan),
            simulation,
            slots,
            evictions: outcome.evictions,
            explored: outcome.explored,
            version: inputs.version,
            cuda,
            set_aside: !completed_leases.is_empty(),
        })
    }
}
