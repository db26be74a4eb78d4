"""The HTTP contract as OpenAPI sees it: the POST body's schema (a pydantic model with the CLI's field constraints
and examples), the answers' models and the error shape every status shares.

The body is still validated by `submission.parse_submission` (the CLI's checks and the pipeline's context budget,
with the CLI's messages); this model documents it, so a client generator or a fuzzer can build a valid song.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..protocol import (ADAPTER_SCALE_RANGE, CONTEXT, DEFAULT_SEED, MAX_CFG_SCALE, MAX_SECONDS, MAX_SEED,
                        TOKENS_PER_SECOND)
from ..takes import MAX_TAKES

# At least one character that is not white space as Python's str.strip() (the CLI's check) counts it, spelled out:
# JSON Schema's \S (ECMA), pydantic's (Rust regex) and Python's disagree on U+001C-U+001F, U+0085 and U+FEFF.
NON_BLANK = r"[^\t\n\v\f\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
SONG_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,179}$"
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,127}$"
IDEMPOTENCY_KEY = r"^[\x21-\x7e]{1,255}$"
STATUSES = ("queued", "planning", "generating", "synthesizing", "decoding", "complete", "failed", "cancelled")


class Sampling(BaseModel):
    """One AR phase's sampling overrides, merged over the server's defaults for the phase (then
    `min_tokens <= max_tokens` must hold, and the prompt plus `max_tokens` must fit the context)."""

    model_config = ConfigDict(extra="forbid", title="Sampling")
    temperature: float = Field(None, ge=0, le=5)
    top_p: float = Field(None, gt=0, le=1)
    top_k: int = Field(None, ge=1)
    repetition_penalty: float = Field(None, gt=0)
    penalty_window: int = Field(None, ge=1, le=100)
    min_tokens: int = Field(None, ge=0, le=CONTEXT)
    max_tokens: int = Field(None, ge=1, le=CONTEXT)


class AdapterChoice(BaseModel):
    """One registered adapter a song uses (GET /v1/adapters lists them), at a scale (0: off)."""

    model_config = ConfigDict(extra="forbid", title="AdapterChoice")
    name: str = Field(..., pattern=ADAPTER_NAME, description="a registered adapter's name", examples=["instrumental"])
    scale: float = Field(1.0, ge=ADAPTER_SCALE_RANGE[0], le=ADAPTER_SCALE_RANGE[1],
                         description="its strength: LoRA deltas times scale, replacements at strength scale")


SHA256 = r"^[0-9a-f]{64}$"


class TranscriptionSource(BaseModel):
    """The audio a score was transcribed from, as given: its bytes' sha256 and size, length, rate, channels and
    libsndfile's format."""

    model_config = ConfigDict(extra="forbid", title="TranscriptionSource")
    sha256: str = Field(..., pattern=SHA256)
    bytes: int = Field(None, ge=0)
    seconds: float = Field(None, ge=0)
    sample_rate: int = Field(None, ge=0)
    channels: int = Field(None, ge=0)
    format: str = Field(None, max_length=64, examples=["WAV"])
    subtype: str = Field(None, max_length=64, examples=["PCM_16"])
    peak_dbfs: float = Field(None, le=100)


class TranscriptionNote(BaseModel):
    """Something a musician should check, in one line, with its figures (the drift: where and how far a cover will
    drift out of sync)."""

    model_config = ConfigDict(extra="forbid", title="TranscriptionNote")
    code: str = Field(..., max_length=64, examples=["drift"])
    message: str = Field(..., max_length=2000)
    figures: dict = Field(..., description="the warning's figures (JSON)")


