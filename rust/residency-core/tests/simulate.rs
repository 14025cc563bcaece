//! The plan simulation (preflight and `explain`) against the documented rules
//! (docs/concepts/plans.md#preflight).

use std::sync::Arc;

use residency_core::{
    Action, CudaDevices, HandleId, HandleRef, HandleSlot, Location, Manager, Plan, Recoverability,
    ReplicaMode, Reservation, SlotResolution, ValueSpec,
};

fn spec(bytes: u64, mode: ReplicaMode, recoverability: Recoverability) -> ValueSpec {
    ValueSpec::new(bytes, bytes, mode, recoverability).expect("valid spec")
}

fn handle_ref(id: &str) -> HandleRef {
    HandleRef {
        manager_id: Arc::from("m"),
        handle_id: Arc::from(id),
        type_key: 1,
    }
}

fn plan(handles: usize, enter: Vec<Action>, reservations: Vec<Reservation>) -> Plan {
    let refs = (0..handles)
        .map(|slot| handle_ref(&format!("h{slot}")))
        .collect();
    Plan::new("p", refs, vec![], enter, vec![], reservations).expect("valid IR")
}

fn resolved(handles: &[HandleId]) -> Vec<SlotResolution> {
    handles.iter().map(|&handle| Ok(handle)).collect()
}

const CUDA: CudaDevices = CudaDevices::Count(2);
const SLOT0: HandleSlot = HandleSlot(0);
const SLOT1: HandleSlot = HandleSlot(1);

#[test]
fn a_budget_failure_names_the_location_and_still_raises_the_peak() {
    let manager = Manager::new(&[(Location::PageableHost, 100)]);
    let (value, _) = manager
        .register_source(
            1,
            spec(60, ReplicaMode::Replicable, Recoverability::Reconstructible),
            Location::PinnedHost,
        )
        .expect("registers");
    let (filler, _) = manager
        .adopt(
            1,
            spec(50, ReplicaMode::Exclusive, Recoverability::MustPreserve),
            Location::PageableHost,
            50,
            &[],
        )
        .expect("fits");
    let simulation = manager.simulate(
        &plan(
            1,
            vec![Action::Ensure {
                handle: SLOT0,
                location: Location::PageableHost,
            }],
            vec![],
        ),
        &resolved(&[value]),
        CUDA,
        &[],
        &[],
    );
    assert!(!simulation.feasible);
    assert_eq!(
        simulation.reason.as_deref(),
        Some("Transition exceeds budget at pageable-host")
    );
    let outcome = &simulation.actions[0];
    assert!(!outcome.executable);
    assert_eq!(outcome.source, Some(Location::PinnedHost));
    assert_eq!(outcome.destination, Some(Location::PageableHost));
    assert_eq!((outcome.logical_nbytes, outcome.storage_nbytes), (60, 60));
    // Registered locations first (budgeted, then the source's), the peak raised by the
    // refused attempt and the temporary load charge.
    assert_eq!(
        simulation.peaks,
        vec![(Location::PageableHost, 110), (Location::PinnedHost, 60)]
    );
    let _ = filler;
}

#[test]
fn reservations_are_admitted_before_enter_and_name_their_label() {
    let manager = Manager::new(&[(Location::Cuda(0), 100)]);
    let (value, _) = manager
        .adopt(
            1,
            spec(10, ReplicaMode::Replicable, Recoverability::MustPreserve),
            Location::PageableHost,
            10,
            &[],
        )
        .expect("adopts");
    let reservation = Reservation {
        location: Location::Cuda(0),
        nbytes: 95,
        label: Arc::from("work"),
    };
    let simulation = manager.simulate(
        &plan(
            1,
            vec![Action::Ensure {
                handle: SLOT0,
                location: Location::Cuda(0),
            }],
            vec![reservation],
        ),
        &resolved(&[value]),
        CUDA,
        &[],
        &["'work'".to_owned()],
    );
    assert_eq!(
        simulation.reason.as_deref(),
        Some("Transition exceeds budget at cuda:0")
    );
    let over = Reservation {
        location: Location::Cuda(0),
        nbytes: 101,
        label: Arc::from("it's"),
    };
    let simulation = manager.simulate(
        &plan(1, vec![], vec![over]),
        &resolved(&[value]),
        CUDA,
        &[],
        &[],
    );
    assert_eq!(
        simulation.reason.as_deref(),
        Some("Reservation \"it's\" exceeds budget at cuda:0")
    );
}

