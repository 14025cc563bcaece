"""The base of `SimulatedRuntime`: its simulated devices and the instrumentation of its calls.

`SimulatedDevices` holds what every other part of the simulation builds on: the
``device_count`` simulated CUDA devices, each thread's current device
(docs/concepts/simulation.md#current-device-and-default-streams), the lock that guards
the simulation's state, and the counting (``calls``) and fault injection (`fail_next`)
of every seam method (docs/concepts/simulation.md#instrumentation).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import threading
from collections import _count_elements  # type: ignore[attr-defined]
from collections.abc import Iterator
from typing import Final

import torch

from fhelium.residency._runtime.base import DeviceRuntime

__all__ = ["SimulatedDevices"]

# Every method of the seam, i.e. what `calls` counts and `fail_next` accepts. Derived from the
# Protocol so that a method added there is instrumented here without a second list to forget.
_SEAM_METHODS: Final = frozenset(
    name
    for name, member in vars(DeviceRuntime).items()
    if not name.startswith("_") and inspect.isfunction(member)
)


class _Fault:
    __slots__ = ("exc", "remaining")

    def __init__(self, exc: BaseException | type[BaseException], remaining: int) -> None:
        self.exc = exc
        self.remaining = remaining


class SimulatedDevices:
    """Simulated CUDA devices ``cuda:0`` up, each thread's current one, and the counting
    and fault injection of seam calls: the base of `SimulatedRuntime`.

    Args:
        device_count: How many simulated CUDA devices (an int >= 0, checked by the caller).
    """

    def __init__(self, device_count: int) -> None:
        self._device_count = device_count
        self._devices = tuple(torch.device("cuda", index) for index in range(device_count))
        self._indices = {device: index for index, device in enumerate(self._devices)}
        self._lock = threading.Lock()
        self._faults: dict[str, collections.deque[_Fault]] = {}
        # Each thread's current device (0 until changed).
        self._current = threading.local()
        self.calls: collections.Counter[str] = collections.Counter()

    # --- instrumentation ------------------------------------------------------------
    def fail_next(
        self,
        method_name: str,
        exc: BaseException | type[BaseException] | None = None,
        count: int = 1,
    ) -> None:
        """Make the next ``count`` calls of seam method ``method_name`` raise ``exc``.

        ``exc`` may be an instance (re-raised each time) or a class (instantiated with a message
        each time); it defaults to `RuntimeError`. Successive calls for one method queue up in
        order. The failing call is still counted in ``calls``. See
        docs/concepts/simulation.md#instrumentation.

        Args:
            method_name: A seam method's name, such as ``"copy_to_cuda"``.
            exc: The exception instance or class, or ``None`` for `RuntimeError`.
            count: How many calls fail (an int >= 1).

        Raises:
            ValueError: An unknown seam method, or ``count < 1``.
            TypeError: ``count`` is not an int, or ``exc`` is neither an exception instance nor
                an exception class.
        """
        if method_name not in _SEAM_METHODS:
            raise ValueError(
                f"{method_name!r} is not a seam method; expected one of {sorted(_SEAM_METHODS)}"
            )
        if not isinstance(count, int) or isinstance(count, bool):
            raise TypeError(f"count must be an int, got {type(count).__name__}")
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if exc is None:
            exc = RuntimeError
        elif not isinstance(exc, BaseException) and not (
            isinstance(exc, type) and issubclass(exc, BaseException)
        ):
            raise TypeError(f"exc must be an exception or exception class, got {exc!r}")
        with self._lock:
            self._faults.setdefault(method_name, collections.deque()).append(_Fault(exc, count))

    def clear_faults(self) -> None:
        """Drop every pending injected failure."""
        with self._lock:
            self._faults.clear()

    def _enter(self, name: str) -> None:
        """Count a seam call and raise an injected failure if one is due."""
        if not self._faults:
            # The common case: counting only. The C counting helper updates the Counter
            # without running Python code in between, so counts stay exact under threads.
            _count_elements(self.calls, (name,))
            return
        with self._lock:
            _count_elements(self.calls, (name,))
            queue = self._faults.get(name)
            if not queue:
                return
            fault = queue[0]
            fault.remaining -= 1
            if fault.remaining == 0:
                queue.popleft()
                if not queue:
                    del self._faults[name]
        exc = fault.exc
        if isinstance(exc, BaseException):
            # Re-raising one instance would otherwise grow its traceback on every call.
            raise exc.with_traceback(None)
        raise exc(f"injected failure in SimulatedRuntime.{name}")

    # --- availability -------------------------------------------------------------
    def cuda_available(self) -> bool:
        """Whether CUDA is available: true when ``device_count > 0``.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Returns:
            Whether any simulated device exists.

        Raises:
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("cuda_available")
        return self._device_count > 0

    def device_count(self) -> int:
        """Return the number of simulated CUDA devices.

        A seam method the manager calls: counted in `calls`, fault-injectable with `fail_next`.

        Returns:
            The ``device_count`` given at construction.

        Raises:
            Exception: The failure queued by `fail_next` for this method, if any.
        """
        self._enter("device_count")
        return self._device_count

    # --- test helpers (not counted, never fault-injected) ---------------------------
    def current_device(self) -> int:
        """Return the calling thread's current simulated CUDA device (0 until `set_device`).

        Returns:
            The device index.
        """
        return int(getattr(self._current, "index", 0))

    def set_device(self, device: torch.device | str | int) -> None:
        """Make ``device`` the calling thread's current simulated CUDA device.

        Default-stream handles then name its stream.

        Args:
            device: A simulated CUDA device (a device, ``"cuda:N"`` or an index).

        Raises:
            ValueError: A device the runtime does not simulate.
        """
        self._current.index = self._cuda_index(device)

    @contextlib.contextmanager
    def device_guard(self, device: torch.device | str | int) -> Iterator[None]:
        """Make ``device`` the calling thread's current device for a ``with`` block.

        The previous current device comes back when the block ends, as with
        ``torch.cuda.device(device)``.

        Args:
            device: A simulated CUDA device (a device, ``"cuda:N"`` or an index).

        Yields:
            Nothing.

        Raises:
            ValueError: A device the runtime does not simulate.
        """
        index = self._cuda_index(device)
        previous = self.current_device()
        self._current.index = index
        try:
            yield
        finally:
            self._current.index = previous

    def _cuda_index(self, device: torch.device | str | int) -> int:
        """The index of the simulated CUDA device named by ``device`` (else ``ValueError``)."""
        if type(device) is torch.device:
            known = self._device_index(device)
            if known is not None:
                return known
        try:
            normalized = (
                torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            )
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"{device!r} is not a simulated CUDA device") from exc
        index = self._device_index(normalized)
        if index is None:
            raise ValueError(
                f"{normalized} is not a simulated CUDA device "
                f"(this runtime has {self._device_count})"
            )
        return index

    def _cuda_device(self, device: torch.device | str | int) -> torch.device:
        return self._devices[self._cuda_index(device)]

    def _device_index(self, device: torch.device) -> int | None:
        if not isinstance(device, torch.device):
            return None
        # A simulated device (or an equal one) by lookup: reading `device.type` is slow.
        known = self._indices.get(device)
        if known is not None:
            return known
        if device.type != "cuda":
            return None
        # An unindexed "cuda" means the current device, which the simulation fixes at 0.
        index = 0 if device.index is None else device.index
        return index if index < self._device_count else None
