"""Policy metadata, eviction candidates, the policy protocol and the
built-in `DeterministicTieredLRU`."""

# Exception types are fixed; ValueError wording is not (docs/concepts/conventions.md#check-order).
# ruff: noqa: PT011

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation, cuda_location
from fhelium.residency.policy import (
    DeterministicTieredLRU,
    ResidencyEvictionCandidate,
    ResidencyPolicy,
    ResidencyPolicyMetadata,
)
from helpers.records import (
    BLANK_STR,
    BLANK_STR_IDS,
    NOT_STRICT_INT,
    NOT_STRICT_INT_IDS,
    NOT_STRICT_INT_NONE_OK,
    NOT_STRICT_INT_NONE_OK_IDS,
    make_handle,
)

H1 = make_handle(handle_id="h1")
CUDA0 = cuda_location("cuda:0")
CUDA1 = cuda_location("cuda:1")
META = ResidencyPolicyMetadata()

# --- ResidencyPolicyMetadata ---------------------------------------------------------------------


def test_metadata_defaults_and_record(frozen_record) -> None:
    md = ResidencyPolicyMetadata()
    assert md.priority == 0
    assert md.stable_key is None
    frozen_record(md, ["priority", "stable_key"])
    keyed = ResidencyPolicyMetadata(-7, "weights/layer0")
    assert (keyed.priority, keyed.stable_key) == (-7, "weights/layer0")
    frozen_record(keyed, ["priority", "stable_key"])
    assert ResidencyPolicyMetadata(priority=3, stable_key="k") == ResidencyPolicyMetadata(3, "k")


@pytest.mark.parametrize("priority", [-(2**70), -1, 0, 1, 2**70])
def test_metadata_priority_any_sign(priority: int) -> None:
    assert ResidencyPolicyMetadata(priority).priority == priority


