import json

import numpy as np
import pytest
import soundfile
import torch

from yue2_vllm.artifacts import ResumeError, verify_result
from yue2_vllm.checkpoint import HashCache
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.protocol import CODEC_SIZE, SongRequest
from yue2_vllm.options import AROptions, DeviceOptions, EngineOptions, LoadOptions

GENERATION = {"abc": {"max_tokens": 10, "min_tokens": 4}, "semantic": {"max_tokens": 30, "min_tokens": 10},
              "ode_steps": 4}
REQUEST = SongRequest("piano pop", "[verse]\nla la la\n", seed=11, id="song1")


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_vae_dir, tmp_path_factory):
    cache = HashCache(tmp_path_factory.mktemp("hashes") / "cache.json")
    return YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                        load=LoadOptions(hash_cache=cache))


def test_song_end_to_end(pipe):
    result = pipe(REQUEST)
    frames = len(result.semantic.tokens)
    assert frames == 30 and all(0 <= t < CODEC_SIZE for t in result.semantic.tokens)
    assert result.latents.shape == (frames, 64) and result.latents.dtype == np.float32
    assert result.audio.shape == (1920 * frames - 64, 2) and np.abs(result.audio).max() <= 1
    assert result.truncated == {"abc": True, "semantic": True}
    assert result.plan.prefix[-1] == 151851 and len(result.plan.abc_ids) == 10
    assert result.config["overrides"] == ["abc.max_tokens", "abc.min_tokens", "semantic.max_tokens",
                                          "semantic.min_tokens", "ode_steps"]
    again = pipe(REQUEST)
    assert again.semantic.tokens == result.semantic.tokens and np.array_equal(again.audio, result.audio)
    assert again.identity == result.identity


def test_cot_off_uses_paired_cfg_and_external_abc_skips_planning(pipe):
    off = pipe(SongRequest("rock", "yeah", cot="off", id="off"))
    assert off.plan.abc is None and off.semantic.timing["cfg_branches"] == 2 and off.config["cfg_scale"] == 1.01
    external = pipe(SongRequest("rock", "yeah", cot="melody", abc="X:1\nK:C\nCDEF|", id="ext"))
    assert external.plan.timing["output_tokens"] == 0 and external.plan.abc == "X:1\nK:C\nCDEF|"


def test_artifacts_and_flac(pipe, tmp_path):
    document = pipe.generate_to(tmp_path / "s", REQUEST)
    assert document["status"] == "complete" and document["sample_rate"] == 48000
    info = soundfile.info(str(tmp_path / "s" / "audio.flac"))
    assert (info.samplerate, info.channels, info.frames, info.subtype) == (48000, 2, 1920 * 30 - 64, "PCM_24")
    names = set(document["artifacts"])
    assert {"audio.flac", "score.abc", "prefix.npy", "abc_tokens.npy", "semantic.npy", "latent.npy", "request.json",
            "config.json"} <= names
    assert verify_result(tmp_path / "s", document["identity"]) == document
    assert json.loads((tmp_path / "s" / "request.json").read_text()) == REQUEST.to_dict()
    direct = pipe(REQUEST)
    assert np.array_equal(np.load(tmp_path / "s" / "semantic.npy"), np.asarray(direct.semantic.tokens))
    assert np.array_equal(np.load(tmp_path / "s" / "latent.npy"), direct.latents)


class Crash(RuntimeError):
    pass


def crash_in(stage):
    def on_token(phase, token):
        if phase == stage:
            raise Crash(stage)

    def on_progress(name, done, total):
        if name == stage:
            raise Crash(stage)

    return on_token, on_progress


def recorder(seen):
    return (lambda phase, token: seen.add(phase)), (lambda name, done, total: seen.add(name))


@pytest.mark.parametrize("stage,redone,state,kept", [
    ("abc", {"abc", "semantic", "nar", "vae"}, "plan_failed", []),
    ("semantic", {"semantic", "nar", "vae"}, "semantic_failed", ["plan"]),
    ("nar", {"nar", "vae"}, "synthesis_failed", ["plan", "semantic"]),
    ("vae", {"vae"}, "decode_failed", ["plan", "semantic", "synthesis"])])
def test_resume_after_crash_redoes_only_later_stages(pipe, tmp_path, stage, redone, state, kept):
    on_token, on_progress = crash_in(stage)
    with pytest.raises(Crash):
        pipe.generate_to(tmp_path / "s", REQUEST, on_token=on_token, on_progress=on_progress)
    recorded = json.loads((tmp_path / "s" / "run_state.json").read_text())
    assert recorded["state"] == state and "Crash" in recorded["error"]
    with pytest.raises(FileExistsError):
        pipe.generate_to(tmp_path / "s", REQUEST)
    seen = set()
    document = pipe.generate_to(tmp_path / "s", REQUEST, resume=True, on_token=recorder(seen)[0],
                                on_progress=recorder(seen)[1])
    assert seen == redone
    reference = pipe.generate_to(tmp_path / "ref", REQUEST)
    assert document["artifacts"]["audio.flac"] == reference["artifacts"]["audio.flac"]
    assert document["identity"] == reference["identity"]
    # upstream's meaning: resumed only when the finished result is reused untouched; the kept stages apart
    assert (document["resumed"], document["stages_reused"]) == (False, kept)
    assert (reference["resumed"], reference["stages_reused"]) == (False, [])
    recorded = json.loads((tmp_path / "s" / "result.json").read_text())
    assert (recorded["resumed"], recorded["stages_reused"]) == (False, kept)


