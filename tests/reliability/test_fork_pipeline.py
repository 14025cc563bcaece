"""A pipeline belongs to the process that made it (docs/concepts/lifetimes.md#fork).

A process forked in the middle of a `controller.run` loop, with a step active and the
next one staged (its copy issued, its values held), gets a copy of the pipeline. If the
fork advances it, the manager refuses that with `ResidencyForkedError`, and nothing the
parent holds changes. The parent then finishes its loop: every step reads its own
layer's bytes, and once the loop ends nothing is held, leased or reserved.

The parent runs in a child interpreter, with its memory capped, and it forks there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from helpers.limits import capped_memory

SCRIPT = textwrap.dedent(
    """
    import json, os
    import torch
    from fhelium.residency import (
        PINNED_HOST, ReplicaMode, ResidencyController, ResidencyManager, ResidencyRequest,
        ResidencyRequirement, cuda_location,
    )
    from fhelium.residency.simulation import SimulatedRuntime, use_runtime
    from fhelium.values import ResidentTensor

    CUDA = cuda_location("cuda:0")
    runtime = SimulatedRuntime(1, auto_complete=True)
    stream = runtime.current_stream(torch.device("cuda", 0))
    with use_runtime(runtime):
        manager = ResidencyManager({CUDA: 3 * 32, PINNED_HOST: 6 * 32})
    layers = [
        manager.adopt(
            runtime.pin(ResidentTensor(torch.full((8,), float(layer)))),
            at=PINNED_HOST,
            replica_mode=ReplicaMode.REPLICABLE,
        )
        for layer in range(6)
    ]
    requests = [
        ResidencyRequest(f"step-{step}", [ResidencyRequirement(layers[step % 6], CUDA)])
        for step in range(12)
    ]
    controller = ResidencyController(manager)
    seen, child = [], None
    with controller.run(requests, prefetch=1, consumer_streams={CUDA: stream}) as steps:
        for position, step in enumerate(steps):
            value = step.value(step.request.requirements[0].handle, at=CUDA)
            seen.append(float(value.tensor[0]))
            if position == 3:
                reader, writer = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(reader)
                    try:
                        next(steps)
                        outcome = "advanced"
                    except Exception as error:
                        outcome = type(error).__name__
                    with os.fdopen(writer, "w") as pipe:
                        pipe.write(outcome)
                    os._exit(0)
                os.close(writer)
                with os.fdopen(reader) as pipe:
                    child = pipe.read()
                _, status = os.waitpid(pid, 0)
    held = [
        (location.hold_count, location.use_count, location.reservation_count)
        for location in manager.snapshot().locations
    ]
    manager.close()
    print(json.dumps({"child": child, "status": status, "seen": seen, "held": held}))
    """
)


def test_a_fork_cannot_advance_the_parents_pipeline() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=capped_memory,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "Traceback" not in completed.stderr, completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["child"] == "ResidencyForkedError"
    assert result["status"] == 0
    # Every step read its own layer, the fork's attempt notwithstanding.
    assert result["seen"] == [float(step % 6) for step in range(12)]
    assert all(counts == [0, 0, 0] for counts in result["held"]), result["held"]
