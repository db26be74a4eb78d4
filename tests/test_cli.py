import json
import os
import subprocess
import sys

from yue2_vllm.cli import main


def test_make_tiny(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "t")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"].endswith("YuE2-3B-tiny") and (tmp_path / "t" / "YuE2-Vae-tiny" / "model.safetensors").exists()


def test_demo_on_embedded_default(tmp_path):
    env = {**os.environ, "YUE2_VLLM_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "yue2_vllm.cli", "demo", "--frames", "4"], env=env,
                            capture_output=True, text=True, check=True)
    summary = json.loads(result.stdout)
    assert summary["audio_shape"] == [1, 2, 1920 * 4 - 64] == [1, 2, summary["audio_samples_expected"]]
    assert summary["layers"] == 2 and summary["abc_prompt_tokens"] > 20
    assert 0 <= summary["abc_first_token"]["id"] < 151643 or summary["abc_first_token"]["id"] == 151848
    assert (tmp_path / "tiny-v1" / "YuE2-3B-tiny" / "model.safetensors").exists()


def test_demo_needs_both_paths(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="both --model and --vae"):
        main(["demo", "--model", str(tmp_path)])
