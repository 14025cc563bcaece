//! One plan phase in one call: each action in order through the one-call
//! transition path, with its transfer stream.
//!
//! The caller holds the transition gate for the whole phase. Each action's report is
//! appended to the caller's list as soon as it is committed, so when an action fails
//! the list holds exactly the committed prefix and its length tells the caller which
//! action failed; the error itself propagates unchanged.

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::execute;
use crate::manager::CoreManager;

/// Runs `actions` in order, appending each report to `transitions`. `stream_for`
/// gives an action's transfer stream (`None` when the phase has no streams).
pub fn run_phase(
    manager: &CoreManager,
    py: Python<'_>,
    actions: &Bound<'_, PyTuple>,
    transitions: &Bound<'_, PyList>,
    stream_for: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    for action in actions.iter() {
        // A signal handler runs between actions, as it would between the iterations
        // of a loop in Python.
        py.check_signals()?;
        let stream = match stream_for {
            Some(stream_for) => {
                Some(stream_for.call1((&action,))?).filter(|stream| !stream.is_none())
            }
            None => None,
        };
        transitions.append(execute::execute(manager, py, &action, stream.as_ref())?)?;
    }
    Ok(())
}
