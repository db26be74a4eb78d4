"""The FP8 KV row: bf16 K/V against an FP8 KV cache on the same AR checkpoint, per phase."""
import json

import pytest
from test_quant_evaluate import corpus  # noqa: F401  (the tiny held-out corpus fixture)

from yue2_vllm.engine.backend import vllm_version
from yue2_vllm.quant.evaluate import PhaseStats
from yue2_vllm.quant.kv_quality import compare_sparse_pair, histogram_tv, kv_markdown, run_kv_gate


def test_histogram_tv_is_the_moved_share_of_sampled_ids():
    assert histogram_tv([1, 2, 3, 4], [4, 3, 2, 1]) == 0.0  # order does not matter, only how often
    assert histogram_tv([1, 1, 2, 2], [1, 1, 1, 1]) == 0.5
    assert histogram_tv([1, 2], [3, 4]) == 1.0 and histogram_tv([], []) == 0.0


def test_sparse_pair_coarsens_both_engines_alike():
    import math

    stats = PhaseStats()
    same = {1: math.log(0.5), 2: math.log(0.3)}
    compare_sparse_pair(stats, [same], [dict(same)], [2])
    row = stats.row()
    assert row["top1"] == 1.0 and row["tv"] == 0.0 and row["kl"] == 0.0
    moved = PhaseStats()  # 0.1 of id 1's probability moves to id 2: the argmax stays, TV is 0.1
    compare_sparse_pair(moved, [same], [{1: math.log(0.4), 2: math.log(0.4)}], [2])
    assert moved.row()["tv"] == pytest.approx(0.1) and moved.row()["kl"] > 0


@pytest.mark.slow  # a quality row; an FP8 KV engine's song stays in tests/test_kv_cache.py
@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_fp8_kv_row_on_the_tiny_model(tiny_model_dir, corpus, tmp_path):  # noqa: F811
    from yue2_vllm.kv_cache import cpu_fp8_isa

    if not cpu_fp8_isa():  # vLLM-CPU stores FP8 K/V only with AVX-512 or AMX: the refusal is the record here
        pytest.skip("this CPU has neither AVX-512 nor AMX: --kv-cache-dtype fp8 is refused (test_kv_cache.py)")
    report = run_kv_gate(f"torch:{tiny_model_dir}", corpus, tmp_path / "kv")
    floor, fp8 = report["rows"]
    assert floor["candidate"].endswith("(bf16 KV against itself)") and fp8["candidate"].endswith("#kv=fp8")
    for phase in ("abc", "semantic"):
        same, m = floor["phases"][phase], fp8["phases"][phase]
        assert same["top1"] == 1.0 and same["tv"] == 0.0 and same["sampled_tv"] == 0.0
        assert m["positions"] == same["positions"] > 0 and m["sampled_tokens"] > 0
        # The tiny model's random weights give near-flat logits (every position "unsure"): there the argmax flips
        # under any rounding (top-1 0.85-0.975 by CPU), so the bound is on the distributions: FP8 K/V moves them
        # by ~1e-6 KL / ~5e-5 TV; a wrong scale or layout moves them by orders of magnitude more.
        assert m["tv"] < 1e-3 and 0 <= m["kl"] < 1e-4 and 0 <= m["sampled_tv"] <= 1
        # Same seeds on both engines: FP8 K/V changes fewer sampled ids than other seeds do.
        assert m["sampled_tv"] < m["sampled_tv_floor"]
    assert fp8["phases"]["semantic"]["positions"] == 40
    table = (tmp_path / "kv" / "kv_quality.md").read_text()
    assert table == kv_markdown(report["rows"]) and "| KV cache | phase |" in table
    assert json.loads((tmp_path / "kv" / "kv_quality.json").read_text())["rows"][1]["phases"]["abc"]


def test_the_kv_row_refuses_auto_and_unknown_forms(tiny_model_dir, corpus, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="compares an FP8 form against bf16 K/V"):
        run_kv_gate(f"torch:{tiny_model_dir}", corpus, tmp_path / "kv", ("auto",))
    with pytest.raises(ValueError, match="unknown KV cache form"):
        run_kv_gate(f"torch:{tiny_model_dir}", corpus, tmp_path / "kv", ("int8",))
