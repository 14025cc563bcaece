"""Values between ranks (docs/concepts/distributed.md#all-or-nothing): broadcast,
scatter and gather through real gloo groups; the bytes arrive intact, every budget
holds, and a refusal, a failure or a dead rank anywhere leaves no charge anywhere."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fhelium.errors import (
    ResidencyCollectiveError,
    ResidencyCommunicationError,
    ResidencyError,
)
from fhelium.residency import PAGEABLE_HOST, PINNED_HOST, ReplicaMode, ResidencyManager
from fhelium.residency.distributed import (
    broadcast,
    gather,
    rank_location,
    rank_manager,
    scatter,
)
from fhelium.residency.simulation import current_runtime
from fhelium.values import TensorBundle
from helpers.distributed import run_ranks

BUDGET = 1 << 16


def _value(seed: int) -> TensorBundle:
    """Views into one storage (a slice and a row) and a second dtype: the layout, not
    just the numbers, must survive the trip."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(40, 40, generator=generator)
    return TensorBundle(
        w=base[3:9, 5:30],
        row=base[11],
        ids=torch.randint(0, 1 << 30, (17,), dtype=torch.int64, generator=generator),
    )


def _numbers(value: Any) -> dict[str, Any]:
    return {name: (tensor.tolist(), str(tensor.dtype)) for name, tensor in value.tensors.items()}


def _fingerprint(value: Any) -> dict[str, Any]:
    return {
        name: (tensor.tolist(), str(tensor.dtype), tuple(tensor.stride()), tensor.storage_offset())
        for name, tensor in value.tensors.items()
    }


def _books(manager: ResidencyManager) -> dict[str, tuple[int, int, int]]:
    """Per location: used, reserved, and the leases and holds still on it."""
    return {
        entry.location.name: (
            entry.used_bytes,
            entry.reserved_bytes,
            entry.use_count + entry.hold_count + entry.pending_event_count,
        )
        for entry in manager.snapshot().locations
    }


def _within_budget(manager: ResidencyManager) -> bool:
    return all(
        entry.budget_bytes is None or entry.used_bytes + entry.reserved_bytes <= entry.budget_bytes
        for entry in manager.snapshot().locations
    )


def _read(manager: ResidencyManager, handle: Any, at: Any) -> dict[str, Any]:
    stream = current_runtime().current_stream(at.device) if at.kind == "cuda" else None
    with manager.acquire([handle], at=at, consumer_stream=stream) as values:
        value = values[handle]
        storages = {value[name].untyped_storage().data_ptr() for name in ("w", "row")}
        shared = len(storages) == 1
        return {"fingerprint": _fingerprint(value), "shared": shared}


def _numbers_at(manager: ResidencyManager, handle: Any, at: Any) -> dict[str, Any]:
    stream = current_runtime().current_stream(at.device)
    with manager.acquire([handle], at=at, consumer_stream=stream) as values:
        return _numbers(values[handle])


def _place(manager: ResidencyManager, value: TensorBundle, at: Any) -> Any:
    runtime = current_runtime()
    placed = runtime.to_device(value, at.device) if at.kind == "cuda" else value  # type: ignore[attr-defined]
    if at == PINNED_HOST:
        placed = runtime.pin(value)  # type: ignore[attr-defined]
    return manager.adopt(placed, at=at, replica_mode=ReplicaMode.REPLICABLE)


def _broadcast(rank: int, world: int, where: str) -> dict[str, Any]:
    at = {"device": rank_location(), "pinned": PINNED_HOST, "pageable": PAGEABLE_HOST}[where]
    manager = rank_manager({at: BUDGET, PAGEABLE_HOST: BUDGET})
    handle = _place(manager, _value(5), at) if rank == 0 else None
    received = broadcast(manager, handle, src=0, at=at)
    assert (received == handle) if rank == 0 else (received.manager_id == manager.manager_id)
    (entry,) = [v for v in manager.snapshot().values if v.handle == received]
    return {
        **_read(manager, received, at),
        "books": _books(manager),
        "within": _within_budget(manager),
        "charge": entry.spec.storage_nbytes,
        "mode": entry.spec.replica_mode,
        "where": [m.location for m in entry.materializations],
    }


