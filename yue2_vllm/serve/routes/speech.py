"""OpenAI's `POST /v1/audio/speech`, for its clients: `input` the lyrics, `instructions` the style, `model` the base
model (`yue2`) or a registered adapter's name (as vLLM's servers name adapters), `response_format` flac or wav.

A speech request is an ordinary job (queued, durable, listed, its files kept as any song's) that this call waits
for, then answers with its audio; a song not made within `--speech-timeout` is a 504 naming the job, which goes
on. The call waits on the event loop for the job's final event (`SongService.subscribe_final`), holding no worker
thread; at most `--max-waiting-calls` wait at once (the next is a 503 saying so), and when the server stops each
answers 503 naming its job, which resumes at the next start. `voice` is accepted whatever it says (OpenAI's SDKs require one): YuE2's voice comes from the style, so it is
recorded as the job's label only. `speed` other than 1 and formats other than flac and wav are refused (422 naming
the field); an unknown `model` is a 404 naming it, as OpenAI's and vLLM's servers answer.
"""
from __future__ import annotations

import asyncio
import io
import json
import re
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from ..contract import NON_BLANK, RETRY_AFTER, ErrorBody, error_docs
from ..errors import NotFound, RequestInvalid, ServiceError, Unavailable
from ...request_json import UsageError, parse_json
from ..events import STOPPING
from ..safety import error_response, is_json, read_body
from ..store import JobRecord
from .adapters import BASE_MODELS, adapter_listing
from .common import Api

FORMATS = {"flac": "audio/flac", "wav": "audio/wav"}
STOPPED_RETRY_SECONDS = 5  # a stopped server's next start answers 503 (Retry-After 5) until it serves


class SpeechTimeout(ServiceError):
    """The song outlived the call's wait (--speech-timeout); it goes on as an ordinary job."""

    status = 504

    def __init__(self, job_id: str, status: str, seconds: float):
        super().__init__(f"the song {job_id} is still {status} after {seconds:g} s (--speech-timeout); it goes on as "
                         f"a job: GET /v1/songs/{job_id}, its audio at /v1/songs/{job_id}/audio",
                         headers={"Location": f"/v1/songs/{job_id}", "X-Song-Id": job_id})


class SpeechStopped(Unavailable):
    """The server stops while the call waits: the song resumes at the next start, as a job."""

    def __init__(self, job_id: str):
        super().__init__(f"the server stopped before the song {job_id} was made; it resumes when the server starts "
                         f"again: GET /v1/songs/{job_id}, its audio at /v1/songs/{job_id}/audio",
                         headers={"Location": f"/v1/songs/{job_id}", "X-Song-Id": job_id,
                                  "Retry-After": str(STOPPED_RETRY_SECONDS)})


class SpeechBody(BaseModel):
    """OpenAI's speech request as its SDKs send it."""

    model_config = ConfigDict(extra="forbid", title="SpeechBody")
    model: str = Field(..., description="the base model (yue2) or a registered adapter's name")
    input: str = Field(..., pattern=NON_BLANK, description="the lyrics, with [verse]/[chorus] sections")
    instructions: str = Field(..., pattern=NON_BLANK, description="the style YuE2 is conditioned on (genre, "
                              "instruments, mood, voice)")
    voice: Any = Field(None, description="accepted and not used: YuE2's voice comes from the style (instructions)")
    response_format: Literal["flac", "wav"] = Field("flac", description="the audio's container (48 kHz stereo)")
    speed: float = Field(1.0, ge=1.0, le=1.0, description="only 1: a song's tempo comes from its style")
    stream_format: Literal["audio"] = Field("audio", description="only audio (no SSE stream)")


def speech_body(data) -> SpeechBody:
    """The body checked, each problem a 422 naming its field."""
    if not isinstance(data, dict):
        raise RequestInvalid(f"body: must be a JSON object, got {type(data).__name__}")
    from pydantic import ValidationError

    try:
        body = SpeechBody(**data)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(part) for part in first.get("loc", ())) or None
        words = first.get("msg", "invalid")
        if name == "instructions" and first.get("type") == "missing":
            words = "give the style (genre, instruments, mood, voice) the song is conditioned on"
        raise RequestInvalid(f"{name or 'body'}: {words}", field=name) from None
    return body


def song_of(body: SpeechBody) -> dict:
    """The song a speech request asks for, as a POST /v1/songs body (its `model`, unless the base's, the song's
    adapter: checked with the rest of the song by the submission, `submit_speech`)."""
    song = {"style": body.instructions, "lyrics": body.input}
    if body.model not in BASE_MODELS:
        song["adapters"] = [{"name": body.model}]
    if isinstance(body.voice, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,179}", body.voice):
        song["id"] = body.voice  # kept as the job's label
    return song


