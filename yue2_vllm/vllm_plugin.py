"""vLLM plugin: YuE2's windowed, count-based repetition penalty as a vLLM v1 logits processor.

Per request, `SamplingParams(extra_args={"yue2_window_penalty": p, "yue2_penalty_window": w})`
turns it on: each id seen c times among the last w generated tokens has its logit multiplied
by p**c when negative, divided by it otherwise (vLLM's own repetition penalty is presence-based
over the whole sequence, which is not what YuE2 was sampled with). Requests without the
extra args are untouched, so the processor is safe to load into every engine.

`WindowedPenalty` is created lazily (module `__getattr__`), so importing this module does not
import vLLM; vLLM loads it through the `vllm.logits_processors` entry point or by FQCN.
"""
from __future__ import annotations

from typing import Sequence

import torch

PENALTY_KEY = "yue2_window_penalty"
WINDOW_KEY = "yue2_penalty_window"
MAX_WINDOW = 100
FQCN = "yue2_vllm.vllm_plugin:WindowedPenalty"
ENTRY_POINT = "yue2_window_penalty"


def penalty_params(extra_args: dict | None) -> tuple[float, int] | None:
    """`(penalty, window)` from a request's extra args, None when off; invalid values raise ValueError."""
    if not extra_args or PENALTY_KEY not in extra_args:
        return None
    penalty, window = extra_args[PENALTY_KEY], extra_args.get(WINDOW_KEY, 50)
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not penalty > 0 \
            or penalty != penalty or penalty == float("inf"):
        raise ValueError(f"{PENALTY_KEY} must be a finite number > 0, got {penalty!r}")
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
        raise ValueError(f"{WINDOW_KEY} must be an integer in [1, {MAX_WINDOW}], got {window!r}")
    return (float(penalty), window) if penalty != 1.0 else None


def apply_window_penalty(logits: torch.Tensor, rows: torch.Tensor, windows: torch.Tensor,
                         penalties: torch.Tensor) -> torch.Tensor:
    """In place on `logits [batch, vocab]`: `windows [k, w]` holds each penalised row's recent ids (−1 = none).

    Vectorised over rows and window positions: counts come from comparing the window with
    itself (w ≤ 100), so no `[batch, vocab]` temporary is built.
    """
    valid = windows >= 0
    ids = windows.clamp(min=0)
    counts = ((ids[:, :, None] == ids[:, None, :]) & valid[:, None, :]).sum(-1).to(logits.dtype)
    current = logits[rows[:, None], ids]
    alpha = penalties.to(logits.dtype)[:, None] ** counts
    updated = torch.where(current < 0, current * alpha, current / alpha)
    row_index = rows[:, None].expand_as(ids)
    logits[row_index[valid], ids[valid]] = updated[valid]  # duplicate ids write identical values
    return logits


def recent_windows(states: dict[int, tuple[list[int], float, int]]) -> tuple[list[int], list[list[int]], list[float]]:
    """Rows with history, their last-window ids padded with −1 to one width, and their penalties."""
    rows, windows, penalties = [], [], []
    for row, (output_ids, penalty, window) in states.items():
        recent = output_ids[-window:]
        if recent:
            rows.append(row)
            windows.append(list(recent))
            penalties.append(penalty)
    width = max((len(w) for w in windows), default=0)
    return rows, [w + [-1] * (width - len(w)) for w in windows], penalties


def _build_class():
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class WindowedPenalty(LogitsProcessor):
        """Keeps `row -> (live output ids, penalty, window)` in step with vLLM's persistent batch."""

        @classmethod
        def validate_params(cls, sampling_params) -> None:
            penalty_params(sampling_params.extra_args)

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            self.device, self.pin = device, is_pin_memory and device.type == "cuda"
            self.states: dict[int, tuple[list[int], float, int]] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.states.pop(index, None)
            for index, params, _prompt, output_ids in batch_update.added:
                settings = penalty_params(params.extra_args) if params is not None else None
                if settings is None:
                    self.states.pop(index, None)
                else:
                    self.states[index] = (output_ids, *settings)
            for a, b, direction in batch_update.moved:
                first, second = self.states.pop(a, None), self.states.pop(b, None)
                if first is not None:
                    self.states[b] = first
                if direction == MoveDirectionality.SWAP and second is not None:
                    self.states[a] = second

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.states:
                return logits
            rows, windows, penalties = recent_windows(self.states)
            if not rows:
                return logits
            to_device = {"device": logits.device, "non_blocking": self.pin}
            apply_window_penalty(logits, torch.tensor(rows, pin_memory=self.pin).to(**to_device),
                                 torch.tensor(windows, pin_memory=self.pin).to(**to_device),
                                 torch.tensor(penalties, dtype=torch.float32, pin_memory=self.pin).to(**to_device))
            return logits

    WindowedPenalty.__module__ = __name__
    return WindowedPenalty


_CLASS = None


def __getattr__(name: str):
    global _CLASS
    if name == "WindowedPenalty":
        if _CLASS is None:
            _CLASS = _build_class()
        return _CLASS
    raise AttributeError(name)


def entry_point_installed() -> bool:
    """Whether vLLM will load the processor by itself (this package's entry point is registered)."""
    from importlib.metadata import entry_points

    return any(ep.value == FQCN for ep in entry_points(group="vllm.logits_processors"))


def reference_penalty(logits: torch.Tensor, histories: Sequence[Sequence[int]], settings) -> torch.Tensor:
    """The torch backend's penalty applied row by row (for tests and benchmarks)."""
    from .sampling import window_penalty

    rows = []
    for row, history, setting in zip(logits, histories, settings):
        if setting is None:
            rows.append(row[None])
        else:
            penalty, window = setting
            rows.append(window_penalty(row[None].clone(), list(history)[-window:], penalty))
    return torch.cat(rows)
