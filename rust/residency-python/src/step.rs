//! A staged pipeline step's entry in one call, and its leases as one object
//! (docs/concepts/controller.md#steps): what `enter_step` admits, a lease per
//! location, without a lease object each. The
//! step's use reads its values here and releases them here; the rules are the
//! leases' own (docs/concepts/lifetimes.md#leases): a CUDA lease's release records an
//! event on its consumer stream, a host lease's ends at once, and a step never
//! released is finalized as a lease is (released safely, with a `ResourceWarning`),
//! when it is collected or at exit, never in a forked child.

use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple, PyWeakrefReference};
use residency_core::{HandleId, Location};

use crate::kinds::LifetimeKind;
use crate::lifetimes;
use crate::manager::{CoreManager, StateView};
use crate::search::PolicyKeys;

pyo3::import_exception!(fhelium.errors, ResidencyLifetimeClosedError);

/// One location's lease of a step.
#[derive(Debug)]
pub(crate) struct Borrow {
    /// The lease's token.
    pub token: u64,
    /// The location's code.
    pub at: Location,
    /// The location object.
    pub location: Py<PyAny>,
    /// The borrowed handles, normalised (in order, duplicates collapsed).
    pub handles: Py<PyTuple>,
    /// Their indices, in the same order.
    pub indices: Vec<HandleId>,
    /// The consumer streams a CUDA lease's release records events on (empty for a
    /// host lease); the finalizer reads this very list.
    pub streams: Py<PyList>,
    /// Not yet released.
    pub active: bool,
}

impl Borrow {
    /// What its release or lookup needs.
    fn taken(&self, py: Python<'_>) -> Taken {
        Taken {
            token: self.token,
            at: self.at,
            location: self.location.clone_ref(py),
            streams: self.streams.clone_ref(py),
        }
    }

    /// The index of `handle` when it is the very object of one of the handles.
    fn index_of(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> Option<HandleId> {
        let handles = self.handles.bind(py);
        let found = handles.iter().position(|candidate| candidate.is(handle))?;
        self.indices.get(found).copied()
    }
}

/// A staged step's leases, one per location of its request in order of first
/// appearance (the use's groups); built by `CoreManager.enter_step`.
#[pyclass(frozen, weakref, module = "fhelium._core", name = "StepEntry")]
#[derive(Debug)]
pub struct StepEntry {
    manager: Py<CoreManager>,
    engine: Py<PyAny>,
    borrows: Mutex<Vec<Borrow>>,
}

/// What one borrow's release or lookup needs, read under the entry's lock.
struct Taken {
    token: u64,
    at: Location,
    location: Py<PyAny>,
    streams: Py<PyList>,
}

impl StepEntry {
    fn borrows(&self) -> MutexGuard<'_, Vec<Borrow>> {
        self.borrows.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The entry for `borrows` (taken out of the vector once it is built), tracked by
    /// its manager under each lease's token until released, so that at exit it is
    /// finalized as live leases are. On an error `borrows` is left as it was.
    pub(crate) fn track(
        owner: &Bound<'_, CoreManager>,
        engine: &Bound<'_, PyAny>,
        borrows: &mut Vec<Borrow>,
    ) -> PyResult<Py<StepEntry>> {
        let py = owner.py();
        let entry = Bound::new(
            py,
            StepEntry {
                manager: owner.clone().unbind(),
                engine: engine.clone().unbind(),
                borrows: Mutex::new(Vec::new()),
            },
        )?;
        let reference = PyWeakrefReference::new(&entry)?.into_any().unbind();
        let manager = owner.get();
        for borrow in borrows.iter() {
            manager.keep_lease(borrow.token, reference.clone_ref(py));
        }
        *entry.get().borrows() = std::mem::take(borrows);
        Ok(entry.unbind())
    }

