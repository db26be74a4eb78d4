"""A song's files: the FLAC (GET/HEAD, Range; with an API key, the key or a signed URL), a short-lived signed URL
for it, its peaks and spectrogram, the ABC score (and it as MIDI) and result.json. The helpers serve a take's files
too."""
from __future__ import annotations

import json
import os
import time
from contextlib import asynccontextmanager

import anyio
from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, Response
from starlette.background import BackgroundTask

from .. import contract
from ..contract import error_docs, media_doc
from ..errors import Conflict, Unauthorized
from ..safety import redact
from ..service import SongService, urls
from ..signed import AUDIO_URL_SECONDS, SIGNATURE_PATTERN, signature_problem, signed_audio_query, signing_key
from .common import BEARER, CHALLENGE, Api
from .scores import MIDI, midi_of, midi_response


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


def file_answers(api: Api) -> dict:
    """A file of a job: 404 (no such job), 409 (not ready yet)."""
    return error_docs(*api.denied, 404, 409, s409="not ready yet")


def audio_answers(api: Api) -> dict:
    binary = {"type": "string", "format": "binary"}
    return {200: media_doc("audio/flac", "the FLAC", binary), 206: media_doc("audio/flac", "a Range of it", binary),
            416: {"description": "the Range is outside the file"}, **file_answers(api)}


def opened(service: SongService, job_id: str, name: str):
    """A job's ready file, open (404 once the job is deleted, even when that happens meanwhile)."""
    path = service.file(job_id, name)
    try:
        return open(path, "rb")
    except FileNotFoundError:
        service.get_record(job_id)
        raise Conflict(f"{name} is missing from the job's directory") from None


def audio_file(service: SongService, job_id: str) -> OpenFileResponse:
    label = service.get_record(job_id).label or job_id
    return OpenFileResponse(opened(service, job_id, "audio.flac"), media_type="audio/flac", filename=f"{label}.flac",
                            content_disposition_type="inline", headers={"Cache-Control": "private, no-cache"})


def score_of(service: SongService, job_id: str) -> Response:
    with opened(service, job_id, "score.abc") as file:
        return Response(file.read(), media_type="text/vnd.abc; charset=utf-8")


def score_midi_of(service: SongService, job_id: str) -> Response:
    """The song's score as MIDI; 409 naming the score line when the score does not read (the tiny model's do not)."""
    with opened(service, job_id, "score.abc") as file:
        text = file.read().decode("utf-8", errors="replace")
    try:
        data = midi_of(text)
    except ValueError as exc:
        raise Conflict(f"the song's score does not read, so it has no MIDI: {exc}") from None
    return midi_response(data, service.get_record(job_id).label or job_id)


def score_midi_answers(api: Api) -> dict:
    return {200: media_doc(MIDI, "the score as a Standard MIDI File", {"type": "string", "format": "binary"}),
            **error_docs(*api.denied, 404, 409, s409="not ready yet, or the score does not read (the line named)")}


def result_of(api: Api, request: Request, job_id: str) -> Response:
    with opened(api.service, job_id, "result.json") as file:
        data = file.read()
    if api.trusted(request):
        return Response(data, media_type="application/json")
    return api.answer(request, redact(json.loads(data), inside=False))


def files_router(api: Api) -> APIRouter:
    """The files under the key (the audio itself: `signed_audio_router`)."""
    router, service, files = APIRouter(prefix="/v1", dependencies=api.auth), api.service, file_answers(api)
    audio_key = signing_key(api.api_key) if api.guarded else None

    @router.get("/songs/{job_id}/audio-url", summary="A short-lived URL that plays the song without the key",
                response_model=contract.AudioUrl, responses=files)
    def audio_url(job_id: str):
        service.file(job_id, "audio.flac")  # 404 / 409 now, not when the player asks
        path = urls(job_id)["audio"]
        if not api.guarded:
            return {"url": path, "expires": None, "expires_in": None}
        query, expires = signed_audio_query(audio_key, job_id, time.time())
        return {"url": f"{path}?{query}", "expires": expires, "expires_in": AUDIO_URL_SECONDS}

    @router.get("/songs/{job_id}/peaks", summary="The song's peaks and spectrogram, to draw it",
                response_model=contract.Picture, responses=files)
    async def peaks(job_id: str):
        return await run_in_threadpool(service.picture, job_id)

    @router.get("/songs/{job_id}/score", summary="The ABC score", responses={
        200: media_doc("text/vnd.abc", "the score as planned"), **files})
    def score(job_id: str):
        return score_of(service, job_id)

    @router.get("/songs/{job_id}/score.mid", summary="The score as MIDI", responses=score_midi_answers(api))
    def score_midi(job_id: str):
        return score_midi_of(service, job_id)

    @router.get("/songs/{job_id}/result", summary="result.json", responses={
        200: media_doc("application/json", "the run's result.json", {"type": "object"}), **files})
    def result(request: Request, job_id: str):
        return result_of(api, request, job_id)

    return router


def signed_audio_router(api: Api) -> APIRouter:
    """GET/HEAD /v1/songs/{id}/audio: it checks the key itself, since a signed URL stands in for it (the <audio>
    element sends no header)."""
    router, service = APIRouter(prefix="/v1"), api.service
    audio_key = signing_key(api.api_key) if api.guarded else None

    def audio(request: Request, job_id: str, _=Depends(BEARER),
              expires: int | None = Query(None, ge=0, le=2 ** 53, description="a signed URL's expiry (audio-url)"),
              signature: str | None = Query(None, pattern=SIGNATURE_PATTERN, description="a signed URL's signature")):
        if api.guarded and not api.trusted(request):  # the key, or a signed URL the <audio> element can use directly
            problem = signature_problem(audio_key, job_id, expires, signature, time.time())
            if problem is not None:
                raise Unauthorized(problem, headers=CHALLENGE)
        return audio_file(service, job_id)

    for method in ("GET", "HEAD"):
        router.add_api_route("/songs/{job_id}/audio", audio, methods=[method], summary="The song (FLAC)",
                             description="Range requests answer 206. With an API key: the key, or the signed URL "
                                         "of GET /v1/songs/{id}/audio-url.",
                             responses=audio_answers(api), operation_id=f"song_audio_{method.lower()}")
    return router
