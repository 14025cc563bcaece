"""Records built in bulk by the extension (snapshot value entries, explanation actions)
are exactly the records their validating constructors build."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
import torch

from fhelium import _core
from fhelium.residency import (
    PAGEABLE_HOST,
    DiscardValue,
    DropResident,
    EnsureResident,
    MoveResident,
    Recoverability,
    ReplicaMode,
    ResidencyManager,
    ResidencyPlan,
    ResidencyValueSpec,
)
from fhelium.residency._records import bulk_builder
from fhelium.residency.snapshot import (
    MaterializationSnapshot,
    ResidencyActionExplanation,
    ResidencyValueSnapshot,
)
from fhelium.values import ResidentTensor
from helpers.manager import CUDA0, sim_fixture, stream  # noqa: F401

SPEC = ResidencyValueSpec(
    ResidentTensor, 32, 32, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
)


class _Source:
    def load(self) -> ResidentTensor:
        return ResidentTensor(torch.zeros(8))


def _rebuilt(record: Any) -> Any:
    """The same record through its public, validating constructor."""
    cls = type(record)
    return cls(**{field.name: getattr(record, field.name) for field in dataclasses.fields(cls)})


def _check(record: Any, cls: type) -> None:
    assert type(record) is cls
    rebuilt = _rebuilt(record)
    assert record == rebuilt
    assert hash(record) == hash(rebuilt)
    assert repr(record) == repr(rebuilt)
    assert pickle.loads(pickle.dumps(record)) == record
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.extra = 1


def _manager() -> tuple[ResidencyManager, list[Any]]:
    manager = ResidencyManager()
    handles = [manager.register_source(SPEC, _Source()) for _ in range(4)]
    handles.append(manager.adopt(ResidentTensor(torch.zeros(4))))
    manager.ensure(handles[0], PAGEABLE_HOST)
    manager.ensure(handles[1], PAGEABLE_HOST)
    manager.ensure(handles[1], CUDA0)
    manager.discard(handles[2])
    return manager, handles


def test_value_entries_are_plain_records(sim: Any) -> None:
    manager, _ = _manager()
    values = manager.snapshot().values
    assert type(values) is tuple
    assert len(values) == 5
    for value in values:
        _check(value, ResidencyValueSnapshot)
        assert type(value.materializations) is tuple
        for materialization in value.materializations:
            _check(materialization, MaterializationSnapshot)
    assert [len(value.materializations) for value in values] == [1, 2, 0, 0, 1]
    assert values[2].discarded
    assert not values[2].has_source
    assert values[3].source_location == PAGEABLE_HOST
    assert values[3].has_source
    assert values[1].materializations[1].location == CUDA0
    # Equal materialisations of values sharing a spec are one immutable record.
    assert values[0].materializations[0] is values[1].materializations[0]
    manager.close()


def test_action_entries_are_plain_records(sim: Any) -> None:
    manager, handles = _manager()
    plan = ResidencyPlan(
        "bulk",
        reclaim=[DropResident(handles[1], CUDA0)],
        enter=[
            EnsureResident(handles[0], PAGEABLE_HOST),
            MoveResident(handles[3], CUDA0),
        ],
        exit=[DiscardValue(handles[4]), EnsureResident(handles[2], PAGEABLE_HOST)],
    )
    explanation = manager.explain(plan)
    actions = explanation.actions
    assert type(actions) is tuple
    assert len(actions) == 5
    ordered = (*plan.reclaim, *plan.enter, *plan.exit)
    for action, explained in zip(ordered, actions, strict=True):
        _check(explained, ResidencyActionExplanation)
        assert explained.action is action
    assert actions[1].no_op
    assert actions[1].reason == "destination already resident"
    assert not actions[4].executable
    assert actions[4].reason == explanation.reason
    assert pickle.loads(pickle.dumps(explanation)) == explanation
    manager.close()


def test_builder_refuses_a_class_it_cannot_fill(sim: Any) -> None:
    names = [field.name for field in dataclasses.fields(MaterializationSnapshot)]
    with pytest.raises(ValueError, match="proper subclass"):
        _core.RecordBuilder(MaterializationSnapshot, MaterializationSnapshot, names)
    with pytest.raises(ValueError, match="proper subclass"):
        _core.RecordBuilder(MaterializationSnapshot, ResidencyValueSnapshot, names)
    builder = bulk_builder(MaterializationSnapshot)
    assert builder.record_class is MaterializationSnapshot
    # A builder for the wrong record class is refused before anything is built.
    manager, _ = _manager()
    view, _ = manager._engine.core.snapshot_state()
    with pytest.raises(ValueError, match="fields"):
        view.value_entries(manager._engine.core, builder, builder, lambda code: None)
    manager.close()


def test_one_record_call_is_the_validating_constructor_s_record(sim: Any) -> None:
    builder = bulk_builder(ResidencyActionExplanation)
    fields = dataclasses.fields(ResidencyActionExplanation)
    manager, handles = _manager()
    action = EnsureResident(handles[0], PAGEABLE_HOST)
    values = {
        "action": action,
        "executable": True,
        "no_op": False,
        "source": None,
        "destination": PAGEABLE_HOST,
        "logical_nbytes": 32,
        "storage_nbytes": 32,
        "reason": None,
    }
    record = builder(*[values[field.name] for field in fields])
    _check(record, ResidencyActionExplanation)
    assert record == ResidencyActionExplanation(**values)
    # One record's fields, all of them, positionally.
    with pytest.raises(TypeError, match="fields"):
        builder(action)
    with pytest.raises(TypeError):
        builder(**values)
    manager.close()


def test_lazily_built_records_compare_as_their_plain_records(sim: Any) -> None:
    # A decision, its explanation and a report are built by one native call each over
    # private slots: they equal, hash and pickle as the records their public
    # constructors build, and are frozen.
    from fhelium.residency import ResidencyController, ResidencyRequest, ResidencyRequirement

    manager, handles = _manager()
    controller = ResidencyController(manager)
    request = ResidencyRequest("r", [ResidencyRequirement(handles[0], CUDA0)])
    decision = controller.decide(request)
    plain = type(decision)(
        **{field.name: getattr(decision, field.name) for field in dataclasses.fields(decision)}
    )
    assert decision == plain
    assert hash(decision) == hash(plain)
    assert pickle.loads(pickle.dumps(decision)) == decision
    assert decision.evictions == ()
    assert decision.plan.enter == (EnsureResident(handles[0], CUDA0),)
    explanation = decision.explanation
    assert explanation.feasible
    assert explanation == _rebuilt(explanation)
    assert pickle.loads(pickle.dumps(explanation)) == explanation
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.request = request  # type: ignore[misc]
    with controller.use(request, consumer_streams={CUDA0: stream(sim, 0)}) as use:
        pass
    report = use.report
    assert report.plan_name == "r"
    assert report == _rebuilt(report)
    assert pickle.loads(pickle.dumps(report)) == report
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.plan_name = "s"  # type: ignore[misc]
    manager.close()


class _FakeSimulation:
    """What `RecordBuilder.explanation` reads off a simulation: ``feasible``,
    ``reason``, ``peaks()`` (only when no peaks are given) and, once the actions are
    read, ``action_entries``."""

    def __init__(self, peaks: list[tuple[int, int]] | None) -> None:
        self.feasible = False
        self.reason = "over budget"
        self._peaks = peaks
        self.entries = 0

    def peaks(self) -> list[tuple[int, int]]:
        assert self._peaks is not None, "peaks were given: the simulation's are not read"
        return self._peaks

    def action_entries(self, actions: Any, builder: Any, location_of: Any) -> tuple[Any, ...]:
        self.entries += 1
        return ()


def test_explanation_builder_is_the_validating_constructor_s_record(sim: Any) -> None:
    # `RecordBuilder.explanation` builds a decision's or `explain`'s explanation in one
    # native call: the very record the public constructor builds from the same fields,
    # its peaks' locations the shared location records, its actions built when read.
    from fhelium.residency import PINNED_HOST, MemoryReservation
    from fhelium.residency._plans import explanation_of
    from fhelium.residency.snapshot import ResidencyPlanExplanation

    manager, handles = _manager()
    reservation = MemoryReservation(CUDA0, 16, "headroom")
    empty = ResidencyPlan("empty", reservations=[reservation])
    for given in (None, [(1, 64), (2, 0)]):
        simulation = _FakeSimulation(None if given else [(1, 64), (2, 0)])
        explanation = explanation_of(empty, simulation, given)
        plain = ResidencyPlanExplanation(
            "empty", (), (reservation,), ((PINNED_HOST, 64), (CUDA0, 0)), False, "over budget"
        )
        assert explanation == plain
        assert plain == explanation
        assert hash(explanation) == hash(plain)
        assert repr(explanation) == repr(plain)
        assert pickle.loads(pickle.dumps(explanation)) == plain
        assert type(pickle.loads(pickle.dumps(explanation))) is ResidencyPlanExplanation
        assert explanation.predicted_peak_bytes[0][0] is PINNED_HOST
        assert type(explanation.predicted_peak_bytes) is tuple
        # A plan without actions explains none, without asking the simulation.
        assert explanation.actions == ()
        assert simulation.entries == 0
        with pytest.raises(dataclasses.FrozenInstanceError):
            explanation.feasible = True  # type: ignore[misc]
    acting = ResidencyPlan("acting", enter=[EnsureResident(handles[0], CUDA0)])
    simulation = _FakeSimulation([(1, 64)])
    explanation = explanation_of(acting, simulation)
    assert simulation.entries == 0
    assert explanation.actions == ()
    assert explanation.actions == ()
    assert simulation.entries == 1  # built on first read, once
    manager.close()


def test_explanation_builder_asks_each_location_function_for_its_records(sim: Any) -> None:
    # The builder keeps the location records it was given, per code, for the function
    # that gave them: another function is asked again.
    from fhelium.residency import PINNED_HOST
    from fhelium.residency._locations import location_of
    from fhelium.residency._plans import _Explanation

    names = [
        "plan_name",
        "reservations",
        "predicted_peak_bytes",
        "feasible",
        "reason",
        "_actions",
        "_plan",
        "_simulation",
    ]
    builder = bulk_builder(_Explanation, names)
    plan = ResidencyPlan("p")
    asked: list[int] = []

    def pageable(code: int) -> Any:
        asked.append(code)
        return PAGEABLE_HOST

    first = builder.explanation(location_of, plan, _FakeSimulation([(1, 8)]))
    assert first.predicted_peak_bytes == ((PINNED_HOST, 8),)
    other = builder.explanation(pageable, plan, _FakeSimulation([(1, 8), (0, 4)]))
    assert other.predicted_peak_bytes == ((PAGEABLE_HOST, 8), (PAGEABLE_HOST, 4))
    assert asked == [1, 0]
    again = builder.explanation(pageable, plan, _FakeSimulation([(0, 2), (1, 3)]))
    assert again.predicted_peak_bytes == ((PAGEABLE_HOST, 2), (PAGEABLE_HOST, 3))
    assert asked == [1, 0]
    # A builder of another record is refused before anything is built.
    with pytest.raises(ValueError, match="fields"):
        bulk_builder(MaterializationSnapshot).explanation(
            location_of, plan, _FakeSimulation([(1, 8)])
        )
