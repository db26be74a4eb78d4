"""Engine admission: rows and worst-case KV held by requests and given back, without an engine."""
import threading
import time

import pytest

from yue2_vllm.derive import ARCheckpoint
from yue2_vllm.engine.admission import EngineAdmission, kv_budget, prompts_kv_bytes
from yue2_vllm.engine.backend import EngineSettings
from yue2_vllm.memory import kv_bytes_per_token
from yue2_vllm.testing import TINY_CONFIG


def test_a_request_waits_until_its_rows_and_kv_are_free():
    admission = EngineAdmission(rows=2, kv_budget=100)
    entered = threading.Event()

    def second():
        with admission.admitted(1, 50):
            entered.set()

    with admission.admitted(1, 60) as waited:
        assert waited >= 0 and admission.load == {"rows_used": 1, "kv_used": 60}
        thread = threading.Thread(target=second)
        thread.start()
        assert not entered.wait(0.3)  # a row is free, but 60 + 50 bytes of KV are more than the engine has
    thread.join(10)
    assert entered.is_set() and admission.load == {"rows_used": 0, "kv_used": 0}


def test_more_than_the_engine_has_is_refused_and_a_cancel_ends_the_wait():
    admission = EngineAdmission(rows=2, kv_budget=2 * 2**20)
    with pytest.raises(ValueError, match=r"needs 3 engine row\(s\) and 1.0 MiB of KV cache, but the engine has 2 "
                                         r"rows and 2.0 MiB"):
        with admission.admitted(3, 2**20):
            pass
    with admission.admitted(2, 0):
        with pytest.raises(InterruptedError, match="cancelled while waiting for an engine row"):
            with admission.admitted(1, 0, cancelled=lambda: True):
                pass
    assert admission.load == {"rows_used": 0, "kv_used": 0}  # nothing held after either


def test_without_kv_admission_only_rows_count():
    admission = EngineAdmission(rows=1, kv_budget=10, kv_admission=False)
    with admission.admitted(1, 10**9):
        assert admission.load == {"rows_used": 1, "kv_used": 0}


def test_busy_time_is_counted_while_any_row_is_held():
    admission = EngineAdmission(rows=2, kv_budget=0)
    with admission.admitted(1, 0):
        with admission.admitted(1, 0):
            time.sleep(0.05)
        assert admission.busy_seconds == 0.0  # a row is still held: the busy stretch goes on
    assert admission.busy_seconds >= 0.05


def test_kv_is_counted_in_whole_blocks_less_the_held_back_ones(tmp_path):
    plan = EngineSettings(ARCheckpoint(tmp_path, "derived", None)).plan(TINY_CONFIG, engine_weights=2**20)
    per_token, block = kv_bytes_per_token(TINY_CONFIG, plan.kv_dtype_bytes), plan.kv_block_tokens
    assert per_token == 512  # 2 layers x K and V x 2 heads x 32 x bf16
    # A row of `block` tokens fills one block exactly; one token more takes a second.
    assert prompts_kv_bytes(TINY_CONFIG, plan, [[1] * (block - 3)], 3) == block * per_token
    assert prompts_kv_bytes(TINY_CONFIG, plan, [[1] * (block - 3), [1] * (block - 2)], 3) == 3 * block * per_token
    assert kv_budget(TINY_CONFIG, 10**6, plan) == 10**6 - 2 * block * per_token
