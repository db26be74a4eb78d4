"""The durable job store: one SQLite database (WAL) in the data dir, beside each job's run directory.

Admission is one `BEGIN IMMEDIATE` transaction: the idempotency key lookup, the queue bound and the
insert happen together, so two clients can neither both take the last queue slot nor create two
jobs for one key. A job's status only leaves a final state through `requeue` (resume / render). A DELETEd job
is marked `deleted` at once (hidden from every read from then on, its idempotency key freed) and its row removed
once nothing of it runs any more.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA_VERSION = 2  # 2: the deleted column
FINAL = ("complete", "failed", "cancelled")
SCHEMA = """
CREATE TABLE jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- creation order: the queue order and the list cursor
    id TEXT NOT NULL UNIQUE,
    label TEXT,                              -- the body's own "id", if any (never a path)
    status TEXT NOT NULL,
    stage TEXT NOT NULL,                     -- "plan" or "audio": where the job stops
    request TEXT NOT NULL,                   -- SongRequest fields (JSON)
    overrides TEXT NOT NULL,                 -- per-phase sampling overrides (JSON)
    body_sha256 TEXT NOT NULL,               -- of the canonical body, for Idempotency-Key
    idempotency_key TEXT UNIQUE,
    created REAL NOT NULL,
    started REAL,
    finished REAL,
    updated REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,     -- times handed to the scheduler
    retries TEXT NOT NULL DEFAULT '[]',      -- why it was handed again: [{"at", "kind", "reason"}]
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    error TEXT,                              -- {"type", "message"} (JSON) once failed or cancelled
    stages TEXT NOT NULL DEFAULT '{}',       -- per stage: state, timings, backend (JSON)
    result TEXT,                             -- summary of result.json once complete (JSON)
    deleted REAL                             -- when a DELETE asked for it to go (removed once it stopped)
);
CREATE INDEX jobs_status_seq ON jobs (status, seq);
"""
MIGRATIONS = {1: ("ALTER TABLE jobs ADD COLUMN deleted REAL",)}  # from schema N to N + 1
JSON_COLUMNS = ("request", "overrides", "retries", "error", "stages", "result")
UPDATABLE = {"label", "status", "stage", "started", "finished", "attempts", "retries", "cancel_requested", "error",
             "stages", "result", "request", "overrides"}  # request / overrides: a take's shared score, the kept take


class StoreError(RuntimeError):
    """The database cannot be used (made by a newer version, or not ours)."""


class QueueFull(Exception):
    def __init__(self, depth: int, limit: int):
        super().__init__(f"the queue is full ({depth} of {limit} jobs waiting)")
        self.depth, self.limit = depth, limit


class IdempotencyConflict(Exception):
    def __init__(self, key: str, job_id: str):
        super().__init__(f"Idempotency-Key {key!r} was used for job {job_id} with a different body")
        self.key, self.job_id = key, job_id


@dataclass
class JobRecord:
    seq: int
    id: str
    label: str | None
    status: str
    stage: str
    request: dict
    overrides: dict
    body_sha256: str
    idempotency_key: str | None
    created: float
    started: float | None
    finished: float | None
    updated: float
    attempts: int
    retries: list
    cancel_requested: bool
    error: dict | None
    stages: dict
    result: dict | None
    deleted: float | None = None

    @property
    def final(self) -> bool:
        return self.status in FINAL


@dataclass
class NewJob:
    id: str
    label: str | None
    stage: str
    request: dict
    overrides: dict
    body_sha256: str
    idempotency_key: str | None = None
    stages: dict = field(default_factory=dict)


def _record(row: sqlite3.Row) -> JobRecord:
    values = dict(row)
    for name in JSON_COLUMNS:
        if values[name] is not None:
            values[name] = json.loads(values[name])
    values["cancel_requested"] = bool(values["cancel_requested"])
    return JobRecord(**values)


def _encode(name: str, value):
    return json.dumps(value, ensure_ascii=False, sort_keys=True) if name in JSON_COLUMNS and value is not None \
        else value


class JobStore:
    """Jobs in `path` (created with its schema when new). Thread-safe: one connection behind a lock."""

    def __init__(self, path: str | Path, clock=time.time):
        self.path, self.clock = Path(path), clock
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a 202 means the job survives a power cut too
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def _migrate(self) -> None:
        with self.transaction() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                tables = db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'")
                if tables.fetchall():
                    raise StoreError(f"{self.path}: holds tables that are not a yue2-vllm job store")
                for statement in SCHEMA.split(";\n"):  # executescript would COMMIT this transaction
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            elif version > SCHEMA_VERSION:
                raise StoreError(f"{self.path}: job store schema {version} was written by a newer yue2-vllm "
                                 f"(this one reads schema {SCHEMA_VERSION})")
            else:
                for step in range(version, SCHEMA_VERSION):
                    for statement in MIGRATIONS[step]:
                        db.execute(statement)
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @contextmanager
    def transaction(self):
        """`BEGIN IMMEDIATE` ... `COMMIT` (rolled back on an exception)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._rollback()
                raise
            try:
                self._db.execute("COMMIT")
            except BaseException:  # e.g. SQLITE_FULL at COMMIT: the transaction may still be open
                self._rollback()
                raise

    def _rollback(self) -> None:
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:  # SQLite rolled it back itself
                pass

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- admission

    def admit(self, job: NewJob, queue_limit: int | None) -> tuple[JobRecord, bool]:
        """Insert `job` as queued; `(record, True)`. With a known idempotency key and the same body, the
        existing job: `(record, False)`. Raises IdempotencyConflict or QueueFull."""
        with self.transaction() as db:
            if job.idempotency_key is not None:
                row = db.execute("SELECT * FROM jobs WHERE idempotency_key = ?", (job.idempotency_key,)).fetchone()
                if row is not None:
                    if row["body_sha256"] != job.body_sha256:
                        raise IdempotencyConflict(job.idempotency_key, row["id"])
                    return _record(row), False
            if queue_limit is not None:
                depth = self._queued(db)
                if depth >= queue_limit:
                    raise QueueFull(depth, queue_limit)
            now = self.clock()
            db.execute("INSERT INTO jobs (id, label, status, stage, request, overrides, body_sha256, idempotency_key,"
                       " created, updated, stages) VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?)",
                       (job.id, job.label, job.stage, _encode("request", job.request),
                        _encode("overrides", job.overrides), job.body_sha256, job.idempotency_key, now, now,
                        _encode("stages", job.stages)))
            return _record(db.execute("SELECT * FROM jobs WHERE id = ?", (job.id,)).fetchone()), True

    def requeue(self, job_id: str, queue_limit: int | None, *, reason: str, kind: str, stage: str | None = None,
                from_statuses: tuple[str, ...] = FINAL) -> JobRecord:
        """Put a job back in the queue (`kind`: resume, render, engine retry, restart), noting why in its
        retries; the queue bound applies when `queue_limit` is given. Raises QueueFull, or LookupError when
        the job is not in one of `from_statuses`."""
        with self.transaction() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or row["status"] not in from_statuses or row["deleted"] is not None:
                raise LookupError(job_id)
            if queue_limit is not None:
                depth = self._queued(db)
                if depth >= queue_limit:
                    raise QueueFull(depth, queue_limit)
            retries = json.loads(row["retries"]) + [{"at": self.clock(), "kind": kind, "reason": reason}]
            # started is cleared too: song seconds and Retry-After count this attempt, not the time in between.
            db.execute("UPDATE jobs SET status='queued', started=NULL, finished=NULL, error=NULL, result=NULL,"
                       " cancel_requested=0, stage=?, retries=?, updated=? WHERE id=?",
                       (stage or row["stage"], _encode("retries", retries), self.clock(), job_id))
            return _record(db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())

    # -- updates

    def update(self, job_id: str, *, unless_final: bool = False, **values) -> bool:
        """Set columns of one job; with `unless_final`, only while it is not in a final state. Whether it
        was written."""
        unknown = set(values) - UPDATABLE
        if unknown:
            raise ValueError(f"not updatable: {sorted(unknown)}")
        columns = ", ".join(f"{name} = ?" for name in values)
        query = f"UPDATE jobs SET {columns}, updated = ? WHERE id = ?"
        if unless_final:
            query += " AND status NOT IN ('complete', 'failed', 'cancelled')"
        with self.transaction() as db:
            cursor = db.execute(query, [_encode(n, v) for n, v in values.items()] + [self.clock(), job_id])
            return cursor.rowcount == 1

    def mark_deleted(self, job_id: str) -> JobRecord | None:
        """Mark a job deleted (DELETE): every read the service answers treats it as gone from now on, and its
        idempotency key names no job any more; an unfinished one is asked to stop. The record as it was before,
        or None when there is no such job (or it was deleted already)."""
        with self.transaction() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ? AND deleted IS NULL", (job_id,)).fetchone()
            if row is None:
                return None
            db.execute("UPDATE jobs SET deleted = ?, idempotency_key = NULL, updated = ?, cancel_requested = "
                       "CASE WHEN status IN ('complete', 'failed', 'cancelled') THEN cancel_requested ELSE 1 END "
                       "WHERE id = ?", (self.clock(), self.clock(), job_id))
            return _record(row)

    def delete(self, job_id: str) -> bool:
        """Remove a finished or deleted job's row; whether there was one. A job that is neither is never removed."""
        with self.transaction() as db:
            cursor = db.execute("DELETE FROM jobs WHERE id = ? AND (status IN ('complete', 'failed', 'cancelled') "
                                "OR deleted IS NOT NULL)", (job_id,))
            return cursor.rowcount == 1

    def deleted_ids(self) -> list[str]:
        """Ids of the jobs marked deleted whose rows are still here (their runs had not stopped yet)."""
        with self._lock:
            return [row[0] for row in self._db.execute("SELECT id FROM jobs WHERE deleted IS NOT NULL ORDER BY seq")]

    def finished_before(self, timestamp: float, limit: int = 100) -> list[str]:
        """Ids of finished jobs that finished before `timestamp`, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT id FROM jobs WHERE status IN ('complete', 'failed', 'cancelled') AND "
                                    "deleted IS NULL AND finished < ? ORDER BY finished LIMIT ?",
                                    (timestamp, limit)).fetchall()
        return [row[0] for row in rows]

    # -- reads

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _record(row) if row is not None else None

    def list(self, statuses: tuple[str, ...] = (), limit: int = 50, before: int | None = None) -> list[JobRecord]:
        """Newest first, deleted jobs left out; `before` is the `seq` of the last job of the previous page."""
        query, params = "SELECT * FROM jobs WHERE deleted IS NULL", []
        if statuses:
            query += f" AND status IN ({', '.join('?' * len(statuses))})"
            params += list(statuses)
        if before is not None:
            query += " AND seq < ?"
            params.append(before)
        query += " ORDER BY seq DESC LIMIT ?"
        params.append(limit)
        with self._lock:
            return [_record(row) for row in self._db.execute(query, params)]

    def unfinished(self) -> list[JobRecord]:
        """Every job not in a final state, in creation order (the order they are resumed in)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs WHERE status NOT IN ('complete', 'failed', 'cancelled') "
                                    "ORDER BY seq").fetchall()
        return [_record(row) for row in rows]

    @staticmethod
    def _queued(db) -> int:
        return db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued'").fetchone()[0]

    def queued(self) -> int:
        with self._lock:
            return self._queued(self._db)

    def queue_position(self, record: JobRecord) -> int:
        """How many queued jobs are ahead of this one (0: next)."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued' AND seq < ?",
                                    (record.seq,)).fetchone()[0]

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {row[0]: row[1] for row in self._db.execute("SELECT status, COUNT(*) FROM jobs WHERE deleted IS "
                                                               "NULL GROUP BY status")}
