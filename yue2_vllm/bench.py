"""`yue2-vllm bench`: every stage and precision of a model measured the same way, in one run.

For a model (the tiny default, a one-layer slice of YuE2-3B at real width, or a real download) and a
list of AR paths — `torch-bf16`, `torch-int8` (load-time proxies), `vllm-bf16`, `vllm-bf16-full-head`
(the phase-sliced lm_head switched off), `vllm-bf16-reproducible` (what `--reproducible` costs), `vllm-fp8`, `vllm-int8` (compressed-tensors checkpoints,
exported on the fly through the quantization venv when not given), `mrv2-head` (Model Runner V2's head and
sampler in bf16 as its runner drives them, sliced vs full head: the part of an MRV2 step this machine can
run, `engine.mrv2_step`) — it reports AR prefill tok/s and
decode tok/s per phase at batch 1 and at `--concurrency` songs, NAR seconds per ODE step and per audio
second, the VAE real-time factor, peak memory and engine start time: medians of `--repeats`, as JSON
and a Markdown table headed by the machine. Each quantized checkpoint carries the speed policy's
verdict for this device (`quant.schemes.slow_reason`); the bench serves it regardless, to measure it.
`--paths transcription` measures the covers' transcribers (no model): seconds per audio minute and peak memory.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PATHS = ("torch-bf16", "torch-int8", "vllm-bf16", "vllm-bf16-full-head", "vllm-bf16-reproducible", "vllm-fp8",
         "vllm-int8", "mrv2-head", "head", "takes", "engine-memory", "engine-memory-fp8", "lora", "transcription")
LORA_RANK, LORA_ADAPTERS = 64, 4  # the lora path: rank-64 AR adapters (the released instrumental one's rank)
DEFAULT_PATHS = ("torch-bf16", "vllm-bf16", "head", "vllm-bf16-reproducible", "vllm-fp8", "vllm-int8")
SECTIONS = {"takes": "bench_takes", "head": "bench_head",  # paths reported as their own table
            "transcription": "bench_transcription"}
NO_MODEL = ("transcription",)  # paths that measure no model (a run of these alone times no NAR or VAE)
PROMPT_TOKENS = 512
NAR_FRAMES = 250  # 10 s of audio


@dataclass
class BenchConfig:
    model_dir: Path
    vae_dir: Path | None
    label: str
    paths: tuple[str, ...] = DEFAULT_PATHS
    concurrency: int = 8
    tokens: int = 64
    repeats: int = 3
    nar_steps: int = 4
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="yue2-bench-")))
    checkpoints: dict[str, Path] = field(default_factory=dict)  # "fp8"/"int8" -> compressed-tensors AR dir


def machine() -> dict:
    import torch

    from .quant.schemes import device_info
    from .engine.backend import vllm_version

    cpu = device_info("cpu")
    info = {"python": platform.python_version(), "torch": torch.__version__, "vllm": vllm_version(),
            "cpu": platform.processor() or platform.machine(), "cpu_isa": cpu.describe(),
            "cores": len(os.sched_getaffinity(0)), "gpu": None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_isa"] = device_info("cuda").describe()
    return info


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def peak_rss_bytes(pid: int | None = None, field: str = "VmHWM") -> int:
    """Peak resident set of this process, or of `pid` (a worker) from /proc (`field` VmRSS: its resident set now)."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_SALT = [0]


def prompts(phase: str, count: int, length: int = PROMPT_TOKENS) -> list[list[int]]:
    """`count` prompts of `length` tokens, new ones every call (no prefix-cache hits across runs)."""
    from .protocol import ABC_START, EOD, MUSIC_START

    tail = [ABC_START] if phase == "abc" else [ABC_START, 300, 301, 151848, MUSIC_START]
    _SALT[0] += 1
    return [[EOD, 1000 + _SALT[0] % 100000, 200 + i] + [100 + (7 * i + j) % 5000
                                                        for j in range(length - len(tail) - 3)] + tail
            for i in range(count)]


def decode_rate(timing: dict) -> float:
    """Decode tok/s after the first token (the prefill excluded)."""
    return (timing["output_tokens"] - 1) / max(1e-9, timing["seconds"] - timing["ttft_seconds"])


# --------------------------------------------------------------------------- AR


def run_ar(backend, phase: str, tokens: int, concurrency: int, prompt_tokens: int = PROMPT_TOKENS,
           loras=None) -> dict:
    """Prefill tok/s and decode tok/s of `concurrency` requests at once (aggregate and per sequence); `loras`: the
    vLLM adapter of each request (engine.lora.LoraRequest or None), cycled."""
    from .protocol import Sampling

    sampling = Sampling(min_tokens=tokens, max_tokens=tokens)
    jobs = prompts(phase, concurrency, prompt_tokens)
    results = [None] * concurrency

    def one(index: int) -> None:
        lora = loras[index % len(loras)] if loras else None
        results[index] = backend.generate(jobs[index], sampling, 1000 + index, phase,
                                          **({"lora": lora} if lora is not None else {})).timing

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    first = results[0]
    prefill = first.get("prefill_seconds") or first["ttft_seconds"]
    return {"prefill_tok_s": prompt_tokens / prefill if concurrency == 1 else None,
            "decode_tok_s": median(decode_rate(t) for t in results),
            "aggregate_tok_s": sum(t["output_tokens"] for t in results) / wall}


