"""The song scheduler: many songs through one pipeline, the AR engine kept busy, synthesis beside it.

Each admitted song runs `YuE2Pipeline.generate_to` in its own thread (at most `concurrency` at
once; the rest wait in the queue), so its artifacts, resume, identity and failure records are
exactly a single song's. Its AR phases go to the shared engine as soon as they are ready (the
vLLM backend multiplexes them; songs that need the torch AR backend take the pipeline's torch
lane one at a time). Its synthesis and decoding go to one `SynthesisLane` thread, which runs the
NAR of several songs that are ready together as one batched flow matching, while the engine
keeps decoding other songs. A failure or a cancellation belongs to its song alone.

    with SongScheduler(pipe, concurrency=8) as scheduler:
        handles = [scheduler.submit(request, runs / request.id) for request in requests]
        for handle in scheduler.as_completed(handles):
            print(handle.id, handle.state, handle.document or handle.error)
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import traceback
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from .pipeline import SemanticResult, YuE2Pipeline
from .protocol import SongRequest
from .song.continuation import CONTINUE_KEY, read_parent
from .takes import TakeOptions, run_takes

STATES = ("queued", "planning", "generating", "synthesizing", "decoding", "complete", "failed", "cancelled")
FINAL_STATES = ("complete", "failed", "cancelled")
STAGE_STATES = {"plan": "planning", "semantic": "generating", "synthesis": "synthesizing", "audio": "decoding"}
LOG = logging.getLogger(__name__)
COALESCE_SECONDS = 0.25  # how long the lane waits for songs about to finish their AR before a batched NAR


@dataclass
class SongEvent:
    """What happened to a song: `state`, `tokens` (per phase), `stage_done`, `score`, `nar`, `vae`, `waiting`
    (a stage waits for room on the device), or a final state (`complete`, `failed`, `cancelled`)."""

    song: "SongHandle"
    kind: str
    data: dict = field(default_factory=dict)


Listener = Callable[[SongEvent], None]


class SongHandle:
    """One submitted song: its live state and progress, its result, and a way to cancel it."""

    def __init__(self, request: SongRequest, directory: Path, overrides: dict, resume: bool, stage: str,
                 listener: Listener | None):
        self.request, self.directory, self.overrides = request, Path(directory), dict(overrides or {})
        self.resume, self.stage = resume, stage
        self.adapters = None  # the song's adapters (song.adapters.AdapterRequest), resolved once when it is admitted
        self.state = "queued"
        self.tokens = {"abc": 0, "semantic": 0}
        self.progress: dict[str, tuple[int, int]] = {}
        self.waiting: dict | None = None  # a stage waiting for room on the device, and since when
        self.document: dict | None = None
        self.error: BaseException | None = None
        self.submitted = time.time()
        self.finished: float | None = None
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._transition = threading.Lock()  # a queued song is either started or cancelled, once
        self._started = False
        self._listener = listener

    @property
    def id(self) -> str:
        return self.request.id

    def cancel(self) -> bool:
        """Stop the song at its next token, ODE step or VAE tile; a queued song is cancelled at once (True)."""
        self._cancel.set()
        return self._cancel_if_queued()

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _emit(self, kind: str, **data) -> None:
        if self._listener is not None:
            try:
                self._listener(SongEvent(self, kind, data))
            except Exception:  # a listener's bug must not fail the song
                traceback.print_exc()

    def _set_state(self, state: str, **data) -> None:
        self.state = state
        self._emit("state", state=state, **data)

    # -- pipeline callbacks

    def on_token(self, phase: str, token: int) -> None:
        self.tokens[phase] += 1
        self._emit("tokens", phase=phase, count=self.tokens[phase])

    def on_progress(self, stage: str, done: int, total: int) -> None:
        if stage.endswith("_wait"):  # the stage waits for room on the device (song.admission.admitted): need, free
            self.waiting = {"stage": stage[:-len("_wait")], "need_bytes": done, "free_bytes": total,
                            "since": time.time()}
            self._emit("waiting", **self.waiting)
            return
        if self.waiting is not None and self.waiting["stage"] == stage:
            self.waiting = None
        self.progress[stage] = (done, total)
        self._emit(stage, done=done, total=total)

    def on_stage(self, stage: str, event: str, meta: dict | None) -> None:
        if event == "start":
            self._set_state(STAGE_STATES[stage])
            return
        self._emit("stage_done", stage=stage, reused=event == "reused", meta=meta)
        if stage == "plan":
            self._emit("score", abc=(meta or {}).get("abc"), reused=event == "reused")

    def _start(self) -> bool:
        """Claim the song for a song thread; False when it was cancelled (and finished) while queued."""
        with self._transition:
            if self._done.is_set() or self._cancel.is_set():
                return False
            self._started = True
            return True

    def _cancel_if_queued(self) -> bool:
        with self._transition:
            if self._started or self._done.is_set():
                return False
            self._finish_locked("cancelled", error=InterruptedError("cancelled before it started"))
        self._emit_final()
        return True

    def _finish(self, state: str, document: dict | None = None, error: BaseException | None = None) -> None:
        with self._transition:
            finished = self._finish_locked(state, document, error)
        if finished:
            self._emit_final()

    def _finish_locked(self, state, document=None, error=None) -> bool:
        if self._done.is_set():
            return False
        self.document, self.error, self.finished = document, error, time.time()
        self.state = state
        self._done.set()
        return True

    def _emit_final(self) -> None:
        """The final event, sent once the transition lock is released: a listener may take its own locks (or
        cancel this very song) without an order between the two."""
        error = self.error
        self._emit(self.state, error=None if error is None else f"{type(error).__name__}: {error}")


@dataclass
class _LaneJob:
    kind: str  # "nar" | "vae"
    payload: object
    cancelled: Callable[[], bool] | None
    on_progress: Callable | None
    future: Future = field(default_factory=Future)
    queued: float = field(default_factory=time.perf_counter)


class SynthesisLane:
    """The torch side of every song: one NAR thread and one VAE thread, fed by the song threads.

    The NAR thread runs songs that are ready together as one batched flow matching (`batch` songs
    at most; 1 keeps upstream's one-song path, bit for bit) while the VAE thread decodes the songs
    before them, so the two stages overlap. On CUDA a NAR batch is admitted only while the device
    has room for its buffers; a batched run that fails as a whole is retried one song at a time,
    so no song fails for another's sake.
    """

    def __init__(self, pipe: YuE2Pipeline, batch: int = 1, expecting: Callable[[], int] | None = None,
                 threads: int | None = None):
        if batch < 1:
            raise ValueError(f"synthesis batch must be >= 1, got {batch}")
        self.pipe, self.batch = pipe, batch
        self.expecting = expecting or (lambda: 0)  # songs still in their AR phases (they may join a batch)
        self.threads = threads
        self._queues: dict[str, queue.Queue[_LaneJob | None]] = {"nar": queue.Queue(), "vae": queue.Queue()}
        self.batches: list[int] = []
        self._active, self._busy_since, self.busy_seconds = 0, 0.0, 0.0
        self._busy_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(kind,), name=f"yue2-lane-{kind}", daemon=True)
                         for kind in self._queues]
        for thread in self._threads:
            thread.start()

    # -- called from song threads (they block until their job is done)

    def synthesize(self, semantic: SemanticResult, *, cancelled=None, on_progress=None) -> np.ndarray:
        return self._submit("nar", semantic, cancelled, on_progress)

    def decode(self, latents: np.ndarray, *, cancelled=None, on_progress=None) -> np.ndarray:
        return self._submit("vae", latents, cancelled, on_progress)

    def _submit(self, kind, payload, cancelled, on_progress):
        job = _LaneJob(kind, payload, cancelled, on_progress)
        self._queues[kind].put(job)
        return job.future.result()

    def close(self, timeout: float | None = 60.0) -> None:
        for jobs in self._queues.values():
            jobs.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def threads_alive(self) -> list[threading.Thread]:
        return [thread for thread in self._threads if thread.is_alive()]

    @property
    def healthy(self) -> bool:
        """Both lane threads are running (a dead one would leave every song waiting for its synthesis)."""
        return all(thread.is_alive() for thread in self._threads)

    # -- the lane threads

    def _busy(self, delta: int) -> None:
        with self._busy_lock:
            now = time.perf_counter()
            if self._active == 0 and delta > 0:
                self._busy_since = now
            self._active += delta
            if self._active == 0:
                self.busy_seconds += now - self._busy_since

    def _take(self, kind: str) -> list[_LaneJob] | None:
        jobs_queue = self._queues[kind]
        job = jobs_queue.get()
        if job is None:
            return None
        jobs = [job]
        if kind == "nar" and self.batch > 1:
            deadline = time.perf_counter() + COALESCE_SECONDS
            while len(jobs) < self.batch and (self.expecting() > 0 or not jobs_queue.empty()):
                try:
                    more = jobs_queue.get(timeout=max(0.0, deadline - time.perf_counter()))
                except queue.Empty:
                    break
                if more is None:
                    jobs_queue.put(None)  # stop after this batch
                    break
                jobs.append(more)
        return jobs

    def _run(self, kind: str) -> None:
        with torch_threads(self.threads):
            while True:
                jobs = self._take(kind)
                if jobs is None:
                    return
                self._busy(+1)
                try:
                    if kind == "vae":
                        self._one(jobs[0])
                    else:
                        self._nar(jobs)
                finally:
                    self._busy(-1)

    def _one(self, job: _LaneJob) -> None:
        try:
            call = self.pipe.decode if job.kind == "vae" else self.pipe.synthesize
            job.future.set_result(call(job.payload, cancelled=job.cancelled, on_progress=job.on_progress))
        except BaseException as exc:  # the song's own failure
            job.future.set_exception(exc)

    def _nar(self, jobs: list[_LaneJob]) -> None:
        jobs = self._admit(jobs)
        self.batches.append(len(jobs))
        if len(jobs) == 1:
            self._one(jobs[0])
            return
        try:
            results = self.pipe.synthesize_many([job.payload for job in jobs], cancelled=[j.cancelled for j in jobs],
                                                on_progress=[j.on_progress for j in jobs])
        except Exception:  # e.g. out of memory for the whole batch: each song on its own
            for job in jobs:
                self._one(job)
            return
        for job, result in zip(jobs, results):
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)

    def _admit(self, jobs: list[_LaneJob]) -> list[_LaneJob]:
        """Keep only as many songs as there is room for now, requeue the rest: beside the engine on a discrete
        GPU the plan's room (`room.DeviceRoom`, where the pipeline then admits the batch: the first song waits
        there when even it does not fit); on unified memory the pool the plan reads (MemAvailable less the OS
        reserve); otherwise on CUDA what this process can still allocate (its cached blocks plus growth up to
        the per-process cap and the device's free bytes)."""
        room = getattr(self.pipe, "room", None)
        if len(jobs) == 1 or (room is None and self.pipe.device.type != "cuda"):
            return jobs
        from .memory import nar_song_bytes
        from .protocol import CONTEXT, chunk_ranges

        if room is not None:
            free = room.free
        elif getattr(self.pipe, "unified", None) is not None:
            from .memory import unified_pool

            free = unified_pool().pool
        else:
            from .devices import cuda_free_bytes

            free = cuda_free_bytes(self.pipe.device)
        streamed = not getattr(self.pipe, "ar_on_device", True)
        config = self.pipe.model.config
        generation = getattr(self.pipe, "generation_config", None)  # its NAR context sets the chunks (a long song's)
        context = generation.context if generation is not None else CONTEXT
        admitted, need = [], 0
        for job in jobs:
            semantic = job.payload
            prefix = len(semantic.plan.prefix)
            chunks = [prefix + (b - a) + 3 for a, b in chunk_ranges(len(semantic.tokens), prefix, context)]
            need += nar_song_bytes(config, chunks, streamed=streamed and not admitted)
            if admitted and need > free:
                self._queues["nar"].put(job)
            else:
                admitted.append(job)
        return admitted


class FairQueue:
    """Queued songs taken round-robin over their groups (a job's takes are one group), in the order the groups
    arrived: takes of one job share the song threads with other jobs' songs instead of going first as a block.
    `stop()` hands one waiting (or the next) taker None once nothing is queued."""

    def __init__(self):
        self._groups: OrderedDict[str, deque] = OrderedDict()
        self._stops = 0
        self._ready = threading.Condition()

    def put(self, item, group: str) -> None:
        with self._ready:
            self._groups.setdefault(group, deque()).append(item)
            self._ready.notify()

    def stop(self) -> None:
        with self._ready:
            self._stops += 1
            self._ready.notify()

    def get(self):
        with self._ready:
            while not self._groups and not self._stops:
                self._ready.wait()
            if not self._groups:
                self._stops -= 1
                return None
            group, items = next(iter(self._groups.items()))
            item = items.popleft()
            del self._groups[group]
            if items:  # the group's next song waits behind every other group's next
                self._groups[group] = items
            return item


class SongScheduler:
    """Runs submitted songs `concurrency` at a time over one pipeline (see the module docstring)."""

    def __init__(self, pipe: YuE2Pipeline, *, concurrency: int | None = None, synthesis_batch: int | None = None,
                 listener: Listener | None = None):
        self.pipe = pipe
        self.concurrency = concurrency if concurrency is not None else default_concurrency(pipe)
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        self._check_memory()
        self.threads = self._torch_threads()
        self.listener = listener
        # Why a queued song may not start now (e.g. its data dir is full), else None; polled until it may.
        self.start_gate: Callable[[SongHandle], str | None] | None = None
        self._closing = threading.Event()
        self.lane = SynthesisLane(pipe, synthesis_batch if synthesis_batch is not None else default_synthesis_batch(pipe, self.concurrency),
                                  expecting=lambda: sum(1 for h in list(self._handles.values())
                                                        if h.state in ("planning", "generating")),
                                  threads=self.threads)
        self._queue = FairQueue()
        self._handles: dict[str, SongHandle] = {}
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._worker, name=f"yue2-song-{i}", daemon=True)
                         for i in range(self.concurrency)]
        for thread in self._threads:
            thread.start()

    def _check_memory(self) -> None:
        """Refuse, before any song starts, a concurrency whose engine + torch split cannot fit."""
        engine = self.pipe.engine
        if engine is not None:
            if self.pipe.options.engine.keep is False:
                raise ValueError("EngineOptions.keep=False stops the engine before each NAR, under the songs still "
                                 "generating; the scheduler needs a resident engine")
            engine.plan.check()

    def _torch_threads(self) -> int | None:
        """On the CPU beside an engine, this process's torch threads stay off the engine's cores."""
        if self.pipe.device.type != "cpu" or self.pipe.engine is None:
            return None
        from .engine.worker_process import cpu_split

        return cpu_split()[1]

    def submit(self, request: SongRequest, directory: str | os.PathLike, *, overrides: dict | None = None,
               resume: bool = False, stage: str = "audio", group: str | None = None,
               adapters=None) -> SongHandle:
        """Queue a song. Its events may reach the listener before `submit` returns (a song thread can
        take it at once); `event.song` is the handle this returns. Songs of one `group` (a job's takes; default:
        the song alone) are taken in turn with other groups' (FairQueue). `adapters`: what the caller's
        `pipe.check_request` returned for this request (None: the song is checked, and its adapters resolved, when
        it starts)."""
        handle = SongHandle(request, Path(directory), overrides or {}, resume, stage, self.listener)
        handle.adapters = adapters
        with self._lock:
            if request.id in self._handles and not self._handles[request.id].done:
                raise ValueError(f"song id {request.id!r} is already in flight")
            self._handles[request.id] = handle
        handle._emit("state", state="queued")
        self._queue.put(handle, group or request.id)
        return handle

    def cancel(self, song_id: str) -> bool:
        handle = self._handles.get(song_id)
        if handle is None or handle.done:
            return False
        handle.cancel()
        return True

    def get(self, song_id: str) -> SongHandle | None:
        """A song that is queued or in flight (finished songs are forgotten; keep their handles)."""
        return self._handles.get(song_id)

    @property
    def in_flight(self) -> int:
        return sum(1 for h in list(self._handles.values()) if h.state not in ("queued",) + FINAL_STATES)

    @property
    def healthy(self) -> bool:
        """Every song thread and both lane threads are running."""
        return all(thread.is_alive() for thread in self._threads) and self.lane.healthy

    @property
    def queued(self) -> int:
        return sum(1 for h in list(self._handles.values()) if h.state == "queued")

    @staticmethod
    def as_completed(handles: Iterable[SongHandle], poll: float = 0.05) -> Iterator[SongHandle]:
        pending = list(handles)
        while pending:
            for handle in [h for h in pending if h.done]:
                pending.remove(handle)
                yield handle
            if pending:
                pending[0].wait(poll)

    def close(self, cancel: bool = False, timeout: float | None = None) -> bool:
        """Stop taking songs; with `cancel`, stop the ones in flight too. Waits for the song threads, at most
        `timeout` seconds in all (None: until they stop); True when every thread stopped in time."""
        self._closing.set()
        if cancel:
            for handle in list(self._handles.values()):
                handle.cancel()
        for _ in self._threads:
            self._queue.stop()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.lane.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads + self.lane.threads_alive())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)

    # -- song threads

    def _worker(self) -> None:
        with torch_threads(self.threads):
            while True:
                handle = self._queue.get()
                if handle is None:
                    return
                self._wait_for_gate(handle)
                self._run(handle)

    def _wait_for_gate(self, handle: SongHandle, poll: float = 0.5) -> None:
        """Keep a queued song queued while `start_gate` says why it may not start (a cancel or close ends the
        wait: the song then ends as it would have)."""
        said = None
        while self.start_gate is not None and not handle.cancelled() and not self._closing.is_set():
            reason = self.start_gate(handle)
            if reason is None:
                if said is not None:
                    LOG.info("song %s starts: %s no longer holds it", handle.id, said)
                return
            if said is None:
                LOG.info("song %s stays queued: %s", handle.id, reason)
                said = reason
            self._closing.wait(poll)

    def _run(self, handle: SongHandle) -> None:
        try:
            if handle._start():
                self._generate(handle)
        finally:
            with self._lock:  # finished songs are the caller's to keep: the scheduler forgets them
                if self._handles.get(handle.id) is handle:
                    del self._handles[handle.id]

    def _generate(self, handle: SongHandle) -> None:
        try:
            continued = handle.overrides.get(CONTINUE_KEY)  # a capped song to go on from: its run directory
            parent = read_parent(continued["directory"]) if continued else None
            abc, semantic = handle.overrides.get("abc"), handle.overrides.get("semantic")
            if handle.adapters is None:  # the song's admission: checked, its adapters resolved once
                handle.adapters = self.pipe.check_request(handle.request, abc, semantic)
            document = self.pipe.generate_to(
                handle.directory, handle.request, resume=handle.resume, stage=handle.stage, abc_sampling=abc,
                semantic_sampling=semantic, cancelled=handle.cancelled, on_token=handle.on_token,
                on_progress=handle.on_progress, on_stage=handle.on_stage, synthesizer=self.lane.synthesize,
                decoder=self.lane.decode, parent=parent, adapters=handle.adapters)
        except (InterruptedError, KeyboardInterrupt) as exc:
            handle._finish("cancelled", error=exc)
        except BaseException as exc:  # recorded on the song; the other songs go on
            handle._finish("failed", error=exc)
        else:
            handle._finish("complete", document)  # for stage="plan": the plan record


