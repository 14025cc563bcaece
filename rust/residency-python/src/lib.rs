//! `fhelium._core`: thin conversions between Python and `residency-core`.
//!
//! Argument schema errors are raised by the Python glue before anything reaches this
//! crate; what arrives here is already well-typed, so conversions stay mechanical.

mod api;
mod checksum;
mod context;
mod direct;
mod errors;
mod execute;
mod kinds;
mod lifetimes;
mod manager;
mod measure;
mod objects;
mod plan;
mod plans;
mod records;
mod search;
mod shapes;
mod step;
mod transition;

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The extension's Rust allocations (the core's state, searches, plans and records)
/// go to mimalloc rather than the C library's allocator: a pipeline step makes dozens
/// of small, short-lived allocations, and mimalloc's per-thread free lists serve them
/// at a fraction of the cost (docs/architecture.md#allocation). Python objects and
/// tensors keep their own allocators.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The interpreter's after-fork hook in a child: the core reads the child's process id
/// on its next check (`residency_core::process`).
#[pyfunction]
fn _after_fork_in_child() {
    residency_core::process::forget_after_fork();
}

#[pymodule(gil_used = false)]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    module.add("MAX_CUDA_INDEX", u32::from(residency_core::MAX_CUDA_INDEX))?;
    module.add_class::<search::ScheduleIndex>()?;
    module.add_class::<search::PolicyKeys>()?;
    module.add_class::<search::Decided>()?;
    module.add_class::<search::LoweredRequest>()?;
    module.add_class::<search::TierTable>()?;
    module.add_class::<kinds::LifetimeKind>()?;
    module.add_class::<plan::PlanIr>()?;
    module.add_class::<manager::CoreManager>()?;
    module.add_class::<manager::StateView>()?;
    module.add_class::<manager::SimulationView>()?;
    module.add_class::<records::RecordBuilder>()?;
    module.add_class::<plans::PlanRun>()?;
    module.add_class::<lifetimes::LeaseFinalizer>()?;
    module.add_class::<step::StepEntry>()?;
    module.add_class::<checksum::Checksum>()?;
    module.add_function(wrap_pyfunction!(plan::lower_records, module)?)?;
    module.add_function(wrap_pyfunction!(measure::measure_tensors, module)?)?;
    module.add_function(wrap_pyfunction!(checksum::checksum, module)?)?;
    // Registered when the extension is loaded, before any manager can exist (and so
    // before any other after-fork hook of the library's, which run in registration
    // order and may check their process).
    let hook = wrap_pyfunction!(_after_fork_in_child, module)?;
    let arguments = PyDict::new(module.py());
    arguments.set_item("after_in_child", hook)?;
    module
        .py()
        .import("os")?
        .call_method("register_at_fork", (), Some(&arguments))?;
    residency_sim::register(module)
}