def test_tampered_artifact_is_detected_and_redone(pipe, tmp_path):
    document = pipe.generate_to(tmp_path / "s", REQUEST)
    assert (document["resumed"], document["stages_reused"]) == (False, [])
    reused = pipe.generate_to(tmp_path / "s", REQUEST, resume=True)  # a finished result reused
    assert reused == {**document, "resumed": True, "stages_reused": ["plan", "semantic", "synthesis", "audio"]} \
        == json.loads((tmp_path / "s" / "result.json").read_text())
    semantic = tmp_path / "s" / "semantic.npy"
    tokens = np.load(semantic)
    tokens[0] = (tokens[0] + 1) % CODEC_SIZE
    np.save(semantic, tokens)
    with pytest.raises(ValueError, match="semantic.npy: does not match"):
        verify_result(tmp_path / "s")
    seen = set()
    redone = pipe.generate_to(tmp_path / "s", REQUEST, resume=True, on_token=recorder(seen)[0],
                              on_progress=recorder(seen)[1])
    assert seen == {"semantic", "nar", "vae"}
    assert (redone["resumed"], redone["stages_reused"]) == (False, ["plan"])
    assert redone["artifacts"]["semantic.npy"] == document["artifacts"]["semantic.npy"]
    seen.clear()
    assert pipe.generate_to(tmp_path / "s", REQUEST, resume=True, on_token=recorder(seen)[0]) == \
        {**redone, "resumed": True, "stages_reused": ["plan", "semantic", "synthesis", "audio"]}
    assert seen == set()


def test_changed_request_refuses_to_resume(pipe, tmp_path):
    on_token, _ = crash_in("semantic")
    with pytest.raises(Crash):
        pipe.generate_to(tmp_path / "s", REQUEST, on_token=on_token)
    with pytest.raises(ResumeError, match="different request"):
        pipe.generate_to(tmp_path / "s", SongRequest("jazz", "other", seed=11, id="song1"), resume=True)


def test_cancel_leaves_resumable_state(pipe, tmp_path):
    tokens = []
    with pytest.raises(InterruptedError):
        pipe.generate_to(tmp_path / "s", REQUEST, on_token=lambda p, t: tokens.append(p),
                         cancelled=lambda: tokens.count("semantic") >= 5)
    assert tokens.count("semantic") == 5
    assert json.loads((tmp_path / "s" / "run_state.json").read_text())["state"] == "cancelled"
    document = pipe.generate_to(tmp_path / "s", REQUEST, resume=True)
    assert document["status"] == "complete"


def test_plan_stage_only(pipe, tmp_path):
    plan = pipe.generate_to(tmp_path / "s", REQUEST, stage="plan")
    assert plan["status"] == "planned" and (tmp_path / "s" / "score.abc").exists()
    assert not (tmp_path / "s" / "semantic.npy").exists()
    assert pipe.generate_to(tmp_path / "s", REQUEST, resume=True)["status"] == "complete"


def test_torch_execution_is_recorded_per_phase_and_batched_gives_the_same_song(tiny_model_dir, tiny_vae_dir,
                                                                              tmp_path):
    with pytest.raises(ValueError, match="--torch-execution graph needs a CUDA device; the model is on cpu"):
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, load=LoadOptions(hash_cache=HashCache(tmp_path / "c")),
                     ar=AROptions(torch_execution="graph"))
    songs = {}
    for execution in ("auto", "batched"):
        pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                            load=LoadOptions(hash_cache=HashCache(tmp_path / "cache.json")),
                            ar=AROptions(dtype="float32", torch_execution=execution))
        plan = pipe.plan(REQUEST)
        songs[execution] = (plan, pipe.generate_semantic(plan))
    (plan, semantic), (batched_plan, batched) = songs["auto"], songs["batched"]
    assert batched_plan.abc_ids == plan.abc_ids and batched.tokens == semantic.tokens
    for timing in (plan.timing, semantic.timing):
        assert timing["execution"] == "eager" and timing["attention"] == "sdpa"
        assert timing["graph_fallback_reason"].startswith("non_cuda_device:")
    for timing in (batched_plan.timing, batched.timing):
        assert timing["execution"] == "batched" and timing["attention"] == "sdpa_masked"
        assert timing["kv_bytes"] > 0 and timing["capture_seconds"] == 0.0


