"""The built-in transcriber, for a single melodic line (a hum, a whistle, a sung or played melody): pYIN's notes
(pitch.py) onto the grid (tempo.py), the key from their pitch classes (key.py), the lyrics' sections placed
(sections.py), written in the melody-mode dialect (writer.py) and read back by the project's upstream-exact reader
before it is returned."""
from __future__ import annotations

import time
from fractions import Fraction

from ..score import read_score
from .audio import read_audio
from .key import estimate_key
from .pitch import notes_from_track, require_librosa, track_pitch
from .result import Note, Transcription, TranscriptionError, TranscriptionWarning
from .sections import place_sections
from .tempo import STEPS_PER_BEAT, drift, drift_warning, quantize
from .writer import melody_score, written_sections

NAME = "pyin"
VERSION = "1"  # this transcriber's rules; the version string adds librosa's
MAX_SECONDS = 360.0  # six minutes: pYIN's time grows with the length (see docs/covers.md for the measured rate)
MIN_NOTES_FOR_TEMPO = 4  # the tempo is found from the notes' onsets: fewer than this needs a given bpm
TUNING_WARNING = 0.2  # semitones off concert pitch that a musician should hear about
SINGING_RANGE = (40, 84)  # E2 to C6: outside it, a melody lies beyond what a voice sings


def _range_warning(pitches) -> TranscriptionWarning | None:
    low, high = min(pitches), max(pitches)
    if SINGING_RANGE[0] <= low and high <= SINGING_RANGE[1]:
        return None
    return TranscriptionWarning(
        "range", f"range: the melody spans MIDI {low}-{high}, beyond a singing voice's {SINGING_RANGE[0]}-"
                 f"{SINGING_RANGE[1]} (E2-C6); YuE2 may sing it in another octave (a whistle sounds an octave or two "
                 "above the voice)", {"lowest": low, "highest": high, "singing_range": list(SINGING_RANGE)})


def _tuning_warning(tuning: float) -> TranscriptionWarning | None:
    if abs(tuning) < TUNING_WARNING:
        return None
    cents = round(tuning * 100)
    return TranscriptionWarning(
        "tuning", f"tuning: the source is {abs(cents)} cents {'sharp' if cents > 0 else 'flat'} of concert pitch; "
                  "its notes are read against its own tuning", {"cents": cents})


def _check_read_back(abc: str, expected: list, voice: str, bpm: int) -> None:
    score = read_score(abc)
    others = [name for name in score.voices if name != voice]
    if score.voices[voice].notes != expected or score.bpm != bpm or any(score.voices[o].notes for o in others):
        raise RuntimeError("the transcription's score does not read back as the notes it was written from "
                           "(please report it with the audio)")


def transcribe_pyin(audio, request) -> Transcription:
    """`audio`: a path, bytes or binary file; `request`: a TranscriptionRequest for "pyin"."""
    librosa = require_librosa()  # a missing extra is said before the audio is read
    clock = time.perf_counter()
    audio = read_audio(audio, max_seconds=MAX_SECONDS)
    timing, clock = {"read_seconds": time.perf_counter() - clock}, time.perf_counter()
    track = track_pitch(audio.samples, audio.info.sample_rate)
    timing["pitch_seconds"], clock = time.perf_counter() - clock, time.perf_counter()
    heard, tuning = notes_from_track(track)
    if not heard:
        raise TranscriptionError("audio", "no pitched notes: pYIN heard no steady pitch between C2 and C7 (a hum, a "
                                          "whistle, or a sung or played melody, one note at a time)")
    if request.bpm is None and len(heard) < MIN_NOTES_FOR_TEMPO:
        raise TranscriptionError("audio", f"only {len(heard)} note{'s' if len(heard) > 1 else ''} heard; finding the "
                                          f"tempo needs at least {MIN_NOTES_FOR_TEMPO} (or give bpm)")
    meter = request.meter_pair
    onsets, offsets = [note.onset for note in heard], [note.offset for note in heard]
    grid = quantize(onsets, offsets, meter, request.bpm, request.pickup_beats)
    pitches = [note.pitch for note in heard]
    key = request.key or estimate_key(pitches, grid.lengths)
    timing["notes_seconds"], clock = time.perf_counter() - clock, time.perf_counter()
    report = drift(grid, onsets)
    labels, warnings = place_sections(request.lyrics, grid.positions, grid.lengths, grid.bar_steps) \
        if request.lyrics.strip() else ({}, [])
    voice = request.melody_voice
    placed = list(zip(grid.positions, grid.lengths, pitches))
    abc = melody_score(placed, meter=meter, key=key, bpm=grid.written_bpm, voice=voice, sections=labels)
    unit = Fraction(1, meter[1])  # quarter notes a step
    _check_read_back(abc, [[p * unit, pitch, n * unit] for p, n, pitch in placed], voice, grid.written_bpm)
    timing["score_seconds"] = time.perf_counter() - clock
    notes = tuple(Note(note.onset, note.offset - note.onset, note.pitch, position * unit, length * unit, voice)
                  for note, position, length in zip(heard, grid.positions, grid.lengths))
    found = [drift_warning(report), _tuning_warning(tuning), _range_warning(pitches), *warnings]
    details = {"tuning_cents": round(tuning * 100, 1), "heard_notes": len(heard),
               "first_note_step": grid.positions[0], "steps_per_beat": STEPS_PER_BEAT,
               "bpm_given": request.bpm is not None, "key_given": request.key is not None}
    return Transcription(abc, NAME, f"{NAME}-{VERSION} (librosa {librosa.__version__})", audio.info,
                         grid.written_bpm, f"{meter[0]}/{meter[1]}", key, notes,
                         tuple(warning for warning in found if warning is not None), None, timing, request,
                         tempo=report, sections=written_sections(labels), details=details)
