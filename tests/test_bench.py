"""`yue2-vllm bench` on the tiny default: every requested path measured, the table and JSON written."""
import json
import subprocess
import sys

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
