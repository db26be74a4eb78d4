"""The HTTP API and the web page: a FastAPI app over one `SongService`.

Every error is `{"error": {"status", "message", "field"}}` (documented for every status in /openapi.json);
with an API key, every /v1 path and /metrics need `Authorization: Bearer KEY` (/health and the page stay open).
Safe by default: the Host must be a loopback name, an IP address or an `allowed_hosts` name (no DNS rebinding);
an unsafe method from a browser page of another origin is refused (403), a POST body must be JSON (415), and a
caller without the key (everyone, when there is none) never sees a server path or a trace.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import re
import time
from contextlib import asynccontextmanager
from importlib import resources
from urllib.parse import urlsplit

import anyio
from fastapi import APIRouter, Depends, FastAPI, Header, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import HTTPBearer
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.background import BackgroundTask
from starlette.routing import Match

from .. import __version__
from . import contract
from .errors import Conflict, RequestInvalid, ServiceError, TooLarge, Unauthorized, Unavailable
from .events import event_json
from .metrics import CONTENT_TYPE
from ..takes import MAX_TAKES
from .service import FINAL_STATES, SongService, urls
from .signed import AUDIO_URL_SECONDS, SIGNATURE_PATTERN, signature_problem, signed_audio_query, signing_key

MAX_BODY_BYTES = 256 * 1024
HEARTBEAT_SECONDS = 15.0
MAX_SSE_CLIENTS = 256
LOOPBACK_NAMES = ("localhost", "localhost.")
STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}  # modules need the JS type


def page_files() -> dict[str, str]:
    """The page's files (its ES modules and style sheet) by name, with their media types, as the package holds them."""
    folder = resources.files(__package__).joinpath("static")
    suffixes = {entry.name: os.path.splitext(entry.name)[1] for entry in folder.iterdir()}
    return {name: STATIC_TYPES[suffix] for name, suffix in sorted(suffixes.items()) if suffix in STATIC_TYPES}


STATIC = page_files()  # a fixed set of names, never a path
# The page loads nothing from elsewhere; audio streams from the server (a signed URL when there is an API key),
# result.json may come from a blob: URL (fetched with the key).
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; media-src 'self'; connect-src 'self' blob:; "
                                           "img-src 'self' data:; "
                                           "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
UNSAFE_METHODS = ("POST", "PUT", "PATCH", "DELETE")
_STATUS = "(?:" + "|".join(contract.STATUSES) + ")"
STATUS_LIST = f"^,*(?:{_STATUS}(?:,+{_STATUS})*)?,*$"  # statuses, comma-separated (empty pieces ignored)


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


class OpenFileResponse(FileResponse):
    """A FileResponse (Range requests and all) over a file opened while the answer was made: a DELETE that removes
    the job meanwhile does not cut a download short."""

    def __init__(self, file, **options):
        self.file = file
        super().__init__(file.name, stat_result=os.fstat(file.fileno()), background=BackgroundTask(file.close),
                         **options)

    @asynccontextmanager
    async def _open_file(self):
        yield anyio.wrap_file(self.file)


# --------------------------------------------------------------------------- OpenAPI: statuses and media


def _errors(*statuses: int, **words: str) -> dict:
    default = {400: "the Host is not a name of this server", 401: "missing or wrong API key",
               403: "from a page of another origin", 404: "no such song (ids are j + 20 hex digits)",
               409: "not ready, or in a state that does not allow it", 413: "the body is over 256 KiB",
               415: "the body is not application/json", 422: "a field, parameter or header is invalid (named)",
               429: "the queue is full (Retry-After)", 503: "unavailable now (Retry-After)"}
    return {status: {"model": contract.ErrorBody, "description": words.get(f"s{status}", default[status])}
            for status in statuses}


def _media(media_type: str, description: str, schema: dict | None = None) -> dict:
    return {"description": description, "content": {media_type: {"schema": schema or {"type": "string"}}}}


EVENT_KINDS = ("status", "state", "tokens", "stage", "score", "waiting", "nar", "vae", "retry", "complete",
               "failed", "cancelled")
# One event (OpenAPI 3.2's itemSchema for a sequential media type): its data is always one line of JSON.
SSE_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "enum": list(EVENT_KINDS)},
    "data": {"type": "string", "contentMediaType": "application/json", "pattern": "^[^\\r\\n\u0085\u2028\u2029]*$"},
    "id": {"type": "string"}, "retry": {"type": "integer", "minimum": 0}}}


RETRY_AFTER = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
LOCATION = {"Location": {"description": "the job's URL", "schema": {"type": "string"}}}


