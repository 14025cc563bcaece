"""The simulated runtime's storage registry: which storages are "on cuda:N" or "pinned".

Values stay ordinary CPU tensors; `StorageRegistry` records the storages the runtime's
own copies and buffers created, with their simulated device and pinning, keeps each
device's allocated and reserved bytes as they are registered and freed, and answers the
seam's questions about a value's placement from it. A storage it did not create reports
its real torch placement. A device allocation checks the memory-reuse order
(docs/concepts/simulation.md#memory-reuse) and records a `SimulatedHazard`.
"""

from __future__ import annotations

import collections
import mmap
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Final, NamedTuple

import torch

from fhelium.residency._runtime._reuse import ReuseOrder
from fhelium.residency._runtime.base import ValueFacts
from fhelium.residency._runtime.simulated_streams import SimulatedStream
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation, cuda_location
from fhelium.values.tensor_resident import TensorResident

__all__ = [
    "SimulatedHazard",
    "StorageEntry",
    "StorageRegistry",
    "empty_host",
    "page_aligned",
    "reserved_nbytes",
    "strided_clone",
]

# The CUDA caching allocator rounds every block up to 512 bytes; reserved bytes do the same
# so that reserved >= allocated holds the way it does on a real device.
_BLOCK: Final = 512

_new_ref: Final = weakref.ref.__new__
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


