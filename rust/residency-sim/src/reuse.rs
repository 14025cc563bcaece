//! The simulated runtime's memory-reuse order, as native data
//! (docs/concepts/simulation.md#memory-reuse).
//!
//! Order between streams is tracked with vector clocks: each stream counts the work
//! enqueued on it, and knows, per other stream, how much of that stream's work it is
//! ordered after (through `wait_event`, or through the host having seen an event
//! complete before it enqueued). A freed device storage keeps its readers' positions
//! in the pool of the stream that allocated it; the next allocation on that stream
//! checks that every such reader is ordered before it. [`Order`] is the rule
//! (pyo3-free); [`ReuseOrder`] owns one for a runtime, whose methods are called under
//! the runtime's lock, and is what both its Python code and the native seam use.

use std::sync::{Mutex, PoisonError};

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet};
use pyo3::{PyTraverseError, PyVisit};
use residency_core::{FastMap, FastSet};

/// Per stream (by simulated handle): how many of its enqueued operations are covered.
pub type Clock = FastMap<i64, u64>;

/// A storage's readers (by handle, in the order they first read it): their last
/// positions.
type Readers = Vec<(i64, u64)>;

/// `into[stream] = max(into[stream], position)` for every stream of `other`.
fn merge(into: &mut Clock, other: impl IntoIterator<Item = (i64, u64)>) {
    for (stream, position) in other {
        let known = into.entry(stream).or_insert(0);
        if *known < position {
            *known = position;
        }
    }
}

/// Happens-before between simulated streams and the host, the readers of each live
/// device storage, and each stream's pool of freed blocks; `S` is what it keeps of a
/// reading stream, to name it in a hazard.
#[derive(Debug)]
pub struct Order<S> {
    seq: Clock,
    knows: FastMap<i64, Clock>,
    host: Clock,
    streams: FastMap<i64, S>,
    /// By storage key: the readers' last positions.
    readers: FastMap<u64, Readers>,
    /// By owning stream: freed blocks (readers, bytes) not yet seen ordered.
    pools: FastMap<i64, Vec<(Readers, u64)>>,
    /// The streams whose work, and what it is ordered after, the host has taken in
    /// (`drained`) since anything was last enqueued on them or they last waited.
    clean: FastSet<i64>,
}

impl<S> Default for Order<S> {
    fn default() -> Self {
        Self {
            seq: Clock::default(),
            knows: FastMap::default(),
            host: Clock::default(),
            streams: FastMap::default(),
            readers: FastMap::default(),
            pools: FastMap::default(),
            clean: FastSet::default(),
        }
    }
}

impl<S> Order<S> {
    /// What stream `handle` is ordered after now: work enqueued from here on also
    /// follows everything the host has seen complete.
    fn catch_up(&mut self, handle: i64) -> &mut Clock {
        let knows = self.knows.entry(handle).or_default();
        merge(knows, self.host.iter().map(|(&k, &v)| (k, v)));
        knows
    }

    /// One operation enqueued on stream `handle`; its position there. (What the stream
    /// is ordered after is brought up to date only where it is read: it only grows.)
    pub fn enqueue(&mut self, handle: i64) -> u64 {
        let position = self.seq.entry(handle).or_insert(0);
        *position += 1;
        let position = *position;
        self.clean.remove(&handle);
        position
    }

    /// An event recorded on stream `handle` now: everything enqueued there, and
    /// everything that is ordered before it.
    pub fn clock(&mut self, handle: i64) -> Clock {
        let mut clock = self.catch_up(handle).clone();
        clock.insert(handle, self.seq.get(&handle).copied().unwrap_or(0));
        clock
    }

    /// Stream `handle` waits for an event of `clock`.
    pub fn wait(&mut self, handle: i64, clock: impl IntoIterator<Item = (i64, u64)>) {
        merge(self.catch_up(handle), clock);
        self.clean.remove(&handle);
    }

    /// The host saw an event of `clock` complete.
    pub fn completed(&mut self, clock: impl IntoIterator<Item = (i64, u64)>) {
        merge(&mut self.host, clock);
    }

