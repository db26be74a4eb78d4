"""A melody on the grid written in upstream's melody-mode dialect, as SheetSage2's serializer writes it.

The header (X:1, a blank T:, the meter, L:1/(4·d) so one unit is one grid step, one integer Q:1/4, the two native
voice definitions, the key); groups of 1-4 bars, both voices the same bars, a new group where a `% section` label
starts; the melody in one voice and whole-bar rests (Z, Z2-Z4) in the other; notes cut at barlines and tied, each
piece one of the dialect's lengths (longest first); no chords, no `w:` lines. Pitches are spelled against the key
as SheetSage2 spells them: the key's scale, and between its notes the raised first, second, fourth and fifth degree
or the lowered seventh (so F natural is E# in D major, and A# in C major is Bb); an accidental is written where the
bar's earlier notes on that letter (in any octave) or the key do not already give it, on each tied piece of a note
inside a bar and again after a barline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..score import KEYS, NATURAL, VOICES, key_alterations, sized, split_length, write_score

LETTERS = "CDEFGAB"
MAJOR_TONICS = ("Cb", "Gb", "Db", "Ab", "Eb", "Bb", "F", "C", "G", "D", "A", "E", "B", "F#", "C#")  # -7..7 accidentals
MAJOR_SCALE = (0, 2, 4, 5, 7, 9, 11)
# Semitones above the tonic outside the scale -> (scale degree, 0-based; its alteration from the key's)
CHROMATIC = {1: (0, 1), 3: (1, 1), 6: (3, 1), 8: (4, 1), 10: (6, -1)}
MARKS = {-2: "__", -1: "_", 0: "=", 1: "^", 2: "^^"}
STEPS_PER_BEAT = 4


@dataclass(frozen=True)
class _Bar:
    meter: tuple[int, int]
    key: str
    section: str | None


def spell(pitch: int, key: str, marks: dict[str, int]) -> str:
    """`pitch` (MIDI) written in `key`, with an accidental where `marks` (the bar's accidentals so far, by letter;
    updated) and the key do not give it."""
    signature = key_alterations(key, 0)
    tonic = MAJOR_TONICS[KEYS[key] + 7]
    tonic_pitch = NATURAL[tonic[0]] + signature[tonic[0]]
    interval = (pitch - tonic_pitch) % 12
    degree, extra = (MAJOR_SCALE.index(interval), 0) if interval in MAJOR_SCALE else CHROMATIC[interval]
    letter = LETTERS[(LETTERS.index(tonic[0]) + degree) % 7]
    alteration = signature[letter] + extra
    mark = ""
    if marks.get(letter, signature[letter]) != alteration:
        mark, marks[letter] = MARKS[alteration], alteration
    octave = (pitch - alteration - 60 - NATURAL[letter]) // 12
    return mark + (letter + "," * -octave if octave <= 0 else letter.lower() + "'" * (octave - 1))


def _bar_text(notes: Sequence[tuple[int, int, int]], start: int, end: int, key: str) -> str:
    inside = [note for note in notes if note[0] < end and note[0] + note[1] > start]
    if not inside:
        return "Z"
    text, cursor, marks = [], start, {}
    for position, length, pitch in inside:
        a, b = max(start, position), min(end, position + length)
        text += [sized("z", count) for count in split_length(a - cursor)]
        name, pieces = spell(pitch, key, marks), split_length(b - a)
        for index, count in enumerate(pieces):
            text.append(sized(name, count) + ("-" if index < len(pieces) - 1 or b < position + length else ""))
        cursor = b
    text += [sized("z", count) for count in split_length(end - cursor)]
    return "".join(text)


def melody_score(notes: Sequence[tuple[int, int, int]], *, meter: tuple[int, int], key: str, bpm: int,
                 voice: str = "Vocal", sections: Mapping[int, str] | None = None) -> str:
    """The score of `notes` — (position, length, MIDI pitch), steps from the start of bar one, rising, not
    overlapping — in `voice` ("Vocal" or "Ins"), the other voice resting; `sections` maps a bar (0-based) to the
    label that starts there."""
    bar_steps = meter[0] * STEPS_PER_BEAT
    count = max(1, -(-max(position + length for position, length, _ in notes) // bar_steps)) if notes else 1
    labels, section, bars = dict(sections or {}), None, []
    for index in range(count):
        section = labels.get(index, section)
        bars.append(_Bar(meter, key, section))
    melody = [_bar_text(notes, index * bar_steps, (index + 1) * bar_steps, key) for index in range(count)]
    texts = {name: melody if name == voice else ["Z"] * count for name in VOICES}
    return write_score(bars, texts, bpm, STEPS_PER_BEAT * meter[1])


def written_sections(sections: Mapping[int, str] | None) -> tuple[tuple[int, str], ...]:
    """The labels a score written with `sections` shows: (bar, 1-based; label) where the label changes."""
    shown, last = [], None
    for bar, label in sorted((sections or {}).items()):
        if label != last:
            shown.append((bar + 1, label))
        last = label
    return tuple(shown)
