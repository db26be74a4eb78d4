"""The YuE2 AR model for vLLM: vLLM's Qwen3 with an lm_head computed only over each row's phase.

A semantic-phase row can only emit MUSIC_END and the 32,768 codec ids, an abc-phase row only ids
below EOD and </abc>; the other 151,935 (resp. 32,855) rows of the 184,704-row head are wasted reads.
`compute_logits` therefore multiplies each row's hidden state with its phase's slice of the head and
leaves the rest −inf, so the sampler and the logits processors still see a full-vocabulary tensor.
The head's kernels are vLLM's own, built per part of the head's rows (`PhaseHeadMethod`, `head`): on the
CPU vLLM prepacks each part as it would prepack the whole head, in place of the whole head; each phase
takes its slice, or the full head plus a mask where the slice's copy would cost more than its skipped rows
(`head.slice_pays`, decided once per engine for its `max_num_seqs`).

How a row's phase is known, on the host and without a device sync on either runner:
* V1 model runner: the yue2 logits processor (`plugin.YuE2Sampler`) keeps a table `batch index ->
  RowState` that vLLM updates through `BatchUpdate` at the start of every step, before the forward pass;
  `compute_logits` reads it through `plugin.phase_rows`.
* Model Runner V2 (vLLM 0.31+, the CUDA default): the model names its own `ModelState`
  (`get_model_state_cls`, honoured by MRV2's `init_model_state` from 0.28), vLLM's default state plus
  `mrv2.SlotPhases`: each request's phase when it takes a slot, and each step's `idx_mapping_np` (logits
  row -> slot) in `prepare_inputs`, which runs before the forward also when the forward is a replayed
  CUDA graph; `compute_logits` runs eagerly after it (`sample()`).
Chunked prefill (rows still prefilling carry their request's phase; their samples are discarded anyway),
preemption (rows leave and re-enter as new requests) and CUDA-graph padding (logits are computed for the
gathered per-request rows only) keep it exact; so do mixed batches (one GEMM per phase present). Rows of
plain requests get the full head; a step whose logits rows are not one per request (speculative
decoding, prompt logprobs, dummy runs) gets the full head throughout. The engine uses this class when our
plugin overrides the architecture (`hf_overrides`, see `worker`), which the backend does for checkpoints
with YuE2's 184,704-token layout unless `sliced_head` is off.

Importing this module imports vLLM: only the engine worker (through the registry) does.
"""
from __future__ import annotations

import functools

import torch
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.platforms import current_platform

from .head import PhaseHead, head_parts, phase_choices
from .mrv2 import SlotPhases, model_state_class
from .plugin import phase_rows
from .sampling import PHASE_SLICES


class HeadPart:
    """Rows `[start, stop)` of the lm_head as vLLM's GEMM dispatch sees a layer: a weight (a view, no copy) and,
    on the CPU, the `cpu_linear` vLLM's dispatch gives a weight of that shape."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int):
        self.weight = weight[start:stop]
        self.bias = None


class PhaseHeadMethod(UnquantizedEmbeddingMethod):
    """vLLM's unquantized lm_head method; processing the loaded weight also builds the head's parts (`PhaseHead`).

    On the CPU each part gets what vLLM's own `dispatch_cpu_unquantized_gemm` gives a weight of its shape (the
    oneDNN handler with the weight prepacked, AMX's small-GEMM kernel, zentorch, or `F.linear`), and the parts
    take the whole head's place: vLLM's packed copy of the whole head is built only where a phase takes the full
    head. Elsewhere a part runs through vLLM's own `apply` (batch-invariant kernel included) on its rows."""

    def __init__(self, max_rows: int):
        super().__init__()
        self.max_rows = max_rows
        self.head: PhaseHead | None = None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        vocab, hidden_size = layer.org_vocab_size, layer.weight.shape[1]
        sliced = phase_choices(hidden_size, vocab, self.max_rows)
        parts = head_parts(vocab)
        if not current_platform.is_cpu():
            super().process_weights_after_loading(layer)
            self.head = PhaseHead(vocab, {bounds: self._kernel(HeadPart(layer.weight, *bounds)) for bounds in parts},
                                  functools.partial(self.apply, layer), sliced)
            return
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        keep_full = not all(sliced.values())
        if keep_full:  # vLLM's own packed full head, beside the slices that pay
            super().process_weights_after_loading(layer)
            parts = [bounds for phase, bounds in enumerate(PHASE_SLICES) if sliced[phase]]
        kernels = {}
        for bounds in parts:
            part = HeadPart(layer.weight, *bounds)
            dispatch_cpu_unquantized_gemm(part, remove_weight=False)
            kernels[bounds] = self._kernel(part)
        self.head = PhaseHead(vocab, kernels, functools.partial(self.apply, layer) if keep_full else None, sliced)
        if not keep_full:  # vLLM's own path to the full head (`LogitsProcessor`) runs on the parts too
            layer.cpu_linear = lambda x, weight, bias: self.head.full_logits(x)

    def _kernel(self, part: HeadPart):
        return functools.partial(self.apply, part)


class YuE2ARForCausalLM(Qwen3ForCausalLM):
    # Instrumentation (tests, benchmarks): the most head rows one sequence got in one step since reset.
    widest_row = 0

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._vllm_config = vllm_config
        if type(self.lm_head.quant_method) is UnquantizedEmbeddingMethod and self.lm_head.tp_size == 1:
            self.lm_head.quant_method = PhaseHeadMethod(vllm_config.scheduler_config.max_num_seqs)
        # Model Runner V2: rows' phases, told by our model state (`get_model_state_cls`); unused under V1.
        self.slot_phases = SlotPhases()

    @staticmethod
    def get_model_state_cls():
        """Model Runner V2: vLLM's default model state, also telling `slot_phases` each step's rows."""
        return model_state_class()

    def _row_phases(self, rows: int) -> dict | None:
        phases = phase_rows(self._vllm_config, rows)
        if phases is None:
            phases = self.slot_phases.take(rows)
        return phases

    def _phase_head(self) -> PhaseHead | None:
        """The head's parts, where the logits are the head's plain product (one rank, no scale, cap or cast)."""
        method = self.lm_head.quant_method
        plain = self.logits_processor.scale == 1.0 and self.logits_processor.soft_cap is None \
            and getattr(self.logits_processor, "head_dtype", None) in (None, self.lm_head.weight.dtype)
        return method.head if plain and isinstance(method, PhaseHeadMethod) else None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        phases = self._row_phases(len(hidden_states))
        phase_head = self._phase_head() if phases is not None else None
        if phase_head is None:
            type(self).widest_row = max(type(self).widest_row, self.config.vocab_size)
            return super().compute_logits(hidden_states)
        logits, widest = phase_head.logits(hidden_states, phases)
        type(self).widest_row = max(type(self).widest_row, widest)
        return logits
