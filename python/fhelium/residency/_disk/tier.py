"""A manager's disk tier: the `DiskStore` of each disk location it writes to and the
one `Staging` ring its transfers share, called by the binding to write, read and remove
the materialisations at disk locations (docs/concepts/locations-and-budgets.md#disk).

While a pipeline stages a step (`DiskTier.defer`), a read to a device, or a
reconstruction by a source that ``loads_alone``, runs whole on the ring's I/O thread,
after the ones before it, and its event is a `StagedEvent`
(docs/concepts/locations-and-budgets.md#staging-and-direct-io).
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any

import numpy as np
import torch

from fhelium.errors import ResidencyMaterializationError
from fhelium.residency._disk.format import DiskFile
from fhelium.residency._disk.staging import Staging, copy_through, pageable
from fhelium.residency._disk.store import DiskStore
from fhelium.residency._runtime.base import StagedEvent
from fhelium.values.tensor_resident import TensorResident

__all__ = ["DiskTier"]


class DiskTier:
    """A manager's disk locations: one `DiskStore` per directory, opened on first
    write, all removed at close, and one `Staging` ring for the transfers that need it.
    The binding calls it to write, read and remove the materialisations at disk
    locations (docs/concepts/locations-and-budgets.md#disk)."""

    __slots__ = ("_deferring", "owner_id", "staging", "stores", "written")

    def __init__(self) -> None:
        # Per thread: the list the reads to a device it defers are added to, while a
        # pipeline stages ahead (`defer`); None otherwise.
        self._deferring = threading.local()
        self.owner_id = ""
        self.stores: dict[str, DiskStore] = {}
        self.staging: Staging | None = None
        self.written = 0  # names every file uniquely

    def _store(self, location: Any) -> DiskStore:
        store = self.stores.get(location.path)
        if store is None:
            store = DiskStore(
                location.path,
                self.owner_id,
                direct=location.direct_io,
                verify=location.verify,
            )
            self.stores[location.path] = store
        return store

    def _store_of(self, file: DiskFile) -> DiskStore:
        for store in self.stores.values():
            if store.directory == file.path.parent:
                return store
        raise ResidencyMaterializationError(f"{file.path} belongs to no open disk store")

    def _staging(self, runtime: Any, *, deferred: bool = False) -> Staging:
        """The ring, for ``runtime``; unless for a ``deferred`` read, once the reads
        deferred before are done (the caller then uses the slots itself)."""
        staging = self.staging
        if staging is None or staging.runtime is not runtime:
            if staging is not None:
                staging.close()
            staging = self.staging = Staging(runtime)
        elif not deferred:
            staging.quiesce()
        return staging

    def defer(self, runtime: Any) -> tuple[list[StagedEvent], list[StagedEvent] | None]:
        """From now on, this thread's reads from disk to a device (and reconstructions by
        sources that ``loads_alone``) are deferred to the ring's I/O thread, where
        ``runtime`` accepts a `StagedEvent`: the list their events are added to, in
        order, and what to give `undefer` (a pipeline's staging; no context manager,
        which would cost a step more)."""
        local = self._deferring
        previous: list[StagedEvent] | None = getattr(local, "issued", None)
        issued: list[StagedEvent] = []
        if getattr(runtime, "staged_events", False):
            local.issued = issued
        return issued, previous

    def undefer(self, previous: list[StagedEvent] | None) -> None:
        """Ends `defer`: this thread's reads block again (or go to ``previous``)."""
        self._deferring.issued = previous

    def write(self, location: Any, value: TensorResident, runtime: Any) -> DiskFile:
        """Writes a host or CUDA value to a new file (a CUDA one through the staging
        ring, one chunk at a time)."""
        device = runtime.value_device(value)
        store = self._store(location)
        cuda = device if device.type == "cuda" else None
        staging = self._staging(runtime) if cuda is not None or store.direct else None
        self.written += 1
        # Unique across processes too: a forked child inherits the counter.
        name = f"value-{os.getpid()}-{self.written}-{secrets.token_hex(4)}"
        return store.write(name, value, staging=staging, device=cuda)

    def read(self, file: DiskFile, pinned: bool, runtime: Any) -> TensorResident:
        """The stored value read into new pageable memory of the process's own, or
        into new pinned memory, its checksums checked."""
        store = self._store_of(file)
        staging = self._staging(runtime) if store.direct else None
        allocate = runtime.empty_pinned if pinned else pageable
        return store.read(file, allocate, staging=staging)

    def read_to_cuda(
        self, file: DiskFile, device: torch.device, stream: Any, runtime: Any
    ) -> tuple[TensorResident, Any]:
        """The stored value on ``device``, copied through the staging ring on
        ``stream``, and the event of its last copy (enqueued, not waited for). While
        this thread defers (`defer`), the reads and copies are left to the ring's I/O
        thread and the event is a `StagedEvent`."""
        store = self._store_of(file)
        issued = getattr(self._deferring, "issued", None)
        if issued is None:
            return store.read_to_cuda(file, device, stream, self._staging(runtime))
        staging = self._staging(runtime, deferred=True)
        value, event = store.read_to_cuda_deferred(file, device, stream, staging)
        issued.append(event)
        return value, event

    def load_to_cuda(
        self, source: Any, device: torch.device, stream: Any, runtime: Any
    ) -> tuple[TensorResident, StagedEvent] | None:
        """While this thread defers (`defer`), a reconstruction from a source that
        `loads_alone` (it never calls a manager) into pageable memory, left to the
        ring's I/O thread: the destination is allocated here from the source's
        ``layout()``, and that thread runs ``load()``, checks that the loaded value has
        that layout and copies it through the ring, a chunk at a time, on ``stream``.
        None where the reconstruction is not deferred (it then runs as usual)
        (docs/concepts/values.md#reconstructions-a-pipeline-defers)."""
        issued = getattr(self._deferring, "issued", None)
        if issued is None or not getattr(source, "loads_alone", False):
            return None
        layout = source.layout()
        if not isinstance(layout, TensorResident):
            raise TypeError(
                f"{type(source).__name__}.layout() must return a TensorResident, "
                f"got {type(layout).__name__}"
            )
        shapes = [(tensor.shape, tensor.dtype) for tensor in layout._resident_tensors]
        buffers = [
            runtime.empty_cuda(shape.numel() * dtype.itemsize, device, stream)
            for shape, dtype in shapes
        ]
        value = layout._with_resident_tensors(
            tuple(
                buffer[: shape.numel() * dtype.itemsize].view(dtype).view(shape)
                for buffer, (shape, dtype) in zip(buffers, shapes, strict=True)
            )
        )
        staging = self._staging(runtime, deferred=True)
        staged = StagedEvent()
        staged.value = value

        def load() -> None:
            try:
                loaded = source.load()
                tensors = loaded._resident_tensors if isinstance(loaded, TensorResident) else None
                if (
                    type(loaded) is not type(layout)
                    or tensors is None
                    or [(t.shape, t.dtype, t.device.type) for t in tensors]
                    != [(shape, dtype, "cpu") for shape, dtype in shapes]
                ):
                    raise ResidencyMaterializationError(
                        f"{type(source).__name__}.load() returned a value other than its "
                        "layout() described"
                    )
                event = copy_through(staging, tensors, buffers, stream)
                if event is None:
                    event = runtime.record_event(stream)
            except BaseException as error:  # carried by the event to whoever waits
                staged.finish(None, error)
                return
            staged.finish(event, None)

        staging.defer(load)
        issued.append(staged)
        return value, staged

    def remove(self, file: object) -> None:
        if isinstance(file, DiskFile):
            for store in self.stores.values():
                if file.path.parent == store.directory:
                    store.remove(file)
                    return

    def facts(self, file: DiskFile) -> tuple[int, int]:
        """(logical bytes, storage bytes) of a stored value."""
        logical = sum(
            int(np.prod(field.size, dtype=np.int64))
            * torch.empty(0, dtype=field.dtype).element_size()
            for field in file.fields
        )
        return logical, sum(length for _, length in file.storages)

    def close(self) -> None:
        staging, self.staging = self.staging, None
        stores, self.stores = self.stores, {}
        try:
            if staging is not None:
                staging.close()
        finally:
            for store in stores.values():
                store.close()
