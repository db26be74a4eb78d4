import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
TORCH_SECTIONS = ("torch.devices", "torch.numerics", "torch.vae", "torch.ar", "torch.fp8", "torch.int8",
                  "torch.memory")
ENGINE_SECTIONS = ("engine.sampler", "engine.sampler_syncs", "engine.sliced_head", "engine.mrv2_sliced_head",
                   "engine.runners")


def test_gpu_check_quick_runs_its_cpu_parts_and_names_every_section(tmp_path):
    report_path = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(report_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in TORCH_SECTIONS + ENGINE_SECTIONS:
        assert f"== {name} (" in result.stdout
    report = json.loads(report_path.read_text())
    sections = report["sections"]
    assert set(TORCH_SECTIONS + ENGINE_SECTIONS) <= set(sections) and not any("error" in s for s in sections.values())
    assert {row["row"] for row in sections["engine.sampler"]["rows"]} == {
        "bfloat16 cfg=off", "bfloat16 cfg=1.5 legacy", "float32 cfg=off", "float32 cfg=1.5 legacy"}
    assert all(row["ok"] for row in sections["torch.numerics"]["rows"])
    if report["device"] == "cpu only":
        assert sections["torch.memory"]["skipped"].startswith("CUDA not available")
        assert "SKIPPED: CUDA not available" in result.stdout
