"""Request documents: upstream's request JSON, as `generate --request`, `batch` rows and the server take it.

Errors are `UsageError`s that name the document (`where`) and the field, so every front end can show
them as they are.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

REQUEST_FIELDS = {"style", "tags", "lyrics", "cot", "seed", "abc", "cfg_scale", "id", "abc_sampling",
                  "semantic_sampling", "instrumental", "seconds", "adapters", "transcription"}
IGNORED_FIELDS = {"lang", "eval_index", "clip_id", "prompt", "abc_path"}
# A cover's source (docs/covers.md): the audio to transcribe into the song's score, and how (the transcription
# request's fields but the lyrics, which are the song's).
MELODY_FIELDS = {"melody_audio", "melody"}
MELODY_KNOBS = ("transcriber", "bpm", "meter", "key", "voice", "pickup_beats")


class UsageError(ValueError):
    """A problem with what the user asked for (shown without a traceback).

    `cause` is the exception underneath (a missing file's FileNotFoundError, a JSONDecodeError, ...);
    records name its type, as upstream's do (see `error_type`)."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


def error_type(error: BaseException) -> str:
    """The exception type a record names: a UsageError's underlying one (ValueError when it has none, as
    upstream's own checks raise), any other error's own."""
    if isinstance(error, UsageError):
        return type(error.cause).__name__ if error.cause is not None else "ValueError"
    return type(error).__name__


def _json_type(value) -> str:
    names = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def parse_json(text: str):
    """A JSON document; malformed or absurdly nested input is a UsageError (the caller names where)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})", exc) from None
    except RecursionError as exc:
        raise UsageError("invalid JSON (nested too deeply)", exc) from None


def read_text_file(path: Path, what: str, *, exact: bool = False) -> str:
    """A UTF-8 file named by the flag or field `what`; `exact` keeps every byte (CRLF too), else
    line ends are read as Python's text mode reads them."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{what} {path}: {exc.strerror or exc}", exc) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what} {path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})",
                         exc) from None
    return text if exact else text.replace("\r\n", "\n").replace("\r", "\n")


def read_json_file(path: Path, what: str):
    try:
        return parse_json(read_text_file(path, what))
    except UsageError as exc:
        message = str(exc)
        raise UsageError(message if message.startswith(what) else f"{what} {path}: {message}", exc.cause) from None


def read_abc(path: Path, what: str) -> str:
    """An external score exactly as stored: CRLF and every other byte kept (the ABC ids depend on them)."""
    return read_text_file(path, what, exact=True)


@dataclass(frozen=True)
class MelodyAudio:
    """A request's `melody_audio`: the audio file whose transcription becomes the song's score (a cover), and its
    `melody` knobs as given (MELODY_KNOBS; the transcription request checks their values). The CLI transcribes it
    (`cli.transcribe`); `where` names the document in errors."""

    path: Path
    knobs: dict
    where: str


def melody_from_json(data: dict, base_dir: Path | None, where: str, *, allow_files: bool) -> MelodyAudio | None:
    """The document's `melody_audio` and `melody` read as data (None when it has none): a path relative to the
    document's directory, refused from the network (`allow_files` False) and beside a score (`abc`, `abc_path`,
    `transcription`: the transcription is the score), each refusal naming both fields."""
    given = [name for name in ("melody_audio", "melody") if name in data]
    if given and not allow_files:  # first: "give melody_audio too" would ask for what is refused here
        raise UsageError(f"{where}: {given[0]} is not accepted here (no file is read for a request); send the "
                         "audio to POST /v1/covers, or POST /v1/transcriptions and the score as 'abc'")
    if "melody_audio" not in data:
        if "melody" in data:
            raise UsageError(f"{where}: 'melody' sets how 'melody_audio' is transcribed; give melody_audio too")
        return None
    for name in ("abc", "abc_path", "transcription"):
        if name in data:
            raise UsageError(f"{where}: give 'melody_audio' or '{name}', not both (a cover's score is the "
                             "transcription of its melody_audio)")
    value, knobs = data["melody_audio"], data.get("melody", {})
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{where}: melody_audio must be a file name, got {_json_type(value)} {value!r}")
    if not isinstance(knobs, dict):
        raise UsageError(f"{where}: melody must be an object of {', '.join(MELODY_KNOBS)}, got {_json_type(knobs)}")
    unknown = sorted(set(knobs) - set(MELODY_KNOBS))
    if unknown:
        raise UsageError(f"{where}: melody: unknown field(s) {unknown}; the fields are {', '.join(MELODY_KNOBS)} "
                         "(the lyrics are the song's)")
    return MelodyAudio((base_dir or Path.cwd()) / value, dict(knobs), where)


