"""`python -m fhelium.residency demo`: the main job, from the command line.

``demo`` (or ``demo llama``) generates tokens from a Llama model whose weights are three
times the device budget, through `fhelium.residency.nn.offload`, four ways
(`fhelium.residency._demos.llama`). ``demo layers`` streams layer weights through a
bounded device with the controller, three ways, optionally spilling to disk or
partitioned across ranks under torchrun (`fhelium.residency._demos.layers`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from fhelium.residency._demos import DemoUsageError
from fhelium.residency.sizes import parse_size

# The options of `demo layers` only, with the value `parse_args` leaves when absent.
_LAYER_OPTIONS = ("passes", "budget_layers", "width", "batch", "disk", "host_layers")
# The options of `demo llama` only.
_LLAMA_OPTIONS = (
    "hidden",
    "intermediate",
    "heads",
    "kv_heads",
    "vocab",
    "dtype",
    "prompt_tokens",
    "new_tokens",
    "prefetch",
    "budget_mib",
    "hbm_gbps",
)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help that shows every option's default: written into the help text where it
    depends on the device or the workload, appended from the parser otherwise."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.nargs == 0:  # a flag
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """A parser whose usage errors are one line (and exit status 2), never the whole
    usage synopsis or a traceback."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "count"  # argparse names the type in its messages
    return parse


def _rate(text: str) -> float:
    """An argparse type: a positive, finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _size(text: str) -> int:
    """An argparse type: a byte count such as ``64MiB`` (a plain number is MiB)."""
    try:
        return round(_rate(text) * (1 << 20))
    except argparse.ArgumentTypeError:
        pass
    try:
        value = parse_size(text, "budget")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text}")
    return value


_rate.__name__ = "number"
_size.__name__ = "size"


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (``fhelium-residency``, ``python -m fhelium.residency``)."""
    parser = _Parser(prog="fhelium-residency", description=__doc__, formatter_class=_Formatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="a Llama model larger than its device budget, generating through offload",
        description=__doc__,
        formatter_class=_Formatter,
    )
    demo.add_argument(
        "workload",
        nargs="?",
        choices=("llama", "layers"),
        default=None,
        help="what to run (default: llama; layers with --distributed)",
    )
    demo.add_argument("--out", type=Path, default=Path("residency-demo"), help="output folder")
    demo.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cuda: the GPU; cpu: the simulated runtime (CPU tensors stand in for a device); "
        "auto: the GPU when one is present",
    )
    demo.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="where the checkpoint or the layer files live "
        "(default: $XDG_CACHE_HOME/fhelium-residency-demo, else ~/.cache/...)",
    )
    demo.add_argument(
        "--layers",
        type=_count(1),
        default=None,
        help="decoder layers (llama; default: 24 on a GPU, 8 on the CPU) or layer weights "
        "(layers; default: 24)",
    )
    demo.add_argument(
        "--h2d-gbps", type=_rate, default=55.0, help="CPU only: the model's copy bandwidth, GB/s"
    )
    demo.add_argument(
        "--tflops", type=_rate, default=60.0, help="CPU only: the model's compute rate, TFLOP/s"
    )
    demo.add_argument(
        "--json",
        action="store_true",
        help="print the summary as JSON on standard output instead of the table",
    )
    llama = demo.add_argument_group("llama")
    from fhelium.residency._demos.llama import CPU_SIZES, GPU_SIZES

    for flag, field, what in (
        ("--hidden", "hidden", "hidden size"),
        ("--intermediate", "intermediate", "MLP size"),
        ("--heads", "heads", "attention heads"),
        ("--kv-heads", "kv_heads", "key/value heads"),
        ("--vocab", "vocab", "vocabulary size"),
    ):
        on_gpu, on_cpu = getattr(GPU_SIZES, field), getattr(CPU_SIZES, field)
        llama.add_argument(
            flag,
            type=_count(1),
            default=None,
            help=f"{what} (default: {on_gpu} on a GPU, {on_cpu} on the CPU)",
        )
    llama.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        default=None,
        help="the weights' dtype (default: float16 on a GPU, float32 on the CPU)",
    )
    llama.add_argument(
        "--prompt-tokens", type=_count(1), default=None, help="prompt length (default: 16)"
    )
    llama.add_argument(
        "--new-tokens", type=_count(1), default=None, help="tokens generated (default: 16)"
    )
    llama.add_argument(
        "--prefetch",
        type=_count(0),
        default=None,
        help="steps staged ahead in the schedule-aware run (default: 1)",
    )
    llama.add_argument(
        "--budget-mib",
        type=_size,
        default=None,
        metavar="SIZE",
        help="the lru and schedule-aware runs' device budget, in MiB or with a unit such as "
        "64MiB or 1.5GB (default: a third of the weights)",
    )
    llama.add_argument(
        "--hbm-gbps",
        type=_rate,
        default=None,
        help="CPU only: the rate at which compute reads weights, GB/s (default: 3350)",
    )
    layers = demo.add_argument_group("layers")
    layers.add_argument("--passes", type=_count(1), default=None, help="passes (default: 3)")
    layers.add_argument(
        "--budget-layers",
        type=_count(2),
        default=None,
        help="layers the budget holds (default: 8; with --distributed a third of a rank's)",
    )
    layers.add_argument(
        "--width",
        type=_count(1),
        default=None,
        help="layers are width x width (default: 5792 on a GPU, 256 on the CPU)",
    )
    layers.add_argument(
        "--batch", type=_count(1), default=None, help="activation rows (default: 2048)"
    )
    layers.add_argument(
        "--disk",
        type=Path,
        default=None,
        help="keep the layers past --host-layers on disk in this folder (default: none)",
    )
    layers.add_argument(
        "--host-layers",
        type=_count(1),
        default=None,
        help="with --disk: layers the pinned host holds (default: a third of them)",
    )
    layers.add_argument(
        "--distributed",
        action="store_true",
        help="under torchrun: each rank streams its own partition, rank 0 broadcasts the "
        "shared weights (NCCL on GPUs, gloo on the CPU)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments = parser.parse_args(argv)
    workload = arguments.workload or ("layers" if arguments.distributed else "llama")
    given = vars(arguments)
    if workload == "llama":
        wrong = [name for name in _LAYER_OPTIONS if given[name] is not None]
        wrong += ["distributed"] if arguments.distributed else []
    else:
        wrong = [name for name in _LLAMA_OPTIONS if given[name] is not None]
    if wrong:
        other = "layers" if workload == "llama" else "llama"
        flags = ", ".join("--" + name.replace("_", "-") for name in wrong)
        parser.error(f"{flags}: an option of `demo {other}`, not of `demo {workload}`")
    _check(parser, arguments, workload)
    try:
        summary = _layers(parser, arguments) if workload == "layers" else _llama(arguments)
    except DemoUsageError as error:
        parser.error(str(error))
    except ImportError as error:  # transformers is missing: say what to install
        print(f"fhelium-residency demo: {error}", file=sys.stderr)
        return 1
    # Under torchrun every rank returns the summary; rank 0 prints it.
    if arguments.json and summary is not None and os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary, indent=2, default=str))
    return 0


