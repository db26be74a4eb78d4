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
