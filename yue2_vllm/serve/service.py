"""The song service: jobs in a durable store, run by song workers.

It validates and admits jobs (atomically with the queue bound and idempotency keys), hands each attempt to its
workers — one `SongWorker` in this process, or a pool of Ray Serve replicas (`serve.cluster.ReplicaPool`) —
writes each job's status from their events (`complete` only once the artifacts verify), fans the events out to
SSE subscribers (token and synthesis events at most 4/s per job), keeps the metrics, resumes every unfinished job
when it starts, and puts back the songs a dead engine or a dead replica failed.

What it needs of its workers (both kinds have it): `rules` (SongRules), `concurrency`, `listener` (set here),
`start()`, `close(timeout)`, `submit(order) -> run` (a run has `id`, `state`, `done`, `cancel()` and may name
its `replica`), `down_for_good()` (why no song can be served, else None) and `health()`.

`SongService` is composed of one part per responsibility, each in its own module: `owner` (the job owner thread,
start, close, the watchdog), `jobs` (submit, launch, requeue, cancel, delete), `run_events` (the workers' events,
final records, retries), `take_jobs` (takes), `admission` (disk room, the queue's 429), `views` (the JSON
documents), `health` (/health) and `service_metrics`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..scheduler import FINAL_STATES  # noqa: F401 (re-exported)
from ..takes import MAX_TAKES
from .admission import Admission
from .disk import RETENTION_SECONDS
from .durable import DurableStore
from .errors import NotFound
from .events import EventHub, Throttle
from .health import Health
from .jobs import JobActions
from .owner import JobOwner
from .run_events import RunEvents
from .service_metrics import ServiceMetrics
from .store import IdempotencyConflict, JobRecord, JobStore, NewJob, QueueFull  # noqa: F401 (re-exported)
from .submission import valid_job_id
from .take_jobs import Takes
from .views import Views, urls  # noqa: F401 (re-exported)
from .worker import SongWorker

LOG = logging.getLogger("yue2_vllm.serve")


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
    sweep_interval: float = 60.0  # the watchdog looks for jobs past the retention window this often
    min_free_bytes: int = 1 << 30  # kept free beyond what every admitted song may still write (else 507)
    owner_timeout: float = 30.0  # an HTTP call waits this long for the job owner, then answers 503
    max_takes: int = MAX_TAKES  # the most takes one POST may ask for (--max-takes)
    speech_wait_seconds: float = 900.0  # POST /v1/audio/speech waits this long for its song, then answers 504
    max_waiting_calls: int = 256  # POST /v1/audio/speech calls waiting at once before the next answers 503

    def __post_init__(self):
        self.data_dir = Path(self.data_dir)
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size}")
        if self.max_interrupted_runs < 1:
            raise ValueError(f"max_interrupted_runs must be >= 1, got {self.max_interrupted_runs}")
        if self.replica_retries < 0 or self.engine_retries < 0:
            raise ValueError("engine_retries and replica_retries must be >= 0")
        if not self.speech_wait_seconds > 0:
            raise ValueError(f"speech_wait_seconds must be > 0, got {self.speech_wait_seconds}")
        if self.max_waiting_calls < 1:
            raise ValueError(f"max_waiting_calls must be >= 1, got {self.max_waiting_calls}")
        if not 1 <= self.max_takes <= MAX_TAKES:
            raise ValueError(f"max_takes must be in [1, {MAX_TAKES}], got {self.max_takes}")

    @property
    def database(self) -> Path:
        return self.data_dir / "jobs.sqlite3"

    @property
    def jobs(self) -> Path:
        return self.data_dir / "jobs"


class SongService(JobOwner, JobActions, RunEvents, Takes, Admission, Views, Health, ServiceMetrics):
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
        self.workers, self.config, self.rules = workers, config, workers.rules
        config.jobs.mkdir(parents=True, exist_ok=True)
        self._init_owner()
        # Every write the job owner makes lands (retried while the disk refuses it); see serve.durable.
        self.store = DurableStore(JobStore(config.database), config.data_dir, stopping=self._stop.is_set)
        self.hub, self.throttle = EventHub(), Throttle(config.event_interval)
        self._init_admission()
        self._init_takes()
        self._init_views()
        self._init_metrics()
        workers.listener = self._post_event
        if hasattr(workers, "min_free_bytes"):  # a queued song waits while the data dir is full (see SongWorker)
            workers.min_free_bytes = config.min_free_bytes

    def directory(self, job_id: str) -> Path:
        if not valid_job_id(job_id):  # never a path from outside
            raise NotFound(f"no song {job_id!r}")
        return self.config.jobs / job_id

    def get_record(self, job_id: str) -> JobRecord:
        record = self.store.get(job_id) if valid_job_id(job_id) else None
        if record is None or record.deleted is not None:
            raise NotFound(f"no song {job_id!r}")
        return record
