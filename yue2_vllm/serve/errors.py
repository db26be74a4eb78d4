"""The service's errors: each carries its HTTP status, a message in words and, for 422, the field it is about."""
from __future__ import annotations


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
