"""One tensor name of an adapter file, in any layout users bring, read as (module, role).

The forms (each with real examples in docs/adapters.md):

* suffix-less released files: `layers.3.self_attn.q_proj.lora_A` (no `model.`, no `.weight`);
* PEFT: `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (also `.lora_A.default.weight`);
* the upstream module paths: `model.layers.3.nar_mlp.up_proj.lora_B`;
* kohya / ComfyUI: `text_encoders.model.layers.3.self_attn.qkv_proj.lora_up.weight` (the AR half, ComfyUI's
  CLIP slot), `diffusion_model.model.layers.3.mlp.gate_up_proj.lora_down.weight` (the NAR half, named with the
  AR module names), a per-module `.alpha`, additive `diffusion_model.vae2llm.diff` / `.diff_b`;
* ntc-ai's slider distills: `adapters.model-layers-3-self_attn-q_proj.lora_down.weight`;
* whole replacement tensors of the NAR's bridges: `vae2llm.weight`, `llm2vae.bias`.

Parameterisations that are not a LoRA pair (LoKr, LoHa, DoRA, routed slider particles, HOT-Step/PiSSA
residuals) and LoRA on the embeddings or the lm_head are refused by name (`refusal`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .. import peft_format as peft

# Role suffixes, longest first: (suffix, role).
ROLES = (
    (".lora_A.default.weight", "a"), (".lora_B.default.weight", "b"),
    (".lora_A.weight", "a"), (".lora_B.weight", "b"), (".lora_down.weight", "a"), (".lora_up.weight", "b"),
    (".lora_A", "a"), (".lora_B", "b"), (".lora_down", "a"), (".lora_up", "b"),
    (".alpha", "alpha"), (".diff_b", "diff_b"), (".diff", "diff"), (".weight", "weight"), (".bias", "bias"),
)
# Container prefixes: (prefix, half it says the file meant or None).
PREFIXES = (("text_encoders.", "ar"), ("diffusion_model.", "nar"), (peft.KEY_PREFIX, None), ("module.", None))
LAYER_SITES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED_SITES = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# The NAR's modules outside the layers; their `.weight` / `.bias` may be whole replacements.
FLAT_MODULES = ("vae2llm", "llm2vae", "time_embedder.mlp.0", "time_embedder.mlp.2")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Markers of what is not a LoRA pair: (pattern, what it is).
NOT_LORA = (
    (re.compile(r"(^|\.)lokr_w[12]"), "a LoKr factor (Kronecker adapter), not a LoRA pair"),
    (re.compile(r"(^|\.)hada_w[12]"), "a LoHa factor (Hadamard adapter), not a LoRA pair"),
    (re.compile(r"(lora_magnitude_vector|dora_scale)"), "a DoRA magnitude, not a plain LoRA pair"),
    (re.compile(r"(^particles$|\.bridge\.(router|net)\.)"),
     "a routed slider particle (ntc-ai's native particle teacher: a routed MLP, not LoRA; use its rank-8 distill)"),
    (re.compile(r"(^|\.)hot_step\."), "a HOT-Step trainer tensor (HiRA/PiSSA residual), not a LoRA pair"),
    (re.compile(r"lora_embedding_[AB]|(^|\.)(embed_tokens|lm_head)\."),
     "LoRA on the embeddings or the lm_head, which stay the base model's (our phase-sliced head and sampler)"),
)


@dataclass(frozen=True)
class Key:
    """A tensor name read: the module it changes (unfused `FUSED_SITES` keep their fused name here), what it is
    for that module, the half its container prefix says (None: no prefix) and the key form."""

    module: str
    role: str  # a, b, alpha, diff, diff_b, weight, bias
    hint: str | None
    form: str  # peft, plain, kohya, slider


def refusal(name: str) -> str | None:
    """What a tensor is when it marks a parameterisation we do not run, else None."""
    for pattern, what in NOT_LORA:
        if pattern.search(name):
            return what
    return None


def _strip_role(name: str) -> tuple[str, str, str]:
    for suffix, role in ROLES:
        if name.endswith(suffix) and len(name) > len(suffix):
            form = "kohya" if "lora_down" in suffix or "lora_up" in suffix else \
                "peft" if suffix.endswith(".weight") and role in ("a", "b") else "plain"
            return name[: -len(suffix)], role, form
    raise KeyError("no role suffix (.lora_A, .lora_B, .lora_down/up, .alpha, .diff, .weight, .bias)")


def parse_key(name: str) -> Key:
    """The module and role of one tensor name (KeyError saying why it names nothing of YuE2)."""
    body, role, form = _strip_role(name)
    hint = None
    for prefix, half in PREFIXES:
        if body.startswith(prefix):
            body, hint = body[len(prefix):], half or hint
            if prefix == peft.KEY_PREFIX:
                form = "peft"
            break
    if body.startswith("adapters."):  # ntc-ai's dashed module paths
        body, form = body[len("adapters."):].replace("-", "."), "slider"
    if hint == "ar" or hint == "nar":
        form = "comfyui" if form != "slider" else form
    if body.startswith("model.layers.") or body.startswith("layers."):
        body = body if body.startswith("model.") else "model." + body
    elif body.startswith("model.") and body[len("model."):] in FLAT_MODULES:
        body = body[len("model."):]
    if body in FLAT_MODULES:
        if hint == "ar":
            raise KeyError(f"{body} is a NAR module under the AR prefix text_encoders.")
        if role in ("a", "b", "alpha", "diff", "diff_b", "weight", "bias"):
            return Key(body, role, hint, form)
    match = _LAYER.fullmatch(body)
    if not match:
        raise KeyError("names no module of YuE2 (layers.N.self_attn/mlp, nar_self_attn/nar_mlp, vae2llm, llm2vae, "
                       "time_embedder)")
    layer, site = match.groups()
    nar = site.startswith("nar_")
    if not nar and hint == "nar":  # ComfyUI names the NAR expert with the AR module names
        site, nar = "nar_" + site, True
    if nar and hint == "ar":
        raise KeyError("a NAR module under the AR prefix text_encoders.")
    plain = site[len("nar_"):] if nar else site
    if plain not in LAYER_SITES and plain not in FUSED_SITES:
        raise KeyError(f"{site} is not one of the adapted projections (q/k/v/o, gate/up/down, fused qkv/gate_up)")
    if role in ("weight", "bias"):
        raise KeyError("a whole replacement of a layer projection (only vae2llm / llm2vae / time_embedder "
                       "take replacement tensors)")
    return Key(f"model.layers.{int(layer)}.{site}", role, hint, form)


def unfused(module: str) -> tuple[str, ...] | None:
    """The modules a fused `qkv_proj` / `gate_up_proj` name stands for, in row order; None for any other."""
    match = _LAYER.fullmatch(module)
    if not match:
        return None
    layer, site = match.groups()
    nar = "nar_" if site.startswith("nar_") else ""
    parts = FUSED_SITES.get(site[len(nar):])
    return None if parts is None else tuple(f"model.layers.{layer}.{nar}{part}" for part in parts)
