"""Error messages say what happened in units a person reads and what to do next
(docs/concepts/errors.md#messages), while the structured attributes stay as they were.

One test per error class a new user meets first: a budget refusal, a plain tensor where a
value is expected, a CUDA location on a machine without CUDA, and a controller that finds
no room.
"""

from __future__ import annotations

import pytest
import torch

from fhelium.errors import (
    ResidencyBudgetError,
    ResidencyIntegrityError,
    ResidencyMaterializationError,
    ResidencyPlanError,
    ResidencySearchLimitError,
    ResidencyStaleStateError,
)
from fhelium.residency import (
    PAGEABLE_HOST,
    Recoverability,
    ReplicaMode,
    ResidencyController,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    ResidencyValueSpec,
    cuda_location,
)
from fhelium.residency.simulation import SimulatedRuntime, use_runtime
from fhelium.values import ResidentTensor

KiB, MiB = 1 << 10, 1 << 20


def _floats(nbytes: int) -> ResidentTensor:
    return ResidentTensor(torch.zeros(nbytes // 4))


def test_a_budget_refusal_names_the_shortfall_and_the_ways_to_make_room() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: MiB})
    manager.adopt(_floats(768 * KiB))
    with pytest.raises(ResidencyBudgetError) as caught:
        manager.adopt(_floats(512 * KiB))
    error = caught.value
    # The attributes and the key=value figures are the stable interface.
    assert (error.location, error.budget_bytes, error.used_bytes) == (
        "pageable-host",
        MiB,
        768 * KiB,
    )
    assert (error.reserved_bytes, error.requested_bytes) == (0, 512 * KiB)
    message = str(error)
    assert "budget_bytes=1048576, used_bytes=786432" in message
    assert (
        "512 KiB (524288 bytes) does not fit in the 256 KiB (262144 bytes) free of the "
        "1 MiB (1048576 bytes) budget at pageable-host"
    ) in message
    assert "256 KiB (262144 bytes) more is needed" in message
    for remedy in (
        "raise the budget by at least 256 KiB",
        "drop or move values away",
        "let a ResidencyController evict them",
        "release the holds and reservations at pageable-host",
    ):
        assert remedy in message, message
    manager.close()


def test_a_charge_past_the_whole_budget_says_so() -> None:
    error = ResidencyBudgetError(
        location="cuda:0",
        budget_bytes=8 << 30,
        used_bytes=0,
        reserved_bytes=0,
        requested_bytes=12 << 30,
    )
    assert "12 GiB (12884901888 bytes) is more than the whole budget of 8 GiB" in str(error)
    assert "raise the budget by at least 4 GiB" in str(error)


def test_a_tensor_where_a_value_is_expected_names_resident_tensor() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: MiB})
    with pytest.raises(TypeError, match="value must be a TensorResident, got Tensor") as caught:
        manager.adopt(torch.zeros(4))  # type: ignore[arg-type]
    assert "fhelium.values.ResidentTensor(tensor)" in str(caught.value)
    with pytest.raises(TypeError, match="got dict") as caught:
        manager.adopt({"w": torch.zeros(4)})  # type: ignore[arg-type]
    assert "fhelium.values.as_resident(value)" in str(caught.value)
    manager.close()


def test_a_source_that_returns_a_tensor_names_resident_tensor() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: MiB})
    spec = ResidencyValueSpec(
        ResidentTensor, 16, 16, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
    )

    class Plain:
        def load(self) -> torch.Tensor:
            return torch.zeros(4)

    handle = manager.register_source(spec, Plain())  # type: ignore[arg-type]
    with pytest.raises(ResidencyMaterializationError, match="got Tensor") as caught:
        manager.ensure(handle, PAGEABLE_HOST)
    assert "fhelium.values.ResidentTensor(tensor)" in str(caught.value)
    manager.close()


def test_cuda_without_cuda_names_the_simulated_runtime() -> None:
    with (
        use_runtime(SimulatedRuntime(0)),
        pytest.raises(ValueError, match="CUDA is not available") as caught,
    ):
        ResidencyManager({cuda_location(0): MiB})
    message = str(caught.value)
    assert message.startswith("cuda:0 is not usable: CUDA is not available")
    assert "fhelium.residency.simulation.use_runtime(SimulatedRuntime(1))" in message
    assert "docs/concepts/simulation.md" in message


def test_a_capacity_failure_names_what_holds_the_room_and_why() -> None:
    runtime = SimulatedRuntime(1)
    gpu = cuda_location(0)
    with use_runtime(runtime):
        manager = ResidencyManager({gpu: MiB, PAGEABLE_HOST: 8 * MiB})
    device = torch.device("cuda", 0)
    states = [manager.adopt(runtime.to_device(_floats(256 * KiB), device)) for _ in range(3)]
    incoming = manager.adopt(_floats(512 * KiB))
    request = ResidencyRequest("incoming", [ResidencyRequirement(incoming, gpu)])
    hold = manager.hold([states[0]], at=gpu)
    with pytest.raises(ResidencyPlanError) as caught:
        ResidencyController(manager).decide(request)
    message = str(caught.value)
    # The figures stay as they were.
    assert (
        "capacity failure at cuda:0 for 524288 bytes (materialization): budget=1048576, "
        "used=786432, reserved=0, protected=1 materialization(s) of 262144 bytes"
    ) in message
    assert "256 KiB (262144 bytes) more is needed" in message
    assert f'value "{states[0].handle_id}" (256 KiB) is held by 1 hold(s)' in message
    assert f'value "{states[1].handle_id}" (256 KiB) is its only copy' in message
    for remedy in (
        "release the holds",
        "give the policy a fallback tier for cuda:0",
        "raise cuda:0's budget",
        "require less at once",
    ):
        assert remedy in message, message
    hold.release()
    manager.close()


def test_the_other_structured_errors_say_what_to_do() -> None:
    stale = ResidencyStaleStateError(expected_version=1, actual_version=2)
    assert "expected_version=1, actual_version=2" in str(stale)
    assert "Decide or build the plan again" in str(stale)
    limited = ResidencySearchLimitError(
        request_name="r", state_limit=5, explored_states=5, detail="d"
    )
    assert "raise the controller's search_state_limit" in str(limited)
    deep = ResidencySearchLimitError(
        request_name="r", state_limit=5, explored_states=3, detail="d", bound="depth"
    )
    assert "require fewer values at once" in str(deep)
    assert "search_state_limit," not in str(deep)
    damaged = ResidencyIntegrityError(path="/d/v.safetensors", expected="a", actual="b")
    assert "Drop that disk copy" in str(damaged)