class TranscriptionRecord(BaseModel):
    """Where a score came from (docs/covers.md): what POST /v1/transcriptions answers as `transcription`, and what a
    song rendered from that score (edited or not) records as its request's `transcription`: the transcriber and its
    version, the source, tempo, meter and key, the warnings with their figures, the licence (SheetSage2's CC BY-NC
    4.0) and the transcribed score's sha256. At most 16 KiB of JSON; `edited` is worked out by the server (whether
    the song's abc differs from the transcribed score)."""

    model_config = ConfigDict(extra="forbid", title="TranscriptionRecord")
    transcriber: str = Field(..., max_length=64, examples=["pyin"])
    transcriber_version: str = Field(..., max_length=200, examples=["pyin-1 (librosa 0.11.0)"])
    source: TranscriptionSource
    bpm: int = Field(..., description="the score's Q:1/4")
    meter: str = Field(..., max_length=16, examples=["4/4"])
    key: str = Field(..., max_length=16, examples=["G"])
    warnings: list[TranscriptionNote] = Field(..., max_length=32)
    licence: str | None = Field(..., max_length=1000, description="the weights' licence where one applies "
                                "(SheetSage2: CC BY-NC 4.0, non-commercial use with attribution); null for pyin")
    score_sha256: str = Field(..., pattern=SHA256, description="the transcribed score's sha256 (UTF-8)")
    edited: bool = Field(None, description="worked out by the server: whether the song's abc differs from the "
                                           "transcribed score (a value sent is not used)")


class SongBody(BaseModel):
    """A song: the `generate --request` JSON, plus `stage` and `reproducible`. Give `style` or its alias `tags`
    (both only when equal). The prompt built from style, lyrics and score must fit the model's context with
    each phase's `max_tokens` (a 422 naming `lyrics` or `abc` otherwise)."""

    model_config = ConfigDict(extra="forbid", title="SongBody", json_schema_extra={"examples": [
        {"style": "pop, piano, warm female vocal", "lyrics": "[verse]\nla la la\n", "seed": 7},
        {"tags": "rock, electric guitar", "lyrics": "[chorus]\nhey\n", "cot": "melody", "stage": "plan",
         "semantic_sampling": {"temperature": 0.9, "max_tokens": 3000}},
    ]})
    style: str = Field(None, pattern=NON_BLANK, description="the style tags the song is conditioned on",
                       examples=["pop, piano, warm female vocal"])
    tags: str | None = Field(None, pattern=NON_BLANK, description="an alias of style (null: not given)")
    lyrics: str = Field(None, pattern=NON_BLANK, description="the lyrics, with [verse]/[chorus] sections (optional "
                        "only with instrumental)", examples=["[verse]\nla la la\n"])
    cot: Literal["off", "melody", "full"] = Field("full", description="chain of thought: a chord-annotated score "
                                                  "(full), a melody-only one (melody), or none (off)")
    seed: int = Field(DEFAULT_SEED, ge=0, lt=MAX_SEED)
    abc: str | None = Field(None, pattern=NON_BLANK, description="an external ABC score (not with cot off)")
    cfg_scale: float | None = Field(None, ge=0, le=MAX_CFG_SCALE, description="classifier-free guidance scale "
                                    "(null: the cot mode's default)")
    id: str | None = Field(None, pattern=SONG_ID, description="kept as the job's label (never a path)")
    abc_sampling: Sampling | None = None
    semantic_sampling: Sampling | None = None
    instrumental: bool = Field(False, description="upstream's instrumental recipe: plan a score, move its vocal "
                               "melody to the instrument (or edit the given abc so), render that with an "
                               "instrumental style and section tags; not with cot off (docs/instrumental.md)")
    seconds: float | None = Field(None, ge=1 / TOKENS_PER_SECOND, le=MAX_SECONDS, description="cap the song at this "
                                  "length: its semantic tokens at 25 a second, the semantic phase's budget (not with "
                                  "semantic_sampling.max_tokens; at least its min_tokens / 25); prompt, score budget "
                                  "and song must fit the context (POST /v1/songs/length says the longest song a body "
                                  "can reach; docs/length.md)")
    adapters: list[AdapterChoice] | None = Field([], description="registered adapters the song runs with (the AR "
                                                 "parts on vLLM, the NAR parts in synthesis; docs/adapters.md; null: "
                                                 "none)")
    transcription: TranscriptionRecord | None = Field(None, description="where the given abc came from: the "
                                                      "`transcription` POST /v1/transcriptions answered (the song "
                                                      "records it, outside its identity, and whether its abc is the "
                                                      "transcribed score edited); needs abc")
    stage: Literal["plan", "audio"] = Field("audio", description="plan: the score only (render its audio later)")
    reproducible: bool = Field(False, description="ask for a batch-invariant song (only on a server started with "
                                                  "--reproducible)")
    takes: int = Field(1, ge=1, le=MAX_TAKES, description="whole songs from this request, run at once (take k's seed: "
                       "(seed + k - 1) mod 2**63; take 1 is this job); at most the server's --max-takes")
    best_of: bool = Field(False, description="mark the take with the highest semantic mean log-prob as the pick "
                                             "(needs takes >= 2; every take is kept)")
    takes_share_score: bool = Field(False, description="plan one score (take 1's) and render every take from it "
                                                       "(needs takes >= 2)")
    lang: Any = Field(None, description="upstream's request JSON: accepted and ignored")
    eval_index: Any = Field(None, description="upstream's request JSON: accepted and ignored")
    clip_id: Any = Field(None, description="upstream's request JSON: accepted and ignored")


