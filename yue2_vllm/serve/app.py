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
import json
import os
import time
from contextlib import asynccontextmanager
from importlib import resources

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
from .contract import LOCATION, RETRY_AFTER, SSE_EVENT, error_docs, media_doc
from .errors import Conflict, RequestInvalid, ServiceError, Unauthorized, Unavailable
from .events import event_json
from .metrics import CONTENT_TYPE
from ..takes import MAX_TAKES
from .safety import (Guard, ResponseCounter, error_response, host_allowed, is_json, read_body,  # noqa: F401
                     redact, redact_text)  # (host_allowed, redact_text: re-exported)
from .service import FINAL_STATES, SongService, urls
from .signed import AUDIO_URL_SECONDS, SIGNATURE_PATTERN, signature_problem, signed_audio_query, signing_key

MAX_BODY_BYTES = 256 * 1024
HEARTBEAT_SECONDS = 15.0
MAX_SSE_CLIENTS = 256
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
_STATUS = "(?:" + "|".join(contract.STATUSES) + ")"
STATUS_LIST = f"^,*(?:{_STATUS}(?:,+{_STATUS})*)?,*$"  # statuses, comma-separated (empty pieces ignored)


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
                  responses=error_docs(400))
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
             responses={200: media_doc(CONTENT_TYPE.split(";")[0], "Prometheus text exposition (0.0.4)"),
                        **error_docs(*denied)})
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
        **error_docs(*denied, 403, 413, 415, 422, s422="a field is invalid (named), or the Idempotency-Key was used "
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
                                                               **error_docs(*denied, 422)})
    def list_songs(request: Request,
                   status: str | None = Query(None, description="statuses, comma-separated", examples=["complete"],
                                              pattern=STATUS_LIST),
                   limit: int = Query(50, ge=1, le=200), cursor: str | None = Query(None, pattern=r"^\d{0,18}$")):
        statuses = tuple(s for s in (status or "").split(",") if s)
        return answer(request, service.list(statuses, limit, cursor))

    song = {200: {"model": contract.Song}, **error_docs(*denied, 404)}

    @v1.get("/songs/{job_id}", summary="A job", responses=song)
    def get_song(request: Request, job_id: str):
        return answer(request, service.document(job_id))

    @v1.delete("/songs/{job_id}", status_code=204, summary="Delete a job: it is gone at once, its files and row "
               "once it stopped", responses={
        204: {"description": "the job's files and row are gone (nothing of it was running)"},
        202: {"model": contract.Song, "description": "the job, asked to stop: it is gone for every client already "
                                                     "(each GET answers 404); its run stops at the next token, ODE "
                                                     "step or tile, then its files and row are removed"},
        **error_docs(*denied, 403, 404)})
    def delete_song(request: Request, job_id: str):
        stopping = service.delete(job_id)
        return Response(status_code=204) if stopping is None else answer(request, stopping, 202)

    @v1.post("/songs/{job_id}/cancel", summary="Cancel a job (it stays, resumable)", responses={
        202: {"model": contract.Song, "description": "asked to stop at the next token, ODE step or tile"},
        200: {"model": contract.Song, "description": "cancelled at once (it was queued), or it had ended already: "
                                                     "the job as it is"},
        **error_docs(*denied, 403, 404)})
    def cancel_song(request: Request, job_id: str):
        record, asked = service.cancel(job_id)
        return answer(request, service.describe(record), 202 if asked and not record.final else 200)

    requeue = {202: {"model": contract.Song, "description": "queued again"},
               **error_docs(*denied, 403, 404, 409), 429: {"model": contract.ErrorBody, "description": "the queue is "
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

    files = error_docs(*denied, 404, 409, s409="not ready yet")

    audio_answers = {200: media_doc("audio/flac", "the FLAC", {"type": "string", "format": "binary"}),
                     206: media_doc("audio/flac", "a Range of it", {"type": "string", "format": "binary"}),
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
        200: media_doc("text/vnd.abc", "the score as planned"), **files})
    def score(job_id: str):
        with opened(job_id, "score.abc") as file:
            return Response(file.read(), media_type="text/vnd.abc; charset=utf-8")

    @v1.get("/songs/{job_id}/result", summary="result.json", responses={
        200: media_doc("application/json", "the run's result.json", {"type": "object"}), **files})
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
        **error_docs(*denied, 403, 404, 409, s409="take 1 is the job itself")})
    def delete_take(request: Request, job_id: str, take: int = take_number):
        stopping = service.delete_take(job_id, take)
        return Response(status_code=204) if stopping is None else answer(request, stopping, 202)

    @v1.post("/songs/{job_id}/takes/{take}/keep", summary="Mark the take kept (recorded on the job)", responses={
        200: {"model": contract.Song, "description": "the job, with takes.kept"},
        **error_docs(*denied, 403, 404, 409, s409="the job has no takes")})
    def keep_take(request: Request, job_id: str, take: int = take_number):
        return answer(request, service.describe(service.keep_take(job_id, take)))

    def take_audio(job_id: str, take: int = take_number):
        return audio_file(service.take_job(job_id, take))  # under the key (v1), as every take route

    for method in ("GET", "HEAD"):
        v1.add_api_route("/songs/{job_id}/takes/{take}/audio", take_audio, methods=[method],
                         summary="One take's song (FLAC)", responses=audio_answers,
                         operation_id=f"take_audio_{method.lower()}")

    @v1.get("/songs/{job_id}/takes/{take}/score", summary="One take's ABC score", responses={
        200: media_doc("text/vnd.abc", "the score as planned"), **files})
    def take_score(job_id: str, take: int = take_number):
        return score(service.take_job(job_id, take))

    @v1.get("/songs/{job_id}/takes/{take}/result", summary="One take's result.json", responses={
        200: media_doc("application/json", "the take's result.json", {"type": "object"}), **files})
    def take_result(request: Request, job_id: str, take: int = take_number):
        return result(request, service.take_job(job_id, take))

    @v1.get("/songs/{job_id}/events", summary="Server-Sent Events of a job", responses={
        200: {"description": "status (the whole job, first), then state, tokens, stage, score, nar, vae, retry, "
                             "and complete, failed or cancelled; each data is one line of JSON",
              "content": {"text/event-stream": {"itemSchema": SSE_EVENT}}},
        **error_docs(*denied, 404), 503: {"model": contract.ErrorBody, "description": "too many event streams open",
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
