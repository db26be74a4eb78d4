"""One AR decode step for a song's CFG branches as a batch, eager or captured in a CUDA graph.

`BranchDecoder` keeps one K/V buffer per layer, `[branches, capacity, kv_heads, head_dim]`
(sequence-major, so FlashAttention's packed varlen view needs no copy). Each branch's prefix is
prefilled into its own row by the ordinary `forward_ar` (one causal SDPA call per branch: no
attention matrix, logits of the last position only); then every step feeds one shared token to
all rows, writes each row's K/V at its own position and attends over that row's used length.
Each branch keeps its own RoPE positions; rows never see each other.

The step's logits cover only the phase's own rows of the lm_head (`PhaseRows`: the 32,768 codec
ids + MUSIC_END for semantic, the ordinary text ids + `</abc>` for abc), as one slice of the
weight per contiguous range, never a copy.

With `capture=True` (CUDA only) the step is warmed up on a side stream and captured once; each
token then costs one graph replay. With `capture=False` the very same step runs eagerly: that is
what the CPU tests compare against the two-forward path of `TorchARBackend`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .modeling import StaticKVCache, YuE2Model, rope_angles, sdpa
from ..protocol import allowed_token_ids

GRAPH_WARMUP_RUNS = 3  # eager runs on the side stream before capture (cuBLAS / allocator settle)
ATTENTION_KINDS = ("auto", "flash_varlen", "sdpa_masked")
AR_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class PhaseRows:
    """The vocabulary ids a phase may sample, as sorted half-open ranges of lm_head rows."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def for_phase(cls, phase: str) -> "PhaseRows":
        """`protocol.allowed_token_ids(phase)` as runs of consecutive ids."""
        if phase not in ("abc", "semantic"):
            raise ValueError(f"phase must be 'abc' or 'semantic', got {phase!r}")
        ranges: list[list[int]] = []
        for token in sorted(allowed_token_ids(phase)):
            if ranges and ranges[-1][1] == token:
                ranges[-1][1] = token + 1
            else:
                ranges.append([token, token + 1])
        return cls(tuple((start, stop) for start, stop in ranges))

    @property
    def size(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def index_of(self, token: int) -> int:
        """Position of vocabulary id `token` among the rows."""
        offset = 0
        for start, stop in self.ranges:
            if start <= token < stop:
                return offset + token - start
            offset += stop - start
        raise ValueError(f"token {token} is not among the phase's rows")

    def ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.cat([torch.arange(start, stop, device=device) for start, stop in self.ranges])

    def logits(self, lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """`lm_head(hidden)` restricted to these rows, in vocabulary order."""
        weight = lm_head.weight
        bias = getattr(lm_head, "bias", None)
        parts = [F.linear(hidden, weight[start:stop], None if bias is None else bias[start:stop])
                 for start, stop in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def flash_varlen_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when aten's varlen FlashAttention with `seqused_k` can run the step, else why not."""
    if device.type != "cuda":
        return f"FlashAttention runs on CUDA only (the model is on {device})"
    if getattr(torch.version, "hip", None):
        return "the ROCm varlen FlashAttention op rejects seqused_k"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashAttention needs bf16/fp16, the model is {str(dtype).removeprefix('torch.')}"
    if head_dim % 8 or head_dim > 256:
        return f"FlashAttention needs head_dim a multiple of 8 up to 256, got {head_dim}"
    if not sys.platform.startswith("linux"):
        return f"torch wheels for {sys.platform} ship no FlashAttention kernel"
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or "seqused_k" not in str(op.default._schema):
        return f"torch {torch.__version__} has no aten._flash_attention_forward with seqused_k"
    return None


def select_attention(device: torch.device, dtype: torch.dtype, head_dim: int, requested: str = "auto") -> str:
    """`flash_varlen` where torch offers it on this device, else `sdpa_masked` (SDPA over the whole buffer with a
    boolean mask of each row's used length)."""
    if requested not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {requested!r}")
    missing = flash_varlen_available(device, dtype, head_dim)
    if requested == "flash_varlen" and missing:
        raise ValueError(f"attention flash_varlen is unavailable: {missing}")
    if requested == "auto":
        return "sdpa_masked" if missing else "flash_varlen"
    return requested


def graph_refusal(model: YuE2Model) -> str | None:
    """Why the AR linears as they are now (bf16, or load-time/checkpoint proxies) must not be captured, or None.

    Capturable: nn.Linear; FP8Linear on CUDA (`_scaled_mm` with its dynamic scales computed on the device:
    no host sync, no shape that changes between steps); Int8Linear (packed kernel or dequantise + F.linear,
    both plain device ops). gpu_check's `torch.graph` section compares graph and eager tokens for FP8 proxies.
    Anything else (an FP8 reference proxy, an unknown module) runs eager, with this reason recorded.
    """
    from .torch_quant import FP8Linear, Int8Linear

    for index, layer in enumerate(model.model.layers):
        for owner in (layer.self_attn, layer.mlp):
            for name in AR_LINEAR_NAMES:
                module = getattr(owner, name, None)
                if module is None or type(module) in (nn.Linear, Int8Linear):
                    continue
                if type(module) is FP8Linear and not module.reference:
                    continue
                what = "an FP8 reference proxy (dequantising, for tests)" if type(module) is FP8Linear \
                    else f"{type(module).__name__}"
                return f"layer {index} {name} is {what}: not validated for CUDA graph capture"
    return None


class BranchDecoder:
    """The decode of 1 or 2 branches (a song and its CFG negative) over one shared K/V buffer.

    `prefill()` returns the branches' logits `[branches, rows]` of the first token; each of at most
    `max_tokens - 1` calls to `step(token)` feeds that one token to every branch and returns the next
    logits. Captured, the returned tensor is the graph's static output: valid until the next step.
    """

    def __init__(self, model: YuE2Model, prefixes: Sequence[Sequence[int]], max_tokens: int, *,
                 rows: PhaseRows, capture: bool = False, attention: str = "auto"):
        config = model.config
        if len(prefixes) not in (1, 2):
            raise ValueError(f"a BranchDecoder takes one prefix or a CFG pair, got {len(prefixes)}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        for prefix in prefixes:
            if not prefix or min(prefix) < 0 or max(prefix) >= config.vocab_size:
                raise ValueError("every branch prefix must be non-empty token ids inside the vocabulary")
            if len(prefix) + max_tokens > config.max_position_embeddings:
                raise ValueError(f"{len(prefix)} prefix tokens + {max_tokens} exceed the "
                                 f"{config.max_position_embeddings}-token context; nothing was truncated")
        device, dtype = model.device, model.dtype
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graph capture needs a CUDA device; the model is on {device} "
                             "(capture=False runs the same step eagerly)")
        self.model, self.rows, self.device = model, rows, device
        self.prefixes = [[int(t) for t in prefix] for prefix in prefixes]
        self.branches, self.max_tokens = len(prefixes), max_tokens
        self.capacity = max(map(len, self.prefixes)) + max_tokens
        self.attention = select_attention(device, dtype, config.head_dim, attention)
        self.capture, self.graph, self.output = capture, None, None
        self.capture_seconds, self.graph_bytes = 0.0, 0
        self.steps, self.ready = 0, False
        shape = (self.branches, self.capacity, config.num_key_value_heads, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.kv_bytes = 2 * len(self.keys) * self.keys[0].numel() * self.keys[0].element_size()
        self.initial_positions = torch.tensor([len(p) for p in self.prefixes], dtype=torch.long, device=device)
        self.positions = self.initial_positions.clone()
        self.tokens = torch.zeros(self.branches, 1, dtype=torch.long, device=device)
        self.key_positions = torch.arange(self.capacity, device=device)
        self.cu_q = torch.arange(self.branches + 1, dtype=torch.int32, device=device)
        self.cu_k = self.cu_q * self.capacity

    def row_cache(self, branch: int) -> StaticKVCache:
        """A `StaticKVCache` writing through into row `branch` of the shared buffers."""
        return StaticKVCache.over([k[branch:branch + 1].transpose(1, 2) for k in self.keys],
                                  [v[branch:branch + 1].transpose(1, 2) for v in self.values])

    @torch.inference_mode()
    def prefill(self) -> torch.Tensor:
        """Each branch's prefix into its rows (eager); then, when capturing, the step's graph."""
        if self.ready:
            raise RuntimeError("prefill runs once per BranchDecoder")
        model, logits = self.model, []
        for branch, prefix in enumerate(self.prefixes):
            hidden = model.hidden_ar(torch.tensor([prefix], device=self.device), self.row_cache(branch))
            logits.append(self.rows.logits(model.lm_head, hidden[:, -1]))
        if self.capture and self.max_tokens > 1:
            self._capture()
        self.ready = True
        return torch.cat(logits)

    @torch.inference_mode()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one shared token (a one-element integer tensor, on any device) to every branch."""
        if not self.ready:
            raise RuntimeError("call prefill() before step()")
        if self.steps >= self.max_tokens - 1:
            raise ValueError(f"the phase's budget of {self.max_tokens} tokens is exhausted "
                             f"({self.steps} steps after the prefill)")
        if token.numel() != 1 or token.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"step needs one shared integer token, got {token.dtype} {list(token.shape)}")
        self.tokens.copy_(token.reshape(1, 1).expand(self.branches, 1), non_blocking=True)
        self.steps += 1
        if self.graph is not None:
            self.graph.replay()
            return self.output
        return self._decode()

    def _decode(self) -> torch.Tensor:
        """One token for every branch at its own position; advances the positions (on the device)."""
        model, config, b = self.model, self.model.config, self.branches
        backbone = model.model
        cos, sin = rope_angles(self.positions[:, None], config.head_dim, config.rope_theta)
        mask = None
        if self.attention == "sdpa_masked":
            mask = (self.key_positions[None, :] <= self.positions[:, None])[:, None, None, :]
        used = (self.positions + 1).to(torch.int32)
        slots = self.positions[:, None, None, None].expand(b, 1, config.num_key_value_heads, config.head_dim)
        x = backbone.embed_tokens(self.tokens)
        for layer, keys, values in zip(backbone.layers, self.keys, self.values):
            attn = layer.self_attn
            q, k, v = attn.project_qkv(layer.input_layernorm(x), cos, sin)
            keys.scatter_(1, slots, k)  # each row's K/V at its own position (no host sync, capturable)
            values.scatter_(1, slots, v)
            if self.attention == "flash_varlen":
                out = torch.ops.aten._flash_attention_forward(
                    q[:, 0], keys.view(-1, *keys.shape[2:]), values.view(-1, *values.shape[2:]), self.cu_q,
                    self.cu_k, 1, self.capacity, 0.0, False, False, seqused_k=used)[0]
            else:
                out = sdpa(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask)
                out = out.transpose(1, 2)
            x = x + attn.o_proj(out.reshape(b, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.rows.logits(model.lm_head, backbone.norm(x)[:, 0])
        self.positions.add_(1)
        return logits

    def _capture(self) -> None:
        device = self.device
        reserved = torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        with torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            side = torch.cuda.Stream(device=device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(GRAPH_WARMUP_RUNS):
                    self._decode()
                    self.positions.copy_(self.initial_positions)
            current.wait_stream(side)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                output = self._decode()
            # Warm-up and capture wrote one slot past each prefix: the first real step overwrites it
            # in every layer before the mask (or seqused_k) makes it visible.
            self.positions.copy_(self.initial_positions)
            torch.cuda.synchronize(device)
        self.graph, self.output = graph, output
        self.capture_seconds = time.perf_counter() - start
        self.graph_bytes = max(0, torch.cuda.memory_reserved(device) - reserved)  # warm-up cache + graph pool

    def close(self) -> None:
        """Drop the graph and the buffers (the decoder cannot step afterwards)."""
        self.graph = self.output = None
        self.keys.clear()
        self.values.clear()
        self.ready = False