    /// Whether `drained` of stream `handle` would change nothing.
    pub fn is_clean(&self, handle: i64) -> bool {
        self.clean.contains(&handle)
    }

    /// The host waited for everything enqueued on stream `handle` (or saw an event
    /// recorded there now complete): `completed` of its `clock`, without building it.
    pub fn drained(&mut self, handle: i64) {
        if !self.clean.insert(handle) {
            return;
        }
        if let Some(knows) = self.knows.get(&handle) {
            merge(&mut self.host, knows.iter().map(|(&k, &v)| (k, v)));
        }
        let position = self.seq.get(&handle).copied().unwrap_or(0);
        merge(&mut self.host, [(handle, position)]);
    }

    /// Work enqueued on stream `handle` (kept as `stream`) now reads the storages
    /// `keys`.
    pub fn read(&mut self, handle: i64, stream: S, keys: impl IntoIterator<Item = u64>) {
        let position = self.enqueue(handle);
        self.streams.insert(handle, stream);
        for key in keys {
            self.note(key, handle, position);
        }
    }

    /// Reader `handle` read storage `key` at `position`.
    fn note(&mut self, key: u64, handle: i64, position: u64) {
        let readers = self.readers.entry(key).or_default();
        match readers.iter_mut().find(|(reader, _)| *reader == handle) {
            Some((_, last)) => *last = position,
            None => readers.push((handle, position)),
        }
    }

    /// A copy enqueued on stream `handle` now: it reads the device storage `source`
    /// (with the stream, kept; `None`: host memory, not tracked) and allocates on the
    /// stream. `read` (or `enqueue`) and `check` in one step: `check`'s hazards, `None`
    /// when no stream has a pool to check.
    pub fn copied(
        &mut self,
        handle: i64,
        sources: &[u64],
        stream: Option<S>,
    ) -> Option<Vec<(S, u64)>>
    where
        S: Clone,
    {
        let position = self.enqueue(handle);
        if let Some(stream) = stream {
            self.streams.insert(handle, stream);
            for &source in sources {
                self.note(source, handle, position);
            }
        }
        if self.pools.is_empty() {
            None
        } else {
            Some(self.check(handle))
        }
    }

    /// Whether any live storage has readers (else `freed` has nothing to do).
    pub fn has_readers(&self) -> bool {
        !self.readers.is_empty()
    }

    /// The device storage `key` of `nbytes`, allocated on stream `owner` (`None`:
    /// none), was freed: its readers go to that stream's pool.
    pub fn freed(&mut self, key: u64, nbytes: u64, owner: Option<i64>) {
        let Some(readers) = self.readers.remove(&key) else {
            return;
        };
        if let Some(owner) = owner
            && !readers.is_empty()
        {
            self.pools.entry(owner).or_default().push((readers, nbytes));
        }
    }

    /// An allocation on stream `handle`: empties its pool, returning `(reader, nbytes)`
    /// for each freed block with a reader not ordered before it.
    pub fn check(&mut self, handle: i64) -> Vec<(S, u64)>
    where
        S: Clone,
    {
        let Some(pool) = self.pools.remove(&handle) else {
            return Vec::new();
        };
        if pool.is_empty() {
            return Vec::new();
        }
        let knows = self.catch_up(handle).clone();
        let mut hazards = Vec::new();
        for (readers, nbytes) in pool {
            // In the readers' order: the first one not ordered before names the hazard.
            for (reader, position) in readers {
                if reader != handle && knows.get(&reader).copied().unwrap_or(0) < position {
                    if let Some(stream) = self.streams.get(&reader) {
                        hazards.push((stream.clone(), nbytes));
                    }
                    break;
                }
            }
        }
        hazards
    }

    /// The streams in `clean`.
    pub fn clean(&self) -> impl Iterator<Item = i64> + '_ {
        self.clean.iter().copied()
    }
}

/// A stream as the order keeps it: the stream object, for a hazard (reference counted,
/// so cloning is an increment).
#[derive(Debug)]
pub struct Stream(Py<PyAny>);

impl Clone for Stream {
    fn clone(&self) -> Self {
        Python::attach(|py| Self(self.0.clone_ref(py)))
    }
}

