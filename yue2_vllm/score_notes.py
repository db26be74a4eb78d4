"""What a native score sounds like, read by the project's upstream-exact reader (`score.read_score`): each
voice's notes (onset and length in quarter notes, MIDI pitch), the chord symbols with a plain voicing, the tempo,
meters, keys and section labels, and the cot it renders with. The page draws, plays and checks scores from it;
`midi` writes it as a Standard MIDI File. Pure: no model, no files."""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from .score import NATURAL, VOICES, ScoreError, read_score, section_labels

# Each chord quality the dialect writes (instrumental's chord symbols), as semitones above its root.
CHORD_INTERVALS = {"": (0, 4, 7), "m": (0, 3, 7), "dim": (0, 3, 6), "aug": (0, 4, 8), "7": (0, 4, 7, 10),
                   "maj7": (0, 4, 7, 11), "m7": (0, 3, 7, 10), "dim7": (0, 3, 6, 9), "m7b5": (0, 3, 6, 10),
                   "sus4": (0, 5, 7), "sus2": (0, 2, 7), "6": (0, 4, 7, 9), "m6": (0, 3, 7, 9),
                   "7sus4": (0, 5, 7, 10), "m(maj7)": (0, 3, 7, 11)}
CHORD_ROOT, CHORD_BASS = 48, 36  # the voicing: the chord from its root in the octave of C3, its bass in C2's
_PITCH = r"([A-G])(bb|##|b|#)?"
_SYMBOL = re.compile(_PITCH + r"(.*?)(?:/" + _PITCH + r")?")
_SHIFT = {None: 0, "#": 1, "##": 2, "b": -1, "bb": -2}
_LINE = re.compile(r"score line (\d+): ")
# A MIDI file keeps the tempo as a quarter note's microseconds in 24 bits (1 to 16777215, `midi` rounds 60e6 / bpm to
# the microsecond): the Q: it can hold, slowest and fastest.
MIDI_BPM_RANGE = (4, 119_999_999)
TEMPO_LINE = 5  # the native header's Q:


@dataclass(frozen=True)
class Note:
    onset: Fraction  # quarter notes from the score's start
    duration: Fraction  # quarter notes, ties merged
    pitch: int  # MIDI


@dataclass(frozen=True)
class Chord:
    onset: Fraction
    duration: Fraction  # until the next chord symbol, or the score's end
    symbol: str
    pitches: tuple[int, ...]  # chord_pitches(symbol)


@dataclass(frozen=True)
class ScoreNotes:
    """A native score's music. Times are quarter notes from its start (Q: counts quarters a minute)."""

    bpm: int
    unit: Fraction  # L:
    bars: int
    quarters: Fraction  # its length
    voices: dict  # "Vocal" and "Ins" -> tuple[Note, ...], in time order
    chords: tuple[Chord, ...]  # Vocal's chord symbols (the dialect writes none in Ins)
    meters: tuple[tuple[Fraction, tuple[int, int]], ...]  # (onset, (n, d)): the first and every change
    keys: tuple[tuple[Fraction, str], ...]  # (onset, key): the first and every change
    sections: tuple[tuple[Fraction, str], ...]  # (onset, label): each `% label` at the bar it names

    @property
    def cot(self) -> str:
        """The cot the score renders with, upstream's rule: `full` when it has chord symbols, else `melody`."""
        return "full" if self.chords else "melody"

    @property
    def seconds_per_quarter(self) -> Fraction:
        return Fraction(60, self.bpm)

    def to_json(self) -> dict:
        """The music as the page takes it (times as numbers of quarter notes)."""
        return {
            "cot": self.cot, "bpm": self.bpm, "unit": f"{self.unit.numerator}/{self.unit.denominator}",
            "meter": _meter_text(self.meters[0][1]), "key": self.keys[0][1], "bars": self.bars,
            "quarters": float(self.quarters), "seconds": float(self.quarters * self.seconds_per_quarter),
            "voices": {name: [{"onset": float(n.onset), "duration": float(n.duration), "pitch": n.pitch}
                              for n in notes] for name, notes in self.voices.items()},
            "chords": [{"onset": float(c.onset), "duration": float(c.duration), "symbol": c.symbol,
                        "pitches": list(c.pitches)} for c in self.chords],
            "meters": [{"onset": float(at), "meter": _meter_text(meter)} for at, meter in self.meters],
            "keys": [{"onset": float(at), "key": key} for at, key in self.keys],
            "sections": [{"onset": float(at), "label": label} for at, label in self.sections],
        }