    /// The borrow at `position` if still active, else the closed lease's error.
    fn active(&self, py: Python<'_>, position: usize) -> PyResult<Taken> {
        let borrows = self.borrows();
        let Some(borrow) = borrows.get(position) else {
            return Err(PyIndexError::new_err(format!(
                "no lease at position {position} of this step"
            )));
        };
        if !borrow.active {
            let count = borrow.handles.bind(py).len();
            let location = borrow.location.clone_ref(py);
            drop(borrows);
            let location = location.bind(py).str()?;
            return Err(ResidencyLifetimeClosedError::new_err(format!(
                "this lease of {count} value(s) at {location} was released"
            )));
        }
        Ok(borrow.taken(py))
    }

    /// The active borrows, last first (a use unwinds its leases in that order).
    fn active_last_first(&self, py: Python<'_>) -> Vec<(usize, Taken)> {
        let borrows = self.borrows();
        borrows
            .iter()
            .enumerate()
            .rev()
            .filter(|(_, borrow)| borrow.active)
            .map(|(position, borrow)| (position, borrow.taken(py)))
            .collect()
    }

    fn mark_released(&self, position: usize) {
        if let Some(borrow) = self.borrows().get_mut(position) {
            borrow.active = false;
        }
    }

    /// A lease's release (`ResidencyLease.release`, or as finalizers release with
    /// `finalizing`): a CUDA one records its events, a host one ends at once when the
    /// gate is free, else waits or is queued.
    fn release_one(
        &self,
        py: Python<'_>,
        taken: &Taken,
        finalizing: bool,
        stacklevel: i32,
    ) -> PyResult<()> {
        let manager = self.manager.get();
        if taken.at.is_cuda() {
            return manager.release_lease(
                py,
                taken.token,
                taken.location.bind(py),
                taken.streams.bind(py),
                false,
                finalizing,
                stacklevel,
            );
        }
        if !finalizing && manager.release_now(LifetimeKind::Lease, taken.token) {
            return Ok(()); // (released at once, and untracked with it)
        }
        manager.release(py, LifetimeKind::Lease, taken.token, finalizing)
    }

    /// Finalizes what is still active, as a collected lease is: nothing in a forked
    /// child (the leases are the parent's), else each released safely, with a
    /// `ResourceWarning` (`fhelium.residency.lease.finalize_lease`).
    fn finalize(&self, py: Python<'_>) -> PyResult<()> {
        let manager = self.manager.get();
        if manager.core().check_process().is_err() {
            return Ok(());
        }
        let mut error: Option<PyErr> = None;
        for (position, taken) in self.active_last_first(py) {
            self.mark_released(position);
            manager.forget_lease(taken.token);
            let finalized = lifetimes::finalize_lease(
                py,
                self.engine.bind(py),
                taken.token,
                taken.location.bind(py),
                taken.streams.bind(py).as_any(),
            );
            if let Err(failure) = finalized {
                error.get_or_insert(failure);
            }
        }
        error.map_or(Ok(()), Err)
    }
}

#[pymethods]
impl StepEntry {
    /// The value of `handle`, one of the handles of the lease at `position`.
    ///
    /// Raises `ResidencyLifetimeClosedError` once that lease was released, and the
    /// lookup's error when it no longer borrows the value (after a forced close).
    fn value(
        &self,
        py: Python<'_>,
        position: usize,
        handle: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let taken = self.active(py, position)?;
        // The request's own handle object, as a requirement holds it: its index is
        // known. Any other (an equal handle) is resolved.
        let known = (self.borrows().get(position)).and_then(|borrow| borrow.index_of(py, handle));
        let location = taken.location.bind(py);
        lifetimes::borrowed_known(
            self.manager.get(),
            py,
            taken.token,
            handle,
            location,
            known.map(|index| (index, taken.at)),
        )
    }

