"""SheetSage2's worker, run as its environment runs it (a script, one JSON request on stdin, one JSON answer on
stdout and nothing else there), with a stand-in for its gated weights."""
import json
import subprocess
import sys

import pytest

from sheetsage_stand_in import stand_in_model
from yue2_vllm.transcription import sheetsage_worker
from yue2_vllm.transcription.sheetsage import WORKER
from yue2_vllm.transcription.sheetsage_worker import PROTOCOL, beat_times


def ask(request, raw=None):
    done = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, timeout=300,
                          input=raw if raw is not None else json.dumps({"protocol": PROTOCOL, **request}))
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()  # the answer is all stdout holds
    return json.loads(line), done.stderr


def test_it_checks_its_environment_and_model_directory(tmp_path):
    model = stand_in_model(tmp_path / "model", "X:1\n")
    answer, _ = ask({"op": "check", "model_dir": str(model)})
    assert answer["ok"] and (answer["model_dir"], answer["revision"], answer["cuda"]) == (str(model), "0123abcd",
                                                                                        False)
    assert set(answer["versions"]) == set(sheetsage_worker.PACKAGES) and answer["versions"]["torch"]
    missing, _ = ask({"op": "check", "model_dir": str(tmp_path / "nothing")})
    assert (missing["ok"], missing["error"]) == (False, "environment") and "no config.json" in missing["message"]


@pytest.mark.parametrize("raw, message", [
    ("not json", "not JSON: Expecting value: line 1 column 1 (char 0)"),
    (json.dumps({"protocol": 0, "op": "check"}), f"expected a protocol {PROTOCOL} request object"),
    (json.dumps({"protocol": PROTOCOL, "op": "train"}), "unknown op 'train' (check or transcribe)"),
    (json.dumps({"protocol": PROTOCOL, "op": "transcribe"}), "the request has no 'audio'"),
])
def test_a_request_it_does_not_read_is_answered_as_such(raw, message):
    answer, _ = ask({}, raw=raw)
    assert answer == {"protocol": PROTOCOL, "ok": False, "error": "request", "message": message}


def test_a_model_that_builds_no_score_is_an_input_refusal_and_its_printing_stays_off_stdout(tmp_path):
    model = stand_in_model(tmp_path / "model", "", refuse="SheetSage2 needs at least two decoded beats.")
    (tmp_path / "source.wav").write_bytes(b"RIFF")
    answer, stderr = ask({"op": "transcribe", "model_dir": str(model), "audio": str(tmp_path / "source.wav"),
                          "output_dir": str(tmp_path / "out"), "device": "cuda", "dtype": "bf16",
                          "prompts": ["timestamp", "melody_full"], "melody_only": True})
    assert answer == {"protocol": PROTOCOL, "ok": False, "error": "input",
                      "message": "SheetSage2 built no score: SheetSage2 needs at least two decoded beats.",
                      "abc_error": "SheetSage2 needs at least two decoded beats.", "warnings": ["2 beats decoded"]}
    assert "the model talks on stdout" in stderr


def transcribe_request(model, tmp_path):
    (tmp_path / "source.wav").write_bytes(b"RIFF")
    return {"op": "transcribe", "model_dir": str(model), "audio": str(tmp_path / "source.wav"),
            "output_dir": str(tmp_path / "out"), "device": "cpu", "dtype": "fp32", "prompts": ["timestamp"],
            "melody_only": True, "max_seconds": 600.0}


def test_a_model_that_fails_as_it_runs_is_the_models_failure_not_the_audios(tmp_path):
    # torch's OutOfMemoryError is a RuntimeError, as SheetSage2's "no score" is: only the one carrying .result is
    # the audio's
    model = stand_in_model(tmp_path / "model", "X:1\n", fail="CUDA out of memory. Tried to allocate 2.00 GiB")
    answer, _ = ask(transcribe_request(model, tmp_path))
    assert {key: answer[key] for key in ("ok", "error", "message", "exception")} == {
        "ok": False, "error": "model", "exception": "OutOfMemoryError",
        "message": "SheetSage2 failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}


def test_a_sheetsage2_that_does_not_take_an_assumed_argument_is_an_environment_refusal_naming_it(tmp_path):
    model = stand_in_model(tmp_path / "model", "X:1\n", documented_only=True)
    answer, _ = ask(transcribe_request(model, tmp_path))
    assert (answer["ok"], answer["error"], answer["argument"]) == (False, "environment", "dtype")
    assert answer["message"].startswith("this SheetSage2's transcribe does not take the argument 'dtype' (its "
                                        "pipeline's, assumed here: dtype, prompts, max_seconds, overlap_seconds, "
                                        "lookahead_seconds): ")
    assert "dtype" in sheetsage_worker.ASSUMED_ARGUMENTS


def test_beats_are_the_first_number_of_each_line_of_the_beat_annotation(tmp_path):
    assert beat_times({"labs": {"beat": "0.50\t1\n1.125 2\n\nnot a beat\n1.75,3\n"}}, None) == [0.5, 1.125, 1.75]
    (tmp_path / "beat.lab").write_text("0.25\t1\n0.75\t2\n")
    assert beat_times({"labs": {}}, str(tmp_path)) == [0.25, 0.75] and beat_times({}, None) == []