def bench_ar_path(config: BenchConfig, path: str) -> dict:
    """One AR path: batch-1 and N-concurrent rates per phase, medians of the repeats."""
    from .model.loader import load_model

    row: dict = {"path": path}
    if path == "mrv2-head":
        return {**row, **bench_mrv2_head(config)}
    if path == "lora":
        return {**row, **bench_lora(config)}
    if path.startswith("engine-memory"):
        return engine_memory_row(config.model_dir, config.workdir, "fp8" if path.endswith("fp8") else "auto")
    if path.startswith("torch"):
        from .model.sampling import TorchARBackend

        model = load_model(config.model_dir, quantization="int8" if path == "torch-int8" else "none")
        backend = TorchARBackend(model)
        for phase in ("abc", "semantic"):
            runs = [run_ar(backend, phase, config.tokens, 1) for _ in range(config.repeats)]
            row[f"{phase}_prefill_tok_s"] = median(r["prefill_tok_s"] for r in runs)
            row[f"{phase}_decode_tok_s"] = median(r["decode_tok_s"] for r in runs)
        row["peak_rss_bytes"] = peak_rss_bytes()
        return row
    backend, verdict = open_engine(config, path)
    row["policy"] = verdict
    try:
        start = time.perf_counter()
        backend.start()
        row["engine_start_s"] = time.perf_counter() - start
        for phase in ("abc", "semantic"):
            single = [run_ar(backend, phase, config.tokens, 1) for _ in range(config.repeats)]
            many = [run_ar(backend, phase, config.tokens, config.concurrency) for _ in range(config.repeats)]
            row[f"{phase}_prefill_tok_s"] = median(r["prefill_tok_s"] for r in single)
            row[f"{phase}_decode_tok_s"] = median(r["decode_tok_s"] for r in single)
            row[f"{phase}_decode_tok_s_x{config.concurrency}"] = median(r["aggregate_tok_s"] for r in many)
        row["peak_rss_bytes"] = peak_rss_bytes(backend.process.pid)
    finally:
        backend.close()
    return row


def bench_mrv2_head(config: BenchConfig) -> dict:
    """Semantic decode steps of MRV2's model state + lm_head + sampler (bf16, random hidden states: no forward)
    at 1 and `concurrency` rows, sliced vs full head: tok/s medians and their ratio."""
    from .derive import derive_ar_checkpoint
    from .engine.mrv2_step import head_rates

    checkpoint = derive_ar_checkpoint(config.model_dir, config.workdir / "arcache")
    rates = head_rates(checkpoint, "bfloat16", (1, config.concurrency), config.tokens, config.repeats, ("semantic",))
    n = config.concurrency
    return {"semantic_decode_tok_s": rates["semantic_tok_s_x1"]["sliced"],
            f"semantic_decode_tok_s_x{n}": rates[f"semantic_tok_s_x{n}"]["sliced"], "mrv2_head": rates,
            "policy": f"head+sampler only; sliced/full {rates['semantic_sliced_over_full_x1']:.2f}x at 1 row, "
                      f"{rates[f'semantic_sliced_over_full_x{n}']:.2f}x at {n}"}


HEAD_NUMERICS = ("bf16", "reproducible")


def bench_head(config: BenchConfig) -> dict:
    """The sliced vs the full lm_head, per phase at 1 and `concurrency` rows, side by side: decode tok/s on the vLLM
    engine (bf16, and as `--reproducible` runs it) with the head sliced and switched off, alternating (`repeats`
    times; the ratio is the median of the per-repeat ratios: this machine's speed drifts over minutes), and MRV2's
    model state + head + sampler (`engine.mrv2_step`, no forward) in the same two numerics where the engine cannot run
    MRV2 (a CPU)."""
    import torch

    rows = []
    for numerics in HEAD_NUMERICS:
        rows += _engine_head_rows(config, numerics)
    if not torch.cuda.is_available():  # on a GPU the engine rows are Model Runner V2's own
        rows += _mrv2_head_rows(config)
    return {"rows": rows}


