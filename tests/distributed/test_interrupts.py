"""Ctrl-C inside a collective (docs/concepts/distributed.md#interrupts): a
`KeyboardInterrupt` at any phase of `broadcast`, `scatter` or `gather`, on a sending or
a receiving rank, propagates unchanged there and leaves nothing of the collective on
that rank: no charge, reservation, lease or value. The other ranks raise
`ResidencyCommunicationError` once the interrupted rank has left the group, or finish
normally when it was interrupted after the last verdict.

Each case forks the ranks of one gloo group (helpers.distributed) and, in the rank to
interrupt only, replaces one of the transfer's steps with one that raises the
interrupt: the phases' own steps (describing, admitting, moving, rebuilding, releasing)
and each collective verdict, before it is taken and once it was taken."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fhelium.errors import ResidencyCommunicationError, ResidencyError
from fhelium.residency import ReplicaMode, ResidencyManager
from fhelium.residency.distributed import _collectives as transfers
from fhelium.residency.distributed import broadcast, gather, rank_location, rank_manager, scatter
from fhelium.residency.lease import ResidencyLease
from fhelium.residency.simulation import current_runtime
from fhelium.values import TensorBundle
from helpers.distributed import run_ranks
from helpers.manager import assert_balanced

BUDGET = 1 << 16

# Which rank sends and which receives, per operation (the group's size is 3).
ROOT = 0
ROLES = {"sender": 0, "receiver": 1}
GATHER_ROLES = {"sender": 1, "receiver": 0}

# The collective verdicts, in order: the 1st, 2nd, ... all-gather of a transfer.
VERDICTS = {"agreement": 1, "admission-verdict": 2, "transfer-verdict": 3, "commit-verdict": 4}

# The phases each role goes through, with a step of its own to interrupt. A sender
# offers (takes its leases) and, after the last verdict, releases them; a receiver
# admits (reserves and allocates) and commits (rebuilds and adopts). "transfer" is the
# sender's copy of a buffer for the backend, or the receiver's landing of one that
# arrived. `gather`'s receiver also sends (its own part) and so offers and releases.
SENDER = (
    "offer",
    "agreement",
    "admission-verdict",
    "transfer",
    "transfer-verdict",
    "commit-verdict",
    "after-commit-verdict",
    "release",
)
RECEIVER = (
    "agreement",
    "admission",
    "admission-verdict",
    "transfer",
    "transfer-verdict",
    "commit",
    "commit-verdict",
    "after-commit-verdict",
)
GATHER_RECEIVER = ("offer", *RECEIVER, "release")

# Interrupted in these phases, the rank has taken part in every collective: the others
# finish. Anywhere else they are left waiting for it, and fail once it has gone.
FINISHED = ("after-commit-verdict", "release")

CASES = [
    (operation, role, phase)
    for operation in ("broadcast", "scatter")
    for role, phases in (("sender", SENDER), ("receiver", RECEIVER))
    for phase in phases
] + [
    ("gather", role, phase)
    for role, phases in (("sender", SENDER), ("receiver", GATHER_RECEIVER))
    for phase in phases
]


def _value(seed: int) -> TensorBundle:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(12, 12, generator=generator)
    return TensorBundle(w=base[2:7], ids=torch.arange(seed, seed + 9, dtype=torch.int64))


def _place(manager: ResidencyManager, value: TensorBundle) -> Any:
    at = rank_location()
    placed = current_runtime().to_device(value, at.device)  # type: ignore[attr-defined]
    return manager.adopt(placed, at=at, replica_mode=ReplicaMode.REPLICABLE)


def _state(manager: ResidencyManager) -> dict[str, Any]:
    """What a collective can leave behind: per location the charged, reserved and
    protected bytes and counts, the live values, and whether the books balance."""
    snapshot = manager.snapshot()
    try:
        assert_balanced(snapshot)
        balanced = "balanced"
    except AssertionError as error:
        balanced = f"unbalanced: {error}"
    return {
        "locations": {
            entry.location.name: (
                entry.used_bytes,
                entry.reserved_bytes,
                entry.reservation_count,
                entry.use_count,
                entry.hold_count,
                entry.pending_event_count,
            )
            for entry in snapshot.locations
        },
        "values": sorted(str(value.handle) for value in snapshot.values if not value.discarded),
        "reservations": len(snapshot.reservations),
        "balanced": balanced,
    }


def _calls(name: str, nth: int, interrupt: KeyboardInterrupt, *, after: bool) -> None:
    """Replaces the transfer step ``name`` with one whose ``nth`` call raises
    ``interrupt``, before the real step runs or once it has run (``after``)."""
    real = getattr(transfers, name)
    count = 0

    def step(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        if count == nth and not after:
            raise interrupt
        result = real(*args, **kwargs)
        if count == nth:
            raise interrupt
        return result

    setattr(transfers, name, step)


def _inject(phase: str, sending: bool, incoming: int, interrupt: KeyboardInterrupt) -> None:
    """Makes this rank's next collective raise ``interrupt`` at ``phase``."""
    if phase in VERDICTS:
        _calls("_all_gather_objects", VERDICTS[phase], interrupt, after=False)
    elif phase == "after-commit-verdict":
        _calls("_all_gather_objects", VERDICTS["commit-verdict"], interrupt, after=True)
    elif phase == "offer":
        # The lease on the value is taken by then.
        _calls("_describe", 1, interrupt, after=False)
    elif phase == "admission":
        # The reservations are taken and the storages allocated.
        _calls("_receive_buffers", 1, interrupt, after=True)
    elif phase == "transfer":
        # A sender copies its first buffer for the backend; a receiver lands the
        # first buffer that arrived.
        _calls("_send" if sending else "_land", 1, interrupt, after=False)
    elif phase == "commit":
        # Rebuilding the last incoming value: those before it are adopted and charged.
        _calls("_rebuild", incoming, interrupt, after=False)
    elif phase == "release":
        # Once the first lease is released; the others are still held.
        real = ResidencyLease.release

        def release(self: ResidencyLease, *, wait: bool = False) -> None:
            real(self, wait=wait)
            ResidencyLease.release = real  # type: ignore[method-assign]
            raise interrupt

        ResidencyLease.release = release  # type: ignore[method-assign]
    else:
        raise AssertionError(f"no phase {phase!r}")


