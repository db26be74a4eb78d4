"""Requests' streams and commands without a worker: what a phase's run reads and sends through."""
import pytest

from yue2_vllm.engine.routing import EventRouter
from yue2_vllm.engine.worker_process import EngineError


def test_a_pairs_rows_share_one_stream_until_forgotten():
    router = EventRouter(lambda: None, progress_timeout_s=1.0)
    stream = router.open_stream(["p-c", "p-u"])
    assert router.streams == {"p-c": stream, "p-u": stream}
    before = stream.last_progress
    stream.events.put(("p-u", "tokens", [7, 8]))
    assert router.next_event(stream) == ("p-u", "tokens", [7, 8]) and stream.last_progress >= before
    assert router.next_event(stream) is None  # nothing yet: a short wait, then None
    router.forget_streams(["p-c", "p-u"])
    assert router.streams == {}


def test_commands_need_a_running_worker():
    router = EventRouter(lambda: None, progress_timeout_s=1.0)
    with pytest.raises(EngineError, match="the vLLM engine worker is not running"):
        router.send({"command": "generate"})
    router.abort("p-c")  # nothing runs, so nothing to abort
