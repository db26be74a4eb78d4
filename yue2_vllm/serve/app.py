"""The HTTP API and the web page: a FastAPI app over one `SongService`.

Every error is `{"error": {"status", "message", "field"}}`; with an API key, every /v1 path and
/metrics need `Authorization: Bearer KEY` (/health and the page stay open).
"""
from __future__ import annotations

import asyncio
import hmac
import json
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from .metrics import CONTENT_TYPE
from .errors import ServiceError, TooLarge, Unauthorized
from .service import FINAL_STATES, SongService, urls

MAX_BODY_BYTES = 256 * 1024
HEARTBEAT_SECONDS = 15.0
STATIC = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
# The page loads nothing from elsewhere; audio may come from a blob: URL (fetched with the API key).
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; media-src 'self' blob:; img-src 'self' data:; "
                                           "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def error_response(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"status": status, "message": message, "field": field}}, status_code=status,
                        headers=headers)


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


def sse(kind: str, data, event_id: int | None = None) -> str:
    lines = [f"event: {kind}"] + ([f"id: {event_id}"] if event_id is not None else [])
    lines += [f"data: {line}" for line in json.dumps(data, ensure_ascii=False).splitlines()]
    return "\n".join(lines) + "\n\n"


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


def create_app(service: SongService, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        await run_in_threadpool(service.start)
        try:
            yield
        finally:
            await run_in_threadpool(service.close)

    app = FastAPI(title="yue2-vllm", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(ResponseCounter, counter=service.http_responses)

    @app.exception_handler(ServiceError)
    async def service_error(request, exc: ServiceError):
        return error_response(exc.status, exc.message, exc.field, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        field = str(first.get("loc", ["", ""])[-1]) or None
        return error_response(422, f"{field}: {first.get('msg', 'invalid')}", field)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    def authorized(authorization: str | None = Header(None)) -> None:
        if api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise Unauthorized("missing or wrong API key: send 'Authorization: Bearer KEY'",
                               headers={"WWW-Authenticate": 'Bearer realm="yue2-vllm"'})

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

    @app.get("/health")
    def health():
        document, ok = service.health()
        return JSONResponse(document, status_code=200 if ok else 503, headers=None if ok else {"Retry-After": "5"})

    @app.get("/metrics", dependencies=[Depends(authorized)])
    def metrics():
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    # -- /v1

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @v1.post("/songs", status_code=202)
    async def create_song(request: Request, idempotency_key: str | None = Header(None)):
        body = await read_body(request, max_body_bytes)
        record, created = await run_in_threadpool(service.submit, body, idempotency_key)
        document = {"id": record.id, "label": record.label, "status": record.status, "stage": record.stage,
                    "created": created, "urls": urls(record.id)}
        return JSONResponse(document, status_code=202 if created else 200,
                            headers={"Location": document["urls"]["self"]})

    @v1.get("/songs")
    def list_songs(status: str | None = None, limit: int = Query(50, ge=1, le=200), cursor: str | None = None):
        statuses = tuple(s for s in (status or "").split(",") if s)
        return service.list(statuses, limit, cursor)

    @v1.get("/songs/{job_id}")
    def get_song(job_id: str):
        return service.document(job_id)

    @v1.delete("/songs/{job_id}")
    def cancel_song(job_id: str):
        record, asked = service.cancel(job_id)
        return JSONResponse(service.describe(record), status_code=202 if asked and not record.final else 200)

    @v1.post("/songs/{job_id}/resume", status_code=202)
    def resume_song(job_id: str):
        return service.describe(service.requeue(job_id, render=False))

    @v1.post("/songs/{job_id}/render", status_code=202)
    def render_song(job_id: str):
        return service.describe(service.requeue(job_id, render=True))

    @v1.api_route("/songs/{job_id}/audio", methods=["GET", "HEAD"])
    def audio(job_id: str):
        path = service.file(job_id, "audio.flac")
        label = service.get_record(job_id).label or job_id
        return FileResponse(path, media_type="audio/flac", filename=f"{label}.flac", content_disposition_type="inline")

    @v1.get("/songs/{job_id}/score")
    def score(job_id: str):
        path = service.file(job_id, "score.abc")
        return Response(path.read_bytes(), media_type="text/vnd.abc; charset=utf-8")

    @v1.get("/songs/{job_id}/result")
    def result(job_id: str):
        return Response(service.file(job_id, "result.json").read_bytes(), media_type="application/json")

    @v1.get("/songs/{job_id}/events")
    async def events(job_id: str):
        loop = asyncio.get_running_loop()
        subscriber, snapshot = await run_in_threadpool(service.subscribe, job_id, loop)

        async def stream():
            try:
                yield "retry: 2000\n\n" + sse("status", snapshot)
                if snapshot["status"] in FINAL_STATES:
                    yield sse(snapshot["status"], {"status": snapshot["status"], "error": snapshot["error"],
                                                   "result": snapshot["result"], "urls": snapshot["urls"]})
                    return
                while True:
                    try:
                        kind, data, event_id = await asyncio.wait_for(subscriber.queue.get(), HEARTBEAT_SECONDS)
                    except asyncio.TimeoutError:
                        yield ": keep-alive\n\n"
                        continue
                    if kind == "resync":  # this client fell behind: the current state instead of the backlog
                        kind, data = "status", await run_in_threadpool(service.document, job_id)
                    yield sse(kind, data, event_id)
                    if kind in FINAL_STATES:
                        return
            finally:
                service.hub.unsubscribe(subscriber)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    app.include_router(v1)
    return app
