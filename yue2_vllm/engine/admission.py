"""Engine rows and KV cache handed to requests: a request is sent only when an engine row per prompt and the
prompts' worst-case KV (prompt + max_tokens, in whole blocks) are free, so vLLM never has to preempt. The admission
also keeps the time with at least one row admitted (`busy_seconds`: benchmarks read the engine's idle time)."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Sequence

from ..memory import MemoryPlan, kv_cache_bytes, row_kv_bytes
from ..model.modeling import YuE2Config
from ..model.sampling import Cancelled
from .worker_process import POLL_SECONDS


def kv_budget(config: YuE2Config, cache_bytes: int, plan: MemoryPlan) -> int:
    """KV bytes the admitted rows may reserve: the engine's cache less vLLM's held-back blocks."""
    block = plan.kv_block_tokens
    return cache_bytes - kv_cache_bytes(config, 1, 2 * block, block, plan.kv_dtype_bytes)


def prompts_kv_bytes(config: YuE2Config, plan: MemoryPlan, prompts: Sequence[Sequence[int]], max_tokens: int) -> int:
    """The worst-case KV of rows that each may run to `max_tokens` after their prompt, in whole blocks."""
    return sum(row_kv_bytes(config, len(prompt) + max_tokens, plan.kv_block_tokens, plan.kv_dtype_bytes)
               for prompt in prompts)


class EngineAdmission:
    """`rows` engine rows and `kv_budget` KV bytes, reserved by requests and given back when they end; with
    `kv_admission` off only rows are counted (vLLM may then preempt)."""

    def __init__(self, rows: int, kv_budget: int, kv_admission: bool = True):
        self.rows, self.kv_budget, self.kv_admission = rows, kv_budget, kv_admission
        self._changed = threading.Condition()
        self._rows_used = 0
        self._kv_used = 0
        self._busy_since: float | None = None
        self.busy_seconds = 0.0  # time with at least one row admitted

    @contextlib.contextmanager
    def admitted(self, rows: int, kv: int, cancelled: Cancelled | None = None) -> Iterator[float]:
        """Hold `rows` rows and `kv` bytes for the block, once free; yields the seconds waited for them. More
        than the engine has is a ValueError at once; a cancel while waiting an InterruptedError."""
        waited, reserved = self._reserve(rows, kv, cancelled)
        try:
            yield waited
        finally:
            self._release(rows, reserved)

    def _reserve(self, rows: int, kv: int, cancelled: Cancelled | None) -> tuple[float, int]:
        """Wait until `rows` engine rows and `kv` bytes are free; `(seconds waited, KV bytes reserved)`."""
        if not self.kv_admission:
            kv = 0
        if rows > self.rows or kv > self.kv_budget:
            raise ValueError(f"the request needs {rows} engine row(s) and {kv / 2**20:.1f} MiB of KV cache, but the "
                             f"engine has {self.rows} rows and {self.kv_budget / 2**20:.1f} MiB")
        start = time.perf_counter()
        with self._changed:
            while self._rows_used + rows > self.rows or self._kv_used + kv > self.kv_budget:
                if cancelled is not None and cancelled():
                    raise InterruptedError("cancelled while waiting for an engine row")
                self._changed.wait(timeout=POLL_SECONDS * 4)
            if self._rows_used == 0:
                self._busy_since = time.perf_counter()
            self._rows_used += rows
            self._kv_used += kv
        return time.perf_counter() - start, kv

    def _release(self, rows: int, kv: int) -> None:
        with self._changed:
            self._rows_used -= rows
            self._kv_used -= kv
            if self._rows_used == 0 and self._busy_since is not None:
                self.busy_seconds += time.perf_counter() - self._busy_since
                self._busy_since = None
            self._changed.notify_all()

    @property
    def load(self) -> dict:
        with self._changed:
            return {"rows_used": self._rows_used, "kv_used": self._kv_used}
