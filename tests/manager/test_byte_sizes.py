"""Byte counts in human units wherever one is taken: a manager's budgets, reservations
(direct and in a request), and offload's budgets; stored as exact ints
(docs/concepts/locations-and-budgets.md#byte-counts)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fhelium.errors import ResidencyBudgetError, ResidencyPlanError
from fhelium.residency import (
    PAGEABLE_HOST,
    MemoryReservation,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    cuda_location,
)
from fhelium.residency.nn import offload
from fhelium.residency.simulation import SimulatedRuntime, use_runtime
from fhelium.values import ResidentTensor


def _budget(manager: ResidencyManager, name: str) -> int | None:
    return next(
        entry.budget_bytes for entry in manager.snapshot().locations if entry.location.name == name
    )


def test_manager_budgets_take_sizes() -> None:
    with ResidencyManager({PAGEABLE_HOST: "1.5 KiB"}) as manager:
        assert _budget(manager, "pageable-host") == 1536
        manager.adopt(ResidentTensor(torch.zeros(256)))  # 1 KiB fits
        with pytest.raises(ResidencyBudgetError):
            manager.adopt(ResidentTensor(torch.zeros(256)))  # a second does not
    with ResidencyManager({PAGEABLE_HOST: "8GiB"}) as manager:
        assert _budget(manager, "pageable-host") == 8 << 30


@pytest.mark.parametrize(
    ("size", "error"), [("8G", ValueError), ("-1KiB", ValueError), (1.5, TypeError)]
)
def test_bad_budget_sizes_are_refused(size: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="budget for pageable-host"):
        ResidencyManager({PAGEABLE_HOST: size})  # type: ignore[dict-item]


def test_reservations_take_sizes() -> None:
    with ResidencyManager({PAGEABLE_HOST: "4KiB"}) as manager:
        with manager.reserve(PAGEABLE_HOST, "3 KiB", label="workspace") as reservation:
            assert reservation.nbytes == 3072
            with pytest.raises(ResidencyBudgetError):
                manager.reserve(PAGEABLE_HOST, "2KiB", label="more")
        with pytest.raises(ValueError, match="nbytes"):
            manager.reserve(PAGEABLE_HOST, "lots", label="x")
    record = MemoryReservation(PAGEABLE_HOST, "64KiB", "activations")
    assert record.nbytes == 65536
    assert record == MemoryReservation(PAGEABLE_HOST, 65536, "activations")
    with pytest.raises(ValueError, match="unknown unit"):
        MemoryReservation(PAGEABLE_HOST, "64 KQ", "activations")


def test_a_request_reservation_in_a_size_is_admitted_exactly() -> None:
    with ResidencyManager({PAGEABLE_HOST: "2KiB"}) as manager:
        handle = manager.adopt(ResidentTensor(torch.zeros(128)))  # 512 bytes
        controller = ResidencyController(manager)
        fits = ResidencyRequest(
            "fits",
            [ResidencyRequirement(handle, PAGEABLE_HOST)],
            [MemoryReservation(PAGEABLE_HOST, "1.5KiB", "work")],
        )
        with controller.use(fits):
            pass
        too_much = ResidencyRequest(
            "too much",
            [ResidencyRequirement(handle, PAGEABLE_HOST)],
            [
                MemoryReservation(PAGEABLE_HOST, "1.5KiB", "work"),
                MemoryReservation(PAGEABLE_HOST, "1B", "more"),
            ],
        )
        with pytest.raises(ResidencyPlanError), controller.use(too_much):
            pass


def test_offload_budgets_take_sizes() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).eval()  # 1088 bytes each
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
    with use_runtime(SimulatedRuntime(1)), torch.no_grad():
        with offload(model, budget="1.1KB", prefetch=0) as off:
            assert _budget(off.manager, "cuda:0") == 1100
            assert torch.equal(model(x.to("cpu")), expected)
        with pytest.raises(ValueError, match="not a whole number"):
            offload(model, budget="0.5B")
        with pytest.raises(TypeError, match="budget"):
            offload(model, budget=2.5)  # type: ignore[arg-type]
    assert cuda_location("cuda:0").name == "cuda:0"
