"""Token sampling for the AR half, and the torch AR backend.

The per-step logits pipeline reproduces upstream's torch path operation for operation, so
the same seed and torch version give the same tokens: fp32 cast (bf16 kept for cot=off's
"legacy" sampling), phase allow-mask, end token blocked below `min_tokens`, count-based
windowed repetition penalty, temperature, top-k (ties kept), top-p (keep ≥ 1, or 3 for
legacy), softmax and a seeded multinomial. Paired CFG mixes the two branches' bf16 logits.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Protocol, Sequence

import torch

from .modeling import YuE2Model
from ..protocol import CODEC_OFFSET, CODEC_SIZE, EOD, Sampling, check_budget, end_token

OnToken = Callable[[str, int], None]
Cancelled = Callable[[], bool]


class ARResult(NamedTuple):
    """Generated content ids (end token excluded), a timing record, and whether `max_tokens` cut it."""

    ids: list[int]
    timing: dict
    truncated: bool


class ARBackend(Protocol):
    """What the pipeline asks of an AR engine, per phase."""

    name: str

    def generate(self, prefix: Sequence[int], sampling: Sampling, seed: int, phase: str, *,
                 negative: Sequence[int] | None = None, cfg_scale: float = 1.0, legacy_off: bool = False,
                 on_token: OnToken | None = None, cancelled: Cancelled | None = None) -> ARResult: ...


# --------------------------------------------------------------------------- logits pipeline


def window_penalty(scores: torch.Tensor, recent: Sequence[int], penalty: float) -> torch.Tensor:
    """Count-based penalty: a token seen c times in `recent` gets α = penalty**c; negative ×α, else ÷α."""
    if penalty == 1.0 or len(recent) == 0:
        return scores
    ids = torch.as_tensor(list(recent), dtype=torch.long, device=scores.device).reshape(1, -1)
    counts = torch.zeros_like(scores)
    counts.scatter_add_(-1, ids, torch.ones_like(ids, dtype=scores.dtype))
    alpha = penalty ** counts
    return torch.where(scores < 0, scores * alpha, scores / alpha)


def phase_scores(logits: torch.Tensor, sampling: Sampling, history: Sequence[int], step: int, phase: str,
                 legacy_off: bool = False) -> torch.Tensor:
    """Scores `[1, vocab]` ready for softmax (or argmax when temperature is 0)."""
    scores = logits.clone() if legacy_off else logits.float().clone()
    end = end_token(phase)
    allowed = torch.full_like(scores, float("-inf"))
    if phase == "abc":
        allowed[..., :EOD] = 0
    else:
        allowed[..., CODEC_OFFSET:CODEC_OFFSET + CODEC_SIZE] = 0
    allowed[..., end] = 0
    scores = scores + allowed
    if step < sampling.min_tokens:
        scores[..., end] = -torch.inf
    scores = window_penalty(scores, history[-sampling.penalty_window:], sampling.repetition_penalty)
    if sampling.temperature == 0:
        return scores
    if sampling.temperature != 1:
        scores = scores / sampling.temperature
    threshold = scores.topk(min(sampling.top_k, scores.shape[-1])).values[..., -1, None]
    scores = scores.masked_fill(scores < threshold, -torch.inf)
    if sampling.top_p < 1:
        values, indices = scores.sort(descending=True)
        probabilities = values.softmax(-1)
        removed = probabilities.cumsum(-1) - probabilities > sampling.top_p
        removed[..., :3 if legacy_off else 1] = False
        values = values.masked_fill(removed, -torch.inf)
        scores = values.scatter(-1, indices, values)
    return scores


def sample(scores: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """Next id `[1, 1]`: argmax at temperature 0, else a seeded multinomial draw."""
    if temperature == 0:
        return scores.argmax(-1, keepdim=True)
    probabilities = scores.softmax(-1)
    if probabilities.device.type not in ("cpu", "cuda"):  # e.g. MPS: draw on the CPU generator
        return torch.multinomial(probabilities.cpu(), 1, generator=generator).to(probabilities.device)
    return torch.multinomial(probabilities, 1, generator=generator)


def mix_cfg(conditional: torch.Tensor, unconditional: torch.Tensor | None, cfg_scale: float) -> torch.Tensor:
    """`uncond + cfg·(cond − uncond)` in the logits' own dtype (bf16), before any upcast."""
    if cfg_scale == 1.0 or unconditional is None:
        return conditional
    return unconditional + cfg_scale * (conditional - unconditional)


# --------------------------------------------------------------------------- torch backend


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TorchARBackend:
    """Eager AR decoding on the MoT's AR expert with preallocated static KV caches."""

    name = "torch"

    def __init__(self, model: YuE2Model):
        self.model = model

    @torch.inference_mode()
    def generate(self, prefix: Sequence[int], sampling: Sampling, seed: int, phase: str, *,
                 negative: Sequence[int] | None = None, cfg_scale: float = 1.0, legacy_off: bool = False,
                 on_token: OnToken | None = None, cancelled: Cancelled | None = None) -> ARResult:
        end = end_token(phase)
        check_budget(prefix, sampling.max_tokens, f"{phase} prompt")
        if cfg_scale != 1.0:
            if negative is None:
                raise ValueError("cfg_scale != 1 needs a negative (unconditional) prompt")
            check_budget(negative, sampling.max_tokens, f"{phase} negative prompt")
        if cancelled is not None and cancelled():
            raise InterruptedError(f"cancelled before the {phase} prefill")
        model, device = self.model, self.model.device
        generator = torch.Generator(device=device if device.type in ("cpu", "cuda") else "cpu").manual_seed(seed)
        branches = [list(prefix)] + ([list(negative)] if cfg_scale != 1.0 else [])
        caches = [model.new_cache(len(ids) + sampling.max_tokens) for ids in branches]

        _synchronize(device)
        start = time.perf_counter()
        logits = [model.forward_ar(torch.tensor([ids], device=device), cache)[:, -1, :]
                  for ids, cache in zip(branches, caches)]
        _synchronize(device)
        prefill_seconds = time.perf_counter() - start
        history: list[int] = []
        first_token_seconds, ended = None, False
        for step in range(sampling.max_tokens):
            if cancelled is not None and cancelled():
                raise InterruptedError(f"cancelled during the {phase} phase after {step} tokens")
            mixed = mix_cfg(logits[0], logits[1] if len(logits) > 1 else None, cfg_scale)
            next_id = sample(phase_scores(mixed, sampling, history, step, phase, legacy_off),
                             sampling.temperature, generator)
            token = int(next_id.item())
            if first_token_seconds is None:
                first_token_seconds = time.perf_counter() - start
            if on_token is not None:
                on_token(phase, token)
            if token == end:
                ended = True
                break
            history.append(token)
            if step + 1 < sampling.max_tokens:
                logits = [model.forward_ar(next_id, cache)[:, -1, :] for cache in caches]
        _synchronize(device)
        seconds = time.perf_counter() - start
        output_tokens = len(history) + int(ended)
        timing = {
            "seconds": seconds, "prefill_seconds": prefill_seconds, "ttft_seconds": first_token_seconds,
            "output_tokens": output_tokens, "content_tokens": len(history),
            "output_tps": output_tokens / seconds if seconds > 0 else 0.0, "prefix_tokens": len(prefix),
            "cfg_branches": len(branches), "backend_actual": self.name, "execution": "eager", "attention": "sdpa",
        }
        return ARResult(history, timing, not ended)
