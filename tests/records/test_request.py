"""`ResidencyRequirement` and `ResidencyRequest` (docs/concepts/controller.md#requests)."""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).
# ruff: noqa: PT011

from __future__ import annotations

from typing import Any

import pytest

from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, cuda_location
from fhelium.residency.plan import EnsureResident, MemoryReservation
from fhelium.residency.request import ResidencyRequest, ResidencyRequirement
from helpers.records import (
    BLANK_STR,
    BLANK_STR_IDS,
    NOT_STR,
    NOT_STR_IDS,
    Boom,
    exploding,
    make_handle,
)

H1 = make_handle(handle_id="h1")
H2 = make_handle(handle_id="h2")
CUDA0 = cuda_location("cuda:0")
RESERVATION = MemoryReservation(CUDA0, 128, "workspace")

# --- ResidencyRequirement ------------------------------------------------------------------------


def test_requirement_record(frozen_record) -> None:
    req = ResidencyRequirement(H1, CUDA0)
    assert (req.handle, req.location) == (H1, CUDA0)
    frozen_record(req, ["handle", "location"])
    assert ResidencyRequirement(location=CUDA0, handle=H1) == req


def test_requirement_unequal_to_ensure_action_with_same_fields() -> None:
    assert ResidencyRequirement(H1, CUDA0) != EnsureResident(H1, CUDA0)
    assert EnsureResident(H1, CUDA0) != ResidencyRequirement(H1, CUDA0)


@pytest.mark.parametrize("bad", ["h1", None, 1], ids=repr)
def test_requirement_handle_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyRequirement(bad, CUDA0)


@pytest.mark.parametrize("bad", ["cuda:0", None, CUDA0.device], ids=repr)
def test_requirement_location_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyRequirement(H1, bad)


# --- ResidencyRequest ----------------------------------------------------------------------------


def test_request_record(frozen_record) -> None:
    request = ResidencyRequest(
        "step", [ResidencyRequirement(H1, CUDA0), ResidencyRequirement(H2, CUDA0)], [RESERVATION]
    )
    assert request.name == "step"
    assert request.requirements == (
        ResidencyRequirement(H1, CUDA0),
        ResidencyRequirement(H2, CUDA0),
    )
    assert request.reservations == (RESERVATION,)
    frozen_record(request, ["name", "requirements", "reservations"])


def test_request_defaults_and_tuples() -> None:
    reqs = [ResidencyRequirement(H1, CUDA0)]
    request = ResidencyRequest("r", reqs)
    assert request.reservations == ()
    assert type(request.requirements) is tuple
    assert request == ResidencyRequest("r", tuple(reqs), ())
    assert hash(request) == hash(ResidencyRequest("r", (x for x in reqs)))
    reqs.append(ResidencyRequirement(H2, CUDA0))
    assert request.requirements == (ResidencyRequirement(H1, CUDA0),)


def test_request_requirements_is_required() -> None:
    with pytest.raises(TypeError):
        ResidencyRequest("r")  # type: ignore[call-arg]


def test_request_same_handle_at_several_locations_is_allowed() -> None:
    request = ResidencyRequest(
        "multi",
        [
            ResidencyRequirement(H1, CUDA0),
            ResidencyRequirement(H1, PINNED_HOST),
            ResidencyRequirement(H1, PAGEABLE_HOST),
        ],
    )
    assert len(request.requirements) == 3


@pytest.mark.parametrize("bad", NOT_STR, ids=NOT_STR_IDS)
def test_request_name_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyRequest(bad, [ResidencyRequirement(H1, CUDA0)])


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_request_name_blank(bad: str) -> None:
    with pytest.raises(ValueError):
        ResidencyRequest(bad, [ResidencyRequirement(H1, CUDA0)])


def test_request_empty_requirements() -> None:
    with pytest.raises(ValueError):
        ResidencyRequest("r", [])
    with pytest.raises(ValueError):
        ResidencyRequest("r", iter(()))


@pytest.mark.parametrize("bad", [EnsureResident(H1, CUDA0), (H1, CUDA0), H1, None], ids=repr)
def test_request_requirement_elements(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyRequest("r", [ResidencyRequirement(H1, CUDA0), bad])


def test_request_duplicate_pair() -> None:
    with pytest.raises(ValueError):
        ResidencyRequest("r", [ResidencyRequirement(H1, CUDA0), ResidencyRequirement(H1, CUDA0)])
    with pytest.raises(ValueError):
        ResidencyRequest(
            "r",
            [
                ResidencyRequirement(H1, cuda_location("cuda:0")),
                ResidencyRequirement(H2, CUDA0),
                ResidencyRequirement(H1, cuda_location("cuda:0")),
            ],
        )


@pytest.mark.parametrize("bad", [EnsureResident(H1, CUDA0), "r", 5, None], ids=repr)
def test_request_reservation_elements(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyRequest("r", [ResidencyRequirement(H1, CUDA0)], [RESERVATION, bad])


def test_request_non_iterables() -> None:
    with pytest.raises(TypeError):
        ResidencyRequest("r", 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ResidencyRequest("r", [ResidencyRequirement(H1, CUDA0)], 5)  # type: ignore[arg-type]


def test_request_check_order() -> None:
    req = ResidencyRequirement(H1, CUDA0)
    # 1. name before conversion
    with pytest.raises(ValueError):
        ResidencyRequest("", 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ResidencyRequest(5, [])  # type: ignore[arg-type]
    # 2. both conversions before 3. the empty check
    with pytest.raises(TypeError):
        ResidencyRequest("r", [], 5)  # type: ignore[arg-type]
    with pytest.raises(Boom):
        ResidencyRequest("r", [], exploding())
    with pytest.raises(Boom):
        ResidencyRequest("r", ["bad"], exploding())
    # 3. empty before 6. reservation element types
    with pytest.raises(ValueError):
        ResidencyRequest("r", [], ["bad"])
    # 4. every element type before 5. duplicates
    with pytest.raises(TypeError):
        ResidencyRequest("r", [req, req, "bad"])
    # 5. duplicates before 6. reservation element types
    with pytest.raises(ValueError):
        ResidencyRequest("r", [req, req], ["bad"])
    # 4. element types before 6. reservation element types (both TypeError) - still TypeError
    with pytest.raises(TypeError):
        ResidencyRequest("r", ["bad"], ["bad"])
