"""A song worker: what runs songs for the job service — one pipeline, its song scheduler and synthesis lane, and a
watchdog that restarts a dead engine. A single-process server holds one; with Ray every replica holds one
(`serve.replica`), and the service talks to them through `serve.cluster.ReplicaPool` instead.

The service hands the worker one attempt of a job at a time (`SongOrder`) and hears back `SongEvent`s: the
scheduler's own (`state`, `tokens`, `stage_done`, `score`, `nar`, `vae`) and one final event (`complete`,
`failed`, `cancelled`) whose data says it all in plain values, so it can cross a process boundary:
`{"error": {"type", "message"} | None, "result": {...} | None, "engine_failure": bool}`. A `complete` song's
files are verified here, on the song's own thread, before the event says `complete`.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ..artifacts import RunDirectory, verify_result
from ..checkpoint import disk_full
from ..pipeline import STAGE_RECORDS, YuE2Pipeline
from ..protocol import SongRequest
from ..takes import take_signals
from ..scheduler import FINAL_STATES, SongEvent, SongHandle, SongScheduler
from .durable import disk_refusal
from .errors import log_failure

LOG = logging.getLogger("yue2_vllm.serve")
ENGINE_DOWN = ("starting", "restarting", "failed")  # the engine cannot serve now: /health answers 503
# The engine's first start failed: songs run on the torch backend (/health 200) while the start is retried with
# backoff (startup.StartRetry); the engine part of /health says why and when it is tried again.
ENGINE_START_FAILED = "start_failed"
ERROR_CHARS = 2000
DISK_FULL = "DiskFull"  # the error type of a song whose files could not be written for want of space


def error_words(error: BaseException) -> dict:
    """`{"type", "message"}` of an exception, without an engine log tail, at most ERROR_CHARS long (a full disk's
    type is DiskFull: the song may be resumed once space returns)."""
    message = str(error).split("; log tail")[0]
    if len(message) > ERROR_CHARS:
        message = message[:ERROR_CHARS] + "…"
    return {"type": DISK_FULL if disk_full(error) else type(error).__name__, "message": message}


@dataclass(frozen=True)
class SongOrder:
    """One attempt of a job, as a worker runs it (plain values: it may travel to a Ray replica)."""

    job_id: str
    attempt: int
    request: dict  # SongRequest fields
    overrides: dict  # per-phase sampling overrides
    stage: str  # "plan" or "audio"
    directory: str  # the job's run directory (in the data dir every worker reads and writes)

    @property
    def run_id(self) -> str:
        return f"{self.job_id}.{self.attempt}"

    def to_dict(self) -> dict:
        return asdict(self)


def engine_failure(error: BaseException | None) -> bool:
    from ..engine.backend import EngineError

    return isinstance(error, EngineError)


class SongWorker:
    """Songs over one pipeline (see the module docstring). `listener` hears every event, from song and lane
    threads; it must not block."""

    def __init__(self, pipe: YuE2Pipeline, *, concurrency: int | None = None,
                 listener: Callable[[SongEvent], None] | None = None, watch_interval: float = 1.0):
        self.pipe = pipe
        self.listener = listener
        self.watch_interval = watch_interval
        self.engine_state: dict = {"state": "none" if pipe.backend_requested == "torch" else "starting"}
        self._engine = None
        self._stop = threading.Event()
        self.scheduler = SongScheduler(pipe, concurrency=concurrency, listener=self._on_song_event)
        # A queued song waits while its data dir cannot be written or has under this many bytes free: started,
        # it would fail at its first write.
        self.min_free_bytes = 0
        self.scheduler.start_gate = lambda handle: disk_refusal(handle.directory.parent, self.min_free_bytes)
        self._watchdog = threading.Thread(target=self._watch, name="yue2-engine-watchdog", daemon=True)

    @property
    def concurrency(self) -> int:
        return self.scheduler.concurrency

    @property
    def rules(self):
        return self.pipe.rules

    @property
    def weights(self) -> dict:
        """The weights' identities songs here are made with (a continuation must be of a song they made)."""
        return self.pipe.weights

    def start(self) -> None:
        if not self._watchdog.is_alive() and not self._stop.is_set():
            self._watchdog.start()

    def close(self, timeout: float | None = None) -> bool:
        """Stop every song at its next boundary; True when every thread stopped within `timeout` seconds."""
        self._stop.set()
        stopped = self.scheduler.close(cancel=True, timeout=timeout)
        self.pipe.stop_starting()  # the watchdog may be waiting for an engine start: it ends within seconds
        if self._watchdog.is_alive():
            self._watchdog.join(timeout=10)
        return stopped

    # -- songs

    def submit(self, order: SongOrder) -> SongHandle:
        """Run one attempt of a job; its events reach the listener (perhaps before this returns)."""
        group = (order.overrides.get("takes") or {}).get("parent") or order.job_id  # a job's takes: one group
        return self.scheduler.submit(SongRequest.from_dict(order.request), Path(order.directory),
                                     overrides=order.overrides, resume=True, stage=order.stage, group=group)

    def _on_song_event(self, event: SongEvent) -> None:
        if event.kind in FINAL_STATES:
            event = SongEvent(event.song, *self._final(event.song, event.kind))
        if self.listener is not None:
            self.listener(event)

    def _final(self, handle: SongHandle, kind: str) -> tuple[str, dict]:
        """The final event's kind and data: a `complete` song only once its files verify."""
        if kind == "complete":
            try:
                return "complete", {"error": None, "result": self.verify(handle), "engine_failure": False}
            except Exception as exc:  # noqa: BLE001 (a record never claims what the files do not hold)
                return "failed", {"error": {"type": "VerificationError",
                                            "message": f"the song's artifacts do not verify: {exc}"},
                                  "result": None, "engine_failure": False}
        error = error_words(handle.error) if handle.error is not None else None
        if kind == "cancelled" and error is None:
            error = {"type": "Cancelled", "message": "cancelled"}
        died = kind == "failed" and engine_failure(handle.error)
        return kind, {"error": error, "result": None, "engine_failure": died}

    def verify(self, handle: SongHandle) -> dict:
        """What result.json (or, for stage=plan, the plan record) holds, after checking every file."""
        pipe, request, overrides = self.pipe, handle.request, handle.overrides
        config = pipe.effective_config(request, overrides.get("abc"), overrides.get("semantic"),
                                       adapters=handle.adapters)
        document = handle.document or {}
        if handle.stage == "plan":
            latent_id = pipe.latent_identity(request, config)
            if RunDirectory(handle.directory).verified_stage("plan", latent_id, *STAGE_RECORDS["plan"]) is None:
                raise ValueError(f"{handle.directory}: plan.stage.json does not verify")
            return {"identity": document.get("identity"), "truncated": {"abc": document.get("truncated")},
                    "resumed": document.get("resumed")}
        document = verify_result(handle.directory, pipe.run_identity(request, config))
        return {"identity": document["identity"], "audio_seconds": document["audio_seconds"],
                "sample_rate": document["sample_rate"], "truncated": document["truncated"],
                "resumed": document["resumed"], "audio_bytes": document["artifacts"]["audio.flac"]["bytes"],
                "batch_invariant": document.get("batch_invariant", False), "signals": take_signals(document),
                **{key: document[key] for key in ("truncation", "continuation", "transcription")
                   if document.get(key)}}

    # -- the engine

    def down_for_good(self) -> str | None:
        """Why no song can be served any more (the engine died and may not be restarted), else None. Checked
        now, not at the watchdog's last look: a song that the engine's death failed asks at once."""
        engine = self.pipe.engine if self.pipe.backend_requested != "torch" else None
        if engine is not None and engine.gone_for_good:
            if self.engine_state.get("state") != "failed":
                self.engine_state = {"state": "failed", "reason": "the AR engine died and may not be restarted "
                                                                  f"(restarts so far: {engine.restarts})"}
        if self.engine_state.get("state") == "failed":
            return self.engine_state.get("reason") or "the AR engine is down"
        return None

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self.watch_engine()
            except Exception as exc:  # noqa: BLE001 (logged; the watchdog goes on)
                log_failure(LOG, "engine watchdog", exc)
            self._stop.wait(self.watch_interval)

    def watch_engine(self) -> None:
        """Keep `engine_state` current and restart a dead engine (bounded by the engine's max_restarts)."""
        from ..engine.backend import EngineError

        if self.pipe.backend_requested == "torch":
            return
        engine = self._engine or self.pipe.engine
        self._engine = engine
        if engine is None or not engine.running:
            restarting = engine is not None and engine.ever_started
            if restarting and self.engine_state.get("state") != "failed":
                LOG.warning("the AR engine is down; restarting it (restarts so far: %d)", engine.restarts)
                self.engine_state = {"state": "restarting", "restarts": engine.restarts}
            try:
                _, reason = self.pipe.select_ar_backend(1.0, False)  # starts (or restarts) the engine
            except EngineError as exc:
                if self._stop.is_set():
                    return  # the worker is closing: the stopped start is no failure to report
                if self.engine_state.get("state") != "failed":
                    LOG.error("the AR engine will not be restarted now: %s", error_words(exc)["message"])
                self.engine_state = {"state": "failed", "reason": error_words(exc)["message"]}
            else:
                self._engine = self.pipe.engine
                if reason and self.pipe.start_retry.failures:
                    self.engine_state = {"state": ENGINE_START_FAILED}  # its words are read live (engine_status)
                else:
                    self.engine_state = {"state": "unavailable", "reason": reason} if reason else {"state": "running"}
                if restarting and not reason:
                    LOG.warning("the AR engine is back")
        elif self.engine_state.get("state") != "running":
            self.engine_state = {"state": "running"}

    def engine_status(self) -> dict:
        """The engine as /health shows it: backend, state, restarts (checked now, not at the last watch)."""
        backend = self.pipe.backend_requested
        state = dict(self.engine_state)
        if state["state"] == ENGINE_START_FAILED:
            state = self.pipe.start_retry.describe() if self.pipe.start_retry.failures else {"state": "starting"}
        engine = self._engine
        if engine is not None:
            if state["state"] == "running" and not engine.running:
                state = {"state": "restarting"}
            state["restarts"] = engine.restarts
        actual = "torch" if backend == "torch" or state["state"] in ("unavailable", ENGINE_START_FAILED) else "vllm"
        return {"backend_requested": backend, "backend": actual, **state}

    def health(self) -> dict:
        """This worker's part of /health: its engine, what keeps it from serving (`problems`), its load."""
        engine = self.engine_status()
        problems = []
        if engine["state"] in ENGINE_DOWN:
            problems.append(f"the AR engine is {engine['state']}" + (f": {engine['reason']}" if engine.get("reason")
                                                                     else ""))
        if not self.scheduler.healthy:
            problems.append("the torch side is not running (a song or synthesis thread has stopped)")
        return {"engine": engine, "problems": problems, "in_flight": self.scheduler.in_flight,
                "queued": self.scheduler.queued, "concurrency": self.concurrency}
