"""Each request's events from the engine worker to the call waiting on them, and its commands to the worker: what
a phase's run (`runs`) talks through. A stream per request id (both rows of a CFG pair share one), fed by the
worker's reader thread; a command framed to the running worker; the next event of a stream, with the engine's two
failures named: a worker that died, and a request without an event for `progress_timeout_s` (a stalled engine:
its worker is then stopped, and the next request starts a fresh one)."""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Sequence

from .worker_process import POLL_SECONDS, EngineError, Stream, WorkerProcess, exit_in_words


class EventRouter:
    """`runs.EngineLink` over whichever worker `current_worker` returns (the engine's life owns it)."""

    def __init__(self, current_worker: Callable[[], WorkerProcess | None], progress_timeout_s: float):
        self.current_worker = current_worker
        self.progress_timeout_s = progress_timeout_s
        self.streams: dict[str, Stream] = {}
        self.lock = threading.Lock()  # the worker's reader thread feeds `streams` under it

    def open_stream(self, rids: Sequence[str]) -> Stream:
        stream = Stream()
        with self.lock:
            for rid in rids:
                self.streams[rid] = stream
        return stream

    def forget_streams(self, rids: Sequence[str]) -> None:
        with self.lock:
            for rid in rids:
                self.streams.pop(rid, None)

    def send(self, message: dict) -> None:
        worker = self.current_worker()
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
        worker = self.current_worker()
        if worker is not None and worker.alive:
            worker.send({"command": "abort", "id": rid})

    def next_event(self, stream: Stream) -> tuple | None:
        """The stream's next event, None after a short wait (a dead worker raises, and so does a request
        without an event for `progress_timeout_s`: the worker is then stopped, the next request restarts it)."""
        try:
            event = stream.events.get(timeout=POLL_SECONDS)
        except queue.Empty:
            worker = self.current_worker()
            if worker is None:
                return None
            if not worker.alive and stream.events.empty() and worker.failure:
                raise EngineError(worker.failure) from None
            limit = self.progress_timeout_s
            if limit and worker.alive and time.monotonic() - stream.last_progress > limit:
                reason = (f"no progress for {limit:g} s: a request in the vLLM engine got no token, end or error "
                          f"(progress_timeout_s); the engine is taken as stalled and its worker was stopped")
                worker.stop(reason)
                raise EngineError(f"{reason}; log kept at {worker.log_path}; log tail:\n{worker.log_tail()}") from None
            return None
        stream.last_progress = time.monotonic()
        return event
