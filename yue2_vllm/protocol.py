"""The YuE2 token protocol: ids, instructions, requests, sampling settings and prompts.

Everything here is pure Python: it fixes what the AR half is asked (prompt token ids) and
how each phase may sample, independent of the backend that runs it.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from numbers import Integral, Real
from typing import Protocol, Sequence

EOD = 151643  # <|endoftext|>, also the first prompt token
ABC_START = 151847  # <abc>
ABC_END = 151848  # </abc>
MUSIC_START = 151851
MUSIC_END = 151852
CODEC_OFFSET = 151853
CODEC_SIZE = 32768
LATENT_START = 184621
LATENT_END = 184622
LATENT_PAD = 184623
VOCAB_SIZE = 184704
CONTEXT = 24576
PROTOCOL_VERSION = "yue2-native-v1"
DEFAULT_SEED = 831001
TOKENS_PER_SECOND = 25  # semantic tokens (= latent frames) per second of audio

COT_MODES = ("off", "melody", "full")
INSTRUCTIONS = {
    "off": "Generate music with codec tokens from the given conditions.",
    "melody": ("Generate a melody-only ABC transcription without chord symbols, "
               "then generate music with codec tokens from the given conditions."),
    "full": ("Generate a chord-annotated ABC transcription, "
             "then generate music with codec tokens from the given conditions."),
}
PHASES = ("abc", "semantic")
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,179}")
MAX_SEED = 2**63
MAX_CFG_SCALE = 20.0


class TextEncoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def check_seed(seed, what: str = "seed") -> int:
    """An integer seed in [0, 2**63) as a plain int; floats and bools are refused, never rounded."""
    if not _is_int(seed) or not 0 <= seed < MAX_SEED:
        raise ValueError(f"{what} must be an integer in [0, 2**63), got {seed!r}")
    return int(seed)


def check_token_ids(ids: Sequence[int], what: str, low: int = 0, high: int = VOCAB_SIZE,
                    kind: str = "an integer id") -> list[int]:
    """Integer ids in [low, high) as plain ints; floats and bools are refused, never coerced."""
    ids = list(ids)
    for position, value in enumerate(ids):
        if not _is_int(value) or not low <= value < high:
            raise ValueError(f"{what}[{position}] = {value!r} is not {kind} in [{low}, {high})")
    return [int(v) for v in ids]


def check_unicode(text: str, what: str) -> None:
    """Text must encode as UTF-8: JSON's \\ud800 escapes can smuggle in lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode text (a lone surrogate at position {exc.start})") from None


def valid_song_id(value) -> bool:
    """Whether `value` can name a song (and its output directory)."""
    return isinstance(value, str) and bool(_ID_PATTERN.fullmatch(value)) and value not in (".", "..")


def default_cfg_scale(cot: str) -> float:
    """cot=off runs paired CFG at 1.01 by default; the score modes run without CFG."""
    return 1.01 if cot == "off" else 1.0


def seconds_tokens(seconds: float) -> int:
    """Semantic tokens (= latent frames) in `seconds` of song at YuE2's 25 a second, counted as upstream's tools
    count them (`examples/instrumental_clip.py`: `int(seconds * TOKENS_PER_SECOND)`, rounding down)."""
    return int(seconds * TOKENS_PER_SECOND)


def tokens_seconds(tokens: int) -> float:
    """The seconds of song `tokens` semantic tokens make (each is one 1,920-sample frame at 48 kHz)."""
    return tokens / TOKENS_PER_SECOND


def seconds_for_tokens(tokens: int) -> float:
    """The largest `seconds` (to 0.01 s) whose cap is at most `tokens` tokens (0.0 when none is)."""
    seconds = math.floor(tokens * 100 / TOKENS_PER_SECOND) / 100
    while seconds > 0 and seconds_tokens(seconds) > tokens:
        seconds = round(seconds - 0.01, 2)
    return max(seconds, 0.0)


MAX_SECONDS = CONTEXT / TOKENS_PER_SECOND  # the whole 24,576-token context as song: 983.04 s


