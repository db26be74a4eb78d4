from pathlib import Path

import pytest

from yue2_vllm.request_json import UsageError, error_type, read_json_file, request_from_json


@pytest.mark.parametrize("make,kind", [
    (lambda d: request_from_json({"style": "a", "lyrics": "b", "abc_path": "missing.abc"}, d), "FileNotFoundError"),
    (lambda d: request_from_json({"style": "a", "lyrics": "b", "abc_path": "."}, d), "IsADirectoryError"),
    (lambda d: request_from_json({"style": "a", "lyrics": "b", "unsupported": 1}, d), "ValueError"),
    (lambda d: request_from_json({"abc_sampling": {"top_k": "x"}}, d), "ValueError"),
    (lambda d: read_json_file(_write(d / "r.json", b"{oops"), "--request"), "JSONDecodeError"),
    (lambda d: read_json_file(_write(d / "r.json", b"\xff"), "--request"), "UnicodeDecodeError"),
    (lambda d: read_json_file(_write(d / "r.json", b"[" * 100_000), "--request"), "RecursionError"),
])
def test_records_name_the_underlying_exception(make, kind, tmp_path):
    with pytest.raises(UsageError) as info:
        make(tmp_path)
    assert error_type(info.value) == kind


def test_error_type_of_other_errors():
    assert error_type(UsageError("plain")) == "ValueError"
    assert error_type(FileNotFoundError("x")) == "FileNotFoundError"


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# --------------------------------------------------------------------------- a cover's melody_audio


def test_melody_audio_is_read_as_data_relative_to_the_document(tmp_path):
    from yue2_vllm.request_json import MelodyAudio

    fields, _ = request_from_json({"style": "a", "lyrics": "b", "melody_audio": "hum.wav",
                                   "melody": {"bpm": 96, "meter": "3/4"}}, tmp_path, "row")
    assert fields == {"style": "a", "lyrics": "b", "cot": "melody",
                      "melody_audio": MelodyAudio(tmp_path / "hum.wav", {"bpm": 96, "meter": "3/4"}, "row")}
    # the file is not read here (the CLI transcribes it): a missing one is its transcription's refusal


@pytest.mark.parametrize("data,message", [
    ({"melody_audio": "hum.wav", "abc": "X:1"}, "row: give 'melody_audio' or 'abc', not both"),
    ({"melody_audio": "hum.wav", "abc_path": "s.abc"}, "row: give 'melody_audio' or 'abc_path', not both"),
    ({"melody_audio": "hum.wav", "cot": "full"}, "row: cot: a cover renders its transcribed melody_audio with cot "
                                                 "'melody', got 'full'"),
    ({"melody_audio": "", "melody": {}}, "row: melody_audio must be a file name, got a string ''"),
    ({"melody_audio": "hum.wav", "melody": [96]}, "row: melody must be an object of transcriber, bpm"),
    ({"melody_audio": "hum.wav", "melody": {"tempo": 96}}, r"row: melody: unknown field\(s\) \['tempo'\]"),
    ({"melody": {"bpm": 96}}, "row: 'melody' sets how 'melody_audio' is transcribed; give melody_audio too"),
    ({"transcription": {}}, "row: 'transcription' records where the score given as 'abc' came from; give abc too"),
])
def test_a_melody_beside_a_score_or_without_audio_is_refused_naming_both(data, message, tmp_path):
    with pytest.raises(UsageError, match="^" + message):
        request_from_json({"style": "a", "lyrics": "b", **data}, tmp_path, "row")


def test_melody_audio_is_refused_from_the_network():
    with pytest.raises(UsageError, match="^body: melody_audio is not accepted here .* POST /v1/covers"):
        request_from_json({"style": "a", "lyrics": "b", "melody_audio": "/etc/passwd"}, where="body",
                          allow_files=False)
    # its knobs alone are refused the same way, not asked for the melody_audio that would then be refused
    with pytest.raises(UsageError, match="^body: melody is not accepted here .* POST /v1/covers"):
        request_from_json({"style": "a", "lyrics": "b", "melody": {"bpm": 96}}, where="body", allow_files=False)
