"""Checkpoints for fhelium.residency.nn: safetensors files and sharded indexes read lazily,
validated before anything runs (errors name the key and the file), one value's source
reading only its tensors' byte ranges, casts, files that change under the reader, and
`init_empty_weights`.

The sharded layout is the one transformers' ``save_pretrained(max_shard_size=...)``
writes, produced here with ``safetensors.torch.save_file`` and an index written by hand.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fhelium import errors
from fhelium.errors import (
    ResidencyCheckpointError,
    ResidencyError,
    ResidencyMaterializationError,
)
from fhelium.residency import PAGEABLE_HOST, PINNED_HOST, ResidencyManager
from fhelium.residency.nn import _checkpoint, init_empty_weights
from fhelium.residency.nn._checkpoint import INDEX, SINGLE, Checkpoint, CheckpointSource
from fhelium.residency.simulation import SimulatedRuntime, use_runtime
from fhelium.values import TensorBundle
from helpers.manager import assert_balanced


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(26)
    return {
        "embed.weight": torch.randn(16, 8, generator=generator),
        "layers.0.weight": torch.randn(8, 8, generator=generator).to(torch.bfloat16),
        "layers.0.bias": torch.randn(8, generator=generator).to(torch.float16),
        "layers.1.weight": torch.randn(8, 8, generator=generator, dtype=torch.float64),
        "layers.1.steps": torch.arange(5, dtype=torch.int64),
        "layers.1.mask": torch.tensor([True, False, True]),
        "layers.1.codes": torch.tensor([1, 255, 7], dtype=torch.uint8),
        "norm.scale": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
    }


SHARDS = (
    ("embed.weight", "empty"),
    ("layers.0.weight", "layers.0.bias", "norm.scale"),
    ("layers.1.weight", "layers.1.steps", "layers.1.mask", "layers.1.codes"),
)


def _write_sharded(directory: Path, tensors: Mapping[str, torch.Tensor]) -> Path:
    """The save_pretrained layout: model-0000i-of-0000n.safetensors plus the index."""
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for number, keys in enumerate(SHARDS, start=1):
        name = f"model-{number:05d}-of-{len(SHARDS):05d}.safetensors"
        save_file({key: tensors[key] for key in keys}, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX).write_text(json.dumps(index, indent=2))
    return directory


def _write_raw(path: Path, header: dict[str, Any], data: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    return _tensors()


@pytest.fixture
def single(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / "weights.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "note": "single"})
    return path


@pytest.fixture
def sharded(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    return _write_sharded(tmp_path / "sharded", tensors)


def _load_all(checkpoint: Checkpoint, dtype: torch.dtype | None = None) -> TensorBundle:
    keys = checkpoint.keys()
    return checkpoint.source(dict(zip(keys, keys, strict=True)), dtype=dtype).load()


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(got, want)


# --- opening and round trips ------------------------------------------------------------


def test_a_single_file_round_trips(single: Path, tensors: dict[str, torch.Tensor]) -> None:
    checkpoint = Checkpoint.open(single)
    assert sorted(checkpoint.keys()) == sorted(tensors)
    assert "embed.weight" in checkpoint
    assert "lm_head.weight" not in checkpoint
    assert checkpoint.files == (single,)
    assert checkpoint.metadata == {"format": "pt", "note": "single"}
    loaded = _load_all(checkpoint)
    assert loaded.names == checkpoint.keys()
    for key, tensor in tensors.items():
        _assert_same(loaded[key], tensor)
        found = checkpoint.entry(key)
        assert (found.path, found.dtype, found.shape) == (single, tensor.dtype, tensor.shape)
        assert found.nbytes == tensor.numel() * tensor.element_size()


def test_a_directory_with_model_safetensors(
    tmp_path: Path, tensors: dict[str, torch.Tensor]
) -> None:
    save_file(tensors, tmp_path / SINGLE)
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.files == (tmp_path / SINGLE,)
    _assert_same(_load_all(checkpoint)["layers.0.weight"], tensors["layers.0.weight"])


def test_a_sharded_checkpoint_round_trips(sharded: Path, tensors: dict[str, torch.Tensor]) -> None:
    checkpoint = Checkpoint.open(sharded)
    assert checkpoint.keys() == tuple(sorted(tensors))
    assert "norm.scale" in checkpoint
    assert "ghost" not in checkpoint
    assert len(checkpoint.files) == len(SHARDS)
    assert checkpoint.metadata["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    loaded = _load_all(checkpoint)
    for key, tensor in tensors.items():
        _assert_same(loaded[key], tensor)
    shard_of = {key: number for number, keys in enumerate(SHARDS, 1) for key in keys}
    for key in tensors:
        assert checkpoint.entry(key).path.name.startswith(f"model-{shard_of[key]:05d}-")


def test_the_bundle_follows_the_given_names_and_order(sharded: Path) -> None:
    checkpoint = Checkpoint.open(sharded)
    names = {"scale": "norm.scale", "w": "layers.1.weight", "table": "embed.weight"}
    source = checkpoint.source(names)
    value = source.load()
    assert value.names == ("scale", "w", "table")
    assert source.names == ("scale", "w", "table")
    assert [found.path.name[:11] for found in source.entries] == [
        "model-00002",
        "model-00003",
        "model-00001",
    ]


def test_the_single_file_wins_over_an_index(
    sharded: Path, tensors: dict[str, torch.Tensor]
) -> None:
    # transformers looks for model.safetensors first.
    save_file({"only": torch.ones(2)}, sharded / SINGLE)
    assert Checkpoint.open(sharded).keys() == ("only",)


def test_shard_headers_are_read_only_when_needed(sharded: Path) -> None:
    checkpoint = Checkpoint.open(sharded)
    third = checkpoint.files[2]
    third.write_bytes(b"\xff" * 64)  # not a safetensors file any more
    value = checkpoint.source({"w": "layers.0.weight", "e": "embed.weight"}).load()
    assert value["w"].dtype == torch.bfloat16
    with pytest.raises(ResidencyCheckpointError) as raised:
        checkpoint.entry("layers.1.steps")
    assert (raised.value.key, raised.value.path) == ("layers.1.steps", str(third))


# --- validation: every failure names the key and the file -------------------------------


def _expected(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {key: (tensor.shape, tensor.dtype) for key, tensor in tensors.items()}


def test_check_accepts_what_is_there(
    single: Path, sharded: Path, tensors: dict[str, torch.Tensor]
) -> None:
    for path in (single, sharded):
        Checkpoint.open(path).check(_expected(tensors))


def test_a_missing_key_names_the_key_and_the_file(
    single: Path, sharded: Path, tensors: dict[str, torch.Tensor]
) -> None:
    expected = {**_expected(tensors), "lm_head.weight": (torch.Size([16, 8]), torch.float32)}
    for path, named in ((single, single), (sharded, sharded / INDEX)):
        with pytest.raises(ResidencyCheckpointError) as raised:
            Checkpoint.open(path).check(expected)
        assert (raised.value.key, raised.value.path) == ("lm_head.weight", str(named))
        assert "'lm_head.weight'" in str(raised.value)
        assert str(named) in str(raised.value)


def test_a_wrong_shape_names_the_key_and_the_shard(
    sharded: Path, tensors: dict[str, torch.Tensor]
) -> None:
    expected = _expected(tensors)
    expected["layers.0.weight"] = (torch.Size([8, 9]), torch.bfloat16)
    checkpoint = Checkpoint.open(sharded)
    with pytest.raises(ResidencyCheckpointError) as raised:
        checkpoint.check(expected)
    assert raised.value.key == "layers.0.weight"
    assert raised.value.path == str(checkpoint.entry("layers.0.weight").path)
    assert "[8, 8]" in str(raised.value)
    assert "[8, 9]" in str(raised.value)


@pytest.mark.parametrize(
    ("key", "module_dtype", "cast"),
    [
        ("embed.weight", torch.int64, None),  # float into an integer tensor
        ("embed.weight", torch.bool, torch.float16),  # ... a bool one, even with a cast
        ("layers.1.steps", torch.float32, None),  # integer into a float tensor
        ("layers.1.steps", torch.float32, torch.float32),  # integers are never cast
        ("layers.1.steps", torch.int32, torch.float32),  # nor between integer widths
        ("layers.1.mask", torch.uint8, None),
        ("layers.0.weight", torch.float32, None),  # float to float needs dtype=
    ],
)
def test_a_dtype_that_does_not_load_names_the_key_and_the_file(
    single: Path,
    tensors: dict[str, torch.Tensor],
    key: str,
    module_dtype: torch.dtype,
    cast: torch.dtype | None,
) -> None:
    expected = _expected(tensors)
    expected[key] = (tensors[key].shape, module_dtype)
    with pytest.raises(ResidencyCheckpointError) as raised:
        Checkpoint.open(single).check(expected, dtype=cast)
    assert (raised.value.key, raised.value.path) == (key, str(single))
    assert str(tensors[key].dtype) in str(raised.value)


def test_float_to_float_is_a_cast_when_dtype_is_given(
    single: Path, tensors: dict[str, torch.Tensor]
) -> None:
    expected = _expected(tensors)
    expected["layers.0.weight"] = (torch.Size([8, 8]), torch.float32)
    checkpoint = Checkpoint.open(single)
    with pytest.raises(ResidencyCheckpointError, match="dtype="):
        checkpoint.check(expected)
    checkpoint.check(expected, dtype=torch.float32)


def test_check_and_source_refuse_bad_arguments(single: Path) -> None:
    checkpoint = Checkpoint.open(single)
    with pytest.raises(TypeError):
        checkpoint.check({"empty": torch.Size([0, 4])})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        checkpoint.check({}, dtype="float16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="floating"):
        checkpoint.check({}, dtype=torch.int8)
    with pytest.raises(ValueError, match="at least one"):
        checkpoint.source({})
    with pytest.raises(ValueError, match="non-empty"):
        checkpoint.source({" ": "empty"})
    with pytest.raises(TypeError):
        checkpoint.source({"a": 3})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        Checkpoint.open(3)  # type: ignore[arg-type]


def test_an_index_pointing_at_a_missing_shard(sharded: Path) -> None:
    checkpoint = Checkpoint.open(sharded)
    gone = checkpoint.files[1]
    gone.unlink()
    with pytest.raises(ResidencyCheckpointError, match="does not exist") as raised:
        checkpoint.check({"norm.scale": (torch.Size([]), torch.float32)})
    assert (raised.value.key, raised.value.path) == ("norm.scale", str(gone))


def test_an_index_naming_a_tensor_its_shard_lacks(sharded: Path) -> None:
    index = json.loads((sharded / INDEX).read_text())
    index["weight_map"]["ghost"] = index["weight_map"]["embed.weight"]
    (sharded / INDEX).write_text(json.dumps(index))
    checkpoint = Checkpoint.open(sharded)
    with pytest.raises(ResidencyCheckpointError) as raised:
        checkpoint.check({"ghost": (torch.Size([1]), torch.float32)})
    assert raised.value.key == "ghost"
    assert raised.value.path == str(checkpoint.entry("embed.weight").path)


@pytest.mark.parametrize("shard", ["../model.safetensors", "/etc/passwd", "sub/x.safetensors", ""])
def test_an_index_may_only_name_files_beside_it(sharded: Path, shard: str) -> None:
    index = json.loads((sharded / INDEX).read_text())
    index["weight_map"]["embed.weight"] = shard
    (sharded / INDEX).write_text(json.dumps(index))
    with pytest.raises(ResidencyCheckpointError) as raised:
        Checkpoint.open(sharded)
    assert (raised.value.key, raised.value.path) == ("embed.weight", str(sharded / INDEX))


@pytest.mark.parametrize("text", ["{", "[]", '{"metadata": {}}', '{"weight_map": []}'])
def test_a_damaged_index(tmp_path: Path, text: str) -> None:
    (tmp_path / INDEX).write_text(text)
    with pytest.raises(ResidencyCheckpointError) as raised:
        Checkpoint.open(tmp_path)
    assert raised.value.path == str(tmp_path / INDEX)


def test_opening_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Checkpoint.open(tmp_path / "nowhere")
    with pytest.raises(ResidencyCheckpointError, match="neither") as raised:
        Checkpoint.open(tmp_path)
    assert raised.value.path == str(tmp_path)


@pytest.mark.parametrize(
    ("header", "data", "key", "fragment"),
    [
        ({"w": {"dtype": "F4X", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0", "w", "F4X"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "w", "12"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "w", "trunc"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "w", "shape"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "w", "offset"),
        ({"w": [1, 2]}, b"", "w", "object"),
        ({"__metadata__": {"a": 1}}, b"", None, "__metadata__"),
    ],
)
def test_a_damaged_header_names_the_key_and_the_file(
    tmp_path: Path, header: dict[str, Any], data: bytes, key: str | None, fragment: str
) -> None:
    path = tmp_path / "bad.safetensors"
    _write_raw(path, header, data)
    checkpoint = Checkpoint.open(path)
    with pytest.raises(ResidencyCheckpointError, match=fragment) as raised:
        checkpoint.keys()
    assert (raised.value.key, raised.value.path) == (key, str(path))


@pytest.mark.parametrize(
    "content",
    [b"", b"\x01\x02", (10**9).to_bytes(8, "little") + b"{}", (64).to_bytes(8, "little") + b"{}"],
)
def test_not_a_safetensors_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ResidencyCheckpointError) as raised:
        Checkpoint.open(path).keys()
    assert raised.value.path == str(path)
    path.write_bytes((4).to_bytes(8, "little") + b"\xff\xfe{}")
    with pytest.raises(ResidencyCheckpointError, match="JSON"):
        Checkpoint.open(path).keys()


def test_a_big_endian_host_is_refused(single: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_checkpoint, "_BYTEORDER", "big")
    with pytest.raises(ResidencyCheckpointError, match="big-endian") as raised:
        Checkpoint.open(single)
    assert raised.value.path == str(single)


# --- a unit's source reads only its byte ranges -----------------------------------------


class _CountingReads:
    """Wraps ``os.preadv``: every (offset, bytes) it read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[int, int]] = []
        self._preadv = os.preadv
        monkeypatch.setattr(os, "preadv", self)

    def __call__(self, descriptor: int, buffers: Any, offset: int) -> int:
        got = self._preadv(descriptor, buffers, offset)
        self.reads.append((offset, got))
        return got


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        elif stop > start:
            merged.append((start, stop))
    return merged


