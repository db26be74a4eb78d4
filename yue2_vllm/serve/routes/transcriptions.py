"""Covers and hums over HTTP (docs/covers.md): POST /v1/transcriptions (a multipart `audio` file and the knobs → the
melody-mode score and its record) and POST /v1/covers (`audio`, the song's `style`, `lyrics`, `seed`, `id` and the
knobs → the melody transcribed, then a song job that renders its score byte for byte with cot melody, answered as
POST /v1/songs answers, with the transcription's record).

Uploads are multipart/form-data of at most --max-upload-mb (413 naming the limit; the JSON routes keep their own
body limit), spooled to temporary files removed after; the audio in any format libsndfile reads. Bad audio (not
audio, too short, silent, no pitched notes, longer than the transcriber's limit) or a bad field is a 422 naming it:
no job is made and nothing is written. The transcription runs in the server's pool (serve/transcribing.py), awaited
on the event loop; SheetSage2 is told the GPU memory free beside the engine. A cover's job is an ordinary song job
(its request carries the transcription's record); its directory keeps the whole record, transcription.json.
"""
from __future__ import annotations

import json

from fastapi import APIRouter, Header, Request
from fastapi.concurrency import run_in_threadpool

from ...cover import cover_request
from ...request_json import MELODY_KNOBS
from .. import contract
from ..contract import LOCATION, RETRY_AFTER, error_docs
from ..errors import RequestInvalid
from ..safety import error_response, is_multipart, read_form
from ..submission import check_idempotency_key, new_job_id, parse_submission
from ..transcribing import TranscriptionPool
from .common import Api
from .songs import IDEMPOTENCY_HEADER, JobIntake

RECORD_FILE = "transcription.json"
# The form's fields besides `audio`, as the multipart parser gives them (text), and what each is read as.
KNOB_TYPES = {"transcriber": str, "bpm": float, "meter": str, "key": str, "voice": str, "pickup_beats": float}
SONG_TYPES = {"style": str, "lyrics": str, "seed": int, "id": str}
STAND_IN_SCORE = "X:1\n"  # a cover's fields are checked with this before minutes go into its transcription


def form_schema(song: bool) -> dict:
    """The multipart body's JSON Schema: the audio file, the transcription's knobs and, for a cover, the song."""
    from ...score import KEYS
    from ...transcription.request import BPM_RANGE, MAX_LYRICS_CHARS

    knobs = {
        "audio": {"type": "string", "format": "binary", "description": "the audio: WAV, FLAC, OGG, MP3, AIFF, ... "
                  "(what libsndfile reads), 1 s up to the transcriber's limit (pyin 360 s, sheetsage2 600 s)"},
        "transcriber": {"type": "string", "enum": ["pyin", "sheetsage2"], "description": "pyin (built in, one "
                        "melodic line; default) or sheetsage2 (full mixes; CC BY-NC 4.0, where it is set up)"},
        "bpm": {"type": "number", "minimum": BPM_RANGE[0], "maximum": BPM_RANGE[1],
                "description": "quarter notes a minute (pyin; default: found from the notes)"},
        "meter": {"type": "string", "pattern": "^[1-9][0-9]?/(2|4|8|16)$", "description": "n/d (pyin; default 4/4)"},
        "key": {"type": "string", "enum": sorted(KEYS), "description": "the K: key (pyin; default: found)"},
        "voice": {"type": "string", "enum": ["vocal", "ins", "both"], "description": "where the melody goes: pyin "
                  "vocal (default) or ins; sheetsage2 both (default), vocal or ins"},
        "pickup_beats": {"type": "number", "minimum": 0, "maximum": 16, "description": "beats before the first "
                         "downbeat, in quarter beats (pyin; default: found)"},
        "lyrics": {"type": "string", "maxLength": MAX_LYRICS_CHARS, "description": "the song's lyrics: their tags "
                   "become the score's section labels, their syllables are counted against the notes"},
    }
    required = ["audio"]
    if song:
        knobs.update({
            "style": {"type": "string", "pattern": contract.NON_BLANK, "description": "the style the cover is "
                      "conditioned on"},
            "lyrics": {**knobs["lyrics"], "pattern": contract.NON_BLANK, "description": "the cover's lyrics (and "
                       "the transcription's: section labels, syllables)"},
            "seed": {"type": "integer", "minimum": 0, "maximum": contract.MAX_SEED - 1},
            "id": {"type": "string", "pattern": contract.SONG_ID, "description": "kept as the job's label"}})
        required += ["style", "lyrics"]
    schema = {"type": "object", "properties": knobs, "required": required, "additionalProperties": False}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {
        "schema": schema, "encoding": {"audio": {"contentType": "application/octet-stream, audio/*"}}}}}}


