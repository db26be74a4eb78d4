"""The batched-branch decode step (capture-ready) against the two-forward path, in float32 on the CPU."""
import pytest
import torch
from torch import nn

from yue2_vllm.model import decode_step
from yue2_vllm.model.decode_step import BranchDecoder, PhaseRows, graph_refusal, select_attention
from yue2_vllm.model.sampling import TorchARBackend, resolve_execution
from yue2_vllm.model.torch_quant import FP8Linear, prepare_ar_proxies, restore_ar
from yue2_vllm.protocol import ABC_END, CODEC_OFFSET, CODEC_SIZE, EOD, MUSIC_END, MUSIC_START, Sampling
from yue2_vllm.testing import TINY_CONFIG, random_model

PREFIX = [EOD] + list(range(100, 131))
NEGATIVE = [EOD, 40, 41, MUSIC_START]
FEED = [CODEC_OFFSET + 7 * i for i in range(8)]  # the shared tokens fed to every branch


@pytest.fixture(scope="module")
def model32():
    return random_model(TINY_CONFIG, 0).float()


def reference_logits(model, prefix, tokens, rows):
    """Today's path: one static cache per branch, one forward per token; logits on the phase's rows."""
    cache = model.new_cache(len(prefix) + len(tokens) + 1)
    ids = rows.ids()
    out = [model.forward_ar(torch.tensor([prefix]), cache)[0, -1, ids]]
    for token in tokens:
        out.append(model.forward_ar(torch.tensor([[token]]), cache)[0, -1, ids])
    return torch.stack(out)


def test_phase_rows_are_the_allowed_ids_in_vocabulary_order():
    semantic, abc = PhaseRows.for_phase("semantic"), PhaseRows.for_phase("abc")
    assert semantic.ranges == ((MUSIC_END, CODEC_OFFSET + CODEC_SIZE),) and semantic.size == CODEC_SIZE + 1
    assert abc.ranges == ((0, EOD), (ABC_END, ABC_END + 1)) and abc.size == EOD + 1
    assert abc.index_of(ABC_END) == EOD and semantic.index_of(CODEC_OFFSET) == 1
    assert abc.ids()[-2:].tolist() == [EOD - 1, ABC_END]
    with pytest.raises(ValueError, match="not among the phase's rows"):
        semantic.index_of(EOD)
    with pytest.raises(ValueError, match="phase must be"):
        PhaseRows.for_phase("lyrics")


@pytest.mark.parametrize("branches", [1, 2])
def test_batched_step_equals_the_two_forward_path_over_the_whole_budget(model32, branches):
    rows = PhaseRows.for_phase("semantic")
    prefixes = [PREFIX, NEGATIVE][:branches]
    budget = len(FEED) + 1
    decoder = BranchDecoder(model32, prefixes, budget, rows=rows)
    got = [decoder.prefill()]
    for token in FEED:
        got.append(decoder.step(torch.tensor([[token]])).clone())
    got = torch.stack(got, dim=1)  # [branches, tokens, rows]
    for branch, prefix in enumerate(prefixes):
        want = reference_logits(model32, prefix, FEED, rows)
        torch.testing.assert_close(got[branch], want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[branch].argmax(-1), want.argmax(-1))
    with pytest.raises(ValueError, match=f"budget of {budget} tokens is exhausted"):
        decoder.step(torch.tensor([FEED[0]]))
    assert decoder.positions.tolist() == [len(p) + len(FEED) for p in prefixes]


def test_buffers_are_never_reallocated_and_branches_stay_isolated(model32):
    rows = PhaseRows.for_phase("abc")
    pair = BranchDecoder(model32, [PREFIX, NEGATIVE], 6, rows=rows)
    pointers = [t.data_ptr() for t in (*pair.keys, *pair.values, pair.positions, pair.tokens)]
    untouched = pair.keys[0][1, len(NEGATIVE) + 5:].clone()
    pair_logits = [pair.prefill()] + [pair.step(torch.tensor([t])) for t in (5, 6, 7, 8, 9)]
    assert [t.data_ptr() for t in (*pair.keys, *pair.values, pair.positions, pair.tokens)] == pointers
    assert torch.equal(pair.keys[0][1, len(NEGATIVE) + 5:], untouched)  # nothing beyond a row's used length
    # A different negative branch leaves the positive row's logits exactly as they were (and vice versa).
    other = BranchDecoder(model32, [PREFIX, NEGATIVE[:2]], 6, rows=rows)
    other_logits = [other.prefill()] + [other.step(torch.tensor([t])) for t in (5, 6, 7, 8, 9)]
    single = BranchDecoder(model32, [PREFIX], 6, rows=rows)
    single_logits = [single.prefill()] + [single.step(torch.tensor([t])) for t in (5, 6, 7, 8, 9)]
    for a, b, s in zip(pair_logits, other_logits, single_logits):
        assert torch.equal(a[0], b[0])
        torch.testing.assert_close(a[0], s[0], rtol=1e-5, atol=1e-5)
        assert not torch.equal(a[1], b[1])


