"""What a POST body asks for: the song request, validated with the CLI's checks and the context
budget (a 422 names the field), the body's canonical hash for idempotency, and job ids."""
from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
from dataclasses import dataclass

from ..protocol import TOKENS_PER_SECOND, SongRequest, SongRules, check_seconds, tokens_seconds, valid_song_id
from ..request_json import UsageError, parse_json, request_from_json
from ..takes import MAX_TAKES, TAKE_FIELDS, TakeOptions, check_takes_for, pop_take_options
from .errors import RequestInvalid

JOB_ID = re.compile(r"j[0-9a-f]{20}")


def new_job_id() -> str:
    return "j" + secrets.token_hex(10)


def valid_job_id(value) -> bool:
    return isinstance(value, str) and JOB_ID.fullmatch(value) is not None


@dataclass
class Submission:
    request: SongRequest
    overrides: dict
    stage: str
    label: str | None
    body_sha256: str
    takes: TakeOptions = TakeOptions()


_FIELD_PATTERNS = (
    re.compile(r"SongRequest\.(\w+)"),
    re.compile(r"^(seconds):"),
    re.compile(r"^body: ((?:abc|semantic)_sampling):"),
    re.compile(r"^((?:abc|semantic)_sampling):"),
    re.compile(r"unknown field\(s\) \['([^']*)'"),
    re.compile(r"'(tags)' and 'style' differ"),
    re.compile(r"^(?:body: )?(adapters)\["),
    re.compile(r"^body: (abc_path) "),
    re.compile(r"^body: (melody_audio) "),
    re.compile(r"^body: '(melody)' sets how"),
    re.compile(r"^body: '(transcription)' records"),
    re.compile(r"^body: (lyrics) must be non-blank"),
    re.compile(r"'(prompt)'"),
)


def field_of(message: str) -> str | None:
    """The request field a validation message is about (None: the body as a whole)."""
    for pattern in _FIELD_PATTERNS:
        match = pattern.search(message)
        if match:
            return match.group(1)
    return None


_INTEGER_FIELDS = ("top_k", "penalty_window", "min_tokens", "max_tokens")