/// A runtime's memory-reuse order (see the module). Every method is called under the
/// runtime's lock; no Python code runs while its order is locked.
#[pyclass(module = "fhelium._core", frozen)]
#[derive(Debug, Default)]
pub struct ReuseOrder {
    order: Mutex<Order<Stream>>,
}

fn handle_of(stream: &Bound<'_, PyAny>) -> PyResult<i64> {
    stream.getattr(intern!(stream.py(), "_handle"))?.extract()
}

fn clock_of(clock: &Bound<'_, PyAny>) -> PyResult<Vec<(i64, u64)>> {
    if clock.is_none() {
        return Ok(Vec::new());
    }
    clock
        .cast::<PyDict>()?
        .iter()
        .map(|(k, v)| Ok((k.extract()?, v.extract()?)))
        .collect()
}

#[pymethods]
impl ReuseOrder {
    #[new]
    fn py_new() -> Self {
        Self::default()
    }

    // The streams it keeps refer to their runtime, which holds it: the collector sees
    // them (an order locked at that moment is skipped, which keeps it alive).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        let Ok(order) = self.order.try_lock() else {
            return Ok(());
        };
        for stream in order.streams.values() {
            visit.call(&stream.0)?;
        }
        Ok(())
    }

    fn __clear__(&self) {
        let streams = std::mem::take(&mut self.lock().streams);
        drop(streams);
    }

    /// One operation enqueued on ``stream``; its position there.
    fn enqueue(&self, stream: &Bound<'_, PyAny>) -> PyResult<u64> {
        let handle = handle_of(stream)?;
        Ok(self.lock().enqueue(handle))
    }

    /// An event recorded on ``stream`` now, as a clock (``{handle: position}``).
    fn clock<'py>(&self, stream: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
        let handle = handle_of(stream)?;
        let clock = self.lock().clock(handle);
        let out = PyDict::new(stream.py());
        for (stream, position) in clock {
            out.set_item(stream, position)?;
        }
        Ok(out)
    }

    /// ``stream`` waits for an event of ``clock`` (``None``: nothing to wait for).
    fn wait(&self, stream: &Bound<'_, PyAny>, clock: &Bound<'_, PyAny>) -> PyResult<()> {
        if clock.is_none() {
            return Ok(());
        }
        let handle = handle_of(stream)?;
        let clock = clock_of(clock)?;
        self.lock().wait(handle, clock);
        Ok(())
    }

    /// The host saw an event of ``clock`` complete (``None``: nothing to take in).
    fn completed(&self, clock: &Bound<'_, PyAny>) -> PyResult<()> {
        let clock = clock_of(clock)?;
        self.lock().completed(clock);
        Ok(())
    }

    /// The host waited for everything enqueued on ``stream``.
    fn drained(&self, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        let handle = handle_of(stream)?;
        self.lock().drained(handle);
        Ok(())
    }

    /// Whether `drained` of ``stream`` would change nothing (read without the lock).
    fn is_clean(&self, stream: &Bound<'_, PyAny>) -> PyResult<bool> {
        let handle = handle_of(stream)?;
        Ok(self.lock().is_clean(handle))
    }

    /// The handles of the streams `drained` would change nothing for, a snapshot.
    #[getter]
    fn clean<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PySet>> {
        let clean: Vec<i64> = self.lock().clean().collect();
        PySet::new(py, clean)
    }

    /// Work enqueued on ``stream`` now reads the storages ``keys``.
    fn read(&self, stream: &Bound<'_, PyAny>, keys: Vec<u64>) -> PyResult<()> {
        let handle = handle_of(stream)?;
        let kept = Stream(stream.clone().unbind());
        self.lock().read(handle, kept, keys);
        Ok(())
    }

    /// What `freed` takes for a storage allocated on ``stream``: its handle.
    #[staticmethod]
    fn owner(stream: &Bound<'_, PyAny>) -> PyResult<i64> {
        handle_of(stream)
    }

    /// A copy enqueued on ``stream`` now, reading device storage ``source`` (or
    /// ``None``): ``(owner, hazards or None)``.
    #[pyo3(signature = (stream, source))]
    fn copied<'py>(
        &self,
        stream: &Bound<'py, PyAny>,
        source: Option<u64>,
    ) -> PyResult<(i64, Option<Bound<'py, PyList>>)> {
        let handle = handle_of(stream)?;
        let hazards = self.copied_native(stream, handle, source.as_slice());
        Ok((
            handle,
            hazards
                .map(|found| hazards_list(stream.py(), found))
                .transpose()?,
        ))
    }

    /// Whether any live storage has readers.
    fn has_readers(&self) -> bool {
        self.lock().has_readers()
    }

    /// The device storage ``key`` of ``nbytes``, allocated by ``owner`` (or ``None``),
    /// was freed.
    #[pyo3(signature = (key, nbytes, owner))]
    fn freed(&self, key: u64, nbytes: u64, owner: Option<i64>) {
        self.lock().freed(key, nbytes, owner);
    }

    /// An allocation on ``stream``: ``[(reader, nbytes)]`` of the hazards.
    fn check<'py>(&self, stream: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let handle = handle_of(stream)?;
        let found = self.lock().check(handle);
        hazards_list(stream.py(), found)
    }
}