def test_weight_identity_is_cached(tiny_model_dir, tiny_vae_dir, tmp_path):
    cache = HashCache(tmp_path / "c.json")
    from yue2_vllm.checkpoint import model_identity

    first = model_identity(tiny_model_dir, hashes=cache)
    entries = json.loads((tmp_path / "c.json").read_text())
    assert len(entries) == 1 and first["files"]["model.safetensors"]["bytes"] > 10**7
    key = next(iter(entries))
    entries[key]["sha256"] = "0" * 64  # a cache hit is trusted without re-hashing...
    (tmp_path / "c.json").write_text(json.dumps(entries))
    assert model_identity(tiny_model_dir, hashes=cache)["files"]["model.safetensors"]["sha256"] == "0" * 64
    from yue2_vllm.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="changed in place"):  # ...and verify re-hashes
        model_identity(tiny_model_dir, hashes=cache, verify=True)


def test_int8_proxies_serve_ar_and_are_restored_before_nar(tiny_model_dir, tiny_vae_dir, tmp_path):
    import torch

    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                        load=LoadOptions(hash_cache=HashCache(tmp_path / "c.json")),
                        ar=AROptions(quantization="int8"))
    bf16 = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                        load=LoadOptions(hash_cache=HashCache(tmp_path / "c.json")))
    song = pipe(REQUEST)
    assert song.config["quantization"] == "int8" and song.config["quantization_status"]["active_ar_linears"] == 14
    reference = {k: v for k, v in bf16.model.state_dict().items()}
    restored = pipe.model.state_dict()
    assert list(restored) == list(reference) and all(torch.equal(restored[k], reference[k]) for k in reference)
    plan = pipe.plan(REQUEST)  # the next song's AR phases run on the proxies again
    assert pipe.model.quantization_status["mode"] == "int8" and len(plan.abc_ids) == 10
    assert song.identity != bf16(REQUEST).identity


def test_song_from_an_int8_ar_checkpoint(tiny_model_dir, tiny_vae_dir, tmp_path):
    from yue2_vllm.model.torch_quant import export_int8_ar

    export_int8_ar(tiny_model_dir, tmp_path / "int8ar")
    pipe = YuE2Pipeline(tmp_path / "int8ar", tiny_vae_dir, generation_config=GENERATION,
                        load=LoadOptions(hash_cache=HashCache(tmp_path / "c.json")),
                        ar=AROptions(quantization="auto"))
    song = pipe(REQUEST)
    assert song.config["quantization_status"]["source"] == "checkpoint"
    assert song.audio.shape == (1920 * 30 - 64, 2) and np.isfinite(song.audio).all()
    with pytest.raises(ValueError, match="yue2-int8-ar"):
        YuE2Pipeline(tmp_path / "int8ar", tiny_vae_dir, load=LoadOptions(hash_cache=HashCache(tmp_path / "c.json")),
                     ar=AROptions(quantization="none"))


def test_float_or_bool_ids_are_rejected_by_the_stages(pipe):
    """1.0 == 1 in Python: a hand-built plan or semantic result with float ids must not slip through."""
    from dataclasses import replace

    from yue2_vllm.pipeline import SemanticResult

    plan = pipe.plan(SongRequest("rock", "yeah", cot="off", id="off"))
    with pytest.raises(ValueError, match=r"plan.prefix\[0\] = 151643.0"):
        pipe.generate_semantic(replace(plan, prefix=[float(t) for t in plan.prefix]))
    with pytest.raises(ValueError, match=r"semantic.tokens\[1\] = True"):
        pipe.synthesize(SemanticResult(plan, [3, True, 5]))
    with pytest.raises(ValueError, match=r"semantic.tokens\[0\] = 2.0"):
        pipe.synthesize(SemanticResult(plan, [2.0]))


def _edit_json(path, change):
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


@pytest.mark.parametrize("damage,redone", [
    # a stage claimed complete without file hashes (and its file gone)
    (lambda d: (_edit_json(d / "plan.stage.json", lambda r: r.update(files={})), (d / "prefix.npy").unlink()),
     {"abc", "semantic", "nar", "vae"}),
    (lambda d: _edit_json(d / "semantic.stage.json", lambda r: r.update(files=["semantic.npy"])),
     {"semantic", "nar", "vae"}),
    (lambda d: _edit_json(d / "synthesis.stage.json", lambda r: r.pop("meta")), {"nar", "vae"}),
    (lambda d: _edit_json(d / "run_state.json", lambda r: r.pop("identity")), set()),
    (lambda d: (d / "run_state.json").write_text("null"), set()),
])
def test_resume_over_an_inconsistent_manifest_redoes_the_affected_stages(pipe, tmp_path, damage, redone):
    on_token, on_progress = crash_in("vae")
    with pytest.raises(Crash):
        pipe.generate_to(tmp_path / "s", REQUEST, on_token=on_token, on_progress=on_progress)
    damage(tmp_path / "s")
    seen = set()
    document = pipe.generate_to(tmp_path / "s", REQUEST, resume=True, on_token=recorder(seen)[0],
                                on_progress=recorder(seen)[1])
    assert seen == redone | {"vae"}
    assert verify_result(tmp_path / "s", document["identity"]) == document


