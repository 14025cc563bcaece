"""Plan benchmarks: `explain` of a 20k-action plan over 10k values (alone, and with all
of its action records built), and preflight plus execution of 10k ensure/drop actions
on the host, net of the sources' own loads (alone, and with every transition record of
the report built and read).

Run: python tests/benchmarks/bench_plans.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from fhelium.residency import (
    PAGEABLE_HOST,
    DropResident,
    EnsureResident,
    Recoverability,
    ReplicaMode,
    ResidencyManager,
    ResidencyPlan,
    ResidencyValueSpec,
)
from fhelium.values import ResidentTensor

SPEC = ResidencyValueSpec(
    ResidentTensor, 32, 32, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
)


class CachedSource:
    """Returns one host value: the load itself costs next to nothing."""

    def __init__(self) -> None:
        self.value = ResidentTensor(torch.zeros(8))

    def load(self) -> ResidentTensor:
        return self.value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus; python {platform.python_version()}"
    )
    print(f"torch {torch.__version__}; medians of {repeats} repeats\n")

    manager = ResidencyManager()
    handles = [manager.register_source(SPEC, CachedSource()) for _ in range(10_000)]
    plan = ResidencyPlan(
        "explain-20k",
        enter=[EnsureResident(handle, PAGEABLE_HOST) for handle in handles],
        exit=[DropResident(handle, PAGEABLE_HOST) for handle in handles],
    )
    # Each repeat explains afresh and then builds every action record, as a caller
    # reading the whole explanation does.
    explain_ms, build_ms, total_ms = [], [], []
    for _ in range(repeats):
        started = time.perf_counter()
        explanation = manager.explain(plan)
        explained = time.perf_counter()
        assert len(explanation.actions) == 20_000
        built = time.perf_counter()
        explain_ms.append((explained - started) * 1e3)
        build_ms.append((built - explained) * 1e3)
        total_ms.append((built - started) * 1e3)
        assert explanation.feasible
        del explanation

    # 10k actions: ensure 5k values from their sources, then drop them again.
    count = 5_000
    runners = [manager.register_source(SPEC, CachedSource()) for _ in range(count)]
    actions = [EnsureResident(handle, PAGEABLE_HOST) for handle in runners] + [
        DropResident(handle, PAGEABLE_HOST) for handle in runners
    ]
    per_action, per_action_read = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        manager.execute_actions(actions)
        per_action.append((time.perf_counter() - started) / len(actions) * 1e6)
    # The same, with every transition record of the report built and read.
    for _ in range(repeats):
        started = time.perf_counter()
        report = manager.execute_actions(actions)
        assert sum(transition.no_op for transition in report.transitions) == 0
        per_action_read.append((time.perf_counter() - started) / len(actions) * 1e6)
        del report

    rows = [
        ("explain, 20k actions over 10k values (ms)", statistics.median(explain_ms), 4.0),
        ("  then building its 20k action records (ms)", statistics.median(build_ms), None),
        ("explain plus building every action record (ms)", statistics.median(total_ms), 8.0),
        (
            "preflight + execution, 10k ensure/drop actions (us/action)",
            statistics.median(per_action),
            1.5,
        ),
        (
            "  the same, reading every transition record (us/action)",
            statistics.median(per_action_read),
            None,
        ),
    ]
    width = max(len(name) for name, _, _ in rows)
    for name, measured, target in rows:
        if target is None:
            print(f"{name:<{width}}  {measured:8.2f}")
        else:
            verdict = "ok" if measured <= target else "OVER"
            print(f"{name:<{width}}  {measured:8.2f}   target <= {target:g}   {verdict}")
    manager.close()


if __name__ == "__main__":
    main()