def request_from_json(data, base_dir: Path | None = None, where: str = "request", *,
                      allow_files: bool = True) -> tuple[dict, dict]:
    """Upstream's request JSON → (SongRequest fields, per-phase sampling overrides); `where` names
    the document in errors. Without `allow_files` (a document from the network) `abc_path` and `melody_audio` are
    refused: the score must come as `abc` text. A cover's `melody_audio` comes back as the field `melody_audio`, a
    MelodyAudio for the caller to transcribe into the song's `abc` (cover.cover_request)."""
    from .protocol import PHASES, SongRequest, check_sampling_overrides

    if not isinstance(data, dict):
        raise UsageError(f"{where}: must be a JSON object, got {_json_type(data)}")
    unknown = sorted(set(data) - REQUEST_FIELDS - IGNORED_FIELDS - MELODY_FIELDS)
    if unknown:
        raise UsageError(f"{where}: unknown field(s) {unknown}")
    melody = melody_from_json(data, base_dir, where, allow_files=allow_files)
    if data.get("transcription") is not None and data.get("abc") is None and "abc_path" not in data:
        raise UsageError(f"{where}: 'transcription' records where the score given as 'abc' came from; give abc too")
    fields = {k: v for k, v in data.items() if k in REQUEST_FIELDS and k not in ("abc_sampling", "semantic_sampling")}
    tags = fields.pop("tags", None)
    if tags is not None:
        if "style" in fields and fields["style"] != tags:
            raise UsageError(f"{where}: 'tags' and 'style' differ (tags is an alias of style)")
        fields["style"] = tags
    if "abc_path" in data:
        value = data["abc_path"]
        if not allow_files:
            raise UsageError(f"{where}: abc_path is not accepted here (no file is read for a request); "
                             "send the score text as 'abc'")
        if "abc" in fields:
            raise UsageError(f"{where}: give 'abc' or 'abc_path', not both")
        if not isinstance(value, str) or not value.strip():
            raise UsageError(f"{where}: abc_path must be a file name, got {_json_type(value)} {value!r}")
        fields["abc"] = read_abc((base_dir or Path.cwd()) / value, f"{where}: abc_path")
    if fields.get("instrumental") is True:  # lyrics are optional for an instrumental: left out means none
        if fields.get("lyrics") == "":
            raise UsageError(f"{where}: lyrics must be non-blank text when given (leave it out for an instrumental "
                             "with none)")
        fields.setdefault("lyrics", "")
    overrides = {}
    for phase in PHASES:
        key = f"{phase}_sampling"
        if data.get(key) is not None:
            try:
                value = check_sampling_overrides(data[key])
            except ValueError as exc:
                raise UsageError(f"{where}: {key}: {exc}", exc) from None
            if value:
                overrides[phase] = value
    if melody is not None and fields.setdefault("cot", "melody") != "melody":
        raise UsageError(f"{where}: cot: a cover renders its transcribed melody_audio with cot 'melody', got "
                         f"{fields['cot']!r}")
    if "prompt" in data:
        if "style" not in fields or "lyrics" not in fields:
            raise UsageError(f"{where}: 'prompt' needs 'style' (or 'tags') and 'lyrics' beside it")
        if data["prompt"] != SongRequest(**fields).text():
            raise UsageError(f"{where}: 'prompt' does not equal the text built from style and lyrics")
    if melody is not None:
        fields["melody_audio"] = melody
    return fields, overrides
