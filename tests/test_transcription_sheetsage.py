"""SheetSage2, out of process, up to the model call: where it runs (the rule), how its environment is found, the
client's side of the worker's protocol (a worker that crashes, hangs or refuses), and the stripping and checks on a
score shaped as SheetSage2 writes it. Its gated weights cannot be had here: a stand-in model (remote code loaded by
transformers' AutoModel, as SheetSage2's is, answering `transcribe` with that score) takes their place in the
end-to-end run (tests/test_transcription_sheetsage_worker.py runs the worker itself)."""
import json
import os
import re
import sys
from fractions import Fraction

import numpy as np
import pytest

from melodies import wav_bytes
from sheetsage_stand_in import stand_in_model
from yue2_vllm.score import read_score
from yue2_vllm.transcription import TranscriberUnavailable, TranscriptionError, transcribe
from yue2_vllm.transcription import sheetsage
from yue2_vllm.transcription.sheetsage import (GPU_FREE_GIB, LICENCE, SETUP_RECORD, SheetSageSettings,
                                               _raise_refusal, _warnings, melody_only_score, model_windows,
                                               placement, run_worker, score_notes, score_sections,
                                               sheetsage_device, sheetsage_model_dir, sheetsage_python,
                                               sheetsage_status)

GIB = 2 ** 30
HEADER = ('X:1\nT:\nM:4/4\nL:1/16\nQ:1/4=96\nV: Vocal clef=treble name="Vocal Melody" snm="Vocal"\n'
          'V: Ins clef=treble name="Ins Melody" snm="Inst."\nK:D\n')
# Shaped as SheetSage2's serializer writes a score: an intro where only Ins plays (a leading bar padded with rests),
# chords in Vocal at bar starts and changes, key-relative spelling (E# and C natural in D major), accidentals
# repeated on tied pieces, whole-bar rests compressed per group, structure labels breaking groups.
FULL = HEADER + ('% intro\nV: Vocal\n"D"z16|"A"z16|\nV: Ins\nz8A4B4|c4d4e8|\n'
                 '% verse\nV: Vocal\n"D"z4F4A4d4|"G"B8-B4A4|"D"A4^E4E4=C4|"A"^G8-^G8|\nV: Ins\nZ4|\n'
                 '% chorus\nV: Vocal\n"Bm"d4c4B4A4|\nV: Ins\nZ|\n')
MELODY = FULL.replace('"D"', "").replace('"A"', "").replace('"G"', "").replace('"Bm"', "")

@pytest.fixture
def environment(monkeypatch, tmp_path):
    """SheetSage2's environment found through the variables: our own python (it holds torch and transformers) and a
    stand-in model directory."""
    model = stand_in_model(tmp_path / "SheetSage2-merged", FULL)
    monkeypatch.setenv("YUE2_SHEETSAGE_PYTHON", sys.executable)
    monkeypatch.setenv("YUE2_SHEETSAGE_MODEL", str(model))
    return model


@pytest.mark.parametrize("device, free, expected", [
    ("auto", None, ("cpu", "fp32")),
    ("auto", int(GPU_FREE_GIB * GIB) - 1, ("cpu", "fp32")),
    ("auto", int(GPU_FREE_GIB * GIB), ("cuda", "bf16")),
    ("cpu", 80 * GIB, ("cpu", "fp32")),
    ("cuda", 2 * GIB, ("cuda", "bf16")),
])
def test_sheetsage2_runs_on_the_gpu_only_where_enough_stays_free_beside_the_engine(device, free, expected):
    assert placement(device, free)[:2] == expected


def test_placement_says_why_and_refuses_off_and_a_missing_gpu():
    assert placement("auto", 6 * GIB)[2] == "6.0 GiB free beside the engine (the GPU needs at least 8 GiB free): " \
                                            "the CPU, minutes a song"
    with pytest.raises(TranscriberUnavailable, match="^sheetsage2: turned off here"):
        placement("off", 80 * GIB)
    with pytest.raises(TranscriberUnavailable, match="no GPU here"):
        placement("cuda", None)
    with pytest.raises(ValueError, match="device must be one of auto, cuda, cpu, off"):
        SheetSageSettings(device="gpu")