def check_seconds(value, what: str = "seconds") -> float:
    """A song length in seconds as a float: a finite number > 0 that caps at least one token and fits the context."""
    if not _is_real(value) or not value > 0:
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")
    if value > MAX_SECONDS:  # first: 1e308 seconds would overflow the count
        raise ValueError(f"{what} must be at most {MAX_SECONDS:g} (the whole {CONTEXT}-token context at "
                         f"{TOKENS_PER_SECOND} tokens a second), got {value!r}")
    if seconds_tokens(value) < 1:
        raise ValueError(f"{what} must be at least {1 / TOKENS_PER_SECOND:g} (one semantic token at "
                         f"{TOKENS_PER_SECOND} a second), got {value!r}")
    return float(value)


def end_token(phase: str) -> int:
    """The token that closes a phase: `</abc>` for abc, MUSIC_END for semantic."""
    if phase == "abc":
        return ABC_END
    if phase == "semantic":
        return MUSIC_END
    raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")


def allowed_token_ids(phase: str) -> range | list[int]:
    """Ids a phase may emit: every ordinary text id + `</abc>`, or the codec ids + MUSIC_END."""
    if phase == "abc":
        return list(range(EOD)) + [ABC_END]
    if phase == "semantic":
        return list(range(CODEC_OFFSET, CODEC_OFFSET + CODEC_SIZE)) + [MUSIC_END]
    raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")


# --------------------------------------------------------------------------- requests


ADAPTER_SCALE_RANGE = (-10.0, 10.0)  # a song's adapter scale; 0 switches the adapter off
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,127}")


@dataclass(frozen=True)
class AdapterRef:
    """One adapter a song uses, by its registered name (docs/adapters.md), at a scale."""

    name: str
    scale: float = 1.0

    def __post_init__(self):
        if not isinstance(self.name, str) or not ADAPTER_NAME.fullmatch(self.name):
            raise ValueError(f"adapter name {self.name!r}: use letters, digits and _ . : @ + - (up to 128, starting "
                             "with a letter or digit)")
        low, high = ADAPTER_SCALE_RANGE
        if not _is_real(self.scale) or not low <= self.scale <= high:
            raise ValueError(f"adapter {self.name} scale: {self.scale!r} is not a number in [{low:g}, {high:g}]")
        object.__setattr__(self, "scale", float(self.scale))


def adapter_refs(value, what: str = "SongRequest.adapters") -> tuple[AdapterRef, ...]:
    """`[{name, scale}]` (or AdapterRefs) as a tuple of AdapterRefs, scale-0 ones dropped (an adapter switched off is
    none); a name given twice stacks (its deltas add)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
        raise ValueError(f"{what} must be a list of {{name, scale}} objects, got {type(value).__name__}")
    refs = []
    for index, entry in enumerate(value):
        if isinstance(entry, dict):
            unknown = sorted(set(entry) - {"name", "scale"})
            if unknown or "name" not in entry:
                raise ValueError(f"{what}[{index}]: " + (f"unknown field(s) {unknown}" if unknown else "needs a name"))
            try:
                entry = AdapterRef(entry["name"], entry.get("scale", 1.0))
            except ValueError as exc:
                raise ValueError(f"{what}[{index}]: {exc}") from None
        elif not isinstance(entry, AdapterRef):
            raise ValueError(f"{what}[{index}] must be an object {{name, scale}}, got {type(entry).__name__}")
        refs.append(entry)
    return tuple(ref for ref in refs if ref.scale)


# A cover's record of the transcription its score came from (docs/covers.md): JSON-ready, small (no notes: the run's
# transcription.json keeps them). Its fields and their JSON types; `edited` is not given but worked out (below).
TRANSCRIPTION_FIELDS = {"transcriber": str, "transcriber_version": str, "source": dict, "bpm": int, "meter": str,
                        "key": str, "warnings": list, "licence": (str, type(None)), "score_sha256": str}
TRANSCRIPTION_SOURCE_FIELDS = {"sha256": str, "bytes": int, "seconds": (int, float), "sample_rate": int,
                               "channels": int, "format": str, "subtype": str, "peak_dbfs": (int, float)}
MAX_TRANSCRIPTION_BYTES = 16 * 1024  # its JSON: a record, not the notes
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _check_json_type(value, types, what: str):
    """`value` as one of `types` (a bool is not a number here). An integer field takes a float with no fraction,
    as an integer (JSON Schema's integer is any number with no fraction: 1.0 is one)."""
    types = types if isinstance(types, tuple) else (types,)
    if int in types and float not in types and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, types) or isinstance(value, bool):
        raise ValueError(f"{what} has the wrong type ({type(value).__name__})")
    return value


