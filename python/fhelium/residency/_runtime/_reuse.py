"""The simulated runtime's memory-reuse check (docs/concepts/simulation.md#memory-reuse).

Order between streams is tracked with vector clocks: each stream counts the work
enqueued on it, and knows, per other stream, how much of that stream's work it is
ordered after (through `wait_event`, or through the host having seen an event
complete before it enqueued). A freed device storage keeps its readers' positions in
the pool of the stream that allocated it; the next allocation on that stream checks
that every such reader is ordered before it. Every method is called under the
runtime's lock.

The order is native data (`fhelium._core.ReuseOrder`, in ``rust/residency-sim``), which
the runtime's Python methods and its native seam calls share; an event keeps its
clock as a `Clock`.
"""

from __future__ import annotations

from fhelium._core import ReuseOrder

__all__ = ["Clock", "ReuseOrder"]

# Per stream (by simulated handle): how many of its enqueued operations are covered.
Clock = dict[int, int]
