"""The HTTP side's safe defaults, as pure ASGI and small functions: the error body every status shares, no server
paths or traces for callers without the key (`redact`), the Host allow-list and the cross-origin refusal
(`Guard`), responses counted by status, and JSON bodies read up to a limit."""
from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import JSONResponse

from .errors import RequestInvalid, TooLarge

LOOPBACK_NAMES = ("localhost", "localhost.")
UNSAFE_METHODS = ("POST", "PUT", "PATCH", "DELETE")


def error_response(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"status": status, "message": message, "field": field}}, status_code=status,
                        headers=headers)


# --------------------------------------------------------------------------- no paths for callers without the key

_PATH = re.compile(r"(?<![\w.~:/\\-])/(?!v1/)(?:[^\s'\"()<>\[\]{},;:/]+/)+([^\s'\"()<>\[\]{},;:/]*)")
_TRACE = re.compile(r"Traceback \(most recent call last\).*", re.S)
# Keys whose values the server writes (errors, reasons, records of where weights came from); what a client
# sent (style, lyrics, score) is given back as it came.
_SERVER_KEYS = {"error", "errors", "message", "reason", "fallback_reason", "retries", "stages", "result",
                "engine", "sources", "source", "path", "directory", "backend_note", "batch_note", "problems", "disk"}


def redact_text(text: str) -> str:
    """A message without absolute paths (each becomes `…/NAME`) and without a Python traceback."""
    return _PATH.sub(lambda m: "…/" + m.group(1), _TRACE.sub("(trace left out)", text))


def redact(value, inside: bool = False):
    """`value` with every server-written string in it redacted (see _SERVER_KEYS)."""
    if isinstance(value, dict):
        return {k: redact(v, inside or k in _SERVER_KEYS) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(item, inside) for item in value]
    if isinstance(value, str) and inside:
        return redact_text(value)
    return value


# --------------------------------------------------------------------------- safe defaults (pure ASGI)


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether a Host header names this server: an IP literal, a loopback name or an allowed name."""
    if "*" in allowed:
        return True
    name = host.strip().lower()
    if name.startswith("["):  # [v6]:port
        name, closed, port = name[1:].partition("]")
        if not closed or (port and not re.fullmatch(r":\d{1,5}", port)):
            return False
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True  # a name an attacker's DNS can point here is a name, never an address
    except ValueError:
        pass
    return name in LOOPBACK_NAMES or name.endswith(".localhost") or name.rstrip(".") in allowed


class Guard:
    """The Host allow-list (DNS rebinding) for every request, and for unsafe methods a browser's `Origin` (or
    `Sec-Fetch-Site: cross-site`) from a page of another origin refused: no cross-site request reaches a route."""

    def __init__(self, app, allowed_hosts: tuple[str, ...] = ()):
        self.app, self.allowed = app, tuple(h.lower().rstrip(".") if h != "*" else h for h in allowed_hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if not host_allowed(host, self.allowed):
            response = error_response(400, f"Host {host[:100]!r} is not a name of this server (start it with "
                                           "--allowed-host NAME to serve under that name)", "Host")
            return await response(scope, receive, send)
        if scope["method"] in UNSAFE_METHODS:
            origin = headers.get("origin")
            cross = headers.get("sec-fetch-site") == "cross-site"
            if cross or (origin is not None and origin != "null" and urlsplit(origin).netloc.lower() != host.lower()):
                response = error_response(403, "a request from a page of another origin is refused", "Origin")
                return await response(scope, receive, send)
            if origin == "null":
                response = error_response(403, "a request from an opaque origin is refused", "Origin")
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class ResponseCounter:
    """Pure ASGI middleware: counts responses by status code (SSE streams included)."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counter.inc(code=str(message["status"]))
            await send(message)

        return await self.app(scope, receive, counting_send)


def is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it passes `limit` bytes (declared or streamed)."""
    declared = request.headers.get("content-length")
    too_large = TooLarge(f"body: larger than the limit of {limit} bytes")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def is_multipart(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == "multipart/form-data"


async def read_form(request: Request, limit: int, max_files: int, max_fields: int):
    """A multipart/form-data body (an upload) parsed as it streams in, refused with 413 naming the limit once it
    passes `limit` bytes (declared or streamed); its files are spooled to temporary files (removed when the form is
    closed: `async with` it, or `await form.close()`). A body the parser refuses (no boundary, a part without a name,
    more than `max_files` file parts or `max_fields` text fields) is a 422 naming `body`."""
    from starlette.exceptions import HTTPException
    from starlette.requests import Request as Stream

    mb = f"{limit / 1e6:g} MB"
    too_large = TooLarge(f"audio: the upload is larger than the limit of {mb} ({limit} bytes; --max-upload-mb)",
                         field="audio")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    seen = 0

    async def receive():
        nonlocal seen
        message = await request.receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large
        return message

    try:
        return await Stream(request.scope, receive).form(max_files=max_files, max_fields=max_fields,
                                                         max_part_size=1 << 20)
    except HTTPException as exc:  # Starlette's answer to its parser's refusal: a 400 naming no field
        raise RequestInvalid(f"body: the multipart form does not read: {exc.detail}", field="body") from None