def test_a_source_reads_exactly_its_byte_ranges(
    single: Path, tensors: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = Checkpoint.open(single)
    source = checkpoint.source({"w": "layers.0.weight", "b": "layers.1.steps"})
    counting = _CountingReads(monkeypatch)
    value = source.load()
    _assert_same(value["w"], tensors["layers.0.weight"])
    _assert_same(value["b"], tensors["layers.1.steps"])
    assert source.read_nbytes == 8 * 8 * 2 + 5 * 8
    read = [(offset, offset + got) for offset, got in counting.reads]
    assert sum(got for _, got in counting.reads) == source.read_nbytes
    assert _merged(read) == _merged([(found.start, found.stop) for found in source.entries])


def test_bytes_outside_a_units_ranges_do_not_matter(
    single: Path, tensors: dict[str, torch.Tensor]
) -> None:
    checkpoint = Checkpoint.open(single)
    unit = checkpoint.source({"w": "layers.1.weight"})
    other = checkpoint.entry("embed.weight")
    mine = checkpoint.entry("layers.1.weight")
    with open(single, "r+b") as file:
        for offset in (other.start, other.stop - 1):
            file.seek(offset)
            byte = file.read(1)
            file.seek(offset)
            file.write(bytes([byte[0] ^ 0xFF]))
    os.utime(single, ns=(single.stat().st_atime_ns, checkpoint_mtime(checkpoint, single)))
    _assert_same(unit.load()["w"], tensors["layers.1.weight"])
    # ...and a byte inside it does: the source reads the file each time.
    with open(single, "r+b") as file:
        file.seek(mine.start)
        byte = file.read(1)
        file.seek(mine.start)
        file.write(bytes([byte[0] ^ 0x01]))
    os.utime(single, ns=(single.stat().st_atime_ns, checkpoint_mtime(checkpoint, single)))
    assert not torch.equal(unit.load()["w"], tensors["layers.1.weight"])


def checkpoint_mtime(checkpoint: Checkpoint, path: Path) -> int:
    """The mtime the checkpoint recorded with the header (editing in place keeps the size
    and inode; putting the mtime back plays an edit the reader cannot see)."""
    return checkpoint._shard(path).identity[3]


def test_adjacent_tensors_are_read_in_one_call(
    single: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = Checkpoint.open(single)
    keys = checkpoint.keys()
    every = checkpoint.source(dict(zip(keys, keys, strict=True)))
    counting = _CountingReads(monkeypatch)
    every.load()
    # The file's tensors lie end to end: one run, one call (the empty one reads nothing).
    assert len(counting.reads) == 1
    assert counting.reads[0][1] == every.read_nbytes


# --- casts ------------------------------------------------------------------------------


def test_floating_tensors_are_cast_and_integers_keep_their_dtype(
    sharded: Path, tensors: dict[str, torch.Tensor]
) -> None:
    checkpoint = Checkpoint.open(sharded)
    names = {"w": "layers.0.weight", "d": "layers.1.weight", "s": "layers.1.steps"}
    names |= {"m": "layers.1.mask", "c": "layers.1.codes"}
    source = checkpoint.source(names, dtype=torch.float32)
    assert source.dtype == torch.float32
    value = source.load()
    _assert_same(value["w"], tensors["layers.0.weight"].to(torch.float32))
    _assert_same(value["d"], tensors["layers.1.weight"].to(torch.float32))
    _assert_same(value["s"], tensors["layers.1.steps"])
    _assert_same(value["m"], tensors["layers.1.mask"])
    _assert_same(value["c"], tensors["layers.1.codes"])
    assert source.nbytes == value.nbytes == 64 * 4 + 64 * 4 + 5 * 8 + 3 + 3
    assert source.read_nbytes == 64 * 2 + 64 * 8 + 5 * 8 + 3 + 3
    spec = source.spec()
    assert (spec.logical_nbytes, spec.storage_nbytes) == (value.nbytes, value.storage_nbytes)


# --- files that change under the reader -------------------------------------------------


def test_a_truncated_file_raises_and_never_returns_other_bytes(single: Path) -> None:
    checkpoint = Checkpoint.open(single)
    source = checkpoint.source({"w": "layers.1.weight"})
    source.load()
    os.truncate(single, checkpoint.entry("layers.1.weight").start + 3)
    with pytest.raises(ResidencyMaterializationError) as raised:
        source.load()
    assert str(single) in str(raised.value)


def test_a_file_rewritten_with_another_layout_is_refused(
    single: Path, tensors: dict[str, torch.Tensor]
) -> None:
    checkpoint = Checkpoint.open(single)
    source = checkpoint.source({"w": "layers.1.weight"})
    reordered = dict(reversed(list(tensors.items())))
    reordered["extra"] = torch.ones(1)
    save_file(reordered, single)  # another header: the recorded offsets are stale
    with pytest.raises(ResidencyMaterializationError, match="changed since"):
        source.load()
    # Opening again reads the new header.
    _assert_same(
        Checkpoint.open(single).source({"w": "layers.1.weight"}).load()["w"],
        tensors["layers.1.weight"],
    )


def test_short_reads_are_continued(
    single: Path, tensors: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = Checkpoint.open(single).source({"w": "layers.1.weight", "e": "embed.weight"})
    preadv = os.preadv

    def dribble(descriptor: int, buffers: list[memoryview], offset: int) -> int:
        return preadv(descriptor, [buffers[0][:3]], offset)  # 3 bytes at a time

    monkeypatch.setattr(os, "preadv", dribble)
    value = source.load()
    _assert_same(value["w"], tensors["layers.1.weight"])
    _assert_same(value["e"], tensors["embed.weight"])


def test_a_file_that_ends_while_it_is_read(single: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Truncated between the size check and the read: the read finds the end of the file.
    source = Checkpoint.open(single).source({"w": "layers.1.weight"})
    monkeypatch.setattr(os, "preadv", lambda descriptor, buffers, offset: 0)
    with pytest.raises(ResidencyMaterializationError, match="ended early") as raised:
        source.load()
    assert str(single) in str(raised.value)


def test_a_deleted_file(single: Path) -> None:
    source = Checkpoint.open(single).source({"w": "layers.1.weight"})
    single.unlink()
    with pytest.raises(ResidencyMaterializationError, match="cannot be read"):
        source.load()


def test_a_header_pointing_past_the_end(tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(64)}, path)
    os.truncate(path, path.stat().st_size - 8)
    with pytest.raises(ResidencyCheckpointError, match="truncated") as raised:
        Checkpoint.open(path).keys()
    assert (raised.value.key, raised.value.path) == ("b", str(path))


# --- through a manager ------------------------------------------------------------------


def test_a_source_registers_as_a_reconstructible_value(
    sharded: Path, tensors: dict[str, torch.Tensor]
) -> None:
    checkpoint = Checkpoint.open(sharded)
    source = checkpoint.source(
        {"weight": "layers.0.weight", "bias": "layers.0.bias", "scale": "norm.scale"},
        dtype=torch.float32,
    )
    assert isinstance(source, CheckpointSource)
    runtime = SimulatedRuntime(1, pinned=True)
    with use_runtime(runtime), ResidencyManager({PINNED_HOST: source.nbytes}) as manager:
        handle = manager.register_source(source.spec(), source)
        report = manager.ensure(handle, PINNED_HOST)
        assert report.destination == PINNED_HOST
        with manager.acquire([handle], at=PINNED_HOST) as values:
            value = values[handle]
            assert isinstance(value, TensorBundle)
            assert runtime.placement(value) == PINNED_HOST
            assert value.names == ("weight", "bias", "scale")
            _assert_same(value["weight"], tensors["layers.0.weight"].float())
            _assert_same(value["bias"], tensors["layers.0.bias"].float())
            _assert_same(value["scale"], tensors["norm.scale"])
        # The last copy can go: the checkpoint rebuilds it.
        manager.drop(handle, PINNED_HOST)
        manager.drop(handle, PAGEABLE_HOST)
        assert not manager.ensure(handle, PINNED_HOST).no_op
        assert_balanced(manager.snapshot())


# --- the error --------------------------------------------------------------------------


def test_the_checkpoint_error() -> None:
    error = ResidencyCheckpointError("has shape [2]", key="w", path="/c/model.safetensors")
    assert isinstance(error, ResidencyError)
    assert isinstance(error, ValueError)
    assert ResidencyCheckpointError.__bases__ == (ResidencyError, ValueError)
    assert "ResidencyCheckpointError" in errors.__all__
    assert (error.detail, error.key, error.path) == ("has shape [2]", "w", "/c/model.safetensors")
    assert str(error) == "checkpoint /c/model.safetensors, key 'w': has shape [2]"
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is ResidencyCheckpointError
    assert (str(clone), clone.__dict__) == (str(error), error.__dict__)
    bare = ResidencyCheckpointError("no index")
    assert (bare.key, bare.path, str(bare)) == (None, None, "checkpoint: no index")


# --- init_empty_weights -----------------------------------------------------------------

META = torch.device("meta")
CPU = torch.device("cpu")


def _build() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3), nn.BatchNorm1d(3))


def _devices(module: nn.Module) -> tuple[set[torch.device], set[torch.device]]:
    params = {p.device for p in module.parameters()}
    buffers = {b.device for b in module.buffers()}
    return params, buffers


@pytest.fixture
def pristine() -> Iterator[None]:
    before = (nn.Module.register_parameter, nn.Module.register_buffer)
    yield
    assert (nn.Module.register_parameter, nn.Module.register_buffer) == before


@pytest.mark.usefixtures("pristine")
def test_parameters_on_meta_buffers_real_by_default() -> None:
    with init_empty_weights():
        model = _build()
    assert _devices(model) == ({META}, {CPU})
    assert model[0].weight.shape == (10, 4)
    assert model[1].weight.dtype == torch.float32
    assert type(model[1].weight) is nn.Parameter
    assert model[1].weight.requires_grad
    assert model[2].num_batches_tracked.dtype == torch.int64
    assert torch.equal(model[2].running_var, torch.ones(3))
    # Outside the block modules are real again.
    assert _devices(_build()) == ({CPU}, {CPU})


@pytest.mark.usefixtures("pristine")
def test_include_buffers_puts_buffers_on_meta_too() -> None:
    with init_empty_weights(include_buffers=True):
        model = _build()
    assert _devices(model) == ({META}, {META})
    assert model[2].running_mean.shape == (3,)


@pytest.mark.usefixtures("pristine")
def test_parameter_attributes_and_requires_grad_survive() -> None:
    class Tagged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            weight = nn.Parameter(torch.ones(2), requires_grad=False)
            weight.tag = "kept"  # type: ignore[attr-defined]
            self.weight = weight
            self.register_parameter("nothing", None)

    with init_empty_weights():
        module = Tagged()
    assert module.weight.device == META
    assert not module.weight.requires_grad
    assert module.weight.tag == "kept"  # type: ignore[attr-defined]
    assert module.nothing is None


@pytest.mark.usefixtures("pristine")
def test_nested_blocks_and_an_exception_restore_exactly() -> None:
    with init_empty_weights():
        with init_empty_weights(include_buffers=True):
            inner = _build()
        outer = _build()
        with pytest.raises(RuntimeError, match="boom"), init_empty_weights(include_buffers=True):
            raise RuntimeError("boom")
        after_error = _build()
    assert _devices(inner) == ({META}, {META})
    assert _devices(outer) == ({META}, {CPU})
    assert _devices(after_error) == ({META}, {CPU})
    assert _devices(_build()) == ({CPU}, {CPU})


@pytest.mark.usefixtures("pristine")
def test_other_threads_are_not_affected() -> None:
    inside = threading.Event()
    built = threading.Event()
    results: dict[str, nn.Module] = {}

    def elsewhere() -> None:
        inside.wait(10)
        results["other"] = _build()
        built.set()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    with init_empty_weights():
        inside.set()
        assert built.wait(10)
        results["here"] = _build()
    thread.join(10)
    assert _devices(results["here"]) == ({META}, {CPU})
    assert _devices(results["other"]) == ({CPU}, {CPU})


def test_include_buffers_must_be_a_bool() -> None:
    with pytest.raises(TypeError), init_empty_weights(include_buffers=1):  # type: ignore[arg-type]
        pass
