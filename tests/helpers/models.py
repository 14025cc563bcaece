"""Tiny random-weight models for the offload tests (tests/nn): four transformers
architectures built from small configs, a plain `nn.Sequential` MLP and a small CNN.

Nothing is downloaded: every model is built from a config with a fixed seed. Each builder
returns a `TinyModel`: the model in eval mode, on the CPU, in float32, with its forward
inputs; how to save it as a checkpoint (transformers' `save_pretrained` sharded into
several files, or a safetensors file) and how to build the same architecture with its
parameters on meta (`fhelium.residency.nn.init_empty_weights`), for `offload(checkpoint=)`.

The configs are small enough for a whole test file to run in seconds on two cores, and
balanced so that a third of the weights holds the largest unit of the default unit rule
(each module that directly owns parameters or buffers) with room to spare: at that budget
Belady's rule keeps some weights from one forward to the next (for every model here it
moves 75 to 95% of the weights per forward, not all of them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

__all__ = [
    "BUILDERS",
    "RoutedMoE",
    "GENERATIVE",
    "TinyModel",
    "build",
    "cnn",
    "device_budget",
    "generate",
    "gpt2",
    "largest_unit_nbytes",
    "llama",
    "mixtral",
    "mlp",
    "outputs",
    "routed_moe",
    "t5",
    "weight_nbytes",
]

VOCAB = 96
SEED = 0
# Input ids avoid 0..2 (the configs' bos, eos and pad ids).
_PROMPT = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))


@dataclass(frozen=True)
class TinyModel:
    """One tiny model, its inputs, and its checkpoint round trip.

    Attributes:
        name: The builder's name (a key of `BUILDERS`).
        model: The model: eval mode, CPU, float32, random weights from `SEED`.
        inputs: Keyword arguments of one forward (``model(**inputs)``).
        generate_inputs: Keyword arguments of ``model.generate`` (``None``: no generate).
        factory: Builds the architecture again (random weights; on meta under
            `init_empty_weights`).
        save: Writes ``model``'s checkpoint under a directory and returns what
            ``offload(checkpoint=)`` takes (a directory or a file).
    """

    name: str
    model: nn.Module
    inputs: Mapping[str, torch.Tensor]
    generate_inputs: Mapping[str, torch.Tensor] | None
    factory: Callable[[], nn.Module] = field(repr=False)
    save: Callable[[Path], Path] = field(repr=False)

    def build_meta(self) -> nn.Module:
        """The same architecture, parameters on meta and buffers real, in eval mode."""
        from fhelium.residency.nn import init_empty_weights

        with init_empty_weights():
            model = self.factory()
        return model.eval()


def weight_nbytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (ties count once)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        if tensor.is_meta or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def largest_unit_nbytes(model: nn.Module) -> int:
    """Bytes of the largest unit of the default rule, computed here independently: each
    module that directly owns parameters or buffers, the outermost when they nest, with
    everything it holds (shared parameters included: its step requires them too)."""
    owners: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{owner}.") for owner, _ in owners):
            continue
        direct = (*module.parameters(recurse=False), *module.buffers(recurse=False))
        if direct:
            owners.append((name, module))
            if not name:  # the root owns tensors itself: one unit holds everything
                break
    return max((weight_nbytes(module) for _, module in owners), default=0)


def device_budget(model: nn.Module) -> int:
    """The device budget of the offload tests: a third of the weights' bytes, but at least
    the largest unit's (a step must fit on its own). The configs here are balanced so that
    the third is the larger."""
    return max(weight_nbytes(model) // 3, largest_unit_nbytes(model))


def _seeded(factory: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(SEED)
    return factory().eval()


def _save_pretrained(model: nn.Module, directory: Path, *, shards: int = 3, **options: Any) -> Path:
    """``save_pretrained`` into several shard files (``max_shard_size`` a part of the
    weights); returns the directory, which holds ``model.safetensors.index.json``."""
    size = max(1, weight_nbytes(model) // shards)
    model.save_pretrained(directory, max_shard_size=size, **options)  # type: ignore[operator]
    index = directory / "model.safetensors.index.json"
    files = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    if len(files) < 2:
        raise AssertionError(f"save_pretrained wrote {sorted(files)}: not sharded")
    return directory


def _transformers(
    name: str,
    factory: Callable[[], nn.Module],
    inputs: Mapping[str, torch.Tensor],
    generate_inputs: Mapping[str, torch.Tensor],
    **save_options: Any,
) -> TinyModel:
    model = _seeded(factory)
    return TinyModel(
        name=name,
        model=model,
        inputs=inputs,
        generate_inputs=generate_inputs,
        factory=factory,
        save=lambda directory: _save_pretrained(model, directory, **save_options),
    )


def _causal_inputs() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    ids = _PROMPT.clone()
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask}, {"input_ids": ids, "attention_mask": mask}


def gpt2() -> TinyModel:
    """GPT-2, 2 blocks: the LM head is tied to the token embedding (one parameter)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    inputs, generate_inputs = _causal_inputs()
    built = _transformers("gpt2", lambda: GPT2LMHeadModel(config), inputs, generate_inputs)
    head, embedding = built.model.lm_head.weight, built.model.transformer.wte.weight  # type: ignore[union-attr]
    if head is not embedding:
        raise AssertionError("GPT-2's LM head is not tied to its embedding")
    return built


