"""The seam's optional `copy_to_cuda_measured` (docs/architecture.md#the-device-seam): a
runtime that gives a CUDA copy's facts with the copy spares the manager a second call
to measure it, and those facts are exactly what `measure` says of the copy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fhelium.residency import PINNED_HOST, ReplicaMode, ResidencyManager, cuda_location
from fhelium.residency._runtime import ValueFacts
from fhelium.residency.simulation import SimulatedRuntime, Timeline, use_runtime
from fhelium.values import ResidentTensor, TensorBundle, TensorResident, TensorSequence

CUDA0 = torch.device("cuda", 0)
ON_CUDA0 = cuda_location("cuda:0")


def _shared() -> TensorResident:
    base = torch.arange(16, dtype=torch.float32)
    return TensorBundle({"a": base[:8], "b": base[8:].view(torch.int32)})


# Each builds a value on `runtime`: where it lives and how its storage is laid out vary.
VALUES: dict[str, Callable[[SimulatedRuntime], TensorResident]] = {
    "pinned": lambda rt: rt.pin(ResidentTensor(torch.arange(8.0))),
    "pageable": lambda rt: ResidentTensor(torch.arange(8.0)),
    "view of a larger storage": lambda rt: ResidentTensor(torch.arange(64.0)[8:12]),
    "empty": lambda rt: ResidentTensor(torch.zeros(0)),
    "parameter": lambda rt: ResidentTensor(torch.nn.Parameter(torch.ones(3))),
    "shared storage": lambda rt: _shared(),
    "sequence": lambda rt: TensorSequence([torch.ones(2), torch.zeros(3, dtype=torch.int64)]),
    "on cuda:1": lambda rt: rt.to_device(ResidentTensor(torch.arange(4.0)), 1),
    "on cuda:0": lambda rt: rt.to_device(ResidentTensor(torch.arange(4.0)), 0),
}

RUNTIMES: dict[str, Callable[[], SimulatedRuntime]] = {
    "auto_complete": lambda: SimulatedRuntime(2, auto_complete=True),
    "pending events": lambda: SimulatedRuntime(2),
    "timeline": lambda: SimulatedRuntime(2, timeline=Timeline()),
}


@pytest.mark.parametrize("make_runtime", RUNTIMES.values(), ids=list(RUNTIMES))
@pytest.mark.parametrize("make_value", VALUES.values(), ids=list(VALUES))
def test_the_facts_are_what_measure_says_of_the_copy(
    make_runtime: Callable[[], SimulatedRuntime],
    make_value: Callable[[SimulatedRuntime], TensorResident],
) -> None:
    runtime = make_runtime()
    value = make_value(runtime)
    stream = runtime.create_stream(CUDA0)
    runtime.calls.clear()
    copy, facts = runtime.copy_to_cuda_measured(value, CUDA0, stream, non_blocking=True)
    assert type(facts) is ValueFacts
    assert facts == runtime.measure(copy)
    assert runtime.placement(copy) == ON_CUDA0
    # One seam call, the copy's: counted and logged as `copy_to_cuda`.
    assert runtime.calls == {"copy_to_cuda": 1, "measure": 1}
    assert [(c.destination, c.stream, c.non_blocking) for c in runtime.copies] == [
        (ON_CUDA0, stream, True)
    ]
    # The copy is the value's, as `copy_to_cuda` makes it.
    for got, want in zip(copy._resident_tensors, value._resident_tensors, strict=True):
        assert torch.equal(got.detach(), want.detach())
        assert got.requires_grad == want.requires_grad


def test_it_is_the_copy_to_cuda_seam_call() -> None:
    runtime = SimulatedRuntime(1)
    stream = runtime.current_stream(CUDA0)
    runtime.fail_next("copy_to_cuda", ValueError("injected"))
    with pytest.raises(ValueError, match="injected"):
        runtime.copy_to_cuda_measured(
            ResidentTensor(torch.ones(2)), CUDA0, stream, non_blocking=False
        )
    assert runtime.calls["copy_to_cuda"] == 1
    assert runtime.copies == []
    other = SimulatedRuntime(1).current_stream(CUDA0)
    copy, facts = runtime.copy_to_cuda_measured(
        ResidentTensor(torch.ones(2)), CUDA0, other, non_blocking=False
    )
    assert facts == runtime.measure(copy)  # an equal device's stream, as copy_to_cuda takes
    with pytest.raises(ValueError, match="not on"):
        runtime.copy_to_cuda_measured(
            ResidentTensor(torch.ones(2)),
            CUDA0,
            SimulatedRuntime(2).current_stream(torch.device("cuda", 1)),
            non_blocking=False,
        )


class OwnCopies(SimulatedRuntime):
    """Copies its own way: every copy to a device is logged here."""

    def __init__(self) -> None:
        super().__init__(1)
        self.made: list[TensorResident] = []

    def copy_to_cuda(
        self, value: TensorResident, device: torch.device, stream: Any, *, non_blocking: bool
    ) -> TensorResident:
        made = super().copy_to_cuda(value, device, stream, non_blocking=non_blocking)
        self.made.append(made)
        return made


def test_a_replaced_copy_or_measure_gives_the_copy_without_facts() -> None:
    runtime = OwnCopies()
    stream = runtime.current_stream(CUDA0)
    copy, facts = runtime.copy_to_cuda_measured(
        ResidentTensor(torch.ones(2)), CUDA0, stream, non_blocking=True
    )
    assert (runtime.made, facts) == ([copy], None)
    plain = SimulatedRuntime(1)
    measured: list[TensorResident] = []

    def measure(value: TensorResident) -> ValueFacts:
        measured.append(value)
        return SimulatedRuntime.measure(plain, value)

    plain.measure = measure  # type: ignore[method-assign]
    copy, facts = plain.copy_to_cuda_measured(
        ResidentTensor(torch.ones(2)), CUDA0, plain.current_stream(CUDA0), non_blocking=True
    )
    assert facts is None
    assert measured == []  # left to the replacement, after the copy is waited for


class WithoutMeasuredCopies:
    """A runtime without the capability: a simulated one's seam, but for that method."""

    def __init__(self, inner: SimulatedRuntime) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "copy_to_cuda_measured":
            raise AttributeError(name)
        return getattr(self.inner, name)


