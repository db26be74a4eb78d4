"""`yue2-vllm bench` on the tiny default: every requested path measured, the table and JSON written."""
import json
import subprocess
import sys

import pytest

from yue2_vllm.engine.backend import vllm_version


def test_bench_table_on_the_tiny_default(tmp_path):
    paths = "torch-bf16,vllm-bf16" if vllm_version() else "torch-bf16"
    result = subprocess.run([sys.executable, "-m", "yue2_vllm.cli", "bench", "--paths", paths, "--tokens", "6",
                             "--repeats", "1", "--concurrency", "2", "--nar-steps", "1", "--workdir",
                             str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, check=True)
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [row["path"] for row in report["ar"]] == paths.split(",")
    for row in report["ar"]:
        assert row["semantic_decode_tok_s"] > 0 and row["abc_prefill_tok_s"] > 0 and row["peak_rss_bytes"] > 0
    if vllm_version():
        engine = report["ar"][1]
        assert engine["semantic_decode_tok_s_x2"] > 0 and engine["engine_start_s"] > 0 and engine["policy"] == "bf16"
    assert report["synthesis"]["nar_s_per_step"] > 0 and report["synthesis"]["vae_rtf"] > 0
    assert report["machine"]["cpu_isa"].startswith("CPU ")
    table = (tmp_path / "out" / "bench.md").read_text()
    assert table == result.stdout and "| torch-bf16 |" in table and "semantic decode tok/s ×N" in table


@pytest.mark.slow  # a bench row; transcription runs for real in tests/test_transcription_*.py
def test_bench_transcription_rows_measure_each_source_length_side_by_side(tmp_path, monkeypatch):
    """The covers' transcribers, no model loaded: pyin's seconds per audio minute (warm and first) and peak memory
    for each source length; SheetSage2, not set up here, is a line saying why."""
    monkeypatch.setenv("YUE2_SHEETSAGE_PYTHON", str(tmp_path / "no-python"))
    result = subprocess.run([sys.executable, "-m", "yue2_vllm.cli", "bench", "--paths", "transcription", "--repeats",
                             "1", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, check=True)
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = report["transcription"]["rows"]
    assert [(row["transcriber"], row["source_s"]) for row in rows] == [("pyin", 30.0), ("pyin", 120.0)]
    for row in rows:
        assert row["notes"] > row["source_s"] and row["s_per_audio_min"] > 0 and row["peak_rss_above_bytes"] > 0
        assert row["first_s_per_audio_min"] > 0
    assert report["synthesis"] is None and report["ar"] == []  # no model measured
    assert "setup-sheetsage-env.sh" in report["transcription"]["not_run"]["sheetsage2"]
    assert "| pyin | 120 |" in result.stdout and "(sheetsage2 not run: " in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_bench_takes_row_compares_takes_with_separate_requests(tmp_path):
    subprocess.run([sys.executable, "-m", "yue2_vllm.cli", "bench", "--paths", "takes", "--tokens", "6", "--repeats",
                    "1", "--nar-steps", "1", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                   capture_output=True, text=True, check=True)
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    separate, takes, ratio = report["takes"]["rows"]
    assert (separate["mode"], takes["mode"]) == ("separate", "takes") and takes["songs"] == 4
    for row in (separate, takes):
        assert row["wall_s"] > 0 and row["songs_per_s"] > 0 and row["prompt_tokens"] > 0
        assert row["computed_prompt_tokens"] == row["prompt_tokens"] - row["cached_prompt_tokens"]
    assert takes["cached_prompt_tokens"] > 0.5 * takes["prompt_tokens"]  # the shared prompt is prefilled once
    assert ratio["wall_s"] > 0
    assert "| takes |" in (tmp_path / "out" / "bench.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_bench_head_rows_set_the_sliced_and_the_full_head_side_by_side(tmp_path):
    result = subprocess.run([sys.executable, "-m", "yue2_vllm.cli", "bench", "--paths", "head", "--tokens", "4",
                             "--repeats", "1", "--concurrency", "2", "--nar-steps", "1", "--workdir",
                             str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, check=True)
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = report["head"]["rows"]
    assert {(r["runner"], r["numerics"], r["phase"], r["rows"]) for r in rows} == {
        (runner, numerics, phase, count) for runner in ("v1", "mrv2 head+sampler")
        for numerics in ("bf16", "reproducible") for phase in ("abc", "semantic") for count in (1, 2)}
    for row in rows:
        assert row["sliced_tok_s"] > 0 and row["full_tok_s"] > 0 and row["choice"] == "sliced"
    assert "| v1 | reproducible | abc | 2 |" in result.stdout and "sliced / full" in result.stdout


@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_engine_memory_row_reads_the_workers_peak_against_the_plan(tmp_path):
    """The real-size row (`--model release-size`, run by hand: docs/memory.md) on the tiny model: the engine as
    the plan sizes it, started and serving 2 rows; its worker's peak RSS against the plan's engine peak."""
    from yue2_vllm.bench import BenchConfig, markdown, run
    from yue2_vllm.memory import ENGINE_LOAD_BYTES, ENGINE_OVERHEAD_BYTES
    from yue2_vllm.testing import tiny_default

    model_dir, _ = tiny_default()
    report = run(BenchConfig(model_dir, None, "tiny", ("engine-memory",), workdir=tmp_path))
    (row,) = report["ar"]
    assert report["synthesis"] is None  # the memory rows alone load no MoT
    assert row["rows"] == 2 and row["kv_cache_dtype"] == "auto" and row["device"] == "cpu"
    assert row["plan_overhead_bytes"] == ENGINE_OVERHEAD_BYTES["cpu"]
    assert row["plan_engine_bytes"] == row["plan_weights_bytes"] + row["plan_kv_bytes"] + row["plan_overhead_bytes"]
    assert row["plan_peak_bytes"] == max(row["plan_engine_bytes"], 2 * row["plan_weights_bytes"]
                                         + ENGINE_LOAD_BYTES["cpu"])
    # The worker holds its weights and KV cache and more (Python, torch, vLLM); the peak is the most it held.
    assert row["peak_bytes"] >= row["rss_served_bytes"] > row["plan_weights_bytes"] + row["plan_kv_bytes"]
    assert row["measured_overhead_bytes"] == row["rss_served_bytes"] - row["plan_weights_bytes"] - row["plan_kv_bytes"]
    assert row["peak_over_plan"] == row["peak_bytes"] / row["plan_peak_bytes"] and row["within_plan"]
    assert row["kv_cache"]["attention_backend"] == "CPU_ATTN" and row["decode_tok_s_rows"] > 0
    assert "| engine-memory | 2 | auto |" in markdown(report)
