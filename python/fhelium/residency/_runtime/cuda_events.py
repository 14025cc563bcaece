"""Lease release events through cuda-python (`cuda.bindings`): timing-free, pooled.

A lease release records one event per consumer stream and the manager polls them;
events are created without timing (cheaper to record and query) and returned to a
per-device pool once the manager lets go of a completed one, so steady-state
releases create no CUDA objects.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Final

__all__ = ["CudaEvent", "CudaEventPool", "cuda_bindings_available"]

try:  # cuda-python is a declared dependency, but a broken install must not break imports.
    from cuda.bindings import runtime as _cudart
except Exception:  # pragma: no cover - exercised only where cuda-python is unusable
    _cudart = None

_POOL_LIMIT: Final = 256  # per device; beyond it completed events are destroyed


def cuda_bindings_available() -> bool:
    return _cudart is not None


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

    def __del__(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._pool._give_back(handle, self.device_index, completed=self._completed)

    def __repr__(self) -> str:
        state = "complete" if self._completed else "recorded"
        return f"CudaEvent(device={self.device_index}, {state})"


class CudaEventPool:
    """Per-device free lists of timing-free events, shared by every manager."""

    def __init__(self) -> None:
        self._free: dict[int, list[Any]] = {}
        self._lock = threading.Lock()

    def record(self, stream_handle: int, device_index: int) -> CudaEvent:
        """Records a (pooled or new) event on `stream_handle`; the caller has made
        `device_index` current."""
        with self._lock:
            free = self._free.get(device_index)
            handle = free.pop() if free else None
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
            with self._lock:
                free = self._free.setdefault(device_index, [])
                if len(free) < _POOL_LIMIT:
                    free.append(handle)
                    return
        # At interpreter exit CUDA may already be torn down; nothing is left to free.
        with contextlib.suppress(Exception):
            _cudart.cudaEventDestroy(handle)

    def pooled(self, device_index: int) -> int:
        """How many completed events wait for reuse on `device_index` (tests)."""
        with self._lock:
            return len(self._free.get(device_index, ()))