def test_decoder_refuses_bad_input_and_capture_off_cuda(model32):
    rows = PhaseRows.for_phase("semantic")
    with pytest.raises(ValueError, match="CUDA graph capture needs a CUDA device; the model is on cpu"):
        BranchDecoder(model32, [PREFIX], 4, rows=rows, capture=True)
    with pytest.raises(ValueError, match="one prefix or a CFG pair"):
        BranchDecoder(model32, [PREFIX] * 3, 4, rows=rows)
    with pytest.raises(ValueError, match="exceed the 24576-token context"):
        BranchDecoder(model32, [[EOD] * 20000], 5000, rows=rows)
    with pytest.raises(ValueError, match="non-empty token ids"):
        BranchDecoder(model32, [[]], 4, rows=rows)
    decoder = BranchDecoder(model32, [PREFIX], 4, rows=rows)
    with pytest.raises(RuntimeError, match="call prefill"):
        decoder.step(torch.tensor([1]))
    decoder.prefill()
    with pytest.raises(ValueError, match="one shared integer token"):
        decoder.step(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="one shared integer token"):
        decoder.step(torch.tensor([1, 2]))


def test_attention_choice_is_what_the_device_offers():
    assert select_attention(torch.device("cpu"), torch.float32, 128) == "sdpa_masked"
    with pytest.raises(ValueError, match="flash_varlen is unavailable: FlashAttention runs on CUDA only"):
        select_attention(torch.device("cpu"), torch.bfloat16, 128, "flash_varlen")
    missing = decode_step.flash_varlen_available(torch.device("cuda"), torch.float32, 128)
    assert "bf16/fp16" in missing
    with pytest.raises(ValueError, match="attention must be one of"):
        select_attention(torch.device("cpu"), torch.float32, 128, "cudnn")


@pytest.mark.parametrize("phase,cfg", [("semantic", 1.0), ("semantic", 1.5), ("abc", 1.5)])
def test_backend_batched_gives_todays_tokens_in_float32(model32, phase, cfg):
    kwargs = {"negative": NEGATIVE, "cfg_scale": cfg} if cfg != 1.0 else {}
    sampling = Sampling(min_tokens=3, max_tokens=14, repetition_penalty=1.3, penalty_window=4)
    eager = TorchARBackend(model32, "eager").generate(PREFIX, sampling, 5, phase, **kwargs)
    streamed = []
    batched = TorchARBackend(model32, "batched").generate(PREFIX, sampling, 5, phase,
                                                           on_token=lambda p, t: streamed.append(t), **kwargs)
    assert batched.ids == eager.ids and len(batched.ids) == 14 and batched.truncated
    assert streamed == batched.ids
    assert batched.timing["execution"] == "batched" and batched.timing["attention"] == "sdpa_masked"
    assert batched.timing["cfg_branches"] == eager.timing["cfg_branches"] == (2 if cfg != 1.0 else 1)
    assert eager.timing["execution"] == "eager" and eager.timing["attention"] == "sdpa"
    assert eager.timing["graph_fallback_reason"] == "eager requested (--torch-execution eager)"


