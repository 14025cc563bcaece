"""`python -m fhelium.residency demo layers`: layer weights streamed through a bounded device.

A transformer-like stack of layer weights lives on disk as safetensors files, is
registered as reconstructible values and staged once in pinned host memory. A compute
location (cuda:0 on a GPU machine; a simulated cuda:0 with the timeline model
otherwise) has a budget that holds only a third of them. Several passes over the
layers run three ways: the tiered LRU, the schedule-aware policy, and the
schedule-aware policy with prefetch, which copies the next layer in while the current
one computes. The table compares the bytes moved, loads, evictions, peak against
budget and time (CUDA events on a GPU, the timeline model's prediction on the CPU).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fhelium.residency import (
    PINNED_HOST,
    DropResident,
    EnsureResident,
    MemoryReservation,
    MoveResident,
    ReplicaMode,
    ResidencyController,
    ResidencyLocation,
    ResidencyManager,
    ResidencyRequest,
    ResidencyRequirement,
    ResidencySnapshot,
    ResidencyTransitionReport,
)
from fhelium.residency._demos import DemoUsageError
from fhelium.residency._demos._compute import MIB, Compute, GpuTimer
from fhelium.residency._demos._progress import Progress
from fhelium.residency.disk import DiskLocation, disk_location
from fhelium.residency.schedule import ScheduleAwarePolicy
from fhelium.residency.sizes import format_size
from fhelium.residency.sources import SafetensorsSource
from fhelium.values import ResidentTensor


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


def _fewest_loads(schedule: Sequence[int], capacity: int) -> int:
    """Belady's MIN: the loads of a cache of `capacity` equal values that always evicts
    the value needed farthest ahead (no choice of victims loads fewer)."""
    upcoming: dict[int, list[int]] = {}
    for position in range(len(schedule) - 1, -1, -1):
        upcoming.setdefault(schedule[position], []).append(position)
    cached: set[int] = set()
    loads = 0
    for value in schedule:
        upcoming[value].pop()
        if value in cached:
            continue
        loads += 1
        if len(cached) >= capacity:

            def next_use(candidate: int) -> float:
                later = upcoming[candidate]
                return later[-1] if later else float("inf")

            cached.remove(max(cached, key=next_use))
        cached.add(value)
    return loads


_RUNS: tuple[tuple[str, bool, int], ...] = (
    ("lru", False, 0),
    ("schedule-aware", True, 0),
    ("schedule-aware + prefetch", True, 1),
)


def _traffic(
    transitions: Sequence[ResidencyTransitionReport], compute: ResidencyLocation
) -> dict[str, int]:
    """Bytes moved host-to-device and device-to-host, loads into and evictions from
    the compute location, from a run's transition reports."""
    figures = {"h2d_bytes": 0, "d2h_bytes": 0, "disk_read_bytes": 0, "loads": 0, "evictions": 0}
    for report in transitions:
        if report.no_op:
            continue
        source, destination = report.source, report.destination
        if isinstance(source, DiskLocation):
            figures["disk_read_bytes"] += report.storage_nbytes
        if destination == compute:
            figures["loads"] += 1
            if source is None or source.kind != "cuda":
                figures["h2d_bytes"] += report.storage_nbytes
        elif destination is not None and destination.kind != "cuda" and source == compute:
            figures["d2h_bytes"] += report.storage_nbytes
        if source == compute and destination != compute:
            figures["evictions"] += 1
    return figures


