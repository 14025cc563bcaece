"""Replica modes, recoverability, handles, value specs and sources (docs/concepts/values.md)."""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).
# ruff: noqa: PT011

from __future__ import annotations

import enum
import typing
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fhelium.residency.model import (
    Recoverability,
    ReplicaMode,
    ResidencyHandle,
    ResidencySource,
    ResidencyValueSpec,
)
from helpers.records import (
    BLANK_STR,
    BLANK_STR_IDS,
    NOT_STR,
    NOT_STR_IDS,
    NOT_STRICT_INT,
    NOT_STRICT_INT_IDS,
    Pair,
    Single,
)

EXCLUSIVE = ReplicaMode.EXCLUSIVE
PRESERVE = Recoverability.MUST_PRESERVE

# --- enums ---------------------------------------------------------------------------------------


def test_replica_mode_members() -> None:
    assert issubclass(ReplicaMode, enum.StrEnum)
    assert [m.name for m in ReplicaMode] == ["REPLICABLE", "EXCLUSIVE"]
    assert ReplicaMode.REPLICABLE == "replicable"
    assert ReplicaMode.EXCLUSIVE == "exclusive"
    assert ReplicaMode("exclusive") is ReplicaMode.EXCLUSIVE
    assert str(ReplicaMode.REPLICABLE) == "replicable"


def test_recoverability_members() -> None:
    assert issubclass(Recoverability, enum.StrEnum)
    assert [m.name for m in Recoverability] == ["RECONSTRUCTIBLE", "MUST_PRESERVE"]
    assert Recoverability.RECONSTRUCTIBLE == "reconstructible"
    assert Recoverability.MUST_PRESERVE == "must-preserve"
    assert Recoverability("must-preserve") is Recoverability.MUST_PRESERVE
    assert str(Recoverability.MUST_PRESERVE) == "must-preserve"


# --- ResidencyHandle -----------------------------------------------------------------------------


def test_handle_fields_and_record_protocol(frozen_record) -> None:
    h = ResidencyHandle("mgr", "h-1", Pair)
    assert h.manager_id == "mgr"
    assert h.handle_id == "h-1"
    assert h.value_type is Pair
    frozen_record(h, ["manager_id", "handle_id", "value_type"])
    assert repr(h) == f"ResidencyHandle(manager_id='mgr', handle_id='h-1', value_type={Pair!r})"


def test_handle_keyword_construction() -> None:
    h = ResidencyHandle(value_type=Single, handle_id="x", manager_id="m")
    assert h == ResidencyHandle("m", "x", Single)


def test_handle_is_generic() -> None:
    alias = ResidencyHandle[Pair]
    assert typing.get_origin(alias) is ResidencyHandle
    assert typing.get_args(alias) == (Pair,)


def test_handle_equality_covers_every_field() -> None:
    base = ResidencyHandle("m", "h", Pair)
    assert base == ResidencyHandle("m", "h", Pair)
    assert base != ResidencyHandle("m2", "h", Pair)
    assert base != ResidencyHandle("m", "h2", Pair)
    assert base != ResidencyHandle("m", "h", Single)
    assert len({base, ResidencyHandle("m", "h", Single)}) == 2


def test_handle_accepts_any_tensor_resident_subclass() -> None:
    from fhelium.values import ResidentTensor, TensorBundle

    for cls in (Pair, Single, ResidentTensor, TensorBundle):
        assert ResidencyHandle("m", "h", cls).value_type is cls


@pytest.mark.parametrize("bad", NOT_STR, ids=NOT_STR_IDS)
def test_handle_manager_id_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyHandle(bad, "h", Pair)


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_handle_manager_id_blank(bad: str) -> None:
    with pytest.raises(ValueError):
        ResidencyHandle(bad, "h", Pair)


@pytest.mark.parametrize("bad", NOT_STR, ids=NOT_STR_IDS)
def test_handle_handle_id_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyHandle("m", bad, Pair)


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_handle_handle_id_blank(bad: str) -> None:
    with pytest.raises(ValueError):
        ResidencyHandle("m", bad, Pair)


