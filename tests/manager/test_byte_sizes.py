"""Sizes as people write them (docs/concepts/locations-and-budgets.md#byte-counts):
`parse_size` gives the exact int that a manager's budgets, reservations and records
take; a string where the contract asks for an int stays a `TypeError`, whose message
shows the `parse_size` call; `offload` takes sizes directly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fhelium.errors import ResidencyBudgetError
from fhelium.residency import PAGEABLE_HOST, MemoryReservation, ResidencyManager
from fhelium.residency.nn import offload
from fhelium.residency.simulation import SimulatedRuntime, use_runtime
from fhelium.residency.sizes import parse_size
from fhelium.values import ResidentTensor


def _budget(manager: ResidencyManager, name: str) -> int | None:
    return next(
        entry.budget_bytes for entry in manager.snapshot().locations if entry.location.name == name
    )


def test_parse_size_feeds_the_manager() -> None:
    with ResidencyManager({PAGEABLE_HOST: parse_size("1.5 KiB")}) as manager:
        assert _budget(manager, "pageable-host") == 1536
        manager.adopt(ResidentTensor(torch.zeros(256)))  # 1 KiB fits
        with pytest.raises(ResidencyBudgetError):
            manager.adopt(ResidentTensor(torch.zeros(256)))  # a second does not
        with manager.reserve(PAGEABLE_HOST, parse_size("0.5KiB"), label="rest") as reservation:
            assert reservation.nbytes == 512
    assert MemoryReservation(PAGEABLE_HOST, parse_size("64KiB"), "a").nbytes == 65536


def test_a_string_budget_is_a_type_error_that_shows_parse_size() -> None:
    with pytest.raises(TypeError, match=r"parse_size\('8GiB'\)"):
        ResidencyManager({PAGEABLE_HOST: "8GiB"})  # type: ignore[dict-item]
    with ResidencyManager() as manager, pytest.raises(TypeError, match=r"parse_size\('1MiB'\)"):
        manager.reserve(PAGEABLE_HOST, "1MiB", label="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        MemoryReservation(PAGEABLE_HOST, "64KiB", "a")  # type: ignore[arg-type]


def test_offload_budgets_take_sizes() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).eval()  # 1088 bytes each
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
    with use_runtime(SimulatedRuntime(1)), torch.no_grad():
        with offload(model, budget="1.1KB", prefetch=0) as off:
            assert _budget(off.manager, "cuda:0") == 1100
            assert torch.equal(model(x), expected)
        with pytest.raises(ValueError, match="not a whole number"):
            offload(model, budget="0.5B")
        with pytest.raises(TypeError, match="budget"):
            offload(model, budget=2.5)  # type: ignore[arg-type]
