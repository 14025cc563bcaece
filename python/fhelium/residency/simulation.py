"""Simulated CUDA devices for CI without a GPU and for dry runs of GPU workloads.

`SimulatedRuntime` stands in for the CUDA runtime: pinned host memory and ``device_count``
CUDA devices are simulated with ordinary CPU tensors, streams and events are plain objects,
and every call is counted and can be made to fail. Install it process-wide with
`use_runtime` (or `set_runtime`); managers constructed while it is installed use it.

Give it a `Timeline` to model virtual time: copies and declared compute occupy per-device
engines, events complete when the host clock reaches them, and the timeline's spans
(`TimelineSpan`) and ``makespan`` predict how a workload's copies and compute overlap. See
docs/concepts/simulation.md.
"""

from fhelium.residency._runtime import current_runtime, set_runtime, use_runtime
from fhelium.residency._runtime.simulated import SimulatedCopy, SimulatedRuntime
from fhelium.residency._runtime.simulated_storage import SimulatedHazard
from fhelium.residency._runtime.simulated_streams import SimulatedEvent, SimulatedStream
from fhelium.residency._runtime.timeline import Timeline, TimelineSpan

__all__ = [
    "SimulatedCopy",
    "SimulatedEvent",
    "SimulatedHazard",
    "SimulatedRuntime",
    "SimulatedStream",
    "Timeline",
    "TimelineSpan",
    "current_runtime",
    "set_runtime",
    "use_runtime",
]
