"""Lease release events through cuda-python (`cuda.bindings`): timing-free, pooled.

A lease release records one event per consumer stream and the manager polls them;
events are created without timing (cheaper to record and query) and returned to a
per-device pool once the manager lets go of a completed one, so steady-state
releases create no CUDA objects.

Importing cuda-python is not enough to use it: cuda-bindings 13 needs a CUDA 13 driver
and answers every call with `cudaErrorInsufficientDriver` on an older one. So
`cuda_bindings_available()` probes the driver once per process, the first time it is
asked (never at import, which must not initialise CUDA), and the runtime falls back to
`torch.cuda.Event` when the probe fails.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from typing import Any, Final

import torch

__all__ = ["CudaEvent", "CudaEventPool", "cuda_bindings_available"]

try:  # cuda-python is a declared dependency, but a broken install must not break imports.
    from cuda.bindings import runtime as _cudart
except Exception:  # pragma: no cover - exercised only where cuda-python is unusable
    _cudart = None

_POOL_LIMIT: Final = 256  # per device; beyond it completed events are destroyed
_LEGACY_DEFAULT_STREAM: Final = 0

# The probe's answer, in a one-slot list (no `global`): None until the first
# `cuda_bindings_available()` call. Reentrant lock: the probe calls into torch, whose
# allocations can run the garbage collector, and a lease finalized there records its
# release event, which asks again on the same thread (and probes again, harmlessly).
_probe_lock: Final = [threading.RLock()]
_probe_answer: Final[list[bool | None]] = [None]


def _unlock_in_child() -> None:
    # A lock another thread held at a fork stays held in the child, which has no such
    # thread: the child starts with a free one (docs/concepts/lifetimes.md#fork).
    _probe_lock[0] = threading.RLock()


os.register_at_fork(after_in_child=_unlock_in_child)


def cuda_bindings_available() -> bool:
    """Whether release events go through cuda-python: it imported and the driver works.

    Probed once per process, on first use; any failure answers False."""
    result = _probe_answer[0]
    if result is None:
        with _probe_lock[0]:
            result = _probe_answer[0]
            if result is None:
                result = _probe_answer[0] = _probe(_cudart)
    return result


def _reset_probe() -> None:
    """Forgets the probe's answer, so the next `cuda_bindings_available()` probes again (tests)."""
    with _probe_lock[0]:
        _probe_answer[0] = None


def _probe(cudart: Any) -> bool:
    """Creates, records, queries and destroys one event on torch's current device."""
    if cudart is None:
        return False
    try:
        if not torch.cuda.is_available():
            return False
        # `current_device()` initialises torch's CUDA first, so the probe runs in the
        # primary context torch uses, on the device it has current.
        with torch.cuda.device(torch.cuda.current_device()):
            return _probe_event(cudart)
    except Exception:
        return False


def _probe_event(cudart: Any) -> bool:
    errors = cudart.cudaError_t
    error, handle = cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming)
    if error != errors.cudaSuccess:
        return False
    try:
        (error,) = cudart.cudaEventRecord(handle, _LEGACY_DEFAULT_STREAM)
        if error != errors.cudaSuccess:
            return False
        # Queried, not synchronized: the legacy default stream waits for whatever torch
        # queued on it, and not-ready proves the driver answers as well as done does.
        (error,) = cudart.cudaEventQuery(handle)
        if error not in (errors.cudaSuccess, errors.cudaErrorNotReady):
            return False
    finally:
        (destroyed,) = cudart.cudaEventDestroy(handle)
    return bool(destroyed == errors.cudaSuccess)


def _check(result: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    error = result[0]
    if error != _cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what} failed: {error!r}")
    return result[1:]


class CudaEvent:
    """One recorded event. The pool takes it back when the last reference goes."""

    __slots__ = ("_completed", "_handle", "_pool", "device_index")

    def __init__(self, pool: CudaEventPool, handle: Any, device_index: int) -> None:
        self._pool = pool
        self._handle = handle
        self.device_index = device_index
        self._completed = False

    def query(self) -> bool:
        if self._completed:
            return True
        (error,) = _cudart.cudaEventQuery(self._handle)
        if error == _cudart.cudaError_t.cudaSuccess:
            self._completed = True
            return True
        if error == _cudart.cudaError_t.cudaErrorNotReady:
            return False
        raise RuntimeError(f"cudaEventQuery failed: {error!r}")

    def synchronize(self) -> None:
        if not self._completed:
            _check(_cudart.cudaEventSynchronize(self._handle), "cudaEventSynchronize")
            self._completed = True

    def wait_on(self, stream_handle: int) -> None:
        """Makes the stream ``stream_handle`` wait for this event on the device."""
        if not self._completed:
            _check(
                _cudart.cudaStreamWaitEvent(stream_handle, self._handle, 0), "cudaStreamWaitEvent"
            )

    def __del__(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._pool._give_back(handle, self.device_index, completed=self._completed)

    def __repr__(self) -> str:
        state = "complete" if self._completed else "recorded"
        return f"CudaEvent(device={self.device_index}, {state})"


class CudaEventPool:
    """Per-device free lists of timing-free events, shared by every manager.

    Lock-free on purpose. Events come back from `CudaEvent.__del__`, which the garbage
    collector can run at any allocation, and from Python 3.12 at almost any bytecode,
    including inside a pool method on the same thread: a pool lock, even one held only
    around non-allocating code, could be taken again there and deadlock (a reentrant lock
    would instead let the finalizer see the free lists mid-update). So the free lists are
    `collections.deque`s, whose append and pop are atomic, and the dict holding them only
    sees atomic `get` and `setdefault` with int keys. The price: `_POOL_LIMIT` is a soft
    cap, which give-backs racing past the length check together can overshoot by one each.
    """

    def __init__(self) -> None:
        self._free: dict[int, collections.deque[Any]] = {}

    def record(self, stream_handle: int, device_index: int) -> CudaEvent:
        """Records a (pooled or new) event on `stream_handle`; the caller has made
        `device_index` current."""
        free = self._free.get(device_index)
        try:
            handle = free.pop() if free else None
        except IndexError:  # emptied since the check, by another thread
            handle = None
        if handle is None:
            (handle,) = _check(
                _cudart.cudaEventCreateWithFlags(_cudart.cudaEventDisableTiming),
                "cudaEventCreateWithFlags",
            )
        event = CudaEvent(self, handle, device_index)
        _check(_cudart.cudaEventRecord(handle, stream_handle), "cudaEventRecord")
        return event

    def _give_back(self, handle: Any, device_index: int, *, completed: bool) -> None:
        # Only an event known to be complete may be re-recorded; anything else is
        # destroyed, which CUDA defers until the event's work is done.
        if completed:
            free = self._free.get(device_index)
            if free is None:
                free = self._free.setdefault(device_index, collections.deque())
            if len(free) < _POOL_LIMIT:
                free.append(handle)
                return
        # At interpreter exit CUDA may already be torn down; nothing is left to free.
        with contextlib.suppress(Exception):
            _cudart.cudaEventDestroy(handle)

    def pooled(self, device_index: int) -> int:
        """How many completed events wait for reuse on `device_index` (tests)."""
        return len(self._free.get(device_index, ()))
