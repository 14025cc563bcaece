"""Disk store throughput: writing a value with the store (atomic: temporary file,
flush, fsync, rename, directory fsync) and reading it back (a copy-on-write map, or
straight into a caller's buffer) against a raw sequential write (write, flush, fsync)
and read (``readinto`` a buffer) of the same bytes in the same directory.

The target (for the disk tier, issue "a disk tier") is a store/raw ratio of at least
0.90 for 64 MiB to 1 GiB values. Reads through the page cache: the file was just
written, so both sides read from memory; this measures the store's own overhead.

Run: python tests/benchmarks/bench_disk.py [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fhelium.residency._disk import DiskStore
from fhelium.values import ResidentTensor

MIB = 1 << 20
TARGET = 0.90


def _median_s(run: Callable[[], object], repeats: int, setup: Callable[[], object]) -> float:
    samples = []
    for _ in range(repeats):
        setup()
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


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


def _row(size: int, repeats: int, root: Path, store: DiskStore) -> list[tuple[str, float, float]]:
    data = torch.randint(0, 255, (size * MIB,), dtype=torch.uint8)
    value = ResidentTensor(data)
    raw_path = root / "raw.bin"

    def fresh() -> None:
        raw_path.unlink(missing_ok=True)
        store.path_of("v").unlink(missing_ok=True)

    raw_write = _median_s(lambda: _raw_write(raw_path, data), repeats, fresh)
    store_write = _median_s(lambda: store.write("v", value), repeats, fresh)
    _raw_write(raw_path, data)
    file = store.write("v", value)

    def nothing() -> None:
        pass

    raw_read = _median_s(lambda: _raw_read(raw_path), repeats, nothing)
    read_into = _median_s(
        lambda: store.read(file, lambda n: torch.empty(n, dtype=torch.uint8)), repeats, nothing
    )
    raw_touch = _median_s(lambda: _raw_read(raw_path).sum(), repeats, nothing)

    def mapped() -> None:
        back = store.read(file)
        assert isinstance(back, ResidentTensor)
        back.tensor.sum()  # touch every page

    read_map = _median_s(mapped, repeats, nothing)
    return [
        ("write", raw_write, store_write),
        ("read into a buffer", raw_read, read_into),
        ("read mapped + sum", raw_touch, read_map),
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
        print(f"directory: {root}; medians of {repeats}; page cache (no direct I/O)")
        for size in sizes:
            for name, raw, ours in _row(size, repeats, Path(root), store):
                ratio = raw / ours
                verdict = "ok" if ratio >= TARGET else f"UNDER {TARGET}"
                print(
                    f"{name:<20} {size:>5} MiB: store {size / ours / 1024:6.2f} GiB/s, "
                    f"raw {size / raw / 1024:6.2f} GiB/s, ratio {ratio:.3f} {verdict}"
                )
        store.close()


if __name__ == "__main__":
    main()
