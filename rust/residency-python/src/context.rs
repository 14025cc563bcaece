//! What the engine hands over once, when a manager is made: the classes the binding
//! recognises, the record builders, the runtime, the shared location records, and
//! the checks of locations and streams with what they remember.

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};
use residency_core::tables::{CallTable, Recent};
use residency_core::{ActionKind, CudaDevices, Location, LocationKind, Refusal};
use residency_sim::SimulatedSeam;

use crate::errors::{refuse, to_py_err};
use crate::kinds::kind_of;
use crate::records::RecordBuilder;

/// What the engine hands over once: the classes it recognises, the report builder,
/// the runtime, and the shared records and strings reports carry.
#[derive(Debug)]
pub struct Context {
    /// The action record classes and their kinds, in `ActionKind::ALL` order, and the
    /// builders of the records of `ensure`, `move` and `drop` called directly.
    actions: [(Py<PyAny>, ActionKind, Option<Py<RecordBuilder>>); 4],
    /// Builds transition reports without running Python code.
    pub(crate) report: Py<RecordBuilder>,
    pub(crate) runtime: Py<PyAny>,
    /// The runtime measures with torch directly, so this crate can too.
    pub(crate) native_measure: bool,
    /// The runtime gives a CUDA copy's facts with the copy (`copy_to_cuda_measured`,
    /// an optional capability of the seam, docs/architecture.md#the-device-seam).
    pub(crate) measured_copies: bool,
    /// A `SimulatedRuntime`'s native seam calls, which the copies, events and samples
    /// take first (docs/concepts/simulation.md#native-calls).
    pub(crate) seam: Option<Py<SimulatedSeam>>,
    pub(crate) pinning_possible: bool,
    /// Shared location records by code; `location_of` builds the others.
    pub(crate) pageable: Py<PyAny>,
    pub(crate) pinned: Py<PyAny>,
    pub(crate) location_of: Py<PyAny>,
    /// The manager's disk tier (`fhelium.residency._disk.DiskTier`) and the glue's
    /// numbering of disk directories (`_locations.disk_code`).
    pub(crate) disk: Py<PyAny>,
    pub(crate) disk_code: Py<PyAny>,
    /// The reason text of each kind's no-op report (`ActionKind::no_op_reason`),
    /// converted once.
    no_op_reasons: Vec<(ActionKind, Py<PyAny>)>,
    /// The options of a copy to a device, by `non_blocking` (false, true): built once,
    /// never changed, so every copy passes the same mapping.
    copy_options: [Py<PyDict>; 2],
    /// The process-wide integer key of a value type.
    pub(crate) type_key: Py<PyAny>,
    /// Builds an adopted value's spec record: `(type, logical, charge, mode, recoverability)`.
    pub(crate) spec_builder: Py<PyAny>,
    pub(crate) must_preserve: Py<PyAny>,
    /// Builds a lease: `(engine, token, handles, location, consumer_streams)`.
    pub(crate) new_lease: Py<PyAny>,
    pub(crate) exclusive: Py<PyAny>,
    /// CUDA devices the runtime reports (0 without CUDA).
    pub(crate) cuda_count: u32,
    /// Builds a hold: `(engine, token, handles, location)`.
    pub(crate) new_hold: Py<PyAny>,
    /// Builds a reservation: `(engine, token, location, nbytes, label)`.
    pub(crate) new_reservation: Py<PyAny>,
    /// Normalises a `handles` argument into a tuple of distinct handles.
    pub(crate) normalize_handles: Py<PyAny>,
    pub(crate) handle_class: Py<PyAny>,
    /// Streams already checked, with their location: a stream never changes device,
    /// so one checked again is not asked about twice.
    pub(crate) checked_streams: Recent<CheckedStream>,
    /// CUDA location records already checked (records are immutable), and the shared
    /// record of each CUDA code.
    pub(crate) checked_cuda: Recent<(Py<PyAny>, Location)>,
    /// With the device each shared CUDA record names (`None` for a disk record).
    pub(crate) shared_cuda: Recent<SharedRecord>,
    /// Action records `run_direct` built, reused for the same call: records are
    /// immutable, so an equal record may be shared (docs/concepts/transitions.md#reports),
    /// and a kept record holds its arguments alive, so an address in a key stays its own.
    pub(crate) direct_actions: CallTable<Py<PyAny>>,
}

