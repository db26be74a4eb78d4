"""One melodic line's notes, heard: librosa's pYIN pitch track (no weights) and its level, then notes from them.

`track_pitch` runs pYIN at 16 kHz over C2-C7 in quarter-semitone bins (librosa's default tenth of a semitone costs
six times as much in its Viterbi pass and a semitone grid gains nothing from it); frames far below the loudest are
not heard. `notes_from_track` is pure: each voiced stretch is split where the pitch moves to another semitone and
stays there (a vibrato around one note does not), and a note is split again where the sound dips (a repeated pitch
sung or played again); blips shorter than a note are dropped; a note's pitch is the median of its middle frames
(checked, and made exact, by plain YIN), less the source's tuning (found from those medians).
"""
from __future__ import annotations

from dataclasses import dataclass

ANALYSIS_RATE = 16000
FRAME = 1024  # samples: 64 ms, two periods of C2
HOP = 256  # samples: a frame every 16 ms
LEVEL_FRAME = 512  # samples: the level over 32 ms, short enough to see the gap between repeated notes
FMIN_MIDI, FMAX_MIDI = 36, 96  # C2 (65.4 Hz) to C7 (2093 Hz): a low voice to a whistle
RESOLUTION = 0.25  # semitones per pYIN pitch bin
SMOOTH_FRAMES = 5  # the median filter over the pitch track (80 ms)
SPLIT_SEMITONES = 0.7  # a pitch this far from the note's own ...
CHANGE_FRAMES = 3  # ... held this many frames (48 ms) starts a new note; a vibrato's +-50 cents never does
CHANGE_DIP_DB = 3.0  # a dip this deep just before a pitch change marks where the new note was attacked
DIP_DB = 6.0  # a dip this deep below the sound on both sides of it starts the note again
MIN_NOTE_SECONDS = 0.06
OCTAVE_AGREEMENT = 0.5  # semitones: how closely plain YIN's frames must agree to refine a note's pitch or octave
GATE_DB = 40.0  # frames this far below the loudest are unvoiced, whatever pYIN says (YIN hears pitch at any level)


@dataclass(frozen=True, eq=False)
class PitchTrack:
    """Per frame: the pitch in (fractional) MIDI numbers, NaN where unvoiced, and the level in dB; `yin_midi` is
    plain YIN's pitch (no path through the frames: it checks the octave pYIN's smooth path may take)."""

    midi: object  # numpy float64 [frames]
    level_db: object  # numpy float64 [frames]
    frame_seconds: float
    yin_midi: object = None  # numpy float64 [frames], or None


@dataclass(frozen=True)
class HeardNote:
    onset: float  # seconds
    offset: float
    pitch: int  # MIDI, the source's tuning taken out


def require_librosa():
    """librosa, or TranscriberUnavailable naming the extra to install."""
    try:
        import librosa
    except ImportError as exc:
        from .result import TranscriberUnavailable

        raise TranscriberUnavailable("pyin", f"the built-in transcriber needs librosa ({exc}): install the "
                                             "extra, pip install 'yue2-vllm[transcribe]'") from None
    return librosa


def track_pitch(samples, rate: int) -> PitchTrack:
    """pYIN over mono `samples` at `rate` Hz."""
    import numpy as np

    librosa = require_librosa()
    audio = np.asarray(samples, dtype=np.float32)
    if rate != ANALYSIS_RATE:
        audio = librosa.resample(audio, orig_sr=rate, target_sr=ANALYSIS_RATE)
    f0, voiced, _ = librosa.pyin(audio, fmin=librosa.midi_to_hz(FMIN_MIDI), fmax=librosa.midi_to_hz(FMAX_MIDI),
                                 sr=ANALYSIS_RATE, frame_length=FRAME, hop_length=HOP, resolution=RESOLUTION)
    rms = librosa.feature.rms(y=audio, frame_length=LEVEL_FRAME, hop_length=HOP)[0][:len(f0)]
    level = 20 * np.log10(np.maximum(rms, 1e-10)).astype(np.float64)
    heard = voiced & np.isfinite(f0) & (level >= level.max() - GATE_DB)
    midi = np.where(heard, librosa.hz_to_midi(np.where(np.isfinite(f0), f0, 1.0)), np.nan)
    yin = librosa.yin(audio, fmin=librosa.midi_to_hz(FMIN_MIDI), fmax=librosa.midi_to_hz(FMAX_MIDI),
                      sr=ANALYSIS_RATE, frame_length=FRAME, hop_length=HOP)[:len(f0)]
    return PitchTrack(midi.astype(np.float64), level, HOP / ANALYSIS_RATE,
                      librosa.hz_to_midi(yin).astype(np.float64))


def tuning_offset(pitches, weights) -> float:
    """The source's tuning in semitones (-0.5 to 0.5): the weighted circular mean of the notes' distances from the
    semitone grid (each note's median pitch, so a vibrato averages out)."""
    import numpy as np

    pitches, weights = np.asarray(pitches, float), np.asarray(weights, float)
    if not len(pitches):
        return 0.0
    mean = (weights * np.exp(2j * np.pi * pitches)).sum() / weights.sum()
    return float(np.angle(mean) / (2 * np.pi)) if abs(mean) > 1e-9 else 0.0


def _runs(mask) -> list[tuple[int, int]]:
    """The [start, end) frame ranges where `mask` holds."""
    import numpy as np

    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def _smoothed(pitch):
    """A centred running median (SMOOTH_FRAMES wide, narrower at the ends)."""
    import numpy as np

    half = SMOOTH_FRAMES // 2
    return np.array([np.median(pitch[max(0, i - half):i + half + 1]) for i in range(len(pitch))])


