"""What an offload counts (docs/concepts/offload.md#stats): `OffloadStats`, and the
counters its steps feed and the manager's trace completes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from fhelium.residency.location import ResidencyLocation
from fhelium.residency.manager import ResidencyManager, engine_of
from fhelium.residency.nn._loading import GroupSource

__all__ = ["TRACE_CAPACITY", "Counters", "OffloadStats", "manager_closed"]

# An offload's own manager keeps this many transition reports between two readings
# (each forward's end reads and clears them for `stats`).
TRACE_CAPACITY: Final = 1 << 16


@dataclass(frozen=True)
class OffloadStats:
    """What an offload did, since it was opened (docs/concepts/offload.md#stats).

    Attributes:
        forwards: Root forwards run.
        steps: Unit forwards run (each a step).
        loads: Copies into the device (a value made resident there).
        h2d_bytes: Bytes copied from host memory to the device.
        d2h_bytes: Bytes copied from the device to host memory.
        disk_read_bytes: Bytes read from the disk location.
        disk_write_bytes: Bytes written to the disk location.
        stalls: Steps whose values were not all copied in ahead of their turn.
        mispredictions: Steps that were not the recording's prediction.
        rerecords: Times the recording was replaced by a forward's real order.
        device_peak_bytes: The device's peak of charged bytes (used plus reserved).
        host_peak_bytes: The host location's peak of used bytes.
    """

    forwards: int
    steps: int
    loads: int
    h2d_bytes: int
    d2h_bytes: int
    disk_read_bytes: int
    disk_write_bytes: int
    stalls: int
    mispredictions: int
    rerecords: int
    device_peak_bytes: int
    host_peak_bytes: int


class Counters:
    """An offload's counts since it was opened: the steps count theirs as they run,
    `collect` adds the transitions of the manager's trace, `stats` reads them all."""

    __slots__ = (
        "d2h",
        "disk_read",
        "disk_write",
        "forwards",
        "h2d",
        "host",
        "loads",
        "location",
        "manager",
        "mispredictions",
        "owns_manager",
        "peaks",
        "rerecords",
        "sources",
        "stalls",
        "steps",
        "trace_seen",
    )

    def __init__(
        self,
        manager: ResidencyManager,
        *,
        owns_manager: bool,
        location: ResidencyLocation,
        host: ResidencyLocation,
    ) -> None:
        self.forwards = self.steps = self.loads = self.stalls = 0
        self.h2d = self.d2h = self.disk_read = self.disk_write = 0
        self.mispredictions = self.rerecords = 0
        self.manager = manager
        self.owns_manager = owns_manager
        self.location = location
        self.host = host
        # The checkpoint's sources, whose reads count as disk reads.
        self.sources: list[GroupSource] = []
        # The last trace report counted, in a caller's manager (whose trace is not
        # cleared).
        self.trace_seen: Any = None
        # The peaks last read, for `stats` after the manager closed.
        self.peaks = (0, 0)

    def collect(self) -> None:
        """Counts the transitions since the last reading (the manager's trace)."""
        manager = self.manager
        reports = manager.trace()
        if not self.owns_manager:
            seen = self.trace_seen
            start = 0
            if seen is not None:
                for index in range(len(reports) - 1, -1, -1):
                    if reports[index] is seen:
                        start = index + 1
                        break
            self.trace_seen = reports[-1] if reports else seen
            reports = reports[start:]
        else:
            manager.clear_trace()
        for report in reports:
            if report.no_op or report.destination is None or report.source is None:
                continue
            source: str = report.source.kind
            destination: str = report.destination.kind
            nbytes = report.storage_nbytes
            if destination == "cuda":
                self.loads += 1
                if source in ("pinned-host", "pageable-host"):
                    self.h2d += nbytes
            elif source == "cuda" and destination in ("pinned-host", "pageable-host"):
                self.d2h += nbytes
            if source == "disk":
                self.disk_read += nbytes
            if destination == "disk":
                self.disk_write += nbytes

    def stats(self) -> OffloadStats:
        """The counts and peaks so far (the peaks last read once the manager closed)."""
        closed = manager_closed(self.manager)
        if not closed:
            self.collect()
        device_peak = host_peak = 0
        if not closed:
            for record in self.manager.snapshot().locations:
                if record.location == self.location:
                    device_peak = record.peak_charged_bytes
                elif record.location == self.host:
                    host_peak = record.peak_used_bytes
            self.peaks = (device_peak, host_peak)
        else:
            device_peak, host_peak = self.peaks
        return OffloadStats(
            forwards=self.forwards,
            steps=self.steps,
            loads=self.loads,
            h2d_bytes=self.h2d,
            d2h_bytes=self.d2h,
            disk_read_bytes=self.disk_read
            + sum(source.reads * source.read_nbytes for source in self.sources),
            disk_write_bytes=self.disk_write,
            stalls=self.stalls,
            mispredictions=self.mispredictions,
            rerecords=self.rerecords,
            device_peak_bytes=device_peak,
            host_peak_bytes=host_peak,
        )


def manager_closed(manager: ResidencyManager) -> bool:
    """Whether ``manager`` is closed."""
    return engine_of(manager).closed
