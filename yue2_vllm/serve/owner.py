"""The job owner: the one thread every job transition happens on, and the service's life around it.

Song, lane and replica-stream threads post their events to its inbox; HTTP threads run their cancel / resume /
render / launch there as calls (`_call`). It resumes the unfinished jobs at start, puts the running ones back in
the queue at close, and its watchdog releases held jobs and purges past the retention window.
"""
from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from ..protocol import PHASES
from ..scheduler import FINAL_STATES, STATES, SongEvent
from .errors import Unavailable, log_failure

LOG = logging.getLogger("yue2_vllm.serve")
UNFINISHED = tuple(state for state in STATES if state not in FINAL_STATES)


@dataclass(eq=False)
class LiveJob:
    """A job a worker holds now: its run and what the events said so far (the owner's alone to write)."""

    handle: object | None  # the run (SongHandle, or a replica's RemoteRun); None only while a worker takes it
    budgets: dict
    record_stages: dict
    tokens: dict = field(default_factory=lambda: {phase: 0 for phase in PHASES})
    progress: dict = field(default_factory=dict)
    waiting: dict | None = None  # a stage waiting for room on the device (scheduler's `waiting` event)
    cancel_requested: bool = False
    finalized: bool = False


class JobOwner:
    """The owner thread and the lifecycle (part of `SongService`). Holds what only the owner writes: the live
    jobs (`_live`), the held ones (`_held`) and the recent song durations."""

    def _init_owner(self) -> None:
        self._stop = threading.Event()
        self._live: dict[str, LiveJob] = {}
        self._held: list[str] = []  # queued jobs kept from the workers while they cannot serve any song
        self._durations: deque[float] = deque(maxlen=50)  # recent songs, started → finished (for Retry-After)
        self.closing = False
        self._inbox: queue.Queue = queue.Queue()
        self._owner = threading.Thread(target=self._own, name="yue2-serve-jobs", daemon=True)
        self._busy_since: float | None = None  # when the owner took the item it is on (None: waiting)
        self._last_progress = time.monotonic()
        self._watchdog = threading.Thread(target=self._watch, name="yue2-serve-watchdog", daemon=True)
        self.started = False

    def _own(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            self._busy_since = time.monotonic()
            try:
                if item[0] == "event":
                    self._on_event(item[1])
                else:
                    _, fn, args, future = item
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:  # the caller's to raise
                        future.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 (one job's bug must not stop every other job's transitions)
                log_failure(LOG, f"job owner: handling {item[0]}", exc)
            finally:
                self._busy_since = None

    def _call(self, fn, *args):
        """Run `fn(*args)` on the job owner and return its result (on the owner itself: directly)."""
        if threading.current_thread() is self._owner or not self._owner.is_alive():
            return fn(*args)
        future: Future = Future()
        self._inbox.put(("call", fn, args, future))
        deadline = time.monotonic() + self.config.owner_timeout
        while True:  # in slices: a client is told at once when the owner waits on the store
            try:
                return future.result(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                fault = self.store.fault()
                if fault is not None and time.monotonic() - fault.since > 2:
                    raise Unavailable(f"the job store cannot be written ({fault.error}); the job owner retries "
                                      "its pending write and then carries out this request",
                                      headers={"Retry-After": "5"}) from None
                if time.monotonic() >= deadline:
                    raise Unavailable(f"the job owner did not answer within {self.config.owner_timeout:.0f} s",
                                      headers={"Retry-After": "5"}) from None

    def _post_event(self, event: SongEvent) -> None:
        """The workers' listener (song, lane and stream threads): never blocks, takes no lock."""
        self._last_progress = time.monotonic()
        self._inbox.put(("event", event))

    def start(self) -> None:
        """Resume every unfinished job (creation order), then watch the engine."""
        if self.started:
            return
        self.started = True
        self.workers.start()
        self._owner.start()
        try:
            self._call(self._recover)
        except Unavailable as exc:  # the store cannot be written now: the recovery stays queued on the owner
            LOG.error("resuming unfinished jobs waits: %s", exc)
        self._watchdog.start()

    def _recover(self) -> None:
        for job_id in self.store.deleted_ids():  # DELETEd while it ran, and the server stopped before it did
            self._remove(job_id)
        unfinished = self.store.unfinished()
        if unfinished:
            LOG.info("resuming %d unfinished job(s) from their last verified stage", len(unfinished))
        for record in unfinished:
            if record.cancel_requested:  # asked to stop before the server did: it stays stopped
                self._record_final(record.id, None, "cancelled", error={"type": "Cancelled", "message": "cancelled"})
                continue
            if record.status != "queued":  # it was running when the process died
                deaths = 1 + sum(1 for entry in record.retries if entry.get("kind") == "restart")
                if deaths >= self.config.max_interrupted_runs:
                    message = (f"the server died {deaths} times while this job was running (last while "
                               f"{record.status}); not running it again: it may be what kills the server")
                    self._record_final(record.id, None, "failed", error={"type": "Interrupted", "message": message})
                    continue
                record = self.store.requeue(record.id, None, reason=f"server restarted while {record.status}",
                                            kind="restart", from_statuses=UNFINISHED)
            self._launch(record)

    def close(self) -> None:
        """Stop at the next boundaries, waiting at most `shutdown_seconds`; unfinished jobs go back to the queue
        (as a shutdown, not a death) and resume at the next start."""
        self.closing = True
        self.hub.stop()  # nothing waits for a job's events any more (the server's shutdown may have said so first)
        self._stop.set()
        self.store.wake()
        if not self.workers.close(timeout=self.config.shutdown_seconds):
            LOG.warning("songs did not stop within %.0f s; leaving them to resume at the next start",
                        self.config.shutdown_seconds)
        if self._owner.is_alive():
            try:
                self._call(self._requeue_unfinished)
            except (Unavailable, sqlite3.OperationalError) as exc:  # the store refused: the next start resumes them
                LOG.error("stopping: unfinished jobs not requeued (%s); the next start resumes them", exc)
            self._inbox.put(None)
            self._owner.join(timeout=10)
        if self._watchdog.is_alive():
            self._watchdog.join(timeout=10)
        self.store.close()

    def _requeue_unfinished(self) -> None:
        for record in self.store.unfinished():
            if record.status != "queued" and not record.cancel_requested:
                self.store.requeue(record.id, None, reason=f"the server was stopped while {record.status}",
                                   kind="shutdown", from_statuses=UNFINISHED)

    def _watch(self) -> None:
        """Put held jobs back to the workers once they can serve again; purge past the retention window."""
        last_sweep, was_down = 0.0, False
        while not self._stop.is_set():
            down = self.workers.down_for_good() is not None
            if was_down and not down and self._held:
                self._call_quietly(self._release_held)
            was_down = down
            if self.config.retention_seconds is not None and time.monotonic() - last_sweep > self.config.sweep_interval:
                last_sweep = time.monotonic()
                self._call_quietly(self._sweep)
            self._stop.wait(self.config.watchdog_interval)

    def _call_quietly(self, fn) -> None:
        try:
            self._call(fn)
        except Exception as exc:  # noqa: BLE001 (logged; the watchdog goes on)
            log_failure(LOG, f"watchdog: {getattr(fn, '__name__', fn)}", exc)

    def _sweep(self) -> None:
        """Purge finished jobs past the retention window (owner; called from the watchdog)."""
        if self.config.retention_seconds is None:
            return
        for job_id in self.store.finished_before(time.time() - self.config.retention_seconds):
            self._purge(job_id)

    def _purge(self, job_id: str) -> bool:
        """Remove a finished job past the retention window (never one a run still holds), its finished takes too."""
        record = self.store.get(job_id)
        if record is not None:
            for take in self.take_records(record)[1:]:
                if take.final and take.id not in self._live:
                    self._remove(take.id)
        return job_id not in self._live and self._remove(job_id)
