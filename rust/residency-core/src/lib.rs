//! The residency core: the state machine behind `fhelium.residency`.
//!
//! It knows handles as integers, locations as a small enum and values as byte
//! counts plus flags. It never sees a tensor, a stream or a Python object; the
//! Python glue measures values and performs the copies this crate admits.
#![forbid(unsafe_code)]

pub mod bytes;
pub mod checksum;
pub mod entries;
pub mod error;
pub mod fasthash;
pub mod gate;
pub mod keys;
pub mod location;
pub mod manager;
pub mod messages;
pub mod objects;
mod overlay;
pub mod placement;
pub mod plan;
pub mod process;
pub mod pvec;
pub mod report;
pub mod search;
pub mod simulate;
pub mod state;
pub mod tables;
pub mod tokens;
pub mod value;
pub mod victims;

pub use error::{CoreError, CoreResult};
pub use fasthash::{FastMap, FastSet};
pub use location::{CopyRoute, Location, LocationKind, MAX_CUDA_INDEX};
pub use manager::{
    Admitted, Begun, Committed, Copied, DecideFailure, Decision, Device, EvictionRow, HostCost,
    InFlight, Inputs, Landed, LeaseRelease, LeaseState, LifetimeHost, LoweredRequest, Manager,
    Measured, NativePolicy, OpenLifetimes, PlanDevice, PlanRun, Resolutions, Row, RunError,
    ScheduleIndex, SearchInputs, SettleWait, StateValues, StorageKey, Ticket, TransitionDevice,
    Transitioned, Unborrowable, Work,
};
pub use messages::{Refusal, RefusalKind};
pub use placement::{Measurement, Misplaced, Misplacement, ValueFacts};
pub use plan::{
    Action, ActionKind, HandleRef, HandleSlot, Place, Plan, PlanPhase, RecordFields, ReportPlaces,
    Reservation, Telemetry,
};
pub use simulate::{ActionOutcome, CudaDevices, Simulation, SlotResolution};
pub use state::{
    HandleId, LocationBooks, LocationState, Materialization, ReservationRecord, State, ValueRecord,
};
pub use tokens::{Freed, LifetimeKind, ObjectId, Release};
pub use value::{
    HandleName, Recoverability, ReplicaMode, SourceRefusal, SpecField, ValueSpec, charge_of,
};