@pytest.mark.parametrize("state", [
    # upstream's case: a run state for another identity that claims stages no record backs
    {"schema_version": 1, "identity": "bogus", "state": "synthesized", "request": {}},
    {"schema_version": 1, "identity": "bogus", "state": "complete", "request": {}},
    {"schema_version": 1, "identity": "bogus", "state": "not_a_real_state", "request": {}},
    {"schema_version": 7, "identity": "bogus", "state": "created", "request": {}},
])
def test_an_inconsistent_manifest_is_discarded_and_every_stage_redone(pipe, tmp_path, state, caplog):
    directory = tmp_path / "s"
    directory.mkdir()
    (directory / "run_state.json").write_text(json.dumps(state), encoding="utf-8")
    seen = set()
    with caplog.at_level("WARNING", logger="yue2_vllm"):
        document = pipe.generate_to(directory, REQUEST, resume=True, on_token=recorder(seen)[0],
                                    on_progress=recorder(seen)[1])
    assert seen == {"abc", "semantic", "nar", "vae"}
    assert (document["status"], document["resumed"], document["stages_reused"]) == ("complete", False, [])
    assert json.loads((directory / "run_state.json").read_text(encoding="utf-8"))["state"] == "complete"
    assert [r.getMessage() for r in caplog.records if "inconsistent" in r.getMessage()] == [
        f"{directory}: run_state.json is inconsistent ({problem}); discarding it and redoing every stage"
        for problem in [{"synthesized": "state 'synthesized' claims the plan stage, which has no record of this run",
                         "complete": "state 'complete' claims the plan stage, which has no record of this run",
                         "not_a_real_state": "unknown state 'not_a_real_state'",
                         "created": "schema_version 7, expected 1"}[state["state"]]]]


def test_stage_records_of_another_run_do_not_back_a_claimed_state(pipe, tmp_path):
    """A consistent run state of another request is refused; one whose stages are another run's is discarded."""
    on_token, _ = crash_in("semantic")
    with pytest.raises(Crash):
        pipe.generate_to(tmp_path / "s", REQUEST, on_token=on_token)
    other = SongRequest("jazz", "other", seed=11, id="song1")
    with pytest.raises(ResumeError, match="different request"):  # semantic_failed: its plan record is there
        pipe.generate_to(tmp_path / "s", other, resume=True)
    _edit_json(tmp_path / "s" / "run_state.json", lambda r: r.update(identity="bogus"))
    seen = set()
    document = pipe.generate_to(tmp_path / "s", other, resume=True, on_token=recorder(seen)[0])
    assert seen == {"abc", "semantic"} and document["stages_reused"] == []


def test_a_run_killed_while_redoing_a_stage_leaves_a_consistent_manifest(pipe, tmp_path):
    """The run state stops claiming a stage before its record is removed, so a kill -9 there loses no stage."""
    from yue2_vllm.artifacts import RunDirectory

    on_token, on_progress = crash_in("vae")
    with pytest.raises(Crash):
        pipe.generate_to(tmp_path / "s", REQUEST, on_token=on_token, on_progress=on_progress)
    (tmp_path / "s" / "latent.npy").write_bytes(b"damaged")
    states = []

    def killed(name, done, total):  # the state as the redone synthesis stage sees it, then "kill -9"
        states.append(json.loads((tmp_path / "s" / "run_state.json").read_text(encoding="utf-8"))["state"])
        raise SystemExit("killed")

    with pytest.raises(SystemExit):
        pipe.generate_to(tmp_path / "s", REQUEST, resume=True, on_progress=killed)
    assert states == ["semantic_generated"]
    _edit_json(tmp_path / "s" / "run_state.json", lambda r: r.update(state=states[0]))  # as the kill left it
    assert RunDirectory(tmp_path / "s").manifest_problem(json.loads(
        (tmp_path / "s" / "run_state.json").read_text(encoding="utf-8"))) is None
    seen = set()
    document = pipe.generate_to(tmp_path / "s", REQUEST, resume=True, on_token=recorder(seen)[0],
                                on_progress=recorder(seen)[1])
    assert seen == {"nar", "vae"} and document["stages_reused"] == ["plan", "semantic"]


def test_result_without_hashes_or_with_a_symlink_is_not_trusted(pipe, tmp_path):
    document = pipe.generate_to(tmp_path / "s", REQUEST)
    _edit_json(tmp_path / "s" / "result.json", lambda r: r.update(artifacts={}))
    seen = set()
    again = pipe.generate_to(tmp_path / "s", REQUEST, resume=True, on_token=recorder(seen)[0],
                             on_progress=recorder(seen)[1])
    assert seen == set() and again["artifacts"] == document["artifacts"]
    latent = tmp_path / "s" / "latent.npy"
    (tmp_path / "elsewhere.npy").write_bytes(latent.read_bytes())
    latent.unlink()
    latent.symlink_to(tmp_path / "elsewhere.npy")
    redone = pipe.generate_to(tmp_path / "s", REQUEST, resume=True, on_token=recorder(seen)[0],
                              on_progress=recorder(seen)[1])
    assert seen == {"nar", "vae"} and not latent.is_symlink()
    for name in ("latent.npy", "audio.flac"):
        assert redone["artifacts"][name] == document["artifacts"][name]