fn hazards_list(py: Python<'_>, found: Vec<(Stream, u64)>) -> PyResult<Bound<'_, PyList>> {
    let out = PyList::empty(py);
    for (stream, nbytes) in found {
        out.append((stream.0, nbytes))?;
    }
    Ok(out)
}

impl ReuseOrder {
    fn lock(&self) -> std::sync::MutexGuard<'_, Order<Stream>> {
        self.order.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `copied` of stream `handle`, for the seam: the hazards, if a pool was checked.
    pub fn copied_native(
        &self,
        stream: &Bound<'_, PyAny>,
        handle: i64,
        sources: &[u64],
    ) -> Option<Vec<(Stream, u64)>> {
        let stream = (!sources.is_empty()).then(|| Stream(stream.clone().unbind()));
        self.lock().copied(handle, sources, stream)
    }

    /// `drained` of stream `handle`, for the seam.
    pub fn drained_native(&self, handle: i64) {
        self.lock().drained(handle);
    }

    /// `is_clean` of stream `handle`, for the seam.
    pub fn is_clean_native(&self, handle: i64) -> bool {
        self.lock().is_clean(handle)
    }

    /// `freed`, for the seam, where any storage has readers.
    pub fn freed_native(&self, key: u64, nbytes: u64, owner: Option<i64>) {
        self.lock().freed(key, nbytes, owner);
    }
}

impl Stream {
    /// The stream object.
    pub fn into_object(self) -> Py<PyAny> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_reused_while_its_reader_is_unordered_is_a_hazard() {
        let mut order: Order<&str> = Order::default();
        // Stream 1 copies from storage 7, allocated by stream 2; 7 is freed.
        order.read(1, "one", [7]);
        order.freed(7, 512, Some(2));
        assert_eq!(order.copied(2, &[], None), Some(vec![("one", 512)]));
        // The pool was emptied: the next allocation finds nothing.
        assert_eq!(order.check(2), Vec::new());
    }

    #[test]
    fn a_wait_or_a_drain_orders_the_reuse() {
        let mut order: Order<&str> = Order::default();
        order.read(1, "one", [7]);
        let clock = order.clock(1);
        order.freed(7, 512, Some(2));
        order.wait(2, clock);
        assert_eq!(order.check(2), Vec::new());

        order.read(1, "one", [8]);
        order.freed(8, 512, Some(2));
        assert!(!order.is_clean(1));
        order.drained(1);
        assert!(order.is_clean(1));
        assert_eq!(order.check(2), Vec::new());
        // Work enqueued again: no longer clean.
        order.enqueue(1);
        assert!(!order.is_clean(1));
    }

    #[test]
    fn a_storage_freed_without_readers_goes_to_no_pool() {
        let mut order: Order<&str> = Order::default();
        order.freed(9, 512, Some(2));
        assert!(!order.has_readers());
        assert_eq!(order.copied(2, &[], None), None);
    }
}