def test_its_environment_is_found_from_settings_variables_the_setup_record_or_the_repo(monkeypatch, tmp_path):
    monkeypatch.delenv("YUE2_SHEETSAGE_PYTHON", raising=False)
    monkeypatch.delenv("YUE2_SHEETSAGE_MODEL", raising=False)
    monkeypatch.setattr(sheetsage, "VENV", tmp_path / "no-venv")
    status = sheetsage_status()
    assert not status.ready and status.python is None and "calibration/setup-sheetsage-env.sh" in status.reason
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.symlink_to(sys.executable)
    model = stand_in_model(tmp_path / "models" / "merged", FULL)
    (venv / SETUP_RECORD).write_text(json.dumps({"model_dir": str(model), "revision": "0123abcd"}))
    monkeypatch.setattr(sheetsage, "VENV", venv)
    assert sheetsage_python() == python and sheetsage_model_dir(record={"model_dir": str(model)}) == model
    status = sheetsage_status()
    assert (status.ready, status.python, status.model_dir, status.setup["revision"]) == \
        (True, str(python), str(model), "0123abcd")
    assert status.record()["licence"] == LICENCE and status.record()["gpu_free_gib"] == GPU_FREE_GIB
    monkeypatch.setenv("YUE2_SHEETSAGE_MODEL", str(tmp_path / "elsewhere"))
    status = sheetsage_status()
    assert not status.ready and status.reason.startswith(f"no SheetSage2 weights in {tmp_path / 'elsewhere'}")
    settings = SheetSageSettings(python=str(tmp_path / "missing-python"), model_dir=str(model))
    assert sheetsage_python(settings) is None and sheetsage_model_dir(settings) == model


def test_a_worker_that_crashes_hangs_or_cannot_start_is_named(tmp_path):
    crashing = tmp_path / "crashing-python"
    crashing.write_text("#!/bin/sh\necho 'half an answer {' ; echo 'Traceback: boom' >&2; exit 3\n")
    crashing.chmod(0o755)
    with pytest.raises(RuntimeError, match="worker exited 3 without an answer; its stderr ends: Traceback: boom"):
        run_worker(crashing, {"op": "check"}, 30)
    hanging = tmp_path / "hanging-python"
    hanging.write_text("#!/bin/sh\nexec sleep 30\n")
    hanging.chmod(0o755)
    with pytest.raises(RuntimeError, match="ran past its 1 s limit and was stopped"):
        run_worker(hanging, {"op": "check"}, 1)
    (tmp_path / "not-executable").write_text("")
    with pytest.raises(TranscriberUnavailable, match="cannot start"):
        run_worker(tmp_path / "not-executable", {"op": "check"}, 30)


def test_its_score_is_stripped_of_chords_as_upstream_does_with_the_sounding_notes_unchanged():
    assert melody_only_score(FULL, "both") == MELODY
    source = read_score(FULL)
    for voice in ("Vocal", "Ins"):
        assert read_score(MELODY).voices[voice].notes == source.voices[voice].notes
    vocal_only = read_score(melody_only_score(FULL, "Vocal"))
    assert vocal_only.voices["Ins"].notes == [] and vocal_only.voices["Vocal"].notes == source.voices["Vocal"].notes
    assert melody_only_score(MELODY, "both") == MELODY
    with pytest.raises(RuntimeError, match="sheetsage2 wrote a score upstream's reader refuses: score line 13: "
                                           "group 1, Ins, bar 1"):
        melody_only_score(FULL.replace("z8A4B4|", "z8A4B4c|"), "both")


