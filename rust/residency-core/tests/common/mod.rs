//! Helpers shared by the core's integration tests.

use residency_core::{
    Committed, CoreResult, Freed, Landed, Location, LocationState, Manager, Recoverability,
    ReplicaMode, Ticket, ValueRecord, ValueSpec,
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

/// Everything a failed transition must leave as it found it. Peaks are left out: a
/// temporary charge raises `peak_charged_bytes` for good (checked on its own).
#[allow(dead_code)] // the transition tests' (tickets, the driver)
#[derive(Debug, PartialEq, Eq)]
pub struct Accounts {
    pub version: u64,
    pub books: Vec<LocationState>,
    pub values: Vec<ValueRecord>,
    pub pending_leases: u64,
    pub pending_tokens: Vec<u64>,
}

/// The manager's accounts, after checking that its books balance.
#[allow(dead_code)] // the transition tests' (tickets, the driver)
pub fn accounts(manager: &Manager) -> Accounts {
    manager.check_books().expect("books balance");
    let state = manager.current();
    Accounts {
        version: state.version,
        books: state
            .locations
            .iter()
            .map(|books| LocationState {
                peak_used_bytes: 0,
                peak_charged_bytes: 0,
                ..books.clone()
            })
            .collect(),
        values: state
            .values
            .iter()
            .map(|record| (**record).clone())
            .collect(),
        pending_leases: state.pending_leases,
        pending_tokens: manager.pending_lease_tokens(),
    }
}

#[allow(dead_code)] // the transition tests' (tickets, the driver)
pub fn books(manager: &Manager, location: Location) -> LocationState {
    manager.current().books(location)
}
