"""Several AR adapters on one song, as the one adapter vLLM takes per request.

vLLM runs one LoRA per request. Adapters stack exactly by concatenating their ranks: per module
`A = [A₁; A₂; …]` and `B = [s₁·B₁, s₂·B₂, …]`, so `B @ A = Σ sᵢ·Bᵢ @ Aᵢ`. `ar_directory(uses)` returns the PEFT
directory for a song's AR adapters at their scales: one adapter's own (`Converted.ar_directory(scale)`), or a
stack built once into `stacks/<key>/` of the adapter cache (key: the adapters' contents and scales, in order),
with the scales folded into B in float32 and `lora_alpha = r`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from ..checkpoint import atomic_directory, identity, write_json_atomic
from ..derive import _exclusive
from .cache import (CONVERTER, PEFT_CONFIG, PEFT_PREFIX, PEFT_WEIGHTS, Converted, adapters_root, peft_config,
                    save_tensors)
from .weights import AdapterError

STACK_RECORD = "stack.json"


def stack_key(uses: Sequence[tuple[Converted, float]]) -> str:
    return identity({"converter": CONVERTER, "stack": [[c.sha256, float(s)] for c, s in uses]})


def stack_rank(uses: Sequence[tuple[Converted, float]]) -> int:
    """The rank vLLM sees for a song's AR adapters: one adapter's, or the sum of the stacked ones'."""
    return sum(c.ar_rank for c, _ in uses)


def ar_directory(uses: Sequence[tuple[Converted, float]], cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The PEFT directory vLLM loads for a song's AR adapters (None: no adapter has an AR part)."""
    uses = [(c, float(s)) for c, s in uses if c.ar_path is not None and s]
    if not uses:
        return None
    if len(uses) == 1:
        return uses[0][0].ar_directory(uses[0][1])
    root = adapters_root(cache_dir) / "stacks"
    root.mkdir(parents=True, exist_ok=True)
    key = stack_key(uses)
    target = root / key
    with _exclusive(root / f".{key}.lock"):
        if (target / STACK_RECORD).is_file():
            return target
        factors: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for converted, scale in uses:
            for module, (a, b) in converted.ar_pairs().items():
                factors.setdefault(module, []).append((a.float(), b.float() * scale))
        out, rank = {}, 0
        for module, pairs in sorted(factors.items()):
            out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = torch.cat([a for a, _ in pairs]).contiguous()
            out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = torch.cat([b for _, b in pairs], dim=1).contiguous()
            rank = max(rank, sum(a.shape[0] for a, _ in pairs))
        if not out:
            raise AdapterError("the stacked adapters adapt no AR projection")
        try:
            with atomic_directory(target) as tmp:
                write_json_atomic(tmp / PEFT_CONFIG, peft_config(rank, factors))
                save_tensors(tmp / PEFT_WEIGHTS, out, {"format": "pt"})
                write_json_atomic(tmp / STACK_RECORD, {"key": key, "rank": rank, "adapters": [
                    {"sha256": c.sha256, "scale": s, "rank": c.ar_rank} for c, s in uses]})
        except FileExistsError:
            pass  # another process made it (the lock is per process group of this machine)
    return target
