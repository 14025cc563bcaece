"""Handle ids as the manager issues and resolves them (docs/concepts/values.md#handles).

Ids are version 4 UUIDs in their lower-case hyphenated form; a handle built by hand
with the same fields names the same value; any other spelling names nothing; and the
operations that run in one core call refuse what is not a location record exactly as
the general path does.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import torch

from fhelium.errors import ResidencyHandleError
from fhelium.residency import (
    PAGEABLE_HOST,
    Recoverability,
    ReplicaMode,
    ResidencyHandle,
    ResidencyManager,
    ResidencyValueSpec,
)
from fhelium.values import ResidentTensor

SPEC = ResidencyValueSpec(
    ResidentTensor, 32, 32, ReplicaMode.REPLICABLE, Recoverability.RECONSTRUCTIBLE
)


class Source:
    def load(self) -> ResidentTensor:
        return ResidentTensor(torch.zeros(8))


def test_issued_ids_are_distinct_version_4_uuids() -> None:
    manager = ResidencyManager()
    handles = [manager.register_source(SPEC, Source()) for _ in range(500)]
    handles += [manager.adopt(ResidentTensor(torch.zeros(2))) for _ in range(50)]
    ids = [handle.handle_id for handle in handles]
    assert len(set(ids)) == len(ids)
    for handle_id in ids:
        parsed = uuid.UUID(handle_id)
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
        assert str(parsed) == handle_id
    assert all(handle.manager_id == manager.manager_id for handle in handles)
    manager.close()


def test_a_handle_built_by_hand_names_the_same_value() -> None:
    manager = ResidencyManager()
    issued = manager.register_source(SPEC, Source())
    twin: ResidencyHandle[Any] = ResidencyHandle(
        issued.manager_id, issued.handle_id, issued.value_type
    )
    assert twin == issued
    assert twin is not issued
    assert not manager.ensure(twin, PAGEABLE_HOST).no_op
    assert manager.ensure(issued, PAGEABLE_HOST).no_op
    with manager.acquire([twin], at=PAGEABLE_HOST) as values:
        assert values[twin].tensor.shape == (8,)
    assert not manager.drop(twin, PAGEABLE_HOST).no_op
    manager.close()


@pytest.mark.parametrize(
    "respell",
    [str.upper, lambda text: text.replace("-", ""), lambda text: "{" + text + "}"],
    ids=["upper", "no-hyphens", "braced"],
)
def test_other_spellings_of_an_id_name_no_value(respell: Any) -> None:
    manager = ResidencyManager()
    issued = manager.register_source(SPEC, Source())
    other: ResidencyHandle[Any] = ResidencyHandle(
        issued.manager_id, respell(issued.handle_id), issued.value_type
    )
    with pytest.raises(ResidencyHandleError, match="unknown handle"):
        manager.ensure(other, PAGEABLE_HOST)
    with pytest.raises(ResidencyHandleError, match="unknown handle"):
        manager.acquire([other], at=PAGEABLE_HOST)
    manager.close()


def test_an_id_from_another_manager_is_foreign_even_when_the_index_matches() -> None:
    first, second = ResidencyManager(), ResidencyManager()
    mine = first.register_source(SPEC, Source())
    second.register_source(SPEC, Source())
    with pytest.raises(ResidencyHandleError, match="belongs to manager"):
        second.ensure(mine, PAGEABLE_HOST)
    # Same id text under the second manager's id: an unknown handle there.
    forged: ResidencyHandle[Any] = ResidencyHandle(
        second.manager_id, mine.handle_id, mine.value_type
    )
    with pytest.raises(ResidencyHandleError, match="unknown handle"):
        second.ensure(forged, PAGEABLE_HOST)
    first.close()
    second.close()


def test_a_discarded_value_is_named_discarded_through_an_equal_handle() -> None:
    manager = ResidencyManager()
    issued = manager.register_source(SPEC, Source())
    manager.discard(issued)
    twin: ResidencyHandle[Any] = ResidencyHandle(
        issued.manager_id, issued.handle_id, issued.value_type
    )
    with pytest.raises(ResidencyHandleError, match="is discarded"):
        manager.ensure(twin, PAGEABLE_HOST)
    with pytest.raises(ResidencyHandleError, match="is discarded"):
        manager.acquire((twin,), at=PAGEABLE_HOST)
    manager.close()


class LooksLikeALocation:
    """Carries a host location's fields without being a location record."""

    kind = "pageable-host"
    device = torch.device("cpu")


def test_one_call_paths_refuse_what_is_not_a_location_record() -> None:
    manager = ResidencyManager()
    issued = manager.adopt(ResidentTensor(torch.zeros(4)), at=PAGEABLE_HOST)
    fake: Any = LooksLikeALocation()
    with pytest.raises(TypeError):
        manager.acquire((issued,), at=fake)
    with pytest.raises(TypeError):
        manager.adopt(ResidentTensor(torch.zeros(4)), at=fake)
    with pytest.raises(TypeError):
        manager.register_source(SPEC, Source(), source_location=fake)
    assert [value.handle for value in manager.snapshot().values] == [issued]
    manager.close()


def test_a_finished_operation_is_visible_to_the_next_snapshot_on_any_thread() -> None:
    manager = ResidencyManager()
    handle = manager.register_source(SPEC, Source())
    before = manager.snapshot()
    manager.ensure(handle, PAGEABLE_HOST)
    seen: list[int] = []
    worker = threading.Thread(
        target=lambda: seen.append(len(manager.snapshot().values[0].materializations))
    )
    worker.start()
    worker.join()
    assert seen == [1]
    assert manager.snapshot().state_version > before.state_version
    manager.drop(handle, PAGEABLE_HOST)
    assert manager.snapshot().values[0].materializations == ()
    assert before.values[0].materializations == ()
    manager.close()
