//! The per-action rules the bindings apply around a transition: building an action
//! from what a record names, what its report names, which allocator it samples, and
//! which call makes each copy (docs/concepts/transitions.md).

use residency_core::{
    Action, ActionKind, CopyRoute, CoreError, HandleSlot, Location, LocationKind, Place,
    ReportPlaces, Telemetry,
};

const SLOT: HandleSlot = HandleSlot(0);

#[test]
fn an_action_is_built_from_the_locations_its_record_names() {
    assert_eq!(
        Action::new(ActionKind::Move, SLOT, Some(Location::Cuda(1)), None),
        Ok(Action::Move {
            handle: SLOT,
            to: Location::Cuda(1),
            from: None
        })
    );
    assert_eq!(
        Action::new(ActionKind::Discard, SLOT, None, None),
        Ok(Action::Discard { handle: SLOT })
    );
    assert!(matches!(
        Action::new(ActionKind::Drop, SLOT, None, None),
        Err(CoreError::Internal { .. })
    ));
    for kind in [
        ActionKind::Ensure,
        ActionKind::Move,
        ActionKind::Drop,
        ActionKind::Discard,
    ] {
        let action = Action::new(kind, SLOT, Some(Location::PinnedHost), None);
        assert_eq!(action.map(|action| action.kind()), Ok(kind));
        // Only the kinds that copy somewhere take a transfer stream.
        let copies = Action::new(kind, SLOT, Some(Location::PinnedHost), None)
            .map(|action| action.destination().is_some());
        assert_eq!(copies, Ok(kind.takes_stream()));
    }
}

#[test]
fn reports_name_the_source_copied_from_and_the_location_named() {
    let ensure = Action::Ensure {
        handle: SLOT,
        location: Location::Cuda(0),
    };
    assert_eq!(
        ensure.report_places(Some(Location::PinnedHost), false),
        ReportPlaces {
            source: Place::At(Location::PinnedHost),
            destination: Place::Named,
            no_op: None,
        }
    );
    assert_eq!(
        ensure.report_places(None, true).no_op,
        Some(ActionKind::Ensure)
    );
    let drop = Action::Drop {
        handle: SLOT,
        location: Location::Cuda(0),
    };
    assert_eq!(
        drop.report_places(None, true),
        ReportPlaces {
            source: Place::Named,
            destination: Place::None,
            no_op: Some(ActionKind::Drop),
        }
    );
    // A discard names no location and gives no reason, even as a no-op.
    let discard = Action::Discard { handle: SLOT };
    assert_eq!(
        discard.report_places(Some(Location::Cuda(0)), true),
        ReportPlaces {
            source: Place::None,
            destination: Place::None,
            no_op: None,
        }
    );
}

#[test]
fn the_sampled_allocator_is_the_first_cuda_location_touched() {
    // A materialisation list that, were it asked for, would fail the assertion.
    let never = || -> Result<Vec<Location>, CoreError> {
        Err(CoreError::Internal {
            message: "not asked".into(),
        })
    };
    let ensure = |location| Action::Ensure {
        handle: SLOT,
        location,
    };
    assert_eq!(ensure(Location::Cuda(2)).sampled(never), Ok(Place::Named));
    assert_eq!(ensure(Location::PinnedHost).sampled(never), Ok(Place::None));
    let to_host = Action::Move {
        handle: SLOT,
        to: Location::PageableHost,
        from: Some(Location::Cuda(1)),
    };
    assert_eq!(to_host.sampled(never), Ok(Place::At(Location::Cuda(1))));
    let to_cuda = Action::Move {
        handle: SLOT,
        to: Location::Cuda(0),
        from: None,
    };
    // The destination comes first, before the value's materialisations.
    let held = || Ok(vec![Location::PageableHost, Location::Cuda(3)]);
    assert_eq!(to_cuda.sampled(held), Ok(Place::At(Location::Cuda(0))));
    let anywhere = Action::Move {
        handle: SLOT,
        to: Location::PinnedHost,
        from: None,
    };
    assert_eq!(anywhere.sampled(held), Ok(Place::At(Location::Cuda(3))));
    let discard = Action::Discard { handle: SLOT };
    assert_eq!(discard.sampled(held), Ok(Place::At(Location::Cuda(3))));
    assert_eq!(
        discard.sampled(|| Ok(vec![Location::PinnedHost])),
        Ok(Place::None)
    );
}

#[test]
fn each_copy_has_one_route() {
    use Location::{Cuda, Disk, PageableHost, PinnedHost};
    let cases = [
        (
            Disk(0),
            PageableHost,
            CopyRoute::ReadToHost { pinned: false },
        ),
        (Disk(0), PinnedHost, CopyRoute::ReadToHost { pinned: true }),
        (Disk(0), Cuda(0), CopyRoute::ReadToCuda),
        (Cuda(0), Disk(1), CopyRoute::Write),
        (PageableHost, PinnedHost, CopyRoute::ToPinned),
        (Cuda(0), PageableHost, CopyRoute::ToPageable),
        (
            PageableHost,
            Cuda(0),
            CopyRoute::ToCuda {
                non_blocking: false,
            },
        ),
        (
            PinnedHost,
            Cuda(0),
            CopyRoute::ToCuda { non_blocking: true },
        ),
        (Cuda(1), Cuda(0), CopyRoute::ToCuda { non_blocking: true }),
    ];
    for (from, to, route) in cases {
        assert_eq!(CopyRoute::between(from, to), route, "{from} -> {to}");
    }
}

#[test]
fn location_records_name_their_kind() {
    assert_eq!(
        LocationKind::named("pageable-host"),
        LocationKind::PageableHost
    );
    assert_eq!(LocationKind::named("pinned-host"), LocationKind::PinnedHost);
    assert_eq!(LocationKind::named("disk"), LocationKind::Disk);
    // Every other kind names a CUDA device by its index.
    assert_eq!(LocationKind::named("cuda"), LocationKind::Cuda);
    assert_eq!(LocationKind::named("Pinned-Host"), LocationKind::Cuda);
}

#[test]
fn an_asynchronous_transition_names_its_device_but_takes_no_readings() {
    let ensure = Action::Ensure {
        handle: SLOT,
        location: Location::Cuda(0),
    };
    let none = || Ok(Vec::new());
    assert_eq!(
        ensure.telemetry(false, none),
        Ok(Telemetry {
            device: Place::Named,
            readings: true,
        })
    );
    assert_eq!(
        ensure.telemetry(true, none),
        Ok(Telemetry {
            device: Place::Named,
            readings: false,
        })
    );
    // Nothing on CUDA: nothing to read.
    let host = Action::Drop {
        handle: SLOT,
        location: Location::PinnedHost,
    };
    assert_eq!(
        host.telemetry(false, none),
        Ok(Telemetry {
            device: Place::None,
            readings: false,
        })
    );
}
