"""`python -m fhelium.residency demo`: a bounded-memory streaming workload.

Weight shards live on disk as safetensors files and are registered as reconstructible
values. A budgeted compute location (cuda:0 on a GPU machine; a simulated cuda:0
backed by CPU tensors otherwise) holds only a few at a time. Each stage asks the
controller for a window of shards plus workspace, computes on the borrowed values, and
moves on; the controller evicts what the next stage does not need.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from fhelium.residency import (
    PINNED_HOST,
    EnsureResident,
    MemoryReservation,
    ReplicaMode,
    ResidencyController,
    ResidencyLocation,
    ResidencyManager,
    ResidencyPlanReport,
    ResidencyRequest,
    ResidencyRequirement,
    ResidencySnapshot,
    ResidencyTransitionReport,
    cuda_location,
)
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.residency.sources import SafetensorsSource
from fhelium.values import ResidentTensor

MIB = 1 << 20


def _shards(cache: Path, count: int, width: int) -> list[Path]:
    """Writes the shard files once (deterministic contents), then reuses them."""
    from safetensors.torch import save_file

    cache.mkdir(parents=True, exist_ok=True)
    paths = []
    generator = torch.Generator().manual_seed(1234)
    for index in range(count):
        path = cache / f"shard-{index:03d}-{width}.safetensors"
        weight = torch.randn(width, width, generator=generator) / width**0.5
        if not path.exists():
            save_file({"weight": weight.contiguous()}, str(path))
        paths.append(path)
    return paths


@contextlib.contextmanager
def _compute_location(
    device: str,
) -> Iterator[tuple[ResidencyLocation, Any, str, torch.device]]:
    """(location, consumer stream, description, torch device for the compute)."""
    use_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_gpu:
        yield (
            cuda_location("cuda:0"),
            torch.cuda.Stream(device=0),  # type: ignore[no-untyped-call]
            torch.cuda.get_device_name(0),
            torch.device("cuda", 0),
        )
        return
    runtime = SimulatedRuntime(1, pinned=True, auto_complete=True)
    with use_runtime(runtime):
        yield (
            cuda_location("cuda:0"),
            runtime.current_stream(torch.device("cuda", 0)),
            "simulated cuda:0 (no GPU: CPU tensors stand in for device memory)",
            torch.device("cpu"),
        )


def _bytes_moved(
    transitions: Sequence[ResidencyTransitionReport],
) -> Counter[tuple[str, str]]:
    moved: Counter[tuple[str, str]] = Counter()
    for report in transitions:
        if report.no_op or report.destination is None:
            continue
        source = "disk" if report.source is None else str(report.source)
        moved[(source, str(report.destination))] += report.storage_nbytes
    return moved


def run_demo(
    out: Path,
    *,
    shards: int = 24,
    width: int = 512,
    window: int = 3,
    stages: int = 40,
    budget_shards: float = 4.5,
    device: str = "auto",
    cache: Path | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Runs the workload; returns the summary figures and writes the trace and plot."""
    started = time.perf_counter()
    shard_bytes = width * width * 4
    workspace = 64 * width * 4 * 2
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
        "fhelium-residency-demo"
    )
    paths = _shards(cache, shards, width)
    out.mkdir(parents=True, exist_ok=True)
    with _compute_location(device) as (compute, stream, description, compute_device):
        budget = int(budget_shards * shard_bytes) + workspace
        staging = shards * shard_bytes
        manager = ResidencyManager({compute: budget, PINNED_HOST: staging})
        controller = ResidencyController(manager)
        handles = []
        for path in paths:
            source: SafetensorsSource[ResidentTensor] = SafetensorsSource(path, "weight")
            handles.append(
                manager.register_source(source.spec(replica_mode=ReplicaMode.REPLICABLE), source)
            )
        # Stage every shard once in pinned host memory: the compute location then
        # fills from there (fast host-to-device copies) and an eviction is a drop.
        manager.execute_actions(
            [EnsureResident(handle, PINNED_HOST) for handle in handles], name="staging"
        )
        log = print if not quiet else (lambda *_: None)
        log(f"fhelium.residency demo: {shards} shards of {shard_bytes / MIB:.1f} MiB on disk")
        log(f"compute location: {description}; budget {budget / MIB:.2f} MiB")
        log(f"staging: pinned host, {staging / MIB:.1f} MiB")
        activation = torch.randn(64, width, generator=torch.Generator().manual_seed(7)).to(
            compute_device
        )
        on_gpu = compute_device.type == "cuda"
        samples: list[tuple[int, ResidencySnapshot[Any]]] = [(time.time_ns(), manager.snapshot())]
        plans: list[ResidencyPlanReport] = []
        evictions = 0
        checksum = 0.0
        for stage in range(stages):
            first = (stage * 2) % shards
            chosen = [handles[(first + offset) % shards] for offset in range(window)]
            request = ResidencyRequest(
                f"stage-{stage:03d}",
                [ResidencyRequirement(handle, compute) for handle in chosen],
                [MemoryReservation(compute, workspace, "activations")],
            )
            with controller.use(request, consumer_streams={compute: stream}) as use:
                evictions += len(use.decision.evictions)
                # The kernels run on the consumer stream the leases protect.
                with torch.cuda.stream(stream) if on_gpu else contextlib.nullcontext():
                    output = activation
                    for handle in chosen:
                        weight = use.value(handle, at=compute)
                        assert isinstance(weight, ResidentTensor)
                        output = torch.tanh(output @ weight.tensor)
                    checksum += float(output.sum())
                activation = output
                # Mid-stage: the window is leased and the workspace reserved.
                samples.append((time.time_ns(), manager.snapshot()))
            if use.report is not None:
                plans.append(use.report)
            snapshot = manager.snapshot()
            samples.append((time.time_ns(), snapshot))
            books = next(entry for entry in snapshot.locations if entry.location == compute)
            log(
                f"  stage {stage + 1:>3}/{stages}: {len(use.decision.evictions)} evicted, "
                f"{books.used_bytes / MIB:5.2f} MiB used of {budget / MIB:.2f} MiB"
            )
        transitions = manager.trace()
        final = manager.snapshot()
        manager.close(force=True)
    elapsed = time.perf_counter() - started
    from fhelium.residency.export import plot_memory, write_trace

    write_trace(out / "trace.json", [*transitions, *plans], samples)
    plotted = True
    try:
        plot_memory(samples, out / "memory.png", title="fhelium.residency demo")
    except ImportError as error:
        plotted = False
        log(f"memory.png skipped: {error}")
    moved = _bytes_moved(transitions)
    bytes_moved = {f"{a} -> {b}": n for (a, b), n in sorted(moved.items())}
    peaks = {
        str(entry.location): (entry.peak_charged_bytes, entry.budget_bytes)
        for entry in final.locations
    }
    summary = {
        "stages": stages,
        "evictions": evictions,
        "bytes_moved": bytes_moved,
        "peak_vs_budget": peaks,
        "seconds": elapsed,
        "checksum": checksum,
        "trace": str(out / "trace.json"),
        "plot": str(out / "memory.png") if plotted else None,
    }
    log("summary:")
    log(f"  stages {stages}, evictions {evictions}, {elapsed:.2f} s")
    for pair, nbytes in bytes_moved.items():
        log(f"  moved {pair}: {nbytes / MIB:.1f} MiB")
    for location, (peak, limit) in peaks.items():
        limit_text = "unbudgeted" if limit is None else f"budget {limit / MIB:.2f} MiB"
        log(f"  peak at {location}: {peak / MIB:.2f} MiB ({limit_text})")
    log(f"  wrote {summary['trace']}" + (f" and {summary['plot']}" if plotted else ""))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fhelium-residency", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the bounded-memory streaming demo")
    demo.add_argument("--out", type=Path, default=Path("residency-demo"), help="output folder")
    demo.add_argument("--stages", type=int, default=40)
    demo.add_argument("--shards", type=int, default=24)
    demo.add_argument("--width", type=int, default=512, help="shard matrices are width x width")
    demo.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    demo.add_argument("--cache", type=Path, default=None, help="where the shard files live")
    arguments = parser.parse_args(argv)
    run_demo(
        arguments.out,
        shards=arguments.shards,
        width=arguments.width,
        stages=arguments.stages,
        device=arguments.device,
        cache=arguments.cache,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
