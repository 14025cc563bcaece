//! The core's kinds as Python enums, so the glue names them instead of numbering them.
//!
//! Each enum mirrors one core enum; the conversions below match exhaustively, so a
//! kind added to the core does not compile until it has its Python name here. The
//! values keep the numbers the glue used before, and `eq_int` lets them compare
//! equal to those numbers while callers move over.

use pyo3::prelude::*;
use residency_core::ActionKind;
use residency_core::LeaseState as CoreLeaseState;

/// The kind of a residency action.
#[pyclass(
    eq,
    eq_int,
    frozen,
    from_py_object,
    module = "fhelium._core",
    name = "ActionKind"
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PyActionKind {
    #[pyo3(name = "ENSURE")]
    Ensure = 0,
    #[pyo3(name = "MOVE")]
    Move = 1,
    #[pyo3(name = "DROP")]
    Drop = 2,
    #[pyo3(name = "DISCARD")]
    Discard = 3,
}

impl From<ActionKind> for PyActionKind {
    fn from(kind: ActionKind) -> Self {
        match kind {
            ActionKind::Ensure => Self::Ensure,
            ActionKind::Move => Self::Move,
            ActionKind::Drop => Self::Drop,
            ActionKind::Discard => Self::Discard,
        }
    }
}

impl From<PyActionKind> for ActionKind {
    fn from(kind: PyActionKind) -> Self {
        match kind {
            PyActionKind::Ensure => Self::Ensure,
            PyActionKind::Move => Self::Move,
            PyActionKind::Drop => Self::Drop,
            PyActionKind::Discard => Self::Discard,
        }
    }
}

/// What an ensure needs from the glue.
#[pyclass(eq, eq_int, frozen, module = "fhelium._core", name = "EnsureOutcome")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnsureOutcome {
    /// Already resident at the destination.
    #[pyo3(name = "NO_OP")]
    NoOp = 0,
    /// Copy from a materialisation.
    #[pyo3(name = "COPY")]
    Copy = 1,
    /// Reconstruct through the registered source first.
    #[pyo3(name = "RECONSTRUCT")]
    Reconstruct = 2,
}

/// What a move needs from the glue.
#[pyclass(eq, eq_int, frozen, module = "fhelium._core", name = "MoveOutcome")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveOutcome {
    /// Nothing to do.
    #[pyo3(name = "NO_OP")]
    NoOp = 0,
    /// The destination was already resident; the source replica was removed.
    #[pyo3(name = "REMOVED_SOURCE")]
    RemovedSource = 1,
    /// Copy, install, then remove the source.
    #[pyo3(name = "COPY")]
    Copy = 2,
    /// Reconstruct through the registered source; nothing is removed after.
    #[pyo3(name = "RECONSTRUCT")]
    Reconstruct = 3,
}

/// Which kind of lifetime a token names, for the one-call release.
#[pyclass(
    eq,
    eq_int,
    frozen,
    from_py_object,
    module = "fhelium._core",
    name = "LifetimeKind"
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LifetimeKind {
    #[pyo3(name = "LEASE")]
    Lease = 0,
    #[pyo3(name = "HOLD")]
    Hold = 1,
    #[pyo3(name = "RESERVATION")]
    Reservation = 2,
}

/// Where a lease token stands.
#[pyclass(eq, eq_int, frozen, module = "fhelium._core", name = "LeaseState")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// Never issued, released, or dropped by a forced close.
    #[pyo3(name = "UNKNOWN")]
    Unknown = 0,
    /// Borrowing: its use tokens protect the materialisations.
    #[pyo3(name = "ACTIVE")]
    Active = 1,
    /// Released on CUDA streams whose events have not all completed.
    #[pyo3(name = "PENDING")]
    Pending = 2,
}

impl From<CoreLeaseState> for LeaseState {
    fn from(state: CoreLeaseState) -> Self {
        match state {
            CoreLeaseState::Unknown => Self::Unknown,
            CoreLeaseState::Active => Self::Active,
            CoreLeaseState::Pending => Self::Pending,
        }
    }
}

impl From<LifetimeKind> for residency_core::LifetimeKind {
    fn from(kind: LifetimeKind) -> Self {
        match kind {
            LifetimeKind::Lease => Self::Lease,
            LifetimeKind::Hold => Self::Hold,
            LifetimeKind::Reservation => Self::Reservation,
        }
    }
}