def llama() -> TinyModel:
    """Llama, 2 layers: grouped-query attention (4 query heads, 2 key-value heads), an
    untied LM head, and rotary ``inv_freq`` buffers that checkpoints leave out."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    inputs, generate_inputs = _causal_inputs()
    return _transformers("llama", lambda: LlamaForCausalLM(config), inputs, generate_inputs)


def mixtral() -> TinyModel:
    """Mixtral, 3 layers of 4 experts (top 2), grouped-query attention, untied head.

    transformers 5 stores each layer's experts as two fused 3-D parameters of one module
    (``MixtralExperts.gate_up_proj`` and ``down_proj``), not a ModuleList: the experts of a
    layer are one unit, and the router's choice does not change the order of units.
    ``save_pretrained`` would by default write the original per-expert layout
    (``block_sparse_moe.experts.N.w1.weight``), which transformers converts when loading;
    ``offload(checkpoint=)`` reads the module's own ``state_dict`` names, so this saves the
    fused layout (``save_original_format=False``).
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=12,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    inputs, generate_inputs = _causal_inputs()
    return _transformers(
        "mixtral",
        lambda: MixtralForCausalLM(config),
        inputs,
        generate_inputs,
        save_original_format=False,
    )


def t5() -> TinyModel:
    """T5, 2 encoder and 2 decoder blocks: the shared embedding is tied to both stacks'
    token embeddings and to the LM head (one parameter, four modules)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        initializer_factor=5.0,
        decoder_start_token_id=2,
        eos_token_id=1,
        pad_token_id=2,
    )
    ids = _PROMPT.clone()
    mask = torch.ones_like(ids)
    decoder = torch.tensor([[2, 7, 11], [2, 13, 5]])
    return _transformers(
        "t5",
        lambda: T5ForConditionalGeneration(config),
        {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder},
        {"input_ids": ids, "attention_mask": mask},
    )


def _save_state_dict(model: nn.Module, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(path))
    return path


def mlp() -> TinyModel:
    """A plain ``nn.Sequential`` MLP; its checkpoint is one safetensors file."""

    def factory() -> nn.Module:
        layers: list[nn.Module] = [nn.Linear(16, 24), nn.ReLU()]
        for index in range(6):
            layers += [nn.Linear(24, 24), (nn.GELU, nn.Tanh, nn.ReLU)[index % 3]()]
        return nn.Sequential(*layers, nn.Linear(24, 8))

    model = _seeded(factory)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    return TinyModel(
        name="mlp",
        model=model,
        inputs={"input": x},
        generate_inputs=None,
        factory=factory,
        save=lambda directory: _save_state_dict(model, directory / "mlp.safetensors"),
    )


def cnn() -> TinyModel:
    """A small CNN (Conv2d, BatchNorm2d, ReLU, pooling, Linear). The batch norms' running
    statistics are set away from their defaults, so a checkpoint that missed those
    buffers would change the output. Its checkpoint is a directory with
    ``model.safetensors``."""

    def factory() -> nn.Module:
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            *(
                layer
                for _ in range(5)
                for layer in (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
            ),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(16, 10),
        )
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.BatchNorm2d):
                    module.running_mean.uniform_(-0.5, 0.5)  # type: ignore[operator]
                    module.running_var.uniform_(0.5, 2.0)  # type: ignore[operator]
                    module.num_batches_tracked.fill_(7)  # type: ignore[operator]
        return model

    model = _seeded(factory)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))

    def save(directory: Path) -> Path:
        _save_state_dict(model, directory / "model.safetensors")
        return directory

    return TinyModel(
        name="cnn",
        model=model,
        inputs={"input": x},
        generate_inputs=None,
        factory=factory,
        save=save,
    )


class RoutedMoE(nn.Module):
    """A mixture of experts as a ModuleList, in plain torch: each token goes to its top
    expert, and only the experts some token picked run (in index order), so the order of
    units depends on the input, as in older transformers MoE code."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.gate = nn.Linear(32, 4)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32)) for _ in range(4)
        )
        self.head = nn.Linear(32, 8)

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """Each token's expert."""
        return self.gate(self.embed(x)).argmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        choice = self.gate(hidden).argmax(dim=-1)
        mixed = torch.zeros_like(hidden)
        for expert in sorted(set(choice.tolist())):
            rows = choice == expert
            mixed[rows] = self.experts[expert](hidden[rows])
        return self.head(hidden + mixed)


