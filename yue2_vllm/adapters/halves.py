"""Which half of YuE2 an adapter changes, told from its module names (never from a file or directory name).

The AR half is every layer's `self_attn` / `mlp`; the NAR half is every layer's `nar_self_attn` / `nar_mlp`
and the modules outside the layers that only the velocity runs (`vae2llm`, `llm2vae`, `time_embedder`).
"""
from __future__ import annotations

from typing import Iterable

# The short names vLLM's Qwen3 knows the AR projections by (PEFT target_modules).
AR_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def half_of(module: str) -> str:
    """"ar" or "nar" for one module name of the MoT checkpoint (without `.weight`)."""
    if not module.startswith("model.layers."):
        return "nar"
    site = module.split(".", 3)[3]
    return "nar" if site.startswith("nar_") else "ar"


def halves(modules: Iterable[str]) -> str:
    """"ar", "nar" or "both" for a set of modules (ValueError for none)."""
    found = {half_of(module) for module in modules}
    if not found:
        raise ValueError("an adapter with no modules has no half")
    return "both" if len(found) == 2 else found.pop()


def projection(module: str) -> str:
    """The short name of a module (`q_proj`, `vae2llm`, `time_embedder.mlp.0`)."""
    return module.rsplit(".", 1)[-1] if module.startswith("model.layers.") else module


def site(module: str) -> str:
    """A module's name inside its layer (`self_attn.q_proj`, `nar_mlp.up_proj`), or the module outside the layers."""
    return module.split(".", 3)[3] if module.startswith("model.layers.") else module
