"""What a transcription returns, and how a transcriber refuses.

A `Transcription` is the score (the native melody-mode ABC, read back by `score.read_score` before it is returned)
with everything a face shows or records beside it: who wrote it (transcriber and version), what it was written from
(the source's sha256, length and format), the tempo, meter and key, the notes as heard and as written, the warnings
with their figures (the drift foretold among them), the licence where one applies, and the timings. `record()` is
its JSON (`transcription.json`); `files()` the files a face writes for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


class TranscriptionError(ValueError):
    """Input a transcriber refuses: `field` names what is wrong ("audio" for the file itself, else the request field),
    `reason` says why; str() is the one line `field: reason` (the faces answer 4xx naming the field)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason

    def __reduce__(self):
        return type(self), (self.field, self.reason)


class TranscriberUnavailable(RuntimeError):
    """A transcriber that cannot run here: not installed, not set up, or turned off; the message says what to do
    (the faces answer 503)."""

    def __init__(self, transcriber: str, reason: str):
        super().__init__(f"{transcriber}: {reason}")
        self.transcriber, self.reason = transcriber, reason

    def __reduce__(self):
        return type(self), (self.transcriber, self.reason)


@dataclass(frozen=True)
class Note:
    """One written note: where the source sounds it (`onset`, `duration`, seconds) and where the score writes it
    (`position`, `length`, quarter notes from the score's start), its MIDI pitch and voice."""

    onset: float
    duration: float
    pitch: int
    position: Fraction
    length: Fraction
    voice: str = "Vocal"

    def record(self) -> dict:
        return {"onset": round(self.onset, 4), "duration": round(self.duration, 4), "pitch": self.pitch,
                "position": str(self.position), "length": str(self.length), "voice": self.voice}


@dataclass(frozen=True)
class TranscriptionWarning:
    """Something a musician should check, in one line (`message`), with its figures (`figures`, JSON-ready);
    `code` says which kind (e.g. "drift", "tuning", "syllables", "range")."""

    code: str
    message: str
    figures: dict

    def record(self) -> dict:
        return {"code": self.code, "message": self.message, "figures": self.figures}


@dataclass(frozen=True)
class TempoReport:
    """How steady the source's tempo is and what one `Q:` makes of it. Offsets are the source's onset less the
    score's (aligned on the first note, at the written tempo): positive where the source comes later than the score.
    A beat is the meter's (a quarter note in 4/4, an eighth in 6/8)."""

    fitted_bpm: float  # the least-squares tempo over all notes (quarter notes a minute)
    written_bpm: int  # the score's Q:1/4
    local_bpm: tuple[float, float]  # the slowest and fastest two-bar stretch
    max_offset_beats: float  # the largest offset, signed
    max_offset_seconds: float
    max_offset_second: float  # the source second of that note
    end_offset_beats: float  # the last note's offset, signed
    end_offset_seconds: float
    end_second: float  # the source second of the last note
    first_beat_off_second: float | None  # the first note more than a beat off, None when none is

    def record(self) -> dict:
        return {"fitted_bpm": round(self.fitted_bpm, 3), "written_bpm": self.written_bpm,
                "local_bpm": [round(value, 3) for value in self.local_bpm],
                "max_offset_beats": round(self.max_offset_beats, 3),
                "max_offset_seconds": round(self.max_offset_seconds, 3),
                "max_offset_second": round(self.max_offset_second, 3),
                "end_offset_beats": round(self.end_offset_beats, 3),
                "end_offset_seconds": round(self.end_offset_seconds, 3), "end_second": round(self.end_second, 3),
                "first_beat_off_second": None if self.first_beat_off_second is None
                else round(self.first_beat_off_second, 3)}


@dataclass(frozen=True)
class Transcription:
    """A melody-mode score transcribed from audio, and what a face shows beside it."""

    abc: str
    transcriber: str  # "pyin" | "sheetsage2"
    transcriber_version: str
    source: object  # audio.AudioInfo: sha256, bytes, seconds, sample rate, channels, format
    bpm: int  # the score's Q:1/4
    meter: str
    key: str
    notes: tuple[Note, ...]
    warnings: tuple[TranscriptionWarning, ...]
    licence: str | None
    timing: dict  # seconds per stage and in all ("total_seconds")
    request: object  # request.TranscriptionRequest
    tempo: TempoReport | None = None  # None where the source's timing is not known (no beats)
    sections: tuple[tuple[int, str], ...] = ()  # (bar, 1-based; label) where each `% label` is written
    details: dict | None = None  # the transcriber's own figures (tuning, device, revision, peak memory...)

    @property
    def source_sha256(self) -> str:
        return self.source.sha256

    def record(self) -> dict:
        """transcription.json: everything but the score's text (score.abc holds it)."""
        return {"transcriber": self.transcriber, "transcriber_version": self.transcriber_version,
                "source": self.source.record(), "score": "score.abc", "bpm": self.bpm, "meter": self.meter,
                "key": self.key, "notes": [note.record() for note in self.notes],
                "warnings": [warning.record() for warning in self.warnings], "licence": self.licence,
                "tempo": self.tempo.record() if self.tempo else None,
                "sections": [{"bar": bar, "label": label} for bar, label in self.sections],
                "request": self.request.to_dict(), "details": self.details or {},
                "timing": {name: round(value, 4) for name, value in self.timing.items()}}

    def summary(self) -> dict:
        """What a song rendered from this score records of it (`SongRequest.transcription`, result.json, an API
        answer): who wrote the score and from what, its tempo, meter and key, the warnings with their figures, the
        licence and the score's sha256 (so the song can tell whether it renders it unedited); no notes
        (transcription.json keeps them)."""
        import hashlib

        return {"transcriber": self.transcriber, "transcriber_version": self.transcriber_version,
                "source": self.source.record(), "bpm": self.bpm, "meter": self.meter, "key": self.key,
                "warnings": [warning.record() for warning in self.warnings], "licence": self.licence,
                "score_sha256": hashlib.sha256(self.abc.encode("utf-8")).hexdigest()}

    def files(self) -> dict[str, bytes]:
        """The files a face writes for it: score.abc (the score's exact text) and transcription.json."""
        from ..checkpoint import json_text

        return {"score.abc": self.abc.encode("utf-8"),
                "transcription.json": (json_text(self.record(), indent=2) + "\n").encode("utf-8")}
