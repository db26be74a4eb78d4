"""The options resolved once (song/resolved.py): every value the pipeline, the CLI, `doctor` and a Ray head read —
the budget and the pool, the VAE tile, the typical song, the AR checkpoint, the KV form, the LoRA slots — worked out
in one place, refused on this machine only, and the LoRA sized from the registered adapters' count and rank."""
import json
from dataclasses import replace

import pytest
import torch

from yue2_vllm.engine.lora import LoraSettings
from yue2_vllm.memory import GIB, PROMPT_ESTIMATE_TOKENS, default_budget_gib
from yue2_vllm.options import AdapterOptions, AROptions, DeviceOptions, EngineOptions, PipelineOptions
from yue2_vllm.protocol import GenerationConfig
from yue2_vllm.song.resolved import (EngineInputs, ResolvedOptions, ar_adapters, default_vae_core_frames,
                                     engine_settings, resolve_options)


def test_resolved_on_this_machine_fills_every_default(monkeypatch, tmp_path):
    monkeypatch.setenv("YUE2_AR_CHECKPOINT", str(tmp_path / "ar"))
    generation = GenerationConfig.from_dict({"abc": {"max_tokens": 300}, "semantic": {"max_tokens": 500}})
    resolved = resolve_options(PipelineOptions(generation, device=DeviceOptions(device="cpu")))
    budget = default_budget_gib(None)
    assert isinstance(resolved, ResolvedOptions) and resolved.device == torch.device("cpu")
    assert (resolved.device_type, resolved.unified, resolved.card_bytes) == ("cpu", None, None)
    assert resolved.budget_gib == budget and resolved.vae_core_frames == default_vae_core_frames(budget)
    assert resolved.typical_tokens == PROMPT_ESTIMATE_TOKENS + 500
    assert resolved.ar_checkpoint == str(tmp_path / "ar") == resolved.options.load.ar_checkpoint
    assert resolved.kv_cache_dtype == "auto" and resolved.ar_on_device and not resolved.beside_engine
    assert resolved.lora == LoraSettings() and resolved.options.device.device == "cpu"
    given = resolve_options(PipelineOptions(load=replace(PipelineOptions().load, ar_checkpoint="/given"),
                                            device=DeviceOptions(device="cpu", budget_gib=12.0, vae_core_frames=64)))
    assert (given.ar_checkpoint, given.budget_gib, given.vae_core_frames) == ("/given", 12.0, 64)


def test_the_vae_tile_is_upstreams_512_at_12_gib_or_less():
    assert [default_vae_core_frames(b) for b in (4.0, 12.0, 12.5, 80.0)] == [512, 512, 1024, 1024]
    for budget, frames in ((12.0, 512), (12.5, 1024)):
        assert resolve_options(PipelineOptions(device=DeviceOptions("cpu", budget))).vae_core_frames == frames


def test_a_budget_above_the_card_is_refused_here_and_left_to_the_replica_elsewhere(fake_gpu):
    gpu = fake_gpu("L40S")
    options = PipelineOptions(device=DeviceOptions(device="cuda", budget_gib=100.0))
    with pytest.raises(ValueError, match=r"^--budget 100.00 GiB is above this GPU's 44.99 GiB"):
        resolve_options(options)
    elsewhere = resolve_options(options, "cuda")  # a Ray head sizing its replicas: they refuse on their machines
    assert elsewhere.device is None and elsewhere.budget_gib == 100.0 and elsewhere.card_bytes == gpu["total"]
    default = resolve_options(replace(options, device=DeviceOptions(device="cuda")))
    assert default.budget_gib == gpu["total"] * 0.9 / GIB and default.card_bytes == gpu["total"]
    assert default.options.device.device == "cuda:0"


def test_another_machines_gpu_without_one_here_plans_in_the_budget():
    """A GPU-less Ray head sizing GPU replicas: no card to read here; nothing is refused."""
    resolved = resolve_options(PipelineOptions(device=DeviceOptions(budget_gib=40.0)), "cuda")
    assert (resolved.device, resolved.device_type, resolved.card_bytes, resolved.budget_gib) == (None, "cuda", None,
                                                                                                40.0)


def test_the_kv_form_is_refused_naming_the_flag_asked_for_or_left_unchecked():
    options = PipelineOptions(ar=AROptions(backend="torch"), engine=EngineOptions(kv_cache_dtype="fp8"),
                              device=DeviceOptions(device="cpu"))
    with pytest.raises(ValueError, match="^--kv-cache-dtype fp8 sets the vLLM engine's KV cache, and the torch "
                                         "backend keeps its K/V in the model dtype"):
        resolve_options(options, kv_flag="--kv-cache-dtype")
    with pytest.raises(ValueError, match="^--kv-cache-dtype fp8 sets"):  # the same on any machine
        resolve_options(options, "cuda", kv_flag="--kv-cache-dtype")
    assert resolve_options(options, "cpu", kv_flag=None).kv_cache_dtype == "fp8"  # doctor: reports, never refuses


