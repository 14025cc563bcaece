//! The ordered plan IR: actions over interned handles, reservations, and phases.
//!
//! A plan is lowered from Python once, when it is built. Handles are interned into a
//! per-plan table so the manager resolves each distinct handle once per execution.

use std::fmt;
use std::sync::Arc;

use crate::error::{CoreError, CoreResult};
use crate::location::Location;

/// A phase of a plan run, as its diagnostics name it: a plan's actions belong to
/// reclaim, enter or exit; `execute_actions` runs its actions as the one phase
/// execute, and a scope admits its reservations in the reserve phase, between
/// reclaim and enter (docs/concepts/plans.md#phase-order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PlanPhase {
    Execute,
    Reclaim,
    Reserve,
    Enter,
    Exit,
}

impl PlanPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Execute => "execute",
            Self::Reclaim => "reclaim",
            Self::Reserve => "reserve",
            Self::Enter => "enter",
            Self::Exit => "exit",
        }
    }
}

impl fmt::Display for PlanPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The four primitive transitions, by name. Plans, the controller's search and the
/// bindings all tell actions apart by this one enum; the bindings expose it to Python
/// so the glue never spells a kind as a bare number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ActionKind {
    Ensure,
    Move,
    Drop,
    Discard,
}

impl ActionKind {
    /// The name of the kind's action record class (`fhelium.residency.plan`), as
    /// messages about an action name it.
    pub fn record_name(self) -> &'static str {
        match self {
            Self::Ensure => "EnsureResident",
            Self::Move => "MoveResident",
            Self::Drop => "DropResident",
            Self::Discard => "DiscardValue",
        }
    }

    /// Whether an action of this kind takes a transfer stream: only those that copy
    /// to a location (an ensure, a move).
    #[inline]
    pub fn takes_stream(self) -> bool {
        matches!(self, Self::Ensure | Self::Move)
    }

    /// The kinds in the order the bindings tell an action record's class apart: an
    /// exact class by identity first, then a subclass, in this order.
    pub const ALL: [Self; 4] = [Self::Ensure, Self::Move, Self::Drop, Self::Discard];

    /// The attributes the kind's action record names its locations by
    /// (`fhelium.residency.plan`): an ensure's and a drop's `location`, a move's
    /// destination `to` and its optional source `from_location`; a discard names none.
    #[inline]
    pub fn record_fields(self) -> RecordFields {
        match self {
            Self::Ensure | Self::Drop => RecordFields {
                location: Some("location"),
                from: None,
            },
            Self::Move => RecordFields {
                location: Some("to"),
                from: Some("from_location"),
            },
            Self::Discard => RecordFields {
                location: None,
                from: None,
            },
        }
    }

    /// The reason a no-op transition of this kind reports
    /// (docs/concepts/transitions.md#reports); a discard is never a no-op.
    #[inline]
    pub fn no_op_reason(self) -> Option<&'static str> {
        match self {
            Self::Ensure => Some("destination already resident"),
            Self::Move => Some("destination already owns the selected replica"),
            Self::Drop => Some("materialization already absent"),
            Self::Discard => None,
        }
    }
}

/// The attributes of an action record that hold its location records (see
/// `ActionKind::record_fields`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordFields {
    /// The location the action names: an ensure's or a drop's, a move's destination.
    pub location: Option<&'static str>,
    /// A move's source, which may hold `None`.
    pub from: Option<&'static str>,
}

/// A location a transition's report or telemetry names: none, the location record
/// the action itself names, or the shared record of a location.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    None,
    Named,
    At(Location),
}

/// What a transition reports of the allocator (see `Action::telemetry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Telemetry {
    /// The CUDA location whose allocator the report names.
    pub device: Place,
    /// Whether the allocator's figures are read before and after the transition.
    pub readings: bool,
}

/// What a transition's report names (see `Action::report_places`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportPlaces {
    pub source: Place,
    pub destination: Place,
    /// The kind whose no-op reason the report gives; `None` when it is not a no-op.
    pub no_op: Option<ActionKind>,
}

/// A handle as the caller wrote it. The manager resolves it against its own records;
/// `type_key` identifies the handle's value type, interned by the glue.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HandleRef {
    pub manager_id: Arc<str>,
    pub handle_id: Arc<str>,
    pub type_key: u64,
}

/// An index into a plan's handle table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HandleSlot(pub u32);

impl HandleSlot {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// One primitive transition request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    Ensure {
        handle: HandleSlot,
        location: Location,
    },
    Move {
        handle: HandleSlot,
        to: Location,
        from: Option<Location>,
    },
    Drop {
        handle: HandleSlot,
        location: Location,
    },
    Discard {
        handle: HandleSlot,
    },
}

