"""What a start-up is doing now: resolving, hashing, loading, deriving, starting the engine (bytes where known).

One process-wide `STARTUP` record, written by the steps that take time (hub resolution, weight hashing, the MoT
load, the AR checkpoint derivation, the engine start) and read by whoever shows it (`serve`'s /health before the
app is up). Steps run in several threads at once (the engine starts while the MoT loads), so the record holds
every step with its own bytes; `phase` names the latest one still running. Nothing here decides anything.

`StepAborted` (an InterruptedError) is what a step's `on_block` raises once its start-up is being stopped, so a
long copy or hash ends between two blocks and its temp files go with the exception.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

# --engine-start-timeout's default: a cold first start of the real AR checkpoint on the slowest machine we name,
# a DGX Spark (GB10, aarch64, sm_121), from a cold page cache and empty compile caches:
#     import torch + vLLM + triton on the Arm cores, cold storage                      60 s
#     read 4.3 GB of bf16 AR weights at a pessimistic 100 MB/s (network/USB storage)   43 s
#     torch.compile (Dynamo + Inductor) of the 28 Qwen3 layers, no compile cache      240 s
#     Triton / FlashInfer JIT kernels for sm_121 (few prebuilt cubins for 12.1)       360 s
#     CUDA graph capture, ~67 batch sizes x ~2 s on GB10                              135 s
#     KV cache allocation, profile run, warm-up                                        30 s
#                                                                          sum  ~    870 s
# i.e. the old fixed 900 s with no room; doubled for margin: 1800 s. Nothing waits on it blindly: a signal stops
# the start at once, and a start that fails is retried later (StartRetry below).
ENGINE_START_TIMEOUT_S = 1800.0
PHASES = ("resolving", "hashing", "loading", "deriving", "starting_engine")
OnBlock = Callable[[int], None]  # bytes of one more block done; may raise StepAborted


class StepAborted(InterruptedError):
    """A start-up step stopped between two blocks because its start-up is being stopped (a signal, close())."""


@dataclass
class Step:
    phase: str
    what: str
    started: float
    done_bytes: int = 0
    total_bytes: int | None = None
    finished: float | None = None

    def describe(self, now: float) -> dict:
        described = {"phase": self.phase, "what": self.what,
                     "seconds": round((self.finished or now) - self.started, 3), "done_bytes": self.done_bytes}
        if self.total_bytes is not None:
            described["total_bytes"] = self.total_bytes
        if self.finished is not None:
            described["finished"] = True
        return described


class StartupRecord:
    """The steps of this process's start-up, thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._steps: list[Step] = []
        self.started = time.monotonic()

    def reset(self) -> None:
        with self._lock:
            self._steps, self.started = [], time.monotonic()

    @contextlib.contextmanager
    def step(self, phase: str, what: str, total_bytes: int | None = None) -> Iterator[Step]:
        """Record one step for the duration of the block; `step.done_bytes` may be advanced meanwhile."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        record = Step(phase, what, time.monotonic(), total_bytes=total_bytes)
        with self._lock:
            self._steps.append(record)
        try:
            yield record
        finally:
            record.finished = time.monotonic()

    def snapshot(self) -> dict:
        """`{"phase", "seconds", "steps": [...]}`: the latest running step's phase ("starting" before any)."""
        now = time.monotonic()
        with self._lock:
            steps = list(self._steps)
        running = [step for step in steps if step.finished is None]
        return {"phase": running[-1].phase if running else "starting", "seconds": round(now - self.started, 3),
                "steps": [step.describe(now) for step in steps]}


STARTUP = StartupRecord()


def block_counter(step: Step, stop: threading.Event | None = None) -> OnBlock:
    """An `on_block` that advances `step` and raises StepAborted once `stop` is set."""
    def on_block(nbytes: int) -> None:
        if stop is not None and stop.is_set():
            raise StepAborted(f"{step.phase} {step.what}: stopped (the start-up is being stopped)")
        step.done_bytes += nbytes

    return on_block


RETRY_FIRST_S = 60.0  # a failed engine start is tried again this long after the failure,
RETRY_MAX_S = 1800.0  # then twice as long after each further failure, at most this long


@dataclass
class StartRetry:
    """When a failed engine start is tried again: RETRY_FIRST_S after the first failure, doubling up to
    RETRY_MAX_S, without end (a long-lived process gets its engine once the cause is gone). Meanwhile songs run
    on the torch backend with `reason` on their record."""

    failures: int = 0
    reason: str | None = None
    failed_at: float | None = None
    retrying: bool = False  # a retry is in progress (songs keep to torch until it is done)

    def failed(self, reason: str, now: float | None = None) -> None:
        self.failures += 1
        self.reason, self.failed_at, self.retrying = reason, time.monotonic() if now is None else now, False

    def succeeded(self) -> None:
        self.failures, self.reason, self.failed_at, self.retrying = 0, None, None, False

    @property
    def backoff_s(self) -> float:
        return min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** max(0, self.failures - 1))

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.failures > 0 and not self.retrying and now - self.failed_at >= self.backoff_s

    def describe(self, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        left = 0.0 if self.retrying else max(0.0, self.failed_at + self.backoff_s - now)
        return {"state": "start_failed", "reason": self.reason, "failed_starts": self.failures,
                "retrying": self.retrying, "next_retry_seconds": round(left, 1)}