def _engine_head_rows(config: BenchConfig, numerics: str) -> list[dict]:
    """Both engines resident and the cells alternating sliced/full where two engines fit in this host's memory (a
    CPU engine), else one engine at a time, alternating round by round (a GPU's memory plan holds one engine)."""
    n = config.concurrency
    cells = [(phase, count) for phase in ("abc", "semantic") for count in (1, n)]
    rates: dict[tuple, dict[str, list[float]]] = {cell: {"sliced": [], "full": []} for cell in cells}
    path = "vllm-bf16" + ("-reproducible" if numerics == "reproducible" else "")

    def engine(kind: str):
        return open_engine(config, path + ("-full-head" if kind == "full" else ""))[0]

    def measure(backend, kind: str, phase: str, count: int) -> None:
        run = run_ar(backend, phase, config.tokens, count)
        rates[(phase, count)][kind].append(run["decode_tok_s"] if count == 1 else run["aggregate_tok_s"])

    backends = {kind: engine(kind) for kind in ("sliced", "full")}
    record = backends["sliced"].runner_record()
    together = _fit_together(backends["sliced"])
    try:
        if together:
            for backend in backends.values():
                backend.start()
        for _ in range(config.repeats):
            if together:
                for phase, count in cells:
                    for kind, backend in backends.items():
                        measure(backend, kind, phase, count)
                continue
            for kind in backends:
                backends[kind] = engine(kind)
                backends[kind].start()
                for phase, count in cells:
                    measure(backends[kind], kind, phase, count)
                backends[kind].close()
    finally:
        for backend in backends.values():
            backend.close()
    rows = []
    for (phase, count), measured in rates.items():
        ratios = [s / f for s, f in zip(measured["sliced"], measured["full"])]
        rows.append({"runner": record["vllm_runner"], "numerics": numerics, "phase": phase, "rows": count,
                     "sliced_tok_s": median(measured["sliced"]), "full_tok_s": median(measured["full"]),
                     "sliced_over_full": median(ratios), "alternated": "per cell" if together else "per round",
                     "choice": (record["sliced_head_phases"] or {}).get(phase) or record["sliced_head_reason"]})
    return rows


def _fit_together(backend) -> bool:
    """Whether two such engines fit in host memory at once, with a fifth to spare (CPU engines only; each counted as
    its plan plus its weights again, for the copies vLLM-CPU packs)."""
    from .checkpoint import weights_bytes
    from .memory import read_meminfo

    if backend.settings.device_type != "cpu":
        return False
    one = backend.plan.engine + weights_bytes(backend.settings.checkpoint.path)
    return 2 * one < 0.8 * read_meminfo().get("MemAvailable", 0)


def _mrv2_head_rows(config: BenchConfig) -> list[dict]:
    """MRV2's head + sampler in the engine's numerics here: bf16, and float32 (`--reproducible` on a CPU)."""
    from .derive import derive_ar_checkpoint
    from .engine.mrv2_step import head_rates

    checkpoint = derive_ar_checkpoint(config.model_dir, config.workdir / "arcache")
    rows = []
    for numerics, dtype in (("bf16", "bfloat16"), ("reproducible", "float32")):
        rates = head_rates(checkpoint, dtype, (1, config.concurrency), config.tokens, config.repeats)
        for phase in ("abc", "semantic"):
            for count in (1, config.concurrency):
                measured = rates[f"{phase}_tok_s_x{count}"]
                rows.append({"runner": "mrv2 head+sampler", "numerics": numerics, "phase": phase, "rows": count,
                             "sliced_tok_s": measured["sliced"], "full_tok_s": measured["full"],
                             "sliced_over_full": rates[f"{phase}_sliced_over_full_x{count}"],
                             "choice": rates["choice"][phase]})
    return rows


def bench_lora(config: BenchConfig) -> dict:
    """Semantic decode tok/s at `concurrency` rows, side by side: an engine without LoRA, then one with LoRA
    (LORA_ADAPTERS slots of rank LORA_RANK) serving no adapter, one adapter on every row, and LORA_ADAPTERS distinct
    adapters across the rows; medians of the repeats and their ratios to LoRA off."""
    from dataclasses import replace

    from .adapters.cache import convert_adapter
    from .engine.lora import LoraIds, LoraSettings
    from .model.modeling import YuE2Config
    from .testing_adapters import write_tiny_adapter

    mot = YuE2Config.load(config.model_dir)
    converted = []
    for index in range(LORA_ADAPTERS):
        path = config.workdir / "adapters" / f"bench-{index}.safetensors"
        if not path.exists():
            write_tiny_adapter(path, "plain", rank=LORA_RANK, seed=index, config=mot)
        converted.append(convert_adapter(path, mot, cache_dir=config.workdir / "adapter-cache"))
    ids = LoraIds()
    loras = [ids.request(c.sha256, 1.0, c.ar_path) for c in converted]
    cases = {"off": None, "on_unused": None, "one_adapter": loras[:1], f"{LORA_ADAPTERS}_adapters": loras}
    rates, starts = {}, {}
    for lora in (False, True):
        backend, _ = open_engine(config, "vllm-bf16")
        if lora:
            backend = type(backend)(mot, replace(backend.settings, lora=LoraSettings(LORA_ADAPTERS, LORA_RANK),
                                                 max_num_seqs=backend.settings.max_num_seqs, kv_cache_bytes=None))
        try:
            start = time.perf_counter()
            backend.start()
            starts["on" if lora else "off"] = time.perf_counter() - start
            for case, loras in cases.items():
                if (case == "off") == lora:
                    continue
                runs = [run_ar(backend, "semantic", config.tokens, config.concurrency, loras=loras)
                        for _ in range(config.repeats)]
                rates[case] = median(r["aggregate_tok_s"] for r in runs)
        finally:
            backend.close()
    n = config.concurrency
    return {f"semantic_decode_tok_s_x{n}": rates["off"], "lora_tok_s": rates,
            "lora_ratio_to_off": {case: rate / rates["off"] for case, rate in rates.items()},
            "engine_start_s": starts.get("on"),
            "policy": f"LoRA off / on unused / 1 / {LORA_ADAPTERS} rank-{LORA_RANK} adapters at {n} rows: "
                      + " / ".join(f"{rates[c]:.1f}" for c in cases) + " tok/s"}


