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