@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_metadata_priority_strict_int(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyPolicyMetadata(bad)


@pytest.mark.parametrize("bad", [5, b"k", ["k"]], ids=repr)
def test_metadata_stable_key_type(bad: Any) -> None:
    with pytest.raises(TypeError):
        ResidencyPolicyMetadata(0, bad)


@pytest.mark.parametrize("bad", BLANK_STR, ids=BLANK_STR_IDS)
def test_metadata_stable_key_blank(bad: str) -> None:
    with pytest.raises(ValueError):
        ResidencyPolicyMetadata(0, bad)


def test_metadata_check_order() -> None:
    with pytest.raises(TypeError):
        ResidencyPolicyMetadata(True, "")
    with pytest.raises(TypeError):
        ResidencyPolicyMetadata(np.int64(1), "")  # type: ignore[arg-type]


# --- ResidencyEvictionCandidate ------------------------------------------------------------------

CANDIDATE_FIELDS = [
    "handle",
    "location",
    "charged_nbytes",
    "registration_index",
    "last_access_epoch",
    "metadata",
]


def _cand(**overrides: Any) -> ResidencyEvictionCandidate:
    fields: dict[str, Any] = {
        "handle": H1,
        "location": CUDA0,
        "charged_nbytes": 100,
        "registration_index": 0,
        "last_access_epoch": None,
        "metadata": META,
    }
    fields.update(overrides)
    return ResidencyEvictionCandidate(**fields)


def test_candidate_record(frozen_record) -> None:
    c = _cand(last_access_epoch=4, metadata=ResidencyPolicyMetadata(2, "k"))
    assert c.handle == H1
    assert c.location == CUDA0
    assert c.charged_nbytes == 100
    assert c.registration_index == 0
    assert c.last_access_epoch == 4
    assert c.metadata == ResidencyPolicyMetadata(2, "k")
    frozen_record(c, CANDIDATE_FIELDS)
    frozen_record(_cand(), CANDIDATE_FIELDS)


def test_candidate_all_fields_required() -> None:
    with pytest.raises(TypeError):
        ResidencyEvictionCandidate(H1, CUDA0, 1, 0, None)  # type: ignore[call-arg]


def test_candidate_zero_values_allowed() -> None:
    c = _cand(charged_nbytes=0, registration_index=0, last_access_epoch=0)
    assert (c.charged_nbytes, c.registration_index, c.last_access_epoch) == (0, 0, 0)


@pytest.mark.parametrize("field", ["charged_nbytes", "registration_index"])
@pytest.mark.parametrize("bad", NOT_STRICT_INT, ids=NOT_STRICT_INT_IDS)
def test_candidate_int_fields_strict(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        _cand(**{field: bad})


@pytest.mark.parametrize("field", ["charged_nbytes", "registration_index", "last_access_epoch"])
def test_candidate_int_fields_negative(field: str) -> None:
    with pytest.raises(ValueError):
        _cand(**{field: -1})


@pytest.mark.parametrize("bad", NOT_STRICT_INT_NONE_OK, ids=NOT_STRICT_INT_NONE_OK_IDS)
def test_candidate_epoch_strict(bad: Any) -> None:
    with pytest.raises(TypeError):
        _cand(last_access_epoch=bad)


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("handle", "h1"),
        ("handle", None),
        ("location", "cuda:0"),
        ("location", None),
        ("metadata", None),
        ("metadata", (0, None)),
    ],
    ids=repr,
)
def test_candidate_object_field_types(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        _cand(**{field: bad})


def test_candidate_check_order() -> None:
    with pytest.raises(TypeError):  # 1. handle
        ResidencyEvictionCandidate("h", "l", -1, -1, -1, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # 2. location
        ResidencyEvictionCandidate(H1, "l", -1, -1, -1, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # 3. charged range before registration type
        ResidencyEvictionCandidate(H1, CUDA0, -1, True, -1, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # 3. charged type before registration range
        ResidencyEvictionCandidate(H1, CUDA0, True, -1, -1, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # 3. registration range before epoch type
        ResidencyEvictionCandidate(H1, CUDA0, 0, -1, "x", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # 3. registration type before epoch range
        ResidencyEvictionCandidate(H1, CUDA0, 0, 1.0, -1, META)  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # 4. epoch range before metadata type
        ResidencyEvictionCandidate(H1, CUDA0, 0, 0, -1, "m")  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # 4. epoch type
        ResidencyEvictionCandidate(H1, CUDA0, 0, 0, np.int64(2), "m")  # type: ignore[arg-type]


# --- ResidencyPolicy protocol --------------------------------------------------------------------


class _StructuralPolicy:
    name = "custom"
    config_identity = ()

    def fallback_locations(self, location: ResidencyLocation) -> tuple[ResidencyLocation, ...]:
        return ()

    def order_candidates(self, candidates: Any) -> tuple[ResidencyEvictionCandidate, ...]:
        return tuple(candidates)


def test_policy_protocol_is_runtime_structural() -> None:
    assert isinstance(DeterministicTieredLRU(), ResidencyPolicy)
    assert isinstance(_StructuralPolicy(), ResidencyPolicy)
    assert not isinstance(object(), ResidencyPolicy)
    assert not isinstance("policy", ResidencyPolicy)


@pytest.mark.parametrize(
    "missing", ["name", "config_identity", "fallback_locations", "order_candidates"]
)
def test_policy_protocol_requires_all_four_members(missing: str) -> None:
    members: dict[str, Any] = {
        "name": "n",
        "config_identity": (),
        "fallback_locations": lambda location: (),
        "order_candidates": tuple,
    }
    assert isinstance(types.SimpleNamespace(**members), ResidencyPolicy)
    del members[missing]
    assert not isinstance(types.SimpleNamespace(**members), ResidencyPolicy)


# --- DeterministicTieredLRU: construction --------------------------------------------------------


def test_lru_without_tiers() -> None:
    for policy in (DeterministicTieredLRU(), DeterministicTieredLRU(None)):
        assert policy.name == "deterministic-tiered-lru"
        assert policy.config_identity == (("fallback_tiers", ()),)
        assert policy.fallback_locations(CUDA0) == ()
        assert policy.fallback_locations(PAGEABLE_HOST) == ()
    assert DeterministicTieredLRU(fallback_tiers=None).config_identity == (("fallback_tiers", ()),)
    assert DeterministicTieredLRU({}).config_identity == (("fallback_tiers", ()),)


def test_lru_config_identity_uses_names_and_keeps_order() -> None:
    tiers = {
        CUDA1: [CUDA0, PINNED_HOST, PAGEABLE_HOST],
        CUDA0: (PINNED_HOST,),
        PINNED_HOST: [],
    }
    policy = DeterministicTieredLRU(tiers)
    expected = (
        (
            "fallback_tiers",
            (
                ("cuda:1", ("cuda:0", "pinned-host", "pageable-host")),
                ("cuda:0", ("pinned-host",)),
                ("pinned-host", ()),
            ),
        ),
    )
    assert policy.config_identity == expected
    assert DeterministicTieredLRU(fallback_tiers=tiers).config_identity == expected
    reordered = DeterministicTieredLRU(dict(reversed(list(tiers.items()))))
    assert reordered.config_identity != expected
    hash(policy.config_identity)


def test_lru_fallback_locations() -> None:
    policy = DeterministicTieredLRU({CUDA0: [PINNED_HOST, PAGEABLE_HOST], PINNED_HOST: []})
    result = policy.fallback_locations(CUDA0)
    assert result == (PINNED_HOST, PAGEABLE_HOST)
    assert type(result) is tuple
    assert policy.fallback_locations(cuda_location("cuda:0")) == (PINNED_HOST, PAGEABLE_HOST)
    assert policy.fallback_locations(ResidencyLocation("cuda", "cuda:0")) == result
    assert policy.fallback_locations(PINNED_HOST) == ()
    # Never inferred: no configured entry, no tiers, even though the chain would suggest one.
    assert policy.fallback_locations(CUDA1) == ()
    assert policy.fallback_locations(PAGEABLE_HOST) == ()


@pytest.mark.parametrize("bad", ["cuda:0", None, CUDA0.device], ids=repr)
def test_lru_fallback_locations_rejects_non_location(bad: Any) -> None:
    policy = DeterministicTieredLRU({CUDA0: [PINNED_HOST]})
    with pytest.raises(TypeError):
        policy.fallback_locations(bad)


def test_lru_is_isolated_from_input_mutation() -> None:
    destinations = [PINNED_HOST]
    tiers = {CUDA0: destinations}
    policy = DeterministicTieredLRU(tiers)
    destinations.append(PAGEABLE_HOST)
    tiers[CUDA1] = [PAGEABLE_HOST]
    assert policy.fallback_locations(CUDA0) == (PINNED_HOST,)
    assert policy.fallback_locations(CUDA1) == ()
    assert policy.config_identity == (("fallback_tiers", (("cuda:0", ("pinned-host",)),)),)


def test_lru_is_immutable() -> None:
    policy = DeterministicTieredLRU({CUDA0: [PINNED_HOST]})
    with pytest.raises(AttributeError):
        policy.name = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        policy.config_identity = ()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        policy.fallback_tiers = {}  # type: ignore[attr-defined]
    assert policy.name == "deterministic-tiered-lru"
    assert policy.fallback_locations(CUDA0) == (PINNED_HOST,)
    assert policy.config_identity == (("fallback_tiers", (("cuda:0", ("pinned-host",)),)),)


class _CustomMapping(Mapping[Any, Any]):
    def __init__(self, items: list[tuple[Any, Any]]) -> None:
        self._items = items

    def __getitem__(self, key: Any) -> Any:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        return iter([k for k, _ in self._items])

    def __len__(self) -> int:
        return len(self._items)


def test_lru_accepts_any_mapping_and_iterable_destinations() -> None:
    proxy = types.MappingProxyType({CUDA0: [PINNED_HOST]})
    assert DeterministicTieredLRU(proxy).fallback_locations(CUDA0) == (PINNED_HOST,)
    custom = _CustomMapping([(CUDA1, iter([CUDA0])), (CUDA0, (x for x in [PAGEABLE_HOST]))])
    policy = DeterministicTieredLRU(custom)
    assert policy.fallback_locations(CUDA1) == (CUDA0,)
    assert policy.fallback_locations(CUDA0) == (PAGEABLE_HOST,)
    assert policy.config_identity == (
        ("fallback_tiers", (("cuda:1", ("cuda:0",)), ("cuda:0", ("pageable-host",)))),
    )


@pytest.mark.parametrize(
    "bad",
    [[(CUDA0, [PINNED_HOST])], ((CUDA0, (PINNED_HOST,)),), "cuda:0", 5, {CUDA0}],
    ids=["list-of-pairs", "tuple-of-pairs", "str", "int", "set"],
)
def test_lru_rejects_non_mapping(bad: Any) -> None:
    with pytest.raises(TypeError):
        DeterministicTieredLRU(bad)


@pytest.mark.parametrize(
    "tiers",
    [
        {"cuda:0": [PINNED_HOST]},
        {CUDA0.device: [PINNED_HOST]},
        {CUDA0: ["pinned-host"]},
        {CUDA0: [PINNED_HOST, None]},
        {CUDA0: 5},
        {CUDA0: None},
    ],
    ids=["str-key", "device-key", "str-dest", "none-dest", "int-dests", "none-dests"],
)
def test_lru_type_errors(tiers: Any) -> None:
    with pytest.raises(TypeError):
        DeterministicTieredLRU(tiers)


@pytest.mark.parametrize(
    "tiers",
    [
        {CUDA0: [CUDA0]},
        {CUDA0: [PINNED_HOST, cuda_location("cuda:0")]},
        {PINNED_HOST: [PAGEABLE_HOST, PAGEABLE_HOST]},
        {CUDA0: [PINNED_HOST, PAGEABLE_HOST, PINNED_HOST]},
    ],
    ids=["self", "self-late", "dup", "dup-late"],
)
def test_lru_value_errors(tiers: Any) -> None:
    with pytest.raises(ValueError):
        DeterministicTieredLRU(tiers)


def test_lru_check_order_within_and_across_entries() -> None:
    # Within an entry: destination element types (TypeError) before the self check.
    with pytest.raises(TypeError):
        DeterministicTieredLRU({CUDA0: [CUDA0, "pinned-host"]})
    # Entries processed in iteration order: the first bad entry decides.
    with pytest.raises(ValueError):
        DeterministicTieredLRU({CUDA0: [CUDA0], "bad-key": []})
    with pytest.raises(TypeError):
        DeterministicTieredLRU({"bad-key": [], CUDA0: [CUDA0]})
    with pytest.raises(ValueError):
        DeterministicTieredLRU({PINNED_HOST: [PAGEABLE_HOST, PAGEABLE_HOST], CUDA0: ["x"]})
    with pytest.raises(TypeError):
        DeterministicTieredLRU({CUDA0: ["x"], PINNED_HOST: [PAGEABLE_HOST, PAGEABLE_HOST]})


# --- DeterministicTieredLRU.order_candidates -----------------------------------------------------


def _key(c: ResidencyEvictionCandidate) -> tuple[Any, ...]:
    epoch = -1 if c.last_access_epoch is None else c.last_access_epoch
    stable_key = c.metadata.stable_key
    return (
        c.metadata.priority,
        epoch,
        0 if stable_key is not None else 1,
        stable_key or "",
        c.registration_index,
    )


def _ids(candidates: Any) -> list[int]:
    return [id(c) for c in candidates]


def test_order_empty_and_type() -> None:
    policy = DeterministicTieredLRU()
    assert policy.order_candidates([]) == ()
    assert policy.order_candidates(iter(())) == ()
    result = policy.order_candidates([_cand()])
    assert type(result) is tuple
    assert result == (_cand(),)


@pytest.mark.parametrize("bad", ["c", None, H1, (H1, CUDA0)], ids=repr)
def test_order_rejects_non_candidates(bad: Any) -> None:
    with pytest.raises(TypeError):
        DeterministicTieredLRU().order_candidates([_cand(), bad])


def test_order_lower_priority_first_even_if_recent() -> None:
    low = _cand(metadata=ResidencyPolicyMetadata(-1), last_access_epoch=1000, registration_index=9)
    mid = _cand(metadata=ResidencyPolicyMetadata(0), last_access_epoch=None)
    high = _cand(
        metadata=ResidencyPolicyMetadata(5, "a"), last_access_epoch=0, registration_index=0
    )
    assert _ids(DeterministicTieredLRU().order_candidates([high, mid, low])) == _ids(
        [low, mid, high]
    )


def test_order_never_accessed_is_oldest() -> None:
    never = _cand(last_access_epoch=None, registration_index=5)
    zero = _cand(last_access_epoch=0, registration_index=0)
    later = _cand(last_access_epoch=3, registration_index=0)
    assert _ids(DeterministicTieredLRU().order_candidates([later, zero, never])) == _ids(
        [never, zero, later]
    )


def test_order_keyed_before_unkeyed_then_key_text_then_registration() -> None:
    unkeyed = _cand(metadata=ResidencyPolicyMetadata(0, None), registration_index=0)
    key_b = _cand(metadata=ResidencyPolicyMetadata(0, "b"), registration_index=0)
    key_a2 = _cand(metadata=ResidencyPolicyMetadata(0, "a"), registration_index=2)
    key_a1 = _cand(metadata=ResidencyPolicyMetadata(0, "a"), registration_index=1)
    key_upper = _cand(metadata=ResidencyPolicyMetadata(0, "Z"), registration_index=7)
    ordered = DeterministicTieredLRU().order_candidates([unkeyed, key_b, key_a2, key_a1, key_upper])
    # "Z" < "a" < "b" by code point; unkeyed (rank 1) last despite its registration index 0.
    assert _ids(ordered) == _ids([key_upper, key_a1, key_a2, key_b, unkeyed])


def test_order_unkeyed_by_registration_index() -> None:
    cands = [_cand(registration_index=i) for i in (3, 0, 2, 1)]
    ordered = DeterministicTieredLRU().order_candidates(cands)
    assert [c.registration_index for c in ordered] == [0, 1, 2, 3]


def test_order_ignores_handle_location_and_bytes_and_is_stable() -> None:
    a = _cand(handle=make_handle(handle_id="zzz"), location=CUDA1, charged_nbytes=1)
    b = _cand(handle=make_handle(handle_id="aaa"), location=CUDA0, charged_nbytes=10**9)
    c = _cand(handle=make_handle(handle_id="mmm"), location=PINNED_HOST, charged_nbytes=0)
    policy = DeterministicTieredLRU()
    assert _ids(policy.order_candidates([a, b, c])) == _ids([a, b, c])
    assert _ids(policy.order_candidates([c, b, a])) == _ids([c, b, a])
    # Equal candidates (same fields) keep their input positions too.
    x, y = _cand(), _cand()
    assert _ids(policy.order_candidates([x, y])) == _ids([x, y])
    assert _ids(policy.order_candidates([y, x])) == _ids([y, x])


def test_order_ignores_fallback_configuration() -> None:
    cands = [_cand(registration_index=i, location=loc) for i, loc in enumerate([CUDA0, CUDA1])]
    tiered = DeterministicTieredLRU({CUDA0: [PINNED_HOST]})
    assert _ids(tiered.order_candidates(cands[::-1])) == _ids(cands)


_metadata = st.builds(
    ResidencyPolicyMetadata,
    st.integers(min_value=-2, max_value=2),
    st.one_of(st.none(), st.sampled_from(["a", "b", "B", "ab"])),
)
_candidate = st.builds(
    ResidencyEvictionCandidate,
    st.sampled_from([make_handle(handle_id=f"h{i}") for i in range(3)]),
    st.sampled_from([CUDA0, CUDA1, PINNED_HOST, PAGEABLE_HOST]),
    st.integers(min_value=0, max_value=4),
    st.integers(min_value=0, max_value=3),
    st.one_of(st.none(), st.integers(min_value=0, max_value=3)),
    _metadata,
)


@given(st.lists(_candidate, max_size=12))
def test_order_is_stable_sort_by_documented_key(
    candidates: list[ResidencyEvictionCandidate],
) -> None:
    policy = DeterministicTieredLRU({CUDA0: [PINNED_HOST]})
    ordered = policy.order_candidates(candidates)
    expected = sorted(candidates, key=_key)
    assert type(ordered) is tuple
    assert _ids(ordered) == _ids(expected)
    # Every input exactly once.
    assert sorted(_ids(ordered)) == sorted(_ids(candidates))
    # Deterministic: repeated calls and a tuple/generator input give the same order.
    assert _ids(policy.order_candidates(tuple(candidates))) == _ids(ordered)
    assert _ids(policy.order_candidates(c for c in candidates)) == _ids(ordered)


@given(st.lists(_candidate, max_size=10), st.randoms(use_true_random=False))
def test_order_depends_only_on_keys_up_to_ties(
    candidates: list[ResidencyEvictionCandidate], rnd: Any
) -> None:
    shuffled = list(candidates)
    rnd.shuffle(shuffled)
    policy = DeterministicTieredLRU()
    assert [_key(c) for c in policy.order_candidates(shuffled)] == sorted(
        _key(c) for c in candidates
    )
