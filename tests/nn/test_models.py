"""`fhelium.residency.nn.offload` on real model code: GPT-2 (tied head), Llama (grouped-query
attention, untied head), Mixtral (mixture of experts), T5 (encoder-decoder), an
`nn.Sequential` MLP and a small CNN, all tiny and random (tests/helpers/models.py).

Each runs on the simulated runtime with a device budget of a third of its weights (at
least its largest unit; see `device_budget`) and must show:
(a) logits and greedy ``generate`` exactly equal to the plain model's, and the module as it
    was after close;
(b) a device peak within the budget, with weights loaded more than once (the budget binds);
(c) with prefetch 0 and the schedule-aware policy, host-to-device bytes per forward after
    the first equal to Belady's rule over the recorded order (tests/helpers/belady.py);
(d) the same results from a sharded checkpoint loaded onto a meta model.
And: a ModuleList mixture of experts whose router changes the order of units; copies whose
events complete only when waited for.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fhelium.residency.nn import Offload, offload
from fhelium.residency.simulation import SimulatedRuntime, Timeline, use_runtime
from helpers.belady import belady_run
from helpers.models import (
    BUILDERS,
    MAX_NEW_TOKENS,
    TinyModel,
    build,
    device_budget,
    generate,
    outputs,
    routed_moe,
    weight_nbytes,
)

NAMES = tuple(BUILDERS)
# Forwards after the first in (c): enough for two periods of a two-pass steady state.
FORWARDS = 4


@pytest.fixture(autouse=True)
def _simulated() -> Iterator[None]:
    # A timeline: each copy and kernel ends at a virtual time, and its event completes once
    # the host clock gets there, as on a GPU (test_pending_events_are_waited_for covers a
    # runtime whose events complete only when waited for).
    with use_runtime(SimulatedRuntime(1, timeline=Timeline())), torch.no_grad():
        yield


def _expected(tiny: TinyModel) -> tuple[torch.Tensor, Any]:
    logits = outputs(tiny.model, tiny.inputs)
    generated = generate(tiny.model, tiny.generate_inputs) if tiny.generate_inputs else None
    return logits, generated


def _assert_same(
    tiny: TinyModel, model: torch.nn.Module, expected: tuple[torch.Tensor, Any]
) -> None:
    logits, generated = expected
    got = outputs(model, tiny.inputs)
    assert torch.equal(got, logits), f"{tiny.name}: offloaded logits differ from the plain model's"
    if generated is None:
        return
    sequences, step_logits = generate(model, tiny.generate_inputs or {})
    assert torch.equal(sequences, generated[0]), (
        f"{tiny.name}: greedy generate gave {sequences.tolist()}, plain {generated[0].tolist()}"
    )
    assert len(step_logits) == len(generated[1]) == MAX_NEW_TOKENS
    for index, (got_step, want_step) in enumerate(zip(step_logits, generated[1], strict=True)):
        assert torch.equal(got_step, want_step), f"{tiny.name}: generate step {index} logits"


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("name", NAMES)
def test_outputs_equal_the_plain_model(name: str) -> None:
    tiny = build(name)
    expected = _expected(tiny)
    before = _state(tiny.model)
    budget = device_budget(tiny.model)
    assert budget < weight_nbytes(tiny.model), "the budget must not hold the whole model"
    with offload(tiny.model, device="cuda:0", budget=budget) as off:
        _assert_same(tiny, tiny.model, expected)
    # Closed: every parameter and buffer back on the CPU with its bytes.
    after = tiny.model.state_dict()
    assert after.keys() == before.keys()
    for key, tensor in before.items():
        assert after[key].device.type == "cpu", key
        assert torch.equal(after[key], tensor), key
    assert off.stats().forwards >= 1


@pytest.mark.parametrize("name", NAMES)
def test_device_peak_within_the_budget(name: str) -> None:
    tiny = build(name)
    budget = device_budget(tiny.model)
    with offload(tiny.model, device="cuda:0", budget=budget) as off:
        for _ in range(2):
            outputs(tiny.model, tiny.inputs)
        if tiny.generate_inputs is not None:
            generate(tiny.model, tiny.generate_inputs)
        stats = off.stats()
    assert 0 < stats.device_peak_bytes <= budget, (stats, budget)
    # Two forwards through a budget a third of the weights reload some of them.
    assert stats.h2d_bytes > weight_nbytes(tiny.model), (stats, weight_nbytes(tiny.model))


def _device_sizes(off: Offload) -> tuple[dict[Hashable, int], frozenset[Hashable]]:
    """Each managed value's charge, and the values materialised at the device now."""
    sizes: dict[Hashable, int] = {}
    resident: set[Hashable] = set()
    for value in off.manager.snapshot().values:
        if value.discarded:
            continue
        sizes[value.handle] = value.spec.storage_nbytes
        if any(m.location == off.location for m in value.materializations):
            resident.add(value.handle)
    return sizes, frozenset(resident)