@pytest.mark.parametrize("where", ["device", "pinned", "pageable"])
def test_broadcast_delivers_identical_bytes_under_every_budget(where: str) -> None:
    results = [outcome.unwrap() for outcome in run_ranks(_broadcast, 2, where)]
    original = _fingerprint(_value(5))
    at = {"device": rank_location(), "pinned": PINNED_HOST, "pageable": PAGEABLE_HOST}[where]
    sender, receiver = results
    # The receiver holds exactly what the sender's manager holds: numbers, dtypes,
    # strides, offsets, and the same charge.
    assert receiver["fingerprint"] == sender["fingerprint"]
    assert receiver["charge"] == sender["charge"]
    assert receiver["shared"] == sender["shared"]
    for result in results:
        assert {name: entry[:2] for name, entry in result["fingerprint"].items()} == {
            name: entry[:2] for name, entry in original.items()
        }
        assert result["within"]
        assert result["where"] == [at]
        assert result["mode"] is ReplicaMode.REPLICABLE
        used, reserved, protected = result["books"][at.name]
        assert (used, reserved, protected) == (result["charge"], 0, 0)
    if where == "pageable":
        # Adopted as built: views into one storage, which the receiver rebuilds.
        assert receiver["fingerprint"] == original
        assert receiver["shared"]
        assert receiver["charge"] == 40 * 40 * 4 + 17 * 8


def _refusing(rank: int, world: int) -> dict[str, Any]:
    at = rank_location()
    # Rank 2 cannot admit the value: its budget is smaller than the value's storage.
    manager = rank_manager(lambda r: {at: 256 if r == 2 else BUDGET})
    handle = _place(manager, _value(1), at) if rank == 0 else None
    before = _books(manager)
    try:
        broadcast(manager, handle, src=0, at=at)
    except ResidencyError as error:
        return {"error": error, "before": before, "after": _books(manager)}
    raise AssertionError("the broadcast went through")


def test_a_rank_that_cannot_admit_makes_every_rank_raise_and_nothing_stays() -> None:
    results = [outcome.unwrap() for outcome in run_ranks(_refusing, 4)]
    at = rank_location().name
    for rank, result in enumerate(results):
        error = result["error"]
        assert type(error) is ResidencyCollectiveError
        assert (error.operation, error.phase) == ("broadcast", "admission")
        assert error.failed_ranks == (2,)
        assert "ResidencyBudgetError" in error.details[0]
        assert "budget_bytes=256" in error.details[0]
        assert "failed_ranks=[2]" in str(error)
        # Nothing charged, reserved or protected beyond what the rank had before.
        assert result["after"] == result["before"], rank
        assert result["after"].get(at, (0, 0, 0))[1:] == (0, 0)
    assert results[0]["after"][at][0] > 0  # the source keeps its own value


def _broadcast_failing(rank: int, world: int, phase: str) -> dict[str, Any]:
    """A broadcast from rank 0 in which one rank fails at ``phase``; its outcome here."""
    at = rank_location()
    manager = rank_manager({at: BUDGET})
    handle = _place(manager, _value(2 if phase == "commit" else 4), at) if rank == 0 else None
    if phase == "commit" and rank == 2:
        # Rank 2 fails while adopting, after the bytes arrived; rank 1 adopted by then.
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected adoption failure")

        ResidencyManager.adopt = refuse  # type: ignore[method-assign]
    if phase == "transfer" and rank == 1:
        # Rank 1 cannot copy what arrived into its storages (the first of several), but
        # it goes on taking part in every collective, so no rank hangs.
        from fhelium.residency.distributed import _collectives as distributed

        def broken(buffer: Any, staged: Any) -> None:
            raise RuntimeError("injected landing failure")

        distributed._land = broken  # type: ignore[attr-defined]
    before = _books(manager)
    try:
        broadcast(manager, handle, src=0, at=at)
    except ResidencyError as error:
        return {
            "error": error,
            "before": before,
            "after": _books(manager),
            "values": len([v for v in manager.snapshot().values if not v.discarded]),
        }
    raise AssertionError("the broadcast went through")


def test_a_failure_after_the_bytes_arrived_is_undone_on_every_rank() -> None:
    results = [outcome.unwrap() for outcome in run_ranks(_broadcast_failing, 3, "commit")]
    for rank, result in enumerate(results):
        error = result["error"]
        assert type(error) is ResidencyCollectiveError
        assert (error.phase, error.failed_ranks) == ("commit", (2,))
        assert "injected adoption failure" in error.details[0]
        assert result["after"] == result["before"], rank
        assert result["values"] == (1 if rank == 0 else 0)


