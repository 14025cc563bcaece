"""The fake cuda-python runtime over a `SimulatedRuntime`, for the release events.

``fhelium.residency._runtime.cuda_events`` drives CUDA events through cuda-python's
``cuda.bindings.runtime``; a simulated runtime hands it `SimulatedCudart` instead, so
the same event code runs on the simulated streams
(docs/concepts/simulation.md#current-device-and-default-streams).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable

from fhelium.residency._runtime.simulated_streams import SimulatedEvent, SimulatedStream

__all__ = ["CudaError", "SimulatedCudart"]


class CudaError(enum.IntEnum):
    """The ``cudaError_t`` codes `SimulatedCudart` answers."""

    cudaSuccess = 0
    cudaErrorInvalidResourceHandle = 400
    cudaErrorNotReady = 600


class SimulatedCudart:
    """The slice of ``cuda.bindings.runtime`` that the release events use
    (``fhelium.residency._runtime.cuda_events``), over a `SimulatedRuntime`'s streams and
    events, with the raw-handle semantics of the CUDA runtime
    (docs/concepts/simulation.md#current-device-and-default-streams):

    - a stream handle of 0, 1 or 2 names the default stream of the calling thread's
      *current* device, whichever device's default stream the caller had in mind;
      any other handle names the stream created with it;
    - an event belongs to the device current when it was created, and recording it on
      a stream of another device fails with ``cudaErrorInvalidResourceHandle``;
    - a stream may wait for an event of any device.

    Calls return tuples headed by a ``cudaError_t``, as cuda-python's do. They are not
    counted in ``calls``; waits are logged in the runtime's ``waits``.
    """

    cudaError_t = CudaError
    cudaEventDisableTiming = 2

    def __init__(
        self,
        current_device: Callable[[], int],
        stream: Callable[[int], SimulatedStream | None],
        record: Callable[[SimulatedStream], SimulatedEvent],
        query: Callable[[SimulatedEvent], bool],
        wait: Callable[[SimulatedStream, SimulatedEvent], None],
    ) -> None:
        # The runtime's own steps, uncounted: the calling thread's current device, the
        # stream a raw handle names (a default-stream handle: the current device's), and
        # recording, querying and waiting for an event.
        self._current_device = current_device
        self._stream = stream
        self._record = record
        self._query = query
        self._wait = wait
        self._handles = itertools.count(1)
        # Live event handles: (device index at creation, the last recorded event).
        self._events: dict[int, tuple[int, SimulatedEvent | None]] = {}

    def cudaEventCreateWithFlags(self, flags: int) -> tuple[CudaError, int]:
        handle = next(self._handles)
        self._events[handle] = (self._current_device(), None)
        return CudaError.cudaSuccess, handle

    def cudaEventRecord(self, event: int, stream: int) -> tuple[CudaError]:
        known = self._events.get(event)
        resolved = self._stream(stream)
        if known is None or resolved is None or resolved.device_index != known[0]:
            return (CudaError.cudaErrorInvalidResourceHandle,)
        self._events[event] = (known[0], self._record(resolved))
        return (CudaError.cudaSuccess,)

    def cudaEventQuery(self, event: int) -> tuple[CudaError]:
        known = self._events.get(event)
        if known is None:
            return (CudaError.cudaErrorInvalidResourceHandle,)
        recorded = known[1]
        done = recorded is None or self._query(recorded)
        return (CudaError.cudaSuccess if done else CudaError.cudaErrorNotReady,)

    def cudaEventSynchronize(self, event: int) -> tuple[CudaError]:
        known = self._events.get(event)
        if known is None:
            return (CudaError.cudaErrorInvalidResourceHandle,)
        if known[1] is not None:
            known[1].complete()
        return (CudaError.cudaSuccess,)

    def cudaStreamWaitEvent(self, stream: int, event: int, flags: int) -> tuple[CudaError]:
        known = self._events.get(event)
        resolved = self._stream(stream)
        if known is None or resolved is None:
            return (CudaError.cudaErrorInvalidResourceHandle,)
        if known[1] is not None:
            self._wait(resolved, known[1])
        return (CudaError.cudaSuccess,)

    def cudaEventDestroy(self, event: int) -> tuple[CudaError]:
        if self._events.pop(event, None) is None:
            return (CudaError.cudaErrorInvalidResourceHandle,)
        return (CudaError.cudaSuccess,)
