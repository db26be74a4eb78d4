"""Tiny adapters for the tiny model, in every layout users bring, with the real key names.

`write_tiny_adapter(path, layout, half=...)` writes one and returns its truth: the edits it means, per
unfused module, as `model.lora` edits (low-rank factors exactly as stored, the layout's scale), so a test can
compare what `adapters/` reads and converts against an independent statement of the same adapter. The writer
knows nothing of `adapters/`: it writes each layout's keys itself.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import peft_format as peft
from .checkpoint import atomic_directory, write_json_atomic
from .model.lora import Additive, Edit, LowRank, Replacement
from .model.modeling import YuE2Config, tensor_shapes
from .testing import TINY_CONFIG

LAYOUTS = ("plain", "peft", "peft-rslora", "alpha-rank", "lora.json", "comfyui", "slider-distill")
REFUSED = ("lokr", "dora", "particles", "lm_head")
AR_SITES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SLIDER_SITES = AR_SITES[:4]


@dataclass
class TinyAdapter:
    path: Path
    layout: str
    half: str
    edits: dict[str, list[Edit]]  # the truth, per unfused module (scale 1 request)

    def scaled(self, scale: float) -> dict[str, list[Edit]]:
        """The truth at a request's scale (LoRA scales and deltas times `scale`, replacements at strength `scale`)."""
        out = {}
        for module, edits in self.edits.items():
            out[module] = [LowRank(e.a, e.b, e.scale * scale) if isinstance(e, LowRank) else
                           Additive(e.weight, e.bias, e.scale * scale) if isinstance(e, Additive) else
                           Replacement(e.weight, e.bias, e.strength * scale) for e in edits]
        return out


def _modules(config: YuE2Config, half: str, sites=AR_SITES) -> list[str]:
    names = []
    for layer in range(config.num_hidden_layers):
        if half in ("ar", "both"):
            names += [f"model.layers.{layer}.{site}" for site in sites]
        if half in ("nar", "both"):
            names += [f"model.layers.{layer}.nar_{site}" for site in sites]
    return names


def _pair(shape: tuple[int, int], rank: int, generator: torch.Generator, gain: float, zero_b: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    out_features, in_features = shape
    a = (torch.randn(rank, in_features, generator=generator) / in_features ** 0.5).to(dtype)
    b = torch.zeros(out_features, rank, dtype=dtype) if zero_b else \
        (gain * torch.randn(out_features, rank, generator=generator) / rank ** 0.5).to(dtype)
    return a, b


def _save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata or {"format": "pt"})


def _emit(path: Path, tensors: dict[str, torch.Tensor], config: tuple[str, dict] | None = None,
          weights: str = "", metadata: dict[str, str] | None = None) -> None:
    """A single safetensors file at `path` (no config), or a directory holding `config` and the `weights` file."""
    if config is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _save(path, tensors, metadata)
        return
    with atomic_directory(path) as tmp:
        write_json_atomic(tmp / config[0], config[1])
        _save(tmp / weights, tensors, metadata)


def _tag(site: str, nar: bool) -> str:
    return ("nar_" if nar else "") + site


