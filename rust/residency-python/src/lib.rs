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

#[pymodule(gil_used = false)]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    module.add("MAX_CUDA_INDEX", u32::from(residency_core::MAX_CUDA_INDEX))?;
    module.add_class::<kinds::PyActionKind>()?;
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
    module.add_function(wrap_pyfunction!(plan::lower_plan, module)?)?;
    module.add_function(wrap_pyfunction!(plan::lower_records, module)?)?;
    module.add_function(wrap_pyfunction!(measure::measure_tensors, module)?)?;
    module.add_function(wrap_pyfunction!(checksum::checksum, module)?)?;
    residency_sim::register(module)
}
