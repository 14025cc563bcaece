//! Lowering of `ResidencyPlan` into the core's plan IR, once per plan.
//!
//! The glue interns handles into a table and encodes each action as a small tuple;
//! this keeps the conversion to one boundary crossing per plan, not per action.

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use residency_core::{Action, ActionKind, HandleRef, HandleSlot, Location, Plan, Reservation};

use crate::errors::to_py_err;
use crate::kinds::PyActionKind;

/// `(kind, handle_slot, location_code, from_code)`; codes are -1 where absent.
type ActionTuple = (PyActionKind, u32, i64, i64);

fn location(code: i64) -> PyResult<Location> {
    let code = u32::try_from(code)
        .map_err(|_| PyValueError::new_err(format!("invalid location code {code}")))?;
    Location::from_code(code).map_err(|err| PyValueError::new_err(err.to_string()))
}

fn action((kind, slot, code, from_code): ActionTuple) -> PyResult<Action> {
    let handle = HandleSlot(slot);
    Ok(match ActionKind::from(kind) {
        ActionKind::Ensure => Action::Ensure {
            handle,
            location: location(code)?,
        },
        ActionKind::Move => Action::Move {
            handle,
            to: location(code)?,
            from: if from_code < 0 {
                None
            } else {
                Some(location(from_code)?)
            },
        },
        ActionKind::Drop => Action::Drop {
            handle,
            location: location(code)?,
        },
        ActionKind::Discard => Action::Discard { handle },
    })
}

fn actions(tuples: Vec<ActionTuple>) -> PyResult<Vec<Action>> {
    tuples.into_iter().map(action).collect()
}

/// A lowered, validated plan. Immutable and shareable across threads.
#[pyclass(frozen, module = "fhelium._core", name = "PlanIR")]
#[derive(Debug)]
pub struct PlanIr {
    plan: Arc<Plan>,
}

impl PlanIr {
    pub fn new(plan: Plan) -> Self {
        Self {
            plan: Arc::new(plan),
        }
    }

    pub fn plan(&self) -> &Arc<Plan> {
        &self.plan
    }
}

#[pymethods]
impl PlanIr {
    fn __repr__(&self) -> String {
        let plan = &self.plan;
        format!(
            "PlanIR(name={:?}, handles={}, reclaim={}, enter={}, exit={}, reservations={})",
            plan.name(),
            plan.handles().len(),
            plan.reclaim().len(),
            plan.enter().len(),
            plan.exit().len(),
            plan.reservations().len(),
        )
    }
}

/// Lowers one plan. The glue has already validated every field's type and value.
#[pyfunction]
#[pyo3(signature = (name, handles, reclaim, enter, exit, reservations, /))]
#[allow(clippy::needless_pass_by_value)] // pyo3 extracts owned vectors.
pub fn lower_plan(
    py: Python<'_>,
    name: String,
    handles: Vec<(String, String, u64)>,
    reclaim: Vec<ActionTuple>,
    enter: Vec<ActionTuple>,
    exit: Vec<ActionTuple>,
    reservations: Vec<(i64, u64, String)>,
) -> PyResult<PlanIr> {
    let handles = handles
        .into_iter()
        .map(|(manager_id, handle_id, type_key)| HandleRef {
            manager_id: Arc::from(manager_id),
            handle_id: Arc::from(handle_id),
            type_key,
        })
        .collect();
    let reservations = reservations
        .into_iter()
        .map(|(code, nbytes, label)| {
            Ok(Reservation {
                location: location(code)?,
                nbytes,
                label: Arc::from(label),
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let plan = Plan::new(
        name,
        handles,
        actions(reclaim)?,
        actions(enter)?,
        actions(exit)?,
        reservations,
    )
    .map_err(|err| to_py_err(py, err))?;
    Ok(PlanIr {
        plan: Arc::new(plan),
    })
}
