"""Adapters on the torch MoT: run time equals merged, removal is exact, songs' rows do not leak into each other."""
import threading

import pytest
import torch

from yue2_vllm.model.lora import (Additive, LowRank, Replacement, Segment, applied, check_edits, effective_weights,
                                  merge_state_dict, merged)
from yue2_vllm.model.modeling import CachedNAR, batched_velocities
from yue2_vllm.model.nar import SongInput, synthesize, synthesize_many
from yue2_vllm.testing import TINY_CONFIG, random_model, tiny_state_dict

IDS = torch.tensor([[151643, 5, 6, 7, 8, 9, 10]])
PREFIX = [151643, 5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def model32():
    return random_model().float()


def low_rank(module_shape, rank=4, seed=0, scale=1.0, zero_b=False):
    generator = torch.Generator().manual_seed(seed)
    out_features, in_features = module_shape
    a = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
    b = torch.zeros(out_features, rank) if zero_b else torch.randn(out_features, rank, generator=generator) / rank ** 0.5
    return LowRank(a, b, scale)


def ar_edits(model, seed=0, scale=0.75, zero_b=False, sites=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")):
    edits = {}
    for layer in range(model.config.num_hidden_layers):
        for index, site in enumerate(sites):
            name = f"model.layers.{layer}.{site}"
            linear = model.get_submodule(name)
            edits[name] = [low_rank((linear.out_features, linear.in_features), seed=seed + 10 * layer + index,
                                    scale=scale, zero_b=zero_b)]
    return edits


def nar_edits(model, seed=100):
    edits = {name.replace("self_attn", "nar_self_attn").replace("mlp", "nar_mlp"): value
             for name, value in ar_edits(model, seed).items()}
    generator = torch.Generator().manual_seed(seed)
    weight = model.vae2llm.weight
    edits["vae2llm"] = [Replacement(0.1 * torch.randn(weight.shape, generator=generator),
                                    0.05 * torch.randn(weight.shape[0], generator=generator))]
    edits["llm2vae"] = [Additive(0.01 * torch.randn(model.llm2vae.weight.shape, generator=generator), None, 0.5)]
    edits["time_embedder.mlp.2"] = [low_rank(model.time_embedder.mlp[2].weight.shape, seed=seed + 1)]
    return edits


def snapshot(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_a_zero_b_adapter_gives_the_base_exactly(model32):
    base = model32.forward_ar(IDS, logits_to_keep=0)
    with applied(model32, ar_edits(model32, zero_b=True)):
        assert torch.equal(model32.forward_ar(IDS, logits_to_keep=0), base)


def test_run_time_equals_merged_and_the_base_stays_bit_exact(model32):
    before = snapshot(model32)
    base = model32.forward_ar(IDS, logits_to_keep=0)
    edits = ar_edits(model32)
    with applied(model32, edits):
        run_time = model32.forward_ar(IDS, logits_to_keep=0)
    weights = [model32.get_submodule(name)._parameters["weight"] for name in edits]
    with merged(model32, edits):
        merged_logits = model32.forward_ar(IDS, logits_to_keep=0)
    assert (run_time - base).abs().max() > 0.1  # the adapter does something
    torch.testing.assert_close(run_time, merged_logits, rtol=0, atol=2e-5)
    assert torch.equal(model32.forward_ar(IDS, logits_to_keep=0), base)
    assert all(model32.get_submodule(name)._parameters["weight"] is weight for name, weight in zip(edits, weights))
    after = snapshot(model32)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_replacement_and_additive_edits_equal_merged_exactly_and_are_removed_exactly(model32):
    before = snapshot(model32)
    edits = {name: value for name, value in nar_edits(model32).items() if name in ("vae2llm", "llm2vae")}
    x = torch.randn(1, 5, TINY_CONFIG.latent_dim, generator=torch.Generator().manual_seed(3))
    hidden = torch.randn(1, 5, TINY_CONFIG.hidden_size, generator=torch.Generator().manual_seed(4))
    base = model32.vae2llm(x), model32.llm2vae(hidden)
    with applied(model32, edits):
        run_time = model32.vae2llm(x), model32.llm2vae(hidden)
    with merged(model32, edits):
        merged_out = model32.vae2llm(x), model32.llm2vae(hidden)
        assert torch.equal(model32.vae2llm.weight, edits["vae2llm"][0].weight)  # strength 1: the tensor itself
    assert all(torch.equal(a, b) for a, b in zip(run_time, merged_out))
    assert not torch.equal(run_time[0], base[0]) and not torch.equal(run_time[1], base[1])
    assert all(torch.equal(a, b) for a, b in zip((model32.vae2llm(x), model32.llm2vae(hidden)), base))
    assert all(torch.equal(before[name], tensor) for name, tensor in model32.state_dict().items())


def test_effective_weights_follow_the_rules():
    weight, bias = torch.randn(6, 4), torch.randn(6)
    full, diff = torch.randn(6, 4), torch.randn(6, 4)
    pair = LowRank(torch.randn(2, 4), torch.randn(6, 2), 0.5)
    merged_weight, merged_bias = effective_weights(weight, bias, [pair, Additive(diff, None, 2.0),
                                                                  Replacement(full, None, 0.25)])
    expected = weight + 0.25 * (full - weight) + 2.0 * diff + 0.5 * pair.b @ pair.a  # replacements first
    torch.testing.assert_close(merged_weight, expected)
    assert torch.equal(merged_bias, bias)
    assert torch.equal(effective_weights(weight, None, [Replacement(full)])[0], full)
    with pytest.raises(TypeError, match="quantized"):
        effective_weights(torch.zeros(6, 4, dtype=torch.int8), None, [pair])
    with pytest.raises(ValueError, match="has none"):
        effective_weights(weight, None, [Additive(None, torch.ones(6))])
    state = merge_state_dict({"x.weight": weight, "x.bias": bias}, {"x": [pair]})
    torch.testing.assert_close(state["x.weight"], weight + 0.5 * pair.b @ pair.a)


def test_edits_are_checked_against_the_model(model32):
    with pytest.raises(KeyError, match="no module 'model.layers.9.self_attn.q_proj'"):
        check_edits(model32, {"model.layers.9.self_attn.q_proj": [low_rank((128, 128))]})
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj: an edit of shape \[128, 128\]"):
        check_edits(model32, {"model.layers.0.self_attn.k_proj": [low_rank((128, 128))]})
    with pytest.raises(TypeError, match="not a linear"):
        check_edits(model32, {"model.norm": [low_rank((128, 128))]})
    with pytest.raises(ValueError, match="low-rank factors"):
        LowRank(torch.zeros(4, 8), torch.zeros(8, 3))


def test_segments_give_each_row_range_its_own_edits(model32):
    q = model32.model.layers[0].self_attn.q_proj
    one, two = low_rank((128, 128), seed=1), low_rank((128, 128), seed=2)
    x = torch.randn(1, 9, 128, generator=torch.Generator().manual_seed(5))
    name = "model.layers.0.self_attn.q_proj"
    with applied(model32, [Segment({name: [one]}, 0, 3), Segment({name: [two]}, 6, 9)]):
        together = q(x)
    with applied(model32, {name: [one]}):
        first = q(x[:, :3])
    with applied(model32, {name: [two]}):
        last = q(x[:, 6:])
    # A 9-row and a 3-row matmul may block the sums differently (the CPU's kernels choose by shape: AVX2 and
    # AVX-512 differ), so the rows agree to the float32 bound of two evaluations of the same sums, not bit for bit.
    assert_within_float32_sums(together[:, :3], first, x[:, :3], q.weight, one)
    assert_within_float32_sums(together[:, 6:], last, x[:, 6:], q.weight, two)
    assert torch.equal(together[:, 3:6], q(x)[:, 3:6])  # rows of no segment: the base output, untouched (same shape)


def assert_within_float32_sums(got, want, x, weight, edit):
    """`got` and `want` are two float32 evaluations of `x @ weight.T + scale · (x @ a.T) @ b.T`, summed in any order.
    Each is within K·u·(|x| @ |W|.T + scale · (|x| @ |a|.T) @ |b|.T) of the exact value (K the longest sum, here the
    in-features; u the unit roundoff, half of torch's eps; the rank's shorter sums and the final add fit in the
    slack of that bound's first-order form), so they differ by at most twice that: K·eps·(...)."""
    magnitude = x.abs() @ weight.abs().T + edit.scale * (x.abs() @ edit.a.abs().T) @ edit.b.abs().T
    bound = weight.shape[1] * torch.finfo(torch.float32).eps * magnitude
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() - bound).max()


def test_edits_are_per_thread(model32):
    edits = ar_edits(model32)
    base = model32.forward_ar(IDS, logits_to_keep=0)
    with applied(model32, edits):
        adapted = model32.forward_ar(IDS, logits_to_keep=0)
    seen, ready, release = {}, threading.Event(), threading.Event()

    def plain():
        ready.wait()
        seen["plain"] = model32.forward_ar(IDS, logits_to_keep=0)
        release.set()

    thread = threading.Thread(target=plain)
    thread.start()
    with applied(model32, edits):
        ready.set()
        release.wait(30)  # the other thread ran its forward while this one's edits were active
        seen["adapted"] = model32.forward_ar(IDS, logits_to_keep=0)
    thread.join()
    assert torch.equal(seen["plain"], base) and torch.equal(seen["adapted"], adapted)


def test_the_nar_with_an_ar_adapter_equals_the_merged_models_latents(model32):
    codec = list(range(40))
    edits = ar_edits(model32, seed=7, scale=1.0)
    base = synthesize(model32, PREFIX, codec, seed=3, steps=4)
    adapted = synthesize(model32, PREFIX, codec, seed=3, steps=4, edits=edits)
    with merged(model32, edits):
        reference = synthesize(model32, PREFIX, codec, seed=3, steps=4)
    assert (adapted - base).abs().max() > 1e-3  # the prefix K/V the NAR attends to changed
    torch.testing.assert_close(adapted, reference, rtol=0, atol=1e-4)
    torch.testing.assert_close(synthesize(model32, PREFIX, codec, seed=3, steps=4), base, rtol=0, atol=0)


def test_different_adapters_side_by_side_in_one_synthesis_batch_do_not_leak(model32):
    both = {**ar_edits(model32, seed=7), **nar_edits(model32)}
    other = nar_edits(model32, seed=300)
    songs = [SongInput(PREFIX, list(range(30)), 1, edits=both), SongInput(PREFIX, list(range(20, 45)), 2),
             SongInput(PREFIX, list(range(5, 40)), 3, edits=other)]
    together = synthesize_many(model32, songs, steps=3)
    solo = [synthesize(model32, s.prefix, s.codec, s.seed, steps=3, edits=s.edits) for s in songs]
    for got, want in zip(together, solo):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert (solo[0] - synthesize(model32, PREFIX, list(range(30)), 1, steps=3)).abs().max() > 1e-3
    with merged(model32, both):  # the merged model's latents, replacements and time-embedder LoRA included
        torch.testing.assert_close(synthesize(model32, PREFIX, list(range(30)), 1, steps=3), together[0],
                                   rtol=0, atol=1e-4)


def test_batched_velocities_with_edits_equal_single_ones(model32):
    edits = nar_edits(model32)
    nars = [CachedNAR(model32, PREFIX + [151700], 4, edits=edits), CachedNAR(model32, PREFIX, 6)]
    states = [torch.randn(4, 64, generator=torch.Generator().manual_seed(1)),
              torch.randn(6, 64, generator=torch.Generator().manual_seed(2))]
    together = batched_velocities(nars, states, 0.3)
    for nar, state, got in zip(nars, states, together):
        torch.testing.assert_close(got, nar.velocity(state, 0.3), rtol=0, atol=1e-5)


def test_a_bf16_model_keeps_its_weights_bit_exact():
    model = random_model()
    before = tiny_state_dict()
    with applied(model, ar_edits(model)):
        model.forward_ar(IDS)
    with merged(model, ar_edits(model)):
        model.forward_ar(IDS)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items()
               if name in before)
