"""Caps for the child processes tests start, so that no test can exhaust the machine.

Every test that starts a child process caps the child's address space (`RLIMIT_AS`):

* a new program (`subprocess`) runs as ``capped(argv)``: a small Python program sets the cap
  and then replaces itself with ``argv`` (`os.execv`), so the cap holds from the child's first
  instruction and no Python code runs between fork and exec in a threaded parent;
* a forked child that goes on running the parent's image (`os.fork`, multiprocessing's fork
  context) calls `capped_memory` first thing: it starts with all of its parent's address
  space, and may add ``headroom`` to it (``preexec_fn=capped_memory`` also works);
* a child that wants a tighter cap of its own calls `cap_address_space`.

A child that runs away then fails inside its own address space (`MemoryError`, an allocation
failure) instead of growing until the kernel's OOM killer picks a victim.

`DEFAULT_ADDRESS_SPACE` is 6 GiB: a child that imports torch and fhelium maps about 3 GiB of
address space before doing anything (measured on Linux x86-64 with torch 2.x: shared
libraries, thread stacks and per-thread malloc arenas, most of it reserved, not resident), and
tests' children use a few hundred MiB more. A child that initialises CUDA needs more (the
driver reserves address space for unified memory): pass a larger ``limit`` there.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence
from pathlib import Path

DEFAULT_ADDRESS_SPACE = 6 << 30
# Above what the interpreter with torch maps (about 3 GiB of address space, most of it
# reserved, not resident), and far below any test machine's memory.
HEADROOM = 3 << 30

# Run as `python -c _EXEC_CAPPED LIMIT PROGRAM ARGS...`: caps, then becomes PROGRAM.
_EXEC_CAPPED = """\
import os, resource, sys
limit = int(sys.argv[1])
_, hard = resource.getrlimit(resource.RLIMIT_AS)
if hard != resource.RLIM_INFINITY:
    limit = min(limit, hard)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
os.execv(sys.argv[2], sys.argv[2:])
"""


def capped(argv: Sequence[str], limit: int = DEFAULT_ADDRESS_SPACE) -> list[str]:
    """The command line that runs ``argv`` (its first item a program's path) with its
    address space capped at ``limit`` bytes; the environment and working directory pass
    through unchanged."""
    return [sys.executable, "-c", _EXEC_CAPPED, str(limit), *argv]


def capped_memory(headroom: int = HEADROOM) -> None:
    """Caps this process's address space at what it maps now plus ``headroom``; run it in
    a child (as ``preexec_fn``, or first thing after a fork)."""
    # A fresh interpreter maps little before it imports torch: never cap below 6 GiB.
    cap_address_space(max(address_space() + headroom, DEFAULT_ADDRESS_SPACE))


def cap_address_space(limit: int = DEFAULT_ADDRESS_SPACE) -> None:
    """Caps this process's address space (`RLIMIT_AS`, soft and hard) at ``limit`` bytes.

    Never raises a lower existing hard limit.
    """
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def address_space() -> int:
    """This process's current address space in bytes (`VmSize`; Linux only)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmSize")