def routed_moe() -> tuple[RoutedMoE, tuple[torch.Tensor, ...]]:
    """A `RoutedMoE` (eval, CPU, float32, seeded) and inputs whose tokens pick different
    sets of experts, one input to another."""
    torch.manual_seed(SEED)
    model = RoutedMoE().eval()
    generator = torch.Generator().manual_seed(4)
    inputs: list[torch.Tensor] = []
    routes: list[frozenset[int]] = []
    with torch.no_grad():
        while len(inputs) < 3:
            x = torch.randn(3, 16, generator=generator) * 3
            route = frozenset(model.route(x).tolist())
            if route not in routes:
                inputs.append(x)
                routes.append(route)
    return model, tuple(inputs)


BUILDERS: dict[str, Callable[[], TinyModel]] = {
    "gpt2": gpt2,
    "llama": llama,
    "mixtral": mixtral,
    "t5": t5,
    "mlp": mlp,
    "cnn": cnn,
}
GENERATIVE = ("gpt2", "llama", "mixtral", "t5")


def build(name: str) -> TinyModel:
    """A fresh `TinyModel` by name (a key of `BUILDERS`)."""
    return BUILDERS[name]()


def outputs(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The model's output for ``inputs`` under ``torch.no_grad``: its logits for a
    transformers model, the tensor itself for the others."""
    with torch.no_grad():
        result = model(**inputs)
    return result if isinstance(result, torch.Tensor) else result.logits


MAX_NEW_TOKENS = 4


def generate(
    model: nn.Module, inputs: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Greedy ``generate``: ``MAX_NEW_TOKENS`` new tokens exactly (no early end of
    sequence); returns the sequences and each step's raw logits."""
    with torch.no_grad():
        result = model.generate(  # type: ignore[operator]
            **inputs,
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            min_new_tokens=MAX_NEW_TOKENS,
            return_dict_in_generate=True,
            output_logits=True,
        )
    return result.sequences, tuple(result.logits)
