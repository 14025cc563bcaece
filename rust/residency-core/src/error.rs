//! The single error enum of the core: one variant per documented failure kind.
//!
//! Variants carry the structured fields a caller needs to act. The bindings crate
//! maps each variant onto its class in `fhelium.errors` in exactly one table.

use crate::location::{InvalidLocation, Location};

pub type CoreResult<T> = Result<T, CoreError>;

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

    /// A value has the wrong type, device, pinning, logical bytes or storage ceiling.
    #[error("{message}")]
    Materialization { message: String },

    /// `EXCLUSIVE` replication, loss of a final `MUST_PRESERVE` copy, or a storage alias.
    #[error("{message}")]
    Ownership { message: String },

    /// The controller's bounded search stopped without a verdict: it reached `bound`
    /// (`"states"`, `"depth"` or `"memory"`, docs/concepts/controller.md#search-bounds).
    #[error(
        "request {request_name:?}: search inconclusive ({bound} bound), state_limit={state_limit}, explored_states={explored_states}: {detail}"
    )]
    SearchLimit {
        request_name: String,
        state_limit: u64,
        explored_states: u64,
        bound: &'static str,
        detail: String,
    },

    /// The controller's search tried every reclaim and none lets the request fit.
    #[error("{}", infeasible(&format!("{request_name:?}"), detail))]
    SearchInfeasible {
        request_name: String,
        detail: String,
    },

    /// A value the request requires has no materialisation and no source to rebuild
    /// it from, so no plan can place it.
    #[error("{}", unplaceable(&format!("{handle_id:?}")))]
    SearchUnavailable { handle_id: String },

    /// A search policy broke its side of the search: an ordering that is not a
    /// permutation of its candidates (`RuntimeError`, the message as is).
    #[error("{message}")]
    Policy { message: String },

    /// A plan's preflight found it infeasible: the simulation's reason, as is
    /// (docs/concepts/plans.md#preflight).
    #[error("{message}")]
    Plan { message: String },

    /// A plan or decision was made against a state version that is no longer the
    /// current one.
    #[error("expected state version {expected_version}, but the state is at {actual_version}")]
    StaleState {
        expected_version: u64,
        actual_version: u64,
    },

    /// A public operation ran while a source callback owned the manager.
    #[error("{message}")]
    Reentrancy { message: String },

    /// The manager is closed.
    #[error("{message}")]
    Closed { message: String },

    /// The manager belongs to another process: this one was forked from its owner
    /// after the manager was made (docs/concepts/lifetimes.md#fork).
    #[error("{message}")]
    Forked {
        message: String,
        owner_pid: u32,
        pid: u32,
    },

    /// A broken internal invariant, unreachable through the public API (`RuntimeError`).
    #[error("internal error: {message}")]
    Internal { message: String },
}

/// The exception class a binding raises an error as (`fhelium.errors`, or a builtin
/// for an invalid argument and a broken invariant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// `ValueError`.
    Value,
    /// `RuntimeError`.
    Runtime,
    Handle,
    Unavailable,
    Budget,
    InUse,
    Materialization,
    Ownership,
    Plan,
    StaleState,
    SearchLimit,
    Reentrancy,
    Closed,
    Forked,
}

/// A keyword field of a structured error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorField<'a> {
    Count(u64),
    Text(&'a str),
    /// A location, by name; `None` where the error names none.
    Location(Option<Location>),
}

/// How a binding builds an error of a class: `class(message)`, `class(message,
/// **fields)` or `class(**fields)` (the class writes its own message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    Message,
    MessageAndFields,
    Fields,
}

impl CoreError {
    /// The class the error is raised as.
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::InvalidArgument { .. } => ErrorClass::Value,
            Self::Internal { .. } | Self::Policy { .. } => ErrorClass::Runtime,
            Self::Handle { .. } => ErrorClass::Handle,
            Self::Unavailable { .. } | Self::SearchUnavailable { .. } => ErrorClass::Unavailable,
            Self::Budget { .. } => ErrorClass::Budget,
            Self::InUse { .. } => ErrorClass::InUse,
            Self::Materialization { .. } => ErrorClass::Materialization,
            Self::Ownership { .. } => ErrorClass::Ownership,
            Self::Plan { .. } | Self::SearchInfeasible { .. } => ErrorClass::Plan,
            Self::StaleState { .. } => ErrorClass::StaleState,
            Self::SearchLimit { .. } => ErrorClass::SearchLimit,
            Self::Reentrancy { .. } => ErrorClass::Reentrancy,
            Self::Closed { .. } => ErrorClass::Closed,
            Self::Forked { .. } => ErrorClass::Forked,
        }
    }

    /// How the error's exception is built from its message and `fields`.
    pub fn shape(&self) -> ErrorShape {
        match self {
            Self::InUse { .. } | Self::Forked { .. } => ErrorShape::MessageAndFields,
            Self::Budget { .. } | Self::StaleState { .. } | Self::SearchLimit { .. } => {
                ErrorShape::Fields
            }
            _ => ErrorShape::Message,
        }
    }

    /// The keyword fields of a structured error, in the order its class takes them;
    /// none for an error that is its message alone.
    pub fn fields(&self) -> Vec<(&'static str, ErrorField<'_>)> {
        use ErrorField::{Count, Location as At, Text};
        match self {
            Self::Budget {
                location,
                budget_bytes,
                used_bytes,
                reserved_bytes,
                requested_bytes,
            } => vec![
                ("location", At(Some(*location))),
                ("budget_bytes", Count(*budget_bytes)),
                ("used_bytes", Count(*used_bytes)),
                ("reserved_bytes", Count(*reserved_bytes)),
                ("requested_bytes", Count(*requested_bytes)),
            ],
            Self::InUse {
                location,
                active_reads,
                holds,
                pending_events,
                ..
            } => vec![
                ("location", At(*location)),
                ("active_reads", Count(*active_reads)),
                ("holds", Count(*holds)),
                ("pending_events", Count(*pending_events)),
            ],
            Self::SearchLimit {
                request_name,
                state_limit,
                explored_states,
                bound,
                detail,
            } => vec![
                ("request_name", Text(request_name)),
                ("state_limit", Count(*state_limit)),
                ("explored_states", Count(*explored_states)),
                ("detail", Text(detail)),
                ("bound", Text(bound)),
            ],
            Self::StaleState {
                expected_version,
                actual_version,
            } => vec![
                ("expected_version", Count(*expected_version)),
                ("actual_version", Count(*actual_version)),
            ],
            Self::Forked { owner_pid, pid, .. } => vec![
                ("owner_pid", Count(u64::from(*owner_pid))),
                ("pid", Count(u64::from(*pid))),
            ],
            _ => Vec::new(),
        }
    }
}

