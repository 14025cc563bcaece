//! The simulated runtime's common-case seam calls, native
//! (`fhelium.residency.simulation.SimulatedRuntime`, docs/concepts/simulation.md).
//!
//! A [`SimulatedSeam`] belongs to one `SimulatedRuntime` (of that exact class) and
//! holds its parts: the storage registry's native data ([`SimulatedStorages`]: entries,
//! counters, freed queue), the native memory-reuse order ([`ReuseOrder`]), the copy
//! log, the lock. Its methods do what the runtime's Python
//! methods do in their common case (no failure queued, no timeline, events completing
//! at once, a simulated stream, a plain one-tensor value), on the same objects under
//! the same lock, and return `None`, having changed nothing, where that case does not
//! apply: the Python method then does the whole call. The runtime's methods call them
//! first; the binding calls them directly when the runtime's seam methods are its own
//! (`SimulatedSeam::own`), sparing the Python frames of a pipeline step.

use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use pyo3::{PyTraverseError, PyVisit};

mod registry;
mod reuse;

pub use registry::{Found, SimulatedStorages, Slot, Table, key_of};
pub use reuse::{Order, ReuseOrder};

/// The CUDA caching allocator's block: reserved bytes are whole blocks.
pub const BLOCK: u64 = 512;

/// A storage's bytes as the simulated allocator reserves them: whole blocks
/// (`simulated_storage.reserved_nbytes`).
pub const fn reserved_nbytes(nbytes: u64) -> u64 {
    nbytes.div_ceil(BLOCK) * BLOCK
}

/// The seam methods the binding may call natively, in the order of `originals`.
const COPY_MEASURED: usize = 0;
const COPY: usize = 1;
const MEASURE: usize = 2;
const RECORD_EVENT: usize = 3;
const EVENT_QUERY: usize = 4;
const MEMORY_SAMPLE: usize = 5;
const NAMES: [&str; 6] = [
    "copy_to_cuda_measured",
    "copy_to_cuda",
    "measure",
    "record_event",
    "event_query",
    "memory_sample",
];

/// One `SimulatedRuntime`'s parts, for its common-case seam calls (see the module).
#[pyclass(module = "fhelium._core", frozen)]
#[derive(Debug)]
pub struct SimulatedSeam {
    /// `SimulatedRuntime`'s own functions of `NAMES`, taken when its module loaded,
    /// and the names, interned.
    originals: Vec<Py<PyAny>>,
    names: Vec<Py<PyString>>,
    /// The runtime's own attribute dict, where a method replaced on the instance (a
    /// test's spy) goes; `None` for an instance without one.
    instance: Option<Py<PyDict>>,
    /// The address of the runtime it belongs to, which holds it.
    runtime: usize,
    /// The runtime's lock's bound `acquire`, `release` and `locked`, taken once.
    acquire: Py<PyAny>,
    release: Py<PyAny>,
    is_locked: Py<PyAny>,
    /// Whether the interpreter runs with the GIL (`sys._is_gil_enabled()`, true where
    /// there is no such function): `serialized` may skip a free lock only then.
    gil: bool,
    faults: Py<PyDict>,
    devices: Py<PyTuple>,
    indices: Py<PyDict>,
    default_streams: Py<PyTuple>,
    cuda_locations: Py<PyList>,
    copies: Py<PyList>,
    hazards: Py<PyList>,
    auto_complete: bool,
    timed: bool,
    // The storage registry's data (`simulated_storage.StorageRegistry.native`).
    storages: Py<SimulatedStorages>,
    // The memory-reuse order.
    order: Py<ReuseOrder>,
    // Classes and helpers.
    classes: Classes,
    /// What the last calls found, which the next ones ask for again.
    last: Mutex<Last>,
}

/// The last simulated device `SimulatedSeam::index` was given (one object, kept: a
/// caller names a device with one object), the last copy's log record, for the next
/// copy to the same place on the same stream, and the streams used lately. Nothing is dropped, and no Python
/// code runs, while it is locked.
#[derive(Debug, Default)]
struct Last {
    device: Option<(Py<PyAny>, usize)>,
    record: Option<Record>,
    /// The simulated streams used lately, latest first, with their devices and handles
    /// (set when a stream is made, never changed). The runtime holds every stream it
    /// made for its whole life: keeping them here keeps nothing longer.
    streams: Vec<(Py<PyAny>, Py<PyAny>, i64)>,
}

/// How many streams `Last` keeps: a pipeline step uses two or three.
const STREAMS: usize = 4;

