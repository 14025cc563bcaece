"""Values people already have, managed without writing a subclass: a tensor, a
state_dict, a list or tuple of tensors, and a safetensors file on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fhelium.residency import PAGEABLE_HOST, ReplicaMode, ResidencyManager
from fhelium.residency.sources import SafetensorsSource
from fhelium.values import (
    ResidentTensor,
    TensorBundle,
    TensorResident,
    TensorSequence,
    as_resident,
)


def test_as_resident_wraps_each_kind_and_keeps_residents() -> None:
    tensor = torch.arange(4.0)
    assert isinstance(as_resident(tensor), ResidentTensor)
    state = {"weight": torch.zeros(2, 2), "bias": torch.ones(2)}
    bundle = as_resident(state)
    assert isinstance(bundle, TensorBundle)
    assert bundle.names == ("weight", "bias")
    listed = as_resident([torch.zeros(1), torch.ones(3)])
    assert isinstance(listed, TensorSequence)
    assert len(listed) == 2
    assert listed[1].shape == (3,)
    assert isinstance(as_resident((torch.zeros(1),)), TensorSequence)
    assert as_resident(bundle) is bundle
    with pytest.raises(TypeError):
        as_resident("not tensors")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        as_resident(3)  # type: ignore[arg-type]


def test_tensor_sequence_checks_and_moves() -> None:
    with pytest.raises(ValueError, match="at least one"):
        TensorSequence([])
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        TensorSequence([torch.zeros(1), 2])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        TensorSequence(torch.zeros(2))  # type: ignore[arg-type]
    value = TensorSequence([torch.zeros(2), torch.ones(3)])
    assert value.nbytes == 20
    copied = value.to("cpu", copy=True)
    assert isinstance(copied, TensorSequence)
    assert copied is not value
    assert copied[1].data_ptr() != value[1].data_ptr()
    assert torch.equal(copied[1], value[1])
    assert "TensorSequence([<" in repr(value)


def test_a_state_dict_and_a_list_are_managed_directly() -> None:
    manager = ResidencyManager({PAGEABLE_HOST: 1 << 20})
    state = as_resident({"weight": torch.randn(8, 8), "bias": torch.zeros(8)})
    layers = as_resident([torch.randn(4), torch.randn(4)])
    handles = [
        manager.adopt(state, replica_mode=ReplicaMode.REPLICABLE),
        manager.adopt(layers),
    ]
    with manager.acquire(handles, at=PAGEABLE_HOST) as values:
        assert values[handles[0]] is state
        assert values[handles[1]] is layers
    used = manager.snapshot().locations[0].used_bytes
    assert used == state.storage_nbytes + layers.storage_nbytes
    manager.close()


def test_safetensors_source_reconstructs_from_disk(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "weights.safetensors"
    save_file({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}, str(path))
    single: SafetensorsSource[ResidentTensor] = SafetensorsSource(path, "a")
    spec = single.spec()
    assert (spec.value_type, spec.logical_nbytes, spec.storage_nbytes) == (ResidentTensor, 24, 24)
    pair: SafetensorsSource[TensorBundle] = SafetensorsSource(path, ["a", "b"])
    assert pair.spec().logical_nbytes == 40
    manager = ResidencyManager()
    handle = manager.register_source(spec, single)
    manager.ensure(handle, PAGEABLE_HOST)
    with manager.acquire([handle], at=PAGEABLE_HOST) as values:
        loaded: TensorResident = values[handle]
        assert isinstance(loaded, ResidentTensor)
        assert torch.equal(loaded.tensor, torch.arange(6.0).reshape(2, 3))
    manager.drop(handle, PAGEABLE_HOST)  # reconstructible: the file can rebuild it
    manager.ensure(handle, PAGEABLE_HOST)
    manager.close()
    with pytest.raises(ValueError, match="at least one"):
        SafetensorsSource(path, [])
