"""The built-in transcriber end to end on synthesized melodies with known notes, tempo, meter and key (a voice-like
tone with vibrato, breath noise, articulation, repeated notes): each transcribes to those notes, in upstream's
melody-mode dialect exactly; and the refusals."""
from fractions import Fraction

import numpy as np
import pytest

from melodies import synthesize, wav_bytes
from yue2_vllm.score import read_score
from yue2_vllm.transcription import TranscriptionError, TranscriptionRequest, transcribe
from yue2_vllm.transcription.pyin import MAX_SECONDS

HEADER = ('X:1\nT:\nM:{meter}\nL:1/{unit}\nQ:1/4={bpm}\nV: Vocal clef=treble name="Vocal Melody" snm="Vocal"\n'
          'V: Ins clef=treble name="Ins Melody" snm="Inst."\nK:{key}\n')


def phrase(items, start=0.0):
    """(position, length, pitch) from (pitch or None for a rest, length) pairs, in quarter notes."""
    notes, position = [], start
    for pitch, length in items:
        if pitch is not None:
            notes.append((position, length, pitch))
        position += length
    return notes


TWINKLE = phrase([(60, 1), (60, 1), (67, 1), (67, 1), (69, 1), (69, 1), (67, 2),
                  (65, 1), (65, 1), (64, 1), (64, 1), (62, 1), (62, 1), (60, 2)])
UP_ABOVE = phrase([(67, 1), (67, 1), (65, 1), (65, 1), (64, 1), (64, 1), (62, 2)] * 2, start=16)


def written(result):
    return [(n.position, n.length, n.pitch) for n in result.notes]


def quarters(notes):
    return [(Fraction(p), Fraction(n), pitch) for p, n, pitch in notes]


def test_a_hummed_melody_with_vibrato_and_breath_noise_is_written_exactly():
    audio = synthesize(TWINKLE, 100, vibrato_semitones=0.3, noise_dbfs=-42)
    result = transcribe(wav_bytes(audio))
    assert result.abc == HEADER.format(meter="4/4", unit=16, bpm=100, key="C") + \
        "V: Vocal\nC4C4G4G4|A4A4G8|F4F4E4E4|D4D4C8|\nV: Ins\nZ4|\n"
    assert written(result) == quarters(TWINKLE)
    assert (result.transcriber, result.bpm, result.meter, result.key, result.licence) == ("pyin", 100, "4/4", "C",
                                                                                         None)
    assert result.warnings == () and result.tempo.first_beat_off_second is None
    assert result.transcriber_version.startswith("pyin-1 (librosa 0.11")
    onsets = [n.onset for n in result.notes]
    expected = [0.3 + p * 0.6 for p, _, _ in TWINKLE]  # the synthesis starts 0.3 s in
    assert max(abs(a - b) for a, b in zip(onsets, expected)) < 0.04
    assert set(result.timing) == {"read_seconds", "pitch_seconds", "notes_seconds", "score_seconds",
                                  "total_seconds"}
    assert result.record()["source"]["seconds"] == pytest.approx(len(audio) / 16000)


def test_repeated_notes_sung_legato_are_split_where_the_sound_dips():
    audio = synthesize(TWINKLE, 96, vibrato_semitones=0.25, legato_dip_db=15, noise_dbfs=-45)
    result = transcribe(wav_bytes(audio))
    assert written(result) == quarters(TWINKLE) and result.bpm == 96


def test_eighths_rests_and_a_key_with_a_sharp():
    melody = phrase([(67, 0.5), (66, 0.5), (67, 1), (69, 0.5), (71, 0.5), (72, 1), (None, 1), (74, 0.5),
                     (72, 0.5), (71, 0.5), (69, 0.5), (67, 2), (None, 1), (71, 1), (69, 1), (66, 1), (67, 3)])
    result = transcribe(wav_bytes(synthesize(melody, 110, vibrato_semitones=0.3, noise_dbfs=-40)))
    assert result.abc == HEADER.format(meter="4/4", unit=16, bpm=110, key="G") + \
        "V: Vocal\nG2F2G4A2B2c4|z4d2c2B2A2G4-|G4z4B4A4|F4G12|\nV: Ins\nZ4|\n"
    assert written(result) == quarters(melody)


def test_a_waltz_in_a_minor():
    melody = phrase([(57, 1), (60, 1), (64, 1), (69, 2), (68, 1), (69, 1), (71, 1), (72, 1), (71, 3), (69, 1),
                     (64, 1), (60, 1), (57, 3)])
    result = transcribe(wav_bytes(synthesize(melody, 132, vibrato_semitones=0.3)), meter="3/4")
    assert result.abc == HEADER.format(meter="3/4", unit=16, bpm=132, key="Am") + \
        "V: Vocal\nA,4C4E4|A8^G4|A4B4c4|B12|\nV: Ins\nZ4|\nV: Vocal\nA4E4C4|A,12|\nV: Ins\nZ2|\n"