def open_engine(config: BenchConfig, path: str):
    """The vLLM backend of a path and the speed policy's verdict on its checkpoint for this device."""
    from .derive import ARCheckpoint, derive_ar_checkpoint, validate_ar_checkpoint
    from .model.modeling import YuE2Config
    from .quant.schemes import device_info, slow_reason
    from .engine.backend import EngineSettings, VLLMBackend

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mot = YuE2Config.load(config.model_dir)
    scheme_name = path.removeprefix("vllm-").removesuffix("-full-head").removesuffix("-reproducible")
    if scheme_name == "bf16":
        checkpoint = ARCheckpoint(derive_ar_checkpoint(config.model_dir, config.workdir / "arcache"), "derived", None)
        verdict = "bf16"
    else:
        directory = config.checkpoints.get(scheme_name) or export(config, scheme_name)
        scheme = validate_ar_checkpoint(directory, mot)
        checkpoint = ARCheckpoint(directory, "override", scheme)
        reason = slow_reason(scheme, device_info(device))
        verdict = f"declined by policy: {reason}" if reason else "fast kernel: served"
    options = {}
    if "-reproducible" in path:  # what --reproducible costs: batch-invariant kernels, or a float32 engine
        from .engine.runner import batch_invariance

        invariance = batch_invariance(device, torch.cuda.get_device_capability() if device == "cuda" else None)
        options = {"batch_invariance": invariance, **({"dtype": invariance.dtype} if invariance.dtype else {})}
    settings = EngineSettings(checkpoint, device_type=device, max_num_seqs=max(8, config.concurrency),
                              max_model_len=4096, sliced_head=not path.endswith("full-head"), **options)
    return VLLMBackend(mot, settings), verdict


def export(config: BenchConfig, scheme: str) -> Path:
    """A compressed-tensors export made by the quantization venv (`calibration/setup-quant-env.sh`)."""
    from .quant.export import quant_python

    python = quant_python()
    if python is None:
        raise RuntimeError(f"no {scheme} checkpoint given and no quantization venv to export one: run "
                           "`bash calibration/setup-quant-env.sh` or pass --checkpoint "
                           f"{scheme}=DIR")
    out = config.workdir / f"export-{scheme}"
    if not (out / "config.json").exists():
        subprocess.run([str(python), "-m", "yue2_vllm.cli", "quantize", str(config.model_dir), "--scheme", scheme,
                        "--out", str(out), "--cache-dir", str(config.workdir / "arcache")], check=True,
                       capture_output=True)
    return out


# --------------------------------------------------------------------------- the engine's memory against the plan


MEMORY_ROWS = 2  # engine rows of the memory row: a real-size plan's KV for more does not fit a 24 GiB machine


class PeakSampler:
    """The least free device memory seen while it runs (the engine is another process: its CUDA peak is read
    from the device, every 20 ms)."""

    def __init__(self):
        import torch

        self.cuda, self.least, self._stop = torch.cuda.is_available(), None, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import torch

        while not self._stop.is_set():
            free = torch.cuda.mem_get_info()[0]
            self.least = free if self.least is None else min(self.least, free)
            self._stop.wait(0.02)

    def __enter__(self):
        if self.cuda:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.cuda:
            self._thread.join()


def engine_memory_row(model_dir: Path, workdir: Path, form: str = "auto", rows: int = MEMORY_ROWS,
                      prompt_tokens: int = PROMPT_TOKENS, tokens: int = 16) -> dict:
    """Start the engine as our memory plan sizes it (`rows` rows of a typical song, the `form` KV cache; the
    engine alone: no torch side is loaded, so none is counted), run `rows` requests of `prompt_tokens` + `tokens`
    at once, and read the engine's peak against the plan's engine figure: the worker's peak RSS (VmHWM) on the
    CPU, the device's least free memory on CUDA, against the plan's engine peak (loading or running).
    `measured_overhead_bytes` is what the engine holds while serving (the CPU's resident set; CUDA's peak) less
    the weights and KV the plan counts: what the plan's engine overhead covers."""
    import torch

    from .derive import ARCheckpoint, derive_ar_checkpoint
    from .engine.backend import EngineSettings, VLLMBackend
    from .memory import default_budget_gib, total_memory_bytes
    from .model.modeling import YuE2Config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = YuE2Config.load(model_dir)
    checkpoint = ARCheckpoint(derive_ar_checkpoint(model_dir, workdir / "arcache"), "derived", None)
    budget = default_budget_gib(None, total_memory_bytes("cuda") if device == "cuda" else None)
    settings = EngineSettings(checkpoint, device_type=device, memory_budget_gib=budget, max_num_seqs=rows,
                              kv_cache_dtype=form)
    backend = VLLMBackend(config, settings)
    plan = backend.plan
    row = {"path": "engine-memory" + ("" if form == "auto" else f"-{form}"), "device": device, "rows": rows,
           "kv_cache_dtype": form, "plan_engine_bytes": plan.engine, "plan_weights_bytes": plan.engine_weights,
           "plan_kv_bytes": plan.kv_cache, "plan_overhead_bytes": plan.engine_overhead,
           "plan_peak_bytes": plan.engine_peak, "budget_gib": round(budget, 2)}
    free_before = torch.cuda.mem_get_info()[0] if device == "cuda" else None
    try:
        with PeakSampler() as sampler:
            start = time.perf_counter()
            backend.start()
            row["engine_start_s"] = time.perf_counter() - start
            if device == "cpu":  # the resident set once started, and the peak the load left behind
                row["rss_started_bytes"] = peak_rss_bytes(backend.process.pid, "VmRSS")
                row["peak_at_start_bytes"] = peak_rss_bytes(backend.process.pid)
            row["decode_tok_s_rows"] = run_ar(backend, "semantic", tokens, rows, prompt_tokens)["aggregate_tok_s"]
            if device == "cpu":
                row["rss_served_bytes"] = peak_rss_bytes(backend.process.pid, "VmRSS")
        row["kv_cache"] = backend.engine_info.get("kv_cache")
        peak = (free_before - sampler.least) if device == "cuda" else peak_rss_bytes(backend.process.pid)
    finally:
        backend.close()
    running = row.get("rss_served_bytes", peak)  # the CPU: the resident set while serving; CUDA: the peak
    row.update(peak_bytes=peak, peak_over_plan=peak / plan.engine_peak, within_plan=peak <= plan.engine_peak,
               measured_overhead_bytes=running - plan.engine_weights - plan.kv_cache)
    return row