/// A `SimulatedCopy` the seam logged, and the addresses of its location and stream
/// (alive while it holds them).
#[derive(Debug)]
struct Record {
    record: Py<PyAny>,
    location: usize,
    stream: usize,
    non_blocking: bool,
}

/// The classes and helpers the seam builds with, read once.
#[derive(Debug)]
struct Classes {
    device: Py<PyAny>,
    stream: Py<PyAny>,
    event: Py<PyAny>,
    /// ``(SimulatedEvent,)`` and ``(ResidentTensor,)``: `object_new`'s arguments, made once.
    event_args: Py<PyTuple>,
    resident_args: Py<PyTuple>,
    /// ``(TensorBundle,)``: `object_new`'s arguments for a bundle's copy.
    bundle_args: Py<PyTuple>,
    bundle: Py<PyAny>,
    hazard: Py<PyAny>,
    facts: Py<PyAny>,
    copy: Py<PyAny>,
    resident: Py<PyAny>,
    tensor: Py<PyAny>,
    parameter: Py<PyAny>,
    strided: Py<PyAny>,
    forward_ad: Py<PyAny>,
    dual_levels_known: bool,
    tuple_new: Py<PyAny>,
    object_new: Py<PyAny>,
    cuda_location: Py<PyAny>,
    /// torch's dtypes that are not complex (``torch.float32`` first), read once.
    real_dtypes: Vec<Py<PyAny>>,
}

fn attr<'py>(object: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    object.getattr(name)
}

/// torch's dtypes (the `torch.dtype` objects its module names) that are not complex,
/// ``torch.float32`` first.
fn real_dtypes(torch: &Bound<'_, PyModule>) -> PyResult<Vec<Py<PyAny>>> {
    let py = torch.py();
    let class = attr(torch, "dtype")?;
    let mut real = vec![attr(torch, "float32")?.unbind()];
    for value in torch.dict().values() {
        if value.get_type().is(&class)
            && !attr(&value, "is_complex")?.is_truthy()?
            && !real.iter().any(|known| value.is(known.bind(py)))
        {
            real.push(value.unbind());
        }
    }
    Ok(real)
}

fn part<T: pyo3::PyTypeCheck>(object: &Bound<'_, PyAny>, name: &str) -> PyResult<Py<T>> {
    Ok(attr(object, name)?.cast_into::<T>()?.unbind())
}

