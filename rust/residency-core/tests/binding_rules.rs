//! The rules the binding follows between its Python conversions, decided here: which
//! attributes an action record names its locations by, a no-op's reason, where a
//! transfer stream is checked, which refusal a spec gets, when a misplacement names a
//! device, and which fact fills which field of the records read in bulk.
#![allow(clippy::panic)] // Test assertions.

use residency_core::entries::{
    ACTION_FIELDS, MATERIALIZATION_FIELDS, VALUE_FIELDS, action_fields, materialization_fields,
    value_fields,
};
use residency_core::report::Field;
use residency_core::{
    Action, ActionKind, ActionOutcome, HandleName, HandleSlot, Location, Materialization,
    Misplaced, RecordFields, Recoverability, Refusal, ReplicaMode, SourceRefusal, SpecField,
    ValueRecord, ValueSpec,
};

#[test]
fn action_records_name_their_locations_by_kind() {
    assert_eq!(
        ActionKind::ALL,
        [
            ActionKind::Ensure,
            ActionKind::Move,
            ActionKind::Drop,
            ActionKind::Discard
        ]
    );
    let fields = |location, from| RecordFields { location, from };
    assert_eq!(
        ActionKind::Ensure.record_fields(),
        fields(Some("location"), None)
    );
    assert_eq!(
        ActionKind::Drop.record_fields(),
        fields(Some("location"), None)
    );
    assert_eq!(
        ActionKind::Move.record_fields(),
        fields(Some("to"), Some("from_location"))
    );
    assert_eq!(ActionKind::Discard.record_fields(), fields(None, None));
}

#[test]
fn a_no_op_reports_the_reason_of_its_kind() {
    assert_eq!(
        ActionKind::Ensure.no_op_reason(),
        Some("destination already resident")
    );
    assert_eq!(
        ActionKind::Move.no_op_reason(),
        Some("destination already owns the selected replica")
    );
    assert_eq!(
        ActionKind::Drop.no_op_reason(),
        Some("materialization already absent")
    );
    assert_eq!(ActionKind::Discard.no_op_reason(), None);
    // Every kind a report gives a reason for has one.
    let ensure = Action::new(
        ActionKind::Ensure,
        HandleSlot(0),
        Some(Location::PinnedHost),
        None,
    )
    .expect("an ensure");
    let kind = ensure
        .report_places(None, true)
        .no_op
        .expect("a no-op ensure gives its reason");
    assert!(kind.no_op_reason().is_some());
}

#[test]
fn a_transfer_stream_is_checked_where_the_action_copies_to() {
    let cuda = Location::Cuda(1);
    let action = |kind, at, from| Action::new(kind, HandleSlot(0), at, from).expect("an action");
    assert_eq!(
        Refusal::stream_destination(&action(ActionKind::Ensure, Some(cuda), None)),
        Ok(cuda)
    );
    assert_eq!(
        Refusal::stream_destination(&action(
            ActionKind::Move,
            Some(cuda),
            Some(Location::PinnedHost)
        )),
        Ok(cuda)
    );
    for kind in [ActionKind::Drop, ActionKind::Discard] {
        let refused = Refusal::stream_destination(&action(kind, Some(cuda), None));
        assert_eq!(refused, Err(Refusal::StreamNotTaken { kind }));
    }
    let Err(refused) = Refusal::stream_destination(&action(ActionKind::Drop, Some(cuda), None))
    else {
        panic!("a drop takes no stream");
    };
    assert_eq!(
        refused.to_string(),
        "DropResident does not take a transfer stream"
    );
}

#[test]
fn a_refused_spec_quotes_the_count_of_the_field_it_names() {
    assert_eq!(SourceRefusal::MustPreserve.field(), None);
    assert_eq!(
        Refusal::of_source(SourceRefusal::MustPreserve, ""),
        Refusal::SourceMustPreserve
    );
    let storage = SourceRefusal::TooManyBytes(SpecField::Storage);
    let field = storage.field().expect("the refused field");
    assert_eq!(field.attribute(), "storage_nbytes");
    let refusal = Refusal::of_source(storage, "18446744073709551616");
    assert_eq!(
        refusal.to_string(),
        "spec.storage_nbytes of 18446744073709551616 bytes exceeds the supported maximum of \
         2**64 - 1"
    );
    let logical = Refusal::of_source(SourceRefusal::TooManyBytes(SpecField::Logical), "7");
    assert_eq!(
        logical,
        Refusal::TooManyBytes {
            name: "spec.logical_nbytes",
            nbytes: "7"
        }
    );
}

