"""Several AR adapters on one song, as the one adapter vLLM takes per request.

vLLM runs one LoRA per request. Adapters stack exactly by concatenating their ranks: per module
`A = [A₁; A₂; …]` and `B = [s₁·B₁, s₂·B₂, …]`, so `B @ A = Σ sᵢ·Bᵢ @ Aᵢ`. `ar_target(uses)` names the PEFT
directory for a song's AR adapters at their scales, writing nothing: one adapter's own (`Converted.scaled_ar_path`),
or a stack's `stacks/<key>/` in the adapter cache (key: the adapters' contents and scales, in order).
`make_ar_directory` makes it when the song runs (a stack once, with the scales folded into B in float32 and
`lora_alpha = r`); `ar_directory` is both.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from .. import peft_format as peft
from ..checkpoint import atomic_directory, identity, write_json_atomic
from ..derive import _exclusive
from .cache import CONVERTER, Converted, adapters_root, peft_config, save_tensors
from .weights import AdapterError

STACKS_DIR, STACK_RECORD = "stacks", "stack.json"


def stack_key(uses: Sequence[tuple[Converted, float]]) -> str:
    return identity({"converter": CONVERTER, "stack": [[c.sha256, float(s)] for c, s in uses]})


def stack_rank(uses: Sequence[tuple[Converted, float]]) -> int:
    """The rank vLLM sees for a song's AR adapters: one adapter's, or the sum of the stacked ones'."""
    return sum(c.ar_rank for c, _ in uses)


def _ar_uses(uses: Sequence[tuple[Converted, float]]) -> list[tuple[Converted, float]]:
    return [(c, float(s)) for c, s in uses if c.ar_path is not None and s]


def ar_target(uses: Sequence[tuple[Converted, float]], cache_dir: str | os.PathLike | None = None) -> Path | None:
    """Where the PEFT directory vLLM loads for a song's AR adapters is (None: no adapter has an AR part): one
    adapter's own at its scale, or their stack's. Writes nothing (`make_ar_directory` makes it when the song runs)."""
    uses = _ar_uses(uses)
    if not uses:
        return None
    if len(uses) == 1:
        return uses[0][0].scaled_ar_path(uses[0][1])
    return adapters_root(cache_dir) / STACKS_DIR / stack_key(uses)


def make_ar_directory(uses: Sequence[tuple[Converted, float]], target: Path) -> Path:
    """`target` (what `ar_target(uses)` named) made, once: one adapter's scaled directory, or the stack."""
    uses = _ar_uses(uses)
    if len(uses) == 1:
        return uses[0][0].ar_directory(uses[0][1])
    if (target / STACK_RECORD).is_file():  # made already: no lock taken
        return target
    root, key = target.parent, target.name
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f".{key}.lock"):
        if (target / STACK_RECORD).is_file():
            return target
        factors: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for converted, scale in uses:
            for module, (a, b) in converted.ar_pairs().items():
                factors.setdefault(module, []).append((a.float(), b.float() * scale))
        out, rank = {}, 0
        for module, pairs in sorted(factors.items()):
            a_key, b_key = peft.lora_keys(module)
            out[a_key] = torch.cat([a for a, _ in pairs]).contiguous()
            out[b_key] = torch.cat([b for _, b in pairs], dim=1).contiguous()
            rank = max(rank, sum(a.shape[0] for a, _ in pairs))
        if not out:
            raise AdapterError("the stacked adapters adapt no AR projection")
        try:
            with atomic_directory(target) as tmp:
                write_json_atomic(tmp / peft.CONFIG, peft_config(rank, factors))
                save_tensors(tmp / peft.WEIGHTS, out, {"format": "pt"})
                write_json_atomic(tmp / STACK_RECORD, {"key": key, "rank": rank, "adapters": [
                    {"sha256": c.sha256, "scale": s, "rank": c.ar_rank} for c, s in uses]})
        except FileExistsError:
            pass  # another process made it (the lock is per process group of this machine)
    return target


def ar_directory(uses: Sequence[tuple[Converted, float]], cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The PEFT directory vLLM loads for a song's AR adapters, made (None: no adapter has an AR part)."""
    target = ar_target(uses, cache_dir)
    return None if target is None else make_ar_directory(uses, target)
