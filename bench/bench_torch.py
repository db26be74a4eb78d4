"""Torch backend speed on CPU: AR prefill/decode tokens/s, NAR seconds per midpoint step, VAE real-time factor.

Two models side by side: the tiny test model and a one-layer slice of YuE2-3B at real width
(hidden 2048, 16/8 heads, FFN 6144, the full 184,704-row lm_head), plus the tiny and the
full-size VAE decoder. Medians of repeated runs; run with `python bench/bench_torch.py`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from yue2_vllm.modeling import CachedNAR, YuE2Config
from yue2_vllm.protocol import CODEC_OFFSET, EOD, MUSIC_END, MUSIC_START, Sampling
from yue2_vllm.sampling import TorchARBackend
from yue2_vllm.testing import TINY_CONFIG, random_model, tiny_vae_config
from yue2_vllm.vae import VAEConfig, random_vae


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_ar(model, prefix_tokens: int, decode_tokens: int, repeats: int) -> dict:
    prefix = [EOD] + [100 + i % 5000 for i in range(prefix_tokens - 2)] + [MUSIC_START]
    prefill = median_seconds(lambda: model.forward_ar(torch.tensor([prefix]), model.new_cache(len(prefix))), repeats)
    backend = TorchARBackend(model)
    sampling = Sampling(min_tokens=decode_tokens, max_tokens=decode_tokens)
    runs = [backend.generate(prefix, sampling, 0, "semantic").timing for _ in range(repeats)]
    decode = statistics.median((t["seconds"] - t["prefill_seconds"]) / t["output_tokens"] for t in runs)
    return {"prefill_tokens": len(prefix), "prefill_tok_s": len(prefix) / prefill, "decode_tok_s": 1 / decode}


def bench_nar(model, prefix_tokens: int, frames: int, repeats: int) -> dict:
    tokens = [EOD] + [100] * (prefix_tokens - 2) + [MUSIC_START] + [CODEC_OFFSET + i for i in range(frames)] \
        + [MUSIC_END]
    nar = CachedNAR(model, tokens, frames)
    state = torch.randn(frames, 64).to(model.dtype)
    per_velocity = median_seconds(lambda: nar.velocity(state, 0.5), repeats)
    return {"frames": frames, "seconds_per_step": 2 * per_velocity, "seconds_per_32_steps": 64 * per_velocity}


def bench_vae(config: VAEConfig, frames: int, repeats: int) -> dict:
    vae = random_vae(config, 0, decoder_only=True)
    latent = torch.randn(1, 64, frames)
    seconds = median_seconds(lambda: vae.decode_tiled(latent, core_frames=1024, halo_frames=16), repeats)
    audio_seconds = (1920 * frames - 64) / 48000
    return {"frames": frames, "seconds": seconds, "real_time_factor": seconds / audio_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    slice_config = YuE2Config(num_hidden_layers=1)
    report = {"threads": torch.get_num_threads()}
    for name, config, prefix, frames in (("tiny", TINY_CONFIG, 512, 250), ("real_width_1_layer", slice_config, 512, 250)):
        model = random_model(config)
        report[name] = {"ar": bench_ar(model, prefix, 32, args.repeats),
                        "nar": bench_nar(model, prefix, frames, args.repeats)}
        del model
    report["tiny"]["vae"] = bench_vae(tiny_vae_config(), 250, args.repeats)
    report["real_width_1_layer"]["vae"] = bench_vae(VAEConfig(), 50, 1)
    tiny, wide = report["tiny"], report["real_width_1_layer"]
    report["ratios"] = {
        "decode_tok_s_tiny_over_wide": tiny["ar"]["decode_tok_s"] / wide["ar"]["decode_tok_s"],
        "nar_step_wide_over_tiny": wide["nar"]["seconds_per_step"] / tiny["nar"]["seconds_per_step"],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