/// The shared record of a location code, and the device a CUDA one names.
type SharedRecord = (Location, Py<PyAny>, Option<Py<PyAny>>);

/// A stream checked for a location, and the stream the runtime binds it to there.
type CheckedStream = (Py<PyAny>, Location, Py<PyAny>);

/// How many checked streams, and CUDA location records, a manager remembers.
const REMEMBERED: usize = 8;

impl Context {
    /// From the engine's tuple: `(ensure, move, drop, discard, report_builder,
    /// runtime, native_measure, pinning_possible, pageable, pinned, location_of,
    /// type_key, spec_builder, must_preserve, new_lease, exclusive, cuda_count,
    /// new_hold, new_reservation, normalize_handles, handle_class, (ensure, move, drop
    /// action builders), disk, disk_code)`.
    pub fn from_tuple(items: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let item = |index: usize| items.get_item(index).map(Bound::unbind);
        let builder = |index: usize, position: usize| -> PyResult<Py<RecordBuilder>> {
            Ok(items
                .get_item(index)?
                .cast::<PyTuple>()?
                .get_item(position)?
                .cast::<RecordBuilder>()?
                .clone()
                .unbind())
        };
        let py = items.py();
        let options = |non_blocking: bool| -> PyResult<Py<PyDict>> {
            let options = PyDict::new(py);
            options.set_item(intern!(py, "non_blocking"), non_blocking)?;
            Ok(options.unbind())
        };
        let [ensure, move_, drop, discard] = ActionKind::ALL;
        Ok(Self {
            actions: [
                (item(0)?, ensure, Some(builder(21, 0)?)),
                (item(1)?, move_, Some(builder(21, 1)?)),
                (item(2)?, drop, Some(builder(21, 2)?)),
                (item(3)?, discard, None),
            ],
            report: items.get_item(4)?.cast::<RecordBuilder>()?.clone().unbind(),
            runtime: item(5)?,
            native_measure: items.get_item(6)?.extract()?,
            measured_copies: items
                .get_item(5)?
                .hasattr(intern!(items.py(), "copy_to_cuda_measured"))?,
            seam: SimulatedSeam::of(&items.get_item(5)?)?.map(Bound::unbind),
            pinning_possible: items.get_item(7)?.extract()?,
            pageable: item(8)?,
            pinned: item(9)?,
            location_of: item(10)?,
            no_op_reasons: ActionKind::ALL
                .into_iter()
                .filter_map(|kind| {
                    let reason = kind.no_op_reason()?;
                    Some((kind, PyString::new(py, reason).into_any().unbind()))
                })
                .collect(),
            copy_options: [options(false)?, options(true)?],
            type_key: item(11)?,
            spec_builder: item(12)?,
            must_preserve: item(13)?,
            new_lease: item(14)?,
            exclusive: item(15)?,
            cuda_count: items.get_item(16)?.extract()?,
            new_hold: item(17)?,
            new_reservation: item(18)?,
            normalize_handles: item(19)?,
            handle_class: item(20)?,
            disk: item(22)?,
            disk_code: item(23)?,
            direct_actions: CallTable::default(),
            checked_streams: Recent::new(REMEMBERED),
            checked_cuda: Recent::new(REMEMBERED),
            shared_cuda: Recent::new(REMEMBERED),
        })
    }

    /// The kind of an action record: by exact class first, then as a subclass of one
    /// of the four.
    pub(crate) fn action_kind(&self, action: &Bound<'_, PyAny>) -> PyResult<ActionKind> {
        let py = action.py();
        let classes = self
            .actions
            .each_ref()
            .map(|(class, kind, _)| (class.bind(py), *kind));
        kind_of(action, &classes)
    }

    /// The class of the records `ensure`, `move` or `drop` called directly make, and
    /// their builder (`None` for a discard, which is no direct call).
    pub(crate) fn direct_class(&self, kind: ActionKind) -> Option<(&Py<PyAny>, &RecordBuilder)> {
        self.actions
            .iter()
            .find(|(_, known, _)| *known == kind)
            .and_then(|(class, _, builder)| Some((class, builder.as_ref()?.get())))
    }

