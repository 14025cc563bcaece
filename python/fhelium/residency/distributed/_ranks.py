"""This rank's set-up and its process group: the rank and group size, the rank's device
(`rank_location`) and manager (`rank_manager`), and the few ways the other modules talk
to the group (where its backend moves bytes, global ranks, gathering objects, and
turning a backend failure into `ResidencyCommunicationError`). See
docs/concepts/distributed.md#rank-local-managers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fhelium.errors import ResidencyCollectiveError, ResidencyCommunicationError
from fhelium.residency._runtime import current_runtime, set_runtime
from fhelium.residency._runtime.simulated import SimulatedRuntime
from fhelium.residency.location import ResidencyLocation, cuda_location
from fhelium.residency.manager import ResidencyManager

Budgets = Mapping[ResidencyLocation, int]


def rank_and_size(group: Any) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; rank 0 of 1 without an
    initialised process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _local_rank() -> int:
    text = os.environ.get("LOCAL_RANK", "0")
    try:
        local = int(text)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer, got {text!r}") from None
    if local < 0:
        raise ValueError(f"LOCAL_RANK must be >= 0, got {local}")
    return local


def rank_location() -> ResidencyLocation:
    """Return this rank's compute location.

    ``cuda:{LOCAL_RANK}`` when CUDA is available, otherwise the simulated ``cuda:0`` that
    `rank_manager` installs (every rank of a CPU machine has its own, in its own process).
    See docs/concepts/distributed.md#rank-local-managers.

    Returns:
        The CUDA location this rank computes on.

    Raises:
        ValueError: ``LOCAL_RANK`` is set but is not a valid device index.
    """
    if torch.cuda.is_available():
        return cuda_location(f"cuda:{_local_rank()}")
    return cuda_location("cuda:0")


def rank_manager(
    budgets: Budgets | Sequence[Budgets] | Callable[[int], Budgets],
    *,
    group: Any = None,
    runtime: SimulatedRuntime | None = None,
    trace_capacity: int = 4096,
) -> ResidencyManager:
    """Build this rank's manager, on this rank's own device.

    ``budgets`` is one mapping for every rank, a sequence with one mapping per rank of
    ``group`` (its length must be the group's size), or a callable taking the rank and
    returning its mapping. With CUDA, ``torch.cuda.set_device(LOCAL_RANK)`` is called
    and `rank_location` is ``cuda:{LOCAL_RANK}``. Without CUDA, ``runtime`` (a
    `SimulatedRuntime`) is installed process-wide (`set_runtime`) when given; otherwise
    the installed runtime is used when it is a `SimulatedRuntime`, and a
    ``SimulatedRuntime(1, auto_complete=True)`` (its events complete as they are
    recorded, as CPU work is done by then) is installed when it is not. Either way
    ``current_runtime()`` then gives its streams. Without an initialised process group
    the process is rank 0 of 1. See docs/concepts/distributed.md#rank-local-managers.

    Args:
        budgets: One budget mapping for every rank, a sequence with one mapping per rank of
            ``group``, or a callable taking the rank and returning its mapping.
        group: The process group; ``None`` for the default group (without an initialised
            group the process is rank 0 of 1).
        runtime: Without CUDA, a `SimulatedRuntime` to install process-wide; ``None`` to use
            (or install) one as described above.
        trace_capacity: As for `ResidencyManager`.

    Returns:
        A new `ResidencyManager` with this rank's budgets.

    Raises:
        TypeError: ``budgets`` of the wrong kind, a rank's budgets not a mapping, or a
            ``runtime`` that is not a `SimulatedRuntime`; as `ResidencyManager` raises.
        ValueError: A sequence whose length is not the group's size; as `ResidencyManager`
            raises.

    Example:
        ```python
        import torch
        from fhelium.residency.distributed import rank_location, rank_manager
        from fhelium.residency.simulation import SimulatedRuntime, use_runtime
        from fhelium.values import ResidentTensor

        with use_runtime(SimulatedRuntime(1, auto_complete=True)):  # a CPU rank
            device = rank_location()
            with rank_manager(lambda rank: {device: 1 << 20}) as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(256)))
                manager.move(handle, device)
        ```
    """
    rank, size = rank_and_size(group)
    if callable(budgets):
        chosen = budgets(rank)
    elif isinstance(budgets, Mapping):
        chosen = budgets
    elif isinstance(budgets, Sequence) and not isinstance(budgets, str | bytes):
        if len(budgets) != size:
            raise ValueError(
                f"budgets has {len(budgets)} entries for a group of {size} ranks; "
                "give one mapping per rank"
            )
        chosen = budgets[rank]
    else:
        raise TypeError(
            "budgets must be a Mapping, a sequence of one Mapping per rank, or a callable "
            f"rank -> Mapping, got {type(budgets).__name__}"
        )
    if not isinstance(chosen, Mapping):
        raise TypeError(
            f"the budgets of rank {rank} must be a Mapping, got {type(chosen).__name__}"
        )
    if runtime is not None and not isinstance(runtime, SimulatedRuntime):
        raise TypeError(f"runtime must be a SimulatedRuntime, got {type(runtime).__name__}")
    if torch.cuda.is_available():
        torch.cuda.set_device(_local_rank())
    elif runtime is not None:
        set_runtime(runtime)
    elif not isinstance(current_runtime(), SimulatedRuntime):
        set_runtime(SimulatedRuntime(1, auto_complete=True))
    return ResidencyManager(chosen, trace_capacity=trace_capacity)


def transport(group: Any) -> torch.device:
    """Where the group's backend moves bytes from: the current CUDA device for NCCL,
    host memory otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank(group: Any, rank: int) -> int:
    """``rank`` of ``group`` as a rank of the default group, as the backend's calls take it."""
    return rank if group is None else dist.get_global_rank(group, rank)


def all_gather_objects(value: Any, group: Any, size: int) -> list[Any]:
    """Every rank's ``value`` (pickled), in rank order."""
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


@contextlib.contextmanager
def communicating(operation: str, phase: str) -> Iterator[None]:
    """A failure of the process group under ``phase`` becomes a
    `ResidencyCommunicationError`, the backend's exception its cause."""
    try:
        yield
    except ResidencyCollectiveError:
        raise
    except (RuntimeError, ValueError, OSError) as error:
        detail = (
            f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
        )
        raise ResidencyCommunicationError(
            operation=operation, phase=phase, detail=detail
        ) from error
