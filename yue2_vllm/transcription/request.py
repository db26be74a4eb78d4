"""What to transcribe and how: one frozen request the faces build (CLI flags, a form's fields, a batch row) and
check once; a field the chosen transcriber does not take is refused, naming it."""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Mapping

from ..score import KEYS
from .result import TranscriptionError

TRANSCRIBERS = ("pyin", "sheetsage2")
# Where the melody goes: the built-in transcriber writes one line into Vocal (or Ins); SheetSage2 writes both of its
# melodies and keeps both, or one with the other silenced (upstream's strip-chords --keep-voice).
VOICES = {"pyin": ("vocal", "ins"), "sheetsage2": ("both", "vocal", "ins")}
DEFAULT_VOICE = {"pyin": "vocal", "sheetsage2": "both"}
BPM_RANGE = (30.0, 300.0)  # the tempi a request may give (quarter notes a minute)
METER_DENOMINATORS = (2, 4, 8, 16)
MAX_BEATS_PER_BAR = 16
DEFAULT_METER = "4/4"
MAX_LYRICS_CHARS = 20_000
# Fields only the built-in transcriber takes: SheetSage2 finds the tempo, meter, key and downbeat itself.
PYIN_ONLY = ("bpm", "meter", "key", "pickup_beats")


def parse_meter(text: str, field: str = "meter") -> tuple[int, int]:
    match = re.fullmatch(r"([1-9][0-9]?)/([0-9]+)", text) if isinstance(text, str) else None
    if match is None or int(match.group(2)) not in METER_DENOMINATORS or int(match.group(1)) > MAX_BEATS_PER_BAR:
        raise TranscriptionError(field, f"{text!r} is not a meter this transcriber writes (n/d with n from 1 to "
                                        f"{MAX_BEATS_PER_BAR} and d one of {', '.join(map(str, METER_DENOMINATORS))},"
                                        " as 4/4, 3/4 or 6/8)")
    return int(match.group(1)), int(match.group(2))


def _number(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TranscriptionError(field, f"expected a number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TranscriptionRequest:
    """`transcriber`: "pyin" (built in: one melodic line, a hum, a whistle, a sung or played melody) or
    "sheetsage2" (full mixes, out of process). `bpm` (quarter notes a minute; default: found from the notes),
    `meter` (default 4/4), `key` (a K: key as G or F#m; default: found from the pitch classes) and `pickup_beats`
    (beats before the first downbeat; default: found from where the notes fall) are the built-in transcriber's.
    `lyrics`: the song's lyrics; their section tags become the score's `% section` labels (built in) and their
    syllables are counted against the notes. `voice`: where the melody goes (see VOICES)."""

    transcriber: str = "pyin"
    bpm: float | None = None
    meter: str | None = None
    key: str | None = None
    lyrics: str = ""
    voice: str | None = None
    pickup_beats: float | None = None

    def __post_init__(self):
        if self.transcriber not in TRANSCRIBERS:
            raise TranscriptionError("transcriber", f"{self.transcriber!r} is not a transcriber (one of "
                                                    f"{', '.join(TRANSCRIBERS)})")
        if self.transcriber != "pyin":
            given = [name for name in PYIN_ONLY if getattr(self, name) is not None]
            if given:
                raise TranscriptionError(given[0], f"{self.transcriber} finds the tempo, meter, key and downbeat "
                                                   f"itself; {given[0]} is for the pyin transcriber")
        if self.bpm is not None:
            bpm = _number(self.bpm, "bpm")
            if not BPM_RANGE[0] <= bpm <= BPM_RANGE[1]:
                raise TranscriptionError("bpm", f"{self.bpm} is outside {BPM_RANGE[0]:g}-{BPM_RANGE[1]:g} quarter "
                                                "notes a minute")
        beats = parse_meter(self.meter)[0] if self.meter is not None else None
        if self.key is not None and (not isinstance(self.key, str) or self.key not in KEYS):
            raise TranscriptionError("key", f"{self.key!r} is not a key the score can name (a major or minor key "
                                            "with at most 7 sharps or flats, as G, Bb, F#m or Ebm)")
        if not isinstance(self.lyrics, str):
            raise TranscriptionError("lyrics", f"expected text, got {type(self.lyrics).__name__}")
        if len(self.lyrics) > MAX_LYRICS_CHARS:
            raise TranscriptionError("lyrics", f"{len(self.lyrics)} characters, more than {MAX_LYRICS_CHARS}")
        if self.voice is not None and self.voice not in VOICES[self.transcriber]:
            raise TranscriptionError("voice", f"{self.voice!r} is not a voice the {self.transcriber} transcriber "
                                              f"writes (one of {', '.join(VOICES[self.transcriber])})")
        if self.pickup_beats is not None:
            pickup = _number(self.pickup_beats, "pickup_beats")
            limit = beats or parse_meter(DEFAULT_METER)[0]
            if not 0 <= pickup < limit or (pickup * 4) % 1:
                raise TranscriptionError("pickup_beats", f"{self.pickup_beats} is not a pickup the grid writes "
                                                         f"(0 up to {limit} beats, in quarter beats)")

    @property
    def melody_voice(self) -> str:
        """Where the melody goes: "Vocal", "Ins" or "both"."""
        voice = self.voice or DEFAULT_VOICE[self.transcriber]
        return {"vocal": "Vocal", "ins": "Ins", "both": "both"}[voice]

    @property
    def meter_pair(self) -> tuple[int, int]:
        return parse_meter(self.meter or DEFAULT_METER)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> "TranscriptionRequest":
        """A request from JSON-like fields (a batch row, a form); an unknown field is refused, naming it."""
        if not isinstance(data, Mapping):
            raise TranscriptionError("request", f"expected an object of fields, got {type(data).__name__}")
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TranscriptionError(unknown[0], "not a transcription field (the fields are "
                                                 f"{', '.join(sorted(known))})")
        return cls(**data)
