"""The YuE2 AR model for vLLM: vLLM's Qwen3 with an lm_head computed only over each row's phase.

A semantic-phase row can only emit MUSIC_END and the 32,768 codec ids, an abc-phase row only ids
below EOD and </abc>; the other 151,935 (resp. 32,855) rows of the 184,704-row head are wasted reads.
`compute_logits` therefore multiplies each row's hidden state with its phase's slice of the head
(the slices are contiguous: no copy) and leaves the rest −inf, so the sampler and the logits
processors still see a full-vocabulary tensor.

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

import torch
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from .mrv2 import SlotPhases, model_state_class
from .plugin import phase_rows, sliced_logits


class YuE2ARForCausalLM(Qwen3ForCausalLM):
    # Instrumentation (tests, benchmarks): the most head rows one sequence got in one step since reset.
    widest_row = 0

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._vllm_config = vllm_config
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

    def _head_is_plain(self) -> bool:
        return isinstance(getattr(self.lm_head, "quant_method", None),
                          (UnquantizedEmbeddingMethod, UnquantizedLinearMethod)) \
            and self.lm_head.tp_size == 1 and self.logits_processor.scale == 1.0 \
            and self.logits_processor.soft_cap is None \
            and getattr(self.logits_processor, "head_dtype", None) in (None, self.lm_head.weight.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        phases = self._row_phases(len(hidden_states))
        if phases is None or not self._head_is_plain():
            type(self).widest_row = max(type(self).widest_row, self.config.vocab_size)
            return super().compute_logits(hidden_states)
        logits, widest = sliced_logits(hidden_states, self.lm_head.weight, phases, self.config.vocab_size)
        type(self).widest_row = max(type(self).widest_row, widest)
        return logits
