"""The distributed demo runs under torchrun on the CPU (docs/concepts/distributed.md#the-demo):
two gloo ranks, each streaming its own partition, the shared weights broadcast from
rank 0 and identical everywhere, every budget held, per-rank files written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fhelium
from helpers.limits import capped_memory


def test_torchrun_runs_the_distributed_demo(tmp_path: Path) -> None:
    out = tmp_path / "out"
    environment = dict(os.environ)
    # The package under test, whichever checkout it comes from.
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(Path(fhelium.__file__).parents[1]), environment.get("PYTHONPATH", "")]
    )
    environment["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "fhelium.residency",
        "demo",
        "--distributed",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--cache",
        str(tmp_path / "cache"),
        "--layers",
        "7",
        "--width",
        "64",
        "--batch",
        "256",
        "--passes",
        "2",
    ]
    finished = subprocess.run(
        command,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        # torchrun and its ranks inherit the cap (a rank maps 3 to 4 GiB).
        preexec_fn=capped_memory,
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    printed = finished.stdout
    assert "2 ranks (gloo)" in printed
    assert "identical on every rank" in printed
    rows = [line.split() for line in printed.splitlines() if line[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1"], printed

    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["backend"] == "gloo"
    assert summary["shared_identical"]
    ranks = summary["ranks"]
    # Each rank streamed its own partition: disjoint, together every layer.
    assert [entry["layers"] for entry in ranks] == [[0, 2, 4, 6], [1, 3, 5]]
    for entry in ranks:
        assert entry["steps"] == 2 * len(entry["layers"])
        assert 0 < entry["peak_bytes"] <= entry["budget_bytes"]
        assert entry["loads"] >= len(entry["layers"]) + 1  # its layers and the shared weights
        assert entry["h2d_bytes"] == entry["loads"] * 64 * 64 * 4
        per_rank = json.loads((out / f"rank-{entry['rank']}" / "summary.json").read_text())
        assert per_rank == entry
        assert (out / f"rank-{entry['rank']}" / "trace.json").stat().st_size > 0
    assert len({entry["shared_sha256"] for entry in ranks}) == 1
