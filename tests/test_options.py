"""The pipeline's typed options: each group refuses a bad field in one line naming it, before anything loads, and the
pipeline keeps them with their defaults filled in."""
import dataclasses
import math

import pytest

from yue2_vllm.checkpoint import HashCache
from yue2_vllm.options import AROptions, DeviceOptions, EngineOptions, LoadOptions, PipelineOptions
from yue2_vllm.protocol import GenerationConfig


@pytest.mark.parametrize("group,fields,message", [
    (AROptions, {"backend": "tensorrt"}, "AROptions.backend must be one of ('torch', 'vllm', 'auto'), got 'tensorrt'"),
    (AROptions, {"dtype": "float16"}, "AROptions.dtype must be one of ('bfloat16', 'float32'), got 'float16'"),
    (AROptions, {"quantization": "int4"},
     "AROptions.quantization must be one of ('none', 'auto', 'int8', 'fp8'), got 'int4'"),
    (AROptions, {"quantized_policy": "always"},
     "AROptions.quantized_policy must be one of ('auto', 'force'), got 'always'"),
    (AROptions, {"cfg_engine": "both"}, "AROptions.cfg_engine must be one of ('vllm', 'torch'), got 'both'"),
    (AROptions, {"torch_execution": "compiled"},
     "AROptions.torch_execution must be one of ('auto', 'graph', 'eager', 'batched'), got 'compiled'"),
    (AROptions, {"backend": ["vllm"]}, "AROptions.backend must be one of ('torch', 'vllm', 'auto'), got ['vllm']"),
    (AROptions, {"reproducible": 1}, "AROptions.reproducible must be True or False, got 1"),
    (EngineOptions, {"kv_cache_dtype": "fp4"},
     "EngineOptions.kv_cache_dtype must be one of ('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'), got 'fp4'"),
    (EngineOptions, {"max_num_seqs": 0}, "EngineOptions.max_num_seqs must be an integer >= 1 or None, got 0"),
    (EngineOptions, {"max_num_seqs": True}, "EngineOptions.max_num_seqs must be an integer >= 1 or None, got True"),
    (EngineOptions, {"max_num_seqs": 8.0}, "EngineOptions.max_num_seqs must be an integer >= 1 or None, got 8.0"),
    (EngineOptions, {"max_num_batched_tokens": -64},
     "EngineOptions.max_num_batched_tokens must be an integer >= 1 or None, got -64"),
    (EngineOptions, {"sliced_head": "no"}, "EngineOptions.sliced_head must be True or False, got 'no'"),
    (EngineOptions, {"runner": "v3"}, "EngineOptions.runner must be one of ('auto', 'v1', 'v2'), got 'v3'"),
    (EngineOptions, {"start_timeout_s": 0}, "EngineOptions.start_timeout_s must be a positive number or None, got 0"),
    (EngineOptions, {"start_timeout_s": math.inf},
     "EngineOptions.start_timeout_s must be a positive number or None, got inf"),
    (EngineOptions, {"start_timeout_s": math.nan},
     "EngineOptions.start_timeout_s must be a positive number or None, got nan"),
    (EngineOptions, {"start_timeout_s": "60"},
     "EngineOptions.start_timeout_s must be a positive number or None, got '60'"),
    (EngineOptions, {"start": None}, "EngineOptions.start must be True or False, got None"),
    (EngineOptions, {"keep": "yes"}, "EngineOptions.keep must be True, False or None, got 'yes'"),
    (EngineOptions, {"tuning": [("max_restarts", 2)]},
     "EngineOptions.tuning must be a mapping of EngineSettings keywords, got [('max_restarts', 2)]"),
    (EngineOptions, {"tuning": {3: 1}},
     "EngineOptions.tuning must be a mapping of EngineSettings keywords, got {3: 1}"),
    (EngineOptions, {"tuning": {"max_num_seqs": 4}},
     "EngineOptions.tuning['max_num_seqs']: set EngineOptions.max_num_seqs instead"),
    (EngineOptions, {"tuning": {"bogus": 1}},
     "EngineOptions.tuning['bogus']: not an engine setting tuning takes (one of max_model_len, kv_cache_bytes, "
     "enforce_eager, progress_timeout_s, max_restarts, restart_window_s, synthesis_batch, threads, kv_admission, "
     "meminfo_path)"),
    (EngineOptions, {"tuning": {"dtype": "float32"}},
     "EngineOptions.tuning['dtype']: the pipeline works it out from AROptions.dtype; set that instead"),
    (EngineOptions, {"tuning": {"checkpoint": "/ar"}},
     "EngineOptions.tuning['checkpoint']: the pipeline works it out from LoadOptions.ar_checkpoint; set that instead"),
    (EngineOptions, {"tuning": {"memory_budget_gib": 8}},
     "EngineOptions.tuning['memory_budget_gib']: the pipeline works it out from DeviceOptions.budget_gib; set that "
     "instead"),
    (DeviceOptions, {"device": ""},
     "DeviceOptions.device must be a device name (auto, cpu, cuda, cuda:N or mps), got ''"),
    (DeviceOptions, {"device": 0},
     "DeviceOptions.device must be a device name (auto, cpu, cuda, cuda:N or mps), got 0"),
    (DeviceOptions, {"budget_gib": 0}, "DeviceOptions.budget_gib must be a positive number or None, got 0"),
    (DeviceOptions, {"budget_gib": -8.0}, "DeviceOptions.budget_gib must be a positive number or None, got -8.0"),
    (DeviceOptions, {"budget_gib": math.nan}, "DeviceOptions.budget_gib must be a positive number or None, got nan"),
    (DeviceOptions, {"offload_ar": "on"}, "DeviceOptions.offload_ar must be True or False, got 'on'"),
    (DeviceOptions, {"vae_core_frames": 0}, "DeviceOptions.vae_core_frames must be an integer >= 1 or None, got 0"),
    (DeviceOptions, {"vae_core_frames": 512.5},
     "DeviceOptions.vae_core_frames must be an integer >= 1 or None, got 512.5"),
    (LoadOptions, {"ar_checkpoint": 3}, "LoadOptions.ar_checkpoint must be a directory or None, got 3"),
    (LoadOptions, {"ar_checkpoint": ""}, "LoadOptions.ar_checkpoint must be a directory or None, got ''"),
    (LoadOptions, {"verify_hashes": None}, "LoadOptions.verify_hashes must be True or False, got None"),
    (LoadOptions, {"hash_cache": "hashes.json"},
     "LoadOptions.hash_cache must be a checkpoint.HashCache or None, got 'hashes.json'"),
])
def test_each_group_names_the_bad_field(group, fields, message):
    with pytest.raises(ValueError) as info:
        group(**fields)
    assert str(info.value) == message


