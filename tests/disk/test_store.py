"""The disk store under a disk location (python/fhelium/residency/_disk/store.py): standard
safetensors files, exact round trips (views and shared storages included), atomic
writes, refused truncated or missing files, cleanup at close and at interpreter exit,
and directories left by killed processes recognised, cleaned or refused."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fhelium.errors import ResidencyInUseError, ResidencyMaterializationError
from fhelium.residency._disk import store as disk_store
from fhelium.residency._disk.store import DiskStore
from fhelium.values import ResidentTensor, TensorBundle
from helpers.limits import capped, capped_memory


def _store(tmp_path: Path, owner: str = "owner-1") -> DiskStore:
    return DiskStore(tmp_path / "disk", owner)


def test_a_value_round_trips_exactly_and_other_tools_can_read_it(tmp_path: Path) -> None:
    store = _store(tmp_path)
    value = TensorBundle(
        weight=torch.randn(16, 8),
        bias=torch.arange(8, dtype=torch.int64),
        mask=torch.tensor([True, False, True]),
        half=torch.randn(5).to(torch.bfloat16),
        empty=torch.empty(0, 3),
    )
    file = store.write("v", value)
    assert file.path.parent == store.directory
    assert file.nbytes == file.path.stat().st_size
    for allocate in (None, lambda n: torch.empty(n, dtype=torch.uint8)):
        back = store.read(file, allocate)
        assert isinstance(back, TensorBundle)
        for name in ("weight", "bias", "mask", "half", "empty"):
            assert torch.equal(back[name], value[name]), name
            assert back[name].dtype == value[name].dtype
    with safe_open(str(file.path), framework="pt") as other:
        assert other.metadata()["fhelium.format"] == "1"
        assert torch.equal(other.get_tensor("field.0"), value["weight"])
        assert torch.equal(other.get_tensor("field.1"), value["bias"])


def test_views_and_shared_storages_keep_their_storage(tmp_path: Path) -> None:
    store = _store(tmp_path)
    base = torch.arange(100, dtype=torch.float32)
    value = TensorBundle(window=base[10:20], strided=base[::10])
    back = store.read(store.write("views", value))
    assert torch.equal(back["window"], value["window"])
    assert torch.equal(back["strided"], value["strided"])
    # One backing storage of the original size, shared by both fields, as before.
    assert back["window"].untyped_storage().nbytes() == 400
    shared = {back[name].untyped_storage().data_ptr() for name in ("window", "strided")}
    assert len(shared) == 1
    assert back.storage_nbytes == value.storage_nbytes


def test_a_write_failing_midway_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path)

    def full(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_store.os, "fsync", full)
    with pytest.raises(ResidencyMaterializationError, match="No space left"):
        store.write("v", ResidentTensor(torch.ones(1000)))
    assert sorted(path.name for path in store.directory.iterdir()) == ["owner.json"]


def test_a_read_only_directory_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path)

    def read_only(source: object, destination: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(disk_store.os, "replace", read_only)
    with pytest.raises(ResidencyMaterializationError, match="Read-only"):
        store.write("v", ResidentTensor(torch.ones(10)))
    assert sorted(path.name for path in store.directory.iterdir()) == ["owner.json"]


def test_a_truncated_or_missing_file_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    file = store.write("v", ResidentTensor(torch.ones(1000)))
    with open(file.path, "r+b") as handle:
        handle.truncate(file.nbytes - 100)
    for allocate in (None, lambda n: torch.empty(n, dtype=torch.uint8)):
        with pytest.raises(ResidencyMaterializationError, match="truncated"):
            store.read(file, allocate)
    file.path.unlink()
    with pytest.raises(ResidencyMaterializationError, match="No such file"):
        store.read(file)
    store.remove(file)  # already gone: no error


def test_close_removes_everything(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.write("a", ResidentTensor(torch.ones(10)))
    store.write("b", ResidentTensor(torch.ones(10)))
    store.close()
    assert not store.directory.exists()
    store.close()  # idempotent
    assert list((tmp_path / "disk").iterdir()) == []


def test_stores_never_share_a_directory(tmp_path: Path) -> None:
    first, second = _store(tmp_path, "one"), _store(tmp_path, "two")
    assert first.directory != second.directory
    with pytest.raises(ResidencyInUseError, match="never shared"):
        _store(tmp_path, "one")
    first.close()
    second.close()


_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    from fhelium.residency._disk.store import DiskStore
    from fhelium.values import ResidentTensor
    store = DiskStore(sys.argv[1], sys.argv[2])
    store.write("v", ResidentTensor(torch.ones(100)))
    print(store.directory, flush=True)
    if sys.argv[3] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _child(root: Path, owner: str, how: str) -> Path:
    done = subprocess.run(
        capped([sys.executable, "-c", _CHILD, str(root), owner, how]),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if how == "kill":
        assert done.returncode == -signal.SIGKILL, done.stderr
    else:
        assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip())


def test_files_are_removed_at_interpreter_exit(tmp_path: Path) -> None:
    directory = _child(tmp_path, "exits", "exit")
    assert not directory.exists()


def test_a_forked_child_leaves_its_parents_files(tmp_path: Path) -> None:
    store = _store(tmp_path)
    file = store.write("v", ResidentTensor(torch.ones(10)))
    with warnings.catch_warnings():
        # Python 3.12 warns that forking a threaded process may deadlock; the child
        # only runs the finalizer and exits.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child exits through the finalizers, as an interpreter would
        capped_memory()
        store._finalizer()
        os._exit(0)
    os.waitpid(pid, 0)
    assert file.path.exists()
    store.close()
    assert not store.directory.exists()


def test_a_killed_owners_directory_is_refused_or_cleaned(tmp_path: Path) -> None:
    directory = _child(tmp_path, "killed", "kill")
    assert (directory / "v.safetensors").exists()
    with pytest.raises(ResidencyInUseError, match="exited without closing"):
        DiskStore(tmp_path, "next", stale="refuse")
    assert directory.exists()
    with pytest.warns(RuntimeWarning, match="exited without closing"):
        store = DiskStore(tmp_path, "next")
    assert not directory.exists()
    store.close()


def test_a_killed_owners_directory_with_foreign_files_is_left_alone(tmp_path: Path) -> None:
    directory = _child(tmp_path, "killed", "kill")
    (directory / "notes.txt").write_text("someone else's")
    with pytest.raises(ResidencyInUseError, match="did not write"):
        DiskStore(tmp_path, "next")
    assert (directory / "notes.txt").exists()


def test_a_live_owners_directory_is_left_alone(tmp_path: Path) -> None:
    first = _store(tmp_path, "live")
    second = _store(tmp_path, "other")  # the first is alive: nothing to clean or refuse
    assert first.directory.exists()
    first.close()
    second.close()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stale"):
        DiskStore(tmp_path, "x", stale="maybe")  # type: ignore[arg-type]
    store = _store(tmp_path)
    with pytest.raises(TypeError, match="complex128"):
        store.write("v", ResidentTensor(torch.zeros(2, dtype=torch.complex128)))
    store.close()
    assert os.listdir(tmp_path / "disk") == []
