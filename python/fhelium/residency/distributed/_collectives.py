"""Values between ranks: `broadcast`, `scatter` and `gather` move managed values between
the ranks' managers through the process group, all or nothing. Each transfer runs in
four phases (agreement, admission, transfer, commit), each closed by a collective
verdict; a refusal or failure anywhere makes every rank raise `ResidencyCollectiveError`
with nothing left charged, and an interrupt leaves nothing of the transfer on this rank.
See docs/concepts/distributed.md#all-or-nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fhelium.errors import ResidencyCollectiveError, ResidencyCommunicationError
from fhelium.residency._runtime import DeviceRuntime
from fhelium.residency.distributed._layout import Layout

# The steps a transfer takes from the modules beside this one, bound here under these
# names: a transfer looks them up in this module as it runs, so tests/distributed can
# replace one here to fail or interrupt a transfer at that step.
from fhelium.residency.distributed._layout import describe as _describe
from fhelium.residency.distributed._layout import rebuild as _rebuild
from fhelium.residency.distributed._ranks import all_gather_objects as _all_gather_objects
from fhelium.residency.distributed._ranks import communicating, global_rank, rank_and_size
from fhelium.residency.distributed._ranks import transport as _transport
from fhelium.residency.lease import ResidencyLease, ResidencyReservation
from fhelium.residency.location import PINNED_HOST, DiskLocation, ResidencyLocation
from fhelium.residency.manager import ResidencyManager, engine_of
from fhelium.residency.model import ReplicaMode, ResidencyHandle
from fhelium.values.tensor_resident import ResidentTensor, TensorResident

ValueT = TypeVar("ValueT", bound=TensorResident)
T = TypeVar("T")


class _Allocator:
    """New byte buffers at a location, through the manager's runtime."""

    def __init__(self, manager: ResidencyManager, at: ResidencyLocation) -> None:
        self.runtime = engine_of(manager).runtime
        self.at = at
        self.stream: Any = None
        if at.kind == "cuda":
            self.stream = self.runtime.current_stream(at.device)

    def empty(self, nbytes: int) -> torch.Tensor:
        if self.at.kind == "cuda":
            return self.runtime.empty_cuda(nbytes, self.at.device, self.stream)
        if self.at == PINNED_HOST:
            return self.runtime.empty_pinned(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.runtime.synchronize_stream(self.stream)
            if torch.cuda.is_available() and self.at.device.type == "cuda":
                torch.cuda.synchronize(self.at.device)


def _check_location(at: object) -> ResidencyLocation:
    if not isinstance(at, ResidencyLocation):
        raise TypeError(f"at must be a ResidencyLocation, got {type(at).__name__}")
    if isinstance(at, DiskLocation):
        raise ValueError("values are transferred into host or CUDA locations, not to disk")
    return at


def _failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class _Transfer:
    """One collective transfer on this rank: what it sends, what it receives, the
    charges and values it holds until the verdict. See
    docs/concepts/distributed.md#all-or-nothing."""

    def __init__(
        self,
        operation: str,
        manager: ResidencyManager,
        at: ResidencyLocation,
        group: Any,
        call: tuple[Any, ...],
    ) -> None:
        if not isinstance(manager, ResidencyManager):
            raise TypeError(f"manager must be a ResidencyManager, got {type(manager).__name__}")
        self.operation = operation
        self.manager = manager
        self.at = _check_location(at)
        self.group = group
        self.rank, self.size = rank_and_size(group)
        self.call = (operation, at.name if at.kind != "cuda" else "cuda", *call)
        self.leases: list[ResidencyLease] = []
        self.reservations: list[ResidencyReservation] = []
        self.adopted: list[ResidencyHandle[Any]] = []
        self.flats: dict[int, list[torch.Tensor]] = {}

    # --- local steps ----------------------------------------------------------------

    def offer(self, handles: Sequence[ResidencyHandle[Any]]) -> list[Layout]:
        """Borrows the values this rank sends, at ``at``, and describes them."""
        layouts = []
        stream = None
        if self.at.kind == "cuda":
            stream = engine_of(self.manager).runtime.current_stream(self.at.device)
        snapshot = self.manager.snapshot()
        modes = {entry.handle: entry.spec.replica_mode for entry in snapshot.values}
        for position, handle in enumerate(handles):
            if not isinstance(handle, ResidencyHandle):
                raise TypeError(f"expected a ResidencyHandle, got {type(handle).__name__}")
            lease = self.manager.acquire([handle], at=self.at, consumer_stream=stream)
            self.leases.append(lease)
            layout, flats = _describe(
                lease.values[handle], modes.get(handle, ReplicaMode.EXCLUSIVE)
            )
            layouts.append(layout)
            self.flats[position] = flats
        return layouts

    def admit(self, layouts: Sequence[Layout]) -> None:
        for index, layout in enumerate(layouts):
            self.reservations.append(
                self.manager.reserve(
                    self.at, layout.nbytes, label=f"{self.operation} incoming value {index}"
                )
            )

    def commit(
        self,
        layouts: Sequence[Layout],
        buffers: Sequence[list[torch.Tensor]],
        allocator: _Allocator,
    ) -> list[ResidencyHandle[Any]]:
        """Rebuilds and adopts the received values, each adopted the moment its
        reservation is given back."""
        allocator.synchronize()
        handles = []
        for layout, parts, reservation in zip(layouts, buffers, self.reservations, strict=True):
            value = _rebuild(layout, parts, allocator.empty)
            reservation.release()
            handle = self.manager.adopt(value, at=self.at, replica_mode=layout.replica_mode)
            self.adopted.append(handle)
            handles.append(handle)
        self.reservations.clear()
        return handles

    def undo(self, error: BaseException | None = None) -> None:
        """Gives back every charge and value this transfer took on this rank; each step
        that fails is a note on ``error`` (the error about to be raised), and the steps
        after it still run. Idempotent: what was given back is forgotten."""
        _drain(
            self.reservations,
            error,
            lambda reservation: f"releasing the reservation {reservation!r}",
            lambda reservation: reservation.release(),
        )
        _drain(
            self.adopted,
            error,
            lambda handle: f"discarding the adopted value {handle!r}",
            self.manager.discard,
        )
        self.release(error)

    def release(self, error: BaseException | None = None) -> None:
        """Releases this rank's leases (waiting for their events); without ``error`` a
        failure propagates, and the leases not yet released stay listed for `undo`."""
        _drain(
            self.leases,
            error,
            lambda lease: f"releasing the lease {lease!r}",
            _release_waiting,
        )

    # --- collective steps -------------------------------------------------------------

    def verdict(self, phase: str, error: BaseException | None) -> None:
        """Every rank's outcome of ``phase``; a failure anywhere raises the same
        `ResidencyCollectiveError` on every rank (`_collective` then undoes each rank's
        part)."""
        local = None if error is None else _failure(error)
        try:
            with communicating(self.operation, phase):
                outcomes = _all_gather_objects(local, self.group, self.size)
        except ResidencyCommunicationError as failure:
            if error is not None:
                failure.add_note(f"this rank had failed too: {_failure(error)}")
            raise
        failed = tuple(rank for rank, outcome in enumerate(outcomes) if outcome is not None)
        if failed:
            raised = ResidencyCollectiveError(
                operation=self.operation,
                phase=phase,
                failed_ranks=failed,
                details=tuple(str(outcomes[rank]) for rank in failed),
            )
            raise raised from error

    def agree(self, offered: list[Layout] | None, error: BaseException | None) -> list[Any]:
        """Phase 1: every rank's call and offered layouts; a mismatched call or a failed
        offer makes every rank raise."""
        mine: tuple[Any, ...] = (self.call, None if error is None else _failure(error), offered)
        with communicating(self.operation, "agreement"):
            everyone = _all_gather_objects(mine, self.group, self.size)
        failed = []
        details = []
        for rank, (call, outcome, _) in enumerate(everyone):
            if call != everyone[0][0]:
                failed.append(rank)
                details.append(f"called {call!r}, rank 0 called {everyone[0][0]!r}")
            elif outcome is not None:
                failed.append(rank)
                details.append(outcome)
        if failed:
            raised = ResidencyCollectiveError(
                operation=self.operation,
                phase="agreement",
                failed_ranks=tuple(failed),
                details=tuple(details),
            )
            raise raised from error
        return [entry[2] for entry in everyone]


def _release_waiting(lease: ResidencyLease) -> None:
    lease.release(wait=True)


def _noted(error: BaseException | None, what: str, step: Callable[..., object], *args: Any) -> None:
    """Runs a clean-up ``step``; a failure becomes a note on ``error`` (or is raised
    when there is no error to carry it). With an error to carry it, an interrupt of the
    step (a second ``KeyboardInterrupt``) is a note too: ``error`` is what propagates."""
    try:
        step(*args)
    except BaseException as failure:
        if error is None:
            raise
        error.add_note(f"clean-up: {what} also failed: {failure!r}")


def _drain(
    items: list[T],
    error: BaseException | None,
    what: Callable[[T], str],
    step: Callable[[T], object],
) -> None:
    """Runs ``step`` on each of ``items`` in order, forgetting each once its step ran.
    Without ``error``, a failure propagates with the failed item and those after it
    still listed, so a later `_Transfer.undo` gives them back."""
    while items:
        item = items[0]
        _noted(error, what(item), step, item)
        del items[0]


def _receive_buffers(layouts: Sequence[Layout], allocator: _Allocator) -> list[list[torch.Tensor]]:
    """The storages each incoming value will live in, allocated at the destination
    during admission (an allocation failure is a refused admission)."""
    return [[allocator.empty(nbytes) for nbytes in layout.storages] for layout in layouts]


class _Wire:
    """Where the process group's backend moves bytes (``device``: this rank's current
    CUDA device for NCCL, the host for gloo), and how this rank's buffers get there.

    A buffer is handed to the backend only when it lives on ``device`` itself, type and
    index, as the manager's runtime places it: a buffer on another GPU than the rank's
    (or on a GPU under gloo, or on the host under NCCL) goes through a staging buffer on
    ``device``. See docs/concepts/distributed.md#all-or-nothing."""

    def __init__(self, runtime: DeviceRuntime, device: torch.device) -> None:
        self.runtime = runtime
        self.device = device
        self.stream: Any = None
        if device.type == "cuda":
            self.stream = runtime.current_stream(device)

    def reaches(self, tensor: torch.Tensor) -> bool:
        """Whether the backend can move ``tensor``'s bytes where they are."""
        return self.runtime.value_device(ResidentTensor(tensor)) == self.device

    def empty(self, nbytes: int) -> torch.Tensor:
        """A new flat ``uint8`` buffer on ``device`` (a staging buffer)."""
        if self.stream is not None:
            return self.runtime.empty_cuda(nbytes, self.device, self.stream)
        return torch.empty(nbytes, dtype=torch.uint8)

    def send(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` itself when the backend reaches it, otherwise a copy on ``device``."""
        if self.reaches(flat):
            return flat
        value = ResidentTensor(flat)
        if self.stream is not None:
            copy = self.runtime.copy_to_cuda(value, self.device, self.stream, non_blocking=False)
        else:
            copy = self.runtime.copy_to_pageable(value)
        (tensor,) = copy._resident_tensors
        return tensor

    def staged(self, buffer: torch.Tensor) -> torch.Tensor:
        """The tensor the backend receives into for ``buffer``: itself when the backend
        reaches it, a staging buffer otherwise (copied in by `_land`)."""
        return buffer if self.reaches(buffer) else self.empty(buffer.numel())


def _wire(transfer: _Transfer) -> _Wire:
    return _Wire(engine_of(transfer.manager).runtime, _transport(transfer.group))


def _send(flat: torch.Tensor, wire: _Wire) -> torch.Tensor:
    return wire.send(flat)


def _land(buffer: torch.Tensor, staged: torch.Tensor) -> None:
    if staged is not buffer:
        buffer.copy_(staged)


def _outgoing(
    flat: torch.Tensor, wire: _Wire, error: BaseException | None
) -> tuple[torch.Tensor, BaseException | None]:
    """What this rank sends for ``flat``, and its first local failure so far. After a
    failure it still sends a buffer of the same size, so the other ranks' collectives
    complete and every rank learns of it at the transfer verdict."""
    if error is None:
        try:
            return _send(flat, wire), None
        except Exception as failure:
            error = failure
    return wire.empty(flat.numel()), error


def _landed(
    buffer: torch.Tensor, staged: torch.Tensor, error: BaseException | None
) -> BaseException | None:
    """Copies what arrived into its destination, unless an earlier copy failed; the
    first local failure so far (the collectives go on either way)."""
    if error is None:
        try:
            _land(buffer, staged)
        except Exception as failure:
            return failure
    return error


Mover = Callable[[_Wire, Sequence[list[torch.Tensor]], BaseException | None], BaseException | None]


def _collective(
    transfer: _Transfer,
    offer: Callable[[], list[Layout]] | None,
    incoming: Callable[[list[Any]], list[Layout]],
    move: Mover,
) -> tuple[list[Any], list[ResidencyHandle[Any]]]:
    """One transfer on this rank (docs/concepts/distributed.md#all-or-nothing): its four
    phases, and the undo of this rank's part when anything raises out of them, an
    interrupt (any ``BaseException``) included; the exception then propagates as it was.
    ``offer`` describes what this rank sends (None: nothing), ``incoming`` picks from
    every rank's offers what this rank receives, and ``move`` takes part in the
    transfer's collectives (given the wire, the receive buffers and the first local
    failure so far, it returns the first local failure). Returns every rank's offers and
    the handles this rank adopted."""
    try:
        return _phases(transfer, offer, incoming, move)
    except BaseException as error:
        transfer.undo(error)
        raise


def _phases(
    transfer: _Transfer,
    offer: Callable[[], list[Layout]] | None,
    incoming: Callable[[list[Any]], list[Layout]],
    move: Mover,
) -> tuple[list[Any], list[ResidencyHandle[Any]]]:
    offered: list[Layout] | None = None
    error: BaseException | None = None
    try:
        if offer is not None:
            offered = offer()
    except Exception as failure:
        error = failure
    everyone = transfer.agree(offered, error)
    layouts = incoming(everyone)
    error = None
    received: list[list[torch.Tensor]] = []
    allocator = _Allocator(transfer.manager, transfer.at)
    wire: _Wire | None = None
    try:
        wire = _wire(transfer)
        if layouts:
            transfer.admit(layouts)
            received = _receive_buffers(layouts, allocator)
    except Exception as failure:
        error = failure
    transfer.verdict("admission", error)
    assert wire is not None  # the verdict raised otherwise
    with communicating(transfer.operation, "transfer"):
        error = move(wire, received, None)
    transfer.verdict("transfer", error)
    return everyone, _finish(transfer, layouts, received, allocator)


def _check_rank(transfer: _Transfer, name: str, rank: int) -> None:
    if not 0 <= rank < transfer.size:
        raise ValueError(
            f"{name} must be a rank of the group (0 to {transfer.size - 1}), got {rank}"
        )


def _send_to(tensor: torch.Tensor, *, peer: int, group: Any) -> None:
    dist.send(tensor, peer, group=group)


def _receive_from(tensor: torch.Tensor, *, peer: int, group: Any) -> None:
    dist.recv(tensor, peer, group=group)


def _send_all(
    flats: Sequence[torch.Tensor],
    wire: _Wire,
    error: BaseException | None,
    send: Callable[[torch.Tensor], object],
) -> BaseException | None:
    for flat in flats:
        payload, error = _outgoing(flat, wire, error)
        send(payload)
    return error


def _receive_all(
    buffers: Sequence[torch.Tensor],
    wire: _Wire,
    error: BaseException | None,
    receive: Callable[[torch.Tensor], object],
) -> BaseException | None:
    for buffer in buffers:
        staged = wire.staged(buffer)
        receive(staged)
        error = _landed(buffer, staged, error)
    return error


def broadcast(
    manager: ResidencyManager,
    handle: ResidencyHandle[ValueT] | None,
    *,
    src: int,
    at: ResidencyLocation,
    group: Any = None,
) -> ResidencyHandle[ValueT]:
    """Copy the value ``handle`` names on rank ``src`` into every other rank's manager at ``at``.

    On ``src`` the value must be materialised at ``at``; the other ranks pass ``None``
    (anything they pass is ignored). Each receiving rank adopts a new MUST_PRESERVE
    value with ``src``'s replica mode, the same tensor layout and the same bytes. All or
    nothing: every rank admits the bytes under its own budget before any byte moves,
    and if any rank refuses or fails, every rank raises `ResidencyCollectiveError` (or
    `ResidencyCommunicationError` when the process group fails) and no rank keeps a
    charge or a value. See docs/concepts/distributed.md#broadcast.

    Args:
        manager: This rank's manager.
        handle: On ``src``, the value, materialised at ``at``; ignored elsewhere (pass
            ``None``).
        src: The sending rank (its rank in ``group``).
        at: Where the value lives on ``src`` and is adopted on the others.
        group: The process group; ``None`` for the default group (without an initialised
            group the process is rank 0 of 1).

    Returns:
        Each rank's handle: ``src``'s own on ``src``, a new MUST_PRESERVE value elsewhere.

    Raises:
        ResidencyCollectiveError: A rank refused or failed (every rank raises it).
        ResidencyCommunicationError: The process group failed.

    Example:
        ```python
        import os, tempfile
        import torch
        import torch.distributed as dist
        from fhelium.residency.distributed import broadcast, rank_location, rank_manager
        from fhelium.residency.simulation import SimulatedRuntime, use_runtime
        from fhelium.values import ResidentTensor

        # One rank here; under torchrun every rank runs the same code.
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "rendezvous"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            with use_runtime(SimulatedRuntime(1, auto_complete=True)):
                device = rank_location()
                with rank_manager({device: 1 << 20}) as manager:
                    weights = None
                    if dist.get_rank() == 0:
                        weights = manager.adopt(ResidentTensor(torch.ones(256)))
                        manager.move(weights, device)
                    weights = broadcast(manager, weights, src=0, at=device)
        finally:
            dist.destroy_process_group()
        ```
    """
    transfer = _Transfer("broadcast", manager, at, group, (src,))
    _check_rank(transfer, "src", src)
    sending = transfer.rank == src
    root = global_rank(group, src)

    def offer() -> list[Layout]:
        if handle is None:
            raise TypeError("the src rank must pass the handle it broadcasts")
        return transfer.offer([handle])

    def move(
        wire: _Wire,
        received: Sequence[list[torch.Tensor]],
        error: BaseException | None,
    ) -> BaseException | None:
        def cast(tensor: torch.Tensor) -> object:
            return dist.broadcast(tensor, root, group=group)

        if sending:
            return _send_all(transfer.flats[0], wire, error, cast)
        return _receive_all(received[0], wire, error, cast)

    _, adopted = _collective(
        transfer,
        offer if sending else None,
        lambda everyone: [] if sending else list(everyone[src]),
        move,
    )
    return handle if sending else adopted[0]  # type: ignore[return-value]


def _finish(
    transfer: _Transfer,
    layouts: Sequence[Layout],
    received: Sequence[list[torch.Tensor]],
    allocator: _Allocator,
) -> list[ResidencyHandle[Any]]:
    """Phase 4: adopt what arrived, agree, and keep it only when every rank did."""
    error: BaseException | None = None
    adopted: list[ResidencyHandle[Any]] = []
    try:
        if layouts:
            adopted = transfer.commit(layouts, received, allocator)
    except Exception as failure:
        error = failure
    transfer.verdict("commit", error)
    transfer.release()
    transfer.adopted.clear()
    return adopted


def scatter(
    manager: ResidencyManager,
    handles: Sequence[ResidencyHandle[Any]] | None,
    *,
    src: int,
    at: ResidencyLocation,
    group: Any = None,
) -> ResidencyHandle[Any]:
    """Send rank ``r`` the value ``handles[r]`` names on rank ``src``.

    On ``src``, ``handles`` has one handle per rank of the group, each materialised at
    ``at``; the other ranks pass ``None``. Each receiving rank admits only its own part;
    the all-or-nothing rule and the errors are `broadcast`'s. See
    docs/concepts/distributed.md#scatter-and-gather.

    Args:
        manager: This rank's manager.
        handles: On ``src``, one handle per rank of the group, each materialised at ``at``;
            ``None`` elsewhere.
        src: The sending rank.
        at: Where the values live on ``src`` and are adopted on the others.
        group: The process group; ``None`` for the default group (without an initialised
            group the process is rank 0 of 1).

    Returns:
        This rank's handle (on ``src``, ``handles[src]`` itself).

    Raises:
        ResidencyCollectiveError: A rank refused or failed (every rank raises it).
        ResidencyCommunicationError: The process group failed.
    """
    transfer = _Transfer("scatter", manager, at, group, (src,))
    _check_rank(transfer, "src", src)
    sending = transfer.rank == src
    root = global_rank(group, src)

    def offer() -> list[Layout]:
        if handles is None or isinstance(handles, ResidencyHandle):
            raise TypeError("the src rank must pass one handle per rank")
        parts = list(handles)
        if len(parts) != transfer.size:
            raise ValueError(f"scatter needs {transfer.size} handles, got {len(parts)}")
        return transfer.offer(parts)

    def move(
        wire: _Wire,
        received: Sequence[list[torch.Tensor]],
        error: BaseException | None,
    ) -> BaseException | None:
        if not sending:
            return _receive_all(received[0], wire, error, lambda t: dist.recv(t, root, group=group))
        for rank in range(transfer.size):
            if rank != src:
                peer = global_rank(group, rank)
                error = _send_all(
                    transfer.flats[rank],
                    wire,
                    error,
                    partial(_send_to, peer=peer, group=group),
                )
        return error

    _, adopted = _collective(
        transfer,
        offer if sending else None,
        lambda everyone: [] if sending else [everyone[src][transfer.rank]],
        move,
    )
    if sending:
        assert handles is not None
        return handles[src]
    return adopted[0]


def gather(
    manager: ResidencyManager,
    handle: ResidencyHandle[Any],
    *,
    dst: int,
    at: ResidencyLocation,
    group: Any = None,
) -> list[ResidencyHandle[Any]] | None:
    """Collect every rank's value into rank ``dst``'s manager at ``at``.

    Every rank passes its own part, materialised at ``at``. On ``dst`` the result is one
    handle per rank, in rank order (its own part's handle at position ``dst``); the
    other ranks get ``None`` and keep their parts. ``dst`` admits every incoming part
    before any byte moves; the all-or-nothing rule and the errors are `broadcast`'s.
    See docs/concepts/distributed.md#scatter-and-gather.

    Args:
        manager: This rank's manager.
        handle: This rank's part, materialised at ``at``.
        dst: The receiving rank.
        at: Where the parts live and are adopted on ``dst``.
        group: The process group; ``None`` for the default group (without an initialised
            group the process is rank 0 of 1).

    Returns:
        On ``dst``, one handle per rank in rank order; ``None`` on the other ranks.

    Raises:
        ResidencyCollectiveError: A rank refused or failed (every rank raises it).
        ResidencyCommunicationError: The process group failed.
    """
    transfer = _Transfer("gather", manager, at, group, (dst,))
    _check_rank(transfer, "dst", dst)
    receiving = transfer.rank == dst
    senders = [rank for rank in range(transfer.size) if rank != dst]
    root = global_rank(group, dst)

    def move(
        wire: _Wire,
        received: Sequence[list[torch.Tensor]],
        error: BaseException | None,
    ) -> BaseException | None:
        if not receiving:
            return _send_all(
                transfer.flats[0], wire, error, lambda t: dist.send(t, root, group=group)
            )
        for rank, buffers in zip(senders, received, strict=True):
            peer = global_rank(group, rank)
            error = _receive_all(
                buffers, wire, error, partial(_receive_from, peer=peer, group=group)
            )
        return error

    _, adopted = _collective(
        transfer,
        lambda: transfer.offer([handle]),
        lambda everyone: [everyone[rank][0] for rank in senders] if receiving else [],
        move,
    )
    if not receiving:
        return None
    adopted.insert(dst, handle)
    return adopted
