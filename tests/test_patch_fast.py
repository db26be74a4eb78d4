"""patches/patch_fast.py against a stand-in for upstream yue2/fast.py."""
import asyncio
import difflib
import importlib.util
import json
import shutil
import subprocess
import sys
import types
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "patches" / "patch_fast.py"
SAMPLE = ROOT / "tests" / "data" / "upstream_fast_sample.py"


def run_patch(path, *args):
    return subprocess.run([sys.executable, str(SCRIPT), str(path), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def fast(tmp_path):
    target = tmp_path / "yue2" / "fast.py"
    target.parent.mkdir()
    shutil.copyfile(SAMPLE, target)
    return target


@pytest.fixture
def patched(fast):
    result = run_patch(fast)
    assert result.returncode == 0, result.stderr
    return fast


@pytest.fixture
def model_dir(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"num_hidden_layers": 2}), encoding="utf-8")
    return directory


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("YUE2_AR_CHECKPOINT", raising=False)
    monkeypatch.delenv("YUE2_VLLM_ALLOW", raising=False)
    monkeypatch.setenv("YUE2_CACHE", str(tmp_path / "cache"))


def load(path):
    spec = importlib.util.spec_from_file_location(f"patched_fast_{uuid.uuid4().hex}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_vllm(monkeypatch, version):
    module = types.ModuleType("vllm")
    module.__version__ = version
    monkeypatch.setitem(sys.modules, "vllm", module)


def worker(module, model_dir):
    return asyncio.run(module._worker_main({"model_dir": str(model_dir)}))


def test_override_returns_checkpoint_dir(patched, model_dir, tmp_path, monkeypatch):
    checkpoint = tmp_path / "fp8"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}", encoding="utf-8")
    monkeypatch.setenv("YUE2_AR_CHECKPOINT", str(tmp_path / "fp8" / ".." / "fp8"))
    module = load(patched)
    assert module.derive_ar_checkpoint(model_dir) == checkpoint.resolve()
    assert not (tmp_path / "cache").exists()  # no derivation, no cache


