"""vLLM plugin: YuE2's sampler as a vLLM v1 logits processor.

A request opts in with `SamplingParams(temperature=0, extra_args={"yue2": row_args(...)})`. For
every such row, every step, the processor scores the row's logits exactly as the torch backend
does (phase mask, `min_tokens`, YuE2's count-based windowed penalty, temperature, top-k, top-p;
see `engine_sampling`), draws the token from a counter-based RNG keyed by (seed, output
position), and leaves that token the only finite logit, so vLLM's greedy sampler takes it.
vLLM's own seeded generators are never used (they crash vLLM-CPU under chunked prefill).
Requests without the extra arg are untouched, so the processor is safe in every engine.

CFG runs as a pair of rows (cond and uncond prompts, one `pair` id): while both rows are present at
the same position the processor mixes their logits (`uncond + s·(cond − uncond)` in the model dtype),
samples once with the cond row's settings and forces that token into both. A row whose partner is
missing or out of step gets `PAIR_SENTINEL`, a stop id; the driver (`vllm_backend`) keeps what the two
rows agree on and resubmits the pair, so unguided tokens are never accepted.

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
MODEL_ARCHITECTURE = "YuE2ARForCausalLM"  # vLLM's Qwen3 with the phase-sliced lm_head (`vllm_model`)


@dataclass(frozen=True)
class Pairing:
    """A row's place in a CFG pair: both rows carry the same `pair` id and scale."""

    pair: str
    role: str  # "cond" | "uncond"
    scale: float


ROLES = ("cond", "uncond")


def row_args(phase: str, sampling: Sampling, seed: int, *, legacy: bool = False, history: Sequence[int] = (),
             pairing: Pairing | None = None) -> dict:
    """The `extra_args` of a YuE2 row. `history`: tokens of this phase already accepted (they end the
    prompt of a resubmitted request); they count for the penalty, `min_tokens` and the RNG position.
    `pairing`: this row is one half of a CFG pair (the cond row's settings sample for both)."""
    args = {"phase": phase, "sampling": sampling.to_dict(), "seed": int(seed), "legacy": bool(legacy),
            "history": [int(t) for t in history]}
    if pairing is not None:
        args.update(pair=pairing.pair, role=pairing.role, scale=float(pairing.scale))
    return {ROW_KEY: args}


@dataclass
class RowState:
    """One YuE2 row of vLLM's persistent batch."""

    settings: es.RowSampling
    output_ids: list[int]  # vLLM's live list of this request's generated ids
    history: list[int] = field(default_factory=list)
    pairing: Pairing | None = None

    @property
    def step(self) -> int:
        return len(self.history) + len(self.output_ids)

    @property
    def last(self) -> int | None:
        return self.output_ids[-1] if self.output_ids else None

    def recent(self) -> list[int]:
        window, out = self.settings.penalty_window, self.output_ids
        if len(out) >= window:
            return out[len(out) - window:]
        return self.history[len(self.history) - (window - len(out)):] + list(out) if self.history else list(out)


