"""GET /v1/songs/{id}/events: a job's Server-Sent Events (its whole state first, then each event, until a final
one, or until the server stops: a client reconnects), at most `max_sse_clients` streams open at once."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from sse_starlette import EventSourceResponse, ServerSentEvent

from .. import contract
from ..contract import RETRY_AFTER, SSE_EVENT, error_docs
from ..errors import ServiceError, Unavailable
from ..events import STOPPING, event_json
from ..safety import redact
from ..service import FINAL_STATES, urls
from .common import Api

HEARTBEAT_SECONDS = 15.0


def events_router(api: Api, max_sse_clients: int) -> APIRouter:
    router, service = APIRouter(prefix="/v1", dependencies=api.auth), api.service
    streams = {"open": 0}

    @router.get("/songs/{job_id}/events", summary="Server-Sent Events of a job", responses={
        200: {"description": "status (the whole job, first), then state, tokens, stage, score, nar, vae, retry, "
                             "and complete, failed or cancelled; each data is one line of JSON",
              "content": {"text/event-stream": {"itemSchema": SSE_EVENT}}},
        **error_docs(*api.denied, 404),
        503: {"model": contract.ErrorBody, "description": "too many event streams open", "headers": RETRY_AFTER}})
    async def events(request: Request, job_id: str):
        if streams["open"] >= max_sse_clients:
            raise Unavailable(f"{streams['open']} event streams are open, the most this server keeps; poll "
                              f"GET {urls(job_id)['self']} or retry later", headers={"Retry-After": "5"})
        loop = asyncio.get_running_loop()
        subscriber, snapshot = await run_in_threadpool(service.subscribe, job_id, loop)
        clean = (lambda data: data) if api.trusted(request) else redact

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
                    if kind == STOPPING:  # the server stops: the client's retry finds it again once it is back
                        return
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

    return router
