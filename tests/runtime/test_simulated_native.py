"""The simulated runtime's native calls (docs/concepts/simulation.md#native-calls): a
`SimulatedRuntime` does the common case of its hottest seam methods natively, and the
manager's binding calls them directly only while the methods are the class's own.

Two things must hold: a method replaced on the instance (a test's spy) or on the class
is called, as before; and nothing observable differs from the Python methods (a
subclass, which never gets the native calls, is the reference)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fhelium.errors import ResidencyPlanExecutionError
from fhelium.residency import (
    PINNED_HOST,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    cuda_location,
)
from fhelium.residency.simulation import SimulatedRuntime, use_runtime
from fhelium.values import ResidentTensor, TensorBundle

CUDA0 = torch.device("cuda", 0)
ON_CUDA0 = cuda_location("cuda:0")
LAYERS = 6
NBYTES = 32


class PythonPath(SimulatedRuntime):
    """The same runtime, without native calls (only the exact class gets them)."""


def _layer(index: int, bundles: bool) -> Any:
    """Layer ``index``: one tensor of ``index`` (32 bytes), or with ``bundles`` a weight
    of ``index`` and a bias of ones (40 bytes, two storages)."""
    weight = torch.full((8,), float(index))
    if bundles:
        return TensorBundle({"weight": weight, "bias": torch.ones(2)})
    return ResidentTensor(weight)


def _read(value: Any) -> float:
    """What a step reads of its layer: the weight's first element plus the bias's sum."""
    if isinstance(value, TensorBundle):
        return float(value["weight"][0]) + float(value["bias"].sum())
    return float(value.tensor[0])


def _cycle(runtime: SimulatedRuntime, passes: int = 2, *, bundles: bool = False) -> dict[str, Any]:
    """A pipeline of pinned layers (`_layer`) cycling through a cuda:0 that holds half of
    them; returns what the runtime observed."""
    stream = runtime.current_stream(CUDA0)
    nbytes = 40 if bundles else NBYTES
    with use_runtime(runtime):
        manager = ResidencyManager({ON_CUDA0: LAYERS // 2 * nbytes, PINNED_HOST: 1 << 20})
    try:
        layers = [
            manager.adopt(
                runtime.pin(_layer(index, bundles)),
                at=PINNED_HOST,
                replica_mode=ReplicaMode.REPLICABLE,
            )
            for index in range(LAYERS)
        ]
        requests = [
            ResidencyRequest(
                f"step-{step}", [ResidencyRequirement(layers[step % LAYERS], ON_CUDA0)]
            )
            for step in range(LAYERS * passes)
        ]
        controller = ResidencyController(manager)
        read: list[float] = []
        samples: list[tuple[int, int] | None] = []
        runtime.calls.clear()
        with controller.run(requests, prefetch=1, consumer_streams={ON_CUDA0: stream}) as run:
            for step in run:
                value = step.value(step.request.requirements[0].handle, at=ON_CUDA0)
                assert runtime.placement(value) == ON_CUDA0
                read.append(_read(value))
                samples.append(runtime.memory_sample(CUDA0))
        return {
            "read": read,
            "samples": samples,
            "calls": dict(runtime.calls),
            "copies": [(copy.destination, copy.non_blocking) for copy in runtime.copies],
            "hazards": list(runtime.hazards),
            "pending": runtime.pending_event_count(),
            "after": runtime.memory_sample(CUDA0),
        }
    finally:
        manager.close()


@pytest.mark.parametrize("auto_complete", [True, False], ids=["auto-complete", "pending"])
def test_the_native_calls_observe_what_the_python_methods_do(auto_complete: bool) -> None:
    native = _cycle(SimulatedRuntime(1, auto_complete=auto_complete))
    python = _cycle(PythonPath(1, auto_complete=auto_complete))
    assert native == python
    assert native["read"] == [float(step % LAYERS) for step in range(2 * LAYERS)]
    assert native["calls"]["copy_to_cuda"] >= LAYERS  # the copies were counted
    assert native["hazards"] == []


# Each seam method the binding may call natively, and a spy that stands in for it.
SEAM = ("copy_to_cuda", "copy_to_cuda_measured", "measure", "record_event", "event_query")


@pytest.fixture
def spied() -> list[str]:
    return []


def _spy(name: str, calls: list[str], original: Callable[..., Any]) -> Callable[..., Any]:
    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return original(*args, **kwargs)

    return spy


@pytest.mark.parametrize("name", SEAM)
def test_a_method_replaced_on_the_instance_is_called(name: str, spied: list[str]) -> None:
    runtime = SimulatedRuntime(1, auto_complete=True)
    setattr(runtime, name, _spy(name, spied, getattr(runtime, name)))
    result = _cycle(runtime)
    assert name in spied, f"{name} replaced on the instance was never called"
    assert result["read"] == [float(step % LAYERS) for step in range(2 * LAYERS)]
    # Put back: the native calls take over again, and the spy is no longer called.
    delattr(runtime, name)
    spied.clear()
    assert _cycle(runtime)["read"] == result["read"]
    assert spied == []


@pytest.mark.parametrize("name", SEAM)
def test_a_method_replaced_on_the_class_is_called(
    name: str, spied: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = SimulatedRuntime(1, auto_complete=True)
    original = getattr(SimulatedRuntime, name)
    monkeypatch.setattr(SimulatedRuntime, name, _spy(name, spied, original))
    result = _cycle(runtime)
    assert name in spied, f"{name} replaced on the class was never called"
    assert result["read"] == [float(step % LAYERS) for step in range(2 * LAYERS)]


def test_a_failure_queued_reaches_the_manager_through_the_native_calls() -> None:
    runtime = SimulatedRuntime(1, auto_complete=True)
    runtime.fail_next("copy_to_cuda", RuntimeError("injected"))
    with pytest.raises(ResidencyPlanExecutionError) as raised:
        _cycle(runtime)
    assert "injected" in repr(raised.value.__cause__)


# Values whose copy the native calls take (a plain one-tensor value on the host) or
# decline (everything else goes to the Python method): each must come out the same.
COPIED: dict[str, Callable[[SimulatedRuntime], Any]] = {
    "pinned": lambda rt: rt.pin(ResidentTensor(torch.arange(8.0))),
    "pageable": lambda rt: ResidentTensor(torch.arange(8.0)),
    "parameter": lambda rt: ResidentTensor(torch.nn.Parameter(torch.ones(3))),
    "requires grad": lambda rt: ResidentTensor(torch.ones(3, requires_grad=True)),
    "view of a larger storage": lambda rt: ResidentTensor(torch.arange(64.0)[8:12]),
    "not contiguous": lambda rt: ResidentTensor(torch.arange(16.0).view(4, 4).t()),
    "empty": lambda rt: ResidentTensor(torch.zeros(0)),
    "conjugate view": lambda rt: ResidentTensor(torch.ones(2, dtype=torch.complex64).conj()),
    "complex": lambda rt: ResidentTensor(torch.arange(3.0).mul(1 + 2j)),
    "conjugate resolved": lambda rt: ResidentTensor(
        torch.ones(2, dtype=torch.complex128).conj().resolve_conj()
    ),
    "conjugate set as data": lambda rt: ResidentTensor(_with_data(_conjugate)),
    "negative view": lambda rt: ResidentTensor(torch._neg_view(torch.arange(3.0))),
    "negative imaginary part": lambda rt: ResidentTensor(_conjugate().imag),
    "float16": lambda rt: ResidentTensor(torch.arange(4, dtype=torch.float16)),
    "int64": lambda rt: ResidentTensor(torch.arange(5)),
    "on cuda:0": lambda rt: rt.to_device(ResidentTensor(torch.arange(4.0)), 0),
}


def _conjugate() -> torch.Tensor:
    """A lazily conjugated complex tensor over its whole storage."""
    return torch.arange(3, dtype=torch.float32).mul(1 + 2j).conj()


def _with_data(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A complex tensor given ``make()``'s as its data (``.data =``: its lazy bits too)."""
    tensor = torch.zeros(3, dtype=torch.complex64)
    tensor.data = make()
    return tensor