def release_size_model(directory: Path) -> Path:
    """YuE2-3B's release layout at its real size with random weights (6.76 GiB, written once, one tensor at a
    time: `testing.write_random_model`)."""
    from .model.modeling import YuE2Config
    from .testing import write_random_model

    if not (directory / "model.safetensors").exists():
        write_random_model(directory, config=YuE2Config())
    return directory


# --------------------------------------------------------------------------- NAR and VAE


def bench_synthesis(config: BenchConfig) -> dict:
    import torch

    from .model.loader import load_model
    from .model.nar import synthesize
    from .protocol import ABC_END, ABC_START, EOD, MUSIC_START
    from .model.vae import load_vae

    model = load_model(config.model_dir)
    prefix = [EOD] + list(range(100, 400)) + [ABC_START, 300, 301, ABC_END, MUSIC_START]
    codec = [(37 * i) % 32768 for i in range(NAR_FRAMES)]
    times = []
    for _ in range(config.repeats):
        start = time.perf_counter()
        latents = synthesize(model, prefix, codec, 1, steps=config.nar_steps)
        times.append(time.perf_counter() - start)
    nar = median(times)
    audio_seconds = NAR_FRAMES / 25
    row = {"nar_s_per_step": nar / config.nar_steps, "nar_s_per_audio_s": nar / config.nar_steps * 32 / audio_seconds}
    if config.vae_dir is not None:
        vae = load_vae(config.vae_dir)
        latent = latents.T[None].contiguous()
        times = []
        for _ in range(config.repeats):
            start = time.perf_counter()
            vae.decode_tiled(latent, core_frames=1024, halo_frames=16)
            times.append(time.perf_counter() - start)
        row["vae_rtf"] = median(times) / audio_seconds
    if torch.cuda.is_available():
        row["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return row


# --------------------------------------------------------------------------- takes


TAKES = 4


def _songs_run(pipe, mode: str, style: str, lyrics: str, directory: Path) -> dict:
    """TAKES whole songs at once, as the takes of one request or as separate requests with the same seeds."""
    from .protocol import SongRequest
    from .scheduler import SongScheduler
    from .takes import TakeOptions, run_takes, take_directory

    request = SongRequest(style, lyrics, seed=1000, id="song")
    start = time.perf_counter()
    with SongScheduler(pipe, concurrency=TAKES) as scheduler:
        if mode == "takes":
            document = run_takes(scheduler, request, directory, TakeOptions(TAKES))
            directories = [take_directory(directory, k) for k in document["complete"]]
        else:
            handles = [scheduler.submit(SongRequest(style, lyrics, seed=1000 + k, id=f"sep{k}"), directory / f"sep{k}")
                       for k in range(TAKES)]
            finished = list(scheduler.as_completed(handles))
            directories = [h.directory for h in finished if h.state == "complete"]
    wall = time.perf_counter() - start
    prompt = cached = 0
    for song in directories:
        timing = json.loads((song / "result.json").read_text(encoding="utf-8"))["timing"]
        for phase in ("abc", "semantic"):
            prompt += timing[phase].get("prompt_tokens") or 0
            cached += timing[phase].get("cached_prompt_tokens") or 0
    return {"mode": mode, "songs": len(directories), "wall_s": wall, "songs_per_s": len(directories) / wall,
            "prompt_tokens": prompt, "cached_prompt_tokens": cached, "computed_prompt_tokens": prompt - cached}


def bench_takes(config: BenchConfig) -> dict:
    """TAKES takes of one request vs TAKES separate requests with the same seeds, at the same concurrency, on
    the vLLM engine: prompt tokens computed and from the prefix cache, wall seconds, songs/s (medians). Each run
    has its own style text, so no run finds another's prompt in the cache."""
    from .options import AROptions, EngineOptions
    from .pipeline import YuE2Pipeline

    generation = {"abc": {"max_tokens": config.tokens, "min_tokens": config.tokens},
                  "semantic": {"max_tokens": config.tokens, "min_tokens": config.tokens}, "ode_steps": 2}
    lyrics = "[verse]\n" + "city lights are fading slow, I keep the words you said tonight\n" * 40
    runs: dict[str, list[dict]] = {"separate": [], "takes": []}
    with YuE2Pipeline(config.model_dir, config.vae_dir, generation_config=generation, ar=AROptions(backend="vllm"),
                      engine=EngineOptions(max_num_seqs=2 * TAKES, start=True)) as pipe:
        for repeat in range(config.repeats):
            for mode in ("separate", "takes"):
                style = f"pop, piano, warm female vocal, run {repeat} {mode}"
                runs[mode].append(_songs_run(pipe, mode, style, lyrics, config.workdir / f"takes-{repeat}-{mode}"))
    rows = []
    for mode, measured in runs.items():
        row = {"mode": mode, "songs": TAKES}
        for key in ("wall_s", "songs_per_s", "prompt_tokens", "cached_prompt_tokens", "computed_prompt_tokens"):
            row[key] = median([m[key] for m in measured])
        rows.append(row)
    rows.append({"mode": "takes / separate", "wall_s": rows[1]["wall_s"] / rows[0]["wall_s"],
                 "songs_per_s": rows[1]["songs_per_s"] / rows[0]["songs_per_s"]})
    return {"takes": TAKES, "rows": rows}


# --------------------------------------------------------------------------- transcription


TRANSCRIPTION_SECONDS = (30, 120)  # the sources measured side by side
# Transcriptions in a fresh process: its peak resident memory before (VmHWM, which exec resets: ru_maxrss would be
# the bench's own, inherited), the first transcription (librosa's lazy imports and numba's kernels compiled) and a
# second of the same source, then the process's peak.
_TRANSCRIPTION_CHILD = """
import json, os, sys, time
from pathlib import Path
from yue2_vllm.bench import peak_rss_bytes
base = peak_rss_bytes(os.getpid())
from yue2_vllm.transcription import transcribe
runs = []
for _ in range(2):
    start = time.perf_counter(); result = transcribe(Path(sys.argv[1]), transcriber=sys.argv[2])
    runs.append(time.perf_counter() - start)
print(json.dumps({"first_s": runs[0], "warm_s": runs[1], "notes": len(result.notes), "source_s": result.source.seconds,
                  "peak_above_bytes": peak_rss_bytes(os.getpid()) - base}))
"""


def melody_wav(seconds: float, path: Path, rate: int = 16000) -> Path:
    """A sung-like melody (a tone and its harmonics, vibrato, a note every 0.4-0.8 s) of `seconds`, as 16-bit WAV."""
    import numpy as np
    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    lengths = np.array([0.4, 0.4, 0.8, 0.6, 0.2, 0.8])
    onsets = np.cumsum(np.tile(lengths, int(seconds / lengths.sum()) + 1))
    index = np.searchsorted(onsets, t)
    pitch = np.array([60, 62, 64, 65, 67, 69, 67, 64])[index % 8] + 0.2 * np.sin(2 * np.pi * 5.5 * t)
    phase = 2 * np.pi * np.cumsum(440.0 * 2 ** ((pitch - 69) / 12)) / rate
    since = t - np.concatenate([[0.0], onsets])[index]
    envelope = np.minimum(1.0, since / 0.02) * np.where(since < 0.9 * lengths[index % 6], 1.0, 0.0)
    soundfile.write(str(path), (0.25 * envelope * (np.sin(phase) + 0.4 * np.sin(2 * phase))).astype(np.float32), rate,
                    subtype="PCM_16")
    return path


def bench_transcription(config: BenchConfig) -> dict:
    """pyin's (and SheetSage2's, where it is set up) transcription of sung-like melodies of TRANSCRIPTION_SECONDS:
    seconds per audio minute once warm and on a process's first call (librosa's imports and numba's kernels), peak
    resident memory above the process's own; each repeat a fresh process, medians of `--repeats`."""
    from .transcription import transcribers_status

    status = transcribers_status()
    rows, not_run = [], {}
    config.workdir.mkdir(parents=True, exist_ok=True)
    for transcriber in ("pyin", "sheetsage2"):
        if not status[transcriber]["ready"]:
            not_run[transcriber] = status[transcriber]["reason"]
            continue
        for seconds in TRANSCRIPTION_SECONDS:
            source = melody_wav(seconds, config.workdir / f"melody-{seconds}s.wav")
            command = [sys.executable, "-c", _TRANSCRIPTION_CHILD, str(source), transcriber]
            runs = [json.loads(subprocess.run(command, capture_output=True, text=True, encoding="utf-8",
                                              check=True).stdout.splitlines()[-1])
                    for _ in range(config.repeats)]
            minutes = runs[0]["source_s"] / 60
            rows.append({"transcriber": transcriber, "source_s": runs[0]["source_s"], "notes": runs[0]["notes"],
                         "s_per_audio_min": median(r["warm_s"] for r in runs) / minutes,
                         "first_s_per_audio_min": median(r["first_s"] for r in runs) / minutes,
                         "peak_rss_above_bytes": median(r["peak_above_bytes"] for r in runs)})
    return {"rows": rows, "not_run": not_run, "repeats": config.repeats}


# --------------------------------------------------------------------------- report


COLUMNS = (("path", "path"), ("abc_prefill_tok_s", "abc prefill tok/s"), ("abc_decode_tok_s", "abc decode tok/s"),
           ("semantic_prefill_tok_s", "semantic prefill tok/s"), ("semantic_decode_tok_s", "semantic decode tok/s"),
           ("semantic_decode_tok_s_xN", "semantic decode tok/s ×N"), ("engine_start_s", "engine start s"),
           ("peak_rss_bytes", "peak RSS MiB"), ("policy", "speed policy"))


def markdown(report: dict) -> str:
    m, n = report["machine"], report["config"]["concurrency"]
    lines = [f"# yue2-vllm bench: {report['config']['model']}", "",
             f"{m['cpu']} ({m['cpu_isa']}, {m['cores']} cores), GPU {m['gpu'] or 'none'}, Python {m['python']}, "
             f"torch {m['torch']}, vLLM {m['vllm'] or 'not installed'}; {report['config']['tokens']} tokens per "
             f"request after a {PROMPT_TOKENS}-token prompt, ×N = {n} concurrent, medians of "
             f"{report['config']['repeats']}", "",
             "| " + " | ".join(label for _, label in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in [row for row in report["ar"] if not row["path"].startswith("engine-memory")]:
        cells = []
        for key, _ in COLUMNS:
            value = row.get(key.replace("xN", f"x{n}"))
            if key == "peak_rss_bytes" and value:
                value = value / 2**20
            cells.append("—" if value is None else (f"{value:.1f}" if isinstance(value, float) else str(value)))
        lines.append("| " + " | ".join(cells) + " |")
    memory = [row for row in report["ar"] if row["path"].startswith("engine-memory") and "peak_bytes" in row]
    if memory:
        gib = lambda value: f"{value / 2**30:.2f}"  # noqa: E731
        lines += ["", "Engine memory against the plan (peak: the worker's VmHWM on the CPU, the device's least free "
                      "memory on CUDA)", "",
                  "| path | rows | KV | plan: weights + KV + overhead = engine (GiB) | plan peak GiB | peak GiB | "
                  "peak / plan | measured overhead GiB |", "|---|---|---|---|---|---|---|---|"]
        for row in memory:
            lines.append(f"| {row['path']} | {row['rows']} | {row['kv_cache_dtype']} | {gib(row['plan_weights_bytes'])}"
                         f" + {gib(row['plan_kv_bytes'])} + {gib(row['plan_overhead_bytes'])} = "
                         f"{gib(row['plan_engine_bytes'])} | {gib(row['plan_peak_bytes'])} | {gib(row['peak_bytes'])} "
                         f"| {row['peak_over_plan']:.2f} | {gib(row['measured_overhead_bytes'])} |")
    s = report["synthesis"]
    if report.get("head"):
        lines += ["", "The lm_head: phase-sliced vs full, per phase, at 1 and ×N rows (decode tok/s, medians; "
                      "sliced / full: the median of per-repeat ratios; mrv2 head+sampler: no forward, random hidden "
                      "states)", "",
                  "| runner | numerics | phase | rows | sliced tok/s | full tok/s | sliced / full | choice |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in report["head"]["rows"]:
            lines.append("| " + " | ".join(
                [str(row["runner"]), row["numerics"], row["phase"], str(row["rows"])]
                + ["—" if row.get(k) is None else f"{row[k]:.{2 if k == 'sliced_over_full' else 1}f}"
                   for k in ("sliced_tok_s", "full_tok_s", "sliced_over_full")] + [str(row.get("choice"))]) + " |")
        if report["head"].get("not_run"):
            lines.append(f"(not run: {report['head']['not_run']})")
    if report.get("takes"):
        lines += ["", f"Takes: {report['takes']['takes']} takes of one request vs as many separate requests with "
                      "the same seeds, at the same concurrency (whole songs, medians)", "",
                  "| run | wall s | songs/s | prompt tokens | from cache | computed |", "|---|---|---|---|---|---|"]
        for row in report["takes"]["rows"]:
            lines.append("| " + " | ".join([row["mode"]] + [
                "—" if row.get(k) is None else (f"{row[k]:.3f}" if isinstance(row[k], float) else str(row[k]))
                for k in ("wall_s", "songs_per_s", "prompt_tokens", "cached_prompt_tokens",
                          "computed_prompt_tokens")]) + " |")
    if report.get("transcription"):
        t = report["transcription"]
        lines += ["", f"Transcription (covers): sung-like melodies, each repeat a fresh process (medians of "
                      f"{t.get('repeats')}); warm: a second transcription in the process, first: its first (librosa's "
                      "imports, numba's kernels compiled), peak: resident memory above the process's own", "",
                  "| transcriber | source s | notes | s per audio min (warm) | s per audio min (first) | peak MiB |",
                  "|---|---|---|---|---|---|"]
        for row in t["rows"]:
            lines.append(f"| {row['transcriber']} | {row['source_s']:.0f} | {row['notes']} | "
                         f"{row['s_per_audio_min']:.2f} | {row['first_s_per_audio_min']:.2f} | "
                         f"{row['peak_rss_above_bytes'] / 2**20:.0f} |")
        not_run = t.get("not_run") or {}
        for transcriber, reason in (not_run.items() if isinstance(not_run, dict) else [("it", not_run)]):
            lines.append(f"({transcriber} not run: {reason})")
    if s is not None:
        lines += ["", f"NAR: {s['nar_s_per_step']:.3f} s per midpoint step at {NAR_FRAMES} frames, "
                      f"{s['nar_s_per_audio_s']:.3f} s per audio second (32 steps)"
                  + (f"; VAE real-time factor {s['vae_rtf']:.3f}" if "vae_rtf" in s else "")]
    return "\n".join(lines) + "\n"


def run(config: BenchConfig, on_row=None) -> dict:
    report = {"machine": machine(), "config": {"model": config.label, "tokens": config.tokens,
                                               "concurrency": config.concurrency, "repeats": config.repeats,
                                               "paths": list(config.paths)}, "ar": []}
    for path in config.paths:
        if path in SECTIONS:
            try:
                report[path] = globals()[SECTIONS[path]](config)
            except Exception as exc:
                report[path] = {"rows": [], "not_run": f"{type(exc).__name__}: {exc}",
                                **({"takes": TAKES} if path == "takes" else {})}
            if on_row is not None:
                on_row(report[path])
            continue
        try:
            row = bench_ar_path(config, path)
        except Exception as exc:  # a path that cannot run here is a row that says why
            row = {"path": path, "policy": f"not run: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        report["ar"].append(row)
        if on_row is not None:
            on_row(row)
    # The memory rows alone (a release-size model) leave the NAR / VAE timing out: it would load the full MoT; so do
    # the paths that measure no model.
    no_model = all(path.startswith("engine-memory") or path in NO_MODEL for path in config.paths)
    report["synthesis"] = None if no_model else bench_synthesis(config)
    return report


def one_layer_slice(directory: Path) -> Path:
    """A one-layer MoT at YuE2-3B's real width (hidden 2048, the full 184,704-row lm_head), written once."""
    from .model.modeling import YuE2Config
    from .testing import write_tiny_model

    if not (directory / "model.safetensors").exists():
        write_tiny_model(directory, config=YuE2Config(num_hidden_layers=1))
    return directory


def save(report: dict, out: Path) -> None:
    from .checkpoint import write_bytes_atomic, write_json_atomic

    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "bench.json", report)
    write_bytes_atomic(out / "bench.md", markdown(report).encode("utf-8"))


def main_from_args(args) -> int:
    from .testing import tiny_default

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="yue2-bench-"))
    if args.model == "one-layer":
        model_dir, vae_dir, label = one_layer_slice(workdir / "one-layer"), None, "one layer of YuE2-3B at real width"
    elif args.model == "release-size":
        model_dir, vae_dir, label = (release_size_model(workdir / "release-size"), None,
                                     "YuE2-3B's release layout at real size, random weights")
    elif args.model:
        model_dir, vae_dir, label = Path(args.model), Path(args.vae) if args.vae else None, str(args.model)
    else:
        (model_dir, vae_dir), label = tiny_default(), "tiny default"
    checkpoints = dict(spec.split("=", 1) for spec in args.checkpoint or [])
    config = BenchConfig(model_dir, vae_dir, label, tuple(args.paths.split(",")), args.concurrency, args.tokens,
                         args.repeats, args.nar_steps, workdir, {k: Path(v) for k, v in checkpoints.items()})
    unknown = set(config.paths) - set(PATHS)
    if unknown:
        raise ValueError(f"--paths: unknown {sorted(unknown)}; choose from {', '.join(PATHS)}")
    report = run(config, on_row=lambda row: print(json.dumps(row), file=sys.stderr, flush=True))
    save(report, Path(args.out))
    print(markdown(report), end="")
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="YuE2 MoT directory, 'one-layer' (a real-width slice), 'release-size' (the "
                                        "release layout at real size, random weights), or nothing for the tiny "
                                        "default")
    parser.add_argument("--vae", help="VAE directory (with --model)")
    parser.add_argument("--paths", default=",".join(DEFAULT_PATHS), help=f"comma list of {', '.join(PATHS)} "
                                                                         f"(default: {','.join(DEFAULT_PATHS)})")
    parser.add_argument("--concurrency", type=int, default=8, help="requests at once for the ×N column (default 8)")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per request (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; medians (default 3)")
    parser.add_argument("--nar-steps", type=int, default=4, help="ODE steps timed for the NAR (default 4)")
    parser.add_argument("--checkpoint", action="append", help="fp8=DIR or int8=DIR: a compressed-tensors AR export "
                                                              "(default: exported through .venv-quant)")
    parser.add_argument("--workdir", help="scratch directory (exports, derived checkpoints); default: a temp dir")
    parser.add_argument("--out", default="bench-results", help="where bench.json and bench.md go (default "
                                                               "bench-results)")
