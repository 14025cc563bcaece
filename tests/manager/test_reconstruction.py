"""Failure atomicity of reconstruction and copies (docs/concepts/values.md#reconstruction,
#install; docs/concepts/transitions.md#copies-and-streams).

A source that raises, returns the wrong type / bytes / location, or an allocation or copy that
fails leaves the manager exactly as before: the registration is kept, no charge is left, no
location is registered and the version does not move. The only allowed trace is a raised
`peak_charged_bytes` at the source location (locations-and-budgets.md#peaks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fhelium.errors import (
    ResidencyMaterializationError,
    ResidencyOwnershipError,
)
from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation
from fhelium.residency.manager import ResidencyManager
from fhelium.values import ResidentTensor, TensorBundle
from helpers.manager import (
    CUDA0,
    CUDA1,
    EXCLUSIVE,
    REPLICABLE,
    Other,
    SubTensor,
    assert_balanced,
    loc_snap,
    mat_locs,
    on,
    sim_fixture,  # noqa: F401
    spec,
    state_key,
    tensor_value,
    val_snap,
)


class Abort(BaseException):
    """A non-Exception failure, like an interrupt, raised from inside `load()`."""


class Switchable:
    """A source that misbehaves via `bad()` until `fixed` is set."""

    def __init__(self, bad: Callable[[], Any], good: Callable[[], Any]) -> None:
        self.bad = bad
        self.good = good
        self.fixed = False
        self.calls = 0

    def load(self) -> Any:
        self.calls += 1
        return self.good() if self.fixed else self.bad()


SHARED_ERROR = ValueError("user error from load()")


def _raise(exc: BaseException) -> Callable[[], Any]:
    def bad() -> Any:
        raise exc

    return bad


def _bad_factories(runtime: Any, source_location: ResidencyLocation) -> dict[str, Any]:
    """name -> (bad factory, expected exception type, expect identical exception object)."""

    def at_source(value: Any) -> Any:
        return on(runtime, source_location, value)

    wrong_place = PINNED_HOST if source_location != PINNED_HOST else CUDA1
    return {
        "raises-value-error": (_raise(SHARED_ERROR), ValueError, True),
        "raises-base-exception": (_raise(Abort("stop")), Abort, False),
        "returns-tensor": (lambda: torch.zeros(4), ResidencyMaterializationError, False),
        "returns-none": (lambda: None, ResidencyMaterializationError, False),
        "returns-other-type": (
            lambda: at_source(Other(torch.zeros(4))),
            ResidencyMaterializationError,
            False,
        ),
        "returns-bundle": (
            lambda: at_source(TensorBundle(a=torch.zeros(4))),
            ResidencyMaterializationError,
            False,
        ),
        "wrong-logical-bytes": (
            lambda: at_source(tensor_value(5)),
            ResidencyMaterializationError,
            False,
        ),
        "storage-over-ceiling": (
            # logical 16 bytes, but a view into a 64-float allocation (256 > 16).
            lambda: ResidentTensor(at_source(ResidentTensor(torch.zeros(64))).tensor[:4]),
            ResidencyMaterializationError,
            False,
        ),
        "wrong-location": (
            lambda: on(runtime, wrong_place, tensor_value(4)),
            ResidencyMaterializationError,
            False,
        ),
    }


BAD_KINDS = [
    "raises-value-error",
    "raises-base-exception",
    "returns-tensor",
    "returns-none",
    "returns-other-type",
    "returns-bundle",
    "wrong-logical-bytes",
    "storage-over-ceiling",
    "wrong-location",
]


@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize(
    ("source_location", "destination"),
    [
        (PAGEABLE_HOST, PAGEABLE_HOST),
        (PAGEABLE_HOST, CUDA0),
        (PINNED_HOST, PINNED_HOST),
        (CUDA1, PAGEABLE_HOST),
    ],
    ids=["pageable-same", "pageable-to-cuda0", "pinned-same", "cuda1-to-pageable"],
)
@pytest.mark.parametrize("operation", ["ensure", "move"])
def test_bad_source_leaves_the_manager_exactly_as_before(
    sim: Any,
    kind: str,
    source_location: ResidencyLocation,
    destination: ResidencyLocation,
    operation: str,
) -> None:
    manager = ResidencyManager()
    bystander = manager.adopt(tensor_value(2), replica_mode=REPLICABLE)
    bad, expected, identical = _bad_factories(sim, source_location)[kind]
    source = Switchable(bad, lambda: on(sim, source_location, tensor_value(4)))
    handle = manager.register_source(spec(4), source, source_location=source_location)
    before = manager.snapshot()
    trace_before = manager.trace()
    locations_before = manager.locations
    call = manager.ensure if operation == "ensure" else manager.move
    with pytest.raises(expected) as info:
        call(handle, destination)
    if identical:
        assert info.value is SHARED_ERROR  # re-raised unchanged
    assert source.calls == 1
    after = manager.snapshot()
    assert state_key(after, ignore_peak_charged=(source_location,)) == state_key(
        before, ignore_peak_charged=(source_location,)
    )
    entry = loc_snap(after, source_location)
    base = loc_snap(before, source_location)
    assert entry.used_bytes == base.used_bytes
    assert (entry.reserved_bytes, entry.reservation_count) == (0, 0)
    assert entry.peak_used_bytes == base.peak_used_bytes
    # The temporary charge was admitted on top of what was used there (values.md#reconstruction).
    assert entry.peak_charged_bytes == base.used_bytes + 16
    assert manager.locations == locations_before
    assert manager.trace() == trace_before
    value_entry = val_snap(after, handle)
    assert value_entry.has_source is True
    assert value_entry.source_location == source_location
    assert value_entry.materializations == ()
    assert mat_locs(after, bystander) == (PAGEABLE_HOST,)
    assert_balanced(after)
    # The manager is fully usable afterwards, and the registration still works.
    source.fixed = True
    report = call(handle, destination)
    assert report.source == source_location
    assert mat_locs(manager.snapshot(), handle) == (destination,)
    assert source.calls == 2


def test_a_subclass_of_the_spec_type_is_accepted() -> None:
    manager = ResidencyManager()
    source = Switchable(lambda: SubTensor(torch.zeros(4)), lambda: None)
    handle = manager.register_source(spec(4), source)
    report = manager.ensure(handle, PAGEABLE_HOST)
    assert report.no_op is False
    assert source.calls == 1
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)
    assert handle.value_type is ResidentTensor


def test_loaded_value_aliasing_managed_storage_is_an_ownership_error() -> None:
    manager = ResidencyManager()
    shared = tensor_value(4)
    owner = manager.adopt(shared)
    source = Switchable(lambda: ResidentTensor(shared.tensor[:]), lambda: tensor_value(4))
    handle = manager.register_source(spec(4), source)
    before = manager.snapshot()
    with pytest.raises(ResidencyOwnershipError):
        manager.ensure(handle, PAGEABLE_HOST)
    after = manager.snapshot()
    assert state_key(after, ignore_peak_charged=(PAGEABLE_HOST,)) == state_key(
        before, ignore_peak_charged=(PAGEABLE_HOST,)
    )
    assert loc_snap(after, PAGEABLE_HOST).used_bytes == 16
    assert loc_snap(after, PAGEABLE_HOST).reserved_bytes == 0
    assert mat_locs(after, owner) == (PAGEABLE_HOST,)
    source.fixed = True
    manager.ensure(handle, PAGEABLE_HOST)
    assert mat_locs(manager.snapshot(), handle) == (PAGEABLE_HOST,)


def test_a_source_returning_the_same_installed_object_twice_is_an_ownership_error() -> None:
    manager = ResidencyManager()
    cached = tensor_value(4)
    first = manager.register_source(spec(4), Switchable(lambda: cached, lambda: cached))
    second = manager.register_source(spec(4), Switchable(lambda: cached, lambda: cached))
    manager.ensure(first, PAGEABLE_HOST)
    with pytest.raises(ResidencyOwnershipError):
        manager.ensure(second, PAGEABLE_HOST)
    assert mat_locs(manager.snapshot(), second) == ()
    # Once the first copy is dropped, the storage is free to be installed again.
    manager.drop(first, PAGEABLE_HOST)
    manager.ensure(second, PAGEABLE_HOST)
    assert mat_locs(manager.snapshot(), second) == (PAGEABLE_HOST,)


# --------------------------------------------------------------------------------------------
# Copy / allocation failures (runtime fault injection)
# --------------------------------------------------------------------------------------------

BOOM = RuntimeError("boom")


@pytest.mark.parametrize(
    ("method", "destination"),
    [
        ("copy_to_cuda", CUDA0),
        ("copy_to_pinned", PINNED_HOST),
        ("record_event", CUDA1),
        ("synchronize_event", CUDA0),
    ],
)
@pytest.mark.parametrize("reconstruct", [False, True], ids=["replica", "reconstruct"])
def test_copy_failure_leaves_the_manager_exactly_as_before(
    sim: Any, method: str, destination: ResidencyLocation, reconstruct: bool
) -> None:
    manager = ResidencyManager()
    if reconstruct:
        handle = manager.register_source(
            spec(4), Switchable(lambda: tensor_value(4), lambda: tensor_value(4))
        )
    else:
        handle = manager.adopt(tensor_value(4), replica_mode=REPLICABLE)
    before = manager.snapshot()
    locations_before = manager.locations
    sim.fail_next(method, exc=BOOM)
    with pytest.raises(RuntimeError) as info:
        manager.ensure(handle, destination)
    assert info.value is BOOM
    assert sim.calls[method] == 1
    after = manager.snapshot()
    masked = (PAGEABLE_HOST,) if reconstruct else ()
    assert state_key(after, ignore_peak_charged=masked) == state_key(
        before, ignore_peak_charged=masked
    )
    assert manager.locations == locations_before
    assert loc_snap(after, destination) is None
    assert manager.trace() == ()
    assert_balanced(after)
    # The same transition succeeds once the fault is gone.
    report = manager.ensure(handle, destination)
    assert report.destination == destination
    assert destination in mat_locs(manager.snapshot(), handle)


def test_copy_to_pageable_failure_during_a_move_removes_nothing(sim: Any) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(on(sim, CUDA1, tensor_value(4)))
    before = state_key(manager.snapshot())
    sim.fail_next("copy_to_pageable", exc=BOOM)
    with pytest.raises(RuntimeError) as info:
        manager.move(handle, PAGEABLE_HOST)
    assert info.value is BOOM
    assert state_key(manager.snapshot()) == before
    assert mat_locs(manager.snapshot(), handle) == (CUDA1,)


def test_failed_move_keeps_the_exclusive_source(sim: Any) -> None:
    manager = ResidencyManager()
    handle = manager.adopt(tensor_value(4))  # EXCLUSIVE
    before = state_key(manager.snapshot())
    sim.fail_next("copy_to_cuda", exc=BOOM)
    with pytest.raises(RuntimeError):
        manager.move(handle, CUDA0)
    assert state_key(manager.snapshot()) == before
    manager.move(handle, CUDA0)
    assert mat_locs(manager.snapshot(), handle) == (CUDA0,)


def test_reconstruction_of_an_exclusive_value_after_a_failed_load(sim: Any) -> None:
    manager = ResidencyManager()
    source = Switchable(_raise(KeyError("x")), lambda: tensor_value(4))
    handle = manager.register_source(spec(4, replica=EXCLUSIVE), source)
    with pytest.raises(KeyError):
        manager.move(handle, CUDA0)
    with pytest.raises(KeyError):
        manager.ensure(handle, PAGEABLE_HOST)
    assert source.calls == 2
    source.fixed = True
    manager.ensure(handle, CUDA0)
    assert mat_locs(manager.snapshot(), handle) == (CUDA0,)
