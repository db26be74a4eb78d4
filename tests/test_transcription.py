"""The transcription room's one interface: a request or its fields, the limits the faces show, and an import that
pulls in no audio-analysis library (nor torch) until a transcriber runs."""
import subprocess
import sys

import pytest

from yue2_vllm.transcription import (TranscriptionError, TranscriptionRequest, max_seconds, transcribe,
                                     transcribers_status)
from yue2_vllm.transcription import pyin, sheetsage

MODULES = ("audio", "key", "pitch", "pyin", "request", "result", "sections", "sheetsage", "sheetsage_worker", "tempo",
           "writer")


def test_importing_the_room_imports_no_audio_analysis_library():
    code = ("import sys, yue2_vllm, yue2_vllm.score, yue2_vllm.instrumental\n"
            + "".join(f"import yue2_vllm.transcription.{name}\n" for name in MODULES)
            + "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('librosa', 'numba', 'scipy', 'soundfile',"
              " 'torch', 'transformers', 'vllm', 'soxr', 'resampy', 'audioread'))\nprint(heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_limits_the_faces_show():
    assert max_seconds("pyin") == pyin.MAX_SECONDS == 360.0
    assert max_seconds("sheetsage2") == sheetsage.MAX_SECONDS == 600.0
    with pytest.raises(TranscriptionError, match="^transcriber: 'basic-pitch' is not a transcriber"):
        max_seconds("basic-pitch")


def test_a_request_or_its_fields_not_both():
    with pytest.raises(TypeError, match=r"give a request or its fields, not both \(bpm\)"):
        transcribe(b"", TranscriptionRequest(), bpm=90)
    with pytest.raises(TranscriptionError, match="^meter: '4' is not a meter"):
        transcribe(b"", meter="4")


def test_what_doctor_reports_of_each_transcriber(monkeypatch, tmp_path):
    monkeypatch.setenv("YUE2_SHEETSAGE_PYTHON", str(tmp_path / "no-python"))
    status = transcribers_status()
    assert status["pyin"] == {"ready": True, "librosa": "0.11.0", "max_seconds": 360.0, "reason": None}
    assert status["sheetsage2"]["ready"] is False and "setup-sheetsage-env.sh" in status["sheetsage2"]["reason"]
    assert status["sheetsage2"]["licence"] == sheetsage.LICENCE
