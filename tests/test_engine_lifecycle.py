"""The engine's life without starting vLLM: the restart budget, and a start refused before any worker."""
import pytest

from yue2_vllm.derive import ARCheckpoint
from yue2_vllm.engine.backend import EngineSettings
from yue2_vllm.engine.lifecycle import EngineLifecycle, RestartBudget
from yue2_vllm.engine.routing import EventRouter
from yue2_vllm.engine.setup import EngineSetup
from yue2_vllm.engine.worker_process import EngineError
from yue2_vllm.testing import TINY_CONFIG


def test_restarts_are_bounded_within_a_sliding_window():
    budget = RestartBudget(max_restarts=2, window_s=10.0)
    budget.spend("first death", now=0.0)
    budget.spend("second death", now=1.0)
    assert not budget.left(now=9.0)
    with pytest.raises(EngineError, match=r"died 3 times within 10 s; not restarting it again \(max_restarts 2\)\. "
                                          r"Last failure: third death"):
        budget.spend("third death", now=9.0)
    assert budget.left(now=10.5)  # the first restart has left the window
    budget.spend("third death", now=10.5)
    assert budget.restarts == 3  # over the engine's life


def test_a_refused_start_spawns_no_worker(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1024)
    setup = EngineSetup.resolve(TINY_CONFIG, EngineSettings(ARCheckpoint(tmp_path, "derived", None)), None)
    life = EngineLifecycle(setup, EventRouter(lambda: None, 1.0), refusal="vllm is not installed")
    with pytest.raises(EngineError, match="^vllm is not installed$"):
        life.start()
    assert (life.process, life.ever_started, life.running, life.gone_for_good) == (None, False, False, False)
    assert life.take_load_seconds() is None and life.describe()["kv_cache"] is None
