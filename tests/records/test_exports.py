"""Public names: module map, `__all__` lists and re-export identity
(docs/concepts/conventions.md#public-names); plus the
frozen-record convention checked once across every record class in the package."""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).

from __future__ import annotations

import dataclasses
import importlib
import typing
from typing import Any

import pytest
import torch

import fhelium
import fhelium.residency
import fhelium.values
import fhelium.values.tensor_resident
from helpers.records import Pair, make_handle

SUBMODULE_NAMES: dict[str, list[str]] = {
    "location": [
        "ResidencyLocationKind",
        "ResidencyLocation",
        "PAGEABLE_HOST",
        "PINNED_HOST",
        "cuda_location",
    ],
    "model": [
        "ReplicaMode",
        "Recoverability",
        "ResidencyHandle",
        "ResidencyValueSpec",
        "ResidencySource",
    ],
    "plan": [
        "EnsureResident",
        "MoveResident",
        "DropResident",
        "DiscardValue",
        "ResidencyAction",
        "MemoryReservation",
        "ResidencyPlan",
    ],
    "request": ["ResidencyRequirement", "ResidencyRequest"],
    "policy": [
        "ResidencyPolicyMetadata",
        "ResidencyEvictionCandidate",
        "ResidencyPolicy",
        "DeterministicTieredLRU",
    ],
    "snapshot": [
        "MaterializationSnapshot",
        "ResidencyValueSnapshot",
        "ResidencyLocationSnapshot",
        "ResidencyReservationSnapshot",
        "ResidencySnapshot",
        "ResidencyTransitionReport",
        "ResidencyActionExplanation",
        "ResidencyPlanExplanation",
        "ResidencyPlanReport",
    ],
    # Not implemented yet; pinned as soon as the submodule exists.
    "lease": ["BorrowedValues", "ResidencyLease", "ResidencyHold", "ResidencyReservation"],
    "manager": ["ResidencyManager", "ResidencyScope"],
    "controller": [
        "ResidencyController",
        "ResidencyDecision",
        "ResidencyEviction",
        "ResidencyUse",
    ],
}
EXPECTED_COUNTS = {
    "location": 5,
    "model": 5,
    "plan": 7,
    "request": 2,
    "policy": 4,
    "lease": 4,
    "manager": 2,
    "controller": 4,
    "snapshot": 9,
}
ALWAYS_PRESENT = ["location", "model", "plan", "request", "policy", "snapshot"]


def _present_submodules() -> list[str]:
    """The six record submodules, plus lease/manager/controller once the package re-exports
    any of their names (they are being built; from then on all their names are pinned)."""
    exported = set(fhelium.residency.__all__)
    return [
        name
        for name in SUBMODULE_NAMES
        if name in ALWAYS_PRESENT or exported.intersection(SUBMODULE_NAMES[name])
    ]


def _expected_package_all() -> list[str]:
    # Staged submodules contribute the documented names they already export.
    names = [
        n
        for sub in _present_submodules()
        for n in SUBMODULE_NAMES[sub]
        if sub in ALWAYS_PRESENT or n in importlib.import_module(f"fhelium.residency.{sub}").__all__
    ]
    constants = ["PAGEABLE_HOST", "PINNED_HOST"]
    classes = sorted(n for n in names if n not in constants and n != "cuda_location")
    return [*constants, *classes, "cuda_location"]


def test_documented_tables_agree() -> None:
    assert {k: len(v) for k, v in SUBMODULE_NAMES.items()} == EXPECTED_COUNTS
    assert sum(EXPECTED_COUNTS.values()) == 42


@pytest.mark.parametrize("submodule", ALWAYS_PRESENT)
def test_submodule_all_lists_exactly_its_names(submodule: str) -> None:
    module = importlib.import_module(f"fhelium.residency.{submodule}")
    assert len(module.__all__) == EXPECTED_COUNTS[submodule]
    assert set(module.__all__) == set(SUBMODULE_NAMES[submodule])
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert hasattr(module, name), name


