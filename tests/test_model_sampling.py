import pytest
import torch

from yue2_vllm.protocol import ABC_END, CODEC_OFFSET, EOD, MUSIC_END, MUSIC_START, Sampling
from yue2_vllm.model.sampling import TorchARBackend, mix_cfg, phase_scores, window_penalty

PREFIX = [EOD, 40, 1771, 285, 9, 10, 11, 12, 151847, 300, 301, 151848, MUSIC_START]


def test_window_penalty_hand_computed():
    logits = torch.tensor([[0.0, 9.0, 12.0, -2.0]])
    # token 2 seen twice: alpha 2**2 = 4 -> 12 / 4; token 3 once: -2 * 2
    assert window_penalty(logits, [2, 2, 3], 2.0).tolist() == [[0.0, 9.0, 3.0, -4.0]]
    assert window_penalty(logits, [1], 3.0).tolist() == [[0.0, 3.0, 12.0, -2.0]]
    assert window_penalty(logits, [], 3.0) is logits
    assert window_penalty(logits, [1, 2], 1.0) is logits


def test_penalty_window_counts_only_recent_history():
    sampling = Sampling(temperature=0, repetition_penalty=2.0, penalty_window=2, min_tokens=0)
    logits = torch.zeros(1, 184704)
    logits[0, CODEC_OFFSET + 5] = 8.0
    scores = phase_scores(logits, sampling, [CODEC_OFFSET + 5, CODEC_OFFSET + 5, CODEC_OFFSET + 1], 3, "semantic")
    assert scores[0, CODEC_OFFSET + 5].item() == 4.0  # only one of the two 5s is inside the window of 2


