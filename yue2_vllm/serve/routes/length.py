"""A song's length (docs/length.md): POST /v1/songs/length (the longest song a body can reach, and whether its own
length fits) and POST /v1/songs/{id}/continue (a capped song continued to the song a longer cap makes: a new job)."""
from __future__ import annotations

from fastapi import APIRouter, Header, Request
from fastapi.concurrency import run_in_threadpool

from .. import contract
from ..contract import error_docs
from ..safety import error_response, is_json, read_body
from .common import Api
from .songs import IDEMPOTENCY_HEADER, JobIntake, body_doc, job_answers


def length_router(api: Api, intake: JobIntake) -> APIRouter:
    router, service = APIRouter(prefix="/v1", dependencies=api.auth), api.service

    @router.post("/songs/length", summary="The longest song a body can reach, and whether its own length fits",
                 openapi_extra=body_doc("SongBody"), responses={
                     200: {"model": contract.SongLength, "description": "the longest song the body's prompt and score "
                           "budget leave room for in the context, the song it asks for, and whether that fits (if "
                           "not, `problem` is the line POST /v1/songs would refuse it with)"},
                     **error_docs(*api.denied, 403, 413, 415, 422, s422="a field is invalid (named), as POST "
                                                                        "/v1/songs would refuse it")})
    async def song_length(request: Request):
        if not is_json(request.headers.get("content-type")):
            return error_response(415, "body: send it as Content-Type: application/json", "Content-Type")
        body = await read_body(request, intake.max_body_bytes)
        return api.answer(request, await run_in_threadpool(service.song_length, body))

    @router.post("/songs/{job_id}/continue", status_code=202, summary="Continue a capped song to a longer length "
                 "(a new job: the song its request with that length makes)", openapi_extra=body_doc("ContinueBody"),
                 responses={**job_answers(api, "the song cannot continue (not finished, it ended by itself, another "
                                               "model: field job_id) or the length cannot be its (field seconds: not "
                                               "longer than the song, or past the context), named in one line"),
                            **error_docs(*api.denied, 404, s404="no such song, or no such take of it")})
    async def continue_song(request: Request, job_id: str,
                            idempotency_key: str | None = Header(None, **IDEMPOTENCY_HEADER)):
        return await intake.accept(request, idempotency_key,
                                   lambda body, key: service.continue_song(job_id, body, key))

    return router