def test_a_failure_record_is_never_listed_in_the_result(pipe, tmp_path):
    """The CLI leaves failure.json beside a failed run and removes it once the resumed run completes."""
    from yue2_vllm.artifacts import RunDirectory

    on_token, on_progress = crash_in("nar")
    with pytest.raises(Crash):
        pipe.generate_to(tmp_path / "s", REQUEST, on_token=on_token, on_progress=on_progress)
    (tmp_path / "s" / "failure.json").write_text('{"status": "failed"}')
    document = pipe.generate_to(tmp_path / "s", REQUEST, resume=True)
    assert "failure.json" not in document["artifacts"]
    RunDirectory(tmp_path / "s").clear_failure()
    assert verify_result(tmp_path / "s", document["identity"]) == document


def test_an_invalid_vae_is_rejected_when_the_pipeline_starts(tiny_model_dir, tiny_vae_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from yue2_vllm.checkpoint import CheckpointError

    bf16 = tmp_path / "vae-bf16"
    shutil.copytree(tiny_vae_dir, bf16)
    state = load_file(str(bf16 / "model.safetensors"))
    save_file({k: v.bfloat16() for k, v in state.items()}, str(bf16 / "model.safetensors"))
    with pytest.raises(CheckpointError, match="the VAE must be float32"):
        YuE2Pipeline(tiny_model_dir, bf16, generation_config=GENERATION,
                     load=LoadOptions(hash_cache=HashCache(tmp_path / "c.json")))


def test_a_changed_vae_redoes_only_the_audio_stage(pipe, tiny_model_dir, tmp_path):
    from yue2_vllm.testing import write_tiny_vae

    on_token, on_progress = crash_in("vae")
    with pytest.raises(Crash):
        pipe.generate_to(tmp_path / "s", REQUEST, on_token=on_token, on_progress=on_progress)
    other = YuE2Pipeline(tiny_model_dir, write_tiny_vae(tmp_path / "vae2", seed=1), generation_config=GENERATION,
                         load=LoadOptions(hash_cache=HashCache(tmp_path / "c.json")))
    seen = set()
    document = other.generate_to(tmp_path / "s", REQUEST, resume=True, on_token=recorder(seen)[0],
                                 on_progress=recorder(seen)[1])
    assert seen == {"vae"} and document["weights"]["vae"] == other.weights["vae"]
    assert verify_result(tmp_path / "s", document["identity"]) == document
    seen.clear()
    back = pipe.generate_to(tmp_path / "s", REQUEST, resume=True, on_token=recorder(seen)[0],
                            on_progress=recorder(seen)[1])  # and back to the first VAE: audio again
    assert seen == {"vae"} and back["identity"] != document["identity"]
    assert back["identity"] == pipe(REQUEST).identity


@pytest.mark.parametrize("cot", ["full", "off"])
def test_too_long_lyrics_fail_before_anything_is_written(pipe, tmp_path, cot):
    request = SongRequest("pop", "la " * 30000, cot=cot, id="long")
    with pytest.raises(ValueError, match="the request is too long: .* exceeds the 24576-token context; shorten"):
        pipe.generate_to(tmp_path / "s", request)
    assert not (tmp_path / "s").exists()
    with pytest.raises(ValueError, match="too long"):
        pipe(request)


def test_resume_decisions_are_told(pipe, tmp_path, caplog):
    import logging

    on_token, on_progress = crash_in("semantic")
    with pytest.raises(Crash):
        pipe.generate_to(tmp_path / "s", REQUEST, on_token=on_token, on_progress=on_progress)
    with caplog.at_level(logging.INFO, logger="yue2_vllm"):
        pipe.generate_to(tmp_path / "s", REQUEST, resume=True)
        pipe.generate_to(tmp_path / "s", REQUEST, resume=True)
    assert [r.getMessage() for r in caplog.records] == ["resuming: plan verified, redoing semantic",
                                                        "resuming: the finished song verifies, nothing to redo"]


# --------------------------------------------------------------------------- devices, numerics, VAE placement


def test_construction_sets_upstreams_numerics_flags(pipe):
    from yue2_vllm.devices import UPSTREAM_NUMERICS, numerics_differences

    assert pipe.numerics == dict(UPSTREAM_NUMERICS) and numerics_differences() == {}
    assert pipe.device == torch.device("cpu") and pipe.effective_config(REQUEST)["device"] == "cpu"


@pytest.fixture
def fresh_vae(pipe):
    yield pipe
    pipe.models._vae = None  # the next decode reloads it on the CPU


def test_the_vae_decodes_on_the_pipelines_device_and_stays_there(fresh_vae, monkeypatch):
    pipe = fresh_vae
    assert pipe.vae.decoder_device.type == "cpu"
    monkeypatch.setattr(pipe, "device", torch.device("meta"))  # any accelerator: placement only
    monkeypatch.setattr(pipe, "_device_room", lambda: 10**12)
    with pipe._vae_on_device() as vae:
        assert vae is pipe.vae and vae.decoder_device.type == "meta"
        assert all(p.device.type == "meta" for p in vae.parameters())
        assert all(p.dtype == torch.float32 for p in vae.parameters())
    assert pipe.vae.decoder_device.type == "meta"  # resident: the memory plan budgets it beside the MoT
    assert pipe.vae_placement["ar_moved"] is False and pipe.vae_placement["device"] == "meta"


@pytest.mark.parametrize("fail", [False, True])
def test_without_room_the_ar_leaves_for_the_decode_and_everything_comes_back(fresh_vae, monkeypatch, fail):
    import contextlib

    import yue2_vllm.song.models as models_module
    from yue2_vllm.memory import vae_decode_bytes

    pipe, events, moves = fresh_vae, [], []

    @contextlib.contextmanager
    def offloaded(model, enabled):
        events.append(("ar off", enabled))
        try:
            yield
        finally:
            events.append(("ar back", moves[-1]))

    monkeypatch.setattr(models_module, "offloaded_ar", offloaded)
    monkeypatch.setattr(pipe.vae, "to", lambda device: moves.append(str(device)) or pipe.vae)  # records the moves
    monkeypatch.setattr(pipe, "device", torch.device("meta"))
    need = vae_decode_bytes(pipe.vae.config, pipe.options.device.vae_core_frames, 16)
    monkeypatch.setattr(pipe, "_device_room", lambda: need)  # not enough for the tile and the VAE's weights
    with contextlib.suppress(Crash):
        with pipe._vae_on_device() as vae:
            assert moves == ["meta"] and events == [("ar off", True)]
            if fail:
                raise Crash("cancelled mid-decode")
    # The VAE went back to the CPU before the AR expert returned, on errors too.
    assert events == [("ar off", True), ("ar back", "cpu")] and pipe.vae_placement["ar_moved"] is True
    assert pipe.vae_placement["need_bytes"] > need


def test_decode_on_the_cpu_moves_nothing_and_is_unchanged(pipe):
    latents = np.random.default_rng(0).standard_normal((12, 64)).astype(np.float32)
    expected = pipe.vae.decode_tiled(torch.from_numpy(latents).T[None], core_frames=pipe.options.device.vae_core_frames,
                                     halo_frames=16)[0].clamp(-1, 1).T.numpy()
    pipe.vae_placement = None
    assert np.array_equal(pipe.decode(latents), expected) and pipe.vae_placement is None


@pytest.mark.parametrize("policy", ["auto", "force"])
def test_slow_int8_proxies_are_declined_on_the_record(tiny_model_dir, tiny_vae_dir, tmp_path, monkeypatch, policy):
    import yue2_vllm.song.models as models_module

    monkeypatch.setattr(models_module, "proxy_slow_reason", lambda mode, device, dtype: f"{mode} is slow here")
    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                        load=LoadOptions(hash_cache=HashCache(tmp_path / "cache.json")),
                        ar=AROptions(quantization="int8", quantized_policy=policy))
    if policy == "auto":
        assert pipe.proxy_mode is None and pipe.quantization_status["mode"] == "none"
        assert pipe.quantization_status["declined"] == "int8 is slow here"
        assert pipe.quantization_status["requested"] == "int8"
        assert pipe.effective_config(REQUEST)["quantization_status"]["declined"] == "int8 is slow here"
    else:
        assert pipe.proxy_mode == "int8" and pipe.quantization_status["mode"] == "int8"
        assert "declined" not in pipe.quantization_status