def write_tiny_adapter(path: str | os.PathLike, layout: str, *, half: str = "ar", rank: int = 4,
                       alpha: float | None = None, seed: int = 0, gain: float = 0.5, zero_b: bool = False,
                       replacements: bool = True, config: YuE2Config = TINY_CONFIG,
                       dtype: torch.dtype = torch.bfloat16) -> TinyAdapter:
    """Write a tiny adapter in `layout` (a file or a directory at `path`, as the layout is) and return its truth.

    `half` "ar", "nar" or "both"; NAR adapters carry the layout's NAR extras when `replacements` (whole
    `vae2llm`/`llm2vae` tensors for "plain", `.diff` deltas for "comfyui", LoRA pairs on the bridges for
    "alpha-rank"). `alpha` None means alpha = 2·rank (scale 2) where the layout has an alpha, rank where not.
    """
    if layout not in LAYOUTS and layout not in REFUSED:
        raise ValueError(f"layout must be one of {LAYOUTS + REFUSED}, got {layout!r}")
    if layout == "slider-distill" and half != "ar":
        raise ValueError("ntc-ai's slider distills adapt the AR attention only")
    path = Path(path)
    generator = torch.Generator().manual_seed(seed)
    shapes = tensor_shapes(config)
    alpha = float(2 * rank if alpha is None else alpha)
    truth: dict[str, list[Edit]] = {}
    tensors: dict[str, torch.Tensor] = {}
    metadata = None

    def factors(module: str, r: int = rank):
        return _pair(shapes[f"{module}.weight"], r, generator, gain, zero_b, dtype)

    def extras(kind: str) -> None:
        for name in ("vae2llm", "llm2vae"):
            w_shape, b_shape = shapes[f"{name}.weight"], shapes[f"{name}.bias"]
            weight = (0.1 * torch.randn(w_shape, generator=generator)).to(dtype)
            bias = (0.05 * torch.randn(b_shape, generator=generator)).to(dtype)
            if kind == "full":
                tensors[f"{name}.weight"], tensors[f"{name}.bias"] = weight, bias
                truth[name] = [Replacement(weight.float(), bias.float())]
            else:
                tensors[f"diffusion_model.{name}.diff"], tensors[f"diffusion_model.{name}.diff_b"] = weight, bias
                truth[name] = [Additive(weight.float(), bias.float())]

    if layout in ("plain", "peft", "peft-rslora", "alpha-rank"):
        scale = 1.0 if layout == "plain" else alpha / math.sqrt(rank) if layout == "peft-rslora" else alpha / rank
        modules = _modules(config, half)
        if layout == "alpha-rank" and half != "ar" and replacements:
            modules += ["vae2llm", "llm2vae"]
        for module in modules:
            a, b = factors(module)
            stem = {"plain": module.removeprefix("model."), "alpha-rank": module}.get(layout,
                                                                                     f"{peft.KEY_PREFIX}{module}")
            suffix = ".weight" if layout.startswith("peft") else ""
            tensors[f"{stem}.lora_A{suffix}"], tensors[f"{stem}.lora_B{suffix}"] = a, b
            truth[module] = [LowRank(a.float(), b.float(), scale)]
        if layout == "plain" and half != "ar" and replacements:
            extras("full")
        if layout == "plain":
            _emit(path, tensors)
        elif layout == "alpha-rank":
            _emit(path, tensors, (peft.CONFIG, {"alpha": alpha, "rank": rank}), "lora.safetensors")
        else:
            _emit(path, tensors, (peft.CONFIG, {
                "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
                "use_rslora": layout == "peft-rslora", "bias": "none",
                "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules})}), peft.WEIGHTS)
        return TinyAdapter(path, "peft" if layout.startswith("peft") else layout, half, truth)

    if layout in ("comfyui", "lora.json"):
        for layer in range(config.num_hidden_layers):
            for nar in ((False, True) if half == "both" else (half == "nar",)):
                prefix = f"{'diffusion_model' if nar else 'text_encoders'}.model.layers.{layer}."
                names = {site: f"model.layers.{layer}.{_tag(site, nar)}" for site in AR_SITES}
                # qkv block-diagonal (rank 3r), gate_up with a shared A (rank r), o and down plain.
                qkv = [factors(names[s]) for s in AR_SITES[:3]]
                down = torch.cat([a for a, _ in qkv])
                up = torch.block_diag(*[b for _, b in qkv])
                gate_a, gate_b = factors(names["mlp.gate_proj"])
                _, up_b = factors(names["mlp.up_proj"])
                fused = {"self_attn.qkv_proj": (down, up, 3 * rank), "mlp.gate_up_proj": (gate_a, torch.cat([gate_b, up_b]), rank),
                         "self_attn.o_proj": (*factors(names["self_attn.o_proj"]), rank),
                         "mlp.down_proj": (*factors(names["mlp.down_proj"]), rank)}
                for site, (a, b, r) in fused.items():
                    module_alpha = alpha * r / rank  # the same scale for every module: alpha / rank
                    up_key, down_key = ("lora_B.weight", "lora_A.weight") if nar else ("lora_up.weight",
                                                                                     "lora_down.weight")
                    tensors[f"{prefix}{site}.{down_key}"], tensors[f"{prefix}{site}.{up_key}"] = a, b
                    if layout == "comfyui":
                        tensors[f"{prefix}{site}.alpha"] = torch.tensor(module_alpha)
                for site, (a, b) in zip(AR_SITES[:3], qkv):
                    truth[names[site]] = [LowRank(a.float(), b.float(), alpha / rank)]
                truth[names["mlp.gate_proj"]] = [LowRank(gate_a.float(), gate_b.float(), alpha / rank)]
                truth[names["mlp.up_proj"]] = [LowRank(gate_a.float(), up_b.float(), alpha / rank)]
                for site in ("self_attn.o_proj", "mlp.down_proj"):
                    a, b, _ = fused[site]
                    truth[names[site]] = [LowRank(a.float(), b.float(), alpha / rank)]
        if layout == "lora.json":
            # One alpha for the file: the fused qkv's rank is 3r, so its scale differs from the others'.
            for layer in range(config.num_hidden_layers):
                for module, edits in truth.items():
                    if module.startswith(f"model.layers.{layer}.") and module.split(".")[-1] in ("q_proj", "k_proj",
                                                                                                "v_proj"):
                        truth[module] = [LowRank(edits[0].a, edits[0].b, alpha / (3 * rank))]
        if half != "ar" and replacements:
            extras("diff")
        if layout == "comfyui":
            _emit(path, tensors)
        else:
            _emit(path, tensors, ("lora.json", {"alpha": alpha, "triggers": ["tinystyle"]}),
                  f"{path.name}.safetensors")
        return TinyAdapter(path, layout, half, truth)

    if layout == "slider-distill":
        for module in _modules(config, "ar", SLIDER_SITES):
            a, b = factors(module)
            key = "adapters." + module.replace(".", "-")
            tensors[f"{key}.lora_down.weight"], tensors[f"{key}.lora_up.weight"] = a, b
            tensors[f"{key}.alpha"] = torch.tensor(alpha)
            truth[module] = [LowRank(a.float(), b.float(), alpha / rank)]
        _emit(path, tensors, metadata={"conceptmod": json.dumps({"format": "conceptmod-yue2-ar-v1", "rank": rank,
                                                                 "alpha": alpha})})
        return TinyAdapter(path, layout, "ar", truth)

    # Refused layouts: the real marker tensors beside otherwise ordinary LoRA pairs.
    module = "model.layers.0.self_attn.q_proj"
    a, b = factors(module)
    tensors = {"layers.0.self_attn.q_proj.lora_A": a, "layers.0.self_attn.q_proj.lora_B": b}
    if layout == "lokr":
        tensors = {"layers.0.self_attn.q_proj.lokr_w1": a[:, :4].contiguous(), "layers.0.self_attn.q_proj.lokr_w2": b}
    elif layout == "particles":
        tensors["particles"] = torch.randn(128, 4, generator=generator)
        metadata = {"conceptmod": json.dumps({"format": "conceptmod-yue2-routed-particle-ar-v1", "rank": 8})}
    elif layout == "lm_head":
        tensors["lm_head.lora_A"] = torch.zeros(rank, config.hidden_size, dtype=dtype)
        tensors["lm_head.lora_B"] = torch.zeros(config.vocab_size, rank, dtype=dtype)
    if layout == "dora":
        a_key, b_key = peft.lora_keys(module)
        _emit(path, {a_key: a, b_key: b, f"{peft.KEY_PREFIX}{module}.lora_magnitude_vector": torch.ones(b.shape[0])},
              (peft.CONFIG, {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_dora": True,
                             "target_modules": ["q_proj"]}), peft.WEIGHTS)
    else:
        _emit(path, tensors, metadata=metadata)
    return TinyAdapter(path, layout, "ar", {})


def write_merged_model(model_dir: str | os.PathLike, out_dir: str | os.PathLike, edits,
                       dtype: torch.dtype | None = torch.float32) -> Path:
    """A copy of a tiny model directory with `edits` merged into its weights, to compare the run-time path with.
    The merged tensors are stored as `dtype` (float32: W + s·BA unrounded, for float32 runs; None: their own)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from .model.lora import merge_state_dict

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    state = load_file(str(model_dir / "model.safetensors"))
    if dtype is not None:
        state = {name: tensor.to(dtype) if name.rsplit(".", 1)[0] in edits else tensor for name, tensor in state.items()}
    state = merge_state_dict(state, edits)
    with atomic_directory(out_dir) as tmp:
        for item in model_dir.iterdir():
            if item.name != "model.safetensors" and item.is_file():
                shutil.copyfile(item, tmp / item.name)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
    return out_dir
