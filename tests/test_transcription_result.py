"""What a transcription returns: its record (transcription.json) and files, and refusals that survive pickling
(a worker process hands them to the server)."""
import json
import pickle
from fractions import Fraction

from yue2_vllm.transcription.audio import AudioInfo
from yue2_vllm.transcription.request import TranscriptionRequest
from yue2_vllm.transcription.result import (Note, TempoReport, TranscriberUnavailable, Transcription,
                                            TranscriptionError, TranscriptionWarning)

INFO = AudioInfo("ab" * 32, 1234, 9.6, 16000, 1, "WAV", "PCM_16", -10.5)
TEMPO = TempoReport(100.04567, 100, (99.5, 100.5), -0.04, -0.024, 0.864, 0.01, 0.006, 8.688, None)


def transcription():
    notes = (Note(0.3, 0.5, 60, Fraction(0), Fraction(1)), Note(0.9, 1.1, 62, Fraction(1), Fraction(3, 2)))
    warning = TranscriptionWarning("tuning", "tuning: the source is 30 cents flat", {"cents": -30})
    return Transcription("X:1\n", "pyin", "pyin-1 (librosa 0.11.0)", INFO, 100, "4/4", "C", notes, (warning,), None,
                         {"read_seconds": 0.01234567, "total_seconds": 1.5}, TranscriptionRequest(lyrics="la"),
                         tempo=TEMPO, sections=((1, "verse"),), details={"tuning_cents": -30.0})


def test_the_record_is_the_transcription_without_its_score_text():
    record = transcription().record()
    assert record == {
        "transcriber": "pyin", "transcriber_version": "pyin-1 (librosa 0.11.0)",
        "source": {"sha256": "ab" * 32, "bytes": 1234, "seconds": 9.6, "sample_rate": 16000, "channels": 1,
                   "format": "WAV", "subtype": "PCM_16", "peak_dbfs": -10.5},
        "score": "score.abc", "bpm": 100, "meter": "4/4", "key": "C",
        "notes": [{"onset": 0.3, "duration": 0.5, "pitch": 60, "position": "0", "length": "1", "voice": "Vocal"},
                  {"onset": 0.9, "duration": 1.1, "pitch": 62, "position": "1", "length": "3/2", "voice": "Vocal"}],
        "warnings": [{"code": "tuning", "message": "tuning: the source is 30 cents flat", "figures": {"cents": -30}}],
        "licence": None,
        "tempo": {"fitted_bpm": 100.046, "written_bpm": 100, "local_bpm": [99.5, 100.5], "max_offset_beats": -0.04,
                  "max_offset_seconds": -0.024, "max_offset_second": 0.864, "end_offset_beats": 0.01,
                  "end_offset_seconds": 0.006, "end_second": 8.688, "first_beat_off_second": None},
        "sections": [{"bar": 1, "label": "verse"}],
        "request": {"transcriber": "pyin", "bpm": None, "meter": None, "key": None, "lyrics": "la", "voice": None,
                    "pickup_beats": None},
        "details": {"tuning_cents": -30.0}, "timing": {"read_seconds": 0.0123, "total_seconds": 1.5}}
    assert transcription().source_sha256 == "ab" * 32


def test_its_files_are_the_score_and_the_record():
    files = transcription().files()
    assert files["score.abc"] == b"X:1\n"
    assert json.loads(files["transcription.json"]) == transcription().record()


def test_refusals_keep_their_field_through_pickling():
    error = pickle.loads(pickle.dumps(TranscriptionError("bpm", "12 is outside 30-300")))
    assert (error.field, error.reason, str(error)) == ("bpm", "12 is outside 30-300", "bpm: 12 is outside 30-300")
    assert isinstance(error, ValueError)
    off = pickle.loads(pickle.dumps(TranscriberUnavailable("sheetsage2", "turned off")))
    assert (off.transcriber, str(off)) == ("sheetsage2", "sheetsage2: turned off") and isinstance(off, RuntimeError)


def test_the_summary_is_what_a_song_records_of_it():
    """`summary()`: the record a cover's request carries (protocol.check_transcription reads it): no notes, no
    timings, the score's sha256 so the song can tell whether it renders the score unedited."""
    import hashlib

    from yue2_vllm.protocol import check_transcription

    made = transcription()
    summary = made.summary()
    assert summary == {"transcriber": "pyin", "transcriber_version": "pyin-1 (librosa 0.11.0)",
                       "source": INFO.record(), "bpm": 100, "meter": "4/4", "key": "C",
                       "warnings": [{"code": "tuning", "message": "tuning: the source is 30 cents flat",
                                     "figures": {"cents": -30}}],
                       "licence": None, "score_sha256": hashlib.sha256(b"X:1\n").hexdigest()}
    assert check_transcription(summary, made.abc) == {**summary, "edited": False}
    assert json.loads(json.dumps(summary)) == summary
