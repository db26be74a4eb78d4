import random

import pytest
import torch

from yue2_vllm.engine import sampling as es
from yue2_vllm.engine import plugin
from yue2_vllm.protocol import CODEC_OFFSET, EOD, MUSIC_END, MUSIC_START, Sampling
from yue2_vllm.engine.backend import vllm_version
from yue2_vllm.engine.plugin import Pairing, RowState, parse_row, row_args, sample_rows, step_layout


def test_row_args_round_trip():
    sampling = Sampling(temperature=0.7, top_k=30, min_tokens=3, max_tokens=9)
    state = parse_row(row_args("semantic", sampling, 42, legacy=True, history=[5, 6]))
    assert state.settings == es.RowSampling(1, 0.7, 0.95, 30, 1.2, 50, 3, 42, True) and state.history == [5, 6]
    assert state.pairing is None and parse_row(None) is None and parse_row({"other": 1}) is None
    paired = parse_row(row_args("abc", sampling, 1, pairing=Pairing("p1", "uncond", 1.5)))
    assert paired.pairing == Pairing("p1", "uncond", 1.5)


@pytest.mark.parametrize("args,message", [
    ({"yue2": 5}, "must be an object"),
    ({"yue2": {"phase": "music", "seed": 1}}, "phase must be one of"),
    ({"yue2": {"phase": "abc", "seed": -1}}, "seed must be an integer"),
    ({"yue2": {"phase": "abc", "seed": True}}, "seed must be an integer"),
    ({"yue2": {"phase": "abc", "seed": 1, "sampling": {"top_p": 0}}}, "top_p"),
    ({"yue2": {"phase": "abc", "seed": 1, "history": [1.5]}}, "history"),
    ({"yue2": {"phase": "abc", "seed": 1, "legacy": "yes"}}, "legacy"),
    ({"yue2": {"phase": "abc", "seed": 1, "pair": "p", "role": "both", "scale": 1.5}}, "role in"),
    ({"yue2": {"phase": "abc", "seed": 1, "pair": "p", "role": "cond", "scale": 25}}, "scale must be"),
])
def test_bad_row_args_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        parse_row(args)


def test_recent_history_spans_accepted_and_generated_tokens():
    settings = es.RowSampling(1, 1.0, 1.0, 10, 1.2, 4, 0, 0)
    row = RowState(settings, [7, 8], history=[1, 2, 3, 4, 5])
    assert row.step == 7 and row.recent() == [4, 5, 7, 8]
    assert RowState(settings, [1, 2, 3, 4, 5, 6]).recent() == [3, 4, 5, 6]
    assert RowState(settings, [7], history=[1, 2]).recent() == [1, 2, 7]  # the window is longer than both