#[test]
fn only_a_value_on_another_device_is_refused_by_its_device() {
    assert!(Misplaced::OtherDevice.names_device());
    for why in [
        Misplaced::InMemoryForDisk,
        Misplaced::MixedPinning,
        Misplaced::NotPinned,
        Misplaced::Pinned,
    ] {
        assert!(!why.names_device(), "{why:?}");
    }
}

fn materialization(location: Location) -> Materialization {
    Materialization {
        location,
        storage_nbytes: 40,
        charged_nbytes: 48,
        use_count: 1,
        hold_count: 2,
        pending_count: 3,
    }
}

#[test]
fn a_value_entry_lists_its_objects_source_and_discard() {
    let spec = ValueSpec::new(
        32,
        48,
        ReplicaMode::Replicable,
        Recoverability::Reconstructible,
    )
    .expect("a valid spec");
    let mut record = ValueRecord {
        handle_id: HandleName::issue(0, 1),
        type_key: 1,
        spec,
        source: Some(Location::PinnedHost),
        discarded: false,
        materializations: vec![materialization(Location::Cuda(0))],
    };
    let fields = value_fields(&record, &"handle", &"spec", &"materializations");
    assert_eq!(fields.len(), VALUE_FIELDS);
    assert_eq!(
        fields,
        [
            Field::Object(&"handle"),
            Field::Object(&"spec"),
            Field::Object(&"materializations"),
            Field::Flag(true),
            Field::Location(Location::PinnedHost),
            Field::Flag(false),
        ]
    );
    record.source = None;
    record.discarded = true;
    let fields = value_fields(&record, &"handle", &"spec", &"materializations");
    assert_eq!(fields[3], Field::Flag(false));
    assert_eq!(fields[4], Field::None);
    assert_eq!(fields[5], Field::Flag(true));
}

#[test]
fn a_materialization_record_gives_the_spec_s_logical_size_and_its_counts() {
    let fields = materialization_fields(&materialization(Location::Cuda(2)), &"logical");
    assert_eq!(fields.len(), MATERIALIZATION_FIELDS);
    assert_eq!(
        fields,
        [
            Field::Location(Location::Cuda(2)),
            Field::Object(&"logical"),
            Field::Count(40),
            Field::Count(48),
            Field::Count(1),
            Field::Count(2),
            Field::Count(3),
        ]
    );
}

#[test]
fn an_explanation_action_lists_its_outcome() {
    let mut outcome = ActionOutcome {
        executable: true,
        no_op: true,
        source: None,
        destination: Some(Location::Cuda(0)),
        logical_nbytes: 16,
        storage_nbytes: 24,
        reason: Some("destination already resident".to_owned()),
    };
    let fields = action_fields(&outcome, &"action");
    assert_eq!(fields.len(), ACTION_FIELDS);
    assert_eq!(
        fields,
        [
            Field::Object(&"action"),
            Field::Flag(true),
            Field::Flag(true),
            Field::None,
            Field::Location(Location::Cuda(0)),
            Field::Count(16),
            Field::Count(24),
            Field::Text("destination already resident"),
        ]
    );
    outcome.reason = None;
    outcome.source = Some(Location::PageableHost);
    let fields = action_fields(&outcome, &"action");
    assert_eq!(fields[3], Field::Location(Location::PageableHost));
    assert_eq!(fields[7], Field::None);
}

#[test]
fn an_adopted_value_must_be_preserved_and_is_charged_by_the_charge_rule() {
    let spec = ValueSpec::adopted(100, 64, true);
    assert_eq!(spec.logical_nbytes(), 100);
    assert_eq!(spec.storage_nbytes(), 100);
    assert_eq!(spec.replica_mode(), ReplicaMode::Exclusive);
    assert_eq!(spec.recoverability(), Recoverability::MustPreserve);
    let spec = ValueSpec::adopted(16, 64, false);
    assert_eq!(spec.storage_nbytes(), 64);
    assert_eq!(spec.replica_mode(), ReplicaMode::Replicable);
    // Values of one shape share a spec (the binding keys spec records by it).
    assert_eq!(spec, ValueSpec::adopted(16, 64, false));
}

#[test]
fn a_registered_source_s_value_is_reconstructible_with_its_spec_s_counts() {
    let spec = ValueSpec::reconstructible(16, 64, true).expect("a valid spec");
    assert_eq!(spec.logical_nbytes(), 16);
    assert_eq!(spec.storage_nbytes(), 64);
    assert_eq!(spec.replica_mode(), ReplicaMode::Exclusive);
    assert_eq!(spec.recoverability(), Recoverability::Reconstructible);
    assert!(ValueSpec::reconstructible(64, 16, false).is_err());
}
