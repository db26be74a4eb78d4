import random

import pytest
import torch

from yue2_vllm import vllm_plugin
from yue2_vllm.protocol import CODEC_OFFSET, CODEC_SIZE, EOD, MUSIC_START
from yue2_vllm.vllm_backend import vllm_version
from yue2_vllm.vllm_plugin import apply_window_penalty, penalty_params, recent_windows, reference_penalty


def test_hand_vectors():
    logits = torch.tensor([[0.0, 9.0, 12.0, -2.0], [0.0, 9.0, 12.0, -2.0]])
    states = {0: ([2, 2, 3], 2.0, 3), 1: ([1], 3.0, 2)}
    rows, windows, penalties = recent_windows(states)
    assert windows == [[2, 2, 3], [1, -1, -1]]
    apply_window_penalty(logits, torch.tensor(rows), torch.tensor(windows), torch.tensor(penalties))
    assert logits.tolist() == [[0.0, 9.0, 3.0, -4.0], [0.0, 3.0, 12.0, -2.0]]


def test_matches_torch_backend_penalty_exactly():
    rng = random.Random(0)
    logits = torch.randn(7, 184704, generator=torch.Generator().manual_seed(0)) * 3
    logits[:, :100] = float("-inf")  # masked ids stay masked
    histories = [[rng.randrange(200) for _ in range(rng.randrange(0, 130))] for _ in range(7)]
    settings = [(1.2, 50), (2.0, 3), None, (1.005, 100), (0.7, 10), (3.0, 1), (1.2, 100)]
    states = {i: (histories[i], *s) for i, s in enumerate(settings) if s}
    rows, windows, penalties = recent_windows(states)
    out = logits.clone()
    apply_window_penalty(out, torch.tensor(rows), torch.tensor(windows), torch.tensor(penalties))
    assert torch.equal(out, reference_penalty(logits, histories, settings))


@pytest.mark.parametrize("extra,message", [({"yue2_window_penalty": 0}, "> 0"),
                                           ({"yue2_window_penalty": float("nan")}, "finite"),
                                           ({"yue2_window_penalty": 1.2, "yue2_penalty_window": 101}, "1, 100"),
                                           ({"yue2_window_penalty": 1.2, "yue2_penalty_window": 2.5}, "integer")])
def test_params_validated(extra, message):
    with pytest.raises(ValueError, match=message):
        penalty_params(extra)


def test_params_off_and_defaults():
    assert penalty_params(None) is None and penalty_params({"other": 1}) is None
    assert penalty_params({"yue2_window_penalty": 1.0}) is None
    assert penalty_params({"yue2_window_penalty": 1.2}) == (1.2, 50)


def test_import_does_not_load_vllm():
    import subprocess
    import sys

    code = "import sys, yue2_vllm.vllm_plugin, yue2_vllm.vllm_backend, yue2_vllm.pipeline; print('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_penalty_inside_real_engine_with_mixed_batch(tiny_model_dir, tmp_path_factory, monkeypatch):
    """24 mixed requests (some without the penalty, varied windows and lengths, so vLLM adds, removes and
    moves rows): at every step, every row equals the torch backend's penalty on the same logits, and every
    row's history is the start of the right request's output."""
    from yue2_vllm.derive import derive_ar_checkpoint

    derived = derive_ar_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arcache"))
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
                       "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        monkeypatch.setenv(key, value)
    from vllm import LLM, SamplingParams

    assert vllm_plugin.entry_point_installed()
    processor = vllm_plugin.WindowedPenalty
    records, original = [], processor.apply

    def recording(self, logits):
        before = logits.clone()
        snapshot = {row: (list(out), p, w) for row, (out, p, w) in self.states.items()}
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
    llm = LLM(model=str(derived), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, enforce_eager=True,
              kv_cache_memory_bytes=64 * 2**20, max_num_seqs=8, seed=0)
    rng = random.Random(1)
    allowed = list(range(CODEC_OFFSET, CODEC_OFFSET + CODEC_SIZE))
    settings, params = [], []
    for i in range(24):
        setting = None if i % 3 == 2 else (1.5 + 0.25 * i, 1 + (7 * i) % 100)
        settings.append(setting)
        extra = {"yue2_window_penalty": setting[0], "yue2_penalty_window": setting[1]} if setting else None
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randrange(3, 40), detokenize=False,
                                     allowed_token_ids=allowed, extra_args=extra))
    prompts = [{"prompt_token_ids": [EOD, 100 + i, 200, MUSIC_START]} for i in range(24)]
    try:
        outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()
    by_setting = {s: i for i, s in enumerate(settings) if s}
    steps_seen = [0] * 24
    for before, after, snapshot in records:
        for row in range(before.shape[0]):
            if row in snapshot:
                history, penalty, window = snapshot[row]
                request = by_setting[(penalty, window)]
                assert outputs[request][:len(history)] == history
                steps_seen[request] += bool(history)
                expected = reference_penalty(before[row:row + 1], [history], [(penalty, window)])
            else:
                expected = before[row:row + 1]
            assert torch.equal(after[row:row + 1], expected)
    for request, setting in enumerate(settings):
        assert steps_seen[request] == (len(outputs[request]) - 1 if setting else 0)
    assert sum(steps_seen) > 200 and moves  # the batch really was compacted