def test_allow_masks_and_min_tokens():
    logits = torch.randn(1, 184704, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    sampling = Sampling(temperature=0, repetition_penalty=1.0, min_tokens=3)
    abc = phase_scores(logits, sampling, [], 0, "abc")
    assert abc.dtype == torch.float32
    finite = torch.isfinite(abc[0]).nonzero().flatten()
    assert finite.tolist() == list(range(EOD))  # ABC_END blocked below min_tokens
    abc_late = phase_scores(logits, sampling, [], 3, "abc")
    assert torch.isfinite(abc_late[0]).nonzero().flatten().tolist() == list(range(EOD)) + [ABC_END]
    semantic = phase_scores(logits, sampling, [], 3, "semantic")
    assert torch.isfinite(semantic[0]).nonzero().flatten().tolist() == [MUSIC_END] + list(range(CODEC_OFFSET, 184621))
    assert phase_scores(logits, sampling, [], 3, "semantic", legacy_off=True).dtype == torch.bfloat16


def test_top_k_keeps_ties_and_top_p_keeps_minimum():
    logits = torch.full((1, 184704), -5.0)
    logits[0, [10, 11, 12, 13]] = torch.tensor([3.0, 2.0, 2.0, 1.0])
    scores = phase_scores(logits, Sampling(top_k=2, top_p=1.0, repetition_penalty=1.0, min_tokens=0), [], 0, "abc")
    assert torch.isfinite(scores[0]).nonzero().flatten().tolist() == [10, 11, 12]
    tiny_p = Sampling(top_k=100, top_p=1e-6, repetition_penalty=1.0, min_tokens=0)
    assert torch.isfinite(phase_scores(logits, tiny_p, [], 0, "abc")[0]).sum().item() == 1
    assert torch.isfinite(phase_scores(logits.bfloat16(), tiny_p, [], 0, "abc", legacy_off=True)[0]).sum().item() == 3


def test_cfg_mix_is_bf16():
    cond = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    uncond = torch.tensor([[0.5, 4.0]], dtype=torch.bfloat16)
    mixed = mix_cfg(cond, uncond, 1.5)
    assert mixed.dtype == torch.bfloat16 and mixed.tolist() == [[1.25, 1.0]]
    assert mix_cfg(cond, uncond, 1.0) is cond


@pytest.fixture(scope="module")
def backend(tiny_model):
    return TorchARBackend(tiny_model)


def test_seeded_semantic_is_deterministic_and_masked(backend):
    sampling = Sampling(min_tokens=5, max_tokens=20)
    first = backend.generate(PREFIX, sampling, 7, "semantic")
    second = backend.generate(PREFIX, sampling, 7, "semantic")
    other = backend.generate(PREFIX, sampling, 8, "semantic")
    assert first.ids == second.ids and first.ids != other.ids
    assert all(CODEC_OFFSET <= t < CODEC_OFFSET + 32768 for t in first.ids)
    assert first.truncated and len(first.ids) == 20 and first.timing["output_tokens"] == 20
    assert first.timing["cfg_branches"] == 1 and first.timing["backend_actual"] == "torch"


def test_abc_phase_respects_mask_and_end(backend, tiny_model):
    # Make ABC_END overwhelmingly likely once min_tokens is reached by biasing the lm_head row.
    seen = []
    with torch.no_grad():
        saved = tiny_model.lm_head.weight[ABC_END].clone()
        tiny_model.lm_head.weight[ABC_END] = tiny_model.model.norm.weight * 3
        try:
            result = backend.generate(PREFIX[:9], Sampling(temperature=1.0, min_tokens=4, max_tokens=50), 1, "abc",
                                      on_token=lambda phase, t: seen.append((phase, t)))
        finally:
            tiny_model.lm_head.weight[ABC_END] = saved
    assert len(result.ids) == 4 and not result.truncated
    assert all(0 <= t < EOD for t in result.ids)
    assert seen == [("abc", t) for t in result.ids] + [("abc", ABC_END)]
    assert result.timing["output_tokens"] == 5 and result.timing["content_tokens"] == 4


def test_cfg_scale_one_equals_no_cfg(backend):
    sampling = Sampling(min_tokens=0, max_tokens=12)
    negative = [EOD, 40, MUSIC_START]
    plain = backend.generate(PREFIX, sampling, 3, "semantic")
    with_negative = backend.generate(PREFIX, sampling, 3, "semantic", negative=negative, cfg_scale=1.0)
    assert plain.ids == with_negative.ids
    guided = backend.generate(PREFIX, sampling, 3, "semantic", negative=negative, cfg_scale=3.0)
    assert guided.timing["cfg_branches"] == 2 and guided.ids != plain.ids


def test_budget_and_cfg_errors(backend):
    with pytest.raises(ValueError, match="exceeds the 24576-token context"):
        backend.generate([EOD] * 20000, Sampling(max_tokens=5000), 0, "semantic")
    with pytest.raises(ValueError, match="negative"):
        backend.generate(PREFIX, Sampling(max_tokens=4, min_tokens=0), 0, "semantic", cfg_scale=1.5)


def test_cancellation_stops_within_one_step(backend):
    emitted = []
    with pytest.raises(InterruptedError, match="after 3 tokens"):
        backend.generate(PREFIX, Sampling(min_tokens=0, max_tokens=50), 0, "semantic",
                         on_token=lambda p, t: emitted.append(t), cancelled=lambda: len(emitted) >= 3)
    assert len(emitted) == 3


def test_default_on_the_cpu_is_eager_and_says_why(backend):
    result = backend.generate(PREFIX, Sampling(min_tokens=0, max_tokens=3), 0, "semantic")
    assert result.timing["execution"] == "eager" and result.timing["attention"] == "sdpa"
    assert result.timing["graph_fallback_reason"].startswith("non_cuda_device: CUDA graphs are captured on CUDA only")


@pytest.mark.parametrize("phase,legacy_off", [("semantic", False), ("abc", False), ("semantic", True)])
def test_row_sampler_scores_equal_phase_scores_on_the_rows(phase, legacy_off):
    from yue2_vllm.model.decode_step import PhaseRows
    from yue2_vllm.model.sampling import RowSampler

    rows = PhaseRows.for_phase(phase)
    ids = rows.ids()
    sampling = Sampling(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.3, penalty_window=3,
                        min_tokens=4, max_tokens=12)
    generator = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if legacy_off else torch.float32
    sampler, history = RowSampler(rows, sampling, phase, 184704, torch.device("cpu"), legacy_off), []
    for step in range(8):
        logits = (torch.randn(1, 184704, generator=generator) * 3).to(dtype)
        want = phase_scores(logits, sampling, history, step, phase, legacy_off)
        got = sampler.scores(logits[:, ids], step)
        want = want[:, ids]
        assert got.dtype == want.dtype
        if legacy_off:  # bf16 ties at the top-p cut: the unstable sort may keep the other of two equal scores
            assert sorted(got[got.isfinite()].tolist()) == sorted(want[want.isfinite()].tolist())
        else:
            assert torch.equal(got, want)
        token = int(ids[step * 97 % 7])  # a few repeats, so the window's counts go up and back down
        sampler._count(torch.tensor([token]), step)
        history.append(token)


def test_draw_is_multinomials_one_sample_draw_without_its_checks():
    from yue2_vllm.model.sampling import draw

    source = torch.Generator().manual_seed(9)
    for seed in range(50):
        probabilities = torch.rand(1, 4096, generator=source).pow(6)
        probabilities[0, ::3] = 0
        probabilities /= probabilities.sum()
        first, second = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        assert torch.equal(draw(probabilities, first), torch.multinomial(probabilities, 1, generator=second))
        assert torch.equal(first.get_state(), second.get_state())


@pytest.mark.parametrize("execution", ["eager", "batched"])
@pytest.mark.parametrize("cfg_scale", [1.0, 1.5])
def test_a_capped_phase_continued_is_the_phase_with_the_larger_budget(tiny_model, execution, cfg_scale):
    """The capped tokens are replayed through the decode steps the phase first ran and its saved generator state
    restored (or, without one, the replay redraws): the tokens, log-probs and end state are one longer run's.

    Eagerly the capped phase is exactly the longer one's beginning (each step attends over the used keys only). The
    batched step attends over its whole buffer, sized by max_tokens, which can round differently (here: CPU SDPA's
    key blocks, with CFG's two branches): there the replay is of the longer run's first tokens, and the generator
    state after as many draws is the capped run's (a draw takes the same generator steps whatever it picks)."""
    from yue2_vllm.model.sampling import ARContinuation

    backend = TorchARBackend(tiny_model, execution)
    kwargs = {"negative": PREFIX[:5] + [MUSIC_START], "cfg_scale": cfg_scale} if cfg_scale != 1.0 else {}
    longer, shorter = Sampling(min_tokens=6, max_tokens=20), Sampling(min_tokens=6, max_tokens=8)
    full = backend.generate(PREFIX, longer, 5, "semantic", **kwargs)
    capped = backend.generate(PREFIX, shorter, 5, "semantic", **kwargs)
    assert capped.truncated and capped.rng_state is not None
    if execution == "eager":
        assert capped.ids == full.ids[:8]
    for state in (capped.rng_state, None):
        streamed = []
        continued = backend.generate(PREFIX, longer, 5, "semantic", **kwargs,
                                     continuation=ARContinuation(full.ids[:8], state, "cpu" if state else None),
                                     on_token=lambda phase, token: streamed.append(token))
        assert (continued.ids, continued.truncated, continued.rng_state) == (full.ids, full.truncated, full.rng_state)
        assert streamed == full.ids[8:] + ([] if full.truncated else [MUSIC_END])  # the replay streams nothing
        timing = continued.timing
        assert timing["mean_logprob"] == full.timing["mean_logprob"]  # of every token, the replayed ones too
        assert (timing["continued_tokens"], timing["output_tokens"], timing["rng_device"]) == \
            (8, full.timing["output_tokens"] - 8, "cpu")
        assert timing["continuation"] == "replayed (generator " + ("restored)" if state else "redrawn)")
    with pytest.raises(ValueError, match="max_tokens 8 leaves nothing to continue after 8 tokens"):
        backend.generate(PREFIX, shorter, 5, "semantic", continuation=ARContinuation(capped.ids))
    with pytest.raises(ValueError, match=r"continuation's tokens\[1\] = 184621 is not a semantic id"):
        backend.generate(PREFIX, longer, 5, "semantic", continuation=ARContinuation([CODEC_OFFSET, 184621]))