async def upload(request: Request, types: dict, limit: int) -> tuple[bytes, dict]:
    """`(audio bytes, the fields read as `types`)` of a multipart body; an empty field counts as not given. 413 past
    `limit`, 422 naming a field that is missing, unknown, repeated or not of its type (the parser takes each field
    as a file or twice, so that it is named here), or naming `body` when the parser refuses it."""
    fields = len(types) + 1
    form = await read_form(request, limit, max_files=fields, max_fields=2 * fields)
    try:
        unknown = sorted(set(form.keys()) - set(types) - {"audio"})
        if unknown:
            raise RequestInvalid(f"{unknown[0]}: not a field here (the fields are audio, {', '.join(types)})",
                                 field=unknown[0])
        repeated = [name for name in form.keys() if len(form.getlist(name)) > 1]
        if repeated:
            raise RequestInvalid(f"{repeated[0]}: given more than once", field=repeated[0])
        audio = form.get("audio")
        if audio is None or isinstance(audio, str):
            raise RequestInvalid("audio: missing (the audio as a multipart file part named 'audio')" if audio is None
                                 else "audio: must be a file part, not a text field", field="audio")
        values = {}
        for name, kind in types.items():
            text = form.get(name)
            if text is None or text == "":
                continue
            if not isinstance(text, str):
                raise RequestInvalid(f"{name}: must be a text field, not a file", field=name)
            try:
                values[name] = kind(text)  # a float's nan or inf is refused with the request's other checks
            except ValueError:
                raise RequestInvalid(f"{name}: expected {'an integer' if kind is int else 'a number'}, got "
                                     f"{text[:40]!r}", field=name) from None
        return await audio.read(), values
    finally:
        await form.close()


def transcription_request(values: dict) -> dict:
    """The knobs (and the lyrics) as a TranscriptionRequest's fields, checked here (422 naming the field) before a
    pool worker is asked."""
    from ...transcription import TranscriptionError, TranscriptionRequest

    fields = {name: values[name] for name in (*MELODY_KNOBS, "lyrics") if name in values}
    try:
        return TranscriptionRequest.from_dict(fields).to_dict()
    except TranscriptionError as exc:
        raise RequestInvalid(str(exc), field=exc.field) from None


def gpu_free_bytes(service) -> int | None:
    """The GPU memory free beside the engine, where this process runs the songs on CUDA (else None: SheetSage2 then
    runs on the CPU, or where its settings say)."""
    device = getattr(getattr(service.workers, "pipe", None), "device", None)
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return int(torch.cuda.mem_get_info(device)[0])


def cover_body(transcription, values: dict) -> bytes:
    """The POST /v1/songs body of a cover (cover.cover_request: the score byte for byte, cot melody, the
    transcription's record); `id` is the job's label."""
    song = {name: values[name] for name in ("style", "lyrics", "seed") if name in values}
    request = cover_request(transcription, **song).to_dict()
    body = {name: request[name] for name in ("style", "lyrics", "cot", "seed", "abc", "transcription")}
    if "id" in values:
        body["id"] = values["id"]
    return json.dumps(body).encode("utf-8")


