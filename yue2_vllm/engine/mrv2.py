"""YuE2's sampler on Model Runner V2's logits-processor interface (vLLM 0.31+, the CUDA default).

MRV2 keeps requests in persistent slots: `add_request(slot, params)` when a request enters (a freed
slot is recycled without notice, so every slot is re-initialised there), then `apply(logits, ctx)` each
step, where a logits row is not a request: `ctx.idx_mapping_np` (host) maps batch positions to slots,
`ctx.pos` (device) gives each row's input position. Token history is the runner's own on-device
`all_token_ids[slot, :]`, which its post-sample kernel extends before the next step runs, so history
is exact under async scheduling too (no placeholders, no host copy of the tokens).

Per step, on the host: the batch layout (which slots are YuE2 rows, their groups and pairs) from
`idx_mapping_np`, cached per layout. On the device: each row's output position (`pos + 1 − start`,
where `start` = where this phase's tokens begin: the prompt length less the accepted history that ends
a resubmitted prompt), its penalty window gathered from `all_token_ids`, and for CFG pairs whether both
rows stand at the same position behind the same token. The arithmetic is `plugin.sample_group`,
the V1 adapter's own. vLLM loads the class by FQCN (`plugin.FQCNS`). Per-slot history lengths are a persistent device buffer written with
`non_blocking` copies from pinned memory in `apply_staged_writes`.

Speculative decoding (several logits rows per request) is not served: our engine never enables it.

The sliced lm_head's side of MRV2 lives here too: `SlotPhases` (each slot's phase and each step's rows, on
the host) and `YuE2ModelState`, vLLM's default model state that feeds it (`model_state_class`, named by
`ar_model.YuE2ARForCausalLM.get_model_state_cls`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import sampling as es
from .plugin import Group, RowState, force_sentinel, group_rows, lazy_class, parse_row, phase_layout, sample_group


@dataclass
class SlotLayout:
    """This step's YuE2 rows for one `idx_mapping` (batch position -> slot), built on the host once."""

    groups: list[tuple[Group, "GroupSlots"]]
    lone: torch.Tensor | None


@dataclass
class GroupSlots:
    """Device index tensors and window width of one group, for the per-step device arithmetic."""

    cond_slots: torch.Tensor
    uncond_slots: torch.Tensor | None
    windows: torch.Tensor  # each sampling row's penalty window
    width: int  # the widest window of the group (host constant)