impl Action {
    /// An action as the bindings encode it: its kind, its handle slot, the location
    /// code it names (a move's destination; ignored for a discard) and a move's source
    /// code, negative where absent.
    pub fn decode(kind: ActionKind, handle: HandleSlot, code: i64, from: i64) -> CoreResult<Self> {
        Ok(match kind {
            ActionKind::Ensure => Self::Ensure {
                handle,
                location: Location::from_signed_code(code)?,
            },
            ActionKind::Move => Self::Move {
                handle,
                to: Location::from_signed_code(code)?,
                from: if from < 0 {
                    None
                } else {
                    Some(Location::from_signed_code(from)?)
                },
            },
            ActionKind::Drop => Self::Drop {
                handle,
                location: Location::from_signed_code(code)?,
            },
            ActionKind::Discard => Self::Discard { handle },
        })
    }

    /// An action of `kind` on `handle` naming `at` (a move's destination; none for a
    /// discard) and, for a move, its source `from`.
    #[inline]
    pub fn new(
        kind: ActionKind,
        handle: HandleSlot,
        at: Option<Location>,
        from: Option<Location>,
    ) -> CoreResult<Self> {
        let named = || {
            at.ok_or_else(|| CoreError::Internal {
                message: format!("{} without its location", kind.record_name()),
            })
        };
        Ok(match kind {
            ActionKind::Ensure => Self::Ensure {
                handle,
                location: named()?,
            },
            ActionKind::Move => Self::Move {
                handle,
                to: named()?,
                from,
            },
            ActionKind::Drop => Self::Drop {
                handle,
                location: named()?,
            },
            ActionKind::Discard => Self::Discard { handle },
        })
    }

    #[inline]
    pub fn kind(&self) -> ActionKind {
        match self {
            Self::Ensure { .. } => ActionKind::Ensure,
            Self::Move { .. } => ActionKind::Move,
            Self::Drop { .. } => ActionKind::Drop,
            Self::Discard { .. } => ActionKind::Discard,
        }
    }

    /// What a transition's report names (docs/concepts/transitions.md#reports): its
    /// source and destination, given `source`, where the transition copied from, and
    /// the kind whose no-op reason it gives when it was a no-op. A drop's source and
    /// the others' destination are the location the action names; a discard's report
    /// names no location and gives no reason.
    #[inline]
    pub fn report_places(&self, source: Option<Location>, no_op: bool) -> ReportPlaces {
        let at = |location: Option<Location>| location.map_or(Place::None, Place::At);
        let (source, destination) = match self {
            Self::Ensure { .. } | Self::Move { .. } => (at(source), Place::Named),
            Self::Drop { .. } => (Place::Named, Place::None),
            Self::Discard { .. } => (Place::None, Place::None),
        };
        let no_op = (no_op && !matches!(self, Self::Discard { .. })).then(|| self.kind());
        ReportPlaces {
            source,
            destination,
            no_op,
        }
    }

    /// What the action's transition reports of the allocator
    /// (docs/concepts/transitions.md#telemetry): the CUDA device it touched, if any
    /// (`sampled`), and whether the allocator's figures are read before and after it.
    /// An asynchronous plan's transitions (a prefetch's) take no readings: their copies
    /// are still in flight, and a reading per transition would cost two allocator
    /// queries before the next copy is enqueued.
    #[inline]
    pub fn telemetry(
        &self,
        asynchronous: bool,
        materializations: impl FnOnce() -> CoreResult<Vec<Location>>,
    ) -> CoreResult<Telemetry> {
        let device = self.sampled(materializations)?;
        Ok(Telemetry {
            device,
            readings: !asynchronous && device != Place::None,
        })
    }

    /// The CUDA location whose allocator is read around the action's transition, if
    /// any: an ensure's or a drop's own location; for a move, the first CUDA one of
    /// its destination and its source (without one, the value's `materializations`);
    /// for a discard, the first CUDA one of its `materializations`.
    #[inline]
    pub fn sampled(
        &self,
        materializations: impl FnOnce() -> CoreResult<Vec<Location>>,
    ) -> CoreResult<Place> {
        let first_cuda = |locations: &[Location]| {
            locations
                .iter()
                .find(|location| location.is_cuda())
                .map_or(Place::None, |location| Place::At(*location))
        };
        Ok(match *self {
            Self::Ensure { location, .. } | Self::Drop { location, .. } => {
                if location.is_cuda() {
                    Place::Named
                } else {
                    Place::None
                }
            }
            Self::Move { to, from, .. } => {
                let mut touched = vec![to];
                match from {
                    Some(from) => touched.push(from),
                    None => touched.extend(materializations()?),
                }
                first_cuda(&touched)
            }
            Self::Discard { .. } => first_cuda(&materializations()?),
        })
    }

    /// Where the action copies to, which picks its transfer stream: an ensure's
    /// location or a move's destination; a drop or a discard copies nothing.
    pub fn destination(&self) -> Option<Location> {
        match *self {
            Self::Ensure { location, .. } => Some(location),
            Self::Move { to, .. } => Some(to),
            Self::Drop { .. } | Self::Discard { .. } => None,
        }
    }

