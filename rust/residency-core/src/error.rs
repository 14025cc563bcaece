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
}
