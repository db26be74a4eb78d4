"""An adapter checked against the base model before anything loads it: every refusal is one line naming the file
and the tensor.

Refused: a module the base model does not have (a layer past its last), a factor whose shape does not fit
the base weight, a rank above the limit (vLLM's largest `max_lora_rank` unless the caller sets a lower
one), non-finite or non-float values, a full-rank delta or replacement on the AR half (vLLM runs AR adapters as
LoRA only), a bias delta for a linear without a bias, and an adapter with no module at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.modeling import YuE2Config, tensor_shapes
from .halves import half_of, halves, site
from .weights import AdapterError, AdapterWeights, Change, Pair

# vLLM's `max_lora_rank` choices (config/lora.py, 0.32 and 0.33): an engine's slots are padded to one of them.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_RANK = VLLM_MAX_LORA_RANKS[-1]


def max_lora_rank_for(rank: int) -> int:
    """The smallest vLLM `max_lora_rank` choice that holds `rank` (ValueError above the largest)."""
    for choice in VLLM_MAX_LORA_RANKS:
        if rank <= choice:
            return choice
    raise ValueError(f"rank {rank} is above vLLM's largest max_lora_rank {MAX_RANK}")


@dataclass(frozen=True)
class Summary:
    """What a checked adapter is: its half, its largest rank and the projections it adapts per half."""

    half: str
    rank: int  # the largest LoRA rank (0: no LoRA pair, only deltas or replacements)
    ar_rank: int
    modules: int
    projections: tuple[str, ...]  # sites, sorted (mlp.down_proj, …, self_attn.q_proj, vae2llm)

    def record(self) -> dict:
        return {"half": self.half, "rank": self.rank, "ar_rank": self.ar_rank, "modules": self.modules,
                "projections": list(self.projections)}


def _first_key(change: Change) -> str:
    return next(key for key in change.keys if key)


def _check_change(module: str, change: Change, shapes: dict[str, tuple[int, ...]], max_rank: int) -> None:
    weight_shape = shapes.get(f"{module}.weight")
    where = f"{change.file}: tensor {_first_key(change)}"
    if weight_shape is None:
        raise AdapterError(f"{where}: the base model has no {module} (unknown key)")
    out_features, in_features = weight_shape
    if isinstance(change, Pair):
        rank = change.rank
        if tuple(change.a.shape) != (rank, in_features):
            raise AdapterError(f"{change.file}: tensor {change.keys[0]}: shape {list(change.a.shape)}, {module} needs "
                               f"lora_A [rank, {in_features}]")
        if tuple(change.b.shape) != (out_features, rank):
            raise AdapterError(f"{change.file}: tensor {change.keys[1]}: shape {list(change.b.shape)}, {module} needs "
                               f"lora_B [{out_features}, {rank}]")
        if rank > max_rank:
            raise AdapterError(f"{where}: rank {rank} is above the limit {max_rank}")
        parts = zip(change.keys, (change.a, change.b))
    else:
        if half_of(module) == "ar":
            raise AdapterError(f"{where}: a full-rank {'delta' if type(change).__name__ == 'Diff' else 'replacement'} "
                               "on the AR half (vLLM runs AR adapters as LoRA pairs only)")
        bias_shape = shapes.get(f"{module}.bias")
        if change.weight is not None and tuple(change.weight.shape) != weight_shape:
            raise AdapterError(f"{change.file}: tensor {change.keys[0]}: shape {list(change.weight.shape)}, "
                               f"{module}.weight is {list(weight_shape)}")
        if change.bias is not None and (bias_shape is None or tuple(change.bias.shape) != bias_shape):
            raise AdapterError(f"{change.file}: tensor {change.keys[1]}: shape {list(change.bias.shape)}, "
                               + (f"{module}.bias is {list(bias_shape)}" if bias_shape else f"{module} has no bias"))
        parts = zip(change.keys, (change.weight, change.bias))
    for key, tensor in parts:
        if tensor is None:
            continue
        if not tensor.is_floating_point():
            raise AdapterError(f"{change.file}: tensor {key}: dtype {tensor.dtype} is not a float type")
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"{change.file}: tensor {key}: holds non-finite values (inf or nan)")


def check_adapter(adapter: AdapterWeights, config: YuE2Config, max_rank: int = MAX_RANK) -> Summary:
    """The adapter's summary, or AdapterError for the first thing that does not fit the base model."""
    if not adapter.modules:
        raise AdapterError(f"{adapter.source}: adapts no module")
    shapes = tensor_shapes(config)
    for module, change in adapter.modules.items():
        _check_change(module, change, shapes, max_rank)
        if isinstance(change, Pair) and not abs(change.scale) < float("inf"):
            raise AdapterError(f"{change.file}: tensor {change.keys[0]}: scale {change.scale} is not finite")
    pairs = {m: c for m, c in adapter.modules.items() if isinstance(c, Pair)}
    return Summary(halves(adapter.modules), max((c.rank for c in pairs.values()), default=0),
                   max((c.rank for m, c in pairs.items() if half_of(m) == "ar"), default=0), len(adapter.modules),
                   tuple(sorted({site(m) for m in adapter.modules})))
