"""The installed vLLM's version, and its release read in one place."""
from yue2_vllm.engine.lora import needs_mixed_batch_guard
from yue2_vllm.engine.runner import resolve_runner
from yue2_vllm.vllm_release import release, vllm_version


def test_release():
    assert release("0.32.0") == (0, 32) and release("0.32.0+cpu") == (0, 32) and release("0.33.1rc1") == (0, 33)
    assert release("1.2") == (1, 2)
    assert release(None) is None and release("") is None and release("unknown") is None and release("1") is None


def test_its_readers_agree():
    """The LoRA guard, the runner choice and the KV checks read the release the same way."""
    assert needs_mixed_batch_guard("0.32.0+cpu", "cpu") and not needs_mixed_batch_guard("0.33.0", "cpu")
    assert needs_mixed_batch_guard("unknown", "cpu") and not needs_mixed_batch_guard("0.32.0", "cuda")
    assert "0.30" in resolve_runner("auto", "cuda", "0.30.2", triton=True, environ={}).reason
    assert resolve_runner("auto", "cuda", "0.31.0", triton=True, environ={}).runner == "v2"


def test_the_installed_version_is_read_without_importing_vllm():
    import subprocess
    import sys

    code = ("import sys; from yue2_vllm.vllm_release import vllm_version; found = vllm_version(); "
            "print(found, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == str(vllm_version()) and out[1] == "False"
