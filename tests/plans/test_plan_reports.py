"""Plan reports whose transition records are built when first read
(docs/concepts/plans.md#reports), and the plan entry points as single core calls.

A plan run keeps its committed transitions as plain data in the core; the report's
`transitions` builds their records on first access. These tests pin that the lazily
built report is indistinguishable from the record users could build themselves, that
the trace and the report share one record per transition, and the rule the core's
execution relies on: a plan that ends a value before a later action names it never
passes its preflight.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from fhelium.errors import ResidencyPlanError, ResidencyPlanExecutionError
from fhelium.residency.location import PAGEABLE_HOST
from fhelium.residency.manager import ResidencyManager, ResidencyScope
from fhelium.residency.plan import (
    DiscardValue,
    DropResident,
    EnsureResident,
    MemoryReservation,
    ResidencyPlan,
)
from fhelium.residency.snapshot import ResidencyPlanReport, ResidencyTransitionReport
from helpers.manager import Source, fresh, spec


def _plan_report(manager: ResidencyManager) -> tuple[ResidencyPlanReport, list[object]]:
    handles = [manager.register_source(spec(), Source(fresh())) for _ in range(3)]
    actions = [EnsureResident(handle, PAGEABLE_HOST) for handle in handles]
    actions += [DropResident(handle, PAGEABLE_HOST) for handle in handles]
    return manager.execute_actions(actions, name="lazy"), list(actions)


def test_report_reads_like_the_record_built_from_its_fields() -> None:
    manager = ResidencyManager()
    report, actions = _plan_report(manager)
    assert isinstance(report, ResidencyPlanReport)
    assert [transition.action for transition in report.transitions] == actions
    assert all(type(t) is ResidencyTransitionReport for t in report.transitions)
    assert [t.no_op for t in report.transitions] == [False] * 6
    plain = ResidencyPlanReport(
        report.plan_name, report.transitions, report.started_at_ns, report.completed_at_ns
    )
    assert report == plain
    assert plain == report
    assert hash(report) == hash(plain)
    assert repr(report) == repr(plain)
    assert repr(report).startswith("ResidencyPlanReport(plan_name='lazy', transitions=(")
    assert dataclasses.astuple(report) == dataclasses.astuple(plain)
    assert pickle.loads(pickle.dumps(report)) == plain
    assert copy.copy(report) == plain
    assert dataclasses.replace(report, plan_name="other") == dataclasses.replace(
        plain, plan_name="other"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.transitions = ()  # type: ignore[misc]


def test_report_differs_from_a_report_with_other_transitions() -> None:
    manager = ResidencyManager()
    first, _ = _plan_report(manager)
    second, _ = _plan_report(manager)
    assert first != second
    assert first.transitions != second.transitions


def test_trace_and_report_share_one_record_per_transition() -> None:
    manager = ResidencyManager()
    report, _ = _plan_report(manager)
    # The trace read first: the report's records are the very same objects.
    traced = manager.trace()[-6:]
    assert all(a is b for a, b in zip(traced, report.transitions, strict=True))
    assert report.transitions is report.transitions


def test_report_read_after_the_manager_closed() -> None:
    manager = ResidencyManager()
    report, actions = _plan_report(manager)
    manager.close()
    assert [transition.action for transition in report.transitions] == actions


def test_scope_report_is_built_when_read() -> None:
    manager = ResidencyManager()
    handle = manager.register_source(spec(), Source(fresh()))
    plan = ResidencyPlan(
        "scoped",
        enter=[EnsureResident(handle, PAGEABLE_HOST)],
        exit=[DropResident(handle, PAGEABLE_HOST)],
        reservations=[MemoryReservation(PAGEABLE_HOST, 4, "scratch")],
    )
    with ResidencyScope(manager, plan) as scope:
        pass
    report = scope.report
    assert report is not None
    assert [type(t.action) for t in report.transitions] == [EnsureResident, DropResident]
    assert report == ResidencyPlanReport(
        "scoped", report.transitions, report.started_at_ns, report.completed_at_ns
    )


def test_partial_report_of_a_failed_plan_holds_the_committed_prefix() -> None:
    manager = ResidencyManager()
    handle = manager.register_source(spec(), Source(fresh()))

    def refuse() -> None:
        raise OSError("the source is gone")

    failing = Source(fresh(), before_load=refuse)
    broken = manager.register_source(spec(), failing)
    actions = [EnsureResident(handle, PAGEABLE_HOST), EnsureResident(broken, PAGEABLE_HOST)]
    with pytest.raises(ResidencyPlanExecutionError) as raised:
        manager.execute_actions(actions)
    assert raised.value.failed_action_index == 1
    assert [t.action for t in raised.value.partial_report.transitions] == actions[:1]
    # The committed prefix stays committed.
    assert manager.snapshot().values[0].materializations[0].location == PAGEABLE_HOST


def test_a_plan_that_ends_a_value_before_naming_it_again_never_runs() -> None:
    manager = ResidencyManager()
    handle = manager.register_source(spec(), Source(fresh()))
    version = manager.state_version
    for actions in (
        [DiscardValue(handle), EnsureResident(handle, PAGEABLE_HOST)],
        [
            EnsureResident(handle, PAGEABLE_HOST),
            DiscardValue(handle),
            DropResident(handle, PAGEABLE_HOST),
        ],
    ):
        with pytest.raises(ResidencyPlanError):
            manager.execute_actions(actions)
        assert manager.state_version == version


def test_a_plan_resolved_before_follows_discards_and_managers() -> None:
    # A plan keeps its handles' last resolution; it must never outlive a discard or
    # carry over to another manager.
    first = ResidencyManager()
    handle = first.register_source(spec(), Source(fresh()))
    plan = ResidencyPlan("again", enter=[EnsureResident(handle, PAGEABLE_HOST)])
    assert first.explain(plan).feasible
    second = ResidencyManager()
    foreign = second.explain(plan)
    assert not foreign.feasible
    assert "belongs to manager" in (foreign.reason or "")
    assert first.explain(plan).feasible
    other = first.register_source(spec(), Source(fresh()))
    first.discard(other)
    assert first.explain(plan).feasible
    first.discard(handle)
    ended = first.explain(plan)
    assert not ended.feasible
    assert "discarded" in (ended.reason or "")
    with pytest.raises(ResidencyPlanError, match="discarded"), ResidencyScope(first, plan):
        pass
