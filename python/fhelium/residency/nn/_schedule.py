"""An offload's schedule (docs/concepts/offload.md#the-schedule): the recorded order of
its steps, where the prediction stands in it, each step's request, and the `Feeder` that
hands a pipeline the step about to be entered, then the recording's predictions.

A step is a `Key`: the units active when it was entered, outermost first.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

from fhelium.residency.location import ResidencyLocation
from fhelium.residency.nn._stats import Counters
from fhelium.residency.nn._values import OffloadValue
from fhelium.residency.policy import DeterministicTieredLRU, ResidencyPolicy
from fhelium.residency.request import ResidencyRequest, ResidencyRequirement
from fhelium.residency.schedule import ScheduleAwarePolicy

__all__ = ["Feeder", "Key", "Schedule"]

Key = tuple[int, ...]


class Schedule:
    """The recording, the prediction's cursor in it, and each step's request (made once).

    ``recording`` is None before the first forward; ``positions`` maps each step to its
    positions in the recording; ``policy`` is the policy last made by `policy_for`, which
    a misprediction seeks when it follows the recording.
    """

    __slots__ = (
        "counters",
        "cursor",
        "host",
        "location",
        "names",
        "policy",
        "positions",
        "recording",
        "requests",
        "unit_values",
    )

    def __init__(
        self,
        unit_values: Sequence[Sequence[OffloadValue]],
        names: Sequence[str],
        *,
        location: ResidencyLocation,
        host: ResidencyLocation,
        counters: Counters,
    ) -> None:
        self.unit_values = unit_values
        self.names = names
        self.location = location
        self.host = host
        self.counters = counters
        self.requests: dict[Key, ResidencyRequest] = {}
        self.recording: list[Key] | None = None
        self.positions: dict[Key, list[int]] = {}
        self.cursor = 0
        self.policy: ResidencyPolicy | None = None

    def request(self, key: Key) -> ResidencyRequest:
        """Step ``key``'s request: its units' values on the device (a checkpoint's
        also on the host)."""
        request = self.requests.get(key)
        if request is None:
            requirements: dict[ResidencyRequirement, None] = {}
            for unit in key:
                for value in self.unit_values[unit]:
                    # The host copy first: the device's is then copied from it.
                    if value.reconstructible:
                        requirements[ResidencyRequirement(value.handle, self.host)] = None
                    requirements[ResidencyRequirement(value.handle, self.location)] = None
            request = self.requests[key] = ResidencyRequest(
                "/".join(self.names[unit] for unit in key), list(requirements)
            )
        return request

    def policy_for(
        self,
        choice: str | ResidencyPolicy,
        tiers: dict[ResidencyLocation, list[ResidencyLocation]],
    ) -> ResidencyPolicy:
        """The policy to decide with (and to seek): ``choice`` when it is a policy, the
        schedule-aware one over the recording, or LRU (chosen, or before a recording)."""
        policy: ResidencyPolicy
        if not isinstance(choice, str):
            policy = choice
        elif choice == "lru" or not self.recording:
            policy = DeterministicTieredLRU(tiers)
        else:
            steps = [self.request(key) for key in self.recording]
            policy = ScheduleAwarePolicy(steps, cyclic=True, fallback_tiers=tiers)
        self.policy = policy
        return policy

    def record(self, actual: list[Key]) -> None:
        """Makes ``actual`` the recording, predicted from its start."""
        self.recording = actual
        positions: dict[Key, list[int]] = {}
        for position, key in enumerate(actual):
            positions.setdefault(key, []).append(position)
        self.positions = positions
        self.cursor = 0

    def predict(self) -> tuple[Key, int] | None:
        """The recording's next step and its position, or None without a recording."""
        recording = self.recording
        if not recording:
            return None
        position = self.cursor
        self.cursor = (position + 1) % len(recording)
        return recording[position], position

    def resync(self, key: Key, expected: int) -> None:
        """After a misprediction: predict from the recording's next occurrence of
        ``key`` at or after position ``expected`` (cyclically)."""
        recording = self.recording
        positions = self.positions.get(key)
        if not recording or not positions:
            return
        at = bisect.bisect_left(positions, expected)
        position = positions[at] if at < len(positions) else positions[0]
        self.cursor = (position + 1) % len(recording)
        policy = self.policy
        if isinstance(policy, ScheduleAwarePolicy):
            policy.seek(position)

    def follow(self, key: Key) -> None:
        """Moves the prediction past ``key``: the recording's next step, or (a
        misprediction) the step after ``key``'s next occurrence in the recording."""
        recording = self.recording
        if not recording:
            return
        if recording[self.cursor] == key:
            self.cursor = (self.cursor + 1) % len(recording)
        else:
            self.counters.mispredictions += 1
            self.resync(key, self.cursor)

    def named(self) -> tuple[tuple[str, ...], ...]:
        """The recording by unit names (empty before the first forward)."""
        names = self.names
        return tuple(tuple(names[u] for u in key) for key in self.recording or ())


class Feeder:
    """The pipeline's requests: the step about to be entered (``upcoming``), then the
    recording's predictions, each remembered in ``handed`` with its position until its
    step is entered; ``stopped`` once the recording gave none."""

    __slots__ = ("handed", "schedule", "stopped", "upcoming")

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.upcoming: Key | None = None
        self.handed: deque[tuple[Key, int]] = deque()
        self.stopped = False

    def __iter__(self) -> Feeder:
        return self

    def __next__(self) -> ResidencyRequest:
        schedule = self.schedule
        if self.upcoming is not None:
            key, self.upcoming = self.upcoming, None
            return schedule.request(key)
        predicted = schedule.predict()
        if predicted is None:
            self.stopped = True
            raise StopIteration
        self.handed.append(predicted)
        return schedule.request(predicted[0])
