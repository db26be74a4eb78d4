"""int8 weight-only vs bf16 on CPU: matmuls at YuE2 shapes and torch-backend decode tokens/s.

1. `torch._weight_int8pack_mm` (per-output-channel int8, the `Int8Linear` kernel) against bf16
   `F.linear` at the AR shapes — q/o 2048x2048, gate/up [6144, 2048], down [2048, 6144] — and the
   full lm_head [184704, 2048] (which stays bf16 in every int8 format; listed for scale), at
   M=1 (decode) and M=8. Medians of repeats; `int8_speedup` = bf16 seconds / int8 seconds.
2. Decode tokens/s of `TorchARBackend` at batch 1 on real-width random models (one layer, and a
   few more to split the per-layer cost from the fixed cost: embedding, norm, 184,704-row lm_head,
   sampling), bf16 against load-time int8 proxies, with a linear projection to 28 layers.

Run with `python bench/bench_int8.py`; prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from yue2_vllm.model.modeling import YuE2Config
from yue2_vllm.protocol import EOD, MUSIC_START, Sampling
from yue2_vllm.model.sampling import TorchARBackend
from yue2_vllm.testing import random_model
from yue2_vllm.model.torch_quant import (int8_linear, int8pack_available, prepare_ar_proxies, quantize_int8,
                                  restore_ar)

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


def decode_seconds(model, prefix: list[int], tokens: int, seed: int) -> float:
    timing = TorchARBackend(model).generate(prefix, Sampling(min_tokens=tokens, max_tokens=tokens), seed,
                                            "semantic").timing
    return (timing["seconds"] - timing["prefill_seconds"]) / timing["output_tokens"]


def bench_decode(layers: list[int], prefix_tokens: int, tokens: int, repeats: int) -> dict:
    """bf16 and int8-proxy runs alternate (restore_ar / prepare_ar_proxies between them) on one model."""
    prefix = [EOD] + [100 + i % 5000 for i in range(prefix_tokens - 2)] + [MUSIC_START]
    report = {"prefix_tokens": len(prefix), "decode_tokens": tokens, "batch": 1, "by_layers": {}}
    for count in layers:
        model = random_model(YuE2Config(num_hidden_layers=count))
        times, kernel = {"bf16": [], "int8": []}, None
        for seed in range(repeats + 1):  # the first round warms up
            restore_ar(model)
            bf16 = decode_seconds(model, prefix, tokens, seed)
            kernel = prepare_ar_proxies(model, "int8")["kernel"]
            int8 = decode_seconds(model, prefix, tokens, seed)
            if seed:
                times["bf16"].append(bf16)
                times["int8"].append(int8)
        bf16, int8 = (1 / statistics.median(times[mode]) for mode in ("bf16", "int8"))
        report["by_layers"][count] = {"bf16_tok_s": round(bf16, 3), "int8_tok_s": round(int8, 3),
                                      "int8_speedup": round(int8 / bf16, 4), "int8_kernel": kernel}
        del model
    if len(layers) >= 2:
        lo, hi = min(layers), max(layers)
        projected = {}
        for mode in ("bf16", "int8"):
            t_lo, t_hi = (1 / report["by_layers"][c][f"{mode}_tok_s"] for c in (lo, hi))
            per_layer = (t_hi - t_lo) / (hi - lo)
            fixed = t_lo - lo * per_layer
            projected[mode] = {"ms_per_layer": round(1e3 * per_layer, 3), "fixed_ms": round(1e3 * fixed, 3),
                               "tok_s_28_layers": round(1 / (fixed + 28 * per_layer), 3)}
        projected["int8_speedup_28_layers"] = round(projected["int8"]["tok_s_28_layers"]
                                                     / projected["bf16"]["tok_s_28_layers"], 4)
        report["projection"] = projected
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="matmul repeats (lm_head uses a quarter)")
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--layers", default="1,4", help="comma-separated layer counts of the decode models")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "int8pack_cpu_bf16": int8pack_available("cpu", torch.bfloat16), "matmuls": bench_matmuls(args.repeats)}
    if not args.skip_decode:
        layers = [int(c) for c in args.layers.split(",") if c]
        report["decode"] = bench_decode(layers, args.prefix, args.tokens, args.decode_repeats)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