def test_unified_memory_split_is_refused_before_any_weights_load(fake_gpu, tiny_model_dir, tiny_vae_dir, tmp_path,
                                                                  monkeypatch):
    """On a GB10 the default budget is the pool (MemAvailable less the OS reserve); a split that cannot hold the
    host sides and a --budget above the pool are both refused before the MoT is read."""
    from conftest import write_meminfo

    from yue2_vllm import memory
    from yue2_vllm.song import models

    gpu = fake_gpu("GB10")
    reserve = max(8 * 2**30, int(0.10 * (gpu["total"] // 1024 * 1024)))
    monkeypatch.setattr(memory, "MEMINFO", str(write_meminfo(tmp_path / "meminfo", gpu["total"], reserve + 3 * 2**30)))

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the split was checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    with pytest.raises(MemoryError, match=r"unified memory: .* MemAvailable is .* the pool 3\.00 GiB"):
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, ar=AROptions(backend="vllm"), device=DeviceOptions(device="cuda"))
    with pytest.raises(ValueError, match=r"--budget 24\.00 GiB is above the unified memory pool of 3\.00 GiB"):
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, ar=AROptions(backend="torch"),
                     device=DeviceOptions(device="cuda", budget_gib=24))


@pytest.mark.parametrize("name", ["GB10", "H100"])
def test_the_engine_starts_after_the_mot_loads_on_unified_memory_only(fake_gpu, tiny_model_dir, tiny_vae_dir,
                                                                       tmp_path, monkeypatch, name):
    """Beside the MoT load on a discrete GPU (as before); after it on unified memory, so that vLLM's start-up check
    measures the pool with the MoT already in it."""
    from conftest import write_meminfo

    from yue2_vllm import memory
    from yue2_vllm.song import models
    from yue2_vllm.song.engine_life import EngineLife

    gpu = fake_gpu(name)
    monkeypatch.setattr(memory, "MEMINFO", str(write_meminfo(tmp_path / "meminfo", gpu["total"], 100 * 2**30)))
    order = []

    def load(*args, **kwargs):
        order.append("load")
        raise RuntimeError("stop here")

    monkeypatch.setattr(models, "load_model", load)
    monkeypatch.setattr(EngineLife, "start_in_background", lambda self: order.append("engine"))
    with pytest.raises(RuntimeError, match="stop here"):
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, ar=AROptions(backend="vllm"), engine=EngineOptions(start=True),
                     device=DeviceOptions(device="cuda"))
    assert order == (["load"] if gpu["integrated"] else ["engine", "load"])


