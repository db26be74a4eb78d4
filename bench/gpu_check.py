"""One prepared GPU check of what only a GPU can show, as named sections of rows.

    .venv/bin/python bench/gpu_check.py [--quick] [--json PATH] [--only NAME[,NAME]]

Each section is a function in `SECTIONS` (name, what it needs, the function). A section that needs
CUDA is skipped, with the reason, on a machine without it; CPU-runnable rows (small shapes with
`--quick`) run everywhere, so CI runs this file as a smoke test. Torch-side sections:

* `torch.devices`: pipeline construction with auto / cuda / cuda:0 (device, memory cap, flags).
* `torch.numerics`: the six numerics flags as the pipeline sets them.
* `torch.vae`: the release-layout random VAE decoding 30 s of latents on CUDA (strict fp32 and TF32)
  vs the CPU: seconds and max relative error; peak memory vs `memory.vae_decode_bytes`.
* `torch.ar`: full-size random AR decode tok/s at cfg 1 and 1.5 (prefix 512, 128 tokens), CUDA
  kernels and host syncs per token; the first token index where CUDA and CPU differ for one seed.
* `torch.fp8`: row-wise vs upstream's per-tensor FP8 proxies (our default): error vs bf16, ms per call, M 1/16.
* `torch.int8`: `_weight_int8pack_mm` availability per device and the proxy policy's verdict.
* `torch.memory`: `mem_get_info` vs the per-process cap vs what admission counts.
* `torch.release_song`: one real-size song's NAR beside the engine (the full-size random MoT with its AR expert in
  pinned host memory, streamed to the prefill; a 2,048-token prefix + 9,000 codec tokens) and one 1,024-frame VAE
  tile: `torch.cuda.max_memory_allocated` above the resident weights vs the plan's NAR and tile figures.
* `torch.graph`: the torch AR backend's captured batched step (both CFG branches, one shared token) vs its eager
  two-forward path on the full-size bf16 model: decode tok/s at cfg 1 and a CFG pair, tokens identical or the
  first divergence and the logit gap there, capture seconds, graph pool and K/V bytes, host syncs and kernels per
  token; the captured step bit-equal to the same step run eagerly (bf16, FP8 and int8 proxies: graph safety).
  On the CPU only the capture-free batched step runs (float32 tiny model: tokens identical to the eager path).

DGX Spark / Blackwell sections (so the first run on a GB10 tells what is true; not run on one yet):

* `spark.kernels`: for sm80/86/89/90/100/120/121 and this GPU, the vLLM W8A8 kernel each AR form (FP8
  per-tensor, FP8 row-wise, int8) would get under our engine's environment, and whether it runs.
* `spark.memory`: `is_integrated`, MemAvailable vs `mem_get_info`'s free figure, the unified pool, and the
  split the release weights (bf16 and FP8 AR) would be planned with on this GPU.

vLLM-side sections (the engine's sampler arithmetic is plain torch; only `engine.runners` needs vLLM, which
the GPU machines of this project do not have, so it is skipped there with the reason):

* `engine.sampler`: the in-engine sampler on CUDA vs the CPU over random rows — temperatures 0/0.7/1,
  top-k 1/30/100, top-p 0.9/1, legacy CFG pairs on/off, bf16/fp32 logits: the share of equal tokens.
* `engine.sampler_syncs`: host syncs per sampler step (`torch.cuda.set_sync_debug_mode`), V1 and MRV2 adapters.
* `engine.sliced_head`: bench's `head` rows for a GPU: a decode step's head + sampler with the phase-sliced head
  (`engine.head.PhaseHead`, each phase's choice) vs the full head, per phase at 1/8/64 rows, in bf16, vLLM's
  batch-invariant bf16 (where vLLM imports) and float32 at 2048 x 184,704 (tok/s, ratio, choice, max |Δ|, equal
  tokens); with `--quick` or no CUDA, small shapes.
* `engine.mrv2_sliced_head`: Model Runner V2's sliced head (model state layout + `head.PhaseHead`) vs the
  full head in bf16 at 2048 x 184,704, M 1/8/64, semantic-only and half-abc batches (ms, ratio, host syncs).
* `engine.runners`: the engine on each model runner with the tiny checkpoint (runner, async scheduling,
  a float32 song's tokens equal across runners).
* `engine.kv_cache`: per KV form this GPU runs (`attention.choose`), the engine's peak device memory against the
  plan's engine figure, tok/s at 1 and 8 rows, and the attention backend the engine reports against the predicted.
* `engine.lora`: AR adapters on each model runner: tok/s at 8 rows with LoRA off, on but unused, one adapter,
  four distinct adapters; a greedy song with the adapter against the merged checkpoint's (identical, or the first
  divergence); on CUDA the memory the LoRA engine took against the plan (its slots included). CUDA (not --quick):
  a full-size random AR with rank-64 adapters; otherwise the tiny one, rank 8, float32.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from yue2_vllm.options import DeviceOptions, LoadOptions  # noqa: E402

Rows = list[dict]


@dataclass(frozen=True)
class Section:
    name: str
    needs: str | None  # "cuda" or None (runs anywhere)
    run: Callable[[argparse.Namespace], Rows]


SECTIONS: list[Section] = []


def section(name: str, needs: str | None = None):
    def register(fn):
        SECTIONS.append(Section(name, needs, fn))
        return fn
    return register


def cuda_missing() -> str | None:
    if torch.cuda.is_available():
        return None
    return f"CUDA not available (torch {torch.__version__}, {torch.cuda.device_count()} CUDA devices)"


def skipped(what: str, reason: str) -> dict:
    return {"row": what, "skipped": reason}


def timed(fn, repeats: int = 3) -> tuple[float, object]:
    """Median seconds of `fn()` (synchronized on CUDA) and its last result."""
    times, result = [], None
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def tiny_dirs() -> tuple[Path, Path]:
    from yue2_vllm.testing import write_tiny_model, write_tiny_vae

    root = Path(tempfile.mkdtemp(prefix="yue2-gpu-check-"))
    return write_tiny_model(root / "mot"), write_tiny_vae(root / "vae")


# --------------------------------------------------------------------------- torch sections


@section("torch.devices")
def torch_devices(args) -> Rows:
    from yue2_vllm.checkpoint import HashCache
    from yue2_vllm.devices import engine_cuda_env, resolve_device
    from yue2_vllm.pipeline import YuE2Pipeline

    model_dir, vae_dir = tiny_dirs()
    rows = [{"row": "resolve auto", "device": str(resolve_device("auto"))}]
    names = ["cpu"] + (["auto", "cuda", "cuda:0"] if torch.cuda.is_available() else [])
    for name in names:
        try:
            pipe = YuE2Pipeline(model_dir, vae_dir,
                                load=LoadOptions(hash_cache=HashCache(model_dir.parent / "hashes.json")),
                                device=DeviceOptions(device=name, budget_gib=8))
            row = {"row": f"pipeline device={name}", "device": str(pipe.device), "cap_bytes": pipe.memory_cap_bytes,
                   "engine_env": engine_cuda_env(pipe.device)}
            if pipe.device.type == "cuda":
                row["cap_fraction"] = torch.cuda.get_per_process_memory_fraction(pipe.device.index)
            rows.append(row)
            del pipe
        except Exception as exc:  # the row records the failure; the other rows still run
            rows.append({"row": f"pipeline device={name}", "error": f"{type(exc).__name__}: {exc}"})
    if not torch.cuda.is_available():
        rows.append(skipped("pipeline device=auto/cuda/cuda:0", cuda_missing()))
    return rows


@section("torch.numerics")
def torch_numerics(args) -> Rows:
    from yue2_vllm.devices import UPSTREAM_NUMERICS, numerics_flags, set_upstream_numerics

    before = numerics_flags()
    after = set_upstream_numerics()
    return [{"row": flag, "before": before[flag], "set": after[flag], "upstream": value,
             "ok": after[flag] == value} for flag, value in UPSTREAM_NUMERICS]


@section("torch.vae")
def torch_vae(args) -> Rows:
    from yue2_vllm.memory import vae_decode_bytes
    from yue2_vllm.testing import tiny_vae_config
    from yue2_vllm.model.vae import VAEConfig, random_vae

    full = torch.cuda.is_available() and not args.quick
    config = VAEConfig() if full else tiny_vae_config()
    frames, core = (750, 1024) if full else (40, 16)  # 750 frames = 30 s at 25 frames/s
    vae = random_vae(config, 0, decoder_only=True)
    latent = torch.randn(1, 64, frames, generator=torch.Generator().manual_seed(1))
    cpu_seconds, cpu_audio = timed(lambda: vae.decode_tiled(latent, core_frames=core, halo_frames=16), repeats=1)
    rows = [{"row": "cpu", "layout": "release" if full else "tiny", "frames": frames, "seconds": cpu_seconds,
             "samples": cpu_audio.shape[-1]}]
    if not torch.cuda.is_available():
        return rows + [skipped("cuda strict fp32 / tf32", cuda_missing())]
    from yue2_vllm.devices import set_upstream_numerics

    vae.to("cuda")
    for mode in ("strict fp32", "tf32"):
        set_upstream_numerics()
        if mode == "tf32":
            torch.backends.cudnn.allow_tf32 = True
            torch.backends.cuda.matmul.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seconds, audio = timed(lambda: vae.decode_tiled(latent, core_frames=core, halo_frames=16))
        rows.append({"row": f"cuda {mode}", "seconds": seconds, "speedup_vs_cpu": cpu_seconds / seconds,
                     "max_rel_error_vs_cpu": max_rel_error(audio, cpu_audio),
                     "peak_tile_bytes": torch.cuda.max_memory_allocated() - base,
                     "estimate_bytes": vae_decode_bytes(config, core, 16)})
    set_upstream_numerics()
    return rows


def random_ar(config, device: str, seed: int = 0):
    """A random MoT made directly on `device` (bf16), scaled like the tiny checkpoints."""
    from yue2_vllm.model.modeling import YuE2Model, sinusoid_table

    with torch.device("meta"):
        model = YuE2Model(config)
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name == "latent_pos_embed.pe":
                tensor.copy_(sinusoid_table(*tensor.shape))
            elif name.endswith("norm.weight"):
                tensor.fill_(1.0)
            elif tensor.ndim == 1:
                tensor.zero_()
            else:
                scale = 1.0 if name == "model.embed_tokens.weight" else tensor.shape[1] ** -0.5
                tensor.copy_(torch.randn(tensor.shape, generator=generator, device=device) * scale)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def count_syncs_and_kernels(fn, tokens: int) -> dict:
    """Host syncs (torch's sync debug mode) and CUDA kernels (profiler) per token of `fn()`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    return {"host_syncs_per_token": syncs / tokens, "cuda_kernels_per_token": kernels / tokens}


@section("torch.ar")
def torch_ar(args) -> Rows:
    from yue2_vllm.model.modeling import YuE2Config
    from yue2_vllm.protocol import Sampling
    from yue2_vllm.model.sampling import TorchARBackend
    from yue2_vllm.testing import TINY_CONFIG, random_model

    prefix_len, tokens = (32, 8) if args.quick else (512, 128)
    prefix = [(i * 7919) % 150000 for i in range(prefix_len)]
    negative = prefix[: prefix_len // 2]
    sampling = Sampling(min_tokens=tokens, max_tokens=tokens)
    rows = []
    # CPU vs CUDA: one seed, the first token where they part (a 4-layer full-width model bounds the CPU time).
    small = TINY_CONFIG if args.quick else YuE2Config(num_hidden_layers=4)
    cpu_model = random_model(small, 0)
    cpu_ids = TorchARBackend(cpu_model).generate(prefix, sampling, 7, "abc")[0]
    rows.append({"row": "cpu reference", "layers": small.num_hidden_layers, "tokens": len(cpu_ids)})
    if not torch.cuda.is_available():
        return rows + [skipped("cuda tok/s, kernels, syncs, first divergence", cuda_missing())]
    cuda_ids = TorchARBackend(cpu_model.to("cuda")).generate(prefix, sampling, 7, "abc")[0]
    first = next((i for i, (a, b) in enumerate(zip(cpu_ids, cuda_ids)) if a != b), None)
    rows.append({"row": "first token index where CUDA != CPU (seed 7)", "index": first, "tokens": len(cuda_ids)})
    del cpu_model
    torch.cuda.empty_cache()
    model = random_ar(YuE2Config() if not args.quick else small, "cuda")
    backend = TorchARBackend(model)
    for cfg in (1.0, 1.5):
        kwargs = {"negative": negative, "cfg_scale": cfg} if cfg != 1.0 else {}
        backend.generate(prefix, Sampling(min_tokens=4, max_tokens=4), 7, "abc", **kwargs)  # warm-up
        timing = backend.generate(prefix, sampling, 7, "abc", **kwargs)[1]
        decode_seconds = timing["seconds"] - timing["prefill_seconds"]
        row = {"row": f"full-size decode cfg {cfg}", "tok_s": timing["output_tokens"] / decode_seconds,
               "prefill_seconds": timing["prefill_seconds"]}
        row.update(count_syncs_and_kernels(
            lambda: backend.generate(prefix, Sampling(min_tokens=16, max_tokens=16), 7, "abc", **kwargs), 16))
        rows.append(row)
    return rows


@section("torch.fp8")
@torch.no_grad()
def torch_fp8(args) -> Rows:
    from torch import nn

    from yue2_vllm.model.torch_quant import FP8Linear, fp8_supported

    out_features, in_features = (64, 128) if args.quick else (6144, 2048)
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(2))
                            * in_features ** -0.5)
    linear = linear.to(torch.bfloat16)
    device = "cuda" if torch.cuda.is_available() and fp8_supported("cuda") is None else None
    rows = []
    for m in (1, 16):
        x = torch.randn(m, in_features, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        exact = linear(x).float()
        for scheme, label in (("channel", "row-wise (our former default)"),
                              ("tensor", "per-tensor (upstream's scheme, our default)")):
            row = {"row": f"M={m} {label}"}
            reference = FP8Linear.from_linear(linear, reference=True, scheme=scheme)
            row["cpu_reference_rel_error"] = float((reference(x).float() - exact).norm() / exact.norm())
            if device is not None:
                module = FP8Linear.from_linear(linear.to(device), scheme=scheme)
                xd = x.to(device)
                try:
                    seconds, out = timed(lambda: module(xd), repeats=20)
                    row.update({"cuda_rel_error": float((out.float().cpu() - exact).norm() / exact.norm()),
                                "ms_per_call": seconds * 1e3})
                except RuntimeError as exc:  # e.g. row-wise scaling unsupported on this GPU/torch
                    row["cuda_error"] = str(exc).splitlines()[0]
                linear.to("cpu")
            rows.append(row)
        if device is not None:
            lin = linear.to("cuda")
            seconds, _ = timed(lambda: lin(x.to("cuda")), repeats=20)
            rows.append({"row": f"M={m} bf16 F.linear", "ms_per_call": seconds * 1e3})
            linear.to("cpu")
    if device is None:
        rows.append(skipped("cuda _scaled_mm", cuda_missing() or fp8_supported("cuda")))
    return rows


@section("torch.int8")
def torch_int8(args) -> Rows:
    from yue2_vllm.model.torch_quant import int8pack_available, proxy_slow_reason

    rows = []
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        rows.append({"row": device, "int8pack_bf16": int8pack_available(device, torch.bfloat16),
                     "proxy_policy": proxy_slow_reason("int8", device) or "int8 proxies kept"})
    if not torch.cuda.is_available():
        rows.append(skipped("cuda", cuda_missing()))
    else:
        rows.append(quantize_bits_row())
    return rows


def quantize_bits_row() -> dict:
    """Quantizing a weight on CUDA gives the CPU's bits (a CPU export equals load-time quantization there)."""
    from yue2_vllm.model.torch_quant import quantize_fp8, quantize_fp8_per_tensor, quantize_int8

    weight = torch.randn(6144, 2048, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    row = {"row": "quantize on cuda == on cpu"}
    for name, quantize in (("int8", quantize_int8), ("fp8_channel", quantize_fp8), ("fp8_tensor", quantize_fp8_per_tensor)):
        cpu, gpu = quantize(weight), quantize(weight.cuda())
        row[name] = all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.cpu().view(torch.uint8)
                                    if b.dtype.itemsize == 1 else b.cpu()) for a, b in zip(cpu, gpu))
    return row