class ContinueBody(BaseModel):
    """Continue a capped song: the song its request with this longer `seconds` makes (docs/length.md)."""

    model_config = ConfigDict(extra="forbid", title="ContinueBody", json_schema_extra={"examples": [
        {"seconds": 90}, {"seconds": 120, "take": 2, "id": "ballad-2min"}]})
    seconds: float = Field(..., ge=1 / TOKENS_PER_SECOND, le=MAX_SECONDS, description="the longer length (more "
                           "than the song's), at 25 semantic tokens a second")
    take: int = Field(1, ge=1, le=MAX_TAKES, description="which take of the job to continue (1: the job itself)")
    id: str | None = Field(None, pattern=SONG_ID, description="the new job's label (default: the song's label or "
                           "id, then .<seconds>s)")


class SongLength(BaseModel):
    """The longest song a body's prompt and score budget leave room for, the song it asks for, and whether that fits
    the context (else the one line POST /v1/songs would refuse it with)."""

    longest: dict = Field(..., description="tokens and seconds", examples=[{"tokens": 20417, "seconds": 816.68}])
    asked: dict = Field(..., description="tokens, seconds and by (seconds or max_tokens)")
    fits: bool
    problem: str | None
    prompt_tokens: int
    score_budget_tokens: int
    context_tokens: int
    tokens_per_second: int


class AdapterInfo(BaseModel):
    """A registered adapter: what it adapts and where it came from."""

    name: str
    half: Literal["ar", "nar", "both"] = Field(..., description="the half of YuE2 it changes, told from its tensors")
    rank: int = Field(..., description="its largest LoRA rank (0: only deltas or replacement tensors)")
    modules: list[str] = Field(..., description="the projections it adapts, by their name inside a layer")
    module_count: int
    sha256: str = Field(..., description="its content hash (a single file's own sha256); songs record it")
    layout: str = Field(..., description="plain, peft, alpha-rank, lora.json, comfyui or slider-distill")
    licence: str | None = Field(..., description="from its card's front matter, when it has one")
    triggers: list[str] = Field([], description="trigger words its lora.json names")
    source: str = Field(..., description="the path or Hub id it was registered from")


class AdapterList(BaseModel):
    adapters: list[AdapterInfo]


class ModelEntry(BaseModel):
    id: str
    object: Literal["model"]
    owned_by: str
    parent: str | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelEntry]


class ScoreBody(BaseModel):
    """An ABC score to check (or to write as MIDI) with the server's upstream-exact reader."""

    model_config = ConfigDict(extra="forbid", title="ScoreBody", json_schema_extra={"examples": [
        {"abc": 'X:1\nT:\nM:4/4\nL:1/16\nQ:1/4=96\nV: Vocal clef=treble name="Vocal Melody" snm="Vocal"\n'
                'V: Ins clef=treble name="Ins Melody" snm="Inst."\nK:C\n% verse\nV: Vocal\n"C"c4e4g8|\n'
                'V: Ins\nZ|\n'}]})
    abc: str = Field(..., description="the score's text (any line ending)")


