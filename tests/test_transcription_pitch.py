"""Notes from a pitch track (pure: synthetic tracks with known notes), the source's tuning, and pYIN itself on a
synthesized tone."""
import sys

import numpy as np
import pytest

from yue2_vllm.transcription.pitch import (HOP, ANALYSIS_RATE, HeardNote, PitchTrack, notes_from_track,
                                           require_librosa, track_pitch, tuning_offset)
from yue2_vllm.transcription.result import TranscriberUnavailable

FRAME = HOP / ANALYSIS_RATE  # 16 ms


def track(segments, vibrato=0.0, level_db=-20.0):
    """A pitch track from (frames, MIDI pitch or None for unvoiced, level dB or None for the default) segments, with
    a 5.5 Hz vibrato of +-`vibrato` semitones on every voiced frame."""
    midi, level = [], []
    for frames, pitch, db in segments:
        midi += [np.nan if pitch is None else pitch] * frames
        level += [(-80.0 if pitch is None else level_db) if db is None else db] * frames
    midi = np.array(midi, float)
    midi += vibrato * np.sin(2 * np.pi * 5.5 * np.arange(len(midi)) * FRAME)
    return PitchTrack(midi, np.array(level, float), FRAME)


def heard(notes):
    return [(round(n.onset / FRAME), round(n.offset / FRAME), n.pitch) for n in notes]


def test_a_vibrato_around_one_note_is_one_note_and_a_step_is_two():
    notes, tuning = notes_from_track(track([(5, None, None), (60, 67, None), (40, 69, None), (5, None, None)],
                                           vibrato=0.45))
    assert heard(notes) == [(5, 65, 67), (65, 105, 69)] and abs(tuning) < 0.05


def test_a_glide_between_notes_splits_where_the_new_pitch_holds():
    glide = [(1, 60 + 0.5 * i, None) for i in range(1, 5)]  # 60.5 .. 62.0 over four frames
    notes, _ = notes_from_track(track([(30, 60, None), *glide, (30, 62, None)]))
    assert [n.pitch for n in notes] == [60, 62] and heard(notes)[0][0] == 0 and heard(notes)[1][1] == 64


def test_a_repeated_pitch_is_split_where_the_sound_dips_and_not_where_it_does_not():
    dipped = track([(30, 64, -20.0), (3, 64, -34.0), (30, 64, -20.0)])
    assert heard(notes_from_track(dipped)[0]) == [(0, 33, 64), (33, 63, 64)]  # again where it comes back
    shallow = track([(30, 64, -20.0), (3, 64, -23.0), (30, 64, -20.0)])
    assert heard(notes_from_track(shallow)[0]) == [(0, 63, 64)]


def test_an_unvoiced_gap_separates_notes_of_one_pitch():
    notes, _ = notes_from_track(track([(20, 72, None), (6, None, None), (20, 72, None)]))
    assert heard(notes) == [(0, 20, 72), (26, 46, 72)]


def test_blips_shorter_than_a_note_are_dropped_or_joined_to_the_note_they_end():
    blip_alone = track([(2, 60, None), (10, None, None), (30, 65, None)])
    assert heard(notes_from_track(blip_alone)[0]) == [(12, 42, 65)]
    blip_inside = track([(30, 65, None), (3, 70, None), (30, 65, None)])  # a crack in the voice: one note
    assert heard(notes_from_track(blip_inside)[0]) == [(0, 63, 65)]


def test_the_sources_tuning_is_found_from_its_notes_and_taken_out():
    notes, tuning = notes_from_track(track([(30, 59.7, None), (30, 61.7, None), (30, 63.7, None)], vibrato=0.3))
    assert tuning == pytest.approx(-0.3, abs=0.02) and [n.pitch for n in notes] == [60, 62, 64]
    assert tuning_offset([60.45, 61.45], [1, 1]) == pytest.approx(0.45)
    assert tuning_offset([60.55], [1]) == pytest.approx(-0.45)  # the nearest semitone is the one above
    assert tuning_offset([], []) == 0.0


def test_pyin_hears_a_tone_at_its_pitch():
    rate = 22050  # resampled to the analysis rate
    t = np.arange(int(1.0 * rate)) / rate
    tone = np.where((t > 0.2) & (t < 0.8), 0.3 * np.sin(2 * np.pi * 440.0 * t), 0.0).astype(np.float32)
    result = track_pitch(tone, rate)
    voiced = np.flatnonzero(np.isfinite(result.midi))
    assert result.frame_seconds == FRAME and len(result.midi) == len(result.level_db)
    assert voiced[0] * FRAME == pytest.approx(0.2, abs=0.05) and voiced[-1] * FRAME == pytest.approx(0.8, abs=0.05)
    assert np.nanmedian(result.midi) == pytest.approx(69.0, abs=0.01)
    assert notes_from_track(result)[0] == [HeardNote(voiced[0] * FRAME, (voiced[-1] + 1) * FRAME, 69)]


def test_without_librosa_the_extra_to_install_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "librosa", None)
    with pytest.raises(TranscriberUnavailable, match=r"pip install 'yue2-vllm\[transcribe\]'"):
        require_librosa()