def parse_row(extra_args: dict | None) -> RowState | None:
    """The state of a YuE2 row (no live output list yet), None for other requests; bad values raise ValueError."""
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
    pairing = None
    if "pair" in args:
        role, scale = args.get("role"), args.get("scale")
        if not isinstance(args["pair"], str) or role not in ROLES:
            raise ValueError(f"extra_args[{ROW_KEY!r}]: a paired row needs a string pair id and a role in {ROLES}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 <= scale <= 20:
            raise ValueError(f"extra_args[{ROW_KEY!r}].scale must be a number in [0, 20], got {scale!r}")
        pairing = Pairing(args["pair"], role, float(scale))
    settings = es.RowSampling(es.PHASE_INDEX[phase], sampling.temperature, sampling.top_p, sampling.top_k,
                              sampling.repetition_penalty, sampling.penalty_window, sampling.min_tokens, seed, legacy)
    return RowState(settings, [], list(history), pairing)


@dataclass
class StepLayout:
    """Who samples how this step: single rows and aligned CFG pairs per (phase, numerics), and lone rows."""

    groups: list[tuple[int, int, list[int], list[int], es.RowBatch, torch.Tensor | None]]
    lone: list[int]


def step_layout(rows: dict[int, RowState], device: torch.device, cache: dict) -> StepLayout:
    """Group this step's rows. A paired row whose partner is absent, or at another position, or behind
    another last token, is lone: it gets the sentinel (a stop id) so the driver can restart the pair."""
    singles, pairs = [], {}
    for index, row in rows.items():
        if row.pairing is None:
            singles.append(index)
        else:
            pairs.setdefault(row.pairing.pair, {})[row.pairing.role] = index
    guided, lone = [], []
    for members in pairs.values():
        cond, uncond = members.get("cond"), members.get("uncond")
        if cond is not None and uncond is not None and rows[cond].step == rows[uncond].step \
                and rows[cond].last == rows[uncond].last:
            guided.append((cond, uncond))
        else:
            lone += [i for i in (cond, uncond) if i is not None]
    groups = []
    for phase in es.PHASE_INDEX.values():
        for legacy in (False, True):
            def fits(index: int) -> bool:
                return rows[index].settings.phase == phase and rows[index].settings.legacy == legacy

            single = sorted(i for i in singles if fits(i))
            paired = sorted(pair for pair in guided if fits(pair[0]))
            for conds, unconds in ((single, []), ([c for c, _ in paired], [u for _, u in paired])):
                if not conds:
                    continue
                key = (phase, legacy, tuple(conds), tuple(unconds))
                if key not in cache:
                    scales = torch.tensor([rows[c].pairing.scale for c in conds], device=device) if unconds else None
                    cache[key] = es.RowBatch.build([rows[c].settings for c in conds], device), scales
                batch, scales = cache[key]
                groups.append((phase, legacy, conds, unconds, batch, scales))
    return StepLayout(groups, lone)


def sample_rows(logits: torch.Tensor, rows: dict[int, RowState], layout: StepLayout,
                model_dtype: torch.dtype) -> None:
    """Choose and force one token for every YuE2 row of `logits` (in place); a guided pair's token goes
    into both of its rows, computed from their logits mixed with upstream's bf16 arithmetic."""
    device = logits.device
    if layout.lone:
        es.force(logits, torch.tensor(layout.lone, device=device),
                 torch.full((len(layout.lone),), es.PAIR_SENTINEL, device=device))
    for phase, legacy, conds, unconds, batch, scales in layout.groups:
        states = [rows[i] for i in conds]
        steps = torch.tensor([s.step for s in states], dtype=torch.long, device=device)
        windows = torch.tensor(es.local_windows([s.recent() for s in states], phase), dtype=torch.long,
                               device=device).reshape(len(states), -1)
        cond_index = torch.tensor(conds, device=device)
        work = logits[cond_index, es.phase_slice(phase)]
        if unconds:
            uncond_index = torch.tensor(unconds, device=device)
            uncond = logits[uncond_index, es.phase_slice(phase)]
            work = es.mix_guidance(work.to(model_dtype), uncond.to(model_dtype), scales)
            cond_index = torch.cat([cond_index, uncond_index])
        work = work.to(model_dtype) if legacy else work.float()  # legacy rows are scored in the model dtype
        tokens = es.choose(es.masked_scores(work, phase, batch, steps, windows), phase, batch, steps)
        es.force(logits, cond_index, tokens.repeat(2) if unconds else tokens)


_TABLES: dict[int, object] = {}  # id(vllm_config) -> the processor serving that engine (one per worker)


def phase_rows(vllm_config, rows: int) -> dict[int | None, list[int]] | None:
    """Logits rows grouped by phase (None: not a YuE2 row) for a step of `rows` requests; None when the
    processor's batch is not that step's (another engine, prompt logprobs, speculative rows)."""
    processor = _TABLES.get(id(vllm_config))
    if processor is None or processor.batch_size != rows or not processor.rows:
        return None
    groups: dict[int | None, list[int]] = {}
    for index in range(rows):
        state = processor.rows.get(index)
        groups.setdefault(None if state is None else state.settings.phase, []).append(index)
    return groups


def register() -> None:
    """`vllm.general_plugins` entry point: make `YuE2ARForCausalLM` known to vLLM (in every vLLM process)."""
    from vllm import ModelRegistry

    if MODEL_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(MODEL_ARCHITECTURE, f"yue2_vllm.vllm_model:{MODEL_ARCHITECTURE}")


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
            self.layouts: dict = {}  # settings tensors per row layout, reused while the batch keeps it
            self.batch_size = 0
            _TABLES[id(vllm_config)] = self  # the sliced lm_head reads the rows' phases from here

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            self.batch_size = batch_update.batch_size
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for index, params, _prompt, output_ids in batch_update.added:
                state = parse_row(params.extra_args) if params is not None else None
                if state is None:
                    self.rows.pop(index, None)
                else:
                    state.output_ids = output_ids  # the live list: it grows as the request generates
                    self.rows[index] = state
            for a, b, direction in batch_update.moved:
                first, second = self.rows.pop(a, None), self.rows.pop(b, None)
                if first is not None:
                    self.rows[b] = first
                if direction == MoveDirectionality.SWAP and second is not None:
                    self.rows[a] = second
            self.layouts.clear()

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.rows:
                return logits
            sample_rows(logits, self.rows, step_layout(self.rows, logits.device, self.layouts), self.model_dtype)
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
