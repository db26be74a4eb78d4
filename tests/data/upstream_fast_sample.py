"""Stand-in for upstream yue2/fast.py (YuE @ bd20996) for tests/test_patch_fast.py.

Only the shapes patches/patch_fast.py edits are reproduced: derive_ar_checkpoint() with its
signature, docstring, cache logic and returned Path, and the worker's exact vLLM version pin.
"""
import json
import os
from pathlib import Path

CONTEXT = 24576


def qwen_config(config):
    return {**config, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}


def derive_ar_checkpoint(model_dir, cache_dir=None):
    """Extract the AR subset into a content-addressed cache (here: just its config)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if cache_dir is None:
        base = Path(os.environ.get("YUE2_CACHE", Path.home() / ".cache/huggingface"))
        cache_dir = base / "yue2-ar"
    target = Path(cache_dir) / "derived"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(qwen_config(config)), encoding="utf-8")
    return target


async def _worker_main(setup):
    import vllm
    if vllm.__version__ != "0.19.0":
        raise RuntimeError(f"This backend requires vllm==0.19.0, found {vllm.__version__}")
    derived = derive_ar_checkpoint(setup["model_dir"])
    return json.loads((derived / "config.json").read_text(encoding="utf-8"))
