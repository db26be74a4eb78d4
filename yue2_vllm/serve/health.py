"""What /health says: the workers' problems, a wedged owner or stalled songs, and the data dir (free bytes,
probe writes, a store write waiting to land)."""
from __future__ import annotations

import time

from ..scheduler import FINAL_STATES
from .durable import disk_refusal, disk_state


class Health:
    """/health and its parts (part of `SongService`)."""

    _disk_checked: tuple[float, tuple | None] = (0.0, None)  # (when, disk_state): the probe write at most once a second

    def engine_status(self) -> dict:
        return self.workers.health()["engine"]

    def health(self) -> tuple[dict, bool]:
        """What /health says: ok only when the workers can serve (the engine, the torch side; with replicas, at
        least one), the job owner runs and songs in flight make progress (or none are in flight) — a wedged
        server answers 503 with the reason."""
        workers = self.workers.health()
        problems = list(workers["problems"])
        in_flight, now = self.in_flight(), time.monotonic()
        quiet = now - self._last_progress
        if in_flight and quiet > self.config.stall_seconds:
            problems.append(f"no song has made progress for {quiet:.0f} s with {in_flight} in flight")
        busy = self._busy_since
        if busy is not None and now - busy > self.config.stall_seconds:
            problems.append(f"the job owner has been on one event for {now - busy:.0f} s")
        if not self._owner.is_alive() and self.started and not self.closing:
            problems.append("the job owner thread is not running")
        disk, disk_problems = self.disk_health()
        problems += disk_problems or self._pending_problems(in_flight, quiet)  # a full disk holds the queue
        ok = not problems
        extra = {k: v for k, v in workers.items() if k not in ("engine", "problems", "in_flight", "queued",
                                                               "concurrency")}
        return {"status": "ok" if ok else "unavailable", "problems": problems, "engine": workers["engine"],
                "queue": {"depth": self.store.queued(), "limit": self.config.queue_size, "held": len(self._held)},
                "in_flight": in_flight, "concurrency": self.workers.concurrency, "disk": disk, **extra}, ok

    def _disk(self) -> tuple[int | None, str | None]:
        """The data dir's free bytes and why it cannot be written (its probe write at most once a second)."""
        checked, state = self._disk_checked
        if state is None or time.monotonic() - checked >= 1.0:
            state = disk_state(self.config.data_dir)
            self._disk_checked = (time.monotonic(), state)
        return state

    def disk_health(self) -> tuple[dict, list[str]]:
        """The data dir as /health shows it, and its problems: under --min-free-disk, a probe write refused (checked
        at most once a second), a store write waiting to land — each naming the data dir, its free bytes and
        what is held."""
        data_dir, now = self.config.data_dir, time.monotonic()
        free, refused = state = self._disk()
        fault = self.store.fault()
        held = (f"{self.in_flight()} song(s) in flight, {self.store.queued()} queued "
                f"({len(self._held)} held)")
        problems = []
        refusal = disk_refusal(data_dir, self.config.min_free_bytes, state)
        if refusal is not None:
            problems.append(f"{refusal}: songs writing there fail (resumable), queued ones wait and new ones are "
                            f"refused (507); {held}")
        if fault is not None:
            problems.append(f"the job store {self.config.database} cannot be written for "
                            f"{now - fault.since:.0f} s ({fault.error}; {free} bytes free): the job owner retries "
                            f"the {fault.what} until it lands, every later transition waits behind it; {held}")
        disk = {"data_dir": str(data_dir), "free_bytes": free, "min_free_bytes": self.config.min_free_bytes,
                "writable": refused is None, "store_writable": fault is None,
                "store_waiting_seconds": None if fault is None else round(now - fault.since, 1)}
        return disk, problems

    def _pending_problems(self, in_flight: int, quiet: float) -> list[str]:
        """Work pending and nothing moving: queued jobs none of which starts, or jobs the store says run that no
        run holds — for longer than stall_seconds (a store fault is reported on its own)."""
        if self.store.fault() is not None or self.closing or not self.started:
            return []
        problems, stall = [], self.config.stall_seconds
        waiting = self.store.queued() - len(self._held)
        if waiting > 0 and in_flight == 0 and quiet > stall:
            problems.append(f"{waiting} job(s) are queued and none has started for {quiet:.0f} s "
                            f"(0 of {self.workers.concurrency} in flight)")
        counts = self.store.counts()
        running = sum(n for status, n in counts.items() if status not in ("queued",) + FINAL_STATES)
        holding = sum(1 for live in list(self._live.values()) if not live.finalized)
        if running > holding and quiet > stall:
            problems.append(f"{running - holding} job(s) the store says are running have no run behind them")
        return problems

    def in_flight(self) -> int:
        return sum(1 for live in list(self._live.values()) if not live.finalized and live.handle is not None
                   and live.handle.state not in ("queued",) + FINAL_STATES)