def submit_speech(service, song: dict, model: str, adapters: dict):
    """`service.submit` of the song; the submission's refusal of its adapter (the one check of the name) is
    answered as OpenAI's and vLLM's servers answer an unknown model: a 404 naming `model`."""
    try:
        return service.submit(json.dumps(song).encode("utf-8"))
    except RequestInvalid as exc:
        if exc.field != "adapters":
            raise
        raise NotFound(f"model {model!r} does not exist (the base model is {BASE_MODELS[0]!r}; adapters: "
                       f"{', '.join(sorted(adapters)) or 'none'})", field="model") from None


def audio_bytes(path, response_format: str) -> bytes:
    """The song's FLAC as it is, or re-written as 24-bit WAV."""
    if response_format == "flac":
        return path.read_bytes()
    import soundfile

    audio, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    out = io.BytesIO()
    soundfile.write(out, audio, rate, format="WAV", subtype="PCM_24")
    return out.getvalue()


def speech_schema(models: list[str]) -> dict:
    """SpeechBody's JSON schema with `model` limited to what this server serves (the base's names, its adapters)."""
    schema = SpeechBody.model_json_schema()
    schema["properties"]["model"] = {**schema["properties"]["model"], "enum": models}
    return schema


def speech_router(api: Api, max_body_bytes: int) -> APIRouter:
    router, service = APIRouter(prefix="/v1", dependencies=api.auth), api.service
    models = [*BASE_MODELS, *sorted(adapter_listing(api))]
    waiting = {"calls": 0}  # calls between their submit and their song's end (no thread each)

    async def finished(job_id: str) -> JobRecord:
        """The job's record once it is final, awaited on the event loop: 504 past --speech-timeout, 503 when the
        server stops first, 404 once the job is deleted."""
        loop, seconds = asyncio.get_running_loop(), service.config.speech_wait_seconds
        deadline = loop.time() + seconds
        subscriber, record = await run_in_threadpool(service.subscribe_final, job_id, loop)
        try:
            while not record.final:  # a final event, then the record: resumed meanwhile, it waits on
                try:
                    kind, _, _ = await asyncio.wait_for(subscriber.queue.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    record = await run_in_threadpool(service.get_record, job_id)
                    if record.final:
                        break
                    raise SpeechTimeout(job_id, record.status, seconds) from None
                if kind == STOPPING:
                    raise SpeechStopped(job_id)
                record = await run_in_threadpool(service.get_record, job_id)
        finally:
            service.hub.unsubscribe(subscriber)
        return record

    @router.post("/audio/speech", summary="OpenAI's speech endpoint: a song from lyrics (input) and style "
                 "(instructions), its audio in the answer", openapi_extra={"requestBody": {"required": True, "content": {
                     "application/json": {"schema": speech_schema(models)}}}},
                 responses={200: {"description": "the song's audio: FLAC, or WAV for response_format wav", "content": {
                     media: {"schema": {"type": "string", "format": "binary"}} for media in FORMATS.values()}},
                            **error_docs(*api.denied, 404, 415, 422,
                                         s404="no such model (the base, yue2, or a registered adapter's name), "
                                              "or the song's job was deleted while the call waits"),
                            429: {"model": ErrorBody, "description": "the queue is full", "headers": RETRY_AFTER},
                            503: {"model": ErrorBody, "description": "--max-waiting-calls calls wait for their songs "
                                  "already, or the engine is down for good, or the server stopped before the song "
                                  "was made (it resumes at the next start, as the job Location names)",
                                  "headers": RETRY_AFTER},
                            500: {"model": ErrorBody, "description": "the song failed (the job's error)"},
                            504: {"model": ErrorBody, "description": "the song was not made within --speech-timeout: "
                                  "it goes on as the job Location names (its audio at /v1/songs/{id}/audio)"}})
    async def speech(request: Request):
        if not is_json(request.headers.get("content-type")):
            return error_response(415, "body: send it as Content-Type: application/json", "Content-Type")
        try:
            data = parse_json((await read_body(request, max_body_bytes)).decode("utf-8", errors="replace"))
        except UsageError as exc:
            raise RequestInvalid(f"body: {exc}") from None
        body = speech_body(data)
        most = service.config.max_waiting_calls
        if waiting["calls"] >= most:
            raise Unavailable(f"{waiting['calls']} speech calls are waiting for their songs, the most this server "
                              f"keeps (--max-waiting-calls {most}); retry later, or POST /v1/songs and follow the "
                              "job", headers={"Retry-After": str(service.retry_after())})
        waiting["calls"] += 1
        try:
            record, _ = await run_in_threadpool(submit_speech, service, song_of(body), body.model,
                                                adapter_listing(api))
            record = await finished(record.id)
        finally:
            waiting["calls"] -= 1
        if record.status != "complete":
            error = (record.error or {}).get("message") or record.status
            raise ServiceError(f"the song {record.id} {record.status}: {error}")
        path = await run_in_threadpool(service.file, record.id, "audio.flac")
        data = await run_in_threadpool(audio_bytes, path, body.response_format)
        return Response(data, media_type=FORMATS[body.response_format],
                        headers={"X-Song-Id": record.id, "Location": f"/v1/songs/{record.id}"})

    return router