    /// The reason a no-op transition of `kind` reports.
    pub(crate) fn no_op_reason(&self, py: Python<'_>, kind: ActionKind) -> Option<Py<PyAny>> {
        self.no_op_reasons
            .iter()
            .find(|(known, _)| *known == kind)
            .map(|(_, reason)| reason.clone_ref(py))
    }

    /// The keyword options of a copy to a device (the runtime's `copy_to_cuda`).
    pub(crate) fn copy_options<'py>(
        &self,
        py: Python<'py>,
        non_blocking: bool,
    ) -> &Bound<'py, PyDict> {
        self.copy_options[usize::from(non_blocking)].bind(py)
    }

    /// The builder of transition report records.
    pub(crate) fn report_builder<'py>(&'py self, _py: Python<'py>) -> &'py RecordBuilder {
        self.report.get()
    }

    pub(crate) fn type_key(&self, py: Python<'_>, value_type: &Bound<'_, PyAny>) -> PyResult<u64> {
        self.type_key.bind(py).call1((value_type,))?.extract()
    }

    pub(crate) fn adopted_spec(
        &self,
        py: Python<'_>,
        value_type: &Bound<'_, PyAny>,
        logical: u64,
        charge: u64,
        replica_mode: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        Ok(self
            .spec_builder
            .bind(py)
            .call1((
                value_type,
                logical,
                charge,
                replica_mode,
                self.must_preserve.bind(py),
            ))?
            .unbind())
    }

    pub(crate) fn is_exclusive(&self, replica_mode: &Bound<'_, PyAny>) -> bool {
        replica_mode.is(&self.exclusive)
    }

    pub(crate) fn is_must_preserve(&self, recoverability: &Bound<'_, PyAny>) -> bool {
        recoverability.is(&self.must_preserve)
    }

    /// A non-empty tuple of distinct handles, first occurrences kept; the common
    /// single-handle tuple is taken as it is.
    pub(crate) fn normalized_handles<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        if let Ok(tuple) = handles.cast_exact::<PyTuple>()
            && tuple.len() == 1
            && tuple.get_item(0)?.get_type().is(&self.handle_class)
        {
            return Ok(tuple.clone());
        }
        Ok(self
            .normalize_handles
            .bind(py)
            .call1((handles,))?
            .cast_into::<PyTuple>()?)
    }

    pub(crate) fn runtime<'py>(&self, py: Python<'py>) -> &Bound<'py, PyAny> {
        self.runtime.bind(py)
    }

    /// The runtime's native seam calls, if it is a `SimulatedRuntime` with them.
    pub(crate) fn seam(&self) -> Option<&SimulatedSeam> {
        self.seam.as_ref().map(Py::get)
    }

    pub(crate) fn cuda_count(&self) -> u32 {
        self.cuda_count
    }

    /// The code of a location record: a `TypeError` for anything else, a
    /// `ValueError` for a CUDA device this process cannot use
    /// (docs/concepts/locations-and-budgets.md).
    pub(crate) fn location_code(
        &self,
        py: Python<'_>,
        location: &Bound<'_, PyAny>,
    ) -> PyResult<Location> {
        if location.is(&self.pageable) {
            return Ok(Location::PageableHost);
        }
        if location.is(&self.pinned) {
            return Ok(Location::PinnedHost);
        }
        if let Some(known) = self
            .checked_cuda
            .find_map(|(record, known)| record.is(location).then_some(*known))
        {
            return Ok(known);
        }
        if !location.is_instance(&self.pageable.bind(py).get_type())? {
            return Err(refuse(
                py,
                Refusal::NotALocation {
                    got: &location.get_type().name()?.to_cow()?,
                },
            ));
        }
        let kind = location.getattr(intern!(py, "kind"))?;
        match LocationKind::named(kind.cast::<PyString>()?.to_str()?) {
            LocationKind::PageableHost => return Ok(Location::PageableHost),
            LocationKind::PinnedHost => return Ok(Location::PinnedHost),
            LocationKind::Disk => {
                let code: u32 = self.disk_code.bind(py).call1((location,))?.extract()?;
                let checked = Location::from_code(code).map_err(|err| to_py_err(py, err.into()))?;
                if let Location::Disk(index) = checked {
                    // Messages name the directory, as the record does.
                    residency_core::location::name_disk(index, &location.str()?.to_cow()?);
                }
                self.checked_cuda
                    .remember((location.clone().unbind(), checked));
                return Ok(checked);
            }
            LocationKind::Cuda => {}
        }
        let index: u32 = location
            .getattr(intern!(py, "device"))?
            .getattr(intern!(py, "index"))?
            .extract()?;
        CudaDevices::from_count(self.cuda_count)
            .check(location.str()?, index)
            .map_err(PyValueError::new_err)?;
        let checked = Location::cuda(index).map_err(|err| to_py_err(py, err.into()))?;
        self.checked_cuda
            .remember((location.clone().unbind(), checked));
        Ok(checked)
    }

    /// A transfer or consumer stream must be a CUDA stream on the location's device.
    pub(crate) fn check_stream<'py>(
        &self,
        py: Python<'py>,
        stream: &Bound<'py, PyAny>,
        location: &Bound<'py, PyAny>,
        at: Location,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some(bound) = self.checked_streams.find_map(|(known, known_at, bound)| {
            (known.is(stream) && *known_at == at).then(|| bound.clone_ref(py))
        }) {
            return Ok(bound.into_bound(py));
        }
        let runtime = self.runtime.bind(py);
        if !runtime
            .call_method1(intern!(py, "is_stream"), (stream,))?
            .is_truthy()?
        {
            return Err(refuse(
                py,
                Refusal::NotAStream {
                    got: &stream.get_type().name()?.to_cow()?,
                },
            ));
        }
        if !matches!(at, Location::Cuda(_)) {
            return Err(refuse(
                py,
                Refusal::StreamForHost {
                    location: &location.str()?.to_cow()?,
                },
            ));
        }
        let location_device = location.getattr(intern!(py, "device"))?;
        let device = runtime.call_method1(intern!(py, "stream_device"), (stream,))?;
        if device.ne(&location_device)? {
            return Err(refuse(
                py,
                Refusal::StreamOnOtherDevice {
                    device: &device.str()?.to_cow()?,
                    location: &location.str()?.to_cow()?,
                },
            ));
        }
        // The stream as the manager keeps it: a default-stream handle, which names the
        // current device's default stream, is fixed to this location's device here
        // (docs/concepts/lifetimes.md#consumer-streams).
        let bound = runtime.call_method1(intern!(py, "bind_stream"), (stream, &location_device))?;
        self.checked_streams
            .remember((stream.clone().unbind(), at, bound.clone().unbind()));
        Ok(bound)
    }

    /// Forgets the action records kept for direct calls (a value was discarded, or the
    /// manager closed), so no handle is held alive for reuse any longer.
    pub(crate) fn forget_direct_actions(&self) {
        self.direct_actions.clear();
    }

    /// The location record of a code.
    pub(crate) fn location<'py>(
        &self,
        py: Python<'py>,
        location: Location,
    ) -> PyResult<Bound<'py, PyAny>> {
        match location {
            Location::PageableHost => Ok(self.pageable.bind(py).clone()),
            Location::PinnedHost => Ok(self.pinned.bind(py).clone()),
            Location::Cuda(_) | Location::Disk(_) => Ok(self.shared(py, location)?.0),
        }
    }

    /// The device a CUDA location's shared record names.
    pub(crate) fn device<'py>(
        &self,
        py: Python<'py>,
        location: Location,
    ) -> PyResult<Bound<'py, PyAny>> {
        match self.shared(py, location)?.1 {
            Some(device) => Ok(device),
            None => self.location(py, location)?.getattr(intern!(py, "device")),
        }
    }

    /// The shared record of a CUDA or disk location, and the device a CUDA one names.
    fn shared<'py>(
        &self,
        py: Python<'py>,
        location: Location,
    ) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
        if let Some(known) = self.shared_cuda.find_map(|(known, record, device)| {
            (*known == location).then(|| {
                (
                    record.bind(py).clone(),
                    device.as_ref().map(|device| device.bind(py).clone()),
                )
            })
        }) {
            return Ok(known);
        }
        let record = self.location_of.bind(py).call1((location.code(),))?;
        let device = if location.is_cuda() {
            Some(record.getattr(intern!(py, "device"))?)
        } else {
            None
        };
        self.shared_cuda.remember((
            location,
            record.clone().unbind(),
            device.as_ref().map(|device| device.clone().unbind()),
        ));
        Ok((record, device))
    }
}