class ScoreNote(BaseModel):
    onset: float = Field(..., description="quarter notes from the score's start")
    duration: float = Field(..., description="quarter notes (tied notes merged)")
    pitch: int = Field(..., ge=0, le=127, description="MIDI pitch (60: middle C)")


class ScoreChord(BaseModel):
    onset: float = Field(..., description="quarter notes from the score's start")
    duration: float = Field(..., description="until the next chord symbol or the score's end")
    symbol: str = Field(..., examples=["Am7"])
    pitches: list[int] = Field(..., description="a plain voicing: the bass from C2, the chord from its root from C3")


class ScoreMeter(BaseModel):
    onset: float
    meter: str = Field(..., examples=["4/4"])


class ScoreKey(BaseModel):
    onset: float
    key: str = Field(..., examples=["Am"])


class ScoreSection(BaseModel):
    onset: float
    label: str = Field(..., examples=["verse"])


class ScoreMusic(BaseModel):
    """A valid score's music as the reader reads it (times in quarter notes; seconds = quarters × 60 / bpm)."""

    cot: Literal["full", "melody"] = Field(..., description="the cot it renders with: full when Vocal has chord "
                                                            "symbols, else melody (upstream's rule)")
    bpm: int = Field(..., description="Q:1/4=bpm")
    unit: str = Field(..., description="L:", examples=["1/16"])
    meter: str = Field(..., description="the first M:", examples=["4/4"])
    key: str = Field(..., description="the first K:", examples=["C"])
    bars: int
    quarters: float = Field(..., description="its length in quarter notes")
    seconds: float = Field(..., description="its length at its tempo")
    voices: dict[Literal["Vocal", "Ins"], list[ScoreNote]]
    chords: list[ScoreChord]
    meters: list[ScoreMeter] = Field(..., description="the first meter and every change")
    keys: list[ScoreKey] = Field(..., description="the first key and every change")
    sections: list[ScoreSection] = Field(..., description="each `% label` at the bar it names")


class ScoreCheck(BaseModel):
    """The reader's verdict: valid with the music, or the first problem in one line naming the score line."""

    valid: bool
    problem: str | None = Field(..., examples=["score line 12: group 1, Vocal: the bar holds 3 quarter notes, its "
                                               "meter 4/4 takes 4"])
    line: int | None = Field(..., description="the score line (1-based) the problem names")
    score: ScoreMusic | None


class TranscriptionAnswer(BaseModel):
    """A melody transcribed: the score (melody-mode ABC, read back by the server's reader), its record as a song
    takes it (`transcription`: send it back with the score, edited or not, to POST /v1/songs), and the whole record
    (`record`: transcription.json, the notes as heard and as written, the tempo's drift figures, the timings)."""

    abc: str
    transcription: TranscriptionRecord
    record: dict


class ErrorDetail(BaseModel):
    status: int = Field(..., examples=[422])
    message: str = Field(..., examples=["cfg_scale must be a finite number in [0, 20], got 99"])
    field: str | None = Field(..., description="the request field, header or parameter it is about",
                              examples=["cfg_scale"])


class ErrorBody(BaseModel):
    """Every error: its status, a message in words and the field it is about (or null)."""

    error: ErrorDetail


class Urls(BaseModel):
    model_config = ConfigDict(extra="allow")
    self: str
    events: str
    audio: str
    score: str
    result: str


class SongCreated(BaseModel):
    id: str = Field(..., pattern=r"^j[0-9a-f]{20}$")
    label: str | None
    status: Literal[STATUSES]
    stage: Literal["plan", "audio"]
    created: bool = Field(..., description="false: an earlier request with this Idempotency-Key made the job")
    urls: Urls


