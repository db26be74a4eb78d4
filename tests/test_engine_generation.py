"""A phase's prompts checked and its run's record, without an engine."""
import pytest

from yue2_vllm.engine.generation import PhaseTiming, phase_prompts
from yue2_vllm.protocol import EOD

# A single row's record on the CPU engine, in the order result.json holds it (runner and signals abridged).
RECORD_KEYS = ["seconds", "ttft_seconds", "output_tokens", "content_tokens", "output_tps", "prefix_tokens",
               "cfg_branches", "backend_actual", "vllm_version", "engine_dtype", "kv_cache_dtype", "kv_cache",
               "max_num_seqs", "kv_cache_memory_bytes", "kv_reserved_bytes", "mean_batch_rows", "unified_memory",
               "vllm_runner", "admission_wait_seconds", "engine_restarts", "ar_checkpoint", "mean_logprob",
               "cached_prompt_tokens"]


def timing(**changes) -> PhaseTiming:
    fields = dict(seconds=2.0, ttft_seconds=None, output_tokens=48, content_tokens=47, prefix_tokens=123,
                  cfg_branches=1, vllm_version="0.32.0", engine_dtype="bfloat16", kv_cache_dtype="auto",
                  kv_cache={"layers": 2}, max_num_seqs=16, kv_cache_memory_bytes=2**24, kv_reserved_bytes=98304,
                  mean_batch_rows=1.0, runner={"unified_memory": False, "vllm_runner": "v1"},
                  admission_wait_seconds=0.0, engine_restarts=0, ar_checkpoint={"source": "derived"},
                  signals={"mean_logprob": -8.5, "cached_prompt_tokens": 0})
    return PhaseTiming(**{**fields, **changes})


def test_the_record_is_the_fields_in_order_with_runner_and_signals_spread():
    record = timing().as_dict()
    assert list(record) == RECORD_KEYS
    assert record["output_tps"] == 24.0 and record["backend_actual"] == "vllm"
    assert record["ttft_seconds"] is None  # recorded as None, not left out: only the optional fields are
    assert timing(seconds=0.0).as_dict()["output_tps"] == 0.0


def test_a_pair_continued_with_an_adapter_on_a_fresh_engine_adds_its_keys_in_place():
    record = timing(cfg_branches=2, lora="voice", continued_tokens=140, cfg_scale=1.5, pair_restarts=0,
                    engine_load_seconds=8.5).as_dict()
    assert list(record) == (RECORD_KEYS[:RECORD_KEYS.index("ar_checkpoint")] + ["lora"]
                            + RECORD_KEYS[RECORD_KEYS.index("ar_checkpoint"):]
                            + ["continued_tokens", "continuation", "cfg_scale", "pair_restarts",
                               "engine_load_seconds"])
    assert (record["continuation"], record["pair_restarts"]) == ("prefilled", 0)


def test_prompts_are_one_row_or_a_pair_within_the_budgets():
    assert phase_prompts([EOD, 5], None, 1.0, 10, "abc", 100) == [[EOD, 5]]
    assert phase_prompts((EOD, 5), (EOD,), 1.5, 10, "semantic", 100) == [[EOD, 5], [EOD]]
    with pytest.raises(ValueError, match=r"cfg_scale != 1 needs a negative \(unconditional\) prompt"):
        phase_prompts([EOD], None, 1.5, 10, "semantic", 100)
    with pytest.raises(ValueError, match="semantic negative prompt \\+ max_tokens exceeds the engine's "
                                         "max_model_len 12"):
        phase_prompts([EOD], [EOD] * 3, 1.5, 10, "semantic", 12)
    with pytest.raises(ValueError, match="abc prompt of 20000 tokens \\+ max_tokens 5000 = 25000 exceeds the "
                                         "24576-token context"):
        phase_prompts([EOD] * 20000, None, 1.0, 5000, "abc", 10**6)
