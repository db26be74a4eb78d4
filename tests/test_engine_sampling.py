"""Engine-side sampling: `phase_scores`' arithmetic over many rows, and the counter-based draw."""
import random

import pytest
import torch

from yue2_vllm.engine import sampling as es
from yue2_vllm.protocol import ABC_END, CODEC_OFFSET, EOD, MUSIC_END, VOCAB_SIZE, Sampling
from yue2_vllm.model.sampling import mix_cfg, phase_scores


def random_rows(phase: str, legacy: bool, count: int, seed: int):
    rng = random.Random(seed)
    samplings, histories, settings = [], [], []
    for i in range(count):
        s = Sampling(temperature=rng.choice([0.7, 1.0, 1.3]), top_p=rng.choice([0.9, 0.95, 1.0]),
                     top_k=rng.choice([1, 30, 100, 500, 10**6]), repetition_penalty=rng.choice([1.0, 1.2, 1.005, 0.8]),
                     penalty_window=rng.choice([1, 50, 100]), min_tokens=rng.choice([0, 5, 200]), max_tokens=300)
        low = 0 if phase == "abc" else CODEC_OFFSET
        histories.append([rng.randrange(low, low + 300) for _ in range(rng.randrange(0, 150))])
        samplings.append(s)
        settings.append(es.RowSampling(es.PHASE_INDEX[phase], s.temperature, s.top_p, s.top_k, s.repetition_penalty,
                                       s.penalty_window, s.min_tokens, seed * 100 + i, legacy))
    return samplings, histories, settings


def engine_scores(logits, phase, samplings, histories, settings):
    index = es.PHASE_INDEX[phase]
    batch = es.RowBatch.build(settings)
    recent = [h[len(h) - s.penalty_window:] if len(h) > s.penalty_window else h for h, s in zip(histories, samplings)]
    windows = torch.tensor(es.local_windows(recent, index), dtype=torch.long).reshape(len(settings), -1)
    steps = torch.tensor([len(h) for h in histories])
    return es.masked_scores(logits[:, es.phase_slice(index)], index, batch, steps, windows), batch, steps


@pytest.mark.parametrize("phase", ["abc", "semantic"])
def test_fp32_rows_match_phase_scores(phase):
    """Masked/penalised scores equal `phase_scores` exactly; the sampled distribution within 1e-6."""
    samplings, histories, settings = random_rows(phase, False, 10, 1)
    logits = torch.randn(10, VOCAB_SIZE, generator=torch.Generator().manual_seed(2)) * 3
    scores, batch, _ = engine_scores(logits, phase, samplings, histories, settings)
    dist = es.distribution(scores, es.PHASE_INDEX[phase], batch)
    low, high = es.PHASE_SLICES[es.PHASE_INDEX[phase]]
    for i, (s, h) in enumerate(zip(samplings, histories)):
        greedy = Sampling(**{**s.to_dict(), "temperature": 0})
        reference = phase_scores(logits[i:i + 1], greedy, h, len(h), phase)[0]
        assert torch.equal(reference[low:high], scores[i])
        assert torch.isinf(reference[:low]).all() and torch.isinf(reference[high:]).all()
        expected = phase_scores(logits[i:i + 1], s, h, len(h), phase).softmax(-1)[0]
        assert (expected - dist[i]).abs().max() < 1e-6