def _meter_text(meter: tuple[int, int]) -> str:
    return f"{meter[0]}/{meter[1]}"


def _pitch_class(letter: str, accidental: str | None) -> int:
    return (NATURAL[letter] + _SHIFT[accidental]) % 12


def chord_pitches(symbol: str) -> tuple[int, ...]:
    """A plain voicing of a chord symbol the dialect writes (`Cm7`, `F#sus4`, `G/B`): its bass (the slash note,
    else the root) in the octave from C2, then the chord's tones from its root in the octave from C3."""
    match = _SYMBOL.fullmatch(symbol)
    if match is None or match.group(3) not in CHORD_INTERVALS:
        raise ValueError(f"not a chord symbol of the native dialect: {symbol!r}")
    root = _pitch_class(match.group(1), match.group(2))
    bass = _pitch_class(match.group(4), match.group(5)) if match.group(4) else root
    return (CHORD_BASS + bass, *(CHORD_ROOT + root + step for step in CHORD_INTERVALS[match.group(3)]))


def _changes(pairs) -> tuple:
    """(onset, value) pairs in time order, each kept where its value changes (a later one at the same onset wins)."""
    kept: list = []
    for at, value in pairs:
        if kept and kept[-1][0] == at:
            kept.pop()
        if not kept or kept[-1][1] != value:
            kept.append((at, value))
    return tuple(kept)


def _chords(pairs, end: Fraction) -> tuple[Chord, ...]:
    symbols = []
    for at, symbol in pairs:  # one symbol an onset: the last written
        if symbols and symbols[-1][0] == at:
            symbols.pop()
        symbols.append((at, symbol))
    ends = [at for at, _ in symbols[1:]] + [end]
    return tuple(Chord(at, stop - at, symbol, chord_pitches(symbol)) for (at, symbol), stop in zip(symbols, ends))


def _sections(score) -> tuple[tuple[Fraction, str], ...]:
    """Each `% label` at the onset of the bar it starts (score.section_labels)."""
    bars = score.voices["Vocal"].bars
    return tuple((bars[index][0], label) for index, label in section_labels(score))


def score_notes(text: str) -> ScoreNotes:
    """The music of the native score `text`, or the reader's ScoreError naming the line that is wrong."""
    score = read_score(text)
    vocal = score.voices["Vocal"]
    voices = {name: tuple(Note(onset, duration, pitch) for onset, pitch, duration in score.voices[name].notes)
              for name in VOICES}
    return ScoreNotes(bpm=score.bpm, unit=score.unit, bars=len(vocal.bars), quarters=vocal.time, voices=voices,
                      chords=_chords(vocal.chords, vocal.time),
                      meters=_changes((start, meter) for start, _, meter in vocal.bars),
                      keys=_changes(vocal.keys), sections=_sections(score))


def problem_line(error: ScoreError) -> int | None:
    """The score line a ScoreError names."""
    match = _LINE.search(str(error))
    return int(match.group(1)) if match else None


def check_score(text: str) -> dict:
    """The reader's verdict on `text`, as POST /v1/scores/check answers it: `valid`, and either the music
    (`score`: ScoreNotes.to_json) or the first problem in one line (`problem`) and the line it names (`line`). A
    tempo a MIDI file cannot hold (MIDI_BPM_RANGE) is a problem too: the song's score.mid could not be written."""
    try:
        notes = score_notes(text)
    except ScoreError as exc:
        return {"valid": False, "problem": str(exc), "line": problem_line(exc), "score": None}
    slowest, fastest = MIDI_BPM_RANGE
    if not slowest <= notes.bpm <= fastest:  # it reads, but its score.mid could not be written
        problem = (f"score line {TEMPO_LINE}: the tempo Q:1/4={notes.bpm} is "
                   f"{'slower' if notes.bpm < slowest else 'faster'} than a MIDI file can hold (Q:1/4={slowest} to "
                   f"Q:1/4={fastest}: a quarter note of 1 to 16777215 microseconds)")
        return {"valid": False, "problem": problem, "line": TEMPO_LINE, "score": None}
    return {"valid": True, "problem": None, "line": None, "score": notes.to_json()}
