//! The single error enum of the core: one variant per documented failure kind.
//!
//! Variants carry the structured fields a caller needs to act. The bindings crate
//! maps each variant onto its class in `fhelium.errors` in exactly one table.

use std::fmt;

use crate::location::Location;

pub type CoreResult<T> = Result<T, CoreError>;

/// The execution segment of a plan in which a runtime failure happened.
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

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// A malformed argument value that the glue should have rejected (`ValueError`).
    #[error("{message}")]
    InvalidArgument { message: String },

    /// A foreign, unknown, discarded or type-inconsistent handle.
    #[error("{message}")]
    Handle { message: String },

    /// A missing materialisation or reconstruction path.
    #[error("{message}")]
    Unavailable { message: String },

    /// Strict budget admission failed: `used + reserved + requested > budget`.
    #[error(
        "{location:?} budget_bytes={budget_bytes}, used_bytes={used_bytes}, reserved_bytes={reserved_bytes}, requested_bytes={requested_bytes}"
    )]
    Budget {
        location: Location,
        budget_bytes: u64,
        used_bytes: u64,
        reserved_bytes: u64,
        requested_bytes: u64,
    },

    /// Removal blocked by protection, or close blocked by live lifetimes.
    #[error("{message}")]
    InUse {
        message: String,
        location: Option<Location>,
        active_reads: u64,
        holds: u64,
        pending_events: u64,
    },

    /// A released lease, hold or reservation was used again.
    #[error("{message}")]
    LifetimeClosed { message: String },

    /// A value has the wrong type, device, pinning, logical bytes or storage ceiling.
    #[error("{message}")]
    Materialization { message: String },

    /// `EXCLUSIVE` replication, loss of a final `MUST_PRESERVE` copy, or a storage alias.
    #[error("{message}")]
    Ownership { message: String },

    /// Preflight infeasibility.
    #[error("{reason}")]
    Plan { reason: String },

    /// The manager state changed after the caller's observation.
    #[error("expected_version={expected}, actual_version={actual}")]
    StaleState { expected: u64, actual: u64 },

    /// The controller's bounded search stopped without a verdict.
    #[error(
        "request {request_name:?}: search inconclusive, state_limit={state_limit}, explored_states={explored_states}: {detail}"
    )]
    SearchLimit {
        request_name: String,
        state_limit: u64,
        explored_states: u64,
        detail: String,
    },

    /// A runtime failure after a successful preflight; the committed prefix stays.
    #[error("plan {plan_name:?} failed in phase {phase} after {committed} transitions: {cause}")]
    PlanExecution {
        plan_name: String,
        phase: PlanPhase,
        failed_index: Option<usize>,
        committed: usize,
        cause: Box<CoreError>,
    },

    /// A public operation ran while a source callback owned the manager.
    #[error("{message}")]
    Reentrancy { message: String },

    /// The manager is closed.
    #[error("{message}")]
    Closed { message: String },

    /// A broken internal invariant, unreachable through the public API (`RuntimeError`).
    #[error("internal error: {message}")]
    Internal { message: String },
}

impl CoreError {
    /// The name of the Python class this variant becomes (the bindings' table key).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidArgument { .. } => "ValueError",
            Self::Handle { .. } => "ResidencyHandleError",
            Self::Unavailable { .. } => "ResidencyUnavailableError",
            Self::Budget { .. } => "ResidencyBudgetError",
            Self::InUse { .. } => "ResidencyInUseError",
            Self::LifetimeClosed { .. } => "ResidencyLifetimeClosedError",
            Self::Materialization { .. } => "ResidencyMaterializationError",
            Self::Ownership { .. } => "ResidencyOwnershipError",
            Self::Plan { .. } => "ResidencyPlanError",
            Self::StaleState { .. } => "ResidencyStaleStateError",
            Self::SearchLimit { .. } => "ResidencySearchLimitError",
            Self::PlanExecution { .. } => "ResidencyPlanExecutionError",
            Self::Reentrancy { .. } => "ResidencyReentrancyError",
            Self::Closed { .. } => "ResidencyClosedError",
            Self::Internal { .. } => "RuntimeError",
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidArgument {
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_message_names_every_figure() {
        let err = CoreError::Budget {
            location: Location::Cuda(0),
            budget_bytes: 100,
            used_bytes: 60,
            reserved_bytes: 30,
            requested_bytes: 20,
        };
        let text = err.to_string();
        for needle in [
            "budget_bytes=100",
            "used_bytes=60",
            "reserved_bytes=30",
            "requested_bytes=20",
        ] {
            assert!(text.contains(needle), "{text} lacks {needle}");
        }
        assert_eq!(err.kind(), "ResidencyBudgetError");
    }

    #[test]
    fn every_kind_names_a_distinct_python_class() {
        let samples = [
            CoreError::invalid("x"),
            CoreError::Handle {
                message: "x".into(),
            },
            CoreError::Unavailable {
                message: "x".into(),
            },
            CoreError::Budget {
                location: Location::PageableHost,
                budget_bytes: 0,
                used_bytes: 0,
                reserved_bytes: 0,
                requested_bytes: 1,
            },
            CoreError::InUse {
                message: "x".into(),
                location: None,
                active_reads: 0,
                holds: 0,
                pending_events: 0,
            },
            CoreError::LifetimeClosed {
                message: "x".into(),
            },
            CoreError::Materialization {
                message: "x".into(),
            },
            CoreError::Ownership {
                message: "x".into(),
            },
            CoreError::Plan { reason: "x".into() },
            CoreError::StaleState {
                expected: 1,
                actual: 2,
            },
            CoreError::SearchLimit {
                request_name: "r".into(),
                state_limit: 1,
                explored_states: 1,
                detail: "d".into(),
            },
            CoreError::PlanExecution {
                plan_name: "p".into(),
                phase: PlanPhase::Enter,
                failed_index: Some(0),
                committed: 0,
                cause: Box::new(CoreError::Closed {
                    message: "x".into(),
                }),
            },
            CoreError::Reentrancy {
                message: "x".into(),
            },
            CoreError::Closed {
                message: "x".into(),
            },
        ];
        let mut kinds: Vec<&str> = samples.iter().map(CoreError::kind).collect();
        kinds.sort_unstable();
        kinds.dedup();
        assert_eq!(kinds.len(), samples.len());
    }

    #[test]
    fn phases_have_documented_names() {
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