@pytest.mark.parametrize("part,value,message", [
    ("ar", {"backend": "vllm"}, "ar must be of type AROptions, got dict"),
    ("engine", AROptions(), "engine must be of type EngineOptions, got AROptions"),
    ("device", "cuda", "device must be of type DeviceOptions, got str"),
    ("load", None, "load must be of type LoadOptions, got NoneType"),
    ("generation", {"ode_steps": 2}, "generation must be of type GenerationConfig, got dict"),
])
def test_the_bundle_takes_each_group_by_its_type(part, value, message):
    with pytest.raises(TypeError) as info:
        PipelineOptions(**{part: value})
    assert str(info.value) == message


def test_the_options_are_frozen_values():
    tuning = {"max_restarts": 2}
    engine = EngineOptions(max_num_seqs=8, tuning=tuning)
    tuning["max_restarts"] = 0  # the caller's dict changing later changes nothing
    assert engine.tuning == {"max_restarts": 2}
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.max_num_seqs = 4
    assert AROptions(backend="vllm") == AROptions(backend="vllm") != AROptions()
    assert LoadOptions(hash_cache=HashCache(None)) == LoadOptions()  # the cache object is no part of the value
    assert LoadOptions(ar_checkpoint="/ckpt", verify_hashes=True).ar_checkpoint == "/ckpt"


def test_engine_settings_are_what_was_set_plus_tuning():
    """What reaches EngineSettings: the named fields that are set (None leaves vLLM's default or the plan's size),
    then the tuning keywords."""
    assert EngineOptions().settings() == {"sliced_head": True, "runner": "auto"}
    options = EngineOptions(kv_cache_dtype="fp8", max_num_seqs=8, max_num_batched_tokens=256, sliced_head=False,
                            runner="v1", start_timeout_s=90.0, start=True, keep=False,
                            tuning={"max_restarts": 2, "kv_admission": False})
    assert options.settings() == {"max_num_seqs": 8, "max_num_batched_tokens": 256, "sliced_head": False,
                                  "runner": "v1", "start_timeout_s": 90.0, "max_restarts": 2, "kv_admission": False}