def _copied(runtime: SimulatedRuntime, make: Callable[[SimulatedRuntime], Any]) -> dict[str, Any]:
    """What a copy of ``make(runtime)`` to cuda:0 is and did, field by field."""
    value = make(runtime)
    stream = runtime.create_stream(CUDA0)
    runtime.calls.clear()
    copy, facts = runtime.copy_to_cuda_measured(value, CUDA0, stream, non_blocking=True)
    event = runtime.record_event(stream)
    fields = copy._resident_tensors
    measured = runtime.measure(copy)
    # The copy's facts are what `measure` says of it (storage keys are addresses: their
    # number is compared across the two runtimes).
    assert facts is None or facts == measured
    bundle = isinstance(copy, TensorBundle)
    return {
        "type": type(copy),
        "names": copy.names if bundle else None,
        # A bundle's copy shares its never-mutated names and index with the source.
        "shares names": bundle and copy._names is value._names and copy._index is value._index,
        "facts": None if facts is None else facts._replace(storage_keys=len(facts.storage_keys)),
        "measured": measured._replace(storage_keys=len(measured.storage_keys)),
        "placement": runtime.placement(copy),
        "bytes": [field.resolve_conj().tolist() for field in fields],
        "layout": [
            (f.shape, f.stride(), f.dtype, f.is_conj(), f.is_neg(), type(f)) for f in fields
        ],
        "requires_grad": [field.requires_grad for field in fields],
        "leaf": [field.is_leaf for field in fields],
        "storages": len({f.untyped_storage().data_ptr() for f in fields if f.numel()}),
        # (An empty tensor has no memory to share: its address is 0 on both sides.)
        "shares source": any(
            f.numel() > 0 and f.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
            for f, s in zip(fields, value._resident_tensors, strict=True)
        ),
        "calls": dict(runtime.calls),
        "copies": [(c.destination, c.non_blocking) for c in runtime.copies],
        "sample": runtime.memory_sample(CUDA0),
        "event": runtime.event_query(event),
    }


