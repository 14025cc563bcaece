"""The GPU check is sized for a short device lease: its stages' time budgets add up to
five minutes at most, so a rerun fits in the same lease, and it checks the lease
guarantee functionally rather than with a tool that cannot see the hazard."""

from __future__ import annotations

import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"


def _commands() -> list[str]:
    return [
        line
        for line in SCRIPT.read_text(encoding="utf-8").splitlines()
        if not line.lstrip().startswith("#")
    ]


def test_stage_budgets_add_up_to_five_minutes_at_most() -> None:
    budgets = [
        int(seconds) for line in _commands() for seconds in re.findall(r"\btimeout (\d+)\b", line)
    ]
    assert len(budgets) >= 5, "every stage runs under its own timeout"
    assert sum(budgets) <= 300


def test_the_lease_guarantee_is_checked_by_a_kernel_not_racecheck() -> None:
    commands = "\n".join(_commands())
    assert "compute-sanitizer" not in commands
    assert "released_lease_protects" in commands
