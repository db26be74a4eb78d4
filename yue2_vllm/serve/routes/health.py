"""/health (open: the engine, the queue, the disk; 503 with each problem) and /metrics (Prometheus, under the key)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .. import contract
from ..contract import RETRY_AFTER, error_docs, media_doc
from ..metrics import CONTENT_TYPE
from ..safety import redact_text
from .common import Api


def health_router(api: Api) -> APIRouter:
    router, service = APIRouter(), api.service

    @router.get("/health", summary="Engine state, queue depth, songs in flight",
                responses={200: {"model": contract.Health},
                           503: {"model": contract.Health, "description": "not ok, each reason in `problems`: the "
                                 "engine is starting, restarting or down; the data dir cannot be written or is under "
                                 "--min-free-disk, or the job store cannot be written (`disk` says which, with the "
                                 "free bytes); queued work makes no progress", "headers": RETRY_AFTER}})
    def health(request: Request):
        document, ok = service.health()
        document = {**document, "api_key_required": api.guarded}
        return api.answer(request, document, 200 if ok else 503, None if ok else {"Retry-After": "5"})

    @router.get("/metrics", dependencies=api.auth, summary="Prometheus metrics",
                responses={200: media_doc(CONTENT_TYPE.split(";")[0], "Prometheus text exposition (0.0.4)"),
                           **error_docs(*api.denied)})
    def metrics(request: Request):
        text = service.metrics.render()
        return Response(text if api.trusted(request) else redact_text(text), media_type=CONTENT_TYPE)

    return router