@section("torch.memory", needs="cuda")
def torch_memory(args) -> Rows:
    from yue2_vllm.devices import cuda_free_bytes, process_cap_bytes
    from yue2_vllm.model.torch_quant import apply_memory_cap

    cap = apply_memory_cap("cuda", 24)
    block = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    del block  # 1 GiB cached, not allocated
    free, total = torch.cuda.mem_get_info()
    return [{"row": "after a 24 GiB cap and 1 GiB cached", "mem_get_info_free": free, "total": total,
             "cap": cap, "process_cap_bytes": process_cap_bytes("cuda"), "reserved": torch.cuda.memory_reserved(),
             "admission_room": cuda_free_bytes("cuda")}]


def random_split_model(config, device: str, ar_home: str):
    """A random bf16 MoT laid out as the pipeline loads it beside the engine: the AR expert in pinned host memory
    (`ar_home="host"`), everything else on `device`; owned by an `ARPlacement` like a loaded one."""
    from yue2_vllm.model.modeling import YuE2Model, ar_streamed_shapes, assign_tensor
    from yue2_vllm.model.placement import placement_of

    with torch.device("meta"):
        model = YuE2Model(config)
    host = set(ar_streamed_shapes(config)) if ar_home == "host" else set()
    generator = torch.Generator().manual_seed(0)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        value = (torch.randn(tensor.shape, generator=generator) * 0.02).to(torch.bfloat16)
        if name.endswith("norm.weight"):
            value = torch.ones(tensor.shape, dtype=torch.bfloat16)
        on_host = name in host
        value = value.pin_memory() if on_host and device == "cuda" else value.to("cpu" if on_host else device)
        assign_tensor(model, name, value)
    model = model.eval().requires_grad_(False)
    placement_of(model)  # home: where the AR expert was just put
    return model


