"""The YuE2 AR–NAR Mixture-of-Transformers in plain torch, with checkpoint-compatible names.

Each decoder layer holds two experts: the AR expert (`input_layernorm`, `self_attn`,
`post_attention_layernorm`, `mlp`) writes tokens; the NAR expert (`nar_*`) predicts the
flow-matching velocity of audio latents while attending to the AR expert's keys.

Numerics follow upstream bit for bit where it matters: RMSNorm multiplies in the input dtype,
q/k norms come before NeoX RoPE (theta 1e6), the timestep embedding is `[cos, sin]` of the
unscaled t, and attention goes through SDPA with the same shapes and masks.
"""
from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import Expected, model_file, read_json
from .lora import Edits, Segment, applied

CONFIG_FILE = "config.json"
LOG = logging.getLogger(__name__)
FREQUENCY_EMBEDDING_SIZE = 256
AR_LAYER_TENSORS = (
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
NAR_LAYER_TENSORS = (
    "nar_input_layernorm.weight", "nar_self_attn.q_proj.weight", "nar_self_attn.k_proj.weight",
    "nar_self_attn.v_proj.weight", "nar_self_attn.o_proj.weight", "nar_self_attn.q_norm.weight",
    "nar_self_attn.k_norm.weight", "nar_pre_mlp_layernorm.weight", "nar_mlp.gate_proj.weight",
    "nar_mlp.up_proj.weight", "nar_mlp.down_proj.weight",
)
# Keys of a Hugging Face config.json that carry no model fact for us (ignored without a note).
_HF_KEYS = frozenset({
    "model_type", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "return_dict",
    "output_hidden_states", "output_attentions", "use_cache", "torchscript", "is_decoder", "is_encoder_decoder",
    "add_cross_attention", "bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
    "attn_implementation",
})


@dataclass(frozen=True)
class YuE2Config:
    """The MoT's shape; defaults are the released YuE2-3B values."""

    hidden_size: int = 2048
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 6144
    vocab_size: int = 184704
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 24576
    tie_word_embeddings: bool = False
    latent_type: str = "vae"
    latent_dim: int = 64
    max_latent_frames: int = 24576
    timestep_shift: float = 1.0

    def __post_init__(self):
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings", "latent_dim", "max_latent_frames"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("config.num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("config.head_dim must be even (RoPE rotates halves)")
        if self.latent_type != "vae":
            raise ValueError(f"config.latent_type must be 'vae', got {self.latent_type!r}")
        if self.tie_word_embeddings:
            raise ValueError("config.tie_word_embeddings must be false (YuE2 has a separate lm_head)")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0 or not self.timestep_shift > 0:
            raise ValueError("config.rms_norm_eps, rope_theta and timestep_shift must be positive")

    @classmethod
    def from_dict(cls, data: dict) -> "YuE2Config":
        """Known fields are checked; any other key (`_name_or_path`, whatever another transformers
        version's `save_pretrained` adds) is ignored, as upstream's config class ignores it."""
        if not isinstance(data, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - _HF_KEYS)
        if unknown:
            LOG.debug("config.json: ignoring unknown field(s) %s", unknown)
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, model_dir: str | os.PathLike) -> "YuE2Config":
        path = model_file(model_dir, CONFIG_FILE)
        try:
            return cls.from_dict(read_json(path))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None

    def to_dict(self) -> dict:
        return {"architectures": ["YuE2ForCausalLM"], "model_type": "yue2", "dtype": "bfloat16", **asdict(self)}


def ar_tensor_shapes(config: YuE2Config) -> dict[str, tuple[int, ...]]:
    """The 3 + 11·layers tensors of the AR half (what vLLM's Qwen3 needs)."""
    h, hd, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    per_layer = {
        "input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,), "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
    }
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (config.vocab_size, h)}
    for layer in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def ar_streamed_shapes(config: YuE2Config) -> dict[str, tuple[int, ...]]:
    """The AR-expert tensors a discrete GPU's torch side keeps in pinned host memory (`model.placement`): all
    of `ar_tensor_shapes` but the final norm, which the NAR's velocity runs too."""
    return {name: shape for name, shape in ar_tensor_shapes(config).items() if name != "model.norm.weight"}


