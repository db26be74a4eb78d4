"""A score's music (`score_notes.ScoreNotes`) as a Standard MIDI File, format 1: a conductor track (tempo from
Q:, each meter and key, each section label as a marker), then one track a voice, Vocal on channel 1 and Ins on
channel 2, and, when the score has chord symbols, a Chords track on channel 3 (each symbol as a text event over its
plain voicing). Pure: bytes in memory, no dependency."""
from __future__ import annotations

import struct
from fractions import Fraction
from math import lcm

from .score import KEYS

TICKS_PER_QUARTER = 480  # divides every power-of-two grid down to 1/32 of a quarter, and triplets
MAX_TICKS_PER_QUARTER = 0x7FFF  # the header's division field
FALLBACK_TICKS_PER_QUARTER = 3840  # the reader's finest grid (1/256 of a quarter) and triplets: rounded there
VELOCITY = {"Vocal": 96, "Ins": 88, "Chords": 56}
PROGRAM = {"Vocal": 53, "Ins": 0, "Chords": 48}  # General MIDI: voice oohs, acoustic grand piano, strings
CHANNEL = {"Vocal": 0, "Ins": 1, "Chords": 2}
NOTE_OFF_VELOCITY = 64
MAX_VARIABLE_LENGTH = 0x0FFFFFFF  # the largest variable-length quantity (four bytes) a Standard MIDI File holds


def ticks_per_quarter(notes) -> int:
    """The division that places every onset and length exactly (480 unless a finer grid or a tuplet needs more;
    past what the header holds, FALLBACK_TICKS_PER_QUARTER, where times round to the nearest tick)."""
    times = [t for voice in notes.voices.values() for n in voice for t in (n.onset, n.duration)]
    times += [t for c in notes.chords for t in (c.onset, c.duration)]
    times += [at for at, _ in (*notes.meters, *notes.keys, *notes.sections)]
    division = lcm(TICKS_PER_QUARTER, *(Fraction(t).denominator for t in times))
    return division if division <= MAX_TICKS_PER_QUARTER else FALLBACK_TICKS_PER_QUARTER


def variable_length(value: int) -> bytes:
    """A MIDI variable-length quantity: 7 bits a byte, most significant first, the high bit on all but the last; at
    most four bytes (MAX_VARIABLE_LENGTH), as the standard allows."""
    if value < 0:
        raise ValueError(f"a MIDI delta time cannot be negative, got {value}")
    if value > MAX_VARIABLE_LENGTH:
        raise ValueError(f"MIDI cannot write {value} ticks or bytes in one variable-length quantity (at most "
                         f"{MAX_VARIABLE_LENGTH} = 0x0FFFFFFF, four bytes): a delta time or length that long")
    groups = [value & 0x7F]
    value >>= 7
    while value:
        groups.append(0x80 | value & 0x7F)
        value >>= 7
    return bytes(reversed(groups))


def _meta(kind: int, data: bytes) -> bytes:
    return bytes([0xFF, kind]) + variable_length(len(data)) + data


def _track(events: list[tuple[int, int, bytes]]) -> bytes:
    """An MTrk chunk from (tick, order, event bytes), sorted (at one tick, lower order first), with its end."""
    body, now = bytearray(), 0
    for tick, _, event in sorted(events, key=lambda e: (e[0], e[1])):
        body += variable_length(tick - now) + event
        now = tick
    body += variable_length(0) + _meta(0x2F, b"")
    return b"MTrk" + struct.pack(">I", len(body)) + bytes(body)


def _at(time, division: int) -> int:
    return round(Fraction(time) * division)


def _notes_track(name: str, notes: list[tuple], division: int, texts=()) -> bytes:
    """A voice's track: its name, its program, its notes `(onset, duration, pitch)` (at one tick the note offs
    first, so a repeated pitch sounds again), and texts `(onset, text)` before the notes they stand over."""
    channel = CHANNEL[name]
    events = [(0, 0, _meta(0x03, name.encode("ascii"))), (0, 1, bytes([0xC0 | channel, PROGRAM[name]]))]
    events += [(_at(at, division), 2, _meta(0x01, text.encode("utf-8"))) for at, text in texts]
    for onset, duration, pitch in notes:
        start, stop = _at(onset, division), _at(onset + duration, division)
        events.append((start, 4, bytes([0x90 | channel, pitch, VELOCITY[name]])))
        events.append((stop, 3, bytes([0x80 | channel, pitch, NOTE_OFF_VELOCITY])))
    return _track(events)


def _tempo(bpm: int) -> bytes:
    """Q:'s quarter notes a minute as the set-tempo event's microseconds a quarter (rounded to the microsecond)."""
    tempo = round(Fraction(60_000_000, bpm))
    if not 1 <= tempo <= 0xFFFFFF:
        raise ValueError(f"MIDI cannot write the tempo Q:1/4={bpm} (a quarter note of {tempo} microseconds; "
                         "it takes 1 to 16777215)")
    return tempo.to_bytes(3, "big")


def _conductor(notes, division: int) -> bytes:
    events = [(0, 0, _meta(0x03, b"score")), (0, 1, _meta(0x51, _tempo(notes.bpm)))]
    for at, (n, d) in notes.meters:
        if n > 0xFF:
            raise ValueError(f"MIDI cannot write the meter {n}/{d} (a numerator up to 255)")
        clocks = 96 // d if d <= 96 else 1  # MIDI clocks (24 a quarter) a beat of the meter's unit
        events.append((_at(at, division), 2, _meta(0x58, bytes([n, d.bit_length() - 1, clocks, 8]))))
    for at, key in notes.keys:
        events.append((_at(at, division), 3, _meta(0x59, struct.pack(">bB", KEYS[key], key.endswith("m")))))
    for at, label in notes.sections:
        events.append((_at(at, division), 4, _meta(0x06, label.encode("utf-8"))))
    return _track(events)


def midi_file(notes) -> bytes:
    """The Standard MIDI File (format 1) of a score's music (`score_notes.ScoreNotes`)."""
    division = ticks_per_quarter(notes)
    tracks = [_conductor(notes, division)]
    for name, voice in notes.voices.items():
        tracks.append(_notes_track(name, [(n.onset, n.duration, n.pitch) for n in voice], division))
    if notes.chords:
        tones = [(c.onset, c.duration, pitch) for c in notes.chords for pitch in c.pitches]
        tracks.append(_notes_track("Chords", tones, division, [(c.onset, c.symbol) for c in notes.chords]))
    header = b"MThd" + struct.pack(">IHHH", 6, 1, len(tracks), division)
    return header + b"".join(tracks)
