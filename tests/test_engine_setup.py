"""What the engine is set up as, decided from its settings without starting it."""
from dataclasses import replace

import pytest

from yue2_vllm.derive import ARCheckpoint
from yue2_vllm.engine.backend import EngineSettings
from yue2_vllm.engine.plugin import MODEL_ARCHITECTURE, processor_fqcn
from yue2_vllm.engine.runner import BatchInvariance
from yue2_vllm.engine.setup import EngineSetup
from yue2_vllm.testing import TINY_CONFIG


@pytest.fixture
def checkpoint(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1024)
    return ARCheckpoint(tmp_path, "derived", None)


def test_a_cpu_float32_engine_is_set_up_sliced_and_batch_invariant(checkpoint):
    setup = EngineSetup.resolve(TINY_CONFIG, EngineSettings(checkpoint, max_num_seqs=4, dtype="float32"), "0.32.0")
    assert setup.settings.max_num_seqs == 4 and setup.settings.threads >= 1  # resolved once, here
    assert (setup.runner.runner, setup.runner.async_scheduling) == ("v1", False)
    assert setup.sliced_head and set(setup.sliced_head_phases) == {"abc", "semantic"}
    assert setup.invariance.how == "float32 engine (vLLM-CPU)"
    frame = setup.worker_setup()
    assert (frame["model"], frame["max_num_seqs"], frame["enforce_eager"], frame["dtype"]) == \
        (str(checkpoint.path), 4, True, "float32")
    assert frame["architecture"] == MODEL_ARCHITECTURE and frame["logits_processors"] == [processor_fqcn("v1")]
    assert frame["block_size"] == setup.plan.kv_block_tokens and "lora" not in frame
    assert setup.describe(None)["kv_cache"] is None and setup.describe(None)["batch_invariant"] is True


def test_a_model_without_yue2s_token_layout_gets_the_full_head(checkpoint):
    setup = EngineSetup.resolve(replace(TINY_CONFIG, vocab_size=1000), EngineSettings(checkpoint), "0.32.0")
    assert (setup.sliced_head, setup.sliced_head_reason, setup.sliced_head_phases) == \
        (False, "not YuE2's token layout", None)
    assert "architecture" not in setup.worker_setup() and setup.invariance is None  # bf16: no invariance


def test_a_batch_invariance_that_needs_another_dtype_is_refused(checkpoint):
    invariance = BatchInvariance("float32", {}, "float32 engine (vLLM-CPU)")
    with pytest.raises(ValueError, match=r"needs dtype float32 \(float32 engine \(vLLM-CPU\)\), got bfloat16"):
        EngineSetup.resolve(TINY_CONFIG, EngineSettings(checkpoint, batch_invariance=invariance), "0.32.0")