/// `SearchInfeasible`'s message, with the request's name quoted as the caller's
/// language quotes a string.
pub fn infeasible(quoted_name: &str, detail: &str) -> String {
    format!("request {quoted_name} is infeasible: {detail}")
}

/// `SearchUnavailable`'s message, with the handle id quoted as the caller's language
/// quotes a string.
pub fn unplaceable(quoted_handle_id: &str) -> String {
    format!("value {quoted_handle_id} has no materialization and no reconstruction source")
}

impl From<InvalidLocation> for CoreError {
    fn from(InvalidLocation(message): InvalidLocation) -> Self {
        Self::InvalidArgument { message }
    }
}

impl CoreError {
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
    }

    #[test]
    fn search_failures_name_the_request() {
        let limit = CoreError::SearchLimit {
            request_name: "r".into(),
            state_limit: 3,
            explored_states: 3,
            bound: "states",
            detail: "d".into(),
        };
        assert_eq!(
            limit.to_string(),
            "request \"r\": search inconclusive (states bound), state_limit=3, explored_states=3: d"
        );
        let infeasible = CoreError::SearchInfeasible {
            request_name: "r".into(),
            detail: "d".into(),
        };
        assert_eq!(infeasible.to_string(), "request \"r\" is infeasible: d");
        let unplaceable = CoreError::SearchUnavailable {
            handle_id: "h".into(),
        };
        assert_eq!(
            unplaceable.to_string(),
            "value \"h\" has no materialization and no reconstruction source"
        );
        // The bindings quote names as their language does.
        assert_eq!(
            super::infeasible("'r'", "d"),
            "request 'r' is infeasible: d"
        );
        assert_eq!(
            super::unplaceable("'h'"),
            "value 'h' has no materialization and no reconstruction source"
        );
    }

    #[test]
    fn structured_errors_list_their_fields_in_the_class_order() {
        let budget = CoreError::Budget {
            location: Location::Cuda(0),
            budget_bytes: 100,
            used_bytes: 60,
            reserved_bytes: 30,
            requested_bytes: 20,
        };
        assert_eq!(budget.class(), ErrorClass::Budget);
        assert_eq!(budget.shape(), ErrorShape::Fields);
        assert_eq!(
            budget.fields(),
            vec![
                ("location", ErrorField::Location(Some(Location::Cuda(0)))),
                ("budget_bytes", ErrorField::Count(100)),
                ("used_bytes", ErrorField::Count(60)),
                ("reserved_bytes", ErrorField::Count(30)),
                ("requested_bytes", ErrorField::Count(20)),
            ]
        );
        let in_use = CoreError::InUse {
            message: "busy".into(),
            location: None,
            active_reads: 1,
            holds: 2,
            pending_events: 3,
        };
        assert_eq!(in_use.shape(), ErrorShape::MessageAndFields);
        assert_eq!(in_use.fields()[0], ("location", ErrorField::Location(None)));
        let forked = CoreError::Forked {
            message: "forked".into(),
            owner_pid: 7,
            pid: 8,
        };
        assert_eq!(
            forked.fields(),
            vec![
                ("owner_pid", ErrorField::Count(7)),
                ("pid", ErrorField::Count(8)),
            ]
        );
        let limit = CoreError::SearchLimit {
            request_name: "r".into(),
            state_limit: 3,
            explored_states: 4,
            bound: "depth",
            detail: "d".into(),
        };
        let names: Vec<&str> = limit.fields().iter().map(|(name, _)| *name).collect();
        assert_eq!(
            names,
            [
                "request_name",
                "state_limit",
                "explored_states",
                "detail",
                "bound"
            ]
        );
    }

    #[test]
    fn plain_errors_are_their_message_in_their_class() {
        let cases = [
            (CoreError::invalid("x"), ErrorClass::Value),
            (
                CoreError::Internal {
                    message: "x".into(),
                },
                ErrorClass::Runtime,
            ),
            (
                CoreError::Policy {
                    message: "x".into(),
                },
                ErrorClass::Runtime,
            ),
            (
                CoreError::SearchInfeasible {
                    request_name: "r".into(),
                    detail: "d".into(),
                },
                ErrorClass::Plan,
            ),
            (
                CoreError::SearchUnavailable {
                    handle_id: "h".into(),
                },
                ErrorClass::Unavailable,
            ),
            (
                CoreError::Closed {
                    message: "x".into(),
                },
                ErrorClass::Closed,
            ),
        ];
        for (error, class) in cases {
            assert_eq!(error.class(), class);
            assert_eq!(error.shape(), ErrorShape::Message);
            assert!(error.fields().is_empty());
        }
    }
}