def test_tuning_takes_the_engine_settings_no_other_option_sets():
    """Every EngineSettings keyword is one of: an EngineOptions field, a tuning keyword (ENGINE_TUNING), or worked
    out from another option (ENGINE_DERIVED, refused in tuning naming that option). The options module may not
    import engine/, so its tables are checked here against EngineSettings itself."""
    from yue2_vllm.engine.backend import EngineSettings
    from yue2_vllm.options import _ENGINE_SETTINGS, ENGINE_DERIVED, ENGINE_TUNING

    named = {*_ENGINE_SETTINGS, "kv_cache_dtype"}
    tables = [named, set(ENGINE_TUNING), set(ENGINE_DERIVED)]
    assert sum(map(len, tables)) == len(set().union(*tables))  # each keyword in one table
    assert set().union(*tables) == {f.name for f in dataclasses.fields(EngineSettings)}
    assert named <= {f.name for f in dataclasses.fields(EngineOptions)}
    assert EngineOptions(tuning={key: 1 for key in ENGINE_TUNING}).tuning == {key: 1 for key in ENGINE_TUNING}
    for key, option in ENGINE_DERIVED.items():
        with pytest.raises(ValueError, match=rf"^EngineOptions.tuning\['{key}'\]: the pipeline works it out from "):
            EngineOptions(tuning={key: 1})
        assert option.startswith(("LoadOptions.", "AROptions.", "DeviceOptions.", "AdapterOptions.", "the "))


def test_engine_options_entries_land_on_their_fields_and_are_named_when_bad():
    """The earlier release's `engine_options` dict: its named keys are EngineOptions' fields, `dtype` and
    `offload_ar` the fields vLLM's and upstream's flat keywords of those names set; a bad value or key is refused
    naming its entry."""
    from yue2_vllm.options import pipeline_options

    options = pipeline_options(engine_options={"dtype": "float32", "offload_ar": True, "max_num_seqs": 2,
                                               "max_restarts": 1})
    assert (options.ar.dtype, options.device.offload_ar) == ("float32", True)
    assert options.engine == EngineOptions(max_num_seqs=2, tuning={"max_restarts": 1})
    for entries, message in (
            ({"max_num_seqs": 0}, "engine_options['max_num_seqs'] must be an integer >= 1 or None, got 0"),
            ({"kv_cache_dtype": "fp4"},
             "engine_options['kv_cache_dtype'] must be one of ('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'), got 'fp4'"),
            ({"dtype": "float16"}, "engine_options['dtype'] must be one of ('bfloat16', 'float32'), got 'float16'"),
            ({"bogus": 1}, "engine_options['bogus']: not an engine setting tuning takes (one of max_model_len, "),
            ({"memory_budget_gib": 8}, "engine_options['memory_budget_gib']: the pipeline works it out from "
                                       "DeviceOptions.budget_gib; set that instead")):
        with pytest.raises(ValueError) as caught:
            pipeline_options(engine_options=entries)
        assert str(caught.value).startswith(message), str(caught.value)
    for keywords, message in (
            ({"engine_options": {"dtype": "float32"}, "dtype": "bfloat16"},
             "YuE2Pipeline() got 'engine_options' and 'dtype', which both set AROptions.dtype; give one of them"),
            ({"engine_options": {"offload_ar": True}, "device": DeviceOptions()},
             "YuE2Pipeline() got engine_options['offload_ar'] both as a keyword and in device= (DeviceOptions); give "
             "it in one place")):
        with pytest.raises(TypeError) as caught:
            pipeline_options(**keywords)
        assert str(caught.value) == message


def test_a_torch_device_is_its_name():
    """Upstream takes `device=torch.device("cuda:1")`: the options keep its name."""
    import torch

    from yue2_vllm.options import pipeline_options

    assert DeviceOptions(torch.device("cuda:1")) == DeviceOptions("cuda:1")
    assert pipeline_options(device=torch.device("cpu")).device == DeviceOptions("cpu")


def test_the_defaults_are_the_clis():
    assert AROptions() == AROptions("torch", "bfloat16", "none", "auto", "vllm", "auto", False)
    assert EngineOptions() == EngineOptions("auto", None, None, True, "auto", None, False, None, {})
    assert DeviceOptions() == DeviceOptions("auto", None, False, None)
    assert LoadOptions() == LoadOptions(None, False)
    assert PipelineOptions().generation == GenerationConfig()