#[pymethods]
impl SimulatedSeam {
    /// The runtime's parts it holds, for the collector: they reach the runtime's streams,
    /// which refer back to the runtime that holds this seam, so a runtime dropped with
    /// them is a cycle through this object, collected only if the collector sees these
    /// references (the cycle is broken by clearing the runtime's own attributes).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(instance) = &self.instance {
            visit.call(instance)?;
        }
        // Not waited for: the lock is never held while Python code runs (the collector's
        // included), and a reference not shown keeps its object, which is safe.
        if let Ok(last) = self.last.try_lock() {
            if let Some((device, _)) = &last.device {
                visit.call(device)?;
            }
            if let Some(record) = &last.record {
                visit.call(&record.record)?;
            }
            for (stream, device, _) in &last.streams {
                visit.call(stream)?;
                visit.call(device)?;
            }
        }
        for held in [
            &self.acquire,
            &self.release,
            &self.is_locked,
            self.faults.as_any(),
            self.devices.as_any(),
            self.indices.as_any(),
            self.default_streams.as_any(),
            self.cuda_locations.as_any(),
            self.copies.as_any(),
            self.hazards.as_any(),
            self.storages.as_any(),
            self.order.as_any(),
        ] {
            visit.call(held)?;
        }
        Ok(())
    }

    /// The parts of ``runtime``, a `SimulatedRuntime` whose construction is complete,
    /// and ``originals``: its class's own functions, by `NAMES`.
    #[new]
    fn new(runtime: &Bound<'_, PyAny>, originals: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let py = runtime.py();
        if originals.len() != NAMES.len() {
            return Err(PyTypeError::new_err(
                "originals: one function per seam method",
            ));
        }
        let storage = attr(runtime, "_storage")?;
        let order = attr(runtime, "_order")?;
        let torch = py.import("torch")?;
        let simulated = py.import("fhelium.residency._runtime.simulated")?;
        let streams = py.import("fhelium.residency._runtime.simulated_streams")?;
        let registry = py.import("fhelium.residency._runtime.simulated_storage")?;
        let base = py.import("fhelium.residency._runtime.base")?;
        let values = py.import("fhelium.values.tensor_resident")?;
        let builtins = py.import("builtins")?;
        let forward_ad = attr(&values, "_forward_ad")?;
        let event = attr(&streams, "SimulatedEvent")?;
        let resident = attr(&values, "ResidentTensor")?;
        let bundle = attr(&values, "TensorBundle")?;
        let classes = Classes {
            device: attr(&torch, "device")?.unbind(),
            stream: attr(&streams, "SimulatedStream")?.unbind(),
            event_args: PyTuple::new(py, [&event])?.unbind(),
            resident_args: PyTuple::new(py, [&resident])?.unbind(),
            bundle_args: PyTuple::new(py, [&bundle])?.unbind(),
            bundle: bundle.unbind(),
            event: event.unbind(),
            hazard: attr(&registry, "SimulatedHazard")?.unbind(),
            facts: attr(&base, "ValueFacts")?.unbind(),
            copy: attr(&simulated, "SimulatedCopy")?.unbind(),
            resident: resident.unbind(),
            tensor: attr(&torch, "Tensor")?.unbind(),
            parameter: attr(&attr(&torch, "nn")?, "Parameter")?.unbind(),
            strided: attr(&torch, "strided")?.unbind(),
            dual_levels_known: forward_ad.hasattr("_current_level")?,
            forward_ad: forward_ad.unbind(),
            tuple_new: attr(&attr(&builtins, "tuple")?, "__new__")?.unbind(),
            object_new: attr(&attr(&builtins, "object")?, "__new__")?.unbind(),
            cuda_location: attr(&simulated, "cuda_location")?.unbind(),
            real_dtypes: real_dtypes(&torch)?,
        };
        Ok(Self {
            originals: originals.iter().map(Bound::unbind).collect(),
            runtime: runtime.as_ptr().addr(),
            instance: match runtime.getattr_opt(intern!(py, "__dict__"))? {
                Some(own) => Some(own.cast_into::<PyDict>()?.unbind()),
                None => None,
            },
            names: NAMES
                .iter()
                .map(|name| PyString::intern(py, name).unbind())
                .collect(),
            acquire: attr(&attr(runtime, "_lock")?, "acquire")?.unbind(),
            release: attr(&attr(runtime, "_lock")?, "release")?.unbind(),
            is_locked: attr(&attr(runtime, "_lock")?, "locked")?.unbind(),
            gil: match py.import("sys")?.getattr_opt("_is_gil_enabled")? {
                Some(enabled) => enabled.call0()?.is_truthy()?,
                None => true,
            },
            faults: part(runtime, "_faults")?,
            devices: part(runtime, "_devices")?,
            indices: part(runtime, "_indices")?,
            default_streams: part(runtime, "_default_streams")?,
            cuda_locations: part(runtime, "_cuda_locations")?,
            copies: part(runtime, "copies")?,
            hazards: part(runtime, "hazards")?,
            auto_complete: attr(runtime, "_auto_complete")?.is_truthy()?,
            timed: !attr(runtime, "_timing")?.is_none(),
            storages: part(&storage, "native")?,
            order: order.cast_into::<ReuseOrder>()?.unbind(),
            classes,
            last: Mutex::default(),
        })
    }

    /// `copy_to_cuda` (and `copy_to_cuda_measured`) of a plain value (`plains`) to a
    /// simulated device, on a simulated stream of that device
    /// or its default stream (``None``), with no failure queued and no timeline:
    /// ``(copy, facts)``, counted as ``"copy_to_cuda"``. ``None`` otherwise, having done
    /// nothing.
    fn copy<'py>(
        &self,
        runtime: &Bound<'py, PyAny>,
        value: &Bound<'py, PyAny>,
        device: &Bound<'py, PyAny>,
        stream: &Bound<'py, PyAny>,
        non_blocking: bool,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let Some(copied) = self.copy_native(runtime, value, device, stream, non_blocking)? else {
            return Ok(None);
        };
        let py = runtime.py();
        let index = copied.index.into_pyobject(py)?.into_any();
        let nbytes = copied.nbytes.into_pyobject(py)?.into_any();
        let keys = PyList::empty(py);
        for &pointer in &copied.pointers {
            keys.append(PyTuple::new(
                py,
                [index.clone(), pointer.into_pyobject(py)?.into_any()],
            )?)?;
        }
        // Contiguous tensors, each over its whole storage of its own: their bytes are
        // the storages'.
        let facts = self.tuple_of(
            self.classes.facts.bind(py),
            &[
                copied.device,
                index,
                false.into_pyobject(py)?.to_owned().into_any(),
                nbytes.clone(),
                nbytes,
                keys.into_any(),
            ],
        )?;
        PyTuple::new(py, [copied.value, facts]).map(Some)
    }

    /// `record_event` on a simulated stream of a runtime whose events complete at once,
    /// with no failure queued: the complete event. ``None`` otherwise.
    fn record_event<'py>(
        &self,
        runtime: &Bound<'py, PyAny>,
        stream: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = runtime.py();
        if !self.auto_complete
            || self.timed
            || !self.faults.bind(py).is_empty()
            || !stream.get_type().is(self.classes.stream.bind(py))
        {
            return Ok(None);
        }
        self.count(runtime, intern!(py, "record_event"))?;
        // Complete at once: the host takes in its order now (`ReuseOrder.drained`), so
        // the event keeps no clock.
        let event = self
            .classes
            .object_new
            .bind(py)
            .call1(self.classes.event_args.bind(py))?;
        event.setattr(intern!(py, "_stream"), stream)?;
        event.setattr(intern!(py, "_time"), py.None())?;
        event.setattr(intern!(py, "_completed"), true)?;
        event.setattr(intern!(py, "_clock"), py.None())?;
        let (_, handle) = self.stream_of(stream)?;
        let order = self.order.get();
        if !order.is_clean_native(handle) {
            self.serialized(py, || order.drained_native(handle))?;
        }
        Ok(Some(event))
    }

    /// `event_query` of a `SimulatedEvent` without a timeline, with no failure queued.
    /// ``None`` otherwise.
    fn event_query(
        &self,
        runtime: &Bound<'_, PyAny>,
        event: &Bound<'_, PyAny>,
    ) -> PyResult<Option<bool>> {
        let py = runtime.py();
        if self.timed
            || !self.faults.bind(py).is_empty()
            || !event.get_type().is(self.classes.event.bind(py))
        {
            return Ok(None);
        }
        self.count(runtime, intern!(py, "event_query"))?;
        event
            .getattr(intern!(py, "_completed"))?
            .is_truthy()
            .map(Some)
    }

    /// `memory_sample` of a simulated device, with no failure queued. ``None``
    /// otherwise.
    fn memory_sample<'py>(
        &self,
        runtime: &Bound<'py, PyAny>,
        device: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = runtime.py();
        if !self.faults.bind(py).is_empty() {
            return Ok(None);
        }
        let Some(index) = self.index(device)? else {
            return Ok(None);
        };
        self.count(runtime, intern!(py, "memory_sample"))?;
        let storages = self.storages.get();
        // With no storage freed since the last drain, draining does nothing.
        let sample = if storages.has_freed(py) {
            self.locked(py, || {
                self.drain(py)?;
                Ok(storages.sample(index))
            })?
        } else {
            self.serialized(py, || storages.sample(index))?
        };
        let Some(sample) = sample else {
            return Ok(None);
        };
        sample.into_pyobject(py).map(Some)
    }
}