def test_its_sections_and_notes_are_read_from_the_score():
    score = read_score(MELODY)
    assert score_sections(score) == ((1, "intro"), (3, "verse"), (7, "chorus"))
    # the labels as score_notes reads them (score.section_labels): a hand-edited "%  chorus " is "chorus"
    assert score_sections(read_score(MELODY.replace("% chorus\n", "%  chorus \n"))) == score_sections(score)
    notes = score_notes(score, 96)
    assert [(n.voice, n.pitch, n.position, n.length) for n in notes[:3]] == [
        ("Ins", 69, Fraction(2), Fraction(1)), ("Ins", 71, Fraction(3), Fraction(1)), ("Ins", 73, Fraction(4), 1)]
    assert notes[5].voice == "Vocal" and notes[5].onset == pytest.approx(9 * 60 / 96)
    assert (notes[-5].pitch, notes[-5].length) == (68, Fraction(4))  # G# tied to G# (the mark repeated): one note


def test_a_transcription_through_the_worker_carries_the_score_its_licence_and_the_drift(environment, monkeypatch):
    slowing = [0.5 + sum(0.6 + 0.004 * k for k in range(index)) for index in range(80)]
    stand_in_model(environment, FULL, beats=slowing)
    audio = wav_bytes(np.full(8000 * 305, 0.1, np.float32), rate=8000)  # longer than one of its windows
    result = transcribe(audio, transcriber="sheetsage2", lyrics="[verse]\n" + "la " * 13)
    assert result.abc == MELODY and (result.transcriber, result.licence) == ("sheetsage2", LICENCE)
    assert result.transcriber_version == "m-a-p/SheetSage2@0123abcd (transformers " \
        f"{result.details['versions']['transformers']})"
    assert (result.bpm, result.meter, result.key) == (96, "4/4", "D")
    assert result.sections == ((1, "intro"), (3, "verse"), (7, "chorus"))
    assert [(n.position, n.pitch) for n in result.notes if n.voice == "Vocal"][:3] == \
        [(Fraction(9), 66), (Fraction(10), 69), (Fraction(11), 74)]
    codes = [w.code for w in result.warnings]
    assert codes == ["drift", "sheetsage2", "sheetsage2", "window-joins"]
    assert result.warnings[1].message == "SheetSage2: low confidence in bar 3"
    assert "a beat is more than a beat off the source" in result.warnings[0].message
    assert result.tempo.end_second == pytest.approx(slowing[-1], abs=1e-4)
    call = json.loads(result.details["diagnostics"][0])
    assert call == {"audio_is_file": True, "dtype": "fp32", "prompts": list(sheetsage.PROMPTS), "melody_only": True,
                    "max_seconds": sheetsage.MAX_SECONDS, "overlap_seconds": sheetsage.OVERLAP_SECONDS,
                    "lookahead_seconds": sheetsage.LOOKAHEAD_SECONDS, "device": "cpu"}
    assert (result.details["device"], result.details["dtype"], result.details["beats"]) == ("cpu", "fp32", 80)
    assert result.details["windows"] == {"window_seconds": 300.0, "overlap_seconds": 200.0, "lookahead_seconds": 100.0}
    assert result.details["peak_rss_bytes"] > 0 and result.record()["licence"] == LICENCE
    assert {"read_seconds", "worker_seconds", "load_seconds", "transcribe_seconds", "score_seconds",
            "total_seconds"} <= set(result.timing)


def test_the_window_joins_are_warned_about_at_the_window_sheetsage2_reports():
    # the window is its model's input length, not an argument: what its result reports, else its 300 s default
    score, answer = read_score(MELODY), {"windows": {"window_seconds": 240.0, "overlap_seconds": 160.0,
                                                     "lookahead_seconds": 80.0}}
    (joins,) = [w for w in _warnings(answer, score, 250.0, "", "both") if w.code == "window-joins"]
    assert joins.message.startswith("windows: the source is 250 s, longer than SheetSage2's 240 s window")
    assert joins.figures == {"seconds": 250.0, "window_seconds": 240.0, "overlap_seconds": 160.0,
                             "lookahead_seconds": 80.0}
    assert [w.code for w in _warnings({}, score, 250.0, "", "both")] == []
    assert model_windows({}) == {"window_seconds": 300.0, "overlap_seconds": 200.0, "lookahead_seconds": 100.0}


