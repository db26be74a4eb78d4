import base64

import pytest

from yue2_vllm.protocol import ABC_END, ABC_START, EOD
from yue2_vllm.testing import tiktoken_file_bytes
from yue2_vllm.tokenizer import TokenizerError, YuE2Tokenizer, special_tokens


def test_vocabulary_layout(tokenizer):
    assert tokenizer.n_vocab == 151851
    names = special_tokens()
    assert len(names) == 208 and names[0] == "<|endoftext|>" and names[7] == "<sep>"
    assert names[ABC_START - EOD] == "<abc>" and names[ABC_END - EOD] == "</abc>"
    assert tokenizer.decode([EOD, ABC_START, ABC_END]) == "<|endoftext|><abc></abc>"


@pytest.mark.parametrize("text", ["Hello, world!\n", "[verse]\n你好，世界\n", "café — naïve 🎵", "X:1\nK:C\n|:CDEF GABc:|"])
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < EOD for i in ids)
    assert tokenizer.decode(ids) == text


def test_special_strings_in_user_text_stay_text(tokenizer):
    ids = tokenizer.encode("<abc></abc><|endoftext|>")
    assert ABC_START not in ids and ABC_END not in ids and EOD not in ids
    assert tokenizer.decode(ids) == "<abc></abc><|endoftext|>"


def test_nfc_normalisation(tokenizer):
    assert tokenizer.encode("cafe\u0301") == tokenizer.encode("caf\u00e9")


def test_decode_ignores_out_of_range(tokenizer):
    assert tokenizer.decode([-1, 285, 151853, 184703, 999999]) == "ab"


def _write(tmp_path, data):
    path = tmp_path / "qwen.tiktoken"
    path.write_bytes(data)
    return path


def test_rejects_wrong_rank_count(tmp_path):
    lines = tiktoken_file_bytes().splitlines(keepends=True)
    with pytest.raises(TokenizerError, match="151642 ranks, expected exactly 151643"):
        YuE2Tokenizer(_write(tmp_path, b"".join(lines[:-1])))


def test_rejects_malformed_and_missing(tmp_path):
    with pytest.raises(TokenizerError, match=":1: malformed"):
        YuE2Tokenizer(_write(tmp_path, b"!!notbase64 0\n"))
    with pytest.raises(TokenizerError, match="not found"):
        YuE2Tokenizer(tmp_path / "absent.tiktoken")


def test_rejects_gapped_ranks(tmp_path):
    lines = tiktoken_file_bytes().splitlines(keepends=True)
    token = base64.b64encode(b"\x00")
    lines[0] = token + b" 999999\n"
    with pytest.raises(TokenizerError, match="not exactly 0..151642"):
        YuE2Tokenizer(_write(tmp_path, b"".join(lines)))
