"""The YuE2 AR model for vLLM: vLLM's Qwen3 with an lm_head computed only over each row's phase.

A semantic-phase row can only emit MUSIC_END and the 32,768 codec ids, an abc-phase row only ids
below EOD and </abc>; the other 151,935 (resp. 32,855) rows of the 184,704-row head are wasted reads.
`compute_logits` therefore multiplies each row's hidden state with its phase's slice of the head
(the slices are contiguous: no copy) and leaves the rest −inf, so the sampler and the logits
processors still see a full-vocabulary tensor.

How a row's phase is known (V1 model runner only): the yue2 logits processor (`plugin.YuE2Sampler`) keeps a table
`batch index -> RowState` that vLLM updates through `BatchUpdate` at the start of every step,
before the forward pass; `compute_logits` reads it through `plugin.phase_rows`. Chunked
prefill (rows still prefilling are in the table; their samples are discarded anyway), preemption
(rows leave and re-enter through the same updates) and CUDA-graph padding (logits are computed for
the gathered per-request rows only) keep it exact. Rows it does not know (plain requests, prompt
logprobs, a batch of another size) get the full head. The engine uses this class when our plugin
overrides the architecture (`hf_overrides`, see `worker`), which the backend does for
checkpoints with YuE2's 184,704-token layout unless `sliced_head` is off. Under Model Runner V2
`compute_logits` gets no row-to-request table, so the backend serves plain Qwen3 there (recorded).

Importing this module imports vLLM: only the engine worker (through the registry) does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from . import sampling as es
from .plugin import phase_rows


class YuE2ARForCausalLM(Qwen3ForCausalLM):
    # Instrumentation (tests, benchmarks): the most head rows one sequence got in one step since reset.
    widest_row = 0

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._vllm_config = vllm_config

    def _head_is_plain(self) -> bool:
        return isinstance(getattr(self.lm_head, "quant_method", None),
                          (UnquantizedEmbeddingMethod, UnquantizedLinearMethod)) \
            and self.lm_head.tp_size == 1 and self.logits_processor.scale == 1.0 \
            and self.logits_processor.soft_cap is None \
            and getattr(self.logits_processor, "head_dtype", None) in (None, self.lm_head.weight.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        phases = phase_rows(self._vllm_config, len(hidden_states))
        if phases is None or not self._head_is_plain():
            type(self).widest_row = max(type(self).widest_row, self.config.vocab_size)
            return super().compute_logits(hidden_states)
        weight = self.lm_head.weight
        logits = torch.full((len(hidden_states), self.config.vocab_size), float("-inf"), dtype=hidden_states.dtype,
                            device=hidden_states.device)
        for phase, index in phases.items():  # index tensors cached per batch layout: no per-step copy
            columns = slice(0, self.config.vocab_size) if phase is None else es.phase_slice(phase)
            logits[index, columns] = F.linear(hidden_states[index], weight[columns])
            type(self).widest_row = max(type(self).widest_row, columns.stop - columns.start)
        return logits