def _interrupted(rank: int, world: int, operation: str, role: str, phase: str) -> dict[str, Any]:
    at = rank_location()
    manager = rank_manager({at: BUDGET})
    roles = GATHER_ROLES if operation == "gather" else ROLES
    root = GATHER_ROLES["receiver"] if operation == "gather" else ROOT
    if operation == "broadcast":
        mine = _place(manager, _value(1)) if rank == root else None

        def call() -> Any:
            return broadcast(manager, mine, src=root, at=at)

    elif operation == "scatter":
        parts = [_place(manager, _value(r)) for r in range(world)] if rank == root else None

        def call() -> Any:
            return scatter(manager, parts, src=root, at=at)

    else:
        part = _place(manager, _value(rank))

        def call() -> Any:
            return gather(manager, part, dst=root, at=at)

    interrupt = KeyboardInterrupt(f"injected at {phase}")
    target = roles[role]
    if rank == target:
        incoming = world - 1 if operation == "gather" else 1
        _inject(phase, role == "sender", incoming, interrupt)
    before = _state(manager)
    outcome: dict[str, Any] = {"before": before}
    try:
        result = call()
    except KeyboardInterrupt as error:
        outcome.update(
            interrupted=True,
            same=error is interrupt,
            notes=list(getattr(error, "__notes__", [])),
            cause=repr(error.__cause__),
        )
    except ResidencyError as error:
        outcome.update(error=error)
    else:
        handles = result if isinstance(result, list) else [result]
        outcome.update(returned=[str(handle) for handle in handles if handle is not None])
    outcome["after"] = _state(manager)
    return outcome


@pytest.mark.parametrize(("operation", "role", "phase"), CASES)
def test_an_interrupt_leaves_nothing_behind_on_its_rank(
    operation: str, role: str, phase: str
) -> None:
    outcomes = run_ranks(_interrupted, 3, operation, role, phase, timeout_s=10.0, deadline_s=60.0)
    target = (GATHER_ROLES if operation == "gather" else ROLES)[role]
    results = [outcome.unwrap() for outcome in outcomes]
    mine = results[target]
    # The interrupt propagated on its rank, the very object, with nothing added.
    assert mine.get("interrupted"), mine
    assert mine["same"]
    assert mine["notes"] == []
    assert mine["cause"] == "None"
    # Nothing of the collective is left there: no charge, reservation, lease or value.
    assert mine["after"] == mine["before"]
    assert mine["after"]["balanced"] == "balanced"
    for rank, result in enumerate(results):
        if rank == target:
            continue
        assert result["after"]["balanced"] == "balanced", rank
        if phase in FINISHED:
            # The collective completed everywhere else: each other rank holds its result.
            assert "error" not in result, (rank, result)
            after, before = result["after"], result["before"]
            assert after["reservations"] == 0
            assert all(entry[3:] == (0, 0, 0) for entry in after["locations"].values())
            assert set(result["returned"]) <= set(after["values"])
            assert set(before["values"]) <= set(after["values"])
        else:
            error = result.get("error")
            assert type(error) is ResidencyCommunicationError, (rank, result)
            assert error.operation == operation
            assert result["after"] == result["before"], rank


def _clean_up_fails(rank: int, world: int, failure: str) -> dict[str, Any]:
    """A broadcast whose receiver, rank 1, is interrupted at the commit verdict and then
    cannot discard the value it adopted."""
    at = rank_location()
    manager = rank_manager({at: BUDGET})
    mine = _place(manager, _value(1)) if rank == 0 else None
    interrupt = KeyboardInterrupt("injected at commit-verdict")
    if rank == 1:
        _inject("commit-verdict", False, 1, interrupt)

        def discard(*args: Any, **kwargs: Any) -> Any:
            if failure == "error":
                raise RuntimeError("injected discard failure")
            raise KeyboardInterrupt("a second interrupt")

        ResidencyManager.discard = discard  # type: ignore[method-assign]
    try:
        broadcast(manager, mine, src=0, at=at)
    except KeyboardInterrupt as error:
        return {"same": error is interrupt, "notes": list(getattr(error, "__notes__", []))}
    except ResidencyError as error:
        return {"error": error}
    raise AssertionError("the broadcast went through")


@pytest.mark.parametrize("failure", ["error", "interrupt"])
def test_a_clean_up_failure_is_a_note_on_the_interrupt(failure: str) -> None:
    outcomes = run_ranks(_clean_up_fails, 2, failure, timeout_s=10.0, deadline_s=60.0)
    result = outcomes[1].unwrap()
    assert result["same"]
    (note,) = result["notes"]
    assert note.startswith("clean-up: discarding the adopted value ResidencyHandle(")
    expected = "RuntimeError('injected" if failure == "error" else "KeyboardInterrupt('a second"
    assert expected in note
    assert type(outcomes[0].unwrap()["error"]) is ResidencyCommunicationError
