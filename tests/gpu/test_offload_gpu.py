"""`fhelium.residency.nn.offload` on a real GPU (docs/concepts/offload.md): a stack of
layers three times its device budget computes the plain model's outputs exactly, with
each layer's kernels slowed by `torch.cuda._sleep` so that an eviction that did not wait
for the kernels reading a layer, or a copy read before it landed, changes the result.
Plain torch modules only (the GPU machine has no transformers). Skipped without CUDA;
the same rules run in CI on the simulated runtime (tests/nn/)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fhelium.residency.nn import offload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

WIDTH = 1024
LAYERS = 12


class Slow(nn.Module):
    """A linear layer whose kernels start after a device-side sleep."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.cycles = cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cycles and x.is_cuda:
            torch.cuda._sleep(self.cycles)
        return torch.tanh(self.linear(x))


def build(cycles: int) -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(*[Slow(cycles) for _ in range(LAYERS)]).eval()


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("policy", ["schedule-aware", "lru"])
@pytest.mark.parametrize("cycles", [0, 2_000_000], ids=["fast", "slow-kernels"])
def test_outputs_equal_the_plain_model(prefetch: int, policy: str, cycles: int) -> None:
    model = build(cycles)
    original = {name: t.clone() for name, t in model.state_dict().items()}
    x = torch.randn(8, WIDTH)
    with torch.no_grad():
        reference = copy.deepcopy(model).cuda()
        expected = reference(x.cuda())
        torch.cuda.synchronize()
        del reference
        weights = sum(t.numel() * t.element_size() for t in original.values())
        budget = weights // 3
        with offload(
            model, device="cuda:0", budget=budget, prefetch=prefetch, policy=policy
        ) as off:
            for _ in range(4):
                out = model(x)  # inputs are moved to the device
                assert out.is_cuda
                assert torch.equal(out, expected)
            stats = off.stats()
            assert stats.device_peak_bytes <= budget
            assert stats.h2d_bytes > weights
            assert stats.d2h_bytes == 0
        torch.cuda.synchronize()
    for name, tensor in model.state_dict().items():
        assert tensor.device.type == "cpu"
        assert torch.equal(tensor, original[name]), name


def test_whole_model_fits_stays_resident() -> None:
    model = build(0)
    x = torch.randn(8, WIDTH)
    with torch.no_grad():
        expected = copy.deepcopy(model).cuda()(x.cuda())
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        with offload(model, device="cuda:0", budget=2 * weights) as off:
            assert torch.equal(model(x), expected)
            loaded = off.stats().h2d_bytes
            for _ in range(3):
                assert torch.equal(model(x), expected)
            assert off.stats().h2d_bytes == loaded