def test_importing_the_options_loads_neither_torch_nor_vllm():
    import subprocess
    import sys

    code = ("import sys\nimport yue2_vllm.options\n"
            "bad = [m for m in ('torch', 'vllm') if m in sys.modules]\nassert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


def test_the_pipeline_keeps_its_options_with_the_defaults_filled_in(tiny_model_dir, tiny_vae_dir, tmp_path,
                                                                    monkeypatch):
    from yue2_vllm.memory import default_budget_gib
    from yue2_vllm.pipeline import YuE2Pipeline, default_vae_core_frames

    monkeypatch.setenv("YUE2_AR_CHECKPOINT", str(tmp_path / "ar"))
    budget = default_budget_gib(None)  # the CPU's: 24, or the machine's memory less 10 % where that is less
    generation = {"abc": {"max_tokens": 4, "min_tokens": 2}, "semantic": {"max_tokens": 6, "min_tokens": 2}}
    engine = EngineOptions(max_num_seqs=2, tuning={"max_restarts": 1})
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=generation, engine=engine,
                      load=LoadOptions(hash_cache=HashCache(tmp_path / "h.json")),
                      device=DeviceOptions(device="cpu", offload_ar=True)) as pipe:
        assert pipe.options == PipelineOptions(GenerationConfig.from_dict(generation),
                                               LoadOptions(ar_checkpoint=str(tmp_path / "ar")), AROptions(), engine,
                                               DeviceOptions("cpu", budget, True, default_vae_core_frames(budget)))
        assert pipe.engine_life.inputs.options is pipe.options  # the engine reads the same objects
        assert pipe.generation_config is pipe.options.generation and pipe.backend_requested == "torch"


def test_the_pipeline_refuses_conflicting_unknown_and_untyped_keywords_before_anything_loads(tiny_model_dir,
                                                                                             tiny_vae_dir, monkeypatch):
    from yue2_vllm.pipeline import YuE2Pipeline

    def no_load(*args, **kwargs):
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr("yue2_vllm.song.models.LoadedModels.__init__", no_load)
    for keywords, error, message in (
            ({"backend": "vllm", "ar": AROptions()}, TypeError,
             "YuE2Pipeline() got 'backend' both as a keyword and in ar= (AROptions); give it in one place"),
            ({"device": DeviceOptions(device="cpu"), "memory_budget_gib": 24}, TypeError,
             "YuE2Pipeline() got 'memory_budget_gib' both as a keyword and in device= (DeviceOptions); give it in one "
             "place"),
            ({"backend": "torch-eager", "torch_execution": "batched"}, TypeError,
             "YuE2Pipeline() got 'backend' and 'torch_execution', which both set AROptions.torch_execution; give one "
             "of them"),
            ({"engine_options": {"max_num_seqs": 2}, "max_num_seqs": 4}, TypeError,
             "YuE2Pipeline() got 'engine_options' and 'max_num_seqs', which both set EngineOptions.max_num_seqs; "
             "give one of them"),
            ({"gpu_memory_utilization": 0.9}, TypeError,
             "YuE2Pipeline() got an unexpected keyword argument 'gpu_memory_utilization'"),
            ({"options": PipelineOptions(), "backend": "vllm"}, TypeError,
             "YuE2Pipeline() got 'backend' beside options=, which holds every option; give one of them"),
            ({"ar": {"backend": "vllm"}}, TypeError, "ar must be of type AROptions, got dict"),
            ({"progress": "yes"}, TypeError, "progress must be True or False, got 'yes'"),
            ({"backend": "tensorrt"}, ValueError,
             "backend must be one of ('torch', 'torch-eager', 'vllm', 'auto'), got 'tensorrt'"),
            ({"memory_budget_gib": -1}, ValueError, "memory_budget_gib must be a positive number or None, got -1"),
            ({"quantization": "int4"}, ValueError,
             "quantization must be one of ('none', 'auto', 'int8', 'fp8'), got 'int4'"),
            ({"kv_cache_dtype": "fp4"}, ValueError,
             "kv_cache_dtype must be one of ('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'), got 'fp4'"),
            ({"device": "tpu"}, ValueError, "device 'tpu': not a device (use auto, cpu, cuda, cuda:N or mps)"),
            ({"device": DeviceOptions(device="tpu")}, ValueError,
             "device 'tpu': not a device (use auto, cpu, cuda, cuda:N or mps)"),
            ({"backend": "torch", "kv_cache_dtype": "fp8"}, ValueError,
             "EngineOptions.kv_cache_dtype fp8 sets the vLLM engine's KV cache, and the torch backend keeps its K/V "
             "in the model dtype")):
        with pytest.raises(error) as caught:
            YuE2Pipeline(tiny_model_dir, tiny_vae_dir, **keywords)
        assert str(caught.value).startswith(message), (keywords, str(caught.value))
        assert "\n" not in str(caught.value)


