"""A job's takes (take 1 is the job itself): one take's record, DELETE (2 or later), keep, and its files."""
from __future__ import annotations

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response

from ...takes import MAX_TAKES
from .. import contract
from ..contract import error_docs, media_doc
from .common import Api
from .files import audio_answers, audio_file, file_answers, result_of, score_midi_answers, score_midi_of, score_of
from .songs import song_answers


def takes_router(api: Api) -> APIRouter:
    router, service, denied = APIRouter(prefix="/v1", dependencies=api.auth), api.service, api.denied
    files = file_answers(api)
    take_number = Path(..., ge=1, le=MAX_TAKES, description="the take, 1 (the job itself) to the job's takes")

    @router.get("/songs/{job_id}/takes/{take}", summary="One take of a job (its own job record)",
                responses=song_answers(api))
    def get_take(request: Request, job_id: str, take: int = take_number):
        return api.answer(request, service.document(service.take_job(job_id, take)))

    @router.delete("/songs/{job_id}/takes/{take}", status_code=204, summary="Delete one take (2 or later; take 1 is "
                   "the job: DELETE the job)", responses={
        204: {"description": "the take's files and row are gone"},
        202: {"model": contract.Song, "description": "the take, asked to stop: gone for every client already, its "
                                                     "files and row once it stopped"},
        **error_docs(*denied, 403, 404, 409, s409="take 1 is the job itself")})
    def delete_take(request: Request, job_id: str, take: int = take_number):
        stopping = service.delete_take(job_id, take)
        return Response(status_code=204) if stopping is None else api.answer(request, stopping, 202)

    @router.post("/songs/{job_id}/takes/{take}/keep", summary="Mark the take kept (recorded on the job)", responses={
        200: {"model": contract.Song, "description": "the job, with takes.kept"},
        **error_docs(*denied, 403, 404, 409, s409="the job has no takes")})
    def keep_take(request: Request, job_id: str, take: int = take_number):
        return api.answer(request, service.describe(service.keep_take(job_id, take)))

    def take_audio(job_id: str, take: int = take_number):
        return audio_file(service, service.take_job(job_id, take))  # under the key (v1), as every take route

    for method in ("GET", "HEAD"):
        router.add_api_route("/songs/{job_id}/takes/{take}/audio", take_audio, methods=[method],
                             summary="One take's song (FLAC)", responses=audio_answers(api),
                             operation_id=f"take_audio_{method.lower()}")

    @router.get("/songs/{job_id}/takes/{take}/score", summary="One take's ABC score", responses={
        200: media_doc("text/vnd.abc", "the score as planned"), **files})
    def take_score(job_id: str, take: int = take_number):
        return score_of(service, service.take_job(job_id, take))

    @router.get("/songs/{job_id}/takes/{take}/score.mid", summary="One take's score as MIDI",
                responses=score_midi_answers(api))
    def take_score_midi(job_id: str, take: int = take_number):
        return score_midi_of(service, service.take_job(job_id, take))

    @router.get("/songs/{job_id}/takes/{take}/result", summary="One take's result.json", responses={
        200: media_doc("application/json", "the take's result.json", {"type": "object"}), **files})
    def take_result(request: Request, job_id: str, take: int = take_number):
        return result_of(api, request, service.take_job(job_id, take))

    return router
