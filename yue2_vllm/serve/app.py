"""The HTTP API and the web page: a FastAPI app over one `SongService`, made of the routers in `serve.routes` (one
per resource: the page, health, songs, files, takes, events, adapters, scores, transcriptions and covers, and
OpenAI's speech).

Every error is `{"error": {"status", "message", "field"}}` (documented for every status in /openapi.json);
with an API key, every /v1 path and /metrics need `Authorization: Bearer KEY` (/health and the page stay open).
Safe by default: the Host must be a loopback name, an IP address or an `allowed_hosts` name (no DNS rebinding);
an unsafe method from a browser page of another origin is refused (403), a POST body must be JSON (415; an upload
to the transcription routes multipart/form-data), and a
caller without the key (everyone, when there is none) never sees a server path or a trace.
"""
from __future__ import annotations

import json
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.openapi.utils import get_openapi

from .. import __version__
from . import contract
from .contract import error_docs
from .routes.adapters import adapters_router
from .routes.common import Api, add_error_handlers
from .routes.events import events_router
from .routes.files import OpenFileResponse, files_router, signed_audio_router  # noqa: F401 (OpenFileResponse)
from .routes.health import health_router
from .routes.page import page_router
from .routes.scores import scores_router
from .routes.length import length_router
from .routes.songs import JobIntake, songs_router
from .routes.speech import speech_router
from .routes.takes import takes_router
from .routes.transcriptions import transcriptions_router
from .safety import Guard, ResponseCounter, host_allowed, redact, redact_text  # noqa: F401 (re-exported)
from .service import SongService
from .transcribing import QUEUE, WORKERS, TranscriptionPool

MAX_BODY_BYTES = 256 * 1024
MAX_UPLOAD_MB = 40  # the multipart routes' bodies (--max-upload-mb; 1 MB = 10**6 bytes)
MAX_SSE_CLIENTS = 256


def create_app(service: SongService, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               allowed_hosts: tuple[str, ...] = (), max_sse_clients: int = MAX_SSE_CLIENTS,
               max_upload_bytes: int = MAX_UPLOAD_MB * 10**6, transcription_workers: int = WORKERS,
               transcription_queue: int = QUEUE, sheetsage_device: str | None = None) -> FastAPI:
    """The app; `max_upload_bytes` bounds the multipart routes' bodies (the audio of a transcription or a cover), the
    JSON routes keep `max_body_bytes`; transcriptions run `transcription_workers` at once with
    `transcription_queue` more waiting, SheetSage2 where `sheetsage_device` says (serve/transcribing.py)."""
    pool = TranscriptionPool(transcription_workers, transcription_queue, sheetsage_device)

    @asynccontextmanager
    async def lifespan(app):
        await run_in_threadpool(service.start)
        try:
            yield
        finally:
            try:
                await run_in_threadpool(pool.close)
            finally:  # the songs go back to the queue as a shutdown whatever the pool did
                await run_in_threadpool(service.close)

    app = FastAPI(title="yue2-vllm", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Songs from YuE2 over HTTP: durable jobs with live progress (Server-Sent Events).",
                  responses=error_docs(400))
    app.add_middleware(ResponseCounter, counter=service.http_responses)
    app.add_middleware(Guard, allowed_hosts=tuple(allowed_hosts))
    api = Api(service, api_key)
    add_error_handlers(app, api)
    # In this order, the order of /openapi.json's paths: the signed audio route (which checks the key itself) last.
    intake = JobIntake(max_body_bytes)  # both routes that queue a job: one Idempotency-Key in flight at a time
    for router in (page_router(), health_router(api), songs_router(api, intake), length_router(api, intake),
                   files_router(api), takes_router(api), events_router(api, max_sse_clients), adapters_router(api),
                   scores_router(api, max_body_bytes), transcriptions_router(api, intake, pool, max_upload_bytes),
                   speech_router(api, max_body_bytes), signed_audio_router(api)):
        app.include_router(router)
    app.openapi = lambda: openapi_document(app, reproducible=bool(service.rules.reproducible),
                                           max_takes=service.config.max_takes,
                                           adapters=tuple(getattr(service.rules, "adapters", {})))
    return app


def openapi_document(app: FastAPI, *, reproducible: bool, max_takes: int, adapters: tuple = ()) -> dict:
    """/openapi.json, made once: FastAPI's document with our POST body schemas (contract.py) and our 422 shape."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(contract.song_body_schemas(reproducible=reproducible, max_takes=max_takes, adapters=adapters))
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