def test_unset_override_derives_as_before(patched, model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("YUE2_AR_CHECKPOINT", "")
    derived = load(patched).derive_ar_checkpoint(model_dir)
    assert derived == tmp_path / "cache" / "yue2-ar" / "derived"
    assert json.loads((derived / "config.json").read_text())["model_type"] == "qwen3"


@pytest.mark.parametrize("make, reason", [
    (lambda path: None, "is not an existing directory"),
    (lambda path: path.write_text("x"), "is not an existing directory"),
    (lambda path: path.mkdir(), "has no config.json"),
])
def test_invalid_override_is_a_clear_error(patched, model_dir, tmp_path, monkeypatch, make, reason):
    bad = tmp_path / "bad"
    make(bad)
    monkeypatch.setenv("YUE2_AR_CHECKPOINT", str(bad))
    with pytest.raises(FileNotFoundError, match=reason) as error:
        load(patched).derive_ar_checkpoint(model_dir)
    assert "YUE2_AR_CHECKPOINT" in str(error.value) and str(bad) in str(error.value)


def test_version_gate_defaults_to_the_pin(patched, model_dir, monkeypatch):
    module = load(patched)
    fake_vllm(monkeypatch, "0.19.0")
    assert worker(module, model_dir)["model_type"] == "qwen3"
    fake_vllm(monkeypatch, "0.20.1")
    with pytest.raises(RuntimeError, match=r"requires vllm==0\.19\.0, found 0\.20\.1.*YUE2_VLLM_ALLOW"):
        worker(module, model_dir)


@pytest.mark.parametrize("spec, version, admitted", [
    ("0.20.1", "0.20.1", True),
    ("0.20.1", "0.20.1+cu128", True),
    ("0.20.1", "0.20.10", False),
    ("0.18, 0.20.1", "0.20.1", True),
    ("0.21", "0.21.3", True),
    ("0.2", "0.21.3", False),
    ("0.3*", "0.31.0", True),
    ("0.3*", "0.29.0", False),
    ("*", "1.0.0", True),
    ("", "0.20.1", False),
])
def test_version_gate_env(patched, model_dir, monkeypatch, spec, version, admitted):
    module = load(patched)
    monkeypatch.setenv("YUE2_VLLM_ALLOW", spec)
    fake_vllm(monkeypatch, version)
    if admitted:
        assert worker(module, model_dir)["model_type"] == "qwen3"
    else:
        with pytest.raises(RuntimeError, match="YUE2_VLLM_ALLOW"):
            worker(module, model_dir)


def test_allow_vllm_bakes_a_default(fast, model_dir, monkeypatch):
    result = run_patch(fast, "--allow-vllm", "0.20.1,0.3*")
    assert result.returncode == 0, result.stderr
    module = load(fast)
    for version in ("0.19.0", "0.20.1", "0.33.0"):
        fake_vllm(monkeypatch, version)
        assert worker(module, model_dir)["model_type"] == "qwen3"
    fake_vllm(monkeypatch, "0.22.0")
    with pytest.raises(RuntimeError, match="found 0.22.0"):
        worker(module, model_dir)
    monkeypatch.setenv("YUE2_VLLM_ALLOW", "")  # the variable replaces the baked default
    fake_vllm(monkeypatch, "0.20.1")
    with pytest.raises(RuntimeError, match="found 0.20.1"):
        worker(module, model_dir)


def test_second_run_is_a_no_op(patched):
    before = patched.read_bytes()
    result = run_patch(patched)
    assert result.returncode == 0 and "already patched" in result.stdout
    assert patched.read_bytes() == before


def test_second_run_with_other_allowance_is_refused(patched):
    before = patched.read_bytes()
    result = run_patch(patched, "--allow-vllm", "0.21")
    assert result.returncode != 0 and "already patched" in result.stderr
    assert patched.read_bytes() == before


def test_backup_equals_original_and_is_never_overwritten(fast):
    original = fast.read_bytes()
    backup = fast.with_name("fast.py.orig")
    assert run_patch(fast).returncode == 0
    assert backup.read_bytes() == original
    fast.write_bytes(original)
    backup.write_bytes(b"older backup")
    assert run_patch(fast).returncode == 0
    assert backup.read_bytes() == b"older backup"


@pytest.mark.parametrize("edit", [
    lambda text: text.replace("def derive_ar_checkpoint(model_dir, cache_dir=None)", "def derive(model_dir)"),
    lambda text: text.replace("def derive_ar_checkpoint(model_dir, cache_dir=None)",
                              "def derive_ar_checkpoint(path, cache_dir=None)"),
    lambda text: text.replace('vllm.__version__ != "0.19.0"', 'not vllm.__version__.startswith("0.19")'),
    lambda text: text.replace("        raise RuntimeError(", "        print(", 1),
    lambda text: text + '\n\ndef again(vllm):\n    if vllm.__version__ != "0.19.0":\n        raise ValueError()\n',
    lambda text: text + "\nthis is not python(\n",
])
def test_unrecognised_file_is_refused(fast, edit):
    fast.write_text(edit(SAMPLE.read_text()))
    before = fast.read_bytes()
    result = run_patch(fast)
    assert result.returncode != 0
    assert "nothing changed" in result.stderr
    assert fast.read_bytes() == before
    assert not fast.with_name("fast.py.orig").exists()


def test_dry_run_prints_diff_and_changes_nothing(fast):
    before = fast.read_bytes()
    result = run_patch(fast, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"--- {fast}\n+++ {fast} (patched)\n@@")
    assert "+    _yue2_override = _yue2_ar_override()" in result.stdout
    assert fast.read_bytes() == before
    assert sorted(path.name for path in fast.parent.iterdir()) == ["fast.py"]


def test_diff_touches_only_expected_lines(patched):
    original = SAMPLE.read_text().splitlines()
    after = patched.read_text().splitlines()
    removed, added = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, original, after, autojunk=False).get_opcodes():
        removed += original[i1:i2] if tag in ("replace", "delete") else []
        added += after[j1:j2] if tag in ("replace", "insert") else []
    assert [line.strip() for line in removed] == [
        'if vllm.__version__ != "0.19.0":',
        'raise RuntimeError(f"This backend requires vllm==0.19.0, found {vllm.__version__}")']
    start = added.index("# >>> yue2_vllm patch (patches/patch_fast.py) >>>")
    end = added.index("# <<< yue2_vllm patch <<<")
    assert start == 0 and added[end + 1:end + 3] == ["", ""]
    assert [line.strip() for line in added[end + 3:]] == [
        "_yue2_override = _yue2_ar_override()  # yue2_vllm patch: YUE2_AR_CHECKPOINT",
        "if _yue2_override is not None:",
        "return _yue2_override",
        "if not _yue2_vllm_allowed(vllm.__version__):  # yue2_vllm patch: YUE2_VLLM_ALLOW",
        "raise RuntimeError(_yue2_vllm_refusal(vllm.__version__))"]
    # The override sits right after the docstring.
    docstring = after.index('    """Extract the AR subset into a content-addressed cache (here: just its config)."""')
    assert after[docstring + 1].startswith("    _yue2_override = ")


def test_crlf_line_endings_are_kept(fast):
    fast.write_bytes(SAMPLE.read_bytes().replace(b"\n", b"\r\n"))
    assert run_patch(fast).returncode == 0
    data = fast.read_bytes()
    assert b"_yue2_ar_override" in data and data.count(b"\n") == data.count(b"\r\n")