@section("torch.release_song")
def torch_release_song(args) -> Rows:
    """One real-size song's NAR beside the engine: the full-size random MoT with its AR expert in pinned host
    memory (streamed to the prefill), a 2,048-token prefix + 9,000 codec tokens (a 6-minute song), and one
    1,024-frame VAE tile; peaks (`torch.cuda.max_memory_allocated` above what is resident) vs the plan's
    figures for this card. `--quick` / no CUDA: the tiny model on the CPU (the code path only; no peaks)."""
    from yue2_vllm.memory import (GIB, default_budget_gib, nar_song_bytes, plan_memory, release_sizes,
                                  total_memory_bytes, vae_decode_bytes)
    from yue2_vllm.model.modeling import YuE2Config
    from yue2_vllm.model.nar import synthesize
    from yue2_vllm.model.placement import placement_of
    from yue2_vllm.protocol import CODEC_OFFSET, chunk_ranges
    from yue2_vllm.testing import TINY_CONFIG

    cuda = torch.cuda.is_available() and not args.quick
    device, config = ("cuda", YuE2Config()) if cuda else ("cpu", TINY_CONFIG)
    prefix_len, frames, steps = (2048, 9000, 2) if cuda else (24, 20, 2)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = random_split_model(config, device, "host")
    generator = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, CODEC_OFFSET, (prefix_len,), generator=generator).tolist()
    codec = torch.randint(0, 32768, (frames,), generator=generator).tolist()
    chunks = [prefix_len + (b - a) + 3 for a, b in chunk_ranges(frames, prefix_len)]
    need = nar_song_bytes(config, chunks, streamed=device == "cuda")
    resident = torch.cuda.memory_allocated() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    record: dict = {}
    seconds, latents = timed(lambda: synthesize(model, prefix, codec, seed=0, steps=steps, record=record), repeats=1)
    row = {"row": f"{'release' if cuda else 'tiny (CPU)'} song NAR, AR expert in host memory",
           "device": device, "prefix": prefix_len, "frames": frames, "ode_steps": steps, "seconds": seconds,
           "prefill_weights": record.get("prefill_weights"), "streamed_bytes": record.get("streamed_bytes"),
           "ar_moves": len(placement_of(model).moves), "plan_nar_bytes": need, "finite": bool(latents.isfinite().all())}
    rows = [row]
    if not cuda:
        return rows + [skipped("release song peaks vs the plan", cuda_missing() or "--quick")]
    peak = torch.cuda.max_memory_allocated() - resident
    sizes = release_sizes()
    card = total_memory_bytes("cuda")
    plan = plan_memory(config, device="cuda", budget_gib=default_budget_gib(None, card),
                       engine_weights=sizes["ar_forms"]["bf16"], torch_model=sizes["mot_bytes"],
                       vae=sizes["vae_bytes"], vae_tile=sizes["vae_tile"], total=card)
    row.update({"resident_bytes": resident, "plan_torch_model_bytes": plan.torch_model, "nar_peak_bytes": peak,
                "peak_over_plan": peak / need, "within_plan": peak <= need,
                "plan_song_room_bytes": plan.song_room, "plan_rows": plan.max_num_seqs})
    del model, latents
    torch.cuda.empty_cache()
    from yue2_vllm.model.vae import VAEConfig, random_vae

    vae = random_vae(VAEConfig(), 0, decoder_only=True).to("cuda")
    latents = torch.randn(1, 64, 1024 + 32, device="cuda")
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        vae.decode_tiled(latents, core_frames=1024, halo_frames=16)
    tile_peak = torch.cuda.max_memory_allocated() - base
    tile = vae_decode_bytes(VAEConfig(), 1024, 16)
    rows.append({"row": "release VAE tile (1,024 frames)", "tile_peak_bytes": tile_peak, "plan_tile_bytes": tile,
                 "peak_over_plan": tile_peak / tile, "within_plan": tile_peak <= tile,
                 "plan_summary": plan.describe()["summary"], "card_gib": card / GIB})
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # the engine's own report needs vLLM on this machine
        rows.append(skipped("engine peak vs the plan's engine share", f"vllm not importable ({exc})"))
    return rows