def test_a_rank_that_fails_during_the_transfer_makes_every_rank_raise_before_adopting() -> None:
    results = [outcome.unwrap() for outcome in run_ranks(_broadcast_failing, 3, "transfer")]
    for rank, result in enumerate(results):
        error = result["error"]
        assert type(error) is ResidencyCollectiveError
        assert (error.phase, error.failed_ranks) == ("transfer", (1,))
        assert "injected landing failure" in error.details[0]
        assert result["after"] == result["before"], rank
        assert result["values"] == (1 if rank == 0 else 0)


def _bad_calls(rank: int, world: int, case: str) -> ResidencyError:
    at = rank_location()
    manager = rank_manager({at: BUDGET, PINNED_HOST: BUDGET})
    where = at if case == "mismatch" else PINNED_HOST
    handle = _place(manager, _value(3), where) if rank == 0 else None
    before = _books(manager)
    try:
        if case == "mismatch":
            broadcast(manager, handle, src=0 if rank == 0 else 1, at=at)
        else:  # the source's value is not at `at`
            broadcast(manager, handle, src=0, at=at)
    except ResidencyError as error:
        assert _books(manager) == before
        return error
    raise AssertionError("the broadcast went through")


@pytest.mark.parametrize(
    ("case", "failed", "detail"),
    [("mismatch", (1,), "rank 0 called"), ("unavailable", (0,), "ResidencyUnavailableError")],
)
def test_bad_calls_are_refused_on_every_rank_before_anything_moves(
    case: str, failed: tuple[int, ...], detail: str
) -> None:
    for outcome in run_ranks(_bad_calls, 2, case):
        error = outcome.unwrap()
        assert type(error) is ResidencyCollectiveError
        assert (error.phase, error.failed_ranks) == ("agreement", failed)
        assert detail in error.details[0]


def _scatter_gather(rank: int, world: int) -> dict[str, Any]:
    at = rank_location()
    manager = rank_manager({at: BUDGET})
    parts = [_place(manager, _value(10 + r), at) for r in range(world)] if rank == 0 else None
    mine = scatter(manager, parts, src=0, at=at)
    got = _numbers_at(manager, mine, at)
    # Back again: rank 1 collects every rank's part.
    collected = gather(manager, mine, dst=1, at=at)
    gathered = None
    if collected is not None:
        gathered = [_numbers_at(manager, handle, at) for handle in collected]
    return {"mine": got, "gathered": gathered, "within": _within_budget(manager)}


def test_scatter_then_gather_routes_each_part() -> None:
    results = [outcome.unwrap() for outcome in run_ranks(_scatter_gather, 3)]
    for rank, result in enumerate(results):
        assert result["mine"] == _numbers(_value(10 + rank))
        assert result["within"]
        assert (result["gathered"] is None) == (rank != 1)
    assert results[1]["gathered"] == [_numbers(_value(10 + r)) for r in range(3)]


def _dying(rank: int, world: int, how: str) -> dict[str, Any]:
    at = rank_location()
    manager = rank_manager({at: BUDGET})
    handle = _place(manager, _value(4), at) if rank == 0 else None
    if rank == world - 1:
        # The last rank stops in the middle of the transfer: after admission, at the
        # first byte; it hangs past the group's timeout, or exits at once. It hangs well
        # past the timeout, so that on a loaded machine the others still see the
        # timeout, not its exit.
        def stop(*args: Any, **kwargs: Any) -> Any:
            if how == "hang":
                time.sleep(5.0)
            os._exit(3)

        dist.broadcast = stop  # type: ignore[assignment]
    before = _books(manager)
    started = time.monotonic()
    try:
        broadcast(manager, handle, src=0, at=at)
    except ResidencyError as error:
        return {
            "error": error,
            "cause": error.__cause__,
            "seconds": time.monotonic() - started,
            "before": before,
            "after": _books(manager),
        }
    raise AssertionError("the broadcast went through")


@pytest.mark.parametrize("how", ["hang", "exit"])
def test_a_rank_that_dies_mid_collective_ends_the_others_with_an_error(how: str) -> None:
    outcomes = run_ranks(_dying, 3, how, timeout_s=1.5, deadline_s=30.0)
    assert outcomes[2].exit_code == 3
    for outcome in outcomes[:2]:
        result = outcome.unwrap()
        error = result["error"]
        assert type(error) is ResidencyCommunicationError
        assert isinstance(error, ResidencyCollectiveError)
        assert error.operation == "broadcast"
        assert error.phase in {"transfer", "commit"}
        assert isinstance(result["cause"], RuntimeError)
        assert result["after"] == result["before"]
        if how == "hang":
            assert "Timed out" in error.detail or "timeout" in error.detail.lower()
        assert result["seconds"] < 1.5 + 2.0, "the group's timeout ends it, not a hang"