def check_transcription(value, abc: str | None) -> dict:
    """A request's `transcription` record checked — a JSON object of TRANSCRIPTION_FIELDS (source: its sha256 and
    TRANSCRIPTION_SOURCE_FIELDS; warnings: {code, message, figures} objects), at most MAX_TRANSCRIPTION_BYTES of
    JSON — and completed: `edited` is whether `abc`, the song's score, differs from the transcribed score (by its
    sha256). ValueError naming `SongRequest.transcription` and the field."""
    import hashlib
    import json

    what = "SongRequest.transcription"
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be an object (a transcription's record), got {type(value).__name__}")
    unknown = sorted(set(value) - set(TRANSCRIPTION_FIELDS) - {"edited"})
    missing = [name for name in TRANSCRIPTION_FIELDS if name not in value]
    if unknown or missing:
        raise ValueError(f"{what}: " + (f"unknown field(s) {unknown}" if unknown else f"missing {missing}")
                         + f"; its fields are {', '.join(TRANSCRIPTION_FIELDS)} (and edited, worked out)")
    try:
        size = len(json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8"))
    except (TypeError, ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"{what} is not JSON-ready data ({exc})") from None
    if size > MAX_TRANSCRIPTION_BYTES:
        raise ValueError(f"{what} is {size} bytes of JSON, more than {MAX_TRANSCRIPTION_BYTES} (a record without "
                         "its notes)")
    value = {name: _check_json_type(value[name], types, f"{what}.{name}")
             for name, types in TRANSCRIPTION_FIELDS.items()}
    if not _SHA256.fullmatch(value["score_sha256"]):
        raise ValueError(f"{what}.score_sha256 must be 64 lowercase hex digits (the transcribed score's sha256)")
    source = value["source"]
    unknown = sorted(set(source) - set(TRANSCRIPTION_SOURCE_FIELDS))
    if unknown or not isinstance(source.get("sha256"), str) or not _SHA256.fullmatch(source["sha256"]):
        raise ValueError(f"{what}.source: " + (f"unknown field(s) {unknown}" if unknown else
                                               "needs its sha256 (64 lowercase hex digits)"))
    source = {name: _check_json_type(item, TRANSCRIPTION_SOURCE_FIELDS[name], f"{what}.source.{name}")
              for name, item in source.items()}
    for index, warning in enumerate(value["warnings"]):
        if not isinstance(warning, dict) or set(warning) != {"code", "message", "figures"} or \
                not isinstance(warning["code"], str) or not isinstance(warning["message"], str) or \
                not isinstance(warning["figures"], dict):
            raise ValueError(f"{what}.warnings[{index}] must be an object {{code, message, figures}}")
    edited = abc is None or hashlib.sha256(abc.encode("utf-8")).hexdigest() != value["score_sha256"]
    return {**value, "source": source, "edited": edited}


@dataclass(frozen=True)
class SongRequest:
    """One song: conditions, chain-of-thought mode, seed, optional external ABC and CFG scale."""

    style: str
    lyrics: str
    cot: str = "full"
    seed: int = DEFAULT_SEED
    abc: str | None = None
    cfg_scale: float | None = None
    id: str = "song"
    # Upstream's instrumental recipe (see instrumental.py): plan a score, move its vocal melody to the instrument,
    # render that. Lyrics are optional then ("" plans with upstream's section tags).
    instrumental: bool = False
    # A length to cap the song at: its semantic tokens (= latent frames) at 25 a second, as upstream's tools count
    # them (`seconds_tokens`). None: the semantic phase's max_tokens, as always.
    seconds: float | None = None
    # Adapters by registered name and scale (AdapterRef); their contents enter the identity through the config.
    adapters: tuple = ()
    # A cover's record of the transcription its score came from (check_transcription); not part of the song's
    # identity: the song depends on its score, not on where the score came from.
    transcription: dict | None = field(default=None, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "adapters", adapter_refs(self.adapters))
        if not isinstance(self.instrumental, bool):
            raise ValueError(f"SongRequest.instrumental must be true or false, got {self.instrumental!r}")
        # The model is conditioned on both; blank text has no upstream meaning, except no lyrics ('') for an
        # instrumental or a given score (upstream renders an instrumental score with empty section lyrics).
        lyrics_optional = self.instrumental or self.abc is not None
        for name in ("style", "lyrics"):
            value = getattr(self, name)
            optional = name == "lyrics" and lyrics_optional and value == ""
            if not isinstance(value, str) or not (value.strip() or optional):
                raise ValueError(f"SongRequest.{name} must be non-blank text"
                                 + (" (or '' for none)" if name == "lyrics" and lyrics_optional else "")
                                 + f", got {value!r}")
            check_unicode(value, f"SongRequest.{name}")
        if self.cot not in COT_MODES:
            raise ValueError(f"SongRequest.cot must be one of {COT_MODES}, got {self.cot!r}")
        object.__setattr__(self, "seed", check_seed(self.seed, "SongRequest.seed"))
        if not valid_song_id(self.id):
            raise ValueError("SongRequest.id must match [A-Za-z0-9][A-Za-z0-9_.-]{0,179}, "
                             f"got {self.id!r}")
        if self.abc is not None:
            if not isinstance(self.abc, str) or not self.abc.strip():
                raise ValueError("SongRequest.abc must be non-blank text when given")
            check_unicode(self.abc, "SongRequest.abc")
            if self.cot == "off":
                raise ValueError("SongRequest.abc needs cot 'melody' or 'full' (cot 'off' has no score)")
        if self.seconds is not None:
            object.__setattr__(self, "seconds", check_seconds(self.seconds, "SongRequest.seconds"))
        if self.transcription is not None:
            object.__setattr__(self, "transcription", check_transcription(self.transcription, self.abc))
        if self.cfg_scale is not None and (not _is_real(self.cfg_scale)
                                           or not 0 <= self.cfg_scale <= MAX_CFG_SCALE):
            raise ValueError(f"SongRequest.cfg_scale must be a finite number in [0, 20], got {self.cfg_scale!r}")
        if self.instrumental:
            if self.cot == "off":
                raise ValueError("SongRequest.instrumental needs cot 'full' or 'melody': upstream's recipe edits the "
                                 "song's score, and cot 'off' has none")
            if self.abc is not None:
                from .instrumental import edit_score

                try:
                    edit_score(self.abc)  # refused now, naming its line, not once the song runs
                except ValueError as exc:
                    raise ValueError(f"SongRequest.abc: {exc}") from None

    @property
    def guidance(self) -> float:
        """Effective CFG scale: the explicit one, else the cot mode's default."""
        return float(self.cfg_scale) if self.cfg_scale is not None else default_cfg_scale(self.cot)

    def text(self) -> str:
        return f"{INSTRUCTIONS[self.cot]}\n[Tags]\n{self.style}\n[Lyrics]\n{self.lyrics}\n"

    def to_dict(self) -> dict:
        """The fields; `instrumental`, `seconds`, `adapters` and `transcription` only when set, so every other song
        keeps the identity it always had."""
        data = asdict(self)
        if self.transcription is None:
            del data["transcription"]
        if not self.instrumental:
            del data["instrumental"]
        if self.seconds is None:
            del data["seconds"]
        if self.adapters:
            data["adapters"] = [{"name": ref.name, "scale": ref.scale} for ref in self.adapters]
        else:
            del data["adapters"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "SongRequest":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"SongRequest: unknown field(s) {unknown}")
        return cls(**data)


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class Sampling:
    """Per-phase sampling settings (upstream's semantic defaults)."""

    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 100
    repetition_penalty: float = 1.2
    penalty_window: int = 50
    min_tokens: int = 200
    max_tokens: int = 9000

    def __post_init__(self):
        for f in fields(self):
            problem = _sampling_type_problem(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(f"Sampling.{problem}")
        checks = [
            (0 <= self.temperature <= 5, "temperature must be in [0, 5]"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 1, "top_k must be >= 1"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (1 <= self.penalty_window <= 100, "penalty_window must be in [1, 100]"),
            (1 <= self.max_tokens <= CONTEXT, f"max_tokens must be in [1, {CONTEXT}] (the context)"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"Sampling.{message}")

    def to_dict(self) -> dict:
        return asdict(self)


_SAMPLING_INTS = ("top_k", "penalty_window", "min_tokens", "max_tokens")


def _sampling_type_problem(name: str, value) -> str | None:
    if name in _SAMPLING_INTS:
        return None if _is_int(value) else f"{name} must be an integer, got {value!r}"
    return None if _is_real(value) else f"{name} must be a finite number, got {value!r}"


def check_sampling_overrides(value) -> dict:
    """A dict of Sampling fields with values of the right types (ranges are checked once merged
    over a phase's defaults)."""
    if not isinstance(value, dict):
        raise ValueError(f"Sampling overrides must be an object of Sampling fields, got {type(value).__name__} "
                         f"{value!r}")
    unknown = sorted(set(value) - {f.name for f in fields(Sampling)})
    if unknown:
        raise ValueError(f"Sampling: unknown field(s) {unknown}")
    for name, item in value.items():
        problem = _sampling_type_problem(name, item)
        if problem:
            raise ValueError(f"Sampling.{problem}")
    return value


ABC_DEFAULTS = Sampling(temperature=0.7, top_p=0.9, top_k=30, repetition_penalty=1.005,
                        penalty_window=100, min_tokens=32, max_tokens=4096)
SEMANTIC_DEFAULTS = Sampling()


def resolve_sampling(value: Sampling | dict | None, default: Sampling) -> Sampling:
    """None → the default; a Sampling as is; a dict overrides fields of the default."""
    if value is None:
        return default
    if isinstance(value, Sampling):
        return value
    if isinstance(value, dict):
        return replace(default, **check_sampling_overrides(value))
    raise ValueError(f"sampling must be None, a Sampling or a dict, got {type(value).__name__}")


@dataclass(frozen=True)
class GenerationConfig:
    """Per-phase sampling plus the NAR solver settings."""

    abc: Sampling = field(default_factory=lambda: ABC_DEFAULTS)
    semantic: Sampling = field(default_factory=lambda: SEMANTIC_DEFAULTS)
    ode_steps: int = 32
    ode_method: str = "midpoint"
    # The NAR's chunk context: a song whose prefix + 2·frames + 3 exceeds it runs in several chunks. The AR
    # phases always have the model's 24,576 positions; a smaller value only exercises the chunked NAR on a
    # tiny model (the real model's songs reach a second chunk only past ~(24,576 - prefix) / 2 frames).
    context: int = CONTEXT
    version: str = PROTOCOL_VERSION

    def __post_init__(self):
        if not _is_int(self.ode_steps) or self.ode_steps < 1:
            raise ValueError(f"GenerationConfig.ode_steps must be a positive integer, got {self.ode_steps!r}")
        if self.ode_method != "midpoint":
            raise ValueError(f"GenerationConfig.ode_method must be 'midpoint', got {self.ode_method!r}")
        if not _is_int(self.context) or not 1 <= self.context <= CONTEXT:
            raise ValueError(f"GenerationConfig.context must be an integer in [1, {CONTEXT}], got {self.context!r}")
        if self.version != PROTOCOL_VERSION:
            raise ValueError(f"GenerationConfig.version must be {PROTOCOL_VERSION!r}, got {self.version!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "GenerationConfig":
        """Fields over the defaults; a phase's sampling may be partial and may also be spelled as in
        request files (`abc_sampling`, `semantic_sampling`)."""
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"GenerationConfig must be an object, got {type(data).__name__}")
        data = dict(data or {})
        for phase in PHASES:
            alias = f"{phase}_sampling"
            if alias in data:
                if phase in data:
                    raise ValueError(f"GenerationConfig: give {phase!r} or {alias!r}, not both")
                data[phase] = data.pop(alias)
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"GenerationConfig: unknown field(s) {unknown}; the fields are abc (or abc_sampling), "
                             f"semantic (or semantic_sampling), {', '.join(known[2:])}")
        for phase, default in (("abc", ABC_DEFAULTS), ("semantic", SEMANTIC_DEFAULTS)):
            try:
                data[phase] = resolve_sampling(data.get(phase), default)
            except ValueError as exc:
                raise ValueError(f"GenerationConfig.{phase}: {exc}") from None
        return cls(**data)


def ar_signals(logprobs: Sequence[float | None], tokens: int, cached: int | None, prompt_tokens: int) -> dict:
    """A phase's per-song signals: the mean raw log-prob the model gave its sampled tokens (end token included;
    the cond branch's own under CFG, before the phase's penalty, temperature and top-k/p) and how many prompt
    tokens came from the engine's prefix cache (None: the backend has none)."""
    values = [float(v) for v in list(logprobs)[:tokens] if v is not None]
    return {"mean_logprob": sum(values) / len(values) if values else None, "logprob_tokens": len(values),
            "cached_prompt_tokens": cached, "prompt_tokens": prompt_tokens}


# --------------------------------------------------------------------------- prompts


def base_prompt(request: SongRequest, tokenizer: TextEncoder) -> list[int]:
    return [EOD] + tokenizer.encode(request.text())


def check_abc_ids(abc_ids: Sequence[int]) -> list[int]:
    return check_token_ids(abc_ids, "abc_ids", 0, EOD, "an ordinary text id")


def abc_prompt(request: SongRequest, tokenizer: TextEncoder) -> list[int]:
    """Prompt of the abc (score) phase: `[EOD] text <abc>`."""
    if request.cot == "off":
        raise ValueError("cot 'off' has no abc phase")
    if request.abc is not None:
        raise ValueError("the request carries an external ABC score; there is no abc phase")
    return base_prompt(request, tokenizer) + [ABC_START]


def semantic_prompt(request: SongRequest, tokenizer: TextEncoder, abc_ids: Sequence[int] | None = None) -> list[int]:
    """Prompt of the semantic phase. `abc_ids` are the exact generated ids (never re-tokenized).

    cot=off: `[EOD] text <abc></abc> MUSIC_START`. Otherwise
    `[EOD] text <abc> abc_ids </abc> MUSIC_START`, where an external score is encoded once.
    """
    base = base_prompt(request, tokenizer)
    if request.cot == "off":
        if abc_ids:
            raise ValueError("cot 'off' takes no abc_ids")
        return base + [ABC_START, ABC_END, MUSIC_START]
    if abc_ids is None:
        if request.abc is None:
            raise ValueError("semantic prompt needs the abc ids of the score phase")
        abc_ids = tokenizer.encode(request.abc)
    return base + [ABC_START] + check_abc_ids(abc_ids) + [ABC_END, MUSIC_START]


def negative_prompt(request: SongRequest, tokenizer: TextEncoder, abc_ids: Sequence[int] | None = None) -> list[int]:
    """Unconditional CFG branch: instruction text only (no tags or lyrics), same ABC ids."""
    base = [EOD] + tokenizer.encode(INSTRUCTIONS[request.cot])
    if request.cot == "off":
        return base + [MUSIC_START]
    if abc_ids is None:
        raise ValueError("the negative prompt needs the exact positive abc ids")
    return base + [ABC_START] + check_abc_ids(abc_ids) + [ABC_END, MUSIC_START]


def check_budget(prompt: Sequence[int], max_tokens: int, what: str = "prompt") -> None:
    """Hard error, never silent truncation, when a prompt plus its budget exceed the context; the
    prompt must be integer ids inside the vocabulary (every backend checks its prompts here)."""
    check_token_ids(prompt, what)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"{what}: max_tokens must be a positive integer, got {max_tokens!r}")
    if len(prompt) + max_tokens > CONTEXT:
        raise ValueError(f"{what} of {len(prompt)} tokens + max_tokens {max_tokens} = "
                         f"{len(prompt) + max_tokens} exceeds the {CONTEXT}-token context")



@dataclass(frozen=True)
class ContextBudget:
    """What a request asks of the 24,576-token context: the prompt before the song (the text, and a given score or
    the `</abc>` MUSIC_START a generated one is closed with), the generated score's budget (0: none is generated)
    and the song's (semantic max_tokens, or `seconds` at 25 a second)."""

    prompt: int
    score: int
    song: int
    seconds: float | None = None  # the request's length, when it set the song's budget
    given_score: bool = False  # the prompt holds a given (external) score

    @property
    def total(self) -> int:
        return self.prompt + self.score + self.song

    @property
    def over(self) -> int:
        """Tokens past the context (<= 0: it fits)."""
        return self.total - CONTEXT

    @property
    def longest_song(self) -> int:
        """The most semantic tokens this prompt and score budget leave the song."""
        return max(0, CONTEXT - self.prompt - self.score)

    def refusal(self, song_min_tokens: int = 1, score_min_tokens: int = 1) -> str:
        """One line naming what to shorten and by how much (for a budget that does not fit)."""
        over = self.over
        if self.score:
            what = f"semantic prompt (with a score of up to abc max_tokens {self.score}) of {self.prompt + self.score}"
        else:
            what = f"semantic prompt of {self.prompt}"
        line = (f"the request is too long: {what} tokens + max_tokens {self.song} = {self.total} exceeds the "
                f"{CONTEXT}-token context")
        texts = "lyrics, style or score" if self.given_score else "lyrics or style"
        fixes = [f"shorten the {texts} by {over} tokens"]
        room = self.song - over
        if room >= max(1, song_min_tokens):
            if self.seconds is not None:
                fixes.insert(0, f"lower seconds to at most {seconds_for_tokens(room):g} ({room} tokens; asked: "
                                f"{self.seconds:g})")
            else:
                fixes.append(f"lower semantic_sampling.max_tokens to {room} ({tokens_seconds(room):g} s of song)")
        if self.score and self.score - over >= max(1, score_min_tokens):
            fixes.append(f"lower abc_sampling.max_tokens to {self.score - over}")
        line += "; " + ", or ".join(fixes)
        return f"seconds: {line}" if self.seconds is not None else line


@dataclass(frozen=True)
class SongRules:
    """What admitting a song takes, without any weights: each phase's sampling defaults, the tokenizer (the
    prompt's length) and whether the engine is batch-invariant. The pipeline holds one; so does a server whose
    songs run on other processes (Ray replicas), which must refuse what a replica would refuse."""

    generation: GenerationConfig
    tokenizer: TextEncoder
    reproducible: bool = False
    adapters: dict = field(default_factory=dict)  # registered adapter name -> what GET /v1/adapters lists of it

    def check_adapters(self, request: SongRequest) -> None:
        """Every adapter the request names is registered (ValueError naming it and the registered ones)."""
        for index, ref in enumerate(request.adapters):
            if ref.name not in self.adapters:
                raise ValueError(f"adapters[{index}]: unknown adapter {ref.name!r} (registered: "
                                 f"{', '.join(sorted(self.adapters)) or 'none'})")

    def sampling_for(self, overrides: dict | Sampling | None, phase: str) -> Sampling:
        return resolve_sampling(overrides, getattr(self.generation, phase))

    def phase_sampling(self, request: SongRequest, overrides: dict | Sampling | None, phase: str) -> Sampling:
        """How `request` samples `phase`: the overrides over the defaults and, for the semantic phase, the request's
        `seconds` as its token budget (max_tokens). A `seconds` that cannot be one raises a ValueError beginning
        `seconds:`; bad overrides one beginning `<phase>_sampling:`."""
        if phase != "semantic" or request.seconds is None:
            try:
                return self.sampling_for(overrides, phase)
            except ValueError as exc:
                raise ValueError(f"{phase}_sampling: {exc}") from None
        if isinstance(overrides, dict) and "max_tokens" in overrides:
            raise ValueError("seconds: seconds and semantic_sampling.max_tokens both set the song's token budget; "
                             "give one of them")
        cap = seconds_tokens(request.seconds)
        if isinstance(overrides, Sampling):
            overrides = overrides.to_dict()
        min_tokens = (overrides or {}).get("min_tokens", self.generation.semantic.min_tokens)
        if _is_int(min_tokens) and cap < min_tokens:
            least = seconds_for_tokens(min_tokens)
            least = least if seconds_tokens(least) >= min_tokens else round(least + 0.01, 2)
            raise ValueError(f"seconds: {request.seconds:g} caps the song at {cap} tokens, below the semantic phase's "
                             f"min_tokens {min_tokens}; ask for at least {least:g} seconds, or lower "
                             "semantic_sampling.min_tokens")
        try:
            return self.sampling_for({**(overrides or {}), "max_tokens": cap}, phase)
        except ValueError as exc:
            raise ValueError(f"{phase}_sampling: {exc}") from None

    def budget(self, request: SongRequest, abc_sampling=None, semantic_sampling=None) -> ContextBudget:
        """What the request asks of the context (see ContextBudget); an instrumental is counted as the request that
        plans its score, or renders its given one."""
        prompt, score, given = self._before_song(request, abc_sampling)
        song = self.phase_sampling(request, semantic_sampling, "semantic").max_tokens
        return ContextBudget(prompt, score, song, request.seconds, given)

    def _before_song(self, request: SongRequest, abc_sampling) -> tuple[int, int, bool]:
        """`(prompt tokens, score budget, whether a score is given)` of what precedes the song."""
        if request.instrumental:
            from .instrumental import admission_request

            request = admission_request(request)
        if request.cot == "off" or request.abc is not None:
            return len(semantic_prompt(request, self.tokenizer)), 0, request.abc is not None
        # As upstream, nothing is truncated: the semantic prompt will hold the generated score, so a song is
        # admitted only if a score of the abc phase's whole budget leaves its budget room.
        return len(abc_prompt(request, self.tokenizer)) + 2, self.phase_sampling(request, abc_sampling, "abc").max_tokens, \
            False

    def check_fields(self, request: SongRequest, abc_sampling=None, semantic_sampling=None) -> None:
        """Refuse what is wrong whatever the context: adapters that are not registered, each phase's overrides (also
        of a phase the request skips, as with a given score) and a `seconds` that cannot cap the song."""
        self.check_adapters(request)
        for phase, overrides in (("abc", abc_sampling), ("semantic", semantic_sampling)):
            self.phase_sampling(request, overrides, phase)

    def check_request(self, request: SongRequest, abc_sampling=None, semantic_sampling=None) -> None:
        """Refuse, before any stage runs, overrides that do not resolve, a `seconds` that cannot cap the song, and
        prompts that cannot fit the context with their token budgets (a generated score can only make the semantic
        prompt longer): one line naming what to shorten and by how much; and what `check_fields` refuses."""
        self.check_fields(request, abc_sampling, semantic_sampling)
        budget = self.budget(request, abc_sampling, semantic_sampling)
        if budget.over > 0:
            semantic = self.phase_sampling(request, semantic_sampling, "semantic")
            score_min = self.phase_sampling(request, abc_sampling, "abc").min_tokens if budget.score else 1
            raise ValueError(budget.refusal(semantic.min_tokens, score_min))

    def longest_song(self, request: SongRequest, abc_sampling=None) -> dict:
        """The longest song this request's prompt (and score budget) leaves room for, whatever its `seconds`: its
        tokens and seconds, and the prompt and score budget that take the rest of the context."""
        prompt, score, _ = self._before_song(request, abc_sampling)
        tokens = max(0, CONTEXT - prompt - score)
        return {"tokens": tokens, "seconds": seconds_for_tokens(tokens), "prompt_tokens": prompt,
                "score_budget_tokens": score, "context_tokens": CONTEXT}


def chunk_ranges(frames: int, prefix_tokens: int, context: int = CONTEXT) -> list[tuple[int, int]]:
    """NAR chunks `[a, b)` over the codec frames so that prefix + n + 1 AR and n + 2 NAR fit the context."""
    if not _is_int(frames) or frames < 0:
        raise ValueError(f"frames must be a non-negative integer, got {frames!r}")
    if not _is_int(prefix_tokens) or prefix_tokens < 1:
        raise ValueError(f"prefix_tokens must be a positive integer, got {prefix_tokens!r}")
    if not _is_int(context) or not 1 <= context <= CONTEXT:
        raise ValueError(f"context must be an integer in [1, {CONTEXT}] (the model's positions), got {context!r}")
    size = min((context - prefix_tokens - 3) // 2, CONTEXT)
    if size < 1:
        raise ValueError(f"prefix of {prefix_tokens} tokens leaves no room for audio in a {context}-token context")
    return [(start, min(start + size, frames)) for start in range(0, frames, size)]