def output_positions(pos: torch.Tensor, slots: torch.Tensor, prompt_len: torch.Tensor,
                     history_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(steps, start)` per row: the output position of the token sampled from a row whose input token
    sits at `pos`, and the sequence position where the phase's own tokens (history, then outputs) start."""
    start = prompt_len[slots].long() - history_len[slots]
    return pos.long() + 1 - start, start


def recent_phase_ids(all_token_ids: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, start: torch.Tensor,
                     input_ids: torch.Tensor, windows: torch.Tensor, width: int, phase: int) -> torch.Tensor:
    """Each row's last `window` phase tokens in slice coordinates, valid ids first, −1 after (the layout
    `sampling.apply_window_penalty` needs). The token at `pos` is the row's input token."""
    low, high = es.PHASE_SLICES[phase]
    if width == 0:
        return torch.empty((len(slots), 0), dtype=torch.long, device=pos.device)
    back = torch.arange(width, device=pos.device)
    positions = pos.long()[:, None] - back[None, :]  # most recent first
    valid = (positions >= start[:, None]) & (back[None, :] < windows[:, None])
    tokens = all_token_ids[slots[:, None], positions.clamp(min=0)].long()
    tokens[:, 0] = input_ids.long()
    valid &= (tokens >= low) & (tokens < high)
    local = torch.where(valid, tokens - low, torch.full_like(tokens, -1))
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    return local.gather(1, order)


def last_output(input_ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                prompt_len: torch.Tensor) -> torch.Tensor:
    """The row's last generated token (its input token once it has outputs), −1 before its first output."""
    return torch.where(pos.long() >= prompt_len[slots].long(), input_ids.long(), torch.full_like(pos.long(), -1))


class SlotSampler:
    """The MRV2 adapter's state and step, apart from vLLM's base class (so tests can drive it directly).

    `req_states` is vLLM's `LogitsProcRequestState`: `all_token_ids.gpu [max_num_reqs, max_model_len]`,
    `prompt_len.gpu [max_num_reqs]` (read afresh every step: the runner re-points it), `device`."""

    def __init__(self, model_dtype: torch.dtype, req_states):
        self.model_dtype = model_dtype
        self.req_states = req_states
        self.device = torch.device(req_states.device)
        self.slots: dict[int, RowState] = {}
        self.history_host = torch.zeros(req_states.max_num_reqs, dtype=torch.long)
        self.history_len = torch.zeros(req_states.max_num_reqs, dtype=torch.long, device=self.device)
        self.staged = False
        self.layouts: dict[tuple, SlotLayout] = {}

    def add_request(self, slot: int, params) -> bool:
        state = parse_row(getattr(params, "extra_args", None)) if params is not None else None
        self.layouts.clear()  # a layout naming this slot may describe its previous occupant
        if state is None:
            self.slots.pop(slot, None)
            return False
        self.slots[slot] = state
        self.history_host[slot] = len(state.history)
        self.staged = True
        return True

    def apply_staged_writes(self) -> None:
        if not self.staged:
            return
        source = self.history_host if self.device.type == "cpu" else self.history_host.pin_memory()
        self.history_len.copy_(source, non_blocking=True)
        self.staged = False

    def layout(self, idx_mapping_np) -> SlotLayout | None:
        key = tuple(int(slot) for slot in idx_mapping_np)
        if key in self.layouts:
            return self.layouts[key]
        rows = {row: self.slots[slot] for row, slot in enumerate(key) if slot in self.slots}
        if not rows:
            layout = None
        else:
            groups, lone = group_rows(rows, self.device)  # pairs in step: checked on the device
            layout = SlotLayout([(group, self._slots_of(group, key)) for group in groups],
                                torch.tensor(lone, dtype=torch.long).to(self.device) if lone else None)
        self.layouts[key] = layout
        return layout

    def _slots_of(self, group: Group, key: tuple[int, ...]) -> GroupSlots:
        def on_device(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(self.device)

        windows = [self.slots[key[row]].settings.penalty_window for row in group.sampling_rows]
        uncond = None if group.uncond is None else on_device([key[row] for row in group.partner_rows])
        return GroupSlots(on_device([key[row] for row in group.sampling_rows]), uncond, on_device(windows),
                          max(windows))

    def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        if not self.slots:
            return logits
        if logits.shape[0] != len(ctx.idx_mapping_np):
            if any(int(slot) in self.slots for slot in ctx.idx_mapping_np):
                raise RuntimeError("YuE2 rows under speculative decoding (several logits rows per request) "
                                   "are not supported")
            return logits
        layout = self.layout(ctx.idx_mapping_np)
        if layout is None:
            return logits
        if layout.lone is not None:
            force_sentinel(logits, layout.lone)
        prompt_len, tokens = self.req_states.prompt_len.gpu, self.req_states.all_token_ids.gpu
        for group, slots in layout.groups:
            pos = ctx.pos[group.cond]
            steps, start = output_positions(pos, slots.cond_slots, prompt_len, self.history_len)
            windows = recent_phase_ids(tokens, slots.cond_slots, pos, start, ctx.input_ids[group.cond],
                                       slots.windows, slots.width, group.phase)
            aligned = None
            if group.uncond is not None:
                partner_pos = ctx.pos[group.uncond]
                partner_steps, _ = output_positions(partner_pos, slots.uncond_slots, prompt_len, self.history_len)
                aligned = (steps == partner_steps) & (
                    last_output(ctx.input_ids[group.cond], pos, slots.cond_slots, prompt_len)
                    == last_output(ctx.input_ids[group.uncond], partner_pos, slots.uncond_slots, prompt_len))
            sample_group(logits, group, steps, windows, self.model_dtype, aligned)
        return logits


class SlotPhases:
    """Model Runner V2: each logits row's phase for the sliced lm_head (`ar_model`), known on the host.

    MRV2 calls the model's `ModelState` (`get_model_state_cls`) with every new request
    (`add_request(slot, new_req_data)`: its sampling params carry the row's phase, fixed for the request's
    life) and every step before the forward (`prepare_inputs(input_batch)`: `idx_mapping_np`, the host
    array batch position -> slot) — also when the forward is a replayed CUDA graph. `prepare` turns that
    array into `plugin.phase_layout` (cached per layout: a stable batch costs a dict lookup, a changed
    one a non-blocking copy), and `take` hands it to this step's `compute_logits`, once: the runner's later
    calls in the step (prompt logprobs) and its dummy runs get None, so the full head. Nothing here reads
    the device: no host sync. The phase comes from the request, not from its tokens, so it is exact for
    rows still prefilling (their samples are discarded) and rows resubmitted with history."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)  # the runner's, set by the model state
        self.phases: dict[int, int | None] = {}
        self.layouts: dict[bytes, dict | None] = {}
        self.pending: tuple[int, dict | None] | None = None

    def add_request(self, slot: int, params) -> None:
        state = parse_row(getattr(params, "extra_args", None)) if params is not None else None
        self.phases[slot] = None if state is None else state.settings.phase  # a recycled slot: its new occupant
        self.layouts.clear()

    def prepare(self, idx_mapping_np) -> None:
        key = idx_mapping_np.tobytes()
        if key not in self.layouts:
            row_phases = [self.phases.get(int(slot)) for slot in idx_mapping_np]
            self.layouts[key] = (None if all(phase is None for phase in row_phases)
                                 else phase_layout(row_phases, self.device))
        self.pending = (len(idx_mapping_np), self.layouts[key])

    def take(self, rows: int) -> dict | None:
        """This step's layout if `rows` logits rows are this step's requests (one each), else None."""
        pending, self.pending = self.pending, None
        if pending is None or pending[0] != rows:
            return None  # speculative rows, a dummy run, a second call in the step: the full head
        return pending[1]


def _build_model_state_class():
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    class YuE2ModelState(DefaultModelState):
        """vLLM's default model state (what it picks for Qwen3), telling `model.slot_phases` each step's rows."""

        def __init__(self, vllm_config, model, encoder_cache, device):
            super().__init__(vllm_config, model, encoder_cache, device)
            self.slot_phases = model.slot_phases  # the model's own: compute_logits reads it
            self.slot_phases.device = torch.device(device)

        def add_request(self, req_index: int, new_req_data) -> None:
            super().add_request(req_index, new_req_data)
            self.slot_phases.add_request(req_index, new_req_data.sampling_params)

        def prepare_inputs(self, input_batch, req_states):
            self.slot_phases.prepare(input_batch.idx_mapping_np)
            return super().prepare_inputs(input_batch, req_states)

    YuE2ModelState.__module__ = __name__
    return YuE2ModelState


@functools.cache
def model_state_class():
    """`YuE2ModelState`, built on first use (importing this module does not import vLLM)."""
    return _build_model_state_class()


def _build_class():
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

    class YuE2SamplerV2(LogitsProcessor):
        """Model Runner V2: YuE2 rows keyed by persistent slot; see `SlotSampler`."""

        @classmethod
        def validate_params(cls, sampling_params) -> None:
            parse_row(sampling_params.extra_args)

        def __init__(self, vllm_config, req_states):
            self.sampler = SlotSampler(vllm_config.model_config.dtype, req_states)

        def add_request(self, req_idx: int, sampling_params) -> bool:
            return self.sampler.add_request(req_idx, sampling_params)

        def apply_staged_writes(self) -> None:
            self.sampler.apply_staged_writes()

        def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
            return self.sampler.apply(logits, ctx)

    YuE2SamplerV2.__module__ = __name__
    return YuE2SamplerV2


# `YuE2SamplerV2` is built on first use, so importing this module does not import vLLM.
__getattr__ = lazy_class("YuE2SamplerV2", _build_class)
