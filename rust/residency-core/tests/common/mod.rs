//! Helpers shared by the core's integration tests.

use residency_core::{
    Committed, CoreResult, Freed, Landed, Manager, Recoverability, ReplicaMode, Ticket, ValueSpec,
};

/// A spec whose charge is its logical size.
pub fn spec(bytes: u64, exclusive: bool, reconstructible: bool) -> ValueSpec {
    ValueSpec::new(
        bytes,
        bytes,
        if exclusive {
            ReplicaMode::Exclusive
        } else {
            ReplicaMode::Replicable
        },
        if reconstructible {
            Recoverability::Reconstructible
        } else {
            Recoverability::MustPreserve
        },
    )
    .expect("equal byte counts are a valid spec")
}

/// Commits `ticket` with no copy left in flight (no event to hand over).
#[allow(dead_code)] // the transition driver's tests commit through the driver
pub fn commit(
    manager: &Manager,
    ticket: Ticket,
    landed: Option<Landed<'_>>,
) -> CoreResult<Committed> {
    manager.commit(ticket, landed, None, &mut Freed::default())
}