impl SimulatedSeam {
    /// The seam of ``runtime`` when the binding may call it for the runtime's own seam
    /// methods: a runtime built with one (a `SimulatedRuntime` of that exact class).
    pub fn of<'py>(runtime: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, Self>>> {
        let py = runtime.py();
        let Some(seam) = runtime.getattr_opt(intern!(py, "_native"))? else {
            return Ok(None);
        };
        // Its own seam, not one another object hands on (a wrapper of the runtime).
        Ok(seam
            .cast_into::<Self>()
            .ok()
            .filter(|seam| seam.get().runtime == runtime.as_ptr().addr()))
    }

    /// `copy` (see there) with the copy's facts as they are: for the binding, and for
    /// `copy`, which builds the `ValueFacts`.
    fn copy_native<'py>(
        &self,
        runtime: &Bound<'py, PyAny>,
        value: &Bound<'py, PyAny>,
        device: &Bound<'py, PyAny>,
        stream: &Bound<'py, PyAny>,
        non_blocking: bool,
    ) -> PyResult<Option<Copied<'py>>> {
        let py = runtime.py();
        if self.timed || !self.faults.bind(py).is_empty() {
            return Ok(None);
        }
        let Some(index) = self.index(device)? else {
            return Ok(None);
        };
        let target = self.devices.bind(py).get_item(index)?;
        let stream = if stream.is_none() {
            self.default_streams.bind(py).get_item(index)?
        } else if stream.get_type().is(self.classes.stream.bind(py))
            && self.stream_of(stream)?.0.is(&target)
        {
            stream.clone()
        } else {
            return Ok(None);
        };
        let Some((bundle, sources)) = self.plains(value)? else {
            return Ok(None);
        };
        self.count(runtime, intern!(py, "copy_to_cuda"))?;
        self.copy_plain(
            value,
            bundle,
            &sources,
            target,
            index,
            &stream,
            non_blocking,
        )
        .map(Some)
    }

    /// Whether ``runtime``'s seam methods ``names`` are its class's own: none replaced
    /// on the instance (a test's spy) or on the class.
    fn own(&self, runtime: &Bound<'_, PyAny>, names: &[usize]) -> PyResult<bool> {
        let py = runtime.py();
        let instance = self.instance.as_ref().map(|own| own.bind(py));
        let class = runtime.get_type();
        for &name in names {
            let key = self.names[name].bind(py);
            // Replaced on the instance: its own attribute shadows the class's function
            // (looked up in its dict: no bound method is made).
            if let Some(own) = instance
                && own.contains(key)?
            {
                return Ok(false);
            }
            // Replaced on the class (or a class of its own set since): what the class
            // gives is another function.
            let Some(function) = class.getattr_opt(key)? else {
                return Ok(false);
            };
            if !function.is(self.originals[name].bind(py)) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// `copy_to_cuda_measured` for the binding: `copy` where none of the methods it
    /// stands for is replaced.
    pub fn copy_measured<'py>(
        &self,
        runtime: &Bound<'py, PyAny>,
        value: &Bound<'py, PyAny>,
        device: &Bound<'py, PyAny>,
        stream: &Bound<'py, PyAny>,
        non_blocking: bool,
    ) -> PyResult<Option<Copied<'py>>> {
        if !self.own(runtime, &[COPY_MEASURED, COPY, MEASURE])? {
            return Ok(None);
        }
        self.copy_native(runtime, value, device, stream, non_blocking)
    }

    /// `record_event` for the binding, where it is the runtime's own.
    pub fn record<'py>(
        &self,
        runtime: &Bound<'py, PyAny>,
        stream: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        if !self.own(runtime, &[RECORD_EVENT])? {
            return Ok(None);
        }
        self.record_event(runtime, stream)
    }

    /// `event_query` for the binding, where it is the runtime's own.
    pub fn query(
        &self,
        runtime: &Bound<'_, PyAny>,
        event: &Bound<'_, PyAny>,
    ) -> PyResult<Option<bool>> {
        if !self.own(runtime, &[EVENT_QUERY])? {
            return Ok(None);
        }
        self.event_query(runtime, event)
    }

    /// `memory_sample` for the binding, where it is the runtime's own.
    pub fn sample<'py>(
        &self,
        runtime: &Bound<'py, PyAny>,
        device: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        if !self.own(runtime, &[MEMORY_SAMPLE])? {
            return Ok(None);
        }
        self.memory_sample(runtime, device)
    }

    /// The index of a simulated device given as a `torch.device` (else ``None``).
    fn index(&self, device: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let py = device.py();
        // The device given last, by identity (a `torch.device` is immutable).
        if let Some((last, index)) = &self.last().device
            && device.is(last)
        {
            return Ok(Some(*index));
        }
        if !device.get_type().is(self.classes.device.bind(py)) {
            return Ok(None);
        }
        let Some(index) = self.indices.bind(py).get_item(device)? else {
            return Ok(None);
        };
        let index: usize = index.extract()?;
        let held = device.clone().unbind();
        let replaced = self.last().device.replace((held, index));
        drop(replaced);
        Ok(Some(index))
    }

    /// A simulated stream's device and handle (its ``_device`` and ``_handle``).
    fn stream_of<'py>(&self, stream: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyAny>, i64)> {
        let py = stream.py();
        if let Some((_, device, handle)) = self.last().streams.iter().find(|(s, _, _)| stream.is(s))
        {
            return Ok((device.bind(py).clone(), *handle));
        }
        let device = stream.getattr(intern!(py, "_device"))?;
        let handle: i64 = stream.getattr(intern!(py, "_handle"))?.extract()?;
        let held = (stream.clone().unbind(), device.clone().unbind(), handle);
        let dropped = {
            let streams = &mut self.last().streams;
            streams.insert(0, held);
            let kept = STREAMS.min(streams.len());
            streams.split_off(kept)
        };
        drop(dropped);
        Ok((device, handle))
    }

    /// `last`, locked.
    fn last(&self) -> MutexGuard<'_, Last> {
        self.last.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The `SimulatedCopy` of a copy to `location` on `stream`: the last one logged
    /// where it records the same (a named tuple is immutable), else a new one.
    fn record_of<'py>(
        &self,
        location: Bound<'py, PyAny>,
        stream: &Bound<'py, PyAny>,
        non_blocking: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = stream.py();
        let (at, on) = (location.as_ptr().addr(), stream.as_ptr().addr());
        if let Some(last) = &self.last().record
            && (last.location, last.stream, last.non_blocking) == (at, on, non_blocking)
        {
            return Ok(last.record.bind(py).clone());
        }
        let record = self.tuple_of(
            self.classes.copy.bind(py),
            &[
                location,
                stream.clone(),
                non_blocking.into_pyobject(py)?.to_owned().into_any(),
            ],
        )?;
        let replaced = self.last().record.replace(Record {
            record: record.clone().unbind(),
            location: at,
            stream: on,
            non_blocking,
        });
        drop(replaced);
        Ok(record)
    }
    /// One call of seam method ``name`` counted in ``runtime.calls`` (read from the
    /// runtime's own dict, where it is kept: a test may set a new counter), as
    /// `collections._count_elements` counts it.
    fn count(&self, runtime: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> PyResult<()> {
        let py = runtime.py();
        let calls = match self.instance.as_ref() {
            Some(own) => match own.bind(py).get_item(intern!(py, "calls"))? {
                Some(calls) => calls,
                None => runtime.getattr(intern!(py, "calls"))?,
            },
            None => runtime.getattr(intern!(py, "calls"))?,
        };
        let Ok(calls) = calls.cast::<PyDict>() else {
            // Not a dict: as `_count_elements` counts in any mapping.
            let counted = py.import("collections")?.getattr("_count_elements")?;
            counted.call1((calls, (name,)))?;
            return Ok(());
        };
        // As `_count_elements`: the value plus one (`PyNumber_Add`), or one.
        let one = 1_i64.into_pyobject(py)?;
        match calls.get_item(name)? {
            Some(now) => calls.set_item(name, now.add(one)?),
            None => calls.set_item(name, one),
        }
    }

    /// `f`, which runs no Python code and keeps the GIL, serialized with every hold of
    /// the runtime's lock: at once where the lock is free (a thread that takes it now
    /// acts under it only once it has the GIL, after `f`), else with the lock held.
    fn serialized<T>(&self, py: Python<'_>, f: impl FnOnce() -> T) -> PyResult<T> {
        // Without the GIL, another thread may act under the lock at the same time.
        if !self.gil || self.is_locked.bind(py).call0()?.is_truthy()? {
            return self.locked(py, || Ok(f()));
        }
        Ok(f())
    }

    /// `f` with the runtime's lock held.
    fn locked<T>(&self, py: Python<'_>, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
        self.acquire.bind(py).call0()?;
        let done = f();
        self.release.bind(py).call0()?;
        done
    }

    /// The plain fields of ``value``, with whether it is a bundle: a `ResidentTensor`
    /// whose tensor is plain (`plain`), or a `TensorBundle` (that exact class) whose
    /// every field is plain over a storage of its own (docs/concepts/simulation.md#native-calls);
    /// ``None`` for any other value.
    fn plains<'py>(
        &self,
        value: &Bound<'py, PyAny>,
    ) -> PyResult<Option<(bool, Fields<Plain<'py>>)>> {
        let py = value.py();
        let classes = &self.classes;
        let kind = value.get_type();
        if kind.is(classes.resident.bind(py)) {
            let tensor = value.getattr(intern!(py, "_tensor"))?;
            return Ok(self
                .plain(tensor)?
                .map(|plain| (false, smallvec::smallvec![plain])));
        }
        if !kind.is(classes.bundle.bind(py)) {
            return Ok(None);
        }
        let tensors = value
            .getattr(intern!(py, "_tensors"))?
            .cast_into::<PyTuple>()?;
        let mut plains: Fields<Plain<'py>> = Fields::with_capacity(tensors.len());
        let mut pointers: Fields<u64> = Fields::with_capacity(tensors.len());
        for tensor in tensors.iter() {
            let Some(plain) = self.plain(tensor)? else {
                return Ok(None);
            };
            // Fields sharing a storage keep sharing one in `to`'s copy: not this path.
            let pointer: u64 = plain
                .storage
                .call_method0(intern!(py, "data_ptr"))?
                .extract()?;
            if pointers.contains(&pointer) {
                return Ok(None);
            }
            pointers.push(pointer);
            plains.push(plain);
        }
        Ok((!plains.is_empty()).then_some((true, plains)))
    }

    /// `host_copy`'s checks (`fhelium.values.tensor_resident.host_copy`) of one tensor:
    /// a plain strided CPU tensor (or parameter), not quantized, contiguous from offset
    /// 0 over its whole, non-empty storage, without lazy conjugate or negative bits,
    /// with its storage and their bytes; ``None`` for any other tensor.
    fn plain<'py>(&self, tensor: Bound<'py, PyAny>) -> PyResult<Option<Plain<'py>>> {
        let py = tensor.py();
        let classes = &self.classes;
        let kind = tensor.get_type();
        if !(kind.is(classes.tensor.bind(py)) || kind.is(classes.parameter.bind(py))) {
            return Ok(None);
        }
        let layout = tensor.getattr(intern!(py, "layout"))?;
        let strided = classes.strided.bind(py);
        // torch hands out one object per layout: compared only where it is another.
        if (!layout.is(strided) && layout.ne(strided)?)
            || tensor.getattr(intern!(py, "is_quantized"))?.is_truthy()?
            || !tensor.getattr(intern!(py, "is_cpu"))?.is_truthy()?
            || tensor
                .call_method0(intern!(py, "storage_offset"))?
                .is_truthy()?
            || !tensor
                .call_method0(intern!(py, "is_contiguous"))?
                .is_truthy()?
        {
            return Ok(None);
        }
        let storage = tensor.call_method0(intern!(py, "untyped_storage"))?;
        let nbytes: u64 = storage.call_method0(intern!(py, "nbytes"))?.extract()?;
        let tensor_nbytes: u64 = tensor.getattr(intern!(py, "nbytes"))?.extract()?;
        if nbytes == 0 || tensor_nbytes != nbytes {
            return Ok(None);
        }
        // torch sets the lazy conjugate bit only on a complex tensor, and keeps it only
        // while its dtype is complex: a tensor of a dtype known not complex has none.
        let dtype = tensor.getattr(intern!(py, "dtype"))?;
        let real = classes.real_dtypes.iter().any(|known| dtype.is(known));
        if (!real && tensor.call_method0(intern!(py, "is_conj"))?.is_truthy()?)
            || tensor.call_method0(intern!(py, "is_neg"))?.is_truthy()?
        {
            return Ok(None);
        }
        Ok(Some(Plain {
            tensor,
            storage,
            nbytes,
        }))
    }

    /// The copy of a checked plain value (`plains`: a `ResidentTensor`, or with
    /// `bundle` a `TensorBundle` whose fields have storages of their own) to device
    /// `index` on `stream`: each field cloned as `to` copies it, the value rebuilt
    /// around the clones as `_with_resident_tensors` rebuilds it, registered
    /// (`register_copy`), logged, with its facts.
    #[allow(clippy::too_many_arguments)] // the copy's parts, as `copy_native` has them
    fn copy_plain<'py>(
        &self,
        value: &Bound<'py, PyAny>,
        bundle: bool,
        sources: &[Plain<'py>],
        target: Bound<'py, PyAny>,
        index: usize,
        stream: &Bound<'py, PyAny>,
        non_blocking: bool,
    ) -> PyResult<Copied<'py>> {
        let py = target.py();
        let classes = &self.classes;
        // As `to`: detached first where autograd could see the copy.
        let dual = !classes.dual_levels_known
            || classes
                .forward_ad
                .bind(py)
                .getattr(intern!(py, "_current_level"))?
                .extract::<i64>()?
                >= 0;
        let mut fields: Fields<Bound<'py, PyAny>> = Fields::with_capacity(sources.len());
        let mut storages: Fields<Bound<'py, PyAny>> = Fields::with_capacity(sources.len());
        let mut pointers: Fields<u64> = Fields::with_capacity(sources.len());
        let mut nbytes = 0;
        for source in sources {
            let requires_grad = source
                .tensor
                .getattr(intern!(py, "requires_grad"))?
                .is_truthy()?;
            let field = if requires_grad || dual {
                source.tensor.call_method0(intern!(py, "detach"))?
            } else {
                source.tensor.clone()
            }
            .call_method0(intern!(py, "clone"))?;
            if requires_grad {
                field.call_method1(intern!(py, "requires_grad_"), (true,))?;
            }
            let storage = field.call_method0(intern!(py, "untyped_storage"))?;
            pointers.push(storage.call_method0(intern!(py, "data_ptr"))?.extract()?);
            storages.push(storage);
            fields.push(field);
            nbytes += source.nbytes;
        }
        let copy = if bundle {
            // `_with_resident_tensors`: the names and index shared, the fields new.
            let copy = classes
                .object_new
                .bind(py)
                .call1(classes.bundle_args.bind(py))?;
            copy.setattr(intern!(py, "_index"), value.getattr(intern!(py, "_index"))?)?;
            copy.setattr(intern!(py, "_names"), value.getattr(intern!(py, "_names"))?)?;
            copy.setattr(intern!(py, "_tensors"), PyTuple::new(py, &fields)?)?;
            copy
        } else {
            let copy = classes
                .object_new
                .bind(py)
                .call1(classes.resident_args.bind(py))?;
            copy.setattr(intern!(py, "_tensor"), &fields[0])?;
            copy
        };
        let location = match self.cuda_locations.bind(py).get_item(index)? {
            location if !location.is_none() => location,
            _ => {
                let location = classes.cuda_location.bind(py).call1((&target,))?;
                self.cuda_locations.bind(py).set_item(index, &location)?;
                location
            }
        };
        let record = self.record_of(location, stream, non_blocking)?;
        self.register_copy(&storages, sources, &target, index, stream, &record)?;
        Ok(Copied {
            value: copy,
            device: target,
            index,
            nbytes,
            pointers,
        })
    }

    /// A named tuple of `class` built without its Python ``__new__`` frame.
    fn tuple_of<'py>(
        &self,
        class: &Bound<'py, PyAny>,
        items: &[Bound<'py, PyAny>],
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = class.py();
        self.classes
            .tuple_new
            .bind(py)
            .call1((class, PyTuple::new(py, items)?))
    }

    /// `StorageRegistry.register_copy`: under one hold of the lock, the freed taken
    /// out, the copy's read of its source and its allocation on `stream` in the reuse
    /// order (`ReuseOrder.copied`), its storage's entry counted on device `index`, and
    /// `record` logged.
    fn register_copy<'py>(
        &self,
        copies: &[Bound<'py, PyAny>],
        sources: &[Plain<'py>],
        target: &Bound<'py, PyAny>,
        index: usize,
        stream: &Bound<'py, PyAny>,
        record: &Bound<'py, PyAny>,
    ) -> PyResult<()> {
        let py = target.py();
        let storages = self.storages.get();
        // The sources' keys, where they are registered simulated device storages.
        let mut reads: Fields<u64> = Fields::new();
        for source in sources {
            if let Some(found) = storages.lookup(&source.storage)?
                && found.code >= 0
            {
                reads.push(found.key);
            }
        }
        let (_, handle) = self.stream_of(stream)?;
        let order = self.order.get();
        self.locked(py, || {
            self.drain(py)?;
            // The copy's reads of its sources and its allocation (`ReuseOrder.copied`).
            if let Some(hazards) = order.copied_native(stream, handle, &reads) {
                for (reader, nbytes) in hazards {
                    let hazard = self.classes.hazard.bind(py).call1((
                        target,
                        stream,
                        reader.into_object(),
                        nbytes,
                    ))?;
                    self.hazards.bind(py).append(hazard)?;
                }
            }
            let code = i64::try_from(index)?;
            for (storage, source) in copies.iter().zip(sources) {
                storages.add(storage, target, code, false, source.nbytes, Some(handle))?;
            }
            self.copies.bind(py).append(record)
        })
    }

    /// `StorageRegistry.drain_freed_locked`, with the lock held: the storages freed
    /// since the last call taken out of the registry and counters, and their readers
    /// given to their owners' pools.
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        self.storages
            .get()
            .drain_into(py, self.order.bind(py).get())
    }
}

