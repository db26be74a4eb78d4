import json

import numpy as np
import pytest

from yue2_vllm.quant.calibration import (RequestSet, build_corpus, heldout_sequences, load_request_set, train_windows,
                                   window_ranges)
from yue2_vllm.checkpoint import HashCache
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.protocol import ABC_END, CODEC_OFFSET, EOD, MUSIC_END, SongRequest
from yue2_vllm.options import LoadOptions

GENERATION = {"abc": {"max_tokens": 12, "min_tokens": 4}, "semantic": {"max_tokens": 90, "min_tokens": 10}}


def test_default_request_set():
    requests = load_request_set()
    assert len(requests.requests) == 32 and len(requests.heldout) == 4
    assert {r.cot for r in requests.requests} == {"full", "melody"}
    assert {m["lang"] for m in requests.meta.values()} == {"en", "zh"}
    assert len({r.lyrics for r in requests.requests}) == 16 and len({r.style for r in requests.requests}) == 4


def test_window_ranges():
    assert window_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert window_ranges(8192) == [(0, 8192)] and window_ranges(8193)[-1] == (8192, 8193)
    with pytest.raises(ValueError, match="8192"):
        window_ranges(10, 9000)


@pytest.fixture(scope="module")
def corpus(tiny_model_dir, tmp_path_factory):
    pipe = YuE2Pipeline(tiny_model_dir, None, generation_config=GENERATION,
                        load=LoadOptions(hash_cache=HashCache(tmp_path_factory.mktemp("h") / "c.json")))
    requests = [SongRequest("pop", "la la", cot="full", seed=1, id="t1"),
                SongRequest("rock", "yeah", cot="melody", seed=2, id="h1"),
                SongRequest("民谣", "你好", cot="full", seed=3, id="t2")]
    request_set = RequestSet(requests, frozenset({"h1"}), {"h1": {"lang": "en"}})
    out = tmp_path_factory.mktemp("corpus") / "c"
    return out, build_corpus(pipe, request_set, out, window=64)


def test_corpus_windows_and_split(corpus):
    out, manifest = corpus
    assert manifest["totals"]["requests"] == 3
    assert all(w["tokens"] <= 64 for w in manifest["windows"])
    held = [w for w in manifest["windows"] if w["request"] == "h1"]
    assert held and all(w["split"] == "heldout" for w in held)
    assert len(train_windows(out)) == manifest["totals"]["train_windows"] == len(manifest["windows"]) - len(held)
    for record in manifest["requests"]:
        sequence = np.load(out / "sequences" / f"{record['id']}.npy")
        windows = [np.load(out / w["file"]) for w in manifest["windows"] if w["request"] == record["id"]]
        assert np.array_equal(np.concatenate(windows), sequence)  # windows tile the sequence exactly
        assert record["tokens"] == len(sequence) and record["semantic_tokens"] == 90
    assert 0 < manifest["totals"]["codec_share"] < 1
    assert json.loads((out / "manifest.json").read_text())["version"] == 1


def test_phase_targets_point_at_generated_tokens(corpus):
    out, _ = corpus
    (record, tokens), = heldout_sequences(out)
    a0, a1 = record["targets"]["abc"]
    s0, s1 = record["targets"]["semantic"]
    assert a1 - a0 == record["abc_tokens"] + (not record["truncated"]["abc"])
    assert all(t < EOD or t == ABC_END for t in tokens[a0:a1])
    assert s1 == len(tokens) and s1 - s0 == 90
    assert all(CODEC_OFFSET <= t or t == MUSIC_END for t in tokens[s0:s1])
    assert record["lang"] == "en" and record["split"] == "heldout"