def _check(parser: argparse.ArgumentParser, arguments: argparse.Namespace, workload: str) -> None:
    """What argparse's types cannot see: options that need another, a GPU that is not
    there, folders that are files, sizes that do not divide."""
    for flag, folder in (("--out", arguments.out), ("--cache", arguments.cache)):
        if folder is not None and folder.exists() and not folder.is_dir():
            parser.error(f"{flag} {folder}: a file is there, not a folder")
    if arguments.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error(
                "--device cuda: no CUDA device is available here; use --device cpu (or "
                "auto) to run on the simulated runtime, where CPU tensors stand in for "
                "device memory"
            )
    if workload == "layers":
        if arguments.host_layers is not None and arguments.disk is None:
            parser.error(
                "--host-layers needs --disk (the layers the host does not hold live there)"
            )
        if arguments.disk is not None and arguments.disk.exists() and not arguments.disk.is_dir():
            parser.error(f"--disk {arguments.disk}: a file is there, not a folder")
        layers = 24 if arguments.layers is None else arguments.layers
        if arguments.host_layers is not None and arguments.host_layers > layers:
            parser.error(f"--host-layers {arguments.host_layers}: more than the {layers} layers")
        return
    heads, kv_heads, hidden = arguments.heads, arguments.kv_heads, arguments.hidden
    if heads is not None and kv_heads is not None and heads % kv_heads:
        parser.error(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    if heads is not None and hidden is not None and hidden % heads:
        parser.error(f"--hidden {hidden} must be a multiple of --heads {heads}")


def _llama(arguments: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fhelium.residency._demos.llama import CPU_SIZES, GPU_SIZES, run_llama_demo, scaled

    on_gpu = arguments.device == "cuda" or (
        arguments.device == "auto" and torch.cuda.is_available()
    )
    sizes = scaled(
        GPU_SIZES if on_gpu else CPU_SIZES,
        layers=arguments.layers,
        hidden=arguments.hidden,
        intermediate=arguments.intermediate,
        heads=arguments.heads,
        kv_heads=arguments.kv_heads,
        vocab=arguments.vocab,
        dtype=arguments.dtype,
    )
    return run_llama_demo(
        arguments.out,
        sizes=sizes,
        prompt_tokens=16 if arguments.prompt_tokens is None else arguments.prompt_tokens,
        new_tokens=16 if arguments.new_tokens is None else arguments.new_tokens,
        prefetch=1 if arguments.prefetch is None else arguments.prefetch,
        budget_bytes=arguments.budget_mib,
        device=arguments.device,
        cache=arguments.cache,
        h2d_gbps=arguments.h2d_gbps,
        tflops=arguments.tflops,
        hbm_gbps=3350.0 if arguments.hbm_gbps is None else arguments.hbm_gbps,
        quiet=arguments.json,
        progress=True,
    )


def _layers(
    parser: argparse.ArgumentParser, arguments: argparse.Namespace
) -> dict[str, Any] | None:
    from fhelium.residency._demos.layers import run_demo, run_distributed_demo

    layers = 24 if arguments.layers is None else arguments.layers
    passes = 3 if arguments.passes is None else arguments.passes
    if arguments.distributed:
        if arguments.disk is not None:
            parser.error("--disk is not available with --distributed")
        return run_distributed_demo(
            arguments.out,
            layers=layers,
            width=arguments.width,
            batch=arguments.batch,
            passes=passes,
            budget_layers=arguments.budget_layers,
            device=arguments.device,
            cache=arguments.cache,
            h2d_gbps=arguments.h2d_gbps,
            tflops=arguments.tflops,
            quiet=arguments.json,
        )
    return run_demo(
        arguments.out,
        layers=layers,
        width=arguments.width,
        batch=arguments.batch,
        passes=passes,
        budget_layers=8 if arguments.budget_layers is None else arguments.budget_layers,
        device=arguments.device,
        cache=arguments.cache,
        h2d_gbps=arguments.h2d_gbps,
        tflops=arguments.tflops,
        disk=arguments.disk,
        host_layers=arguments.host_layers,
        quiet=arguments.json,
        progress=True,
    )


if __name__ == "__main__":
    sys.exit(main())
