"""Prepared CUDA check of the torch-path AR quantization: kernels, exactness, decode speed.

On one CUDA GPU: (1) quantize_int8 / quantize_fp8 give the same bits on CUDA as on the CPU
(so a CPU export equals load-time quantization on the GPU); (2) bf16 F.linear vs int8
(`Int8Linear`: packed kernel if CUDA has one, else dequantise) vs FP8 (`FP8Linear`:
`_scaled_mm`, sm89+) at YuE2 shapes, M=1 and 8, CUDA-event medians; (3) decode tok/s of
`TorchARBackend` at batch 1 on a real-width random model (bf16, int8 proxies, FP8 proxies),
`restore_ar` exactness and its peak extra memory. Exits 0 with a message when CUDA is absent.

    python bench/gpu_quant.py [--layers 4] [--tokens 32]   # JSON on stdout, and $OUT/gpu_quant.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

SHAPES = {"q_o 2048x2048": (2048, 2048), "gate_up [6144,2048]": (6144, 2048), "down [2048,6144]": (2048, 6144),
          "lm_head [184704,2048]": (184704, 2048)}


def cuda_ms(fn, iters: int = 50, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def guarded(fn):
    try:
        return fn()
    except Exception as exc:  # keep the rest of the report
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=3)}


@torch.inference_mode()
def kernels(device, fp8_ok: bool) -> dict:
    from yue2_vllm.model.torch_quant import FP8Linear, Int8Linear, quantize_fp8, quantize_int8

    weight = torch.randn(6144, 2048).to(torch.bfloat16)
    q_cpu, s_cpu = quantize_int8(weight)
    q_gpu, s_gpu = quantize_int8(weight.to(device))
    f_cpu, fs_cpu = quantize_fp8(weight)
    f_gpu, fs_gpu = quantize_fp8(weight.to(device))
    report = {"int8_cpu_equals_cuda": torch.equal(q_cpu, q_gpu.cpu()) and torch.equal(s_cpu, s_gpu.cpu()),
              "fp8_cpu_equals_cuda": torch.equal(f_cpu.view(torch.uint8), f_gpu.cpu().view(torch.uint8))
              and torch.equal(fs_cpu, fs_gpu.cpu()), "shapes": []}
    for name, (n, k) in SHAPES.items():
        linear = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        int8 = Int8Linear.from_linear(linear)
        fp8 = FP8Linear.from_linear(linear) if fp8_ok else None
        for m in (1, 8):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            row = {"shape": name, "M": m, "bf16_ms": cuda_ms(lambda: F.linear(x, linear.weight)),
                   "int8_ms": cuda_ms(lambda: int8(x))}
            if fp8 is not None:
                row["fp8_ms"] = cuda_ms(lambda: fp8(x))
                exact = F.linear(x, linear.weight).float()
                row["fp8_rel_error"] = ((fp8(x).float() - exact).norm() / exact.norm()).item()
            row["int8_speedup"] = row["bf16_ms"] / row["int8_ms"]
            if "fp8_ms" in row:
                row["fp8_speedup"] = row["bf16_ms"] / row["fp8_ms"]
            report["shapes"].append(row)
        del linear, int8, fp8
    return report


def decode(device, layers: int, tokens: int, prefix_tokens: int, fp8_ok: bool) -> dict:
    from yue2_vllm.model.modeling import YuE2Config
    from yue2_vllm.protocol import EOD, MUSIC_START, Sampling
    from yue2_vllm.model.sampling import TorchARBackend
    from yue2_vllm.testing import random_model
    from yue2_vllm.model.torch_quant import apply_memory_cap, module_bytes, prepare_ar_proxies, restore_ar

    start = time.perf_counter()
    model = random_model(YuE2Config(num_hidden_layers=layers))
    reference = {name: t.clone() for name, t in model.state_dict().items()}
    model = model.to(device)
    report = {"layers": layers, "model_bytes": module_bytes(model), "build_s": time.perf_counter() - start}
    prefix = [EOD] + [100 + i % 5000 for i in range(prefix_tokens - 2)] + [MUSIC_START]

    def tok_s() -> float:
        backend = TorchARBackend(model)
        backend.generate(prefix[:16], Sampling(min_tokens=4, max_tokens=4), 0, "semantic")
        runs = [backend.generate(prefix, Sampling(min_tokens=tokens, max_tokens=tokens), s, "semantic").timing
                for s in range(3)]
        return 1 / statistics.median((t["seconds"] - t["prefill_seconds"]) / t["output_tokens"] for t in runs)

    report["bf16_tok_s"] = guarded(tok_s)
    for mode in ("int8", "fp8") if fp8_ok else ("int8",):
        def run(mode=mode):
            status = prepare_ar_proxies(model, mode)
            speed = tok_s()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            restore_ar(model)
            torch.cuda.synchronize()
            restored = model.state_dict()
            exact = all(torch.equal(restored[n].cpu(), t) for n, t in reference.items())
            return {"tok_s": speed, "kernel": status["kernel"], "restore_exact": exact,
                    "restore_peak_extra_bytes": torch.cuda.max_memory_allocated() - before,
                    "device_bytes_with_proxies": before}
        report[mode] = guarded(run)
    report["memory_cap_24gib"] = guarded(lambda: apply_memory_cap(device, 24, report["model_bytes"]))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=512)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_quant: CUDA is not available here; nothing to measure (run on a CUDA machine)")
        return 0
    from yue2_vllm.model.torch_quant import fp8_supported, int8pack_available

    device = torch.device("cuda", torch.cuda.current_device())
    fp8_reason = fp8_supported(device)
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device),
              "capability": list(torch.cuda.get_device_capability(device)),
              "int8pack_cuda_bf16": int8pack_available(device, torch.bfloat16), "fp8": fp8_reason or "supported"}
    report["kernels"] = guarded(lambda: kernels(device, fp8_reason is None))
    report["decode"] = guarded(lambda: decode(device, args.layers, args.tokens, args.prefix, fp8_reason is None))
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_quant.json"), "w") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