_THREADS_LOCK = threading.Lock()
_threads_held = 0  # scheduler threads running with a count of their own
_threads_before = 0  # the count a fresh thread took before the first of them set one


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run this (fresh) thread with `threads` torch intra-op threads (None: as it is). torch.set_num_threads also
    sets the count every thread started later takes (at::init_num_threads reads one process-wide value), and the
    count changes float sums: so when the last thread that set one ends, the count fresh threads took before is
    put back, and a closed scheduler leaves no later thread's arithmetic changed."""
    if not threads:
        yield
        return
    import torch

    global _threads_held, _threads_before
    with _THREADS_LOCK:
        if _threads_held == 0:
            _threads_before = torch.get_num_threads()  # in a fresh thread: what fresh threads take
        _threads_held += 1
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        with _THREADS_LOCK:
            _threads_held -= 1
            if _threads_held == 0:
                torch.set_num_threads(_threads_before)


def default_concurrency(pipe: YuE2Pipeline) -> int:
    """What the engine's settings allow (its rows); 1 on the torch backend."""
    engine = pipe.engine
    return engine.settings.max_num_seqs if engine is not None else 1


def default_synthesis_batch(pipe: YuE2Pipeline, concurrency: int) -> int:
    """Batch the NAR of up to 4 songs on the CPU (per-op overhead dominates there), 8 on CUDA."""
    if concurrency <= 1:
        return 1
    return min(concurrency, 8 if pipe.device.type == "cuda" else 4)


def generate_many(pipe: YuE2Pipeline, requests: Iterable[SongRequest], directory: str | os.PathLike, *,
                  concurrency: int | None = None, resume: bool = False,
                  listener: Listener | None = None) -> Iterator[SongHandle]:
    """Run `requests` into `directory/<id>` and yield each song's handle as it finishes."""
    directory = Path(directory)
    with SongScheduler(pipe, concurrency=concurrency, listener=listener) as scheduler:
        handles = [scheduler.submit(request, directory / request.id, resume=resume) for request in requests]
        yield from scheduler.as_completed(handles)


def generate_takes(pipe: YuE2Pipeline, request: SongRequest, directory: str | os.PathLike, options: TakeOptions, *,
                   concurrency: int | None = None, **kwargs) -> dict:
    """`takes.run_takes` over a scheduler of its own (at most `options.takes` songs at once, within the engine's
    rows; one at a time on the torch backend); returns the takes.json document."""
    with SongScheduler(pipe, concurrency=concurrency or min(options.takes, default_concurrency(pipe))) as scheduler:
        return run_takes(scheduler, request, directory, options, **kwargs)
