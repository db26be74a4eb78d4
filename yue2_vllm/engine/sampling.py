"""Sampling inside the vLLM engine: the torch backend's per-step pipeline over many rows at once.

vLLM's own sampler does not choose YuE2 tokens: its seeded per-request generators crash vLLM-CPU
once a prompt is prefilled in chunks, and its repetition penalty is not YuE2's. Instead the yue2
logits processor scores every YuE2 row with the arithmetic of `model.sampling.phase_scores` (after the
bf16 CFG mix of `model.sampling.mix_cfg` for guided pairs), draws one token per row by Gumbel-max with
noise keyed by (seed, output position, token id), and forces that token. The draw depends on
nothing else, so a song's tokens do not depend on the batch it shares, on preemption or on
restarts.

All of it is plain torch on the logits' device and vectorised over rows; only the CPU path reads
a count back to size the candidate block (no host sync per step on CUDA).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..protocol import ABC_END, CODEC_OFFSET, CODEC_SIZE, EOD, MUSIC_END, VOCAB_SIZE

PHASE_INDEX = {"abc": 0, "semantic": 1}
PAIR_SENTINEL = VOCAB_SIZE - 1  # a padded-vocabulary id no phase may emit: ends an out-of-step CFG row
END_TOKENS = (ABC_END, MUSIC_END)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


# The ids a phase may emit lie in one slice of the vocabulary: abc = [0, EOD) and </abc> (the 205 ids
# between are masked), semantic = MUSIC_END followed by the 32,768 codec ids. Rows are scored on
# their phase's slice only (5.6x fewer columns in the semantic phase); the rest is −inf anyway.
PHASE_SLICES = ((0, ABC_END + 1), (MUSIC_END, CODEC_OFFSET + CODEC_SIZE))
PHASE_HOLES = ((EOD, ABC_END), (0, 0))  # [start, end) inside the slice's own coordinates (abc: absolute = local)


def phase_slice(phase: int) -> slice:
    low, high = PHASE_SLICES[phase]
    return slice(low, high)


# --------------------------------------------------------------------------- counter-based RNG


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's `>>` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors (wrapping arithmetic = the uint64 reference)."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def splitmix64_reference(x: int) -> int:
    """The same function on Python ints (unsigned 64-bit), to check the tensor version against."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One int64 key per row from (seed, output position)."""
    return splitmix64(splitmix64(seeds) ^ positions)


