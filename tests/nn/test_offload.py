"""`fhelium.residency.nn.offload` on plain PyTorch modules, on the simulated runtime
(docs/concepts/offload.md). Real model code (transformers) is in test_models.py."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fhelium.errors import ResidencyBudgetError, ResidencyUnavailableError
from fhelium.residency.nn import Offload, offload
from fhelium.residency.simulation import SimulatedRuntime, use_runtime

POLICIES = ["schedule-aware", "lru"]


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


@pytest.fixture(params=[True, False], ids=["events-complete", "events-pending"])
def runtime(request: pytest.FixtureRequest) -> Iterator[SimulatedRuntime]:
    simulated = SimulatedRuntime(1, auto_complete=request.param)
    with use_runtime(simulated):
        yield simulated


def weights_nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def mlp(layers: int = 8, width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    ).eval()


class Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 10)
        self.norm.running_mean.uniform_(-0.5, 0.5)
        self.norm.running_var.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.conv(x)))
        x = torch.relu(self.conv2(x))
        return self.head(x.flatten(1))


class Tied(nn.Module):
    """An embedding and a head that share one weight (as GPT-2's LM head does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(64, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.embed(ids))))


class WithTable(nn.Module):
    """A linear layer and a non-persistent buffer (as rotary ``inv_freq`` is)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("table", torch.arange(8.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.table


class Switch(nn.Module):
    """Runs its layers forward or backward: the order a forward takes depends on input."""

    def __init__(self, layers: int = 6, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        order = reversed(self.layers) if reverse else self.layers
        for layer in order:
            x = torch.tanh(layer(x))
        return x


def test_default_units_are_the_modules_that_own_tensors(runtime: SimulatedRuntime) -> None:
    model = mlp(4)
    with offload(model, budget=1 << 20) as off:
        assert [unit.name for unit in off.units] == [f"{i}.0" for i in range(4)]
        assert all(len(unit.handles) == 1 for unit in off.units)
        assert off.units[0].nbytes == 32 * 32 * 4 + 32 * 4


def test_an_owner_takes_its_whole_subtree(runtime: SimulatedRuntime) -> None:
    # MultiheadAttention owns in_proj_weight and reads out_proj.weight without calling
    # out_proj: one unit for both.
    attention = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(1, 4, 16)
    expected = attention(x, x, x)[0]
    with offload(attention, budget=1 << 20) as off:
        assert [unit.name for unit in off.units] == ["<root>"]
        assert torch.equal(attention(x, x, x)[0], expected)


def test_units_by_class_and_predicate(runtime: SimulatedRuntime) -> None:
    model = mlp(4)
    with offload(model, budget=1 << 20, units=nn.Sequential) as off:
        # The root is a Sequential too: the outermost match wins.
        assert [unit.name for unit in off.units] == ["<root>"]
    with offload(model, budget=1 << 20, units=lambda name, m: name.count(".") == 0 and name != ""):
        pass
    with offload(model, budget=1 << 20, units=lambda name, m: name in ("0", "1")) as off:
        # Blocks 0 and 1 are units; the layers left over follow the default rule.
        assert [unit.name for unit in off.units] == ["0", "1", "2.0", "3.0"]
    # A predicate of one argument is given the module.
    with offload(model, budget=1 << 20, units=lambda m: m is model[2]) as off:
        assert [unit.name for unit in off.units] == ["0.0", "1.0", "2", "3.0"]
    with pytest.raises(TypeError, match="units"):
        offload(model, budget=1 << 20, units=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bool"):
        offload(model, budget=1 << 20, units=lambda m: "yes")


def test_tied_weights_are_one_value(runtime: SimulatedRuntime) -> None:
    model = Tied().eval()
    ids = torch.randint(0, 64, (2, 5))
    expected = model(ids)
    with offload(model, budget=1 << 20, prefetch=0) as off:
        by_name = {unit.name: unit for unit in off.units}
        shared = set(by_name["embed"].handles) & set(by_name["head"].handles)
        assert len(shared) == 1
        assert torch.equal(model(ids), expected)
        values = off.manager.snapshot().values
        assert len(values) == 2  # the shared weight and the body: the head owns nothing else
    assert model.head.weight is model.embed.weight
    assert torch.equal(model(ids), expected)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_outputs_equal_under_a_third_of_the_weights(
    runtime: SimulatedRuntime, policy: str, prefetch: int
) -> None:
    model = mlp(9)
    x = torch.randn(3, 32)
    expected = model(x)
    total = weights_nbytes(model)
    budget = total // 3
    with offload(model, budget=budget, prefetch=prefetch, policy=policy) as off:  # type: ignore[arg-type]
        for _ in range(4):
            assert torch.equal(model(x), expected)
        stats = off.stats()
        assert stats.forwards == 4
        assert stats.steps == 36
        assert stats.device_peak_bytes <= budget
        assert stats.h2d_bytes > total  # it had to stream
        assert stats.d2h_bytes == 0  # device copies are replicas: eviction drops them


def test_cnn_with_buffers(runtime: SimulatedRuntime) -> None:
    model = Cnn().eval()
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    with offload(model, budget=weights_nbytes(model) * 7 // 8) as off:
        assert torch.equal(model(x), expected)
        assert torch.equal(model(x), expected)
        assert "norm" in [unit.name for unit in off.units]
    assert torch.equal(model(x), expected)


def test_placeholders_outside_the_forward(runtime: SimulatedRuntime) -> None:
    model = mlp(2)
    with offload(model, budget=1 << 20) as off:
        weight = model[0][0].weight
        assert isinstance(weight, nn.Parameter)
        assert weight.shape == (32, 32)
        assert weight.dtype == torch.float32
        assert "0.0.weight" in repr(weight)
        with pytest.raises(ResidencyUnavailableError, match=r"0\.0\.weight is offloaded"):
            _ = weight + 1
        with pytest.raises(ResidencyUnavailableError, match="materialize"):
            torch.matmul(torch.ones(1, 32), weight)
        with off.materialize(model[0]) as block:
            assert block is model[0]
            assert torch.equal(model[0][0].weight, mlp(2)[0][0].weight)
        with pytest.raises(ResidencyUnavailableError):
            _ = model[0][0].weight.sum()
        with pytest.raises(ValueError, match="not part"), off.materialize(nn.Linear(2, 2)):
            pass


def test_close_puts_the_module_back(runtime: SimulatedRuntime) -> None:
    model = mlp(3)
    original = {name: t.clone() for name, t in model.state_dict().items()}
    x = torch.randn(2, 32)
    expected = model(x)
    off = offload(model, budget=weights_nbytes(model) // 2)
    assert torch.equal(model(x), expected)
    manager = off.manager
    off.close()
    off.close()  # idempotent
    for name, tensor in model.state_dict().items():
        assert tensor.device.type == "cpu"
        assert torch.equal(tensor, original[name]), name
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())  # as they were
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert engine_closed(manager)
    assert torch.equal(model(x), expected)


def engine_closed(manager: object) -> bool:
    from fhelium.residency.manager import engine_of

    return bool(engine_of(manager).core.closed)  # type: ignore[arg-type]


def test_wrapped_forwards_keep_their_signatures(runtime: SimulatedRuntime) -> None:
    # Model code reads a forward's signature: transformers' `generate` builds
    # `position_ids` only for a forward that takes them, so a wrapper that hid it would
    # change the model's computation.
    model = Switch()
    units = list(model.layers)
    before = inspect.signature(model.forward)
    with offload(model, budget=weights_nbytes(model) // 2):
        assert inspect.signature(model.forward) == before
        assert "reverse" in inspect.signature(model.forward).parameters
        for layer in units:
            assert inspect.signature(layer.forward) == inspect.signature(nn.Linear(2, 2).forward)
        x = torch.randn(2, 16)
        assert torch.equal(model(x, reverse=True), model(x, reverse=True))
    assert inspect.signature(model.forward) == before


def test_inference_only(runtime: SimulatedRuntime) -> None:
    model = mlp(1)
    with torch.enable_grad(), pytest.raises(ValueError, match="no_grad"):
        offload(model, budget=1 << 20)
    assert isinstance(model[0][0].weight, nn.Parameter)
    assert model[0][0].weight.device.type == "cpu"


def test_argument_errors(runtime: SimulatedRuntime) -> None:
    model = mlp(1)
    with pytest.raises(TypeError, match="budget"):
        offload(model)
    with pytest.raises(ValueError, match="CUDA"):
        offload(model, device="cpu", budget=1)
    with pytest.raises(ValueError, match="prefetch"):
        offload(model, budget=1, prefetch=-1)
    with pytest.raises(TypeError, match="module"):
        offload("model", budget=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host"):
        offload(model, budget=1, host="disk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="disk_budget"):
        offload(model, budget=1, disk_budget=10)


def test_pageable_host_when_pinned_is_unavailable() -> None:
    model = mlp(2)
    x = torch.randn(1, 32)
    expected = model(x)
    with use_runtime(SimulatedRuntime(1, pinned=False, auto_complete=True)):
        with pytest.warns(UserWarning, match="pinned host memory is not available"):
            off = offload(model, budget=1 << 20)
        with off:
            assert torch.equal(model(x), expected)
            kinds = {
                m.location.kind for v in off.manager.snapshot().values for m in v.materializations
            }
            assert "pinned-host" not in kinds
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with use_runtime(SimulatedRuntime(1, auto_complete=True)), offload(model, budget=1 << 20):
            pass


def test_host_budget_too_small_without_disk(runtime: SimulatedRuntime) -> None:
    model = mlp(4)
    original = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(ResidencyBudgetError):
        offload(model, budget=1 << 20, host_budget=weights_nbytes(model) // 2)
    # Nothing lost: the module is as it was.
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, original[name])


def test_spills_to_disk(runtime: SimulatedRuntime, tmp_path: Path) -> None:
    model = mlp(6)
    x = torch.randn(2, 32)
    expected = model(x)
    total = weights_nbytes(model)
    with offload(model, budget=total // 3, host_budget=total // 2, disk=tmp_path / "spill") as off:
        kinds = [
            {m.location.kind for m in v.materializations} for v in off.manager.snapshot().values
        ]
        assert sum("disk" in k for k in kinds) >= 3
        for _ in range(3):
            assert torch.equal(model(x), expected)
        stats = off.stats()
        assert stats.disk_read_bytes > 0
        assert stats.host_peak_bytes <= total // 2
        assert stats.device_peak_bytes <= total // 3
    assert torch.equal(model(x), expected)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_another_order_is_followed_and_recorded(runtime: SimulatedRuntime, prefetch: int) -> None:
    model = Switch().eval()
    x = torch.randn(2, 16)
    forward, backward = model(x), model(x, reverse=True)
    with offload(model, budget=weights_nbytes(model) // 3, prefetch=prefetch) as off:
        assert torch.equal(model(x), forward)
        first = off.schedule
        assert torch.equal(model(x, reverse=True), backward)
        assert off.schedule == tuple(reversed(first))
        assert torch.equal(model(x, reverse=True), backward)
        assert torch.equal(model(x), forward)
        stats = off.stats()
        assert stats.rerecords == 2
        assert stats.mispredictions >= 2


def test_an_error_inside_a_forward_leaves_it_usable(runtime: SimulatedRuntime) -> None:
    model = mlp(3)
    x = torch.randn(2, 32)
    expected = model(x)
    budget = weights_nbytes(model) // 2
    with offload(model, budget=budget) as off:
        assert torch.equal(model(x), expected)
        with pytest.raises(RuntimeError):
            model(torch.randn(2, 7))  # wrong width: the first layer raises
        assert torch.equal(model(x), expected)
        with pytest.raises(ResidencyUnavailableError):
            _ = model[0][0].weight + 0
        assert off.stats().device_peak_bytes <= budget


def test_whole_model_fits_moves_nothing_after_the_first_forward(
    runtime: SimulatedRuntime,
) -> None:
    model = mlp(5)
    x = torch.randn(2, 32)
    expected = model(x)
    total = weights_nbytes(model)
    with offload(model, budget=total * 2) as off:
        assert torch.equal(model(x), expected)
        loaded = off.stats().h2d_bytes
        assert loaded == total
        for _ in range(3):
            assert torch.equal(model(x), expected)
        assert off.stats().h2d_bytes == loaded
        # Outside a forward the placeholders are back, resident or not.
        with pytest.raises(ResidencyUnavailableError):
            _ = model[1][0].weight + 0


def test_nested_units(runtime: SimulatedRuntime) -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0), requires_grad=False)
            self.inner = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * self.scale

    torch.manual_seed(4)
    model = nn.Sequential(Outer(), Outer()).eval()
    x = torch.randn(2, 8)
    expected = model(x)
    for prefetch in (0, 1):
        with offload(model, budget=1 << 20, prefetch=prefetch, units=nn.Linear) as off:
            assert [unit.name for unit in off.units] == ["0", "0.inner", "1", "1.inner"]
            assert torch.equal(model(x), expected)
            assert torch.equal(model(x), expected)
            assert off.schedule[:2] == (("0",), ("0", "0.inner"))


def test_a_unit_larger_than_the_budget(runtime: SimulatedRuntime) -> None:
    model = mlp(2)
    with pytest.raises(ValueError, match=r"unit '0\.0' needs 4224 bytes"):
        offload(model, budget=4000)
    assert model[0][0].weight.device.type == "cpu"
    assert isinstance(model[0][0].weight, nn.Parameter)


def test_repr(runtime: SimulatedRuntime) -> None:
    with offload(mlp(2), budget=1 << 20) as off:
        assert isinstance(off, Offload)
        assert "units=2" in repr(off)
        assert "open" in repr(off)
    assert "closed" in repr(off)


def save(module: nn.Module, path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    return path


def test_checkpoint_onto_a_meta_module(runtime: SimulatedRuntime, tmp_path: Path) -> None:
    from fhelium.residency.nn import init_empty_weights

    model = Cnn().eval()
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    file = save(model, tmp_path / "cnn.safetensors")
    with init_empty_weights():
        empty = Cnn().eval()
    assert empty.conv.weight.is_meta
    total = weights_nbytes(model)
    with offload(empty, checkpoint=file, budget=total * 7 // 8, host_budget=total) as off:
        for _ in range(3):
            assert torch.equal(empty(x), expected)
        stats = off.stats()
        # The host keeps a copy of what it read: the file is read once.
        assert stats.disk_read_bytes == total
        assert stats.host_peak_bytes <= total
    assert all(p.is_meta for p in empty.parameters())


def test_checkpoint_cast_and_kept_buffers(runtime: SimulatedRuntime, tmp_path: Path) -> None:
    from fhelium.residency.nn import init_empty_weights

    torch.manual_seed(5)
    model = WithTable().eval()
    file = save(model, tmp_path / "m.safetensors")
    x = torch.randn(2, 8)
    with init_empty_weights():
        empty = WithTable().eval()
    assert not empty.table.is_meta  # buffers stay real
    with offload(empty, checkpoint=file, budget=1 << 20, dtype=torch.float64):
        out = empty(x.double())
        assert out.dtype == torch.float64
        expected = model.double()(x.double())
        assert torch.allclose(out, expected)


def test_checkpoint_errors_before_anything_runs(runtime: SimulatedRuntime, tmp_path: Path) -> None:
    from fhelium.errors import ResidencyCheckpointError
    from fhelium.residency.nn import init_empty_weights

    model = mlp(2)
    state = model.state_dict()
    del state["1.0.bias"]
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "missing.safetensors"))
    with init_empty_weights():
        empty = mlp(2)
    with pytest.raises(ResidencyCheckpointError) as caught:
        offload(empty, checkpoint=tmp_path / "missing.safetensors", budget=1 << 20)
    assert caught.value.key == "1.0.bias"
    assert caught.value.path is not None
    assert caught.value.path.endswith("missing.safetensors")
    assert all(p.is_meta for p in empty.parameters())  # untouched
    assert not any("forward" in m.__dict__ for m in empty.modules())
    state = mlp(2).state_dict()
    state["0.0.weight"] = torch.zeros(31, 32)
    save_file(state, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ResidencyCheckpointError, match="shape") as caught:
        offload(empty, checkpoint=tmp_path / "shape.safetensors", budget=1 << 20)
    assert caught.value.key == "0.0.weight"
    with pytest.raises(ValueError, match="meta"):
        offload(empty, budget=1 << 20)  # no checkpoint for a meta module


def test_with_a_manager_of_the_callers(runtime: SimulatedRuntime) -> None:
    from fhelium.residency import ResidencyManager, cuda_location

    model = mlp(4)
    x = torch.randn(2, 32)
    expected = model(x)
    gpu = cuda_location("cuda:0")
    budget = weights_nbytes(model) // 2
    with ResidencyManager({gpu: budget}) as manager:
        with pytest.raises(ValueError, match="budgets are the manager's"):
            offload(model, manager=manager, budget=budget)
        with offload(model, manager=manager) as off:
            assert off.manager is manager
            for _ in range(2):
                assert torch.equal(model(x), expected)
            assert off.stats().h2d_bytes > 0
            assert off.stats().device_peak_bytes <= budget
        # The module has its tensors back: the manager forgot them.
        values = manager.snapshot().values
        assert all(v.discarded and not v.materializations for v in values)
    assert torch.equal(model(x), expected)


def test_prefetch_hides_the_loads(runtime: SimulatedRuntime) -> None:
    model = mlp(9)
    x = torch.randn(2, 32)
    budget = weights_nbytes(model) // 3
    per_forward = {}
    for prefetch in (0, 1):
        with offload(model, budget=budget, prefetch=prefetch) as off:
            model(x)
            before = off.stats()
            for _ in range(3):
                model(x)
            after = off.stats()
            per_forward[prefetch] = (
                (after.loads - before.loads) / 3,
                (after.stalls - before.stalls) / 3,
            )
    loads, stalls = per_forward[0]
    assert loads > 0
    assert stalls == loads  # without prefetch every load is waited for at its turn
    loads, stalls = per_forward[1]
    assert loads > 0
    assert stalls < 1  # the next unit is already on its way


def test_offload_again_after_close(runtime: SimulatedRuntime, tmp_path: Path) -> None:
    from fhelium.residency.nn import init_empty_weights

    torch.manual_seed(6)
    model = WithTable().eval()
    x = torch.randn(2, 8)
    expected = model(x)
    file = save(model, tmp_path / "m.safetensors")
    for _ in range(2):  # pinned host copies come back pageable: a second offload works
        with offload(model, budget=1 << 20):
            assert torch.equal(model(x), expected)
    assert torch.equal(model(x), expected)
    with init_empty_weights():
        empty = WithTable().eval()
    for _ in range(2):  # the buffer the file lacks comes back real
        with offload(empty, checkpoint=file, budget=1 << 20):
            assert torch.equal(empty(x), expected)
        assert empty.linear.weight.is_meta
        assert torch.equal(empty.table, torch.arange(8.0))


def test_pageable_host_with_a_budget_spills_to_disk(
    runtime: SimulatedRuntime, tmp_path: Path
) -> None:
    model = mlp(8, 64)
    x = torch.randn(2, 64)
    expected = model(x)
    total = weights_nbytes(model)
    with offload(
        model, budget=total // 4, host="pageable", host_budget=total // 2, disk=tmp_path / "d"
    ) as off:
        for _ in range(2):
            assert torch.equal(model(x), expected)
        assert off.stats().host_peak_bytes <= total // 2
        assert off.stats().disk_read_bytes > 0
    assert torch.equal(model(x), expected)


def test_under_inference_mode(runtime: SimulatedRuntime) -> None:
    model = mlp(4)
    x = torch.randn(2, 32)
    expected = model(x)
    with torch.inference_mode(), offload(model, budget=weights_nbytes(model) // 2):
        for _ in range(2):
            assert torch.equal(model(x), expected)
    # Back as it was: ordinary tensors that autograd can use.
    assert not any(p.is_inference() for p in model.parameters())
    with torch.enable_grad():
        model(x).sum().backward()
    assert model[0][0].weight.grad is not None


def test_checkpoint_under_a_host_budget(runtime: SimulatedRuntime, tmp_path: Path) -> None:
    from fhelium.residency.nn import init_empty_weights

    model = mlp(8)
    x = torch.randn(2, 32)
    expected = model(x)
    file = save(model, tmp_path / "mlp.safetensors")
    total = weights_nbytes(model)
    with init_empty_weights():
        empty = mlp(8)
    with offload(
        empty, checkpoint=file, budget=total // 4, host_budget=total // 2, prefetch=1
    ) as off:
        for _ in range(3):
            assert torch.equal(empty(x), expected)
        stats = off.stats()
        assert stats.host_peak_bytes <= total // 2
        assert stats.device_peak_bytes <= total // 4
        # The host caches what it can: fewer reads than one file read per forward.
        assert total < stats.disk_read_bytes < 4 * total


def test_offloaded_twice_or_used_after_close(runtime: SimulatedRuntime) -> None:
    from fhelium.errors import ResidencyClosedError

    model = mlp(2)
    x = torch.randn(1, 32)
    expected = model(x)
    off = offload(model, budget=1 << 20)
    with pytest.raises(ValueError, match="already offloaded"):
        offload(model, budget=1 << 20)
    assert torch.equal(model(x), expected)  # the first one is untouched
    off.close()
    with pytest.raises(ResidencyClosedError), off.materialize(model[0]):
        pass
    assert torch.equal(model(x), expected)
