"""The search's memory is bounded whatever `search_state_limit` says
(docs/concepts/controller.md#search-bounds).

A child process (`helpers/search_child.py`) gets 512 MiB of address space beyond what it
holds once its manager is set up, then runs a search with a limit of 10**12 states: a deep
one (two tiers pointing at each other, one level deeper per state) must stop at the depth
bound, a wide one (subsets of 40 droppable values, each exhausted one remembered) at the
memo's memory bound, both with `ResidencySearchLimitError`, never `MemoryError` or a crash.
Before the bounds the deep search grew by about 10 KiB a state until the kernel killed it;
the deep one reaches the whole depth bound (131072 open states) and the path it holds stays
under the documented 150 MiB (about 1.1 KB a level; on the native stack it took about
4.7 KB a level, and the depth bound was 16384).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.limits import capped

CHILD = Path(__file__).resolve().parent.parent / "helpers" / "search_child.py"
HEADROOM = 512 << 20
# controller.md#search-bounds: MAX_SEARCH_DEPTH and what a path of that many levels may hold.
MAX_SEARCH_DEPTH = 131_072
DEEP_PATH_BYTES = 150 << 20


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status")
@pytest.mark.parametrize(("shape", "bound"), [("deep", "depth"), ("wide", "memory")])
def test_a_huge_state_limit_stays_within_the_search_bounds(shape: str, bound: str) -> None:
    done = subprocess.run(
        capped([sys.executable, str(CHILD), shape, str(10**12), str(HEADROOM)]),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.stdout, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert lines[0] == "searching", done.stdout
    outcome = lines[1].split()
    assert outcome[0] == "limit", done.stdout
    assert outcome[2] == bound, done.stdout
    assert 0 < int(outcome[1]) < 10**12
    grown = int(lines[2].split()[1])
    assert grown < HEADROOM, done.stdout
    if shape == "deep":
        assert int(outcome[1]) == MAX_SEARCH_DEPTH, done.stdout
        assert grown < DEEP_PATH_BYTES, done.stdout