/// A copy the seam made for the binding, with its facts: on the simulated device of
/// `index` (`device`), contiguous tensors each over a whole storage of its own, of
/// `nbytes` in all, at `pointers` in field order (`ValueFacts`: not pinned, `nbytes`
/// logical and storage bytes, a key per storage).
#[derive(Debug)]
pub struct Copied<'py> {
    pub value: Bound<'py, PyAny>,
    pub device: Bound<'py, PyAny>,
    pub index: usize,
    pub nbytes: u64,
    pub pointers: Fields<u64>,
}

/// A value's fields, or what each of them gives: most values have one, none is on
/// the heap for it.
pub type Fields<T> = smallvec::SmallVec<[T; 2]>;

/// A plain tensor's tensor, storage and bytes (`SimulatedSeam::plain`).
struct Plain<'py> {
    tensor: Bound<'py, PyAny>,
    storage: Bound<'py, PyAny>,
    nbytes: u64,
}

/// Registers the seam's and the registry's classes in the extension module.
pub fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<SimulatedSeam>()?;
    module.add_class::<SimulatedStorages>()?;
    module.add_class::<ReuseOrder>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_bytes_are_whole_blocks() {
        assert_eq!(reserved_nbytes(0), 0);
        assert_eq!(reserved_nbytes(1), 512);
        assert_eq!(reserved_nbytes(512), 512);
        assert_eq!(reserved_nbytes(513), 1024);
    }
}