def test_flat_keywords_set_their_groups_fields():
    """Upstream's constructor keywords, vLLM's LLM keywords and the earlier release's flat keywords land on the
    fields of the typed groups; the groups left out keep their defaults."""
    from yue2_vllm.options import FLAT_KEYWORDS, pipeline_options

    cache = HashCache(None)
    upstream = pipeline_options(None, device="cpu", memory_budget_gib=24, backend="torch-eager", verify_hashes=True,
                                vae_core_frames=512, quantization="fp8", offload_ar=True)
    assert upstream == PipelineOptions(
        GenerationConfig(), LoadOptions(verify_hashes=True), AROptions(backend="torch", torch_execution="eager",
                                                                        quantization="fp8"),
        EngineOptions(), DeviceOptions("cpu", 24, True, 512))
    assert pipeline_options(backend="vllm").ar == AROptions(backend="vllm")
    assert pipeline_options(offload_nar=True).device.offload_ar is True  # upstream: offload_ar or offload_nar
    assert pipeline_options(offload_nar=False, offload_ar=False).device.offload_ar is False
    assert pipeline_options(offload_nar=True, offload_ar=False).device.offload_ar is True
    vllm = pipeline_options(kv_cache_dtype="fp8", max_num_seqs=4, max_num_batched_tokens=256, dtype="float32",
                            enforce_eager=True, max_model_len=8192, max_loras=2, max_lora_rank=16,
                            sliced_head=False)
    assert vllm.engine == EngineOptions(kv_cache_dtype="fp8", max_num_seqs=4, max_num_batched_tokens=256,
                                        sliced_head=False, tuning={"enforce_eager": True, "max_model_len": 8192})
    assert vllm.ar.dtype == "float32" and (vllm.adapters.max_loras, vllm.adapters.max_lora_rank) == (2, 16)
    earlier = pipeline_options({"ode_steps": 2}, hash_cache=cache, ar_checkpoint="/ckpt", keep_engine=False,
                               start_engine=True, cfg_engine="torch", quantized_policy="force", reproducible=True,
                               torch_execution="batched",
                               engine_options={"max_num_seqs": 3, "kv_cache_dtype": "fp8", "max_restarts": 1})
    assert earlier.generation == GenerationConfig(ode_steps=2)
    assert earlier.load == LoadOptions(ar_checkpoint="/ckpt") and earlier.load.hash_cache is cache
    assert earlier.ar == AROptions(cfg_engine="torch", quantized_policy="force", torch_execution="batched",
                                   reproducible=True)
    assert earlier.engine == EngineOptions(kv_cache_dtype="fp8", max_num_seqs=3, start=True, keep=False,
                                           tuning={"max_restarts": 1})
    groups = pipeline_options(ar=AROptions(backend="auto"), device=DeviceOptions(budget_gib=8.0), max_num_seqs=2)
    assert (groups.ar.backend, groups.device.budget_gib, groups.engine.max_num_seqs) == ("auto", 8.0, 2)
    assert {group for group, _ in FLAT_KEYWORDS.values()} == {"load", "ar", "engine", "device", "adapters"}


def test_adapter_options_refuse_in_one_line():
    from yue2_vllm.options import AdapterOptions

    assert AdapterOptions((["a", "x.safetensors"],)).modules == (("a", "x.safetensors"),)
    for fields, message in (({"modules": "a=x"}, "AdapterOptions.modules must be (name, path) pairs"),
                            ({"modules": (("a", "x"), ("a", "y"))}, "pairs with distinct names"),
                            ({"max_loras": 0}, "AdapterOptions.max_loras must be an integer >= 1 or None"),
                            ({"max_lora_rank": 2.5}, "AdapterOptions.max_lora_rank must be an integer >= 1"),
                            ({"modules": (("a", "x"),), "instrumental": "b"},
                             "AdapterOptions.instrumental must be one of the registered names ['a']")):
        with pytest.raises(ValueError) as caught:
            AdapterOptions(**fields)
        assert message in str(caught.value)
    assert PipelineOptions().adapters == AdapterOptions()
