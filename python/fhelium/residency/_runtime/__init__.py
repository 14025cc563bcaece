"""The device seam and the process-wide choice of runtime.

Managers capture `current_runtime()` when they are constructed. The default is one shared
`TorchCudaRuntime`; any other runtime is installed explicitly with `set_runtime` or
`use_runtime`, never picked silently.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from fhelium.residency._runtime.base import DeviceRuntime, StorageKey, ValueFacts
from fhelium.residency._runtime.simulated import SimulatedCopy, SimulatedRuntime
from fhelium.residency._runtime.simulated_storage import SimulatedHazard
from fhelium.residency._runtime.simulated_streams import SimulatedEvent, SimulatedStream
from fhelium.residency._runtime.timeline import Timeline, TimelineSpan
from fhelium.residency._runtime.torch_runtime import TorchCudaRuntime

__all__ = [
    "DeviceRuntime",
    "SimulatedCopy",
    "SimulatedEvent",
    "SimulatedHazard",
    "SimulatedRuntime",
    "SimulatedStream",
    "StorageKey",
    "Timeline",
    "TimelineSpan",
    "TorchCudaRuntime",
    "ValueFacts",
    "current_runtime",
    "set_runtime",
    "use_runtime",
]

_DEFAULT_RUNTIME = TorchCudaRuntime()


class _Slot:
    """The installed runtime; a holder object rather than a rebound module global."""

    __slots__ = ("runtime",)

    def __init__(self) -> None:
        self.runtime: DeviceRuntime | None = None


# Writers take the lock so that a swap and the capture of what it replaced are one step;
# readers need not, as reading one attribute is atomic.
# In a one-slot list (no `global`) so a forked child can start with a free one.
_lock = [threading.Lock()]
_slot = _Slot()


def _unlock_in_child() -> None:
    # A lock another thread held at a fork stays held in the child, which has no such
    # thread: the child starts with a free one (docs/concepts/lifetimes.md#fork).
    _lock[0] = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_child)


def current_runtime() -> DeviceRuntime:
    """Return the installed runtime, or the process-wide `TorchCudaRuntime` when none is.

    A manager calls it once, at construction. See docs/concepts/simulation.md#installing-it.

    Returns:
        The runtime new managers capture.
    """
    installed = _slot.runtime
    return _DEFAULT_RUNTIME if installed is None else installed


def set_runtime(runtime: DeviceRuntime | None) -> DeviceRuntime | None:
    """Install ``runtime`` process-wide until further notice, and return the previous one.

    The previous value is what was installed, ``None`` when the default was in effect, so
    ``set_runtime(previous)`` restores the exact earlier state. Managers that already exist
    keep the runtime they captured. See docs/concepts/simulation.md#installing-it.

    Args:
        runtime: A device runtime, such as a `SimulatedRuntime`; ``None`` goes back to the
            default CUDA runtime.

    Returns:
        The previously installed runtime, or ``None``.

    Raises:
        TypeError: ``runtime`` does not implement the device runtime protocol.

    Example:
        ```python
        from fhelium.residency.simulation import SimulatedRuntime, current_runtime, set_runtime

        previous = set_runtime(SimulatedRuntime(device_count=1))
        try:
            assert current_runtime().name == "simulated"
        finally:
            set_runtime(previous)
        ```
    """
    if runtime is not None and not isinstance(runtime, DeviceRuntime):
        raise TypeError(f"runtime must implement DeviceRuntime, got {type(runtime).__name__}")
    with _lock[0]:
        previous = _slot.runtime
        _slot.runtime = runtime
    return previous


@contextmanager
def use_runtime(runtime: DeviceRuntime) -> Iterator[DeviceRuntime]:
    """Install ``runtime`` process-wide for a ``with`` block, then restore the previous one.

    Nested blocks restore in LIFO order. The installation is process-wide, not per thread:
    blocks on several threads that overlap without nesting restore in whatever order they
    exit. Managers built inside the block keep the runtime after it ends. See
    docs/concepts/simulation.md#installing-it.

    Args:
        runtime: A device runtime, such as a `SimulatedRuntime`.

    Yields:
        ``runtime`` itself.

    Raises:
        TypeError: ``runtime`` does not implement the device runtime protocol.

    Example:
        ```python
        import torch
        from fhelium.residency import ResidencyManager, cuda_location
        from fhelium.residency.simulation import SimulatedRuntime, use_runtime
        from fhelium.values import ResidentTensor

        with use_runtime(SimulatedRuntime(device_count=1)) as runtime:
            manager = ResidencyManager()  # captures the simulated runtime
        handle = manager.adopt(ResidentTensor(torch.ones(4)))
        manager.move(handle, cuda_location("cuda:0"))  # still simulated
        manager.close()
        ```
    """
    if not isinstance(runtime, DeviceRuntime):
        raise TypeError(f"runtime must implement DeviceRuntime, got {type(runtime).__name__}")
    previous = set_runtime(runtime)
    try:
        yield runtime
    finally:
        set_runtime(previous)
