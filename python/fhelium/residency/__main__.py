"""`python -m fhelium.residency demo`: the main job, from the command line.

``demo`` (or ``demo llama``) generates tokens from a Llama model whose weights are three
times the device budget, through `fhelium.residency.nn.offload`, four ways
(`fhelium.residency._demos.llama`). ``demo layers`` streams layer weights through a
bounded device with the controller, three ways, optionally spilling to disk or
partitioned across ranks under torchrun (`fhelium.residency._demos.layers`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fhelium-residency", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="a Llama model larger than its device budget, generating through offload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "workload",
        nargs="?",
        choices=("llama", "layers"),
        default=None,
        help="llama (the default; `layers` with --distributed)",
    )
    demo.add_argument("--out", type=Path, default=Path("residency-demo"), help="output folder")
    demo.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    demo.add_argument(
        "--cache", type=Path, default=None, help="where the checkpoint or the layer files live"
    )
    demo.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (llama; default 24 on a GPU, 8 on the CPU) or layer weights "
        "(layers; default 24)",
    )
    demo.add_argument(
        "--h2d-gbps", type=float, default=55.0, help="CPU only: the model's copy bandwidth"
    )
    demo.add_argument(
        "--tflops", type=float, default=60.0, help="CPU only: the model's compute rate"
    )
    llama = demo.add_argument_group("llama")
    llama.add_argument("--hidden", type=int, default=None, help="hidden size")
    llama.add_argument("--intermediate", type=int, default=None, help="MLP size")
    llama.add_argument("--heads", type=int, default=None, help="attention heads")
    llama.add_argument("--kv-heads", type=int, default=None, help="key/value heads")
    llama.add_argument("--vocab", type=int, default=None, help="vocabulary size")
    llama.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        default=None,
        help="the weights' dtype (default float16 on a GPU, float32 on the CPU)",
    )
    llama.add_argument("--prompt-tokens", type=int, default=None, help="default 16")
    llama.add_argument("--new-tokens", type=int, default=None, help="default 16")
    llama.add_argument("--prefetch", type=int, default=None, help="default 1")
    llama.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="the lru and schedule-aware runs' device budget (default a third of the weights)",
    )
    llama.add_argument(
        "--hbm-gbps",
        type=float,
        default=None,
        help="CPU only: the rate at which compute reads weights (default 3350)",
    )
    layers = demo.add_argument_group("layers")
    layers.add_argument("--passes", type=int, default=None, help="default 3")
    layers.add_argument(
        "--budget-layers",
        type=int,
        default=None,
        help="layers the budget holds (default 8; with --distributed a third of a rank's)",
    )
    layers.add_argument("--width", type=int, default=None, help="layers are width x width")
    layers.add_argument("--batch", type=int, default=None, help="activation rows")
    layers.add_argument(
        "--disk", type=Path, default=None, help="keep the layers past --host-layers on disk here"
    )
    layers.add_argument(
        "--host-layers", type=int, default=None, help="with --disk: layers the pinned host holds"
    )
    layers.add_argument(
        "--distributed",
        action="store_true",
        help="under torchrun: each rank streams its own partition, rank 0 broadcasts the "
        "shared weights (NCCL on GPUs, gloo on the CPU)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
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
    if workload == "layers":
        return _layers(parser, arguments)
    try:
        return _llama(arguments)
    except ImportError as error:  # transformers is missing: say what to install
        print(f"fhelium-residency demo: {error}", file=sys.stderr)
        return 1


def _llama(arguments: argparse.Namespace) -> int:
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
    budget = None if arguments.budget_mib is None else round(arguments.budget_mib * (1 << 20))
    run_llama_demo(
        arguments.out,
        sizes=sizes,
        prompt_tokens=16 if arguments.prompt_tokens is None else arguments.prompt_tokens,
        new_tokens=16 if arguments.new_tokens is None else arguments.new_tokens,
        prefetch=1 if arguments.prefetch is None else arguments.prefetch,
        budget_bytes=budget,
        device=arguments.device,
        cache=arguments.cache,
        h2d_gbps=arguments.h2d_gbps,
        tflops=arguments.tflops,
        hbm_gbps=3350.0 if arguments.hbm_gbps is None else arguments.hbm_gbps,
    )
    return 0


def _layers(parser: argparse.ArgumentParser, arguments: argparse.Namespace) -> int:
    from fhelium.residency._demos.layers import run_demo, run_distributed_demo

    layers = 24 if arguments.layers is None else arguments.layers
    passes = 3 if arguments.passes is None else arguments.passes
    if arguments.distributed:
        if arguments.disk is not None:
            parser.error("--disk is not available with --distributed")
        run_distributed_demo(
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
        )
        return 0
    run_demo(
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
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