@pytest.mark.parametrize("phase", ["abc", "semantic"])
def test_legacy_rows_match_the_bf16_path(phase):
    """cot=off rows are scored in bf16 like the torch backend; ties at a top-p cut may take other ids of
    the same value (torch's sort order among ties is unspecified), so the sorted distributions agree."""
    samplings, histories, settings = random_rows(phase, True, 10, 3)
    logits = (torch.randn(10, VOCAB_SIZE, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    scores, batch, _ = engine_scores(logits, phase, samplings, histories, settings)
    dist = es.distribution(scores, es.PHASE_INDEX[phase], batch)
    low, high = es.PHASE_SLICES[es.PHASE_INDEX[phase]]
    for i, (s, h) in enumerate(zip(samplings, histories)):
        greedy = Sampling(**{**s.to_dict(), "temperature": 0})
        assert torch.equal(phase_scores(logits[i:i + 1], greedy, h, len(h), phase, True)[0][low:high], scores[i])
        expected = phase_scores(logits[i:i + 1], s, h, len(h), phase, True).float().softmax(-1)[0]
        assert (expected.sort().values - dist[i].sort().values).abs().max() < 1e-6


def test_guidance_mix_rounds_like_mix_cfg():
    cond = (torch.randn(3, 5000) * 3).to(torch.bfloat16)
    uncond = (torch.randn(3, 5000) * 3).to(torch.bfloat16)
    scales = torch.tensor([1.01, 1.5, 3.0])
    mixed = es.mix_guidance(cond, uncond, scales)
    for i, scale in enumerate(scales.tolist()):
        assert torch.equal(mixed[i], mix_cfg(cond[i:i + 1], uncond[i:i + 1], scale)[0])
    assert torch.equal(es.mix_guidance(cond.float(), uncond.float(), scales)[1],
                       mix_cfg(cond[1:2].float(), uncond[1:2].float(), 1.5)[0])


def test_splitmix_matches_the_uint64_reference():
    values = [0, 1, 2, 12345, 2**31, 2**62 + 7, 2**63 - 1]
    out = es.splitmix64(torch.tensor(values + [-1, -5]))
    expected = [es.splitmix64_reference(v) for v in values + [2**64 - 1, 2**64 - 5]]
    assert [v % 2**64 for v in out.tolist()] == expected


def test_gumbel_draw_follows_the_distribution():
    """Over 20,000 (seed, position) keys, Gumbel-max with the counter noise matches a fixed softmax."""
    probabilities = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    keys = es.row_keys(torch.full((20000,), 77), torch.arange(20000))
    ids = torch.arange(CODEC_OFFSET, CODEC_OFFSET + 4).expand(20000, -1)
    drawn = (probabilities.log() + es.gumbel(keys, ids)).argmax(-1)
    frequencies = torch.bincount(drawn, minlength=4).double() / 20000
    assert (frequencies - probabilities).abs().max() < 0.015


def test_draw_depends_only_on_seed_and_position():
    """A row's draw does not change when other rows join the batch or its neighbours change."""
    logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(5)) * 2
    setting = es.RowSampling(1, 1.0, 0.95, 100, 1.0, 50, 0, seed=77)
    other = es.RowSampling(1, 0.7, 0.9, 30, 1.0, 50, 0, seed=5)
    scores = logits[:, es.phase_slice(1)]
    alone = es.choose(scores[1:3], 1, es.RowBatch.build([setting] * 2), torch.tensor([3, 4]))
    mixed = es.choose(scores, 1, es.RowBatch.build([other, setting, setting, other]), torch.tensor([9, 3, 4, 1]))
    assert torch.equal(alone, mixed[1:3])
    single = es.choose(scores[1:2], 1, es.RowBatch.build([setting]), torch.tensor([3]))
    assert single[0] == alone[0]


def test_greedy_is_argmax_with_first_index_on_ties_and_end_blocked():
    logits = torch.zeros(2, VOCAB_SIZE)
    logits[:, 10] = 5.0
    logits[:, 20] = 5.0
    logits[:, ABC_END] = 9.0
    greedy = es.RowSampling(0, 0.0, 1.0, 1, 1.0, 1, 0, seed=0)
    blocked = es.RowSampling(0, 0.0, 1.0, 1, 1.0, 1, 5, seed=0)
    batch = es.RowBatch.build([greedy, blocked])
    scores = es.masked_scores(logits[:, es.phase_slice(0)], 0, batch, torch.tensor([0, 0]),
                              torch.full((2, 1), -1, dtype=torch.long))
    assert es.choose(scores, 0, batch, torch.tensor([0, 0])).tolist() == [ABC_END, 10]
    assert torch.isinf(scores[:, EOD:ABC_END]).all()


def test_force_leaves_one_greedy_choice():
    logits = torch.randn(3, 100)
    es.force(logits, torch.tensor([0, 2]), torch.tensor([7, 42]))
    assert logits.argmax(-1)[[0, 2]].tolist() == [7, 42]