# --------------------------------------------------------------------------- DGX Spark / Blackwell sections

SPARK_CAPABILITIES = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1)]


@section("spark.kernels")
def spark_kernels(args) -> Rows:
    from yue2_vllm.quant.schemes import ar_form_kernels

    capabilities = list(SPARK_CAPABILITIES)
    if torch.cuda.is_available():
        capabilities.append(tuple(torch.cuda.get_device_capability()))
    rows = []
    for index, capability in enumerate(capabilities):
        what = "this GPU " if index == len(SPARK_CAPABILITIES) else ""
        for form, choice in ar_form_kernels(capability).items():
            if form == "bf16":
                continue
            rows.append({"row": f"{what}sm{capability[0]}{capability[1]} {form}", "kernel": choice["kernel"],
                         "runs": choice["runs"], "engine_env": choice["engine_env"] or None})
    return rows


def release_ar_bytes(config, fp8: bool) -> int:
    """The release AR checkpoint's bytes: bf16, or FP8 W8A8 (1-byte linears in the layers, the rest bf16)."""
    from yue2_vllm.memory import ar_expert_bytes
    from yue2_vllm.model.modeling import ar_tensor_shapes

    linears = sum(math.prod(shape) for name, shape in ar_tensor_shapes(config).items()
                  if name.startswith("model.layers.") and name.endswith("_proj.weight"))
    return ar_expert_bytes(config) - (linears if fp8 else 0)


@section("spark.memory", needs="cuda")
def spark_memory(args) -> Rows:
    from yue2_vllm.devices import unified_memory
    from yue2_vllm.memory import GIB, device_pool, plan_memory, read_meminfo
    from yue2_vllm.model.modeling import YuE2Config, tensor_shapes

    props = torch.cuda.get_device_properties(0)
    unified, why = unified_memory(0)
    free, total = torch.cuda.mem_get_info(0)
    meminfo = read_meminfo()
    rows = [{"row": "device", "name": props.name, "capability": torch.cuda.get_device_capability(0),
             "is_integrated": bool(getattr(props, "is_integrated", False)), "unified": unified, "why": why},
            {"row": "MemAvailable vs mem_get_info", "mem_available": meminfo.get("MemAvailable"),
             "mem_total": meminfo.get("MemTotal"), "mem_get_info_free": free, "mem_get_info_total": total,
             "cached": meminfo.get("Cached")}]
    pool = device_pool("cuda:0")
    if pool is not None:
        rows.append({"row": "unified pool", **pool.describe()})
    config = YuE2Config()
    mot, vae = 2 * sum(math.prod(s) for s in tensor_shapes(config).values()), int(0.25 * GIB)  # bf16 MoT
    budget = pool.pool / GIB if pool is not None else min(total, 24 * GIB) / GIB
    for form, fp8 in (("bf16", False), ("fp8", True)):
        plan = plan_memory(config, device="cuda", budget_gib=budget, engine_weights=release_ar_bytes(config, fp8),
                           torch_model=mot, vae=vae, total=total, unified=pool)
        rows.append({"row": f"release plan, {form} AR", "rows": plan.max_num_seqs, "kv_cache": plan.kv_cache,
                     "gpu_memory_utilization": plan.gpu_memory_utilization, "summary": plan.describe()["summary"],
                     "problems": plan.problems(),
                     "startup_problem": plan.startup_problem(meminfo.get("MemAvailable", 0))})


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def forced_logits(decoder, tokens: list[int]) -> torch.Tensor:
    """A BranchDecoder's row logits `[steps, branches, rows]` with `tokens` fed (teacher forcing)."""
    out = [decoder.prefill().float().cpu()]
    for token in tokens[:-1]:
        out.append(decoder.step(torch.tensor([token], device=decoder.device)).float().cpu())
    return torch.stack(out)


def graph_safety_row(model, label: str, prefixes, tokens: list[int]) -> dict:
    """The captured step against the same step run eagerly, fed the same tokens: graph-safe means bit-equal."""
    from yue2_vllm.model.decode_step import BranchDecoder, PhaseRows

    rows = PhaseRows.for_phase("semantic")
    eager = forced_logits(BranchDecoder(model, prefixes, len(tokens), rows=rows), tokens)
    captured = forced_logits(BranchDecoder(model, prefixes, len(tokens), rows=rows, capture=True), tokens)
    return {"row": f"{label}: captured step == eager step (forced tokens)", "bit_equal": torch.equal(eager, captured),
            "max_abs_diff": (eager - captured).abs().max().item(), "steps": len(tokens)}


