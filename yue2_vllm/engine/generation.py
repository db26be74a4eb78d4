"""One phase's generation on the engine, checked and recorded: its rows' prompts (one row, or a CFG pair's cond and
uncond rows) against the budgets before anything is sent, and the record each song keeps of the run
(`PhaseTiming`: `ARResult.timing`, result.json's `timing.abc` and `timing.semantic`)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

from ..protocol import check_budget

SPREAD = {"spread": True}  # a dict field whose keys stand in the record in its place
OPTIONAL = {"optional": True}  # a field left out of the record when None


def phase_prompts(prefix: Sequence[int], negative: Sequence[int] | None, cfg_scale: float, max_tokens: int,
                  phase: str, max_model_len: int) -> list[list[int]]:
    """The rows' prompts: `[prefix]`, or `[prefix, negative]` for a CFG pair (`cfg_scale != 1`); each checked
    against the context and the engine's `max_model_len` with its `max_tokens`."""
    paired = cfg_scale != 1.0
    if paired and negative is None:
        raise ValueError("cfg_scale != 1 needs a negative (unconditional) prompt")
    prompts = [list(prefix)] + ([list(negative)] if paired else [])
    for prompt, what in zip(prompts, (f"{phase} prompt", f"{phase} negative prompt")):
        check_budget(prompt, max_tokens, what)
        if len(prompt) + max_tokens > max_model_len:
            raise ValueError(f"{what} + max_tokens exceeds the engine's max_model_len {max_model_len}")
    return prompts


@dataclass(frozen=True, kw_only=True)
class PhaseTiming:
    """One phase's run on the engine as a song records it. `as_dict` is the record: the fields in this order (the
    order result.json keeps), `runner` and `signals` spread in their place, an optional field left out when None."""

    seconds: float  # admitted to done: the engine's start (when it starts for this run) and the run
    ttft_seconds: float | None
    output_tokens: int  # what this run made, the end token counted (a continuation's tokens aside)
    content_tokens: int  # the phase's ids, the end token left out (a continuation's tokens in)
    output_tps: float = field(init=False)
    prefix_tokens: int
    cfg_branches: int  # 2 for a CFG pair
    backend_actual: str = "vllm"
    vllm_version: str | None
    engine_dtype: str
    kv_cache_dtype: str
    kv_cache: dict | None  # the engine's own record of its K/V, read back when it started
    max_num_seqs: int
    kv_cache_memory_bytes: int
    kv_reserved_bytes: int  # the rows' worst-case KV, admitted before the run
    mean_batch_rows: float
    runner: dict = field(metadata=SPREAD)  # EngineSetup.runner_record
    admission_wait_seconds: float
    engine_restarts: int  # the engine's restarts before this run
    lora: str | None = field(default=None, metadata=OPTIONAL)  # the song's AR adapter
    ar_checkpoint: dict
    signals: dict = field(metadata=SPREAD)  # protocol.ar_signals
    continued_tokens: int | None = field(default=None, metadata=OPTIONAL)  # a continuation's, prefilled
    continuation: str | None = field(init=False, metadata=OPTIONAL)
    cfg_scale: float | None = field(default=None, metadata=OPTIONAL)  # a CFG pair's
    pair_restarts: int | None = field(default=None, metadata=OPTIONAL)
    engine_load_seconds: float | None = field(default=None, metadata=OPTIONAL)  # the first run on a fresh engine

    def __post_init__(self):
        seconds = self.seconds
        object.__setattr__(self, "output_tps", self.output_tokens / seconds if seconds > 0 else 0.0)
        object.__setattr__(self, "continuation", "prefilled" if self.continued_tokens else None)

    def as_dict(self) -> dict:
        record = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if item.metadata.get("spread"):
                record.update(value)
            elif value is not None or not item.metadata.get("optional"):
                record[item.name] = value
        return record
