"""The command line behaves (`python -m fhelium.residency`, the `fhelium-residency`
script): every option has help text that shows its default; an invalid value ends with
a one-line usage error and exit status 2, never a traceback; long work shows a progress
bar on a terminal and nothing elsewhere; ``--json`` prints the summary."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.helpers.limits import capped

import fhelium
from fhelium.residency.__main__ import build_parser, main
from fhelium.residency._demos._progress import Progress
from fhelium.residency.sizes import format_size

ROOT = Path(__file__).resolve().parents[2]

# A layer demo that takes a second: 6 layers of 32 x 32, two passes.
TINY_LAYERS = [
    "demo",
    "layers",
    "--layers",
    "6",
    "--width",
    "32",
    "--batch",
    "64",
    "--passes",
    "2",
    "--budget-layers",
    "2",
    "--device",
    "cpu",
]


def _options(parser: Any) -> list[Any]:
    """Every option of the parser and of its subcommands' parsers."""
    found = []
    for action in parser._actions:
        if action.option_strings and "-h" not in action.option_strings:
            found.append((parser.prog, action))
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict):
            for sub in choices.values():
                found.extend(_options(sub))
    return found


def test_every_option_has_help_that_shows_its_default() -> None:
    parser = build_parser()
    options = _options(parser)
    assert len(options) >= 20  # demo's options were found
    for prog, action in options:
        assert action.help, f"{prog} {action.option_strings[0]} has no help text"
    demo = build_parser()._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr]
    text = demo.format_help()
    # Each option's help (the text from its flag to the next option) names its default.
    blocks = text.split("\n  --")[1:]
    assert len(blocks) >= 20
    for block in blocks:
        assert "default" in " ".join(block.split()), f"--{block.splitlines()[0]}: no default"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["demo", "--layers", "0"], "--layers: must be >= 1"),
        (["demo", "--layers", "many"], "not a whole number"),
        (["demo", "--new-tokens", "-3"], "--new-tokens: must be >= 1"),
        (["demo", "--prefetch", "-1"], "--prefetch: must be >= 0"),
        (["demo", "--h2d-gbps", "0"], "must be a positive number"),
        (["demo", "--tflops", "nan"], "must be a positive number"),
        (["demo", "--budget-mib", "12QB"], "unknown unit"),
        (["demo", "--budget-mib", "0"], "more than 0 bytes"),
        (["demo", "--heads", "3", "--kv-heads", "2"], "multiple of --kv-heads"),
        (["demo", "--hidden", "30", "--heads", "4"], "multiple of --heads"),
        (["demo", "layers", "--budget-layers", "1"], "--budget-layers: must be >= 2"),
        (["demo", "layers", "--host-layers", "3"], "--host-layers needs --disk"),
        (["demo", "layers", "--hidden", "32"], "an option of `demo llama`"),
        (["demo", "--width", "32"], "an option of `demo layers`"),
        (["demo", "--bogus"], "unrecognized arguments"),
        ([], "required"),
    ],
)
def test_an_invalid_value_is_a_one_line_usage_error(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert says in lines[0]
    assert lines[0].startswith("fhelium-residency")
    assert "--help" in lines[0]  # where to look next


def test_a_file_where_the_output_folder_goes_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "taken").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main([*TINY_LAYERS, "--out", str(tmp_path / "taken")])
    assert exit_.value.code == 2
    assert "a file is there, not a folder" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_points_at_the_simulated_runtime(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--device", "cuda"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "--device cpu" in err
    assert "simulated runtime" in err


def test_the_module_exits_2_without_a_traceback(tmp_path: Path) -> None:
    """As a user runs it: a new process, its address space capped."""
    done = subprocess.run(
        capped([sys.executable, "-m", "fhelium.residency", "demo", "--layers", "0"]),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        # The fhelium this test imported (an installed wheel in CI, the tree here).
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(Path(fhelium.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
            ),
        },
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "fhelium-residency demo: error: argument --layers: must be >= 1, got 0 "
        "(see fhelium-residency demo --help)"
    ]
    assert not (tmp_path / "residency-demo").exists()  # nothing ran


def test_json_prints_the_summary_and_no_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*TINY_LAYERS, "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "c")]
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out)  # the whole of standard output is the JSON
    assert set(summary["runs"]) == {"lru", "schedule-aware", "schedule-aware + prefetch"}
    assert summary["layers"] == 6
    assert summary["passes"] == 2
    assert summary["layer_bytes"] == 32 * 32 * 4
    assert set(summary) >= {"runs", "budget_bytes", "fewest_loads", "trace"}
    assert Path(summary["trace"]).exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_drawn_on_a_terminal_and_silent_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*TINY_LAYERS, "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "c")]
    # Not a terminal (pytest's captured stream): no bar.
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err
    assert "[" not in captured.err
    # The header reads in human units: 6 layers of 4 KiB, 24 KiB of weights.
    assert f"6 layers of {format_size(32 * 32 * 4)} ({format_size(6 * 32 * 32 * 4)}" in (
        captured.out
    )
    assert "4 KiB" in captured.out
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(argv) == 0
    drawn = terminal.getvalue()
    # Three runs of 12 steps: the bar reaches 36/36 and ends its line.
    assert "\r" in drawn
    assert "36/36" in drawn
    assert "demo layers: schedule-aware + prefetch" in drawn
    assert drawn.endswith("\n")


def test_progress_counts_and_clamps() -> None:
    terminal = _Terminal()
    with Progress(4, "work", stream=terminal) as bar:
        bar.advance()
        bar.advance(10, "more")  # clamped at the total
        assert bar.done == 4
    drawn = terminal.getvalue()
    assert "more [" in drawn
    assert "4/4" in drawn
    assert drawn.endswith("\n")
    quiet = _Terminal()
    with Progress(4, "work", enabled=False, stream=quiet) as bar:
        bar.advance(4)
    assert quiet.getvalue() == ""
