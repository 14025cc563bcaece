//! `fhelium._core.Checksum`: the core's streaming XXH3-64 over Python buffers, hashed
//! with the interpreter released, so the disk tier can check bytes while they stream
//! (docs/concepts/locations-and-budgets.md#disk).

use std::sync::{Mutex, PoisonError};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use residency_core::checksum::{ALGORITHM, Checksum as CoreChecksum};

/// Runs `hash` over the bytes of `buffer` with the interpreter released, then
/// releases the buffer.
///
/// The one place in the crate that reads memory through a raw pointer: a detached
/// closure cannot hold the `Python` token that pyo3's safe (and copying) accessors need.
#[allow(unsafe_code)]
fn with_bytes_detached<R: Send>(
    py: Python<'_>,
    buffer: PyBuffer<u8>,
    hash: impl FnOnce(&[u8]) -> R + Send,
) -> PyResult<R> {
    let Some(pointer) = buffer.as_slice_ptr() else {
        return Err(PyValueError::new_err(
            "a checksum needs a C-contiguous buffer of bytes",
        ));
    };
    // SAFETY: `buffer` is a `PyBuffer<u8>`, a held buffer-protocol view: the exporter
    // is kept alive and its memory neither freed nor moved until the view is released,
    // which happens only at `drop(buffer)` below, after the last use of the slice.
    // `as_slice_ptr` returned `Some`, so the view is C-contiguous: `item_count` bytes
    // (`u8` has no alignment or validity requirement) from a non-null pointer. The
    // slice is only read. The disk tier hashes only memory that no other thread writes
    // meanwhile (buffers it has just read into, staging slots it owns).
    let bytes: &[u8] = unsafe { pointer.as_ref() };
    let result = py.detach(move || hash(bytes));
    drop(buffer); // releases the view (taking the interpreter briefly)
    Ok(result)
}

/// A streaming XXH3-64 checksum (see `residency_core::checksum`).
#[pyclass(frozen, module = "fhelium._core", name = "Checksum")]
#[derive(Debug)]
pub struct Checksum {
    state: Mutex<CoreChecksum>,
}

#[pymethods]
impl Checksum {
    #[new]
    fn new() -> Self {
        Self {
            state: Mutex::new(CoreChecksum::new()),
        }
    }

    /// The algorithm's name as files record it (`"xxh3-64"`).
    #[classattr]
    fn algorithm() -> &'static str {
        ALGORITHM
    }

    /// Adds the bytes of `data` (a C-contiguous buffer of `uint8`/`B` items), hashed
    /// with the interpreter released.
    fn update(&self, py: Python<'_>, data: PyBuffer<u8>) -> PyResult<()> {
        let state = &self.state;
        with_bytes_detached(py, data, |bytes| {
            state
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .update(bytes);
        })
    }

    /// The checksum of every byte added so far.
    fn digest(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .digest()
    }

    /// `digest` as 16 lowercase hexadecimal digits.
    fn hexdigest(&self) -> String {
        format!("{:016x}", self.digest())
    }
}

/// The XXH3-64 checksum of the bytes of `data`, hashed with the interpreter released.
#[pyfunction]
pub fn checksum(py: Python<'_>, data: PyBuffer<u8>) -> PyResult<u64> {
    with_bytes_detached(py, data, residency_core::checksum::checksum)
}