CHUNKED = {**GENERATION, "context": 126}  # the tiny song's ~83-token prefix + 2 x 20 + 3: 30 frames in two chunks


@pytest.fixture(scope="module")
def chunked_pipe(tiny_model_dir, tiny_vae_dir, tmp_path_factory):
    cache = HashCache(tmp_path_factory.mktemp("hashes") / "cache.json")
    return YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=CHUNKED, load=LoadOptions(hash_cache=cache))


def test_a_song_past_one_nar_chunk_runs_through_the_pipeline(chunked_pipe, pipe, tmp_path):
    from yue2_vllm.protocol import chunk_ranges

    progress = []
    document = chunked_pipe.generate_to(tmp_path / "s", REQUEST,
                                        on_progress=lambda stage, done, total: progress.append((stage, done, total)))
    prefix = np.load(tmp_path / "s" / "prefix.npy")
    assert len(chunk_ranges(30, len(prefix), 126)) == 2
    assert [(d, n) for s, d, n in progress if s == "nar"] == [(i, 8) for i in range(1, 9)]  # 4 steps x 2 chunks
    latents = np.load(tmp_path / "s" / "latent.npy")
    assert latents.shape == (30, 64) and document["audio_seconds"] == (1920 * 30 - 64) / 48000
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["generation"]["context"] == 126 and "context" in config["overrides"]
    one_chunk = pipe(REQUEST)  # the same tokens; each chunk sees only its own frames, so other latents
    assert np.load(tmp_path / "s" / "semantic.npy").tolist() == one_chunk.semantic.tokens
    assert not np.allclose(latents, one_chunk.latents)
    assert verify_result(tmp_path / "s", document["identity"]) == document


# -- the engine start: a timeout, a failed first start retried with backoff, close() while it starts


def test_start_retry_backs_off_from_a_minute_to_half_an_hour():
    from yue2_vllm.startup import StartRetry

    retry, waits = StartRetry(), []
    for n in range(7):
        retry.failed("boom", now=1000.0)
        waits.append(retry.backoff_s)
    assert waits == [60, 120, 240, 480, 960, 1800, 1800]
    assert not retry.due(now=1000.0 + 1799) and retry.due(now=1000.0 + 1800)
    assert retry.describe(now=1900.0) == {"state": "start_failed", "reason": "boom", "failed_starts": 7,
                                          "retrying": False, "next_retry_seconds": 900.0}
    retry.succeeded()
    assert (retry.failures, retry.reason, retry.due(now=1e9)) == (0, None, False)


