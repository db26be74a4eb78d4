"""The song service: jobs in a durable store, run by song workers.

It validates and admits jobs (atomically with the queue bound and idempotency keys), hands each attempt to its
workers — one `SongWorker` in this process, or a pool of Ray Serve replicas (`serve.cluster.ReplicaPool`) —
writes each job's status from their events (`complete` only once the artifacts verify), fans the events out to
SSE subscribers (token and synthesis events at most 4/s per job), keeps the metrics, resumes every unfinished job
when it starts, and puts back the songs a dead engine or a dead replica failed.

What it needs of its workers (both kinds have it): `rules` (SongRules), `concurrency`, `listener` (set here),
`start()`, `close(timeout)`, `submit(order) -> run` (a run has `id`, `state`, `done`, `cancel()` and may name
its `replica`), `down_for_good()` (why no song can be served, else None) and `health()`.
"""
from __future__ import annotations

import json
import logging
import math
import queue
import re
import shutil
import sqlite3
import statistics
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from ..protocol import PHASES, SongRequest
from ..takes import MAX_TAKES, pick_take, read_score, shares_plan, take_seed
from ..scheduler import FINAL_STATES, STAGE_STATES, STATES, SongEvent
from ..checkpoint import write_json_atomic
from .disk import RETENTION_SECONDS, DiskLedger, request_bytes, written_bytes
from .durable import DurableStore, disk_refusal, disk_state
from .errors import Conflict, InsufficientStorage, NotFound, RequestInvalid, TooManyJobs, Unavailable
from .events import EventHub, Throttle
from .metrics import Registry, RateWindow
from .picture import PICTURE_VERSION, song_picture
from .store import IdempotencyConflict, JobRecord, JobStore, NewJob, QueueFull  # noqa: F401 (re-exported)
from .submission import check_idempotency_key, new_job_id, parse_submission, valid_job_id
from .worker import DISK_FULL, ENGINE_DOWN, SongOrder, SongWorker

LOG = logging.getLogger("yue2_vllm.serve")
STAGE_OF_STATE = {state: stage for stage, state in STAGE_STATES.items()}
STAGES = tuple(STAGE_STATES)  # plan, semantic, synthesis, audio
UNFINISHED = tuple(state for state in STATES if state not in FINAL_STATES)
PICTURE_CACHE = "page-cache/picture.json"  # a directory: never among a run's artifacts


def iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def fallback_label(reason: str) -> str:
    """A bounded Prometheus label for a fallback reason: its first clause, numbers as N."""
    text = re.split(r"[(:;]", reason, maxsplit=1)[0]
    return re.sub(r"\d+(?:\.\d+)?", "N", text).strip()[:80] or "other"


def urls(job_id: str) -> dict:
    base = f"/v1/songs/{job_id}"
    return {"self": base, "events": f"{base}/events", "audio": f"{base}/audio", "score": f"{base}/score",
            "result": f"{base}/result"}


def take_urls(job_id: str, take: int, take_job: str) -> dict:
    """Take k's files under its job (`events`: the take's own job, whose id the listing names)."""
    base = f"/v1/songs/{job_id}/takes/{take}"
    return {"self": base, "events": f"/v1/songs/{take_job}/events", "audio": f"{base}/audio",
            "score": f"{base}/score", "result": f"{base}/result", "keep": f"{base}/keep"}


def take_info(record: JobRecord) -> dict | None:
    """A job's takes record (in its overrides): take 1's lists the others (`children`); take k's names its
    `parent`. None for a one-take job."""
    info = record.overrides.get("takes")
    return info if isinstance(info, dict) else None


def sampling_of(record: JobRecord) -> dict:
    return {k: v for k, v in record.overrides.items() if k != "takes"}


# --------------------------------------------------------------------------- the service


@dataclass
class ServeConfig:
    data_dir: Path
    concurrency: int | None = None  # songs in flight (None: the scheduler's default)
    queue_size: int = 64  # queued (not yet started) jobs before 429
    event_interval: float = 0.25  # token / NAR / VAE events per job at most every this many seconds
    engine_retries: int = 1  # times a song failed by an engine death goes back to the queue
    replica_retries: int = 3  # times a job goes back to the queue after the replica running it died
    watchdog_interval: float = 1.0
    max_interrupted_runs: int = 2  # a job running when the process died this many times is failed, not requeued
    stall_seconds: float = 300.0  # songs in flight but none progressed for this long: /health says wedged
    shutdown_seconds: float = 20.0  # how long close() waits for songs to reach a boundary
    retention_seconds: float | None = RETENTION_SECONDS  # finished jobs older than this are purged (None: kept)
    min_free_bytes: int = 1 << 30  # kept free beyond what every admitted song may still write (else 507)
    owner_timeout: float = 30.0  # an HTTP call waits this long for the job owner, then answers 503
    max_takes: int = MAX_TAKES  # the most takes one POST may ask for (--max-takes)

    def __post_init__(self):
        self.data_dir = Path(self.data_dir)
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size}")
        if self.max_interrupted_runs < 1:
            raise ValueError(f"max_interrupted_runs must be >= 1, got {self.max_interrupted_runs}")
        if self.replica_retries < 0 or self.engine_retries < 0:
            raise ValueError("engine_retries and replica_retries must be >= 0")
        if not 1 <= self.max_takes <= MAX_TAKES:
            raise ValueError(f"max_takes must be in [1, {MAX_TAKES}], got {self.max_takes}")

    @property
    def database(self) -> Path:
        return self.data_dir / "jobs.sqlite3"

    @property
    def jobs(self) -> Path:
        return self.data_dir / "jobs"


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


