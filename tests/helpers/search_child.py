"""A child process that runs long controller searches, for the interrupt and memory tests.

Run as ``python search_child.py SHAPE LIMIT HEADROOM [ROUNDS]``:

* ``SHAPE`` ``deep``: two tiers pointing at each other, so the search moves one value back
  and forth, one level deeper per state, until a bound stops it
  (docs/concepts/controller.md#consequences);
* ``SHAPE`` ``wide``: an infeasible request over 40 droppable values, so the search visits
  subsets of them (about 2**40 states) at a depth of at most 40, remembering each exhausted
  one, until a bound stops it;
* ``SHAPE`` ``wide-python``: the same through a subclass of the built-in policy, which the
  controller consults through Python;
* ``SHAPE`` ``heavy``: the wide search with 3000 more requirements that hold already, so
  that each state takes about a millisecond to simulate;
* ``LIMIT``: the controller's ``search_state_limit``;
* ``HEADROOM``: bytes of address space the child may add to what it holds once the manager
  is set up (`RLIMIT_AS`), or 0 for the default cap of `helpers.limits`;
* ``ROUNDS``: how many times to decide the request (default 1).

Each round prints ``searching``, then one line: ``interrupted <time.monotonic()>`` at
`KeyboardInterrupt`, ``limit <explored_states> <bound>`` at `ResidencySearchLimitError`,
``memoryerror`` at `MemoryError`, or ``decided``. Then the child prints ``grown <bytes>``,
how much its peak resident memory (`ru_maxrss`) grew while searching.
"""

from __future__ import annotations

import resource
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.limits import address_space, cap_address_space
from helpers.manager import Source, fresh, spec


def main() -> None:
    shape, limit, headroom = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    # A test run started in the background of a shell without job control inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt handler: put it back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch

    from fhelium.errors import ResidencySearchLimitError
    from fhelium.residency import (
        PAGEABLE_HOST,
        DeterministicTieredLRU,
        ResidencyController,
        ResidencyManager,
        ResidencyRequest,
        ResidencyRequirement,
        cuda_location,
    )
    from fhelium.residency._runtime import SimulatedRuntime, use_runtime
    from fhelium.values import ResidentTensor

    cuda0, cuda1 = cuda_location("cuda:0"), cuda_location("cuda:1")
    runtime = SimulatedRuntime(device_count=2)
    with use_runtime(runtime):
        if shape == "deep":
            manager = ResidencyManager({cuda0: 16, cuda1: 16})
            on_device = runtime.to_device(ResidentTensor(torch.zeros(4)), "cuda:0")
            manager.adopt(on_device, at=cuda0)
            wanted = [(manager.adopt(ResidentTensor(torch.zeros(4))), cuda0)]
            wanted.append((manager.adopt(ResidentTensor(torch.zeros(4))), cuda1))
            policy = DeterministicTieredLRU({cuda0: [cuda1], cuda1: [cuda0]})
        else:  # "wide", or "wide-python" through a policy subclass (the Python policy path)
            count = 40
            manager = ResidencyManager({cuda0: 4 * count})
            for _ in range(count):
                # One float32 with a source, materialised at cuda:0: each can be dropped.
                handle = manager.register_source(spec(1), Source(fresh(1)))
                manager.ensure(handle, cuda0)
            too_big = manager.register_source(spec(count + 1), Source(fresh(count + 1)))
            wanted = []
            if shape == "heavy":
                # 3000 values the request needs where they are: nothing to do for them, but
                # every state's simulation reads them.
                for _ in range(3000):
                    wanted.append((manager.adopt(ResidentTensor(torch.zeros(1))), PAGEABLE_HOST))
            wanted.append((too_big, cuda0))
            policy = DeterministicTieredLRU() if shape != "wide-python" else _subclass()()
        controller = ResidencyController(manager, policy=policy, search_state_limit=limit)
        request = ResidencyRequest(
            shape, [ResidencyRequirement(handle, location) for handle, location in wanted]
        )
        if headroom:
            cap_address_space(address_space() + headroom)
        else:
            cap_address_space()
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(rounds):
            print("searching", flush=True)
            try:
                controller.decide(request)
                print("decided", flush=True)
            except KeyboardInterrupt:
                print(f"interrupted {time.monotonic()!r}", flush=True)
            except ResidencySearchLimitError as error:
                print(f"limit {error.explored_states} {error.bound}", flush=True)
            except MemoryError:
                print("memoryerror", flush=True)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
        print(f"grown {grown * 1024}", flush=True)


def _subclass() -> type:
    from fhelium.residency import DeterministicTieredLRU

    class Subclass(DeterministicTieredLRU):
        """The built-in order, reached through `order_candidates` from the core."""

    return Subclass


if __name__ == "__main__":
    main()