def test_pairs_are_guided_together_and_lone_rows_get_the_sentinel():
    """Rows 0/1: an aligned pair (one guided token in both); rows 2/3: a pair one step apart; row 4: no
    partner; row 5: a single row. Guided = the single-row draw on the bf16-mixed logits."""
    sampling = Sampling(temperature=1.0, top_k=50, min_tokens=0, max_tokens=100)

    def row(role, pair, output, seed=3):
        args = row_args("semantic", sampling, seed, pairing=Pairing(pair, role, 1.5) if role else None)
        state = parse_row(args)
        state.output_ids = output
        return state

    rows = {0: row("cond", "a", [CODEC_OFFSET + 1]), 1: row("uncond", "a", [CODEC_OFFSET + 1]),
            2: row("cond", "b", [CODEC_OFFSET + 1]), 3: row("uncond", "b", []), 4: row("cond", "c", []),
            5: row(None, None, [])}
    logits = (torch.randn(6, 184704, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16).float()
    original = logits.clone()
    sample_rows(logits, rows, step_layout(rows, torch.device("cpu"), {}), torch.bfloat16)
    tokens = logits.argmax(-1).tolist()
    assert tokens[0] == tokens[1] and tokens[2] == tokens[3] == tokens[4] == es.PAIR_SENTINEL
    mixed = es.mix_guidance(original[0:1].to(torch.bfloat16), original[1:2].to(torch.bfloat16),
                            torch.tensor([1.5])).float()
    single = parse_row(row_args("semantic", sampling, 3))
    single.output_ids = [CODEC_OFFSET + 1]
    reference = mixed.repeat(1, 1)
    sample_rows(reference, {0: single}, step_layout({0: single}, torch.device("cpu"), {}), torch.bfloat16)
    assert reference.argmax(-1).item() == tokens[0] != es.PAIR_SENTINEL
    assert CODEC_OFFSET <= tokens[5] < CODEC_OFFSET + 32768


def test_import_does_not_load_vllm():
    import subprocess
    import sys

    code = "import sys, yue2_vllm.engine.plugin, yue2_vllm.engine.backend, yue2_vllm.pipeline; print('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_sampler_inside_real_engine_with_mixed_batch(tiny_model_dir, tmp_path_factory, monkeypatch):
    """24 requests (a third of them plain vLLM requests, the rest YuE2 rows with varied settings and
    lengths, so vLLM adds, removes and moves rows): every YuE2 token is what the sampler draws for
    that row alone from the same logits, and the plain rows are left to vLLM."""
    from yue2_vllm.derive import derive_ar_checkpoint

    derived = derive_ar_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arcache"))
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
                       "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        monkeypatch.setenv(key, value)
    from vllm import LLM, SamplingParams

    processor = plugin.YuE2Sampler
    records, original = [], processor.apply

    def recording(self, logits):
        before = logits.clone()
        snapshot = {row: (state.settings, list(state.recent()), state.step) for row, state in self.rows.items()}
        after = original(self, logits)
        records.append((before, after.clone(), snapshot))
        return after

    moves, original_update = [], processor.update_state

    def counting(self, batch_update):
        if batch_update is not None:
            moves.extend(batch_update.moved)
        return original_update(self, batch_update)

    monkeypatch.setattr(processor, "apply", recording)
    monkeypatch.setattr(processor, "update_state", counting)
    llm = LLM(model=str(derived), skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True,
              kv_cache_memory_bytes=64 * 2**20, max_num_seqs=8, seed=0, logits_processors=[plugin.FQCNS["v1"]])
    rng = random.Random(1)
    params, seeds = [], []
    for i in range(24):
        max_tokens = rng.randrange(3, 40)
        if i % 3 == 2:
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True))
            seeds.append(None)
            continue
        sampling = Sampling(temperature=[0.0, 1.0, 0.7][i % 3], top_k=[1, 30, 100][i % 3], top_p=0.9,
                            repetition_penalty=1.5 + 0.25 * i, penalty_window=1 + (7 * i) % 100, min_tokens=2,
                            max_tokens=max_tokens)
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[MUSIC_END],
                                     ignore_eos=True, detokenize=False, extra_args=row_args("semantic", sampling, i)))
        seeds.append(i)
    prompts = [{"prompt_token_ids": [EOD, 100 + i, 200, MUSIC_START]} for i in range(24)]
    try:
        outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()
    steps_seen = [0] * 24
    for before, after, snapshot in records:
        for row in range(before.shape[0]):
            if row not in snapshot:
                assert torch.equal(after[row], before[row])  # a plain request: untouched
                continue
            settings, recent, step = snapshot[row]
            request = seeds.index(settings.seed)
            scores = es.masked_scores(before[row:row + 1, es.phase_slice(1)], 1, es.RowBatch.build([settings]),
                                      torch.tensor([step]), torch.tensor(es.local_windows([recent], 1)).reshape(1, -1))
            token = int(es.choose(scores, 1, es.RowBatch.build([settings]), torch.tensor([step]))[0])
            assert outputs[request][step] == token and after[row].argmax() == token
            steps_seen[request] += 1
    for request, seed in enumerate(seeds):
        if seed is not None:
            assert steps_seen[request] == len(outputs[request])
            assert all(CODEC_OFFSET <= t or t == MUSIC_END for t in outputs[request])
    assert moves  # the batch really was compacted