def test_the_workers_refusals_become_the_faces_errors():
    with pytest.raises(TranscriptionError) as caught:
        _raise_refusal({"error": "input", "message": "SheetSage2 built no score: too few beats"})
    assert (caught.value.field, str(caught.value)) == ("audio", "audio: SheetSage2 built no score: too few beats")
    with pytest.raises(TranscriberUnavailable, match="^sheetsage2: torch is missing .*setup-sheetsage-env.sh"):
        _raise_refusal({"error": "environment", "message": "torch is missing"})
    with pytest.raises(RuntimeError, match="^sheetsage2's worker refused the request: the request has no 'audio'"):
        _raise_refusal({"error": "request", "message": "the request has no 'audio'"})
    with pytest.raises(RuntimeError, match="^sheetsage2: SheetSage2 failed: OutOfMemoryError: CUDA out of memory$") \
            as caught:
        _raise_refusal({"error": "model", "message": "SheetSage2 failed: OutOfMemoryError: CUDA out of memory"})
    assert not isinstance(caught.value, TranscriptionError)  # the server's 500, not a 422 blaming the audio


def test_a_model_that_runs_out_of_memory_does_not_blame_the_audio(environment):
    stand_in_model(environment, FULL, fail="CUDA out of memory")
    with pytest.raises(RuntimeError, match="^sheetsage2: SheetSage2 failed: OutOfMemoryError: CUDA out of memory$") \
            as caught:
        transcribe(wav_bytes(np.full(8000 * 2, 0.1, np.float32), rate=8000), transcriber="sheetsage2")
    assert not isinstance(caught.value, TranscriptionError)


def test_its_device_is_the_settings_else_the_variable_else_auto(environment, monkeypatch):
    monkeypatch.delenv("YUE2_SHEETSAGE_DEVICE", raising=False)
    assert (sheetsage_device(), sheetsage_device(SheetSageSettings())) == ("auto", "auto")
    monkeypatch.setenv("YUE2_SHEETSAGE_DEVICE", "off")  # an operator turns it off without a line of Python
    assert sheetsage_device() == "off" and sheetsage_device(SheetSageSettings(device="cpu")) == "cpu"
    with pytest.raises(TranscriberUnavailable, match="^sheetsage2: turned off here"):
        transcribe(b"not even audio", transcriber="sheetsage2")
    status = sheetsage_status()
    assert (status.ready, status.record()["device"]) == (False, "off")
    assert status.reason == "turned off here (device off: $YUE2_SHEETSAGE_DEVICE or serve --sheetsage-device)"
    assert sheetsage_status(SheetSageSettings(device="cpu")).ready
    monkeypatch.setenv("YUE2_SHEETSAGE_DEVICE", "gpu")
    message = "$YUE2_SHEETSAGE_DEVICE='gpu' is not a device (one of auto, cuda, cpu, off)"
    with pytest.raises(TranscriberUnavailable, match=re.escape(f"sheetsage2: {message}")):
        transcribe(b"not even audio", transcriber="sheetsage2")
    assert (sheetsage_status().ready, sheetsage_status().reason, sheetsage_status().device) == (False, message, None)


def test_turned_off_or_not_set_up_it_refuses_before_reading_the_audio(environment, monkeypatch):
    with pytest.raises(TranscriberUnavailable, match="turned off"):
        transcribe(b"not even audio", transcriber="sheetsage2", sheetsage=SheetSageSettings(device="off"))
    monkeypatch.setenv("YUE2_SHEETSAGE_MODEL", str(environment / "missing"))
    with pytest.raises(TranscriberUnavailable, match="no SheetSage2 weights in .*setup-sheetsage-env.sh"):
        transcribe(b"not even audio", transcriber="sheetsage2")
    assert os.environ["YUE2_SHEETSAGE_PYTHON"] == sys.executable