def create_app(service: SongService, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               allowed_hosts: tuple[str, ...] = (), max_sse_clients: int = MAX_SSE_CLIENTS) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        await run_in_threadpool(service.start)
        try:
            yield
        finally:
            await run_in_threadpool(service.close)

    guarded = api_key is not None
    app = FastAPI(title="yue2-vllm", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Songs from YuE2 over HTTP: durable jobs with live progress (Server-Sent Events).",
                  responses=_errors(400))
    app.add_middleware(ResponseCounter, counter=service.http_responses)
    app.add_middleware(Guard, allowed_hosts=tuple(allowed_hosts))
    reproducible = bool(service.rules.reproducible)
    in_flight_keys: set[str] = set()
    streams = {"open": 0}

    def trusted(request: Request) -> bool:
        """Whether the caller sent the right API key (never, when the server has none)."""
        if api_key is None:
            return False
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())

    def answer(request: Request, document, status_code: int = 200, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(document if trusted(request) else redact(document), status_code=status_code,
                            headers=headers)

    @app.exception_handler(ServiceError)
    async def service_error(request, exc: ServiceError):
        message = exc.message if trusted(request) else redact_text(exc.message)
        return error_response(exc.status, message, exc.field, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(part) for part in first.get("loc", ())]
        field = location[-1] if len(location) > 1 else None
        if field and location[0] == "header":  # as the header is spelled: Idempotency-Key
            field = "-".join(part.capitalize() for part in field.split("-"))
        return error_response(422, f"{field or 'request'}: {first.get('msg', 'invalid')}", field)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # every method of every route at this path, not just the first route's
            methods = set()
            for route in app.router.routes:
                match, _ = route.matches({**request.scope, "method": "GET"})
                if match != Match.NONE and getattr(route, "methods", None):
                    methods |= set(route.methods)
            if methods:
                headers["Allow"] = ", ".join(sorted(methods))
        return error_response(exc.status_code, message, headers=headers or None)

    bearer = HTTPBearer(auto_error=False, description="the server's --api-key (or $YUE2_API_KEY)")

    def authorized(request: Request, _=Depends(bearer)) -> None:
        if api_key is not None and not trusted(request):
            raise Unauthorized("missing or wrong API key: send 'Authorization: Bearer KEY'",
                               headers={"WWW-Authenticate": 'Bearer realm="yue2-vllm"'})

    auth = [Depends(authorized)] if guarded else []
    denied = (401,) if guarded else ()

    # -- open: the page and health

    @app.get("/", include_in_schema=False)
    def page():
        html = resources.files(__package__).joinpath("static/index.html").read_text(encoding="utf-8")
        return Response(html, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str):
        if name not in STATIC:  # a fixed set of files, never a path
            return error_response(404, f"no static file {name!r}")
        data = resources.files(__package__).joinpath(f"static/{name}").read_bytes()
        return Response(data, media_type=STATIC[name], headers=PAGE_HEADERS)

    @app.get("/health", summary="Engine state, queue depth, songs in flight",
             responses={200: {"model": contract.Health},
                        503: {"model": contract.Health, "description": "not ok, each reason in `problems`: the "
                              "engine is starting, restarting or down; the data dir cannot be written or is under "
                              "--min-free-disk, or the job store cannot be written (`disk` says which, with the "
                              "free bytes); queued work makes no progress", "headers": RETRY_AFTER}})
    def health(request: Request):
        document, ok = service.health()
        document = {**document, "api_key_required": guarded}
        return answer(request, document, 200 if ok else 503, None if ok else {"Retry-After": "5"})

    @app.get("/metrics", dependencies=auth, summary="Prometheus metrics",
             responses={200: _media(CONTENT_TYPE.split(";")[0], "Prometheus text exposition (0.0.4)"),
                        **_errors(*denied)})
    def metrics(request: Request):
        text = service.metrics.render()
        return Response(text if trusted(request) else redact_text(text), media_type=CONTENT_TYPE)

    # -- /v1

    v1 = APIRouter(prefix="/v1", dependencies=auth)
    body_doc = {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/SongBody"}}}}}

    @v1.post("/songs", status_code=202, summary="Queue a song", openapi_extra=body_doc, responses={
        202: {"model": contract.SongCreated, "description": "queued", "headers": LOCATION},
        200: {"model": contract.SongCreated, "description": "the job an earlier request with this Idempotency-Key "
                                                            "made (the same body)", "headers": LOCATION},
        **_errors(*denied, 403, 413, 415, 422, s422="a field is invalid (named), or the Idempotency-Key was used "
                  "with another body (the IETF Idempotency-Key draft's answer)"),
        409: {"model": contract.ErrorBody, "description": "a request with this Idempotency-Key is still being "
                                                          "processed", "headers": RETRY_AFTER},
        429: {"model": contract.ErrorBody, "description": "the queue is full", "headers": RETRY_AFTER},
        503: {"model": contract.ErrorBody, "description": "the engine is down for good", "headers": RETRY_AFTER},
        507: {"model": contract.ErrorBody, "description": "the free disk cannot hold what the song may write beside "
                                                          "the admitted songs", "headers": RETRY_AFTER}})
    async def create_song(request: Request, idempotency_key: str | None = Header(
            None, pattern=contract.IDEMPOTENCY_KEY, max_length=255,
            description="the same key and body again → the same job (200); another body → 422")):
        if not is_json(request.headers.get("content-type")):
            return error_response(415, "body: send it as Content-Type: application/json", "Content-Type")
        body = await read_body(request, max_body_bytes)
        if idempotency_key is not None and idempotency_key in in_flight_keys:
            raise Conflict("Idempotency-Key: a request with this key is still being processed; retry in a moment",
                           field="Idempotency-Key", headers={"Retry-After": "1"})
        if idempotency_key is not None:
            in_flight_keys.add(idempotency_key)
        try:
            record, created = await run_in_threadpool(service.submit, body, idempotency_key)
        except ServiceError as exc:
            if exc.status == 409 and exc.field == "Idempotency-Key":  # reused with another body: IETF draft → 422
                raise RequestInvalid(exc.message, field=exc.field) from None
            raise
        finally:
            in_flight_keys.discard(idempotency_key)
        document = {"id": record.id, "label": record.label, "status": record.status, "stage": record.stage,
                    "created": created, "urls": urls(record.id)}
        return JSONResponse(document, status_code=202 if created else 200,
                            headers={"Location": document["urls"]["self"]})

    @v1.get("/songs", summary="Jobs, newest first", responses={200: {"model": contract.SongList},
                                                               **_errors(*denied, 422)})
    def list_songs(request: Request,
                   status: str | None = Query(None, description="statuses, comma-separated", examples=["complete"],
                                              pattern=STATUS_LIST),
                   limit: int = Query(50, ge=1, le=200), cursor: str | None = Query(None, pattern=r"^\d{0,18}$")):
        statuses = tuple(s for s in (status or "").split(",") if s)
        return answer(request, service.list(statuses, limit, cursor))

    song = {200: {"model": contract.Song}, **_errors(*denied, 404)}

    @v1.get("/songs/{job_id}", summary="A job", responses=song)
    def get_song(request: Request, job_id: str):
        return answer(request, service.document(job_id))

    @v1.delete("/songs/{job_id}", status_code=204, summary="Delete a job: it is gone at once, its files and row "
               "once it stopped", responses={
        204: {"description": "the job's files and row are gone (nothing of it was running)"},
        202: {"model": contract.Song, "description": "the job, asked to stop: it is gone for every client already "
                                                     "(each GET answers 404); its run stops at the next token, ODE "
                                                     "step or tile, then its files and row are removed"},
        **_errors(*denied, 403, 404)})
    def delete_song(request: Request, job_id: str):
        stopping = service.delete(job_id)
        return Response(status_code=204) if stopping is None else answer(request, stopping, 202)

    @v1.post("/songs/{job_id}/cancel", summary="Cancel a job (it stays, resumable)", responses={
        202: {"model": contract.Song, "description": "asked to stop at the next token, ODE step or tile"},
        200: {"model": contract.Song, "description": "cancelled at once (it was queued), or it had ended already: "
                                                     "the job as it is"},
        **_errors(*denied, 403, 404)})
    def cancel_song(request: Request, job_id: str):
        record, asked = service.cancel(job_id)
        return answer(request, service.describe(record), 202 if asked and not record.final else 200)

    requeue = {202: {"model": contract.Song, "description": "queued again"},
               **_errors(*denied, 403, 404, 409), 429: {"model": contract.ErrorBody, "description": "the queue is "
                                                                                      "full", "headers": RETRY_AFTER},
               507: {"model": contract.ErrorBody, "description": "the free disk cannot hold what the song may still "
                                                                 "write", "headers": RETRY_AFTER}}

    @v1.post("/songs/{job_id}/resume", status_code=202, summary="Resume a failed or cancelled job",
             responses=requeue)
    def resume_song(request: Request, job_id: str):
        return answer(request, service.describe(service.requeue(job_id, render=False)), 202)

    @v1.post("/songs/{job_id}/render", status_code=202, summary="Render a planned job's audio", responses=requeue)
    def render_song(request: Request, job_id: str):
        return answer(request, service.describe(service.requeue(job_id, render=True)), 202)

    files = _errors(*denied, 404, 409, s409="not ready yet")

    audio_answers = {200: _media("audio/flac", "the FLAC", {"type": "string", "format": "binary"}),
                     206: _media("audio/flac", "a Range of it", {"type": "string", "format": "binary"}),
                     416: {"description": "the Range is outside the file"}, **files}

    def opened(job_id: str, name: str):
        """A job's ready file, open (404 once the job is deleted, even when that happens meanwhile)."""
        path = service.file(job_id, name)
        try:
            return open(path, "rb")
        except FileNotFoundError:
            service.get_record(job_id)
            raise Conflict(f"{name} is missing from the job's directory") from None

    audio_key = signing_key(api_key) if guarded else None

    def audio(request: Request, job_id: str, _=Depends(bearer),
              expires: int | None = Query(None, ge=0, le=2 ** 53, description="a signed URL's expiry (audio-url)"),
              signature: str | None = Query(None, pattern=SIGNATURE_PATTERN, description="a signed URL's signature")):
        if guarded and not trusted(request):  # the key, or a signed URL the <audio> element can use directly
            problem = signature_problem(audio_key, job_id, expires, signature, time.time())
            if problem is not None:
                raise Unauthorized(problem, headers={"WWW-Authenticate": 'Bearer realm="yue2-vllm"'})
        return audio_file(job_id)

    def audio_file(job_id: str) -> OpenFileResponse:
        label = service.get_record(job_id).label or job_id
        return OpenFileResponse(opened(job_id, "audio.flac"), media_type="audio/flac", filename=f"{label}.flac",
                                content_disposition_type="inline", headers={"Cache-Control": "private, no-cache"})

    signed = APIRouter(prefix="/v1")  # the audio route checks the key itself: a signed URL stands in for it
    for method in ("GET", "HEAD"):
        signed.add_api_route("/songs/{job_id}/audio", audio, methods=[method], summary="The song (FLAC)",
                             description="Range requests answer 206. With an API key: the key, or the signed URL "
                                         "of GET /v1/songs/{id}/audio-url.",
                             responses=audio_answers, operation_id=f"song_audio_{method.lower()}")

    @v1.get("/songs/{job_id}/audio-url", summary="A short-lived URL that plays the song without the key",
            response_model=contract.AudioUrl, responses=files)
    def audio_url(job_id: str):
        service.file(job_id, "audio.flac")  # 404 / 409 now, not when the player asks
        path = urls(job_id)["audio"]
        if not guarded:
            return {"url": path, "expires": None, "expires_in": None}
        query, expires = signed_audio_query(audio_key, job_id, time.time())
        return {"url": f"{path}?{query}", "expires": expires, "expires_in": AUDIO_URL_SECONDS}

    @v1.get("/songs/{job_id}/peaks", summary="The song's peaks and spectrogram, to draw it",
            response_model=contract.Picture, responses=files)
    async def peaks(job_id: str):
        return await run_in_threadpool(service.picture, job_id)

    @v1.get("/songs/{job_id}/score", summary="The ABC score", responses={
        200: _media("text/vnd.abc", "the score as planned"), **files})
    def score(job_id: str):
        with opened(job_id, "score.abc") as file:
            return Response(file.read(), media_type="text/vnd.abc; charset=utf-8")

    @v1.get("/songs/{job_id}/result", summary="result.json", responses={
        200: _media("application/json", "the run's result.json", {"type": "object"}), **files})
    def result(request: Request, job_id: str):
        with opened(job_id, "result.json") as file:
            data = file.read()
        if trusted(request):
            return Response(data, media_type="application/json")
        return answer(request, redact(json.loads(data), inside=False))

    take_number = Path(..., ge=1, le=MAX_TAKES, description="the take, 1 (the job itself) to the job's takes")

    @v1.get("/songs/{job_id}/takes/{take}", summary="One take of a job (its own job record)", responses=song)
    def get_take(request: Request, job_id: str, take: int = take_number):
        return answer(request, service.document(service.take_job(job_id, take)))

    @v1.delete("/songs/{job_id}/takes/{take}", status_code=204, summary="Delete one take (2 or later; take 1 is "
               "the job: DELETE the job)", responses={
        204: {"description": "the take's files and row are gone"},
        202: {"model": contract.Song, "description": "the take, asked to stop: gone for every client already, its "
                                                     "files and row once it stopped"},
        **_errors(*denied, 403, 404, 409, s409="take 1 is the job itself")})
    def delete_take(request: Request, job_id: str, take: int = take_number):
        stopping = service.delete_take(job_id, take)
        return Response(status_code=204) if stopping is None else answer(request, stopping, 202)

    @v1.post("/songs/{job_id}/takes/{take}/keep", summary="Mark the take kept (recorded on the job)", responses={
        200: {"model": contract.Song, "description": "the job, with takes.kept"},
        **_errors(*denied, 403, 404, 409, s409="the job has no takes")})
    def keep_take(request: Request, job_id: str, take: int = take_number):
        return answer(request, service.describe(service.keep_take(job_id, take)))

    def take_audio(job_id: str, take: int = take_number):
        return audio_file(service.take_job(job_id, take))  # under the key (v1), as every take route

    for method in ("GET", "HEAD"):
        v1.add_api_route("/songs/{job_id}/takes/{take}/audio", take_audio, methods=[method],
                         summary="One take's song (FLAC)", responses=audio_answers,
                         operation_id=f"take_audio_{method.lower()}")

    @v1.get("/songs/{job_id}/takes/{take}/score", summary="One take's ABC score", responses={
        200: _media("text/vnd.abc", "the score as planned"), **files})
    def take_score(job_id: str, take: int = take_number):
        return score(service.take_job(job_id, take))

    @v1.get("/songs/{job_id}/takes/{take}/result", summary="One take's result.json", responses={
        200: _media("application/json", "the take's result.json", {"type": "object"}), **files})
    def take_result(request: Request, job_id: str, take: int = take_number):
        return result(request, service.take_job(job_id, take))

    @v1.get("/songs/{job_id}/events", summary="Server-Sent Events of a job", responses={
        200: {"description": "status (the whole job, first), then state, tokens, stage, score, nar, vae, retry, "
                             "and complete, failed or cancelled; each data is one line of JSON",
              "content": {"text/event-stream": {"itemSchema": SSE_EVENT}}},
        **_errors(*denied, 404), 503: {"model": contract.ErrorBody, "description": "too many event streams open",
                                       "headers": RETRY_AFTER}})
    async def events(request: Request, job_id: str):
        if streams["open"] >= max_sse_clients:
            raise Unavailable(f"{streams['open']} event streams are open, the most this server keeps; poll "
                              f"GET {urls(job_id)['self']} or retry later", headers={"Retry-After": "5"})
        loop = asyncio.get_running_loop()
        subscriber, snapshot = await run_in_threadpool(service.subscribe, job_id, loop)
        clean = (lambda data: data) if trusted(request) else redact

        def event(kind: str, data, event_id: int | None = None) -> ServerSentEvent:
            return ServerSentEvent(event_json(clean(data)), event=kind,
                                   id=str(event_id) if event_id is not None else None)

        async def stream():
            streams["open"] += 1
            try:
                yield ServerSentEvent(retry=2000, event="status", data=event_json(clean(snapshot)))
                if snapshot["status"] in FINAL_STATES:
                    yield event(snapshot["status"], {"status": snapshot["status"], "error": snapshot["error"],
                                                     "result": snapshot["result"], "urls": snapshot["urls"]})
                    return
                while True:
                    kind, data, event_id = await subscriber.queue.get()
                    if kind == "resync":  # this client fell behind: the current state instead of the backlog
                        try:
                            kind, data = "status", await run_in_threadpool(service.document, job_id)
                        except ServiceError:  # deleted meanwhile: nothing more to say
                            return
                    yield event(kind, data, event_id)
                    if kind in FINAL_STATES:
                        return
            finally:
                streams["open"] -= 1
                service.hub.unsubscribe(subscriber)

        return EventSourceResponse(stream(), ping=HEARTBEAT_SECONDS, sep="\n",
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    app.include_router(v1)
    app.include_router(signed)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(contract.song_body_schemas(reproducible=reproducible,
                                                      max_takes=service.config.max_takes))
            for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 shape is not ours
                schemas.pop(name, None)
            for operations in schema["paths"].values():
                for operation in operations.values():
                    invalid = operation.get("responses", {}).get("422")
                    if invalid and "HTTPValidationError" in json.dumps(invalid):
                        operation["responses"]["422"] = {
                            "description": "a parameter or header is invalid (named)",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app
