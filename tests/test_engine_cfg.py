"""CFG and cot=off served on vLLM as paired rows: parity with the torch CFG backend (float32), under
chunked prefill, preemption and batching; the guided distribution; the recorded backends."""
import json

import pytest
import torch

from yue2_vllm.engine import sampling as es
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.protocol import CODEC_OFFSET, Sampling, SongRequest, negative_prompt, semantic_prompt
from yue2_vllm.model.sampling import mix_cfg, phase_scores
from yue2_vllm.scheduler import SongScheduler
from yue2_vllm.engine.backend import vllm_version
from yue2_vllm.options import AROptions, EngineOptions

from engines import FLOAT32_ENGINE

pytestmark = pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
GREEDY = {"abc": {"max_tokens": 16, "min_tokens": 16, "temperature": 0},
          "semantic": {"max_tokens": 40, "min_tokens": 40, "temperature": 0}, "ode_steps": 2}
LONG_LYRICS = "[verse]\n" + "walking down the river road " * 30 + "\n"  # ~ 250 prompt tokens
GUIDED = [SongRequest("pop", LONG_LYRICS, cot="off", seed=4, id="off"),  # cfg 1.01, legacy numerics
          SongRequest("pop", LONG_LYRICS, cfg_scale=1.5, seed=3, id="g15"),
          SongRequest("jazz", "oh yeah\n", cot="melody", cfg_scale=3.0, seed=5, id="g3")]
PLAIN = [SongRequest("rock", f"la {i}\n", seed=20 + i, id=f"plain{i}") for i in range(3)]


@pytest.fixture(scope="module")
def torch_pipe(tiny_model_dir, tiny_vae_dir):
    return YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GREEDY, ar=AROptions(dtype="float32"))


@pytest.fixture(scope="module")
def reference(torch_pipe):
    """Each guided song's abc and semantic tokens from the torch CFG backend, alone."""
    out = {}
    for request in GUIDED:
        plan = torch_pipe.plan(request)
        out[request.id] = (plan.abc_ids, torch_pipe.generate_semantic(plan).tokens)
    return out


def tokens_of(directory):
    import numpy as np

    return (np.load(directory / "abc_tokens.npy").tolist(), np.load(directory / "semantic.npy").tolist())


def test_greedy_cfg_alone_and_in_a_chunked_batch_equals_torch(tiny_model_dir, tiny_vae_dir, engines, reference,
                                                              tmp_path):
    """Step budget 64 < the ~250-token prompts: every prefill is chunked, also inside the batch (the engine
    tests/test_scheduler.py's songs share)."""
    with engines.pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GREEDY,
                          ar=AROptions(backend="vllm", dtype="float32"), engine=FLOAT32_ENGINE) as pipe:
        for request in GUIDED:
            plan = pipe.plan(request)
            semantic = pipe.generate_semantic(plan)
            assert (plan.abc_ids, semantic.tokens) == reference[request.id], request.id
            assert semantic.timing["backend_actual"] == "vllm" and semantic.timing["cfg_branches"] == 2
            assert semantic.timing["prefix_tokens"] > 64 or request.id == "g3"
        with SongScheduler(pipe, concurrency=6) as scheduler:
            handles = [scheduler.submit(r, tmp_path / r.id) for r in GUIDED + PLAIN]
            assert {h.state for h in scheduler.as_completed(handles)} == {"complete"}
    for request in GUIDED:
        assert tokens_of(tmp_path / request.id) == reference[request.id], request.id
        timing = json.loads((tmp_path / request.id / "result.json").read_text())["timing"]["semantic"]
        assert timing["mean_batch_rows"] > 2 and "pair_restarts" in timing


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
def test_greedy_cfg_under_preemption_equals_torch(tiny_model_dir, tiny_vae_dir, reference, tmp_path):
    """KV for about two sequences and no parent-side KV admission: vLLM preempts rows of pairs."""
    from yue2_vllm.memory import kv_cache_bytes
    from yue2_vllm.testing import TINY_CONFIG

    small = kv_cache_bytes(TINY_CONFIG, 1, 1024 + 64, 32, dtype_bytes=4)  # 1,088 tokens for 6 rows of ~300
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GREEDY,
                      ar=AROptions(backend="vllm", dtype="float32"),
                      engine=EngineOptions(max_num_seqs=8, tuning={"kv_cache_bytes": small, "kv_admission": False,
                                                                   "max_model_len": 1024})) as pipe:
        with SongScheduler(pipe, concurrency=4) as scheduler:
            handles = [scheduler.submit(r, tmp_path / r.id) for r in GUIDED]
            assert {h.state for h in scheduler.as_completed(handles)} == {"complete"}
    restarts = 0
    for request in GUIDED:
        assert tokens_of(tmp_path / request.id) == reference[request.id], request.id
        restarts += json.loads((tmp_path / request.id / "result.json").read_text())["timing"]["semantic"][
            "pair_restarts"]
    assert restarts > 0  # the guard and the driver really had to resubmit pairs


