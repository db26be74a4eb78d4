"""Admission: room on the disk for what a song may write (`serve.disk`'s bounds and ledger), the queue bound's
429 and the Retry-After both carry, and the store refusing an insert."""
from __future__ import annotations

import math
import shutil
import sqlite3
import statistics

from ..protocol import SongRequest
from .disk import DiskLedger, request_bytes
from .errors import InsufficientStorage, TooManyJobs, Unavailable
from .store import JobRecord, QueueFull


class Admission:
    """Disk and queue admission (part of `SongService`)."""

    def _init_admission(self) -> None:
        self.disk = DiskLedger(self.config.jobs, lambda path: shutil.disk_usage(path).free)

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
