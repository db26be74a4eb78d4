"""Scores without a song: POST /v1/scores/check (the reader's verdict on an ABC text, and its music when valid: what
the page draws, plays and validates as you type) and POST /v1/scores/midi (a valid score as a MIDI file). A song's
own score as MIDI is `files`' GET /v1/songs/{id}/score.mid."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from ...midi import midi_file
from ...score_notes import check_score, score_notes
from .. import contract
from ..contract import error_docs, media_doc
from ..errors import RequestInvalid
from ..safety import error_response, is_json, read_body
from ..submission import json_object
from .common import Api

MIDI = "audio/midi"
SCORE_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": contract.ScoreBody.model_json_schema()}}}}


def score_text(data: dict) -> str:
    """The body's `abc` (a 422 naming the field for anything else)."""
    unknown = sorted(set(data) - {"abc"})
    if unknown:
        raise RequestInvalid(f"body: unknown field(s) {unknown}; a score body has only 'abc'", field=unknown[0])
    if "abc" not in data:
        raise RequestInvalid("abc: missing (the score's text)", field="abc")
    if not isinstance(data["abc"], str):
        raise RequestInvalid(f"abc: must be a string, got {type(data['abc']).__name__}", field="abc")
    return data["abc"]


def midi_of(text: str) -> bytes:
    """A score's MIDI file, or the ValueError (the reader's ScoreError naming the line) that stops it."""
    return midi_file(score_notes(text))


def midi_response(data: bytes, name: str) -> Response:
    return Response(data, media_type=MIDI, headers={"Content-Disposition": f'attachment; filename="{name}.mid"'})


def scores_router(api: Api, max_body_bytes: int) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=api.auth)
    refusals = error_docs(*api.denied, 403, 413, 415, 422, s422="the body is not {\"abc\": text} (the field named)")

    async def text_of(request: Request) -> str | Response:
        if not is_json(request.headers.get("content-type")):
            return error_response(415, "body: send it as Content-Type: application/json", "Content-Type")
        return score_text(json_object(await read_body(request, max_body_bytes)))

    @router.post("/scores/check", summary="Check an ABC score with the server's reader (upstream's parser rules)",
                 openapi_extra=SCORE_BODY, responses={
                     200: {"model": contract.ScoreCheck, "description": "valid, with the score's music; or the first "
                           "problem in one line naming the score line"}, **refusals})
    async def check(request: Request):
        text = await text_of(request)
        if isinstance(text, Response):
            return text
        return JSONResponse(await run_in_threadpool(check_score, text))

    @router.post("/scores/midi", summary="A valid ABC score as a Standard MIDI File", openapi_extra=SCORE_BODY,
                 responses={200: media_doc(MIDI, "the score's MIDI file (format 1: a conductor track, Vocal, Ins, "
                                           "and Chords when it has chord symbols)", {"type": "string",
                                                                                   "format": "binary"}),
                            **refusals, 422: {**refusals[422], "description": "the body is not {\"abc\": text}, or "
                                              "the score does not read (its first problem, naming the line)"}})
    async def midi(request: Request):
        text = await text_of(request)
        if isinstance(text, Response):
            return text
        try:
            data = await run_in_threadpool(midi_of, text)
        except ValueError as exc:
            raise RequestInvalid(f"abc: {exc}", field="abc") from None
        return midi_response(data, "score")

    return router
