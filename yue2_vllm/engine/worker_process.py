"""The engine worker process as the backend sees it: spawned from one long-lived thread, fed length-checked
frames on its stdin, read line by line on its stdout by one thread that hands each request's events to its
stream, and killed as a whole process group.

The worker runs in its own process session: closing it kills the whole group and leaves no orphans; if the
parent dies, the kernel kills the worker (`PR_SET_PDEATHSIG`, armed for a worker forked by the one long-lived
spawner thread) and the worker also exits on EOF on its stdin. A malformed message either way is fatal for the
worker and named in the error of every request in flight.
"""
from __future__ import annotations

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
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from .runner import BatchInvariance, RunnerChoice
from .worker import EVENT_PREFIX, PARENT_ENV, frame

LOG_TAIL_CHARS = 12000
POLL_SECONDS = 0.05


class EngineError(RuntimeError):
    """The vLLM worker failed or died; the message carries the tail of its log."""


class EngineStartAborted(EngineError):
    """The engine's start was stopped from outside (`abort_start`: a signal, the pipeline closing)."""


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


def kill_group(process: subprocess.Popen, grace: float = 2.0) -> None:
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
class Stream:
    """Events of one request (or of both rows of a CFG pair), fed by the reader thread: `(row id, kind,
    payload)` with kind `tokens`, `done`, `aborted`, `error`, or `died` (for every stream at once)."""

    events: queue.Queue = field(default_factory=queue.Queue)
    last_progress: float = field(default_factory=time.monotonic)  # when its last event arrived


class Spawner:
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


class WorkerProcess:
    """One engine process: its pipes, its log, and the thread that reads its events."""

    def __init__(self, setup: dict, streams: dict[str, Stream], lock: threading.Lock, threads: int | None = None,
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
            self.process = Spawner.popen([sys.executable, "-m", "yue2_vllm.engine.worker"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log,
                                          env={**worker_env(threads, env), PARENT_ENV: str(os.getpid())},
                                          start_new_session=True)
        self._finalizer = weakref.finalize(self, kill_group, self.process)
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
        kill_group(self.process, grace=0.0)

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
        kill_group(self.process)
        self._finalizer.detach()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        if not keep_log and not crashed:
            shutil.rmtree(self.log_dir, ignore_errors=True)
