"""README's commands and code are what CI and users run."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_python_api_example_runs_as_printed(tiny_model_dir, tiny_vae_dir, tmp_path):
    from yue2_vllm.testing import TINY_VERSION

    (example,) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    cache = tmp_path / "cache" / TINY_VERSION  # the tiny default, already generated (what tiny_default() makes)
    cache.mkdir(parents=True)
    (cache / "YuE2-3B-tiny").symlink_to(tiny_model_dir, target_is_directory=True)
    (cache / "YuE2-Vae-tiny").symlink_to(tiny_vae_dir, target_is_directory=True)
    result = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "YUE2_VLLM_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "48 250 (250, 64) (479936, 2)"
    assert "nar: 32/32" in result.stdout and "vae: 1/1" in result.stdout


def test_the_test_command_is_what_ci_runs_and_says_how_to_enable_export_tests():
    section = README[README.index("## Run the tests"):README.index("## Layout")]
    (command,) = re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    runs = [line for line in ci.splitlines() if "-m pytest" in line and not line.startswith("#")]
    # README's command first, then the slow tests; each failure is kept and the script exits with it.
    assert runs == [f"{command} || status=$?", f"{command} -m slow || status=$?"]
    assert ci.rstrip().splitlines()[-1] == "exit $status"
    assert f"`{command} -m slow`" in section
    assert "bash calibration/setup-quant-env.sh" in section and "tests/test_quant_export.py" in section
    for step in ("entry_point_installed", "yue2-vllm doctor", "setup-quant-env.sh"):
        assert step in ci
    assert "entry point" in section and "`yue2-vllm doctor`" in section and "setup-quant-env.sh" in section
