"""int8 weight-only vs bf16 on CPU: the matmul kernels at YuE2's shapes.

`torch._weight_int8pack_mm` (per-output-channel int8, the `Int8Linear` kernel) against bf16
   `F.linear` at the AR shapes — q/o 2048x2048, gate/up [6144, 2048], down [2048, 6144] — and the
   full lm_head [184704, 2048] (which stays bf16 in every int8 format; listed for scale), at
   M=1 (decode) and M=8. Medians of repeats; `int8_speedup` = bf16 seconds / int8 seconds.
Decode tok/s of the torch backend with and without int8 proxies is `yue2-vllm bench --model one-layer
--paths torch-bf16,torch-int8` (measured once, there).

Run with `python bench/bench_int8.py`; prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from yue2_vllm.model.torch_quant import int8_linear, int8pack_available, quantize_int8

SHAPES = {  # name: (out_features, in_features) of the weight
    "q_o_proj 2048x2048": (2048, 2048),
    "gate_up_proj [6144,2048]": (6144, 2048),
    "down_proj [2048,6144]": (2048, 6144),
    "lm_head [184704,2048]": (184704, 2048),
}


def paired_seconds(fns: dict, repeats: int, warmup: int = 2) -> dict[str, dict[str, float]]:
    """Median and minimum seconds of each function, calls interleaved so all see the same CPU contention."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: {"median": statistics.median(t), "min": min(t)} for name, t in times.items()}


@torch.inference_mode()
def bench_matmuls(repeats: int) -> list[dict]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        weight = (torch.randn(n, k, generator=generator) / k ** 0.5).to(torch.bfloat16)
        q, scale = quantize_int8(weight)
        reps = max(5, repeats // 4) if n > 100_000 else repeats
        for m in (1, 8):
            x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
            fns = {"bf16": lambda: F.linear(x, weight), "int8": lambda: torch._weight_int8pack_mm(x, q, scale)}
            if n < 100_000:  # the dequantising fallback (what a device without the kernel runs)
                fns["dequant_fallback"] = lambda: int8_linear(x, q, scale, kernel=False)
            t = paired_seconds(fns, reps)
            bf16, int8 = t["bf16"]["median"], t["int8"]["median"]
            row = {"shape": name, "M": m, "bf16_ms": 1e3 * bf16, "int8_ms": 1e3 * int8, "int8_speedup": bf16 / int8,
                   "int8_speedup_of_minima": t["bf16"]["min"] / t["int8"]["min"],
                   "bf16_GBps": weight.nbytes / bf16 / 1e9, "int8_GBps": (q.nbytes + scale.nbytes) / int8 / 1e9}
            if "dequant_fallback" in t:
                row["dequant_fallback_ms"] = 1e3 * t["dequant_fallback"]["median"]
            rows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        del weight, q, scale
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="matmul repeats (lm_head uses a quarter)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "int8pack_cpu_bf16": int8pack_available("cpu", torch.bfloat16), "matmuls": bench_matmuls(args.repeats)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
