"""The backend is handed only tensors on its own device
(docs/concepts/distributed.md#all-or-nothing).

NCCL moves bytes from the rank's current CUDA device; a buffer on another GPU (or on
the host) must be staged there, never handed over as it is. Devices compare whole,
type and index, as the manager's runtime places the tensors. Checked on the simulated
runtime with two devices: the ranks run a real gloo group underneath (simulated device
memory is CPU memory), with the transport device made the rank's ``cuda:0`` as it is
under NCCL, and every tensor given to the backend is checked for its placement."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from fhelium.residency import PINNED_HOST, ReplicaMode, cuda_location
from fhelium.residency.distributed import _collectives as transfers
from fhelium.residency.distributed import broadcast, gather, rank_manager
from fhelium.residency.simulation import SimulatedRuntime
from fhelium.values import TensorBundle
from helpers.distributed import run_ranks
from helpers.manager import assert_balanced

BUDGET = 1 << 16
RANK_DEVICE = torch.device("cuda", 0)
WHERE = {"other-gpu": cuda_location("cuda:1"), "rank-gpu": cuda_location("cuda:0")}
WHERE["pinned"] = PINNED_HOST


def _value(seed: int) -> TensorBundle:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(10, 10, generator=generator)
    return TensorBundle(w=base[1:6], ids=torch.arange(seed, seed + 7, dtype=torch.int64))


def _numbers(value: Any) -> dict[str, Any]:
    return {name: (tensor.tolist(), str(tensor.dtype)) for name, tensor in value.tensors.items()}


def _over_nccl(rank: int, world: int, operation: str, where: str) -> dict[str, Any]:
    runtime = SimulatedRuntime(2, auto_complete=True)
    at = WHERE[where]
    manager = rank_manager({at: BUDGET}, runtime=runtime)
    # As under NCCL: the backend moves bytes on the rank's current CUDA device.
    transfers._transport = lambda group: RANK_DEVICE  # type: ignore[attr-defined]
    handed: list[str] = []

    def checked(real: Any) -> Any:
        def collective(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            handed.append(runtime.placement(tensor).name)
            return real(tensor, *args, **kwargs)

        return collective

    dist.broadcast = checked(dist.broadcast)  # type: ignore[assignment]
    dist.send = checked(dist.send)  # type: ignore[assignment]
    dist.recv = checked(dist.recv)  # type: ignore[assignment]

    def place(value: TensorBundle) -> Any:
        placed = runtime.pin(value) if at == PINNED_HOST else runtime.to_device(value, at.device)
        return manager.adopt(placed, at=at, replica_mode=ReplicaMode.REPLICABLE)

    if operation == "broadcast":
        handles = [broadcast(manager, place(_value(7)) if rank == 0 else None, src=0, at=at)]
    else:
        handles = gather(manager, place(_value(rank)), dst=0, at=at) or []
    values = []
    for handle in handles:
        stream = runtime.current_stream(at.device) if at.kind == "cuda" else None
        with manager.acquire([handle], at=at, consumer_stream=stream) as borrowed:
            values.append(
                {
                    "numbers": _numbers(borrowed[handle]),
                    "placement": runtime.placement(borrowed[handle]).name,
                }
            )
    assert_balanced(manager.snapshot())
    return {"handed": handed, "values": values, "staged": runtime.calls["copy_to_cuda"]}


@pytest.mark.parametrize("where", ["other-gpu", "rank-gpu", "pinned"])
@pytest.mark.parametrize("operation", ["broadcast", "gather"])
def test_the_backend_gets_only_tensors_on_the_ranks_device(operation: str, where: str) -> None:
    results = [outcome.unwrap() for outcome in run_ranks(_over_nccl, 2, operation, where)]
    for rank, result in enumerate(results):
        # Whatever `at` is, every tensor given to the backend lives on the rank's GPU.
        assert result["handed"], rank
        assert set(result["handed"]) == {"cuda:0"}, (rank, result["handed"])
        # Copied there from elsewhere (both storages of the value); handed over as it is
        # when already there.
        sends = rank == (0 if operation == "broadcast" else 1)
        assert result["staged"] == (2 if sends and where != "rank-gpu" else 0)
        # The values arrive intact, where they were asked for.
        for value in result["values"]:
            assert value["placement"] == WHERE[where].name
    if operation == "broadcast":
        assert [value["numbers"] for value in results[1]["values"]] == [_numbers(_value(7))]
    else:
        assert [value["numbers"] for value in results[0]["values"]] == [
            _numbers(_value(0)),
            _numbers(_value(1)),
        ]