def tensor_shapes(config: YuE2Config) -> dict[str, tuple[int, ...]]:
    """All tensors of the full MoT checkpoint (628 for the released config)."""
    shapes = ar_tensor_shapes(config)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for ar_name, nar_name in zip(AR_LAYER_TENSORS, NAR_LAYER_TENSORS):
            shapes[prefix + nar_name] = shapes[prefix + ar_name]
    h, d = config.hidden_size, config.latent_dim
    shapes.update({
        "llm2vae.weight": (d, h), "llm2vae.bias": (d,), "vae2llm.weight": (h, d), "vae2llm.bias": (h,),
        "time_embedder.mlp.0.weight": (h, FREQUENCY_EMBEDDING_SIZE), "time_embedder.mlp.0.bias": (h,),
        "time_embedder.mlp.2.weight": (h, h), "time_embedder.mlp.2.bias": (h,),
        "latent_pos_embed.pe": (config.max_latent_frames, h),
    })
    return shapes


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The statistic is fp32, but the multiplies stay in x's dtype (unlike HF/vLLM Qwen3).
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin of shape `positions.shape + (head_dim // 2,)`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.float().unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (half-split) rotation; cos/sin are cast to x's dtype first."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: YuE2Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """`[B, T, hidden]` → q `[B, T, H, D]`, k/v `[B, T, KVH, D]`; q/k normed, then rotated."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        return apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin), v


class MLP(nn.Module):
    def __init__(self, config: YuE2Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
         is_causal: bool = False) -> torch.Tensor:
    """SDPA over `[B, heads, T, dim]` with grouped-query K/V; CPU and CUDA make exactly one native call.

    On MPS, upstream's two workarounds: K/V are repeated to the query heads (MPS SDPA lacks
    `enable_gqa` on some releases), and in half precision `is_causal` becomes an explicit
    lower-triangular mask (the MPS half kernel of torch <= 2.12 can expose future keys in blocks of
    four query rows).
    """
    if query.device.type == "mps":
        key, value, attn_mask, is_causal = mps_sdpa_inputs(query, key, value, attn_mask, is_causal)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                          enable_gqa=query.shape[1] != key.shape[1])


def mps_sdpa_inputs(query, key, value, attn_mask, is_causal):
    """`(key, value, attn_mask, is_causal)` for MPS: K/V repeated per query head; a half-precision causal
    call as an explicit lower-triangular mask."""
    if query.shape[1] != key.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if is_causal and query.dtype in (torch.float16, torch.bfloat16):
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        is_causal = False
    return key, value, attn_mask, is_causal