@pytest.mark.parametrize(
    "bad",
    [int, object, torch.Tensor, "Pair", None, Pair(torch.zeros(1), torch.zeros(1)), list[int]],
    ids=["int", "object", "Tensor", "str", "None", "instance", "generic-alias"],
)
def test_handle_value_type_must_be_tensor_resident_class(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyHandle("m", "h", bad)


def test_handle_check_order() -> None:
    # 1. manager_id, 2. handle_id, 3. value_type: the first failing check decides.
    with pytest.raises(ValueError):
        ResidencyHandle("", 5, int)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ResidencyHandle(5, "", int)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ResidencyHandle("m", " ", int)
    with pytest.raises(TypeError):
        ResidencyHandle("m", None, Pair)  # type: ignore[arg-type]


def test_handle_requires_all_three_fields() -> None:
    with pytest.raises(TypeError):
        ResidencyHandle("m", "h")  # type: ignore[call-arg]


_handle_fields = st.tuples(
    st.text(min_size=1, max_size=6).filter(str.strip),
    st.text(min_size=1, max_size=6).filter(str.strip),
    st.sampled_from([Pair, Single]),
)


@given(_handle_fields, _handle_fields)
def test_handle_eq_hash_consistency(
    first: tuple[str, str, type], second: tuple[str, str, type]
) -> None:
    a = ResidencyHandle(*first)
    b = ResidencyHandle(*second)
    assert (a == b) == (first == second)
    if a == b:
        assert hash(a) == hash(b)
    assert a == ResidencyHandle(*first)
    assert hash(a) == hash(ResidencyHandle(*first))


# --- ResidencyValueSpec --------------------------------------------------------------------------

SPEC_FIELDS = ["value_type", "logical_nbytes", "storage_nbytes", "replica_mode", "recoverability"]


def test_spec_fields_and_record_protocol(frozen_record) -> None:
    spec = ResidencyValueSpec(Pair, 16, 32, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE)
    assert spec.value_type is Pair
    assert spec.logical_nbytes == 16
    assert spec.storage_nbytes == 32
    assert spec.replica_mode is ReplicaMode.REPLICABLE
    assert spec.recoverability is Recoverability.RECONSTRUCTIBLE
    frozen_record(spec, SPEC_FIELDS)


def test_spec_is_generic() -> None:
    assert typing.get_origin(ResidencyValueSpec[Pair]) is ResidencyValueSpec
    assert typing.get_args(ResidencyValueSpec[Pair]) == (Pair,)


def test_spec_equal_and_zero_sizes() -> None:
    spec = ResidencyValueSpec(Pair, 0, 0, EXCLUSIVE, PRESERVE)
    assert spec.logical_nbytes == 0
    assert spec.storage_nbytes == 0
    assert ResidencyValueSpec(Pair, 7, 7, EXCLUSIVE, PRESERVE).storage_nbytes == 7
    assert spec != ResidencyValueSpec(Single, 0, 0, EXCLUSIVE, PRESERVE)
    assert spec != ResidencyValueSpec(Pair, 0, 0, ReplicaMode.REPLICABLE, PRESERVE)
    assert spec != ResidencyValueSpec(Pair, 0, 0, EXCLUSIVE, Recoverability.RECONSTRUCTIBLE)
    assert spec != ResidencyValueSpec(Pair, 0, 1, EXCLUSIVE, PRESERVE)


def test_spec_all_fields_required() -> None:
    with pytest.raises(TypeError):
        ResidencyValueSpec(Pair, 1, 1, EXCLUSIVE)  # type: ignore[call-arg]


@pytest.mark.parametrize("bad", [int, "Pair", None, object, torch.Tensor], ids=repr)
def test_spec_value_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyValueSpec(bad, 1, 1, EXCLUSIVE, PRESERVE)


@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_spec_logical_nbytes_strict_int(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyValueSpec(Pair, bad, 100, EXCLUSIVE, PRESERVE)


@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_spec_storage_nbytes_strict_int(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyValueSpec(Pair, 0, bad, EXCLUSIVE, PRESERVE)


def test_spec_negative_byte_counts() -> None:
    with pytest.raises(ValueError):
        ResidencyValueSpec(Pair, -1, 10, EXCLUSIVE, PRESERVE)
    with pytest.raises(ValueError):
        ResidencyValueSpec(Pair, 0, -1, EXCLUSIVE, PRESERVE)


def test_spec_storage_below_logical() -> None:
    with pytest.raises(ValueError):
        ResidencyValueSpec(Pair, 10, 9, EXCLUSIVE, PRESERVE)


@pytest.mark.parametrize(
    "bad", ["exclusive", "replicable", None, Recoverability.MUST_PRESERVE, 1], ids=repr
)
def test_spec_replica_mode_must_be_enum(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyValueSpec(Pair, 1, 1, bad, PRESERVE)


@pytest.mark.parametrize(
    "bad", ["must-preserve", "reconstructible", None, ReplicaMode.EXCLUSIVE], ids=repr
)
def test_spec_recoverability_must_be_enum(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyValueSpec(Pair, 1, 1, EXCLUSIVE, bad)


def test_spec_check_order() -> None:
    # 1. value_type
    with pytest.raises(TypeError):
        ResidencyValueSpec(int, -1, -1, "x", "y")  # type: ignore[arg-type]
    # 2. logical (ValueError) before storage type (TypeError)
    with pytest.raises(ValueError):
        ResidencyValueSpec(Pair, -1, True, "x", "y")  # type: ignore[arg-type]
    # 2. logical type (TypeError) before storage range (ValueError)
    with pytest.raises(TypeError):
        ResidencyValueSpec(Pair, 1.0, -1, EXCLUSIVE, PRESERVE)  # type: ignore[arg-type]
    # 3. storage range (ValueError) before replica_mode type (TypeError)
    with pytest.raises(ValueError):
        ResidencyValueSpec(Pair, 1, -1, "x", "y")  # type: ignore[arg-type]
    # 4. storage < logical (ValueError) before replica_mode (TypeError)
    with pytest.raises(ValueError):
        ResidencyValueSpec(Pair, 10, 5, "exclusive", "must-preserve")  # type: ignore[arg-type]
    # 5. replica_mode (TypeError) before recoverability (TypeError): observable only as TypeError
    with pytest.raises(TypeError):
        ResidencyValueSpec(Pair, 5, 10, "exclusive", PRESERVE)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ResidencyValueSpec(Pair, 5, 10, EXCLUSIVE, "must-preserve")  # type: ignore[arg-type]


@given(
    st.integers(min_value=0, max_value=2**40),
    st.integers(min_value=0, max_value=2**40),
    st.sampled_from(list(ReplicaMode)),
    st.sampled_from(list(Recoverability)),
)
def test_spec_accepts_exactly_storage_at_least_logical(
    logical: int, storage: int, mode: ReplicaMode, rec: Recoverability
) -> None:
    if storage >= logical:
        spec = ResidencyValueSpec(Pair, logical, storage, mode, rec)
        twin = ResidencyValueSpec(Pair, logical, storage, mode, rec)
        assert spec == twin
        assert hash(spec) == hash(twin)
        assert (spec.logical_nbytes, spec.storage_nbytes) == (logical, storage)
    else:
        with pytest.raises(ValueError):
            ResidencyValueSpec(Pair, logical, storage, mode, rec)


# --- ResidencySource -----------------------------------------------------------------------------


def test_source_protocol_is_not_runtime_checkable() -> None:
    class Loader:
        def load(self) -> Pair:
            return Pair(torch.zeros(1), torch.zeros(1))

    assert getattr(ResidencySource, "_is_protocol", False) is True
    with pytest.raises(TypeError):
        isinstance(Loader(), ResidencySource)


def test_source_protocol_is_generic() -> None:
    assert typing.get_origin(ResidencySource[Pair]) is ResidencySource
    assert callable(ResidencySource.load)