def _slow_engine_pipeline(tiny_model_dir, tiny_vae_dir, tmp_path, monkeypatch, timeout_s):
    from yue2_vllm.engine.backend import vllm_version

    if vllm_version() is None:
        pytest.skip("vLLM is not installed")
    monkeypatch.setenv("YUE2_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("YUE2_TEST_ENGINE_START_DELAY_S", "60")  # the worker takes a minute before importing vLLM
    return YuE2Pipeline(tiny_model_dir, tiny_vae_dir, load=LoadOptions(hash_cache=HashCache(None)),
                        ar=AROptions(backend="vllm"), engine=EngineOptions(start_timeout_s=timeout_s))


def test_a_failed_first_start_falls_back_and_is_retried_later_with_backoff(tiny_model_dir, tiny_vae_dir, tmp_path,
                                                                          monkeypatch):
    import time

    pipe = _slow_engine_pipeline(tiny_model_dir, tiny_vae_dir, tmp_path, monkeypatch, 1.0)
    try:
        backend, reason = pipe.select_ar_backend(1.0, False)
        assert backend is pipe.torch_backend
        assert reason.startswith("vLLM engine could not start: vLLM engine did not start within 1 s "
                                 "(--engine-start-timeout; its worker was stopped)")
        assert (pipe.start_retry.failures, pipe.start_retry.backoff_s) == (1, 60)
        # Not final: until the backoff has passed songs keep to torch without a new start ...
        assert pipe.select_ar_backend(1.0, False) == (pipe.torch_backend, reason) and pipe.engine_life._vllm is None
        pipe.start_retry.failed_at -= 60  # ... then the next song starts it again, in the background
        backend, again = pipe.select_ar_backend(1.0, False)
        assert backend is pipe.torch_backend and again == f"{reason}; a new start is under way"
        assert pipe.start_retry.retrying
        deadline = time.monotonic() + 30
        while not pipe.engine_life._prestart.done.is_set():
            assert time.monotonic() < deadline
            assert pipe.select_ar_backend(1.0, False)[1] == again  # songs meanwhile: torch, not waiting
            time.sleep(0.1)
        backend, reason2 = pipe.select_ar_backend(1.0, False)  # the retry failed too: twice as long to the next
        assert backend is pipe.torch_backend and reason2.split("; log kept")[0] == reason.split("; log kept")[0]
        assert (pipe.start_retry.failures, pipe.start_retry.backoff_s, pipe.start_retry.retrying) == (2, 120, False)
    finally:
        pipe.close()


def test_close_stops_an_engine_start_at_once(tiny_model_dir, tiny_vae_dir, tmp_path, monkeypatch):
    import time

    pipe = _slow_engine_pipeline(tiny_model_dir, tiny_vae_dir, tmp_path, monkeypatch, 900.0)
    pipe.engine_life.start_in_background()
    deadline = time.monotonic() + 30
    while pipe.engine_life._vllm is None or pipe.engine_life._vllm.process is None and pipe.engine_life._vllm.life.starting is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    worker = pipe.engine_life._vllm.life.starting.process
    start = time.monotonic()
    pipe.close()
    assert time.monotonic() - start < 3.0 and worker.poll() is not None
    assert pipe.engine_life._prestart is None and pipe.engine_life._prestart_error is None  # stopped, not failed: a later start goes ahead
    assert pipe.start_retry.failures == 0


@pytest.mark.slow  # a real vLLM engine start on the CPU
def test_a_retried_engine_start_that_succeeds_serves_the_later_songs(tiny_model_dir, tiny_vae_dir, tmp_path,
                                                                    monkeypatch):
    import time

    pipe = _slow_engine_pipeline(tiny_model_dir, tiny_vae_dir, tmp_path, monkeypatch, 1.0)
    try:
        assert pipe.select_ar_backend(1.0, False)[0] is pipe.torch_backend and pipe.start_retry.failures == 1
        monkeypatch.delenv("YUE2_TEST_ENGINE_START_DELAY_S")  # the cause is gone (e.g. memory freed, storage back)
        from dataclasses import replace

        life = pipe.engine_life  # a longer timeout for the next start (the options are frozen: new inputs)
        resolved = life.inputs.resolved
        engine = replace(resolved.options.engine, start_timeout_s=900.0)
        life.inputs = replace(life.inputs, resolved=replace(resolved, options=replace(resolved.options,
                                                                                      engine=engine)))
        pipe.start_retry.failed_at -= 60
        assert pipe.select_ar_backend(1.0, False)[1].endswith("a new start is under way")
        deadline = time.monotonic() + 600
        while not pipe.engine_life._prestart.done.is_set():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        backend, reason = pipe.select_ar_backend(1.0, False)
        assert backend is pipe.engine_life._vllm and backend.running and reason is None
        assert (pipe.start_retry.failures, pipe.start_retry.reason) == (0, None)
        song = pipe(SongRequest(style="pop", lyrics="[verse]\nla\n", seed=3),
                    abc_sampling={"max_tokens": 4, "min_tokens": 4}, semantic_sampling={"max_tokens": 8,
                                                                                       "min_tokens": 8})
        assert song.semantic.timing["backend_actual"] == "vllm"
    finally:
        pipe.close()


def test_without_a_usable_vllm_a_stack_above_the_engines_rank_is_not_refused(tiny_model_dir, tiny_vae_dir, tmp_path,
                                                                             monkeypatch):
    """`backend="auto"` where no vLLM can serve (resolved.beside_engine false): the AR half runs on torch, which takes
    any stack, so a stack above the max_lora_rank an engine would have is resolved without a LoRA request, at the
    song's admission and in the staged API alike (where vLLM may serve it, it is refused: test_song_adapters)."""
    from yue2_vllm.options import AdapterOptions
    from yue2_vllm.testing_adapters import write_tiny_adapter

    monkeypatch.setattr("yue2_vllm.song.resolved.vllm_usable", lambda: False)  # a machine without vLLM
    first = write_tiny_adapter(tmp_path / "a.safetensors", "plain", rank=4)
    second = write_tiny_adapter(tmp_path / "b.safetensors", "plain", rank=8, seed=1)
    adapters = AdapterOptions((("a", str(first.path)), ("b", str(second.path))))
    request = SongRequest(**{**REQUEST.to_dict(), "adapters": [{"name": "a"}, {"name": "b"}]})
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(backend="auto"),
                      adapters=adapters, load=LoadOptions(hash_cache=HashCache(tmp_path / "h.json"))) as pipe:
        assert not pipe.resolved.beside_engine and pipe.resolved.lora.max_lora_rank == 8  # 4 + 8 stack above it
        admitted = pipe.check_request(request)
        assert admitted.lora_request is None and [use.adapter.name for use in admitted.uses] == ["a", "b"]
        assert pipe.stages.resolve_adapters(request).lora_request is None
