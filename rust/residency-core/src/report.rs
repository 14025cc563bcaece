//! A committed transition as plain data, over the caller's objects, and the order its
//! report record lists the fields in (docs/concepts/transitions.md#reports).
//!
//! The bindings keep one per transition, and build the report record from `fields`
//! only when it is first read: a plan builds no report objects while it runs.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::location::Location;

/// Nanoseconds since the Unix epoch: a transition's start and completion times.
#[inline]
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX)
        })
}

/// One committed transition. `O` is the caller's object: the action record, the
/// location records, the device, the allocator's figures and the no-op reason.
#[derive(Debug)]
pub struct TransitionFacts<O> {
    pub action: O,
    pub no_op: bool,
    pub source: Option<O>,
    pub destination: Option<O>,
    pub logical: u64,
    pub storage: u64,
    pub started: u64,
    /// Never before `started` (the clock may step back).
    pub completed: u64,
    pub allocator: Option<Box<AllocatorReadings<O>>>,
    pub reason: Option<O>,
}

/// The allocator's device and figures (allocated, reserved) around a transition that
/// touched CUDA; a figure the runtime could not give is absent.
#[derive(Debug)]
pub struct AllocatorReadings<O> {
    pub device: O,
    pub before: Option<(O, O)>,
    pub after: Option<(O, O)>,
}

/// One field of a record the bindings build (a report, a snapshot entry, an
/// explanation action): one of the caller's objects, `None`, a flag, a byte count, the
/// shared record of a location, or a text.
#[derive(Debug, PartialEq, Eq)]
pub enum Field<'a, O> {
    Object(&'a O),
    None,
    Flag(bool),
    Count(u64),
    Location(Location),
    Text(&'a str),
}

// A field only borrows the caller's objects: copied whatever `O` is.
impl<O> Clone for Field<'_, O> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<O> Copy for Field<'_, O> {}

/// How many fields a transition report record has.
pub const REPORT_FIELDS: usize = 14;

impl<O> TransitionFacts<O> {
    /// The facts of a transition that completed now.
    // On every transition's path: built in the caller's frame, not moved out of a call.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    #[allow(clippy::too_many_arguments)] // the report's fields
    pub fn completed_now(
        action: O,
        no_op: bool,
        source: Option<O>,
        destination: Option<O>,
        logical: u64,
        storage: u64,
        started: u64,
        allocator: Option<Box<AllocatorReadings<O>>>,
        reason: Option<O>,
    ) -> Self {
        Self {
            action,
            no_op,
            source,
            destination,
            logical,
            storage,
            started,
            completed: now_ns().max(started),
            allocator,
            reason,
        }
    }

    /// The report record's fields in declaration order (`ResidencyTransitionReport`):
    /// `action`, `no_op`, `source`, `destination`, `logical_nbytes`, `storage_nbytes`,
    /// `started_at_ns`, `completed_at_ns`, `allocator_device`, the allocated and
    /// reserved bytes before, the allocated and reserved bytes after, and `reason`.
    #[inline]
    pub fn fields(&self) -> [Field<'_, O>; REPORT_FIELDS] {
        let allocator = self.allocator.as_deref();
        let (allocated_before, reserved_before) =
            figures(allocator.and_then(|allocator| allocator.before.as_ref()));
        let (allocated_after, reserved_after) =
            figures(allocator.and_then(|allocator| allocator.after.as_ref()));
        [
            Field::Object(&self.action),
            Field::Flag(self.no_op),
            optional(self.source.as_ref()),
            optional(self.destination.as_ref()),
            Field::Count(self.logical),
            Field::Count(self.storage),
            Field::Count(self.started),
            Field::Count(self.completed),
            optional(allocator.map(|allocator| &allocator.device)),
            allocated_before,
            reserved_before,
            allocated_after,
            reserved_after,
            optional(self.reason.as_ref()),
        ]
    }
}

fn optional<O>(object: Option<&O>) -> Field<'_, O> {
    object.map_or(Field::None, Field::Object)
}

/// A reading's (allocated, reserved) figures.
fn figures<O>(sample: Option<&(O, O)>) -> (Field<'_, O>, Field<'_, O>) {
    match sample {
        Some((allocated, reserved)) => (Field::Object(allocated), Field::Object(reserved)),
        None => (Field::None, Field::None),
    }
}