def test_a_torch_execution_the_device_lacks_is_refused_before_anything_else():
    with pytest.raises(ValueError, match="^--torch-execution graph needs a CUDA device"):
        resolve_options(PipelineOptions(ar=AROptions(torch_execution="graph"), device=DeviceOptions(device="cpu")))


def test_the_lora_is_sized_by_the_registered_ar_adapters_count_and_rank():
    base = resolve_options(PipelineOptions(device=DeviceOptions(device="cpu")))
    assert base.with_adapters(0, 0).lora == LoraSettings() and not base.with_adapters(0, 0).lora.enabled
    assert base.with_adapters(1, 8).lora == LoraSettings(1, 8)
    assert base.with_adapters(3, 12).lora == LoraSettings(3, 16)  # vLLM's next rank up
    assert base.with_adapters(6, 64).lora == LoraSettings(4, 64)  # at most DEFAULT_MAX_LORAS unless asked
    asked = resolve_options(PipelineOptions(device=DeviceOptions(device="cpu"),
                                            adapters=AdapterOptions(max_loras=6, max_lora_rank=32)))
    assert asked.with_adapters(2, 8).lora == LoraSettings(6, 32)


def test_the_registry_gives_the_ar_adapters_count_and_rank(tmp_path):
    """No adapters or NAR-only ones: LoRA off (no cost); AR ones: one slot each, the rank that holds them."""
    from yue2_vllm.song.adapters import ServedAdapters
    from yue2_vllm.testing import TINY_CONFIG
    from yue2_vllm.testing_adapters import write_tiny_adapter

    nar = write_tiny_adapter(tmp_path / "voice.safetensors", "comfyui", half="nar")
    ar = write_tiny_adapter(tmp_path / "style", "peft", half="ar", rank=8)
    cache = tmp_path / "cache"
    base = resolve_options(PipelineOptions(device=DeviceOptions(device="cpu")))

    def sized(modules):
        registry = ServedAdapters.register(AdapterOptions(modules, cache_dir=cache), TINY_CONFIG).registry
        return ar_adapters(registry), base.with_adapters(*ar_adapters(registry)).lora

    assert sized(()) == ((0, 0), LoraSettings())
    assert sized((("voice", str(nar.path)),)) == ((0, 0), LoraSettings())
    assert sized((("voice", str(nar.path)), ("style", str(ar.path)))) == ((1, 8), LoraSettings(1, 8))


def test_lora_slots_are_lowered_while_the_engines_plan_fails_at_the_real_size(tmp_path):
    """At YuE2-3B's sizes: 4 rank-64 slots (133 MiB each) asked for by four adapters where only 2 fit leave 2; an
    explicit count stays as given (and the plan then says why it fails)."""
    from yue2_vllm.lora_memory import lora_slots_bytes
    from yue2_vllm.memory import ar_expert_bytes
    from yue2_vllm.model.modeling import YuE2Config

    config = YuE2Config()
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    engine = EngineOptions(max_num_seqs=1, tuning={"kv_cache_bytes": 2**30})

    def resolved(budget_gib, max_loras=None):
        return resolve_options(PipelineOptions(engine=engine, device=DeviceOptions(device="cpu", budget_gib=budget_gib),
                                               adapters=AdapterOptions(max_loras=max_loras)))

    def need(slots):
        sized = replace(resolved(100.0), lora=LoraSettings(slots, 64))
        return engine_settings(EngineInputs(tmp_path, None, sized), None).plan(
            config, engine_weights=ar_expert_bytes(config)).need

    assert need(3) - need(2) == lora_slots_bytes(config, 1, 64)  # each slot is engine memory
    budget = (need(2) + need(3)) / 2 / 2**30  # room for 2 slots, not 3
    sized = resolved(budget).with_adapters(4, 64, tmp_path)
    assert sized.lora == LoraSettings(2, 64)
    plan = engine_settings(EngineInputs(tmp_path, None, sized), None).plan(config,
                                                                          engine_weights=ar_expert_bytes(config))
    assert plan.lora_slots == lora_slots_bytes(config, 2, 64) and not plan.problems()
    assert resolved(budget, max_loras=4).with_adapters(4, 64, tmp_path).lora == LoraSettings(4, 64)
    assert resolved(budget).with_adapters(4, 64).lora == LoraSettings(4, 64)  # no model to plan with: as asked