@pytest.mark.parametrize("capable", [True, False], ids=["measured copies", "without"])
def test_the_manager_charges_the_measured_truth(capable: bool) -> None:
    simulated = SimulatedRuntime(1, auto_complete=True)
    runtime: Any = simulated if capable else WithoutMeasuredCopies(simulated)
    assert hasattr(runtime, "copy_to_cuda_measured") is capable
    base = torch.arange(64.0)
    with use_runtime(runtime), ResidencyManager({ON_CUDA0: 1 << 20}) as manager:
        # A view of a larger storage: the copy keeps the layout, so its storage bytes
        # (what is measured) are the whole storage's, not the view's.
        handle = manager.adopt(
            simulated.pin(ResidentTensor(base[8:12])), replica_mode=ReplicaMode.REPLICABLE
        )
        simulated.calls.clear()
        manager.ensure(handle, ON_CUDA0)
        # Measured with the copy, or by a second call after it.
        assert simulated.calls["copy_to_cuda"] == 1
        assert simulated.calls["measure"] == (0 if capable else 1)
        (entry,) = manager.snapshot().values
        by_location = {m.location: m for m in entry.materializations}
        assert set(by_location) == {PINNED_HOST, ON_CUDA0}
        assert by_location[ON_CUDA0].storage_nbytes == base.untyped_storage().nbytes() == 256
        assert by_location[ON_CUDA0].logical_nbytes == 16
        assert simulated.memory_allocated(CUDA0) == 256
        consumer = simulated.current_stream(CUDA0)
        with manager.acquire([handle], at=ON_CUDA0, consumer_stream=consumer) as values:
            assert simulated.placement(values[handle]) == ON_CUDA0
            assert torch.equal(values[handle].tensor, base[8:12])
