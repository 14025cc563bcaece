//! Invariants of the plan IR as the bindings lower it.

use std::sync::Arc;

use residency_core::{
    Action, CoreError, HandleRef, HandleSlot, Location, Plan, PlanPhase, Reservation,
};

fn handle(id: &str) -> HandleRef {
    HandleRef {
        manager_id: Arc::from("manager"),
        handle_id: Arc::from(id),
        type_key: 1,
    }
}

/// A plan of one enter phase, the shape `execute_actions` lowers to.
fn enter_only(
    name: &str,
    handles: Vec<HandleRef>,
    actions: Vec<Action>,
) -> Result<Plan, CoreError> {
    Plan::new(name, handles, vec![], actions, vec![], vec![])
}

fn reservation(label: &str, location: Location, nbytes: u64) -> Reservation {
    Reservation {
        location,
        nbytes,
        label: Arc::from(label),
    }
}

#[test]
fn ordered_actions_run_reclaim_then_enter_then_exit_with_local_indices() {
    let a = HandleSlot(0);
    let b = HandleSlot(1);
    let plan = Plan::new(
        "step",
        vec![handle("a"), handle("b")],
        vec![Action::Drop {
            handle: b,
            location: Location::Cuda(0),
        }],
        vec![
            Action::Ensure {
                handle: a,
                location: Location::Cuda(0),
            },
            Action::Move {
                handle: b,
                to: Location::PinnedHost,
                from: Some(Location::PageableHost),
            },
        ],
        vec![Action::Discard { handle: a }],
        vec![reservation("workspace", Location::Cuda(0), 64)],
    )
    .expect("valid plan");
    let order: Vec<(PlanPhase, usize, HandleSlot)> = plan
        .ordered_actions()
        .map(|(phase, index, action)| (phase, index, action.handle()))
        .collect();
    assert_eq!(
        order,
        vec![
            (PlanPhase::Reclaim, 0, b),
            (PlanPhase::Enter, 0, a),
            (PlanPhase::Enter, 1, b),
            (PlanPhase::Exit, 0, a),
        ]
    );
    assert_eq!(plan.action_count(), 4);
    assert_eq!(plan.handle(b).handle_id.as_ref(), "b");
    assert_eq!(
        plan.reservations(),
        &[reservation("workspace", Location::Cuda(0), 64)]
    );
}

#[test]
fn blank_names_labels_and_ids_are_rejected() {
    let invalid =
        |result: Result<Plan, CoreError>| matches!(result, Err(CoreError::InvalidArgument { .. }));
    assert!(invalid(enter_only("  ", vec![], vec![])));
    assert!(invalid(enter_only("p", vec![handle(" ")], vec![])));
    assert!(invalid(Plan::new(
        "p",
        vec![],
        vec![],
        vec![],
        vec![],
        vec![reservation("\t", Location::PageableHost, 0)],
    )));
}

#[test]
fn an_action_must_refer_to_a_slot_in_the_handle_table() {
    let err = enter_only(
        "p",
        vec![handle("a")],
        vec![Action::Discard {
            handle: HandleSlot(1),
        }],
    )
    .expect_err("slot 1 of a one-handle table");
    assert!(err.to_string().contains("slot 1 of 1"), "{err}");
}

#[test]
fn empty_and_duplicate_actions_are_valid_ir() {
    let empty = enter_only("noop", vec![], vec![]).expect("empty plan");
    assert_eq!(empty.action_count(), 0);
    let drop = Action::Drop {
        handle: HandleSlot(0),
        location: Location::PageableHost,
    };
    let duplicate =
        enter_only("dup", vec![handle("a")], vec![drop, drop]).expect("duplicates allowed");
    assert_eq!(duplicate.enter(), &[drop, drop]);
}

#[test]
fn a_plan_describes_itself_by_its_counts() {
    let plan = Plan::new(
        "p",
        vec![handle("a")],
        vec![],
        vec![Action::Ensure {
            handle: HandleSlot(0),
            location: Location::PinnedHost,
        }],
        vec![],
        vec![reservation("r", Location::Cuda(0), 8)],
    )
    .expect("a valid plan");
    assert_eq!(
        plan.to_string(),
        "PlanIR(name=\"p\", handles=1, reclaim=0, enter=1, exit=0, reservations=1)"
    );
}

#[test]
fn reservations_decode_signed_location_codes() {
    let decoded = Reservation::decode(3, 8, "r").expect("cuda:1's code");
    assert_eq!(decoded.location, Location::Cuda(1));
    assert_eq!((decoded.nbytes, &*decoded.label), (8, "r"));
    assert!(matches!(
        Reservation::decode(-1, 8, "r"),
        Err(CoreError::InvalidArgument { message }) if message == "invalid location code -1"
    ));
}
