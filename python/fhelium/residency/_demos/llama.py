"""`python -m fhelium.residency demo`: a Llama model whose weights do not fit its device
budget generates tokens through `fhelium.residency.nn.offload`, four ways.

The model is transformers' ``LlamaForCausalLM`` built from a config with random weights
(no download), saved once as a sharded checkpoint (``save_pretrained`` with
``max_shard_size``) into a cache folder and reused on later runs. Each run builds the
model with its parameters on meta (`init_empty_weights`), offloads it from the
checkpoint with each decoder layer as one unit, runs one warm-up forward over the prompt
(the recording), and then times a greedy ``generate``:

1. ``resident``: a budget that holds every unit (the floor: after the warm-up nothing
   moves);
2. ``every unit, every token``: what Accelerate's offload hooks do, each unit loaded
   for every forward and nothing prefetched, emulated by ``offload(policy="lru",
   prefetch=0)`` with a budget of the largest unit (loading it leaves room for nothing
   else);
3. ``lru``: ours at a budget of a third of the weights, the tiered LRU, with prefetch;
4. ``schedule-aware``: ours at the same budget, the recorded order followed cyclically,
   with prefetch.

On a GPU the sizes are a few GB of fp16 weights and times are CUDA events. Without one,
a small fp32 model runs on the simulated runtime (docs/concepts/simulation.md): each
decoder layer and the LM head declare their compute on the simulated stream (the
longer of their FLOPs at ``tflops`` and their weights read at ``hbm_gbps``), copies take
their bytes at ``h2d_gbps``, and the times are the timeline's predictions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from fhelium.residency._demos import DemoUsageError
from fhelium.residency._demos._compute import MIB, Compute
from fhelium.residency._demos._progress import Progress
from fhelium.residency.sizes import format_size

__all__ = ["GPU_SIZES", "CPU_SIZES", "LlamaSizes", "run_llama_demo"]

SEED = 1234


@dataclass(frozen=True)
class LlamaSizes:
    """The model's shape (a ``LlamaConfig``'s fields) and the weights' dtype."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    dtype: str  # "float16", "bfloat16" or "float32"

    def config(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        }

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must name a floating torch dtype, got {self.dtype!r}")
        return dtype


# About 2.4 GB of fp16 weights (1.2 B parameters): 24 decoder layers of 90 MiB, and an
# embedding and an LM head of 125 MiB each.
GPU_SIZES = LlamaSizes(
    layers=24, hidden=2048, intermediate=5632, heads=16, kv_heads=4, vocab=32000, dtype="float16"
)
# About 25 MiB of fp32 weights: 8 decoder layers of 2.6 MiB (the largest units), an
# embedding and an LM head of 2 MiB each.
CPU_SIZES = LlamaSizes(
    layers=8, hidden=256, intermediate=688, heads=8, kv_heads=2, vocab=2048, dtype="float32"
)

# (name, policy, prefetch or None for the run's `prefetch`, budget kind)
_RUNS: tuple[tuple[str, Literal["lru", "schedule-aware"], int | None, str], ...] = (
    ("resident", "lru", 0, "everything"),
    ("every unit, every token", "lru", 0, "largest unit"),
    ("lru", "lru", None, "a third"),
    ("schedule-aware", "schedule-aware", None, "a third"),
)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "the demo builds its Llama model with transformers, which is not installed: "
            "pip install 'fhelium-residency[plot]' (or pip install transformers), or run "
            "the layer demo, `python -m fhelium.residency demo layers`"
        ) from error
    return transformers


