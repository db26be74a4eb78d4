"""The engine's life: its worker started (checked before: the vLLM release, the memory split; and after: the ready
event's runner, scheduling and K/V record), a start stopped from another thread, a dead worker restarted within a
restart budget, the worker closed. A start that fails keeps the worker's log and names it with its tail."""
from __future__ import annotations

import queue
import subprocess
import threading
import time

from ..checkpoint import drop_page_cache
from ..kv_cache import record_problem
from ..memory import MEMINFO, read_meminfo
from .routing import EventRouter
from .setup import EngineSetup
from .worker_process import POLL_SECONDS, EngineError, EngineStartAborted, WorkerProcess, exit_in_words, kill_group


class RestartBudget:
    """A dead engine is started again at most `max_restarts` times within any `window_s` seconds (a long-lived
    server keeps going); `restarts` counts them over the engine's life."""

    def __init__(self, max_restarts: int, window_s: float):
        self.max_restarts, self.window_s = max_restarts, window_s
        self.restarts = 0
        self._times: list[float] = []

    def left(self, now: float | None = None) -> bool:
        """Whether a dead engine would be started again now."""
        now = time.monotonic() if now is None else now
        return sum(1 for t in self._times if now - t < self.window_s) < self.max_restarts

    def spend(self, failure: str | None, now: float | None = None) -> None:
        """Count one restart, or raise EngineError naming the last `failure` when this window's budget is spent."""
        now = time.monotonic() if now is None else now
        self._times = [t for t in self._times if now - t < self.window_s]
        if len(self._times) >= self.max_restarts:
            raise EngineError(f"the vLLM engine died {len(self._times) + 1} times within {self.window_s:.0f} s; not "
                              f"restarting it again (max_restarts {self.max_restarts}). Last failure: {failure}")
        self._times.append(now)
        self.restarts += 1


class EngineLifecycle:
    """One engine worker at a time for `setup`, feeding `routing`'s streams; `refusal` (None: none) is why this
    vLLM cannot be driven, decided when the backend was built and raised by every start."""

    def __init__(self, setup: EngineSetup, routing: EventRouter, refusal: str | None = None):
        self.setup, self.routing, self.refusal = setup, routing, refusal
        self.budget = RestartBudget(setup.settings.max_restarts, setup.settings.restart_window_s)
        self.engine_info: dict = {}  # the running engine's vllm_version, engine_load_seconds and kv_cache record
        self.worker: WorkerProcess | None = None
        self.starting: WorkerProcess | None = None  # the worker of a start in progress
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set by abort_start: the start in progress gives up within POLL_SECONDS
        self._starts = 0
        self._fresh = False  # started, and no run has taken its load time yet

    @property
    def running(self) -> bool:
        return self.worker is not None and self.worker.alive

    @property
    def ever_started(self) -> bool:
        return self._starts > 0

    @property
    def process(self) -> subprocess.Popen | None:
        return self.worker.process if self.worker is not None else None

    @property
    def gone_for_good(self) -> bool:
        """The worker died and `start` would refuse to restart it (this window's restart budget is spent). A
        restart in progress is not: the dead worker is dropped before the new one starts."""
        worker = self.worker
        return worker is not None and not worker.alive and not self.budget.left()

    def abort_start(self) -> None:
        """Stop a start in progress from another thread: its worker's process group is killed and `start`
        raises EngineStartAborted at once (the next `start` goes ahead as usual)."""
        self._stop.set()
        worker = self.starting
        if worker is not None:
            worker.closing = True
            kill_group(worker.process, grace=1.0)

    def start(self) -> None:
        with self._lock:
            self._stop.clear()
            if self.running:
                return
            if self.worker is not None:  # it died: a later song gets a fresh engine, within the restart budget
                self.budget.spend(self.worker.failure)
                self.worker.close(keep_log=True)
                self.worker = None
            self._check_startable()
            worker = WorkerProcess(self.setup.worker_setup(), self.routing.streams, self.routing.lock,
                                   self.setup.settings.threads, self.setup.worker_env(),
                                   self.setup.settings.progress_timeout_s)
            event = self._await_ready(worker)
            kv_cache = self._check_ready(worker, event)
            self.worker, self._starts, self._fresh = worker, self._starts + 1, True
            self.engine_info = {"vllm_version": event["vllm_version"],
                                "engine_load_seconds": event["engine_load_seconds"], "kv_cache": kv_cache}
            if self.setup.plan.unified is not None:  # the engine has read its weights: their cached pages are the pool's
                drop_page_cache(self.setup.settings.checkpoint.path)

    def _check_startable(self) -> None:
        """Refuse, before a worker is spawned, what would fail in it: this vLLM, a split that cannot fit, and on
        unified memory a pool that shrank since the split was planned."""
        if self.refusal:
            raise EngineError(self.refusal)
        plan = self.setup.plan
        plan.check()
        if plan.unified is not None:  # refused here rather than by vLLM's own start-up check
            meminfo = self.setup.settings.meminfo_path
            problem = plan.startup_problem(read_meminfo(meminfo).get("MemAvailable", 0))
            if problem:
                raise EngineError(f"{problem} (MemAvailable from {meminfo or MEMINFO})")

    def _await_ready(self, worker: WorkerProcess) -> dict:
        """The worker's first event (`ready`, `died`), `timeout` after start_timeout_s; a start stopped meanwhile
        (`abort_start`), or an exception in this thread, kills the worker and raises."""
        self.starting = worker
        try:
            event = self._first_event(worker)
        except BaseException:  # e.g. KeyboardInterrupt in the thread that starts it: no worker is left behind
            worker.closing = True
            kill_group(worker.process, grace=1.0)
            worker.close()
            raise
        finally:
            self.starting = None
        if event.get("event") == "aborted" or self._stop.is_set():
            worker.closing = True
            kill_group(worker.process, grace=1.0)
            worker.close()
            raise EngineStartAborted("the vLLM engine start was stopped (the pipeline is closing)")
        return event

    def _first_event(self, worker: WorkerProcess) -> dict:
        deadline = time.monotonic() + self.setup.settings.start_timeout_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return {"event": "timeout"}
            try:
                return worker.ready.get(timeout=min(POLL_SECONDS * 4, left))
            except queue.Empty:
                continue
        return {"event": "aborted"}

    def _check_ready(self, worker: WorkerProcess, event: dict) -> dict:
        """The started engine's K/V record, once the engine is what was asked for: ready, with the runner and
        scheduling its sampler was chosen for and the K/V form asked; else the worker is closed (its log kept)."""
        settings, runner = self.setup.settings, self.setup.runner
        if event.get("event") != "ready":
            worker.close(keep_log=True)
            if event.get("event") == "timeout":
                what = (f"did not start within {settings.start_timeout_s:.0f} s (--engine-start-timeout; its worker "
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
        problem = record_problem(kv_cache, settings.kv_cache_dtype, settings.dtype)
        if problem:
            worker.close(keep_log=True)
            raise EngineError(f"{problem}; log kept at {worker.log_path}")
        return kv_cache

    def take_load_seconds(self) -> float | None:
        """The engine's load time for the first run after a start to record, None for every later run."""
        with self._lock:
            if not self._fresh:
                return None
            self._fresh = False
            return self.engine_info["engine_load_seconds"]

    def close(self) -> None:
        """Stop the worker and its process group (frees all engine memory)."""
        with self._lock:
            worker, self.worker = self.worker, None
        if worker is not None:
            worker.close()

    def describe(self) -> dict:
        """The engine's settings and memory split (for `doctor` and per-song records)."""
        return self.setup.describe(self.engine_info.get("kv_cache"))
