"""`offload` when things go wrong: an interrupt at any step of a forward, a copy failing,
threads sharing the model, a fork (docs/concepts/offload.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from fhelium.errors import ResidencyUnavailableError
from fhelium.residency.nn import offload
from fhelium.residency.simulation import SimulatedRuntime, use_runtime
from helpers.limits import capped_memory

LAYERS = 6
WIDTH = 16


class Tripwire(nn.Module):
    """A linear layer whose forward raises ``error`` on its ``trip``-th call."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.calls = 0
        self.trip = -1
        self.error: BaseException = KeyboardInterrupt()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.trip:
            raise self.error
        return torch.tanh(self.linear(x))


def build() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(*[Tripwire() for _ in range(LAYERS)]).eval()


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def assert_placeholders(model: nn.Module) -> None:
    for parameter in model.parameters():
        with pytest.raises(ResidencyUnavailableError):
            _ = parameter + 0


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize(
    "error", [KeyboardInterrupt(), RuntimeError("boom")], ids=["ctrl-c", "error"]
)
def test_an_interrupt_at_any_step(prefetch: int, error: BaseException) -> None:
    model = build()
    original = weights(model)
    x = torch.randn(3, WIDTH)
    expected = model(x)
    budget = sum(t.numel() * 4 for t in original.values()) // 3
    with use_runtime(SimulatedRuntime(1)):
        off = offload(model, budget=budget, prefetch=prefetch)
        assert torch.equal(model(x), expected)  # recorded
        for step in range(LAYERS):
            layer = model[step]
            layer.error = error
            layer.trip = layer.calls + 1
            with pytest.raises(type(error)):
                model(x)
            layer.trip = -1
            assert_placeholders(model)
            assert off.stats().device_peak_bytes <= budget
            # The next forward is right, and so is the one after it.
            assert torch.equal(model(x), expected)
            assert torch.equal(model(x), expected)
        off.close()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    assert torch.equal(model(x), expected)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError], ids=["ctrl-c", "error"])
def test_a_copy_failing(prefetch: int, error: type[BaseException]) -> None:
    model = build()
    original = weights(model)
    x = torch.randn(3, WIDTH)
    expected = model(x)
    budget = sum(t.numel() * 4 for t in original.values()) // 3
    runtime = SimulatedRuntime(1)
    with use_runtime(runtime):
        off = offload(model, budget=budget, prefetch=prefetch)
        assert torch.equal(model(x), expected)
        for _ in range(3):
            runtime.fail_next("copy_to_cuda", error)
            with pytest.raises(error):
                model(x)
            assert_placeholders(model)
            assert torch.equal(model(x), expected)
        off.close()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, original[name]), name


def test_threads_share_one_offloaded_model() -> None:
    model = build()
    inputs = [torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    expected = [model(x) for x in inputs]
    budget = sum(p.numel() * 4 for p in model.parameters()) // 3
    failures: list[BaseException] = []

    def run(index: int) -> None:
        try:
            with torch.no_grad():
                for _ in range(5):
                    assert torch.equal(model(inputs[index]), expected[index])
        except BaseException as failure:  # reported below
            failures.append(failure)

    with use_runtime(SimulatedRuntime(1)), offload(model, budget=budget) as off:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads), "a forward hung"
        assert not failures, failures
        assert off.stats().forwards == 20
        assert off.stats().device_peak_bytes <= budget


CHILD = textwrap.dedent(
    """
    import json, os, signal, torch
    from torch import nn
    from fhelium.errors import ResidencyForkedError
    from fhelium.residency.nn import offload
    from fhelium.residency.simulation import SimulatedRuntime, use_runtime

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        with use_runtime(SimulatedRuntime(1)):
            off = offload(model, budget=600)
            model(x)
            reader, writer = os.pipe()
            child = os.fork()
            if child == 0:
                signal.alarm(5)
                try:
                    model(x)
                    outcome = "ran"
                except ResidencyForkedError:
                    outcome = "forked"
                except BaseException as error:
                    outcome = f"{type(error).__name__}: {error}"
                os.write(writer, outcome.encode())
                os._exit(0)
            os.close(writer)
            with os.fdopen(reader) as pipe:
                outcome = pipe.read()
            os.waitpid(child, 0)
            again = bool(torch.equal(model(x), expected))
            off.close()
            restored = bool(torch.equal(model(x), expected))
    print(json.dumps({"child": outcome, "again": again, "restored": restored}))
    """
)


def test_a_forked_child_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=capped_memory,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"child": "forked", "again": True, "restored": True}
