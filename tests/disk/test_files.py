"""What the disk tier's files and directories may and may not do
(docs/concepts/locations-and-budgets.md#disk): a read owns its memory (truncating or
rewriting the file afterwards changes nothing and cannot kill the process, and a
dropped file frees its blocks); directories are made atomically and swept when stale,
with or without an owner record; modes are 0700/0600 whatever the umask; the sweep
touches only this user's directories and never follows a symlink; file names are
unique across processes, and a write never removes a file it did not create."""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from fhelium.errors import ResidencyInUseError, ResidencyMaterializationError
from fhelium.residency import PAGEABLE_HOST, ReplicaMode, ResidencyManager
from fhelium.residency._disk import staging as disk_staging
from fhelium.residency._disk import store as disk_store
from fhelium.residency._disk.store import DiskStore
from fhelium.residency._disk.tier import DiskTier
from fhelium.residency.disk import disk_location
from fhelium.residency.simulation import SimulatedRuntime
from fhelium.values import ResidentTensor

# Address space for a child process: enough for torch, far below the machine.
CHILD_MEMORY = 6 << 30


# The first lines of every child script: its memory is capped before anything else.
_CAPPED = (
    f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({CHILD_MEMORY}, {CHILD_MEMORY}))\n"
)


def _limit_memory() -> None:
    """Caps a forked child's address space at what it maps now plus 3 GiB (never below
    `CHILD_MEMORY`): the parent's maps come with the fork."""
    mapped = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            mapped = int(line.split()[1]) * 1024
    limit = max(mapped + (3 << 30), CHILD_MEMORY)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _run_child(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CAPPED + textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _dead_pid() -> int:
    """The id of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", _CAPPED])
    child.wait(timeout=60)
    return child.pid


def _value(nbytes: int = 1 << 16) -> ResidentTensor:
    generator = torch.Generator().manual_seed(nbytes)
    return ResidentTensor(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator))


# --------------------------------------------------------------------- owned memory

_TRUNCATE = """
    import os, sys, torch
    from pathlib import Path
    from fhelium.residency import PAGEABLE_HOST, ReplicaMode, ResidencyManager
    from fhelium.residency.disk import disk_location
    from fhelium.values import ResidentTensor
    disk = disk_location(sys.argv[1], direct_io=sys.argv[2] == "direct")
    manager = ResidencyManager({PAGEABLE_HOST: 64 << 20, disk: 64 << 20})
    expected = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
    handle = manager.adopt(ResidentTensor(expected.clone()), replica_mode=ReplicaMode.REPLICABLE)
    manager.move(handle, disk)
    manager.ensure(handle, PAGEABLE_HOST)  # read back; the file stays
    (file,) = Path(sys.argv[1]).glob("*/*.safetensors")
    os.truncate(file, 0)  # behind the manager's back
    with manager.acquire([handle], at=PAGEABLE_HOST) as values:
        # Touch every byte: a map of the file would fault (SIGBUS) here.
        same = torch.equal(values[handle].tensor, expected)
    manager.close()
    print("same" if same else "different", flush=True)
"""


@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_truncating_the_file_after_a_read_cannot_kill_the_process(
    tmp_path: Path, mode: str
) -> None:
    done = _run_child(_TRUNCATE, str(tmp_path), mode)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "same"


def test_an_outside_write_after_a_read_does_not_show_through(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, "owner")
    value = _value(1 << 20)
    file = store.write("v", value)
    back = store.read(file)
    assert isinstance(back, ResidentTensor)
    descriptor = os.open(file.path, os.O_WRONLY)
    try:
        os.pwrite(descriptor, b"\xaa" * (1 << 20), file.data_start)
    finally:
        os.close(descriptor)
    assert torch.equal(back.tensor, value.tensor)
    store.close()


def _maps_naming(directory: str) -> list[str]:
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return [line for line in maps if directory in line]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_moving_a_value_off_disk_frees_the_files_blocks(tmp_path: Path) -> None:
    disk = disk_location(tmp_path)
    manager = ResidencyManager({PAGEABLE_HOST: 4 << 20, disk: 4 << 20})
    handle = manager.adopt(_value(2 << 20), replica_mode=ReplicaMode.REPLICABLE)
    manager.move(handle, disk)
    (file,) = Path(disk.path).glob("*/*.safetensors")
    assert file.stat().st_blocks * 512 >= 2 << 20
    manager.move(handle, PAGEABLE_HOST)
    # The file is gone, and nothing of the process still maps it (a map would keep its
    # blocks allocated, outside every budget, as long as the value lives).
    assert not file.exists()
    assert _maps_naming(disk.path) == []
    with manager.acquire([handle], at=PAGEABLE_HOST) as values:
        got = values[handle]
        assert isinstance(got, ResidentTensor)
        assert torch.equal(got.tensor, _value(2 << 20).tensor)
        assert _maps_naming(disk.path) == []
    manager.close()


# --------------------------------------------------------------------- stale directories


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_a_directory_without_an_owner_record_is_stale_after_the_documented_age(
    tmp_path: Path,
) -> None:
    left = tmp_path / f"{disk_store.PREFIX}killed-early"
    left.mkdir()
    (left / "value-1.safetensors").write_bytes(b"x" * 100)
    # Young: perhaps being created right now, so it is left alone (no warning).
    young = DiskStore(tmp_path, "young")
    assert left.exists()
    _age(left, disk_store.STALE_AGE + 60)
    with pytest.raises(ResidencyInUseError, match="no owner record"):
        DiskStore(tmp_path, "refusing", stale="refuse")
    assert left.exists()
    with pytest.warns(RuntimeWarning, match="no owner record"):
        cleaning = DiskStore(tmp_path, "cleaning")
    assert not left.exists()
    young.close()
    cleaning.close()


def test_an_old_directory_without_an_owner_holding_other_files_is_left_alone(
    tmp_path: Path,
) -> None:
    left = tmp_path / f"{disk_store.PREFIX}not-ours"
    left.mkdir()
    (left / "notes.txt").write_text("someone else's")
    _age(left, disk_store.STALE_AGE + 60)
    store = DiskStore(tmp_path, "next")  # no warning, no error
    assert (left / "notes.txt").exists()
    store.close()


_KILLED_WHILE_CREATING = """
    import os, signal, sys
    from fhelium.residency._disk import store
    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    store._write_owner = killed  # the process dies right after making the directory
    store.DiskStore(sys.argv[1], "killed")
"""


def test_a_process_killed_while_creating_its_directory_leaves_nothing_final(
    tmp_path: Path,
) -> None:
    done = _run_child(_KILLED_WHILE_CREATING, str(tmp_path))
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    # Created atomically: the final name never exists without its owner record.
    assert not (tmp_path / f"{disk_store.PREFIX}killed").exists()
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(f"{disk_store.PREFIX}killed{disk_store.CREATING}")
    assert list(left.iterdir()) == []
    store = DiskStore(tmp_path, "next")  # young: left alone
    assert left.exists()
    _age(left, disk_store.STALE_AGE + 1)
    with pytest.warns(RuntimeWarning, match="killed while creating it"):
        again = DiskStore(tmp_path, "again")
    assert not left.exists()
    store.close()
    again.close()


# --------------------------------------------------------------------- permissions


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("direct", [False, True])
def test_directories_are_0700_and_files_0600_whatever_the_umask(
    tmp_path: Path, direct: bool
) -> None:
    previous = os.umask(0)
    try:
        store = DiskStore(tmp_path / "root", "owner", direct=direct)
        staging = disk_staging.Staging(SimulatedRuntime(0, pinned=False)) if direct else None
        file = store.write("v", _value(), staging=staging)
    finally:
        os.umask(previous)
    assert _mode(store.directory) == 0o700
    assert _mode(store.directory / disk_store.OWNER) == 0o600
    assert _mode(file.path) == 0o600
    if staging is not None:
        staging.close()
    store.close()


def _stale_record(directory: Path, owner: str = "gone") -> None:
    directory.mkdir(parents=True)
    record = {"pid": _dead_pid(), "host": os.uname().nodename, "owner": owner, "started": "0"}
    (directory / disk_store.OWNER).write_text(json.dumps(record))
    (directory / "value-1.safetensors").write_bytes(b"spilled")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory away")
def test_the_sweep_leaves_other_users_directories(tmp_path: Path) -> None:
    other = tmp_path / f"{disk_store.PREFIX}someone-else"
    _stale_record(other)
    for path in (other, other / disk_store.OWNER, other / "value-1.safetensors"):
        os.lchown(path, 65534, 65534)
    store = DiskStore(tmp_path, "mine")  # no warning: not this user's to judge
    assert (other / "value-1.safetensors").read_bytes() == b"spilled"
    store.close()


def test_a_symlink_named_like_a_store_directory_is_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    _stale_record(elsewhere)
    root = tmp_path / "root"
    root.mkdir()
    (root / f"{disk_store.PREFIX}planted").symlink_to(elsewhere, target_is_directory=True)
    _age(root / f"{disk_store.PREFIX}planted", disk_store.STALE_AGE + 60)
    store = DiskStore(root, "mine")  # no warning: a symlink is not a store directory
    assert (elsewhere / "value-1.safetensors").read_bytes() == b"spilled"
    assert (elsewhere / disk_store.OWNER).exists()
    assert (root / f"{disk_store.PREFIX}planted").is_symlink()
    store.close()


def test_a_symlink_planted_inside_a_stale_directory_leaves_its_target(tmp_path: Path) -> None:
    precious = tmp_path / "precious.safetensors"
    precious.write_bytes(b"keep me")
    record = tmp_path / "record.json"
    record.write_text(
        json.dumps({"pid": _dead_pid(), "host": os.uname().nodename, "owner": "x", "started": "0"})
    )
    root = tmp_path / "root"
    stale = root / f"{disk_store.PREFIX}stale"
    _stale_record(stale)
    (stale / "value-2.safetensors").symlink_to(precious)
    # A symlinked owner record is no record: the directory is judged by its age.
    linked = root / f"{disk_store.PREFIX}linked-owner"
    linked.mkdir()
    (linked / disk_store.OWNER).symlink_to(record)
    with pytest.warns(RuntimeWarning, match="exited without closing"):
        store = DiskStore(root, "mine")
    assert not stale.exists()
    assert precious.read_bytes() == b"keep me"
    assert linked.exists()  # young, with no owner record of its own
    assert record.exists()
    store.close()


# --------------------------------------------------------------------- processes


class _Location:
    """What `DiskTier` reads from a disk location."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.direct_io = False
        self.verify = True


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_file_names_are_unique_across_processes(tmp_path: Path) -> None:
    runtime = SimulatedRuntime(0, pinned=False)
    location = _Location(tmp_path)
    tier = DiskTier()
    tier.owner_id = "shared"
    tier.write(location, _value(100), runtime)
    reading, writing = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        child = os.fork()
    if child == 0:  # pragma: no cover - the child's outcome is its exit status
        try:
            _limit_memory()
            os.close(reading)
            made = tier.write(location, _value(200), runtime)
            os.write(writing, str(made.path).encode())
        finally:
            os._exit(0)
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        child_path = pipe.read().decode()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    mine = tier.write(location, _value(300), runtime)
    # The parent's next file is not the child's, which inherited the same counter.
    assert child_path
    assert str(mine.path) != child_path
    back = tier.read(mine, False, runtime)
    assert isinstance(back, ResidentTensor)
    assert torch.equal(back.tensor, _value(300).tensor)
    tier.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_removes_its_parents_files(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, "owner")
    file = store.write("v", _value())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:  # pragma: no cover - the child's outcome is its exit status
        try:
            _limit_memory()
            store.remove(file)
            store.close()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert file.path.exists()
    assert torch.equal(store.read(file).tensor, _value().tensor)  # type: ignore[attr-defined]
    store.close()
    assert not store.directory.exists()


@pytest.mark.parametrize("direct", [False, True])
def test_a_write_that_finds_its_temporary_name_taken_removes_nothing(
    tmp_path: Path, direct: bool
) -> None:
    store = DiskStore(tmp_path, "owner", direct=direct)
    staging = disk_staging.Staging(SimulatedRuntime(0, pinned=False)) if direct else None
    taken = store.directory / f"v{disk_store.SUFFIX}{disk_store.TEMPORARY}"
    taken.write_bytes(b"another writer's")
    with pytest.raises(ResidencyMaterializationError, match="exists"):
        store.write("v", _value(), staging=staging)
    assert taken.read_bytes() == b"another writer's"
    assert not store.path_of("v").exists()
    if staging is not None:
        staging.close()
    store.close()