def transcriptions_router(api: Api, intake: JobIntake, pool: TranscriptionPool, max_upload_bytes: int) -> APIRouter:
    router, service = APIRouter(prefix="/v1", dependencies=api.auth), api.service
    mb = f"{max_upload_bytes / 1e6:g} MB"
    refusals = {**error_docs(*api.denied, 403, 422, s422="a field is invalid, or the audio is not audio, too short, "
                             "silent, has no pitched notes or is longer than the transcriber's limit (the field "
                             "named), or the multipart body does not parse (body)"),
                413: {"model": contract.ErrorBody, "description": f"the upload is over the limit ({mb}, "
                                                                  "--max-upload-mb)"},
                415: {"model": contract.ErrorBody, "description": "the body is not multipart/form-data"},
                429: {"model": contract.ErrorBody, "description": "the transcription pool is full (its figures; "
                                                                  "Retry-After)", "headers": RETRY_AFTER},
                503: {"model": contract.ErrorBody, "description": "the transcriber cannot run here (not installed, "
                      "not set up), or its worker died", "headers": RETRY_AFTER},
                500: {"model": contract.ErrorBody, "description": "the transcriber failed in a way it does not "
                      "name as the audio's or its set-up's (its error's type and words)"}}

    def not_multipart(request: Request):
        if not is_multipart(request.headers.get("content-type")):
            return error_response(415, "body: send it as Content-Type: multipart/form-data (the audio as the file "
                                       "part 'audio')", "Content-Type")
        return None

    @router.post("/transcriptions", summary="Transcribe a melody (a hum, a sung or played melody; SheetSage2: a "
                 "full mix) into a melody-mode score", openapi_extra=form_schema(song=False),
                 responses={200: {"model": contract.TranscriptionAnswer}, **refusals})
    async def transcriptions(request: Request):
        refused = not_multipart(request)
        if refused is not None:
            return refused
        with pool.place():  # a full pool refuses before the upload is read
            audio, values = await upload(request, {**KNOB_TYPES, "lyrics": str}, max_upload_bytes)
            knobs = transcription_request(values)
            transcription = await pool.transcribe(audio, knobs, await run_in_threadpool(gpu_free_bytes, service))
        return api.answer(request, {"abc": transcription.abc, "transcription": transcription.summary(),
                                    "record": transcription.record()})  # no server path for callers without the key

    @router.post("/covers", status_code=202, summary="A cover: transcribe the melody of the audio and queue the song "
                 "that renders its score with this style and lyrics", openapi_extra=form_schema(song=True),
                 responses={202: {"model": contract.CoverCreated, "description": "queued", "headers": LOCATION},
                            200: {"model": contract.CoverCreated, "description": "the job an earlier request with "
                                  "this Idempotency-Key made (the same audio and fields)", "headers": LOCATION},
                            **refusals,
                            409: {"model": contract.ErrorBody, "description": "a request with this Idempotency-Key "
                                  "is still being processed", "headers": RETRY_AFTER},
                            429: {"model": contract.ErrorBody, "description": "the transcription pool or the song "
                                  "queue is full", "headers": RETRY_AFTER},
                            503: {**refusals[503], "description": "the transcriber cannot run here, its worker died, "
                                  "or the engine is down for good"},
                            507: {"model": contract.ErrorBody, "description": "the free disk cannot hold what the "
                                  "song may write beside the admitted songs", "headers": RETRY_AFTER}})
    async def covers(request: Request, idempotency_key: str | None = Header(None, **IDEMPOTENCY_HEADER)):
        refused = not_multipart(request)
        if refused is not None:
            return refused
        key = check_idempotency_key(idempotency_key)
        # The key, then a place in the pool, held before the upload is read: a retry while this request runs is a
        # 409 (never a second transcription), a full pool a 429; both given back however the request ends.
        with intake.claimed(key):
            with pool.place():
                audio, values = await upload(request, {**KNOB_TYPES, **SONG_TYPES}, max_upload_bytes)
                for name in ("style", "lyrics"):
                    if name not in values:
                        raise RequestInvalid(f"{name}: missing (the cover's {name})", field=name)
                song = {name: values[name] for name in SONG_TYPES if name in values}
                stand_in = json.dumps({**song, "cot": "melody", "abc": STAND_IN_SCORE}).encode("utf-8")
                await run_in_threadpool(parse_submission, service.rules, stand_in, new_job_id(),
                                        service.config.max_takes)
                knobs = transcription_request(values)
                transcription = await pool.transcribe(audio, knobs, await run_in_threadpool(gpu_free_bytes, service))
            record = transcription.files()[RECORD_FILE]

            def keep_record(job, created: bool) -> None:  # the whole record beside the song's files
                if created:
                    from ...checkpoint import write_bytes_atomic

                    directory = service.directory(job.id)
                    directory.mkdir(parents=True, exist_ok=True)
                    write_bytes_atomic(directory / RECORD_FILE, record)

            return await intake.queued(cover_body(transcription, values), key, service.submit,
                                       extra={"transcription": transcription.summary()}, on_queued=keep_record)

    return router