def run_demo(
    out: Path,
    *,
    layers: int = 24,
    width: int | None = None,
    batch: int | None = None,
    passes: int = 3,
    budget_layers: int = 8,
    device: str = "auto",
    cache: Path | None = None,
    quiet: bool = False,
    h2d_gbps: float = 55.0,
    tflops: float = 60.0,
    disk: Path | None = None,
    host_layers: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Streams `passes` passes over `layers` layer weights through a compute budget of
    `budget_layers` of them, three ways; returns the summary and writes the trace and
    the plot. Sizes default to a few GB of weights on a GPU and to a scaled-down copy
    on the CPU.

    With `disk`, the weights are the manager's own (adopted, must be preserved), the
    pinned host's budget holds only `host_layers` of them (default: a third), and the
    rest live in a disk location in that directory, read back whenever a step needs
    them."""
    compute = Compute(device, h2d_gbps=h2d_gbps, tflops=tflops)
    if width is None:
        width = 5792 if compute.on_gpu else 256
    if batch is None:
        batch = 2048
    if layers < 1 or passes < 1 or width < 1 or batch < 1:
        raise DemoUsageError("layers, passes, width and batch must be >= 1")
    if not budget_layers >= 2:
        raise DemoUsageError("budget_layers must be >= 2 (one step computing, one arriving)")
    log = print if not quiet else (lambda *_: None)
    started = time.perf_counter()
    layer_bytes = width * width * 4
    workspace = batch * width * 4 * 2
    budget = budget_layers * layer_bytes + workspace
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
        "fhelium-residency-demo"
    )
    paths = _shards(cache, layers, width)
    out.mkdir(parents=True, exist_ok=True)
    location = compute.location
    schedule = [layer for _ in range(passes) for layer in range(layers)]
    pinned_layers = layers if disk is None else (host_layers or max(1, layers // 3))
    with compute.installed():
        budgets: dict[ResidencyLocation, int] = {
            location: budget,
            PINNED_HOST: pinned_layers * layer_bytes,
        }
        spill = None if disk is None else disk_location(disk)
        if spill is not None:
            budgets[spill] = layers * layer_bytes
        manager = ResidencyManager(budgets, trace_capacity=8 * len(schedule) + 64)
        handles = []
        for path in paths:
            source: SafetensorsSource[ResidentTensor] = SafetensorsSource(path, "weight")
            if spill is None:
                handles.append(
                    manager.register_source(
                        source.spec(replica_mode=ReplicaMode.REPLICABLE), source
                    )
                )
            else:
                # The manager's own copy, which must be kept: the pinned host holds a
                # few, the disk the rest.
                handles.append(manager.adopt(source.load(), replica_mode=ReplicaMode.REPLICABLE))
        # Every layer is staged once in pinned host memory (or, past its budget, on
        # disk): the compute location fills from there with fast host-to-device copies,
        # and an eviction from it is a drop.
        if spill is None:
            manager.execute_actions(
                [EnsureResident(handle, PINNED_HOST) for handle in handles], name="staging"
            )
        else:
            manager.execute_actions(
                [
                    MoveResident(handle, PINNED_HOST if index < pinned_layers else spill)
                    for index, handle in enumerate(handles)
                ],
                name="staging",
            )
        log(
            f"fhelium.residency demo: {passes} passes over {layers} layers of "
            f"{format_size(layer_bytes)} ({format_size(layers * layer_bytes)} of weights)"
        )
        log(
            f"compute: {compute.description}; budget {budget / MIB:.1f} MiB "
            f"({budget_layers} layers + {workspace / MIB:.1f} MiB of activations)"
        )
        if spill is not None:
            log(
                f"host: pinned budget of {pinned_layers} layers; the other "
                f"{layers - pinned_layers} live on {spill.name}"
            )
        requests = [
            ResidencyRequest(
                f"pass-{step // layers}-layer-{layer:03d}",
                [ResidencyRequirement(handles[layer], location)],
                [MemoryReservation(location, workspace, "activations")],
            )
            for step, layer in enumerate(schedule)
        ]
        runs: dict[str, dict[str, Any]] = {}
        run_samples: dict[str, list[tuple[int, ResidencySnapshot[Any]]]] = {}
        series: dict[str, dict[str, list[float]]] = {}
        last_transitions: tuple[ResidencyTransitionReport, ...] = ()
        bar = Progress(len(_RUNS) * len(schedule), "demo layers", enabled=progress)
        for name, aware, prefetch in _RUNS:
            # A cold start: nothing of the last run stays on the device.
            compute.synchronize()
            manager.execute_actions(
                [DropResident(handle, location) for handle in handles], name="cold-start"
            )
            manager.clear_trace()
            if compute.timeline is not None:
                compute.timeline.reset()
            policy: ScheduleAwarePolicy | None = ScheduleAwarePolicy(requests) if aware else None
            controller = ResidencyController(manager, policy=policy)
            bar.advance(0, f"demo layers: {name}")
            stream = _stream(controller, requests, prefetch, compute, location, batch, width, bar)
            figures, samples, transitions, seconds, checksum = stream
            series[name] = _series(samples, location)
            peak = int(max(series[name]["charged_bytes"]))
            runs[name] = {
                **figures,
                "prefetch": prefetch,
                "peak_bytes": peak,
                "seconds": seconds,
                "checksum": checksum,
            }
            run_samples[name] = samples
            last_transitions = transitions
        bar.close()
        # The manager's own high-water marks over every run, against which the plotted
        # series are checked (tests/usage/test_demo.py): a peak between two samples
        # would show in these and not in the plot.
        peaks = {
            entry.location.name: (entry.peak_used_bytes, entry.peak_charged_bytes)
            for entry in manager.snapshot().locations
        }
        manager.close(force=True)
    time_kind = "measured (CUDA events)" if compute.on_gpu else "predicted (timeline model)"
    fewest = _fewest_loads(schedule, budget_layers)
    from fhelium.residency.export import write_trace

    write_trace(
        out / "trace.json",
        last_transitions,
        run_samples[_RUNS[-1][0]],
        timeline=compute.timeline,
    )
    plotted = _plot_runs(series, budget, location, out / "memory.png", time_kind, log)
    summary: dict[str, Any] = {
        "device": compute.description,
        "layers": layers,
        "passes": passes,
        "layer_bytes": layer_bytes,
        "budget_bytes": budget,
        "time": time_kind,
        "fewest_loads": fewest,
        "runs": runs,
        "seconds": time.perf_counter() - started,
        "trace": str(out / "trace.json"),
        "plot": str(out / "memory.png") if plotted else None,
        "location": location.name,
        "plotted": series,
        "snapshot_peaks": peaks,
    }
    log("")
    log(
        f"{'run':<27}{'H2D MiB':>9}{'D2H MiB':>9}{'loads':>7}{'evicted':>9}"
        f"{'peak/budget MiB':>17}{'time ms':>10}"
    )
    for name, figures in runs.items():
        log(
            f"{name:<27}{figures['h2d_bytes'] / MIB:>9.1f}{figures['d2h_bytes'] / MIB:>9.1f}"
            f"{figures['loads']:>7}{figures['evictions']:>9}"
            f"{figures['peak_bytes'] / MIB:>9.1f}/{budget / MIB:<7.1f}"
            f"{figures['seconds'] * 1e3:>10.2f}"
            + (f"   read {figures['disk_read_bytes'] / MIB:.1f} MiB from disk" if disk else "")
        )
    log(f"time: {time_kind}. Belady's MIN at this budget: {fewest} loads of {len(schedule)}.")
    log(f"wrote {summary['trace']}" + (f" and {summary['plot']}" if plotted else ""))
    return summary


def run_distributed_demo(
    out: Path,
    *,
    layers: int = 24,
    width: int | None = None,
    batch: int | None = None,
    passes: int = 3,
    budget_layers: int | None = None,
    device: str = "auto",
    cache: Path | None = None,
    quiet: bool = False,
    h2d_gbps: float = 55.0,
    tflops: float = 60.0,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """One rank of the distributed demo, under ``torchrun``: every rank streams its
    own partition of the layers (layers ``rank``, ``rank + world``, ...) through its own
    device's budget, with the schedule-aware policy and ``prefetch=1``, while rank 0
    broadcasts the shared weights (a projection every step also uses) into every rank's
    pinned host memory. Rank 0 prints a per-rank table; every rank writes
    ``out/rank-{rank}/summary.json`` and ``trace.json``, and rank 0 ``out/summary.json``.

    Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; the process group uses NCCL on
    GPUs and gloo on the CPU, where each rank has its own simulated ``cuda:0`` and
    timeline. See docs/concepts/distributed.md#the-demo."""
    import datetime
    import hashlib
    import json

    import torch.distributed as dist

    from fhelium.residency.distributed import broadcast, rank_manager

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    compute = Compute(device, h2d_gbps=h2d_gbps, tflops=tflops, index=local_rank)
    if compute.on_gpu:
        torch.cuda.set_device(local_rank)
    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group(
            "nccl" if compute.on_gpu else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if width is None:
        width = 5792 if compute.on_gpu else 256
    if batch is None:
        batch = 2048
    if layers < world or passes < 1 or width < 1 or batch < 1:
        raise DemoUsageError("layers must be >= the number of ranks; passes, width, batch >= 1")
    owned = list(range(rank, layers, world))
    if budget_layers is None:
        budget_layers = max(2, len(owned) // 3)
    if budget_layers < 2:
        raise DemoUsageError("budget_layers must be >= 2 (one step computing, one arriving)")
    log = print if (rank == 0 and not quiet) else (lambda *_: None)
    started = time.perf_counter()
    layer_bytes = width * width * 4
    workspace = batch * width * 4 * 2
    # The rank's layers, the shared projection, and the activations.
    budget = (budget_layers + 1) * layer_bytes + workspace
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
        "fhelium-residency-demo"
    )
    # Rank 0 writes the shard files once; the others read the same files.
    if rank == 0:
        _shards(cache, layers, width)
    dist.barrier()
    paths = _shards(cache, layers, width)
    location = compute.location
    folder = out / f"rank-{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    with compute.installed():
        manager = rank_manager(
            {location: budget, PINNED_HOST: (len(owned) + 1) * layer_bytes},
            runtime=compute.runtime,
            trace_capacity=8 * passes * len(owned) + 64,
        )
        handles = []
        for index in owned:
            source: SafetensorsSource[ResidentTensor] = SafetensorsSource(paths[index], "weight")
            handles.append(
                manager.register_source(source.spec(replica_mode=ReplicaMode.REPLICABLE), source)
            )
        manager.execute_actions(
            [EnsureResident(handle, PINNED_HOST) for handle in handles], name="staging"
        )
        # The shared weights: made on rank 0, broadcast through the process group into
        # every rank's pinned host memory, admitted there under each rank's budget.
        shared = None
        if rank == 0:
            projection = (
                torch.randn(width, width, generator=torch.Generator().manual_seed(99)) / width**0.5
            )
            value = ResidentTensor(projection)
            pinned = compute.runtime.pin(value) if compute.runtime else value.pin_memory()
            shared = manager.adopt(pinned, at=PINNED_HOST, replica_mode=ReplicaMode.REPLICABLE)
        shared = broadcast(manager, shared, src=0, at=PINNED_HOST)
        with manager.acquire([shared], at=PINNED_HOST) as borrowed:
            shared_tensor = borrowed[shared]
            assert isinstance(shared_tensor, ResidentTensor)
            shared_digest = hashlib.sha256(
                shared_tensor.tensor.contiguous().numpy().tobytes()
            ).hexdigest()
        requests = [
            ResidencyRequest(
                f"pass-{p}-layer-{index:03d}",
                [
                    ResidencyRequirement(handle, location),
                    ResidencyRequirement(shared, location),
                ],
                [MemoryReservation(location, workspace, "activations")],
            )
            for p in range(passes)
            for index, handle in zip(owned, handles, strict=True)
        ]
        manager.clear_trace()
        if compute.timeline is not None:
            compute.timeline.reset()
        controller = ResidencyController(manager, policy=ScheduleAwarePolicy(requests))
        stream = _stream(controller, requests, 1, compute, location, batch, width)
        figures, samples, transitions, seconds, checksum = stream
        peak = int(max(_series(samples, location)["charged_bytes"]))
        manager.close(force=True)
    from fhelium.residency.export import write_trace

    write_trace(folder / "trace.json", transitions, samples, timeline=compute.timeline)
    mine = {
        "rank": rank,
        "device": location.name,
        "layers": owned,
        "steps": len(requests),
        **figures,
        "peak_bytes": peak,
        "budget_bytes": budget,
        "seconds": seconds,
        "checksum": float(checksum),
        "shared_sha256": shared_digest,
    }
    (folder / "summary.json").write_text(json.dumps(mine, indent=2))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    time_kind = "measured (CUDA events)" if compute.on_gpu else "predicted (timeline model)"
    summary: dict[str, Any] = {
        "world_size": world,
        "backend": dist.get_backend(),
        "device": compute.description,
        "layer_bytes": layer_bytes,
        "time": time_kind,
        "shared_identical": len({entry["shared_sha256"] for entry in everyone}) == 1,
        "ranks": everyone,
        "seconds": time.perf_counter() - started,
    }
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log(
        f"fhelium.residency demo --distributed: {world} ranks ({summary['backend']}), "
        f"{passes} passes over {layers} layers of {format_size(layer_bytes)}, partitioned"
    )
    log(f"compute: {compute.description}; per-rank budget {budget / MIB:.1f} MiB")
    log("")
    log(
        f"{'rank':<6}{'device':<9}{'layers':>7}{'H2D MiB':>9}{'loads':>7}{'evicted':>9}"
        f"{'peak/budget MiB':>17}{'time ms':>10}  shared weights"
    )
    for entry in everyone:
        log(
            f"{entry['rank']:<6}{entry['device']:<9}{len(entry['layers']):>7}"
            f"{entry['h2d_bytes'] / MIB:>9.1f}{entry['loads']:>7}{entry['evictions']:>9}"
            f"{entry['peak_bytes'] / MIB:>9.1f}/{entry['budget_bytes'] / MIB:<7.1f}"
            f"{entry['seconds'] * 1e3:>10.2f}  sha256 {entry['shared_sha256'][:12]}"
        )
    log(
        f"time: {time_kind}. Shared weights broadcast from rank 0: "
        + ("identical on every rank." if summary["shared_identical"] else "DIFFERENT on some rank!")
    )
    log(f"wrote {out / 'summary.json'} and {out}/rank-*/summary.json, trace.json")
    if started_here:
        dist.destroy_process_group()
    return summary


def _stream(
    controller: ResidencyController,
    requests: list[ResidencyRequest],
    prefetch: int,
    compute: Compute,
    location: ResidencyLocation,
    batch: int,
    width: int,
    bar: Progress | None = None,
) -> tuple[dict[str, int], list[tuple[int, ResidencySnapshot[Any]]], Any, float, float]:
    """Streams ``requests`` through ``controller.run`` once: each step multiplies the
    activations by its values in order (a tanh after the first), on the compute stream,
    and samples a snapshot. Returns the traffic figures, the samples, the trace, the
    makespan in seconds and the checksum."""
    manager = controller.manager
    activation = torch.randn(batch, width, generator=torch.Generator().manual_seed(7)).to(
        compute.torch_device
    )
    checksum = torch.zeros((), device=compute.torch_device)
    samples: list[tuple[int, ResidencySnapshot[Any]]] = []
    origin = compute.clock_ns()
    timer = GpuTimer(compute) if compute.on_gpu else None
    with controller.run(
        requests, prefetch=prefetch, consumer_streams={location: compute.stream}
    ) as steps:
        for step in steps:
            values = [
                step.value(requirement.handle, at=location)
                for requirement in step.request.requirements
            ]
            with compute.kernels():
                for position, value in enumerate(values):
                    assert isinstance(value, ResidentTensor)
                    activation = activation @ value.tensor
                    if position == 0:
                        activation = torch.tanh(activation)
                checksum += activation[0, 0]
            compute.declare(len(values) * 2.0 * batch * width * width, step.request.name)
            samples.append((compute.clock_ns() - origin, manager.snapshot()))
            if bar is not None:
                bar.advance()
    compute.synchronize()
    seconds = timer.stop() if timer is not None else compute.timeline.makespan  # type: ignore[union-attr]
    samples.append((compute.clock_ns() - origin, manager.snapshot()))
    transitions = manager.trace()
    return _traffic(transitions, location), samples, transitions, seconds, float(checksum)


def _series(
    samples: list[tuple[int, ResidencySnapshot[Any]]], location: ResidencyLocation
) -> dict[str, list[float]]:
    """What the plot draws for one run, and what its summary's peak is read from: the
    time (ms) of each sample and the location's used and used + reserved bytes then."""
    series: dict[str, list[float]] = {"times_ms": [], "used_bytes": [], "charged_bytes": []}
    for time_ns, snapshot in samples:
        entry = next(e for e in snapshot.locations if e.location == location)
        series["times_ms"].append(time_ns / 1e6)
        series["used_bytes"].append(entry.used_bytes)
        series["charged_bytes"].append(entry.used_bytes + entry.reserved_bytes)
    return series


def _plot_runs(
    runs: dict[str, dict[str, list[float]]],
    budget: int,
    location: ResidencyLocation,
    path: Path,
    time_kind: str,
    log: Any,
) -> bool:
    """One panel per run: the compute location's bytes over the run's time (the
    series of `_series`, which the summary's peaks are read from too)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log("memory.png skipped: matplotlib is missing (pip install 'fhelium-residency[plot]')")
        return False
    figure = Figure(figsize=(4.0 * len(runs), 3.4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(runs), sharex=True, sharey=True, squeeze=False)[0]
    for ax, (name, series) in zip(axes, runs.items(), strict=True):
        times = series["times_ms"]
        used = [nbytes / MIB for nbytes in series["used_bytes"]]
        charged = [nbytes / MIB for nbytes in series["charged_bytes"]]
        ax.step(times, used, where="post", label="layers")
        ax.step(times, charged, where="post", linestyle="-.", label="layers + activations")
        ax.axhline(budget / MIB, color="tab:red", linestyle="--", label="budget")
        ax.set_title(name, fontsize="medium")
        ax.set_xlabel(f"time (ms, {time_kind.split(' ', maxsplit=1)[0]})")
        ax.set_ylim(bottom=0.0)
        ax.grid(visible=True, alpha=0.3)
    axes[0].set_ylabel(f"{location.name} MiB")
    axes[-1].legend(loc="lower right", fontsize="small")
    figure.suptitle("fhelium.residency demo: one budget, three ways")
    figure.savefig(path, format="png")
    return True