def test_guided_distribution_at_a_teacher_forced_position_equals_phase_scores(torch_pipe):
    """Real model logits of a cond and an uncond prompt after the same accepted tokens (float32)."""
    model = torch_pipe.model
    request = SongRequest("pop", "la la\n", cfg_scale=1.5, seed=1)
    abc = [100, 200, 300]
    forced = [CODEC_OFFSET + t for t in (5, 17, 5, 900)]
    prompts = [semantic_prompt(request, torch_pipe.tokenizer, abc), negative_prompt(request, torch_pipe.tokenizer, abc)]
    cond, uncond = (model.forward_ar(torch.tensor([p + forced]))[:, -1] for p in prompts)
    for sampling, legacy in ((Sampling(temperature=0.9, top_p=0.9, top_k=60, min_tokens=10), False),
                             (Sampling(temperature=1.0, top_p=0.95, top_k=100, min_tokens=0), True)):
        dtype = torch.bfloat16 if legacy else torch.float32
        c, u = cond.to(dtype), uncond.to(dtype)  # legacy numerics stay in the (here bf16) logits' dtype
        expected = phase_scores(mix_cfg(c, u, 1.5), sampling, forced, len(forced), "semantic", legacy).float()
        settings = es.RowSampling(1, sampling.temperature, sampling.top_p, sampling.top_k,
                                  sampling.repetition_penalty, sampling.penalty_window, sampling.min_tokens, 1, legacy)
        batch = es.RowBatch.build([settings])
        mixed = es.mix_guidance(c[:, es.phase_slice(1)], u[:, es.phase_slice(1)], torch.tensor([1.5]))
        windows = torch.tensor(es.local_windows([forced], 1))
        scores = es.masked_scores(mixed, 1, batch, torch.tensor([len(forced)]), windows)
        got = es.distribution(scores, 1, batch)[0]
        want = expected.softmax(-1)[0]
        assert (want.sort().values - got.sort().values).abs().max() < 1e-6
        if not legacy:
            assert (want - got).abs().max() < 1e-6


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
def test_seeded_sampled_cfg_song_is_the_same_alone_and_in_a_batch(tiny_model_dir, tiny_vae_dir, tmp_path):
    sampled = {"abc": {"max_tokens": 12, "min_tokens": 12}, "semantic": {"max_tokens": 30, "min_tokens": 30},
               "ode_steps": 2}
    guided = SongRequest("pop", LONG_LYRICS, cfg_scale=1.5, seed=77, id="sampled")
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=sampled,
                      ar=AROptions(backend="vllm", dtype="float32"),
                      engine=EngineOptions(max_num_seqs=8, max_num_batched_tokens=128)) as pipe:
        alone = pipe.generate_semantic(pipe.plan(guided)).tokens
        with SongScheduler(pipe, concurrency=4) as scheduler:
            handles = [scheduler.submit(r, tmp_path / r.id) for r in [guided] + PLAIN]
            assert {h.state for h in scheduler.as_completed(handles)} == {"complete"}
    assert tokens_of(tmp_path / "sampled")[1] == alone


def test_cli_records_vllm_for_cfg_and_cot_off(tiny_model_dir, tiny_vae_dir, engines, tmp_path, capsys):
    """The CLI in this process, on the session's engine for its settings (both songs share it)."""
    from yue2_vllm.cli import main

    (tmp_path / "gen.json").write_text(json.dumps(GREEDY))
    common = ["generate", "--backend", "vllm", "--quiet", "--model", str(tiny_model_dir), "--vae", str(tiny_vae_dir),
              "--config", str(tmp_path / "gen.json"), "--output", str(tmp_path / "runs"), "--style", "pop",
              "--lyrics", "la la"]
    for extra, name in ((["--cfg-scale", "1.5", "--id", "g"], "g"), (["--cot", "off", "--id", "o"], "o")):
        with engines.shared():
            assert main(common + extra) == 0
        status = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert status["status"] == "complete"
        timing = json.loads((tmp_path / "runs" / name / "result.json").read_text())["timing"]
        assert timing["semantic"]["backend_actual"] == "vllm" and timing["semantic"]["fallback_reason"] is None
        assert timing["semantic"]["pair_restarts"] >= 0 and timing["semantic"]["cfg_branches"] == 2
        if name == "g":
            assert timing["abc"]["backend_actual"] == "vllm"
