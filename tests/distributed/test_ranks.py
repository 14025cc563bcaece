"""The forked ranks of the distributed suite (helpers.distributed): each runs with its
address space capped, so a runaway rank fails alone instead of exhausting the machine."""

from __future__ import annotations

import resource

import torch

from helpers.distributed import run_ranks


def _oversized(rank: int, world: int) -> tuple[int, str]:
    cap, _ = resource.getrlimit(resource.RLIMIT_AS)
    try:
        torch.empty(cap, dtype=torch.uint8)
    except (MemoryError, RuntimeError) as error:
        return cap, type(error).__name__
    return cap, "allocated"


def test_a_rank_cannot_grow_past_its_cap() -> None:
    for outcome in run_ranks(_oversized, 2):
        cap, result = outcome.unwrap()
        assert cap != resource.RLIM_INFINITY
        assert result != "allocated"