def _integral(value):
    """A JSON number with no fractional part (26.0) is the integer JSON Schema calls it; any other value as is."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def integers_as_integers(data: dict) -> dict:
    """The body with `seed` and the sampling counts written as 26.0 read as 26 (1.5 stays, and is refused)."""
    data = dict(data)
    if "seed" in data:
        data["seed"] = _integral(data["seed"])
    for key in ("abc_sampling", "semantic_sampling"):
        if isinstance(data.get(key), dict):
            data[key] = {k: _integral(v) if k in _INTEGER_FIELDS else v for k, v in data[key].items()}
    return data


def canonical_sha256(data) -> str:
    """The same for every spelling of one JSON document (ASCII escapes: lone surrogates hash too)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def json_object(body: bytes) -> dict:
    """A POST body as the JSON object it must be (RequestInvalid `body: ...` for anything else)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestInvalid(f"body: not UTF-8 text (byte 0x{body[exc.start]:02x} at offset {exc.start})") from None
    try:
        data = parse_json(text)
    except UsageError as exc:
        raise RequestInvalid(f"body: {exc}") from None
    if not isinstance(data, dict):
        raise RequestInvalid(f"body: must be a JSON object, got {type(data).__name__}")
    return data


def check_label(label) -> None:
    """A body's `id`, kept as the job's label: None or a song id (RequestInvalid naming `id`)."""
    if label is not None and not valid_song_id(label):
        raise RequestInvalid(f"id: must match [A-Za-z0-9][A-Za-z0-9_.-]{{0,179}} (it is kept as the job's label), "
                             f"got {label!r}", field="id")


def parse_submission(rules: SongRules, body: bytes, job_id: str, max_takes: int = MAX_TAKES, *,
                     check_context: bool = True) -> Submission:
    """A POST body → the song it asks for, with the CLI's validation and the context check (`rules`: the
    server's SongRules, or a pipeline, which holds them); `max_takes`: the server's --max-takes. Without
    `check_context` a body whose prompt and budgets overflow the context passes (its fields are checked all the
    same): what `song_length` explains."""
    data = integers_as_integers(json_object(body))
    body_sha256 = canonical_sha256(data)
    stage = data.pop("stage", "audio")
    if stage not in ("plan", "audio"):
        raise RequestInvalid(f"stage: must be 'plan' or 'audio', got {stage!r}", field="stage")
    reproducible = data.pop("reproducible", False)
    if not isinstance(reproducible, bool):
        raise RequestInvalid(f"reproducible: must be true or false, got {reproducible!r}", field="reproducible")
    if reproducible and not rules.reproducible:
        raise RequestInvalid("reproducible: this server's engine is not batch-invariant, so a seed may not fix the "
                             "song under load; start the server with --reproducible (then every song is)",
                             field="reproducible")
    try:
        takes = pop_take_options(data, max_takes)
    except ValueError as exc:
        message = str(exc)
        raise RequestInvalid(message, field=next((name for name in TAKE_FIELDS if message.startswith(f"{name}:")),
                                                 "takes")) from None
    try:
        fields, overrides = request_from_json(data, where="body", allow_files=False)
    except (ValueError, TypeError) as exc:
        raise RequestInvalid(str(exc), field=field_of(str(exc))) from None
    label = fields.pop("id", None)
    check_label(label)
    for name in ("style", "lyrics"):
        if name not in fields:
            raise RequestInvalid(f"{name}: missing" + (" (or 'tags')" if name == "style" else ""), field=name)
    try:
        request = SongRequest(**fields, id=job_id)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        name = field_of(message)
        raise RequestInvalid(message.replace(f"SongRequest.{name}", name) if name else message, field=name) \
            from None
    try:
        if check_context:
            rules.check_request(request, overrides.get("abc"), overrides.get("semantic"))
        else:
            rules.check_fields(request, overrides.get("abc"), overrides.get("semantic"))
            rules.budget(request, overrides.get("abc"), overrides.get("semantic"))
    except ValueError as exc:
        message = str(exc)
        name = field_of(message)
        if name is None:  # the prompt does not fit: the longest text is the one to shorten
            name = "abc" if request.abc is not None and len(request.abc) > len(request.lyrics) else "lyrics"
        raise RequestInvalid(message, field=name) from None
    try:
        check_takes_for(request, takes, stage)
    except ValueError as exc:
        raise RequestInvalid(str(exc), field="takes") from None
    return Submission(request, overrides, stage, label, body_sha256, takes)


def check_idempotency_key(key: str | None) -> str | None:
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not all(33 <= ord(c) <= 126 for c in key):
        raise RequestInvalid("Idempotency-Key: must be 1-255 visible ASCII characters", field="Idempotency-Key")
    return key


def song_length(rules: SongRules, body: bytes, max_takes: int = MAX_TAKES) -> dict:
    """For a body `POST /v1/songs` would take: the longest song its prompt and score budget leave room for in the
    context, the song it asks for (its `seconds`, else the semantic budget), and whether that fits (else the
    refusal's one line, as a POST would answer it). Bad fields are refused as the POST refuses them."""
    song = parse_submission(rules, body, new_job_id(), max_takes, check_context=False)
    abc, semantic = song.overrides.get("abc"), song.overrides.get("semantic")
    longest = rules.longest_song(song.request, abc)
    budget = rules.budget(song.request, abc, semantic)
    problem = None
    if budget.over > 0:
        try:
            rules.check_request(song.request, abc, semantic)
        except ValueError as exc:
            problem = str(exc)
    return {"longest": {"tokens": longest["tokens"], "seconds": longest["seconds"]},
            "asked": {"tokens": budget.song, "seconds": tokens_seconds(budget.song),
                      "by": "seconds" if song.request.seconds is not None else "max_tokens"},
            "fits": problem is None, "problem": problem, "prompt_tokens": longest["prompt_tokens"],
            "score_budget_tokens": longest["score_budget_tokens"], "context_tokens": longest["context_tokens"],
            "tokens_per_second": TOKENS_PER_SECOND}


CONTINUE_FIELDS = ("seconds", "take", "id")


@dataclass
class ContinueBody:
    """What `POST /v1/songs/{id}/continue` asks: the longer length, which take (1: the job), a label."""

    seconds: float
    take: int
    label: str | None
    body_sha256: str


def parse_continue(body: bytes, max_takes: int = MAX_TAKES) -> ContinueBody:
    """A continue body → its fields (RequestInvalid naming the field)."""
    data = json_object(body)
    unknown = sorted(set(data) - set(CONTINUE_FIELDS))
    if unknown:
        raise RequestInvalid(f"body: unknown field(s) {unknown}; a continue takes {list(CONTINUE_FIELDS)}",
                             field=unknown[0])
    if "seconds" not in data:
        raise RequestInvalid("seconds: missing (the longer length to continue the song to)", field="seconds")
    try:
        seconds = check_seconds(data["seconds"])
    except ValueError as exc:
        raise RequestInvalid(str(exc), field="seconds") from None
    take = _integral(data.get("take", 1))
    if isinstance(take, bool) or not isinstance(take, int) or not 1 <= take <= max_takes:
        raise RequestInvalid(f"take: must be an integer in [1, {max_takes}] (1: the job itself), got {take!r}",
                             field="take")
    label = data.get("id")
    check_label(label)
    return ContinueBody(seconds, take, label, canonical_sha256(integers_as_integers(data)))
