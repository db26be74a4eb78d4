"""A job: POST /v1/songs (queue a song; Idempotency-Key), the list, one job, DELETE, cancel, resume and render."""
from __future__ import annotations

import contextlib

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from .. import contract
from ..contract import LOCATION, RETRY_AFTER, error_docs
from ..errors import Conflict, RequestInvalid, ServiceError
from ..safety import error_response, is_json, read_body
from ..service import urls
from .common import Api

_STATUS = "(?:" + "|".join(contract.STATUSES) + ")"
STATUS_LIST = f"^,*(?:{_STATUS}(?:,+{_STATUS})*)?,*$"  # statuses, comma-separated (empty pieces ignored)


def song_answers(api: Api) -> dict:
    """A job record, or 404 (a job, or a take of one)."""
    return {200: {"model": contract.Song}, **error_docs(*api.denied, 404)}


def body_doc(schema: str) -> dict:
    """`openapi_extra` for a JSON request body of the named components schema (contract.py)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{schema}"}}}}}


def job_answers(api: Api, s422: str) -> dict:
    """What a request that queues a job answers: 202 (or 200, an Idempotency-Key's job), and every refusal."""
    return {
        202: {"model": contract.SongCreated, "description": "queued", "headers": LOCATION},
        200: {"model": contract.SongCreated, "description": "the job an earlier request with this Idempotency-Key "
                                                            "made (the same body)", "headers": LOCATION},
        **error_docs(*api.denied, 403, 413, 415, 422, s422=s422),
        409: {"model": contract.ErrorBody, "description": "a request with this Idempotency-Key is still being "
                                                          "processed", "headers": RETRY_AFTER},
        429: {"model": contract.ErrorBody, "description": "the queue is full", "headers": RETRY_AFTER},
        503: {"model": contract.ErrorBody, "description": "the engine is down for good", "headers": RETRY_AFTER},
        507: {"model": contract.ErrorBody, "description": "the free disk cannot hold what the song may write beside "
                                                          "the admitted songs", "headers": RETRY_AFTER}}


class JobIntake:
    """Bodies that queue a job (POST /v1/songs, POST /v1/songs/{id}/continue): JSON only, within the size limit,
    one request per Idempotency-Key at a time; the job as 202 (or 200: the key's earlier job)."""

    def __init__(self, max_body_bytes: int):
        self.max_body_bytes = max_body_bytes
        self.in_flight_keys: set[str] = set()

    async def accept(self, request: Request, idempotency_key: str | None, queue) -> Response:
        """`queue(body, key)` -> `(record, created)` runs in a worker thread."""
        if not is_json(request.headers.get("content-type")):
            return error_response(415, "body: send it as Content-Type: application/json", "Content-Type")
        with self.claimed(idempotency_key):
            return await self.queued(await read_body(request, self.max_body_bytes), idempotency_key, queue)

    @contextlib.contextmanager
    def claimed(self, idempotency_key: str | None):
        """The key held by one request while the block runs (from before its body is read): 409 with Retry-After
        while another request holds it; given back however the block ends."""
        if idempotency_key is None:
            yield
            return
        if idempotency_key in self.in_flight_keys:
            raise Conflict("Idempotency-Key: a request with this key is still being processed; retry in a moment",
                           field="Idempotency-Key", headers={"Retry-After": "1"})
        self.in_flight_keys.add(idempotency_key)
        try:
            yield
        finally:
            self.in_flight_keys.discard(idempotency_key)

    async def queued(self, body: bytes, idempotency_key: str | None, queue, *, extra: dict | None = None,
                     on_queued=None) -> Response:
        """`body` queued by `queue(body, key)` -> `(record, created)` in a worker thread, then `on_queued(record,
        created)` there too; the job's answer (with `extra` in it). The caller holds the key (`claimed`)."""

        def run():
            record, created = queue(body, idempotency_key)
            if on_queued is not None:
                on_queued(record, created)
            return record, created

        try:
            record, created = await run_in_threadpool(run)
        except ServiceError as exc:
            if exc.status == 409 and exc.field == "Idempotency-Key":  # reused with another body: IETF draft → 422
                raise RequestInvalid(exc.message, field=exc.field) from None
            raise
        document = {"id": record.id, "label": record.label, "status": record.status, "stage": record.stage,
                    "created": created, "urls": urls(record.id), **(extra or {})}
        return JSONResponse(document, status_code=202 if created else 200,
                            headers={"Location": document["urls"]["self"]})


IDEMPOTENCY_HEADER = dict(pattern=contract.IDEMPOTENCY_KEY, max_length=255,
                          description="the same key and body again → the same job (200); another body → 422")


def songs_router(api: Api, intake: JobIntake) -> APIRouter:
    router, service, denied = APIRouter(prefix="/v1", dependencies=api.auth), api.service, api.denied

    @router.post("/songs", status_code=202, summary="Queue a song", openapi_extra=body_doc("SongBody"),
                 responses=job_answers(api, "a field is invalid (named), or the Idempotency-Key was used with another "
                                            "body (the IETF Idempotency-Key draft's answer)"))
    async def create_song(request: Request, idempotency_key: str | None = Header(None, **IDEMPOTENCY_HEADER)):
        return await intake.accept(request, idempotency_key, service.submit)

    @router.get("/songs", summary="Jobs, newest first", responses={200: {"model": contract.SongList},
                                                                   **error_docs(*denied, 422)})
    def list_songs(request: Request,
                   status: str | None = Query(None, description="statuses, comma-separated", examples=["complete"],
                                              pattern=STATUS_LIST),
                   limit: int = Query(50, ge=1, le=200), cursor: str | None = Query(None, pattern=r"^\d{0,18}$")):
        statuses = tuple(s for s in (status or "").split(",") if s)
        return api.answer(request, service.list(statuses, limit, cursor))

    @router.get("/songs/{job_id}", summary="A job", responses=song_answers(api))
    def get_song(request: Request, job_id: str):
        return api.answer(request, service.document(job_id))

    @router.delete("/songs/{job_id}", status_code=204, summary="Delete a job: it is gone at once, its files and row "
                   "once it stopped", responses={
        204: {"description": "the job's files and row are gone (nothing of it was running)"},
        202: {"model": contract.Song, "description": "the job, asked to stop: it is gone for every client already "
                                                     "(each GET answers 404); its run stops at the next token, ODE "
                                                     "step or tile, then its files and row are removed"},
        **error_docs(*denied, 403, 404)})
    def delete_song(request: Request, job_id: str):
        stopping = service.delete(job_id)
        return Response(status_code=204) if stopping is None else api.answer(request, stopping, 202)

    @router.post("/songs/{job_id}/cancel", summary="Cancel a job (it stays, resumable)", responses={
        202: {"model": contract.Song, "description": "asked to stop at the next token, ODE step or tile"},
        200: {"model": contract.Song, "description": "cancelled at once (it was queued), or it had ended already: "
                                                     "the job as it is"},
        **error_docs(*denied, 403, 404)})
    def cancel_song(request: Request, job_id: str):
        record, asked = service.cancel(job_id)
        return api.answer(request, service.describe(record), 202 if asked and not record.final else 200)

    requeue = {202: {"model": contract.Song, "description": "queued again"},
               **error_docs(*denied, 403, 404, 409), 429: {"model": contract.ErrorBody, "description": "the queue is "
                                                                                      "full", "headers": RETRY_AFTER},
               507: {"model": contract.ErrorBody, "description": "the free disk cannot hold what the song may still "
                                                                 "write", "headers": RETRY_AFTER}}

    @router.post("/songs/{job_id}/resume", status_code=202, summary="Resume a failed or cancelled job",
                 responses=requeue)
    def resume_song(request: Request, job_id: str):
        return api.answer(request, service.describe(service.requeue(job_id, render=False)), 202)

    @router.post("/songs/{job_id}/render", status_code=202, summary="Render a planned job's audio", responses=requeue)
    def render_song(request: Request, job_id: str):
        return api.answer(request, service.describe(service.requeue(job_id, render=True)), 202)

    return router
