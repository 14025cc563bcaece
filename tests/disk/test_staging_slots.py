"""The staging ring's slots are exactly `CHUNK` bytes of page-aligned pinned memory
(docs/concepts/locations-and-budgets.md#disk).

Pinned memory is page-aligned, so a slot needs no slack for aligning: asking torch's
pinned allocator, which rounds every request up to a power of two, for `CHUNK + ALIGN`
would take twice `CHUNK` per slot. Only a runtime handing back an unaligned buffer gets
one `ALIGN` bigger, used from its first aligned byte.
"""

from __future__ import annotations

import torch

from fhelium.residency import PINNED_HOST
from fhelium.residency._disk import format as disk_format
from fhelium.residency._disk import staging as disk_staging
from fhelium.residency._runtime import SimulatedRuntime


class Recording(SimulatedRuntime):
    """Logs the size of every pinned buffer asked for; with ``offset``, hands back
    buffers that start ``offset`` bytes past a page."""

    def __init__(self, offset: int = 0) -> None:
        super().__init__(1)
        self.offset = offset
        self.sizes: list[int] = []

    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        if not self.offset:
            return super().empty_pinned(nbytes)
        return super().empty_pinned(nbytes + self.offset)[self.offset :]


def _check_slots(staging: disk_staging.Staging, runtime: SimulatedRuntime) -> None:
    assert len(staging.buffers) == disk_staging.SLOTS
    for buffer in staging.buffers:
        assert buffer.dtype == torch.uint8
        assert buffer.numel() == disk_staging.CHUNK
        assert buffer.data_ptr() % disk_format.ALIGN == 0
        assert runtime.placement(buffer) == PINNED_HOST


def test_each_slot_is_one_chunk_of_page_aligned_pinned_memory() -> None:
    runtime = Recording()
    staging = disk_staging.Staging(runtime)
    try:
        staging.take()
        assert runtime.sizes == [disk_staging.CHUNK] * disk_staging.SLOTS
        _check_slots(staging, runtime)
    finally:
        staging.close()


def test_an_unaligned_pinned_buffer_is_replaced_by_one_a_page_bigger() -> None:
    runtime = Recording(offset=64)
    staging = disk_staging.Staging(runtime)
    try:
        staging.take()
        assert (
            runtime.sizes
            == [disk_staging.CHUNK] * disk_staging.SLOTS
            + [disk_staging.CHUNK + disk_format.ALIGN] * disk_staging.SLOTS
        )
        _check_slots(staging, runtime)
    finally:
        staging.close()