def _change_frame(raw, level, lo: int, found: int, old: float, new: float) -> int:
    """Where a pitch change found at frame `found` (late: the smoothing and CHANGE_FRAMES hold it back) began: just
    after the sound's lowest frame close before it, where it dips CHANGE_DIP_DB (a new attack); else the first frame
    from which the unsmoothed pitch stays nearer the new pitch than the old (a slur). Never at or before `lo`."""
    frames = range(max(lo + 1, found - CHANGE_FRAMES - SMOOTH_FRAMES // 2), found + 1)
    lowest = min(frames, key=lambda j: level[j])
    if level[lowest] <= max(level[j] for j in frames) - CHANGE_DIP_DB:
        return min(found, lowest + 1)
    begin = found
    while begin - 1 in frames and abs(raw[begin - 1] - new) < abs(raw[begin - 1] - old):
        begin -= 1
    return begin


def _pitch_splits(pitch, raw, level) -> list[int]:
    """Where, inside one voiced stretch (`pitch` smoothed, `raw` not, `level` in dB), a new note starts: found where
    CHANGE_FRAMES frames stay more than SPLIT_SEMITONES from the current note's pitch (the median of its frames so
    far) and within a semitone of each other, then placed where the change began (`_change_frame`)."""
    import numpy as np

    splits, start, away = [], 0, None
    for index in range(len(pitch)):
        own = np.median(pitch[start:index]) if index > start else pitch[start]
        if abs(pitch[index] - own) < SPLIT_SEMITONES:
            away = None
            continue
        if away is None or abs(pitch[index] - np.median(pitch[away:index + 1])) >= 1.0:
            away = index
        if index - away + 1 >= CHANGE_FRAMES:
            begin = _change_frame(raw, level, start, away, own, float(np.median(pitch[away:index + 1])))
            splits.append(begin)
            start, away = begin, None
    return splits


def _dip_splits(level, start: int, end: int, shortest: int) -> list[int]:
    """Where the sound comes back after dipping DIP_DB below its peaks on both sides, inside [start, end): the
    deepest dip first (its last lowest frame), then each side again; every part keeps at least `shortest` frames."""
    best, depth = None, DIP_DB
    for index in range(start + max(1, shortest - 1), end - shortest):
        around = level[max(start, index - 2):min(end, index + 3)]
        if level[index] > around.min():
            continue
        dip = min(level[start:index].max(), level[index:end].max()) - level[index]
        if dip >= depth:
            best, depth = index, dip
    if best is None:
        return []
    split = best + 1
    return _dip_splits(level, start, split, shortest) + [split] + _dip_splits(level, split, end, shortest)


def _note_pitch(frames, yin) -> float:
    """A note's pitch from its middle frames: pYIN's median (in its quarter-semitone bins), made exact by plain YIN's
    median where YIN's frames agree on a pitch and it lies within half a semitone, or moved by the octaves YIN hears
    it off (pYIN's path keeps near its neighbours and can take a short note after a leap an octave off)."""
    import numpy as np

    median = float(np.median(frames))
    if yin is None or len(yin) < 2:
        return median
    low, middle, high = np.percentile(yin, [25, 50, 75])
    octaves = round((middle - median) / 12)
    if high - low < OCTAVE_AGREEMENT and abs(middle - median - 12 * octaves) < OCTAVE_AGREEMENT:
        return float(middle) if not octaves else median + 12 * octaves
    return median


def notes_from_track(track: PitchTrack) -> tuple[list[HeardNote], float]:
    """The notes of a pitch track and the source's tuning (semitones, taken out of the notes' pitches)."""
    import numpy as np

    shortest = max(1, round(MIN_NOTE_SECONDS / track.frame_seconds))
    pieces = []  # [start frame, end frame, median pitch, starts again (after a dip or a gap: never merged)]
    for start, end in _runs(np.isfinite(track.midi)):
        pitch = _smoothed(track.midi[start:end])
        bounds = [0, *_pitch_splits(pitch, track.midi[start:end], track.level_db[start:end]), end - start]
        for a, b in zip(bounds, bounds[1:]):
            dips = _dip_splits(track.level_db, start + a, start + b, shortest)
            for index, (c, d) in enumerate(zip([start + a, *dips], [*dips, start + b])):
                trim = (d - c) // 5
                yin = track.yin_midi[c + trim:d - trim] if track.yin_midi is not None else None
                pieces.append([c, d, _note_pitch(pitch[c - start + trim:d - start - trim], yin), index > 0 or a == 0])
    kept = [piece for piece in pieces if piece[1] - piece[0] >= shortest]
    tuning = tuning_offset([piece[2] for piece in kept], [piece[1] - piece[0] for piece in kept])
    notes: list[list] = []
    for start, end, median, again in pieces:
        semitone = int(np.rint(median - tuning))
        joined = notes and notes[-1][1] == start
        if end - start < shortest:
            if joined:
                notes[-1][1] = end  # a blip at a note's end belongs to it
            continue
        if joined and not again and notes[-1][2] == semitone:
            notes[-1][1] = end  # the same pitch again after a dropped blip: one note
            continue
        notes.append([start, end, semitone])
    return [HeardNote(start * track.frame_seconds, end * track.frame_seconds, pitch)
            for start, end, pitch in notes], tuning
