"""Job-store writes that land: a write the disk refuses (full, I/O error, locked past its timeout) is retried with
backoff until it lands, and the data dir's own state (free bytes, writable) as /health reports it.

The job owner makes every transition through `DurableStore`: a failed write blocks the owner on that one
transition — nothing after it is done, so what the scheduler acts on never runs ahead of the store — and
`fault()` says what is waiting and since when, for /health. Admission (an HTTP thread) does not wait: a refused
insert is answered there (507) and the client retries.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import free_bytes

LOG = logging.getLogger("yue2_vllm.serve")
RETRIED = ("update", "requeue", "mark_deleted", "delete")  # the owner's writes (admit answers the client itself)
FIRST_DELAY, MAX_DELAY = 0.05, 2.0  # seconds between attempts: doubling up to MAX_DELAY
LOG_EVERY = 30.0  # seconds between the "still failing" lines of one fault
PROBE = ".write-probe"


@dataclass
class StoreFault:
    """A store write that has not landed yet."""

    since: float  # time.monotonic() of its first failure
    what: str  # "update of job X"
    error: str  # the last sqlite error
    attempts: int = 1


def store_fault_error(exc: BaseException) -> bool:
    """An error that a later attempt of the same write may not meet (space, I/O, a lock)."""
    return isinstance(exc, sqlite3.OperationalError)


class DurableStore:
    """`store` (a JobStore) whose RETRIED writes are retried until they land; everything else passes through.
    `stopping()` true: a write gives up after its third attempt (the job resumes from the store at the next
    start)."""

    def __init__(self, store, data_dir: Path, stopping=lambda: False):
        self._store, self.data_dir, self._stopping = store, Path(data_dir), stopping
        self._fault: StoreFault | None = None
        self._wake = threading.Event()  # set by close(): stop sleeping between attempts

    def __getattr__(self, name):
        value = getattr(self._store, name)
        if name in RETRIED:
            return lambda *args, **kwargs: self._retry(name, value, args, kwargs)
        return value

    def fault(self) -> StoreFault | None:
        return self._fault

    def wake(self) -> None:
        self._wake.set()

    def _retry(self, name: str, method, args, kwargs):
        delay, last_line = FIRST_DELAY, 0.0
        while True:
            try:
                result = method(*args, **kwargs)
            except Exception as exc:
                if not store_fault_error(exc):
                    raise
                fault = self._fault
                what = f"{name} of job {args[0]}" if args else name
                if fault is None:
                    fault = self._fault = StoreFault(time.monotonic(), what, str(exc))
                else:
                    fault.attempts, fault.what, fault.error = fault.attempts + 1, what, str(exc)
                if fault.attempts >= 3 and self._stopping():
                    LOG.error("job store: giving up on the %s (%s) while stopping; the job resumes from the store "
                              "at the next start", what, exc)
                    raise
                now = time.monotonic()
                if now - last_line >= LOG_EVERY:
                    last_line = now
                    LOG.error("job store: cannot write %s (%s: %s; the data dir %s has %s bytes free); the job "
                              "owner retries every %.0f s at most until it lands", self._store.path, what, exc,
                              self.data_dir, free_bytes(self.data_dir), MAX_DELAY)
                self._wake.wait(delay)
                delay = min(MAX_DELAY, delay * 2)
                continue
            if self._fault is not None:
                fault, self._fault = self._fault, None
                LOG.warning("job store: writes land again (the %s waited %.1f s, %d attempts)", fault.what,
                            time.monotonic() - fault.since, fault.attempts)
            return result


def probe_writable(directory: Path) -> str | None:
    """Why `directory` cannot take a new file's bytes now (its OSError's words), or None when it can."""
    path = Path(directory) / PROBE
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(descriptor, b"\0" * 4096)  # a block of data: an empty file needs only an inode
        finally:
            os.close(descriptor)
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        try:
            path.unlink()
        except OSError:
            pass
    return None


def disk_state(directory: Path) -> tuple[int | None, str | None]:
    """`directory`'s free bytes (None: unreadable) and why it cannot be written now (None: it can)."""
    return free_bytes(directory), probe_writable(directory)


def disk_refusal(directory: Path, min_free_bytes: int = 0, state: tuple[int | None, str | None] | None = None) \
        -> str | None:
    """Why a song should not start writing into `directory` now (it cannot be written, or has under
    `min_free_bytes` free), else None. `state`: a `disk_state` already taken."""
    free, refused = state if state is not None else disk_state(directory)
    if refused is not None:
        return f"the data dir {directory} cannot be written ({refused}; {free} bytes free)"
    if free is not None and free < min_free_bytes:
        return f"the data dir {directory} has {free} bytes free, under --min-free-disk ({min_free_bytes} bytes)"
    return None
