"""The simulated runtime's storage registry: which storages are "on cuda:N" or "pinned".

Values stay ordinary CPU tensors; `StorageRegistry` records the storages the runtime's
own copies and buffers created, with their simulated device and pinning, keeps each
device's allocated and reserved bytes as they are registered and freed, and answers the
seam's questions about a value's placement from it. A storage it did not create reports
its real torch placement. Its data (the entries, the counters, the freed queue) is
native (`fhelium._core.SimulatedStorages`), shared with the runtime's native seam
calls (docs/concepts/simulation.md#native-calls). A device allocation checks the memory-reuse order
(docs/concepts/simulation.md#memory-reuse) and records a `SimulatedHazard`.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterable
from typing import Final, NamedTuple

import torch

from fhelium._core import SimulatedStorages
from fhelium.residency._runtime._reuse import ReuseOrder
from fhelium.residency._runtime.base import ValueFacts
from fhelium.residency._runtime.simulated_streams import SimulatedStream
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation, cuda_location
from fhelium.values.tensor_resident import TensorResident

__all__ = [
    "SimulatedHazard",
    "StorageRegistry",
    "empty_host",
    "page_aligned",
    "reserved_nbytes",
    "strided_clone",
]

# The CUDA caching allocator rounds every block up to 512 bytes; reserved bytes do the same
# so that reserved >= allocated holds the way it does on a real device.
_BLOCK: Final = 512

# A named tuple built without its Python ``__new__`` frame (every measurement is one).
_new_tuple: Final = tuple.__new__


class SimulatedHazard(NamedTuple):
    """A freed device block that an allocation may reuse while it is still read: a named tuple.

    Recorded in ``SimulatedRuntime.hazards`` (docs/concepts/simulation.md#memory-reuse).

    Attributes:
        device: The simulated device.
        stream: The stream that allocated, which owns the freed block.
        reader: A stream whose declared read of the block is not ordered before the
            allocation.
        nbytes: The freed block's bytes.
    """

    device: torch.device
    stream: SimulatedStream
    reader: SimulatedStream
    nbytes: int


class StorageRegistry:
    """The storages a `SimulatedRuntime` created, by storage identity, and the live
    simulated bytes of each device.

    Its entries, kept in ``native`` (`SimulatedStorages`), are weak references to the
    storages whose callback reports their death, so the per-device byte counters follow
    frees without a scan. torch keeps a storage's Python object alive for as long as the
    storage itself (as it does a tensor's), so the reference dies, and the callback runs,
    exactly when the storage is freed. A storage registered again replaces its entry and
    is counted once. An entry stays under its key (the address of the storage's Python
    object, which torch keeps while the storage lives) from its storage's death until
    the registry takes it out; meanwhile a new storage may be allocated at the same
    address, so a lookup by key is the storage's entry only when the entry refers to
    that very storage (`SimulatedStorages.find`).

    Methods named ``*_locked`` run with ``lock`` (the runtime's) held; the others take it
    where they change state. Lookups are lock-free.

    Args:
        lock: The runtime's lock.
        devices: The simulated CUDA devices.
        order: The runtime's memory-reuse order.
        hazards: The runtime's ``hazards`` list, which allocations append to.
    """

    __slots__ = ("_hazards", "_lock", "_order", "devices", "native")

    def __init__(
        self,
        lock: threading.Lock,
        devices: tuple[torch.device, ...],
        order: ReuseOrder,
        hazards: list[SimulatedHazard],
    ) -> None:
        self._lock = lock
        self._order = order
        self._hazards = hazards
        self.devices = devices
        # Live simulated CUDA bytes per device (by index), allocated and rounded up to the
        # allocator's block, kept as storages are registered and freed: an allocator
        # reading is O(1). A freed storage's entry lands in the freed queue (its weak
        # reference's callback, which may run on any thread, only appends) and leaves the
        # registry and the counters at the next registration or reading.
        self.native = SimulatedStorages(len(devices))

    @property
    def entries(self) -> dict[int, object]:
        """The entries under their keys (a snapshot): ``{key: weak reference}``."""
        return self.native.entries()

    # --- facts about values -----------------------------------------------------------
    def measure(self, value: TensorResident) -> ValueFacts:
        """A value's device, pinning and storage in one pass (`SimulatedRuntime.measure`)."""
        tensors = value._resident_tensors
        if len(tensors) == 1:
            # One tensor, one lookup: the same facts as the general pass below.
            (tensor,) = tensors
            storage = tensor.untyped_storage()
            found = self.native.find(storage)
            size = storage.nbytes()
            if found is not None:
                # The entry knows its device's code: no `device.type` read (a slow one).
                code = found[1]
                return _new_tuple(
                    ValueFacts,
                    (
                        found[0],
                        code,
                        bool(size) and code == -1 and found[2],
                        tensor.nbytes,
                        size,
                        [(code, storage.data_ptr())] if size else [],
                    ),
                )
            device = tensor.device
            pinned_here = device.type == "cpu" and tensor.is_pinned()
            code = -1 if device.type == "cpu" else (device.index or 0)
            return ValueFacts(
                device,
                code,
                bool(size) and code == -1 and pinned_here,
                tensor.nbytes,
                size,
                [(code, storage.data_ptr())] if size else [],
            )
        device = self.value_device(value)
        on_host = device.type == "cpu"
        code = -1 if on_host else (device.index or 0)
        pinning: set[bool] = set()
        logical = 0
        sizes: dict[int, int] = {}
        for tensor in value._resident_tensors:
            logical += tensor.nbytes
            storage = tensor.untyped_storage()
            size = storage.nbytes()
            if size and sizes.setdefault(storage.data_ptr(), size) != size:
                _ = value.storage_nbytes  # raises the documented RuntimeError
            if on_host and size:
                # Only memory can be pinned: an empty tensor is neither pinned nor
                # pageable, and an all-empty host value reads as pageable.
                pinning.add(self.facts(tensor)[1])
        pinned: bool | None = (True in pinning) if len(pinning) <= 1 else None
        return ValueFacts(
            device, code, pinned, logical, sum(sizes.values()), [(code, ptr) for ptr in sizes]
        )

    def is_pinned(self, value: TensorResident) -> bool:
        """Whether a host value is wholly in simulated pinned memory."""
        # Like TensorResident.is_pinned: the device check comes first and raises the same way.
        if self.value_device(value).type != "cpu":
            return False
        pinning = [
            self.facts(tensor)[1]
            for tensor in value._resident_tensors
            if tensor.untyped_storage().nbytes() > 0
        ]
        return bool(pinning) and all(pinning)

    def pinning_is_uniform(self, value: TensorResident) -> bool:
        """Whether a value's host tensors with storage are all pinned or all pageable."""
        pinning = set()
        for tensor in value._resident_tensors:
            device, pinned = self.facts(tensor)
            if device.type == "cpu" and tensor.untyped_storage().nbytes() > 0:
                pinning.add(pinned)
        return len(pinning) <= 1

    def storage_keys(self, value: TensorResident) -> frozenset[tuple[torch.device, int]]:
        """The ``(device, storage address)`` of every non-empty storage of a value."""
        keys: set[tuple[torch.device, int]] = set()
        for tensor in value._resident_tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:
                found = self.native.find(storage)
                device = tensor.device if found is None else found[0]
                keys.add((device, storage.data_ptr()))
        return frozenset(keys)

    def placement(self, value: TensorResident | torch.Tensor) -> ResidencyLocation:
        """Where a value (or one tensor) lives in the simulation, as a location."""
        tensors = (value,) if isinstance(value, torch.Tensor) else value._resident_tensors
        facts = {self.facts(tensor) for tensor in tensors}
        if len(facts) > 1:
            # Empty tensors have no memory to pin: the others decide between the hosts.
            with_storage = {
                self.facts(tensor) for tensor in tensors if tensor.untyped_storage().nbytes() > 0
            }
            if len({device for device, _ in facts}) == 1 and len(with_storage) == 1:
                facts = with_storage
        if not facts:
            raise RuntimeError(f"{type(value).__name__} has no tensor fields, so no placement")
        if len(facts) > 1:
            raise RuntimeError(
                f"{type(value).__name__} has mixed placements: {sorted(map(str, facts))}"
            )
        ((device, pinned),) = facts
        if device.type == "cuda":
            return cuda_location(device)
        if device.type != "cpu":
            raise RuntimeError(f"{device} is not a residency location")
        return PINNED_HOST if pinned else PAGEABLE_HOST

    def facts(self, tensor: torch.Tensor) -> tuple[torch.device, bool]:
        """(simulated device, simulated pinning) of one tensor."""
        found = self.native.find(tensor.untyped_storage())
        if found is not None:
            return found[0], found[2]
        device = tensor.device
        return device, device.type == "cpu" and tensor.is_pinned()

    def value_device(self, value: TensorResident) -> torch.device:
        tensors = value._resident_tensors
        if not tensors:
            raise RuntimeError(f"{type(value).__name__} has no tensor fields, so no device")
        device = self.facts(tensors[0])[0]
        for tensor in tensors[1:]:
            other = self.facts(tensor)[0]
            if other != device:
                raise RuntimeError(
                    f"{type(value).__name__} spans several devices ({device} and {other}); "
                    "every tensor field must share one device"
                )
        return device

    def device_storage_keys(self, tensors: Iterable[torch.Tensor]) -> list[int]:
        """The keys of the registered simulated device storages among ``tensors``'."""
        keys = []
        for tensor in tensors:
            storage = tensor.untyped_storage()
            found = self.native.find(storage)
            if found is not None and found[3]:
                keys.append(id(storage))
        return keys

    def bytes_by_device(self, value: TensorResident) -> dict[torch.device, int]:
        """The value's unique non-empty storage bytes, by simulated device."""
        by_device: dict[torch.device, int] = {}
        seen: set[int] = set()
        for tensor in value._resident_tensors:
            device = self.facts(tensor)[0]
            by_device.setdefault(device, 0)
            storage = tensor.untyped_storage()
            size = storage.nbytes()
            if size and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                by_device[device] += size
        return by_device

    # --- registration -------------------------------------------------------------------
    def register(
        self,
        tensors: Iterable[torch.Tensor],
        device: torch.device,
        *,
        pinned: bool,
        owner: SimulatedStream | None = None,
    ) -> None:
        with self._lock:
            self.register_locked(tensors, device, pinned=pinned, owner=owner)

    def register_locked(
        self,
        tensors: Iterable[torch.Tensor],
        device: torch.device,
        *,
        pinned: bool,
        owner: SimulatedStream | None = None,
    ) -> None:
        kind = device.type
        cuda = kind == "cuda"
        code = -1 if kind == "cpu" else (device.index or 0)
        self.drain_freed_locked()
        handle = None
        if owner is not None:
            # An allocation on `owner` may reuse any block freed to its pool.
            for reader, nbytes in self._order.check(owner):
                self._hazards.append(SimulatedHazard(device, owner, reader, nbytes))
            if cuda:
                handle = self._order.owner(owner)
        register = self.native.register
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if pinned and storage.nbytes() == 0:
                # As torch's pinned allocator: zero bytes get no pinned storage, so
                # an empty tensor stays a plain (pageable) CPU tensor.
                continue
            # The same storage again (a view of one already registered): the new entry
            # replaces it, and its bytes are counted once.
            register(storage, device, code, pinned, handle)

    def drain_freed_locked(self) -> None:
        """Takes the storages freed since the last call out of the registry and counters;
        the work is one step per storage freed, however many are alive."""
        # Their readers go to their owners' pools.
        self.native.drain(self._order)

    def sample(self, index: int) -> tuple[int, int]:
        """(allocated, reserved) bytes of the simulated device of index ``index``, after
        taking the freed out."""
        # `with self._lock`, spelled out: every transition reads.
        lock = self._lock
        lock.acquire()
        try:
            self.drain_freed_locked()
            return self.native.counters(index)
        finally:
            lock.release()


def reserved_nbytes(nbytes: int) -> int:
    """A storage's bytes as the simulated allocator reserves them: whole blocks."""
    return -(-nbytes // _BLOCK) * _BLOCK


def strided_clone(tensor: torch.Tensor) -> torch.Tensor:
    """A pageable host copy of one field that is not a plain strided tensor, with its
    ``requires_grad`` (`layout_copy`'s fallback for the simulated pinned copies)."""
    clone = tensor.to("cpu", copy=True)
    clone.requires_grad_(tensor.requires_grad)
    return clone


def empty_host(nbytes: int) -> torch.Tensor:
    """A new flat ``uint8`` host buffer (`layout_copy`'s allocation for simulated pinned
    copies: the registry, not the memory, makes them pinned)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def page_aligned(nbytes: int) -> torch.Tensor:
    """A flat ``uint8`` buffer at a page-aligned address, as pinned allocators hand out
    (``cudaHostAlloc`` maps whole pages); zero bytes get an empty tensor."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
