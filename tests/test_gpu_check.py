import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
TORCH_SECTIONS = ("torch.devices", "torch.numerics", "torch.vae", "torch.ar", "torch.fp8", "torch.int8",
                  "torch.memory", "torch.graph", "torch.release_song")
ENGINE_SECTIONS = ("engine.sampler", "engine.sampler_syncs", "engine.sliced_head", "engine.mrv2_sliced_head",
                   "engine.runners", "engine.kv_cache", "engine.lora")
SPARK_SECTIONS = ("spark.kernels", "spark.memory")
# The default run runs the torch and spark sections (what a lent GPU runs first, on their CPU parts); the slow run
# every section. On a CPU the engine sections start tiny engines (engine.kv_cache and engine.lora four, to time them:
# 50 s here); what they show is tested for real in tests/test_kv_cache.py and tests/test_engine_lora.py.


@pytest.mark.parametrize("wanted", [
    TORCH_SECTIONS + SPARK_SECTIONS,
    pytest.param(TORCH_SECTIONS + ENGINE_SECTIONS + SPARK_SECTIONS, marks=pytest.mark.slow)],
    ids=["torch-and-spark", "all"])
def test_gpu_check_quick_runs_its_cpu_parts_and_names_every_section(tmp_path, wanted):
    report_path = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(report_path), "--only",
                             ",".join(wanted)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in wanted:
        assert f"== {name} (" in result.stdout
    report = json.loads(report_path.read_text())
    sections = report["sections"]
    assert set(sections) == set(wanted)
    assert not any("error" in s for s in sections.values())
    kernels = {row["row"]: row for row in sections["spark.kernels"]["rows"]}
    assert kernels["sm121 int8"]["kernel"] == "TritonInt8ScaledMMLinearKernel" and kernels["sm121 int8"]["runs"]
    assert kernels["sm90 int8"]["kernel"] == "CutlassInt8ScaledMMLinearKernel" and kernels["sm90 int8"]["engine_env"] is None
    assert "engine.sampler" not in wanted or {row["row"] for row in sections["engine.sampler"]["rows"]} == {
        "bfloat16 cfg=off", "bfloat16 cfg=1.5 legacy", "float32 cfg=off", "float32 cfg=1.5 legacy"}
    assert all(row["ok"] for row in sections["torch.numerics"]["rows"])
    kv = {row["row"]: row for row in sections.get("engine.kv_cache", {"rows": []})["rows"]}
    if "engine, KV auto" in kv and "skipped" not in kv["engine, KV auto"]:  # vLLM installed
        assert kv["engine, KV auto"]["kv_element_bytes"] == 2 and kv["engine, KV auto"]["tps_8_rows"] > 0
        fp8 = kv["engine, KV fp8"]  # run, or skipped with the one-line refusal on a CPU without AVX-512/AMX
        assert ("AVX-512" in fp8["skipped"]) if "skipped" in fp8 else fp8["kv_element_bytes"] == 1
        if "skipped" not in fp8:
            assert fp8["plan_kv_bytes"] < kv["engine, KV auto"]["plan_kv_bytes"] and fp8["tps_1_row"] > 0
    lora = {row["row"]: row for row in sections.get("engine.lora", {"rows": []})["rows"]}
    if "skipped" not in lora.get("engine LoRA v1", {"skipped": 1}):  # vLLM installed: float32 on the CPU
        assert lora["engine LoRA v1"]["adapter_equals_merged"] and lora["engine LoRA v1"]["tps_8_rows_4_adapters"] > 0
    song = sections["torch.release_song"]["rows"][0]  # the code path of the release row, on the tiny model
    assert song["finite"] and song["ar_moves"] == 0 and song["prefill_weights"] in ("resident", "streamed")
    graph_rows = sections["torch.graph"]["rows"]
    assert [row["tokens_identical"] for row in graph_rows[:2]] == [True, True]
    assert {row["execution"] for row in graph_rows[:2]} == {"batched"}
    if report["device"] == "cpu only":
        assert graph_rows[-1]["skipped"].startswith("CUDA not available")
        assert sections["torch.memory"]["skipped"].startswith("CUDA not available")
        assert "SKIPPED: CUDA not available" in result.stdout