    pub fn handle(&self) -> HandleSlot {
        match *self {
            Self::Ensure { handle, .. }
            | Self::Move { handle, .. }
            | Self::Drop { handle, .. }
            | Self::Discard { handle } => handle,
        }
    }
}

/// Named accounting headroom held for a scope's lifetime. It allocates nothing.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reservation {
    pub location: Location,
    pub nbytes: u64,
    pub label: Arc<str>,
}

/// A frozen, validated plan: reclaim, then reservations, then enter; exit on close.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    name: Arc<str>,
    handles: Vec<HandleRef>,
    reclaim: Vec<Action>,
    enter: Vec<Action>,
    exit: Vec<Action>,
    reservations: Vec<Reservation>,
}

/// The plan's name and how many handles, actions of each phase and reservations it
/// has: `PlanIR(name="p", handles=1, reclaim=0, enter=2, exit=0, reservations=0)`.
impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PlanIR(name={:?}, handles={}, reclaim={}, enter={}, exit={}, reservations={})",
            self.name(),
            self.handles().len(),
            self.reclaim().len(),
            self.enter().len(),
            self.exit().len(),
            self.reservations().len(),
        )
    }
}

impl Reservation {
    /// A reservation as the bindings encode it: a signed location code.
    pub fn decode(code: i64, nbytes: u64, label: impl Into<Arc<str>>) -> CoreResult<Self> {
        Ok(Self {
            location: Location::from_signed_code(code)?,
            nbytes,
            label: label.into(),
        })
    }
}

/// Whether `text` is empty or all whitespace (what `text.trim().is_empty()` says),
/// stopping at the first other character: a plan checks every handle's ids.
fn is_blank(text: &str) -> bool {
    text.chars().all(char::is_whitespace)
}

impl Plan {
    /// Validates the IR's internal consistency. Cross-field semantics (duplicate
    /// actions, foreign handles) are deliberately allowed; the manager judges them.
    pub fn new(
        name: impl Into<Arc<str>>,
        handles: Vec<HandleRef>,
        reclaim: Vec<Action>,
        enter: Vec<Action>,
        exit: Vec<Action>,
        reservations: Vec<Reservation>,
    ) -> CoreResult<Self> {
        let name = name.into();
        if is_blank(&name) {
            return Err(CoreError::invalid("plan name must be a non-empty string"));
        }
        for handle in &handles {
            if is_blank(&handle.manager_id) || is_blank(&handle.handle_id) {
                return Err(CoreError::invalid(
                    "handle manager_id and handle_id must be non-empty strings",
                ));
            }
        }
        let plan = Self {
            name,
            handles,
            reclaim,
            enter,
            exit,
            reservations,
        };
        for (phase, index, action) in plan.ordered_actions() {
            if action.handle().index() >= plan.handles.len() {
                return Err(CoreError::invalid(format!(
                    "{phase} action {index} refers to handle slot {} of {}",
                    action.handle().0,
                    plan.handles.len()
                )));
            }
        }
        if let Some(reservation) = plan
            .reservations
            .iter()
            .find(|reservation| is_blank(&reservation.label))
        {
            return Err(CoreError::invalid(format!(
                "reservation at {} must have a non-empty label",
                reservation.location
            )));
        }
        Ok(plan)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn handles(&self) -> &[HandleRef] {
        &self.handles
    }

    pub fn handle(&self, slot: HandleSlot) -> &HandleRef {
        &self.handles[slot.index()]
    }

    pub fn reclaim(&self) -> &[Action] {
        &self.reclaim
    }

    pub fn enter(&self) -> &[Action] {
        &self.enter
    }

    pub fn exit(&self) -> &[Action] {
        &self.exit
    }

    pub fn reservations(&self) -> &[Reservation] {
        &self.reservations
    }

    pub fn action_count(&self) -> usize {
        self.reclaim.len() + self.enter.len() + self.exit.len()
    }

    /// Every action in simulation order with its phase and phase-local index.
    pub fn ordered_actions(&self) -> impl Iterator<Item = (PlanPhase, usize, &Action)> + '_ {
        tagged(PlanPhase::Reclaim, &self.reclaim)
            .chain(tagged(PlanPhase::Enter, &self.enter))
            .chain(tagged(PlanPhase::Exit, &self.exit))
    }
}

fn tagged(
    phase: PlanPhase,
    actions: &[Action],
) -> impl Iterator<Item = (PlanPhase, usize, &Action)> {
    actions
        .iter()
        .enumerate()
        .map(move |(index, action)| (phase, index, action))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_have_their_diagnostic_names() {
        let names: Vec<&str> = [
            PlanPhase::Execute,
            PlanPhase::Reclaim,
            PlanPhase::Reserve,
            PlanPhase::Enter,
            PlanPhase::Exit,
        ]
        .into_iter()
        .map(PlanPhase::as_str)
        .collect();
        assert_eq!(names, ["execute", "reclaim", "reserve", "enter", "exit"]);
    }
}