def test_a_pickup_the_lyrics_sections_and_the_ins_voice():
    melody = phrase([(67, 1), (72, 2), (72, 1), (74, 1), (76, 2), (74, 1), (72, 1), (71, 2), (69, 1), (67, 1),
                     (72, 4)], start=3)
    lyrics = "[Verse 1]\nOh the morning sun is rising\n\n[Chorus]\nsing along\n"
    result = transcribe(wav_bytes(synthesize(melody, 90, vibrato_semitones=0.2)), lyrics=lyrics, voice="ins")
    assert result.abc == HEADER.format(meter="4/4", unit=16, bpm=90, key="C") + \
        "% verse\nV: Vocal\nZ3|\nV: Ins\nz12G4|c8c4d4|e8d4c4|\n% chorus\nV: Vocal\nZ2|\nV: Ins\nB8A4G4|c16|\n"
    assert result.sections == ((1, "verse"), (4, "chorus")) and result.notes[0].voice == "Ins"
    assert [w.code for w in result.warnings] == []


def test_a_source_whose_tempo_moves_is_followed_and_its_drift_foretold():
    melody = TWINKLE + UP_ABOVE + [(p + 32, n, pitch) for p, n, pitch in TWINKLE]
    result = transcribe(wav_bytes(synthesize(melody, 92, tempo_end=124, vibrato_semitones=0.2)))
    assert written(result) == quarters(melody)
    drift = next(w for w in result.warnings if w.code == "drift")
    report = result.tempo
    assert drift.figures == report.record() and report.first_beat_off_second is not None
    assert abs(report.max_offset_beats) > 1 and report.local_bpm[0] < 100 < 115 < report.local_bpm[1]
    assert f"one Q:1/4={result.bpm} cannot follow it: from {report.first_beat_off_second:.1f} s" in drift.message
    # The offsets are the arithmetic of the heard onsets against one Q: from the first note.
    beat = 60 / result.bpm
    offsets = [(n.onset - result.notes[0].onset - float(n.position - result.notes[0].position) * beat) / beat
               for n in result.notes]
    assert report.end_offset_beats == pytest.approx(offsets[-1])
    assert report.max_offset_beats == pytest.approx(max(offsets, key=abs))


def test_an_out_of_tune_source_is_read_against_its_own_tuning():
    result = transcribe(wav_bytes(synthesize(TWINKLE, 120, detune_semitones=-0.35, vibrato_semitones=0.2)))
    assert written(result) == quarters(TWINKLE)
    tuning = next(w for w in result.warnings if w.code == "tuning")
    # YIN reads a harmonic tone a few cents sharp: the figure is the tuning to within a tenth of a semitone.
    assert tuning.figures["cents"] == pytest.approx(-35, abs=10) and "flat" in tuning.message


def test_a_given_tempo_and_key_are_written():
    request = TranscriptionRequest(bpm=50, key="Am")
    result = transcribe(wav_bytes(synthesize(TWINKLE[:4], 100)), request)
    assert (result.bpm, result.key) == (50, "Am") and result.abc.count("K:Am") == 1
    assert written(result) == [(Fraction(p) / 2, Fraction(n) / 2, pitch) for p, n, pitch in TWINKLE[:4]]


def refused(source, **fields) -> str:
    with pytest.raises(TranscriptionError) as caught:
        transcribe(source, **fields)
    assert caught.value.field == "audio"
    return str(caught.value)


def test_audio_without_a_melody_is_refused_in_one_line():
    noise = np.random.default_rng(1).normal(0, 0.05, 16000 * 2).astype(np.float32)
    assert refused(wav_bytes(noise)).startswith("audio: no pitched notes: pYIN heard no steady pitch")
    three = wav_bytes(synthesize(TWINKLE[:3], 100))
    assert refused(three) == "audio: only 3 notes heard; finding the tempo needs at least 4 (or give bpm)"
    assert len(transcribe(three, bpm=100).notes) == 3
    assert refused(wav_bytes(np.zeros(16000 * 2, np.float32))).startswith("audio: silent")
    too_long = wav_bytes(np.zeros(int(8000 * (MAX_SECONDS + 1)), np.float32), rate=8000)
    assert refused(too_long) == f"audio: {MAX_SECONDS + 1:.1f} s is too long (at most {MAX_SECONDS:g} s for this " \
                                "transcriber)"


def test_every_score_it_writes_reads_back():
    result = transcribe(wav_bytes(synthesize(UP_ABOVE, 104, vibrato_semitones=0.3, noise_dbfs=-45)))
    score = read_score(result.abc)
    assert [[Fraction(p), pitch, Fraction(n)] for p, n, pitch in written(result)] == score.voices["Vocal"].notes
