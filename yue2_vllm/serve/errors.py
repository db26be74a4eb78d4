"""The service's errors: each carries its HTTP status, a message in words and, for 422, the field it is about;
and how a failure is logged (an expected one in one line)."""
from __future__ import annotations

import logging
import sqlite3


class ServiceError(Exception):
    """An error with an HTTP status, a message in words and, for 422, the field it is about."""

    status = 500

    def __init__(self, message: str, *, field: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.field, self.headers = message, field, dict(headers or {})


class RequestInvalid(ServiceError):
    status = 422


class Unauthorized(ServiceError):
    status = 401


class NotFound(ServiceError):
    status = 404


class Conflict(ServiceError):
    status = 409


class TooLarge(ServiceError):
    status = 413


class TooManyJobs(ServiceError):
    status = 429


class Unavailable(ServiceError):
    status = 503


class InsufficientStorage(ServiceError):
    status = 507


# What the world does to a server (a full disk, a store write waiting to land, an answer in words): expected, so
# one line in the log. Anything else is a bug and keeps its traceback.
EXPECTED = (ServiceError, OSError, sqlite3.Error)


def log_failure(log: logging.Logger, what: str, exc: BaseException) -> None:
    """Log that `what` failed: one line for an expected condition, the traceback for anything else."""
    if isinstance(exc, EXPECTED):
        log.error("%s failed: %s: %s", what, type(exc).__name__, exc)
    else:
        log.error("%s failed", what, exc_info=(type(exc), exc, exc.__traceback__))