class CoverCreated(SongCreated):
    """A cover's song job, queued: as POST /v1/songs answers, with the transcription its score came from (warnings,
    licence)."""

    transcription: TranscriptionRecord


class TakeEntry(BaseModel):
    model_config = ConfigDict(extra="allow")
    take: int
    id: str
    status: Literal[STATUSES + ("deleted",)]
    seed: int | None
    signals: dict
    urls: dict | None


class Takes(BaseModel):
    """A job's takes (on take 1's job), or, on take k's own job, which job it is a take of."""

    model_config = ConfigDict(extra="allow")
    take: int
    of: int
    entries: list[TakeEntry] | None = None
    pick: int | None = None
    kept: int | None = None


class Song(BaseModel):
    """A job: status, per-stage progress and records, retries, error and result."""

    model_config = ConfigDict(extra="allow")
    id: str
    label: str | None
    status: Literal[STATUSES]
    stage: Literal["plan", "audio"]
    progress: dict
    stages: dict
    error: dict | None
    result: dict | None
    urls: Urls
    takes: Takes | None = None
    continued_from: dict | None = Field(None, description="the job (and take) of the capped song this one continues")


class SongSummary(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    status: Literal[STATUSES]
    urls: Urls


class SongList(BaseModel):
    songs: list[SongSummary]
    next_cursor: str | None = Field(..., description="pass as cursor for the next page (null: the last page)")


class AudioUrl(BaseModel):
    """A URL that plays the song's audio without the API key (Range requests and all), until it expires."""

    url: str = Field(..., description="the audio route, signed when the server has an API key")
    expires: int | None = Field(..., description="when it stops working (Unix seconds; null: never, no key)")
    expires_in: int | None = Field(..., description="seconds from now until then (null: never)")


class Picture(BaseModel):
    """A song's peaks and spectrogram for drawing (see serve/picture.py)."""

    model_config = ConfigDict(extra="allow")
    version: int
    duration: float = Field(..., description="seconds of audio")
    sample_rate: int
    buckets: int = Field(..., description="(min, max) pairs per channel")
    peaks: list[str] = Field(..., description="per channel (2): base64 of int8 min, max pairs (×127)")
    columns: int
    rows: int
    low_hz: float
    dynamic_db: float
    spectrogram: str = Field(..., description="base64 of uint8 levels, column after column, lowest band first")


class Health(BaseModel):
    model_config = ConfigDict(extra="allow")
    status: Literal["ok", "unavailable"]
    engine: dict
    queue: dict
    in_flight: int
    disk: dict = Field(..., description="the data dir: data_dir, free_bytes, min_free_bytes, writable, "
                       "store_writable, store_waiting_seconds (how long a job-store write has waited to land)")
    api_key_required: bool


def _drop_null_defaults(schema):
    """pydantic writes `default: null` for an optional field that may not be null: leave it out."""
    if isinstance(schema, dict):
        if "default" in schema and schema["default"] is None and "anyOf" not in schema and schema.get("type") != "null":
            schema = {k: v for k, v in schema.items() if k != "default"}
        return {k: _drop_null_defaults(v) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_drop_null_defaults(item) for item in schema]
    return schema


def song_body_schemas(*, reproducible: bool, max_takes: int = MAX_TAKES, adapters: tuple = ()) -> dict:
    """`components.schemas` entries for the POST body: SongBody and Sampling, with what pydantic cannot say
    (style or tags; no score with cot off; reproducible only where the server is; best_of and takes_share_score
    need takes >= 2; a stage=plan job with nothing to plan takes one take; takes up to --max-takes)."""
    schema = _drop_null_defaults(SongBody.model_json_schema(ref_template="#/components/schemas/{model}"))
    definitions = schema.pop("$defs", {})
    for name in ("lang", "eval_index", "clip_id"):
        schema["properties"][name] = {"description": schema["properties"][name]["description"]}
    text = {"type": "string", "pattern": NON_BLANK}
    schema["anyOf"] = [{"required": ["style"]}, {"required": ["tags"], "properties": {"tags": text}}]
    schema["not"] = {"required": ["style", "tags"], "properties": {"tags": text}}
    schema["properties"]["takes"] = {**schema["properties"]["takes"], "maximum": max_takes}
    if adapters:  # the names this server serves
        choice = definitions["AdapterChoice"] = dict(definitions["AdapterChoice"])
        choice["properties"] = {**choice["properties"],
                                "name": {**choice["properties"]["name"], "enum": sorted(adapters)}}
    else:  # this server serves none
        schema["properties"]["adapters"] = {**schema["properties"]["adapters"], "maxItems": 0}
    needs_takes = [{"if": {"required": [name], "properties": {name: {"const": True}}},
                    "then": {"required": ["takes"], "properties": {"takes": {"minimum": 2}}}}
                   for name in ("best_of", "takes_share_score")]
    nothing_to_plan = {"if": {"required": ["stage"], "properties": {"stage": {"const": "plan"}},
                              "anyOf": [{"required": ["abc"], "properties": {"abc": {"type": "string"}}},
                                        {"required": ["cot"], "properties": {"cot": {"const": "off"}}}]},
                       "then": {"properties": {"takes": {"maximum": 1}}}}
    instrumental = {"required": ["instrumental"], "properties": {"instrumental": {"const": True}}}
    lyrics_needed = {"if": {"not": instrumental}, "then": {"required": ["lyrics"]}}
    no_score_to_edit = {"if": instrumental, "then": {"properties": {"cot": {"enum": ["melody", "full"]}}}}
    one_budget = {"not": {"required": ["seconds", "semantic_sampling"], "properties": {
        "seconds": {"type": "number"}, "semantic_sampling": {"type": "object", "required": ["max_tokens"]}}}}
    schema["allOf"] = [{"if": {"required": ["cot"], "properties": {"cot": {"const": "off"}}},
                        "then": {"properties": {"abc": {"type": "null"}}}}, *needs_takes, nothing_to_plan,
                       lyrics_needed, no_score_to_edit, one_budget]
    if not reproducible:
        schema["properties"]["reproducible"] = {**schema["properties"]["reproducible"], "const": False,
                                                "description": "this server's engine is not batch-invariant: "
                                                               "only false (start it with --reproducible)"}
    continue_body = ContinueBody.model_json_schema()
    continue_body["properties"]["take"] = {**continue_body["properties"]["take"], "maximum": max_takes}
    return {"SongBody": schema, **definitions, "ContinueBody": _drop_null_defaults(continue_body)}


# --------------------------------------------------------------------------- the routes' statuses and media


def error_docs(*statuses: int, **words: str) -> dict:
    default = {400: "the Host is not a name of this server", 401: "missing or wrong API key",
               403: "from a page of another origin", 404: "no such song (ids are j + 20 hex digits)",
               409: "not ready, or in a state that does not allow it", 413: "the body is over 256 KiB",
               415: "the body is not application/json", 422: "a field, parameter or header is invalid (named)",
               429: "the queue is full (Retry-After)", 503: "unavailable now (Retry-After)"}
    return {status: {"model": ErrorBody, "description": words.get(f"s{status}", default[status])}
            for status in statuses}


def media_doc(media_type: str, description: str, schema: dict | None = None) -> dict:
    return {"description": description, "content": {media_type: {"schema": schema or {"type": "string"}}}}


EVENT_KINDS = ("status", "state", "tokens", "stage", "score", "waiting", "nar", "vae", "retry", "complete",
               "failed", "cancelled")
# One event (OpenAPI 3.2's itemSchema for a sequential media type): its data is always one line of JSON.
SSE_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "enum": list(EVENT_KINDS)},
    "data": {"type": "string", "contentMediaType": "application/json", "pattern": "^[^\\r\\n\u0085\u2028\u2029]*$"},
    "id": {"type": "string"}, "retry": {"type": "integer", "minimum": 0}}}


RETRY_AFTER = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
LOCATION = {"Location": {"description": "the job's URL", "schema": {"type": "string"}}}
