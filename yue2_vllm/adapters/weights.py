"""What an adapter holds once read, whatever its layout: one change per base-model module.

Module names are the MoT checkpoint's, without `.weight`: `model.layers.3.self_attn.q_proj`,
`model.layers.3.nar_mlp.up_proj`, `vae2llm`. A `Pair`'s `scale` is the layout's rule (alpha / rank, rsLoRA's
alpha / √rank, 1.0 for the suffix-less released files), not the strength a request asks for.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


class AdapterError(ValueError):
    """An adapter that cannot be used; the message (one line) names the file and, where one is at fault, the
    tensor."""


@dataclass(frozen=True, eq=False)
class Pair:
    """A LoRA pair: the delta is `scale · b @ a`, `a [rank, in]`, `b [out, rank]`."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    keys: tuple[str, str]  # the names of a and b in the file (messages, records)
    file: Path

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True, eq=False)
class Diff:
    """An additive delta (ComfyUI's `.diff` / `.diff_b`): `W += weight`, `bias += bias`."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    keys: tuple[str | None, str | None]  # the names of weight and bias in the file
    file: Path


@dataclass(frozen=True, eq=False)
class Full:
    """Whole replacement tensors (`vae2llm.weight`, `vae2llm.bias`, … of the real-audio NAR adapters)."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    keys: tuple[str | None, str | None]
    file: Path


Change = Pair | Diff | Full


@dataclass
class AdapterWeights:
    """One adapter, read and normalized (`layouts.read_adapter`)."""

    source: Path  # what the user named (file or directory)
    layout: str  # `layouts.LAYOUTS`
    files: tuple[Path, ...]  # every file read, weights and config
    modules: dict[str, Change]
    notes: list[str] = field(default_factory=list)  # how it was read: scale rule, splits, …
    card: dict = field(default_factory=dict)  # what its card says: licence, triggers