    /// The value of `handle` at `at` when both are the very objects of one of its
    /// leases (a requirement's, as the use's request holds them), else `None`. Raises
    /// as `value` does.
    fn lookup(
        &self,
        py: Python<'_>,
        handle: &Bound<'_, PyAny>,
        at: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Py<PyAny>>> {
        let found = {
            let borrows = self.borrows();
            borrows.iter().enumerate().find_map(|(position, borrow)| {
                if !borrow.location.bind(py).is(at) {
                    return None;
                }
                Some((position, borrow.index_of(py, handle)?))
            })
        };
        let Some((position, index)) = found else {
            return Ok(None);
        };
        let taken = self.active(py, position)?;
        lifetimes::borrowed_known(
            self.manager.get(),
            py,
            taken.token,
            handle,
            at,
            Some((index, taken.at)),
        )
        .map(Some)
    }

    /// Raises `ResidencyLifetimeClosedError` once the lease at `position` was released.
    fn check(&self, py: Python<'_>, position: usize) -> PyResult<()> {
        self.active(py, position).map(drop)
    }

    /// Registers another stream reading the values of the CUDA lease at `position`,
    /// as `ResidencyLease.add_consumer_stream` does: the release records an event on
    /// it too, and a value still being copied in is ordered before it.
    fn add_consumer_stream(
        &self,
        py: Python<'_>,
        position: usize,
        stream: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let taken = self.active(py, position)?;
        let location = taken.location.bind(py);
        if !taken.at.is_cuda() {
            return Err(PyValueError::new_err(format!(
                "consumer streams apply to CUDA leases, not {}",
                location.str()?
            )));
        }
        let manager = self.manager.get();
        let bound = manager
            .context()
            .check_stream(py, stream, location, taken.at)?;
        let streams = taken.streams.bind(py);
        if streams.iter().any(|known| known.is(&bound)) {
            return Ok(());
        }
        let handles = {
            let borrows = self.borrows();
            borrows
                .get(position)
                .map(|borrow| borrow.handles.clone_ref(py))
        };
        if let Some(handles) = handles {
            manager.wait_transfers(py, handles.bind(py).as_any(), location, &bound)?;
        }
        streams.append(bound)
    }

    /// Releases every lease still active, last first, as a use's exit releases its
    /// leases (`wait=False`); a lease whose release raises stays active, the others
    /// are released all the same, and the error is raised at the end (the last one,
    /// with the earlier ones as its context, as a use's exit chains them).
    #[pyo3(signature = (stacklevel=2))]
    fn release(&self, py: Python<'_>, stacklevel: i32) -> PyResult<()> {
        let mut error: Option<PyErr> = None;
        for (position, taken) in self.active_last_first(py) {
            match self.release_one(py, &taken, false, stacklevel) {
                Ok(()) => self.mark_released(position),
                Err(failure) => {
                    if let Some(previous) = error.take() {
                        failure
                            .value(py)
                            .setattr(intern!(py, "__context__"), previous.value(py))?;
                    }
                    error = Some(failure);
                }
            }
        }
        error.map_or(Ok(()), Err)
    }

    /// `release` as a use's exit callback: `(exc_type, exc, traceback)`, never
    /// suppressing.
    fn exit(
        &self,
        py: Python<'_>,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _traceback: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.release(py, 3).map(|()| false)
    }

    /// Releases as finalizers do, without their warning: queued while this thread
    /// cannot enter the manager (docs/concepts/lifetimes.md#deferred-releases). The
    /// first error propagates.
    fn release_deferred(&self, py: Python<'_>) -> PyResult<()> {
        for (position, taken) in self.active_last_first(py) {
            self.release_one(py, &taken, true, 2)?;
            self.mark_released(position);
        }
        Ok(())
    }

    /// At exit: what is still active is finalized as a live lease is.
    fn _abandon(&self, py: Python<'_>) -> PyResult<()> {
        self.finalize(py)
    }
}

impl Drop for StepEntry {
    fn drop(&mut self) {
        let borrows = self
            .borrows
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if !borrows.iter().any(|borrow| borrow.active) {
            return;
        }
        Python::attach(|py| {
            if let Err(error) = self.finalize(py) {
                error.write_unraisable(py, None);
            }
        });
    }
}

/// A staged pipeline step's entry, under one hold of the gate after reaping
/// (docs/concepts/controller.md#steps): the state its decision describes (its version
/// and books; no value record), then a lease
/// per group `(location, handles)` of `groups` (the handles normalised; a CUDA one read
/// on `consumers[location]`), with nothing in between. Then the staging's `holds` go,
/// whether or not the leases were taken: on a failure the leases already taken are
/// released first, and the error propagates. Returns the view, the leases as one
/// [`StepEntry`] and what their CUDA leases leave protected once released: each one's
/// token and those of the transfers still in flight into its values.
pub fn enter_step(
    manager: &Bound<'_, CoreManager>,
    py: Python<'_>,
    engine: &Bound<'_, PyAny>,
    groups: &Bound<'_, PyTuple>,
    consumers: &Bound<'_, PyDict>,
    holds_list: &Bound<'_, PyList>,
    keys: Option<&PolicyKeys>,
) -> PyResult<(StateView, Py<StepEntry>, Vec<u64>)> {
    let owner = manager;
    let manager = owner.get();
    // The holds are this call's from here on, taken out of the caller's list before
    // anything can be interrupted: it releases them, whatever happens.
    let holds: Vec<u64> = holds_list.extract()?;
    holds_list.del_slice(0, holds_list.len())?;
    let mut released = false;
    let entered = manager.with_gate(py, true, true, || {
        let host = lifetimes::Host::new(manager, py);
        let core = manager.core();
        let mut borrows: Vec<Borrow> = Vec::with_capacity(groups.len());
        let mut protecting: Vec<u64> = Vec::new();
        let taken = (|| {
            core.reap_with(&host)?;
            // The decision reads the version and the books alone: a view of those
            // keeps no value record shared, so the step's changes copy none.
            let view = StateView {
                state: core.current_books(),
            };
            for group in groups.iter() {
                let group = group.cast_into::<PyTuple>()?;
                let at = group.get_item(0)?;
                let handles = manager
                    .context()
                    .normalized_handles(py, &group.get_item(1)?)?;
                let stream = consumer_stream(consumers, &at)?;
                let (admitted, streams) =
                    lifetimes::admit_locked(manager, &host, &handles, &at, stream.as_ref(), false)?;
                if stream.is_some() {
                    protecting.push(admitted.token);
                    protecting.extend(admitted.transfers);
                }
                borrows.push(Borrow {
                    token: admitted.token,
                    at: admitted.at,
                    location: at.unbind(),
                    handles: handles.unbind(),
                    indices: admitted.indices,
                    streams: streams.unbind(),
                    active: true,
                });
            }
            Ok(view)
        })();
        let taken = match taken {
            Ok(view) => StepEntry::track(owner, engine, &mut borrows).map(|entry| {
                // The use's access record, once its leases are all taken: a built-in
                // policy's epochs (docs/concepts/controller.md#access-epochs).
                if let Some(keys) = keys {
                    let borrows = entry.get().borrows();
                    keys.record_use(
                        borrows
                            .iter()
                            .flat_map(|borrow| borrow.indices.iter().copied()),
                    );
                }
                (view, entry, protecting)
            }),
            Err(error) => Err(error),
        };
        // Nothing of a failed entry stays: its leases go as they came (no consumer
        // has read them, so no event is needed).
        for borrow in borrows {
            core.release_lease(borrow.token);
        }
        for &token in &holds {
            core.release_hold(token);
        }
        released = true;
        taken
    });
    if !released {
        // The gate refused the entry (a closed manager, a forked child, a callback
        // running): the holds go the usual way, queued or refused as that path says.
        // The entry's refusal is the error raised; one of a release refused for the
        // same reason is its consequence, noted on it.
        for &token in &holds {
            if let (Err(refused), Err(entry)) = (
                manager.release(py, LifetimeKind::Hold, token, false),
                &entered,
            ) {
                entry.add_note(
                    py,
                    format!("the staging's hold was not released: {refused}"),
                )?;
            }
        }
    }
    entered
}

/// `consumers[at]` (None where absent), found first by identity: a pipeline's consumer
/// streams are keyed by the locations its requests name, so the key is most often the
/// very object, found without hashing it (a location's hash is a Python call).
fn consumer_stream<'py>(
    consumers: &Bound<'py, PyDict>,
    at: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    if consumers.len() <= 4 {
        for (key, stream) in consumers.iter() {
            if key.is(at) {
                return Ok(Some(stream));
            }
        }
    }
    consumers.get_item(at)
}