class SongService:
    """Jobs over song workers. Every transition of a job — its store row, its live state, its events and
    metrics — happens on one thread, the job owner: song, lane and replica-stream threads only post their events
    to its inbox (never calling into the service, so no scheduler lock is ever held across a service one), and
    the HTTP side's cancel / resume / render / launch run there as calls. Reads (status, lists, files) need no
    lock.

    `workers`: a pipeline (this process runs the songs: a `SongWorker` over it, `config.concurrency` at once) or
    a workers object, such as `serve.cluster.ReplicaPool`."""

    def __init__(self, workers, config: ServeConfig):
        if not hasattr(workers, "submit"):  # a pipeline
            workers = SongWorker(workers, concurrency=config.concurrency)
        self.workers, self.config = workers, config
        self.rules = workers.rules
        config.jobs.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        # Every write the job owner makes lands (retried while the disk refuses it); see serve.durable.
        self.store = DurableStore(JobStore(config.database), config.data_dir, stopping=self._stop.is_set)
        self._disk_checked: tuple[float, tuple | None] = (0.0, None)  # (when, disk_state) for /health
        self.disk = DiskLedger(config.jobs, lambda path: shutil.disk_usage(path).free)
        self._picture_lock = threading.Lock()
        self.hub = EventHub()
        self._awaiting_score: dict[str, list[str]] = {}  # take 1's job -> takes waiting for its planned score
        self._awaiting_prefill: dict[str, list[str]] = {}  # take 1's job -> takes waiting for its first token
        self.throttle = Throttle(config.event_interval)
        self._live: dict[str, LiveJob] = {}
        self._held: list[str] = []  # queued jobs kept from the workers while they cannot serve any song
        self._durations: deque[float] = deque(maxlen=50)  # recent songs, started → finished (for Retry-After)
        self.closing = False
        self._inbox: queue.Queue = queue.Queue()
        self._owner = threading.Thread(target=self._own, name="yue2-serve-jobs", daemon=True)
        self._busy_since: float | None = None  # when the owner took the item it is on (None: waiting)
        self._last_progress = time.monotonic()
        self._init_metrics()
        workers.listener = self._post_event
        if hasattr(workers, "min_free_bytes"):  # a queued song waits while the data dir is full (see SongWorker)
            workers.min_free_bytes = config.min_free_bytes
        self._watchdog = threading.Thread(target=self._watch, name="yue2-serve-watchdog", daemon=True)
        self.started = False

    # -- the job owner

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
            except (OSError, sqlite3.Error) as exc:  # expected (a disk, while stopping): one line
                LOG.error("job owner: handling %s failed: %s: %s", item[0], type(exc).__name__, exc)
            except Exception:  # noqa: BLE001 (one job's bug must not stop every other job's transitions)
                LOG.exception("job owner: handling %s failed", item[0])
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

    # -- lifecycle

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

    def directory(self, job_id: str) -> Path:
        if not valid_job_id(job_id):  # never a path from outside
            raise NotFound(f"no song {job_id!r}")
        return self.config.jobs / job_id

    # -- submission (HTTP threads; the launch runs on the owner)

    def submit(self, body: bytes, idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
        """Validate and queue a song; `(record, created)` (created False: an idempotent repeat)."""
        key = check_idempotency_key(idempotency_key)
        down = self.workers.down_for_good()
        if down is not None:
            raise Unavailable(f"no song can be served now: {down}", headers={"Retry-After": "60"})
        job_id = new_job_id()
        song = parse_submission(self.rules, body, job_id, self.config.max_takes)
        stages = {stage: {"state": "pending"} for stage in (STAGES if song.stage == "audio" else ("plan",))}
        count = song.takes.takes
        children = [new_job_id() for _ in range(count - 1)]
        overrides = song.overrides
        if count > 1:  # take 1 is this job; takes 2..N are jobs of their own, listed (and acted on) through it
            overrides = {**overrides, "takes": {"take": 1, "of": count, "best_of": song.takes.best_of,
                                                "share_score": shares_plan(song.request, song.takes),
                                                "children": children, "kept": None}}
        job = NewJob(job_id, song.label, song.stage, song.request.to_dict(), overrides, song.body_sha256, key,
                     stages)
        need = request_bytes(self.rules, song.request, song.overrides, song.stage).total * count  # each take a song
        with self.disk.lock:  # the check and the queueing together: two songs never take the same room
            self._check_disk(need)
            try:  # every take counts against the queue bound: room for all of them, or a 429
                record, created = self.store.admit(job, self.config.queue_size - (count - 1))
            except IdempotencyConflict as exc:
                raise Conflict(str(exc), field="Idempotency-Key") from None
            except QueueFull as exc:
                raise self._too_many(exc) from None
            except sqlite3.OperationalError as exc:  # the store refused the insert: nothing was queued
                raise self._store_refused(exc) from None
            takes = [record]
            if created:
                for k, child in enumerate(children, 2):
                    request = SongRequest.from_dict({**song.request.to_dict(), "id": child,
                                                     "seed": take_seed(song.request.seed, k)})
                    child_job = NewJob(child, song.label, song.stage, request.to_dict(),
                                       {**song.overrides, "takes": {"take": k, "of": count, "parent": job_id,
                                                                    "share_score": overrides["takes"]["share_score"]}},
                                       song.body_sha256, None, dict(stages))
                    takes.append(self.store.admit(child_job, None)[0])
        if created:
            for take in takes:
                try:
                    self._call(self._launch, take)
                except Unavailable:  # the owner is waiting on the store: the job is durable, its launch queued
                    LOG.warning("job %s: accepted; it starts once the job owner's pending store write lands", take.id)
        return record, created

    def _record_bytes(self, record: JobRecord) -> int:
        return request_bytes(self.rules, SongRequest(**record.request), record.overrides, record.stage).total

    def _check_disk(self, need: int) -> None:
        """507 unless `need` more bytes fit in the free disk beside what every unfinished job may still write and
        the `min_free_bytes` kept free (the caller holds `disk.lock`)."""
        unfinished = self.store.unfinished()
        pending = self.disk.outstanding((r.id, r.stage, lambda r=r: self._record_bytes(r)) for r in unfinished)
        fits, free = self.disk.room(need, pending, self.config.min_free_bytes)
        if not fits:
            raise InsufficientStorage(
                f"the song may write up to {need / 1e6:.1f} MB (its token budgets' FLAC, arrays and records); the "
                f"data dir has {free / 1e6:.1f} MB free, {pending / 1e6:.1f} MB of it promised to {len(unfinished)} "
                f"unfinished job(s) and {self.config.min_free_bytes / 1e6:.1f} MB kept free (--min-free-disk); "
                "lower semantic_sampling.max_tokens, or retry once songs finish or are deleted",
                headers={"Retry-After": str(self.retry_after())})

    def _store_refused(self, exc: sqlite3.OperationalError) -> Exception:
        free = shutil.disk_usage(self.config.data_dir).free
        words = f"the job store ({self.config.database}) cannot be written: {exc}; the data dir has {free} bytes free"
        if "full" in str(exc):
            return InsufficientStorage(words)
        return Unavailable(words, headers={"Retry-After": "5"})

    def _too_many(self, full: QueueFull) -> TooManyJobs:
        return TooManyJobs(f"{full}; retry later", headers={"Retry-After": str(self.retry_after())})

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the median recent song over the concurrency."""
        if not self._durations:
            return 5
        seconds = statistics.median(self._durations) / max(1, self.workers.concurrency)
        return max(1, min(60, math.ceil(seconds)))

    def _launch(self, record: JobRecord) -> None:
        """Hand a queued job to the workers (owner only); held back while they cannot serve any song."""
        info = take_info(record)
        if info and info.get("share_score") and info.get("parent") and record.request.get("abc") is None:
            record = self._with_shared_score(record, info["parent"])
            if record is None:
                return  # it waits for take 1's score (launched from _on_stage_done), or failed with it
        elif info and info.get("parent") and not self._parent_prefilled(info["parent"]):
            waiting = self._awaiting_prefill.setdefault(info["parent"], [])
            if record.id not in waiting:
                waiting.append(record.id)
            return  # launched at take 1's first token (its prompt is then in the prefix cache) or end
        if self.workers.down_for_good() is not None:
            if record.id not in self._held:
                self._held.append(record.id)
            return
        budgets = {phase: self.rules.sampling_for(record.overrides.get(phase), phase).max_tokens for phase in PHASES}
        # A stage an earlier attempt was running is pending again (a finished one may still be reused).
        stages = {name: entry if entry.get("state") != "running" else {"state": "pending"}
                  for name, entry in record.stages.items()}
        self.store.update(record.id, attempts=record.attempts + 1, stages=stages)
        live = self._live[record.id] = LiveJob(None, budgets, stages)
        self._last_progress = time.monotonic()
        order = SongOrder(record.id, record.attempts + 1, record.request, record.overrides, record.stage,
                          str(self.directory(record.id)))
        # The song may start (and post events) before submit returns: its first event names the run.
        live.handle = self.workers.submit(order)

    def _with_shared_score(self, record: JobRecord, parent_id: str) -> JobRecord | None:
        """Take k of a shared score renders take 1's: its request gets that score once take 1 planned it."""
        parent = self.store.get(parent_id)
        plan = (parent.stages.get("plan") or {}).get("state") if parent is not None else None
        if plan in ("done", "reused"):
            try:
                score = read_score(self.directory(parent_id))
            except OSError as exc:
                self._record_final(record.id, None, "failed", error={"type": "SharedScoreMissing",
                                   "message": f"take 1's score could not be read: {exc}"})
                return None
            request = {**record.request, "abc": score}
            self.store.update(record.id, request=request)
            return self.store.get(record.id)
        if parent is None or parent.deleted is not None or (parent.final and parent.status != "complete"):
            self._record_final(record.id, None, "failed", error={"type": "SharedScoreMissing",
                               "message": "take 1's score was not planned (take 1 "
                                          f"{'is gone' if parent is None or parent.deleted else parent.status})"})
            return None
        waiting = self._awaiting_score.setdefault(parent_id, [])
        if record.id not in waiting:
            waiting.append(record.id)
        return None

    def _parent_prefilled(self, parent_id: str) -> bool:
        """Whether take 1 has had its first AR token (or a planned score, or has ended): the other takes then find
        the prompt they share in the engine's prefix cache instead of prefilling it again in the same step."""
        live = self._live.get(parent_id)
        if live is not None and any(live.tokens.values()):
            return True
        parent = self.store.get(parent_id)
        return parent is None or parent.final or (parent.stages.get("plan") or {}).get("state") in ("done", "reused")

    def _launch_awaiting(self, parent_id: str, lists: tuple[str, ...] = ("_awaiting_score", "_awaiting_prefill")) \
            -> None:
        """Take 1's score is planned, its prompt prefilled, or it ended: the takes waiting for that go on."""
        children = [child for name in lists for child in getattr(self, name).pop(parent_id, [])]
        for child in children:
            record = self.store.get(child)
            if record is not None and record.status == "queued" and record.deleted is None:
                self._launch(record)

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for job_id in held:
            record = self.store.get(job_id)
            if record is not None and record.status == "queued":
                self._launch(record)

    def requeue(self, job_id: str, *, render: bool) -> JobRecord:
        """Resume a failed or cancelled job from its last verified stage, or render a planned one to audio. On a
        job with takes: every take that can be (the others are left as they are)."""
        record = self.get_record(job_id)
        takes = self.take_records(record)
        if len(takes) > 1:
            ready = [take for take in takes if ((take.stage == "plan" and take.status == "complete") if render
                                                 else take.status in ("failed", "cancelled"))]
            if not ready:
                raise Conflict("no take of this job can be " + ("rendered (none is a complete stage=plan take)"
                                                                if render else "resumed (none failed or was cancelled)"))
            for take in ready:
                self._call(self._requeue, take.id, render)
            return self.get_record(job_id)
        if render and not (record.stage == "plan" and record.status == "complete"):
            raise Conflict(f"only a complete stage=plan job can be rendered; this one is {record.status} with "
                           f"stage={record.stage}")
        if not render and record.status not in ("failed", "cancelled"):
            raise Conflict(f"only a failed or cancelled job can be resumed; this one is {record.status}")
        return self._call(self._requeue, job_id, render)

    def _requeue(self, job_id: str, render: bool) -> JobRecord:
        live = self._live.get(job_id)
        if live is not None and not live.handle.done:
            raise Conflict("the job is still stopping; try again in a moment", headers={"Retry-After": "1"})
        record = self.get_record(job_id)
        bound = self._record_bytes(replace(record, stage="audio") if render else record)
        with self.disk.lock:
            self._check_disk(max(0, bound - written_bytes(self.directory(job_id))))
            try:
                record = self.store.requeue(job_id, self.config.queue_size, kind="render" if render else "resume",
                                            reason="render requested" if render else "resume requested",
                                            stage="audio" if render else None)
            except QueueFull as exc:
                raise self._too_many(exc) from None
            except LookupError:
                raise Conflict("the job changed meanwhile; read it again") from None
        if render:
            stages = {**record.stages, **{s: {"state": "pending"} for s in STAGES[1:]}}
            self.store.update(job_id, stages=stages)
            record.stages = stages
        self._launch(record)
        self.hub.publish(job_id, "state", {"status": "queued", "reason": record.retries[-1]["reason"]})
        return record

    def cancel(self, job_id: str) -> tuple[JobRecord, bool]:
        """Ask a job (every take of it) to stop at its next token, ODE step or VAE tile; `(record, asked)` —
        asked False when it had finished already (its files stay)."""
        record = self.get_record(job_id)
        running = [take for take in self.take_records(record) if not take.final]
        if not running:
            return record, False
        for take in reversed(running):  # take 1 last: its end would launch takes still waiting for it
            self._call(self._cancel, take.id)
        return self.store.get(job_id), True

    def _cancel(self, job_id: str) -> tuple[JobRecord, bool]:
        record = self.store.get(job_id)
        if record is None or record.final:
            return record, False
        live = self._live.get(job_id)
        self.store.update(job_id, cancel_requested=1)
        started = False
        if live is not None:
            live.cancel_requested = True
            started = not live.handle.cancel()  # a song thread had taken it: it stops at its next boundary
        if not started:  # a queued (or held) song never starts: it is cancelled now, not when a thread frees up
            if job_id in self._held:
                self._held.remove(job_id)
            self._record_final(job_id, live, "cancelled", error={"type": "Cancelled",
                                                                  "message": "cancelled before it started"})
        return self.store.get(job_id), True

    def delete(self, job_id: str) -> dict | None:
        """DELETE: the job is gone for every client at once (each read answers 404); a run of it is cancelled, and
        its files and row are removed once nothing of it runs. The job as it is now while that removal is pending
        (a run was stopping), None once it is done. Its other takes go with it."""
        record = self.get_record(job_id)
        for take in self.take_records(record)[1:]:
            self._call(self._delete_quietly, take.id)
        return self._call(self._delete, job_id)

    def _delete_quietly(self, job_id: str) -> None:
        try:
            self._delete(job_id)
        except NotFound:  # deleted already (e.g. that take alone)
            pass

    # -- takes

    def take_records(self, record: JobRecord) -> list[JobRecord]:
        """A job's takes in order, take 1 (the job) first; takes deleted on their own are left out."""
        info = take_info(record)
        if not info or info.get("parent"):
            return [record]
        takes = [record]
        for child in info.get("children", []):
            take = self.store.get(child)
            if take is not None and take.deleted is None:
                takes.append(take)
        return takes

    def take_job(self, job_id: str, take: int) -> str:
        """The job id that holds take `take` of job `job_id` (404 when there is no such take)."""
        record = self.get_record(job_id)
        info = take_info(record)
        if take == 1 and (info is None or not info.get("parent")):
            return job_id
        children = (info or {}).get("children") if info and not info.get("parent") else None
        if not children or not 2 <= take <= len(children) + 1:
            raise NotFound(f"song {job_id!r} has no take {take}")
        child = children[take - 2]
        self.get_record(child)  # 404 once that take was deleted
        return child

    def delete_take(self, job_id: str, take: int) -> dict | None:
        """Delete one take (k >= 2; take 1 is the job itself: DELETE the job)."""
        if take == 1:
            raise Conflict("take 1 is the job itself: DELETE the job to remove it with every take")
        child = self.take_job(job_id, take)
        return self._call(self._delete, child)

    def keep_take(self, job_id: str, take: int) -> JobRecord:
        """Mark take `take` as the one kept (recorded on the job)."""
        self.take_job(job_id, take)
        record = self.get_record(job_id)
        info = take_info(record)
        if info is None or info.get("parent"):
            raise Conflict("this job has no takes to choose from")
        self.store.update(job_id, overrides={**record.overrides, "takes": {**info, "kept": take}})
        return self.get_record(job_id)

    def takes_view(self, record: JobRecord) -> dict | None:
        """What GET shows of a job's takes: each with status, seed, signals and links; the pick and the kept."""
        info = take_info(record)
        if info is None:
            return None
        if info.get("parent"):
            return {"take": info["take"], "of": info["of"], "job": info["parent"]}
        entries = []
        ids = [record.id] + list(info.get("children", []))
        for k, take_id in enumerate(ids, 1):
            take = record if k == 1 else self.store.get(take_id)
            if take is None or take.deleted is not None:
                entries.append({"take": k, "id": take_id, "status": "deleted", "seed": None, "signals": {},
                                "error": None, "urls": None})
                continue
            entries.append({"take": k, "id": take_id, "status": take.status, "seed": take.request.get("seed"),
                            "signals": (take.result or {}).get("signals") or {},
                            "audio_seconds": (take.result or {}).get("audio_seconds"),
                            "error": (take.error or {}).get("message"), "urls": take_urls(record.id, k, take_id)})
        pick = pick_take(entries) if info.get("best_of") else None
        return {"take": 1, "of": info["of"], "best_of": bool(info.get("best_of")),
                "share_score": bool(info.get("share_score")), "signal": "semantic_mean_logprob", "pick": pick,
                "kept": info.get("kept"), "entries": entries,
                "complete": [e["take"] for e in entries if e["status"] == "complete"],
                "not_complete": [e["take"] for e in entries if e["status"] in ("failed", "cancelled", "deleted")]}

    def _delete(self, job_id: str) -> dict | None:
        record = self.store.mark_deleted(job_id)
        if record is None:
            raise NotFound(f"no song {job_id!r}")
        if not record.final:
            self._cancel(job_id)
        live = self._live.get(job_id)
        if live is not None and (live.handle is None or not live.handle.done):
            return self.describe(self.store.get(job_id))  # removed when its final event comes (see _on_event)
        self._remove(job_id)
        return None

    def _remove(self, job_id: str) -> bool:
        """Remove a finished or deleted job's files and row (owner; nothing of it may run). Whether it was here."""
        self._live.pop(job_id, None)
        if job_id in self._held:
            self._held.remove(job_id)
        if not self.store.delete(job_id):
            return False
        directory = self.directory(job_id)
        doomed = directory.with_name(directory.name + ".purging")
        try:
            directory.rename(doomed)  # gone from the data dir at once; removed below
        except FileNotFoundError:
            pass
        shutil.rmtree(doomed, ignore_errors=True)
        self.purged.inc()
        return True

    def _purge(self, job_id: str) -> bool:
        """Remove a finished job past the retention window (never one a run still holds), its finished takes too."""
        record = self.store.get(job_id)
        if record is not None:
            for take in self.take_records(record)[1:]:
                if take.final and take.id not in self._live:
                    self._remove(take.id)
        return job_id not in self._live and self._remove(job_id)

    def _sweep(self) -> None:
        """Purge finished jobs past the retention window (owner; called from the watchdog)."""
        if self.config.retention_seconds is None:
            return
        for job_id in self.store.finished_before(time.time() - self.config.retention_seconds):
            self._purge(job_id)

    # -- reads

    def get_record(self, job_id: str) -> JobRecord:
        record = self.store.get(job_id) if valid_job_id(job_id) else None
        if record is None or record.deleted is not None:
            raise NotFound(f"no song {job_id!r}")
        return record

    def document(self, job_id: str) -> dict:
        return self.describe(self.get_record(job_id))

    def describe(self, record: JobRecord) -> dict:
        """A job as GET /v1/songs/{id} shows it."""
        live = self._live.get(record.id)
        stages = dict(record.stages)
        running = live is not None and not live.finalized
        progress = {}
        for phase, stage in (("abc", "plan"), ("semantic", "semantic")):
            if stage not in stages:
                continue
            if stages[stage].get("state") in ("done", "reused"):
                tokens = stages[stage].get("tokens") or 0
            else:
                tokens = live.tokens[phase] if running else 0
            progress[phase] = {"tokens": tokens,
                               "max_tokens": self.rules.sampling_for(record.overrides.get(phase), phase).max_tokens}
        if running:
            for stage, (done, total) in list(live.progress.items()):
                progress[stage] = {"done": done, "total": total}
            waiting = live.waiting
            if waiting is not None and waiting["stage"] not in live.progress:
                progress[waiting["stage"]] = {"waiting_for_room": {"need_bytes": waiting["need_bytes"],
                                                                   "free_bytes": waiting["free_bytes"]}}
        for stage, entry in stages.items():
            stages[stage] = {k: (iso(v) if k in ("started", "finished") else v) for k, v in entry.items()}
        document = {
            "id": record.id, "label": record.label, "status": record.status, "stage": record.stage,
            "created": iso(record.created), "started": iso(record.started), "finished": iso(record.finished),
            "updated": iso(record.updated),
            "request": {k: v for k, v in record.request.items() if k != "id"},
            "sampling": sampling_of(record), "progress": progress, "stages": stages,
            "attempts": record.attempts,
            "retries": [{**entry, "at": iso(entry["at"])} for entry in record.retries],
            "cancel_requested": record.cancel_requested, "error": record.error, "result": record.result,
            "urls": urls(record.id),
        }
        if record.status == "queued":
            document["queue_position"] = self.store.queue_position(record)
        takes = self.takes_view(record)
        if takes is not None:
            document["takes"] = takes
        return document

    def summary(self, record: JobRecord) -> dict:
        """A job as the list shows it."""
        return {"id": record.id, "label": record.label, "status": record.status, "stage": record.stage,
                "created": iso(record.created), "finished": iso(record.finished),
                "style": record.request.get("style", "")[:120], "cot": record.request.get("cot"),
                "seed": record.request.get("seed"),
                "audio_seconds": (record.result or {}).get("audio_seconds"),
                "error": (record.error or {}).get("message"), "urls": urls(record.id),
                "takes": (take_info(record) or {}).get("of", 1)}

    def list(self, statuses: tuple[str, ...], limit: int, cursor: str | None) -> dict:
        unknown = sorted(set(statuses) - set(STATES))
        if unknown:
            raise RequestInvalid(f"status: {unknown} not among {list(STATES)}", field="status")
        before = None
        if cursor:
            if not cursor.isdigit() or len(cursor) > 18:
                raise RequestInvalid(f"cursor: not a cursor this server gave out: {cursor[:40]!r}", field="cursor")
            before = int(cursor)
        records = self.store.list(statuses, limit + 1, before)
        page = records[:limit]
        return {"songs": [self.summary(r) for r in page if not (take_info(r) or {}).get("parent")],  # takes 2..N: in
                # their job's listing
                "next_cursor": str(page[-1].seq) if len(records) > limit else None}

    def file(self, job_id: str, name: str) -> Path:
        """An artifact of a job that is ready to be read (Conflict while it is not)."""
        record = self.get_record(job_id)
        directory = self.directory(job_id)
        if name == "score.abc":
            plan = record.stages.get("plan", {})
            if plan.get("state") not in ("done", "reused"):
                raise Conflict(f"the score is not ready (status {record.status})")
            if record.request.get("cot") == "off":
                raise NotFound("this song has no score (cot 'off' writes none)")
        elif record.stage == "plan":
            raise Conflict(f"this job was made with stage=plan: it has a score, not {name}; "
                           f"POST {urls(job_id)['self']}/render to make its audio")
        elif record.status != "complete":
            raise Conflict(f"{name} is not ready (status {record.status})")
        path = directory / name
        if path.is_symlink() or not path.is_file():
            raise Conflict(f"{name} is missing from the job's directory")
        return path

    def picture(self, job_id: str) -> dict:
        """The song's peaks and spectrogram (`serve.picture`), computed from its FLAC once and cached beside it
        (`page-cache/picture.json`, written atomically; redone if the FLAC changed or the format did)."""
        path = self.file(job_id, "audio.flac")
        stat = path.stat()
        source = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        cache = path.parent / PICTURE_CACHE
        with self._picture_lock:  # one computation per song, whoever asks meanwhile
            try:
                cached = json.loads(cache.read_text(encoding="utf-8"))
                if cached.get("source") == source and cached.get("version") == PICTURE_VERSION:
                    return cached
            except (OSError, ValueError):
                pass
            document = {**song_picture(path), "source": source}
            cache.parent.mkdir(exist_ok=True)
            write_json_atomic(cache, document)
            return document

    def subscribe(self, job_id: str, loop):
        record = self.get_record(job_id)
        return self.hub.subscribe(record.id, loop, lambda: self.document(record.id))

    # -- worker events (on the owner)

    def _on_event(self, event: SongEvent) -> None:
        job_id, kind, data = event.song.id, event.kind, event.data
        live = self._live.get(job_id)
        if live is None:
            return
        if live.handle is None:
            live.handle = event.song
        elif live.handle is not event.song:
            return  # an event of an earlier run of this job
        if kind in FINAL_STATES:
            try:
                if not live.finalized:
                    self._on_final(job_id, live, kind, data)
            finally:  # the run is done: what it said is in the store now (a retry has a new one)
                if self._live.get(job_id) is live:
                    del self._live[job_id]
                self.throttle.forget((job_id, "ar"))
                self.throttle.forget((job_id, "synthesis"))
                record = self.store.get(job_id)
                if job_id not in self._live and record is not None and record.deleted is not None:
                    self._remove(job_id)  # DELETEd while it ran: now it has stopped
            return
        if live.finalized:
            return
        if kind == "tokens":
            if job_id in self._awaiting_prefill:  # take 1's prompt is prefilled: the other takes go now
                self._launch_awaiting(job_id, ("_awaiting_prefill",))
            added = data["count"] - live.tokens[data["phase"]]  # a replica sends a count every few tokens
            if added > 0:
                self.tokens_total.inc(added, phase=data["phase"])
                self.token_rate.add(data["phase"], added)
            live.tokens[data["phase"]] = data["count"]
            if self.throttle.ready((job_id, "ar")):
                self.hub.publish(job_id, "tokens", {"phase": data["phase"], "count": data["count"],
                                                    "max_tokens": live.budgets[data["phase"]]})
        elif kind == "waiting":
            live.waiting = dict(data)
            self.hub.publish(job_id, "waiting", dict(data))
        elif kind in ("nar", "vae"):
            live.progress[kind] = (data["done"], data["total"])
            if self.throttle.ready((job_id, "synthesis"), force=data["done"] in (1, data["total"])):
                self.hub.publish(job_id, kind, {"done": data["done"], "total": data["total"]})
        elif kind == "state":
            self._on_state(job_id, live, data["state"])
        elif kind == "stage_done":
            self._on_stage_done(job_id, live, data["stage"], data["reused"], data["meta"] or {})
        elif kind == "score":
            self.hub.publish(job_id, "score", {"abc": data["abc"]})

    @staticmethod
    def _where(live: LiveJob) -> dict:
        """The replica running the job, for its stage records (nothing when the songs run in this process)."""
        replica = getattr(live.handle, "replica", None)
        return {"replica": replica} if replica else {}

    def _on_state(self, job_id: str, live: LiveJob, state: str) -> None:
        if state == "queued" or live.cancel_requested:
            return
        stage = STAGE_OF_STATE[state]
        now = time.time()
        live.record_stages[stage] = {"state": "running", "started": now, **self._where(live)}
        record = self.store.get(job_id)
        values = {"status": state, "stages": live.record_stages}
        if record is not None and record.started is None:
            values["started"] = now
        self.store.update(job_id, unless_final=True, **values)
        self.hub.publish(job_id, "state", {"status": state, "stage": stage, **self._where(live)})

    def _on_stage_done(self, job_id: str, live: LiveJob, stage: str, reused: bool, meta: dict) -> None:
        summary = stage_summary(stage, meta, reused)
        previous = live.record_stages.get(stage, {})
        where = {"replica": previous["replica"]} if reused and previous.get("replica") else self._where(live)
        live.record_stages[stage] = {**summary, "started": previous.get("started"),
                                     "finished": None if reused else time.time(), **where}
        self.store.update(job_id, stages=live.record_stages)
        if stage == "plan" and (job_id in self._awaiting_score or job_id in self._awaiting_prefill):
            self._launch_awaiting(job_id)
        if not reused:
            if stage in ("synthesis", "audio") and summary.get("seconds") is not None:
                (self.nar_seconds if stage == "synthesis" else self.vae_seconds).observe(summary["seconds"])
            reason = summary.get("fallback_reason")
            if reason:
                self.fallbacks.inc(phase="abc" if stage == "plan" else "semantic", reason=fallback_label(reason))
        self.hub.publish(job_id, "stage", {"stage": stage, **summary, **where})

    def _on_final(self, job_id: str, live: LiveJob, kind: str, data: dict) -> None:
        """A run's end. `data`: error, result, engine_failure (the engine died under it) and, from a replica pool,
        replica_lost (the replica died under it)."""
        error = data.get("error")
        if kind == "complete":
            self._record_final(job_id, live, "complete", result=data.get("result"))
            return
        if self.closing and not live.cancel_requested:
            return  # the server is stopping: the job stays unfinished and resumes at the next start
        if kind == "failed" and data.get("replica_lost") and not live.cancel_requested:
            if self._retry(job_id, live, error, kind="replica", limit=self.config.replica_retries):
                return
            error = {**error, "message": f"{error['message']} (the replica running this job died "
                                         f"{self.config.replica_retries + 1} times; not running it again)"}
        if kind == "failed" and data.get("engine_failure"):
            if self.workers.down_for_good() is not None and not live.cancel_requested:
                self._hold_for_engine(job_id, live, error)  # not the song's fault: it waits for the engine
                return
            if not live.cancel_requested and self._retry(job_id, live, error, kind="engine",
                                                         limit=self.config.engine_retries):
                return
        if kind == "cancelled" and error is None:
            error = {"type": "Cancelled", "message": "cancelled"}
        if error is not None and error.get("type") == DISK_FULL:
            free = shutil.disk_usage(self.config.data_dir).free
            error = {**error, "message": f"{error['message']}; the data dir {self.config.data_dir} has {free} bytes now "
                                         f"free: POST {urls(job_id)['self']}/resume once space returns"}
            LOG.error("job %s failed: its files could not be written (%s)", job_id, error["message"])
        self._record_final(job_id, live, kind, error=error)

    def _retry(self, job_id: str, live: LiveJob, error: dict, *, kind: str, limit: int) -> bool:
        """Put a song that a dead engine or replica failed back in the queue (resumed from its last verified
        stage), at most `limit` times per job."""
        record = self.store.get(job_id)
        if sum(1 for entry in record.retries if entry.get("kind") == kind) >= limit:
            return False
        what = "the AR engine failed" if kind == "engine" else "the replica running it died"
        reason = f"{what} ({error['message'][:300]}); retrying from the last verified stage"
        live.finalized = True
        record = self.store.requeue(job_id, None, reason=reason, kind=kind, from_statuses=UNFINISHED)
        (self.engine_retried if kind == "engine" else self.replica_retried).inc()
        self.hub.publish(job_id, "retry", {"reason": reason, "attempt": record.attempts + 1, "kind": kind})
        self._launch(record)
        return True

    def _hold_for_engine(self, job_id: str, live: LiveJob, error: dict) -> None:
        """No song can be served (the engine is down for good): the song goes back to the queue, held until the
        workers can serve again."""
        reason = f"the AR engine is down ({error['message'][:300]}); queued until it is back"
        live.finalized = True
        self.store.requeue(job_id, None, reason=reason, kind="engine-down", from_statuses=UNFINISHED)
        self.hub.publish(job_id, "state", {"status": "queued", "reason": reason})
        if job_id not in self._held:
            self._held.append(job_id)

    def _record_final(self, job_id: str, live: LiveJob | None, status: str, *, result: dict | None = None,
                      error: dict | None = None) -> None:
        if live is not None:
            if live.finalized:
                return
            live.finalized = True
        now = time.time()
        written = self.store.update(job_id, unless_final=True, status=status, finished=now, error=error,
                                    result=result, **({"stages": live.record_stages} if live else {}))
        if not written:
            return
        if job_id in self._awaiting_score or job_id in self._awaiting_prefill:  # take 1 ended: the others go on
            self._launch_awaiting(job_id)
        self.songs_finished.inc(status=status)
        record = self.store.get(job_id)
        if status == "complete":
            self.song_seconds.observe(now - record.created)
            if record.started is not None:
                self._durations.append(now - record.started)
        self.hub.publish(job_id, status, {"status": status, "error": error, "result": result, "urls": urls(job_id)})

    # -- watching

    def _watch(self) -> None:
        """Put held jobs back to the workers once they can serve again; purge past the retention window."""
        last_sweep, was_down = 0.0, False
        while not self._stop.is_set():
            down = self.workers.down_for_good() is not None
            if was_down and not down and self._held:
                self._call_quietly(self._release_held)
            was_down = down
            if self.config.retention_seconds is not None and time.monotonic() - last_sweep > 60:
                last_sweep = time.monotonic()
                self._call_quietly(self._sweep)
            self._stop.wait(self.config.watchdog_interval)

    def _call_quietly(self, fn) -> None:
        try:
            self._call(fn)
        except Exception:  # noqa: BLE001 (logged; the watchdog goes on)
            LOG.exception("watchdog: %s failed", getattr(fn, "__name__", fn))

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

    # -- metrics

    def _init_metrics(self) -> None:
        registry = self.metrics = Registry()
        registry.gauge("yue2_queue_depth", "Jobs queued and not yet started.", function=lambda: self.store.queued())
        registry.gauge("yue2_songs_in_flight", "Songs the scheduler is running now.", function=self.in_flight)
        registry.gauge("yue2_jobs", "Jobs in the store by status.", ("status",),
                       function=lambda: {(k,): v for k, v in self.store.counts().items()})
        self.songs_finished = registry.counter("yue2_songs_finished_total",
                                               "Songs that reached a final status since start.", ("status",))
        self.tokens_total = registry.counter("yue2_ar_tokens_total", "AR tokens generated, by phase.", ("phase",))
        self.token_rate = RateWindow(10)
        registry.gauge("yue2_ar_tokens_per_second", "AR tokens per second over the last 10 s, by phase.",
                       ("phase",), function=lambda: self.token_rate.rates(PHASES))
        self.nar_seconds = registry.histogram("yue2_nar_seconds", "NAR (flow matching) seconds per song.")
        self.vae_seconds = registry.histogram("yue2_vae_seconds", "VAE decode seconds per song.")
        self.song_seconds = registry.histogram("yue2_song_seconds", "Seconds from acceptance to complete.")
        self.fallbacks = registry.counter("yue2_fallbacks_total", "AR phases served by the torch backend instead "
                                          "of the requested one, by phase and reason.", ("phase", "reason"))
        self.engine_retried = registry.counter("yue2_engine_retries_total",
                                               "Songs put back in the queue after an engine failure.")
        self.replica_retried = registry.counter("yue2_replica_retries_total",
                                                "Songs put back in the queue after the replica running them died.")
        self.purged = registry.counter("yue2_jobs_purged_total", "Jobs removed (DELETE or retention).")
        registry.gauge("yue2_engine_up", "1 while the AR engine can serve (or none is needed).",
                       function=lambda: 0 if self.engine_status()["state"] in ENGINE_DOWN + ("start_failed",) else 1)
        registry.counter("yue2_engine_restarts_total", "Times the AR engine worker was restarted (all replicas).",
                         function=lambda: self.engine_status().get("restarts", 0))
        self.http_responses = registry.counter("yue2_http_responses_total", "HTTP responses by status code.",
                                               ("code",))
        registry.gauge("yue2_replicas", "Song-worker replicas (serve --replicas / --ray-address): serving and wanted.",
                       ("state",), function=self._replica_counts)
        registry.gauge("yue2_replica_songs_in_flight", "Songs each serving replica runs now.", ("replica",),
                       function=lambda: {(r["replica"],): r["in_flight"] or 0
                                         for r in self.workers.health().get("replica_states", ())})

    def _replica_counts(self) -> dict:
        replicas = self.workers.health().get("replicas")  # "serving/wanted"; none in a single process
        if not replicas:
            return {}
        serving, wanted = replicas.split("/")
        return {("serving",): int(serving), ("wanted",): int(wanted)}


def stage_summary(stage: str, meta: dict, reused: bool) -> dict:
    """What a stage's record says, for the job document: timings, tokens, backend and fallback."""
    summary: dict = {"state": "reused" if reused else "done"}
    if stage in ("plan", "semantic"):
        timing = meta.get("timing") or {}
        summary.update(seconds=timing.get("seconds"), tokens=timing.get("output_tokens"),
                       tokens_per_second=timing.get("output_tps"),
                       backend_requested=timing.get("backend_requested"),
                       backend_actual=timing.get("backend_actual"), fallback_reason=timing.get("fallback_reason"),
                       truncated=meta.get("truncated"))
    elif stage == "synthesis":
        summary["seconds"] = meta.get("nar_seconds")
    else:
        summary.update(seconds=meta.get("vae_seconds"), samples=meta.get("samples"))
    return summary
