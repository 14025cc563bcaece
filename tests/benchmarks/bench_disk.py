"""Disk store throughput: writing a value with the store (atomic: temporary file,
checksums computed as the bytes stream, header rewritten, fsync, rename, directory
fsync) and reading it back (into new pageable memory of its own, or a caller's buffer,
checksums checked) against a raw sequential write (write, flush, fsync) and read
(``readinto`` a buffer) of the same bytes in the same directory.

The target (for the disk tier, issue "a disk tier") is a store/raw ratio of at least
0.90 for 64 MiB to 1 GiB values. Reads through the page cache: the file was just
written, so both sides read from memory; this measures the store's own overhead.

The "verified read" rows compare the same store read with its checksums checked
against a store that does not check (``verify=False``): the cost of integrity (target
0.90 at 256 MiB and 1 GiB). "read pageable + sum" reads into new memory the store owns
and touches every byte (it used to be a copy-on-write map of the file, filled as
touched).

Where the file system allows ``O_DIRECT``, the same comparison with direct I/O: a
store opened with ``direct=True`` (every byte through its staging ring) against a raw
``O_DIRECT`` write of the same bytes from one page-aligned buffer, and a raw read
into a new page-aligned buffer (the store reads into new page-aligned memory, as
pinned memory is, and straight from the file for whole pages) and, for the raw side's
best case, into a buffer already mapped ("warm"); and the store reading into
unaligned memory (through its staging ring, a host copy per chunk).

Run: python tests/benchmarks/bench_disk.py [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fhelium.residency._disk import DiskStore, Staging
from fhelium.residency.simulation import SimulatedRuntime
from fhelium.values import ResidentTensor

MIB = 1 << 20
TARGET = 0.90


def _paired(
    raw: Callable[[], object],
    ours: Callable[[], object],
    repeats: int,
    setup: Callable[[], object] = lambda: None,
) -> tuple[float, float]:
    """Median seconds of ``raw()`` and of ``ours()``, the samples alternating (each after
    ``setup()``), so that the machine's drift weighs on both alike."""
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for side, run in enumerate((raw, ours)):
            setup()
            started = time.perf_counter()
            run()
            samples[side].append(time.perf_counter() - started)
    return statistics.median(samples[0]), statistics.median(samples[1])


def _raw_write(path: Path, data: torch.Tensor) -> None:
    with open(path, "wb") as file:
        file.write(data.numpy().data)
        file.flush()
        os.fsync(file.fileno())


def _raw_read(path: Path) -> torch.Tensor:
    """Plain file I/O into a new buffer, as `read()` would."""
    into = torch.empty(path.stat().st_size, dtype=torch.uint8)
    with open(path, "rb") as file:
        file.readinto(into.numpy().data)
    return into


def _aligned(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    buffer = mmap.mmap(-1, nbytes)
    return buffer, memoryview(buffer)


def _page_aligned(nbytes: int) -> torch.Tensor:
    """New page-aligned memory, as pinned memory is: the store reads whole pages into it
    straight from the file."""
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]


def _raw_direct_write(path: Path, data: memoryview) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        view = data
        while view:
            view = view[os.write(descriptor, view) :]
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _raw_direct_read(path: Path) -> mmap.mmap:
    """Plain direct I/O into a new page-aligned buffer, as the store's read makes a new
    buffer too."""
    into = mmap.mmap(-1, path.stat().st_size + (-path.stat().st_size % 4096))
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        os.preadv(descriptor, [into], 0)
    finally:
        os.close(descriptor)
    return into