class DecoderLayer(nn.Module):
    """One layer, both experts. Only the AR path has a forward here; the NAR path is driven by CachedNAR."""

    def __init__(self, config: YuE2Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.nar_input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.nar_self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.nar_pre_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.nar_mlp = MLP(config)

    def forward_ar(self, x, cos, sin, cache: "StaticKVCache | None", index: int, mask: torch.Tensor | None):
        b, t, _ = x.shape
        q, k, v = self.self_attn.project_qkv(self.input_layernorm(x), cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.append(index, k, v)
        if mask is not None:
            out = sdpa(q, k, v, attn_mask=mask)
        else:
            out = sdpa(q, k, v, is_causal=t > 1 and k.shape[2] == t)
        x = x + self.self_attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: YuE2Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class TimestepEmbedder(nn.Module):
    """`[cos(t·f), sin(t·f)]` over 128 frequencies (t in [0, 1], not ×1000) → Linear → SiLU → Linear."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FREQUENCY_EMBEDDING_SIZE, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = FREQUENCY_EMBEDDING_SIZE // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t.float().unsqueeze(-1) * freqs.unsqueeze(0)
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(embedding.to(self.mlp[0].weight.dtype))


def sinusoid_table(frames: int, hidden: int) -> torch.Tensor:
    """The audio position table: even columns sin(pos·div), odd columns cos(pos·div), fp32."""
    table = torch.zeros(frames, hidden)
    position = torch.arange(0, frames, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, hidden, 2, dtype=torch.float32) * (-math.log(10000.0) / hidden))
    table[:, 0::2] = torch.sin(position * div)
    table[:, 1::2] = torch.cos(position * div)
    return table


class AudioPositionEmbedding(nn.Module):
    """Fixed table `pe`, stored in the checkpoint (bf16) and loaded from it."""

    def __init__(self, frames: int, hidden: int):
        super().__init__()
        self.register_buffer("pe", torch.zeros(frames, hidden))


class StaticKVCache:
    """Preallocated per-layer K/V `[B, KVH, capacity, D]`; appends never reallocate.

    The length advances after the last layer has appended, so every layer of one forward
    sees the same positions.
    """

    def __init__(self, config: YuE2Config, capacity: int, *, batch: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
        if capacity < 1:
            raise ValueError(f"KV cache capacity must be positive, got {capacity}")
        shape = (batch, config.num_key_value_heads, capacity, config.head_dim)
        self.num_layers, self.capacity, self.length = config.num_hidden_layers, capacity, 0
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]

    @classmethod
    def over(cls, keys: list[torch.Tensor], values: list[torch.Tensor]) -> "StaticKVCache":
        """A cache that appends into given per-layer `[B, KVH, capacity, D]` tensors (views of a larger
        buffer are written through; nothing is allocated)."""
        cache = cls.__new__(cls)
        cache.num_layers, cache.capacity, cache.length = len(keys), keys[0].shape[2], 0
        cache.keys, cache.values = list(keys), list(values)
        return cache

    def reset(self) -> None:
        """Forget every position so the same buffers serve a new sequence (nothing is reallocated;
        stale entries beyond `length` are never read)."""
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} exceeded ({end} tokens); nothing was truncated")
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        if layer == self.num_layers - 1:
            self.length = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


# --------------------------------------------------------------------------- the model


class YuE2Model(nn.Module):
    """The full MoT. `forward_ar` serves token generation; `CachedNAR` serves the flow-matching velocity."""

    def __init__(self, config: YuE2Config):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.llm2vae = nn.Linear(config.hidden_size, config.latent_dim)
        self.vae2llm = nn.Linear(config.latent_dim, config.hidden_size)
        self.time_embedder = TimestepEmbedder(config.hidden_size)
        self.latent_pos_embed = AudioPositionEmbedding(config.max_latent_frames, config.hidden_size)

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def new_cache(self, capacity: int, batch: int = 1) -> StaticKVCache:
        return StaticKVCache(self.config, capacity, batch=batch, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward_ar(self, input_ids: torch.Tensor, cache: StaticKVCache | None = None,
                   logits_to_keep: int = 1) -> torch.Tensor:
        """AR expert only: logits `[B, keep, vocab]` of the last `logits_to_keep` positions (0 = all).

        Without a cache this is a plain causal forward; with one it is a prefill (empty cache),
        a chunked prefill (bottom-right causal mask) or a one-token decode.
        """
        return self.lm_head(self.hidden_ar(input_ids, cache, logits_to_keep))

    @torch.inference_mode()
    def hidden_ar(self, input_ids: torch.Tensor, cache: StaticKVCache | None = None,
                  keep: int = 1) -> torch.Tensor:
        """`forward_ar` before the lm_head: the final-normed hidden states `[B, keep, hidden]` (0 = all)."""
        if input_ids.ndim != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [batch, tokens] with tokens >= 1, got {list(input_ids.shape)}")
        past, count = (cache.length if cache is not None else 0), input_ids.shape[1]
        positions = torch.arange(past, past + count, device=input_ids.device)[None]
        cos, sin = rope_angles(positions, self.config.head_dim, self.config.rope_theta)
        mask = None
        if past and count > 1:
            keys = torch.arange(past + count, device=input_ids.device)
            mask = (keys[None, :] <= positions[0, :, None])[None, None]
        x = self.model.embed_tokens(input_ids)
        for index, layer in enumerate(self.model.layers):
            x = layer.forward_ar(x, cos, sin, cache, index, mask)
        hidden = self.model.norm(x)
        return hidden[:, -keep:] if keep else hidden

    def shifted_timestep(self, raw_t: float) -> torch.Tensor:
        """`sigmoid(raw_t)` in the model dtype, then the timestep shift (identity at 1.0)."""
        t = torch.sigmoid(torch.tensor(raw_t, dtype=self.dtype, device=self.device))
        shift = self.config.timestep_shift
        return shift * t / (1 + (shift - 1) * t)


# --------------------------------------------------------------------------- cached NAR velocity


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
           query_block: int | None = None) -> torch.Tensor:
    """SDPA over `[tokens, heads, dim]`; on CPU queries go in blocks of 256 to bound the score memory.

    Blocking never changes the visible key set: a later causal block gets an explicit mask
    of its absolute query positions.
    """
    query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    block = query_block or (len(q) if q.device.type == "cuda" else 256)
    outputs = []
    for start in range(0, len(q), block):
        end = min(start + block, len(q))
        used_key, used_value = (key[..., :end, :], value[..., :end, :]) if causal else (key, value)
        mask = None
        if causal and start:
            mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
        outputs.append(sdpa(query[..., start:end, :], used_key, used_value, attn_mask=mask,
                            is_causal=causal and start == 0))
    return torch.cat(outputs, dim=-2)[0].transpose(0, 1)


AR_EXPERT_MODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")  # a layer's AR half


def staged(module: nn.Module, device: torch.device) -> nn.Module:
    """A shallow clone of `module` whose parameters and buffers are device copies (from pinned memory, without
    blocking); the module itself is not touched, so another stage never sees it change."""
    clone = copy.copy(module)
    # Plain tensors (the prefill runs under inference_mode, whose tensors are not made Parameters).
    clone._parameters = {name: None if p is None else p.detach().to(device, non_blocking=True)
                         for name, p in module._parameters.items()}
    clone._buffers = {name: None if b is None else b.to(device, non_blocking=True)
                      for name, b in module._buffers.items()}
    clone._modules = {name: None if m is None else staged(m, device) for name, m in module._modules.items()}
    return clone


class CachedNAR:
    """Velocity of one NAR chunk, reusing the AR expert's keys/values of its token prefix.

    The prefix (`ar_tokens`: text/ABC prompt + the chunk's codec ids + MUSIC_END) is prefilled
    once with AR weights. Each `velocity(state, raw_t)` then runs only the `frames + 2` NAR
    slots (a zero latent before and after the content), whose RoPE positions continue after the
    prefix while `latent_pos_embed` counts from 0, attending bidirectionally over AR + NAR keys.
    `edits` (the song's adapters, `lora.Edits`) apply to both: the AR ones in the prefill, the NAR ones in
    every velocity, at run time (`lora.applied`).
    """

    def __init__(self, model: YuE2Model, ar_tokens: Sequence[int], frames: int, *, query_block: int | None = None,
                 stream: bool | None = None, edits: Edits | None = None):
        config = model.config
        if not ar_tokens or min(ar_tokens) < 0 or max(ar_tokens) >= config.vocab_size:
            raise ValueError("NAR prefix must be non-empty token ids inside the vocabulary")
        if frames < 1:
            raise ValueError(f"NAR chunk needs at least one frame, got {frames}")
        self.model, self.frames, self.query_block, self.edits = model, frames, query_block, edits or {}
        self.prefix_length, self.slots = len(ar_tokens), frames + 2
        if self.prefix_length + self.slots > config.max_position_embeddings:
            raise ValueError(f"NAR chunk of {self.prefix_length} prefix + {self.slots} latent slots exceeds "
                             f"the {config.max_position_embeddings}-token context")
        device = model.device
        positions = torch.arange(self.prefix_length, self.prefix_length + self.slots, device=device)[None]
        self.cos, self.sin = rope_angles(positions, config.head_dim, config.rope_theta)
        local = torch.arange(self.slots, device=device).clamp(max=config.max_latent_frames - 1)
        self.pos_emb = model.latent_pos_embed.pe[local][None]
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        with applied(model, self.edits):
            self._prefill(torch.tensor([list(ar_tokens)], dtype=torch.long, device=device), stream)

    @torch.inference_mode()
    def _prefill(self, ids: torch.Tensor, stream: bool | None = None) -> None:
        """The AR expert over the prefix, resident or (its weights in host memory: `placement`) streamed to the
        device one layer at a time; the embedding rows are gathered where the table lives (exact either way).
        `prefill_weights` and `streamed_bytes` say which; `stream` None decides by where the weights are."""
        backbone, config = self.model.model, self.model.config
        cos, sin = rope_angles(torch.arange(ids.shape[1], device=ids.device)[None], config.head_dim, config.rope_theta)
        table = backbone.embed_tokens.weight.device
        streamed = backbone.layers[0].post_attention_layernorm.weight.device != ids.device if stream is None else stream
        self.prefill_weights, self.streamed_bytes = ("streamed" if streamed else "resident"), 0
        x = backbone.embed_tokens(ids.to(table)).to(ids.device)
        for resident in backbone.layers:
            layer = resident
            if streamed:  # this layer's AR half on the device for its step only
                layer = SimpleNamespace(**{name: staged(getattr(resident, name), ids.device)
                                           for name in AR_EXPERT_MODULES})
                self.streamed_bytes += sum(t.numel() * t.element_size() for name in AR_EXPERT_MODULES
                                           for t in (*getattr(resident, name).parameters(),
                                                     *getattr(resident, name).buffers()))
            q, k, v = layer.self_attn.project_qkv(layer.input_layernorm(x), cos, sin)
            self.kv.append((k[0], v[0]))
            h = attend(q[0], k[0], v[0], causal=True, query_block=self.query_block)
            x = x + layer.self_attn.o_proj(h.flatten(1)[None])
            x = x + layer.mlp(layer.post_attention_layernorm(x))

    @torch.inference_mode()
    def velocity(self, state: torch.Tensor, raw_t: float) -> torch.Tensor:
        """`state [frames, latent_dim]` at raw (logit) time `raw_t` → velocity of the same shape."""
        if not self.kv:
            raise RuntimeError("CachedNAR was closed")
        if state.ndim != 2 or state.shape[0] != self.frames:
            raise ValueError(f"state must be [{self.frames}, latent_dim], got {list(state.shape)}")
        with applied(self.model, self.edits):
            return self._velocity(state, raw_t)

    def _velocity(self, state: torch.Tensor, raw_t: float) -> torch.Tensor:
        model = self.model
        x = model.vae2llm(F.pad(state, (0, 0, 1, 1))[None])
        x = x + model.time_embedder(model.shifted_timestep(raw_t).expand(self.slots))[None]
        x = x + self.pos_emb
        for layer, (ar_k, ar_v) in zip(model.model.layers, self.kv):
            q, k, v = layer.nar_self_attn.project_qkv(layer.nar_input_layernorm(x), self.cos, self.sin)
            h = attend(q[0], torch.cat((ar_k, k[0])), torch.cat((ar_v, v[0])), query_block=self.query_block)
            x = x + layer.nar_self_attn.o_proj(h.flatten(1)[None])
            x = x + layer.nar_mlp(layer.nar_pre_mlp_layernorm(x))
        return model.llm2vae(model.model.norm(x))[0, 1:-1]

    def close(self) -> None:
        """Release the prefix K/V (about 114 KB per prefix token at full size)."""
        self.kv.clear()


@torch.inference_mode()
def batched_velocities(nars: Sequence[CachedNAR], states: Sequence[torch.Tensor], raw_t: float) -> list[torch.Tensor]:
    """`CachedNAR.velocity` of several chunks (of one song or of many) in one pass.

    The NAR slots of all chunks are packed into one ragged token batch: every per-token op
    (norms, projections, RoPE, MLP) runs once over all of them, and only the attention is done
    per chunk, over that chunk's own AR prefix and slots. Each chunk's result equals its
    single-chunk velocity up to the rounding of the larger matmuls. Chunks with adapters (`CachedNAR.edits`)
    get them on their own rows only (`lora.Segment`), so songs with different adapters share the pass.
    """
    if len(nars) == 1:
        return [nars[0].velocity(states[0], raw_t)]
    model = nars[0].model
    for nar, state in zip(nars, states):
        if not nar.kv or nar.model is not model:
            raise RuntimeError("batched NAR chunks must be open and belong to one model")
        if state.ndim != 2 or state.shape[0] != nar.frames:
            raise ValueError(f"state must be [{nar.frames}, latent_dim], got {list(state.shape)}")
    bounds = torch.tensor([0] + [nar.slots for nar in nars]).cumsum(0).tolist()
    segments = [Segment(nar.edits, start, end) for nar, start, end in zip(nars, bounds[:-1], bounds[1:]) if nar.edits]
    with applied(model, segments):
        return _batched_velocities(model, nars, states, raw_t, bounds, segments)


def _batched_velocities(model: YuE2Model, nars: Sequence[CachedNAR], states: Sequence[torch.Tensor], raw_t: float,
                        bounds: list[int], segments: list[Segment]) -> list[torch.Tensor]:
    x = model.vae2llm(torch.cat([F.pad(state, (0, 0, 1, 1)) for state in states])[None])
    timestep = model.shifted_timestep(raw_t)
    if segments:  # one timestep row per chunk, so that each gets its own adapter's time embedder
        with applied(model, [Segment(nar.edits, index, index + 1) for index, nar in enumerate(nars) if nar.edits]):
            rows = model.time_embedder(timestep.expand(len(nars)))
        x = x + rows.repeat_interleave(torch.tensor([nar.slots for nar in nars], device=rows.device), dim=0)[None]
    else:
        x = x + model.time_embedder(timestep.expand(1))[None]
    x = x + torch.cat([nar.pos_emb for nar in nars], dim=1)
    cos, sin = torch.cat([nar.cos for nar in nars], dim=1), torch.cat([nar.sin for nar in nars], dim=1)
    for index, layer in enumerate(model.model.layers):
        q, k, v = layer.nar_self_attn.project_qkv(layer.nar_input_layernorm(x), cos, sin)
        parts = []
        for nar, start, end in zip(nars, bounds[:-1], bounds[1:]):
            ar_k, ar_v = nar.kv[index]
            parts.append(attend(q[0, start:end], torch.cat((ar_k, k[0, start:end])),
                                torch.cat((ar_v, v[0, start:end])), query_block=nar.query_block))
        x = x + layer.nar_self_attn.o_proj(torch.cat(parts).flatten(1)[None])
        x = x + layer.nar_mlp(layer.nar_pre_mlp_layernorm(x))
    out = model.llm2vae(model.model.norm(x))[0]
    return [out[start + 1:end - 1] for start, end in zip(bounds[:-1], bounds[1:])]


# --------------------------------------------------------------------------- checkpoint layout


def checkpoint_layout(config: YuE2Config) -> dict[str, Expected]:
    """Names and shapes of a bf16/fp MoT checkpoint (the loader in `loader.py` reads it)."""
    return {name: Expected(shape) for name, shape in tensor_shapes(config).items()}


def assign_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put a loaded tensor in place of the (meta) parameter or buffer `name`."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if attr in owner._parameters:
        owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[attr] = tensor