@pytest.mark.parametrize("name", NAMES)
def test_h2d_bytes_per_forward_are_beladys(name: str) -> None:
    tiny = build(name)
    budget = device_budget(tiny.model)
    with offload(
        tiny.model, device="cuda:0", budget=budget, prefetch=0, policy="schedule-aware"
    ) as off:
        outputs(tiny.model, tiny.inputs)  # recorded
        schedule = off.schedule
        handles = {unit.name: unit.handles for unit in off.units}
        sizes, resident = _device_sizes(off)
        steps = [frozenset(h for unit in step for h in handles[unit]) for step in schedule]
        per_forward = []
        for _ in range(FORWARDS):
            before = off.stats().h2d_bytes
            outputs(tiny.model, tiny.inputs)
            per_forward.append(off.stats().h2d_bytes - before)
        stats = off.stats()
    assert stats.rerecords == 0, "the same input took another order"
    assert off.schedule == schedule
    # The reference starts where the offload stood after its first forward.
    reference = belady_run(steps, sizes, budget, resident=resident, passes=FORWARDS)
    # The budget binds (weights reload), and the rule keeps some of them (LRU would not).
    total = sum(sizes.values())
    assert 0 < sum(reference.steady) < total * len(reference.steady), (reference, total)
    assert per_forward == list(reference.pass_bytes[:FORWARDS]), (
        f"{name}: h2d bytes per forward {per_forward}, Belady {reference.pass_bytes[:FORWARDS]}"
        f" (steady {reference.steady}), budget {budget}, {len(schedule)} steps"
    )


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_onto_a_meta_model(name: str, tmp_path: Path) -> None:
    tiny = build(name)
    expected = _expected(tiny)
    budget = device_budget(tiny.model)
    checkpoint = tiny.save(tmp_path / name)
    meta = tiny.build_meta()
    assert all(parameter.is_meta for parameter in meta.parameters())
    with offload(meta, device="cuda:0", budget=budget, checkpoint=checkpoint) as off:
        _assert_same(tiny, meta, expected)
        stats = off.stats()
    assert 0 < stats.device_peak_bytes <= budget, (stats, budget)
    # Closed: the parameters are back on meta, none materialised on the CPU.
    assert all(parameter.is_meta for parameter in meta.parameters())


def test_a_router_that_changes_the_order() -> None:
    # transformers' Mixtral runs each layer's experts as one module (fused parameters), so
    # its order never changes; a ModuleList MoE runs only the experts its router picked.
    model, inputs = routed_moe()
    expected = [model(x) for x in inputs]
    budget = device_budget(model)
    assert budget < weight_nbytes(model)
    with offload(model, device="cuda:0", budget=budget) as off:
        for x, want in zip((*inputs, *inputs), (*expected, *expected), strict=True):
            assert torch.equal(model(x), want)
        stats = off.stats()
    assert 0 < stats.device_peak_bytes <= budget, (stats, budget)
    assert stats.forwards == 2 * len(inputs)
    # Each input after the first took another order than the one recorded before it.
    assert stats.rerecords >= 1, stats


@pytest.mark.parametrize("name", NAMES)
def test_pending_events_are_waited_for(name: str) -> None:
    # Events that complete only when someone waits for them: the host ran ahead of the
    # device. A unit's released lease stays protected until its event completes, so a step
    # that needs its room must wait for it, never report the budget as too small.
    tiny = build(name)
    expected = outputs(tiny.model, tiny.inputs)
    budget = device_budget(tiny.model)
    with use_runtime(SimulatedRuntime(1)), offload(tiny.model, budget=budget) as off:
        for _ in range(2):
            assert torch.equal(outputs(tiny.model, tiny.inputs), expected)
        stats = off.stats()
    assert 0 < stats.device_peak_bytes <= budget, (stats, budget)