def uniforms(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float64 in (0, 1) per (row key, token id); `token_ids` is `[rows, width]`."""
    bits = _shift_right(splitmix64(keys[:, None] + token_ids * _GOLDEN), 11)
    return (bits.double() + 0.5) * (1.0 / (1 << 53))


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniforms(keys, token_ids)))


# --------------------------------------------------------------------------- row settings


@dataclass(frozen=True)
class RowSampling:
    """How one YuE2 row samples: a `protocol.Sampling` plus its phase, seed and numerics."""

    phase: int  # PHASE_INDEX
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    penalty_window: int
    min_tokens: int
    seed: int
    legacy: bool = False  # cot=off: scores stay in the model dtype and top-p keeps at least 3

    @property
    def end(self) -> int:
        return END_TOKENS[self.phase]

    @property
    def keep_first(self) -> int:
        return 3 if self.legacy else 1


_COLUMNS = {"end": torch.long, "min_tokens": torch.long, "temperature": torch.float32,
            "top_k": torch.long, "top_p": torch.float32, "repetition_penalty": torch.float32, "seed": torch.long}


@dataclass
class RowBatch:
    """Rows' settings as tensors on the logits' device (built when the batch changes, not per step)."""

    end: torch.Tensor
    min_tokens: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    repetition_penalty: torch.Tensor
    seed: torch.Tensor
    keep_first: int = 1

    @classmethod
    def build(cls, settings: Sequence[RowSampling], device: str | torch.device = "cpu",
              vocab_size: int = VOCAB_SIZE) -> "RowBatch":
        keep = {s.keep_first for s in settings}
        if len(keep) > 1 or len({s.phase for s in settings}) > 1:
            raise ValueError("a RowBatch holds rows of one phase and one numerics (they are scored apart)")
        columns = {name: torch.tensor([min(getattr(s, name), vocab_size) if name == "top_k" else getattr(s, name)
                                       for s in settings], dtype=dtype, device=device)
                   for name, dtype in _COLUMNS.items()}
        return cls(**columns, keep_first=keep.pop() if keep else 1)


# --------------------------------------------------------------------------- the pipeline


def mix_guidance(conditional: torch.Tensor, unconditional: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`uncond + s·(cond − uncond)` per row in the logits' dtype, rounded as `model.sampling.mix_cfg` rounds:
    the difference in the dtype, the product in fp32 then the dtype, then the sum."""
    difference = conditional - unconditional
    return unconditional + (scales.float()[:, None] * difference.float()).to(conditional.dtype)


def pad_windows(recent: Sequence[Sequence[int]]) -> list[list[int]]:
    """Rows' recent generated ids right-padded with −1 to one width."""
    width = max((len(r) for r in recent), default=0)
    return [list(r) + [-1] * (width - len(r)) for r in recent]


def apply_window_penalty(scores: torch.Tensor, windows: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """YuE2's count-based penalty in place on `scores [rows, vocab]`; `windows [rows, w]` (−1 = no id).

    Each id seen c times in a row's window gets α = penalty**c: negative scores ×α, others ÷α —
    `model.sampling.window_penalty`'s arithmetic, touching only the window's ids (no `[rows, vocab]`
    temporary) and with no data-dependent indexing: padding points at the row's first id and
    writes that id's own value, so every write to one element carries the same value.
    """
    if windows.shape[1] == 0:
        return scores
    valid = windows >= 0
    ids = torch.where(valid, windows, windows[:, :1]).clamp(min=0)
    counts = ((ids[:, :, None] == ids[:, None, :]) & valid[:, None, :]).sum(-1).to(scores.dtype)
    rows = torch.arange(len(scores), device=scores.device)[:, None].expand_as(ids)
    current = scores[rows, ids]
    alpha = penalties.to(scores.dtype)[:, None] ** counts
    scores[rows, ids] = torch.where(current < 0, current * alpha, current / alpha)
    return scores


def masked_scores(logits: torch.Tensor, phase: int, batch: RowBatch, steps: torch.Tensor,
                  windows: torch.Tensor) -> torch.Tensor:
    """`phase_scores` up to the temperature on the phase's slice: mask, end blocked below `min_tokens`, penalty.

    `logits [rows, slice]` (fp32, or the model dtype for legacy rows) is not modified; `windows
    [rows, w]` holds each row's recent generated ids in slice coordinates (−1 = none).
    """
    scores = logits.clone()
    hole_start, hole_end = PHASE_HOLES[phase]
    scores[:, hole_start:hole_end] = float("-inf")
    end = batch.end[:, None] - PHASE_SLICES[phase][0]
    blocked = (steps < batch.min_tokens)[:, None]
    scores.scatter_(1, end, scores.gather(1, end).masked_fill(blocked, float("-inf")))
    return apply_window_penalty(scores, windows, batch.repetition_penalty)


def local_windows(recent: Sequence[Sequence[int]], phase: int) -> list[list[int]]:
    """Recent ids in slice coordinates, right-padded with −1 (ids outside the slice cannot be emitted
    and stay −inf, so they are dropped)."""
    low, high = PHASE_SLICES[phase]
    return pad_windows([[t - low for t in r if low <= t < high] for r in recent])


def _scaled(scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide by the temperature as the torch backend does (fp32 arithmetic, rounded to the dtype)."""
    safe = torch.where(temperature > 0, temperature, 1.0)[:, None]
    return (scores.float() / safe).to(scores.dtype)


def truncated_candidates(scores: torch.Tensor, batch: RowBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k (ties kept) and top-p (the first `keep_first` always kept) on sorted candidates.

    Returns `(values, ids)` `[rows, width]` sorted by score, dropped candidates at −inf; ids outside
    the block are below every row's top-k threshold and carry no probability. On the CPU only the
    top `max(k) + 1` candidates are scaled and sorted (widened when a tie at the k-th value runs
    past them; bf16 logits tie often); on an accelerator the whole slice is sorted, so that nothing
    waits on the host.
    """
    top_k = batch.top_k.clamp(max=scores.shape[-1])
    if scores.device.type == "cpu":
        width = min(int(top_k.max()) + 1, scores.shape[-1])
        raw, ids = scores.topk(width, dim=-1)
        values = _scaled(raw, batch.temperature)
        threshold = values.gather(1, top_k[:, None] - 1)
        if width < scores.shape[-1] and bool((values[:, -1:] >= threshold).any()):
            scaled = _scaled(scores, batch.temperature)  # a tie runs past the block: widen it to the whole run
            values, ids = scaled.topk(int((scaled >= threshold).sum(-1).max()), dim=-1)
    else:
        values, ids = _scaled(scores, batch.temperature).sort(-1, descending=True)
        threshold = values.gather(1, top_k[:, None] - 1)
    values = values.masked_fill(values < threshold, float("-inf"))
    probabilities = values.softmax(-1)
    removed = (probabilities.cumsum(-1) - probabilities) > batch.top_p.to(values.dtype)[:, None]
    removed[:, :batch.keep_first] = False
    nucleus = (batch.top_p < 1)[:, None]
    return values.masked_fill(removed & nucleus, float("-inf")), ids


def choose(scores: torch.Tensor, phase: int, batch: RowBatch, positions: torch.Tensor) -> torch.Tensor:
    """One vocabulary id per row: argmax at temperature 0, else Gumbel-max over the truncated candidates.

    The noise of candidate `t` depends on (seed, position, t) alone, so the draw is the same whatever
    else shares the batch. `scores` is on the phase's slice.
    """
    low = PHASE_SLICES[phase][0]
    sampled = batch.temperature > 0
    on_cpu = scores.device.type == "cpu"
    greedy = scores.argmax(-1) if not on_cpu or not bool(sampled.all()) else None
    if on_cpu and not bool(sampled.any()):
        return greedy + low
    values, ids = truncated_candidates(scores, batch)
    noisy = values.double() + gumbel(row_keys(batch.seed, positions), ids + low)
    drawn = ids.gather(1, noisy.argmax(-1, keepdim=True))[:, 0]
    return (drawn if greedy is None else torch.where(sampled, drawn, greedy)) + low


def distribution(scores: torch.Tensor, phase: int, batch: RowBatch, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """`[rows, vocab]` fp32 probabilities that `choose` samples from (tests, diagnostics)."""
    values, ids = truncated_candidates(scores, batch)
    full = torch.full((len(scores), vocab_size), float("-inf"), dtype=values.dtype, device=scores.device)
    return full.scatter_(1, ids + PHASE_SLICES[phase][0], values).float().softmax(-1)


def force(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """Make `tokens` the greedy choice of `rows` (+inf there); vLLM's greedy sampler must take it."""
    logits[rows, tokens] = float("inf")