def test_backend_batched_legacy_greedy_and_the_end_token(model32):
    sampling = Sampling(temperature=0.0, min_tokens=0, max_tokens=6)
    runs = [TorchARBackend(model32, mode).generate(PREFIX, sampling, 0, "semantic", negative=NEGATIVE,
                                                   cfg_scale=1.01, legacy_off=True) for mode in ("eager", "batched")]
    assert runs[0].ids == runs[1].ids
    seen = {}
    with torch.no_grad():
        saved = model32.lm_head.weight[ABC_END].clone()
        model32.lm_head.weight[ABC_END] = model32.model.norm.weight * 3
        try:
            for mode in ("eager", "batched"):
                seen[mode] = []
                result = TorchARBackend(model32, mode).generate(
                    PREFIX[:9], Sampling(min_tokens=4, max_tokens=20), 1, "abc",
                    on_token=lambda phase, t, mode=mode: seen[mode].append(t))
                assert len(result.ids) >= 4 and not result.truncated
                assert result.timing["output_tokens"] == len(result.ids) + 1
        finally:
            model32.lm_head.weight[ABC_END] = saved
    assert seen["eager"] == seen["batched"] and seen["batched"][-1] == ABC_END


def test_backend_batched_cancellation(model32):
    emitted = []
    with pytest.raises(InterruptedError, match="after 3 tokens"):
        TorchARBackend(model32, "batched").generate(PREFIX, Sampling(min_tokens=0, max_tokens=50), 0, "semantic",
                                                    on_token=lambda p, t: emitted.append(t),
                                                    cancelled=lambda: len(emitted) >= 3)


def test_execution_choice_and_its_reasons(monkeypatch):
    assert resolve_execution("auto", torch.device("cuda")) == ("cuda_graph", None)
    assert resolve_execution("graph", torch.device("cuda:1")) == ("cuda_graph", None)
    execution, reason = resolve_execution("auto", torch.device("cpu"))
    assert execution == "eager" and reason.startswith("non_cuda_device:")
    assert resolve_execution("auto", torch.device("mps"))[0] == "eager"
    with pytest.raises(ValueError, match="--torch-execution graph needs a CUDA device; the model is on cpu"):
        resolve_execution("graph", torch.device("cpu"))
    with pytest.raises(ValueError, match="torch execution must be one of"):
        resolve_execution("fast", torch.device("cpu"))
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert resolve_execution("auto", torch.device("cuda"))[1].startswith("rocm_not_graph_validated")
    with pytest.raises(ValueError, match="not validated on ROCm"):
        resolve_execution("graph", torch.device("cuda"))


def test_graph_policy_for_bf16_int8_and_fp8_proxies():
    model = random_model(TINY_CONFIG, 1)
    assert graph_refusal(model) is None
    prepare_ar_proxies(model, "int8")
    assert graph_refusal(model) is None  # packed kernel or dequantise + F.linear: plain device ops
    restore_ar(model)
    layer = model.model.layers[1]
    layer.mlp.up_proj = FP8Linear.from_linear(layer.mlp.up_proj)  # _scaled_mm on CUDA: scales stay on the device
    assert graph_refusal(model) is None
    layer.mlp.up_proj = FP8Linear.from_linear(nn.Linear(128, 256, bias=False), reference=True)
    assert graph_refusal(model) == ("layer 1 up_proj is an FP8 reference proxy (dequantising, for tests): not "
                                    "validated for CUDA graph capture")
    layer.self_attn.q_proj = nn.Identity()
    assert graph_refusal(model).startswith("layer 1 q_proj is Identity")


class _CaptureFails(BranchDecoder):
    """Stands in for a CUDA capture that fails (this machine has no GPU): the step itself is real."""

    def __init__(self, *args, capture=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.capture = capture

    def _capture(self):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def test_a_refused_or_failed_capture_decodes_the_phase_eagerly_on_the_record(model32, monkeypatch):
    sampling = Sampling(min_tokens=0, max_tokens=5)
    want = TorchARBackend(model32, "eager").generate(PREFIX, sampling, 2, "semantic").ids
    backend = TorchARBackend(model32, "auto")
    backend.execution, backend.execution_reason = "cuda_graph", None  # as resolved on a GPU
    monkeypatch.setattr("yue2_vllm.model.sampling.BranchDecoder", _CaptureFails)
    result = backend.generate(PREFIX, sampling, 2, "semantic")
    assert result.ids == want and result.timing["execution"] == "eager"
    assert result.timing["graph_fallback_reason"] == (
        "capture_failed: RuntimeError: CUDA error: operation not permitted when stream is capturing")
    monkeypatch.setattr("yue2_vllm.model.sampling.graph_refusal", lambda model: "layer 0 q_proj is Odd")
    result = backend.generate(PREFIX, sampling, 2, "semantic")
    assert result.ids == want and result.timing["execution"] == "eager"
    assert result.timing["graph_fallback_reason"] == "layer 0 q_proj is Odd"