def _direct_row(
    size: int,
    repeats: int,
    root: Path,
    store: DiskStore,
    staging: Staging,
    unverified: DiskStore,
) -> list[tuple[str, float, float]]:
    # The value in page-aligned memory, as pinned memory is: its whole pages are
    # written straight from it.
    data = _page_aligned(size * MIB)
    data.copy_(torch.randint(0, 255, (size * MIB,), dtype=torch.uint8))
    value = ResidentTensor(data)
    holder, aligned = _aligned(size * MIB)
    aligned[:] = data.numpy().data
    raw_path = root / "raw-direct.bin"

    def fresh() -> None:
        raw_path.unlink(missing_ok=True)
        store.path_of("d").unlink(missing_ok=True)

    raw_write, store_write = _paired(
        lambda: _raw_direct_write(raw_path, aligned),
        lambda: store.write("d", value, staging=staging),
        repeats,
        fresh,
    )
    _raw_direct_write(raw_path, aligned)
    file = store.write("d", value, staging=staging)
    raw_read, read_into = _paired(
        lambda: _raw_direct_read(raw_path).close(),
        lambda: store.read(file, _page_aligned, staging=staging),
        repeats,
    )
    raw_read_2, read_unaligned = _paired(
        lambda: _raw_direct_read(raw_path).close(),
        lambda: store.read(file, lambda n: torch.empty(n, dtype=torch.uint8), staging=staging),
        repeats,
    )
    descriptor = os.open(raw_path, os.O_RDONLY | os.O_DIRECT)
    try:  # the raw read's best case: a buffer whose pages are already mapped
        warm_read, read_into_2 = _paired(
            lambda: os.preadv(descriptor, [aligned], 0),
            lambda: store.read(file, _page_aligned, staging=staging),
            repeats,
        )
    finally:
        os.close(descriptor)
    plain, checked = _paired(
        lambda: unverified.read(file, _page_aligned, staging=staging),
        lambda: store.read(file, _page_aligned, staging=staging),
        repeats,
    )
    back = store.read(file, lambda n: torch.empty(n, dtype=torch.uint8), staging=staging)
    assert isinstance(back, ResidentTensor)
    assert torch.equal(back.tensor, data)
    aligned.release()
    holder.close()
    return [
        ("direct write", raw_write, store_write),
        ("direct read", raw_read, read_into),
        ("direct read (warm)", warm_read, read_into_2),
        ("direct read, unaligned", raw_read_2, read_unaligned),
        ("direct verified read (vs unverified)", plain, checked),
    ]


def _row(
    size: int, repeats: int, root: Path, store: DiskStore, unverified: DiskStore
) -> list[tuple[str, float, float]]:
    data = torch.randint(0, 255, (size * MIB,), dtype=torch.uint8)
    value = ResidentTensor(data)
    raw_path = root / "raw.bin"

    def fresh() -> None:
        raw_path.unlink(missing_ok=True)
        store.path_of("v").unlink(missing_ok=True)

    raw_write, store_write = _paired(
        lambda: _raw_write(raw_path, data), lambda: store.write("v", value), repeats, fresh
    )
    _raw_write(raw_path, data)
    file = store.write("v", value)
    raw_read, read_into = _paired(
        lambda: _raw_read(raw_path),
        lambda: store.read(file, lambda n: torch.empty(n, dtype=torch.uint8)),
        repeats,
    )

    def owned() -> None:
        back = store.read(file)
        assert isinstance(back, ResidentTensor)
        back.tensor.sum()  # touch every page

    raw_touch, read_owned = _paired(lambda: _raw_read(raw_path).sum(), owned, repeats)
    # The same file read by a store that does not check it: the checksums' cost alone.
    plain, checked = _paired(lambda: unverified.read(file), lambda: store.read(file), repeats)
    return [
        ("write", raw_write, store_write),
        ("read into a buffer", raw_read, read_into),
        ("read pageable + sum", raw_touch, read_owned),
        ("verified read (vs unverified)", plain, checked),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (a temp dir)")
    args = parser.parse_args()
    sizes = [64, 256] if args.quick else [64, 256, 1024]
    repeats = 3 if args.quick else 5
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        store = DiskStore(root, "bench")
        unverified = DiskStore(root, "bench-unverified", verify=False)
        print(f"directory: {root}; medians of {repeats}; page cache (no direct I/O)")
        for size in sizes:
            _report(size, _row(size, repeats, Path(root), store, unverified))
        store.close()
        unverified.close()
        if not hasattr(os, "O_DIRECT"):
            print("direct I/O: not on this platform")
            return
        direct = DiskStore(root, "bench-direct", direct=True)
        unverified_direct = DiskStore(root, "bench-direct-unverified", direct=True, verify=False)
        # The ring without a GPU: page-aligned pageable chunks (pinned on a CUDA machine).
        staging = Staging(SimulatedRuntime(0, pinned=False))
        probe = direct.write("probe", ResidentTensor(torch.zeros(1)), staging=staging)
        if not direct.direct:
            print("direct I/O: refused by this file system (the store fell back to buffered)")
            return
        direct.remove(probe)
        print(f"direct I/O (O_DIRECT), staging {staging.buffers[0].numel() // MIB} MiB x 2")
        for size in sizes:
            _report(
                size, _direct_row(size, repeats, Path(root), direct, staging, unverified_direct)
            )
        staging.close()
        direct.close()
        unverified_direct.close()


def _report(size: int, rows: list[tuple[str, float, float]]) -> None:
    for name, raw, ours in rows:
        ratio = raw / ours
        verdict = "ok" if ratio >= TARGET else f"UNDER {TARGET}"
        print(
            f"{name:<36} {size:>5} MiB: store {size / ours / 1024:6.2f} GiB/s, "
            f"baseline {size / raw / 1024:6.2f} GiB/s, ratio {ratio:.3f} {verdict}"
        )


if __name__ == "__main__":
    main()
