//! The fields of the records users read in bulk, in the order their classes declare
//! them (docs/concepts/snapshots.md): a snapshot's value entries and their
//! materialisation records, and an explanation's action records.
//!
//! The bindings build each record from these fields, converting each kind of field
//! once (`report::Field`); which fact fills which field is decided here.

use crate::location::Location;
use crate::report::Field;
use crate::simulate::ActionOutcome;
use crate::state::{Materialization, ValueRecord};

/// How many fields a value entry (`ResidencyValueEntry`) has.
pub const VALUE_FIELDS: usize = 6;
/// How many fields a materialisation record (`ResidencyMaterialization`) has.
pub const MATERIALIZATION_FIELDS: usize = 7;
/// How many fields an explanation action record (`ResidencyActionExplanation`) has.
pub const ACTION_FIELDS: usize = 8;

fn location<'a, O>(location: Option<Location>) -> Field<'a, O> {
    location.map_or(Field::None, Field::Location)
}

/// A value entry's fields: `handle`, `spec`, `materializations` (the caller's objects:
/// the issued handle and spec, the tuple of the value's materialisation records),
/// `has_source`, `source_location` (`None` without a source) and `discarded`.
#[inline]
pub fn value_fields<'a, O>(
    record: &ValueRecord,
    handle: &'a O,
    spec: &'a O,
    materializations: &'a O,
) -> [Field<'a, O>; VALUE_FIELDS] {
    [
        Field::Object(handle),
        Field::Object(spec),
        Field::Object(materializations),
        Field::Flag(record.source.is_some()),
        location(record.source),
        Field::Flag(record.discarded),
    ]
}

/// A materialisation record's fields: `location`, `logical_nbytes` (the value's spec
/// gives it: `logical`, the caller's object), `storage_nbytes` as measured,
/// `charged_nbytes`, and the `use_count`, `hold_count` and `pending_count`.
#[inline]
pub fn materialization_fields<'a, O>(
    materialization: &Materialization,
    logical: &'a O,
) -> [Field<'a, O>; MATERIALIZATION_FIELDS] {
    [
        Field::Location(materialization.location),
        Field::Object(logical),
        Field::Count(materialization.storage_nbytes),
        Field::Count(materialization.charged_nbytes),
        Field::Count(materialization.use_count.into()),
        Field::Count(materialization.hold_count.into()),
        Field::Count(materialization.pending_count.into()),
    ]
}

/// An explanation action record's fields: the `action` record itself (the caller's
/// object), `executable`, `no_op`, `source` and `destination` (`None` where absent),
/// `logical_nbytes`, `storage_nbytes` and `reason` (`None` without one).
#[inline]
pub fn action_fields<'a, O>(
    outcome: &'a ActionOutcome,
    action: &'a O,
) -> [Field<'a, O>; ACTION_FIELDS] {
    [
        Field::Object(action),
        Field::Flag(outcome.executable),
        Field::Flag(outcome.no_op),
        location(outcome.source),
        location(outcome.destination),
        Field::Count(outcome.logical_nbytes),
        Field::Count(outcome.storage_nbytes),
        outcome.reason.as_deref().map_or(Field::None, Field::Text),
    ]
}
