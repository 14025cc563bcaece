"""`ResidencyLocation`, the host constants and `cuda_location`
(docs/concepts/locations-and-budgets.md#location-kinds)."""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).
# ruff: noqa: PT011

from __future__ import annotations

import re
import typing

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fhelium.residency import location as location_module
from fhelium.residency.location import (
    PAGEABLE_HOST,
    PINNED_HOST,
    ResidencyLocation,
    ResidencyLocationKind,
    cuda_location,
)

CUDA_PATTERN = re.compile(r"cuda:(0|[1-9][0-9]*)")
MAX_CUDA_INDEX = 127


def _valid_cuda_string(text: str) -> bool:
    return CUDA_PATTERN.fullmatch(text) is not None and int(text[5:]) <= MAX_CUDA_INDEX


# --- the kind alias and the constants ---------------------------------------------------------


def test_location_kind_is_literal_of_three_kinds() -> None:
    assert typing.get_origin(ResidencyLocationKind) is typing.Literal
    assert typing.get_args(ResidencyLocationKind) == ("pageable-host", "pinned-host", "cuda")


def test_host_constants_match_docs() -> None:
    assert ResidencyLocation("pageable-host", torch.device("cpu")) == PAGEABLE_HOST
    assert ResidencyLocation("pinned-host", torch.device("cpu")) == PINNED_HOST
    assert PAGEABLE_HOST.kind == "pageable-host"
    assert PINNED_HOST.kind == "pinned-host"
    assert PAGEABLE_HOST.device == torch.device("cpu")
    assert PINNED_HOST.device == torch.device("cpu")
    assert PAGEABLE_HOST != PINNED_HOST
    assert hash(PAGEABLE_HOST) == hash(ResidencyLocation("pageable-host", "cpu"))
    assert location_module.PAGEABLE_HOST is PAGEABLE_HOST


def test_location_is_frozen_record(frozen_record) -> None:
    frozen_record(PAGEABLE_HOST, ["kind", "device"])
    frozen_record(PINNED_HOST, ["kind", "device"])
    frozen_record(cuda_location("cuda:3"), ["kind", "device"])


def test_location_repr_is_dataclass_default() -> None:
    loc = cuda_location("cuda:2")
    assert repr(loc) == "ResidencyLocation(kind='cuda', device=device(type='cuda', index=2))"
    assert (
        repr(PAGEABLE_HOST) == "ResidencyLocation(kind='pageable-host', device=device(type='cpu'))"
    )


# --- host kinds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["pageable-host", "pinned-host"])
@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0)])
def test_host_kinds_store_unindexed_cpu(kind: str, device: object) -> None:
    loc = ResidencyLocation(kind, device)  # type: ignore[arg-type]
    assert isinstance(loc.device, torch.device)
    assert loc.device.type == "cpu"
    assert loc.device.index is None
    assert loc.device == torch.device("cpu")
    assert loc.kind == kind
    assert loc == ResidencyLocation(kind, torch.device("cpu"))  # type: ignore[arg-type]
    assert hash(loc) == hash(ResidencyLocation(kind, torch.device("cpu")))  # type: ignore[arg-type]
    assert loc.name == kind
    assert str(loc) == kind


def test_cpu0_host_location_equals_constant() -> None:
    assert ResidencyLocation("pageable-host", "cpu:0") == PAGEABLE_HOST
    assert ResidencyLocation("pinned-host", torch.device("cpu", 0)) == PINNED_HOST
    assert repr(ResidencyLocation("pinned-host", "cpu:0")) == repr(PINNED_HOST)


@pytest.mark.parametrize("kind", ["pageable-host", "pinned-host"])
@pytest.mark.parametrize("device", ["cuda:0", "cuda", torch.device("cuda", 1), "meta"])
def test_host_kinds_reject_non_cpu_device(kind: str, device: object) -> None:
    with pytest.raises(ValueError):
        ResidencyLocation(kind, device)  # type: ignore[arg-type]


# --- unsupported kinds --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    ["host", "CUDA", "cpu", "pinned", "", " cuda", "cuda ", None, 0, b"cuda", ["cuda"]],
    ids=repr,
)
def test_unsupported_kind_raises_value_error(kind: object) -> None:
    with pytest.raises(ValueError):
        ResidencyLocation(kind, "cpu")  # type: ignore[arg-type]


def test_unsupported_kind_checked_even_with_cuda_device() -> None:
    with pytest.raises(ValueError):
        ResidencyLocation("gpu", "cuda:0")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ResidencyLocation(1, torch.device("cuda", 0))  # type: ignore[arg-type]