def test_optional_submodules_when_present() -> None:
    # Later submodules land in stages (the manager before its scopes): each exports
    # only documented names, each name it exports exists, and none is listed twice.
    for submodule in _present_submodules():
        module = importlib.import_module(f"fhelium.residency.{submodule}")
        assert set(module.__all__) <= set(SUBMODULE_NAMES[submodule]), submodule
        assert len(set(module.__all__)) == len(module.__all__), submodule
        for name in module.__all__:
            assert hasattr(module, name), name


def test_package_all_is_union_of_submodules() -> None:
    expected = _expected_package_all()
    assert set(fhelium.residency.__all__) == set(expected)
    assert len(fhelium.residency.__all__) == len(expected)


def test_package_all_order() -> None:
    # Constants first, then the classes alphabetically, cuda_location last.
    assert list(fhelium.residency.__all__) == _expected_package_all()


def test_package_names_are_the_submodule_objects() -> None:
    for submodule in _present_submodules():
        module = importlib.import_module(f"fhelium.residency.{submodule}")
        for name in module.__all__:
            assert getattr(fhelium.residency, name) is getattr(module, name), (submodule, name)


def test_star_import_exposes_exactly_all() -> None:
    namespace: dict[str, Any] = {}
    exec("from fhelium.residency import *", namespace)
    namespace.pop("__builtins__")
    assert set(namespace) == set(fhelium.residency.__all__)


def test_tensor_resident_is_one_class_everywhere() -> None:
    assert fhelium.TensorResident is fhelium.values.TensorResident
    assert fhelium.values.TensorResident is fhelium.values.tensor_resident.TensorResident


def test_private_helpers_live_in_tensor_resident_module() -> None:
    module = fhelium.values.tensor_resident
    assert callable(module.storage_keys)
    assert callable(module.cpu_pinning_is_uniform)


def test_errors_submodule_is_package_attribute() -> None:
    import fhelium.errors

    assert fhelium.errors is importlib.import_module("fhelium.errors")


# --- frozen-record conventions across every record class -----------------------------------------


def _record_samples() -> dict[str, Any]:
    from fhelium.residency import (
        PAGEABLE_HOST,
        DiscardValue,
        DropResident,
        EnsureResident,
        MaterializationSnapshot,
        MemoryReservation,
        MoveResident,
        Recoverability,
        ReplicaMode,
        ResidencyActionExplanation,
        ResidencyEvictionCandidate,
        ResidencyLocationSnapshot,
        ResidencyPlan,
        ResidencyPlanExplanation,
        ResidencyPlanReport,
        ResidencyPolicyMetadata,
        ResidencyRequest,
        ResidencyRequirement,
        ResidencyReservationSnapshot,
        ResidencySnapshot,
        ResidencyTransitionReport,
        ResidencyValueSnapshot,
        ResidencyValueSpec,
        cuda_location,
    )

    h = make_handle()
    cuda0 = cuda_location("cuda:0")
    spec = ResidencyValueSpec(Pair, 1, 1, ReplicaMode.EXCLUSIVE, Recoverability.MUST_PRESERVE)
    ensure = EnsureResident(h, cuda0)
    return {
        "ResidencyLocation": PAGEABLE_HOST,
        "ResidencyHandle": h,
        "ResidencyValueSpec": spec,
        "EnsureResident": ensure,
        "MoveResident": MoveResident(h, cuda0),
        "DropResident": DropResident(h, cuda0),
        "DiscardValue": DiscardValue(h),
        "MemoryReservation": MemoryReservation(cuda0, 1, "r"),
        "ResidencyPlan": ResidencyPlan("p", [ensure]),
        "ResidencyRequirement": ResidencyRequirement(h, cuda0),
        "ResidencyRequest": ResidencyRequest("r", [ResidencyRequirement(h, cuda0)]),
        "ResidencyPolicyMetadata": ResidencyPolicyMetadata(),
        "ResidencyEvictionCandidate": ResidencyEvictionCandidate(
            h, cuda0, 1, 0, None, ResidencyPolicyMetadata()
        ),
        "MaterializationSnapshot": MaterializationSnapshot(cuda0, 1, 1, 1, 0, 0, 0),
        "ResidencyValueSnapshot": ResidencyValueSnapshot(h, spec, (), False, None, False),
        "ResidencyReservationSnapshot": ResidencyReservationSnapshot(cuda0, 1, "r"),
        "ResidencyLocationSnapshot": ResidencyLocationSnapshot(
            cuda0, None, 0, 0, None, 0, 0, 0, 0, 0, 0, 0, None, None
        ),
        "ResidencySnapshot": ResidencySnapshot("m", 0, (), (), (), 0),
        "ResidencyTransitionReport": ResidencyTransitionReport(
            ensure, True, None, cuda0, 1, 1, 0, 0
        ),
        "ResidencyActionExplanation": ResidencyActionExplanation(
            ensure, True, True, None, cuda0, 1, 1
        ),
        "ResidencyPlanExplanation": ResidencyPlanExplanation("p", (), (), (), True),
        "ResidencyPlanReport": ResidencyPlanReport("p", (), 0, 0),
    }