def graph_decode_rows(model, prefix, negative, tokens: int, label: str) -> Rows:
    """Eager (two forwards) vs graph decode tok/s at cfg 1 and a CFG pair; tokens identical or where they part."""
    from yue2_vllm.model.decode_step import BranchDecoder, PhaseRows
    from yue2_vllm.model.sampling import TorchARBackend
    from yue2_vllm.protocol import Sampling

    sampling, rows = Sampling(min_tokens=tokens, max_tokens=tokens), []
    eager, graph = TorchARBackend(model, "eager"), TorchARBackend(model, "graph")
    for cfg in (1.0, 1.5):
        kwargs = {"negative": negative, "cfg_scale": cfg} if cfg != 1.0 else {}
        results = {}
        for name, backend in (("eager", eager), ("graph", graph)):
            backend.generate(prefix, Sampling(min_tokens=4, max_tokens=4), 7, "semantic", **kwargs)  # warm-up
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            results[name] = backend.generate(prefix, sampling, 7, "semantic", **kwargs)
            results[name].timing["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
        row = {"row": f"{label} semantic decode cfg {cfg}"}
        for name, result in results.items():
            t = result.timing
            row[f"{name}_tok_s"] = t["output_tokens"] / (t["seconds"] - t["prefill_seconds"])
            row[f"{name}_peak_extra_gib"] = t["peak_extra_bytes"] / 2**30
        t = results["graph"].timing
        row.update(speedup=row["graph_tok_s"] / row["eager_tok_s"], execution=t["execution"],
                   attention=t["attention"], capture_seconds=t.get("capture_seconds"),
                   graph_pool_mib=t.get("graph_bytes", 0) / 2**20, kv_mib=t.get("kv_bytes", 0) / 2**20,
                   fallback=t["graph_fallback_reason"])
        ids_e, ids_g = results["eager"].ids, results["graph"].ids
        first = first_divergence(ids_e, ids_g)
        row["tokens_identical"], row["first_divergence"] = first is None, first
        if first is not None:  # the logit gap there: both paths' logits with the eager tokens fed
            prefixes = [prefix] + ([negative] if cfg != 1.0 else [])
            ids = PhaseRows.for_phase("semantic").ids(model.device)
            reference = []
            for branch in prefixes:
                cache = model.new_cache(len(branch) + tokens)
                steps = [model.forward_ar(torch.tensor([branch], device=model.device), cache)[0, -1, ids]]
                steps += [model.forward_ar(torch.tensor([[tok]], device=model.device), cache)[0, -1, ids]
                          for tok in ids_e[:first]]
                reference.append(torch.stack(steps).float().cpu())
            captured = forced_logits(BranchDecoder(model, prefixes, first + 1, rows=PhaseRows.for_phase("semantic"),
                                                   capture=True), ids_e[:first + 1])
            row["logit_gap_at_divergence"] = max((captured[first, b] - reference[b][first]).abs().max().item()
                                                 for b in range(len(prefixes)))
        row.update({f"graph_{k}": v for k, v in count_syncs_and_kernels(
            lambda: graph.generate(prefix, Sampling(min_tokens=16, max_tokens=16), 7, "semantic", **kwargs),
            16).items()})
        rows.append(row)
    rows.append({"row": f"{label} CFG pair / single (graph tok/s)",
                 "ratio": rows[-1]["graph_tok_s"] / rows[-2]["graph_tok_s"], "target": ">= 0.8"})
    return rows


@section("torch.graph")
def torch_graph(args) -> Rows:
    """The torch AR backend's captured batched step vs its eager two-forward path (issue 27)."""
    from yue2_vllm.model.modeling import YuE2Config
    from yue2_vllm.model.sampling import TorchARBackend
    from yue2_vllm.protocol import EOD, MUSIC_START, Sampling
    from yue2_vllm.testing import TINY_CONFIG, random_model

    prefix_len, tokens = (32, 8) if args.quick else (1536, 256)
    prefix = [EOD] + [(i * 7919) % 150000 for i in range(prefix_len - 1)]
    negative = prefix[: prefix_len // 4] + [MUSIC_START]
    rows = []
    # The capture-free batched step on the CPU (float32): the same tokens as the two-forward path.
    tiny = random_model(TINY_CONFIG, 0).float()
    sampling = Sampling(min_tokens=8, max_tokens=8)
    for cfg in (1.0, 1.5):
        kwargs = {"negative": negative, "cfg_scale": cfg} if cfg != 1.0 else {}
        eager = TorchARBackend(tiny, "eager").generate(prefix, sampling, 3, "semantic", **kwargs)
        batched = TorchARBackend(tiny, "batched").generate(prefix, sampling, 3, "semantic", **kwargs)
        rows.append({"row": f"cpu float32 tiny cfg {cfg}: batched (capture off) vs eager",
                     "tokens_identical": batched.ids == eager.ids, "execution": batched.timing["execution"]})
    if not torch.cuda.is_available():
        return rows + [skipped("cuda eager vs graph tok/s, token identity, capture time, graph memory, "
                               "FP8/int8 graph safety", cuda_missing())]
    del tiny
    model = random_ar(YuE2Config(), "cuda")
    rows.append(graph_safety_row(model, "bf16", [prefix, negative], list(range(151853, 151853 + 32))))
    rows += graph_decode_rows(model, prefix, negative, tokens, "full-size bf16")
    from yue2_vllm.model.torch_quant import fp8_supported, prepare_ar_proxies, restore_ar

    for mode in ("fp8", "int8"):
        reason = fp8_supported("cuda") if mode == "fp8" else None
        if reason:
            rows.append(skipped(f"{mode} proxies graph safety", reason))
            continue
        prepare_ar_proxies(model, mode)
        try:
            rows.append(graph_safety_row(model, f"{mode} proxies", [prefix, negative],
                                         list(range(151853, 151853 + 16))))
            if mode == "fp8" and not args.quick:
                rows += graph_decode_rows(model, prefix, negative, min(tokens, 128), "full-size fp8 proxies")
        finally:
            restore_ar(model)
    return rows


# --------------------------------------------------------------------------- vLLM-side sections


def sampler_case(temperature: float, top_k: int, top_p: float, cfg: bool, rows: int = 4):
    """`(rows dict, logits)` for the V1 sampler: semantic rows with one setting (pairs when `cfg`,
    sampled with cot=off's legacy numerics), random histories, bf16-representable logits."""
    import random

    from yue2_vllm.protocol import CODEC_OFFSET, VOCAB_SIZE, Sampling
    from yue2_vllm.engine.plugin import Pairing, parse_row, row_args

    rng = random.Random(hash((temperature, top_k, top_p, cfg)) & 0xFFFF)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=1.2,
                        penalty_window=50, min_tokens=0, max_tokens=100)
    states = {}
    for i in range(rows):
        output = [CODEC_OFFSET + rng.randrange(64) for _ in range(rng.randrange(0, 40))]
        pairing = Pairing(f"p{i}", "cond", 1.5) if cfg else None
        state = parse_row(row_args("semantic", sampling, 1000 + i, legacy=cfg, pairing=pairing))
        state.output_ids = output
        states[len(states)] = state
        if cfg:
            partner = parse_row(row_args("semantic", sampling, 1000 + i, legacy=True,
                                         pairing=Pairing(f"p{i}", "uncond", 1.5)))
            partner.output_ids = list(output)
            states[len(states)] = partner
    generator = torch.Generator().manual_seed(rows + top_k)
    logits = torch.randn(len(states), VOCAB_SIZE, generator=generator) * 3
    return states, logits


def forced_tokens(states, logits, device: str, dtype: torch.dtype) -> list[int]:
    from yue2_vllm.engine.plugin import sample_rows, step_layout

    work = logits.to(dtype).float().to(device)
    sample_rows(work, states, step_layout(states, torch.device(device), {}), dtype)
    return work.argmax(-1).cpu().tolist()


@section("engine.sampler")
def engine_sampler(args) -> Rows:
    """The sampler's arithmetic on CUDA vs the CPU over random rows: the share of equal forced tokens."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    temperatures, top_ks = ((1.0,), (30,)) if args.quick else ((0.0, 0.7, 1.0), (1, 30, 100))
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for cfg in (False, True):
            equal = total = 0
            for temperature in temperatures:
                for top_k in top_ks:
                    for top_p in (0.9, 1.0):
                        states, logits = sampler_case(temperature, top_k, top_p, cfg)
                        tokens = {device: forced_tokens(states, logits, device, dtype) for device in devices}
                        total += len(tokens["cpu"])
                        equal += sum(a == b for a, b in zip(tokens["cpu"], tokens[devices[-1]]))
            rows.append({"row": f"{str(dtype).removeprefix('torch.')} cfg={'1.5 legacy' if cfg else 'off'}",
                         "sampled_rows": total, "cuda_equal_cpu": equal / total if len(devices) > 1 else "no CUDA"})
    return rows


class FakeRunner:
    """Model Runner V2's side of the V2 sampler (slots, device history), as the tests drive it."""

    def __init__(self, device: str, max_reqs: int, max_len: int):
        from types import SimpleNamespace

        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

        self.tokens = torch.zeros(max_reqs, max_len, dtype=torch.int32, device=device)
        self.prompt_len = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.total_len = torch.zeros(max_reqs, dtype=torch.int32, device=device)

        def buffer(tensor):
            return SimpleNamespace(gpu=tensor, np=None)

        self.states = LogitsProcRequestState(device=torch.device(device), max_num_reqs=max_reqs, vocab_size=0,
                                             all_token_ids=buffer(self.tokens), prompt_len=buffer(self.prompt_len),
                                             prefill_len=buffer(self.prompt_len), total_len=buffer(self.total_len))

    def context(self, slots: list[int]):
        import numpy as np
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

        index = torch.tensor(slots, device=self.tokens.device)
        pos = (self.total_len[index] - 1).long()
        return LogitsContext(expanded_idx_mapping=index, idx_mapping=index, idx_mapping_np=np.array(slots),
                             expanded_local_pos=torch.zeros_like(index), input_ids=self.tokens[index, pos], pos=pos,
                             seq_lens_upper_bound_np=np.zeros(len(slots)))


def count_syncs(fn) -> int:
    """Host syncs `fn()` triggers, as torch's CUDA sync debug mode reports them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@section("engine.sampler_syncs", needs="cuda")
def engine_sampler_syncs(args) -> Rows:
    """Host syncs per sampler step once the batch layout is cached: the V1 adapter and the MRV2 adapter."""
    from yue2_vllm.protocol import MUSIC_START, Sampling
    from yue2_vllm.engine.plugin import row_args, sample_rows, step_layout

    rows = []
    states, logits = sampler_case(1.0, 30, 0.9, cfg=True)
    logits, cache = logits.cuda(), {}
    for step in range(3):
        syncs = count_syncs(lambda: sample_rows(logits.clone(), states, step_layout(states, torch.device("cuda"),
                                                                                     cache), torch.bfloat16))
        rows.append({"row": f"V1 adapter step {step}", "host_syncs": syncs, "layout": "new" if step == 0 else "cached"})
    try:
        from types import SimpleNamespace

        from yue2_vllm.engine.mrv2 import YuE2SamplerV2
    except ImportError as exc:
        return rows + [skipped("MRV2 adapter", f"vllm not importable ({exc})")]
    runner = FakeRunner("cuda", 8, 256)
    sampler = YuE2SamplerV2(SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16)), runner.states)
    from vllm import SamplingParams

    for slot in range(8):
        runner.tokens[slot, :3] = torch.tensor([1, 2, MUSIC_START])
        runner.prompt_len[slot] = runner.total_len[slot] = 3
        sampler.add_request(slot, SamplingParams(extra_args=row_args("semantic", Sampling(), slot)))
    sampler.apply_staged_writes()
    big = torch.randn(8, logits.shape[1], device="cuda")
    for step in range(3):
        ctx = runner.context(list(range(8)))
        syncs = count_syncs(lambda: sampler.apply(big.clone(), ctx))
        rows.append({"row": f"MRV2 adapter step {step}", "host_syncs": syncs, "layout": "new" if step == 0 else "cached"})
    return rows


def head_step_kernels(numerics: str):
    """`(kernel(rows) -> Kernel, dtype)` of the lm_head's GEMM as vLLM's CUDA engine runs it in `numerics`: bf16
    (`F.linear`, vLLM's `default_unquantized_gemm`), batch-invariant bf16 (`--reproducible` on sm80+: vLLM's
    `linear_batch_invariant`, which the head's `apply` calls; needs vLLM) and float32 (`--reproducible` below sm80)."""
    import torch.nn.functional as F

    if numerics == "batch-invariant":
        from vllm.model_executor.determinism.batch_invariant import linear_batch_invariant

        return (lambda rows: lambda x: linear_batch_invariant(x, rows)), torch.bfloat16
    return (lambda rows: lambda x: F.linear(x, rows)), torch.float32 if numerics == "float32" else torch.bfloat16


@section("engine.sliced_head")
def engine_sliced_head(args) -> Rows:
    """A decode step's head + sampler as the engine's model runs it, per phase at 1, 8 and 64 rows (bench's `head`
    rows for a GPU): the phase-sliced head (`engine.head.PhaseHead`, each phase's choice for 64 rows, its parts
    views of the weight) vs the full head (one GEMM over all 184,704 rows, what `--no-sliced-head` runs), each
    followed by the V1 sampler on YuE2 rows of that phase, in bf16, batch-invariant bf16 and float32 at
    2048 x 184,704 (`--quick` or no CUDA: 64 x 184,704, 1 and 4 rows): tok/s of head + sampler,
    sliced / full, the choice, max |Δ| on the phase's columns and the share of equal tokens."""
    from yue2_vllm.engine import sampling as es
    from yue2_vllm.engine.head import PhaseHead, choice_record
    from yue2_vllm.engine.plugin import parse_row, row_args, sample_rows, step_layout
    from yue2_vllm.protocol import VOCAB_SIZE, Sampling

    device = "cuda" if torch.cuda.is_available() else "cpu"
    full_size = device == "cuda" and not args.quick
    width, counts = (2048, (1, 8, 64)) if full_size else (64, (1, 4))
    rows = []
    for numerics in ("bf16", "batch-invariant", "float32"):
        try:
            kernel, dtype = head_step_kernels(numerics)
        except ImportError as exc:
            rows.append(skipped(f"{numerics}", f"vllm not importable ({exc})"))
            continue
        if numerics == "batch-invariant" and device != "cuda":
            rows.append(skipped(numerics, "vLLM's batch-invariant GEMM needs CUDA"))
            continue
        generator = torch.Generator(device=device).manual_seed(0)
        weight = (torch.randn(VOCAB_SIZE, width, device=device, generator=generator) * 0.02).to(dtype)
        head = PhaseHead.over(weight, max(counts), kernel)  # head.full: the full head's GEMM, kernel(weight)
        choice = choice_record(width, VOCAB_SIZE, max(counts))
        for phase in ("abc", "semantic"):
            index = es.PHASE_INDEX[phase]
            low, high = es.PHASE_SLICES[index]
            for count in counts:
                states = {row: parse_row(row_args(phase, Sampling(temperature=1.0 if row % 2 else 0.0), 10 + row))
                          for row in range(count)}
                layout = step_layout(states, torch.device(device), {})
                hidden = torch.randn(count, width, device=device, generator=generator).to(dtype)

                def step(sliced: bool):
                    logits = head.logits(hidden, {index: slice(None)})[0] if sliced else head.full(hidden)
                    raw = logits.float()  # vLLM's V1 sampler works in float32
                    forced = raw.clone()
                    sample_rows(forced, states, layout, dtype)
                    return raw, forced.argmax(-1)

                repeats = 7 if full_size else 2
                full_s, (full_raw, full_tokens) = timed(lambda: step(False), repeats)
                sliced_s, (sliced_raw, sliced_tokens) = timed(lambda: step(True), repeats)
                rows.append({"row": f"{numerics} {phase} rows={count}", "device": device,
                             "sliced_tok_s": count / sliced_s, "full_tok_s": count / full_s,
                             "sliced_over_full": full_s / sliced_s, "choice": choice[phase],
                             "max_abs_delta": (full_raw[:, low:high] - sliced_raw[:, low:high]).abs().max().item(),
                             "masked_outside": bool(torch.isinf(sliced_raw[:, :low]).all()
                                                    and torch.isinf(sliced_raw[:, high:]).all()),
                             "tokens_equal": (full_tokens == sliced_tokens).float().mean().item()})
    return rows


@section("engine.mrv2_sliced_head", needs="cuda")
def engine_mrv2_sliced_head(args) -> Rows:
    """Model Runner V2's sliced head (issue 28) in bf16 at 2048 x 184,704, M 1/8/64: what `compute_logits` runs
    after our model state's `prepare_inputs` (`mrv2.SlotPhases` -> `head.PhaseHead.logits`) vs the full head, for
    semantic-only and half-abc batches: ms per step, ratio, host syncs of a step with a cached layout, argmax
    agreement on each row's phase slice."""
    from types import SimpleNamespace

    import numpy as np
    import torch.nn.functional as F

    from yue2_vllm.engine import sampling as es
    from yue2_vllm.engine.head import PhaseHead
    from yue2_vllm.engine.mrv2 import SlotPhases
    from yue2_vllm.engine.plugin import row_args
    from yue2_vllm.protocol import VOCAB_SIZE, Sampling

    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(VOCAB_SIZE, 2048, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
    head = PhaseHead.over(weight, 64, lambda rows: lambda x: F.linear(x, rows))
    rows = []
    for m in (1, 8, 64):
        for mix in ("semantic", "half abc"):
            if mix == "half abc" and m == 1:
                continue
            phases = SlotPhases("cuda")
            slots = list(range(m))[::-1]  # rows map to slots in another order, as MRV2's idx_mapping does
            for slot in slots:
                phase = "abc" if mix == "half abc" and slot % 2 else "semantic"
                phases.add_request(slot, SimpleNamespace(extra_args=row_args(phase, Sampling(), slot)))
            idx_mapping_np = np.array(slots, dtype=np.intp)
            phases.prepare(idx_mapping_np)  # the first step of a layout builds it (non-blocking copies)
            phases.take(m)
            hidden = torch.randn(m, 2048, device="cuda", generator=generator).to(torch.bfloat16)

            def sliced():
                phases.prepare(idx_mapping_np)
                return head.logits(hidden, phases.take(m))[0]

            full_s, full = timed(lambda: F.linear(hidden, weight), 7)
            sliced_s, out = timed(sliced, 7)
            agree = []
            for row, slot in enumerate(slots):
                columns = es.phase_slice(phases.phases[slot])
                agree.append(bool(full[row, columns].argmax() == out[row, columns].argmax()))
            rows.append({"row": f"{mix} M={m}", "full_ms": full_s * 1e3, "sliced_ms": sliced_s * 1e3,
                         "full_over_sliced": full_s / sliced_s, "host_syncs": count_syncs(sliced),
                         "argmax_agreement": sum(agree) / len(agree)})
    return rows


@section("engine.runners")
def engine_runners(args) -> Rows:
    """The engine on each model runner with the tiny checkpoint (needs vLLM): runner chosen, async, tokens."""
    from yue2_vllm.engine.backend import unsupported_reason, vllm_version

    reason = unsupported_reason(vllm_version())
    if reason:
        return [skipped("engine on v1 / v2", reason)]
    from yue2_vllm.derive import ARCheckpoint, derive_ar_checkpoint
    from yue2_vllm.protocol import ABC_START, EOD, MUSIC_START, Sampling
    from yue2_vllm.testing import TINY_CONFIG
    from yue2_vllm.engine.backend import EngineSettings, VLLMBackend

    model_dir, _ = tiny_dirs()
    derived = derive_ar_checkpoint(model_dir, model_dir.parent / "arcache")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompt = [EOD, 40, 1771, 285, 9, 10, ABC_START, 300, 301, MUSIC_START]
    rows, tokens = [], {}
    for runner in ("v1", "v2"):
        try:
            backend = VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(derived, "derived", None), device_type=device,
                                                              max_num_seqs=4, dtype="float32", runner=runner))
        except ValueError as exc:
            rows.append(skipped(f"engine {runner}", str(exc)))
            continue
        try:
            result = backend.generate(prompt, Sampling(min_tokens=48, max_tokens=48), 7, "semantic")
            tokens[runner] = result.ids
            rows.append({"row": f"engine {runner}", **{k: result.timing[k] for k in
                         ("vllm_runner", "async_scheduling", "sliced_head", "output_tps")}})
        except Exception as exc:
            rows.append({"row": f"engine {runner}", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        finally:
            backend.close()
    if len(tokens) == 2:
        rows.append({"row": "tokens v1 == v2 (float32)", "equal": tokens["v1"] == tokens["v2"]})
    return rows


def kv_rows_tps(backend, prompt: list[int], tokens: int, rows: int, loras=None) -> float:
    """Output tokens per second of `rows` semantic streams of `tokens` each, submitted at once (`loras`: the
    adapters of the rows, cycled)."""
    import threading

    from yue2_vllm.protocol import Sampling

    counts = [0] * rows

    def one(index: int) -> None:
        lora = loras[index % len(loras)] if loras else None
        counts[index] = len(backend.generate(prompt + [1000 + index], Sampling(min_tokens=tokens, max_tokens=tokens),
                                             index, "semantic", **({"lora": lora} if lora else {})).ids)

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(rows)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - start)


@section("engine.kv_cache")
def engine_kv_cache(args) -> Rows:
    """Per KV form this device runs (attention.choose on this GPU with the packages installed): the engine's
    peak memory against the plan's engine figure (CUDA: the device's least free memory while it starts and serves,
    sampled; the CPU: the worker's VmHWM), tok/s at 1 and 8 rows, and the attention backend the engine reports
    against the one predicted. CUDA (not --quick): a full-size random AR checkpoint; otherwise the tiny one."""
    from yue2_vllm.attention import choose, installed_packages
    from yue2_vllm.bench import PeakSampler, peak_rss_bytes
    from yue2_vllm.engine.backend import EngineSettings, VLLMBackend, unsupported_reason, vllm_version
    from yue2_vllm.kv_cache import FORMS, engine_setup, kv_cache_problem

    reason = unsupported_reason(vllm_version())
    if reason:
        return [skipped("engine KV forms", reason)]
    from yue2_vllm.derive import ARCheckpoint, derive_ar_checkpoint
    from yue2_vllm.memory import default_budget_gib, total_memory_bytes
    from yue2_vllm.model.modeling import YuE2Config
    from yue2_vllm.protocol import ABC_START, EOD, MUSIC_START
    from yue2_vllm.testing import TINY_CONFIG, write_random_model

    cuda = torch.cuda.is_available()
    full = cuda and not args.quick
    device, config = ("cuda" if cuda else "cpu"), (YuE2Config() if full else TINY_CONFIG)
    root = Path(tempfile.mkdtemp(prefix="yue2-gpu-check-kv-"))
    mot = write_random_model(root / "mot", config=config)
    derived = derive_ar_checkpoint(mot, root / "arcache")
    capability = tuple(torch.cuda.get_device_capability()) if cuda else None
    budget = default_budget_gib(None, total_memory_bytes("cuda") if cuda else None)
    packages = installed_packages() if cuda else None
    prompt, tokens = [EOD, 40, 1771, 285, 9, 10, ABC_START, 300, 301, MUSIC_START], 512 if full else 48
    rows = []
    for form in FORMS if full else ("auto", "fp8"):  # --quick / the CPU: the code path, two engines
        where = dict(device_type=device, vllm_version=vllm_version(), capability=capability, packages=packages,
                     head_dim=config.head_dim)
        problem = kv_cache_problem(form, **where)
        if problem:
            rows.append(skipped(f"engine, KV {form}", problem))
            continue
        predicted = choose(engine_setup(form, **where))
        settings = EngineSettings(ARCheckpoint(derived, "derived", None), device_type=device, max_num_seqs=8,
                                  memory_budget_gib=budget, kv_cache_dtype=form)
        free_before = torch.cuda.mem_get_info()[0] if cuda else None
        backend = VLLMBackend(config, settings)
        row = {"row": f"engine, KV {form}", "kv_element_bytes": backend.plan.kv_dtype_bytes,
               "plan_kv_bytes": backend.settings.kv_cache_bytes, "plan_engine_bytes": backend.plan.engine,
               "predicted_backend": predicted.backend, "predicted_stored_as": predicted.stored_as}
        try:
            with PeakSampler() as sampler:
                backend.start()
                record = backend.engine_info.get("kv_cache") or {}
                row.update(engine_backend=record.get("attention_backend"), engine_stored_as=record.get("stored_as"),
                           engine_scales=record.get("scales"),
                           backend_as_predicted=record.get("attention_backend") == predicted.backend)
                row.update(tps_1_row=kv_rows_tps(backend, prompt, tokens, 1),
                           tps_8_rows=kv_rows_tps(backend, prompt, tokens, 8))
            peak = free_before - sampler.least if cuda else peak_rss_bytes(backend.process.pid)
            row.update(peak_bytes=peak, peak_over_plan=peak / backend.plan.engine,
                       within_plan=peak <= backend.plan.engine)
            rows.append(row)
        except Exception as exc:
            rows.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        finally:
            backend.close()
    return rows


@section("engine.lora")
def engine_lora(args) -> Rows:
    """AR adapters on the engine, per model runner (see the module docstring)."""
    from yue2_vllm.engine.backend import EngineSettings, VLLMBackend, unsupported_reason, vllm_version

    reason = unsupported_reason(vllm_version())
    if reason:
        return [skipped("engine LoRA", reason)]
    from yue2_vllm.adapters.cache import convert_adapter
    from yue2_vllm.derive import ARCheckpoint, derive_ar_checkpoint
    from yue2_vllm.engine.lora import LoraIds, LoraSettings
    from yue2_vllm.memory import GIB, total_memory_bytes
    from yue2_vllm.model.modeling import YuE2Config
    from yue2_vllm.protocol import ABC_START, EOD, MUSIC_START, Sampling
    from yue2_vllm.testing import TINY_CONFIG, write_tiny_model
    from yue2_vllm.testing_adapters import write_merged_model, write_tiny_adapter

    cuda = torch.cuda.is_available()
    full = cuda and not args.quick
    device, config, rank = ("cuda" if cuda else "cpu"), (YuE2Config() if full else TINY_CONFIG), (64 if full else 8)
    dtype = "bfloat16" if cuda else "float32"
    root = Path(tempfile.mkdtemp(prefix="yue2-gpu-check-lora-"))
    mot = write_tiny_model(root / "mot", config=config)
    tiny = [write_tiny_adapter(root / f"a{i}.safetensors", "plain", rank=rank, seed=i, config=config)
            for i in range(4)]
    converted = [convert_adapter(t.path, config, cache_dir=root / "cache") for t in tiny]
    derived = derive_ar_checkpoint(mot, root / "arcache")
    merged = derive_ar_checkpoint(write_merged_model(mot, root / "merged", tiny[0].edits,
                                                     None if cuda else torch.float32), root / "arcache")
    budget = total_memory_bytes("cuda") * 0.9 / GIB if cuda else 24.0
    prompt, tokens = [EOD, 40, 1771, 285, 9, 10, ABC_START, 300, 301, MUSIC_START], 256 if full else 32
    greedy = Sampling(temperature=0.0, min_tokens=tokens, max_tokens=tokens)

    def engine(checkpoint, runner, lora=LoraSettings()):
        return VLLMBackend(config, EngineSettings(ARCheckpoint(checkpoint, "derived", None), device_type=device,
                                                  max_num_seqs=8, memory_budget_gib=budget, dtype=dtype,
                                                  runner=runner, lora=lora))

    rows = []
    for runner in ("v1", "v2"):
        try:
            reference = engine(merged, runner)
        except ValueError as exc:
            rows.append(skipped(f"engine LoRA {runner}", str(exc)))
            continue
        try:
            merged_ids = reference.generate(prompt, greedy, 3, "semantic").ids
            off = kv_rows_tps(reference, prompt, tokens, 8)
        finally:
            reference.close()
        backend = engine(derived, runner, LoraSettings(4, rank))
        try:
            free_before = torch.cuda.mem_get_info()[0] if cuda else None
            backend.start()
            row = {"row": f"engine LoRA {runner}", "runner": backend.setup.runner.runner, "rank": rank,
                   "plan_lora_slots_bytes": backend.plan.lora_slots}
            if cuda:
                used = free_before - torch.cuda.mem_get_info()[0]
                row.update(engine_used_bytes=used, within_plan=used <= backend.plan.engine)
            ids = LoraIds()
            loras = [ids.request(c.sha256, 1.0, c.ar_path) for c in converted]
            adapted = backend.generate(prompt, greedy, 3, "semantic", lora=loras[0]).ids
            row.update(adapter_equals_merged=adapted == merged_ids,
                       first_divergence=first_divergence(adapted, merged_ids),
                       tps_8_rows_off=off, tps_8_rows_unused=kv_rows_tps(backend, prompt, tokens, 8),
                       tps_8_rows_1_adapter=kv_rows_tps(backend, prompt, tokens, 8, loras[:1]),
                       tps_8_rows_4_adapters=kv_rows_tps(backend, prompt, tokens, 8, loras))
            rows.append(row)
        except Exception as exc:
            rows.append({"row": f"engine LoRA {runner}", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        finally:
            backend.close()
    return rows


# --------------------------------------------------------------------------- runner


def run(args) -> dict:
    wanted = set(args.only.split(",")) if args.only else None
    report = {"torch": torch.__version__, "cuda": torch.version.cuda, "quick": args.quick,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu only", "sections": {}}
    for sec in SECTIONS:
        if wanted is not None and sec.name not in wanted:
            continue
        start = time.perf_counter()
        if sec.needs == "cuda" and (reason := cuda_missing()):
            result = {"skipped": reason}
        else:
            try:
                result = {"rows": sec.run(args)}
            except Exception as exc:
                result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result["seconds"] = time.perf_counter() - start
        report["sections"][sec.name] = result
        print_section(sec.name, result)
    return report


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def print_section(name: str, result: dict) -> None:
    print(f"== {name} ({result['seconds']:.1f} s)")
    if "skipped" in result:
        print(f"   SKIPPED: {result['skipped']}")
    if "error" in result:
        print(f"   ERROR: {result['error']}")
    for row in result.get("rows", []):
        label = row.get("row", "")
        rest = ", ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k != "row")
        print(f"   {label}: {rest}")
    sys.stdout.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (the CPU smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--only", metavar="NAMES", help="comma-separated section names")
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    errors = [name for name, result in report["sections"].items() if "error" in result]
    if errors:
        print(f"sections with errors: {', '.join(errors)}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