# --- CUDA kinds ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spelling", "index"),
    [
        ("cuda:0", 0),
        ("cuda:7", 7),
        ("cuda:127", 127),
        (torch.device("cuda:0"), 0),
        (torch.device("cuda", 5), 5),
        (torch.device("cuda", 127), 127),
    ],
    ids=repr,
)
def test_cuda_spellings_normalise_to_indexed_device(spelling: object, index: int) -> None:
    for loc in (ResidencyLocation("cuda", spelling), cuda_location(spelling)):  # type: ignore[arg-type]
        assert loc.kind == "cuda"
        assert isinstance(loc.device, torch.device)
        assert loc.device == torch.device("cuda", index)
        assert loc.device.index == index
        assert loc.name == f"cuda:{index}"
        assert str(loc) == f"cuda:{index}"


def test_cuda_locations_equal_whatever_the_spelling() -> None:
    spellings = [
        "cuda:4",
        torch.device("cuda:4"),
        torch.device("cuda", 4),
        torch.device(type="cuda", index=4),
    ]
    locations = [cuda_location(s) for s in spellings] + [
        ResidencyLocation("cuda", s) for s in spellings
    ]
    assert len(set(locations)) == 1
    assert all(loc == locations[0] for loc in locations)
    assert len({hash(loc) for loc in locations}) == 1
    assert cuda_location("cuda:4") != cuda_location("cuda:5")
    assert cuda_location("cuda:0") != PAGEABLE_HOST


@pytest.mark.parametrize(
    "spelling",
    [
        "cuda",
        "cuda:01",
        "cuda:00",
        "cpu",
        "cpu:0",
        " cuda:0",
        "cuda:0 ",
        "cuda: 0",
        "cuda :0",
        "cuda:0\n",
        "CUDA:0",
        "Cuda:0",
        "cuda:-1",
        "cuda:+1",
        "cuda:1.0",
        "cuda:0x1",
        "cuda:\u0661",  # ARABIC-INDIC DIGIT ONE: not in [0-9]
        "cuda:1_0",
        "cuda:128",
        "cuda:1000",
        "cuda:255",  # torch.device parses this as unindexed cuda
        "cuda:256",  # torch.device wraps this to cuda:0
        "cuda:",
        "",
        "meta",
    ],
    ids=repr,
)
def test_bad_cuda_strings_raise_value_error(spelling: str) -> None:
    with pytest.raises(ValueError):
        cuda_location(spelling)
    with pytest.raises(ValueError):
        ResidencyLocation("cuda", spelling)


@pytest.mark.parametrize(
    "device",
    [
        torch.device("cuda"),
        torch.device("cuda", 128),
        torch.device("cuda", 200),  # torch wraps the index to -56
        torch.device("cpu"),
        torch.device("cpu", 0),
        torch.device("meta"),
    ],
    ids=repr,
)
def test_bad_cuda_devices_raise_value_error(device: torch.device) -> None:
    with pytest.raises(ValueError):
        cuda_location(device)
    with pytest.raises(ValueError):
        ResidencyLocation("cuda", device)


def test_unindexed_cuda_is_never_resolved_against_current_device() -> None:
    # An unindexed "cuda" raises ValueError, regardless of the current device.
    with pytest.raises(ValueError):
        cuda_location("cuda")
    with pytest.raises(ValueError):
        cuda_location(torch.device("cuda"))


def test_construction_does_not_check_cuda_availability() -> None:
    # The manager checks availability and device count; construction never does
    # (locations-and-budgets.md#location-validation).
    loc = cuda_location("cuda:127")
    assert loc.device.index == 127
    assert ResidencyLocation("cuda", "cuda:99").name == "cuda:99"


@given(st.integers(min_value=0, max_value=MAX_CUDA_INDEX))
def test_every_valid_index_roundtrips(index: int) -> None:
    from_str = cuda_location(f"cuda:{index}")
    from_dev = cuda_location(torch.device("cuda", index))
    assert from_str == from_dev
    assert hash(from_str) == hash(from_dev)
    assert from_str.name == f"cuda:{index}"
    assert cuda_location(from_str.name) == from_str


@given(st.integers(min_value=MAX_CUDA_INDEX + 1, max_value=10**6))
def test_every_index_above_127_is_rejected(index: int) -> None:
    # torch.device wraps large indices (int8), so the string must be parsed, not delegated.
    with pytest.raises(ValueError):
        cuda_location(f"cuda:{index}")
    with pytest.raises(ValueError):
        ResidencyLocation("cuda", f"cuda:{index}")


@given(
    st.one_of(
        st.text(max_size=8),
        st.text(alphabet="cuda:0123456789 \n-+", max_size=9),
        st.builds(lambda s: "cuda:" + s, st.text(alphabet="0123456789", max_size=4)),
    )
)
def test_string_acceptance_is_exactly_the_documented_pattern(text: str) -> None:
    if _valid_cuda_string(text):
        loc = cuda_location(text)
        assert loc.name == text
        assert loc.device == torch.device(text)
    else:
        with pytest.raises(ValueError):
            cuda_location(text)