#[test]
fn handle_errors_and_same_plan_discards_stop_the_simulation() {
    let manager = Manager::new(&[]);
    let (value, _) = manager
        .register_source(
            1,
            spec(8, ReplicaMode::Replicable, Recoverability::Reconstructible),
            Location::PageableHost,
        )
        .expect("registers");
    let actions = vec![
        Action::Discard { handle: SLOT0 },
        Action::Ensure {
            handle: SLOT0,
            location: Location::PageableHost,
        },
    ];
    let simulation = manager.simulate(
        &plan(1, actions, vec![]),
        &resolved(&[value]),
        CUDA,
        &[],
        &[],
    );
    assert_eq!(simulation.actions.len(), 2);
    assert!(simulation.actions[0].executable);
    assert_eq!(
        simulation.reason.as_deref(),
        Some("Value 'h0' is discarded")
    );
    assert_eq!(simulation.actions[1].storage_nbytes, 0);

    let unresolved: Vec<SlotResolution> = vec![Err("unknown handle 'x'".to_owned())];
    let simulation = manager.simulate(
        &plan(1, vec![Action::Discard { handle: SLOT0 }], vec![]),
        &unresolved,
        CUDA,
        &[],
        &[],
    );
    assert_eq!(simulation.reason.as_deref(), Some("unknown handle 'x'"));
    assert_eq!(simulation.actions[0].source, None);
}

#[test]
fn protection_blocks_removal_unless_the_pending_lease_completed() {
    let manager = Manager::new(&[]);
    let (value, _) = manager
        .adopt(
            1,
            spec(8, ReplicaMode::Replicable, Recoverability::MustPreserve),
            Location::Cuda(0),
            8,
            &[],
        )
        .expect("adopts");
    manager
        .install(value, Location::PageableHost, 8, 8, &[], false)
        .expect("replica");
    let lease = manager
        .acquire(&[value], Location::Cuda(0))
        .expect("resident");
    assert!(manager.lease_to_pending(lease));
    let drop = || {
        plan(
            1,
            vec![Action::Drop {
                handle: SLOT0,
                location: Location::Cuda(0),
            }],
            vec![],
        )
    };
    let blocked = manager.simulate(&drop(), &resolved(&[value]), CUDA, &[], &[]);
    assert_eq!(
        blocked.reason.as_deref(),
        Some("materialization at cuda:0 is protected")
    );
    let completed = manager.simulate(&drop(), &resolved(&[value]), CUDA, &[lease], &[]);
    assert!(completed.feasible, "{:?}", completed.reason);
}

#[test]
fn cuda_locations_are_validated_with_the_managers_messages() {
    let manager = Manager::new(&[]);
    let (value, _) = manager
        .adopt(
            1,
            spec(8, ReplicaMode::Replicable, Recoverability::MustPreserve),
            Location::PageableHost,
            8,
            &[],
        )
        .expect("adopts");
    let ensure = |location| {
        plan(
            1,
            vec![Action::Ensure {
                handle: SLOT0,
                location,
            }],
            vec![],
        )
    };
    let missing = manager.simulate(
        &ensure(Location::Cuda(0)),
        &resolved(&[value]),
        CudaDevices::Unavailable,
        &[],
        &[],
    );
    assert_eq!(
        missing.reason.as_deref(),
        Some(residency_core::location::cuda_unavailable("cuda:0").as_str())
    );
    assert!(
        missing.reason.as_deref().is_some_and(|reason| reason
            .starts_with("cuda:0 is not usable: CUDA is not available")
            && reason.contains("SimulatedRuntime(1)")),
        "{:?}",
        missing.reason
    );
    let beyond = manager.simulate(
        &ensure(Location::Cuda(2)),
        &resolved(&[value]),
        CUDA,
        &[],
        &[],
    );
    assert_eq!(
        beyond.reason.as_deref(),
        Some("cuda:2 is not usable: only 2 CUDA device(s) present")
    );
}

#[test]
fn moves_prepare_the_destination_before_the_source_and_remove_the_source() {
    let manager = Manager::new(&[]);
    let (first, _) = manager
        .register_source(
            1,
            spec(8, ReplicaMode::Exclusive, Recoverability::Reconstructible),
            Location::Cuda(1),
        )
        .expect("registers");
    let (second, _) = manager
        .adopt(
            1,
            spec(4, ReplicaMode::Exclusive, Recoverability::MustPreserve),
            Location::PageableHost,
            4,
            &[],
        )
        .expect("adopts");
    let simulation = manager.simulate(
        &plan(
            2,
            vec![
                Action::Move {
                    handle: SLOT1,
                    to: Location::Cuda(0),
                    from: None,
                },
                Action::Move {
                    handle: SLOT0,
                    to: Location::PinnedHost,
                    from: None,
                },
            ],
            vec![],
        ),
        &resolved(&[first, second]),
        CUDA,
        &[],
        &[],
    );
    assert!(simulation.feasible, "{:?}", simulation.reason);
    assert_eq!(simulation.actions[1].source, Some(Location::Cuda(1)));
    // Registered: cuda:1 (source registration), pageable (adopt); then cuda:0 and
    // pinned as the moves prepared them.
    let order: Vec<Location> = simulation
        .peaks
        .iter()
        .map(|(location, _)| *location)
        .collect();
    assert_eq!(
        order,
        vec![
            Location::Cuda(1),
            Location::PageableHost,
            Location::Cuda(0),
            Location::PinnedHost
        ]
    );
    assert_eq!(
        simulation.peaks,
        vec![
            (Location::Cuda(1), 8),
            (Location::PageableHost, 4),
            (Location::Cuda(0), 4),
            (Location::PinnedHost, 8)
        ]
    );
}
