"""Caps for the child processes tests start, so that no test can exhaust the machine."""

from __future__ import annotations

import resource
from pathlib import Path

# Above what the interpreter with torch maps (about 3 GiB of address space, most of it
# reserved, not resident), and far below any test machine's memory.
HEADROOM = 3 << 30


def capped_memory(headroom: int = HEADROOM) -> None:
    """Caps this process's address space at what it maps now plus ``headroom``; run it in
    a child (as ``preexec_fn``, or first thing after a fork)."""
    mapped = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            mapped = int(line.split()[1]) * 1024
    # A fresh interpreter maps little before it imports torch: never cap below 6 GiB.
    limit = max(mapped + headroom, 6 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
