"""Room for songs' buffers on the device: what the memory plan leaves after everything resident.

On a discrete GPU the plan (`memory.MemoryPlan.room`) keeps room beside the engine and the resident weights
for the buffers that come and go with songs: a NAR run's prefix K/V and activations, a VAE tile, a
torch-backend song's AR expert and K/V. Each is admitted here before it allocates and given back after; a
buffer that does not fit now waits (its song's status says so) until another song's are given back, and one
that could never fit is refused with the figures. Nothing admitted can then run the device out of memory.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

GIB = 2**30


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


class DeviceRoom:
    """A ledger of `capacity` bytes: `admit(need, what)` holds `need` of it for a `with` block."""

    def __init__(self, capacity: int, device: str = "cuda"):
        if capacity < 0:
            raise ValueError(f"room capacity must be >= 0, got {capacity}")
        self.capacity, self.device = int(capacity), device
        self.used = 0
        self.holders: dict[int, tuple[str, int]] = {}
        self.waits: list[dict] = []  # every wait: what, need, free then, seconds waited
        self._cond = threading.Condition()
        self._next = 0

    @property
    def free(self) -> int:
        with self._cond:
            return self.capacity - self.used

    def problem(self, need: int, what: str) -> str | None:
        """Why `need` can never be admitted (above the whole room), naming the figures; None when it can."""
        if need <= self.capacity:
            return None
        return (f"{what} needs {_gib(need)} on {self.device}, but the memory plan leaves {_gib(self.capacity)} "
                "for songs' buffers beside the engine and the resident weights; lower --concurrency (engine rows) "
                "or the song's length, use the FP8 AR checkpoint, or raise --budget")

    def fits_now(self, need: int) -> bool:
        with self._cond:
            return self.used + need <= self.capacity

    @contextlib.contextmanager
    def admit(self, need: int, what: str, *, on_wait: Callable[[int, int], None] | None = None,
              cancelled: Callable[[], bool] | None = None, poll: float = 0.5) -> Iterator[None]:
        """Hold `need` bytes while the block runs; wait (calling `on_wait(need, free)` once) while others hold
        too much; MemoryError when it can never fit, InterruptedError when `cancelled` while waiting."""
        problem = self.problem(need, what)
        if problem:
            raise MemoryError(problem)
        with self._cond:
            start, told = time.perf_counter(), None
            while self.used + need > self.capacity:
                if told is None:
                    told = {"what": what, "need": need, "free": self.capacity - self.used}
                    self.waits.append(told)
                    if on_wait is not None:
                        on_wait(need, self.capacity - self.used)
                if cancelled is not None and cancelled():
                    raise InterruptedError(f"cancelled while waiting for room ({what})")
                self._cond.wait(poll)
            if told is not None:
                told["seconds"] = time.perf_counter() - start
            self.used += need
            key, self._next = self._next, self._next + 1
            self.holders[key] = (what, need)
        try:
            yield
        finally:
            with self._cond:
                self.used -= need
                del self.holders[key]
                self._cond.notify_all()

    def describe(self) -> dict:
        with self._cond:
            return {"capacity": self.capacity, "used": self.used, "holders": list(self.holders.values()),
                    "waits": len(self.waits)}
