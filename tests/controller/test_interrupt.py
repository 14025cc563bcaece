"""A long controller search stays interruptible: SIGINT during `decide` raises
KeyboardInterrupt promptly instead of running to the state limit."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

SCRIPT = r"""
import sys, time, torch
from fhelium.residency import *
from fhelium.residency._runtime import SimulatedRuntime, use_runtime
from fhelium.values import ResidentTensor

C0, C1 = cuda_location("cuda:0"), cuda_location("cuda:1")
runtime = SimulatedRuntime(device_count=2)
with use_runtime(runtime):
    manager = ResidencyManager({C0: 16, C1: 16})
    manager.adopt(runtime.to_device(ResidentTensor(torch.zeros(4)), "cuda:0"), at=C0)
    y = manager.adopt(ResidentTensor(torch.zeros(4)))
    z = manager.adopt(ResidentTensor(torch.zeros(4)))
    # Two tiers pointing at each other: the search cycles until its limit.
    controller = ResidencyController(
        manager,
        policy=DeterministicTieredLRU({C0: [C1], C1: [C0]}),
        search_state_limit=10**12,
    )
    request = ResidencyRequest(
        "cycle", [ResidencyRequirement(y, C0), ResidencyRequirement(z, C1)]
    )
    print("searching", flush=True)
    started = time.monotonic()
    try:
        controller.decide(request)
    except KeyboardInterrupt:
        print(f"interrupted after {time.monotonic() - started:.1f}s", flush=True)
        sys.exit(0)
    print("not interrupted", flush=True)
    sys.exit(1)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_interrupts_a_long_search() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "searching"
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, (stdout, stderr[-2000:])
    assert "interrupted after" in stdout
