"""Behaviours of real CUDA and PyTorch that the simulated runtime reproduces, so the CPU
suite guards the paths a first GPU run would otherwise be the first to exercise.

Zero-size tensor fields and pinned memory
(docs/concepts/locations-and-budgets.md#pinned-host): torch's pinned allocator returns
no storage for zero bytes, so an empty tensor never reports pinned memory.
"""

from __future__ import annotations

import torch

from fhelium.residency import PAGEABLE_HOST, PINNED_HOST, ReplicaMode, ResidencyManager
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.values import ResidentTensor, TensorBundle
from helpers.manager import CUDA0, assert_balanced, mat_locs


def _with_empty_field() -> TensorBundle:
    return TensorBundle(keys=torch.arange(4.0), empty=torch.zeros(0))


def test_simulated_pinning_leaves_empty_tensors_unpinned_as_torch_does() -> None:
    runtime = SimulatedRuntime(1)
    pinned = runtime.pin(_with_empty_field())
    assert runtime.placement(pinned["keys"]) == PINNED_HOST
    # The empty field got no pinned storage: alone it reads as a plain host tensor...
    assert runtime.placement(pinned["empty"]) == PAGEABLE_HOST
    # ...and it neither makes nor breaks the value's pinning.
    assert runtime.placement(pinned) == PINNED_HOST
    assert runtime.value_is_pinned(pinned)
    assert runtime.pinning_is_uniform(pinned)
    assert runtime.measure(pinned).pinned is True


def test_a_value_with_an_empty_field_moves_through_pinned_host() -> None:
    runtime = SimulatedRuntime(1)
    with use_runtime(runtime):
        manager = ResidencyManager()
    handle = manager.adopt(_with_empty_field(), replica_mode=ReplicaMode.REPLICABLE)
    report = manager.ensure(handle, PINNED_HOST)
    assert report.destination == PINNED_HOST
    manager.move(handle, CUDA0, from_location=PINNED_HOST)
    manager.move(handle, PINNED_HOST, from_location=CUDA0)
    snapshot = manager.snapshot()
    assert set(mat_locs(snapshot, handle)) == {PAGEABLE_HOST, PINNED_HOST}
    assert_balanced(snapshot)
    with manager.acquire([handle], at=PINNED_HOST) as lease:
        borrowed = lease[handle]
        assert torch.equal(borrowed["keys"], torch.arange(4.0))
        assert borrowed["empty"].numel() == 0
    manager.close()


def test_a_pinned_value_with_an_empty_field_is_adopted_as_pinned() -> None:
    runtime = SimulatedRuntime(1)
    with use_runtime(runtime):
        manager = ResidencyManager()
    inferred = manager.adopt(runtime.pin(_with_empty_field()))
    explicit = manager.adopt(runtime.pin(_with_empty_field()), at=PINNED_HOST)
    snapshot = manager.snapshot()
    assert mat_locs(snapshot, inferred) == (PINNED_HOST,)
    assert mat_locs(snapshot, explicit) == (PINNED_HOST,)
    manager.close()


def test_a_value_without_storage_bytes_is_in_place_at_either_host_location() -> None:
    runtime = SimulatedRuntime(1)
    with use_runtime(runtime):
        manager = ResidencyManager()
    handle = manager.adopt(ResidentTensor(torch.zeros(0)), replica_mode=ReplicaMode.REPLICABLE)
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)
    manager.ensure(handle, PINNED_HOST)
    manager.ensure(handle, CUDA0)
    manager.drop(handle, PAGEABLE_HOST)
    manager.move(handle, PAGEABLE_HOST, from_location=PINNED_HOST)
    assert set(mat_locs(manager.snapshot(), handle)) == {PAGEABLE_HOST, CUDA0}
    pinned_empty = manager.adopt(runtime.pin(ResidentTensor(torch.zeros(0))), at=PINNED_HOST)
    assert mat_locs(manager.snapshot(), pinned_empty) == (PINNED_HOST,)
    manager.close()


def test_tensor_resident_pinning_ignores_empty_fields() -> None:
    # On this machine nothing is pinned; the property still treats empty fields as
    # neither pinned nor pageable, and a value of empty fields only is not pinned.
    assert not ResidentTensor(torch.zeros(0)).is_pinned
    assert not _with_empty_field().is_pinned


class _ReportsPinned(torch.Tensor):
    """A host tensor that reports page-locked memory, as a pinned one does on CUDA."""

    def is_pinned(self, device: object = None) -> bool:  # type: ignore[override]
        return True


def test_native_measurement_ignores_empty_fields_for_pinning() -> None:
    # The measurement the real runtime uses, with pinning possible: the pinned field
    # decides, the empty field (never pinned under torch) does not make it "mixed".
    from fhelium._core import measure_tensors

    pinned = torch.arange(4.0).as_subclass(_ReportsPinned)
    facts = measure_tensors((pinned, torch.zeros(0)), True)
    assert facts is not None
    assert facts[2] is True
    # A host value without storage bytes reads as pageable.
    empty_only = measure_tensors((torch.zeros(0), torch.zeros(0)), True)
    assert empty_only is not None
    assert empty_only[2] is False