def checkpoint(cache: Path, sizes: LlamaSizes) -> tuple[Path, bool]:
    """The sharded checkpoint of a random-weight Llama of ``sizes``, in ``cache``: written
    once (deterministic weights, seed `SEED`), then reused. A folder appears whole or not
    at all (written aside, then renamed). Returns the folder and whether it was written
    now."""
    digest = hashlib.sha256(json.dumps(asdict(sizes), sort_keys=True).encode()).hexdigest()
    folder = cache / f"llama-{sizes.layers}x{sizes.hidden}-{sizes.dtype}-{digest[:10]}"
    if (folder / "model.safetensors.index.json").is_file():
        return folder, False
    transformers = _transformers()
    cache.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(**sizes.config())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = transformers.LlamaForCausalLM(config).to(sizes.torch_dtype)
    total = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=cache))
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        # About six shards: each unit's tensors are read from wherever they landed.
        model.save_pretrained(staging, max_shard_size=max(1, total // 6))
        del model
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / "model.safetensors.index.json").is_file():
                raise  # not another process's finished copy
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
        shutil.rmtree(staging, ignore_errors=True)
    return folder, True


def _unit_rule() -> type[nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def _unit_bytes(model: nn.Module) -> list[int]:
    """The bytes of each unit `offload(units=LlamaDecoderLayer)` makes: every decoder
    layer, and each other module that directly owns parameters or buffers."""
    layer = _unit_rule()
    sizes: list[int] = []

    def nbytes(tensors: Iterator[torch.Tensor]) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)

    def walk(module: nn.Module) -> None:
        if isinstance(module, layer):
            sizes.append(nbytes(module.parameters()) + nbytes(module.buffers()))
            return
        own = nbytes(module.parameters(recurse=False)) + nbytes(module.buffers(recurse=False))
        if own:
            sizes.append(own)
        for child in module.children():
            walk(child)

    walk(model)
    return sizes


class _Work:
    """On the simulated runtime, each decoder layer and the LM head declare their compute
    on the stream the offload uses, inside their unit's step (wrapped before `offload`
    wraps them, so the declaration comes before the step's weights are released): the
    longer of the FLOPs at ``tflops`` and the weights read at ``hbm_gbps``."""

    def __init__(
        self, compute: Compute, model: nn.Module, sizes: LlamaSizes, tflops: float, hbm_gbps: float
    ) -> None:
        self.compute = compute
        self.sizes = sizes
        self.flop_rate = tflops * 1e12
        self.byte_rate = hbm_gbps * 1e9
        self.context = 0  # the tokens already in the KV cache when a forward starts
        self.flops = 0.0
        self.undo: list[Callable[[], None]] = []
        layer = _unit_rule()
        self._wrap_root(model)
        for name, module in model.named_modules():
            if isinstance(module, layer) or name == "lm_head":
                self._wrap(name, module, attention=isinstance(module, layer))

    def _wrap_root(self, model: nn.Module) -> None:
        original = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            cache = kwargs.get("past_key_values")
            self.context = 0 if cache is None else int(cache.get_seq_length())
            return original(*args, **kwargs)

        model.forward = forward
        self.undo.append(lambda: model.__dict__.pop("forward", None))

    def _wrap(self, name: str, module: nn.Module, *, attention: bool) -> None:
        original = module.forward
        matmul = sum(
            child.weight.numel() for child in module.modules() if isinstance(child, nn.Linear)
        )
        weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        hidden = self.sizes.hidden

        def forward(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            inputs = next(
                item
                for item in (*args, *kwargs.values())
                if isinstance(item, torch.Tensor) and item.is_floating_point()
            )
            tokens = inputs.numel() // inputs.shape[-1]
            flops = 2.0 * tokens * matmul
            if attention:
                # Scores and the weighted sum, per query over every key so far.
                per_sequence = inputs.shape[-2]
                keys = self.context + per_sequence
                flops += 4.0 * tokens * keys * hidden
            self.flops += flops
            seconds = max(flops / self.flop_rate, weight_bytes / self.byte_rate)
            self.compute.declare_seconds(seconds, name)
            return output

        module.forward = forward
        self.undo.append(lambda: module.__dict__.pop("forward", None))

    def remove(self) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo = []


class _Probe:
    """Which units are on the device as each unit's step begins: a forward pre-hook on
    every unit (it runs before the offload enters the step, so it sees what was staged
    ahead and what was left from earlier steps)."""

    def __init__(self, off: Any) -> None:
        self.off = off
        self.units = [unit.name for unit in off.units]
        self.steps: list[list[int]] = []  # per step: the unit stepped, then those resident
        self.on = False
        self.hooks = [
            unit.module.register_forward_pre_hook(self._hook(index))
            for index, unit in enumerate(off.units)
        ]

    def _hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.on:
                self.steps.append([index, *self._resident()])

        return hook

    def _resident(self) -> list[int]:
        off = self.off
        where: dict[Any, bool] = {}
        for value in off.manager.snapshot().values:
            where[value.handle] = any(m.location == off.location for m in value.materializations)
        return [
            index
            for index, unit in enumerate(off.units)
            if all(where.get(handle, False) for handle in unit.handles)
        ]

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


@contextmanager
def _timed(compute: Compute, spans: list[tuple[str, float, float]]) -> Iterator[dict[str, float]]:
    """The block's time: CUDA events on the GPU's current stream; on the simulated
    runtime the timeline's makespan (reset at the start) and its compute engine's busy
    time, with the copy and compute spans added to ``spans`` (engine, start, end)."""
    result: dict[str, float] = {}
    timeline = compute.timeline
    if timeline is None:
        compute.synchronize()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(compute.stream)
        yield result
        end.record(compute.stream)
        end.synchronize()
        result["seconds"] = float(start.elapsed_time(end)) / 1e3
        return
    compute.synchronize()
    timeline.reset()
    yield result
    compute.synchronize()
    result["seconds"] = timeline.makespan
    result["compute_seconds"] = timeline.busy("compute")
    spans.extend(
        (span.engine, span.start, span.end)
        for span in timeline.spans
        if span.engine in ("h2d", "compute")
    )


def run_llama_demo(
    out: Path,
    *,
    sizes: LlamaSizes | None = None,
    prompt_tokens: int = 16,
    new_tokens: int = 16,
    prefetch: int = 1,
    budget_bytes: int | None = None,
    device: str = "auto",
    cache: Path | None = None,
    quiet: bool = False,
    h2d_gbps: float = 55.0,
    tflops: float = 60.0,
    hbm_gbps: float = 3350.0,
    progress: bool = False,
) -> dict[str, Any]:
    """Generates ``new_tokens`` greedy tokens after a random prompt of ``prompt_tokens``,
    four ways (see the module's docstring); returns the summary, prints the table
    (unless ``quiet``) and writes ``out/summary.json`` and ``out/llama.png`` (when
    matplotlib is installed).

    ``sizes`` defaults to `GPU_SIZES` on a GPU and to `CPU_SIZES` on the simulated
    runtime; ``budget_bytes`` (the third and fourth runs' device budget) to a third of
    the weights. ``h2d_gbps``, ``tflops`` and ``hbm_gbps`` are the simulated device's
    figures (unused on a GPU)."""
    transformers = _transformers()
    from fhelium.residency.nn import init_empty_weights, offload

    compute = Compute(device, h2d_gbps=h2d_gbps, tflops=tflops)
    if sizes is None:
        sizes = GPU_SIZES if compute.on_gpu else CPU_SIZES
    for name, count in (("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
        if count < 1:
            raise DemoUsageError(f"{name} must be >= 1, got {count}")
    if prefetch < 0:
        raise DemoUsageError(f"prefetch must be >= 0, got {prefetch}")
    if sizes.hidden % sizes.heads or sizes.heads % sizes.kv_heads:
        raise DemoUsageError(
            f"hidden ({sizes.hidden}) must be a multiple of heads ({sizes.heads}), and heads "
            f"of kv_heads ({sizes.kv_heads})"
        )
    dtype = sizes.torch_dtype
    log = print if not quiet else (lambda *_: None)
    started = time.perf_counter()
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
        "fhelium-residency-demo"
    )
    folder, written = checkpoint(cache, sizes)
    config = transformers.LlamaConfig.from_pretrained(folder)
    shards = sorted(path.name for path in folder.glob("*.safetensors"))
    with init_empty_weights():
        probe = transformers.LlamaForCausalLM(config)
    units = _unit_bytes(probe)
    del probe
    weights = sum(units)
    third = weights // 3 if budget_bytes is None else budget_bytes
    if third < max(units):
        raise DemoUsageError(
            f"a device budget of {format_size(third, exact=True)} is smaller than the "
            f"largest unit ({format_size(max(units), exact=True)}): give a budget of at "
            "least that, or smaller layers"
        )
    budgets = {"everything": weights, "largest unit": max(units), "a third": third}
    prompt = torch.randint(
        0, sizes.vocab, (1, prompt_tokens), generator=torch.Generator().manual_seed(SEED + 1)
    ).to(compute.torch_device)
    out.mkdir(parents=True, exist_ok=True)
    log(
        f"fhelium.residency demo: Llama ({sizes.layers} layers, hidden {sizes.hidden}, "
        f"{sizes.heads} heads / {sizes.kv_heads} KV heads, vocab {sizes.vocab}, "
        f"{sizes.dtype}), {weights / MIB:.1f} MiB of weights in {len(units)} units, "
        f"random weights"
    )
    log(
        f"checkpoint: {folder} ({len(shards)} shards, "
        + ("written now" if written else "reused")
        + ")"
    )
    log(
        f"compute: {compute.description}"
        + ("" if compute.on_gpu else f"; compute reads weights at {hbm_gbps:g} GB/s")
    )
    log(f"generate: {new_tokens} tokens after a prompt of {prompt_tokens}, greedy, batch 1")
    runs: dict[str, dict[str, Any]] = {}
    # Each run: the recorded forward, then one forward per new token.
    bar = Progress(len(_RUNS) * (1 + new_tokens), "demo llama", enabled=progress)
    with compute.installed(), torch.inference_mode(), bar:
        for name, policy, run_prefetch, budget_kind in _RUNS:
            bar.advance(0, f"demo llama: {name}")
            budget = budgets[budget_kind]
            ahead = prefetch if run_prefetch is None else run_prefetch
            with init_empty_weights():
                model = transformers.LlamaForCausalLM(config)
            model.eval()
            work = None if compute.on_gpu else _Work(compute, model, sizes, tflops, hbm_gbps)
            try:
                with offload(
                    model,
                    device=compute.torch_device if compute.on_gpu else compute.simulated_device,
                    budget=budget,
                    policy=policy,
                    prefetch=ahead,
                    units=_unit_rule(),
                    checkpoint=folder,
                    dtype=dtype,
                ) as off:
                    made = sorted(unit.nbytes for unit in off.units)
                    if made != sorted(units):
                        raise RuntimeError(
                            f"the offload made units of {made} bytes, the demo expected {units}"
                        )
                    # The warm-up: the prompt's forward is recorded (and, when everything
                    # fits, leaves every unit resident).
                    model(prompt, use_cache=False)
                    bar.advance()
                    before = off.stats()
                    flops_before = 0.0 if work is None else work.flops
                    probe = _Probe(off)
                    # On the simulated runtime the map is sampled in the timed generate
                    # (its times are the timeline's, which host work does not move); on
                    # a GPU in an untimed repeat, so the sampling costs no measured time.
                    probe.on = not compute.on_gpu
                    spans: list[tuple[str, float, float]] = []
                    try:
                        with _timed(compute, spans) as timing:
                            tokens = model.generate(
                                prompt,
                                attention_mask=torch.ones_like(prompt),
                                max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens,
                                do_sample=False,
                                streamer=_Ticks(bar),
                            )
                        after = off.stats()
                        if compute.on_gpu:
                            probe.on = True
                            model.generate(
                                prompt,
                                attention_mask=torch.ones_like(prompt),
                                max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens,
                                do_sample=False,
                            )
                    finally:
                        probe.remove()
            finally:
                if work is not None:
                    work.remove()
            generated = tokens[0, prompt_tokens:].tolist()
            seconds = timing["seconds"]
            runs[name] = {
                "policy": policy,
                "prefetch": ahead,
                "budget_bytes": budget,
                "budget_kind": budget_kind,
                "tokens": generated,
                "new_tokens": new_tokens,
                "forwards": after.forwards - before.forwards,
                "steps": after.steps - before.steps,
                "h2d_bytes": after.h2d_bytes - before.h2d_bytes,
                "loads": after.loads - before.loads,
                "stalls": after.stalls - before.stalls,
                "device_peak_bytes": after.device_peak_bytes,
                "host_peak_bytes": after.host_peak_bytes,
                "seconds": seconds,
                "tokens_per_s": len(generated) / seconds if seconds > 0 else float("inf"),
                "compute_seconds": timing.get("compute_seconds"),
                "flops": None if work is None else work.flops - flops_before,
                # Per unit step of the generate: the unit stepped, then every unit on the
                # device as the step began.
                "residency": probe.steps,
                # The timeline's copy and compute spans (engine, start s, end s); empty on
                # a GPU.
                "spans": spans,
            }
    resident = runs["resident"]["seconds"]
    for figures in runs.values():
        if compute.on_gpu:
            figures["exposed_copy_seconds"] = max(0.0, figures["seconds"] - resident)
        else:
            figures["exposed_copy_seconds"] = figures["seconds"] - figures["compute_seconds"]
        figures["h2d_bytes_per_token"] = figures["h2d_bytes"] / new_tokens
    time_kind = "measured (CUDA events)" if compute.on_gpu else "predicted (timeline model)"
    exposed_kind = (
        "estimated as the time less the resident run's"
        if compute.on_gpu
        else "predicted (timeline model): the makespan less the compute engine's busy time"
    )
    summary: dict[str, Any] = {
        "device": compute.description,
        "sizes": asdict(sizes),
        "checkpoint": str(folder),
        "shards": len(shards),
        "written": written,
        "weights_bytes": weights,
        "unit_bytes": units,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "unit_names": probe.units,
        "time": time_kind,
        "exposed": exposed_kind,
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    table = _table(runs, compute.on_gpu)
    log("")
    for line in table:
        log(line)
    log(f"tok/s: {time_kind}. copy-exposed: the copy time not hidden behind compute,")
    log(f"  {exposed_kind}.")
    log("every unit, every token: Accelerate's hooks, emulated by offload(policy='lru',")
    log("  prefetch=0) at a budget of the largest unit.")
    same = len({tuple(figures["tokens"]) for figures in runs.values()}) == 1
    log("tokens: " + ("the same in every run." if same else "DIFFERENT between runs!"))
    plotted = _plot(runs, summary["unit_names"], out / "llama.png", time_kind, log)
    summary["plot"] = str(out / "llama.png") if plotted else None
    log(f"wrote {out / 'summary.json'}" + (f" and {summary['plot']}" if plotted else ""))
    return summary


class _Ticks:
    """A `generate` streamer that moves the progress bar once per new token (its first
    `put` is the prompt)."""

    def __init__(self, bar: Progress) -> None:
        self.bar = bar
        self.prompt = True

    def put(self, value: Any) -> None:
        if self.prompt:
            self.prompt = False
            return
        self.bar.advance()

    def end(self) -> None:
        return None


def _table(runs: dict[str, dict[str, Any]], on_gpu: bool) -> list[str]:
    """The printed table: one line per run."""
    rate = "tok/s" if on_gpu else "tok/s (pred.)"
    lines = [
        f"{'run':<25}{'prefetch':>9}{rate:>15}{'H2D MiB/tok':>13}"
        f"{'device peak/budget MiB':>24}{'host peak MiB':>15}{'copy-exposed ms/tok':>21}"
    ]
    for name, figures in runs.items():
        peak = f"{figures['device_peak_bytes'] / MIB:.1f}/{figures['budget_bytes'] / MIB:.1f}"
        lines.append(
            f"{name:<25}{figures['prefetch']:>9}{figures['tokens_per_s']:>15.0f}"
            f"{figures['h2d_bytes_per_token'] / MIB:>13.2f}{peak:>24}"
            f"{figures['host_peak_bytes'] / MIB:>15.1f}"
            f"{figures['exposed_copy_seconds'] * 1e3 / figures['new_tokens']:>21.3f}"
        )
    return lines


# The timelines show the first tokens of each generate: whole tokens' copies and compute,
# wide enough to see.
_TOKENS_SHOWN = 3


def _stalls(spans: list[Any]) -> list[tuple[float, float]]:
    """The compute engine's idle gaps while a copy runs: where compute waits for weights
    (the first compute span's start included)."""
    compute = sorted((start, end) for engine, start, end in spans if engine == "compute")
    copies = [(start, end) for engine, start, end in spans if engine == "h2d"]
    gaps: list[tuple[float, float]] = []
    previous = 0.0
    for start, end in compute:
        if start > previous:
            waited = [
                (max(previous, a), min(start, b)) for a, b in copies if a < start and b > previous
            ]
            if waited:
                gaps.append((min(a for a, _ in waited), max(b for _, b in waited)))
        previous = max(previous, end)
    return gaps


def _plot(
    runs: dict[str, dict[str, Any]], units: list[str], path: Path, time_kind: str, log: Any
) -> bool:
    """Per run, the copy engine against compute with the stalls marked, and a unit-by-step
    map of what was on the device; then the bytes moved per run and, secondary, the
    device's peak against its budget."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log("llama.png skipped: matplotlib is missing (pip install 'fhelium-residency[plot]')")
        return False
    names = list(runs)
    colours = ["tab:gray", "tab:red", "tab:orange", "tab:blue"][: len(names)]
    kind = time_kind.split(" ", maxsplit=1)[0]
    figure = Figure(figsize=(13.0, 11.0), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(
        len(names) + 2, len(names), height_ratios=[0.7] * len(names) + [2.2, 1.5]
    )
    for row, name in enumerate(names):
        ax = figure.add_subplot(grid[row, :])
        spans = runs[name]["spans"]
        per_token = runs[name]["seconds"] * 1e3 / max(1, len(runs[name]["tokens"]))
        if not spans:
            ax.text(
                0.01,
                0.5,
                f"{name}: {per_token:.3f} ms per token ({kind}); no per-engine timeline on a GPU",
                transform=ax.transAxes,
                va="center",
            )
            ax.set_axis_off()
            continue
        stalls = _stalls(spans)
        ax.broken_barh(
            [(a * 1e3, (b - a) * 1e3) for a, b in stalls], (-0.4, 0.8), color="red", alpha=0.35
        )
        for lane, engine, colour in ((1, "h2d", "tab:purple"), (0, "compute", "tab:green")):
            bars = [(a * 1e3, (b - a) * 1e3) for e, a, b in spans if e == engine]
            ax.broken_barh(bars, (lane - 0.4, 0.8), color=colour, edgecolor="white", linewidth=0.3)
        stalled = sum(b - a for a, b in stalls) * 1e3
        ax.set_yticks([0, 1], ["compute", "copy"])
        ax.set_ylim(-0.6, 1.6)
        shown = min(_TOKENS_SHOWN, len(runs[name]["tokens"]))
        ax.set_xlim(0.0, per_token * shown)
        ax.set_title(
            f"{name}: {per_token:.3f} ms per token; compute waiting for copies (red): "
            f"{stalled:.2f} ms in all (the first {shown} tokens shown)",
            fontsize="small",
            loc="left",
        )
        ax.grid(axis="x", alpha=0.3)
        if row == len(names) - 1:
            ax.set_xlabel(f"ms ({time_kind})")
    for column, name in enumerate(names):
        ax = figure.add_subplot(grid[len(names), column])
        steps = runs[name]["residency"]
        grid_map = [[0.0] * len(steps) for _ in units]
        for x, (_, *resident) in enumerate(steps):
            for unit in resident:
                grid_map[unit][x] = 1.0
        ax.imshow(
            grid_map, aspect="auto", cmap="Blues", vmin=0.0, vmax=1.4, interpolation="nearest"
        )
        ax.scatter(range(len(steps)), [step[0] for step in steps], s=4, color="black", marker="s")
        ax.set_title(f"{name}: on the device", fontsize="small")
        ax.set_xlabel("unit step of the generate")
        if column == 0:
            ax.set_yticks(range(len(units)), [_short(unit) for unit in units], fontsize="x-small")
            ax.set_ylabel("unit (black: the step's own;\non white: loaded at its step)")
        else:
            ax.set_yticks([])
    moved = figure.add_subplot(grid[len(names) + 1, : max(1, len(names) - 1)])
    values = [runs[n]["h2d_bytes_per_token"] / MIB for n in names]
    moved.bar_label(
        moved.barh(names, values, color=colours), fmt="%.2f", padding=3, fontsize="small"
    )
    moved.set_title("host-to-device MiB per token", fontsize="small")
    moved.invert_yaxis()
    moved.margins(x=0.2)
    memory = figure.add_subplot(grid[len(names) + 1, len(names) - 1])
    peaks = [runs[n]["device_peak_bytes"] / MIB for n in names]
    budgets = [runs[n]["budget_bytes"] / MIB for n in names]
    memory.barh(names, budgets, color="none", edgecolor="black", linestyle="--")
    memory.barh(names, peaks, color=colours, alpha=0.6)
    memory.set_title("device peak / budget (dashed), MiB", fontsize="small")
    memory.set_yticks([])
    memory.invert_yaxis()
    figure.suptitle(
        "fhelium.residency demo: a Llama model three times its device budget, four ways"
    )
    figure.savefig(path, format="png")
    return True


def _short(name: str) -> str:
    """A unit's name for an axis: ``model.layers.3`` reads ``layers.3``."""
    return name.removeprefix("model.")


def scaled(sizes: LlamaSizes, **changes: Any) -> LlamaSizes:
    """``sizes`` with some fields changed (the command line's overrides)."""
    return replace(sizes, **{k: v for k, v in changes.items() if v is not None})
