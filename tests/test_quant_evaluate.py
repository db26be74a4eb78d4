import json

import pytest
import torch

from yue2_vllm.quant.calibration import RequestSet, build_corpus
from yue2_vllm.checkpoint import HashCache
from yue2_vllm.quant.evaluate import PhaseStats, compare_dense, compare_sparse, repeated_ngrams, run_gate
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.protocol import CODEC_OFFSET, SongRequest
from yue2_vllm.engine.backend import vllm_version
from yue2_vllm.options import LoadOptions


def test_dense_identical_and_shifted():
    logits = torch.randn(3, 184704, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([CODEC_OFFSET + 1, CODEC_OFFSET + 2, CODEC_OFFSET + 3])
    same = PhaseStats()
    compare_dense(same, logits, logits.clone(), targets, "semantic")
    row = same.row()
    assert (row["positions"], row["top1"], row["tv"], row["kl"]) == (3, 1.0, 0.0, 0.0)
    assert row["nll_reference"] == row["nll_candidate"]
    moved = logits.clone()
    moved[:, CODEC_OFFSET + 5] += 100.0  # the candidate puts all mass on one id
    shifted = PhaseStats()
    compare_dense(shifted, logits, moved, targets, "semantic")
    assert shifted.row()["top1"] == 0.0 and shifted.row()["tv"] > 0.99


def test_sparse_partition_is_exact_for_a_two_token_world():
    reference = torch.full((1, 184704), -1e9)
    reference[0, [10, 11]] = torch.tensor([0.0, 0.0])  # p = (0.5, 0.5)
    candidate = [{10: float(torch.tensor(0.75).log()), 11: float(torch.tensor(0.25).log())}]
    stats = PhaseStats()
    compare_sparse(stats, reference, candidate, torch.tensor([11]))
    row = stats.row()
    assert abs(row["tv"] - 0.25) < 1e-6 and row["top1"] == 1.0
    assert abs(row["nll_candidate"] - float(-torch.tensor(0.25).log())) < 1e-6


def test_repeated_ngrams():
    assert repeated_ngrams(list(range(100))) == 0
    assert repeated_ngrams([1, 2, 3] * 10, n=3) == 25  # 28 trigrams, 3 distinct
    assert repeated_ngrams([5] * 30) == 6


@pytest.fixture(scope="module")
def corpus(tiny_model_dir, tmp_path_factory):
    pipe = YuE2Pipeline(tiny_model_dir, None,
                        generation_config={"abc": {"max_tokens": 16, "min_tokens": 4},
                                           "semantic": {"max_tokens": 40, "min_tokens": 5}},
                        load=LoadOptions(hash_cache=HashCache(tmp_path_factory.mktemp("h") / "c.json")))
    requests = [SongRequest("pop", "la", seed=1, id="t1"), SongRequest("rock", "yeah", cot="melody", seed=2, id="h1")]
    out = tmp_path_factory.mktemp("corpus") / "c"
    build_corpus(pipe, RequestSet(requests, frozenset({"h1"}), {}), out)
    return out


@pytest.mark.slow  # the gate over engines and torch; the protocol's pure parts stay here
def test_gate_table_floor_and_plots(tiny_model_dir, corpus, tmp_path):
    candidates = [f"torch:{tiny_model_dir}#int8"]
    if vllm_version() is not None:
        from yue2_vllm.derive import derive_ar_checkpoint

        candidates.append(f"vllm:{derive_ar_checkpoint(tiny_model_dir, tmp_path / 'ar')}")
    report = run_gate(f"torch:{tiny_model_dir}", candidates, corpus, tmp_path / "q")
    rows = report["rows"]
    assert rows[0]["candidate"].endswith("(64-token chunks)")  # the bf16 floor row comes first
    assert len(rows) == 1 + len(candidates)
    floor, int8 = rows[0]["phases"]["semantic"], rows[1]["phases"]["semantic"]
    assert floor["positions"] == int8["positions"] == 40
    assert rows[0]["phases"]["abc"]["positions"] > 0
    assert floor["tv"] <= int8["tv"] and int8["tv"] > 0  # int8 moves probability, the floor (almost) none
    assert int8["top1"] > 0.5
    table = (tmp_path / "q" / "quality.md").read_text()
    assert "| candidate | support | phase |" in table and "#int8" in table
    assert json.loads((tmp_path / "q" / "quality.json").read_text())["rows"][0]["phases"]
    for name in report["plots"]:
        assert (tmp_path / "q" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"tv_semantic.png", "agreement_by_confidence.png"} <= set(report["plots"])