@pytest.mark.parametrize("make", COPIED.values(), ids=list(COPIED))
def test_a_copy_taken_or_declined_natively_is_the_python_method_s(
    make: Callable[[SimulatedRuntime], Any],
) -> None:
    native = _copied(SimulatedRuntime(1, auto_complete=True), make)
    python = _copied(PythonPath(1, auto_complete=True), make)
    assert native == python
    assert native["placement"] == ON_CUDA0
    assert not native["shares source"]


# The copies the native calls take: a plain tensor of any dtype without lazy conjugate or
# negative bits (a tensor's lazy conjugate bit is read only where its dtype is complex).
TAKEN = {
    "pinned",
    "pageable",
    "parameter",
    "requires grad",
    "complex",
    "conjugate resolved",
    "int64",
}
TAKEN |= {"float16", "on cuda:0"}


# Bundles: the native calls take a `TensorBundle` whose fields are each a plain tensor
# over a whole storage of its own; any other bundle goes to the Python method.
class Bundle(TensorBundle):
    """A subclass: never taken natively (its copy is its class's own business)."""


def _shared() -> TensorBundle:
    weight = torch.arange(6.0)
    return TensorBundle({"weight": weight, "alias": weight})


BUNDLES: dict[str, Callable[[SimulatedRuntime], Any]] = {
    "one field, pinned": lambda rt: rt.pin(TensorBundle({"weight": torch.arange(8.0)})),
    "two fields, pinned": lambda rt: rt.pin(
        TensorBundle({"weight": torch.arange(8.0).view(2, 4), "bias": torch.ones(2)})
    ),
    "mixed dtypes, pageable": lambda rt: TensorBundle(
        {"a": torch.arange(4, dtype=torch.int64), "b": torch.ones(3, dtype=torch.float16)}
    ),
    "parameters": lambda rt: TensorBundle(
        {
            "weight": torch.nn.Parameter(torch.ones(2, 2)),
            "bias": torch.nn.Parameter(torch.zeros(2), requires_grad=False),
        }
    ),
    "bundle on cuda:0": lambda rt: rt.to_device(
        TensorBundle({"weight": torch.arange(4.0), "bias": torch.ones(2)}), 0
    ),
    "a shared storage": lambda rt: _shared(),
    "a view": lambda rt: TensorBundle({"w": torch.arange(4.0), "v": torch.arange(64.0)[8:12]}),
    "an empty field": lambda rt: TensorBundle({"w": torch.arange(4.0), "e": torch.zeros(0)}),
    "a negative view": lambda rt: TensorBundle(
        {"w": torch.arange(4.0), "n": torch._neg_view(torch.arange(3.0))}
    ),
    "a subclass": lambda rt: Bundle({"w": torch.arange(4.0), "b": torch.ones(2)}),
}
BUNDLES_TAKEN = {"one field, pinned", "two fields, pinned", "mixed dtypes, pageable"}
BUNDLES_TAKEN |= {"parameters", "bundle on cuda:0"}


@pytest.mark.parametrize("make", BUNDLES.values(), ids=list(BUNDLES))
def test_a_bundle_copied_natively_or_not_is_the_python_method_s(
    make: Callable[[SimulatedRuntime], Any],
) -> None:
    native = _copied(SimulatedRuntime(1, auto_complete=True), make)
    python = _copied(PythonPath(1, auto_complete=True), make)
    assert native == python
    assert native["shares names"]
    assert native["placement"] == ON_CUDA0
    assert not native["shares source"]


@pytest.mark.parametrize("name", [*COPIED, *BUNDLES])
def test_the_native_calls_take_the_plain_values_and_decline_the_others(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = SimulatedRuntime(1, auto_complete=True)
    value = (COPIED.get(name) or BUNDLES[name])(runtime)
    declined: list[object] = []
    python_copy = SimulatedRuntime._to_cuda

    def spy(self: SimulatedRuntime, *args: Any) -> Any:
        declined.append(args[0])
        return python_copy(self, *args)

    monkeypatch.setattr(SimulatedRuntime, "_to_cuda", spy)
    copy, facts = runtime.copy_to_cuda_measured(value, CUDA0, None, non_blocking=False)
    assert (not declined) == (name in TAKEN or name in BUNDLES_TAKEN)
    assert facts == runtime.measure(copy)
    for field, source in zip(copy._resident_tensors, value._resident_tensors, strict=True):
        assert torch.equal(field, source)
        assert (field.is_conj(), field.is_neg()) == (source.is_conj(), source.is_neg())


@pytest.mark.parametrize("auto_complete", [True, False], ids=["auto-complete", "pending"])
def test_bundles_cycled_natively_are_what_the_python_methods_make(auto_complete: bool) -> None:
    native = _cycle(SimulatedRuntime(1, auto_complete=auto_complete), bundles=True)
    python = _cycle(PythonPath(1, auto_complete=auto_complete), bundles=True)
    assert native == python
    assert native["read"] == [float(step % LAYERS) + 2.0 for step in range(2 * LAYERS)]
    assert native["calls"]["copy_to_cuda"] >= LAYERS