RECORD_NAMES = list(_record_samples())


@pytest.mark.parametrize("name", RECORD_NAMES)
def test_record_has_slots_and_no_dict(name: str) -> None:
    record = _record_samples()[name]
    assert type(record) is getattr(fhelium.residency, name)
    assert hasattr(type(record), "__slots__")
    assert not hasattr(record, "__dict__")


def test_records_reject_undeclared_attribute_with_frozen_instance_error() -> None:
    # Section 0: "assigning an attribute raises dataclasses.FrozenInstanceError". typing's
    # generic-alias call relies on this (it assigns __orig_class__ and tolerates AttributeError).
    wrong: dict[str, str] = {}
    for name, record in _record_samples().items():
        try:
            record.__orig_class__ = None
        except dataclasses.FrozenInstanceError:
            continue
        except Exception as exc:
            wrong[name] = f"{type(exc).__name__}: {exc}"
        else:
            wrong[name] = "no exception"
    assert wrong == {}


GENERIC_FIELDS = {
    "ResidencyHandle": ["manager_id", "handle_id", "value_type"],
    "ResidencyValueSpec": [
        "value_type",
        "logical_nbytes",
        "storage_nbytes",
        "replica_mode",
        "recoverability",
    ],
    "EnsureResident": ["handle", "location"],
    "MoveResident": ["handle", "to", "from_location"],
    "DropResident": ["handle", "location"],
    "DiscardValue": ["handle"],
    "ResidencyValueSnapshot": [
        "handle",
        "spec",
        "materializations",
        "has_source",
        "source_location",
        "discarded",
    ],
    "ResidencySnapshot": [
        "manager_id",
        "state_version",
        "values",
        "locations",
        "reservations",
        "captured_at_ns",
    ],
}


def test_generic_records_accept_subscripting() -> None:
    for name in GENERIC_FIELDS:
        cls = getattr(fhelium.residency, name)
        alias = cls[Pair]
        assert typing.get_origin(alias) is cls
        assert typing.get_args(alias) == (Pair,)


def test_generic_records_construct_through_subscripted_alias() -> None:
    # `ResidencyHandle[Pair](...)` is ordinary typed usage of a generic record.
    samples = _record_samples()
    wrong: dict[str, str] = {}
    for name, fields in GENERIC_FIELDS.items():
        record = samples[name]
        alias = type(record)[Pair]
        try:
            rebuilt = alias(*(getattr(record, f) for f in fields))
        except Exception as exc:
            wrong[name] = f"{type(exc).__name__}: {exc}"
        else:
            if rebuilt != record:
                wrong[name] = "rebuilt record differs"
    assert wrong == {}


def test_torch_device_fields_survive_in_constants() -> None:
    assert fhelium.residency.PAGEABLE_HOST.device == torch.device("cpu")