class StorageEntry(weakref.ref[torch.UntypedStorage]):
    """Where one registered storage lives: a weak reference to the storage whose callback
    reports its death, so the per-device byte counters follow frees without a scan.

    torch keeps a storage's Python object alive for as long as the storage itself (as it
    does a tensor's), so the reference dies, and the callback runs, exactly when the
    storage is freed. ``counted`` is whether the entry's bytes are still in its device's
    counters: a storage registered again replaces its entry and is counted once. An
    entry stays in the registry, under its key (the storage's address), from its
    storage's death until the registry takes it out; meanwhile a new storage may be
    allocated at the same address, so a lookup by key is the storage's entry only when
    the entry refers to that very storage (`StorageRegistry.entry`).
    """

    __slots__ = (
        "code",
        "counted",
        "cuda",
        "device",
        "key",
        "nbytes",
        "owner",
        "pinned",
        "reserved",
    )

    # Plain attributes, set by `make` (see there).
    # -1 on the host, the CUDA index on a simulated device (`ValueFacts.device_code`).
    code: int
    counted: bool
    cuda: bool
    device: torch.device
    key: int
    nbytes: int
    # The handle of the stream that allocated it on a simulated device (whose pool its
    # block goes back to when freed, docs/concepts/simulation.md#memory-reuse), or None.
    owner: int | None
    pinned: bool
    reserved: int

    @classmethod
    def make(
        cls,
        storage: torch.UntypedStorage,
        callback: Callable[[StorageEntry], object],
        device: torch.device,
        pinned: bool,
        cuda: bool,
        code: int,
    ) -> StorageEntry:
        """The entry of ``storage`` on simulated ``device`` (``cuda``: whether it is a CUDA
        device, which the caller knows without reading ``device.type``, a slow property;
        ``code``: -1 on the host, else the device's index).

        Built field by field, without Python ``__new__``/``__init__`` frames: every
        simulated copy registers one.
        """
        entry = _new_ref(cls, storage, callback)
        entry.key = storage._cdata
        entry.device = device
        entry.code = code
        entry.pinned = pinned
        entry.cuda = cuda
        entry.nbytes = nbytes = storage.nbytes()
        # `reserved_nbytes`, inline.
        entry.reserved = -(-nbytes // _BLOCK) * _BLOCK
        entry.counted = False
        entry.owner = None
        return entry


class StorageRegistry:
    """The storages a `SimulatedRuntime` created, by storage identity, and the live
    simulated bytes of each device.

    Methods named ``*_locked`` run with ``lock`` (the runtime's) held; the others take it
    where they change state. Lookups are lock-free: dict lookups are atomic, and an entry
    found under a live storage's key is that storage's only if it refers to it (`entry`).

    Args:
        lock: The runtime's lock.
        devices: The simulated CUDA devices.
        order: The runtime's memory-reuse order.
        hazards: The runtime's ``hazards`` list, which allocations append to.
    """

    __slots__ = (
        "_hazards",
        "_lock",
        "_on_free",
        "_order",
        "allocated",
        "devices",
        "entries",
        "freed",
        "reserved",
    )

    def __init__(
        self,
        lock: threading.Lock,
        devices: tuple[torch.device, ...],
        order: ReuseOrder[SimulatedStream],
        hazards: list[SimulatedHazard],
    ) -> None:
        self._lock = lock
        self._order = order
        self._hazards = hazards
        self.devices = devices
        self.entries: dict[int, StorageEntry] = {}
        # Live simulated CUDA bytes per device, allocated and rounded up to the allocator's
        # block, kept as storages are registered and freed: an allocator reading is O(1).
        # A freed storage's entry lands in `freed` (its weak reference's callback, which
        # may run on any thread, only appends) and leaves the registry and the counters
        # at the next registration or reading.
        # By device index: hashing a `torch.device` is slow, and a copy updates both twice.
        self.allocated: list[int] = [0] * len(devices)
        self.reserved: list[int] = [0] * len(devices)
        self.freed: collections.deque[StorageEntry] = collections.deque()
        # Every entry's weak reference callback: one bound method, made once.
        self._on_free = self.freed.append

    # --- facts about values -----------------------------------------------------------
    def measure(self, value: TensorResident) -> ValueFacts:
        """A value's device, pinning and storage in one pass (`SimulatedRuntime.measure`)."""
        tensors = value._resident_tensors
        if len(tensors) == 1:
            # One tensor, one lookup: the same facts as the general pass below.
            (tensor,) = tensors
            storage = tensor.untyped_storage()
            # `entry`, inline.
            entry = self.entries.get(storage._cdata)
            size = storage.nbytes()
            if entry is not None and entry() is storage:
                # The entry knows its device's code: no `device.type` read (a slow one).
                code = entry.code
                return _new_tuple(
                    ValueFacts,
                    (
                        entry.device,
                        code,
                        bool(size) and code == -1 and entry.pinned,
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
                entry = self.entry(storage)
                device = tensor.device if entry is None else entry.device
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

    def entry(self, storage: torch.UntypedStorage) -> StorageEntry | None:
        """The entry of a live storage, if the runtime registered it. A lock-free read:
        dict lookups are atomic, and the entry found under the storage's key is its own
        only if it refers to it (another one is a dead storage's, not yet taken out)."""
        entry = self.entries.get(storage._cdata)
        return entry if entry is not None and entry() is storage else None

    def facts(self, tensor: torch.Tensor) -> tuple[torch.device, bool]:
        """(simulated device, simulated pinning) of one tensor."""
        # `entry`, inline.
        storage = tensor.untyped_storage()
        entry = self.entries.get(storage._cdata)
        if entry is not None and entry() is storage:
            return entry.device, entry.pinned
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
            # `entry`, inline.
            storage = tensor.untyped_storage()
            entry = self.entries.get(storage._cdata)
            if entry is not None and entry.cuda and entry() is storage:
                keys.append(entry.key)
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
        freed = self._on_free
        kind = device.type
        cuda = kind == "cuda"
        code = -1 if kind == "cpu" else (device.index or 0)
        self.drain_freed_locked()
        if owner is not None:
            # An allocation on `owner` may reuse any block freed to its pool.
            for reader, nbytes in self._order.check(owner):
                self._hazards.append(SimulatedHazard(device, owner, reader, nbytes))
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if pinned and storage.nbytes() == 0:
                # As torch's pinned allocator: zero bytes get no pinned storage, so
                # an empty tensor stays a plain (pageable) CPU tensor.
                continue
            entry = StorageEntry.make(storage, freed, device, pinned, cuda, code)
            previous = self.entries.get(entry.key)
            self.entries[entry.key] = entry
            if previous is not None and previous() is storage:
                # The same storage again (a view of one already registered): the new
                # entry replaces it, and its bytes are counted once. (Another storage's
                # entry is a dead one's, waiting in `freed`: taken out from there.)
                self.uncount_locked(previous)
            if cuda:
                if owner is not None:
                    entry.owner = self._order.owner(owner)
                self.allocated[code] += entry.nbytes
                self.reserved[code] += entry.reserved
                entry.counted = True

    def uncount_locked(self, entry: StorageEntry) -> None:
        if entry.counted:
            entry.counted = False
            # Only a simulated device's entries are counted: `code` is its index.
            self.allocated[entry.code] -= entry.nbytes
            self.reserved[entry.code] -= entry.reserved

    def drain_freed_locked(self) -> None:
        """Takes the storages freed since the last call out of the registry and counters;
        the work is one step per storage freed, however many are alive."""
        freed = self.freed
        entries = self.entries
        order = self._order
        while freed:
            entry = freed.popleft()
            if entry.counted:
                # `uncount_locked`, inline.
                entry.counted = False
                self.allocated[entry.code] -= entry.nbytes
                self.reserved[entry.code] -= entry.reserved
            # A storage registered again, or a new storage at the same address, has a
            # newer entry there, which stays.
            key = entry.key
            if entries.get(key) is entry:
                del entries[key]
                # Its readers go to its owner's pool (none read: nothing to do).
                if entry.cuda and order.readers:
                    order.freed(key, entry.nbytes, entry.owner)

    def sample(self, index: int) -> tuple[int, int]:
        """(allocated, reserved) bytes of the simulated device of index ``index``, after
        taking the freed out."""
        # `with self._lock`, spelled out: every transition reads.
        lock = self._lock
        lock.acquire()
        try:
            if self.freed:
                self.drain_freed_locked()
            return self.allocated[index], self.reserved[index]
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
