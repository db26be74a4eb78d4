"""The phase-sliced lm_head: the head's rows each phase reads, the kernels that read them, and when a slice pays.

A row's phase can emit only the ids of one contiguous slice of the vocabulary (`sampling.PHASE_SLICES`: abc
151,849 of YuE2's 184,704 head rows, semantic 32,769). The head is cut at the slices' bounds into parts
(`head_parts`: the abc slice, 3 control ids, the semantic slice, 83 padding ids), and each part runs on the
kernel the engine gives the whole head, built the same way for the part's rows (`ar_model`: on the CPU vLLM's
own prepacked GEMM; elsewhere vLLM's own `apply` on the part's rows, a view). A phase's GEMM then costs its
share of the head's rows. (It did not when a slice went through a plain `F.linear` on the CPU while vLLM's
full head ran on a weight it had prepacked for oneDNN at load: docs/vllm-backend.md, "Where a decode step's
time goes".)

What a slice still costs that the full head does not: its output is copied into the full-vocabulary logits
the sampler expects. Counted in bytes moved per step, in units of vocabulary × element size, for `m` rows of a
phase with share `s` of the head at hidden size `K`: the slice reads s·K of weight, writes s·m, fills the
other (1 − s)·m columns with −inf and copies 2·s·m; the full head plus a mask reads K, writes m and masks
(1 − s)·m. The slice pays iff (3s − 1)·m < (1 − s)·K (`slice_pays`): always in the semantic phase (s = 0.18),
in the abc phase (s = 0.82) below 0.12·K rows — 252 at YuE2's width (2,048), 15 at the tiny model's (128).
Each phase's choice is made once per engine, for the most rows a step can hold (`max_num_seqs`), so no
row's logits depend on the batch it shares (`--reproducible` stays exact); a phase where the slice does not
pay gets the full head with the other columns masked to −inf, the logits the slice would give.

On the CPU the parts replace vLLM's own packed full head (the full head is then computed part by part), so
the engine holds the head's bytes once, as before; only where a phase takes the full head (a narrow model
with many rows) is the full head kept beside the parts that pay.

Importing this module does not import vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from .sampling import PHASE_INDEX, PHASE_SLICES

Kernel = Callable[[torch.Tensor], torch.Tensor]  # hidden [m, K] -> logits [m, rows of the part]
PhaseRows = Mapping[int | None, "torch.Tensor | slice"]  # phase (None: not a YuE2 row) -> its logits rows


def head_parts(vocab_size: int, slices: Sequence[tuple[int, int]] = PHASE_SLICES) -> tuple[tuple[int, int], ...]:
    """The head's rows cut at every phase slice's bounds: contiguous `(start, stop)` parts covering the vocabulary,
    each phase's slice exactly one of them."""
    bounds = sorted({0, vocab_size, *(bound for pair in slices for bound in pair if 0 < bound < vocab_size)})
    return tuple(zip(bounds, bounds[1:]))


def slice_pays(share: float, hidden_size: int, rows: int) -> bool:
    """Whether a slice holding `share` of the head's rows moves fewer bytes than the full head plus a mask, for
    `rows` rows of its phase in one step at `hidden_size` (see the module docstring)."""
    return (3 * share - 1) * rows < (1 - share) * hidden_size


def phase_choices(hidden_size: int, vocab_size: int, max_rows: int,
                  slices: Sequence[tuple[int, int]] = PHASE_SLICES) -> dict[int, bool]:
    """Per phase index: the slice (True) or the full head plus a mask (False), for steps of up to `max_rows` rows."""
    return {phase: slice_pays((high - low) / vocab_size, hidden_size, max_rows)
            for phase, (low, high) in enumerate(slices)}


def choice_record(hidden_size: int, vocab_size: int, max_rows: int) -> dict[str, str]:
    """The choice per phase name as recorded per song (`sliced_head_phases` in result.json)."""
    choices = phase_choices(hidden_size, vocab_size, max_rows)
    return {name: "sliced" if choices[index] else "full head + mask" for name, index in PHASE_INDEX.items()}


@dataclass
class PhaseHead:
    """The lm_head's kernels, per part of its rows, and each phase's choice. `full`: the whole head's own kernel, or
    None where the parts replace it (the full head is then computed part by part)."""

    vocab_size: int
    parts: dict[tuple[int, int], Kernel]
    full: Kernel | None
    sliced: dict[int, bool]
    slices: Sequence[tuple[int, int]] = PHASE_SLICES

    @classmethod
    def over(cls, weight: torch.Tensor, max_rows: int, kernel: Callable[[torch.Tensor], Kernel],
             vocab_size: int | None = None) -> "PhaseHead":
        """A head whose parts are views of `weight` (no copy; `kernel(rows) -> Kernel`, e.g. an `F.linear` on them),
        and whose full head is `kernel(weight)`: how the engine builds it off the CPU, and what the GPU check times."""
        vocab = vocab_size or weight.shape[0]
        return cls(vocab, {(a, b): kernel(weight[a:b]) for a, b in head_parts(vocab)}, kernel(weight),
                   phase_choices(weight.shape[1], vocab, max_rows))

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.full is not None:
            return self.full(hidden)[:, :self.vocab_size]
        logits = hidden.new_empty((len(hidden), self.vocab_size))
        for (start, stop), kernel in self.parts.items():
            logits[:, start:stop] = kernel(hidden)
        return logits

    def columns(self, phase: int | None) -> tuple[int, int]:
        return (0, self.vocab_size) if phase is None else self.slices[phase]

    def logits(self, hidden: torch.Tensor, phases: PhaseRows) -> tuple[torch.Tensor, int]:
        """`(logits, widest)`: each row's logits over its phase's columns, −inf elsewhere (the full vocabulary for
        rows of phase None); `widest`: the most head rows one row's GEMM read. One GEMM per phase present."""
        if len(phases) == 1:  # one phase holds every row: no gather, no scatter
            return self._one_phase(hidden, next(iter(phases)))
        logits = torch.full((len(hidden), self.vocab_size), float("-inf"), dtype=hidden.dtype, device=hidden.device)
        widest = 0
        for phase, index in phases.items():  # index tensors cached per batch layout: no per-step copy
            low, high = self.columns(phase)
            if phase is not None and self.sliced[phase]:
                logits[index, low:high] = self.parts[(low, high)](hidden[index])
                widest = max(widest, high - low)
            else:
                logits[index, low:high] = self.full_logits(hidden[index])[:, low:high]
                widest = self.vocab_size
        return logits, widest

    def _one_phase(self, hidden: torch.Tensor, phase: int | None) -> tuple[torch.Tensor, int]:
        if phase is None:
            return self.full_logits(hidden), self.vocab_size
        low, high = self.columns(phase)
        if self.sliced[phase]:
            logits = hidden.new_empty((len(hidden), self.vocab_size))
            logits[:, low:high] = self.parts[(low, high)](hidden)
            widest = high - low
        else:
            logits, widest = self.full_logits(hidden), self.vocab_size
        logits[:, :low] = float("-inf")
        logits[:, high:] = float("-inf")
        return logits, widest
