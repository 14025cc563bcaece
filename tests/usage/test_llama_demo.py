"""The main job, `python -m fhelium.residency demo`, runs end to end on the CPU (simulated
cuda:0 with the timeline model), at tiny sizes: a random-weight Llama written once as a
sharded checkpoint, generating through `offload` four ways, and the table's invariants
hold (same tokens, budgets held, the schedule-aware policy moving no more than the LRU,
the Accelerate-like run moving the whole model per token)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from fhelium.residency.__main__ import main
from fhelium.residency._demos.llama import LlamaSizes, run_llama_demo

TINY = LlamaSizes(
    layers=8, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256, dtype="float32"
)
TINY_FLAGS = [
    "--layers",
    "8",
    "--hidden",
    "64",
    "--intermediate",
    "128",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--vocab",
    "256",
    "--prompt-tokens",
    "5",
    "--new-tokens",
    "2",
]
NEW_TOKENS = 4
RUNS = ["resident", "every unit, every token", "lru", "schedule-aware"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo-cache")


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> dict[str, Any]:
    return run_llama_demo(
        tmp_path_factory.mktemp("demo") / "out",
        sizes=TINY,
        prompt_tokens=5,
        new_tokens=NEW_TOKENS,
        device="cpu",
        cache=cache,
        quiet=True,
    )


def test_four_runs_generate_the_same_tokens_as_the_plain_model(summary: dict[str, Any]) -> None:
    runs = summary["runs"]
    assert list(runs) == RUNS
    assert summary["time"] == "predicted (timeline model)"
    tokens = {tuple(figures["tokens"]) for figures in runs.values()}
    assert len(tokens) == 1
    (generated,) = tokens
    assert len(generated) == NEW_TOKENS
    # The plain model, loaded from the same checkpoint by transformers, agrees.
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(summary["checkpoint"]).eval()
    prompt = torch.randint(
        0, TINY.vocab, (1, 5), generator=torch.Generator().manual_seed(1235)
    )  # the demo's prompt (seed SEED + 1)
    with torch.inference_mode():
        plain = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    assert tuple(plain[0, 5:].tolist()) == generated


def test_every_budget_holds_and_the_budgets_are_as_labelled(summary: dict[str, Any]) -> None:
    runs = summary["runs"]
    weights, units = summary["weights_bytes"], summary["unit_bytes"]
    assert weights == sum(units)
    assert runs["resident"]["budget_bytes"] == weights
    assert runs["every unit, every token"]["budget_bytes"] == max(units)
    assert runs["lru"]["budget_bytes"] == runs["schedule-aware"]["budget_bytes"] == weights // 3
    for name, figures in runs.items():
        assert 0 < figures["device_peak_bytes"] <= figures["budget_bytes"], name
        assert figures["host_peak_bytes"] >= weights, name  # the pinned host holds them all


def test_bytes_per_token(summary: dict[str, Any]) -> None:
    runs = summary["runs"]
    weights = summary["weights_bytes"]
    for figures in runs.values():
        assert figures["forwards"] == NEW_TOKENS  # one forward per generated token
        assert figures["h2d_bytes_per_token"] == figures["h2d_bytes"] / NEW_TOKENS
    # Everything stayed resident after the warm-up: nothing moves.
    assert runs["resident"]["h2d_bytes"] == 0
    # What Accelerate's hooks do: the whole model, every token.
    assert runs["every unit, every token"]["h2d_bytes"] == NEW_TOKENS * weights
    # The schedule-aware policy keeps what is needed soonest: it moves no more than the
    # LRU at the same budget and prefetch.
    assert runs["schedule-aware"]["h2d_bytes"] <= runs["lru"]["h2d_bytes"]


def test_predicted_times(summary: dict[str, Any]) -> None:
    runs = summary["runs"]
    for name, figures in runs.items():
        assert figures["seconds"] > 0, name
        assert figures["tokens_per_s"] == pytest.approx(NEW_TOKENS / figures["seconds"])
        # The copy time not hidden: the makespan less the compute engine's busy time.
        exposed = figures["seconds"] - figures["compute_seconds"]
        assert figures["exposed_copy_seconds"] == pytest.approx(exposed)
        assert figures["exposed_copy_seconds"] >= -1e-12, name
    assert runs["resident"]["exposed_copy_seconds"] == pytest.approx(0.0, abs=1e-12)
    # Moving the whole model per token cannot be faster than keeping it resident.
    assert runs["every unit, every token"]["tokens_per_s"] < runs["resident"]["tokens_per_s"]
    assert runs["schedule-aware"]["tokens_per_s"] >= runs["lru"]["tokens_per_s"]


def test_the_residency_map_and_the_timeline_are_what_ran(summary: dict[str, Any]) -> None:
    """The picture's data: per unit step, the unit stepped and the units on the device as
    it began; per run, the timeline's copy and compute spans, with compute waiting for
    copies only where weights move."""
    from fhelium.residency._demos.llama import _stalls

    units = summary["unit_names"]
    assert "lm_head" in units
    for name, run in summary["runs"].items():
        steps = run["residency"]
        assert len(steps) == run["steps"] > 0, name
        for stepped, *resident in steps:
            assert 0 <= stepped < len(units)
            assert resident == sorted(set(resident))
        engines = {engine for engine, _, _ in run["spans"]}
        assert "compute" in engines
        waited = sum(end - start for start, end in _stalls(run["spans"]))
        if name == "resident":
            # Everything stays on the device: every unit, at every step; no copy waited on.
            assert all(len(resident) == len(units) for _, *resident in steps)
            assert "h2d" not in engines
            assert waited == 0.0
        else:
            assert "h2d" in engines
            assert waited > 0.0
            # The copy time not hidden behind compute includes at least those waits.
            assert run["exposed_copy_seconds"] >= waited * 0.999
    # Loaded at its step, every step: with a budget of one unit and no prefetch, the
    # unit stepped is never on the device before its step (a unit used twice in a row
    # excepted).
    every = summary["runs"]["every unit, every token"]["residency"]
    misses = [stepped not in resident for stepped, *resident in every]
    assert sum(misses) >= len(every) - summary["new_tokens"]


def test_the_checkpoint_is_sharded(summary: dict[str, Any]) -> None:
    folder = Path(summary["checkpoint"])
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == summary["shards"] >= 2
    assert summary["written"]


def test_the_summary_and_the_plot_are_written(summary: dict[str, Any]) -> None:
    assert Path(summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads((Path(summary["plot"]).parent / "summary.json").read_text())
    assert (
        written["runs"]["schedule-aware"]["h2d_bytes"]
        == (summary["runs"]["schedule-aware"]["h2d_bytes"])
    )


def test_command_line_prints_the_table_and_reuses_the_checkpoint(
    summary: dict[str, Any], tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = Path(summary["checkpoint"])
    before = {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}
    flags = ["--device", "cpu", "--out", str(tmp_path), "--cache", str(cache)]
    assert main(["demo", *flags, *TINY_FLAGS]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"checkpoint: {folder} (") and "reused" in line for line in lines)
    assert {path.name: path.stat().st_mtime_ns for path in folder.iterdir()} == before
    header = next(line for line in lines if line.startswith("run "))
    assert "tok/s (pred.)" in header
    for name in RUNS:
        assert any(line.startswith(f"{name} ") for line in lines), name
    assert "tokens: the same in every run." in lines
    assert any("predicted (timeline model)" in line for line in lines)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_and_a_progress_bar_per_token(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    flags = ["--device", "cpu", "--out", str(tmp_path), "--cache", str(cache), "--json"]
    assert main(["demo", *flags, *TINY_FLAGS]) == 0
    summary = json.loads(capsys.readouterr().out)  # standard output is only the JSON
    assert list(summary["runs"]) == RUNS
    assert all(run["new_tokens"] == 2 for run in summary["runs"].values())
    # Four runs of one recorded forward and two new tokens each.
    drawn = terminal.getvalue()
    assert "12/12" in drawn
    assert "demo llama: schedule-aware" in drawn
    assert drawn.endswith("\n")


def test_a_budget_smaller_than_a_unit_is_a_usage_error(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--device", "cpu", "--out", str(tmp_path), "--cache", str(cache)]
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *flags, *TINY_FLAGS, "--budget-mib", "1KiB"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "smaller than the largest unit" in err
    assert "1 KiB (1024 bytes)" in err


def test_the_layer_options_belong_to_the_layer_demo(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--width", "32"])
    assert "`demo layers`" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "layers", "--hidden", "32"])
    assert "`demo llama`" in capsys.readouterr().err


def test_without_transformers_the_demo_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    assert main(["demo", "--device", "cpu", "--out", str(tmp_path), "--cache", str(tmp_path)]) == 1
    error = capsys.readouterr().err
    assert "transformers" in error
    assert "pip install" in error


def test_a_budget_smaller_than_a_unit_is_refused(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(ValueError, match="largest unit"):
        run_llama_demo(
            tmp_path,
            sizes=TINY,
            budget_bytes=1024,
            device="cpu",
            cache=cache,
            quiet=True,
        )
